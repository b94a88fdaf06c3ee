//! Uneven inputs with `DistributedDataParallel::join`, against PyTorch's `torch.distributed.algorithms.Join`
//! on the same uneven data: rank 0 has 5 batches, rank 1 has 3 (and the other way round). Both ranks of
//! a tch-dist run end with the parameters of a PyTorch run; a PyTorch DDP rank and a tch-dist rank also
//! join in one group (the protocol is PyTorch's). `throw_on_early_termination` fails every rank at once.
use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::model::{self, batch, init, mlp};
use tch::{nn, nn::OptimizerConfig, Device, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel, JoinOptions};
use tch_dist::DistModule;
use tch_dist::{Error, ProcessGroup};

const PER: i64 = 5;
const LR: f64 = 0.1;

/// Rank `rank` of a tch-dist DDP run with `steps[rank]` batches inside join; its final parameters.
/// `barrier`: end with one, as the PyTorch twin does (a mixed group).
fn train_rank(pg: ProcessGroup, steps: &[usize], divide_by_world: bool, find_unused: bool, barrier: bool) -> Vec<f32> {
    let rank = pg.rank();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs);
    init(&vs, rank as f64);
    let opts = DdpOptions::default().find_unused_parameters(find_unused).process_group(Arc::new(pg));
    let ddp = DistributedDataParallel::from_parameters(model::pytorch_order(&vs), vec![], net, opts).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, LR).unwrap();
    let join = JoinOptions::default().divide_by_initial_world_size(divide_by_world);
    ddp.join(join, || {
        for s in 0..steps[rank] {
            let (x, y) = batch(s, rank, PER);
            opt.zero_grad();
            ddp.backward(&model::loss(&ddp.f_forward(&x)?, &y))?;
            opt.step();
        }
        Ok(())
    })
    .unwrap();
    if barrier {
        ddp.process_group().barrier().unwrap();
    }
    let flat = Tensor::cat(&model::params(&vs).iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
    Vec::<f32>::try_from(&flat).unwrap()
}

#[test]
#[ignore = "rank process spawned by the mixed join test"]
fn worker_rust_join_rank() {
    let pg = ProcessGroup::from_env().unwrap();
    let steps: Vec<usize> = std::env::var("DDP_STEPS").unwrap().split(',').map(|s| s.parse().unwrap()).collect();
    let rank = pg.rank();
    let params = train_rank(pg, &steps, true, false, true);
    let bytes: Vec<u8> = params.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(std::env::var("DDP_OUT").unwrap().replace("RANK", &rank.to_string()), bytes).unwrap();
    println!("rust rank {rank} ok");
}

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Two processes, PyTorch or ours per rank (`python[r]`); every rank's final parameters.
fn run(python: [bool; 2], steps: &str, divide_by_world: bool, find_unused: bool) -> Vec<Vec<f32>> {
    // tests of this file run at once: each run its own directory
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("tdx-join-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let flag = |on: bool| if on { "1" } else { "0" }.to_string();
    let env = [
        ("TCH_DIST_VERIFY", "0".to_string()), // PyTorch's protocol only, whoever runs each rank
        ("TCH_DIST_TIMEOUT_SECS", "60".to_string()),
        ("DDP_STEPS", steps.to_string()),
        ("DDP_DIVIDE_BY_WORLD", flag(divide_by_world)),
        ("DDP_FIND_UNUSED", flag(find_unused)),
        ("DDP_OUT", dir.join("rankRANK.f32").display().to_string()),
    ];
    let pythons: Vec<usize> = (0..2).filter(|&r| python[r]).collect();
    let worker = common::test_name!("worker_rust_join_rank");
    let children = common::spawn_mixed(&worker, 2, &pythons, "tests/py/ddp_rank.py", &env);
    for (r, o) in common::wait_all(children, Duration::from_secs(120)).iter().enumerate() {
        assert!(o.status.success(), "rank {r}:\n{}", common::show(o));
    }
    let params = (0..2).map(|r| read_f32(&dir.join(format!("rank{r}.f32")))).collect();
    let _ = std::fs::remove_dir_all(&dir);
    params
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn uneven_inputs_end_where_pytorchs_join_ends() {
    for (steps, divide_by_world, find_unused) in [("5,3", true, false), ("2,6", true, true), ("5,3", false, false)] {
        let counts: Vec<usize> = steps.split(',').map(|s| s.parse().unwrap()).collect();
        let ours = common::run_threads(2, Duration::from_secs(60), move |pg| {
            train_rank(pg, &counts, divide_by_world, find_unused, false)
        });
        let theirs = run([true, true], steps, divide_by_world, find_unused);
        assert_eq!(ours[0], ours[1], "{steps}: our ranks end different");
        assert_eq!(theirs[0], theirs[1], "{steps}: PyTorch's ranks end different");
        let d = max_diff(&ours[0], &theirs[0]);
        assert!(d < 1e-6, "{steps} divide_by_world={divide_by_world} find_unused={find_unused}: ours vs PyTorch {d:e}");
        // the joined rank did not just stop: training went on past its last batch
        let even = common::run_threads(2, Duration::from_secs(60), |pg| train_rank(pg, &[3, 3], true, false, false));
        assert!(max_diff(&ours[0], &even[0]) > 1e-4, "{steps}: the extra batches changed nothing");
    }
}

#[test]
fn a_pytorch_rank_and_ours_join_in_one_group() {
    for (python, steps) in [([true, false], "5,3"), ([false, true], "5,3"), ([true, false], "2,4")] {
        let mixed = run(python, steps, true, false);
        assert_eq!(mixed[0], mixed[1], "{python:?} {steps}");
        let pure = run([true, true], steps, true, false);
        assert!(max_diff(&mixed[0], &pure[0]) < 1e-6, "{python:?} {steps}: mixed vs PyTorch alone");
    }
}

#[test]
fn throw_on_early_termination_fails_every_rank_at_once() {
    let start = Instant::now();
    let res = common::run_threads(2, Duration::from_secs(60), |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let mut done = 0;
        let r = ddp.join(JoinOptions::default().throw_on_early_termination(true), || {
            for s in 0..[4, 2][rank] {
                let (x, y) = batch(s, rank, PER);
                ddp.backward(&model::loss(&ddp.f_forward(&x)?, &y))?;
                ddp.zero_grad()?;
                done += 1;
            }
            Ok(())
        });
        (r.unwrap_err(), done)
    });
    assert!(start.elapsed() < Duration::from_secs(20));
    for (r, (e, done)) in res.iter().enumerate() {
        assert!(matches!(e, Error::UnevenInputs { .. }), "rank {r}: {e:?}");
        assert_eq!(*done, 2, "rank {r} stopped after {done} batches");
    }
    assert!(res[0].0.to_string().contains("another rank ran out of inputs"), "{}", res[0].0);
    assert!(res[1].0.to_string().contains("this rank ran out of inputs"), "{}", res[1].0);
}
