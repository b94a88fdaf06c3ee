//! PyTorch's `torch.nn.SyncBatchNorm` under PyTorch's DDP (tests/py/sync_bn_rank.py) and tch-dist's
//! SyncBatchNorm under tch-dist's DDP, in one Gloo group of 2 and of 3 ranks with a different batch on
//! each rank: every rank's output, input gradient, weight and bias gradients, running statistics and
//! evaluation output equal tch's (libtorch's) BatchNorm over the concatenated batch in one process,
//! within 1e-6. PyTorch refuses SyncBatchNorm on the CPU and has its kernels for CUDA only, so its rank
//! runs PyTorch's module and protocol with CPU versions of those kernels (see the script).
use crate::common;
use common::bn::{batch, set_affine, C};

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::ModuleT, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::sync_batch_norm::sync_batch_norm2d;
use tch_dist::DistModule;
use tch_dist::ProcessGroup;

const SPATIAL: [i64; 2] = [3, 2];
const TOL: f64 = 1e-6;

fn sizes() -> Vec<i64> {
    std::env::var("SBN_SIZES").unwrap().split(',').map(|s| s.parse().unwrap()).collect()
}

#[test]
#[ignore = "rank process spawned by the mixed PyTorch/tch-dist SyncBatchNorm test"]
fn worker_rust_sync_bn_rank() {
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let n = sizes()[rank];
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = sync_batch_norm2d(vs.root() / "bn", C, Default::default(), pg.clone());
    set_affine(&bn.ws, &bn.bs);
    let params = vec![
        ("bn.weight".to_string(), bn.ws.as_ref().unwrap().shallow_clone()),
        ("bn.bias".to_string(), bn.bs.as_ref().unwrap().shallow_clone()),
    ];
    let ddp =
        DistributedDataParallel::from_parameters(params, vec![], bn, DdpOptions::default().process_group(pg)).unwrap();
    let _ = tch::no_grad(|| ddp.module().f_forward_t(&batch(rank + 10, n, &SPATIAL).0, true).unwrap());
    let (x, t) = batch(rank, n, &SPATIAL);
    let x = x.set_requires_grad(true);
    let y = ddp.forward_with(|m| m.f_forward_t(&x, true)).unwrap().unwrap();
    ddp.backward(&(&y * &t).sum(Kind::Float)).unwrap();
    let bn = ddp.module();
    let y_eval = tch::no_grad(|| bn.f_forward_t(&x, false).unwrap());
    let out = [
        y.detach(),
        x.grad(),
        bn.ws.as_ref().unwrap().grad(),
        bn.bs.as_ref().unwrap().grad(),
        bn.running_mean.shallow_clone(),
        bn.running_var.shallow_clone(),
        y_eval,
    ];
    write(&out, &std::env::var("SBN_OUT").unwrap().replace("RANK", &rank.to_string()));
    ddp.process_group().barrier().unwrap();
    println!("rust rank {rank} ok");
}

fn write(ts: &[Tensor], path: &str) {
    let flat = Tensor::cat(&ts.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
    let v = Vec::<f32>::try_from(&flat).unwrap();
    std::fs::write(path, v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
}

fn read(path: &std::path::Path) -> Tensor {
    let b = std::fs::read(path).unwrap();
    let v: Vec<f32> = b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Tensor::from_slice(&v)
}

/// One process over the concatenated batch: what every rank must report (the weight's and bias's
/// gradients as DDP's average over `world`).
fn reference(sizes: &[i64]) -> Vec<Vec<Tensor>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = nn::batch_norm2d(vs.root() / "bn", C, Default::default());
    set_affine(&bn.ws, &bn.bs);
    let cat = |k: usize| {
        let parts: Vec<(Tensor, Tensor)> = sizes.iter().enumerate().map(|(r, &n)| batch(r + k, n, &SPATIAL)).collect();
        let xs: Vec<&Tensor> = parts.iter().map(|p| &p.0).collect();
        let ts: Vec<&Tensor> = parts.iter().map(|p| &p.1).collect();
        (Tensor::cat(&xs, 0), Tensor::cat(&ts, 0))
    };
    let _ = tch::no_grad(|| bn.forward_t(&cat(10).0, true));
    let (x, t) = cat(0);
    let x = x.set_requires_grad(true);
    let y = bn.forward_t(&x, true);
    (&y * &t).sum(Kind::Float).backward();
    let world = sizes.len() as f64;
    let y_eval = tch::no_grad(|| bn.forward_t(&x, false));
    let mut at = 0;
    sizes
        .iter()
        .map(|&n| {
            let rows = |t: &Tensor| t.narrow(0, at, n).copy();
            let out = vec![
                rows(&y.detach()),
                rows(&x.grad()),
                bn.ws.as_ref().unwrap().grad() / world,
                bn.bs.as_ref().unwrap().grad() / world,
                bn.running_mean.copy(),
                bn.running_var.copy(),
                rows(&y_eval),
            ];
            at += n;
            out
        })
        .collect()
}

fn mixed(sizes: &[i64], python_ranks: &[usize]) {
    let world = sizes.len();
    let dir = std::env::temp_dir().join(format!("tdx-sbn-interop-{}-{world}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let list = sizes.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",");
    let worker = common::test_name!("worker_rust_sync_bn_rank");
    let env = [
        ("TCH_DIST_TIMEOUT_SECS", "60".to_string()),
        ("SBN_SIZES", list),
        ("SBN_OUT", dir.join("rankRANK.f32").display().to_string()),
    ];
    let children = common::spawn_mixed(&worker, world, python_ranks, "tests/py/sync_bn_rank.py", &env);
    let outs = common::wait_all(children, Duration::from_secs(120));
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}:\n{}", common::show(o));
    }
    let names = ["output", "input gradient", "weight gradient", "bias gradient", "running mean", "running var", "eval"];
    for (r, want) in reference(sizes).iter().enumerate() {
        let who = if python_ranks.contains(&r) { "PyTorch" } else { "tch-dist" };
        let got = read(&dir.join(format!("rank{r}.f32")));
        let mut at = 0;
        for (name, w) in names.iter().zip(want) {
            let n = w.numel() as i64;
            let g = got.narrow(0, at, n);
            let d = (&g - w.reshape([-1])).abs().max().double_value(&[]);
            assert!(d < TOL, "{who} rank {r} of {world}: {name} differs from one process by {d:e}");
            at += n;
        }
        assert_eq!(at, got.numel() as i64, "{who} rank {r}: what it wrote");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pytorch_rank0_ours_rank1_uneven_batches() {
    mixed(&[3, 5], &[0]);
}

#[test]
fn three_ranks_pytorch_in_the_middle() {
    mixed(&[4, 2, 3], &[1]);
}
