//! examples/llama against `transformers` itself (tests/py/hf_llama.py): a tiny random Llama saved by
//! `save_pretrained` loads in every layout with `transformers`' logits, sharded or not, and a model
//! trained under FSDP and written with `--to-hf` loads in `transformers` with our logits.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tdx-hf-llama-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn py(args: &[&str]) -> String {
    let o = Command::new(common::python())
        .arg(common::repo_path("tests/py/hf_llama.py"))
        .args(args)
        .output()
        .expect("python runs");
    assert!(o.status.success(), "hf_llama.py {args:?}: {}", common::show(&o));
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// A tiny random `LlamaForCausalLM` in `dir` (files of at most `shard` each), and `dir/train.bin`.
pub fn make(dir: &Path, shard: &str) {
    py(&["make", &dir.display().to_string(), "--max-shard-size", shard]);
}

/// The largest difference between `transformers`' logits with the model in `dir` and the dump's.
pub fn diff(dir: &Path, dump: &Path) -> f64 {
    let out = py(&["logits", &dir.display().to_string(), &dump.display().to_string()]);
    out.lines()
        .find_map(|l| l.strip_prefix("max_diff ").and_then(|x| x.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no max_diff line in: {out}"))
}

pub fn llama(procs: usize, args: &[&str]) -> String {
    let o = Command::new(common::tchrun())
        .args(["--standalone", "--nproc-per-node", &procs.to_string(), "--"])
        .arg(common::example("llama"))
        .args(args)
        .output()
        .expect("tchrun runs");
    assert!(o.status.success(), "llama {args:?} on {procs} processes: {}", common::show(&o));
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// `--from-hf dir --data data --steps 0 --dump-logits dump` with the layout's flags.
pub fn dump(dir: &Path, data: &Path, procs: usize, layout: &[&str], dump: &Path) {
    let (d, data, out) = (dir.display().to_string(), data.display().to_string(), dump.display().to_string());
    let mut args = vec!["--from-hf", &d, "--data", &data, "--steps", "0", "--seq-len", "16", "--batch", "2"];
    args.extend(["--dump-logits", &out]);
    args.extend(layout);
    let _ = llama(procs, &args);
}

/// The first batch's logits from the model in `dir` under `layout` equal `transformers`' within 1e-4.
fn gives_transformers_logits(dir: &Path, procs: usize, layout: &[&str]) {
    let out = dir.join(format!("dump{}.safetensors", layout.join("")));
    dump(dir, &dir.join("train.bin"), procs, layout, &out);
    let d = diff(dir, &out);
    assert!(d < 1e-4, "{layout:?}: logits differ from transformers' by {d}");
}

#[test]
fn a_hugging_face_llama_gives_transformers_logits_in_every_layout() {
    let dir = tmp("layouts");
    make(&dir, "5GB");
    let layouts: [(usize, &[&str]); 6] = [
        (1, &[]),
        (2, &["--dp-shard", "2"]),
        (2, &["--tp", "2"]),
        (4, &["--dp-replicate", "2", "--dp-shard", "2"]),
        (4, &["--dp-shard", "2", "--tp", "2"]),
        (4, &["--pp", "2", "--dp-shard", "2"]),
    ];
    for (procs, layout) in layouts {
        gives_transformers_logits(&dir, procs, layout);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Several files with an index, in bfloat16 as models are published: each rank reads its rows and
/// converts them into the float32 variables (`transformers` upcasts alike).
#[test]
fn a_sharded_bf16_hugging_face_checkpoint_loads_like_a_single_file() {
    let dir = tmp("sharded");
    py(&["make", &dir.display().to_string(), "--max-shard-size", "10KB", "--bf16"]);
    let files =
        std::fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with("model-"));
    assert!(files.count() >= 3, "save_pretrained wrote several files");
    assert!(dir.join("model.safetensors.index.json").exists());
    gives_transformers_logits(&dir, 2, &["--dp-shard", "2"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Three AdamW steps under FSDP 2, pp 2 x FSDP 2 and FSDP 2 x TP 2 give the same model (the same global
/// batch, two microbatches a step in the pipeline); written with `--to-hf` (the source's generation
/// config beside it), `transformers` loads each with our logits, which differ from the untrained model's.
#[test]
fn trained_in_three_layouts_and_written_with_to_hf_transformers_gives_our_logits() {
    let dir = tmp("trained");
    make(&dir, "5GB");
    let (d, data) = (dir.display().to_string(), dir.join("train.bin"));
    let data_s = data.display().to_string();
    let train = ["--from-hf", &d, "--data", &data_s, "--steps", "3", "--seq-len", "16", "--batch", "2", "--lr", "1e-2"];
    let mut dumps = Vec::new();
    let layouts =
        [(2, &["--dp-shard", "2"][..]), (4, &["--pp", "2", "--dp-shard", "2"]), (4, &["--dp-shard", "2", "--tp", "2"])];
    for (procs, layout) in layouts {
        let to = dir.join(format!("tuned{}", layout.join("")));
        let to_s = to.display().to_string();
        let _ = llama(procs, &[&train[..], layout, &["--to-hf", &to_s]].concat());
        assert!(to.join("config.json").exists() && to.join("model.safetensors").exists(), "{layout:?}");
        // what save_pretrained left beside the weights comes along (transformers' generate reads it)
        let generation =
            std::fs::read(dir.join("generation_config.json")).expect("save_pretrained's generation config");
        assert_eq!(std::fs::read(to.join("generation_config.json")).ok(), Some(generation), "{layout:?}");
        let out = dir.join(format!("dump{}.safetensors", layout.join("")));
        dump(&to, &data, 1, &[], &out);
        let ours = diff(&to, &out);
        assert!(ours < 1e-4, "{layout:?}: transformers' logits with the written model differ from ours by {ours}");
        let before = diff(&dir, &out);
        assert!(before > 1e-3, "{layout:?}: three steps at lr 1e-2 left the model as it was ({before})");
        dumps.push(out);
    }
    let logits = |p: &Path| {
        let all = tch::Tensor::read_safetensors(p).unwrap();
        all.into_iter().find(|(n, _)| n == "logits").unwrap().1
    };
    let first = logits(&dumps[0]);
    for (dump, (_, layout)) in dumps[1..].iter().zip(&layouts[1..]) {
        let gap = (&first - &logits(dump)).abs().max().double_value(&[]);
        assert!(gap < 1e-4, "FSDP and {layout:?} trained different models: logits differ by {gap}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Loading under FSDP on 2 ranks reads about half the file on each rank and costs, on top of the shards
/// the rank holds, less than one tensor: no rank materialises the whole model (the counting allocator's
/// peak during the load).
#[test]
fn loading_under_fsdp_reads_and_allocates_a_rank_s_part_only() {
    let dir = tmp("memory");
    py(&["make", &dir.display().to_string(), "--vocab", "512", "--hidden", "128", "--layers", "4"]);
    let (d, data) = (dir.display().to_string(), dir.join("train.bin").display().to_string());
    let out = llama(2, &["--from-hf", &d, "--data", &data, "--steps", "0", "--dp-shard", "2", "--load-report"]);
    let file = std::fs::metadata(dir.join("model.safetensors")).unwrap().len() as f64;
    let largest = 512.0 * 128.0 * 4.0; // the embedding and the head
    let mut ranks = 0;
    for line in out.lines().filter(|l| l.contains("load rank")) {
        let num = |key: &str| -> f64 {
            let at = line.find(key).unwrap_or_else(|| panic!("no {key:?} in {line}"));
            let before = line[..at].trim_end().rsplit(' ').next().unwrap();
            before.trim_start_matches('+').replace(',', "").parse().unwrap()
        };
        let (read, held) = (num(" bytes read"), num(" bytes held"));
        let extra: f64 = line.rsplit('+').next().unwrap().trim().parse().unwrap();
        assert!(read < 0.6 * file && read > 0.4 * file, "{line}: read {read} of a {file}-byte file");
        assert!(held < 0.6 * file, "{line}: holds {held} bytes of a {file}-byte model: more than its shards");
        assert!(extra < largest, "{line}: the load allocated {extra} bytes, more than one tensor ({largest})");
        ranks += 1;
    }
    assert_eq!(ranks, 2, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
