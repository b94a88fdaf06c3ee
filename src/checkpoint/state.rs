//! What a sharded checkpoint saves and loads: the live tensors of the model and the optimizers, each with
//! its place in a global tensor, so that a checkpoint saved from one layout loads into another.
//!
//! Names are global and independent of the layout: `{prefix}.{variable}` for the model (`model.l1.weight`),
//! `{prefix}.state.{variable}.{field}` for optimizer state (`optim.state.l1.weight.exp_avg`), as
//! `torch.distributed.checkpoint` flattens `{"model": ..., "optim": ...}`.
use std::collections::BTreeMap;

use tch::{nn, Tensor};

use super::region::{Bx, Region};
use crate::error::{Error, Result};
use crate::optim::{Optimizer, Stepped};
use crate::placement::{Extent, Piece};

/// One local tensor and its place.
pub(crate) struct Item {
    pub name: String,
    /// The variable's name without the prefix, for a model variable (optimizer state is named after it).
    pub param: Option<String>,
    pub global: Vec<i64>,
    pub region: Region,
    pub local: Tensor,
}

impl Item {
    /// The item's boxes, each with the local tensor's part that holds it (a view).
    pub(crate) fn pieces(&self) -> Result<Vec<(Bx, Tensor)>> {
        match &self.region {
            Region::Box(b) => Ok(vec![(b.clone(), self.local.shallow_clone())]),
            Region::Flat { .. } | Region::Boxes(_) => {
                let flat = self.local.f_reshape([-1])?;
                self.region
                    .boxes(&self.global)
                    .into_iter()
                    .map(|(b, at)| Ok((b.clone(), flat.f_narrow(0, at, b.volume())?.f_view(b.lengths.as_slice())?)))
                    .collect()
            }
        }
    }
}

/// The state a sharded checkpoint saves, or loads in place: tensors by global name with their place in
/// the global tensor, and optimizers whose state follows their parameters.
///
/// ```no_run
/// # let (vs, mut opt) = (tch::nn::VarStore::new(tch::Device::Cpu), tch_dist::optim::AdamW::new(vec![], 1e-3));
/// use tch_dist::checkpoint::StateDict;
/// let mut sd = StateDict::new();
/// sd.var_store("model", &vs).optimizer("optim", &mut opt);
/// # Ok::<(), tch_dist::Error>(())
/// ```
#[derive(Default)]
pub struct StateDict<'a> {
    pub(crate) items: Vec<Item>,
    pub(crate) optimizers: Vec<(String, Held<'a>)>,
    pub(crate) layout: BTreeMap<String, i64>,
    /// The first variable that could not be added (see [`check`](Self::check)).
    error: Option<Error>,
}

