//! What a tch user writes on their first day with tch-dist: tch's model, tch's optimizer and its
//! zero_grad, a DistributedSampler, launched with `tchrun --standalone --nproc-per-node 2 -- my-trainer`.
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::data::{Batches, DistributedSampler, SamplerOptions};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::{ProcessGroup, ReduceOp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pg = std::sync::Arc::new(ProcessGroup::from_env()?);
    tch::manual_seed(0);
    let xs = Tensor::randn([256, 16], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist([1i64].as_slice(), true, Kind::Float).sin();

    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 16, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 32, 1, Default::default()));
    let model = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let mut sampler = DistributedSampler::for_group(256, &pg, SamplerOptions::default())?;

    let mut last = 0.0;
    for epoch in 0..5 {
        sampler.set_epoch(epoch);
        for (x, y) in Batches::new(&xs, &ys, sampler.indices()?, 16)? {
            let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            opt.zero_grad();
            loss.backward();
            opt.step();
            last = loss.double_value(&[]);
        }
    }
    // every rank must hold the same model
    let mut w = vs.variables().get("l1.weight").ok_or("no l1.weight")?.detach().copy();
    let mine = w.copy();
    pg.allreduce(&mut w, ReduceOp::Avg)?;
    let drift = (w - mine).abs().max().double_value(&[]);
    println!("rank {} of {}: last loss {last:.4}, parameters equal across ranks: {}", pg.rank(), pg.size(), drift == 0.0);
    Ok(())
}
