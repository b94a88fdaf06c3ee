//! Hugging Face checkpoints without Python: written from one process and from FSDP's shards, read back
//! whole, sharded or into a fused variable, each rank reading only its part; every mistake named before
//! anything changes. (tests/models/hf.rs checks the files against `transformers` itself.)
use crate::common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::checkpoint::hf::{save_hf, HfCheckpoint, HfPart, HfSaveOptions, HfSlot};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
use tch_dist::{ProcessGroup, Store};

fn solo() -> Arc<ProcessGroup> {
    Arc::new(ProcessGroup::new(&Store::hash().unwrap(), 0, 1, &common::gloo_opts(Duration::from_secs(30))).unwrap())
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tdx-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Two layers under Hugging Face-like names, filled by name (threads share tch's generator), `shift`
/// apart from one another model's values.
fn model(vs: &nn::VarStore, shift: f64) -> Vec<(nn::Path<'_>, nn::Linear)> {
    let r = vs.root();
    let (p1, p2) = (&r / "model" / "layers" / 0 / "up_proj", &r / "lm_head");
    let (l1, l2) = (nn::linear(&p1, 8, 12, Default::default()), nn::linear(&p2, 12, 5, Default::default()));
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    tch::no_grad(|| {
        for (i, (_, t)) in vars.iter().enumerate() {
            let v = (Tensor::arange(t.numel() as i64, (Kind::Float, Device::Cpu)) * 0.37 + i as f64 + shift).sin();
            t.shallow_clone().copy_(&v.view(t.size().as_slice()));
        }
    });
    vec![(p1, l1), (p2, l2)]
}

/// [`model`] in one process, saved whole as a Hugging Face directory in a fresh folder `name`.
fn saved(name: &str) -> (Arc<ProcessGroup>, PathBuf, nn::VarStore) {
    let (pg, dir, vs) = (solo(), tmp(name), nn::VarStore::new(Device::Cpu));
    let _ = model(&vs, 0.0);
    save_hf(&pg, &dir, &vs, &HfSaveOptions::default(), HfPart::same).unwrap();
    (pg, dir, vs)
}

fn values(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn same(a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_eq!(a.len(), b.len());
    for ((n, x), (m, y)) in a.iter().zip(b) {
        assert_eq!(n, m);
        assert!(x.equal(y), "{n} differs");
    }
}

#[test]
fn written_whole_or_in_several_files_and_read_back_the_same() {
    let pg = solo();
    let one = nn::VarStore::new(Device::Cpu);
    let _ = model(&one, 0.0);
    let (single, sharded) = (tmp("single"), tmp("sharded"));
    // a config from a bfloat16 release: a save in the variables' own dtype (float32) records that
    let config = serde_json::json!({"model_type": "test", "torch_dtype": "bfloat16"});
    let as_written = serde_json::json!({"model_type": "test", "torch_dtype": "float32", "dtype": "float32"});
    let opts = HfSaveOptions { config: Some(config.clone()), ..Default::default() };
    save_hf(&pg, &single, &one, &opts, HfPart::same).unwrap();
    // 400 bytes a file: up_proj's weight (384 bytes) alone, and the rest in the others
    save_hf(&pg, &sharded, &one, &HfSaveOptions { max_shard_size: 400, ..opts }, HfPart::same).unwrap();
    assert!(single.join("model.safetensors").exists() && !single.join("model.safetensors.index.json").exists());
    // the weights get the mode the config gets (0666 less the umask), not the writer's private 0600
    let mode = |p: PathBuf| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions());
    assert_eq!(mode(single.join("model.safetensors")), mode(single.join("config.json")), "file modes");
    let files: Vec<_> = std::fs::read_dir(&sharded).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(sharded.join("model.safetensors.index.json").exists(), "{files:?}");
    assert!(files.len() >= 4, "three or more files, an index and the config: {files:?}");
    for dir in [&single, &sharded] {
        let hf = HfCheckpoint::open(dir).unwrap();
        assert_eq!(hf.config().unwrap(), as_written);
        assert_eq!(hf.names().len(), 4);
        let back = nn::VarStore::new(Device::Cpu);
        let _ = model(&back, 1.0);
        let loaded = hf.load(&pg, &back, HfSlot::same).unwrap();
        assert_eq!(loaded.tensors, 4);
        same(&values(&back), &values(&one));
    }
    // written in bfloat16: the files hold it, and the config says so (transformers loads in it)
    let bf = tmp("bf16");
    let opts = HfSaveOptions { dtype: Some(Kind::BFloat16), config: Some(config.clone()), ..Default::default() };
    save_hf(&pg, &bf, &one, &opts, HfPart::same).unwrap();
    let hf = HfCheckpoint::open(&bf).unwrap();
    assert_eq!(hf.read("lm_head.weight").unwrap().kind(), Kind::BFloat16);
    assert_eq!(hf.config().unwrap()["dtype"], "bfloat16");
    let _ = std::fs::remove_dir_all(&bf);
    // a save with fewer files leaves no file of the earlier one behind
    save_hf(&pg, &sharded, &one, &HfSaveOptions::default(), HfPart::same).unwrap();
    let mut left: Vec<_> = std::fs::read_dir(&sharded).unwrap().flatten().map(|e| e.file_name()).collect();
    left.sort();
    assert_eq!(left, ["config.json", "model.safetensors"], "the earlier files and index are gone");
    let _ = (std::fs::remove_dir_all(&single), std::fs::remove_dir_all(&sharded));
}

/// A variable made of several of the checkpoint's tensors (q, k and v in one), both ways.
#[test]
fn separate_tensors_fill_rows_of_a_fused_variable_and_are_written_back_apart() {
    let (pg, dir, _) = saved("fused");
    // up_proj [12, 8] and lm_head's weight [5, 12] do not stack; up_proj's weight with itself does
    let fused = nn::VarStore::new(Device::Cpu);
    let qkv = fused.root().zeros("qkv", &[24, 8]);
    let map = |n: &str| match n {
        "model.layers.0.up_proj.weight" => HfSlot::Rows { var: "qkv".into(), start: 12 },
        _ => HfSlot::Skip,
    };
    let err = HfCheckpoint::open(&dir).unwrap().load(&pg, &fused, map).unwrap_err().to_string();
    assert!(err.contains("fill 96 of the 192 elements of the model's qkv"), "{err}");
    assert!(qkv.abs().sum(Kind::Float).double_value(&[]) == 0.0, "a refused load changed the variable");
    // rows 0..12 and 12..24 from the same tensor: the whole variable
    let back = HfCheckpoint::open(&dir).unwrap();
    let whole = back.read("model.layers.0.up_proj.weight").unwrap();
    let dir2 = tmp("fused2");
    let halves = |v: &str, _: &[i64]| {
        assert_eq!(v, "qkv");
        vec![HfPart::rows("q", 0..12), HfPart::rows("k", 12..24)]
    };
    tch::no_grad(|| {
        qkv.shallow_clone().copy_(&Tensor::cat(&[&whole, &(&whole * 2.0)], 0));
    });
    save_hf(&pg, &dir2, &fused, &HfSaveOptions::default(), halves).unwrap();
    // a map that drops rows, repeats them or writes nothing of a variable is refused, naming the rows
    // (and rows outside the variable are named as such)
    let cases: [(Vec<HfPart>, &str); 5] = [
        (vec![HfPart::rows("q", 0..12)], "writes none of rows 12..24 of qkv"),
        (vec![HfPart::rows("q", 0..16), HfPart::rows("k", 12..24)], "writes twice rows 12..16 of qkv"),
        (vec![], "writes none of rows 0..24 of qkv"),
        (
            vec![HfPart::rows("q", 0..12), HfPart::rows("k", 12..30)],
            "k: rows 12..30 of qkv (outside the variable), which has shape [24, 8]",
        ),
        (vec![HfPart::rows("q", 0..24), HfPart::rows("k", 5..5)], "k: rows 5..5 of qkv (an empty range)"),
    ];
    for (parts, want) in cases {
        let e = save_hf(&pg, tmp("bad-map"), &fused, &HfSaveOptions::default(), |_: &str, _: &[i64]| parts.clone())
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{want:?} not in: {e}");
    }
    let two = HfCheckpoint::open(&dir2).unwrap();
    assert!(two.read("q").unwrap().equal(&whole) && two.read("k").unwrap().equal(&(&whole * 2.0)));
    let again = nn::VarStore::new(Device::Cpu);
    let qkv2 = again.root().zeros("qkv", &[24, 8]);
    let rows = |n: &str| HfSlot::Rows { var: "qkv".into(), start: if n == "q" { 0 } else { 12 } };
    two.load(&pg, &again, rows).unwrap();
    assert!(qkv2.equal(&qkv));
    let _ = (std::fs::remove_dir_all(&dir), std::fs::remove_dir_all(&dir2));
}

#[test]
fn a_missing_unexpected_or_mis_shaped_tensor_is_named_and_nothing_changes() {
    let (pg, dir, one) = saved("errors");
    let hf = HfCheckpoint::open(&dir).unwrap();
    let file = dir.join("model.safetensors").display().to_string();
    let check = |vs: &nn::VarStore, map: &dyn Fn(&str) -> HfSlot, wants: &[&str]| {
        let before = values(vs);
        let e = hf.load(&pg, vs, map).unwrap_err().to_string();
        for w in wants {
            assert!(e.contains(w), "{w:?} not in: {e}");
        }
        same(&values(vs), &before);
    };
    // a variable no tensor fills
    let extra = nn::VarStore::new(Device::Cpu);
    let _ = model(&extra, 1.0);
    let _ = (extra.root() / "model" / "norm").zeros("weight", &[8]);
    check(&extra, &HfSlot::same, &["no tensor goes to the model's model.norm.weight", "shape [8]"]);
    // a tensor no variable takes
    let fewer = nn::VarStore::new(Device::Cpu);
    let _ = nn::linear(fewer.root() / "lm_head", 12, 5, Default::default());
    check(&fewer, &HfSlot::same, &[&file, "go to no variable of the model: model.layers.0.up_proj.bias"]);
    // a shape that differs
    let wide = nn::VarStore::new(Device::Cpu);
    let _ = nn::linear(wide.root() / "model" / "layers" / 0 / "up_proj", 8, 13, Default::default());
    let _ = nn::linear(wide.root() / "lm_head", 12, 5, Default::default());
    check(&wide, &HfSlot::same, &[&file, "model.layers.0.up_proj.bias has shape [12]", "has [13]"]);
    // integers into a float
    let floats = nn::VarStore::new(Device::Cpu);
    let _ = (floats.root() / "lm_head").zeros("bias", &[5]);
    let dir2 = tmp("ints");
    std::fs::create_dir_all(&dir2).unwrap();
    let ids = Tensor::from_slice(&[1i64, 2, 3, 4, 5]);
    Tensor::write_safetensors(&[("lm_head.bias", &ids)], dir2.join("model.safetensors")).unwrap();
    let e = HfCheckpoint::open(&dir2).unwrap().load(&pg, &floats, HfSlot::same).unwrap_err().to_string();
    assert!(e.contains("lm_head.bias is I64, the model's lm_head.bias is Float"), "{e}");
    // a directory that is not a checkpoint, one that does not exist, a file
    let empty = tmp("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = HfCheckpoint::open(&empty).unwrap_err().to_string();
    assert!(e.contains("holds neither model.safetensors.index.json nor model.safetensors"), "{e}");
    let e = HfCheckpoint::open(tmp("nowhere")).unwrap_err().to_string();
    assert!(e.contains("does not exist"), "{e}");
    let e = HfCheckpoint::open(dir.join("model.safetensors")).unwrap_err().to_string();
    assert!(e.contains("is a file: give the directory"), "{e}");
    // a tensor mapped away from the variable it fills: named as the likely culprit
    let map = |n: &str| if n == "lm_head.weight" { HfSlot::Skip } else { HfSlot::same(n) };
    check(
        &one,
        &map,
        &["no tensor goes to the model's lm_head.weight", "tensors of that shape no variable takes: lm_head.weight"],
    );
    // two tensors into the same rows: both named, with their rows
    let parts = nn::VarStore::new(Device::Cpu);
    let (_, _) = (parts.root().zeros("a", &[4, 8]), parts.root().zeros("b", &[4, 8]));
    let dir3 = tmp("overlap");
    save_hf(&pg, &dir3, &parts, &HfSaveOptions::default(), HfPart::same).unwrap();
    let fused = nn::VarStore::new(Device::Cpu);
    let _ = fused.root().zeros("qkv", &[8, 8]);
    let both = |n: &str| HfSlot::Rows { var: "qkv".into(), start: if n == "a" { 0 } else { 2 } };
    let e = HfCheckpoint::open(&dir3).unwrap().load(&pg, &fused, both).unwrap_err().to_string();
    assert!(e.contains("a (rows 0..4) and b (rows 2..6) fill the same part of the model's qkv"), "{e}");
    let _ = std::fs::remove_dir_all(&dir3);
    let _ = std::fs::remove_dir_all(&empty);
    let _ = (std::fs::remove_dir_all(&dir), std::fs::remove_dir_all(&dir2));
}

/// Under FSDP on 2 ranks each rank reads about half the bytes (its rows), the sharded model equals the
/// one-process model loaded from the same directory, and a save from the shards writes the same files.
#[test]
fn fsdp_ranks_read_only_their_rows_and_write_the_same_checkpoint() {
    let pg = solo();
    let dir = tmp("fsdp");
    let one = nn::VarStore::new(Device::Cpu);
    let net = model(&one, 0.0).into_iter().fold(nn::seq(), |s, (_, l)| s.add(l));
    save_hf(&pg, &dir, &one, &HfSaveOptions::default(), HfPart::same).unwrap();
    let total: u64 = values(&one).iter().map(|(_, t)| t.numel() as u64 * 4).sum();
    let input = || Tensor::arange(24, (Kind::Float, Device::Cpu)).view([3, 8]).sin();
    let want = tch::no_grad(|| nn::Module::forward(&net, &input()));
    let (d, out) = (dir.clone(), tmp("fsdp-out"));
    let o = out.clone();
    let got = common::run_threads(2, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone())).unwrap();
        let layers = model(&vs, 1.0); // other values: the load must replace them
        let net = layers.into_iter().fold(nn::seq(), |s, (p, l)| s.add(fsdp.fully_shard(&p, l).unwrap()));
        let net = fsdp.finish(net).unwrap();
        let loaded = HfCheckpoint::open(&d).unwrap().load(&pg, &vs, HfSlot::same).unwrap();
        let y = tch::no_grad(|| nn::Module::forward(&net, &input()));
        save_hf(&pg, &o, &vs, &HfSaveOptions::default(), HfPart::same).unwrap();
        (loaded.bytes_read, y)
    });
    for (rank, (bytes, y)) in got.iter().enumerate() {
        assert!(*bytes > 0 && *bytes * 10 <= total * 6, "rank {rank} read {bytes} of {total} bytes");
        assert!(y.allclose(&want, 1e-6, 1e-6, false), "rank {rank}: the sharded model's output differs");
    }
    let (a, b) = (HfCheckpoint::open(&dir).unwrap(), HfCheckpoint::open(&out).unwrap());
    assert_eq!(a.names(), b.names());
    for n in a.names() {
        assert!(a.read(n).unwrap().equal(&b.read(n).unwrap()), "{n} written from the shards differs");
    }
    let _ = (std::fs::remove_dir_all(&dir), std::fs::remove_dir_all(&out));
}

