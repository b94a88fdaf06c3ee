//! The manual model split: consecutive stages on (possibly) different devices, as the forum's
//! `MyModel` puts `Linear(1024, 2048)` on `cuda:0` and `Linear(2048, 1024)` on `cuda:1`. Forward moves
//! the activation to each stage's device; autograd carries gradients back through those copies.
use tch::{nn, nn::Module, Device, Tensor};

use super::layers::{LayerList, Stage};
use super::partition::Partition;
use crate::error::Result;

/// A model whose stages live on different devices.
#[derive(Debug)]
pub struct SplitModel {
    pub stages: Vec<Stage>,
}

impl SplitModel {
    pub fn new(layers: &LayerList, partition: &Partition, devices: &[Device]) -> Result<SplitModel> {
        Ok(SplitModel { stages: layers.build(partition, devices)? })
    }

    pub fn var_stores(&self) -> Vec<&nn::VarStore> {
        self.stages.iter().map(|s| &s.vs).collect()
    }

    /// The device the output ends on.
    pub fn output_device(&self) -> Device {
        self.stages.last().map_or(Device::Cpu, |s| s.device)
    }
}

impl Module for SplitModel {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.stages.iter().fold(xs.shallow_clone(), |x, s| s.forward(&x.to_device(s.device)))
    }
}

/// The devices for a two-stage split on this machine, and a sentence saying which were chosen:
/// `cuda:0` and `cuda:1` with two GPUs, `cuda:0` twice with one, the CPU twice without.
pub fn two_devices() -> ([Device; 2], &'static str) {
    match tch::Cuda::device_count() {
        n if n >= 2 => ([Device::Cuda(0), Device::Cuda(1)], "two GPUs: stage 0 on cuda:0, stage 1 on cuda:1"),
        1 => ([Device::Cuda(0), Device::Cuda(0)], "one GPU: both stages on cuda:0"),
        _ => ([Device::Cpu, Device::Cpu], "no GPU: both stages on the CPU"),
    }
}
