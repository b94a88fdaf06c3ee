"""Summarises scripts/bench-memory.sh's runs: a Markdown table on stdout and a bar chart.
Usage: bench_memory_report.py RESULTS_DIR PNG"""
import sys

from benchlib import Runs, paired_ratio, table_head, table_row

runs, png = Runs(sys.argv[1]), sys.argv[2]
PSI = 24 * (1024 * 1024 + 1024)  # parameters
N = 2
MB = 1e6
L, H, B = 24, 1024, 16
U = 4 * (H * H + H)  # the largest unit (one Linear) gathered, float32
A = L * B * H * 4  # activations autograd keeps: each Linear's input (the ReLU's output, the same tensor)

# name: (label, model-state bytes the configuration holds per rank, what the formula counts)
RUNS = {
    "torch_default": ("PyTorch DDP (default)", 20 * PSI, "4Ψ params + 4Ψ grads + 4Ψ buckets + 8Ψ Adam"),
    "torch_views": ("PyTorch DDP, gradient_as_bucket_view", 16 * PSI, "16Ψ"),
    "torch_zero": ("PyTorch DDP + ZeroRedundancyOptimizer", 12 * PSI + 8 * PSI / N, "12Ψ + 8Ψ/N"),
    "torch_zero_views": ("PyTorch DDP (views) + ZeroRedundancyOptimizer", 8 * PSI + 8 * PSI / N, "8Ψ + 8Ψ/N"),
    "ours_ddp": ("tch-dist DDP + AdamW", 16 * PSI, "16Ψ"),
    "ours_zero1": ("tch-dist ZeRO-1", 8 * PSI + 8 * PSI / N, "8Ψ + 8Ψ/N"),
    "ours_zero2_25": ("tch-dist ZeRO-2, 25 MB buckets", 4 * PSI + 12 * PSI / N, "4Ψ + 12Ψ/N"),
    "ours_zero2": ("tch-dist ZeRO-2, 4 MB buckets", 4 * PSI + 12 * PSI / N, "4Ψ + 12Ψ/N"),
    "ours_zero2_bf16": ("tch-dist ZeRO-2, bf16 params + fp32 master, 4 MB buckets", 2 * PSI + 14 * PSI / N, "2Ψ + 14Ψ/N (paper)"),
    "torch_fsdp2": ("PyTorch FSDP2 (fully_shard each Linear + root)", 16 * PSI / N + U + A, "16Ψ/N + U + A"),
    "ours_zero3": ("tch-dist ZeRO-3 (FSDP), each Linear a unit", 16 * PSI / N + U + A, "16Ψ/N + U + A"),
    "torch_fsdp2_keep": ("PyTorch FSDP2, reshard_after_forward=False", 4 * PSI + 8 * PSI / N + U + A, "4Ψ + 8Ψ/N + U + A"),
    "ours_zero3_keep": ("tch-dist ZeRO-3, reshard_after_forward(false)", 4 * PSI + 8 * PSI / N + U + A, "4Ψ + 8Ψ/N + U + A"),
    "ours_zero3_ckpt": ("tch-dist ZeRO-3, each unit checkpointed", 16 * PSI / N + U + A, "16Ψ/N + U + A"),
    "ours_zero3_bf16": ("tch-dist ZeRO-3, bf16 compute, fp32 shards", 16 * PSI / N + U / 2 + A / 2, "16Ψ/N + U/2 + A/2"),
    "torch_fsdp2_fused": ("PyTorch FSDP2, AdamW(fused=True)", 16 * PSI / N + U + A, "16Ψ/N + U + A"),
    "ours_zero3_fused": ("tch-dist ZeRO-3, AdamW fused", 16 * PSI / N + U + A, "16Ψ/N + U + A"),
}


def load(name):
    peaks = [max(int(r[1]), int(r[2])) for r in runs.rows(name)]
    return runs.median(name), max(peaks), min(peaks)


def step_ratio(ours, theirs):
    """The median of the rounds' own step ratios (each round runs both, close together), and the ratio of
    the medians: 'paired (of medians)'."""
    paired = paired_ratio(runs.column(ours), runs.column(theirs))
    return f"{paired:.3f} (ratio of medians {R[ours][0] / R[theirs][0]:.3f})"


