//! SyncBatchNorm on 2 and 3 ranks (threads), with a different batch on each rank and an empty one:
//! outputs, input gradients, the weight's and bias's gradients summed over the ranks, and the running
//! statistics equal tch's (libtorch's) BatchNorm over the concatenated batch, in 1-d, 2-d and 3-d.
//! Evaluation runs no collective; bad input is named.
use crate::common;
use common::bn::{batch, set_affine, C};

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::ModuleT, Device, Kind, Tensor};
use tch_dist::sync_batch_norm::SyncBatchNorm;

const TOL: f64 = 1e-5;

struct Out {
    y: Tensor,
    gx: Tensor,
    gw: Tensor,
    gb: Tensor,
    rm: Tensor,
    rv: Tensor,
}

impl Out {
    /// What a backward from `y` left: the input's gradient, the weight's and bias's, the statistics.
    fn after(y: &Tensor, x: &Tensor, affine: [&Option<Tensor>; 2], running: [&Tensor; 2]) -> Out {
        let grad = |t: &Option<Tensor>| t.as_ref().unwrap().grad();
        Out {
            y: y.detach(),
            gx: x.grad(),
            gw: grad(affine[0]),
            gb: grad(affine[1]),
            rm: running[0].copy(),
            rv: running[1].copy(),
        }
    }
}

fn spatial(nd: usize) -> &'static [i64] {
    [&[][..], &[4][..], &[3, 2][..], &[2, 2, 2][..]][nd]
}

/// Two training steps (the running statistics move twice), gradients from the second.
fn sync_run(sizes: &'static [i64], nd: usize) -> Vec<Out> {
    common::run_threads(sizes.len(), Duration::from_secs(60), move |pg| {
        let r = pg.rank();
        steps(Arc::new(pg), r, sizes[r], nd)
    })
}

/// World rank `r`'s two steps with a layer over `pg`, on `n` rows.
fn steps(pg: Arc<tch_dist::ProcessGroup>, r: usize, n: i64, nd: usize) -> Out {
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = SyncBatchNorm::new(vs.root() / "bn", nd.max(1), C, Default::default(), pg);
    set_affine(&bn.ws, &bn.bs);
    let (x0, _) = batch(r + 10, n, spatial(nd));
    let _ = bn.f_forward_t(&x0, true).unwrap();
    let (x, t) = batch(r, n, spatial(nd));
    let x = x.set_requires_grad(true);
    let y = bn.f_forward_t(&x, true).unwrap();
    (&y * &t).sum(Kind::Float).backward();
    Out::after(&y, &x, [&bn.ws, &bn.bs], [&bn.running_mean, &bn.running_var])
}

/// tch's BatchNorm, one process, over the ranks' batches concatenated.
fn reference(sizes: &[i64], nd: usize) -> Out {
    reference_from(0, sizes, nd)
}

/// The same over the batches of world ranks `first..` (of `sizes` rows).
fn reference_from(first: usize, sizes: &[i64], nd: usize) -> Out {
    let spatial = spatial(nd);
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = match nd {
        0 | 1 => nn::batch_norm1d(vs.root() / "bn", C, Default::default()),
        2 => nn::batch_norm2d(vs.root() / "bn", C, Default::default()),
        _ => nn::batch_norm3d(vs.root() / "bn", C, Default::default()),
    };
    set_affine(&bn.ws, &bn.bs);
    let cat = |k: usize| {
        let parts: Vec<(Tensor, Tensor)> =
            sizes.iter().enumerate().map(|(r, &n)| batch(first + r + k, n, spatial)).collect();
        let xs: Vec<&Tensor> = parts.iter().map(|p| &p.0).collect();
        let ts: Vec<&Tensor> = parts.iter().map(|p| &p.1).collect();
        (Tensor::cat(&xs, 0), Tensor::cat(&ts, 0))
    };
    let _ = bn.forward_t(&cat(10).0, true);
    let (x, t) = cat(0);
    let x = x.set_requires_grad(true);
    let y = bn.forward_t(&x, true);
    (&y * &t).sum(Kind::Float).backward();
    Out::after(&y, &x, [&bn.ws, &bn.bs], [&bn.running_mean, &bn.running_var])
}

fn close(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let d = if a.numel() == 0 { 0.0 } else { (a - b).abs().max().double_value(&[]) };
    assert!(d < TOL, "{what}: differs from one process by {d:e}");
}

