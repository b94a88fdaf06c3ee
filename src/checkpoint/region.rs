//! Where a local tensor lies in its global tensor. Every layout we save reduces to boxes (per-dimension
//! offsets and lengths, DCP's chunks): replicated tensors are one box covering everything, tensor-parallel
//! shards a box cut along one dimension, and flat shards (ZeRO's and FSDP's slices of the row-major
//! flattening) a short run of boxes, each contiguous in the flattening.
use serde::{Deserialize, Serialize};

/// A box of a tensor: `offsets[d]..offsets[d] + lengths[d]` along each dimension `d`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct Bx {
    pub offsets: Vec<i64>,
    pub lengths: Vec<i64>,
}

impl Bx {
    /// The whole of a tensor of `shape`.
    pub(crate) fn whole(shape: &[i64]) -> Bx {
        Bx { offsets: vec![0; shape.len()], lengths: shape.to_vec() }
    }

    pub(crate) fn volume(&self) -> i64 {
        self.lengths.iter().product()
    }

    /// The common part of two boxes of one tensor, if any.
    pub(crate) fn intersect(&self, other: &Bx) -> Option<Bx> {
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut lengths = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.lengths[d]).min(other.offsets[d] + other.lengths[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            lengths.push(hi - lo);
        }
        Some(Bx { offsets, lengths })
    }

    /// Whether the box lies inside a tensor of `shape`.
    pub(crate) fn fits(&self, shape: &[i64]) -> bool {
        self.offsets.len() == shape.len()
            && (0..shape.len())
                .all(|d| self.offsets[d] >= 0 && self.lengths[d] >= 0 && self.offsets[d] + self.lengths[d] <= shape[d])
    }
}

/// A local tensor's place in its global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Region {
    /// The local tensor has the box's lengths as its shape.
    Box(Bx),
    /// The local tensor holds elements `start..start + len` of the global tensor's row-major flattening.
    Flat { start: i64, len: i64 },
    /// The local tensor holds these boxes one after another in its flattening, each with where it starts
    /// there (a fused projection's slice of each of its blocks).
    Boxes(Vec<(Bx, i64)>),
}

impl Region {
    /// Elements `lo..lo + len` of the local tensor's own flattening, as a region of the global tensor.
    /// A flat part of a box is only expressible when the box is the whole tensor.
    pub(crate) fn part(&self, global: &[i64], lo: i64, len: i64) -> Option<Region> {
        match self {
            Region::Flat { start, .. } => Some(Region::Flat { start: start + lo, len }),
            Region::Box(b) if b == &Bx::whole(global) => Some(Region::Flat { start: lo, len }),
            Region::Box(b) if lo == 0 && len == b.volume() => Some(self.clone()),
            Region::Boxes(bs) if lo == 0 && len == bs.iter().map(|(b, _)| b.volume()).sum::<i64>() => {
                Some(self.clone())
            }
            Region::Box(_) | Region::Boxes(_) => None,
        }
    }

    /// The region as boxes, with where each starts in the local tensor's flattening (boxes are contiguous
    /// there, and in order).
    pub(crate) fn boxes(&self, global: &[i64]) -> Vec<(Bx, i64)> {
        match self {
            Region::Box(b) => vec![(b.clone(), 0)],
            Region::Boxes(bs) => bs.clone(),
            Region::Flat { start, len } => {
                let mut out = Vec::new();
                flat_boxes(global, *start, *start + len, &mut Vec::new(), &mut out);
                let mut at = 0;
                out.into_iter()
                    .map(|b| {
                        let here = at;
                        at += b.volume();
                        (b, here)
                    })
                    .collect()
            }
        }
    }
}

/// Elements `a..b` of the flattening of `shape` as boxes (at most two per dimension), each contiguous in
/// row-major order; `prefix` holds the fixed leading indices of the sub-tensor being cut.
fn flat_boxes(shape: &[i64], a: i64, b: i64, prefix: &mut Vec<i64>, out: &mut Vec<Bx>) {
    if a >= b {
        return;
    }
    let boxed = |prefix: &[i64], dim0: Option<(i64, i64)>, rest: &[i64]| {
        let mut offsets: Vec<i64> = prefix.to_vec();
        let mut lengths: Vec<i64> = vec![1; prefix.len()];
        if let Some((o, l)) = dim0 {
            offsets.push(o);
            lengths.push(l);
        }
        offsets.extend(vec![0; rest.len()]);
        lengths.extend_from_slice(rest);
        Bx { offsets, lengths }
    };
    let Some((&n0, rest)) = shape.split_first() else {
        out.push(boxed(prefix, None, &[])); // a scalar: its one element
        return;
    };
    let inner: i64 = rest.iter().product();
    if inner == 0 || n0 == 0 {
        return;
    }
    let (r0, r1) = (a / inner, b / inner);
    if r0 == r1 {
        // within one row: cut that row
        prefix.push(r0);
        flat_boxes(rest, a - r0 * inner, b - r0 * inner, prefix, out);
        prefix.pop();
        return;
    }
    let mut first_full = r0;
    if a % inner != 0 {
        prefix.push(r0);
        flat_boxes(rest, a % inner, inner, prefix, out);
        prefix.pop();
        first_full = r0 + 1;
    }
    if r1 > first_full {
        out.push(boxed(prefix, Some((first_full, r1 - first_full)), rest));
    }
    if b % inner != 0 {
        prefix.push(r1);
        flat_boxes(rest, 0, b % inner, prefix, out);
        prefix.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flat range of small shapes: the boxes cover exactly the range's elements, in order.
    #[test]
    fn flat_ranges_become_boxes_in_order() {
        for shape in [vec![], vec![7], vec![3, 4], vec![2, 3, 4], vec![2, 1, 3, 2]] {
            let n: i64 = shape.iter().product();
            for a in 0..n {
                for b in a + 1..=n {
                    let mut flat = Vec::new();
                    for (bx, at) in (Region::Flat { start: a, len: b - a }).boxes(&shape) {
                        assert!(bx.fits(&shape), "{bx:?} outside {shape:?}");
                        assert_eq!(at, flat.len() as i64);
                        // the box's elements in row-major order, as flat indices of the tensor
                        let mut idx = vec![0i64; shape.len()];
                        for _ in 0..bx.volume() {
                            let f = (0..shape.len()).fold(0, |acc, d| acc * shape[d] + bx.offsets[d] + idx[d]);
                            flat.push(f);
                            for d in (0..shape.len()).rev() {
                                idx[d] += 1;
                                if idx[d] < bx.lengths[d] {
                                    break;
                                }
                                idx[d] = 0;
                            }
                        }
                    }
                    assert_eq!(flat, (a..b).collect::<Vec<_>>(), "shape {shape:?}, range {a}..{b}");
                }
            }
        }
    }

    #[test]
    fn intersections() {
        let a = Bx { offsets: vec![0, 2], lengths: vec![4, 4] };
        let b = Bx { offsets: vec![3, 0], lengths: vec![2, 3] };
        assert_eq!(a.intersect(&b), Some(Bx { offsets: vec![3, 2], lengths: vec![1, 1] }));
        assert_eq!(a.intersect(&Bx { offsets: vec![0, 0], lengths: vec![4, 2] }), None);
    }
}
