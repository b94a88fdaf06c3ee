//! The group's own bookkeeping collectives: a few integers gathered, broadcast or reduced (agreement
//! checks, DDP's loop check and bucket sync, the unused-parameter map, overflow flags, checkpoint status).
//!
//! They all go through [`Meta`], which decides once where such integers travel: on the group's CPU
//! backend when it has one (Gloo), else on the CUDA device of its NCCL backend, which takes CUDA tensors
//! only. Metadata then never waits behind GPU work on a `cpu:gloo,cuda:nccl` group.
//!
//! The first check of all is [`agree`](Meta::agree): gather a few integers from every rank and fail, on
//! every rank alike, when they differ. Gloo aborts the whole process (an uncaught exception on its
//! transport thread) when ranks pass tensors of different sizes; checking first turns that into an
//! error that names each rank's view.
//!
//! The checks must not trip Gloo themselves when ranks are at different ones (one rank in DDP's loop
//! check, another in the check before a logging allreduce). So, in a group that verifies, every
//! metadata exchange starts with one message of the same size everywhere ([`HEAD`] integers): what the
//! exchange is and how long its payload, with the payload itself when it is a few integers (a gather of
//! `i64`s: every agreement check). Ranks whose first messages disagree get an error naming each rank's
//! exchange before anything of another size travels. Groups with PyTorch ranks (verification off) keep
//! PyTorch's messages as they are.
use tch::kind::Element;
use tch::{Device, Tensor};

use super::{tensor_meta, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

/// Metadata collectives of one group, on one device (see the module docs).
pub(crate) struct Meta<'a> {
    pg: &'a ProcessGroup,
    device: Device,
}

impl ProcessGroup {
    /// Where the group's metadata travels: CPU when it has a CPU backend, else its CUDA device.
    pub(crate) fn meta(&self) -> Meta<'_> {
        Meta { pg: self, device: self.meta_device() }
    }

    /// PyTorch's DDP runs its own bookkeeping (parameter check, bucket sync, unused map) on the
    /// parameters' device. A group that mixes in PyTorch ranks has agreement checks off, and then these
    /// collectives follow PyTorch to stay on its wire; otherwise they go where [`meta`](Self::meta) says.
    pub(crate) fn meta_as_pytorch(&self, params_device: Device) -> Meta<'_> {
        if self.verifies() {
            self.meta()
        } else {
            Meta { pg: self, device: params_device }
        }
    }
}

fn to_vec<T: Element + Copy>(t: &Tensor) -> Result<Vec<T>> {
    Ok(Vec::<T>::try_from(t.f_to_device(Device::Cpu)?)?)
}

/// Integers in the first message of every metadata exchange of a verifying group.
const HEAD: usize = 16;
/// `[kind, payload length, dtype, root or reduce op]`, then an inline payload.
const HEAD_FIELDS: usize = 4;

/// What a metadata exchange is, as its first message says.
#[derive(Clone, Copy)]
enum Exchange {
    /// A gather of `i64`s short enough to travel in the first message.
    Inline,
    Gather,
    Broadcast(usize),
    Allreduce(ReduceOp),
}

impl Exchange {
    fn code(self) -> [i64; 2] {
        match self {
            Exchange::Inline => [1, 0],
            Exchange::Gather => [2, 0],
            Exchange::Broadcast(root) => [3, root as i64],
            Exchange::Allreduce(op) => [4, op.code() as i64],
        }
    }
}

/// `a gather of 3 Int64` and the like, from a first message.
fn show_head(h: &[i64]) -> String {
    let kind = crate::dtype::from_code(h[2]).map_or_else(|| format!("dtype#{}", h[2]), |k| format!("{k:?}"));
    let n = h[1];
    match h[0] {
        1 | 2 => format!("a gather of {n} {kind}"),
        3 => format!("a broadcast of {n} {kind} from rank {}", h[3]),
        4 => format!("an allreduce of {n} {kind} (op {})", h[3]),
        other => format!("exchange #{other}"),
    }
}

