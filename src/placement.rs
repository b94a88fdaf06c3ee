//! Where each variable lives across ranks, in one registry that every part reads: as DTensor's
//! placements, per process group (a mesh dimension) the variable is [`Placement::Replicate`]d,
//! [`Placement::Shard`]ed along a dimension, a [`Placement::Flat`] range of its flattened values, or held
//! by this rank's pipeline [`Placement::Stage`] alone.
//!
//! The parts that lay tensors out write it: tensor-parallel layers when they are built, FSDP when it
//! shards, pipeline stages, DDP. The parts that must know read it: gradient clipping
//! ([`crate::optim::clip_grad_norm`] and [`crate::optim::GradNorm::parameters`]) and sharded checkpoints
//! ([`crate::checkpoint::StateDict::var_store`]). Users never classify parameters by hand.
//!
//! A record belongs to the tensor itself (every handle to it: the VarStore's entry, the layer's field, a
//! shallow clone), not to a name, so it follows the variable wherever it is passed, and it ends with the
//! tensor.
//!
//! ```no_run
//! # fn f(vs: &tch::nn::VarStore) {
//! for (name, t) in vs.variables() {
//!     if let Some(l) = tch_dist::placement::of(&t) {
//!         println!("{name}: {:?} of {:?}", l.placements(), l.global_shape());
//!     }
//! }
//! # }
//! ```
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi::{tensor_identity, WeakRef};
use crate::group::ProcessGroup;

/// How a variable lies across the ranks of one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank of the group holds the same values.
    Replicate,
    /// The group's ranks hold equal consecutive slices along this dimension, in rank order.
    Shard(usize),
    /// The group's ranks hold consecutive ranges of the flattened values (FSDP's and ZeRO's shards); this
    /// rank's starts at `offset`.
    Flat { offset: i64 },
    /// The group's ranks hold other variables altogether (pipeline stages): this one is this rank's only.
    Stage,
}

impl Placement {
    /// Whether the group's ranks hold disjoint parts of the model here (a norm over the model sums them).
    pub fn is_partial(&self) -> bool {
        !matches!(self, Placement::Replicate)
    }
}

/// Where this rank's values lie in the whole variable.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Extent {
    /// All of it.
    Whole,
    /// The box at `offsets` of `lengths` (the local tensor viewed as `lengths`).
    Box { offsets: Vec<i64>, lengths: Vec<i64> },
    /// Elements `[offset, offset + len)` of the flattened whole (past its end: padding).
    Flat { offset: i64, len: i64 },
    /// Elements `[offset, offset + len)` of the row-major flattening of the box at `offsets` of
    /// `lengths` (FSDP's shard of a tensor-parallel slice).
    FlatOfBox { offsets: Vec<i64>, lengths: Vec<i64>, offset: i64, len: i64 },
    /// A part no box or range describes.
    Other,
}

/// One group the variable is laid out over.
#[derive(Clone)]
struct Along {
    group: Weak<ProcessGroup>,
    name: String,
    size: usize,
    placement: Placement,
}

/// A variable's layout: its whole shape, where this rank's part lies, and how it lies over each group.
pub struct Layout {
    global_shape: Vec<i64>,
    extent: Extent,
    along: Vec<Along>,
    /// This rank's values when they are not the variable's own (FSDP's shard of a parameter that is
    /// empty between uses).
    local: Option<Tensor>,
    /// For a tensor made of parts of several variables (ZeRO's shard of a bucket): those parts.
    pieces: Vec<Piece>,
    /// The optimizer that steps this variable from gradients of its own (ZeRO's, from DDP's buckets or
    /// its shards), which the variable's `.grad` need not be: clipping the variable's is refused.
    stepped_by: Option<String>,
}

/// Elements `start..start + len` of `variable`'s flattening are elements `at..at + len` of the tensor
/// recorded with it. A piece of length 0 names the variable whose per-tensor state (a step count) the
/// tensor shares when it holds no part of any (a shard that is all padding).
pub(crate) struct Piece {
    pub(crate) variable: Tensor,
    pub(crate) start: i64,
    pub(crate) len: i64,
    pub(crate) at: i64,
}

impl Clone for Piece {
    fn clone(&self) -> Self {
        Piece { variable: self.variable.shallow_clone(), start: self.start, len: self.len, at: self.at }
    }
}

impl Clone for Layout {
    fn clone(&self) -> Self {
        Layout {
            global_shape: self.global_shape.clone(),
            extent: self.extent.clone(),
            along: self.along.clone(),
            local: self.local.as_ref().map(|t| t.shallow_clone()),
            pieces: self.pieces.clone(),
            stepped_by: self.stepped_by.clone(),
        }
    }
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layout")
            .field("global_shape", &self.global_shape)
            .field("extent", &self.extent)
            .field("placements", &self.placements())
            .finish()
    }
}

