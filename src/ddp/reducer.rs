//! The reducer: gradient buckets filled by autograd hooks, reduced asynchronously in bucket order while
//! backward goes on, finalised when backward ends. Semantics follow PyTorch's `reducer.cpp`.
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use tch::Tensor;

use super::bucket::{self, TensorSpec};
use super::comm_hook::{CommHook, GradBucket, HookFuture};
use super::grad_sink::{FixedBucket, GradSink};
use super::sync;
use crate::error::{Error, Result};
use crate::group::loop_check::{agree_on_loop, LoopPhase};
use crate::group::{ProcessGroup, ReduceOp};
use crate::hooks::{self, GradHook};

/// How DDP's loop check ends: what DDP offers for uneven inputs.
const UNEVEN_HINT: &str =
    " (for uneven inputs, where some ranks have more batches, run the loop inside `ddp.join(..)`)";

/// What the reducer did during the last backward, in order (to see communication overlap backward).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub enum ReducerEvent {
    /// The gradient of parameter `param` became ready.
    GradReady { param: usize },
    /// The reduction of bucket `bucket` was launched.
    BucketLaunched { bucket: usize },
}

pub(crate) struct Config {
    pub world: usize,
    pub bucket_view: bool,
    pub find_unused: bool,
    pub first_bucket_bytes: usize,
    pub bucket_bytes: usize,
    /// `None`: DDP's own allreduce, dividing by the world size while copying gradients in.
    pub comm_hook: Option<Arc<dyn CommHook>>,
}

pub(crate) struct Bucket {
    /// The bucket's gradients (empty once gradients go to a sink).
    pub flat: Tensor,
    pub params: Vec<usize>,
    pub views: Vec<Tensor>,
    /// Where each parameter starts in the flat layout, and the layout's length.
    pub offsets: Vec<i64>,
    pub numel: i64,
}

pub(crate) struct State {
    pub params: Vec<Tensor>,
    /// Parameters whose ranks hold different parts over DDP's own group (experts spread over it): their
    /// layers' collectives already summed each gradient over the ranks, so DDP leaves them out of its
    /// buckets and only divides them, as its average would.
    pub partial: Vec<Tensor>,
    /// Those of them held alike by the ranks of another group (experts repeated over data-parallel
    /// ranks), whose gradients are summed over that group before the division.
    pub summed: Vec<(Arc<ProcessGroup>, Vec<Tensor>)>,
    pub names: Vec<String>,
    specs: Vec<TensorSpec>,
    pub buckets: Vec<Bucket>,
    loc: Vec<(usize, usize)>, // param -> (bucket, slot)
    pending: Vec<usize>,
    ready: Vec<bool>,
    has_grad: Vec<bool>,
    next_launch: usize,
    /// Reductions running, in bucket order.
    in_flight: Vec<HookFuture>,
    ready_order: Vec<usize>,
    pub rebuilt: bool,
    /// A hook fired in the backward in progress (so the end-of-backward callback is queued).
    active: bool,
    pub sync: bool,
    /// Reductions completed (iterations fully finalised).
    pub iterations: u64,
    pub events: Vec<ReducerEvent>,
    /// This backward's first error, of its kind (a lost peer stays a peer failure).
    error: Option<Error>,
    /// Synchronised forwards and backwards so far, compared across ranks after each backward.
    forwards: i64,
    pub backwards: i64,
    /// The layout no longer changes (a layer above keeps parameters and state in it).
    pub frozen: bool,
    /// A layer above shards the buckets (set once it is built: a failed attempt leaves it unset).
    pub sharded: bool,
    /// Where gradients go instead of the buckets (reduce-scattered into shards, say).
    pub sink: Option<Box<dyn GradSink>>,
    /// Inside `join`: uneven inputs are being shadowed.
    join: Option<super::join::JoinOptions>,
    /// Gradients are divided by this (the world size unless joining asks otherwise).
    divisor: f64,
    /// PyTorch's `require_forward_param_sync`.
    forward_param_sync: bool,
}

/// A complete bucket whose reduction can start.
enum Launch {
    /// Into the sink.
    Sink(usize),
    Reduce(GradBucket),
}