impl Meta<'_> {
    pub(crate) fn device(&self) -> Device {
        self.device
    }

    fn op(&self, what: &str) -> String {
        format!("{what} on {} of {}", self.pg.who(self.pg.rank()), self.pg.size())
    }

    fn tensor<T: Element + Copy>(&self, v: &[T]) -> Result<Tensor> {
        Ok(Tensor::from_slice(v).f_to_device(self.device)?)
    }

    /// The first message of an exchange in a verifying group (see the module docs): every rank's, when
    /// all agree on what the exchange is; else an error on every rank naming each one's.
    fn head<T: Element + Copy>(&self, what: &str, x: Exchange, v: &[T], inline: &[i64]) -> Result<Vec<Vec<i64>>> {
        let [kind, arg] = x.code();
        let dtype = crate::dtype::code(T::KIND).map_or(-1, i64::from);
        let mut h = [0i64; HEAD];
        h[..HEAD_FIELDS].copy_from_slice(&[kind, v.len() as i64, dtype, arg]);
        h[HEAD_FIELDS..HEAD_FIELDS + inline.len()].copy_from_slice(inline);
        let rows = self.gather_raw(what, &h)?;
        if rows.iter().all(|r| r[..HEAD_FIELDS] == rows[0][..HEAD_FIELDS]) {
            return Ok(rows);
        }
        let listing = by_rank(&rows, show_head, ", ");
        Err(dumped(
            self.pg,
            Error::mismatch(
                self.op(what),
                format!(
                    "ranks are at different metadata exchanges here ({listing}){}; {}: one rank runs a collective, a \
                 forward or a check that the others do not",
                    odd_ones_out(self.pg, &rows.iter().map(|r| r[..HEAD_FIELDS].to_vec()).collect::<Vec<_>>()),
                    self.sites(what)
                ),
            ),
        ))
    }

    /// After a disagreement that every rank saw at this same exchange: where each rank was, from one more
    /// message of [`HEAD`] integers (the same size everywhere, so it cannot trip the engine): `call sites:
    /// rank 0 at "DDP forward", rank 1 at "allreduce (agreement check before it)" (in "logging")`.
    fn sites(&self, what: &str) -> String {
        let outer = crate::flight::current_label();
        let mine = if outer.is_empty() || outer == what {
            format!("\"{what}\"")
        } else {
            format!("\"{what}\" (in \"{outer}\")")
        };
        let bytes = mine.as_bytes();
        let mut cut = bytes.len().min((HEAD - 1) * 8);
        while !mine.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut msg = [0i64; HEAD];
        msg[0] = cut as i64;
        for (i, chunk) in bytes[..cut].chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            msg[1 + i] = i64::from_le_bytes(b);
        }
        let Ok(rows) = self.gather_raw(&format!("{what}: call sites"), &msg) else {
            return format!("this rank was at {mine}");
        };
        let listing: Vec<String> = rows
            .iter()
            .enumerate()
            .map(|(r, row)| {
                let n = (row[0].max(0) as usize).min((HEAD - 1) * 8);
                let bytes: Vec<u8> = row[1..].iter().flat_map(|v| v.to_le_bytes()).take(n).collect();
                format!("rank {r} at {}", String::from_utf8_lossy(&bytes))
            })
            .collect();
        format!("call sites: {}", listing.join(", "))
    }

    /// Every rank's `v`, in rank order. All ranks must pass the same length (callers use fixed layouts).
    pub(crate) fn gather<T: Element + Copy + 'static>(&self, what: &str, v: &[T]) -> Result<Vec<Vec<T>>> {
        if self.pg.size() == 1 {
            return Ok(vec![v.to_vec()]);
        }
        if self.pg.verifies() {
            // small i64 payloads ride inline in the first message (checked before any copy)
            let ints = if v.len() <= HEAD - HEAD_FIELDS { same_type::<T, i64>(v) } else { None };
            if let Some(ints) = ints {
                let rows = self.head(what, Exchange::Inline, v, &ints)?;
                let n = v.len();
                return Ok(rows.iter().filter_map(|r| same_type::<i64, T>(&r[HEAD_FIELDS..HEAD_FIELDS + n])).collect());
            }
            self.head(what, Exchange::Gather, v, &[])?;
        }
        self.gather_raw(what, v)
    }

    fn gather_raw<T: Element + Copy>(&self, what: &str, v: &[T]) -> Result<Vec<Vec<T>>> {
        let _l = crate::flight::label(what);
        let mine = self.tensor(v)?;
        let mut all: Vec<Tensor> = (0..self.pg.size()).map(|_| mine.zeros_like()).collect();
        self.pg.all_gather_unverified(&mut all, &mine).and_then(|w| w.wait()).map_err(|e| e.in_op(self.op(what)))?;
        all.iter().map(to_vec).collect()
    }

    /// Rank `root`'s `v` (every rank passes a slice of the same length).
    pub(crate) fn broadcast<T: Element + Copy + 'static>(&self, what: &str, v: &[T], root: usize) -> Result<Vec<T>> {
        if self.pg.size() == 1 {
            return Ok(v.to_vec());
        }
        if self.pg.verifies() {
            self.head(what, Exchange::Broadcast(root), v, &[])?;
        }
        let _l = crate::flight::label(what);
        let mut t = self.tensor(v)?;
        self.pg.broadcast_unverified(&mut t, root).and_then(|w| w.wait()).map_err(|e| e.in_op(self.op(what)))?;
        to_vec(&t)
    }

    /// `v` reduced elementwise across ranks.
    pub(crate) fn allreduce<T: Element + Copy + 'static>(&self, what: &str, v: &[T], op: ReduceOp) -> Result<Vec<T>> {
        if self.pg.size() == 1 {
            return Ok(v.to_vec());
        }
        if self.pg.verifies() {
            self.head(what, Exchange::Allreduce(op), v, &[])?;
        }
        let _l = crate::flight::label(what);
        let mut t = self.tensor(v)?;
        self.pg.allreduce_unverified(&mut t, op).and_then(|w| w.wait()).map_err(|e| e.in_op(self.op(what)))?;
        to_vec(&t)
    }

    /// Shares the outcome of a step every rank did on its own (writing a checkpoint, stepping its shard),
    /// so that no rank goes on, or waits for the others, after one failed: `Ok` everywhere if it
    /// succeeded everywhere; else on every rank an error naming the first rank that failed and its
    /// message (failed ranks leave their messages in the group's store). Every rank calls it, failed or not.
    pub(crate) fn outcome<T>(&self, what: &str, local: Result<T>) -> Result<T> {
        let n = self.pg.outcomes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = |r: usize| format!("outcome/{n}/{r}");
        if let Err(e) = &local {
            // before the gather, so the others can read it when the gather tells them
            let _ = self.pg.store.set(&key(self.pg.rank()), e.to_string().as_bytes());
        }
        let flags = self.gather(what, &[local.is_err() as i64])?;
        let Some(first) = flags.iter().position(|f| f[0] != 0) else { return local };
        if first == self.pg.rank() {
            return local;
        }
        let msg = self
            .pg
            .store
            .get(&key(first))
            .map(|m| String::from_utf8_lossy(&m).to_string())
            .unwrap_or_else(|e| format!("(its message could not be read: {e})"));
        Err(Error::RankFailed { op: self.op(what), rank: first, msg })
    }

    /// Gathers `v` from every rank and fails on every rank alike when any differ; `explain` turns the
    /// rows (rank order) into the error's message. Returns the rows.
    pub(crate) fn agree(
        &self,
        what: &str,
        v: &[i64],
        explain: impl FnOnce(&[Vec<i64>]) -> String,
    ) -> Result<Vec<Vec<i64>>> {
        let rows = self.gather(what, v)?;
        if rows.iter().all(|r| r == &rows[0]) {
            return Ok(rows);
        }
        let sites = if self.pg.verifies() { format!("; {}", self.sites(what)) } else { String::new() };
        Err(dumped(self.pg, Error::mismatch(self.op(what), format!("{}{sites}", explain(&rows)))))
    }
}

