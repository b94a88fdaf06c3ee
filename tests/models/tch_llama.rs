//! examples/llama.rs, a Llama-style model (a fused `c_attn` read by `chunk(3, -1)`, RMSNorm, rotary
//! embeddings passed to each block through `Unit::forward_with`, SwiGLU), small (2 blocks, 32 features, 4
//! heads, 16 characters), trained by tch's own `nn::AdamW`:
//! - under DDP 2, FSDP 2, HSDP 2 × 2 and TP 2 (the fused projection split by `Style::colwise_fused(3)`),
//!   15 steps give the one-process losses within 1e-4, and the loss falls;
//! - saved after 5 steps in one layout with tch's optimizer (`StateDict::tch_optimizer`) and resumed in
//!   another, the next 5 steps give the losses of one process that never stopped, within 1e-4.
use crate::common;

const MODEL: [&str; 10] =
    ["--layers", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--batch-size", "8"];

#[test]
fn every_layout_trains_like_one_process() {
    let layouts: [(usize, &[&str]); 4] =
        [(2, &["--dp", "2"]), (2, &["--fsdp", "2"]), (4, &["--hsdp", "2x2"]), (2, &["--tp", "2"])];
    let args = [&MODEL[..], &["--lr", "0.003", "--steps", "15"]].concat();
    common::layouts_train_like_one_process("tch_llama", &args, 15, &layouts, 1e-4);
}

#[test]
fn tch_s_adamw_saved_in_one_layout_resumes_in_another() {
    let dir = std::env::temp_dir().join(format!("tch-dist-tch-llama-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = common::corpus();
    let run = |procs: usize, layout: &[&str], steps: &str, extra: &[&str], file: &str| {
        let args =
            [&["--corpus", corpus.as_str(), "--lr", "0.003", "--steps", steps][..], &MODEL, layout, extra].concat();
        common::example_losses("tch_llama", procs, &args, &dir.join(file))
    };
    let reference = run(1, &[], "10", &[], "one.txt");
    assert_eq!(reference.len(), 10);
    for (i, (save, resume)) in
        [((2, &["--fsdp", "2"][..]), (2, &["--tp", "2"][..])), ((4, &["--hsdp", "2x2"]), (2, &["--dp", "2"]))]
            .into_iter()
            .enumerate()
    {
        let ck = dir.join(format!("ck{i}"));
        let ck = ck.to_str().unwrap();
        let first = run(save.0, save.1, "5", &["--checkpoint", ck], &format!("a{i}.txt"));
        let then = run(resume.0, resume.1, "10", &["--checkpoint", ck, "--resume"], &format!("b{i}.txt"));
        assert_eq!((first.len(), then.len()), (5, 5), "{save:?} -> {resume:?}");
        for (s, (want, got)) in reference.iter().zip(first.iter().chain(&then)).enumerate() {
            assert!((want - got).abs() <= 1e-4, "{save:?} -> {resume:?}, step {s}: one process {want}, resumed {got}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
