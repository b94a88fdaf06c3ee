//! A failure inside backward reaches the caller of `backward` as its own kind (autograd carries only
//! text; the crate turns it back), so that code can tell a lost peer from a mismatch or a timeout: through
//! DDP's communication hook (failing when called, or in its future) and through FSDP's reduction across
//! replicas.
use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::ddp::{CommHook, DdpOptions, DistributedDataParallel, GradBucket, HookFuture};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions, Replicas};
use tch_dist::DistModule;
use tch_dist::{Error, ProcessGroup, Store};

/// Makes one error afresh for each use.
type Make = fn() -> Error;

/// The three kinds a distributed backward fails with.
fn kinds() -> Vec<(&'static str, Make)> {
    vec![
        ("timeout", || Error::Timeout { op: "injected".into(), timeout: Duration::from_secs(3), msg: "late".into() }),
        ("peer gone", || Error::PeerGone { op: "injected".into(), msg: "rank 1 died".into() }),
        ("mismatch", || Error::Mismatch { op: "injected".into(), msg: "shapes differ".into() }),
    ]
}

fn same_kind(got: &Error, want: &Error) -> bool {
    std::mem::discriminant(got) == std::mem::discriminant(want) && got.to_string().contains(&want.to_string())
}

fn one_rank() -> Arc<ProcessGroup> {
    Arc::new(ProcessGroup::new(&Store::hash().unwrap(), 0, 1, &Default::default()).unwrap())
}

#[derive(Debug)]
struct Failing {
    make: Make,
    /// Fail in the future, after the bucket was handed over, instead of when called.
    later: bool,
}

impl CommHook for Failing {
    fn run(&self, _pg: &Arc<ProcessGroup>, _bucket: &GradBucket) -> tch_dist::Result<HookFuture> {
        let make = self.make;
        if self.later {
            Ok(HookFuture::ready().then(move || Err(make())))
        } else {
            Err(make())
        }
    }
}

#[test]
fn ddp_backward_fails_with_the_hook_s_own_error_kind() {
    for (name, make) in kinds() {
        for later in [false, true] {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = nn::linear(vs.root() / "l", 4, 2, Default::default());
            let opts = DdpOptions::default().process_group(one_rank()).comm_hook(Arc::new(Failing { make, later }));
            let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
            let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
            let err = ddp.backward(&ddp.forward(&x).square().mean(Kind::Float)).unwrap_err();
            assert!(same_kind(&err, &make()), "{name} (in the future: {later}): got {err:?}");
        }
    }
}

#[derive(Debug)]
struct FailingReplicas(Make);

impl Replicas for FailingReplicas {
    fn count(&self) -> usize {
        2
    }
    fn all_reduce_sum(&self, _t: &Tensor) -> tch_dist::Result<()> {
        Err((self.0)())
    }
}

#[test]
fn fsdp_backward_fails_with_the_reduction_s_own_error_kind() {
    for (name, make) in kinds() {
        let vs = nn::VarStore::new(Device::Cpu);
        let opts = FsdpOptions::default().process_group(one_rank()).replicas(Arc::new(FailingReplicas(make)));
        let fsdp = FsdpBuilder::new(&vs, opts).unwrap();
        let l = vs.root() / "l";
        let net = fsdp.fully_shard(&l, nn::linear(&l, 4, 2, Default::default())).unwrap();
        let model = fsdp.finish(net).unwrap();
        let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
        let err = model.backward(&model.forward(&x).square().mean(Kind::Float)).unwrap_err();
        assert!(same_kind(&err, &make()), "{name}: got {err:?}");
    }
}