impl Launch {
    fn bucket(&self) -> usize {
        match self {
            Launch::Sink(nb) => *nb,
            Launch::Reduce(b) => b.index,
        }
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    format!("panicked: {}", crate::error::panic_message(p))
}

pub(crate) struct Reducer {
    pub pg: Arc<ProcessGroup>,
    pub cfg: Config,
    pub state: Mutex<State>,
    /// The next bucket whose reduction may be posted. Launches are decided in bucket order under the
    /// state lock, but posted after it is released; hooks firing on two autograd threads (two devices)
    /// would otherwise post in either order, and NCCL runs a group's collectives in posting order, so
    /// ranks that post differently hang. Each poster waits for its turn (as PyTorch's reducer launches
    /// under its lock), with no lock held while the collective or the user's comm hook runs.
    turn: Mutex<usize>,
    turn_moved: Condvar,
}

pub(super) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock is contained by the hook trampoline; the state stays usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Reducer {
    pub(super) fn new(
        pg: Arc<ProcessGroup>,
        cfg: Config,
        params: Vec<Tensor>,
        names: Vec<String>,
        partial: Vec<Tensor>,
        summed: Vec<(Arc<ProcessGroup>, Vec<Tensor>)>,
    ) -> Result<Arc<Reducer>> {
        let specs: Vec<TensorSpec> = params.iter().map(TensorSpec::of).collect();
        // First iteration, as PyTorch: without unused-parameter search, one bucket per dtype/device
        // (rebuilt after the first backward from the order gradients arrived); with it, the usual caps.
        // Buckets come in reverse parameter order, since gradients arrive roughly last layer first.
        // A hook that needs the same buckets at every iteration never gets them rebuilt.
        let fixed = cfg.find_unused || cfg.comm_hook.as_ref().is_some_and(|h| h.fixed_layout());
        let limits = if fixed { vec![cfg.first_bucket_bytes, cfg.bucket_bytes] } else { vec![usize::MAX] };
        let mut assignment = bucket::assign(&specs, &limits, None);
        assignment.reverse();
        let n = params.len();
        let mut st = State {
            params,
            partial,
            summed,
            names,
            specs,
            buckets: Vec::new(),
            loc: vec![(0, 0); n],
            pending: Vec::new(),
            ready: vec![false; n],
            has_grad: vec![false; n],
            next_launch: 0,
            in_flight: Vec::new(),
            ready_order: Vec::with_capacity(n),
            rebuilt: fixed, // PyTorch rebuilds only without unused-parameter search
            active: false,
            sync: true,
            iterations: 0,
            events: Vec::new(),
            error: None,
            forwards: 0,
            backwards: 0,
            frozen: false,
            sharded: false,
            sink: None,
            join: None,
            divisor: cfg.world as f64,
            forward_param_sync: true,
        };
        init_buckets(&mut st, &cfg, assignment, false)?;
        Ok(Arc::new(Reducer { pg, cfg, state: Mutex::new(st), turn: Mutex::new(0), turn_moved: Condvar::new() }))
    }

    /// Registers one AccumulateGrad hook per parameter. The hooks hold a weak reference.
    pub(super) fn install_hooks(self: &Arc<Self>) -> Result<Vec<GradHook>> {
        let params: Vec<Tensor> = lock(&self.state).params.iter().map(|p| p.shallow_clone()).collect();
        params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let weak: Weak<Reducer> = Arc::downgrade(self);
                hooks::on_grad_accumulated(p, move || {
                    if let Some(r) = weak.upgrade() {
                        // a panic in here becomes this backward's error (reported when it ends)
                        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.on_grad_ready(i))) {
                            r.fail(Error::invalid(
                                "DDP backward",
                                format!("the gradient hook of parameter {i} {}", panic_text(&*p)),
                            ));
                        }
                    }
                })
            })
            .collect()
    }

    fn on_grad_ready(self: &Arc<Self>, i: usize) {
        // Under the lock: bookkeeping and the copy into the bucket. The collectives and the user's comm
        // hook run after it is released.
        let (loop_counts, launches) = {
            let mut st = lock(&self.state);
            if !st.sync || st.error.is_some() {
                return;
            }
            let mut loop_counts = None;
            if !st.active {
                st.active = true;
                st.events.clear();
                if self.loop_check_now(&st, LoopPhase::Backward) {
                    loop_counts = Some((st.forwards, st.backwards));
                }
                st.backwards += 1;
                let weak = Arc::downgrade(self);
                let queued = hooks::queue_backward_callback(move || match weak.upgrade() {
                    Some(r) => r.finalize(),
                    None => Ok(()),
                });
                if let Err(e) = queued {
                    st.error = Some(e);
                    return;
                }
            }
            st.events.push(ReducerEvent::GradReady { param: i });
            if st.ready[i] {
                st.error = Some(Error::invalid(
                    "DDP backward",
                    format!(
                        "parameter {i} ({}) was marked ready twice in one backward; DDP supports one backward per forward",
                        st.names[i]
                    ),
                ));
                return;
            }
            match self.mark_ready(&mut st, i) {
                Ok(l) => (loop_counts, l),
                Err(e) => {
                    st.error = Some(e);
                    return;
                }
            }
        };
        if let Some((forwards, backwards)) = loop_counts {
            if let Err(e) = self.check_loop_agreement(forwards, backwards, LoopPhase::Backward) {
                self.fail(e);
                // the buckets decided here are never posted: later posters must not wait for them
                for l in &launches {
                    self.pass_turn(l.bucket());
                }
                return;
            }
        }
        if let Err(e) = self.start(launches) {
            self.fail(e);
        }
    }

    /// Records the first error of this backward (reported when it ends).
    pub(crate) fn fail(&self, e: Error) {
        lock(&self.state).error.get_or_insert(e);
    }

    /// Copies parameter `i`'s gradient into its bucket slot (divided by the world size) and returns the
    /// buckets that are now complete, in bucket order, for [`start`](Self::start).
    fn mark_ready(&self, st: &mut State, i: usize) -> Result<Vec<Launch>> {
        let _g = tch::no_grad_guard();
        let (b, k) = st.loc[i];
        let grad = st.params[i].grad();
        // a comm hook gets the local gradients as they are and averages them itself (PyTorch's rule)
        let scale = if self.cfg.comm_hook.is_some() { 1.0 } else { 1.0 / st.divisor };
        if let Some(sink) = st.sink.as_mut() {
            sink.accept(b, st.buckets[b].offsets[k], st.specs[i].numel as i64, &grad, 1.0 / st.divisor)?;
            if grad.defined() {
                // the bucket buffer has it now; only the shard survives this backward
                hooks::set_grad(&st.params[i], None)?;
            }
        } else if !grad.defined() {
            let mut view = st.buckets[b].views[k].shallow_clone();
            // An unused parameter contributes zeros.
            let _ = view.f_zero_()?;
        } else if self.cfg.bucket_view && grad.data_ptr() == st.buckets[b].views[k].data_ptr() {
            // Already accumulated in place in the bucket.
            if scale != 1.0 {
                let _ = st.buckets[b].views[k].shallow_clone().f_mul_scalar_(scale)?;
            }
        } else {
            let mut view = st.buckets[b].views[k].shallow_clone();
            if scale != 1.0 {
                // copy and divide in one pass (mul's Scalar overload with out= would compute into a
                // temporary the size of the gradient first; the Tensor overload writes in place)
                let _ = grad.f_mul_out(&view, &Tensor::from(scale))?;
            } else {
                view.f_copy_(&grad)?;
            }
            if self.cfg.bucket_view {
                // From now on autograd accumulates straight into the bucket; the separate grad is freed.
                hooks::set_grad(&st.params[i], Some(&view))?;
            }
        }
        st.has_grad[i] = grad.defined();
        st.ready[i] = true;
        if !st.rebuilt {
            st.ready_order.push(i);
        }
        st.pending[b] -= 1;
        let mut launches = Vec::new();
        while st.next_launch < st.buckets.len() && st.pending[st.next_launch] == 0 {
            let nb = st.next_launch;
            launches.push(if st.sink.is_some() {
                Launch::Sink(nb)
            } else {
                Launch::Reduce(GradBucket {
                    index: nb,
                    count: st.buckets.len(),
                    buffer: st.buckets[nb].flat.shallow_clone(),
                    gradients: st.buckets[nb].views.iter().map(|v| v.shallow_clone()).collect(),
                })
            });
            st.events.push(ReducerEvent::BucketLaunched { bucket: nb });
            st.next_launch += 1;
        }
        Ok(launches)
    }

    /// Waits until bucket `nb` may be posted: every bucket before it was (or was given up). Bounded by
    /// the group's timeout, so that a poster that died cannot hold the others forever.
    fn wait_turn(&self, nb: usize) -> Result<()> {
        let limit = self.pg.timeout();
        let turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        let (turn, waited) =
            self.turn_moved.wait_timeout_while(turn, limit, |t| *t < nb).unwrap_or_else(|e| e.into_inner());
        if waited.timed_out() && *turn < nb {
            return Err(Error::invalid(
                format!("DDP bucket {nb}"),
                format!("bucket {} was never posted within {limit:?}", *turn),
            ));
        }
        Ok(())
    }

    /// Bucket `nb` was posted (or will never be): the next one's poster may go.
    fn pass_turn(&self, nb: usize) {
        let mut turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        *turn = (*turn).max(nb + 1);
        self.turn_moved.notify_all();
    }

    /// Starts the reductions of complete buckets, in bucket order across threads, with no lock held
    /// while they run (they may block, as a sink that waits for the previous bucket, and run the user's
    /// comm hook).
    fn start(&self, launches: Vec<Launch>) -> Result<()> {
        let mut launches = launches.into_iter();
        let mut r = Ok(());
        for l in launches.by_ref() {
            let nb = l.bucket();
            r = self.wait_turn(nb).and_then(|()| self.post(l));
            self.pass_turn(nb);
            if r.is_err() {
                break;
            }
        }
        // after a failure, the rest are given up: their turns pass
        for l in launches {
            self.pass_turn(l.bucket());
        }
        r
    }

    fn post(&self, l: Launch) -> Result<()> {
        match l {
            Launch::Sink(nb) => {
                let _l = crate::flight::label(format!("DDP bucket {nb}"));
                // out of the state while it runs (one backward at a time drives it)
                let Some(mut sink) = lock(&self.state).sink.take() else { return Ok(()) };
                let r = sink.launch(&self.pg, nb);
                lock(&self.state).sink = Some(sink);
                r?;
            }
            Launch::Reduce(bucket) => {
                let _l = crate::flight::label(format!("DDP bucket {}", bucket.index));
                let f = match &self.cfg.comm_hook {
                    None => HookFuture::after(
                        self.pg.allreduce_unverified(&mut bucket.buffer.shallow_clone(), ReduceOp::Sum)?,
                    ),
                    Some(hook) => {
                        // the user's code: a panic in it is this backward's error, not an abort
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook.run(&self.pg, &bucket)))
                            .unwrap_or_else(|p| {
                                Err(Error::invalid(format!("comm hook on bucket {}", bucket.index), panic_text(&*p)))
                            })?
                    }
                };
                lock(&self.state).in_flight.push(f);
            }
        }
        Ok(())
    }

    /// End of backward: reduce what is left, wait for every bucket, write results into `.grad`.
    pub(super) fn finalize(&self) -> Result<()> {
        let r = self.finalize_inner();
        let mut st = lock(&self.state);
        reset_iteration(&mut st);
        *self.turn.lock().unwrap_or_else(|e| e.into_inner()) = 0;
        if r.is_ok() {
            st.iterations += 1;
        }
        r
    }

    fn finalize_inner(&self) -> Result<()> {
        let op = || format!("DDP backward on {} of {}", self.pg.who(self.pg.rank()), self.pg.size());
        // 1. under the lock: this backward's error, and unused parameters marked ready (as zeros)
        let launches = {
            let mut st = lock(&self.state);
            if let Some(e) = st.error.take() {
                return Err(e); // it names its own operation (a bucket's allreduce, a loop check)
            }
            let missing: Vec<usize> = (0..st.params.len()).filter(|&i| !st.ready[i]).collect();
            if !missing.is_empty() && !self.cfg.find_unused {
                let names: Vec<&str> = missing.iter().map(|&i| st.names[i].as_str()).collect();
                return Err(Error::invalid(
                    op(),
                    format!(
                        "parameters received no gradient in this backward: {}. Construct DDP with \
                         find_unused_parameters(true), or make every parameter take part in the loss",
                        names.join(", ")
                    ),
                ));
            }
            let mut launches = Vec::new();
            for i in missing {
                launches.extend(self.mark_ready(&mut st, i)?);
            }
            launches
        };
        // 2. no lock held while the reductions run and are waited for
        self.start(launches)?;
        let _g = tch::no_grad_guard();
        let (divisor, partial, summed) = {
            let st = lock(&self.state);
            let summed: Vec<(Arc<ProcessGroup>, Vec<Tensor>)> =
                st.summed.iter().map(|(g, ps)| (g.clone(), ps.iter().map(|p| p.shallow_clone()).collect())).collect();
            (st.divisor, st.partial.iter().map(|p| p.grad()).collect::<Vec<_>>(), summed)
        };
        for (g, ps) in &summed {
            sum_grads_over(g, ps)?;
        }
        let partial: Vec<Tensor> = if summed.is_empty() {
            partial
        } else {
            // the sums above may have given a gradient to a parameter that had none here
            lock(&self.state).partial.iter().map(|p| p.grad()).collect()
        };
        for mut g in partial.into_iter().filter(|g| g.defined()) {
            let _ = g.f_div_scalar_(divisor)?;
        }
        let (in_flight, sink) = {
            let mut st = lock(&self.state);
            (std::mem::take(&mut st.in_flight), st.sink.take())
        };
        if let Some(mut sink) = sink {
            let r = sink.finish(&self.pg);
            lock(&self.state).sink = Some(sink);
            return r;
        }
        for f in in_flight {
            f.wait()?;
        }
        let globally_used = if self.cfg.find_unused {
            // PyTorch's local_used_map: int32, summed on the parameters' device
            let (flags, device) = {
                let st = lock(&self.state);
                (st.has_grad.iter().map(|&u| u as i32).collect::<Vec<i32>>(), st.specs[0].device)
            };
            let meta = self.pg.meta_as_pytorch(device);
            meta.allreduce("DDP unused-parameter map", &flags, ReduceOp::Sum)?.into_iter().map(|c| c > 0).collect()
        } else {
            Vec::new()
        };
        // 3. the results into `.grad`
        let st = lock(&self.state);
        for i in 0..st.params.len() {
            let used = globally_used.get(i).copied().unwrap_or(true);
            let (b, k) = st.loc[i];
            let view = &st.buckets[b].views[k];
            let mut grad = st.params[i].grad();
            if self.cfg.bucket_view {
                if !grad.defined() && used {
                    hooks::set_grad(&st.params[i], Some(view))?;
                }
            } else if grad.defined() {
                grad.f_copy_(view)?;
            } else if used {
                hooks::set_grad(&st.params[i], Some(&view.f_detach_copy()?))?;
            }
        }
        Ok(())
    }

    /// Whether this forward or backward checks the loop: with agreement checks on and not
    /// joining; on NCCL the first of each only (see [`ProcessGroup::checks_now`]).
    fn loop_check_now(&self, st: &State, phase: LoopPhase) -> bool {
        let device = st.params.first().map_or(tch::Device::Cpu, |p| p.device());
        st.join.is_none() && self.pg.checks_now(crate::group::Scope::Collective, phase.kind(false), device)
    }

    /// Ranks that ran different numbers of forwards and backwards (an extra backward on one rank) would
    /// pair up the wrong collectives: the loop check at the start of each forward and each backward.
    fn check_loop_agreement(&self, forwards: i64, backwards: i64, phase: LoopPhase) -> Result<()> {
        agree_on_loop(&self.pg, "DDP", phase, forwards, backwards, UNEVEN_HINT)
    }

    /// Start of a forward: fails clearly if the last backward did not finish its reduction. Returns
    /// whether this iteration synchronises gradients (not inside `no_sync`).
    pub(super) fn begin_forward(&self) -> Result<bool> {
        let mut st = lock(&self.state);
        if st.active || st.ready.iter().any(|&r| r) {
            reset_iteration(&mut st);
            return Err(Error::invalid(
                format!("DDP forward on {} of {}", self.pg.who(self.pg.rank()), self.pg.size()),
                "the previous iteration did not finish reducing gradients (did its backward fail?)",
            ));
        }
        Ok(st.sync)
    }

    /// Our check that every rank is at the same forward (agreement checks on, not joining).
    pub(super) fn check_forward_loop(&self) -> Result<()> {
        let counts = {
            let st = lock(&self.state);
            if !st.sync {
                return Ok(());
            }
            self.loop_check_now(&st, LoopPhase::Forward).then_some((st.forwards, st.backwards))
        };
        if let Some((forwards, backwards)) = counts {
            self.check_loop_agreement(forwards, backwards, LoopPhase::Forward)?;
        }
        lock(&self.state).forwards += 1;
        Ok(())
    }

    /// Rebuilds the buckets once, after the first synchronised iteration, from the order gradients
    /// arrived, with rank 0's assignment. `shadow`: this rank has joined (see `join`) and follows the
    /// others' rebuild, proposing its current layout if it never saw a whole backward itself.
    pub(super) fn rebuild_if_due(&self, shadow: bool) -> Result<()> {
        let (local, n, device) = {
            let mut st = lock(&self.state);
            let have_order = st.ready_order.len() == st.params.len();
            if st.rebuilt || st.frozen || st.iterations == 0 || !(have_order || shadow) {
                return Ok(());
            }
            let local = if have_order {
                let order = std::mem::take(&mut st.ready_order);
                bucket::assign(&st.specs, &[self.cfg.first_bucket_bytes, self.cfg.bucket_bytes], Some(&order))
            } else {
                st.buckets.iter().map(|b| b.params.clone()).collect()
            };
            (local, st.params.len(), st.specs[0].device)
        };
        // no lock held during the broadcasts
        let agreed = sync::sync_bucket_indices(&self.pg, &local, n, device)?;
        let local = {
            let mut st = lock(&self.state);
            // Old and new buckets side by side would cost a third copy of the parameters at the peak.
            // The old ones can go first when nothing in them is needed: without bucket views they are
            // scratch space; with views they hold the gradients, which after zero_grad are none (ours
            // and tch's optimizers set them to none) or found all zero (an optimizer that zeroes in
            // place).
            let lean = !self.cfg.bucket_view || st.params.iter().all(|p| !p.grad().defined()) || all_zero(&st.buckets)?;
            if lean {
                if self.cfg.bucket_view {
                    for p in &st.params {
                        hooks::set_grad(p, None)?;
                    }
                }
                st.buckets.clear();
            }
            let local = init_buckets(&mut st, &self.cfg, agreed, lean && self.cfg.bucket_view);
            st.rebuilt = local.is_ok();
            local
        };
        // a rank that could not allocate its new buckets tells the others, instead of leaving them
        // waiting in the first bucket's allreduce (our protocol: not with PyTorch ranks in the group)
        if self.pg.verifies() {
            self.pg.meta().outcome("DDP bucket rebuild", local)
        } else {
            local
        }
    }

    /// Join mode (see `ddp::join`): `Some` while a rank's training loop runs inside `join`.
    pub(super) fn set_join(&self, join: Option<super::join::JoinOptions>) {
        let mut st = lock(&self.state);
        st.join = join;
        st.divisor = self.cfg.world as f64;
    }

    pub(super) fn join_options(&self) -> Option<super::join::JoinOptions> {
        lock(&self.state).join
    }

    /// What gradients are divided by this iteration (the world size, or in join mode the ranks still
    /// training, if asked).
    pub(super) fn set_divisor(&self, d: f64) {
        lock(&self.state).divisor = d;
    }

    /// PyTorch's `require_forward_param_sync`: buffers are broadcast in a forward after a synchronised one.
    pub(super) fn forward_param_sync(&self) -> bool {
        lock(&self.state).forward_param_sync
    }

    pub(super) fn set_forward_param_sync(&self, on: bool) {
        lock(&self.state).forward_param_sync = on;
    }

    /// A joined rank's share of a backward it does not run: every bucket reduced as zeros, through the
    /// comm hook if there is one, in bucket order; then the unused-parameter map, as zeros.
    pub(super) fn shadow_backward(&self) -> Result<()> {
        let (zero_buckets, n) = {
            let st = lock(&self.state);
            if st.sink.is_some() {
                return Err(Error::invalid(
                    "DDP join",
                    "this DDP's gradients are reduce-scattered into shards, which join cannot shadow yet",
                ));
            }
            let count = st.buckets.len();
            let mut zb = Vec::with_capacity(count);
            for (index, b) in st.buckets.iter().enumerate() {
                let buffer = b.flat.f_zeros_like()?;
                let gradients = b
                    .params
                    .iter()
                    .zip(&b.offsets)
                    .map(|(&i, &off)| bucket::slot(&buffer, off, &st.params[i].size()))
                    .collect::<Result<Vec<_>>>()?;
                zb.push(GradBucket { index, count, buffer, gradients });
            }
            (zb, st.params.len())
        };
        // no lock held while collectives run
        let mut futures = Vec::with_capacity(zero_buckets.len());
        for b in &zero_buckets {
            futures.push(match &self.cfg.comm_hook {
                None => HookFuture::after(self.pg.allreduce_unverified(&mut b.buffer.shallow_clone(), ReduceOp::Sum)?),
                Some(hook) => hook.run(&self.pg, b)?,
            });
        }
        for f in futures {
            f.wait()?;
        }
        if self.cfg.find_unused {
            let device = lock(&self.state).specs[0].device;
            self.pg.meta_as_pytorch(device).allreduce(
                "DDP join: unused-parameter map",
                &vec![0i32; n],
                ReduceOp::Sum,
            )?;
        }
        lock(&self.state).iterations += 1;
        Ok(())
    }

    /// Fixes the bucket layout for good (a layer above lays parameters and optimizer state out by
    /// bucket). Before the first rebuild, buckets are cut to the configured caps in reverse parameter
    /// order, the order PyTorch starts from; gradients present are kept.
    pub(super) fn fix_layout(&self) -> Result<Vec<FixedBucket>> {
        let mut st = lock(&self.state);
        if st.active {
            return Err(Error::invalid("fixing DDP's bucket layout", "a backward is in progress"));
        }
        if !st.rebuilt && !st.frozen {
            let limits = [self.cfg.first_bucket_bytes, self.cfg.bucket_bytes];
            let mut assignment = bucket::assign(&st.specs, &limits, None);
            assignment.reverse();
            init_buckets(&mut st, &self.cfg, assignment, false)?;
        }
        st.frozen = true;
        Ok(st.buckets.iter().map(|b| FixedBucket { params: b.params.clone(), grads: b.flat.shallow_clone() }).collect())
    }

    /// Sends every synchronised backward's gradients to the sink `make` builds from the fixed layout
    /// (elements and a parameter, for dtype and device, per bucket). The buckets' full-size buffers and
    /// any gradients present are dropped; from now on parameters have no `.grad` after a synchronised
    /// backward. Once only: one sink owns the gradients.
    pub(super) fn route_to(&self, make: impl FnOnce(&[(i64, Tensor)]) -> Result<Box<dyn GradSink>>) -> Result<()> {
        self.fix_layout()?;
        let mut st = lock(&self.state);
        if st.sink.is_some() {
            return Err(Error::invalid(
                "routing DDP's gradients",
                "they go to another sink already (one sharded optimizer per DDP model)",
            ));
        }
        let like: Vec<(i64, Tensor)> =
            st.buckets.iter().map(|b| (b.numel, st.params[b.params[0]].shallow_clone())).collect();
        let sink = make(&like)?;
        for p in &st.params {
            hooks::set_grad(p, None)?;
        }
        for b in st.buckets.iter_mut() {
            b.views.clear();
            b.flat = Tensor::f_empty([0], (b.flat.kind(), b.flat.device()))?;
        }
        st.sink = Some(sink);
        Ok(())
    }

    pub(super) fn set_sync(&self, on: bool) {
        lock(&self.state).sync = on;
    }

    pub(super) fn sync(&self) -> bool {
        lock(&self.state).sync
    }
}

