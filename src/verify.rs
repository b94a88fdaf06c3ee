//! Agreement checks before a collective. Gloo aborts the whole process (an uncaught exception on its
//! transport thread) when ranks pass tensors of different sizes; one small all_gather of each rank's
//! (operation, dtype, shape) turns that into an error naming the ranks and their shapes.
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::ProcessGroup;

const MAX_DIMS: usize = 6;
/// op, dtype, ndim, dims..., extra (root or reduce op)
pub(crate) const LEN: usize = 4 + MAX_DIMS;

/// Encodes what must agree across ranks for one operation.
pub(crate) fn fingerprint(op: i64, t: &Tensor, extra: i64) -> [i64; LEN] {
    let mut f = [0i64; LEN];
    let size = t.size();
    f[0] = op;
    f[1] = crate::dtype::code(t.kind()).map_or(-1, i64::from);
    f[2] = size.len() as i64;
    f[3] = extra;
    if size.len() <= MAX_DIMS {
        f[4..4 + size.len()].copy_from_slice(&size);
    } else {
        // Too many dims to list: the element count still catches size disagreements.
        f[4] = size.iter().product();
    }
    f
}

pub(crate) fn render(f: &[i64]) -> String {
    let kind = crate::dtype::from_code(f[1]).map_or_else(|| format!("dtype#{}", f[1]), |k| format!("{k:?}"));
    let nd = (f[2].max(0) as usize).min(MAX_DIMS);
    format!("{kind}{:?}", &f[4..4 + nd])
}

/// Gathers every rank's fingerprint and fails, on every rank alike, if they differ.
/// `device`: where the metadata travels (CPU for Gloo, the tensor's GPU for NCCL).
pub(crate) fn agree(pg: &ProcessGroup, what: &str, fp: [i64; LEN], device: Device) -> Result<()> {
    if pg.size() == 1 {
        return Ok(());
    }
    let mine = Tensor::from_slice(&fp).to_device(device);
    let mut all: Vec<Tensor> =
        (0..pg.size()).map(|_| Tensor::zeros([LEN as i64], (Kind::Int64, device))).collect();
    let ctx = || format!("{what} on rank {} of {} (agreement check before it)", pg.rank(), pg.size());
    pg.all_gather_unverified(&mut all, &mine)
        .and_then(|w| w.wait())
        .map_err(|e| e.in_op(ctx()))?;
    let rows: Vec<Vec<i64>> =
        all.iter().map(|t| Vec::<i64>::try_from(t.to_device(Device::Cpu)).map_err(Error::from)).collect::<Result<_>>()?;
    if rows.iter().all(|r| r == &rows[0]) {
        return Ok(());
    }
    let ops_differ = rows.iter().any(|r| r[0] != rows[0][0] || r[3] != rows[0][3]);
    let listing: Vec<String> = rows.iter().enumerate().map(|(r, f)| format!("rank {r}: {}", render(f))).collect();
    let msg = if ops_differ {
        format!("ranks issued different operations or arguments at this point ({})", listing.join(", "))
    } else {
        format!("ranks disagree on dtype/shape: {}", listing.join(", "))
    };
    Err(Error::mismatch(format!("{what} on rank {} of {}", pg.rank(), pg.size()), msg))
}

/// An empty tensor matching a fingerprint, to drain a message we refuse.
pub(crate) fn tensor_for(f: &[i64], device: Device) -> Option<Tensor> {
    let kind = crate::dtype::from_code(f[1])?;
    let nd = f[2];
    if !(0..=MAX_DIMS as i64).contains(&nd) {
        return None;
    }
    let dims: Vec<i64> = f[4..4 + nd as usize].to_vec();
    Some(Tensor::zeros(dims.as_slice(), (kind, device)))
}
