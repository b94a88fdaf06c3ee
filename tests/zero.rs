//! ZeRO-1: DDP + ShardedOptimizer ends with the parameters of DDP + the same optimizer unsharded, on 2 and
//! 3 ranks, with a parameter count (23) that no world size here divides; state per rank is one shard.
mod common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::optim::{AdamW, Optimizer, ShardedOptimizer, Sgd};

/// elementwise updates on the same values: observed identical; 1e-6 leaves room for nothing more.
const TOL: f64 = 1e-6;

fn model(vs: &nn::VarStore) -> nn::Sequential {
    let r = vs.root();
    nn::seq()
        .add(nn::linear(&r / "a", 5, 3, Default::default())) // 18
        .add_fn(|x| x.tanh())
        .add(nn::linear(&r / "b", 3, 1, Default::default())) // 4
        .add(nn::linear(&r / "c", 1, 1, nn::LinearConfig { bias: false, ..Default::default() })) // 1
}

fn train(world: usize, sharded: bool, adam: bool) -> Vec<(Vec<Tensor>, i64)> {
    common::run_threads(world, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        common::model::init(&vs, rank as f64); // deterministic; DDP broadcasts rank 0's
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone())).unwrap();
        let make = move |p: Vec<Tensor>| -> Box<dyn Optimizer + Send> {
            if adam { Box::new(AdamW::new(p, 0.05)) } else { Box::new(Sgd::new(p, 0.1).momentum(0.9)) }
        };
        let (mut opt, shard): (Box<dyn Optimizer>, i64) = if sharded {
            let z = ShardedOptimizer::new(vs.trainable_variables(), pg.clone(), make).unwrap();
            let n = z.shard_numel();
            (Box::new(z), n)
        } else {
            (make(vs.trainable_variables()), 23)
        };
        for s in 0..5 {
            let x = ((Tensor::arange(20, (Kind::Float, Device::Cpu)) * 0.3 + (s * 10 + rank) as f64).sin()).view([4, 5]);
            let loss = ddp.forward_with(|m| m.forward(&x)).unwrap().pow_tensor_scalar(2).mean(Kind::Float);
            ddp.backward(&loss).unwrap();
            opt.step().unwrap();
            opt.zero_grad().unwrap();
        }
        (common::model::params(&vs), shard)
    })
}

#[test]
fn zero1_matches_plain_ddp_with_the_same_optimizer() {
    for world in [2, 3] {
        for adam in [true, false] {
            let plain = train(world, false, adam);
            let zero = train(world, true, adam);
            for ((p, _), (z, shard)) in plain.iter().zip(&zero) {
                assert_eq!(*shard, (23 + world as i64 - 1) / world as i64, "each rank holds one shard");
                let d = common::model::max_diff(p, z);
                assert!(d < TOL, "world {world}, adam {adam}: {d:e}");
            }
        }
    }
}
