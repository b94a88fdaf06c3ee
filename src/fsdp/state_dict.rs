//! Checkpoints of an FSDP model: the full parameters by name (loadable on any world size, or without
//! FSDP), and this rank's shards (one file per rank, same world size).
use std::collections::VecDeque;

use tch::{Device, Kind, Tensor};

use super::flat_param::copied;
use super::FullyShardedDataParallel;
use crate::error::{Error, Result};
use crate::group::ring::{all_gather_in_place, Ring};

impl<M> FullyShardedDataParallel<M> {
    /// The full parameters by their VarStore names, gathered one unit at a time and moved to the CPU,
    /// plus the buffers: what `vs.save` of the unsharded model holds. Every rank gets it (every rank must
    /// call it).
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let _g = tch::no_grad_guard();
        let pg = self.rt.pg.clone();
        let mut out = Vec::new();
        self.rt.for_each(|u, _, fp| {
            let world = pg.size() as i64;
            let all = Tensor::f_zeros([world * fp.len], (fp.shard.kind(), fp.full.device()))?;
            if fp.own > 0 {
                all.f_narrow(0, pg.rank() as i64 * fp.len, fp.own)?.f_copy_(&fp.shard)?;
            }
            let mut pending = VecDeque::new();
            if world > 1 {
                all_gather_in_place(&pg, &all, fp.len, Ring::FsdpState, u, &mut pending, usize::MAX)?;
            }
            for w in pending.into_iter().flatten() {
                w.wait()?;
            }
            for ((name, &off), shape) in fp.names.iter().zip(&fp.offsets).zip(&fp.shapes) {
                let n: i64 = shape.iter().product();
                let t = copied(&all.f_narrow(0, off, n)?.f_view(shape.as_slice())?.f_to_device(Device::Cpu)?)?;
                out.push((name.clone(), t));
            }
            Ok(())
        })?;
        let vars = self.vars.lock().unwrap_or_else(|e| e.into_inner());
        let trainable: Vec<&Tensor> = vars.trainable_variables.iter().map(|v| &v.tensor).collect();
        for (name, t) in &vars.named_variables {
            let param = trainable.iter().any(|p| p.data_ptr() == t.data_ptr() && p.size() == t.size());
            if !param && !out.iter().any(|(n, _)| n == name) {
                out.push((name.clone(), copied(&t.f_to_device(Device::Cpu)?)?));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Loads full parameters by name (as [`state_dict`](Self::state_dict) gives them, from any world
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
        let units = self.rt.for_each(|_, _, fp| {
            fp.names.iter().zip(&fp.shapes).map(|(n, s)| find(n, s)).collect::<Result<Vec<Tensor>>>()
        })?;
        self.reshard()?; // a gathered unit would keep the old values
        self.rt.for_each(|u, _, fp| {
            let start = self.rt.pg.rank() as i64 * fp.len;
            let end = start + fp.own;
            for ((t, &off), shape) in units[u].iter().zip(&fp.offsets).zip(&fp.shapes) {
                let n: i64 = shape.iter().product();
                let (lo, hi) = (off.max(start), (off + n).min(end));
                if lo < hi {
                    let src = t.f_reshape([-1])?.f_narrow(0, lo - off, hi - lo)?;
                    fp.shard.f_detach()?.f_narrow(0, lo - start, hi - lo)?.f_copy_(&src)?;
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

    /// This rank's shards (`{unit}.shard`) and their layouts (`{unit}.layout`: elements, per rank,
    /// world size), for one checkpoint file per rank.
    pub fn sharded_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let world = self.rt.pg.size() as i64;
        let mut out = Vec::new();
        self.rt.for_each(|_, name, fp| {
            out.push((format!("{name}.shard"), copied(&fp.shard.f_detach()?)?));
            out.push((format!("{name}.layout"), Tensor::from_slice(&[fp.numel, fp.len, world])));
            Ok(())
        })?;
        Ok(out)
    }

    /// Loads what [`sharded_state_dict`](Self::sharded_state_dict) saved on this rank. The layout must
    /// match (same units, same world size); to change the world size, load the full state dict.
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
        let shards = self.rt.for_each(|_, name, fp| {
            let layout = Vec::<i64>::try_from(get(&format!("{name}.layout"))?.f_to_kind(Kind::Int64)?)?;
            if layout != [fp.numel, fp.len, world] {
                return Err(Error::mismatch(
                    "FSDP load_sharded_state_dict",
                    format!(
                        "unit {name} was saved as {} elements over {} ranks; here it is {} over {world}: load the full state dict to change the layout",
                        layout.first().unwrap_or(&0),
                        layout.get(2).unwrap_or(&0),
                        fp.numel
                    ),
                ));
            }
            let shard = get(&format!("{name}.shard"))?;
            if shard.size() != fp.shard.size() {
                return Err(Error::mismatch(
                    "FSDP load_sharded_state_dict",
                    format!("unit {name}: saved shard {:?}, expected {:?}", shard.size(), fp.shard.size()),
                ));
            }
            Ok(shard)
        })?;
        self.reshard()?;
        self.rt.for_each(|u, _, fp| Ok(fp.shard.f_detach()?.f_copy_(&shards[u])?))?;
        Ok(())
    }
}
