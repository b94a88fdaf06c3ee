//! Runs one training step of a schedule: the per-rank executor shared by the two forms (threads with
//! channels, processes with send/recv). Microbatch losses are scaled by 1/m; gradients accumulate in the
//! stages' variables; the caller steps its optimizers once per batch.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tch::{Kind, Tensor};

use super::layers::Stage;
use super::plan::{self, Step};
use super::schedule::{Action, Schedule};
use super::trace::ActionSpan;
use super::transport::{self, Outgoing, Payload, Transport};
use crate::error::{panic_message, Error, Result};

/// The loss of the last stage's output against the targets (a scalar).
pub type LossFn = dyn Fn(&Tensor, &Tensor) -> Tensor + Send + Sync;

/// What one rank did in a step.
#[derive(Debug, Default)]
pub struct RankReport {
    /// Sum of this rank's microbatch losses divided by m (only the last virtual stage has any): a
    /// scalar on the stage's device, summed there (reading it is the caller's host sync, when it logs).
    pub loss: Option<Tensor>,
    pub spans: Vec<ActionSpan>,
    /// Most microbatch-chunks whose activations this rank held at once.
    pub max_in_flight: usize,
}

/// Inputs of one rank's step.
pub(crate) struct RankStep<'a> {
    pub rank: usize,
    pub schedule: &'a Schedule,
    /// This rank's chunks: `chunks[c]` is virtual stage `c * p + rank`.
    pub chunks: &'a [Stage],
    /// Microbatched inputs (needed by virtual stage 0) and targets (needed by the last).
    pub inputs: &'a [Tensor],
    pub targets: &'a [Tensor],
    pub loss: &'a LossFn,
    /// Keep only each chunk's input per microbatch in flight; recompute the forward in backward.
    pub recompute: bool,
}

/// Wall-clock seconds since the Unix epoch: comparable across the stage processes of one machine.
pub(crate) fn now() -> f64 {
    crate::flight::now()
}

struct Saved {
    input: Tensor,
    output: Option<Tensor>,
    loss: Option<Tensor>,
}

