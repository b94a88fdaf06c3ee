//! Context parallelism: ring attention over 2 and 3 ranks equals attention over the whole sequence in one
//! process (ATen's `scaled_dot_product_attention`), outputs and the gradients of q, k and v within 1e-5,
//! causal and full, with and without head-tail load balancing; bad input is named on every rank.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use tch_dist::context_parallel::{ContextParallel, ContextParallelConfig, RingAttentionConfig};
use tch_dist::Error;

const T: Duration = Duration::from_secs(60);
/// float32; the blocks' sums are merged in another order than one softmax's (observed ~1e-7).
const TOL: f64 = 1e-5;
/// batch, heads, sequence (divisible by 2·2 and 2·3), head dim
const SHAPE: [i64; 4] = [2, 3, 24, 8];

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 1.5).view(shape)
}

fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// q, k, v and the loss's weights over the whole sequence.
fn inputs() -> [Tensor; 4] {
    [formula(&SHAPE, 1.0), formula(&SHAPE, 2.0), formula(&SHAPE, 3.0), formula(&SHAPE, 4.0)]
}

/// One process: the output and the gradients of q, k, v under `loss = sum(out * w)`.
fn reference(causal: bool) -> [Tensor; 4] {
    let [q, k, v, w] = inputs();
    let (q, k, v) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
    let out = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, causal, None, false);
    (&out * &w).sum(Kind::Float).backward();
    [out.detach(), q.grad(), k.grad(), v.grad()]
}

/// `written_out`: the blocks in matrix products (the path where no fused kernel is wired), not the CPU's
/// fused flash attention.
fn check(ranks: usize, causal: bool, load_balance: bool, written_out: bool) {
    let want = reference(causal);
    let got = common::run_threads(ranks, T, move |pg| {
        let cp = ContextParallel::new(Arc::new(pg), ContextParallelConfig { load_balance });
        let local: Vec<Tensor> = inputs().iter().map(|t| cp.shard(t, 2).unwrap()).collect();
        let [q, k, v, w] = &local[..] else { unreachable!() };
        let (q, k, v) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
        let run = || {
            let out = cp.attention(&q, &k, &v, RingAttentionConfig { causal, ..Default::default() }).unwrap();
            (&out * w).sum(Kind::Float).backward();
            out
        };
        let out = if written_out { tch_dist::reference::with_written_out_attention(run) } else { run() };
        [&out, &q.grad(), &k.grad(), &v.grad()].map(|t| cp.unshard(t, 2).unwrap())
    });
    for (r, g) in got.iter().enumerate() {
        for (name, (a, b)) in ["output", "q.grad", "k.grad", "v.grad"].iter().zip(g.iter().zip(&want)) {
            let d = diff(a, b);
            assert!(
                d < TOL,
                "{ranks} ranks, causal {causal}, balanced {load_balance}: rank {r}'s {name} is off by {d}"
            );
        }
    }
}

#[test]
fn ring_attention_equals_one_process_on_2_ranks() {
    for (causal, lb) in [(true, true), (true, false), (false, true)] {
        check(2, causal, lb, false);
        check(2, causal, lb, true);
    }
}

#[test]
fn ring_attention_equals_one_process_on_3_ranks() {
    for (causal, lb) in [(true, true), (true, false), (false, false)] {
        check(3, causal, lb, false);
    }
}