R = {n: load(n) for n in RUNS}
base_t, base_m, _ = R["torch_default"]
zero_t = R["torch_zero"][0]
print(f"24 x Linear(1024, 1024): Ψ = {PSI:,} parameters ({4 * PSI / MB:.1f} MB in float32), AdamW, "
      f"2 ranks (Gloo), batch 16/rank; {len(runs.rows('ours_ddp'))} rounds\n")
table_head("run", "step (s)", "step / PyTorch ZeRO", "peak per rank (MB)", "peak / PyTorch default", "formula",
           "formula (MB)", "peak / formula", align="lrrrrl")
for n, (label, f, ftext) in RUNS.items():
    t, m, lo = R[n]
    spread = f" ({lo / MB:.1f}–{m / MB:.1f})" if m - lo > 0.5 * MB else ""
    table_row(label, f"{t:.3f}", f"{t / zero_t:.2f}", f"{m / MB:.1f}{spread}", f"{m / base_m:.2f}", ftext, f"{f / MB:.1f}",
              f"{m / f:.3f}")
torch_best = min(R[n][1] for n in RUNS if n.startswith("torch") and "fsdp" not in n)
print()
print(f"ours ZeRO-2 (fp32) vs PyTorch's best DDP/ZeRO configuration: {R['ours_zero2'][1] / torch_best:.3f} (goal <= 1)")
for n in ("ours_zero1", "ours_zero2", "ours_zero2_bf16"):
    print(f"{RUNS[n][0]}: peak / formula {R[n][1] / RUNS[n][1]:.3f} (goal <= 1.10); "
          f"step / PyTorch ZeRO {step_ratio(n, 'torch_zero')}, / PyTorch ZeRO with views {step_ratio(n, 'torch_zero_views')} (goal <= 1)")

print()
print(f"ZeRO-3 formulas: U = one Linear gathered = {U / MB:.2f} MB, A = the {L} layer inputs autograd keeps = {A / MB:.2f} MB; "
      "with resharding off all parameters stay gathered from forward to backward (4Ψ), and the gradient shards "
      "are not yet there when backward starts")
for ours, theirs in (("ours_zero3", "torch_fsdp2"), ("ours_zero3_keep", "torch_fsdp2_keep"),
                     ("ours_zero3_ckpt", "torch_fsdp2"), ("ours_zero3_bf16", "torch_fsdp2"),
                     ("ours_zero3_fused", "torch_fsdp2_fused")):
    print(f"{RUNS[ours][0]}: peak / {RUNS[theirs][0]} {R[ours][1] / R[theirs][1]:.3f} (goal <= 0.95), "
          f"peak / formula {R[ours][1] / RUNS[ours][1]:.3f} (goal <= 1.10); step / FSDP2 {step_ratio(ours, theirs)} (goal <= 0.5)")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(11, 5.5))
names = list(RUNS)
ys = range(len(names))
ax.barh(list(ys), [R[n][1] / MB for n in names], color=["#d9822b" if n.startswith("torch") else "#2b6cd9" for n in names])
for y, n in zip(ys, names):
    f = RUNS[n][1] / MB
    ax.plot([f, f], [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.text(R[n][1] / MB + 4, y, f"{R[n][1] / MB:.0f} MB  ({R[n][1] / RUNS[n][1]:.2f}× formula)", va="center", fontsize=9)
ax.set_yticks(list(ys))
ax.set_yticklabels([RUNS[n][0] for n in names], fontsize=9)
ax.invert_yaxis()
ax.set_xlabel("peak bytes per rank (MB); black tick: the ZeRO formula for what the run holds")
ax.set_xlim(0, max(R[n][1] for n in names) / MB * 1.35)
ax.set_title(f"Peak memory per rank, 25.2M-parameter MLP, AdamW, 2 ranks (orange: PyTorch, blue: tch-dist)", fontsize=10)
fig.tight_layout()
fig.savefig(png, dpi=100)
print(f"\nchart: {png}")
