//! What healing sends: a replica rank's model tensors and its optimizer's state, checked on arrival
//! before anything is copied.
use tch::{nn, Tensor};

use crate::error::{Error, Result};
use crate::fsdp::FullyShardedDataParallel;
use crate::optim::Optimizer;

/// A model as fault tolerance heals it: this rank's tensors by name, which a behind replica's same rank
/// takes from a healthy one (torchft's `state_dict` / `load_state_dict` pair).
pub trait ReplicaState {
    /// This rank's tensors themselves (not copies), by name, in one order on every replica: healing
    /// copies a healthy replica's values into them.
    fn replica_tensors(&self) -> Result<Vec<(String, Tensor)>>;
}

/// Every variable, by its VarStore name: a replica of one rank, or DDP among its ranks. A variable FSDP
/// shards (empty between uses, its values in a shard) is refused: pass the FSDP model instead, or healing
/// would copy nothing into it.
impl ReplicaState for nn::VarStore {
    fn replica_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut vars: Vec<(String, Tensor)> = self.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, _)) = vars.iter().find(|(_, t)| crate::placement::of(t).is_some_and(|l| l.local().is_some()))
        {
            return Err(Error::invalid(
                "fault tolerance: the model's state",
                format!(
                    "{name} is sharded by FSDP: give Manager::start_step the FullyShardedDataParallel model, \
                     whose shards hold the values, not its VarStore"
                ),
            ));
        }
        Ok(vars)
    }
}

/// This rank's shards (by parameter name) and the buffers no unit shards: HSDP, each replica sharded
/// over its own ranks, local rank `l` healed by the healthy replica's local rank `l`. Gathered units are
/// freed first, so that the next forward gathers what was received.
impl<M> ReplicaState for FullyShardedDataParallel<M> {
    fn replica_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        self.reshard()?;
        let mut out = self.named_parameters();
        out.extend(self.buffers());
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

/// Everything a replica rank trains with: its model's tensors (`model/NAME`) and its optimizer's state
/// (`optim/KEY`).
pub(crate) fn state_of(model: &dyn ReplicaState, opt: &dyn Optimizer) -> Result<Vec<(String, Tensor)>> {
    let mut out: Vec<(String, Tensor)> =
        model.replica_tensors()?.into_iter().map(|(n, t)| (format!("model/{n}"), t)).collect();
    out.extend(opt.state_dict().into_iter().map(|(k, t)| (format!("optim/{k}"), t)));
    Ok(out)
}

/// Checks that `state` holds every tensor of `model` with its shape and dtype, before anything is copied.
pub(crate) fn check_state(model: &dyn ReplicaState, state: &[(String, Tensor)]) -> Result<()> {
    let mine: std::collections::HashMap<String, Tensor> = model.replica_tensors()?.into_iter().collect();
    let mut seen = 0;
    for (k, t) in state {
        if let Some(name) = k.strip_prefix("model/") {
            let v = mine.get(name).ok_or_else(|| {
                Error::mismatch("healing", format!("the healthy replica has tensor {name}, this one does not"))
            })?;
            if v.size() != t.size() || v.kind() != t.kind() {
                return Err(Error::mismatch(
                    "healing",
                    format!("tensor {name}: {:?} {:?} here, {:?} {:?} sent", v.kind(), v.size(), t.kind(), t.size()),
                ));
            }
            seen += 1;
        }
    }
    if seen != mine.len() {
        return Err(Error::mismatch("healing", format!("{seen} tensors were sent, this replica has {}", mine.len())));
    }
    Ok(())
}

/// Copies a checked state into the model's tensors and the optimizer.
pub(crate) fn load_state(model: &dyn ReplicaState, opt: &mut dyn Optimizer, state: &[(String, Tensor)]) -> Result<()> {
    let mine: std::collections::HashMap<String, Tensor> = model.replica_tensors()?.into_iter().collect();
    let mut optim = Vec::new();
    for (k, t) in state {
        if let Some(v) = k.strip_prefix("model/").and_then(|name| mine.get(name)) {
            let _g = tch::no_grad_guard();
            v.shallow_clone().f_copy_(t)?;
        } else if let Some(key) = k.strip_prefix("optim/") {
            optim.push((key.to_string(), t.shallow_clone()));
        }
    }
    opt.load_state_dict(&optim)
}