/// Whether every bucket holds only zeros; in pieces, since `any` makes a boolean copy of its input.
fn all_zero(buckets: &[Bucket]) -> Result<bool> {
    const PIECE: i64 = 1 << 16;
    for b in buckets {
        let n = b.flat.numel() as i64;
        let mut start = 0;
        while start < n {
            let k = PIECE.min(n - start);
            if b.flat.f_narrow(0, start, k)?.f_any()?.f_int64_value(&[])? != 0 {
                return Ok(false);
            }
            start += k;
        }
    }
    Ok(true)
}

fn reset_iteration(st: &mut State) {
    st.active = false;
    st.in_flight.clear();
    if let Some(sink) = st.sink.as_mut() {
        sink.reset();
    }
    st.next_launch = 0;
    st.ready.iter_mut().for_each(|r| *r = false);
    st.has_grad.iter_mut().for_each(|r| *r = false);
    st.pending = st.buckets.iter().map(|b| b.params.len()).collect();
    if !st.rebuilt && st.ready_order.len() != st.params.len() {
        st.ready_order.clear();
    }
}

/// Allocates one flat buffer per bucket and a view per parameter; with bucket views, existing gradients
/// move into their views, or with `zero_views` every gradient becomes its (zeroed) view.
fn init_buckets(st: &mut State, cfg: &Config, assignment: Vec<Vec<usize>>, zero_views: bool) -> Result<()> {
    let _g = tch::no_grad_guard();
    st.buckets.clear(); // frees the old buffers once grads no longer point into them (below)
    let mut buckets = Vec::with_capacity(assignment.len());
    for (b, params) in assignment.into_iter().enumerate() {
        let first = &st.params[params[0]];
        let total: i64 = params.iter().map(|&i| st.specs[i].numel as i64).sum();
        let flat = Tensor::f_zeros([total], (first.kind(), first.device()))?;
        let mut views = Vec::with_capacity(params.len());
        let mut offsets = Vec::with_capacity(params.len());
        let mut off = 0i64;
        for (k, &i) in params.iter().enumerate() {
            let n = st.specs[i].numel as i64;
            offsets.push(off);
            let view = bucket::slot(&flat, off, &st.params[i].size())?;
            off += n;
            st.loc[i] = (b, k);
            if zero_views {
                hooks::set_grad(&st.params[i], Some(&view))?;
            } else if cfg.bucket_view {
                let grad = st.params[i].grad();
                if grad.defined() {
                    view.shallow_clone().f_copy_(&grad)?;
                    hooks::set_grad(&st.params[i], Some(&view))?;
                }
            }
            views.push(view);
        }
        buckets.push(Bucket { flat, params, views, offsets, numel: total });
    }
    st.buckets = buckets;
    st.pending = st.buckets.iter().map(|b| b.params.len()).collect();
    Ok(())
}

