//! What the units of one FSDP model share: their flat parameters, where each is (sharded, being gathered,
//! gathered), the order of this iteration's forwards, and the bookkeeping of one backward.
//!
//! Every step takes what it needs under the lock, lets go, runs its collectives, and comes back to record
//! the result: no lock is held across a collective.
//!
//! Gradients are reduce-scattered unit by unit in the reverse order of the forwards, once a unit's last
//! gradient has arrived (FSDP's post-backward): at the next unit's pre-backward, or at the end of
//! backward. Not from the gradient's hook itself: autograd holds the gradient until its hook returns, and
//! the reduction frees it before the shard's gradient takes memory of its own. The order is the same on
//! every rank, so the ring's messages pair up even where ranks' gradients arrive in different orders; a
//! unit some of whose parameters got no gradient waits for the end of backward and is reduced there, with
//! zeros for them.
//! With resharding off, each reduction is left running through the next unit's backward and finished
//! before the next one starts (FSDP2's overlap).
//!
//! On CUDA, as FSDP2: prefetched gathers run on a stream of their own and reduce-scatters on another, so
//! that a unit's gather overlaps the compute of the unit before it, and its reduce-scatter the backward
//! of the unit after it. The compute stream waits on events, never the host: for a prefetch before the
//! unit computes, for the last reduction before a new one starts (one in flight, as FSDP2, so that its
//! buffers are free to reuse) and at the end of backward. With pinned offload the host waits once, at the
//! end of backward, for the copies of shards and gradients (FSDP2's `grad_offload_event`).
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use tch::{Device, Kind, Tensor};

use super::flat_param::{FlatParam, ReduceInFlight};
use super::replicas::Replicas;
use crate::error::{Error, Result};
use crate::group::loop_check::{agree_on_loop, LoopPhase};
use crate::group::{ProcessGroup, Scope};
use crate::hooks;
use crate::stream::{Event, Stream};
use crate::work::Work;

/// How FSDP's loop check ends: FSDP has no `join`.
const UNEVEN_HINT: &str = " (FSDP has no `join` for uneven inputs: give every rank the same number of batches, \
     as `DistributedSampler` does by padding; DDP offers `ddp.join(..)`)";

pub(crate) struct Config {
    pub reshard_after_forward: bool,
    pub prefetch: usize,
    pub reduce_dtype: Option<Kind>,
}

enum Phase {
    Sharded,
    /// A prefetch left these steps running (on the gather stream, up to the event, on CUDA).
    InFlight(Vec<Work>, Option<Event>),
    Gathered,
    /// A thread is gathering or freeing it right now.
    Busy,
}

/// What a unit is to the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A layer or block: gathered for its forward and again for its backward.
    Layer,
    /// The root: gathered by the model's forward, kept until the end of backward.
    Root,
    /// Small parameters of the layers: gathered with the first forward of an iteration, kept until the
    /// end of backward.
    Small,
}

struct Unit {
    name: String,
    flat: FlatParam,
    phase: Phase,
    role: Role,
    /// Parameters that get gradients, and how many have this backward.
    expected: usize,
    arrived: usize,
}

struct State {
    units: Vec<Unit>,
    /// Units in the order their forwards began this iteration, and last iteration (for prefetching).
    order: Vec<usize>,
    last_order: Vec<usize>,
    /// Reductions done this backward, counted along the reversed `order`.
    reduced: usize,
    /// The end-of-backward callback is queued: a backward is running.
    in_backward: bool,
    sync: bool,
    /// Off: a backward leaves its units gathered, and the next forward uses them as they are (FSDP2's
    /// `set_reshard_after_backward(False)`, between a pipeline step's microbatches).
    reshard_after_backward: bool,
    /// This backward's first error, of its kind (a lost peer stays a peer failure).
    error: Option<Error>,
    /// The memory of the unit reduced and freed last in backward, for the gather that follows in the same
    /// pre-backward step: handed over, not returned to the allocator (see FlatParam::release); dropped
    /// before the unit's backward computes.
    spare: Option<Tensor>,
    /// With resharding off: the reduction left running through the next unit's backward (FSDP2's
    /// overlap, one at a time), its unit `Busy` until it is finished.
    in_flight: Option<InFlight>,
    /// On CUDA: the end of the last reduction on the reduce stream, not yet waited for by the compute
    /// stream.
    last_reduce: Option<Event>,
    /// Forwards and backwards of the model so far, for the loop check.
    forwards: i64,
    backwards: i64,
}