/// Executes `step.schedule.actions[rank]` with `net` carrying tensors, batch by batch as the schedule's
/// plan (`plan`) says.
pub(crate) fn run_rank(step: &RankStep, net: &mut dyn Transport) -> Result<RankReport> {
    let sch = step.schedule;
    let p = sch.stages;
    let last_vs = p * sch.chunks - 1;
    let rank = step.rank;
    let vs_of = |chunk: usize| chunk * p + rank;
    let prev_rank = (rank + p - 1) % p;
    let next_rank = (rank + 1) % p;
    let scale = 1.0 / sch.microbatches as f64;
    let steps = plan::plan(sch)?.swap_remove(rank);
    // per chunk, the microbatch of its last backward
    let last_backward: HashMap<usize, usize> = steps
        .iter()
        .filter_map(|s| match s {
            Step::Compute(Action::Backward { mb, chunk }) => Some((*chunk, *mb)),
            _ => None,
        })
        .collect();
    let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
    // what the last compute made, for the batch that follows it
    let mut outbox: Vec<Outgoing> = Vec::new();
    let mut report = RankReport::default();
    // summed on the device where it is made; the caller reads it (a host sync) only when it logs
    let mut loss_sum: Option<Tensor> = None;
    if let Some(x) = step.inputs.first() {
        net.begin(x)?;
    }
    let _keep = step.chunks.iter().map(|c| c.keep_gathered()).collect::<Result<Vec<_>>>()?;
    for (i, st) in steps.iter().enumerate() {
        // tch's infallible ops (layers, loss functions) panic on bad shapes: that is this stage's error too
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
            let a = match st {
                Step::Exchange { sends, recvs } => {
                    let mut out = Vec::with_capacity(sends.len());
                    for &(to, key) in sends {
                        let at = outbox.iter().position(|o| o.to == to && o.key == key);
                        let o = at.map(|k| outbox.swap_remove(k)).ok_or_else(|| {
                            Error::invalid(
                                format!("pipeline stage {rank}"),
                                format!("{key:?} is sent before it is made"),
                            )
                        })?;
                        out.push(o);
                    }
                    return net.exchange(out, recvs);
                }
                Step::Compute(a) => *a,
            };
            match a {
                Action::Forward { mb, chunk } => {
                    let stage = &step.chunks[chunk];
                    let vs = vs_of(chunk);
                    let start = now();
                    let input = if vs == 0 {
                        step.inputs[mb].f_to_device(stage.device)?
                    } else {
                        let t = net.recv(prev_rank, (Payload::Activation, mb, vs))?;
                        t.f_to_device(stage.device)?.f_detach()?.set_requires_grad(true)
                    };
                    // With recomputation the forward keeps no graph: only `input` is kept, and backward
                    // runs the forward again.
                    let _no_graph = step.recompute.then(tch::no_grad_guard);
                    let output = stage.f_forward(&input)?;
                    let loss = if vs == last_vs { Some(last_loss(step, &output, mb, scale)?) } else { None };
                    if let Some(l) = &loss {
                        let l = l.f_detach()?;
                        loss_sum = Some(match loss_sum.take() {
                            Some(s) => s.f_add(&l)?,
                            None => l,
                        });
                    }
                    if vs != last_vs {
                        // Backward needs the output's graph and shape, not its values (Megatron's
                        // deallocate_output_tensor): they go once sent, unless a backward function saved
                        // them (tanh keeps its result).
                        let release = (!step.recompute).then(|| output.shallow_clone());
                        let key = (Payload::Activation, mb, vs + 1);
                        outbox.push(Outgoing { to: next_rank, key, tensor: output.f_detach()?, release });
                    }
                    let (output, loss) = if step.recompute { (None, None) } else { (Some(output), loss) };
                    saved.insert((mb, chunk), Saved { input, output, loss });
                    report.max_in_flight = report.max_in_flight.max(saved.len());
                    let end = now();
                    crate::timeline::completed("forward", || format!("F{mb}.{chunk}"), start, end);
                    report.spans.push(ActionSpan { stage: rank, forward: true, mb, chunk, start, end });
                }
                Action::Backward { mb, chunk } => {
                    let stage = &step.chunks[chunk];
                    let vs = vs_of(chunk);
                    let start = now();
                    let s = saved.remove(&(mb, chunk)).ok_or_else(|| missing(rank, a))?;
                    // recomputation: the forward again, this time recording the graph
                    let output = match s.output {
                        Some(o) => o,
                        None => stage.f_forward(&s.input)?,
                    };
                    // a data-parallel chunk reduces its gradients during its last backward of the step only
                    let _sync = stage.backward_sync(last_backward.get(&chunk) == Some(&mb));
                    if vs == last_vs {
                        let loss = match s.loss {
                            Some(l) => l,
                            None => last_loss(step, &output, mb, scale)?,
                        };
                        loss.f_backward()?;
                    } else {
                        let g = net.recv(next_rank, (Payload::Grad, mb, vs))?;
                        crate::hooks::backward_with_grad(&output, &g.f_to_device(output.device())?)?;
                    }
                    if vs > 0 {
                        let gin = s.input.grad();
                        if !gin.defined() {
                            return Err(Error::invalid(
                                format!("pipeline stage {rank}, virtual stage {vs}"),
                                "the stage's output does not depend on its input, so no gradient flows back",
                            ));
                        }
                        outbox.push(Outgoing {
                            to: prev_rank,
                            key: (Payload::Grad, mb, vs - 1),
                            tensor: gin,
                            release: None,
                        });
                    }
                    let end = now();
                    crate::timeline::completed("backward", || format!("B{mb}.{chunk}"), start, end);
                    report.spans.push(ActionSpan { stage: rank, forward: false, mb, chunk, start, end });
                }
                Action::BackwardWeight { .. } => {
                    return Err(Error::invalid(
                        format!("pipeline stage {rank}"),
                        "weight-gradient actions (zero-bubble schedules) are not run by this runtime",
                    ))
                }
                // the plan holds computes only; transfers are its batches
                _ => return Err(missing(rank, a)),
            }
            Ok(())
        }))
        .unwrap_or_else(|p| Err(Error::invalid(format!("pipeline stage {rank}"), panic_message(&*p))));
        if let Err(e) = done {
            warn_neighbours(&steps[i..], net, &e);
            return Err(e);
        }
    }
    net.flush()?;
    if rank == last_vs % p && step.chunks.len() * p > last_vs {
        report.loss = Some(match loss_sum {
            Some(l) => l,
            None => Tensor::f_zeros([], (Kind::Float, step.chunks[last_vs / p].device))?,
        });
    }
    Ok(report)
}

