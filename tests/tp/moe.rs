//! Expert parallelism: the MoE layer with its experts spread over 2 and 4 ranks equals the same layer with
//! every expert in one process (each rank's tokens one call of their own): outputs, input gradients, the
//! experts' gradients and the router's (summed over the ranks) within 1e-5, with tokens dropped for
//! capacity. The one-process layer equals a token-by-token reference written from GShard's rules; the
//! differentiable all-to-all sends gradients back along uneven splits; DDP over the expert-parallel group
//! keeps each rank's experts and averages as one process would; bad input is named.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::moe::{self, Moe, MoeConfig};
use tch_dist::DistModule;
use tch_dist::{Error, ProcessGroup, Store};

const T: Duration = Duration::from_secs(60);
/// float32, the same products batched differently: observed ~1e-7.
const TOL: f64 = 1e-5;
const D: i64 = 6;
const H: i64 = 10;
const E: i64 = 8;
/// 12 tokens a call, 2 experts each, 8 experts: an even share is 3 rows; 0.75 of it keeps 3 (rounded up)
/// of what would be 24 / 8 on average, and the uneven router sends more to some: drops.
const CFG: MoeConfig = MoeConfig { top_k: 2, capacity_factor: 0.75 };
const AUX: f64 = 0.1;

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.5).view(shape)
}

/// The router and the experts' stacks: `[E, D]`, `[E, D, H]`, `[E, H]`, `[E, H, D]`, `[E, D]`.
fn weights() -> (Tensor, [Tensor; 4]) {
    (
        formula(&[E, D], 1.0) * 4.0,
        [formula(&[E, D, H], 2.0), formula(&[E, H], 3.0), formula(&[E, H, D], 4.0), formula(&[E, D], 5.0)],
    )
}

/// Rank r's tokens (`[3, 4, D]`: leading dimensions are tokens) and the loss's weights for them.
fn data(r: usize) -> (Tensor, Tensor) {
    (formula(&[3, 4, D], 10.0 + r as f64), formula(&[3, 4, D], 20.0 + r as f64))
}

fn one_rank() -> Arc<ProcessGroup> {
    let store = Store::hash().unwrap();
    Arc::new(ProcessGroup::new(&store, 0, 1, &common::gloo_opts(T)).unwrap())
}

fn layer(pg: Arc<ProcessGroup>, cfg: MoeConfig) -> (nn::VarStore, Moe) {
    let vs = nn::VarStore::new(Device::Cpu);
    let (router, [w1, b1, w2, b2]) = weights();
    let moe = Moe::from_full(&(vs.root() / "moe"), &router, [&w1, &b1, &w2, &b2], pg, cfg).unwrap();
    (vs, moe)
}

fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// What one call and its backward leave.
struct Run {
    out: Vec<Tensor>,
    gx: Vec<Tensor>,
    /// router, w1, b1, w2, b2 (this rank's experts)
    grads: Vec<Tensor>,
    dropped: i64,
}

fn grads(m: &Moe) -> Vec<Tensor> {
    [&m.router, &m.w1, &m.b1, &m.w2, &m.b2].iter().map(|t| t.grad()).collect()
}

/// Every expert in one process; rank r's tokens one call each, their losses summed.
fn one_process(ranks: usize) -> Run {
    let (_vs, m) = layer(one_rank(), CFG);
    let mut loss = Tensor::zeros([], (Kind::Float, Device::Cpu));
    let (mut out, mut xs, mut dropped) = (Vec::new(), Vec::new(), 0);
    for r in 0..ranks {
        let (x, t) = data(r);
        let x = x.set_requires_grad(true);
        let o = m.f_forward(&x).unwrap();
        loss = loss + (&o.output * &t).sum(Kind::Float) + AUX * &o.aux_loss;
        dropped += o.dropped.int64_value(&[]);
        out.push(o.output.detach());
        xs.push(x);
    }
    loss.backward();
    Run { out, gx: xs.iter().map(|x| x.grad()).collect(), grads: grads(&m), dropped }
}

