//! Sequence parallelism (Megatron's) on 2 and 3 TP ranks: a pre-LayerNorm MLP block with a residual,
//! its LayerNorm and residual on each rank's part of the sequence, the MLP's linears entering and leaving
//! by all-gather and reduce-scatter along the sequence. Output, input gradient and every re-assembled
//! gradient equal the unsharded block's within 1e-5 of their magnitude (LayerNorm's and the bias's after
//! `allreduce_sequence_parallel_grads`).
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::tp::ops::allreduce_sequence_parallel_grads;
use tch_dist::tp::{ColumnParallelConfig, ColumnParallelLinear, RowParallelConfig, RowParallelLinear};

const T: Duration = Duration::from_secs(60);
const TOL: f64 = 1e-5;
const S: i64 = 6; // the sequence, divisible by 2 and 3
const B: i64 = 2;
const D: i64 = 4;
const H: i64 = 12;

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.7).view(shape)
}

/// LayerNorm weight, bias; fc1 weight, bias; fc2 weight, bias.
fn weights() -> Vec<Tensor> {
    vec![
        formula(&[D], 1.0) + 1.0,
        formula(&[D], 2.0),
        formula(&[H, D], 3.0),
        formula(&[H], 4.0),
        formula(&[D, H], 5.0),
        formula(&[D], 6.0),
    ]
}

fn block(x: &Tensor, w: &[Tensor]) -> Tensor {
    let h = x.layer_norm([D], Some(&w[0]), Some(&w[1]), 1e-5, false);
    x + h.linear(&w[2], Some(&w[3])).gelu("none").linear(&w[4], Some(&w[5]))
}

/// The largest difference relative to the largest magnitude (at least 1): the input gradient is well
/// above 1 here, and float32 sums taken in another order differ in its last digits (seen: 1.4e-5 absolute).
fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1.0)
}

#[test]
fn sequence_parallel_block_equals_the_full_block() {
    let proj = formula(&[S, B, D], 7.0);
    let want = {
        let w: Vec<Tensor> = weights().into_iter().map(|t| t.set_requires_grad(true)).collect();
        let x = formula(&[S, B, D], 8.0).set_requires_grad(true);
        let y = block(&x, &w);
        (&y * &proj).sum(Kind::Float).backward();
        (y.detach(), x.grad(), w.iter().map(|t| t.grad()).collect::<Vec<_>>())
    };
    for world in [2usize, 3] {
        let res = common::run_threads(world, T, move |pg| {
            let (rank, t) = (pg.rank() as i64, pg.size() as i64);
            let pg = Arc::new(pg);
            let vs = nn::VarStore::new(Device::Cpu);
            let w = weights();
            let ln_w = vs.root().var_copy("ln_weight", &w[0]);
            let ln_b = vs.root().var_copy("ln_bias", &w[1]);
            let col = ColumnParallelConfig { sequence_parallel: true, ..Default::default() };
            let row = RowParallelConfig { sequence_parallel: true, ..Default::default() };
            let fc1 =
                ColumnParallelLinear::from_full(&(vs.root() / "fc1"), &w[2], Some(&w[3]), pg.clone(), col).unwrap();
            let fc2 = RowParallelLinear::from_full(&(vs.root() / "fc2"), &w[4], Some(&w[5]), pg.clone(), row).unwrap();
            // this rank's part of the sequence
            let x = formula(&[S, B, D], 8.0).narrow(0, rank * S / t, S / t).copy().set_requires_grad(true);
            let h = x.layer_norm([D], Some(&ln_w), Some(&ln_b), 1e-5, false);
            let y = &x + fc2.f_forward(&fc1.f_forward(&h).unwrap().gelu("none")).unwrap();
            assert_eq!(y.size(), [S / t, B, D], "the block's output stays split along the sequence");
            (&y * formula(&[S, B, D], 7.0).narrow(0, rank * S / t, S / t)).sum(Kind::Float).backward();
            let replicated = [ln_w.shallow_clone(), ln_b.shallow_clone(), fc2.bs.as_ref().unwrap().shallow_clone()];
            allreduce_sequence_parallel_grads(&replicated, &pg).unwrap();
            let g = |t: &Tensor| t.grad();
            let grads = vec![
                g(&ln_w),
                g(&ln_b),
                g(&fc1.ws),
                g(fc1.bs.as_ref().unwrap()),
                g(&fc2.ws),
                g(fc2.bs.as_ref().unwrap()),
            ];
            (y.detach(), x.grad(), grads)
        });
        let cat = |i: usize, dim: i64| Tensor::cat(&res.iter().map(|r| &r.2[i]).collect::<Vec<_>>(), dim);
        let what = format!("{world} ranks");
        let y = Tensor::cat(&res.iter().map(|r| &r.0).collect::<Vec<_>>(), 0);
        let xg = Tensor::cat(&res.iter().map(|r| &r.1).collect::<Vec<_>>(), 0);
        assert!(diff(&y, &want.0) < TOL, "{what}: output");
        assert!(diff(&xg, &want.1) < TOL, "{what}: input gradient");
        assert!(diff(&cat(2, 0), &want.2[2]) < TOL, "{what}: fc1 weight gradient");
        assert!(diff(&cat(3, 0), &want.2[3]) < TOL, "{what}: fc1 bias gradient");
        assert!(diff(&cat(4, 1), &want.2[4]) < TOL, "{what}: fc2 weight gradient");
        for (r, x) in res.iter().enumerate() {
            for (i, name) in [(0, "LayerNorm weight"), (1, "LayerNorm bias"), (5, "fc2 bias")] {
                assert!(diff(&x.2[i], &want.2[i]) < TOL, "{what}: rank {r}'s {name} gradient");
            }
        }
    }
}