fn check(sizes: &'static [i64], nd: usize) {
    let want = reference(sizes, nd);
    let got = sync_run(sizes, nd);
    let mut at = 0;
    for (r, o) in got.iter().enumerate() {
        let n = sizes[r];
        let what = |q: &str| format!("{nd}-d, batches {sizes:?}, rank {r}: {q}");
        close(&what("output"), &o.y, &want.y.narrow(0, at, n));
        close(&what("input gradient"), &o.gx, &want.gx.narrow(0, at, n));
        close(&what("running mean"), &o.rm, &want.rm);
        close(&what("running variance"), &o.rv, &want.rv);
        at += n;
    }
    // the weight's and bias's gradients are each rank's part: their sum is one process's
    let defined =
        |t: &Tensor| if t.defined() { t.shallow_clone() } else { Tensor::zeros([C], (Kind::Float, Device::Cpu)) };
    let gw = got.iter().map(|o| defined(&o.gw)).fold(Tensor::zeros([C], (Kind::Float, Device::Cpu)), |a, b| a + b);
    let gb = got.iter().map(|o| defined(&o.gb)).fold(Tensor::zeros([C], (Kind::Float, Device::Cpu)), |a, b| a + b);
    close(&format!("{nd}-d, {sizes:?}: weight gradient summed"), &gw, &want.gw);
    close(&format!("{nd}-d, {sizes:?}: bias gradient summed"), &gb, &want.gb);
}

#[test]
fn the_groups_statistics_equal_one_process_over_the_whole_batch() {
    check(&[3, 5], 2);
    check(&[4, 1, 2], 2);
    check(&[2, 3, 4], 1);
    check(&[3, 2], 0);
    check(&[2, 1, 3], 3);
}

/// PyTorch's `process_group=`: on 4 ranks, two groups of 2 (a subgroup each), each layer normalizing
/// over its own group's batches only.
#[test]
fn a_group_of_its_own_takes_statistics_over_its_ranks_only() {
    let sizes: &'static [i64] = &[3, 5, 2, 4];
    let got = common::run_threads(4, Duration::from_secs(60), move |pg| {
        let r = pg.rank();
        let pair = if r < 2 { [0, 1] } else { [2, 3] };
        let sub = Arc::new(pg.new_subgroup(&pair, "bn").unwrap().unwrap());
        steps(sub, r, sizes[r], 2)
    });
    for first in [0, 2] {
        let want = reference_from(first, &sizes[first..first + 2], 2);
        let mut at = 0;
        for r in first..first + 2 {
            let n = sizes[r];
            close(&format!("rank {r}: output"), &got[r].y, &want.y.narrow(0, at, n));
            close(&format!("rank {r}: input gradient"), &got[r].gx, &want.gx.narrow(0, at, n));
            close(&format!("rank {r}: running mean"), &got[r].rm, &want.rm);
            at += n;
        }
    }
    // the two groups' statistics differ: no statistic crossed between them
    assert!((&got[0].rm - &got[2].rm).abs().max().double_value(&[]) > 1e-3);
}

#[test]
fn a_rank_with_no_rows_takes_part_and_counts_for_nothing() {
    check(&[4, 0, 3], 2);
}

/// Evaluation normalizes with the running statistics on each rank alone: a rank whose peers run no
/// forward at all still finishes (no collective to wait for).
#[test]
fn evaluation_runs_no_collective() {
    let got = common::run_threads(2, Duration::from_secs(60), |pg| {
        let r = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = SyncBatchNorm::new(vs.root() / "bn", 2, C, Default::default(), Arc::new(pg));
        set_affine(&bn.ws, &bn.bs);
        if r == 0 {
            let (x, _) = batch(0, 3, &[3, 2]);
            let y = bn.f_forward_t(&x, false).unwrap();
            let plain = nn::batch_norm2d(nn::VarStore::new(Device::Cpu).root(), C, Default::default());
            set_affine(&plain.ws, &plain.bs);
            Some((y, x.apply_t(&plain, false)))
        } else {
            None
        }
    });
    let (y, want) = got[0].as_ref().unwrap();
    close("evaluation", y, want);
}

#[test]
fn bad_input_is_named() {
    let errs = common::run_threads(2, Duration::from_secs(60), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = SyncBatchNorm::new(vs.root() / "bn", 2, C, Default::default(), Arc::new(pg));
        let channels = bn.f_forward_t(&Tensor::zeros([2, 4, 3, 3], (Kind::Float, Device::Cpu)), true).unwrap_err();
        let dims = bn.f_forward_t(&Tensor::zeros([2, 3, 3], (Kind::Float, Device::Cpu)), true).unwrap_err();
        (channels.to_string(), dims.to_string())
    });
    for (channels, dims) in errs {
        assert!(channels.contains("3 channels") && channels.contains("[2, 4, 3, 3]"), "{channels}");
        assert!(dims.contains("2-d") && dims.contains("[2, 3, 3]"), "{dims}");
    }
}