#[test]
fn experts_over_2_and_4_ranks_equal_every_expert_in_one_process() {
    for world in [2usize, 4] {
        let want = one_process(world);
        assert!(want.dropped > 0, "the test's capacity must drop tokens");
        let ranks = common::run_threads(world, T, |pg| {
            let r = pg.rank();
            let (_vs, m) = layer(Arc::new(pg), CFG);
            let (x, t) = data(r);
            let x = x.set_requires_grad(true);
            let o = m.f_forward(&x).unwrap();
            ((&o.output * &t).sum(Kind::Float) + AUX * &o.aux_loss).backward();
            Run {
                out: vec![o.output.detach()],
                gx: vec![x.grad()],
                grads: grads(&m),
                dropped: o.dropped.int64_value(&[]),
            }
        });
        let local = E / world as i64;
        let mut router = Tensor::zeros([E, D], (Kind::Float, Device::Cpu));
        for (r, got) in ranks.iter().enumerate() {
            let d = diff(&got.out[0], &want.out[r]);
            assert!(d < TOL, "EP {world}, rank {r}: outputs differ by {d:e}");
            let d = diff(&got.gx[0], &want.gx[r]);
            assert!(d < TOL, "EP {world}, rank {r}: input gradients differ by {d:e}");
            for (i, name) in ["w1", "b1", "w2", "b2"].iter().enumerate() {
                let whole = want.grads[i + 1].narrow(0, r as i64 * local, local);
                let d = diff(&got.grads[i + 1], &whole);
                assert!(d < TOL, "EP {world}, rank {r}: {name}'s gradient differs by {d:e}");
            }
            router += &got.grads[0];
        }
        let d = diff(&router, &want.grads[0]);
        assert!(d < TOL, "EP {world}: the router's gradient summed over the ranks differs by {d:e}");
        assert_eq!(ranks.iter().map(|r| r.dropped).sum::<i64>(), want.dropped, "EP {world}: dropped assignments");
    }
}

#[test]
fn ddp_over_the_expert_parallel_group_keeps_each_ranks_experts_and_averages() {
    // DDP leaves the experts (sharded over its own group) out of its check, broadcast and buckets, and
    // divides their gradients: the mean over the ranks of what one process computes for the sum
    let world = 2;
    let want = one_process(world);
    let ranks = common::run_threads(world, T, |pg| {
        let (r, pg) = (pg.rank(), Arc::new(pg));
        let (vs, m) = layer(pg.clone(), CFG);
        let ddp = DistributedDataParallel::new(&vs, m, DdpOptions::default().process_group(pg)).unwrap();
        let (x, t) = data(r);
        let o = ddp.forward_with(|m| m.f_forward(&x)).unwrap().unwrap();
        ddp.backward(&((&o.output * &t).sum(Kind::Float) + AUX * &o.aux_loss)).unwrap();
        (o.output.detach(), grads(ddp.module()), ddp.parameters().len())
    });
    let local = E / world as i64;
    for (r, (out, g, n)) in ranks.iter().enumerate() {
        assert_eq!(*n, 5, "rank {r}: DDP's parameters include the experts it does not bucket");
        assert!(diff(out, &want.out[r]) < TOL, "rank {r}: outputs differ (experts overwritten by rank 0's?)");
        let d = diff(&g[0], &(&want.grads[0] / world as f64));
        assert!(d < TOL, "rank {r}: the router's averaged gradient differs by {d:e}");
        for (i, name) in ["w1", "b1", "w2", "b2"].iter().enumerate() {
            let whole = want.grads[i + 1].narrow(0, r as i64 * local, local) / world as f64;
            let d = diff(&g[i + 1], &whole);
            assert!(d < TOL, "rank {r}: {name}'s gradient differs from the mean's by {d:e}");
        }
    }
}

