//! A small MLP, deterministic data and a single-process reference trainer for the DDP parity tests.
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};

pub const IN: i64 = 12;
pub const OUT: i64 = 4;

/// l1 12x24 (1,152 B weight), l2 24x40 (3,840 B), l3 40x4: several buckets at small caps.
pub fn mlp(vs: &nn::VarStore) -> nn::Sequential {
    let r = vs.root();
    nn::seq()
        .add(nn::linear(&r / "l1", IN, 24, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&r / "l2", 24, 40, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "l3", 40, OUT, Default::default()))
}

/// Parameters in PyTorch's order (`model.parameters()`: per layer, weight before bias), with names.
pub fn pytorch_order(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0).reverse());
    let mut layers: Vec<String> = named.iter().map(|(n, _)| n.split('.').next().unwrap().to_string()).collect();
    layers.sort();
    layers.dedup();
    let mut out = Vec::new();
    for l in layers {
        for kind in ["weight", "bias"] {
            if let Some((n, t)) = named.iter().find(|(n, _)| *n == format!("{l}.{kind}")) {
                out.push((n.clone(), t.shallow_clone()));
            }
        }
    }
    out
}

/// Deterministic parameter values (identical on every rank and in the reference), offset by `shift` so
/// that ranks can start different and rely on DDP's broadcast from rank 0.
pub fn init(vs: &nn::VarStore, shift: f64) {
    let _g = tch::no_grad_guard();
    for (i, (_, mut p)) in pytorch_order(vs).into_iter().enumerate() {
        let n = p.numel() as i64;
        let v = (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + i as f64 * 1.3).sin() * 0.3 + shift;
        p.copy_(&v.view(p.size().as_slice()));
    }
}

/// Rank `rank`'s slice of step `step`'s global batch (`per` rows per rank), as a formula of the indices.
pub fn batch(step: usize, rank: usize, per: i64) -> (Tensor, Tensor) {
    let base = (step as i64 * 1000 + rank as i64 * per) as f64;
    let rows = Tensor::arange(per, (Kind::Float, Device::Cpu)).unsqueeze(1) + base;
    let cols = Tensor::arange(IN, (Kind::Float, Device::Cpu)).unsqueeze(0);
    let x = (&rows * 0.13 + &cols * 0.71).sin();
    let ycols = Tensor::arange(OUT, (Kind::Float, Device::Cpu)).unsqueeze(0);
    let y = (&rows * 0.05 - &ycols * 0.3).cos();
    (x, y)
}

pub fn global_batch(step: usize, world: usize, per: i64) -> (Tensor, Tensor) {
    let parts: Vec<(Tensor, Tensor)> = (0..world).map(|r| batch(step, r, per)).collect();
    let xs: Vec<&Tensor> = parts.iter().map(|p| &p.0).collect();
    let ys: Vec<&Tensor> = parts.iter().map(|p| &p.1).collect();
    (Tensor::cat(&xs, 0), Tensor::cat(&ys, 0))
}

pub fn loss(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

/// Trains the unsplit model on the full batch; returns the parameters after `steps` SGD steps.
pub fn reference(steps: usize, world: usize, per: i64, lr: f64) -> Vec<Tensor> {
    reference_with(steps, world, per, |vs| nn::Sgd::default().build(vs, lr).unwrap())
}

/// [`reference`] with the optimizer `make` builds.
pub fn reference_with(
    steps: usize,
    world: usize,
    per: i64,
    make: impl Fn(&nn::VarStore) -> nn::Optimizer,
) -> Vec<Tensor> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs);
    init(&vs, 0.0);
    let mut opt = make(&vs);
    for s in 0..steps {
        let (x, y) = global_batch(s, world, per);
        opt.zero_grad();
        loss(&net.forward(&x), &y).backward();
        opt.step();
    }
    params(&vs)
}

/// Parameter values in PyTorch's order.
pub fn params(vs: &nn::VarStore) -> Vec<Tensor> {
    pytorch_order(vs).iter().map(|(_, t)| t.detach().copy()).collect()
}

pub fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs().max().double_value(&[])).fold(0.0, f64::max)
}