/// This rank failed before the batches of `rest`: they go out anyway, with placeholders, so the failure
/// travels down the pipeline at once.
fn warn_neighbours(rest: &[Step], net: &mut dyn Transport, e: &Error) {
    let batches: Vec<_> = rest
        .iter()
        .filter_map(|s| match s {
            Step::Exchange { sends, recvs } => Some((sends.clone(), recvs.clone())),
            Step::Compute(_) => None,
        })
        .collect();
    let _ = net.abort(&batches, &e.to_string());
}

fn last_loss(step: &RankStep, out: &Tensor, mb: usize, scale: f64) -> Result<Tensor> {
    let y = step.targets[mb].f_to_device(out.device())?;
    Ok((step.loss)(out, &y).f_mul_scalar(scale)?)
}

fn missing(rank: usize, a: Action) -> Error {
    Error::invalid(format!("pipeline stage {rank}"), format!("{a:?} has nothing to work on: schedule out of order"))
}

/// Runs a step with one thread per rank. `ranks[s]` holds stage `s`'s chunks. A failure on any stage
/// stops the others (no hang) and is returned.
pub(crate) fn run_threads(
    schedule: &Schedule,
    ranks: &mut [Vec<Stage>],
    inputs: &[Tensor],
    targets: &[Tensor],
    loss: &LossFn,
    recompute: bool,
    timeout: Duration,
) -> Result<Vec<RankReport>> {
    let p = schedule.stages;
    let abort = Arc::new(AtomicBool::new(false));
    let nets = transport::channels(p, abort.clone(), timeout);
    let results: Vec<Result<RankReport>> = std::thread::scope(|scope| {
        let handles: Vec<_> = nets
            .into_iter()
            .zip(ranks.iter_mut())
            .enumerate()
            .map(|(rank, (mut net, chunks))| {
                let abort = abort.clone();
                // Tensors are Send but not Sync: each thread gets its own handles to the microbatches.
                let inputs: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
                let targets: Vec<Tensor> = targets.iter().map(|t| t.shallow_clone()).collect();
                scope.spawn(move || {
                    let chunks: &[Stage] = chunks;
                    let step = RankStep { rank, schedule, chunks, inputs: &inputs, targets: &targets, loss, recompute };
                    // tch's infallible ops (layers, loss functions) panic on bad shapes: turn that into
                    // this stage's error and stop the other stages.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_rank(&step, &mut net)))
                        .unwrap_or_else(|p| Err(Error::invalid(format!("pipeline stage {rank}"), panic_message(&*p))));
                    if r.is_err() {
                        abort.store(true, Ordering::SeqCst);
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::invalid("pipeline", "a stage thread panicked"))))
            .collect()
    });
    // Report the root cause, not the "another stage failed" of the others.
    let mut first_other = None;
    let mut out = Vec::with_capacity(p);
    for r in results {
        match r {
            Ok(rep) => out.push(rep),
            Err(e @ Error::PeerGone { .. }) => {
                first_other.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    match first_other {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
