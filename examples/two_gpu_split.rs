//! The article's manual model split, in Rust: `Linear(1024, 2048)` on device 0, `Linear(2048, 1024)` on
//! device 1, batch 32. The forward moves the activation between devices, backward flows back through the
//! copy. With two GPUs the halves go to cuda:0 and cuda:1; with one GPU both go to cuda:0; without a GPU
//! both run on the CPU; the program says which.
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::pipeline::split::{two_devices, SplitModel};
use tch_dist::pipeline::{LayerList, Partition};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (devices, how) = two_devices();
    println!("placement: {how}");
    let layers = LayerList::new()
        .add("submodule1", |p| nn::linear(p, 1024, 2048, Default::default()))
        .add("submodule2", |p| nn::linear(p, 2048, 1024, Default::default()));
    let model = SplitModel::new(&layers, &Partition::sizes(&[1, 1], 2)?, &devices)?;
    for (i, s) in model.stages.iter().enumerate() {
        println!("stage {i}: {:?} on {:?}, {} parameter bytes", s.names(), s.device, s.param_bytes());
    }
    let mut opts =
        model.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, 0.01)).collect::<Result<Vec<_>, _>>()?;
    tch::manual_seed(0);
    let x = Tensor::randn([32, 1024], (Kind::Float, devices[0]));
    let target = Tensor::randn([32, 1024], (Kind::Float, model.output_device()));
    for step in 0..5 {
        let out = model.forward(&x);
        let loss = out.mse_loss(&target, tch::Reduction::Mean);
        opts.iter_mut().for_each(|o| o.zero_grad());
        loss.backward();
        opts.iter_mut().for_each(|o| o.step());
        println!("step {step}: loss {:.5}, output on {:?}", loss.double_value(&[]), out.device());
    }
    for (i, s) in model.stages.iter().enumerate() {
        if let Device::Cuda(d) = s.device {
            println!("stage {i}: cuda:{d} memory allocated {} bytes", tch_dist::memory::allocated(s.device)?);
        }
    }
    Ok(())
}
