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

#[test]
fn a_resumed_run_reads_the_next_batch_and_trains_bit_identically() {
    let dir = tmp("resume");
    make(&dir, "5GB");
    let (d, data) = (dir.display().to_string(), dir.join("train.bin").display().to_string());
    let (ck, whole, resumed) = (dir.join("ck"), dir.join("whole"), dir.join("resumed"));
    let (ck, whole_s, resumed_s) =
        (ck.display().to_string(), whole.display().to_string(), resumed.display().to_string());
    let args = ["--from-hf", &d, "--data", &data, "--steps", "6", "--seq-len", "16", "--batch", "2", "--lr", "1e-2"];
    let args = [&args[..], &["--warmup", "2", "--log-every", "1", "--dp-shard", "2", "--checkpoint", &ck]].concat();
    let first = llama(2, &[&args[..], &["--checkpoint-every", "3", "--to-hf", &whole_s]].concat());
    let first = losses(&first);
    assert_eq!(first.iter().map(|l| l.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>(), "{first:?}");
    // as if the job died after step 3's checkpoint
    std::fs::remove_dir_all(dir.join("ck").join("step-0000000006")).expect("the last checkpoint");
    let again = losses(&llama(2, &[&args[..], &["--resume", "--to-hf", &resumed_s]].concat()));
    assert_eq!(again, first[3..], "the resumed steps 3..6");
    let bytes = |p: &std::path::Path| std::fs::read(p.join("model.safetensors")).expect("a written model");
    assert!(bytes(&whole) == bytes(&resumed), "the resumed run's model differs from the whole run's");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn microbatches_accumulate_the_gradient_of_the_whole_batch() {
    let dir = tmp("accumulate");
    make(&dir, "5GB");
    let (d, data) = (dir.display().to_string(), dir.join("train.bin").display().to_string());
    let args = ["--from-hf", &d, "--data", &data, "--steps", "3", "--seq-len", "16", "--batch", "4", "--lr", "1e-2"];
    let args = [&args[..], &["--log-every", "1", "--dp-shard", "2"]].concat();
    let one = losses(&llama(2, &args));
    let four = losses(&llama(2, &[&args[..], &["--microbatches", "4"]].concat()));
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
    let dir = tmp("recompute");
    make(&dir, "5GB");
    let (d, data) = (dir.display().to_string(), dir.join("train.bin").display().to_string());
    let args = ["--from-hf", &d, "--data", &data, "--steps", "3", "--seq-len", "16", "--batch", "2", "--lr", "1e-2"];
    let args = [&args[..], &["--log-every", "1", "--dp-shard", "2"]].concat();
    let kept = losses(&llama(2, &args));
    let recomputed = losses(&llama(2, &[&args[..], &["--recompute"]].concat()));
    assert_eq!(kept.len(), 3);
    assert_eq!(kept, recomputed, "recomputing the layers changed the training");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--bf16` (FSDP's bfloat16 parameters and compute, float32 shards and reductions) trains close to
/// float32, and not identically: it took effect.
#[test]
fn bf16_compute_trains_close_to_float32_under_fsdp() {
    let dir = tmp("bf16");
    make(&dir, "5GB");
    let (d, data) = (dir.display().to_string(), dir.join("train.bin").display().to_string());
    let args = ["--from-hf", &d, "--data", &data, "--steps", "3", "--seq-len", "16", "--batch", "2", "--lr", "1e-2"];
    let args = [&args[..], &["--log-every", "1", "--dp-shard", "2"]].concat();
    let f32s = losses(&llama(2, &args));
    let bf16 = losses(&llama(2, &[&args[..], &["--bf16"]].concat()));
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
