//! Autograd ops whose collectives the shim runs itself, on the group's engine for the input's device
//! (tensor parallelism's operators, SyncBatchNorm): the call, and the flight recorder's entries for the
//! forward's collective and the backward's. The backward's entry comes from two markers around the op:
//! the one on the output starts it, the one on the input ends it.
use std::sync::{Arc, Mutex};

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi::c10d::{Made, Pg};
use crate::ffi::check;
use crate::flight::Recording;
use crate::group::ProcessGroup;
use crate::hooks;

/// What an op's collectives are, as the recorder names them (`allreduce(Sum) of Float[8] on Cpu`); none
/// where it runs none.
pub(crate) struct Collectives {
    pub(crate) forward: Option<String>,
    pub(crate) backward: Option<String>,
}

/// A backward's entry: what it is, and its recording while it runs.
type Slot = Arc<Mutex<(String, Option<Recording>)>>;

fn lock(s: &Slot) -> std::sync::MutexGuard<'_, (String, Option<Recording>)> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the shim's op `call(backend, input)` on `x` for `name`, recording `collectives`. The backward's
/// entry is kept only when the recorder is on and `x` requires grad (the markers attach only when a
/// backward will run).
pub(crate) fn run(
    x: &Tensor,
    pg: &ProcessGroup,
    name: &str,
    collectives: Collectives,
    call: impl FnOnce(&Pg, &Tensor) -> Made,
) -> Result<Tensor> {
    let desc = || format!("{name} of {} on {pg:?}", crate::group::describe(x));
    let engine = pg.engine_pg(x.device(), &desc)?;
    let backward: Option<Slot> = collectives
        .backward
        .filter(|_| crate::flight::recording() && x.requires_grad())
        .map(|what| Arc::new(Mutex::new((format!("{what} ({name} backward)"), None))));
    let input = match &backward {
        Some(slot) => {
            let slot = slot.clone();
            hooks::backward_marker(x, "ShimOpBackwardEnd", move || {
                if let Some(r) = lock(&slot).1.take() {
                    r.end(None);
                }
                Ok(())
            })?
            .0
        }
        None => x.shallow_clone(),
    };
    let forward = collectives.forward.and_then(|d| pg.record_external(x.device(), &format!("{d} ({name})")));
    let (rc, out) = call(engine, &input);
    let done = check(rc, pg.timeout(), desc);
    if let Some(r) = forward {
        r.end(done.as_ref().err().map(|e| e.to_string()).as_deref());
    }
    done?;
    let y = out.ok_or_else(|| Error::invalid(name, "shim returned no tensor"))?;
    let Some((slot, recorder)) = backward.zip(pg.external_recorder(x.device())) else { return Ok(y) };
    let (y, _) = hooks::backward_marker(&y, "ShimOpBackwardBegin", move || {
        let mut s = lock(&slot);
        s.1 = recorder.record(&s.0);
        Ok(())
    })?;
    Ok(y)
}