/// A checkpoint whose 2-D weights are stored transposed (GPT-2's `Conv1D`): written so with
/// `HfPart::transposed`, read back with `HfSlot::Transposed` in one process and under FSDP on 2 ranks.
#[test]
fn transposed_weights_are_written_and_read_in_any_layout() {
    let pg = solo();
    let dir = tmp("transposed");
    let one = nn::VarStore::new(Device::Cpu);
    let net = model(&one, 0.0).into_iter().fold(nn::seq(), |s, (_, l)| s.add(l));
    let flip = |v: &str, s: &[i64]| vec![if s.len() == 2 { HfPart::transposed(v) } else { HfPart::whole(v) }];
    save_hf(&pg, &dir, &one, &HfSaveOptions::default(), flip).unwrap();
    let hf = HfCheckpoint::open(&dir).unwrap();
    assert_eq!(hf.shape("model.layers.0.up_proj.weight"), Some(&[8i64, 12][..]));
    let unflip = |n: &str| if n.ends_with("weight") { HfSlot::Transposed(n.into()) } else { HfSlot::same(n) };
    let back = nn::VarStore::new(Device::Cpu);
    let _ = model(&back, 1.0);
    hf.load(&pg, &back, unflip).unwrap();
    same(&values(&back), &values(&one));
    // a transposed tensor that does not fit, named
    let e = hf.load(&pg, &back, HfSlot::same).unwrap_err().to_string();
    assert!(e.contains("lm_head.weight has shape [12, 5], the model's lm_head.weight has [5, 12]"), "{e}");
    // a transposed tensor that cannot be read (the file cut short after it was opened: its last tensor,
    // up_proj.weight by name): an error naming it, and every variable as it was
    let cut = tmp("transposed-cut");
    std::fs::create_dir_all(&cut).unwrap();
    std::fs::copy(dir.join("model.safetensors"), cut.join("model.safetensors")).unwrap();
    let short = HfCheckpoint::open(&cut).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(cut.join("model.safetensors")).unwrap();
    file.set_len(file.metadata().unwrap().len() - 4).unwrap();
    let fresh = nn::VarStore::new(Device::Cpu);
    let _ = model(&fresh, 2.0);
    let before = values(&fresh);
    let e = short.load(&pg, &fresh, unflip).unwrap_err().to_string();
    assert!(e.contains("model.layers.0.up_proj.weight"), "{e}");
    same(&values(&fresh), &before);
    let _ = std::fs::remove_dir_all(&cut);
    let input = || Tensor::arange(24, (Kind::Float, Device::Cpu)).view([3, 8]).sin();
    let want = tch::no_grad(|| nn::Module::forward(&net, &input()));
    let d = dir.clone();
    let got = common::run_threads(2, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone())).unwrap();
        let layers = model(&vs, 1.0);
        let net = layers.into_iter().fold(nn::seq(), |s, (p, l)| s.add(fsdp.fully_shard(&p, l).unwrap()));
        let net = fsdp.finish(net).unwrap();
        HfCheckpoint::open(&d).unwrap().load(&pg, &vs, unflip).unwrap();
        tch::no_grad(|| nn::Module::forward(&net, &input()))
    });
    for (rank, y) in got.iter().enumerate() {
        assert!(y.allclose(&want, 1e-6, 1e-6, false), "rank {rank}: the sharded model's output differs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A damaged file is named with what is wrong with it, and opening it reads only its header: a file cut
/// short, one with bytes added, one with a header length past its end, and one that is not safetensors.
#[test]
fn a_damaged_file_is_refused_naming_the_file_and_what_is_wrong() {
    let (_, dir, _) = saved("damaged");
    let file = dir.join("model.safetensors");
    let good = std::fs::read(&file).unwrap();
    let mut longer = good.clone();
    longer.extend_from_slice(&[0; 4]);
    let mut past_end = good.clone();
    past_end[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
    let cases: [(&[u8], &str); 4] = [
        (&good[..good.len() - 4], "describes"),
        (&longer, "describes"),
        (&past_end, "a header of"),
        (b"not a checkpoint at all", "not a safetensors file"),
    ];
    for (bytes, want) in cases {
        std::fs::write(&file, bytes).unwrap();
        let e = HfCheckpoint::open(&dir).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("model.safetensors"), "{want:?} not in: {e}");
    }
    std::fs::write(&file, &good).unwrap();
    assert_eq!(HfCheckpoint::open(&dir).unwrap().names().len(), 4, "the file put back opens");
    // cut short between open and load: the read names the file's own tensor, not our variable's path
    let hf = HfCheckpoint::open(&dir).unwrap();
    std::fs::write(&file, &good[..good.len() / 2]).unwrap();
    let back = nn::VarStore::new(Device::Cpu);
    let _ = model(&back, 1.0);
    let e = hf.load(&solo(), &back, HfSlot::same).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("cannot read bytes") && e.contains("model.safetensors"), "{e}");
    assert!(!e.contains("model.model.") && !e.contains("model.lm_head"), "an internal name in: {e}");
    std::fs::write(&file, &good).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
