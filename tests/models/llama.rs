//! examples/llama as a trainer: a run resumed from its checkpoint reads the next batch it would have
//! read and trains bit-identically; gradient accumulation over microbatches, and recomputed layers,
//! train the model that one batch with kept activations trains.
use crate::hf::{llama, make, tmp};

/// The `step N: loss X` lines of a run's output.
fn losses(out: &str) -> Vec<(usize, f64)> {
    out.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("[rank0]: step ").or_else(|| l.strip_prefix("step "))?;
            let (step, rest) = rest.split_once(": loss ")?;
            Some((step.parse().ok()?, rest.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

/// A tiny Llama in a fresh folder `name`, and the flags of `steps` steps on it under FSDP 2 (`batch`
/// sequences a rank, the loss every step).
fn fsdp_run(name: &str, steps: &str, batch: &str) -> (std::path::PathBuf, Vec<String>) {
    let dir = tmp(name);
    make(&dir, "5GB");
    let (d, data) = (dir.display().to_string(), dir.join("train.bin").display().to_string());
    let args = ["--from-hf", &d, "--data", &data, "--steps", steps, "--seq-len", "16", "--batch", batch];
    let args = [&args[..], &["--lr", "1e-2", "--log-every", "1", "--dp-shard", "2"]].concat();
    (dir, args.iter().map(|a| a.to_string()).collect())
}

/// [`llama`] on 2 processes with `args` and `more`.
fn run2(args: &[String], more: &[&str]) -> Vec<(usize, f64)> {
    let all: Vec<&str> = args.iter().map(String::as_str).chain(more.iter().copied()).collect();
    losses(&llama(2, &all))
}

#[test]
fn a_resumed_run_reads_the_next_batch_and_trains_bit_identically() {
    let (dir, args) = fsdp_run("resume", "6", "2");
    let (ck, whole, resumed) = (dir.join("ck"), dir.join("whole"), dir.join("resumed"));
    let (ck, whole_s, resumed_s) =
        (ck.display().to_string(), whole.display().to_string(), resumed.display().to_string());
    let args: Vec<String> = args.into_iter().chain(["--warmup", "2", "--checkpoint", &ck].map(String::from)).collect();
    let first = run2(&args, &["--checkpoint-every", "3", "--to-hf", &whole_s]);
    assert_eq!(first.iter().map(|l| l.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>(), "{first:?}");
    // as if the job died after step 3's checkpoint
    std::fs::remove_dir_all(dir.join("ck").join("step-0000000006")).expect("the last checkpoint");
    let again = run2(&args, &["--resume", "--to-hf", &resumed_s]);
    assert_eq!(again, first[3..], "the resumed steps 3..6");
    let bytes = |p: &std::path::Path| std::fs::read(p.join("model.safetensors")).expect("a written model");
    assert!(bytes(&whole) == bytes(&resumed), "the resumed run's model differs from the whole run's");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn microbatches_accumulate_the_gradient_of_the_whole_batch() {
    let (dir, args) = fsdp_run("accumulate", "3", "4");
    let one = run2(&args, &[]);
    let four = run2(&args, &["--microbatches", "4"]);
    assert_eq!(one.len(), 3);
    for ((s, a), (_, b)) in one.iter().zip(&four) {
        assert!((a - b).abs() < 1e-5, "step {s}: one batch {a}, four microbatches {b}");
    }
    assert!(one[2].1 != one[0].1, "the model trained");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--recompute` (each decoder layer checkpointed, inside its FSDP unit) trains the model that keeping
/// the activations trains.
#[test]
fn recomputed_layers_train_the_same_model_under_fsdp() {
    let (dir, args) = fsdp_run("recompute", "3", "2");
    let kept = run2(&args, &[]);
    let recomputed = run2(&args, &["--recompute"]);
    assert_eq!(kept.len(), 3);
    assert_eq!(kept, recomputed, "recomputing the layers changed the training");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--bf16` (FSDP's bfloat16 parameters and compute, float32 shards and reductions) trains close to
/// float32, and not identically: it took effect.
#[test]
fn bf16_compute_trains_close_to_float32_under_fsdp() {
    let (dir, args) = fsdp_run("bf16", "3", "2");
    let f32s = run2(&args, &[]);
    let bf16 = run2(&args, &["--bf16"]);
    assert_eq!(f32s.len(), 3);
    for ((s, a), (_, b)) in f32s.iter().zip(&bf16) {
        assert!((a - b).abs() < 2e-2, "step {s}: float32 {a}, bfloat16 {b}");
    }
    assert!(f32s != bf16, "--bf16 changed nothing: {f32s:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--tokenizer tokenizer.json` over a text reads the ids Hugging Face's Python `tokenizers` gives the
/// same text: the dump of the first batch equals the one from those ids, and the logits `transformers`'.
#[test]
fn a_text_through_a_hugging_face_tokenizer_reads_the_ids_python_gives() {
    let dir = tmp("tokenizer");
    make(&dir, "5GB");
    crate::hf::py(&["text", &dir.display().to_string()]);
    let tok = dir.join("tokenizer.json").display().to_string();
    let (from_text, from_ids) = (dir.join("text.safetensors"), dir.join("ids.safetensors"));
    crate::hf::dump(&dir, &dir.join("text.txt"), 1, &["--tokenizer", &tok], &from_text);
    crate::hf::dump(&dir, &dir.join("text.bin"), 1, &[], &from_ids);
    let read = |p: &std::path::Path| {
        let mut all = tch::Tensor::read_safetensors(p).unwrap();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    };
    for ((n, a), (m, b)) in read(&from_text).iter().zip(read(&from_ids).iter()) {
        assert!(n == m && a.equal(b), "{n}: through the tokenizer differs from Python's ids");
    }
    let d = crate::hf::diff(&dir, &from_text);
    assert!(d < 1e-4, "logits differ from transformers' by {d}");
    let _ = std::fs::remove_dir_all(&dir);
}