impl Layout {
    /// The whole variable's shape; a fused projection split block by block (a fused QKV, or
    /// [`crate::parallelize::Style::colwise_fused`]) is viewed as `[parts, out / parts, in]`, where this
    /// rank's part is one box (a checkpoint names it by the layer's own shape, `[out, in]`).
    pub fn global_shape(&self) -> &[i64] {
        &self.global_shape
    }

    /// Where this rank's values lie in the whole.
    pub fn extent(&self) -> &Extent {
        &self.extent
    }

    /// Each group the variable is laid out over, by name, with its placement there.
    pub fn placements(&self) -> Vec<(String, Placement)> {
        self.along.iter().map(|a| (a.name.clone(), a.placement)).collect()
    }

    /// This rank's values, when another tensor holds them (FSDP: the shard of a parameter that is empty
    /// between uses).
    pub fn local(&self) -> Option<&Tensor> {
        self.local.as_ref()
    }

    /// The optimizer that steps this variable from gradients of its own (see [`record_stepped_by`]).
    pub(crate) fn stepped_by(&self) -> Option<&str> {
        self.stepped_by.as_deref()
    }

    /// The parts of variables this tensor holds, when it is made of several (ZeRO's shard of a bucket).
    pub(crate) fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Whether the ranks of `group` hold different parts of the variable (a slice, a shard, an expert).
    pub(crate) fn is_partial_over(&self, group: &Arc<ProcessGroup>) -> bool {
        let g = Arc::downgrade(group);
        self.along.iter().any(|a| a.placement.is_partial() && a.group.ptr_eq(&g))
    }

    /// For a variable sliced over some group whose layer also said which ranks hold the same slice
    /// (`Replicate` along a group other than `besides`): that group. Experts spread over an
    /// expert-parallel group and repeated over the data-parallel ranks beside it are such variables; a
    /// data-parallel wrapper over `besides` sums their gradients over the returned group instead.
    pub(crate) fn replicas_beside(&self, besides: &Arc<ProcessGroup>) -> Option<(Arc<ProcessGroup>, usize)> {
        let b = Arc::downgrade(besides);
        let sliced: usize = self
            .along
            .iter()
            .filter(|a| matches!(a.placement, Placement::Shard(_)) && a.size > 1)
            .map(|a| a.size)
            .product();
        if sliced <= 1 {
            return None;
        }
        self.along
            .iter()
            .filter(|a| a.placement == Placement::Replicate && a.size > 1 && !a.group.ptr_eq(&b))
            .find_map(|a| a.group.upgrade())
            .map(|g| (g, sliced))
    }

    /// The groups whose ranks hold disjoint parts (size 1 left out: nothing to sum), outermost first.
    pub(crate) fn partial_groups(&self, what: &str) -> Result<Vec<Arc<ProcessGroup>>> {
        let mut out = Vec::new();
        for a in self.along.iter().filter(|a| a.placement.is_partial() && a.size > 1) {
            let g = a.group.upgrade().ok_or_else(|| {
                Error::invalid(what, format!("the group {:?} a variable is laid out over no longer exists", a.name))
            })?;
            out.push(g);
        }
        Ok(out)
    }
}

struct Entry {
    weak: WeakRef,
    layout: Layout,
}

#[derive(Default)]
struct Registry {
    records: HashMap<i64, Entry>,
    /// Records of tensors that are gone are dropped when the count reaches this (then twice what is
    /// left): each record is checked a bounded number of times, not once per insert.
    prune_at: usize,
}

/// Records by tensor identity. Each holds a weak reference, so an identity is never reused while its
/// record exists.
static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

/// Whether `a` and `b` are handles to one tensor (not merely views of the same memory): how an empty
/// tensor, which has no memory to compare, is told apart from another.
pub(crate) fn identical(a: &Tensor, b: &Tensor) -> bool {
    match (tensor_identity(a, false), tensor_identity(b, false)) {
        (Ok((x, _)), Ok((y, _))) => x == y,
        _ => false,
    }
}

/// The layout recorded for `t` (any handle to it), if any part laid it out.
pub fn of(t: &Tensor) -> Option<Layout> {
    if !t.defined() {
        return None;
    }
    let (id, _) = tensor_identity(t, false).ok()?;
    let reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    reg.as_ref()?.records.get(&id).filter(|e| !e.weak.expired()).map(|e| e.layout.clone())
}

/// Elements of the model's variables that `t` holds, as its record says (what a rank updates when it
/// steps `t`): the parts of variables a ZeRO shard holds, the real elements of a flat shard (not its
/// padding), else all of `t` (a variable, a tensor-parallel slice).
pub(crate) fn held_elements(t: &Tensor) -> i64 {
    let n = t.numel() as i64;
    match of(t) {
        Some(l) if !l.pieces.is_empty() => l.pieces.iter().map(|p| p.len).sum(),
        Some(Layout { extent: Extent::Flat { offset, .. }, global_shape, .. }) => {
            (global_shape.iter().product::<i64>() - offset).clamp(0, n)
        }
        _ => n,
    }
}

