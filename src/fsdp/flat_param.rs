//! One unit's parameters: sharded one by one (FSDP2's per-parameter sharding), gathered into one flat
//! buffer. Parameter i, padded to a multiple of the world size, occupies `world * chunk_i` elements of the
//! buffer; rank r owns its r-th chunk, a shard that is a tensor of its own (what the optimizer steps).
//!
//! Between uses only the shards exist. The gathered buffer (`full`) keeps its storage object but not its
//! memory, and the parameters point at an empty placeholder, so a stray read finds a tensor with no
//! elements rather than freed memory. Gathering fills `full` again and points the parameters at views of
//! it; tensors autograd saved during forward share that storage and see the data again.
//!
//! The views (each parameter's in `full`, each rank's chunks, the stage's rows) are made once: the
//! storages outlive their frees and allocations, and a gather then costs its copies and collectives, not
//! a view per parameter per step (FSDP2 keeps its views from initialisation too).
//!
//! While a unit gathered one parameter at a time is gathered, from the start of its gather, its shards
//! live inside `full` (their own storage is given up and taken back when the unit is freed), so a
//! gathered or prefetched unit costs its full size, not full size plus shards. Not with mixed precision
//! or offload, where shard and buffer differ in dtype or device, nor for a coalesced unit, whose shards
//! are copied straight into the stage (FSDP2's copy-in) and stay where they are: moving them in and out
//! would cost two copies per parameter per gather to save a shard's size.
//!
//! A coalesced unit is gathered and reduced in one message, not one per parameter: its rank-major copy
//! (`stage`: rank 0's chunks of every parameter, then rank 1's, ...) travels, copied in and out by one
//! kernel each (FSDP2's foreach_all_gather / foreach_reduce). Every unit is coalesced under NCCL's rules
//! (the NCCL engine, or the strict mode standing in for it), where a collective's fixed cost dominates;
//! on Gloo only a unit of small parameters (FsdpOptions::gather_once_below) is, where the copies cost
//! little and the messages saved are round trips. `stage` costs one unit's gathered size while a gather
//! is in flight, as FSDP2's all-gather output does.
//!
//! HSDP (a replicate group beside the shard group): a unit is sharded within the shard group and the
//! same shards are held by every replica; a reduce-scattered chunk is then summed across the replicas
//! before it becomes the shard's gradient (FSDP2's HSDP: reduce-scatter, then all-reduce).
//!
//! On CUDA a gather or a reduction may run on a side stream (FSDP2's): the caller passes it, and this
//! file orders the side stream after the compute stream's work it depends on and records on it the
//! compute stream's memory it uses ([`stream::record_stream`]). Offloaded shards and their gradients
//! live in pinned host memory, copied to and from the GPU without blocking; the runtime makes the host
//! wait for the copies once, at the end of backward, before a host optimizer reads them.
use std::collections::VecDeque;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use super::replicas::Replicas;
use crate::error::{Error, Result};
use crate::group::flat::{self, Reduction};
use crate::group::ProcessGroup;
use crate::stream::{self, Stream, StreamGuard};
use crate::work::Work;
use crate::{hooks, storage};

/// A copy of `t` with storage of its own.
pub(crate) fn copied(t: &Tensor) -> Result<Tensor> {
    let mut out = t.f_empty_like()?;
    out.f_copy_(t)?;
    Ok(out)
}

/// A copy of `t` in pinned host memory.
fn pinned_copy(t: &Tensor) -> Result<Tensor> {
    let out = stream::empty_pinned(&t.size(), t.kind())?;
    out.shallow_clone().f_copy_(t)?;
    Ok(out)
}

/// Makes `side`, when there is one, wait for the compute stream's work so far and current until the
/// guard drops.
fn enter(side: Option<&Stream>, device: Device) -> Result<Option<StreamGuard>> {
    let Some(side) = side else { return Ok(None) };
    if let Some(compute) = Stream::current_if_cuda(device)? {
        side.wait_stream(&compute)?;
    }
    Ok(Some(StreamGuard::new(side)?))
}

