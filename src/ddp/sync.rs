//! The collectives DDP runs besides bucket reductions, in PyTorch's exact wire protocol (so a PyTorch DDP
//! rank and ours can share a group): parameter verification, coalesced broadcast of model state, and
//! rank 0's bucket assignment.
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// PyTorch DDP's `broadcast_bucket_size`.
pub const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

fn i64s(t: &Tensor) -> Result<Vec<i64>> {
    Ok(Vec::<i64>::try_from(t.to_device(Device::Cpu).to_kind(Kind::Int64))?)
}

/// Checks that all ranks hold the same parameters (count, then dtype and shape of each), before anything
/// is broadcast. Errors name the first mismatching parameter and the ranks involved.
///
/// With the group's agreement checks on, every rank gathers every rank's description (robust: no
/// collective ever sees mismatched sizes). With them off, this is PyTorch's own protocol
/// (`_verify_param_shape_across_processes`: all_gather of the count, broadcast of sizes and strides), so
/// a PyTorch DDP rank can join.
pub fn verify_params(pg: &ProcessGroup, params: &[Tensor], names: &[String]) -> Result<()> {
    let op = || format!("DDP parameter check on rank {} of {}", pg.rank(), pg.size());
    let dev = params.first().map_or(Device::Cpu, |p| p.device());
    let meta_dev = if pg.backend() == crate::Backend::Nccl { dev } else { Device::Cpu };
    // 1. parameter counts (both protocols)
    let counts = gather_i64_on(pg, params.len() as i64, meta_dev)?;
    if let Some(r) = counts.iter().position(|&c| c != counts[0]) {
        return Err(Error::mismatch(
            op(),
            format!("rank 0 has {} parameters but rank {r} has {}", counts[0], counts[r]),
        ));
    }
    if pg.verifies() {
        // 2a. every rank's (dtype, ndim, dims) per parameter, gathered everywhere
        const K: usize = 8;
        let mut mine = vec![0i64; params.len() * K];
        for (i, p) in params.iter().enumerate() {
            let f = crate::verify::fingerprint(0, p, 0);
            mine[i * K] = f[1];
            mine[i * K + 1] = f[2];
            mine[i * K + 2..i * K + K].copy_from_slice(&f[4..10]);
        }
        let t = Tensor::from_slice(&mine).to_device(meta_dev);
        let mut all: Vec<Tensor> = (0..pg.size()).map(|_| t.zeros_like()).collect();
        pg.all_gather_unverified(&mut all, &t)?.wait()?;
        let all: Vec<Vec<i64>> = all.iter().map(i64s).collect::<Result<_>>()?;
        for i in 0..params.len() {
            let row = |r: usize| &all[r][i * K..i * K + K];
            if let Some(r) = (1..pg.size()).find(|&r| row(r) != row(0)) {
                let show = |v: &[i64]| {
                    let mut f = [0i64; crate::verify::LEN];
                    f[1] = v[0];
                    f[2] = v[1];
                    f[4..10].copy_from_slice(&v[2..8]);
                    crate::verify::render(&f)
                };
                return Err(Error::mismatch(
                    op(),
                    format!(
                        "parameter {i} ({}) is {} on rank 0 but {} on rank {r}",
                        names[i],
                        show(row(0)),
                        show(row(r))
                    ),
                ));
            }
        }
    } else {
        // 2b. PyTorch's protocol: rank 0's sizes and strides, broadcast, compared locally.
        let mut meta = Vec::new();
        for p in params {
            meta.extend(p.size());
            meta.extend(p.stride());
        }
        let mut t = Tensor::from_slice(&meta).to_device(meta_dev);
        pg.broadcast_unverified(&mut t, 0)?.wait()?;
        let control = i64s(&t)?;
        let mut k = 0;
        for (i, p) in params.iter().enumerate() {
            let n = 2 * p.dim();
            let mut local = p.size();
            local.extend(p.stride());
            if control.get(k..k + n) != Some(&local[..]) {
                return Err(Error::mismatch(
                    op(),
                    format!("parameter {i} ({}) with sizes {:?} does not match rank 0's", names[i], p.size()),
                ));
            }
            k += n;
        }
    }
    Ok(())
}

/// Broadcasts `tensors` from `root` in place, flattened into chunks of at most `limit` bytes per dtype
/// (PyTorch's `_broadcast_coalesced`): few large messages instead of one per tensor.
pub fn broadcast_coalesced(pg: &ProcessGroup, tensors: &[Tensor], limit: usize, root: usize) -> Result<()> {
    let _g = tch::no_grad_guard();
    for group in take_tensors(tensors, limit) {
        let flats: Vec<Tensor> = group.iter().map(|&i| tensors[i].f_reshape([-1])).collect::<std::result::Result<_, _>>()?;
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
/// flattened indices plus the bucket count, then of the bucket sizes).
pub fn sync_bucket_indices(pg: &ProcessGroup, buckets: &[Vec<usize>], n_params: usize) -> Result<Vec<Vec<usize>>> {
    let op = || format!("DDP bucket rebuild on rank {} of {}", pg.rank(), pg.size());
    if pg.verifies() {
        // PyTorch's second broadcast is sized by the local bucket count; make sure all agree first.
        let counts = gather_i64(pg, buckets.len() as i64)?;
        if let Some(r) = counts.iter().position(|&c| c != counts[0]) {
            return Err(Error::mismatch(
                op(),
                format!("rank 0 built {} buckets but rank {r} built {}", counts[0], counts[r]),
            ));
        }
    }
    let dev = Device::Cpu;
    let mut flat: Vec<i32> = buckets.iter().flatten().map(|&i| i as i32).collect();
    if flat.len() != n_params {
        return Err(Error::invalid(op(), format!("{} indices for {n_params} parameters", flat.len())));
    }
    flat.push(buckets.len() as i32);
    let mut t = Tensor::from_slice(&flat).to_device(dev);
    pg.broadcast_unverified(&mut t, 0)?.wait()?;
    let indices = Vec::<i32>::try_from(&t)?;
    let nb = indices[n_params] as usize;
    let mut sizes = Tensor::from_slice(&buckets.iter().map(|b| b.len() as i32).collect::<Vec<_>>());
    pg.broadcast_unverified(&mut sizes, 0)?.wait()?;
    let sizes = Vec::<i32>::try_from(&sizes)?;
    if sizes.len() != nb {
        return Err(Error::mismatch(op(), format!("rank 0 has {nb} buckets, this rank {}", sizes.len())));
    }
    let mut out = Vec::with_capacity(nb);
    let mut k = 0;
    for s in sizes {
        out.push(indices[k..k + s as usize].iter().map(|&i| i as usize).collect());
        k += s as usize;
    }
    Ok(out)
}

fn gather_i64(pg: &ProcessGroup, v: i64) -> Result<Vec<i64>> {
    gather_i64_on(pg, v, Device::Cpu)
}

/// Every rank's `v`, in rank order (one all_gather of a Long[1]).
fn gather_i64_on(pg: &ProcessGroup, v: i64, dev: Device) -> Result<Vec<i64>> {
    let t = Tensor::from_slice(&[v]).to_device(dev);
    let mut all: Vec<Tensor> = (0..pg.size()).map(|_| t.zeros_like()).collect();
    pg.all_gather_unverified(&mut all, &t)?.wait()?;
    all.iter().map(|c| i64s(c).map(|x| x[0])).collect()
}