/// Expert parallelism carved out of data parallelism: 4 ranks, experts spread over EP groups of 2 ({0, 1},
/// {2, 3}) and repeated over {0, 2} and {1, 3}; DDP over all 4 sums the experts' gradients over the ranks
/// that hold the same experts and averages as one process would. A DDP whose group does not span the
/// expert-parallel and replica ranks is refused, naming the parameter.
#[test]
fn ddp_over_ep_2_x_dp_2_sums_experts_over_their_replicas_and_averages() {
    let world = 4;
    let want = one_process(world);
    let ranks = common::run_threads(world, T, |pg| {
        let (r, pg) = (pg.rank(), Arc::new(pg));
        let (g, k) = (r / 2, r % 2);
        let ep = Arc::new(pg.new_subgroup(&[2 * g, 2 * g + 1], &format!("ep{g}")).unwrap().unwrap());
        let same = Arc::new(pg.new_subgroup(&[k, k + 2], &format!("replicas{k}")).unwrap().unwrap());
        let (vs, m) = layer(ep.clone(), CFG);
        let m = m.replicated_over(&same).unwrap();
        if g == 1 {
            // a replica that starts elsewhere is brought to its group's rank 0's values
            let _ = tch::no_grad(|| m.w1.shallow_clone().f_add_scalar_(1.0).unwrap());
        }
        // a communication hook would not see the experts' gradients: refused
        let hooked = DdpOptions::default().process_group(pg.clone()).comm_hook(tch_dist::ddp::comm_hook::allreduce());
        let hooked = DistributedDataParallel::new(&vs, (), hooked).map(|_| ()).unwrap_err().to_string();
        assert!(hooked.contains("communication hook"), "{hooked}");
        // over the expert-parallel group alone, DDP would miss the replicas: refused
        let refused = DistributedDataParallel::new(&vs, (), DdpOptions::default().process_group(ep)).map(|_| ());
        let refused = refused.unwrap_err().to_string();
        let ddp = DistributedDataParallel::new(&vs, m, DdpOptions::default().process_group(pg)).unwrap();
        let (x, t) = data(r);
        let o = ddp.forward_with(|m| m.f_forward(&x)).unwrap().unwrap();
        ddp.backward(&((&o.output * &t).sum(Kind::Float) + AUX * &o.aux_loss)).unwrap();
        (o.output.detach(), grads(ddp.module()), refused)
    });
    let local = E / 2;
    for (r, (out, g, refused)) in ranks.iter().enumerate() {
        assert!(refused.contains("moe.experts.") && refused.contains("repeated over"), "rank {r}: {refused}");
        assert!(diff(out, &want.out[r]) < TOL, "rank {r}: outputs differ");
        let d = diff(&g[0], &(&want.grads[0] / world as f64));
        assert!(d < TOL, "rank {r}: the router's averaged gradient differs by {d:e}");
        for (i, name) in ["w1", "b1", "w2", "b2"].iter().enumerate() {
            let whole = want.grads[i + 1].narrow(0, (r % 2) as i64 * local, local) / world as f64;
            let d = diff(&g[i + 1], &whole);
            assert!(d < TOL, "rank {r}: {name}'s gradient differs from the mean's by {d:e}");
        }
    }
}

/// GShard's rules token by token: each token's top-k experts, every first choice queued before any
/// second one, an expert's assignments past its capacity dropped, gates renormalised over the k choices
/// (top-1: the probability itself).
fn token_by_token(x: &Tensor, router: &Tensor, [w1, b1, w2, b2]: [&Tensor; 4], cfg: MoeConfig) -> (Tensor, Tensor) {
    let (n, k) = (x.size()[0], cfg.top_k);
    let probs = x.matmul(&router.tr()).softmax(-1, Kind::Float);
    let (top, choice) = probs.topk(k, -1, true, true);
    let gates = if k > 1 { &top / top.sum_dim_intlist(-1, true, Kind::Float) } else { top };
    let choice = Vec::<Vec<i64>>::try_from(&choice).unwrap();
    let cap = ((cfg.capacity_factor * (n * k) as f64 / E as f64).ceil() as i64).max(1);
    let mut queued = vec![0i64; E as usize];
    let mut count = vec![0f64; E as usize];
    let mut outs: Vec<Tensor> = (0..n).map(|_| Tensor::zeros([D], (Kind::Float, Device::Cpu))).collect();
    for j in 0..k as usize {
        for (t, picks) in choice.iter().enumerate() {
            let e = picks[j];
            count[e as usize] += 1.0;
            if queued[e as usize] >= cap {
                continue;
            }
            queued[e as usize] += 1;
            let xt = x.get(t as i64).unsqueeze(0);
            let h = (xt.matmul(&w1.get(e)) + b1.get(e)).gelu("none");
            let y = (h.matmul(&w2.get(e)) + b2.get(e)).squeeze_dim(0);
            outs[t] = &outs[t] + y * gates.get(t as i64).get(j as i64);
        }
    }
    let share = Tensor::from_slice(&count) / (n * k) as f64;
    let aux = (share.to_kind(Kind::Float) * probs.mean_dim(0, false, Kind::Float)).sum(Kind::Float) * E as f64;
    (Tensor::stack(&outs, 0), aux)
}