/// FSDP2's side streams of the device the units compute on.
struct Streams {
    device: Device,
    gather: Stream,
    reduce: Stream,
}

struct InFlight {
    unit: usize,
    flat: FlatParam,
    reduce: ReduceInFlight,
}

pub(crate) struct Runtime {
    pub pg: Arc<ProcessGroup>,
    /// HSDP: the replicas of the shards (see FsdpOptions::replicate_group and FsdpOptions::replicas).
    pub replicate: Option<Arc<dyn Replicas>>,
    pub cfg: Config,
    st: Mutex<State>,
    /// Made with the first unit on CUDA; none off CUDA.
    streams: OnceLock<Streams>,
    /// `FsdpBuilder::finish` ran: the root unit exists and the VarStore holds the shards.
    finished: std::sync::atomic::AtomicBool,
}

enum Job {
    Nothing,
    Wait(Vec<Work>, Option<Event>),
    Start,
}

/// Makes the compute (current) stream of `device` wait for `e`, if there is one.
fn compute_waits(device: Device, e: Option<Event>) -> Result<()> {
    if let (Some(e), Some(compute)) = (e, Stream::current_if_cuda(device)?) {
        e.block(&compute)?;
    }
    Ok(())
}

/// Waits for every work, even after one failed (their memory may be freed next), and reports the first
/// failure.
fn wait_all(works: Vec<Work>) -> Result<()> {
    let mut r = Ok(());
    for w in works {
        let x = w.wait();
        if r.is_ok() {
            r = x;
        }
    }
    r
}

impl Runtime {
    pub(crate) fn new(pg: Arc<ProcessGroup>, replicate: Option<Arc<dyn Replicas>>, cfg: Config) -> Runtime {
        let st = State {
            units: Vec::new(),
            order: Vec::new(),
            last_order: Vec::new(),
            reduced: 0,
            in_backward: false,
            sync: true,
            reshard_after_backward: true,
            error: None,
            spare: None,
            in_flight: None,
            last_reduce: None,
            forwards: 0,
            backwards: 0,
        };
        Runtime { pg, replicate, cfg, st: Mutex::new(st), streams: OnceLock::new(), finished: Default::default() }
    }

