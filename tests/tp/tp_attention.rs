//! Head-parallel attention on 2 and 3 TP ranks against the unsharded layer (causal and not): the output,
//! the input gradient and every re-assembled weight gradient within 1e-5; bad head counts refused.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::tp::{ParallelAttention, ParallelAttentionConfig};

const T: Duration = Duration::from_secs(60);
const TOL: f64 = 1e-5;
const D: i64 = 12;
const HEADS: i64 = 6; // divisible by 2 and 3

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.5).view(shape)
}

fn weights() -> [Tensor; 4] {
    [formula(&[3 * D, D], 1.0), formula(&[3 * D], 2.0), formula(&[D, D], 3.0), formula(&[D], 4.0)]
}

fn input() -> Tensor {
    formula(&[2, 5, D], 5.0)
}

/// The unsharded layer, written out: all heads at once.
fn full(x: &Tensor, w: &[Tensor], causal: bool) -> Tensor {
    let (b, s) = (x.size()[0], x.size()[1]);
    let hd = D / HEADS;
    let qkv = x.linear(&w[0], Some(&w[1])).view([b, s, 3, HEADS, hd]).permute([2, 0, 3, 1, 4]);
    let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
    let mut scores = q.matmul(&k.transpose(-2, -1)) / (hd as f64).sqrt();
    if causal {
        scores = scores.masked_fill(&Tensor::ones([s, s], (Kind::Bool, Device::Cpu)).triu(1), f64::NEG_INFINITY);
    }
    let ctx = scores.softmax(-1, Kind::Float).matmul(&v).transpose(1, 2).contiguous().view([b, s, D]);
    ctx.linear(&w[2], Some(&w[3]))
}

fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn head_parallel_attention_equals_the_full_layer() {
    for causal in [true, false] {
        let proj = formula(&[2, 5, D], 6.0);
        let want = {
            let w: Vec<Tensor> = weights().iter().map(|t| t.copy().set_requires_grad(true)).collect();
            let x = input().set_requires_grad(true);
            let y = full(&x, &w, causal);
            (&y * &proj).sum(Kind::Float).backward();
            (y.detach(), x.grad(), w.iter().map(|t| t.grad()).collect::<Vec<_>>())
        };
        for world in [2usize, 3] {
            let res = common::run_threads(world, T, move |pg| {
                let vs = nn::VarStore::new(Device::Cpu);
                let w = weights();
                let cfg = ParallelAttentionConfig { causal, ..Default::default() };
                let a = ParallelAttention::from_full(&vs.root(), &w[0], &w[1], &w[2], &w[3], HEADS, Arc::new(pg), cfg)
                    .unwrap();
                let x = input().set_requires_grad(true);
                let y = a.f_forward(&x).unwrap();
                (&y * formula(&[2, 5, D], 6.0)).sum(Kind::Float).backward();
                let g = |t: &Tensor| t.grad();
                let b = a.out.bs.as_ref().unwrap();
                (y.detach(), x.grad(), [g(&a.qkv.ws), g(a.qkv.bs.as_ref().unwrap()), g(&a.out.ws), g(b)])
            });
            let what = format!("{world} ranks, causal {causal}");
            for (r, (y, xg, _)) in res.iter().enumerate() {
                assert!(diff(y, &want.0) < TOL, "{what}: rank {r}'s output");
                assert!(diff(xg, &want.1) < TOL, "{what}: rank {r}'s input gradient");
            }
            // undo the by-rank order of the QKV rows: [t, 3, d/t, ...] → [3, t, d/t, ...]
            let t = world as i64;
            let qkv_w = Tensor::cat(&res.iter().map(|r| &r.2[0]).collect::<Vec<_>>(), 0)
                .view([t, 3, D / t, D])
                .transpose(0, 1)
                .reshape([3 * D, D]);
            let qkv_b = Tensor::cat(&res.iter().map(|r| &r.2[1]).collect::<Vec<_>>(), 0)
                .view([t, 3, D / t])
                .transpose(0, 1)
                .reshape([3 * D]);
            let out_w = Tensor::cat(&res.iter().map(|r| &r.2[2]).collect::<Vec<_>>(), 1);
            assert!(diff(&qkv_w, &want.2[0]) < TOL, "{what}: QKV weight gradient");
            assert!(diff(&qkv_b, &want.2[1]) < TOL, "{what}: QKV bias gradient");
            assert!(diff(&out_w, &want.2[2]) < TOL, "{what}: output weight gradient");
            for (r, x) in res.iter().enumerate() {
                assert!(diff(&x.2[3], &want.2[3]) < TOL, "{what}: rank {r}'s output bias gradient");
            }
            assert!(want.2[0].abs().max().double_value(&[]) > 1e-3, "gradients are not trivially zero");
        }
    }
}

#[test]
fn head_counts_that_do_not_divide_are_refused() {
    let errs = common::run_threads(2, T, |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let w = weights();
        let causal = ParallelAttentionConfig { causal: true, ..Default::default() };
        let make =
            |heads| ParallelAttention::from_full(&vs.root(), &w[0], &w[1], &w[2], &w[3], heads, pg.clone(), causal);
        (make(5).unwrap_err().to_string(), make(3).unwrap_err().to_string())
    });
    for (d, t) in errs {
        assert!(d.contains("d_model 12 is not divisible by 5 heads"), "{d}");
        assert!(t.contains("3 heads are not divisible by the tensor-parallel size 2"), "{t}");
    }
}

/// Attention dropout follows the train flag: without it (and with dropout 0) the layer gives the
/// undropped output; in training with dropout it does not, and with dropout 1 every attention weight is
/// dropped, leaving the output projection's bias alone.
#[test]
fn attention_dropout_follows_the_train_flag() {
    let outs = common::run_threads(2, T, |pg| {
        let pg = Arc::new(pg);
        let w = weights();
        let x = input();
        let layer = |dropout: f64| {
            let vs = nn::VarStore::new(Device::Cpu);
            let cfg = ParallelAttentionConfig { causal: true, dropout, ..Default::default() };
            ParallelAttention::from_full(&vs.root(), &w[0], &w[1], &w[2], &w[3], HEADS, pg.clone(), cfg).unwrap()
        };
        let plain = layer(0.0).f_forward_t(&x, true).unwrap();
        let half = layer(0.5);
        let all = layer(1.0).f_forward_t(&x, true).unwrap();
        (plain, x.apply_t(&half, false), half.f_forward_t(&x, true).unwrap(), all)
    });
    let want = full(&input(), &weights(), true);
    let bias = weights()[3].view([1, 1, D]).expand([2, 5, D], false);
    for (r, (plain, eval, train, all)) in outs.iter().enumerate() {
        assert!(diff(plain, &want) < TOL, "rank {r}: dropout 0 in training changed the output");
        assert!(diff(eval, &want) < TOL, "rank {r}: dropout ran outside training");
        assert!(diff(train, &want) > 1e-3, "rank {r}: dropout 0.5 in training changed nothing");
        assert!(diff(all, &bias) < TOL, "rank {r}: dropout 1 left attention weights");
    }
}
