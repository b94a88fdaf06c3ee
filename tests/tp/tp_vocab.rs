//! Vocabulary parallelism on 2 and 3 TP ranks against the unsharded layers: the embedding's output and
//! its re-assembled weight gradient; the cross-entropy's per-token loss (against libtorch's own
//! cross_entropy on the full logits) and the re-assembled logits' gradient; an embedding → tied LM
//! head → loss chain; bad shapes and targets refused by name.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Reduction, Tensor};
use tch_dist::tp::{vocab_parallel_cross_entropy, VocabParallelEmbedding};

const T: Duration = Duration::from_secs(60);
const TOL: f64 = 1e-5;
const V: i64 = 12; // divisible by 2 and 3
const D: i64 = 5;

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 1.5).view(shape)
}

/// Ids that visit every rank's slice, [3, 7].
fn ids() -> Tensor {
    (Tensor::arange(21, (Kind::Int64, Device::Cpu)) * 5 + 3).remainder(V).view([3, 7])
}

fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn embedding_and_cross_entropy_equal_the_unsharded_ones() {
    let weight = formula(&[V, D], 1.0);
    let proj = formula(&[3, 7, D], 2.0);
    let logits_full = formula(&[3, 7, V], 3.0);
    // unsharded: embedding, a loss through it; cross-entropy of the full logits (libtorch's own)
    let (want_out, want_wgrad) = {
        let w = weight.copy().set_requires_grad(true);
        let out = Tensor::embedding(&w, &ids(), -1, false, false);
        (&out * &proj).sum(Kind::Float).backward();
        (out.detach(), w.grad())
    };
    let (want_ce, want_zgrad) = {
        let z = logits_full.copy().set_requires_grad(true);
        let ce = z.view([-1, V]).cross_entropy_loss::<Tensor>(&ids().view([-1]), None, Reduction::None, -100, 0.0);
        ce.mean(Kind::Float).backward();
        (ce.detach().view([3, 7]), z.grad())
    };
    for world in [2usize, 3] {
        let res = common::run_threads(world, T, move |pg| {
            let (w, lf, p) = (formula(&[V, D], 1.0), formula(&[3, 7, V], 3.0), formula(&[3, 7, D], 2.0));
            let pg = Arc::new(pg);
            let vs = nn::VarStore::new(Device::Cpu);
            let emb = VocabParallelEmbedding::from_full(&vs.root(), &w, pg.clone()).unwrap();
            let out = emb.f_forward(&ids()).unwrap();
            (&out * &p).sum(Kind::Float).backward();
            let per = V / pg.size() as i64;
            let z = lf.narrow(-1, pg.rank() as i64 * per, per).copy().set_requires_grad(true);
            let ce = vocab_parallel_cross_entropy(&z, &ids(), &pg).unwrap();
            ce.mean(Kind::Float).backward();
            (out.detach(), emb.ws.grad(), ce.detach(), z.grad(), emb.vocab_range())
        });
        let wgrad = Tensor::cat(&res.iter().map(|r| &r.1).collect::<Vec<_>>(), 0);
        let zgrad = Tensor::cat(&res.iter().map(|r| &r.3).collect::<Vec<_>>(), -1);
        for (rank, (out, _, ce, _, range)) in res.iter().enumerate() {
            let per = V / world as i64;
            assert_eq!(*range, (rank as i64 * per, (rank as i64 + 1) * per));
            assert!(diff(out, &want_out) < TOL, "{world} ranks: rank {rank}'s embedding");
            assert!(diff(ce, &want_ce) < TOL, "{world} ranks: rank {rank}'s loss {ce} vs {want_ce}");
        }
        assert!(diff(&wgrad, &want_wgrad) < TOL, "{world} ranks: the embedding's gradient");
        assert!(diff(&zgrad, &want_zgrad) < TOL, "{world} ranks: the logits' gradient");
        assert!(want_zgrad.abs().max().double_value(&[]) > 1e-3, "the gradient is not trivially zero");
    }
}

#[test]
fn tied_embedding_and_lm_head_train_like_the_full_model() {
    // h = embed(ids) · tanh; logits = h Wᵀ with the embedding's own table (tied), loss = CE(logits, next)
    let weight = formula(&[V, D], 1.0);
    let next = || (ids() + 1).remainder(V);
    let want = {
        let w = weight.copy().set_requires_grad(true);
        let h = Tensor::embedding(&w, &ids(), -1, false, false).tanh();
        let logits = h.matmul(&w.tr());
        let l = logits.view([-1, V]).cross_entropy_for_logits(&next().view([-1]));
        l.backward();
        (l.double_value(&[]), w.grad())
    };
    let res = common::run_threads(3, T, move |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let emb = VocabParallelEmbedding::from_full(&vs.root(), &formula(&[V, D], 1.0), pg.clone()).unwrap();
        let h = emb.f_forward(&ids()).unwrap().tanh();
        // the LM head: this rank's vocabulary slice of the logits; its input enters the parallel region
        let h = tch_dist::tp::ops::copy_to_parallel_region(&h, &pg).unwrap();
        let logits = h.matmul(&emb.ws.tr());
        let l = vocab_parallel_cross_entropy(&logits, &next(), &pg).unwrap().mean(Kind::Float);
        l.backward();
        (l.double_value(&[]), emb.ws.grad())
    });
    let grad = Tensor::cat(&res.iter().map(|r| &r.1).collect::<Vec<_>>(), 0);
    for (rank, (l, _)) in res.iter().enumerate() {
        assert!((l - want.0).abs() < TOL, "rank {rank}: loss {l} vs {}", want.0);
    }
    assert!(diff(&grad, &want.1) < TOL, "the tied table's gradient (embedding and head paths)");
}

#[test]
fn bad_shapes_and_targets_are_refused_by_name() {
    let errs = common::run_threads(2, T, |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let odd = VocabParallelEmbedding::from_full(&vs.root(), &formula(&[7, D], 0.0), pg.clone()).unwrap_err();
        let z = formula(&[3, 7, V / 2], 0.0);
        let shape = vocab_parallel_cross_entropy(&z, &ids().view([-1]), &pg).unwrap_err();
        let range = vocab_parallel_cross_entropy(&z, &(ids() + V), &pg).unwrap_err();
        (odd.to_string(), shape.to_string(), range.to_string())
    });
    for (odd, shape, range) in errs {
        assert!(odd.contains("vocabulary (7) is not divisible by the tensor-parallel size 2"), "{odd}");
        assert!(shape.contains("targets [21] do not match logits [3, 7, 6]"), "{shape}");
        assert!(range.contains("targets must be in [0, 12)"), "{range}");
    }
}
