//! A PyTorch DDP rank and a tch-dist DDP rank train together in one Gloo group for 5 steps and end with
//! identical parameters (bit for bit: same libtorch kernels, same wire protocol), which also match a
//! single-process run on the concatenated batch.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::model::{self, batch, init, mlp};
use tch::{nn, nn::OptimizerConfig, Device, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::DistModule;
use tch_dist::ProcessGroup;

const STEPS: usize = 5;
const PER: i64 = 5;
const LR: f64 = 0.1;

#[test]
#[ignore = "rank process spawned by the mixed PyTorch/tch-dist DDP tests"]
fn worker_rust_ddp_rank() {
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs);
    init(&vs, rank as f64);
    let frozen = std::env::var("DDP_FROZEN").unwrap_or_default();
    for (name, t) in vs.variables() {
        if !frozen.is_empty() && name.starts_with(&format!("{frozen}.")) {
            let _ = t.set_requires_grad(false);
        }
    }
    let cap: f64 = std::env::var("DDP_CAP_MB").unwrap().parse().unwrap();
    let opts = DdpOptions::default().bucket_cap_mb(cap).process_group(pg);
    // PyTorch's parameter order, so that both sides lay out buckets alike
    let ddp = DistributedDataParallel::from_parameters(model::pytorch_order(&vs), vec![], net, opts).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, LR).unwrap();
    for s in 0..STEPS {
        let (x, y) = batch(s, rank, PER);
        ddp.backward(&model::loss(&ddp.f_forward(&x).unwrap(), &y)).unwrap();
        opt.step();
        ddp.zero_grad().unwrap();
    }
    let flat = Tensor::cat(&model::params(&vs).iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
    let v = Vec::<f32>::try_from(&flat).unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(std::env::var("DDP_OUT").unwrap().replace("RANK", &rank.to_string()), bytes).unwrap();
    ddp.process_group().barrier().unwrap(); // the PyTorch rank ends with a barrier too
    println!("rust rank {rank} ok");
}

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn mixed(python_rank: usize, cap_mb: &str) {
    mixed_frozen(python_rank, cap_mb, "");
}

/// `frozen`: a layer ("l2") whose parameters do not require grad on either side.
fn mixed_frozen(python_rank: usize, cap_mb: &str, frozen: &str) {
    let dir = std::env::temp_dir().join(format!("tdx-ddp-interop-{}-{python_rank}-{cap_mb}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let worker = common::test_name!("worker_rust_ddp_rank");
    let env = [
        ("TCH_DIST_TIMEOUT_SECS", "60".to_string()),
        ("DDP_CAP_MB", cap_mb.to_string()),
        ("DDP_FROZEN", frozen.to_string()),
        ("DDP_OUT", dir.join("rankRANK.f32").display().to_string()),
    ];
    let children = common::spawn_mixed(&worker, 2, &[python_rank], "tests/py/ddp_rank.py", &env);
    let outs = common::wait_all(children, Duration::from_secs(120));
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}:\n{}", common::show(o));
    }
    let a = read_f32(&dir.join("rank0.f32"));
    let b = read_f32(&dir.join("rank1.f32"));
    assert_eq!(a.len(), b.len());
    assert!(a == b, "PyTorch's and our parameters differ");
    if frozen.is_empty() {
        let reference = model::reference(STEPS, 2, PER, LR);
        let flat = Tensor::cat(&reference.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
        let d = (Tensor::from_slice(&a) - flat).abs().max().double_value(&[]);
        assert!(d < 1e-5, "differs from the single-process run by {d:e}");
    } else {
        // the frozen layer holds rank 0's initial values on both ranks (DDP copied them, nothing changed them)
        let vs = nn::VarStore::new(Device::Cpu);
        let _ = mlp(&vs);
        init(&vs, 0.0);
        let mut off = 0;
        for (name, t) in model::pytorch_order(&vs) {
            let n = t.numel();
            if name.starts_with(&format!("{frozen}.")) {
                let want = Vec::<f32>::try_from(t.reshape([-1])).unwrap();
                assert_eq!(&a[off..off + n], &want[..], "{name}");
            }
            off += n;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pytorch_ddp_rank0_ours_rank1() {
    mixed(0, "25");
}

#[test]
fn ours_rank0_pytorch_ddp_rank1_many_buckets() {
    // 2 KB buckets: several buckets, rebuilt after the first step from rank 0's order
    mixed(1, "0.001953125");
}

#[test]
fn frozen_layer_pytorch_ddp_rank0_ours_rank1() {
    // l2 frozen on both sides: copied from rank 0 at construction, never bucketed nor reduced
    mixed_frozen(0, "0.001953125", "l2");
}