/// Queries whose head dimension is not packed (a transposed copy's view) and a loss that is the output's
/// plain sum (its gradient an expanded scalar): the fused kernel reads rows packed, so such queries take
/// the written-out blocks (fed to the kernel they gave outputs off by ~0.9).
#[test]
fn strided_queries_and_a_broadcast_output_gradient() {
    let want = {
        let [q, k, v, _] = inputs();
        let (q, k, v) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
        let out = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
        out.sum(Kind::Float).backward();
        [out.detach(), q.grad(), k.grad(), v.grad()]
    };
    let got = common::run_threads(2, T, move |pg| {
        let cp = ContextParallel::new(Arc::new(pg), ContextParallelConfig { load_balance: true });
        let local: Vec<Tensor> = inputs()[..3].iter().map(|t| cp.shard(t, 2).unwrap()).collect();
        let [q, k, v] = &local[..] else { unreachable!() };
        let (q, k, v) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
        // the same values, the head dimension strided
        let qs = q.transpose(-1, -2).contiguous().transpose(-1, -2);
        assert_ne!(qs.stride().last(), Some(&1));
        let out = cp.attention(&qs, &k, &v, RingAttentionConfig { causal: true, ..Default::default() }).unwrap();
        out.sum(Kind::Float).backward();
        [&out, &q.grad(), &k.grad(), &v.grad()].map(|t| cp.unshard(t, 2).unwrap())
    });
    for (r, g) in got.iter().enumerate() {
        for (name, (a, b)) in ["output", "q.grad", "k.grad", "v.grad"].iter().zip(g.iter().zip(&want)) {
            let d = diff(a, b);
            assert!(d < TOL, "rank {r}'s {name} is off by {d}");
        }
    }
}

/// On the CPU each step is one call of ATen's fused flash attention forward and one of its backward (its
/// chunks' pairs joined as PyTorch joins them): 2 ranks, head-tail causal, 2 steps.
#[test]
fn blocks_run_in_the_fused_kernel_on_the_cpu() {
    let counts = common::run_threads(2, T, move |pg| {
        let rank = pg.rank();
        let cp = ContextParallel::new(Arc::new(pg), ContextParallelConfig { load_balance: true });
        let local: Vec<Tensor> = inputs().iter().map(|t| cp.shard(t, 2).unwrap()).collect();
        let [q, k, v, w] = &local[..] else { unreachable!() };
        let (q, k, v) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
        let run = || {
            let out = cp.attention(&q, &k, &v, RingAttentionConfig { causal: true, ..Default::default() }).unwrap();
            (&out * w).sum(Kind::Float).backward();
        };
        // one counter at a time in the process: rank 0 counts, rank 1 runs alongside
        if rank == 0 {
            tch_dist::reference::count_ops(run).unwrap().1
        } else {
            run();
            Default::default()
        }
    });
    let ops = &counts[0];
    let n = |name: &str| ops.get(name).copied().unwrap_or(0);
    assert_eq!(n("aten::_scaled_dot_product_flash_attention_for_cpu"), 2, "{ops:?}");
    assert_eq!(n("aten::_scaled_dot_product_flash_attention_for_cpu_backward"), 2, "{ops:?}");
    assert_eq!(n("aten::matmul"), 0, "{ops:?}");
}

/// The scale given, and a sequence layout shared by the position embeddings.
#[test]
fn a_given_scale_and_the_positions_follow_the_layout() {
    let got = common::run_threads(2, T, |pg| {
        let cp = ContextParallel::new(Arc::new(pg), Default::default());
        let [q, k, v, _] = inputs();
        let cfg = RingAttentionConfig { causal: true, scale: Some(0.3) };
        let out = cp.attention(&cp.shard(&q, 2).unwrap(), &cp.shard(&k, 2).unwrap(), &cp.shard(&v, 2).unwrap(), cfg);
        (cp.unshard(&out.unwrap(), 2).unwrap(), cp.positions(8).unwrap())
    });
    let [q, k, v, _] = inputs();
    let want = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, Some(0.3), false);
    assert!(diff(&got[0].0, &want) < TOL, "scale 0.3: off by {}", diff(&got[0].0, &want));
    assert_eq!(got[0].1, vec![0, 1, 6, 7]);
    assert_eq!(got[1].1, vec![2, 3, 4, 5]);
}

