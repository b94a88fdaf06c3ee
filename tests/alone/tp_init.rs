//! Tensor-parallel layers created by `new` hold, on every rank, the slice of what tch's own layer draws
//! after the same seed, and leave the global generator where tch's layer leaves it: a model of any
//! tensor-parallel size starts from the one-process model's values. (In tests/alone/: the global
//! generator is shared by the process's threads, so tests run one at a time and each rank draws under one
//! lock.)
use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::tp::{ColumnParallelLinear, ParallelAttention, ParallelMlp, RowParallelLinear, VocabParallelEmbedding};

static GENERATOR: Mutex<()> = Mutex::new(());

/// `[out, in]` linear layers and `[vocab, d]` embeddings: small, odd (a normal draw's count not a
/// multiple of 16) and large (drawn in several blocks).
const LINEARS: [(i64, i64); 3] = [(8, 12), (12, 20), (520, 264)];
const TABLES: [(i64, i64); 3] = [(12, 5), (16, 4), (1024, 130)];
/// The attention's width and heads (divisible by 1, 2 and 4 ranks); its QKV weight, 480 x 160, is drawn
/// in two blocks, and some ranks' rows of one third cross from one to the other.
const ATTN: (i64, i64) = (160, 4);

/// What tch draws: every layer in turn after `manual_seed(3)`, then four more numbers.
fn tch_draws() -> (Vec<Tensor>, Tensor) {
    let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut out = Vec::new();
    for (i, (o, n)) in LINEARS.iter().enumerate() {
        let l = nn::linear(vs.root() / format!("c{i}"), *n, *o, Default::default());
        out.extend([l.ws, l.bs.unwrap()]);
        let l = nn::linear(vs.root() / format!("r{i}"), *n, *o, Default::default());
        out.extend([l.ws, l.bs.unwrap()]);
    }
    for (i, (v, d)) in TABLES.iter().enumerate() {
        out.push(nn::embedding(vs.root() / format!("e{i}"), *v, *d, Default::default()).ws);
    }
    let mlp_fc1 = nn::linear(vs.root() / "mlp" / "fc1", 8, 16, Default::default());
    let mlp_fc2 = nn::linear(vs.root() / "mlp" / "fc2", 16, 8, Default::default());
    out.extend([mlp_fc1.ws, mlp_fc1.bs.unwrap(), mlp_fc2.ws, mlp_fc2.bs.unwrap()]);
    let d = ATTN.0;
    let qkv = nn::linear(vs.root() / "attn" / "qkv", d, 3 * d, Default::default());
    let o = nn::linear(vs.root() / "attn" / "out", d, d, Default::default());
    out.extend([qkv.ws, qkv.bs.unwrap(), o.ws, o.bs.unwrap()]);
    (out, Tensor::rand([4], (Kind::Float, Device::Cpu)))
}

#[test]
fn every_rank_holds_its_slice_of_tch_s_layers_and_the_generator_moves_as_tch_s() {
    let _alone = common::alone();
    let (want, after) = tch_draws();
    for t in [1usize, 2, 4] {
        let got = common::run_threads(t, Duration::from_secs(60), |pg| {
            let pg = Arc::new(pg);
            let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
            tch::manual_seed(3);
            let vs = nn::VarStore::new(Device::Cpu);
            let mut out = Vec::new();
            for (i, (o, n)) in LINEARS.iter().enumerate() {
                let c =
                    ColumnParallelLinear::new(&(vs.root() / format!("c{i}")), *n, *o, pg.clone(), Default::default())
                        .unwrap();
                out.extend([c.ws, c.bs.unwrap()]);
                let r = RowParallelLinear::new(&(vs.root() / format!("r{i}")), *n, *o, pg.clone(), Default::default())
                    .unwrap();
                out.extend([r.ws, r.bs.unwrap()]);
            }
            for (i, (v, d)) in TABLES.iter().enumerate() {
                let e =
                    VocabParallelEmbedding::new(&(vs.root() / format!("e{i}")), *v, *d, pg.clone(), Default::default());
                out.push(e.unwrap().ws);
            }
            let m = ParallelMlp::new(&(vs.root() / "mlp"), 8, 16, pg.clone()).unwrap();
            out.extend([m.fc1.ws, m.fc1.bs.unwrap(), m.fc2.ws, m.fc2.bs.unwrap()]);
            let a = ParallelAttention::new(&(vs.root() / "attn"), ATTN.0, ATTN.1, pg.clone(), Default::default());
            let a = a.unwrap();
            out.extend([a.qkv.ws, a.qkv.bs.unwrap(), a.out.ws, a.out.bs.unwrap()]);
            (pg.rank(), out, Tensor::rand([4], (Kind::Float, Device::Cpu)))
        });
        for (rank, tensors, rest) in got {
            let r = rank as i64;
            // column: rows; row: columns of the weight, the whole bias; embedding: rows
            let mut expect = Vec::new();
            let mut k = 0;
            let slice = |x: &Tensor, dim: i64| {
                let n = x.size()[dim as usize] / t as i64;
                x.narrow(dim, r * n, n)
            };
            for _ in LINEARS {
                expect.extend([slice(&want[k], 0), slice(&want[k + 1], 0), slice(&want[k + 2], 1), want[k + 3].copy()]);
                k += 4;
            }
            for _ in TABLES {
                expect.push(slice(&want[k], 0));
                k += 1;
            }
            expect.extend([slice(&want[k], 0), slice(&want[k + 1], 0), slice(&want[k + 2], 1), want[k + 3].copy()]);
            k += 4;
            // attention: this rank's heads of the queries, keys and values (a slice of each third)
            let heads = |x: &Tensor| Tensor::cat(&x.chunk(3, 0).iter().map(|p| slice(p, 0)).collect::<Vec<_>>(), 0);
            expect.extend([heads(&want[k]), heads(&want[k + 1]), slice(&want[k + 2], 1), want[k + 3].copy()]);
            assert_eq!(tensors.len(), expect.len());
            for (i, (g, w)) in tensors.iter().zip(&expect).enumerate() {
                assert_eq!(g.size(), w.size(), "t {t} rank {rank} tensor {i}");
                assert!(g.equal(w), "t {t} rank {rank} tensor {i} differs from tch's slice");
            }
            assert!(rest.equal(&after), "t {t} rank {rank}: the generator is not where tch's layers leave it");
        }
    }
}

#[test]
fn a_size_not_divisible_by_the_group_is_named() {
    let _alone = common::alone();
    let errs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let pg = Arc::new(pg);
        let c =
            ColumnParallelLinear::new(&(vs.root() / "h" / 0 / "fc"), 4, 7, pg.clone(), Default::default()).unwrap_err();
        let r =
            RowParallelLinear::new(&(vs.root() / "h" / 0 / "proj"), 5, 4, pg.clone(), Default::default()).unwrap_err();
        let e = VocabParallelEmbedding::new(&vs.root(), 9, 4, pg, Default::default()).unwrap_err();
        (c.to_string(), r.to_string(), e.to_string())
    });
    let (c, r, e) = &errs[0];
    // the layer is named by its path
    assert!(c.contains("out_dim 7") && c.contains("ColumnParallelLinear h.0.fc"), "{c}");
    assert!(r.contains("in_dim 5") && r.contains("RowParallelLinear h.0.proj"), "{r}");
    assert!(e.contains("vocabulary (9)"), "{e}");
}
