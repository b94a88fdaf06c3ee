//! The placement registry: what the layers and wrappers record for each variable, and what its readers
//! do with a layout that leaves part of a variable on no rank.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::checkpoint::{Checkpointer, StateDict};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
use tch_dist::placement::{self, Extent, Placement};
use tch_dist::tp::{ParallelAttention, ParallelAttentionConfig, ParallelMlp, VocabParallelEmbedding};
use tch_dist::DistModule;

const T: Duration = Duration::from_secs(60);

fn placed(vs: &nn::VarStore, name: &str) -> placement::Layout {
    let t = vs.variables().remove(name).unwrap_or_else(|| panic!("no variable {name}"));
    placement::of(&t).unwrap_or_else(|| panic!("{name} has no placement"))
}

#[test]
fn tensor_parallel_layers_record_their_slices() {
    let got = common::run_threads(2, T, |pg| {
        let r = pg.rank() as i64;
        let tp = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let _mlp = ParallelMlp::new(&(vs.root() / "mlp"), 8, 16, tp.clone()).unwrap();
        let w = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
        let causal = ParallelAttentionConfig { causal: true, ..Default::default() };
        let _attn = ParallelAttention::new(&(vs.root() / "attn"), 8, 2, tp.clone(), causal).unwrap();
        let _emb = VocabParallelEmbedding::from_full(&(vs.root() / "emb"), &w(&[10, 8]), tp.clone()).unwrap();
        let shard = |dim| vec![("default".to_string(), Placement::Shard(dim))];
        let l = placed(&vs, "mlp.fc1.weight");
        assert_eq!((l.global_shape(), l.placements()), (&[16i64, 8][..], shard(0)));
        assert_eq!(l.extent(), &Extent::Box { offsets: vec![8 * r, 0], lengths: vec![8, 8] });
        let l = placed(&vs, "mlp.fc2.weight");
        assert_eq!(l.extent(), &Extent::Box { offsets: vec![0, 8 * r], lengths: vec![8, 8] });
        assert_eq!(l.placements(), shard(1));
        let l = placed(&vs, "mlp.fc2.bias");
        assert_eq!(l.placements(), vec![("default".to_string(), Placement::Replicate)]);
        assert_eq!(l.extent(), &Extent::Whole);
        // the projection's rows are this rank's heads of the queries, keys and values
        let l = placed(&vs, "attn.qkv.weight");
        assert_eq!(l.global_shape(), &[3, 8, 8]);
        assert_eq!(l.extent(), &Extent::Box { offsets: vec![0, 4 * r, 0], lengths: vec![3, 4, 8] });
        let l = placed(&vs, "emb.weight");
        assert_eq!(l.extent(), &Extent::Box { offsets: vec![5 * r, 0], lengths: vec![5, 8] });
        // DDP over another group adds its replicas to what the layer recorded
        // every rank makes both one-rank groups, as new_subgroup asks; each keeps its own
        let (a, b) = (tp.new_subgroup(&[0], "dp").unwrap(), tp.new_subgroup(&[1], "dp").unwrap());
        let dp = Arc::new(a.or(b).unwrap());
        let net = nn::seq();
        let _ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(dp)).unwrap();
        let l = placed(&vs, "mlp.fc1.weight").placements();
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!(l[0], ("default".into(), Placement::Shard(0)));
        assert!(l[1].0.starts_with("dp") && l[1].1 == Placement::Replicate, "{l:?}");
    });
    assert_eq!(got.len(), 2);
}

#[test]
fn fsdp_records_flat_shards_of_slices_and_a_checkpoint_names_what_no_rank_holds() {
    let dir = std::env::temp_dir().join(format!("tch-dist-placement-{}", std::process::id()));
    let d = dir.clone();
    let errs = common::run_threads(2, T, move |pg| {
        let r = pg.rank() as i64;
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let f = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone())).unwrap();
        let l1 = f.fully_shard(&(vs.root() / "l1"), nn::linear(vs.root() / "l1", 3, 4, Default::default())).unwrap();
        let model = f.finish(nn::seq().add(l1)).unwrap();
        // the parameter (empty between uses) has its shard as local values; the optimizer's shard too
        let l = placed(&vs, "l1.weight");
        assert_eq!(l.global_shape(), &[4, 3]);
        assert_eq!(l.extent(), &Extent::Flat { offset: 6 * r, len: 6 });
        assert_eq!(l.placements(), vec![("default".into(), Placement::Flat { offset: 6 * r })]);
        let shard = l.local().expect("the shard").shallow_clone();
        assert!(model.parameters().iter().any(|p| p.data_ptr() == shard.data_ptr()));
        assert!(placement::of(&shard).is_some());

        // FSDP over a tensor-parallel layer: a flat shard of a slice (tests/models/hf.rs saves and loads
        // FSDP x TP on a 2 x 2 mesh); here FSDP runs over the TP ranks themselves, so each rank shards its
        // own slice over ranks that hold other slices: half of each slice is on no rank, and a save says so
        let vs = nn::VarStore::new(Device::Cpu);
        let f = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone())).unwrap();
        let mlp = ParallelMlp::new(&(vs.root() / "mlp"), 4, 8, pg.clone()).unwrap();
        let unit = f.fully_shard(&(vs.root() / "mlp"), mlp).unwrap();
        let _model = f.finish(nn::seq().add(unit)).unwrap();
        let l = placed(&vs, "mlp.fc1.weight");
        let want = Extent::FlatOfBox { offsets: vec![4 * r, 0], lengths: vec![4, 4], offset: 8 * r, len: 8 };
        assert_eq!(l.extent(), &want);
        let mut ck = Checkpointer::new(pg.clone(), &d).unwrap();
        ck.save(1, StateDict::new().var_store("model", &vs)).unwrap_err().to_string()
    });
    for e in errs {
        assert!(e.contains("model.mlp.fc1.") && e.contains("the ranks' chunks cover"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