/// Sums the gradients of `params` over `group`, one message per dtype (a parameter without a gradient
/// here sends zeros, and gets the sum as its gradient).
fn sum_grads_over(group: &ProcessGroup, params: &[Tensor]) -> Result<()> {
    let grads: Vec<Tensor> = params
        .iter()
        .map(|p| {
            let g = p.grad();
            if g.defined() {
                Ok(g)
            } else {
                let z = p.f_zeros_like()?;
                crate::hooks::set_grad(p, Some(&z))?;
                Ok(z)
            }
        })
        .collect::<Result<_>>()?;
    let mut kinds: Vec<tch::Kind> = grads.iter().map(|g| g.kind()).collect();
    kinds.dedup();
    let _l = crate::flight::label("DDP: gradients summed over their replicas");
    for kind in kinds.iter().enumerate().filter(|(i, k)| !kinds[..*i].contains(k)).map(|(_, k)| *k) {
        let these: Vec<&Tensor> = grads.iter().filter(|g| g.kind() == kind).collect();
        let flat: Vec<Tensor> = these.iter().map(|g| g.f_reshape([-1])).collect::<std::result::Result<_, _>>()?;
        let mut buf = Tensor::f_cat(&flat, 0)?;
        group.allreduce_unverified(&mut buf, crate::group::ReduceOp::Sum)?.wait()?;
        let mut at = 0;
        for g in these {
            let n = g.numel() as i64;
            g.shallow_clone().f_copy_(&buf.f_narrow(0, at, n)?.f_view_as(g)?)?;
            at += n;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::{GroupOptions, ProcessGroup};
    use crate::store::Store;

    #[derive(Debug, Default)]
    struct Record(Mutex<Vec<usize>>);

    impl CommHook for Record {
        fn run(&self, _pg: &Arc<ProcessGroup>, bucket: &GradBucket) -> Result<HookFuture> {
            self.0.lock().unwrap().push(bucket.index);
            Ok(HookFuture::ready())
        }
    }

    /// Two autograd threads (two devices) complete buckets 0 and 1; the one with bucket 1 gets to post
    /// first. NCCL runs a group's collectives in posting order, so every rank must post bucket 0 first.
    #[test]
    fn buckets_are_posted_in_bucket_order_whichever_thread_completes_them() {
        let pg = Arc::new(ProcessGroup::new(&Store::hash().unwrap(), 0, 1, &GroupOptions::default()).unwrap());
        let record = Arc::new(Record::default());
        let cfg = Config {
            world: 1,
            bucket_view: false,
            find_unused: true,
            first_bucket_bytes: 1,
            bucket_bytes: 1,
            comm_hook: Some(record.clone()),
        };
        let params = vec![Tensor::zeros([8], tch::kind::FLOAT_CPU), Tensor::zeros([8], tch::kind::FLOAT_CPU)];
        let r = Reducer::new(pg, cfg, params, vec!["a".into(), "b".into()], vec![], vec![]).unwrap();
        let launch = |nb: usize| {
            let st = lock(&r.state);
            Launch::Reduce(GradBucket {
                index: nb,
                count: st.buckets.len(),
                buffer: st.buckets[nb].flat.shallow_clone(),
                gradients: vec![],
            })
        };
        assert_eq!(lock(&r.state).buckets.len(), 2, "one bucket per parameter");
        let (l0, l1) = (launch(0), launch(1));
        let second = {
            let r = r.clone();
            std::thread::spawn(move || r.start(vec![l1]))
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        r.start(vec![l0]).unwrap();
        second.join().unwrap().unwrap();
        assert_eq!(*record.0.lock().unwrap(), vec![0, 1]);
    }
}
