//! A pipeline's layers are built each after its own seed, so their values do not depend on how the list
//! is cut; the global generator is then put back where it was, so the program's own draws do not depend
//! on building a pipeline either.
use crate::common;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::pipeline::LayerList;

fn layers() -> LayerList {
    LayerList::new()
        .add("a", |p| nn::linear(p, 4, 6, Default::default()))
        .add("b", |p| nn::linear(p, 6, 3, Default::default()))
}

fn values(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn building_stages_seeds_each_layer_and_leaves_the_global_generator_alone() {
    let _alone = common::alone();
    let draw = || Tensor::rand([8], (Kind::Float, Device::Cpu));
    tch::manual_seed(5);
    let want = draw();
    tch::manual_seed(5);
    let whole = layers().build_stage(0..2, Device::Cpu).unwrap();
    assert!(draw().equal(&want), "building a stage moved the global generator");
    // layer b alone, after other draws, holds what it holds in the whole list
    let _ = draw();
    let b = layers().build_stage(1..2, Device::Cpu).unwrap();
    let whole_b: Vec<(String, Tensor)> = values(&whole.vs).into_iter().filter(|(n, _)| n.starts_with("b.")).collect();
    let alone_b = values(&b.vs);
    assert_eq!(whole_b.len(), 2);
    assert_eq!(alone_b.iter().map(|x| &x.0).collect::<Vec<_>>(), whole_b.iter().map(|x| &x.0).collect::<Vec<_>>());
    for ((n, x), (_, y)) in whole_b.iter().zip(&alone_b) {
        assert!(x.equal(y), "{n} depends on how the list is cut");
    }
}
