//! A tensor's dtype and shape as a few integers: the one encoding of the crate's metadata messages
//! (agreement checks before collectives, DDP's parameter check, send/recv and pipeline headers).
//!
//! Layout: `[dtype code, ndim, d0, .., d5]`. A tensor with more than [`MAX_DIMS`] dimensions keeps its
//! first five and folds the rest into the last slot (their product), so size disagreements are still
//! seen; such an encoding cannot be turned back into a shape ([`decode`] returns `None`).
use tch::{Device, Kind, Tensor};

pub(crate) const MAX_DIMS: usize = 6;
/// Integers per encoded tensor.
pub(crate) const LEN: usize = 2 + MAX_DIMS;

pub(crate) fn encode(t: &Tensor) -> [i64; LEN] {
    encode_parts(t.kind(), &t.size())
}

pub(crate) fn encode_parts(kind: Kind, size: &[i64]) -> [i64; LEN] {
    let mut m = [0i64; LEN];
    m[0] = crate::dtype::code(kind).map_or(-1, i64::from);
    m[1] = size.len() as i64;
    if size.len() <= MAX_DIMS {
        m[2..2 + size.len()].copy_from_slice(size);
    } else {
        m[2..LEN - 1].copy_from_slice(&size[..MAX_DIMS - 1]);
        m[LEN - 1] = size[MAX_DIMS - 1..].iter().product();
    }
    m
}

/// The dtype and shape, when the encoding holds them whole.
pub(crate) fn decode(m: &[i64]) -> Option<(Kind, Vec<i64>)> {
    let kind = crate::dtype::from_code(*m.first()?)?;
    let nd = usize::try_from(*m.get(1)?).ok().filter(|&n| n <= MAX_DIMS)?;
    Some((kind, m.get(2..2 + nd)?.to_vec()))
}

/// `Float[2, 3]`, as errors print it.
pub(crate) fn render(m: &[i64]) -> String {
    let (code, nd) = (m.first().copied().unwrap_or(-1), m.get(1).copied().unwrap_or(0));
    let kind = crate::dtype::from_code(code).map_or_else(|| format!("dtype#{code}"), |k| format!("{k:?}"));
    let shown = (nd.max(0) as usize).min(MAX_DIMS);
    let dims = m.get(2..2 + shown).unwrap_or(&[]);
    if nd as usize > MAX_DIMS {
        format!("{kind}{dims:?} ({nd} dims, the last {} folded)", nd as usize - MAX_DIMS + 1)
    } else {
        format!("{kind}{dims:?}")
    }
}

/// An empty tensor of the encoded dtype and shape on `device` (to receive into).
pub(crate) fn empty(m: &[i64], device: Device) -> Option<Tensor> {
    let (kind, dims) = decode(m)?;
    Tensor::f_empty(dims.as_slice(), (kind, device)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_folding() {
        let t = Tensor::zeros([2, 3, 4], (Kind::BFloat16, Device::Cpu));
        let m = encode(&t);
        assert_eq!(decode(&m), Some((Kind::BFloat16, vec![2, 3, 4])));
        assert_eq!(render(&m), "BFloat16[2, 3, 4]");
        let big = encode_parts(Kind::Float, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&big[2..], &[1, 2, 3, 4, 5, 336]);
        assert_eq!(decode(&big), None);
        assert!(render(&big).contains("8 dims"), "{}", render(&big));
        // different shapes beyond the sixth dimension still encode differently
        assert_ne!(big, encode_parts(Kind::Float, &[1, 2, 3, 4, 5, 6, 7, 9]));
    }
}
