//! One rank of the context-parallel benchmark (scripts/bench-context-parallel.sh starts the ranks, then
//! the PyTorch twin scripts/bench_context_parallel.py, and compares): causal ring attention's forward and
//! backward over the group, on q, k, v of `[1, BENCH_HEADS, BENCH_SEQ, BENCH_DIM]` (the whole sequence;
//! each rank holds its head and tail chunks). With one rank, ATen's `scaled_dot_product_attention` on
//! the whole sequence instead. Prints `seconds_per_step` (the median of BENCH_STEPS after 3 warm-up steps)
//! on rank 0; with BENCH_VERBOSE set, each rank's forward and step times on stderr.
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use tch_dist::context_parallel::{ContextParallel, RingAttentionConfig};
use tch_dist::ProcessGroup;

fn env(name: &str, default: i64) -> Result<i64, Box<dyn std::error::Error>> {
    Ok(std::env::var(name).map_or(Ok(default), |v| v.parse())?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pg = Arc::new(ProcessGroup::from_env()?);
    let (seq, heads, dim, steps) =
        (env("BENCH_SEQ", 2048)?, env("BENCH_HEADS", 8)?, env("BENCH_DIM", 64)?, env("BENCH_STEPS", 10)?);
    let cp = ContextParallel::new(pg.clone(), Default::default());
    tch::manual_seed(0);
    let whole: Vec<Tensor> = (0..3).map(|_| Tensor::randn([1, heads, seq, dim], (Kind::Float, Device::Cpu))).collect();
    let local = whole
        .iter()
        .map(|t| Ok(if pg.size() == 1 { t.shallow_clone() } else { cp.shard(t, 2)? }.set_requires_grad(true)))
        .collect::<tch_dist::Result<Vec<_>>>()?;
    let [q, k, v] = &local[..] else { unreachable!() };
    let cfg = RingAttentionConfig { causal: true, ..Default::default() };
    let mut times = Vec::new();
    for step in 0..steps + 3 {
        pg.barrier()?;
        let start = Instant::now();
        let out = if pg.size() == 1 {
            Tensor::f_scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, false)?
        } else {
            cp.attention(q, k, v, cfg)?
        };
        let fwd = start.elapsed().as_secs_f64();
        out.f_sum(Kind::Float)?.f_backward()?;
        pg.barrier()?;
        if std::env::var_os("BENCH_VERBOSE").is_some() {
            eprintln!("rank {} forward {fwd:.4} s, step {:.4} s", pg.rank(), start.elapsed().as_secs_f64());
        }
        if step >= 3 {
            times.push(start.elapsed().as_secs_f64());
        }
        for t in [q, k, v] {
            tch_dist::hooks::set_grad(t, None)?;
        }
    }
    times.sort_by(f64::total_cmp);
    if pg.rank() == 0 {
        println!("{:.6}", times[times.len() / 2]);
    }
    Ok(())
}