/// Shapes that cannot be attended, and ranks whose sequences differ, are named on every rank; the group
/// works afterwards.
#[test]
fn bad_input_is_named_on_every_rank() {
    let errs = common::run_threads(2, T, |pg| {
        let pg = Arc::new(pg);
        let cp = ContextParallel::new(pg.clone(), Default::default());
        let x = formula(&[1, 2, 8, 4], 0.0);
        let cfg = RingAttentionConfig { causal: true, ..Default::default() };
        let three_d = cp.attention(&x.select(0, 0), &x.select(0, 0), &x.select(0, 0), cfg).unwrap_err();
        let odd = cp.attention(&x.narrow(2, 0, 3), &x.narrow(2, 0, 3), &x.narrow(2, 0, 3), cfg).unwrap_err();
        let seq = cp.shard(&x.narrow(2, 0, 6), 2).unwrap_err();
        // rank 1 passes 4 tokens where rank 0 passes 8
        let n = if pg.rank() == 0 { 8 } else { 4 };
        let y = x.narrow(2, 0, n);
        let uneven = cp.attention(&y, &y, &y, cfg).unwrap_err();
        // rank 1 alone passes a 3-d tensor: refused on both, not left waiting
        let z = if pg.rank() == 0 { x.shallow_clone() } else { x.select(0, 0) };
        let alone = cp.attention(&z, &z, &z, cfg).unwrap_err().to_string();
        assert!(alone.contains("rank 1: q [2, 8, 4]"), "rank {}: {alone}", pg.rank());
        let mut t = Tensor::ones([2], (Kind::Float, Device::Cpu));
        pg.allreduce(&mut t, tch_dist::ReduceOp::Sum).unwrap();
        assert_eq!(t.double_value(&[0]), 2.0);
        assert!(matches!(uneven, Error::Mismatch { .. }), "rank {}: {uneven:?}", pg.rank());
        [three_d, odd, seq, uneven].map(|e| e.to_string())
    });
    for (r, [three_d, odd, seq, uneven]) in errs.iter().enumerate() {
        assert!(three_d.contains("[batch, heads, seq, head_dim]"), "rank {r}: {three_d}");
        assert!(odd.contains("3 tokens do not split into its 2 chunks"), "rank {r}: {odd}");
        assert!(seq.contains("6 tokens, not divisible into 4 chunks"), "rank {r}: {seq}");
        assert!(
            uneven.contains("rank 0: q [1, 2, 8, 4]") && uneven.contains("rank 1: q [1, 2, 4, 4]"),
            "rank {r}: {uneven}"
        );
    }
}

/// Float64 inputs compute in float64; bfloat16 ones in float32 and come back as bfloat16.
#[test]
fn float64_and_bfloat16_inputs() {
    let got = common::run_threads(2, T, |pg| {
        let cp = ContextParallel::new(Arc::new(pg), Default::default());
        let cfg = RingAttentionConfig { causal: true, ..Default::default() };
        [Kind::Double, Kind::BFloat16].map(|kind| {
            let [q, k, v, _] = inputs().map(|t| cp.shard(&t.to_kind(kind), 2).unwrap().set_requires_grad(true));
            let out = cp.attention(&q, &k, &v, cfg).unwrap();
            out.sum(Kind::Float).backward();
            (out.kind(), cp.unshard(&out, 2).unwrap(), cp.unshard(&q.grad(), 2).unwrap())
        })
    });
    let [q, k, v, _] = inputs().map(|t| t.to_kind(Kind::Double).set_requires_grad(true));
    let want = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
    want.sum(Kind::Double).backward();
    let [(k64, o64, g64), (k16, o16, g16)] = &got[0];
    assert_eq!((*k64, *k16), (Kind::Double, Kind::BFloat16));
    let d = |a: &Tensor, b: &Tensor| diff(&a.to_kind(Kind::Double), b);
    assert!(d(o64, &want) < 1e-12 && d(g64, &q.grad()) < 1e-12, "float64: {} {}", d(o64, &want), d(g64, &q.grad()));
    // bfloat16 inputs keep 8 bits of mantissa: against float64 attention over the unrounded inputs
    assert!(d(o16, &want) < 5e-2 && d(g16, &q.grad()) < 5e-2, "bfloat16: {} {}", d(o16, &want), d(g16, &q.grad()));
}
