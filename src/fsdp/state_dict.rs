//! Checkpoints of an FSDP model: the full parameters by name (loadable on any world size, or without
//! FSDP), and this rank's shards (one file per rank, same world size).
use std::collections::VecDeque;

use tch::{Device, Kind, Tensor};

use super::flat_param::copied;
use super::FullyShardedDataParallel;
use crate::error::{Error, Result};
use crate::group::flat;

impl<M> FullyShardedDataParallel<M> {
    /// The full parameters by their VarStore names, gathered one at a time and moved to the CPU, plus the
    /// buffers: what `vs.save` of the unsharded model holds. Every rank gets it (every rank must call it).
    pub(crate) fn gathered_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let _call = self.rt.pg.enter_call("FSDP state_dict");
        let _g = tch::no_grad_guard();
        let pg = self.rt.pg.clone();
        let (rank, world) = (pg.rank() as i64, pg.size() as i64);
        let mut out = Vec::new();
        self.rt.for_each(|u, _, fp| {
            for s in &fp.slots {
                let all = Tensor::f_zeros([world * s.chunk], (s.shard.kind(), fp.full.device()))?;
                if s.own > 0 {
                    all.f_narrow(0, rank * s.chunk, s.own)?.f_copy_(&s.shard)?;
                }
                let mut pending = VecDeque::new();
                flat::all_gather(
                    &pg,
                    &all,
                    s.chunk,
                    &format!("FSDP state-dict gather, unit {u}"),
                    &mut pending,
                    usize::MAX,
                )?;
                for w in pending.into_iter().flatten() {
                    w.wait()?;
                }
                let t = copied(&all.f_narrow(0, 0, s.numel)?.f_view(s.shape.as_slice())?.f_to_device(Device::Cpu)?)?;
                out.push((s.name.clone(), t));
            }
            Ok(())
        })?;
        for (name, t) in self.buffers() {
            out.push((name, copied(&t.f_to_device(Device::Cpu)?)?));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// The variables no unit shards (buffers such as running statistics), by name: the tensors
    /// themselves, the same on every rank of the group.
    pub(crate) fn buffers(&self) -> Vec<(String, Tensor)> {
        let sharded: std::collections::HashSet<String> = self.rt.shards().into_iter().map(|(n, _)| n).collect();
        let vars = self.vars.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<(String, Tensor)> = vars
            .named_variables
            .iter()
            .filter(|(n, _)| !sharded.contains(*n))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Loads full parameters by name (as [`DistModule::state_dict`](crate::DistModule::state_dict) gives them, from any world
    /// size): each rank keeps its shard. Buffers present in `state` are loaded too. Errors name a missing
    /// or mis-shaped entry; nothing is changed then.
    pub fn load_state_dict(&self, state: &[(String, Tensor)]) -> Result<()> {
        let _g = tch::no_grad_guard();
        let find = |name: &str, shape: &[i64]| -> Result<Tensor> {
            let t = state
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t)
                .ok_or_else(|| Error::invalid("FSDP load_state_dict", format!("no entry {name:?}")))?;
            if t.size() != shape {
                return Err(Error::mismatch(
                    "FSDP load_state_dict",
                    format!("{name}: saved {:?}, the model has {shape:?}", t.size()),
                ));
            }
            Ok(t.shallow_clone())
        };
        // check everything before changing anything
        let found = self
            .rt
            .for_each(|_, _, fp| fp.slots.iter().map(|s| find(&s.name, &s.shape)).collect::<Result<Vec<_>>>())?;
        self.reshard()?; // a gathered unit would keep the old values
        let rank = self.rt.pg.rank() as i64;
        self.rt.for_each(|u, _, fp| {
            for (s, t) in fp.slots.iter().zip(&found[u]) {
                if s.own > 0 {
                    let src = t.f_reshape([-1])?.f_narrow(0, rank * s.chunk, s.own)?;
                    s.shard.f_detach()?.f_copy_(&src)?;
                }
            }
            Ok(())
        })?;
        let vars = self.vars.lock().unwrap_or_else(|e| e.into_inner());
        for (name, t) in &vars.named_variables {
            if !t.requires_grad() && t.numel() > 0 {
                if let Some((_, saved)) = state.iter().find(|(n, _)| n == name) {
                    if saved.size() == t.size() {
                        t.f_detach()?.f_copy_(saved)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// This rank's shards (`{name}.shard`) and their layouts (`{name}.layout`: elements, per rank, world
    /// size), for one checkpoint file per rank.
    pub fn sharded_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let world = self.rt.pg.size() as i64;
        let mut out = Vec::new();
        self.rt.for_each(|_, _, fp| {
            for s in &fp.slots {
                out.push((format!("{}.shard", s.name), copied(&s.shard.f_detach()?)?));
                out.push((format!("{}.layout", s.name), Tensor::from_slice(&[s.numel, s.chunk, world])));
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Loads what [`sharded_state_dict`](Self::sharded_state_dict) saved on this rank. The layout must
    /// match (same parameters, same world size); to change the world size, load the full state dict.
    pub fn load_sharded_state_dict(&self, state: &[(String, Tensor)]) -> Result<()> {
        let _g = tch::no_grad_guard();
        let world = self.rt.pg.size() as i64;
        let get = |k: &str| {
            state
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, t)| t.shallow_clone())
                .ok_or_else(|| Error::invalid("FSDP load_sharded_state_dict", format!("no entry {k:?}")))
        };
        let shards = self.rt.for_each(|_, _, fp| {
            let mut v = Vec::new();
            for s in &fp.slots {
                let layout = Vec::<i64>::try_from(get(&format!("{}.layout", s.name))?.f_to_kind(Kind::Int64)?)?;
                if layout != [s.numel, s.chunk, world] {
                    return Err(Error::mismatch(
                        "FSDP load_sharded_state_dict",
                        format!(
                            "{} was saved as {} elements over {} ranks; here it is {} over {world}: load the full state dict to change the layout",
                            s.name,
                            layout.first().unwrap_or(&0),
                            layout.get(2).unwrap_or(&0),
                            s.numel
                        ),
                    ));
                }
                let shard = get(&format!("{}.shard", s.name))?;
                if shard.size() != s.shard.size() {
                    return Err(Error::mismatch(
                        "FSDP load_sharded_state_dict",
                        format!("{}: saved shard {:?}, expected {:?}", s.name, shard.size(), s.shard.size()),
                    ));
                }
                v.push(shard);
            }
            Ok(v)
        })?;
        self.reshard()?;
        self.rt.for_each(|u, _, fp| {
            for (s, t) in fp.slots.iter().zip(&shards[u]) {
                s.shard.f_detach()?.f_copy_(t)?;
            }
            Ok(())
        })?;
        Ok(())
    }
}