    /// The side streams for units computing on `device`: none off CUDA, or on another device than the
    /// first unit's.
    fn streams_for(&self, device: Device) -> Option<&Streams> {
        self.streams.get().filter(|s| s.device == device)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Poisoned only by a panic between two lines of bookkeeping; the state is still consistent.
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a unit (gathered, as FlatParam::new leaves it) and returns its index.
    pub(crate) fn add_unit(&self, name: String, flat: FlatParam, role: Role) -> Result<usize> {
        let device = flat.device();
        if self.streams.get().is_none() && device.is_cuda() {
            let (gather, reduce) = (Stream::high_priority(device)?, Stream::high_priority(device)?);
            let _ = self.streams.set(Streams { device, gather, reduce });
        }
        let expected = if flat.trainable { flat.slots.len() } else { 0 };
        let mut st = self.lock();
        st.units.push(Unit { name, flat, phase: Phase::Gathered, role, expected, arrived: 0 });
        Ok(st.units.len() - 1)
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().units.len()
    }

    /// Runs `f` on each unit's flat parameter (handles, outside the lock), in unit order. A unit still
    /// being prefetched has its shards in the gathered buffer, written on the gather stream: the compute
    /// stream waits for that first, so that `f` reads them as they are.
    pub(crate) fn for_each<T>(&self, mut f: impl FnMut(usize, &str, &FlatParam) -> Result<T>) -> Result<Vec<T>> {
        let units: Vec<(String, FlatParam)> = {
            let st = self.lock();
            for u in &st.units {
                if let Phase::InFlight(_, Some(e)) = &u.phase {
                    e.block(&Stream::current(u.flat.device())?)?; // queued on the GPU: no wait here
                }
            }
            st.units.iter().map(|u| (u.name.clone(), u.flat.handles())).collect()
        };
        units.iter().enumerate().map(|(i, (n, fp))| f(i, n, fp)).collect()
    }

    pub(crate) fn compute_kind(&self, u: usize) -> Kind {
        self.lock().units[u].flat.compute_kind()
    }

    pub(crate) fn set_sync(&self, on: bool) {
        self.lock().sync = on;
    }

    pub(crate) fn sync(&self) -> bool {
        self.lock().sync
    }

    pub(crate) fn set_reshard_after_backward(&self, on: bool) {
        self.lock().reshard_after_backward = on;
    }

    pub(crate) fn reshard_after_backward(&self) -> bool {
        self.lock().reshard_after_backward
    }

    /// Makes unit `u`'s parameters the gathered ones: finishes its prefetch, or gathers it now.
    pub(crate) fn unshard(&self, u: usize) -> Result<()> {
        let (flat, job, spare) = {
            let mut st = self.lock();
            let unit = &mut st.units[u];
            let job = match std::mem::replace(&mut unit.phase, Phase::Busy) {
                Phase::Gathered => Job::Nothing,
                Phase::InFlight(w, e) => Job::Wait(w, e),
                Phase::Sharded => Job::Start,
                Phase::Busy => {
                    return Err(Error::invalid(
                        "FSDP",
                        format!("unit {} is being gathered or freed by another thread", unit.name),
                    ))
                }
            };
            let flat = unit.flat.handles();
            let spare = if matches!(job, Job::Start) { st.spare.take() } else { None };
            (flat, job, spare)
        };
        let done = match job {
            // already pointing at the gathered values
            Job::Nothing => Ok(()),
            // every step waited for, even after a failure: their memory is freed next if it failed
            Job::Wait(w, e) => compute_waits(flat.device(), e)
                .and(wait_all(w))
                .and_then(|()| flat.finish_gather())
                .and_then(|()| flat.use_full()),
            // on the compute stream, which waits for it at once anyway (FSDP2's unprefetched unshard)
            Job::Start => flat
                .start_gather(&self.pg, u, spare, None)
                .and_then(wait_all)
                .and_then(|()| flat.finish_gather())
                .and_then(|()| flat.use_full()),
        };
        if done.is_err() {
            // sharded again, so that the next gather starts from scratch
            let _ = flat.release(false);
        }
        self.lock().units[u].phase = if done.is_ok() { Phase::Gathered } else { Phase::Sharded };
        done
    }

    /// Starts gathering unit `u` if it is sharded, and returns without waiting.
    fn prefetch(&self, u: usize) -> Result<()> {
        let (flat, spare) = {
            let mut st = self.lock();
            let unit = &mut st.units[u];
            if !matches!(unit.phase, Phase::Sharded) {
                return Ok(());
            }
            unit.phase = Phase::Busy;
            let flat = unit.flat.handles();
            (flat, st.spare.take())
        };
        let _l = crate::flight::label(format!("FSDP prefetch of unit {u}"));
        let side = self.streams_for(flat.device()).map(|s| &s.gather);
        let started =
            flat.start_gather(&self.pg, u, spare, side).and_then(|w| match side.map(Event::record).transpose() {
                Ok(e) => Ok((w, e)),
                Err(e) => {
                    // what was posted finishes (the host waits: there is no event) before its memory goes
                    if let Some(side) = side {
                        let _ = Event::record(side).and_then(|e| e.synchronize());
                    }
                    let _ = wait_all(w);
                    Err(e)
                }
            });
        match started {
            Ok((w, e)) => {
                self.lock().units[u].phase = Phase::InFlight(w, e);
                Ok(())
            }
            Err(e) => {
                let _ = flat.release(false);
                self.lock().units[u].phase = Phase::Sharded;
                Err(e)
            }
        }
    }

    /// Frees unit `u`'s gathered parameters (after any gather of it still running).
    pub(crate) fn reshard(&self, u: usize) -> Result<()> {
        self.reshard_keeping(u, false)
    }

    /// [`reshard`](Self::reshard); with `keep`, its memory is kept as the spare for the gather that
    /// follows in the same step of backward (never across the user's code between units, where it
    /// would count as memory in use).
    fn reshard_keeping(&self, u: usize, keep: bool) -> Result<()> {
        let (flat, works, event) = {
            let mut st = self.lock();
            let unit = &mut st.units[u];
            let (works, event) = match std::mem::replace(&mut unit.phase, Phase::Busy) {
                Phase::Sharded => {
                    unit.phase = Phase::Sharded;
                    return Ok(());
                }
                Phase::InFlight(w, e) => (w, e),
                Phase::Gathered => (Vec::new(), None),
                Phase::Busy => {
                    return Err(Error::invalid(
                        "FSDP",
                        format!("unit {} is being gathered or freed by another thread", unit.name),
                    ))
                }
            };
            (unit.flat.handles(), works, event)
        };
        // the gather stream's copies must be done before the memory goes back to the compute stream
        let waited = compute_waits(flat.device(), event).and(wait_all(works));
        // on CUDA the memory may still be in use on a side stream: no handover
        let keep = keep && self.streams_for(flat.device()).is_none();
        let freed = flat.release(keep);
        let mut st = self.lock();
        st.units[u].phase = Phase::Sharded;
        let freed = freed.map(|spare| {
            if spare.is_some() {
                st.spare = spare; // the one before, if unused, is freed here
            }
        });
        waited.and(freed)
    }

    /// The root's forward begins an iteration: the order of forwards is recorded afresh (after a backward
    /// that failed before its end, what it left is cleaned up first).
    pub(crate) fn begin_iteration(&self) -> Result<()> {
        if self.lock().in_backward {
            self.recover();
        }
        self.check_loop(LoopPhase::Forward)?;
        // Units still gathered from a forward without backward (evaluation) are freed, so this forward
        // sees shards changed since (an optimizer step, a loaded checkpoint); with resharding after
        // backward off, the units a backward kept are this forward's (no step comes between).
        if self.reshard_after_backward() {
            for u in 0..self.len() {
                self.reshard(u)?;
            }
        }
        let mut st = self.lock();
        st.order.clear();
        st.reduced = 0;
        st.units.iter_mut().for_each(|x| x.arrived = 0);
        Ok(())
    }

    /// Before unit `u`'s forward: records the order, gathers `u` (and, the first time in an iteration, the
    /// units of small parameters) and prefetches the units that followed it last iteration. A forward
    /// inside backward (a checkpointed block recomputed) prefetches nothing: the backward's own
    /// prefetching looks the other way.
    pub(crate) fn begin_forward(&self, u: usize) -> Result<()> {
        let (small, next): (Vec<usize>, Vec<usize>) = {
            let mut st = self.lock();
            // the first forward of an iteration (begin_iteration cleared the order) takes them along
            let small: Vec<usize> = if st.order.is_empty() {
                (0..st.units.len()).filter(|&v| st.units[v].role == Role::Small).collect()
            } else {
                Vec::new()
            };
            st.order.extend(&small);
            if !st.order.contains(&u) {
                st.order.push(u);
            }
            let at = st.last_order.iter().position(|&x| x == u).filter(|_| !st.in_backward);
            let next = at.map(|i| st.last_order.iter().skip(i + 1).take(self.cfg.prefetch).copied().collect());
            (small, next.unwrap_or_default())
        };
        for v in small {
            self.unshard(v)?;
        }
        self.unshard(u)?;
        for v in next {
            self.prefetch(v)?;
        }
        Ok(())
    }

    /// After unit `u`'s forward: frees its parameters, unless it is the root, resharding is off, this is
    /// a recomputation inside backward, or `u`'s forward came last in the last iteration and its output
    /// `has_backward`: in each of the last two, the unit's backward comes next and would gather it again
    /// at once (DeepSpeed's reuse distance; FSDP2 keeps the root only). Unused, it is freed when the next
    /// iteration begins.
    pub(crate) fn end_forward(&self, u: usize, has_backward: bool) -> Result<()> {
        let keep = {
            let st = self.lock();
            let last = has_backward && st.last_order.last() == Some(&u);
            st.units[u].role != Role::Layer || st.in_backward || last
        };
        if self.cfg.reshard_after_forward && !keep {
            self.reshard(u)?;
        }
        Ok(())
    }

    /// The first thing a backward through the model's output does (a marker the root puts on it): the
    /// end-of-backward step is queued here, in the backward the user started. Queued from inside a
    /// nested backward (a checkpointed unit's recomputation), it would run when that one ends.
    pub(crate) fn begin_backward(self: &Arc<Self>) -> Result<()> {
        self.check_loop(LoopPhase::Backward)?;
        self.ensure_end_callback()?;
        // The units of small parameters stay gathered from the iteration's first forward to the end of
        // backward; a second backward of the same forwards (a pipeline's microbatches, after the first
        // one's end freed them) gathers them again here.
        let small: Vec<usize> = {
            let st = self.lock();
            (0..st.units.len()).filter(|&v| st.units[v].role == Role::Small).collect()
        };
        small.into_iter().try_for_each(|v| self.unshard(v))
    }

    /// DDP's loop check, at the root's forward and at the start of its backward: a rank that runs a
    /// forward or backward the others do not (sampling on rank 0, uneven inputs) is named before any of
    /// its gathers pairs with another collective.
    fn check_loop(&self, phase: LoopPhase) -> Result<()> {
        let (device, forwards, backwards) = {
            let mut st = self.lock();
            let counts = (st.forwards, st.backwards);
            match phase {
                LoopPhase::Forward => st.forwards += 1,
                LoopPhase::Backward => st.backwards += 1,
            }
            (st.units.first().map_or(Device::Cpu, |u| u.flat.device()), counts.0, counts.1)
        };
        if !self.pg.checks_now(Scope::Collective, phase.kind(true), device) {
            return Ok(());
        }
        agree_on_loop(&self.pg, "FSDP", phase, forwards, backwards, UNEVEN_HINT)
    }

    /// Just before unit `u`'s backward (its output's gradient is complete): reduces the units whose
    /// gradients are in (before anything is gathered), gathers `u` again and prefetches the units whose
    /// backward comes next.
    pub(crate) fn pre_backward(self: &Arc<Self>, u: usize) -> Result<()> {
        let (next, sync): (Vec<usize>, bool) = {
            let st = self.lock();
            let at = st.order.iter().position(|&x| x == u).unwrap_or(0);
            (st.order[..at].iter().rev().take(self.cfg.prefetch).copied().collect(), st.sync)
        };
        if sync {
            self.reduce_ready(false, true)?;
        }
        self.unshard(u)?;
        for v in next {
            self.prefetch(v)?;
        }
        self.drop_spare();
        Ok(())
    }

    /// The gathers that follow a release have taken its memory or will not: it goes back to the
    /// allocator before the unit's compute allocates.
    fn drop_spare(&self) {
        let spare = self.lock().spare.take();
        drop(spare); // outside the lock
    }

    /// One parameter of unit `u` has its gradient (called from its accumulator's hook). Counted only: the
    /// reduction waits until autograd lets go of the gradient (see the module's note).
    pub(crate) fn grad_arrived(self: &Arc<Self>, u: usize) {
        // one lock per gradient on this hot path: the end-of-backward flag (normally set by the root's
        // marker already) and the arrival count together
        let queue = {
            let mut st = self.lock();
            let queue = !st.in_backward;
            st.in_backward = true;
            if st.sync {
                st.units[u].arrived += 1;
            }
            queue
        };
        if queue {
            if let Err(e) = self.queue_end_callback() {
                self.record(e);
            }
        }
    }

    fn record(&self, e: Error) {
        let mut st = self.lock();
        if st.error.is_none() {
            st.error = Some(e);
        }
    }

    fn ensure_end_callback(self: &Arc<Self>) -> Result<()> {
        {
            let mut st = self.lock();
            if st.in_backward {
                return Ok(());
            }
            st.in_backward = true;
        }
        self.queue_end_callback()
    }

    /// Queues the end-of-backward step in the running backward (the caller has set `in_backward`).
    fn queue_end_callback(self: &Arc<Self>) -> Result<()> {
        let weak: Weak<Runtime> = Arc::downgrade(self);
        hooks::queue_backward_callback(move || match weak.upgrade() {
            Some(rt) => rt.end_backward(),
            None => Err(Error::invalid("FSDP backward", "the FSDP model was dropped during its backward")),
        })
    }

    /// Reduces, along the reversed forward order, each unit whose gradients are all in; with `force`,
    /// every unit left (missing gradients count as zeros). With `keep`, the last unit freed leaves its
    /// memory as the spare, for the gather the caller starts next.
    fn reduce_ready(&self, force: bool, keep: bool) -> Result<()> {
        loop {
            let (u, flat) = {
                let mut st = self.lock();
                if st.error.is_some() {
                    return Ok(());
                }
                let Some(&u) = st.order.iter().rev().nth(st.reduced) else { return Ok(()) };
                let (expected, arrived) = (st.units[u].expected, st.units[u].arrived);
                if expected > 0 && !force && arrived < expected {
                    return Ok(());
                }
                st.reduced += 1;
                if expected == 0 {
                    continue; // frozen: nothing to reduce
                }
                (u, st.units[u].flat.handles())
            };
            // never a spare beside a reduction's buffers; one reduction running at a time, finished in
            // the same order on every rank
            self.drop_spare();
            self.finish_in_flight()?;
            // A gathered unit lends the reduction the other ranks' chunks and is freed after it;
            // otherwise the gathered parameters go first, so the reduction's buffer takes their place.
            let gathered = {
                let mut st = self.lock();
                let g = matches!(st.units[u].phase, Phase::Gathered);
                if g {
                    st.units[u].phase = Phase::Busy;
                }
                g
            };
            if !gathered {
                self.reshard(u)?;
            }
            let _l = crate::flight::label(format!("FSDP reduce-scatter of unit {u}"));
            let reduce = self.cfg.reduce_dtype.unwrap_or(flat.compute_kind());
            // the mean over every rank that computed a gradient: the shard group's, times the replicas'
            let divisor = (self.pg.size() * self.replicate.as_ref().map_or(1, |r| r.count().max(1))) as f64;
            let side = self.streams_for(flat.device()).map(|s| &s.reduce);
            if side.is_some() {
                // one reduction on the reduce stream at a time: the compute stream waits for the last
                // one here, after the backward it overlapped, so that its buffers are free to reuse
                let last = self.lock().last_reduce.take();
                if let Err(e) = compute_waits(flat.device(), last) {
                    self.restore_gathered(u, gathered)?;
                    return Err(e);
                }
            }
            // With resharding off no gather follows in backward, so the unit's buffers may stay while the
            // next unit's backward computes (4 MB more in the benchmark, far under FSDP2's peak there);
            // with it on, they would add to the peak at every unit.
            if gathered && !force && !self.cfg.reshard_after_forward {
                match flat.start_reduce(&self.pg, u, reduce, divisor, true, side) {
                    Ok(r) => {
                        self.lock().in_flight = Some(InFlight { unit: u, flat, reduce: r });
                        continue;
                    }
                    Err(e) => {
                        self.restore_gathered(u, true)?;
                        return Err(e);
                    }
                }
            }
            let mut reduced = flat.reduce_grads(&self.pg, u, reduce, divisor, gathered, side);
            if let (Ok(()), Some(side)) = (&reduced, side) {
                match Event::record(side) {
                    Ok(e) => self.lock().last_reduce = Some(e),
                    Err(e) => reduced = Err(e),
                }
            }
            if gathered {
                self.lock().units[u].phase = Phase::Gathered;
                self.reshard_keeping(u, keep)?;
            }
            reduced?;
        }
    }

    /// After a failure with unit `u` taken for a reduction (`Busy`, when `gathered`): gathered again,
    /// then freed.
    fn restore_gathered(&self, u: usize, gathered: bool) -> Result<()> {
        if gathered {
            self.lock().units[u].phase = Phase::Gathered;
            self.reshard(u)?;
        }
        Ok(())
    }

    /// Waits for the reduction left running, and frees its unit.
    fn finish_in_flight(&self) -> Result<()> {
        let Some(f) = self.lock().in_flight.take() else { return Ok(()) };
        let device = f.flat.device();
        let done = {
            let _l = crate::flight::label(format!("FSDP reduce-scatter of unit {}", f.unit));
            f.flat.finish_reduce(&self.pg, f.reduce)
        };
        let done = match (done, self.streams_for(device)) {
            (Ok(()), Some(s)) => Event::record(&s.reduce).map(|e| self.lock().last_reduce = Some(e)),
            (d, _) => d,
        };
        self.lock().units[f.unit].phase = Phase::Gathered;
        let freed = self.reshard(f.unit);
        done.and(freed)
    }

    /// The end of a backward: reduces what is left, frees every gathered unit (unless resharding after
    /// backward is off: a reduction frees its unit anyway), and reports the first error of this
    /// backward (the backward fails with it).
    fn end_backward(&self) -> Result<()> {
        let (sync, reshard) = {
            let st = self.lock();
            (st.sync, st.reshard_after_backward)
        };
        let mut r = if sync { self.reduce_ready(true, false) } else { Ok(()) };
        let finished = self.finish_in_flight();
        if r.is_ok() {
            r = finished;
        }
        for u in (0..self.len()).filter(|_| reshard) {
            let freed = self.reshard(u);
            if r.is_ok() {
                r = freed;
            }
        }
        let synced = self.sync_streams();
        if r.is_ok() {
            r = synced;
        }
        let mut st = self.lock();
        st.spare = None;
        st.in_backward = false;
        st.last_order = st.order.clone();
        st.reduced = 0;
        st.units.iter_mut().for_each(|x| x.arrived = 0);
        match st.error.take() {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// The end of backward on CUDA: the compute stream waits for the last reduction, so that what runs
    /// next (clipping, the optimizer) reads the shards' gradients; with pinned offload the host waits
    /// too, for the copies of the gradients to the host and of the shards to the GPU, before a host
    /// optimizer reads the one and writes the other.
    fn sync_streams(&self) -> Result<()> {
        let last = self.lock().last_reduce.take();
        let waited = match self.streams.get() {
            Some(s) => compute_waits(s.device, last),
            None => Ok(()),
        };
        waited.and(self.wait_for_pinned_copies())
    }

    /// With pinned offload: the host waits for the copies between the shards (and their gradients) and
    /// the GPU queued so far, before anything on the host reads or writes them.
    pub(crate) fn wait_for_pinned_copies(&self) -> Result<()> {
        let mut devices: Vec<Device> =
            self.lock().units.iter().filter(|u| u.flat.pinned()).map(|u| u.flat.device()).collect();
        devices.dedup();
        for d in devices {
            Event::record(&Stream::current(d)?)?.synchronize()?;
        }
        Ok(())
    }

    /// After a backward that failed before its end: free what is gathered, forget its bookkeeping.
    fn recover(&self) {
        // waited for, not dropped: its receive writes into the unit's buffer, which is freed next
        let _ = self.finish_in_flight();
        for u in 0..self.len() {
            let _ = self.reshard(u);
        }
        let _ = self.sync_streams();
        let mut st = self.lock();
        st.spare = None;
        st.in_backward = false;
        st.error = None;
        st.reduced = 0;
        st.units.iter_mut().for_each(|x| x.arrived = 0);
    }

    /// This rank's shards with their parameters' names, unit by unit (what the optimizer steps).
    pub(crate) fn shards(&self) -> Vec<(String, Tensor)> {
        let st = self.lock();
        st.units.iter().flat_map(|u| u.flat.slots.iter().map(|s| (s.name.clone(), s.shard.shallow_clone()))).collect()
    }

    /// Records every parameter's placement: this rank's shard holds its flat chunk over the group.
    pub(crate) fn record_placements(&self) -> Result<()> {
        type Placed = (Tensor, Vec<i64>, Tensor, i64);
        let slots: Vec<Placed> = {
            let st = self.lock();
            st.units
                .iter()
                .flat_map(|u| {
                    u.flat
                        .slots
                        .iter()
                        .map(|s| (s.param.shallow_clone(), s.shape.clone(), s.shard.shallow_clone(), s.chunk))
                })
                .collect()
        };
        let rank = self.pg.rank() as i64;
        for (param, shape, shard, chunk) in slots {
            crate::placement::record_flat_shard(&param, &shape, &shard, &self.pg, rank * chunk)?;
            if let Some(r) = self.replicate.as_ref().and_then(|r| r.group()) {
                for t in [&param, &shard] {
                    crate::placement::record_along(t, r, crate::placement::Placement::Replicate)?;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn mark_finished(&self) {
        self.finished.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// An error naming unit `id` when the model it belongs to was never finished.
    pub(crate) fn check_finished(&self, id: usize) -> Result<()> {
        if self.finished.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let name = self.unit_names().get(id).cloned().unwrap_or_default();
        Err(Error::invalid(
            format!("FSDP unit {name:?}"),
            "its model was never finished: call plan.finish(&vs, model) (plan.build does) or FsdpBuilder::finish \
             before the first forward; without it the variables no unit took are never reduced and the \
             VarStore does not hold the shards the optimizer must step",
        ))
    }

    pub(crate) fn unit_names(&self) -> Vec<String> {
        self.lock().units.iter().map(|u| u.name.clone()).collect()
    }
}
