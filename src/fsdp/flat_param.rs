//! One unit's parameters as one flat buffer sharded across the ranks (FSDP's flat parameter): rank r owns
//! elements `[r*len, (r+1)*len)` of the unit's parameters laid end to end and padded to `world*len`.
//!
//! Between uses only the shard exists. The gathered buffer (`full`) keeps its storage object but not its
//! memory, and the parameters point at an empty placeholder, so a stray read finds a tensor with no
//! elements rather than freed memory. Gathering fills `full` again and points the parameters at views of
//! it; tensors autograd saved during forward share that storage and see the data again.
use std::collections::VecDeque;

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::ring::{all_gather_in_place, Ring, RingReduce};
use crate::group::ProcessGroup;
use crate::work::Work;
use crate::{hooks, storage};

/// A copy of `t` with storage of its own.
pub(crate) fn copied(t: &Tensor) -> Result<Tensor> {
    let mut out = t.f_empty_like()?;
    out.f_copy_(t)?;
    Ok(out)
}

pub(crate) struct FlatParam {
    pub names: Vec<String>,
    /// The module's own variables (the VarStore's tensors).
    pub params: Vec<Tensor>,
    pub shapes: Vec<Vec<i64>>,
    pub offsets: Vec<i64>,
    pub numel: i64,
    /// Elements per rank.
    pub len: i64,
    /// Real (unpadded) elements of this rank's shard.
    pub own: i64,
    rank: i64,
    world: i64,
    /// This rank's shard, in the parameters' dtype, on the shard device: a leaf the optimizer steps.
    pub shard: Tensor,
    /// `world * len` elements in the compute dtype on the compute device; storage freed while sharded.
    pub full: Tensor,
    placeholder: Tensor,
    pub trainable: bool,
    /// The shard lives apart from the compute buffers (FsdpOptions::offload), even on the same device.
    pub offloaded: bool,
}

impl FlatParam {
    /// Moves `params` (one dtype and device) into a flat buffer: rank 0's values when `sync`. Returns with
    /// the parameters gathered (views of `full`), so that hooks registered now see their real shapes.
    pub fn new(
        pg: &ProcessGroup,
        unit: &str,
        names: Vec<String>,
        params: Vec<Tensor>,
        compute: Option<Kind>,
        shard_device: Option<Device>,
        sync: bool,
    ) -> Result<FlatParam> {
        let _g = tch::no_grad_guard();
        let first = params.first().ok_or_else(|| Error::invalid("FSDP", format!("unit {unit} has no parameters")))?;
        let (kind, device) = (first.kind(), first.device());
        let trainable = first.requires_grad();
        for (n, p) in names.iter().zip(&params) {
            if p.kind() != kind || p.device() != device {
                return Err(Error::invalid(
                    "FSDP",
                    format!(
                        "unit {unit}: parameter {n} is {:?} on {:?} but {} is {kind:?} on {device:?}; a unit's parameters share one dtype and device",
                        p.kind(),
                        p.device(),
                        names[0]
                    ),
                ));
            }
            if p.requires_grad() != trainable {
                return Err(Error::invalid(
                    "FSDP",
                    format!(
                        "unit {unit} mixes frozen and trainable parameters ({n} and {}): one flat shard is stepped as a whole; give the frozen ones a unit of their own",
                        names[0]
                    ),
                ));
            }
        }
        let (rank, world) = (pg.rank() as i64, pg.size() as i64);
        let numel: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let len = (numel + world - 1) / world;
        let own = (numel - rank * len).clamp(0, len);
        let mut flat = Tensor::f_zeros([world * len], (kind, device))?;
        let mut offsets = Vec::with_capacity(params.len());
        let mut off = 0;
        for p in &params {
            offsets.push(off);
            flat.f_narrow(0, off, p.numel() as i64)?.f_copy_(&p.f_reshape([-1])?)?;
            off += p.numel() as i64;
        }
        if sync && world > 1 {
            let _l = crate::flight::label(format!("FSDP: rank 0's parameters of unit {unit}"));
            pg.broadcast(&mut flat, 0)?;
        }
        let offloaded = shard_device.is_some();
        let shard_device = shard_device.unwrap_or(device);
        let shard = copied(&flat.f_narrow(0, rank * len, own)?.f_to_device(shard_device)?.f_detach()?)?;
        let shard = shard.set_requires_grad(trainable);
        let compute = compute.unwrap_or(kind);
        let full = if compute == kind { flat } else { flat.f_to_kind(compute)? };
        let placeholder = Tensor::f_empty([0], (compute, device))?;
        let shapes = params.iter().map(|p| p.size()).collect();
        let f = FlatParam {
            names,
            params,
            shapes,
            offsets,
            numel,
            len,
            own,
            rank,
            world,
            shard,
            full,
            placeholder,
            trainable,
            offloaded,
        };
        f.use_full()?;
        Ok(f)
    }