/// `v` as `B`s when `A` and `B` are one type (an `i64` payload travels inline in a first
/// message, and comes back out of it).
fn same_type<A: Copy + 'static, B: Copy + 'static>(v: &[A]) -> Option<Vec<B>> {
    if std::any::TypeId::of::<A>() != std::any::TypeId::of::<B>() {
        return None;
    }
    v.iter().map(|x| (x as &dyn std::any::Any).downcast_ref::<B>().copied()).collect()
}

/// A disagreement every rank of the group saw: each leaves its flight-recorder dump (when there is a dump
/// directory), as on a failed collective.
fn dumped(pg: &ProcessGroup, e: Error) -> Error {
    if !pg.is_survivable() {
        crate::flight::dump(&e.to_string());
    }
    e
}

/// "; the odd one out: rank 2" when most ranks of `pg` agree and a few do not (with their world ranks in a
/// subgroup: "rank 2 (world rank 3)").
pub(crate) fn odd_ones_out(pg: &ProcessGroup, rows: &[Vec<i64>]) -> String {
    let common = rows.iter().max_by_key(|r| rows.iter().filter(|x| x == r).count());
    let Some(common) = common else { return String::new() };
    let odd: Vec<String> = rows.iter().enumerate().filter(|(_, r)| *r != common).map(|(i, _)| pg.who(i)).collect();
    if odd.is_empty() || odd.len() * 2 >= rows.len() {
        return String::new();
    }
    let s = if odd.len() == 1 { "" } else { "s" };
    format!("; the odd one{s} out: {}", odd.join(", "))
}

/// `rank 0: .., rank 1: ..` for error messages.
pub(crate) fn by_rank(rows: &[Vec<i64>], show: impl Fn(&[i64]) -> String, sep: &str) -> String {
    rows.iter().enumerate().map(|(r, v)| format!("rank {r}: {}", show(v))).collect::<Vec<_>>().join(sep)
}

/// What must agree across ranks for one collective: `[op, extra (root or reduce op), dtype/shape...]`.
pub(crate) fn fingerprint(op: i64, t: &Tensor, extra: i64) -> Vec<i64> {
    let mut f = vec![op, extra];
    f.extend_from_slice(&tensor_meta::encode(t));
    f
}

/// The check before a public collective: all ranks pass the same operation, arguments, dtype and shape.
pub(crate) fn agree_on_op(pg: &ProcessGroup, what: &str, op: i64, t: &Tensor, extra: i64) -> Result<()> {
    if !pg.checks_now(super::Scope::Collective, what, t.device()) {
        return Ok(());
    }
    let what = format!("{what} (agreement check before it)");
    pg.meta().agree(&what, &fingerprint(op, t, extra), |rows| {
        let listing = by_rank(rows, |f| tensor_meta::render(&f[2..]), ", ");
        let odd = odd_ones_out(pg, rows);
        if rows.iter().any(|r| r[..2] != rows[0][..2]) {
            format!("ranks issued different operations or arguments at this point ({listing}){odd}")
        } else {
            format!("ranks disagree on dtype/shape: {listing}{odd}")
        }
    })?;
    Ok(())
}
