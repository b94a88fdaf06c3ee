//! The collectives DDP runs besides bucket reductions, in PyTorch's exact wire protocol (so a PyTorch DDP
//! rank and ours can share a group): parameter verification, coalesced broadcast of model state, and
//! rank 0's bucket assignment.
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::{meta, tensor_meta, ProcessGroup};

/// PyTorch DDP's `broadcast_bucket_size`.
pub(crate) const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

/// Checks that all ranks hold the same parameters (count, then dtype and shape of each), before anything
/// is broadcast. Errors name the first mismatching parameter and the ranks involved.
///
/// With the group's agreement checks on, every rank gathers every rank's description (robust: no
/// collective ever sees mismatched sizes). With them off, this is PyTorch's own protocol
/// (`_verify_param_shape_across_processes`: all_gather of the count, broadcast of sizes and strides, on
/// the parameters' device), so a PyTorch DDP rank can join.
pub(crate) fn verify_params(pg: &ProcessGroup, params: &[Tensor], names: &[String]) -> Result<()> {
    const WHAT: &str = "DDP parameter check";
    let meta = pg.meta_as_pytorch(params.first().map_or(Device::Cpu, |p| p.device()));
    // 1. parameter counts (both protocols)
    let counts = meta.gather(WHAT, &[params.len() as i64])?;
    if let Some(r) = counts.iter().position(|c| c != &counts[0]) {
        return Err(Error::mismatch(
            op(pg, WHAT),
            format!("rank 0 has {} parameters but rank {r} has {}", counts[0][0], counts[r][0]),
        ));
    }
    if pg.verifies() {
        // 2a. every rank's dtype and shape per parameter, gathered everywhere
        const K: usize = tensor_meta::LEN;
        let mine: Vec<i64> = params.iter().flat_map(tensor_meta::encode).collect();
        let all = meta.gather(WHAT, &mine)?;
        for i in 0..params.len() {
            let row = |r: usize| &all[r][i * K..i * K + K];
            if let Some(r) = (1..pg.size()).find(|&r| row(r) != row(0)) {
                return Err(Error::mismatch(
                    op(pg, WHAT),
                    format!(
                        "parameter {i} ({}) is {} on rank 0 but {} on rank {r}",
                        names[i],
                        tensor_meta::render(row(0)),
                        tensor_meta::render(row(r))
                    ),
                ));
            }
        }
    } else {
        // 2b. PyTorch's protocol: rank 0's sizes and strides, broadcast, compared locally.
        let mut local = Vec::new();
        for p in params {
            local.extend(p.size());
            local.extend(p.stride());
        }
        let control = meta.broadcast(WHAT, &local, 0)?;
        let mut k = 0;
        for (i, p) in params.iter().enumerate() {
            let n = 2 * p.dim();
            if control.get(k..k + n) != local.get(k..k + n) {
                return Err(Error::mismatch(
                    op(pg, WHAT),
                    format!("parameter {i} ({}) with sizes {:?} does not match rank 0's", names[i], p.size()),
                ));
            }
            k += n;
        }
    }
    Ok(())
}

fn op(pg: &ProcessGroup, what: &str) -> String {
    format!("{what} on {} of {}", pg.who(pg.rank()), pg.size())
}

/// Broadcasts `tensors` from `root` in place, flattened into chunks of at most `limit` bytes per dtype
/// (PyTorch's `_broadcast_coalesced`): few large messages instead of one per tensor.
pub(crate) fn broadcast_coalesced(pg: &ProcessGroup, tensors: &[Tensor], limit: usize, root: usize) -> Result<()> {
    let _g = tch::no_grad_guard();
    for group in take_tensors(tensors, limit) {
        let flats: Vec<Tensor> =
            group.iter().map(|&i| tensors[i].f_reshape([-1])).collect::<std::result::Result<_, _>>()?;
        let mut flat = Tensor::f_cat(&flats, 0)?;
        drop(flats);
        pg.broadcast_unverified(&mut flat, root)?.wait()?;
        let mut off = 0i64;
        for &i in &group {
            let n = tensors[i].numel() as i64;
            let mut dst = tensors[i].shallow_clone();
            dst.f_copy_(&flat.f_narrow(0, off, n)?.f_view(tensors[i].size().as_slice())?)?;
            off += n;
        }
    }
    Ok(())
}

/// Groups tensor indices by (dtype, device), consecutive within a group, closing a group once it holds at
/// least `limit` bytes (libtorch's `take_tensors`).
fn take_tensors(tensors: &[Tensor], limit: usize) -> Vec<Vec<usize>> {
    let specs: Vec<_> = tensors.iter().map(super::bucket::TensorSpec::of).collect();
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<(Kind, Device, Vec<usize>, usize)> = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let pos = match open.iter().position(|o| o.0 == s.kind && o.1 == s.device) {
            Some(p) => p,
            None => {
                open.push((s.kind, s.device, Vec::new(), 0));
                open.len() - 1
            }
        };
        let o = &mut open[pos];
        o.2.push(i);
        o.3 += s.bytes();
        if o.3 >= limit {
            out.push(std::mem::take(&mut o.2));
            o.3 = 0;
        }
    }
    out.extend(open.into_iter().filter(|o| !o.2.is_empty()).map(|o| o.2));
    out
}

/// Makes every rank use rank 0's bucket assignment (PyTorch's `sync_bucket_indices`: a broadcast of the
/// flattened indices plus the bucket count, then of the bucket sizes, as int32 on the parameters' device).
pub(crate) fn sync_bucket_indices(
    pg: &ProcessGroup,
    buckets: &[Vec<usize>],
    n_params: usize,
    params_device: Device,
) -> Result<Vec<Vec<usize>>> {
    const WHAT: &str = "DDP bucket rebuild";
    if pg.verifies() {
        // PyTorch's second broadcast is sized by the local bucket count; make sure all agree first.
        pg.meta().agree(WHAT, &[buckets.len() as i64], |rows| {
            format!("ranks built different numbers of buckets ({})", meta::by_rank(rows, |v| v[0].to_string(), ", "))
        })?;
    }
    let meta = pg.meta_as_pytorch(params_device);
    let mut flat: Vec<i32> = buckets.iter().flatten().map(|&i| i as i32).collect();
    if flat.len() != n_params {
        return Err(Error::invalid(op(pg, WHAT), format!("{} indices for {n_params} parameters", flat.len())));
    }
    flat.push(buckets.len() as i32);
    let indices = meta.broadcast(WHAT, &flat, 0)?;
    let nb = indices[n_params] as usize;
    let sizes = meta.broadcast(WHAT, &buckets.iter().map(|b| b.len() as i32).collect::<Vec<_>>(), 0)?;
    if sizes.len() != nb {
        return Err(Error::mismatch(op(pg, WHAT), format!("rank 0 has {nb} buckets, this rank {}", sizes.len())));
    }
    let mut out = Vec::with_capacity(nb);
    let mut k = 0;
    for s in sizes {
        out.push(indices[k..k + s as usize].iter().map(|&i| i as usize).collect());
        k += s as usize;
    }
    Ok(out)
}