/// One parameter's place.
pub(crate) struct Slot {
    pub name: String,
    /// The module's own variable (the VarStore's tensor).
    pub param: Tensor,
    pub shape: Vec<i64>,
    pub numel: i64,
    /// Elements per rank (the padded count over the world size).
    pub chunk: i64,
    /// Where its padded region starts in `full`.
    pub offset: i64,
    /// Real (unpadded) elements of this rank's chunk.
    pub own: i64,
    /// This rank's chunk, a flat leaf in the parameter's dtype on the shard device.
    pub shard: Tensor,
    /// The parameter's gathered value: its region of `full` in its shape.
    view: Tensor,
    /// This rank's chunk in `full`, its padding included, and without it.
    mine_padded: Tensor,
    mine: Tensor,
    /// The slot's padded region of `full`, flat and as `world` rows of its chunk (where the stage's rows
    /// go).
    region: Tensor,
    by_rank: Tensor,
    /// Zeros in the compute dtype, where this rank's chunk is padding (copied into the stage after the
    /// shard).
    pad: Option<Tensor>,
}

impl Slot {
    fn handles(&self) -> Slot {
        Slot {
            name: self.name.clone(),
            param: self.param.shallow_clone(),
            shape: self.shape.clone(),
            numel: self.numel,
            chunk: self.chunk,
            offset: self.offset,
            own: self.own,
            shard: self.shard.shallow_clone(),
            view: self.view.shallow_clone(),
            mine_padded: self.mine_padded.shallow_clone(),
            mine: self.mine.shallow_clone(),
            region: self.region.shallow_clone(),
            by_rank: self.by_rank.shallow_clone(),
            pad: self.pad.as_ref().map(Tensor::shallow_clone),
        }
    }
}

pub(crate) struct FlatParam {
    pub slots: Vec<Slot>,
    /// Every slot's padded region, in the compute dtype on the compute device; storage freed while sharded.
    pub full: Tensor,
    placeholder: Tensor,
    rank: i64,
    world: i64,
    pub trainable: bool,
    /// The shards live apart from the compute buffers (FsdpOptions::offload), even on the same device.
    pub offloaded: bool,
    /// Offloaded from a GPU: shards and their gradients in pinned host memory, copied without blocking.
    pinned: bool,
    /// The shards move into `full` while the unit is gathered.
    home: bool,
    /// Gathered and reduced in one message through `stage` (more than one rank only).
    pub coalesced: bool,
    /// The rank-major copy of `full` that travels when `coalesced`; storage freed between uses.
    stage: Tensor,
    /// This rank's row of `stage`, and `stage` as `world` rows.
    row: Tensor,
    stage_rows: Tensor,
    /// HSDP: the replicas of these shards, across which reduced chunks are summed.
    replicate: Option<Arc<dyn Replicas>>,
}

/// How a unit is laid out: see [`FlatParam::new`].
pub(crate) struct Settings {
    /// The dtype the unit computes in (`None`: the parameters').
    pub compute: Option<Kind>,
    /// Where the shards live (`None`: with the parameters).
    pub shard_device: Option<Device>,
    /// Start from rank 0's values (of the shard group, then of the replicate group).
    pub sync: bool,
    /// Gathered and reduced in one message.
    pub coalesced: bool,
    pub replicate: Option<Arc<dyn Replicas>>,
}

