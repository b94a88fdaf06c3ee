//! A deep MLP as a layer list, data, and an unsplit reference trainer for the pipeline tests.
use std::collections::BTreeMap;

use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::pipeline::LayerList;

pub const STEPS: usize = 3;
pub const BATCH: i64 = 8;
pub const LR: f64 = 0.1;

/// 8 layers: 5 linears, tanh after the first three.
pub fn layers() -> LayerList {
    LayerList::new()
        .seed(42)
        .add("l0", |p| nn::linear(p, 6, 16, Default::default()))
        .add_fn("a0", |x| x.tanh())
        .add("l1", |p| nn::linear(p, 16, 16, Default::default()))
        .add_fn("a1", |x| x.tanh())
        .add("l2", |p| nn::linear(p, 16, 12, Default::default()))
        .add_fn("a2", |x| x.tanh())
        .add("l3", |p| nn::linear(p, 12, 12, Default::default()))
        .add("l4", |p| nn::linear(p, 12, 3, Default::default()))
}

pub fn data(step: usize) -> (Tensor, Tensor) {
    data_rows(step, BATCH)
}

/// `data` with `rows` rows (the first `rows` of a larger batch).
pub fn data_rows(step: usize, rows: i64) -> (Tensor, Tensor) {
    let rows = Tensor::arange(rows, (Kind::Float, Device::Cpu)).unsqueeze(1) + (step as f64) * 100.0;
    let x = (&rows * 0.21 + Tensor::arange(6, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.4).sin();
    let y = (&rows * 0.07 - Tensor::arange(3, (Kind::Float, Device::Cpu)).unsqueeze(0)).cos();
    (x, y)
}

pub fn loss(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

pub fn named(stores: &[&nn::VarStore]) -> BTreeMap<String, Tensor> {
    stores.iter().flat_map(|vs| vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy()))).collect()
}

/// The unsplit model trained on the full batch: (losses per step, final parameters by name).
pub fn reference() -> (Vec<f64>, BTreeMap<String, Tensor>) {
    reference_rows(&[BATCH; STEPS])
}

/// `reference` with `rows[s]` rows at step s.
pub fn reference_rows(rows: &[i64]) -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let l = layers();
    let stage = l.build_stage(0..l.len(), Device::Cpu).unwrap();
    let mut opt = nn::Sgd::default().build(&stage.vs, LR).unwrap();
    let mut losses = Vec::new();
    for (s, &r) in rows.iter().enumerate() {
        let (x, y) = data_rows(s, r);
        opt.zero_grad();
        let lo = loss(&stage.forward(&x), &y);
        losses.push(lo.double_value(&[]));
        lo.backward();
        opt.step();
    }
    (losses, named(&[&stage.vs]))
}

pub fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter().map(|(k, t)| (t - &b[k]).abs().max().double_value(&[])).fold(0.0, f64::max)
}
