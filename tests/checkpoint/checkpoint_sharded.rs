//! Sharded checkpoints: bad input and failures are named on every rank, a failed or interrupted save
//! leaves the previous checkpoint the latest, a damaged file is refused, an asynchronous save holds the
//! values of the moment it was called, replicated tensors are written once, old checkpoints are dropped.
use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{nn, Device, Kind, Tensor};
use tch_dist::checkpoint::{self, Checkpointer, StateDict};
use tch_dist::DistModule;
use tch_dist::{Error, ProcessGroup, ReduceOp};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tch-dist-sharded-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A model of two linears; `hidden` sets l1's output size.
fn model(hidden: i64, extra: bool) -> nn::VarStore {
    let vs = nn::VarStore::new(Device::Cpu);
    let r = vs.root();
    let _ = nn::linear(&r / "l1", 3, hidden, Default::default());
    let _ = nn::linear(&r / "l2", hidden, 2, Default::default());
    if extra {
        let _ = nn::linear(&r / "extra", 2, 2, Default::default());
    }
    tch::no_grad(|| {
        for (i, (_, t)) in checkpoint::var_store_tensors(&vs).into_iter().enumerate() {
            let _ = t.shallow_clone().fill_(0.25 * (i as f64 + 1.0));
        }
    });
    vs
}

fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(Arc<ProcessGroup>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    common::run_threads(world, Duration::from_secs(60), move |pg| f(Arc::new(pg)))
}

fn save(pg: &Arc<ProcessGroup>, root: &Path, step: u64, vs: &nn::VarStore) -> tch_dist::Result<()> {
    Checkpointer::new(pg.clone(), root)?.save(step, StateDict::new().var_store("model", vs))
}

fn load(pg: &Arc<ProcessGroup>, root: &Path, vs: &nn::VarStore) -> tch_dist::Result<Option<u64>> {
    Checkpointer::new(pg.clone(), root)?.load(StateDict::new().var_store("model", vs))
}