impl FlatParam {
    /// Shards `params` (one dtype and device; named) over `pg`: rank 0's values when `sync`. Returns
    /// with the parameters gathered (views of `full`), so that hooks registered now see their real
    /// shapes.
    pub(crate) fn new(pg: &ProcessGroup, unit: &str, named: Vec<(String, Tensor)>, set: Settings) -> Result<FlatParam> {
        let Settings { compute, shard_device, sync, coalesced, replicate } = set;
        let _g = tch::no_grad_guard();
        let first = named.first().ok_or_else(|| Error::invalid("FSDP", format!("unit {unit} has no parameters")))?;
        let (kind, device, trainable) = (first.1.kind(), first.1.device(), first.1.requires_grad());
        for (n, p) in &named {
            if p.kind() != kind || p.device() != device {
                return Err(Error::invalid(
                    "FSDP",
                    format!(
                        "unit {unit}: parameter {n} is {:?} on {:?} but {} is {kind:?} on {device:?}; a unit's parameters share one dtype and device",
                        p.kind(),
                        p.device(),
                        first.0
                    ),
                ));
            }
            if p.requires_grad() != trainable {
                return Err(Error::invalid(
                    "FSDP",
                    format!(
                        "unit {unit} mixes frozen and trainable parameters ({n} and {}); give the frozen ones a unit of their own",
                        first.0
                    ),
                ));
            }
        }
        let (rank, world) = (pg.rank() as i64, pg.size() as i64);
        let mut layout = Vec::with_capacity(named.len());
        let mut total = 0;
        for (_, p) in &named {
            let numel = p.numel() as i64;
            let chunk = (numel + world - 1) / world;
            layout.push((numel, chunk, total));
            total += world * chunk;
        }
        let full = Tensor::f_zeros([total], (kind, device))?;
        for ((_, p), &(numel, _, offset)) in named.iter().zip(&layout) {
            full.f_narrow(0, offset, numel)?.f_copy_(&p.f_reshape([-1])?)?;
        }
        if sync {
            let _l = crate::flight::label(format!("FSDP: rank 0's parameters of unit {unit}"));
            for g in std::iter::once(pg)
                .chain(replicate.as_ref().and_then(|r| r.group()).map(|g| &**g))
                .filter(|g| g.size() > 1)
            {
                g.broadcast(&mut full.shallow_clone(), 0)?;
            }
        }
        let offloaded = shard_device.is_some();
        let shard_device = shard_device.unwrap_or(device);
        let pinned = offloaded && device.is_cuda() && shard_device == Device::Cpu;
        let compute = compute.unwrap_or(kind);
        let shards = named
            .iter()
            .zip(&layout)
            .map(|(_, &(numel, chunk, offset))| {
                let own = (numel - rank * chunk).clamp(0, chunk);
                let mine = full.f_narrow(0, offset + rank * chunk, own)?.f_to_device(shard_device)?;
                let shard = if pinned { pinned_copy(&mine)? } else { copied(&mine)? };
                Ok((own, shard.set_requires_grad(trainable)))
            })
            .collect::<Result<Vec<_>>>()?;
        let full = if compute == kind { full } else { full.f_to_kind(compute)? };
        let mut slots = Vec::with_capacity(named.len());
        for (((name, param), &(numel, chunk, offset)), (own, shard)) in named.into_iter().zip(&layout).zip(shards) {
            let shape = param.size();
            let mine_padded = full.f_narrow(0, offset + rank * chunk, chunk)?;
            let region = full.f_narrow(0, offset, world * chunk)?;
            slots.push(Slot {
                view: full.f_narrow(0, offset, numel)?.f_view(shape.as_slice())?,
                mine: mine_padded.f_narrow(0, 0, own)?,
                mine_padded,
                by_rank: region.f_view([world, chunk])?,
                region,
                pad: (own < chunk).then(|| Tensor::f_zeros([chunk - own], (compute, device))).transpose()?,
                name,
                param,
                shape,
                numel,
                chunk,
                offset,
                own,
                shard,
            });
        }
        let placeholder = Tensor::f_empty([0], (compute, device))?;
        let coalesced = coalesced && world > 1;
        let home = compute == kind && !offloaded && !coalesced;
        let stage = Tensor::f_empty([if coalesced { total } else { 0 }], (compute, device))?;
        let per = total / world;
        let (row, stage_rows) = match coalesced {
            true => (stage.f_narrow(0, rank * per, per)?, stage.f_view([world, per])?),
            false => (stage.shallow_clone(), stage.shallow_clone()),
        };
        storage::free(&stage)?;
        let f = FlatParam {
            slots,
            full,
            placeholder,
            rank,
            world,
            trainable,
            offloaded,
            pinned,
            home,
            coalesced,
            stage,
            row,
            stage_rows,
            replicate,
        };
        f.use_full()?;
        if f.home {
            for s in f.slots.iter().filter(|s| s.own > 0) {
                s.shard.shallow_clone().f_set_data(&s.mine)?;
            }
        }
        Ok(f)
    }

    /// Handles on the same tensors, to work on them without holding the runtime's lock.
    pub(crate) fn handles(&self) -> FlatParam {
        FlatParam {
            slots: self.slots.iter().map(Slot::handles).collect(),
            full: self.full.shallow_clone(),
            placeholder: self.placeholder.shallow_clone(),
            rank: self.rank,
            world: self.world,
            trainable: self.trainable,
            offloaded: self.offloaded,
            pinned: self.pinned,
            home: self.home,
            coalesced: self.coalesced,
            stage: self.stage.shallow_clone(),
            row: self.row.shallow_clone(),
            stage_rows: self.stage_rows.shallow_clone(),
            replicate: self.replicate.clone(),
        }
    }

    pub(crate) fn compute_kind(&self) -> Kind {
        self.full.kind()
    }

    /// Where the unit computes.
    pub(crate) fn device(&self) -> Device {
        self.full.device()
    }

