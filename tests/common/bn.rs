//! The batch-norm tests' data (tests/training/sync_batch_norm.rs, tests/interop/sync_batch_norm.rs, and
//! tests/py/sync_bn_rank.py, which computes the same): rank `r`'s batch and the layer's affine values,
//! set by position so that nothing depends on tch's generator.
use tch::{Device, Kind, Tensor};

/// Channels of every batch-norm test.
pub const C: i64 = 3;

/// Rank `r`'s batch of `n` rows (`[n, C, spatial...]`) and the weights of its loss.
pub fn batch(r: usize, n: i64, spatial: &[i64]) -> (Tensor, Tensor) {
    let mut shape = vec![n, C];
    shape.extend_from_slice(spatial);
    let numel: i64 = shape.iter().product();
    let at = Tensor::arange(numel, (Kind::Double, Device::Cpu)) + 97.0 * r as f64;
    let x = ((&at * 0.37).sin() * 2.0 + (&at * 0.011).cos()).view(shape.as_slice()).to_kind(Kind::Float);
    let t = (&at * 0.23).cos().view(shape.as_slice()).to_kind(Kind::Float);
    (x, t)
}

/// The weight `0.5 + 0.25 c` and bias `0.1 c - 0.2` of channel `c`.
pub fn set_affine(ws: &Option<Tensor>, bs: &Option<Tensor>) {
    tch::no_grad(|| {
        let c = Tensor::arange(C, (Kind::Float, Device::Cpu));
        ws.as_ref().unwrap().shallow_clone().copy_(&(&c * 0.25 + 0.5));
        bs.as_ref().unwrap().shallow_clone().copy_(&(&c * 0.1 - 0.2));
    });
}
