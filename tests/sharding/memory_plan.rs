//! The memory plan predicts what `memory_breakdown` measures on a running model: DDP, ZeRO-1, ZeRO-2 and
//! FSDP on 2 and 3 ranks, float32 AdamW, after a step; and at scale it gives the ZeRO paper's Figure 1.
//! The model's size, read from the placements on a rank that holds shards or slices, is the whole
//! model's.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
use tch_dist::memory::plan::{model_elements, model_states, ModelStates, Precision};
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;

const T: Duration = Duration::from_secs(60);
/// Layer widths: 3 Linear layers, 4,000-odd parameters that no world size here divides.
const DIMS: [i64; 4] = [37, 41, 29, 11];

fn layers(vs: &nn::VarStore) -> Vec<(nn::Path<'_>, nn::Linear)> {
    (0..3)
        .map(|i| {
            let p = vs.root() / format!("l{i}");
            let l = nn::linear(&p, DIMS[i], DIMS[i + 1], Default::default());
            (p, l)
        })
        .collect()
}

fn psi() -> u64 {
    (0..3).map(|i| (DIMS[i] * DIMS[i + 1] + DIMS[i + 1]) as u64).sum()
}

fn step_loss(out: &Tensor) -> Tensor {
    out.square().mean(Kind::Float)
}

fn input(rank: usize) -> Tensor {
    Tensor::arange(4 * DIMS[0], (Kind::Float, Device::Cpu)).view([4, DIMS[0]]).sin() + rank as f64
}

/// Each measured quantity within 1% or 256 bytes of the plan (shards round up per bucket or parameter,
/// Adam's step counters are a few bytes per tensor).
fn close(what: &str, measured: u64, planned: u64) {
    let d = measured.abs_diff(planned);
    assert!(d <= 256 || d * 100 <= planned, "{what}: measured {measured} bytes, planned {planned}");
}

fn check(what: &str, got: ModelStates, stage: Option<ZeroStage>, world: usize) {
    let want = model_states(psi(), world as u64, stage, Precision::FP32_ADAM);
    eprintln!("{what}: measured {got:?}, planned {want:?}");
    close(&format!("{what} parameters"), got.parameters, want.parameters);
    close(&format!("{what} gradients"), got.gradients, want.gradients);
    close(&format!("{what} optimizer"), got.optimizer, want.optimizer);
}

/// DDP (`zero` none) or ZeRO-1/2 over it.
fn data_parallel(world: usize, zero: Option<ZeroStage>) -> Vec<ModelStates> {
    common::run_threads(world, T, move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let seq = layers(&vs).into_iter().fold(nn::seq(), |s, (_, l)| s.add(l).add_fn(|x| x.tanh()));
        // small buckets: several of them, each padded to the world size under ZeRO
        let opts = DdpOptions::default().process_group(Arc::new(pg)).bucket_cap_mb(0.004);
        let ddp = DistributedDataParallel::new(&vs, seq, opts).unwrap();
        let mut opt: Box<dyn Optimizer> = match zero {
            None => Box::new(AdamW::new(ddp.parameters(), 1e-3)),
            Some(z) => Box::new(ShardedOptimizer::new(&ddp, z, |p| Box::new(AdamW::new(p, 1e-3))).unwrap()),
        };
        ddp.backward(&step_loss(&ddp.f_forward(&input(rank)).unwrap())).unwrap();
        opt.step().unwrap();
        let m = ddp.memory_breakdown_with(opt.as_ref()).unwrap();
        assert_eq!(model_elements(&vs), psi());
        ModelStates {
            parameters: m.parameters as u64,
            gradients: (m.gradients + m.buckets + m.gradient_shards) as u64,
            optimizer: (m.optimizer_state + m.master_params) as u64,
        }
    })
}

fn fsdp(world: usize) -> Vec<ModelStates> {
    common::run_threads(world, T, move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let f = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let seq = layers(&vs)
            .into_iter()
            .fold(nn::seq(), |s, (p, l)| s.add(f.fully_shard(&p, l).unwrap()).add_fn(|x| x.tanh()));
        let model = f.finish(seq).unwrap();
        let mut opt = AdamW::new(model.parameters(), 1e-3);
        model.backward(&step_loss(&model.forward(&input(rank)))).unwrap();
        opt.step().unwrap();
        let m = model.memory_breakdown_with(&opt).unwrap();
        assert_eq!(m.gathered_parameters, 0);
        // this rank holds shards; the placements give the whole model's size
        let held: u64 = vs.trainable_variables().iter().map(|t| t.numel() as u64).sum();
        assert!(held < psi());
        assert_eq!(model_elements(&vs), psi());
        ModelStates {
            parameters: m.sharded_parameters as u64,
            gradients: (m.gradient_shards + m.unsharded_gradients) as u64,
            optimizer: m.optimizer_state as u64,
        }
    })
}

#[test]
fn the_plan_predicts_memory_breakdown_for_every_stage() {
    for world in [2, 3] {
        for zero in [None, Some(ZeroStage::One), Some(ZeroStage::Two)] {
            for (r, got) in data_parallel(world, zero).into_iter().enumerate() {
                check(&format!("{zero:?} on {world} ranks, rank {r}"), got, zero, world);
            }
        }
        for (r, got) in fsdp(world).into_iter().enumerate() {
            check(&format!("FSDP on {world} ranks, rank {r}"), got, Some(ZeroStage::Three), world);
        }
    }
}

/// The ZeRO paper's Figure 1 (7.5B parameters, 64 ranks, mixed-precision Adam, K = 12), to its one
/// decimal: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
#[test]
fn at_scale_the_plan_gives_the_papers_figure() {
    let gb = |s| format!("{:.1}", model_states(7_500_000_000, 64, s, Precision::MIXED_ADAM).total() as f64 / 1e9);
    let got: Vec<String> =
        [None, Some(ZeroStage::One), Some(ZeroStage::Two), Some(ZeroStage::Three)].into_iter().map(gb).collect();
    assert_eq!(got, ["120.0", "31.4", "16.6", "1.9"]);
}

/// A tensor-parallel rank holds slices; the placements give the whole layers' size.
#[test]
fn a_tensor_parallel_rank_reads_the_whole_models_size_from_placements() {
    let got = common::run_threads(2, T, |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let col = tch_dist::tp::ColumnParallelLinear::new(&(vs.root() / "c"), 8, 6, pg.clone(), Default::default());
        let row = tch_dist::tp::RowParallelLinear::new(&(vs.root() / "r"), 6, 8, pg, Default::default());
        let _ = (col.unwrap(), row.unwrap());
        let held: u64 = vs.trainable_variables().iter().map(|t| t.numel() as u64).sum();
        (held, model_elements(&vs))
    });
    // column: 3 x 8 weight, 3 bias; row: 8 x 3 weight, the whole 8-element bias
    let whole = (8 * 6 + 6 + 6 * 8 + 8) as u64;
    assert_eq!(got, vec![(3 * 8 + 3 + 8 * 3 + 8, whole); 2]);
}