    /// Whether the shards are in pinned host memory, read and written by copies the host must wait for
    /// before it touches them.
    pub(crate) fn pinned(&self) -> bool {
        self.pinned
    }

    /// Elements per rank of the rank-major layout, and each slot's place in a rank's row.
    fn rows(&self) -> (i64, Vec<i64>) {
        let mut at = Vec::with_capacity(self.slots.len());
        let mut per = 0;
        for s in &self.slots {
            at.push(per);
            per += s.chunk;
        }
        (per, at)
    }

    /// Allocates `full` (with `spare`'s memory when it has the size: see [`release`](Self::release)),
    /// puts this rank's chunks in it and starts the all-gathers (rings of sends into place, one per
    /// parameter, or one for a coalesced unit, on the unit's tag); returns what is still running.
    ///
    /// With `side`, the copies and the gathers queue on that stream, after the compute stream's work so
    /// far; `full` and the stage are the compute stream's memory, and the caller makes the compute stream
    /// wait for the side stream before it uses or frees them.
    pub(crate) fn start_gather(
        &self,
        pg: &ProcessGroup,
        index: usize,
        spare: Option<Tensor>,
        side: Option<&Stream>,
    ) -> Result<Vec<Work>> {
        let _g = tch::no_grad_guard();
        match spare {
            Some(sp) if sp.device() == self.full.device() && storage::nbytes(&sp)? == storage::bytes_of(&self.full) => {
                storage::move_into(&self.full, &sp)?
            }
            _ => storage::allocate(&self.full)?,
        }
        if self.coalesced {
            storage::allocate(&self.stage)?;
        }
        let _on = enter(side, self.device())?;
        // a coalesced unit's shards on the compute device go straight into the stage (post_gathers)
        let into_full = !self.coalesced || self.offloaded;
        for s in self.slots.iter().filter(|s| into_full && s.own > 0) {
            if self.pinned {
                stream::copy_non_blocking(&s.mine, &s.shard)?;
            } else {
                s.mine.shallow_clone().f_copy_(&s.shard)?;
            }
            if self.home {
                if let Some(side) = side {
                    // its memory is freed next, while the side stream may not have read it yet
                    stream::record_stream(&s.shard, side)?;
                }
                // moved in now, not when the gather is waited for: a prefetched unit then costs its full
                // size too, not full size plus shards
                s.shard.shallow_clone().f_set_data(&s.mine)?;
            }
        }
        let mut pending = VecDeque::new();
        if let Err(e) = self.post_gathers(pg, index, &mut pending) {
            // what was posted finishes before the caller frees its memory
            for w in pending.into_iter().flatten() {
                let _ = w.wait();
            }
            return Err(e);
        }
        Ok(pending.into_iter().flatten().collect())
    }

    fn post_gathers(&self, pg: &ProcessGroup, index: usize, pending: &mut VecDeque<Vec<Work>>) -> Result<()> {
        let label = format!("FSDP all-gather, unit {index}");
        if self.coalesced {
            // copy-in: this rank's chunk of every parameter (its padding too) side by side, one kernel
            // (FSDP2's): from the shards, cast to the compute dtype on the way, or from `full` where they
            // were copied to the device first
            let chunks: Vec<Tensor> = match self.offloaded {
                true => self.slots.iter().map(|s| s.mine_padded.shallow_clone()).collect(),
                false => self
                    .slots
                    .iter()
                    .flat_map(|s| {
                        [(s.own > 0).then(|| s.shard.shallow_clone()), s.pad.as_ref().map(Tensor::shallow_clone)]
                    })
                    .flatten()
                    .collect(),
            };
            // a unit of zero-element parameters has nothing to gather (and cat refuses an empty list)
            if self.row.numel() > 0 {
                let _ = Tensor::f_cat_out(&self.row, &chunks, 0)?;
                flat::all_gather(pg, &self.stage, self.row.numel() as i64, &label, pending, usize::MAX)?;
            }
        } else if self.world > 1 {
            for s in &self.slots {
                flat::all_gather(pg, &s.region, s.chunk, &label, pending, usize::MAX)?;
            }
        }
        Ok(())
    }

    /// After the gather's messages have arrived: a coalesced unit's rank-major copy goes into place.
    pub(crate) fn finish_gather(&self) -> Result<()> {
        if !self.coalesced {
            return Ok(());
        }
        let _g = tch::no_grad_guard();
        // copy-out: each rank's chunks into every parameter's region, one kernel (FSDP2's
        // split_with_sizes_copy)
        let regions: Vec<Tensor> = self.slots.iter().map(|s| s.by_rank.shallow_clone()).collect();
        let sizes: Vec<i64> = self.slots.iter().map(|s| s.chunk).collect();
        self.stage_rows.f_split_with_sizes_copy_out(&regions, sizes.as_slice(), 1)?;
        storage::free(&self.stage)
    }

