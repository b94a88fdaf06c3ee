//! All-to-all, as `torch.distributed.all_to_all_single` and `all_to_all`: every rank sends a chunk to
//! every rank, chunks of any size (expert parallelism's token dispatch). Both forms run as c10d's
//! `alltoall_base` (one flat tensor each way, chunk sizes by rank), which Gloo and NCCL both implement for
//! uneven chunks; the list form packs its tensors into one and unpacks after the wait.
//!
//! With agreement checks on, a call first gathers every rank's chunk sizes and refuses, on every rank
//! alike, sizes that do not pair up (rank r's chunk for s must be what s expects from r): Gloo aborts the
//! process on such a mismatch, and NCCL hangs or writes past the chunk.
use tch::{Kind, Tensor};

use super::{describe, meta, ProcessGroup, Scope};
use crate::error::{Error, Result};
use crate::work::{Finish, Work};

/// The agreement check's operation code (beside `meta::agree_on_op`'s).
const OP: i64 = 9;

impl ProcessGroup {
    /// Splits `input` along dim 0 into chunks of `input_splits[r]` rows and sends chunk r to rank r; rank
    /// r's chunk for this rank lands in `output` at `output_splits`' place (rows in rank order). Empty
    /// splits (`&[]`) mean equal chunks (`size(0)` divisible by the group size), as PyTorch's `None`. Rows
    /// must hold the same number of elements in `input`, `output` and on every rank.
    pub fn all_to_all_single(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<()> {
        self.all_to_all_single_async(output, input, output_splits, input_splits)?.wait()
    }

    pub fn all_to_all_single_async(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<Work> {
        self.all_to_all_single_checked(output, input, output_splits, input_splits, true)
    }

    /// [`all_to_all_single_async`](Self::all_to_all_single_async), its agreement check left out when
    /// `check` is false: for a caller whose ranks' splits pair up by construction once it has checked what
    /// they derive from (ring attention's shifts, after one check of the shapes).
    pub(crate) fn all_to_all_single_checked(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
        check: bool,
    ) -> Result<Work> {
        let what = format!("all_to_all_single of {} into {}", describe(input), describe(output));
        let desc = || what.clone();
        let e = self.engine(input.device(), &desc)?;
        if input.kind() != output.kind() || input.device() != output.device() {
            return Err(Error::invalid(desc(), "input and output must have one dtype and one device"));
        }
        if input.dim() == 0 || output.dim() == 0 {
            return Err(Error::invalid(desc(), "input and output need a dim 0 to split (got a scalar)"));
        }
        if !output.is_contiguous() {
            return Err(Error::invalid(desc(), "the output must be contiguous (it is written in place)"));
        }
        let row = |t: &Tensor| t.size()[1..].iter().product::<i64>();
        if row(input) != row(output) {
            return Err(Error::mismatch(
                desc(),
                format!("a row of the input holds {} elements, of the output {}", row(input), row(output)),
            ));
        }
        let ins = self.splits(&desc, "input", input, input_splits)?;
        let outs = self.splits(&desc, "output", output, output_splits)?;
        if check {
            self.agree_on_splits(input, row(input), &ins, &outs)?;
        }
        let input = input.f_contiguous()?;
        // the engine's work holds both tensors until it ends; an empty split list means equal chunks
        let (os, is) = if output_splits.is_empty() && input_splits.is_empty() { (vec![], vec![]) } else { (outs, ins) };
        self.launch(e, desc(), |pg| pg.alltoall_base(output, &input, &os, &is), None)
    }

    /// Sends `inputs[r]` to rank r and receives rank r's tensor for this rank into `outputs[r]`, as
    /// `torch.distributed.all_to_all`. Shapes may differ from rank to rank (each output must have the
    /// elements its sender sends); one dtype throughout.
    pub fn all_to_all(&self, outputs: &mut [Tensor], inputs: &[Tensor]) -> Result<()> {
        self.all_to_all_async(outputs, inputs)?.wait()
    }

    /// [`all_to_all`](Self::all_to_all); `outputs` are written when the work is waited on.
    pub fn all_to_all_async(&self, outputs: &mut [Tensor], inputs: &[Tensor]) -> Result<Work> {
        let desc = || format!("all_to_all of {} tensors", inputs.len());
        let w = self.size;
        if inputs.len() != w || outputs.len() != w {
            return Err(Error::invalid(
                desc(),
                format!(
                    "{} inputs and {} outputs for a group of {w} ranks: one each per rank",
                    inputs.len(),
                    outputs.len()
                ),
            ));
        }
        let (kind, device) = (inputs[0].kind(), inputs[0].device());
        if let Some(t) = inputs.iter().chain(outputs.iter()).find(|t| t.kind() != kind || t.device() != device) {
            return Err(Error::invalid(
                desc(),
                format!("one dtype and one device for every tensor: {} and {}", describe(&inputs[0]), describe(t)),
            ));
        }
        let numels = |ts: &[Tensor]| ts.iter().map(|t| t.numel()).collect::<Vec<usize>>();
        let (in_n, out_n) = (numels(inputs), numels(outputs));
        let flat_in = Tensor::f_cat(&inputs.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0)?;
        let mut flat_out = Tensor::f_empty([out_n.iter().sum::<usize>() as i64], (kind, device))?;
        let work = self.all_to_all_single_async(&mut flat_out, &flat_in, &out_n, &in_n)?;
        let targets: Vec<Tensor> = outputs.iter().map(|t| t.shallow_clone()).collect();
        let unpack: Finish = Box::new(move || {
            let mut off = 0i64;
            for (mut t, n) in targets.into_iter().zip(out_n) {
                let part = flat_out.f_narrow(0, off, n as i64)?.f_view(t.size().as_slice())?;
                t.f_copy_(&part)?;
                off += n as i64;
            }
            Ok(())
        });
        Ok(work.then(unpack))
    }

    /// Chunk sizes (rows) per rank: the given ones, checked against `t`'s dim 0, or equal ones.
    pub(crate) fn splits(
        &self,
        desc: &dyn Fn() -> String,
        what: &str,
        t: &Tensor,
        given: &[usize],
    ) -> Result<Vec<i64>> {
        let rows = t.size()[0];
        let w = self.size as i64;
        match given {
            [] if rows % w == 0 => Ok(vec![rows / w; self.size]),
            [] => Err(Error::invalid(
                desc(),
                format!("the {what} has {rows} rows, not divisible by the group's {w} ranks: give {what}_splits"),
            )),
            s if s.len() != self.size => {
                Err(Error::invalid(desc(), format!("{what}_splits has {} entries for a group of {w} ranks", s.len())))
            }
            s if s.iter().sum::<usize>() as i64 != rows => Err(Error::invalid(
                desc(),
                format!("{what}_splits {s:?} add up to {} rows; the {what} has {rows}", s.iter().sum::<usize>()),
            )),
            s => Ok(s.iter().map(|&n| n as i64).collect()),
        }
    }

    /// The check before an all-to-all (see the module docs): dtype and row size alike everywhere, and
    /// what rank r sends to s is what s expects from r.
    pub(crate) fn agree_on_splits(&self, t: &Tensor, row: i64, ins: &[i64], outs: &[i64]) -> Result<()> {
        if !self.checks_now(Scope::Collective, "all_to_all", t.device()) {
            return Ok(());
        }
        let what = "all_to_all (agreement check before it)";
        let dtype = crate::dtype::code(t.kind()).map_or(-1, i64::from);
        let mut mine = vec![OP, dtype, row];
        mine.extend_from_slice(ins);
        mine.extend_from_slice(outs);
        let rows = self.meta().gather(what, &mine)?;
        let w = self.size;
        let kind = |c: i64| crate::dtype::from_code(c).map_or_else(|| format!("dtype#{c}"), |k: Kind| format!("{k:?}"));
        let op = || format!("{what} on rank {} of {w}", self.rank);
        if rows.iter().any(|r| r[..3] != rows[0][..3]) {
            let listing = meta::by_rank(&rows, |r| format!("{} rows of {} elements", kind(r[1]), r[2]), ", ");
            return Err(Error::mismatch(op(), format!("ranks disagree on dtype or row size: {listing}")));
        }
        let mut bad = Vec::new();
        for (src, r) in rows.iter().enumerate() {
            for (dst, d) in rows.iter().enumerate() {
                let (sent, expected) = (r[3 + dst], d[3 + w + src]);
                if sent != expected {
                    bad.push(format!("rank {src} sends {sent} rows to rank {dst}, which expects {expected}"));
                }
            }
        }
        if bad.is_empty() {
            return Ok(());
        }
        Err(Error::mismatch(op(), format!("the splits do not pair up: {}", bad.join("; "))))
    }
}
