//! examples/min_gpt.rs, tch-rs's min-gpt with constructors taking a `parallelize::Plan`, small (2
//! blocks, 32 features, 2 heads, 16 characters, no dropout): 15 steps with tch's own `nn::AdamW` and
//! `backward_step_clip` under DDP 2, FSDP 2, HSDP 2 × 2 and TP 2 give the one-process losses within
//! 1e-4, and the loss falls.
use crate::common;

#[test]
fn every_layout_trains_like_one_process() {
    let model = ["--layers", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8"];
    let training = ["--pdrop", "0", "--lr", "0.003", "--steps", "15"];
    let layouts: [(usize, &[&str]); 4] =
        [(2, &["--dp", "2"]), (2, &["--fsdp", "2"]), (4, &["--hsdp", "2x2"]), (2, &["--tp", "2"])];
    common::layouts_train_like_one_process("min_gpt", &[&model[..], &training].concat(), 15, &layouts, 1e-4);
}
