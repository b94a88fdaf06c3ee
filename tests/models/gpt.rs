//! examples/gpt.rs, small: 20 steps of a 2-layer GPT (d 32, 2 heads, context 16) on Python's
//! documentation text, in one process and on several meshes under tchrun (tp 2; DDP 2, FSDP 2, HSDP
//! 2 × 2; pp 2 × DDP 2, pp 2 × FSDP 2, pp 2 × DDP 2 × tp 2, pp 2 × HSDP 2 × 2), one model source over a
//! `parallelize::Plan`, each stage's data parallelism run by the pipeline: the losses agree within 1e-4
//! at every step, and fall. Its mixture-of-experts variant (4 experts a block, spread over the "dp"
//! ranks) likewise on DDP 2, pp 2 x DDP 2, DDP 2 x tp 2 and EP 2 x DP 2 (DDP over 4 ranks, the experts
//! spread over pairs of them and repeated over the other pair): every token goes to every expert (top-4 of 4,
//! room for all), since a top-k below the expert count is not continuous in the weights: a rounding
//! apart, a near tie sends a token elsewhere, and AdamW carries that on (seen at step 2 with top-2).
//! tests/tp/moe.rs checks top-k routing and its drops exactly, layer by layer. Context parallelism (ring
//! attention, head-tail chunks; context 24) likewise on cp 2, cp 3, FSDP 2 x cp 2, pp 2 x cp 2 and
//! DDP 2 x cp 2 x tp 2.
use crate::common;

#[test]
fn every_mesh_trains_like_one_process() {
    let model = ["--layers", "2", "--d", "32", "--heads", "2", "--context", "16", "--global-batch", "8"];
    let meshes: [(usize, &[&str]); 8] = [
        (2, &["--tp", "2"]),
        (2, &["--dp", "2"]),
        (2, &["--fsdp", "2"]),
        (4, &["--hsdp", "2x2"]),
        (4, &["--pp", "2", "--dp", "2"]),
        (4, &["--pp", "2", "--fsdp", "2"]),
        (8, &["--pp", "2", "--dp", "2", "--tp", "2"]),
        (8, &["--pp", "2", "--hsdp", "2x2"]),
    ];
    common::layouts_train_like_one_process("gpt", &[&model[..], &["--steps", "20"]].concat(), 20, &meshes, 1e-4);
}

#[test]
fn the_mixture_of_experts_variant_trains_like_one_process() {
    let model = "--layers 2 --d 32 --heads 2 --context 16 --global-batch 8 --experts 4 --top-k 4 --capacity-factor 1";
    let model: Vec<&str> = model.split(' ').collect();
    let meshes: [(usize, &[&str]); 4] = [
        (2, &["--dp", "2"]),
        (4, &["--pp", "2", "--dp", "2"]),
        (4, &["--dp", "2", "--tp", "2"]),
        (4, &["--dp", "4", "--ep", "2"]),
    ];
    common::layouts_train_like_one_process("gpt", &[&model[..], &["--steps", "20"]].concat(), 20, &meshes, 1e-4);
}

#[test]
fn context_parallel_meshes_train_like_one_process() {
    let model = ["--layers", "2", "--d", "32", "--heads", "2", "--context", "24", "--global-batch", "8"];
    let meshes: [(usize, &[&str]); 5] = [
        (2, &["--cp", "2"]),
        (3, &["--cp", "3"]),
        (4, &["--fsdp", "2", "--cp", "2"]),
        (4, &["--pp", "2", "--cp", "2"]),
        (8, &["--dp", "2", "--cp", "2", "--tp", "2"]),
    ];
    common::layouts_train_like_one_process("gpt", &[&model[..], &["--steps", "20"]].concat(), 20, &meshes, 1e-4);
}
