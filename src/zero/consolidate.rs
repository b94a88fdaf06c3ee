//! ZeRO's optimizer state in the unsharded form (PyTorch's `consolidate_state_dict`): each rank's
//! per-bucket state is gathered and cut back into per-parameter tensors, keyed as an unsharded optimizer
//! over the same parameters (in DDP's order) keys them: `adamw.<parameter index>.exp_avg`, ... So a
//! checkpoint written by one world size loads into another, into a different ZeRO stage, or into the
//! plain optimizer.
//!
//! An inner optimizer's entries are `<name>.0.<field>` (it holds one tensor, the shard). An entry shaped
//! like the shard and of the stepped dtype is elementwise (moments, momentum): gathered and cut. Any other
//! (a step counter) is per tensor: copied to every parameter of the bucket. Float32 master weights of
//! 16-bit parameters are `zero.master.<parameter index>`.
use tch::Tensor;

use super::optimizer::{Shard, ShardedOptimizer};
use crate::error::{Error, Result};

fn split_key(key: &str) -> Option<(&str, &str)> {
    let (name, rest) = key.split_once('.')?;
    let field = rest.strip_prefix("0.")?;
    Some((name, field))
}

fn elementwise(t: &Tensor, sh: &Shard) -> bool {
    t.kind() == sh.stepped.kind() && t.size() == [sh.params.own]
}

impl ShardedOptimizer {
    /// The whole optimizer state, unsharded (see the module docs); every rank gets it. Collective: all
    /// ranks must call it together.
    pub fn consolidated_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let _g = tch::no_grad_guard();
        let world = self.pg.size() as i64;
        let mut out = Vec::new();
        for sh in &self.shards {
            let mut entries = sh.opt.state_dict();
            if sh.master {
                entries.push(("zero.0.master".to_string(), sh.stepped.detach()));
            }
            for (key, t) in entries {
                let (name, field) = split_key(&key).ok_or_else(|| {
                    Error::invalid(
                        "consolidated_state_dict",
                        format!("inner optimizer entry {key:?} is not <name>.0.<field>"),
                    )
                })?;
                let rename =
                    |i: usize| if name == "zero" { format!("zero.{field}.{i}") } else { format!("{name}.{i}.{field}") };
                if elementwise(&t, sh) {
                    let len = sh.params.len;
                    let mine = Tensor::f_zeros([len], (t.kind(), t.device()))?;
                    mine.f_narrow(0, 0, sh.params.own)?.f_copy_(&t)?;
                    let mut all: Vec<Tensor> = (0..world).map(|_| mine.zeros_like()).collect();
                    self.pg.all_gather_unverified(&mut all, &mine)?.wait()?;
                    let full = Tensor::f_cat(&all, 0)?;
                    for (i, off, shape) in &sh.members {
                        let n: i64 = shape.iter().product();
                        out.push((rename(*i), full.f_narrow(0, *off, n)?.f_view(shape.as_slice())?.f_contiguous()?));
                    }
                } else {
                    for (i, _, _) in &sh.members {
                        out.push((rename(*i), t.f_detach_copy()?));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Loads a state in the consolidated form, from any world size or stage, or from the plain optimizer
    /// over the same parameters. Each rank takes its shard of every elementwise entry. Entries missing for
    /// a whole bucket leave that bucket's state fresh; a bucket whose parameters disagree (some with an
    /// entry, some without) is an error naming the parameter.
    pub fn load_consolidated_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let _g = tch::no_grad_guard();
        let rank = self.pg.rank() as i64;
        for sh in &mut self.shards {
            // the fields saved for this bucket's first parameter, in the inner optimizer's naming
            let first = sh.members[0].0;
            let mut fields: Vec<(String, String)> = Vec::new(); // (inner key, consolidated key pattern)
            for (key, _) in state {
                let mut parts = key.splitn(3, '.');
                let (Some(a), Some(b), Some(c)) = (parts.next(), parts.next(), parts.next()) else { continue };
                if a == "zero" && b == "master" && c == first.to_string() {
                    fields.push(("zero.0.master".into(), "zero.master.{i}".into()));
                } else if b == first.to_string() {
                    fields.push((format!("{a}.0.{c}"), format!("{a}.{{i}}.{c}")));
                }
            }
            let mut inner = Vec::new();
            for (inner_key, pattern) in fields {
                let find = |i: usize| {
                    let k = pattern.replace("{i}", &i.to_string());
                    state.iter().find(|(n, _)| *n == k).map(|(_, t)| t).ok_or_else(|| {
                        Error::invalid(
                            "load_consolidated_state_dict",
                            format!("no entry {k:?} (parameter {i}'s bucket has {inner_key:?})"),
                        )
                    })
                };
                let t0 = find(first)?;
                let is_elementwise = t0.size() == sh.members[0].2 && t0.kind() == sh.stepped.kind();
                let value = if is_elementwise {
                    let mut parts = Vec::with_capacity(sh.members.len());
                    for (i, _, shape) in &sh.members {
                        let t = find(*i)?;
                        if t.size() != *shape {
                            return Err(Error::mismatch(
                                "load_consolidated_state_dict",
                                format!(
                                    "{}: saved {:?}, parameter {i} is {shape:?}",
                                    pattern.replace("{i}", &i.to_string()),
                                    t.size()
                                ),
                            ));
                        }
                        parts.push(t.f_reshape([-1])?.f_to_kind(sh.stepped.kind())?);
                    }
                    let full = Tensor::f_cat(&parts, 0)?;
                    let start = (rank * sh.params.len).min(full.numel() as i64);
                    full.f_narrow(0, start, sh.params.own)?.f_contiguous()?
                } else {
                    t0.f_detach_copy()?
                };
                if inner_key == "zero.0.master" {
                    sh.stepped.detach().f_copy_(&value)?;
                } else {
                    inner.push((inner_key, value));
                }
            }
            sh.opt.load_state_dict(&inner)?;
        }
        Ok(())
    }
}
