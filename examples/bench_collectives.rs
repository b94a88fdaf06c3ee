//! One rank of the collectives benchmark (scripts/bench-collectives.sh starts two of them, then the
//! PyTorch twin scripts/bench_collectives.py, and compares). Prints `size_bytes seconds_per_op` per size.
//! Environment: torchrun's variables, plus BENCH_OP (`allreduce`, the default, or `all_to_all`: an
//! all_to_all_single of the whole tensor in equal chunks), BENCH_SIZES (comma-separated bytes) and
//! BENCH_SECONDS.
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use tch_dist::{ProcessGroup, ReduceOp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pg = ProcessGroup::from_env()?;
    let sizes: Vec<i64> =
        std::env::var("BENCH_SIZES")?.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
    let budget: f64 = std::env::var("BENCH_SECONDS").unwrap_or_else(|_| "0.5".into()).parse()?;
    let op = std::env::var("BENCH_OP").unwrap_or_else(|_| "allreduce".into());
    for bytes in sizes {
        let mut t = Tensor::ones([bytes / 4], (Kind::Float, Device::Cpu));
        let mut out = t.zeros_like();
        let mut run = || -> tch_dist::Result<()> {
            match op.as_str() {
                "allreduce" => pg.allreduce(&mut t, ReduceOp::Sum),
                "all_to_all" => pg.all_to_all_single(&mut out, &t, &[], &[]),
                other => Err(tch_dist::Error::Env { var: "BENCH_OP".into(), msg: format!("unknown op {other:?}") }),
            }
        };
        // warm up, and agree on an iteration count from rank 0's estimate
        for _ in 0..3 {
            run()?;
        }
        let start = Instant::now();
        run()?;
        let mut iters =
            Tensor::from_slice(&[((budget / start.elapsed().as_secs_f64().max(1e-6)) as i64).clamp(5, 2000)]);
        pg.broadcast(&mut iters, 0)?;
        let n = iters.int64_value(&[0]);
        pg.barrier()?;
        let start = Instant::now();
        for _ in 0..n {
            run()?;
        }
        let per_op = start.elapsed().as_secs_f64() / n as f64;
        if pg.rank() == 0 {
            println!("{bytes} {per_op:.9}");
        }
    }
    Ok(())
}
