//! Gradient bucket assignment, with PyTorch's rules (`c10d::compute_bucket_assignment_by_size`):
//! - buckets never mix dtype or device;
//! - tensors are taken in the given order; a bucket closes as soon as its size reaches its limit;
//! - each (dtype, device) walks the list of limits: the first bucket gets `limits[0]`, later ones the next
//!   limit, the last limit repeating;
//! - partly filled buckets are appended at the end, in the order their key first appeared;
//! - without an explicit order (`order = None`) the result is sorted by each bucket's smallest index.
//!
//! ```
//! use tch_dist::ddp::bucket::{assign, TensorSpec};
//! let specs: Vec<TensorSpec> = [1000, 1000, 10].iter().map(|&n| TensorSpec::cpu(n, tch::Kind::Float)).collect();
//! // 4 KB limit: the first two tensors close a bucket each; the last is left over.
//! assert_eq!(assign(&specs, &[4000], None), vec![vec![0], vec![1], vec![2]]);
//! ```
#![cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public for tests only
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// A `shape`-shaped tensor over `flat`'s memory from element `offset` on. It shares the bucket's memory
/// but is no autograd view of it, so tch's `Optimizer::zero_grad` and `Tensor::zero_grad` (both call
/// `detach_()`, which libtorch refuses on views) work on gradients that live in a bucket. `flat` is a
/// freshly allocated contiguous buffer (storage offset 0).
pub(crate) fn slot(flat: &Tensor, offset: i64, shape: &[i64]) -> Result<Tensor> {
    let n: i64 = shape.iter().product();
    if !flat.is_contiguous() || offset < 0 || offset + n > flat.numel() as i64 {
        return Err(Error::invalid(
            "bucket slot",
            format!("{n} elements at {offset} do not fit a bucket of {}", flat.numel()),
        ));
    }
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    let _g = tch::no_grad_guard();
    let mut t = Tensor::f_empty([0], (flat.kind(), flat.device()))?;
    let _ = t.f_set_source_tensor_storage_offset_(flat, offset, shape, &strides)?;
    Ok(t)
}

/// What the assignment needs to know of a tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorSpec {
    pub numel: usize,
    pub kind: Kind,
    pub device: Device,
}

impl TensorSpec {
    /// A CPU tensor's spec (tests build layouts from these).
    #[cfg(feature = "testing")]
    pub fn cpu(numel: usize, kind: Kind) -> Self {
        TensorSpec { numel, kind, device: Device::Cpu }
    }

    pub fn of(t: &tch::Tensor) -> Self {
        TensorSpec { numel: t.numel(), kind: t.kind(), device: t.device() }
    }

    pub fn bytes(&self) -> usize {
        self.numel * self.kind.elt_size_in_bytes()
    }
}

struct Open {
    kind: Kind,
    device: Device,
    indices: Vec<usize>,
    bytes: usize,
    limit_pos: usize,
}

/// Assigns tensors to buckets. `order`: the tensor indices in the order to walk them (e.g. the order
/// gradients became ready); `None` walks 0..n and sorts buckets by smallest index. Each returned bucket
/// lists tensor indices in walk order, which is also the layout of its flat buffer.
pub fn assign(specs: &[TensorSpec], limits: &[usize], order: Option<&[usize]>) -> Vec<Vec<usize>> {
    let limits: &[usize] = if limits.is_empty() { &[usize::MAX] } else { limits };
    let walk: Vec<usize> = match order {
        Some(o) => o.to_vec(),
        None => (0..specs.len()).collect(),
    };
    let mut open: Vec<Open> = Vec::new(); // one per (kind, device), in order of first appearance
    let mut done: Vec<Vec<usize>> = Vec::new();
    for &i in &walk {
        let s = specs[i];
        let pos = match open.iter().position(|o| o.kind == s.kind && o.device == s.device) {
            Some(p) => p,
            None => {
                open.push(Open { kind: s.kind, device: s.device, indices: Vec::new(), bytes: 0, limit_pos: 0 });
                open.len() - 1
            }
        };
        let b = &mut open[pos];
        b.indices.push(i);
        b.bytes += s.bytes();
        if b.bytes >= limits[b.limit_pos] {
            done.push(std::mem::take(&mut b.indices));
            b.bytes = 0;
            if b.limit_pos + 1 < limits.len() {
                b.limit_pos += 1;
            }
        }
    }
    done.extend(open.into_iter().filter(|o| !o.indices.is_empty()).map(|o| o.indices));
    if order.is_none() {
        done.sort_by_key(|b| b.iter().copied().min().unwrap_or(usize::MAX));
    }
    done
}