    /// Handles on the same tensors, to work on them without holding the runtime's lock.
    pub fn handles(&self) -> FlatParam {
        FlatParam {
            names: self.names.clone(),
            params: self.params.iter().map(|p| p.shallow_clone()).collect(),
            shapes: self.shapes.clone(),
            offsets: self.offsets.clone(),
            numel: self.numel,
            len: self.len,
            own: self.own,
            rank: self.rank,
            world: self.world,
            shard: self.shard.shallow_clone(),
            full: self.full.shallow_clone(),
            placeholder: self.placeholder.shallow_clone(),
            trainable: self.trainable,
            offloaded: self.offloaded,
        }
    }

    pub fn compute_kind(&self) -> Kind {
        self.full.kind()
    }

    /// Allocates `full`, puts this rank's shard in it and starts the all-gather (a ring of sends into
    /// place); returns what is still running.
    pub fn start_gather(&self, pg: &ProcessGroup, index: usize) -> Result<Vec<Work>> {
        let _g = tch::no_grad_guard();
        storage::allocate(&self.full)?;
        if self.own > 0 {
            self.full.f_narrow(0, self.rank * self.len, self.own)?.f_copy_(&self.shard)?;
        }
        let mut pending = VecDeque::new();
        if self.world > 1 {
            all_gather_in_place(pg, &self.full, self.len, Ring::FsdpGather, index, &mut pending, usize::MAX)?;
        }
        Ok(pending.into_iter().flatten().collect())
    }

    /// Points the parameters at their views of `full` (which must be gathered).
    pub fn use_full(&self) -> Result<()> {
        for ((p, &off), shape) in self.params.iter().zip(&self.offsets).zip(&self.shapes) {
            let n: i64 = shape.iter().product();
            let view = self.full.f_narrow(0, off, n)?.f_view(shape.as_slice())?;
            p.shallow_clone().f_set_data(&view)?;
        }
        Ok(())
    }

    /// Points the parameters at the placeholder and frees `full`'s memory.
    pub fn release(&self) -> Result<()> {
        for p in &self.params {
            p.shallow_clone().f_set_data(&self.placeholder)?;
        }
        storage::free(&self.full)
    }

    /// Bytes `full` holds now (0 while sharded).
    pub fn gathered_bytes(&self) -> Result<i64> {
        storage::nbytes(&self.full)
    }

    /// Reduce-scatters the parameters' gradients, each divided by `divisor`, into the shard's gradient
    /// (accumulating into one already there), and drops the parameters' gradients as it copies them. A
    /// parameter without a gradient counts as zeros.
    pub fn reduce_grads(&self, pg: &ProcessGroup, index: usize, reduce: Kind, divisor: f64) -> Result<()> {
        let _g = tch::no_grad_guard();
        let device = self.full.device();
        let buf = Tensor::f_empty([self.world * self.len], (reduce, device))?;
        let pad = self.world * self.len - self.numel;
        if pad > 0 {
            let _ = buf.f_narrow(0, self.numel, pad)?.f_zero_()?;
        }
        let scale = Tensor::from(1.0 / divisor);
        for ((p, &off), shape) in self.params.iter().zip(&self.offsets).zip(&self.shapes) {
            let n: i64 = shape.iter().product();
            let slot = buf.f_narrow(0, off, n)?;
            let g = p.grad();
            if g.defined() && g.kind() == reduce {
                // copy and divide in one pass (the Tensor overload writes into `slot`)
                let _ = g.f_reshape([-1])?.f_mul_out(&slot, &scale)?;
                hooks::set_grad(p, None)?;
            } else if g.defined() {
                // cast first: a product in the gradient's dtype would round before the wider sum
                slot.shallow_clone().f_copy_(&g.f_reshape([-1])?)?;
                let _ = slot.shallow_clone().f_mul_(&scale)?;
                hooks::set_grad(p, None)?;
            } else {
                let _ = slot.shallow_clone().f_zero_()?;
            }
        }
        let out = Tensor::f_empty([self.len], (reduce, device))?;
        RingReduce::start(pg, buf, out.shallow_clone(), Ring::FsdpReduce, index)?.finish(pg)?;
        let mine = out.f_narrow(0, 0, self.own)?;
        let g = self.shard.grad();
        if g.defined() {
            let _ = g.shallow_clone().f_add_(&mine.f_to_device(self.shard.device())?)?;
        } else if self.offloaded || mine.kind() != self.shard.kind() {
            // a buffer of its own on the shard's device (with offload, even when that is the same device)
            let own = Tensor::f_empty([self.own], (self.shard.kind(), self.shard.device()))?;
            own.shallow_clone().f_copy_(&mine)?;
            hooks::set_grad(&self.shard, Some(&own))?;
        } else {
            hooks::set_grad(&self.shard, Some(&mine))?;
        }
        Ok(())
    }
}
