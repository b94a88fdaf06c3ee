//! tch's own optimizers (`nn::Adam`, `nn::AdamW`, `nn::Sgd`, `nn::RmsProp`) seen as an [`Optimizer`], so
//! that their state (libtorch's C++ optimizer's, per parameter) goes into sharded checkpoints and comes
//! back under any layout. The tch optimizer keeps stepping as it did; this only reads and writes its state.
use tch::{nn, Tensor};

use super::{grads_of, memory_of, stepped_params, Optimizer, OptimizerMemory, Stepped};
use crate::error::{Error, Result};
use crate::ffi::tch_optimizer::{CppKind, CppOptimizer};

/// A tch `nn::Optimizer` as an [`Optimizer`]: its step and zero_grad are tch's, its state is read from and
/// written to libtorch's C++ optimizer. Built from the optimizer and the `VarStore` it was built on.
///
/// ```no_run
/// # fn run(ck: &mut tch_dist::checkpoint::Checkpointer) -> Result<(), Box<dyn std::error::Error>> {
/// use tch::nn::{self, OptimizerConfig};
/// use tch_dist::checkpoint::StateDict;
/// use tch_dist::optim::TchOptimizer;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// // ... the model on vs (under FSDP: after `finish`) ...
/// let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;
/// let mut state = TchOptimizer::new(&mut opt, &vs)?;
/// ck.save(100, StateDict::new().var_store("model", &vs).optimizer("optim", &mut state))?;
/// # Ok(())
/// # }
/// ```
pub struct TchOptimizer<'o> {
    /// tch's optimizer, and libtorch's `torch::optim::Optimizer` it owns.
    opt: CppOptimizer<'o>,
    kind: Kind,
    /// Its parameters across its param groups, in order.
    params: Vec<Tensor>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Adam,
    AdamW,
    Sgd,
    RmsProp,
}

impl Kind {
    /// Its state tensors' names, in the shim's order; `step`: whether it counts steps.
    fn fields(self) -> (&'static [&'static str], bool) {
        match self {
            Kind::Adam | Kind::AdamW => (&["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], true),
            Kind::Sgd => (&["momentum_buffer"], false),
            Kind::RmsProp => (&["square_avg", "momentum_buffer", "grad_avg"], true),
        }
    }
}

const WHAT: &str = "TchOptimizer";

impl<'o> TchOptimizer<'o> {
    /// `opt`, which `vs` built (`OptimizerConfig::build(&vs, lr)`). Build the optimizer once the model's
    /// variables are all there (under FSDP, after `finish`): tch adds variables created later only at its
    /// next step, and this refuses an optimizer that does not hold them all yet.
    pub fn new(opt: &'o mut nn::Optimizer, vs: &nn::VarStore) -> Result<TchOptimizer<'o>> {
        let trainable = vs.trainable_variables().len();
        let opt = CppOptimizer::new(opt, vs, trainable)?;
        let kind = match opt.kind()? {
            CppKind::Adam => Kind::Adam,
            CppKind::AdamW => Kind::AdamW,
            CppKind::Sgd => Kind::Sgd,
            CppKind::RmsProp => Kind::RmsProp,
            CppKind::Other => {
                return Err(Error::invalid(WHAT, "an optimizer other than tch's Adam, AdamW, Sgd and RmsProp"))
            }
        };
        let params = opt.params()?;
        if params.len() != trainable {
            return Err(Error::invalid(
                WHAT,
                format!(
                    "the optimizer holds {} of the VarStore's {trainable} trainable variables: tch adds variables \
                     created after `build` only at its next step; build the optimizer after the model (under FSDP, \
                     after `finish`)",
                    params.len()
                ),
            ));
        }
        Ok(TchOptimizer { opt, kind, params })
    }

    fn state_of(&self, i: usize) -> Result<Option<(i64, Vec<Option<Tensor>>)>> {
        self.opt.state(i)
    }
}

/// A step count saved as any scalar (ours: int64 of shape [1]; PyTorch's: a float32 scalar).
fn step_value(t: &Tensor) -> Result<i64> {
    Ok(t.f_reshape([-1])?.f_double_value(&[0])?.round() as i64)
}

impl Optimizer for TchOptimizer<'_> {
    fn step(&mut self) -> Result<()> {
        self.opt.step();
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.opt.zero_grad();
        Ok(())
    }

    /// `tch.{i}.{field}`: `step` (where the optimizer counts them) and its state tensors, for each
    /// parameter that has state (none before its first step).
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let (names, counts) = self.kind.fields();
        let mut out = Vec::new();
        for i in 0..self.params.len() {
            // reading fails only for an index past the parameters or another optimizer kind, both ruled
            // out by `new`: nothing is left out
            let Ok(Some((step, tensors))) = self.state_of(i) else { continue };
            if counts {
                out.push((format!("tch.{i}.step"), Tensor::from_slice(&[step])));
            }
            for (name, t) in names.iter().zip(tensors) {
                if let Some(t) = t {
                    out.push((format!("tch.{i}.{name}"), t));
                }
            }
        }
        out
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let (names, counts) = self.kind.fields();
        for (i, p) in self.params.iter().enumerate() {
            let prefix = format!("tch.{i}.");
            let field = |f: &str| state.iter().find(|(k, _)| k.strip_prefix(&prefix) == Some(f)).map(|(_, t)| t);
            let current = self.state_of(i)?;
            let mut ins: [Option<Tensor>; 3] = [None, None, None];
            for (j, name) in names.iter().enumerate() {
                let Some(saved) = field(name) else { continue };
                if saved.size() != p.size() {
                    return Err(Error::mismatch(
                        format!("{WHAT}: load_state_dict"),
                        format!("{prefix}{name}: saved {:?}, the parameter is {:?}", saved.size(), p.size()),
                    ));
                }
                let now = current.as_ref().and_then(|(_, ts)| ts[j].as_ref());
                // libtorch keeps state in the parameter's dtype and device
                let t = super::restore(now, &saved.f_to_device(p.device())?.f_to_kind(p.kind())?)?;
                ins[j] = Some(t);
            }
            let step = match field("step") {
                Some(s) if counts => step_value(s)?,
                _ => 0,
            };
            let has = ins.iter().any(Option::is_some) || (counts && field("step").is_some());
            self.opt.set_state(i, has, step, [ins[0].as_ref(), ins[1].as_ref(), ins[2].as_ref()])?;
        }
        Ok(())
    }

    fn gradients(&mut self) -> Result<Vec<Tensor>> {
        Ok(grads_of(&self.params))
    }

    fn memory(&self) -> OptimizerMemory {
        memory_of(&self.state_dict(), &self.params)
    }

    fn stepped(&self) -> Vec<Stepped> {
        stepped_params("tch", &self.params)
    }
}