/// Replaces `t`'s record by what `f` makes of it (`None`: it had none).
fn update(t: &Tensor, f: impl FnOnce(Option<Layout>) -> Result<Layout>) -> Result<()> {
    let (id, weak) = tensor_identity(t, true)?;
    let weak = weak.ok_or_else(|| Error::invalid("tensor placement", "the shim gave no weak reference"))?;
    let mut guard = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    let reg = guard.get_or_insert_with(Registry::default);
    if reg.records.len() >= reg.prune_at {
        reg.records.retain(|_, e| !e.weak.expired());
        reg.prune_at = (2 * reg.records.len()).max(64);
    }
    let old = reg.records.remove(&id).filter(|e| !e.weak.expired()).map(|e| e.layout);
    let layout = f(old)?;
    reg.records.insert(id, Entry { weak, layout });
    Ok(())
}

fn along(group: &Arc<ProcessGroup>, placement: Placement) -> Along {
    Along { group: Arc::downgrade(group), name: group.name().to_string(), size: group.size(), placement }
}

/// `t` is this rank's slice along `dim` of a variable sharded over `group` (tensor parallelism): the box
/// at `offsets` of the whole `global_shape`, `t` viewed as `lengths` (its own shape, or the view its
/// slice is cut from). Any earlier record of `t` is replaced.
pub(crate) fn record_shard(
    t: &Tensor,
    group: &Arc<ProcessGroup>,
    dim: usize,
    global_shape: &[i64],
    offsets: &[i64],
    lengths: &[i64],
) -> Result<()> {
    let what = "tensor placement";
    let fits = offsets.len() == global_shape.len()
        && lengths.len() == global_shape.len()
        && dim < global_shape.len()
        && offsets.iter().zip(lengths).zip(global_shape).all(|((o, l), g)| *o >= 0 && o + l <= *g)
        && lengths.iter().product::<i64>() == t.numel() as i64;
    if !fits {
        return Err(Error::invalid(
            what,
            format!("a {:?} slice as {lengths:?} at {offsets:?} does not fit in {global_shape:?}", t.size()),
        ));
    }
    update(t, |_| {
        Ok(Layout {
            global_shape: global_shape.to_vec(),
            extent: Extent::Box { offsets: offsets.to_vec(), lengths: lengths.to_vec() },
            along: vec![along(group, Placement::Shard(dim))],
            local: None,
            pieces: Vec::new(),
            stepped_by: None,
        })
    })
}

/// The record of a whole variable laid out over no group.
fn whole(t: &Tensor) -> Layout {
    Layout {
        global_shape: t.size(),
        extent: Extent::Whole,
        along: Vec::new(),
        local: None,
        pieces: Vec::new(),
        stepped_by: None,
    }
}

/// Adds `group` with `placement` to `t`'s record (a whole variable's record if it had none): DDP's
/// replicas, a pipeline stage's variables.
pub(crate) fn record_along(t: &Tensor, group: &Arc<ProcessGroup>, placement: Placement) -> Result<()> {
    update(t, |old| {
        let mut l = old.unwrap_or_else(|| whole(t));
        // a second wrapper over the same group (a rebuilt DDP) says it again: once is enough
        if !l.along.iter().any(|a| a.group.ptr_eq(&Arc::downgrade(group))) {
            l.along.push(along(group, placement));
        }
        Ok(l)
    })
}

/// `t` (a variable) is stepped by `optimizer` from gradients of its own, not from `t.grad` (ZeRO's
/// optimizer over DDP's buckets or its gradient shards); `None`: from `t.grad` again.
pub(crate) fn record_stepped_by(t: &Tensor, optimizer: Option<&str>) -> Result<()> {
    update(t, |old| {
        let mut l = old.unwrap_or_else(|| whole(t));
        l.stepped_by = optimizer.map(str::to_string);
        Ok(l)
    })
}