    /// Points the parameters at their views of `full` (which must be gathered; the shards moved in when
    /// the gather started).
    pub(crate) fn use_full(&self) -> Result<()> {
        for s in &self.slots {
            s.param.shallow_clone().f_set_data(&s.view)?;
        }
        Ok(())
    }

    /// Takes the shards out of `full` (into storage of their own), points the parameters at the
    /// placeholder and frees `full`'s memory, or with `keep` hands it back in a tensor of its own, for the
    /// next unit's gather. (libtorch's CPU allocator asks glibc for 64-byte aligned blocks, and a freed
    /// block is then a little too small for the next request of its own size: every gather would take
    /// fresh pages, and the process's resident memory grow far past what it uses.)
    pub(crate) fn release(&self, keep: bool) -> Result<Option<Tensor>> {
        let _g = tch::no_grad_guard();
        for s in &self.slots {
            if self.home && s.own > 0 && s.shard.data_ptr() == s.mine.data_ptr() {
                s.shard.shallow_clone().f_set_data(&copied(&s.mine)?)?;
            }
            s.param.shallow_clone().f_set_data(&self.placeholder)?;
        }
        storage::free(&self.stage)?; // a gather waited for by a release only
        if keep && storage::nbytes(&self.full)? > 0 {
            let spare = Tensor::f_empty([0], (Kind::Uint8, self.full.device()))?;
            storage::move_into(&spare, &self.full)?;
            return Ok(Some(spare));
        }
        storage::free(&self.full)?;
        Ok(None)
    }

    /// Bytes `full` holds now (0 while sharded).
    pub(crate) fn gathered_bytes(&self) -> Result<i64> {
        storage::nbytes(&self.full)
    }

    /// Bytes of the shards that have storage of their own (not living in `full`).
    pub(crate) fn shard_bytes(&self) -> Result<i64> {
        let gathered = self.home && self.gathered_bytes()? > 0;
        Ok(if gathered {
            0
        } else {
            self.slots.iter().map(|s| s.own * s.shard.kind().elt_size_in_bytes() as i64).sum()
        })
    }

    /// Reduce-scatters each parameter's gradient, divided by `divisor`, into its shard's gradient
    /// (accumulating into one already there), and drops the parameter's gradient. In place on the
    /// gradient when it has the reduction's dtype and no padding; a parameter without a gradient counts
    /// as zeros.
    ///
    /// Divided where [`Divide`] says: mostly after the sum, on this rank's chunk.
    ///
    /// `in_full`: the unit is still gathered and its backward is over, so the other ranks' chunks of
    /// `full` are free: the reduction receives there, the gradient goes, and only then does the shard's
    /// gradient get memory of its own. Then a rank never holds more than the gathered unit and its
    /// gradient. Only with other ranks, where `full` holds the shards and has the reduction's dtype, and
    /// only once nothing else holds the gradient (autograd does while the gradient's hook runs).
    ///
    /// With `side`, each gradient is copied and divided on the compute stream, and reduced and moved
    /// into its shard's gradient on the side stream, after the compute stream's work so far: the host
    /// does not wait, and the compute stream must wait for the side stream before it reads the shards'
    /// gradients.
    pub(crate) fn reduce_grads(
        &self,
        pg: &ProcessGroup,
        index: usize,
        reduce: Kind,
        divisor: f64,
        in_full: bool,
        side: Option<&Stream>,
    ) -> Result<()> {
        let _g = tch::no_grad_guard();
        let plan = self.plan_reduce(reduce, divisor, in_full, side)?;
        if self.coalesced {
            let (ring, out) = self.start_coalesced(pg, index, reduce, &plan)?;
            return self.finish_coalesced(pg, ring, &out, &plan);
        }
        // one parameter at a time: each gradient is gone before the next reduction starts
        for s in &self.slots {
            let (ring, out) = self.start_slot(pg, index, s, reduce, &plan)?;
            self.finish_slot(pg, s, ring, &out, &plan)?;
        }
        Ok(())
    }