/// The replicated parameters' gradients are summed in one allreduce per dtype (flattened and copied
/// back), not one per parameter: three float32 gradients and one float64 take two.
#[test]
fn sequence_parallel_gradients_take_one_allreduce_per_dtype() {
    let outs = common::run_threads(2, T, |world| {
        let name = "sp-grads";
        let pg = world.new_subgroup(&[0, 1], name).unwrap().unwrap();
        let r = pg.rank() as f64 + 1.0;
        let shapes =
            [(vec![3], Kind::Float), (vec![2, 2], Kind::Float), (vec![2, 3], Kind::Float), (vec![5], Kind::Double)];
        let params: Vec<Tensor> = shapes
            .into_iter()
            .map(|(shape, kind)| Tensor::zeros(shape.as_slice(), (kind, Device::Cpu)).set_requires_grad(true))
            .collect();
        for (i, p) in params.iter().enumerate() {
            // gradient r (i + 1) everywhere
            (p * (r * (i as f64 + 1.0))).sum(p.kind()).backward();
        }
        let after = tch_dist::flight::entries().last().map_or(0, |e| e.id);
        allreduce_sequence_parallel_grads(&params, &pg).unwrap();
        let mine = tch_dist::flight::entries()
            .iter()
            .filter(|e| e.id > after && e.group.contains(name) && e.group_rank == pg.rank())
            .filter(|e| e.op.starts_with("allreduce"))
            .count();
        // the recorder keeps its last entries only: other tests' may have pushed these out
        let kept = tch_dist::flight::entries().first().is_none_or(|e| e.id <= after + 1);
        let sums: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
        (kept, mine, sums)
    });
    for (rank, (kept, n, sums)) in outs.iter().enumerate() {
        // rank 0 gave i + 1, rank 1 2 (i + 1): the sum is 3 (i + 1) in every element
        for (i, s) in sums.iter().enumerate() {
            let want = s.ones_like() * (3.0 * (i as f64 + 1.0));
            assert!(diff(s, &want) < 1e-12, "rank {rank}: gradient {i} is {s}");
        }
        if *kept {
            assert_eq!(*n, 2, "rank {rank}: one allreduce per dtype");
        }
    }
}

/// A gather is one all_gather into one buffer: along the sequence (dimension 0) the buffer is the result,
/// with no copy of ours and no cat; along the last dimension one reshape moves the parts into place. The
/// values are the cat of the ranks' parts. (The same gather is the backward of the scatters, whose
/// gradients the block tests above check.)
#[test]
fn gathers_copy_at_most_once() {
    use tch_dist::tp::ops::{gather_from_parallel_region, gather_from_sequence_parallel_region};
    let out = common::run_threads(3, T, |pg| {
        let r = pg.rank() as f64;
        let x = formula(&[2, B, D], 1.0 + r);
        let parts: Vec<Tensor> = (0..3).map(|k| formula(&[2, B, D], 1.0 + k as f64)).collect();
        // one counter at a time in the process: rank 0 counts, the others run alongside
        let count = |f: &dyn Fn() -> Tensor| {
            if pg.rank() == 0 {
                tch_dist::reference::count_ops(f).unwrap()
            } else {
                (f(), Default::default())
            }
        };
        let (seq, seq_ops) = count(&|| gather_from_sequence_parallel_region(&x, &pg).unwrap());
        let (last, last_ops) = count(&|| gather_from_parallel_region(&x, &pg).unwrap());
        let d = diff(&seq, &Tensor::cat(&parts, 0)).max(diff(&last, &Tensor::cat(&parts, -1)));
        (d, seq_ops, last_ops)
    });
    for (rank, (d, _, _)) in out.iter().enumerate() {
        assert!(*d < TOL, "rank {rank}: a gather differs from the cat of the parts by {d:e}");
    }
    let (_, seq_ops, last_ops) = &out[0];
    let n = |ops: &std::collections::BTreeMap<String, i64>, k: &str| ops.get(k).copied().unwrap_or(0);
    // ours, not the engine's: Gloo's all_gather_into_tensor copies each rank's part into the buffer on
    // this thread (aten::copy_, one a rank), where NCCL receives into it
    assert!(n(seq_ops, "aten::empty") > 0, "nothing counted: {seq_ops:?}");
    for k in ["aten::cat", "aten::reshape", "aten::clone", "aten::contiguous", "aten::empty_like"] {
        assert_eq!(n(seq_ops, k), 0, "the sequence gather calls {k}: {seq_ops:?}");
    }
    assert_eq!(n(last_ops, "aten::cat") + n(last_ops, "aten::empty_like"), 0, "{last_ops:?}");
    assert_eq!(n(last_ops, "aten::reshape"), 1, "the last dimension's gather moves the parts once: {last_ops:?}");
}
