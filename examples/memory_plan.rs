//! Per-rank model-state bytes by ZeRO stage, before running anything (`tch_dist::memory::plan`).
//!   cargo run --example memory_plan                      # the ZeRO paper's 7.5B parameters on 64 ranks
//!   cargo run --example memory_plan -- 1300000000 8 fp32 # Ψ, ranks, precision (mixed | fp32)
use tch_dist::memory::plan::{model_states, Precision};
use tch_dist::zero::ZeroStage;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let params: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(7_500_000_000);
    let world: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(64);
    let (precision, what) = match args.get(2).map(String::as_str) {
        Some("fp32") => (Precision::FP32_ADAM, "float32 AdamW (4 + 4 + 8 bytes)"),
        _ => (Precision::MIXED_ADAM, "mixed-precision Adam (2 + 2 + 12 bytes, the paper's K = 12)"),
    };
    println!("Ψ = {params} parameters on {world} ranks, {what}; GB = 1e9 bytes per rank\n");
    println!("| stage | parameters | gradients | optimizer | total |");
    println!("|---|---:|---:|---:|---:|");
    for (s, name) in [
        (None, "DDP (baseline)"),
        (Some(ZeroStage::One), "ZeRO-1 (P_os)"),
        (Some(ZeroStage::Two), "ZeRO-2 (P_os+g)"),
        (Some(ZeroStage::Three), "ZeRO-3 / FSDP (P_os+g+p)"),
    ] {
        let m = model_states(params, world, s, precision);
        let gb = |b: u64| b as f64 / 1e9;
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.1} |",
            gb(m.parameters),
            gb(m.gradients),
            gb(m.optimizer),
            gb(m.total())
        );
    }
}
