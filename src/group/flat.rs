//! The flat collectives of ZeRO and FSDP: all-gather into, and reduce-scatter out of, one buffer of
//! `world` equal chunks, chunk r rank r's. One place picks the algorithm by engine: NCCL's own collectives
//! (c10d's `_allgather_base` / `_reduce_scatter_base`, PyTorch's `all_gather_into_tensor` /
//! `reduce_scatter_tensor`, as FSDP2 uses), and on Gloo a ring of batched steps (`ring`), measured faster
//! than Gloo's own there.
use std::collections::VecDeque;

use tch::{Device, Tensor};

use super::policy::Collectives;
use super::ring::{self, RingReduce};
use super::{describe, meta, Backend, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::work::Work;

impl ProcessGroup {
    /// Whether flat collectives on `device` run as rings.
    fn rings_on(&self, device: Device) -> bool {
        match self.collectives {
            Collectives::Native => false,
            Collectives::Ring => true,
            Collectives::Auto => self.backend_for(device) == Some(Backend::Gloo),
        }
    }

    /// Gathers every rank's `input` into `output` (`size()` times as many elements, rank r's at
    /// `r * input.numel()`), as `torch.distributed.all_gather_into_tensor`.
    pub fn all_gather_into_tensor(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_into_tensor_async(output, input)?.wait()
    }

    pub fn all_gather_into_tensor_async(&self, output: &mut Tensor, input: &Tensor) -> Result<Work> {
        let desc = || format!("all_gather_into_tensor of {} into {}", describe(input), describe(output));
        self.check_flat(&desc(), output, input)?;
        meta::agree_on_op(self, "all_gather_into_tensor", 6, input, 0)?;
        self.all_gather_base(output, input)
    }

    /// Reduces `input` (`size()` chunks of `output`'s size) across ranks and leaves chunk r's result in
    /// rank r's `output`, as `torch.distributed.reduce_scatter_tensor`.
    pub fn reduce_scatter_tensor(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_tensor_async(output, input, op)?.wait()
    }

    pub fn reduce_scatter_tensor_async(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        let desc = format!("reduce_scatter_tensor({op:?}) of {} into {}", describe(input), describe(output));
        self.check_flat(&desc, input, output)?;
        let e = self.engine(output.device(), &|| desc.clone())?;
        let (code, finish) = self.reduction(e, &desc, op, output)?;
        meta::agree_on_op(self, "reduce_scatter_tensor", 7, input, op.code() as i64)?;
        self.launch(e, desc, |pg| pg.reduce_scatter_base(output, input, code), finish)
    }

    fn check_flat(&self, desc: &str, whole: &Tensor, part: &Tensor) -> Result<()> {
        let n = self.size as i64;
        if whole.kind() != part.kind()
            || whole.device() != part.device()
            || whole.numel() as i64 != n * part.numel() as i64
        {
            return Err(Error::mismatch(
                desc.to_string(),
                format!(
                    "the whole tensor must have {n} times the elements of the part, in its dtype and on its device: {} \
                     and {}",
                    describe(whole),
                    describe(part)
                ),
            ));
        }
        Ok(())
    }

    fn all_gather_base(&self, output: &mut Tensor, input: &Tensor) -> Result<Work> {
        let desc = format!("all_gather_into_tensor of {} into {}", describe(input), describe(output));
        let e = self.engine(output.device(), &|| desc.clone())?;
        self.launch(e, desc, |pg| pg.allgather_base(output, input), None)
    }
}

/// Waits for the oldest entries of `pending` until fewer than `max_in_flight` remain.
pub(crate) fn bound(pending: &mut VecDeque<Vec<Work>>, max_in_flight: usize) -> Result<()> {
    while pending.len() >= max_in_flight.max(1) {
        if let Some(works) = pending.pop_front() {
            for w in works {
                w.wait()?;
            }
        }
    }
    Ok(())
}

/// All-gathers `flat` (`world` chunks of `len`, chunk r this rank's) in place. The work is left in
/// `pending` (oldest first, at most `max_in_flight` entries) so that it overlaps what the caller does
/// next; `label` names it in the flight recorder.
pub(crate) fn all_gather(
    pg: &ProcessGroup,
    flat: &Tensor,
    len: i64,
    label: &str,
    pending: &mut VecDeque<Vec<Work>>,
    max_in_flight: usize,
) -> Result<()> {
    if pg.size() == 1 {
        return Ok(());
    }
    if pg.rings_on(flat.device()) {
        return ring::all_gather_in_place(pg, flat, len, label, pending, max_in_flight);
    }
    let _l = crate::flight::label(label);
    bound(pending, max_in_flight)?;
    let mine = flat.f_narrow(0, pg.rank() as i64 * len, len)?;
    // NCCL gathers in place when the input is the output's own chunk; Gloo copies it in first, so it
    // gets a copy rather than the same memory
    let input = if pg.backend_for(flat.device()) == Some(Backend::Nccl) {
        mine
    } else {
        let copy = mine.f_empty_like()?;
        copy.shallow_clone().f_copy_(&mine)?;
        copy
    };
    let mut whole = flat.f_narrow(0, 0, pg.size() as i64 * len)?;
    let held = crate::storage::in_use(&[flat])?;
    pending.push_back(vec![pg.all_gather_base(&mut whole, &input)?.holding(held)]);
    Ok(())
}

/// A reduce-scatter in flight (see [`reduce_scatter`]).
pub(crate) enum Reduction {
    Ring(RingReduce),
    Native(Work),
}

/// Starts summing `buf` (`world` chunks of `out`'s size) across ranks into `out`, this rank's chunk.
/// `scratch` (like `out`, apart from `buf`) may serve the ring's intermediate steps.
pub(crate) fn reduce_scatter(
    pg: &ProcessGroup,
    buf: Tensor,
    out: Tensor,
    scratch: Option<Tensor>,
    label: String,
) -> Result<Reduction> {
    if pg.size() == 1 || pg.rings_on(buf.device()) {
        return Ok(Reduction::Ring(RingReduce::start(pg, buf, out, scratch, label)?));
    }
    let _l = crate::flight::label(label);
    let desc = format!("reduce_scatter_tensor(Sum) of {} into {}", describe(&buf), describe(&out));
    let e = pg.engine(out.device(), &|| desc.clone())?;
    let code = ReduceOp::Sum.code();
    let held = crate::storage::in_use(&[&buf, &out])?;
    let w = pg.launch(e, desc, |p| p.reduce_scatter_base(&out, &buf, code), None)?;
    Ok(Reduction::Native(w.holding(held)))
}

impl Reduction {
    /// Waits until this rank's chunk is in `out`.
    pub(crate) fn finish(self, pg: &ProcessGroup) -> Result<()> {
        match self {
            Reduction::Ring(r) => r.finish(pg),
            Reduction::Native(w) => w.wait(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::GroupOptions;
    use crate::store::Store;
    use tch::Kind;

    #[test]
    fn a_storage_with_a_gather_in_flight_is_not_freed_until_it_is_waited_for() {
        for collectives in [Collectives::Ring, Collectives::Native] {
            let store = Store::hash().unwrap();
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let store = store.clone();
                    std::thread::spawn(move || {
                        let o = GroupOptions { collectives, strict_nccl: true, ..GroupOptions::default() };
                        let pg = ProcessGroup::new(&store, rank, 2, &o).unwrap();
                        let flat = Tensor::full([8], rank as f64, (Kind::Float, Device::Cpu));
                        let mut pending = VecDeque::new();
                        all_gather(&pg, &flat, 4, "test gather", &mut pending, usize::MAX).unwrap();
                        let refused = crate::storage::free(&flat).unwrap_err().to_string();
                        for w in pending.into_iter().flatten() {
                            w.wait().unwrap();
                        }
                        let sum = flat.sum(Kind::Float).double_value(&[]);
                        crate::storage::free(&flat).unwrap();
                        (refused, sum)
                    })
                })
                .collect();
            for h in hs {
                let (refused, sum) = h.join().unwrap();
                assert!(refused.contains("still in flight"), "{collectives:?}: {refused}");
                assert_eq!(sum, 4.0, "{collectives:?}");
            }
        }
    }
}