/// FSDP: `shard` holds elements `[offset, offset + shard.numel())` of `param`'s values flattened (its
/// local values, if `param` is itself a slice), laid out over `group`; `shape` is `param`'s (which is
/// empty between uses). Both are recorded: `param`, with `shard` as its local values, and `shard`,
/// which the optimizer steps.
pub(crate) fn record_flat_shard(
    param: &Tensor,
    shape: &[i64],
    shard: &Tensor,
    group: &Arc<ProcessGroup>,
    offset: i64,
) -> Result<()> {
    let base = of(param);
    let make = |local: Option<Tensor>| {
        let (global_shape, extent, mut along_) = match &base {
            Some(b) => (b.global_shape.clone(), b.extent.clone(), b.along.clone()),
            None => (shape.to_vec(), Extent::Whole, Vec::new()),
        };
        let extent = match extent {
            Extent::Whole => Extent::Flat { offset, len: shard.numel() as i64 },
            // a slice of the variable's own shape (not a fused projection's view `[parts, out / parts, ..]`)
            Extent::Box { offsets, lengths } if lengths.len() == shape.len() => {
                Extent::FlatOfBox { offsets, lengths, offset, len: shard.numel() as i64 }
            }
            _ => Extent::Other,
        };
        along_.push(along(group, Placement::Flat { offset }));
        Layout { global_shape, extent, along: along_, local, pieces: Vec::new(), stepped_by: None }
    };
    update(param, |_| Ok(make(Some(shard.shallow_clone()))))?;
    update(shard, |_| Ok(make(None)))
}

/// ZeRO: `t` holds elements `[offset, offset + t.numel())` of a flat bucket of `total` elements laid out
/// over `group` (past its end: padding), which concatenates variables; `pieces` say which parts of
/// which variables those are.
pub(crate) fn record_pieces(
    t: &Tensor,
    group: &Arc<ProcessGroup>,
    offset: i64,
    total: i64,
    pieces: Vec<Piece>,
) -> Result<()> {
    let len = t.numel() as i64;
    let fits = pieces.iter().all(|p| {
        p.start >= 0 && p.len >= 0 && p.at >= 0 && p.at + p.len <= len && p.start + p.len <= p.variable.numel() as i64
    });
    if !fits || offset < 0 {
        return Err(Error::invalid("tensor placement", format!("pieces that do not fit in a {len}-element shard")));
    }
    update(t, |_| {
        Ok(Layout {
            global_shape: vec![total],
            extent: Extent::Flat { offset, len },
            along: vec![along(group, Placement::Flat { offset })],
            local: None,
            pieces,
            stepped_by: None,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn a_record_follows_every_handle_and_ends_with_the_tensor() {
        let store = crate::Store::hash().unwrap();
        let pg = Arc::new(ProcessGroup::new(&store, 0, 1, &Default::default()).unwrap());
        let t = Tensor::zeros([4, 2], (Kind::Float, Device::Cpu));
        assert!(of(&t).is_none());
        record_shard(&t, &pg, 0, &[8, 2], &[4, 0], &[4, 2]).unwrap();
        let l = of(&t.shallow_clone()).unwrap();
        assert_eq!(l.global_shape(), &[8, 2]);
        assert_eq!(l.extent(), &Extent::Box { offsets: vec![4, 0], lengths: vec![4, 2] });
        assert_eq!(l.placements(), vec![("default".to_string(), Placement::Shard(0))]);
        // a copy is another tensor
        assert!(of(&t.copy()).is_none());
        let err = record_shard(&t, &pg, 0, &[8, 2], &[6, 0], &[4, 2]).unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
        let id = tensor_identity(&t, false).unwrap().0;
        drop(t);
        assert!(of(&Tensor::zeros([4, 2], (Kind::Float, Device::Cpu))).is_none());
        // pruning comes with inserts, once the count doubles
        let keep: Vec<Tensor> = (0..200).map(|_| Tensor::zeros([1], (Kind::Float, Device::Cpu))).collect();
        for u in &keep {
            record_along(u, &pg, Placement::Replicate).unwrap();
        }
        let reg = REGISTRY.lock().unwrap();
        assert!(!reg.as_ref().unwrap().records.contains_key(&id), "the record of a dropped tensor is gone");
    }

    #[test]
    fn held_elements_leave_out_padding_and_count_a_shards_parts() {
        let store = crate::Store::hash().unwrap();
        let pg = Arc::new(ProcessGroup::new(&store, 0, 1, &Default::default()).unwrap());
        let zeros = |n: i64| Tensor::zeros([n], (Kind::Float, Device::Cpu));
        assert_eq!(held_elements(&zeros(7)), 7, "no record: all of it");
        // a 3-element flat shard at offset 3 of a 5-element parameter: 2 real elements, 1 padding
        let (param, shard) = (zeros(5), zeros(3));
        record_flat_shard(&param, &[5], &shard, &pg, 3).unwrap();
        assert_eq!(held_elements(&shard), 2);
        // a ZeRO shard of 4 elements holding 2 of `a` and 1 of `b`, the rest padding
        let (a, b, t) = (zeros(2), zeros(4), zeros(4));
        let pieces = vec![
            Piece { variable: a.shallow_clone(), start: 0, len: 2, at: 0 },
            Piece { variable: b.shallow_clone(), start: 3, len: 1, at: 2 },
        ];
        record_pieces(&t, &pg, 4, 8, pieces).unwrap();
        assert_eq!(held_elements(&t), 3);
    }
}