#[test]
fn a_missing_tensor_or_a_changed_shape_is_an_error_naming_it_on_every_rank() {
    let root = tmp("names");
    let r = root.clone();
    let errors = on_ranks(2, move |pg| {
        save(&pg, &r, 1, &model(4, false)).unwrap();
        let missing = load(&pg, &r, &model(4, true)).unwrap_err().to_string();
        let shape = load(&pg, &r, &model(5, false)).unwrap_err().to_string();
        (missing, shape)
    });
    for (missing, shape) in errors {
        assert!(missing.contains("has no tensor model.extra."), "{missing}");
        assert!(missing.contains("(the closest it has: model."), "{missing}");
        assert!(shape.contains("model.l1.bias: saved with shape [4], here it is [5]"), "{shape}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_damaged_file_is_refused_by_its_checksum() {
    let root = tmp("damaged");
    on_ranks(1, {
        let r = root.clone();
        move |pg| save(&pg, &r, 1, &model(4, false)).unwrap()
    });
    let dir = checkpoint::step_dir(&root, 1);
    checkpoint::verify(&dir).unwrap();
    let file = dir.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let e = checkpoint::verify(&dir).unwrap_err().to_string();
    assert!(e.contains("rank-00000.safetensors") && e.contains("damaged"), "{e}");
    let r = root.clone();
    let e = on_ranks(1, move |pg| load(&pg, &r, &model(4, false)).unwrap_err().to_string()).remove(0);
    assert!(e.contains("rank-00000.safetensors") && e.contains("fail their checksum"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_rank_failing_to_write_fails_the_save_everywhere_and_the_previous_checkpoint_stays() {
    let root = tmp("failed-write");
    let r = root.clone();
    let out = on_ranks(3, move |pg| {
        let vs = model(4, false);
        save(&pg, &r, 1, &vs).unwrap();
        // rank 1's file of step 2 cannot be created: a directory is in its place
        if pg.rank() == 0 {
            std::fs::create_dir_all(checkpoint::step_dir(&r, 2).join("rank-00001.safetensors").join("x")).unwrap();
        }
        pg.barrier().unwrap();
        tch::no_grad(|| {
            let _ = vs.variables()["l1.weight"].shallow_clone().fill_(9.0);
        });
        let e = save(&pg, &r, 2, &vs).unwrap_err();
        let fresh = model(4, false);
        tch::no_grad(|| {
            let _ = fresh.variables()["l1.weight"].shallow_clone().fill_(-1.0);
        });
        let step = load(&pg, &r, &fresh).unwrap();
        (pg.rank(), e, step, fresh.variables()["l1.weight"].double_value(&[0, 0]))
    });
    for (rank, e, step, w) in out {
        match (&e, rank) {
            (Error::RankFailed { rank: 1, .. }, 0 | 2) => {}
            (Error::Invalid { .. }, 1) => {}
            _ => panic!("rank {rank}: {e}"),
        }
        assert!(e.to_string().contains("rank-00001.safetensors"), "rank {rank}: {e}");
        assert_eq!(step, Some(1), "the previous checkpoint is the latest");
        assert_eq!(w, 0.25 * 2.0, "its values (l1.weight is the second variable by name)");
    }
    assert_eq!(checkpoint::committed_steps(&root), vec![1]);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn bad_input_on_one_rank_fails_the_others_at_once() {
    let root = tmp("bad-input");
    let r = root.clone();
    let out = on_ranks(2, move |pg| {
        let vs = model(4, false);
        let odd = Tensor::zeros([2], (Kind::ComplexFloat, Device::Cpu));
        let mut sd = StateDict::new();
        sd.var_store("model", &vs);
        if pg.rank() == 1 {
            sd.tensor("odd", &odd);
        }
        let t = Instant::now();
        let e = Checkpointer::new(pg.clone(), &r).unwrap().save(1, &sd).unwrap_err().to_string();
        (e, t.elapsed())
    });
    for (e, took) in out {
        assert!(e.contains("ComplexFloat"), "{e}");
        assert!(took < Duration::from_secs(10), "learned after {took:?} (the group's timeout is 60 s)");
    }
    assert!(checkpoint::committed_steps(&root).is_empty());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ranks_disagreeing_on_a_shape_are_named() {
    let root = tmp("disagree");
    let r = root.clone();
    let out = on_ranks(2, move |pg| save(&pg, &r, 1, &model(4 + pg.rank() as i64, false)).unwrap_err().to_string());
    for e in out {
        assert!(e.contains("model.l1.bias: rank 0 has it as [4] F32, rank 1 as [5] F32"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_interrupted_save_leaves_the_previous_checkpoint_the_latest() {
    let root = tmp("interrupted");
    on_ranks(2, {
        let r = root.clone();
        move |pg| save(&pg, &r, 5, &model(4, false)).unwrap()
    });
    // a later save that died before its metadata: files, no metadata
    let later = checkpoint::step_dir(&root, 6);
    std::fs::create_dir_all(&later).unwrap();
    std::fs::copy(checkpoint::step_dir(&root, 5).join("rank-00000.safetensors"), later.join("rank-00000.safetensors"))
        .unwrap();
    assert_eq!(checkpoint::committed_steps(&root), vec![5]);
    let r = root.clone();
    let steps = on_ranks(2, move |pg| load(&pg, &r, &model(4, false)).unwrap());
    assert_eq!(steps, vec![Some(5), Some(5)]);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn replicated_tensors_are_written_once_spread_over_the_ranks_and_old_checkpoints_dropped() {
    let root = tmp("once");
    let r = root.clone();
    on_ranks(2, move |pg| {
        let vs = model(64, false);
        let mut ck = Checkpointer::new(pg.clone(), &r).unwrap().keep_last(2);
        for step in 1..=4 {
            ck.save(step, StateDict::new().var_store("model", &vs)).unwrap();
        }
    });
    assert_eq!(checkpoint::committed_steps(&root), vec![3, 4]);
    let dir = checkpoint::step_dir(&root, 4);
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(checkpoint::METADATA)).unwrap()).unwrap();
    let tensors = meta["tensors"].as_object().unwrap();
    assert_eq!(tensors.len(), 4);
    for (name, t) in tensors {
        assert_eq!(t["chunks"].as_array().unwrap().len(), 1, "{name} written once");
    }
    assert_eq!(meta["files"].as_array().unwrap().len(), 2, "both ranks write: {}", meta["files"]);
    assert_eq!(meta["layout"]["world_size"], 2);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_async_save_holds_the_values_of_its_call_while_training_goes_on() {
    let root = tmp("async");
    let r = root.clone();
    on_ranks(2, move |pg| {
        let vs = model(256, false);
        let mut ck = Checkpointer::new(pg.clone(), &r).unwrap();
        ck.async_save(1, StateDict::new().var_store("model", &vs)).unwrap();
        // training goes on: the parameters change and collectives run while the writer works
        for _ in 0..20 {
            tch::no_grad(|| {
                for (_, t) in vs.variables() {
                    let _ = t.shallow_clone().fill_(7.0);
                }
            });
            let mut t = Tensor::ones([1024], (Kind::Float, Device::Cpu));
            pg.allreduce(&mut t, ReduceOp::Sum).unwrap();
        }
        assert_eq!(ck.wait().unwrap(), Some(1));
        // a second one reuses the staging buffers
        ck.async_save(2, StateDict::new().var_store("model", &vs)).unwrap();
        assert_eq!(ck.wait().unwrap(), Some(2));
    });
    let (_, first) = checkpoint::read_full(&checkpoint::step_dir(&root, 1)).unwrap();
    let expected = model(256, false);
    for (name, t) in first {
        let want = &expected.variables()[name.strip_prefix("model.").unwrap()];
        assert!(t.equal(want), "{name}: the values at the call");
    }
    let (_, second) = checkpoint::read_full(&checkpoint::step_dir(&root, 2)).unwrap();
    assert!(second.iter().all(|(_, t)| t.eq(7.0).all().int64_value(&[]) == 1));
    let _ = std::fs::remove_dir_all(&root);
}

/// FSDP on 3 ranks over a 1-element bias: ranks 1 and 2 hold empty shards, rank 2's starting past the
/// bias's end (rank x chunk = 2). Saved with AdamW's state and loaded into a fresh model, every shard and
/// step count comes back.
#[test]
fn empty_fsdp_shards_past_a_parameter_s_end_save_and_load() {
    use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
    use tch_dist::optim::{AdamW, Optimizer};
    let root = tmp("empty-shards");
    let r2 = root.clone();
    on_ranks(3, move |pg| {
        let build = |pg: &Arc<ProcessGroup>| {
            let vs = nn::VarStore::new(Device::Cpu);
            let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone())).unwrap();
            let l = nn::linear(vs.root() / "l", 4, 1, Default::default());
            let model = fsdp.finish(l).unwrap();
            let opt = AdamW::new(model.parameters(), 0.1);
            (vs, model, opt)
        };
        let (vs, model, mut opt) = build(&pg);
        let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
        model.backward(&tch::nn::Module::forward(&model, &x).square().mean(Kind::Float)).unwrap();
        opt.step().unwrap();
        let mut ck = Checkpointer::new(pg.clone(), &r2).unwrap();
        ck.save(1, StateDict::new().var_store("model", &vs).optimizer("optim", &mut opt)).unwrap();
        let (vs2, model2, mut opt2) = build(&pg);
        let step = ck.load(StateDict::new().var_store("model", &vs2).optimizer("optim", &mut opt2)).unwrap();
        assert_eq!(step, Some(1));
        for (a, b) in model.parameters().iter().zip(model2.parameters()) {
            assert!(a.equal(&b), "rank {}: a shard differs after loading", pg.rank());
        }
        let (s1, s2) = (opt.state_dict(), opt2.state_dict());
        assert_eq!(s1.len(), s2.len());
        for ((k, a), (_, b)) in s1.iter().zip(&s2) {
            assert!(a.equal(b), "rank {}: {k} differs after loading", pg.rank());
        }
    });
    let _ = std::fs::remove_dir_all(&root);
}
