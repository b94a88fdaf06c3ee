//! Healing: a healthy replica sends a recovering one everything it trains with (parameters, optimizer
//! state, the step); nothing touches the disk. The two ranks make a group of their own from their
//! replicate group's store (the sender first) and broadcast over it, so that a wait on a sender cut off
//! silently ends when its heartbeat stops, as in any collective (point-to-point waits are not watched);
//! forming that group is watched the same way, through the sender's heartbeat in the replicate group.
//! One transfer in three parts, in the same order on both sides: the two lengths, a JSON header naming
//! each tensor, then all tensors' bytes in one buffer.
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::format::{dtype_kind, dtype_name};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::storage::bytes_of;

#[derive(Serialize, Deserialize)]
struct Header {
    step: u64,
    tensors: Vec<Entry>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<i64>,
    /// Byte offset in the payload (8-aligned, so any dtype can be viewed there).
    offset: i64,
}

/// The group of the sender `src` (its rank 0) and the receiver `dst` for transfer `name`.
fn pair(pg: &ProcessGroup, src: usize, dst: usize, name: &str) -> Result<ProcessGroup> {
    // a sender that dies before the pair forms is found by its heartbeat in `pg`, not the group timeout
    let g = pg
        .new_subgroup_watched(&[src, dst], name)?
        .ok_or_else(|| Error::invalid("healing", format!("rank {} is neither {src} nor {dst}", pg.rank())))?;
    g.set_survivable();
    Ok(g)
}

/// Frees a pair's group on a thread of its own (after a failure its engine may wait on the lost peer).
fn dispose(g: ProcessGroup) {
    let _ = std::thread::Builder::new().name("tdx-ft-heal".into()).spawn(move || drop(g));
}

/// Sends `step` and `state` to rank `dst` of `pg`, as transfer `name` (the same on both sides, new for
/// each transfer in `pg`).
pub(crate) fn send(pg: &ProcessGroup, dst: usize, name: &str, step: u64, state: &[(String, Tensor)]) -> Result<()> {
    let mut entries = Vec::with_capacity(state.len());
    let mut offset = 0i64;
    for (name, t) in state {
        entries.push(Entry { name: name.clone(), dtype: dtype_name(t.kind())?.to_string(), shape: t.size(), offset });
        offset += (bytes_of(t) + 7) / 8 * 8;
    }
    let header = serde_json::to_vec(&Header { step, tensors: entries })
        .map_err(|e| Error::invalid("healing", format!("cannot encode the state's header: {e}")))?;
    let payload = Tensor::f_zeros([offset], (Kind::Uint8, Device::Cpu))?;
    {
        let _g = tch::no_grad_guard();
        let mut at = 0i64;
        for (_, t) in state {
            let n = bytes_of(t);
            if n > 0 {
                let bytes =
                    t.f_detach()?.f_to(Device::Cpu)?.f_contiguous()?.f_reshape([-1])?.f_view_dtype(Kind::Uint8)?;
                payload.f_narrow(0, at, n)?.f_copy_(&bytes)?;
            }
            at += (n + 7) / 8 * 8;
        }
    }
    #[cfg(feature = "testing")]
    if step > 0 {
        fault_point("kill-before-sending");
    }
    let g = pair(pg, pg.rank(), dst, name)?;
    let sent = (|| {
        g.broadcast(&mut Tensor::from_slice(&[header.len() as i64, offset]), 0)?;
        #[cfg(feature = "testing")]
        if step > 0 {
            fault_point("kill-while-sending");
        }
        g.broadcast(&mut Tensor::from_slice(&header), 0)?;
        g.broadcast(&mut payload.shallow_clone(), 0)
    })();
    dispose(g);
    sent
}

/// Receives what [`send`] sent from rank `src`: the step and the named tensors (on the CPU).
pub(crate) fn recv(pg: &ProcessGroup, src: usize, name: &str) -> Result<(u64, Vec<(String, Tensor)>)> {
    let g = pair(pg, src, pg.rank(), name)?;
    let got = receive(&g, src);
    dispose(g);
    got
}

fn receive(g: &ProcessGroup, src: usize) -> Result<(u64, Vec<(String, Tensor)>)> {
    let mut lengths = Tensor::f_zeros([2], (Kind::Int64, Device::Cpu))?;
    g.broadcast(&mut lengths, 0)?;
    let (hlen, plen) = (lengths.f_int64_value(&[0])?, lengths.f_int64_value(&[1])?);
    if !(0..=1 << 30).contains(&hlen) || plen < 0 {
        return Err(Error::Mismatch {
            op: "healing".into(),
            msg: format!("rank {src} announced a header of {hlen} bytes and a payload of {plen}"),
        });
    }
    let mut header = Tensor::f_zeros([hlen], (Kind::Uint8, Device::Cpu))?;
    g.broadcast(&mut header, 0)?;
    let mut payload = Tensor::f_zeros([plen], (Kind::Uint8, Device::Cpu))?;
    g.broadcast(&mut payload, 0)?;
    let bytes: Vec<u8> = Vec::<u8>::try_from(&header)?;
    let h: Header = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Mismatch { op: "healing".into(), msg: format!("rank {src} sent a bad header: {e}") })?;
    let mut out = Vec::with_capacity(h.tensors.len());
    for e in h.tensors {
        let kind = dtype_kind(&e.dtype)?;
        let numel: i64 = e.shape.iter().product();
        let n = numel * kind.elt_size_in_bytes() as i64;
        if e.offset < 0 || e.offset + n > plen {
            return Err(Error::Mismatch {
                op: "healing".into(),
                msg: format!("tensor {} lies outside the {plen} bytes rank {src} sent", e.name),
            });
        }
        let t = if n == 0 {
            Tensor::f_zeros(e.shape.as_slice(), (kind, Device::Cpu))?
        } else {
            payload.f_narrow(0, e.offset, n)?.f_view_dtype(kind)?.f_reshape(e.shape.as_slice())?.f_detach_copy()?
        };
        out.push((e.name, t));
    }
    Ok((h.step, out))
}

/// Tests of healing kill the sender after step 0 before its pair's group forms
/// (`TCH_DIST_FT_FAULT=kill-before-sending`) or in the middle of the transfer (`kill-while-sending`), on
/// a worker's first start only.
#[cfg(feature = "testing")]
fn fault_point(name: &str) {
    if crate::settings::ft_fault().is_some_and(|f| f == name) {
        eprintln!("tch-dist: fault injected: {name}");
        crate::ffi::kill_self();
    }
}
