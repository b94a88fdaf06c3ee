//! Layers that draw their initial weights from a seed do so from a generator of their own: the values
//! are those tch's `nn::linear` draws after `tch::manual_seed(seed)`, and the user's global generator is
//! left where it was. (A file of its own: the global generator is shared by a binary's test threads.)
mod common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::tp::ParallelMlp;

#[test]
fn parallel_mlp_draws_nn_linear_s_values_from_its_seed_and_leaves_the_global_generator_alone() {
    let (d, h, seed) = (6, 10, 17);
    // what nn::linear draws after tch::manual_seed: weight then bias, each U(-1/sqrt(fan_in), ..)
    tch::manual_seed(seed);
    let u = |shape: &[i64], fan_in: i64| {
        let b = 1.0 / (fan_in as f64).sqrt();
        Tensor::empty(shape, (Kind::Float, Device::Cpu)).uniform_(-b, b)
    };
    let want = [u(&[h, d], d), u(&[h], d), u(&[d, h], h), u(&[d], h)];
    let got = common::run_threads(1, Duration::from_secs(30), move |pg| {
        tch::manual_seed(99);
        let before = Tensor::rand([8], (Kind::Float, Device::Cpu));
        tch::manual_seed(99);
        let vs = nn::VarStore::new(Device::Cpu);
        let mlp = ParallelMlp::new(&vs.root(), d, h, Arc::new(pg), seed).unwrap();
        let after = Tensor::rand([8], (Kind::Float, Device::Cpu));
        let bs = |b: &Option<Tensor>| b.as_ref().expect("a bias").shallow_clone();
        let weights = [mlp.fc1.ws.shallow_clone(), bs(&mlp.fc1.bs), mlp.fc2.ws.shallow_clone(), bs(&mlp.fc2.bs)];
        (before.equal(&after), weights)
    });
    let (untouched, weights) = &got[0];
    assert!(*untouched, "ParallelMlp::new moved the global generator");
    for (i, (g, w)) in weights.iter().zip(&want).enumerate() {
        assert!(g.equal(w), "tensor {i}: {g:?} vs nn::linear's {w:?}");
    }
}