impl<'a> StateDict<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every variable of `vs` (parameters and buffers) as `{prefix}.{name}`, each where its placement
    /// ([`crate::placement`]) says this rank's part lies: whole (a single process, DDP, ZeRO-1/2, a
    /// pipeline stage), a tensor-parallel slice, or FSDP's flat shard (the shard itself, not the parameter
    /// that is empty between uses). A layout a checkpoint cannot describe fails the save or load naming
    /// the variable.
    pub fn var_store(&mut self, prefix: &str, vs: &nn::VarStore) -> &mut Self {
        for (name, t) in crate::var_store::sorted_variables(vs) {
            if let Err(e) = self.variable(prefix, name, t) {
                self.error.get_or_insert(e);
            }
        }
        self
    }

    fn variable(&mut self, prefix: &str, name: String, t: Tensor) -> Result<()> {
        let full = format!("{prefix}.{name}");
        let Some(layout) = crate::placement::of(&t) else {
            let region = Region::Box(Bx::whole(&t.size()));
            self.items.push(Item { name: full, param: Some(name), global: t.size(), region, local: t });
            return Ok(());
        };
        let local = layout.local().map_or(t, |l| l.shallow_clone());
        let global = layout.global_shape().to_vec();
        match layout.extent() {
            Extent::Whole => {
                let region = Region::Box(Bx::whole(&global));
                self.items.push(Item { name: full, param: Some(name), global, region, local });
            }
            // a fused projection's slice, placed in its view `[parts, out / parts, ..]`: saved under the
            // variable's own shape (what one process holds), as its slice of each block
            Extent::Box { offsets, lengths } if global.len() == local.dim() + 1 => {
                let (parts, block) = (global[0], global[1]);
                let inner: i64 = lengths[2..].iter().product();
                let boxes = (0..lengths[0])
                    .map(|k| {
                        let at = [vec![(offsets[0] + k) * block + offsets[1]], offsets[2..].to_vec()].concat();
                        let bx = Bx { offsets: at, lengths: lengths[1..].to_vec() };
                        (bx, k * lengths[1] * inner)
                    })
                    .collect();
                let global = [vec![parts * block], global[2..].to_vec()].concat();
                self.items.push(Item { name: full, param: Some(name), global, region: Region::Boxes(boxes), local });
            }
            Extent::Box { offsets, lengths } => {
                let bx = Bx { offsets: offsets.clone(), lengths: lengths.clone() };
                let local = local.f_view(lengths.as_slice())?;
                self.items.push(Item { name: full, param: Some(name), global, region: Region::Box(bx), local });
            }
            Extent::Flat { offset, .. } => {
                self.flat_shard(full, Some(name), &global, *offset, &local)?;
            }
            // FSDP's shard of a tensor-parallel slice: its run of the slice's flattening, as boxes of
            // the slice moved to where the slice lies
            Extent::FlatOfBox { offsets, lengths, offset, .. } if global.len() == lengths.len() => {
                // the shard itself (it holds no padding): its identity names its optimizer state
                let len = local.numel() as i64;
                if local.dim() != 1
                    || !local.is_contiguous()
                    || (len > 0 && offset + len > lengths.iter().product::<i64>())
                {
                    return Err(Error::invalid(
                        "checkpoint",
                        format!("{full}: a shard of {len} elements at {offset} does not lie in its slice {lengths:?}"),
                    ));
                }
                let boxes = Region::Flat { start: *offset, len }
                    .boxes(lengths)
                    .into_iter()
                    .map(|(mut b, at)| {
                        b.offsets.iter_mut().zip(offsets).for_each(|(o, s)| *o += s);
                        (b, at)
                    })
                    .collect();
                self.items.push(Item { name: full, param: Some(name), global, region: Region::Boxes(boxes), local });
            }
            Extent::FlatOfBox { .. } | Extent::Other => {
                return Err(Error::invalid(
                    "checkpoint",
                    format!(
                        "{full}: a flat shard of a tensor-parallel slice ({:?}) has no place a checkpoint can name",
                        layout.placements()
                    ),
                ))
            }
        }
        Ok(())
    }

    /// The first error met while adding tensors (reported by the save or load).
    pub(crate) fn check(&self) -> Result<()> {
        self.error.as_ref().map_or(Ok(()), |e| Err(crate::error::replay(e)))
    }

    /// A tensor held whole by every rank that adds it.
    pub fn tensor(&mut self, name: &str, t: &Tensor) -> &mut Self {
        self.items.push(Item {
            name: name.to_string(),
            param: None,
            global: t.size(),
            region: Region::Box(Bx::whole(&t.size())),
            local: t.shallow_clone(),
        });
        self
    }

    /// `t` is the box of the global tensor `name` (of `global_shape`) at `offsets`.
    pub fn shard(&mut self, name: &str, global_shape: &[i64], offsets: &[i64], t: &Tensor) -> Result<&mut Self> {
        let bx = Bx { offsets: offsets.to_vec(), lengths: t.size() };
        if !bx.fits(global_shape) {
            return Err(Error::invalid(
                "StateDict::shard",
                format!("{name}: a {:?} tensor at {offsets:?} does not fit in {global_shape:?}", t.size()),
            ));
        }
        self.items.push(Item {
            name: name.to_string(),
            param: None,
            global: global_shape.to_vec(),
            region: Region::Box(bx),
            local: t.shallow_clone(),
        });
        Ok(self)
    }

    /// `t` (flat) is elements `start..start + t.numel()` of the row-major flattening of the global tensor
    /// `name` (ZeRO's and FSDP's shards). `param`: the variable it shards, for optimizer state.
    pub(crate) fn flat_shard(
        &mut self,
        name: String,
        param: Option<String>,
        global_shape: &[i64],
        start: i64,
        t: &Tensor,
    ) -> Result<&mut Self> {
        let (len, total) = (t.numel() as i64, global_shape.iter().product::<i64>());
        // an empty shard of a parameter smaller than the group may start past its end (rank x chunk)
        let start = if len == 0 { start.min(total) } else { start };
        if start < 0 || start + len > total {
            return Err(Error::invalid(
                "StateDict",
                format!("{name}: elements {start}..{} of a {global_shape:?} tensor", start + len),
            ));
        }
        // kept when empty (an FSDP shard of a parameter smaller than the group): it holds no element, but
        // its optimizer's per-tensor state (the step count) is named after it
        let region = Region::Flat { start, len };
        self.items.push(Item { name, param, global: global_shape.to_vec(), region, local: t.shallow_clone() });
        Ok(self)
    }

    /// `opt`'s state, named after the parameters it steps as `{prefix}.state.{variable}.{field}` (the
    /// parameters must be in this state dict: add the model first). Loading fills it in the layout `opt`
    /// has now, whatever the layout it was saved from.
    pub fn optimizer(&mut self, prefix: &str, opt: &'a mut dyn Optimizer) -> &mut Self {
        self.optimizers.push((prefix.to_string(), Held::Borrowed(opt)));
        self
    }

    /// tch's own optimizer (`nn::AdamW`, `nn::Adam`, `nn::Sgd`, `nn::RmsProp`) built on `vs`, as
    /// [`optimizer`](Self::optimizer) does for ours: its state (libtorch's, per parameter) is saved as
    /// `{prefix}.state.{variable}.{field}` and loaded in whatever layout it has now
    /// ([`TchOptimizer`](crate::optim::TchOptimizer)). Add the model first.
    pub fn tch_optimizer(&mut self, prefix: &str, opt: &'a mut nn::Optimizer, vs: &nn::VarStore) -> &mut Self {
        match crate::optim::TchOptimizer::new(opt, vs) {
            Ok(t) => self.optimizers.push((prefix.to_string(), Held::Tch(t))),
            Err(e) => {
                self.error.get_or_insert(e.in_op(format!("checkpoint: optimizer {prefix:?}")));
            }
        }
        self
    }

    /// Records a fact about the layout in the checkpoint's metadata (`zero_stage`, `tp`, `pp`, ...).
    pub fn describe(&mut self, key: &str, value: i64) -> &mut Self {
        self.layout.insert(key.to_string(), value);
        self
    }

    /// The model item of an optimizer's parameter.
    pub(crate) fn param_item(&self, opt: &str, p: &Tensor) -> Result<&Item> {
        self.items.iter().find(|i| i.param.is_some() && same(&i.local, p)).ok_or_else(|| {
            Error::invalid(
                format!("checkpoint: optimizer {opt:?}"),
                format!("a {:?} parameter it steps is not in the state dict: add the model's tensors first", p.size()),
            )
        })
    }

    /// The optimizers' state as items (for saving).
    pub(crate) fn optimizer_items(&self) -> Result<Vec<Item>> {
        let mut out = Vec::new();
        for (prefix, opt) in &self.optimizers {
            let state = opt.state_dict();
            let stepped = opt.stepped();
            if stepped.is_empty() && !state.is_empty() {
                return Err(Error::invalid(
                    format!("checkpoint: optimizer {prefix:?}"),
                    "it does not say which tensors it steps (Optimizer::stepped)",
                ));
            }
            for st in &stepped {
                let pieces = pieces(&st.tensor);
                for (key, t) in &state {
                    let Some(field) = field_of(st, key) else { continue };
                    if elementwise(st, t) {
                        let flat = t.f_contiguous()?.f_reshape([-1])?;
                        for seg in pieces.iter().filter(|s| s.len > 0) {
                            let item = self.param_item(prefix, &seg.variable)?;
                            let region = item.region.part(&item.global, seg.start, seg.len).ok_or_else(|| {
                                Error::invalid(
                                    format!("checkpoint: optimizer {prefix:?}"),
                                    format!("{}: part of a tensor-parallel slice is not supported", item.name),
                                )
                            })?;
                            let mut local = flat.f_narrow(0, seg.at, seg.len)?;
                            if let Region::Box(b) = &region {
                                local = local.f_view(b.lengths.as_slice())?;
                            }
                            let name = state_name(prefix, item, field);
                            out.push(Item { name, param: None, global: item.global.clone(), region, local });
                        }
                    } else {
                        for p in owners(&pieces) {
                            let item = self.param_item(prefix, &p)?;
                            let name = state_name(prefix, item, field);
                            out.push(Item {
                                name,
                                param: None,
                                global: t.size(),
                                region: Region::Box(Bx::whole(&t.size())),
                                local: t.shallow_clone(),
                            });
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// An optimizer a state dict saves and loads: one of ours, borrowed, or tch's, seen through its state.
pub(crate) enum Held<'a> {
    Borrowed(&'a mut dyn Optimizer),
    Tch(crate::optim::TchOptimizer<'a>),
}

impl<'a> std::ops::Deref for Held<'a> {
    type Target = dyn Optimizer + 'a;
    fn deref(&self) -> &Self::Target {
        match self {
            Held::Borrowed(o) => &**o,
            Held::Tch(t) => t,
        }
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Held::Borrowed(o) => &mut **o,
            Held::Tch(t) => t,
        }
    }
}

/// Whether two handles are the same parameter (tensors of one storage at one place and size; an empty
/// one, such as an FSDP shard of a parameter smaller than the group, by identity).
pub(crate) fn same(a: &Tensor, b: &Tensor) -> bool {
    match (a.numel(), b.numel()) {
        (0, 0) => a.defined() && b.defined() && crate::placement::identical(a, b),
        (n, m) => n == m && a.data_ptr() == b.data_ptr(),
    }
}

/// The parts of variables `stepped` holds: those its placement names (ZeRO's shard of a bucket), else
/// all of itself (a variable, or FSDP's shard of one, found among the state dict's items).
pub(crate) fn pieces(stepped: &Tensor) -> Vec<Piece> {
    match crate::placement::of(stepped) {
        Some(l) if !l.pieces().is_empty() => l.pieces().to_vec(),
        _ => vec![Piece { variable: stepped.shallow_clone(), start: 0, len: stepped.numel() as i64, at: 0 }],
    }
}

/// The field a state key of `st` holds (`exp_avg`, `master`), if it is one of its keys.
pub(crate) fn field_of<'k>(st: &Stepped, key: &'k str) -> Option<&'k str> {
    if st.master_key.as_deref() == Some(key) {
        return Some("master");
    }
    key.strip_prefix(st.prefix.as_str()).filter(|f| !f.contains('.') && !f.is_empty())
}

/// Elementwise state (moments, momentum, master weights) has the stepped tensor's shape and dtype;
/// anything else (a step count) belongs to the tensor as a whole.
pub(crate) fn elementwise(st: &Stepped, t: &Tensor) -> bool {
    t.kind() == st.tensor.kind() && t.size() == st.tensor.size()
}

/// The variables whose per-tensor state a stepped tensor holds: those it has a part of, or the one a
/// piece of length 0 names.
pub(crate) fn owners(pieces: &[Piece]) -> Vec<Tensor> {
    let v: Vec<Tensor> = pieces.iter().filter(|s| s.len > 0).map(|s| s.variable.shallow_clone()).collect();
    if v.is_empty() {
        pieces.iter().take(1).map(|a| a.variable.shallow_clone()).collect()
    } else {
        v
    }
}

pub(crate) fn state_name(prefix: &str, param: &Item, field: &str) -> String {
    format!("{prefix}.state.{}.{field}", param.param.as_deref().unwrap_or(&param.name))
}