    /// [`reduce_grads`](Self::reduce_grads) left running: every parameter's reduction is posted (a
    /// coalesced unit's one), and [`finish_reduce`](Self::finish_reduce) completes them.
    pub(crate) fn start_reduce(
        &self,
        pg: &ProcessGroup,
        index: usize,
        reduce: Kind,
        divisor: f64,
        in_full: bool,
        side: Option<&Stream>,
    ) -> Result<ReduceInFlight> {
        let _g = tch::no_grad_guard();
        let plan = self.plan_reduce(reduce, divisor, in_full, side)?;
        if self.coalesced {
            let part = self.start_coalesced(pg, index, reduce, &plan)?;
            return Ok(ReduceInFlight { parts: vec![part], plan });
        }
        let mut parts = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            match self.start_slot(pg, index, s, reduce, &plan) {
                Ok(p) => parts.push(p),
                Err(e) => {
                    // the ones posted finish before the caller frees their memory
                    let _on = plan.side.as_ref().map(StreamGuard::new).transpose();
                    for (ring, _) in parts {
                        let _ = ring.finish(pg);
                    }
                    return Err(e);
                }
            }
        }
        Ok(ReduceInFlight { parts, plan })
    }

    /// Completes what [`start_reduce`](Self::start_reduce) posted.
    pub(crate) fn finish_reduce(&self, pg: &ProcessGroup, r: ReduceInFlight) -> Result<()> {
        let _g = tch::no_grad_guard();
        if self.coalesced {
            let Some((ring, out)) = r.parts.into_iter().next() else { return Ok(()) };
            return self.finish_coalesced(pg, ring, &out, &r.plan);
        }
        for (s, (ring, out)) in self.slots.iter().zip(r.parts) {
            self.finish_slot(pg, s, ring, &out, &r.plan)?;
        }
        Ok(())
    }

    /// A reduction with nothing posted yet: its division, and whether it receives into `full` (asked
    /// for, and possible: see [`reduce_grads`](Self::reduce_grads)).
    fn plan_reduce(&self, reduce: Kind, divisor: f64, in_full: bool, side: Option<&Stream>) -> Result<Plan> {
        let in_full =
            in_full && self.world > 1 && self.home && reduce == self.full.kind() && self.gathered_bytes()? > 0;
        if let (true, false, Some(side)) = (in_full, self.coalesced, side) {
            // the side stream receives into it, and it is freed before the compute stream waits for that
            stream::record_stream(&self.full, side)?;
        }
        Ok(Plan { in_full, scale: Divide::new(reduce, divisor), side: side.copied() })
    }

    /// Posts slot `s`'s reduction; returns it and where this rank's sum will be.
    fn start_slot(
        &self,
        pg: &ProcessGroup,
        index: usize,
        s: &Slot,
        reduce: Kind,
        plan: &Plan,
    ) -> Result<(Reduction, Tensor)> {
        let (scale, in_full, side) = (&plan.scale, plan.in_full, plan.side.as_ref());
        let device = self.full.device();
        let padded = self.world * s.chunk;
        let g = s.param.grad();
        let buf = if g.defined() && g.kind() == reduce && s.numel == padded && g.is_contiguous() {
            g.f_view([-1])?
        } else {
            let b = Tensor::f_empty([padded], (reduce, device))?;
            if padded > s.numel {
                let _ = b.f_narrow(0, s.numel, padded - s.numel)?.f_zero_()?;
            }
            let mut head = b.f_narrow(0, 0, s.numel)?;
            if g.defined() {
                // cast first: a product in the gradient's dtype would round before the wider sum
                head.f_copy_(&g.f_reshape([-1])?)?;
            } else {
                let _ = head.f_zero_()?;
            }
            b
        };
        scale.before(&buf)?;
        drop(g);
        hooks::set_grad(&s.param, None)?; // `buf` keeps it alive for the reduction when in place
        let _on = enter(side, device)?;
        if let Some(side) = side {
            stream::record_stream(&buf, side)?;
        }
        let (out, scratch) = if in_full {
            let chunk = |k: i64| self.full.f_narrow(0, s.offset + (self.rank + k) % self.world * s.chunk, s.chunk);
            (chunk(1)?, if self.world > 2 { Some(chunk(2)?) } else { None })
        } else {
            (Tensor::f_empty([s.chunk], (reduce, device))?, None)
        };
        let ring = flat::reduce_scatter(pg, buf, out.shallow_clone(), scratch, reduce_label(index))?;
        Ok((ring, out))
    }

    /// Waits for slot `s`'s reduction and makes its result the shard's gradient.
    fn finish_slot(&self, pg: &ProcessGroup, s: &Slot, ring: Reduction, out: &Tensor, plan: &Plan) -> Result<()> {
        let _on = plan.side.as_ref().map(StreamGuard::new).transpose()?;
        // `finish` consumes the ring and with it the gradient: gone before anything new is made
        ring.finish(pg)?;
        self.across_replicas(out)?;
        // a buffer of its own when `out` lies in `full`, which is freed next
        self.set_shard_grad(s, &out.f_narrow(0, 0, s.own)?, plan.in_full, &plan.scale)
    }

    /// Posts a coalesced unit's reduction: every gradient into one rank-major buffer (FSDP2's copy-in),
    /// one reduce-scatter into this rank's row; returns it and the row.
    fn start_coalesced(
        &self,
        pg: &ProcessGroup,
        index: usize,
        reduce: Kind,
        plan: &Plan,
    ) -> Result<(Reduction, Tensor)> {
        let (scale, side) = (&plan.scale, plan.side.as_ref());
        let (per, _) = self.rows();
        let device = self.full.device();
        // every gradient (zeros where a parameter has none), padded to its chunks and laid out
        // rank-major, in one kernel (FSDP2's _chunk_cat)
        // a parameter of no elements adds no column (and _chunk_cat refuses empty tensors)
        let grads = self
            .slots
            .iter()
            .filter(|s| s.chunk > 0)
            .map(|s| {
                let g = s.param.grad();
                let g = if g.defined() { g.f_reshape([-1])? } else { Tensor::f_zeros([s.numel], (reduce, device))? };
                Ok(if g.kind() == reduce { g } else { g.f_to_kind(reduce)? })
            })
            .collect::<Result<Vec<_>>>()?;
        let buf = Tensor::f_empty([self.world * per], (reduce, device))?;
        let _ = Tensor::f_internal_chunk_cat_out(&buf.f_view([self.world, per])?, &grads, 0, self.world)?;
        drop(grads);
        for s in &self.slots {
            hooks::set_grad(&s.param, None)?;
        }
        scale.before(&buf)?;
        let _on = enter(side, self.device())?;
        if let Some(side) = side {
            stream::record_stream(&buf, side)?;
        }
        let out = Tensor::f_empty([per], (reduce, device))?;
        let ring = flat::reduce_scatter(pg, buf, out.shallow_clone(), None, reduce_label(index))?;
        Ok((ring, out))
    }

    /// Completes a coalesced unit's reduction: summed across the replicas (HSDP), divided, and each
    /// shard's part made its gradient.
    fn finish_coalesced(&self, pg: &ProcessGroup, ring: Reduction, out: &Tensor, plan: &Plan) -> Result<()> {
        let _on = plan.side.as_ref().map(StreamGuard::new).transpose()?;
        ring.finish(pg)?;
        self.across_replicas(out)?;
        let (per, at) = self.rows();
        let fresh = self.slots.iter().all(|s| !s.shard.grad().defined());
        if !(fresh && !self.offloaded && self.slots.iter().all(|s| s.shard.kind() == out.kind())) {
            // accumulating, or into another dtype or device: each shard's gradient on its own
            for (s, &a) in self.slots.iter().zip(&at) {
                self.set_shard_grad(s, &out.f_narrow(0, a, s.own)?, true, &plan.scale)?;
            }
            return Ok(());
        }
        // divided once, and split into the shards' gradients by one copy (FSDP2's); each a tensor of its
        // own (tch's optimizers detach gradients in place, which views forbid); a rank's padding goes to
        // a scratch chunk, copied short after
        plan.scale.after_in_place(out)?;
        let device = out.device();
        let chunks = self
            .slots
            .iter()
            .map(|s| Tensor::f_empty([s.chunk], (out.kind(), device)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let sizes: Vec<i64> = self.slots.iter().map(|s| s.chunk).collect();
        out.f_narrow(0, 0, per)?.f_split_with_sizes_copy_out(&chunks, sizes.as_slice(), 0)?;
        for (s, g) in self.slots.iter().zip(chunks) {
            let g = if s.own == s.chunk { g } else { copied(&g.f_narrow(0, 0, s.own)?)? };
            hooks::set_grad(&s.shard, Some(&g))?;
        }
        Ok(())
    }

    /// HSDP: this rank's reduced chunk summed across the replicas (each summed its own ranks' gradients),
    /// in place, in the stream the reduce-scatter ran on. Every replica holds the same layout, so the
    /// chunks pair up; the padding travels too, which keeps one message per chunk.
    fn across_replicas(&self, out: &Tensor) -> Result<()> {
        match &self.replicate {
            Some(r) => r.all_reduce_sum(out),
            None => Ok(()),
        }
    }

    /// Makes `mine`, this rank's part of slot `s`'s summed gradient, the shard's gradient (added to one
    /// already there), divided as `scale` says; in a buffer of its own when `copy` (or where it must be:
    /// offload, another dtype).
    fn set_shard_grad(&self, s: &Slot, mine: &Tensor, copy: bool, scale: &Divide) -> Result<()> {
        let sg = s.shard.grad();
        if sg.defined() {
            let _ = sg.shallow_clone().f_add_(&scale.after(&mine.f_to_device(s.shard.device())?)?)?;
        } else if self.pinned {
            // divided on the GPU in the shard's dtype (as the host would), then copied out without
            // blocking; the runtime waits for the copy before the host reads it
            let own = stream::empty_pinned(&[s.own], s.shard.kind())?;
            let wide = if mine.kind() == own.kind() { mine.shallow_clone() } else { mine.f_to_kind(own.kind())? };
            scale.after_in_place(&wide)?;
            stream::copy_non_blocking(&own, &wide)?;
            hooks::set_grad(&s.shard, Some(&own))?;
        } else if copy || self.offloaded || mine.kind() != s.shard.kind() {
            // with offload, even when the shard's device is the same one
            let own = Tensor::f_empty([s.own], (s.shard.kind(), s.shard.device()))?;
            scale.after_into(mine, &own)?;
            hooks::set_grad(&s.shard, Some(&own))?;
        } else {
            scale.after_in_place(mine)?;
            hooks::set_grad(&s.shard, Some(mine))?;
        }
        Ok(())
    }
}

/// A unit's reductions posted by [`FlatParam::start_reduce`]: one ring per parameter and where its sum
/// lands.
pub(crate) struct ReduceInFlight {
    parts: Vec<(Reduction, Tensor)>,
    plan: Plan,
}

/// How a unit's reduction runs: whether it receives into `full`, its division, and its stream.
struct Plan {
    in_full: bool,
    scale: Divide,
    side: Option<Stream>,
}

/// The division of summed gradients by the world size: after the reduction, on this rank's chunk only, in
/// the pass that moves it into the shard's gradient (half the memory traffic of dividing whole gradients
/// first, with 2 ranks); except in float16, whose sums of N gradients can overflow, where each gradient is
/// divided first (PyTorch's pre-divide).
struct Divide {
    by: Option<Tensor>,
    first: bool,
}

impl Divide {
    fn new(reduce: Kind, divisor: f64) -> Divide {
        let by = (divisor != 1.0).then(|| Tensor::from(1.0 / divisor));
        Divide { by, first: reduce == Kind::Half }
    }

    /// On the gradient, before the reduction.
    fn before(&self, buf: &Tensor) -> Result<()> {
        if let (Some(by), true) = (&self.by, self.first) {
            let _ = buf.shallow_clone().f_mul_(by)?;
        }
        Ok(())
    }

    fn late(&self) -> Option<&Tensor> {
        self.by.as_ref().filter(|_| !self.first)
    }

    /// A divided copy of `t` (or `t` itself when there is nothing to divide).
    fn after(&self, t: &Tensor) -> Result<Tensor> {
        Ok(match self.late() {
            Some(by) => t.f_mul(by)?,
            None => t.shallow_clone(),
        })
    }

    /// `into` = `t` divided, in one pass where dtype and device agree.
    fn after_into(&self, t: &Tensor, into: &Tensor) -> Result<()> {
        match self.late() {
            Some(by) if t.kind() == into.kind() && t.device() == into.device() => {
                let _ = t.f_mul_out(into, by)?;
            }
            Some(by) => {
                into.shallow_clone().f_copy_(t)?;
                let _ = into.shallow_clone().f_mul_(by)?; // in the shard's (wider) dtype
            }
            None => into.shallow_clone().f_copy_(t)?,
        }
        Ok(())
    }

    fn after_in_place(&self, t: &Tensor) -> Result<()> {
        if let Some(by) = self.late() {
            let _ = t.shallow_clone().f_mul_(by)?;
        }
        Ok(())
    }
}

fn reduce_label(index: usize) -> String {
    format!("FSDP reduce-scatter, unit {index}")
}