#[test]
fn the_one_process_layer_follows_gshard_token_by_token() {
    for cfg in [CFG, MoeConfig { top_k: 1, capacity_factor: 1.0 }, MoeConfig { top_k: 2, capacity_factor: 4.0 }] {
        let (_vs, m) = layer(one_rank(), cfg);
        let (x, t) = data(0);
        let x = x.reshape([-1, D]).set_requires_grad(true);
        let t = t.reshape([-1, D]);
        let o = m.f_forward(&x).unwrap();
        ((&o.output * &t).sum(Kind::Float) + AUX * &o.aux_loss).backward();

        let (router, w) = weights();
        let router = router.set_requires_grad(true);
        let w: Vec<Tensor> = w.into_iter().map(|t| t.set_requires_grad(true)).collect();
        let xr = x.detach().set_requires_grad(true);
        let (out, aux) = token_by_token(&xr, &router, [&w[0], &w[1], &w[2], &w[3]], cfg);
        ((&out * &t).sum(Kind::Float) + AUX * &aux).backward();

        let name = format!("top-{} at capacity factor {}", cfg.top_k, cfg.capacity_factor);
        assert!(diff(&o.output, &out) < TOL, "{name}: outputs differ by {:e}", diff(&o.output, &out));
        assert!(diff(&o.aux_loss, &aux) < TOL, "{name}: aux losses {} and {}", o.aux_loss, aux);
        assert!(diff(&x.grad(), &xr.grad()) < TOL, "{name}: input gradients differ");
        assert!(diff(&m.router.grad(), &router.grad()) < TOL, "{name}: router gradients differ");
        for (i, (got, want)) in [&m.w1, &m.b1, &m.w2, &m.b2].iter().zip(&w).enumerate() {
            let d = diff(&got.grad(), &want.grad());
            assert!(d < TOL, "{name}: expert tensor {i}'s gradient differs by {d:e}");
        }
        if cfg.capacity_factor >= 4.0 {
            assert_eq!(o.dropped.int64_value(&[]), 0, "{name}: room for every assignment");
        }
    }
}

#[test]
fn the_all_to_all_sends_gradients_back_along_uneven_splits() {
    // rank r sends rank s (r + s + 1) rows of 2; the loss weighs what each rank receives by c_s
    let world = 3;
    let c = |s: usize, rows: i64| formula(&[rows, 2], 30.0 + s as f64);
    let res = common::run_threads(world, T, move |pg| {
        let r = pg.rank();
        let ins: Vec<usize> = (0..world).map(|s| r + s + 1).collect();
        let outs: Vec<usize> = (0..world).map(|q| q + r + 1).collect();
        let x = formula(&[ins.iter().sum::<usize>() as i64, 2], r as f64).set_requires_grad(true);
        let y = moe::all_to_all(&x, &pg, &outs, &ins).unwrap();
        (&y * c(r, y.size()[0])).sum(Kind::Float).backward();
        (r, x.grad())
    });
    for (r, g) in res {
        // the gradient of rank r's chunk for s is the part of c_s that weighed it
        let parts: Vec<Tensor> = (0..world)
            .map(|s| {
                let at: usize = (0..r).map(|q| q + s + 1).sum();
                let rows: usize = (0..world).map(|q| q + s + 1).sum();
                c(s, rows as i64).narrow(0, at as i64, (r + s + 1) as i64)
            })
            .collect();
        let want = Tensor::cat(&parts, 0);
        assert!(diff(&g, &want) < 1e-7, "rank {r}: gradient {g} vs {want}");
    }
}

#[test]
fn bad_input_is_named() {
    // 8 experts over 3 ranks, and ranks that route different numbers of tokens (the capacities, and so
    // the all-to-all's chunks, differ): errors on every rank, never Gloo's abort
    let res = common::run_threads(3, T, |pg| {
        let (router, [w1, b1, w2, b2]) = weights();
        let vs = nn::VarStore::new(Device::Cpu);
        Moe::from_full(&vs.root(), &router, [&w1, &b1, &w2, &b2], Arc::new(pg), CFG).unwrap_err().to_string()
    });
    for e in res {
        assert!(e.contains("8 experts do not spread evenly over the expert-parallel group's 3 ranks"), "{e}");
    }
    let res = common::run_threads(2, T, |pg| {
        let r = pg.rank();
        let (_vs, m) = layer(Arc::new(pg), CFG);
        let x = formula(&[if r == 0 { 12 } else { 8 }, D], 1.0);
        let e = m.f_forward(&x).unwrap_err();
        let wrong = m.f_forward(&formula(&[4, D + 1], 1.0)).unwrap_err().to_string();
        (e, wrong)
    });
    for (e, wrong) in res {
        assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
        // 12 tokens: 3 rows for each of 4 experts; 8 tokens: 2 rows each
        assert!(e.to_string().contains("rank 0 sends 12 rows to rank 1, which expects 8"), "{e}");
        assert!(wrong.contains("does not end in d_model = 6"), "{wrong}");
    }
}
