//! Pipeline schedules as plain data: for each stage, the ordered list of actions it performs in one
//! training step. Unit tests (and `simulate`) check them for deadlocks, completeness, activation memory
//! and bubble size without running a model.
//!
//! Stages are numbered 0..p. With interleaving, stage `s` holds `v` model chunks; chunk `c` of stage `s`
//! is virtual stage `c * p + s`, so activations go 0 → 1 → … → p-1 → (chunk 1 of stage 0) → ….
//!
//! ```
//! use tch_dist::pipeline::schedule::{Schedule, ScheduleKind};
//! let s = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1)?;
//! let sim = s.simulate()?;
//! assert!((sim.bubble_fraction - 1.0 / 5.0).abs() < 1e-12); // (p-1)/(m+p-1)
//! # Ok::<(), tch_dist::Error>(())
//! ```
use crate::error::{Error, Result};

/// Which schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (GPipe): m activations in flight per stage.
    GPipe,
    /// One forward, one backward (PipeDream-Flush): at most p activations in flight.
    OneFOneB,
    /// 1F1B over v model chunks per stage (Megatron-LM): bubble shrinks by v; needs m % p == 0.
    Interleaved1F1B,
    /// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): backward split into the input gradient (B,
    /// on the critical path) and the weight gradient (W, deferred into what would be bubbles). With
    /// equal times for F, B and W, a third of 1F1B's bubble, and no stage holds more activations than
    /// 1F1B's first. Schedule data and simulation only: the runtime does not split backward yet.
    ZeroBubbleH1,
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<ScheduleKind> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" | "interleaved1f1b" | "interleaved-1f1b" => Ok(ScheduleKind::Interleaved1F1B),
            "zbh1" | "zb-h1" | "zerobubble" => Ok(ScheduleKind::ZeroBubbleH1),
            _ => Err(Error::invalid("schedule", format!("unknown schedule {s:?} (gpipe, 1f1b, interleaved, zb-h1)"))),
        }
    }
}

/// One step of a stage. Receives block until the tensor arrives; sends do not block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Receive microbatch `mb`'s activation for chunk `chunk` from the previous virtual stage.
    RecvActivation {
        mb: usize,
        chunk: usize,
    },
    Forward {
        mb: usize,
        chunk: usize,
    },
    /// Send the forward's output to the next virtual stage.
    SendActivation {
        mb: usize,
        chunk: usize,
    },
    /// Receive the gradient of this chunk's output from the next virtual stage.
    RecvGrad {
        mb: usize,
        chunk: usize,
    },
    /// The backward (the input's gradient only, in a schedule with [`Action::BackwardWeight`]).
    Backward {
        mb: usize,
        chunk: usize,
    },
    /// The weight gradients of a backward whose input gradient was computed before (zero-bubble schedules).
    BackwardWeight {
        mb: usize,
        chunk: usize,
    },
    /// Send the gradient of this chunk's input to the previous virtual stage.
    SendGrad {
        mb: usize,
        chunk: usize,
    },
}

/// Per-stage action lists for one training step.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub stages: usize,
    pub microbatches: usize,
    pub chunks: usize,
    pub actions: Vec<Vec<Action>>,
}

/// Time units of each compute action in a simulation. A backward that is not split into input and weight
/// gradients costs `input_grad + weight_grad`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Costs {
    pub forward: usize,
    pub input_grad: usize,
    pub weight_grad: usize,
}

/// What a simulation with unit-time forwards and backwards found.
#[derive(Clone, Debug)]
pub struct Simulation {
    /// Time units until the last action ends.
    pub makespan: usize,
    /// Idle share of the stages' time: 1 - busy / (stages × makespan).
    pub bubble_fraction: f64,
    /// Per stage, the most microbatch-chunks forwarded but not yet backwarded at once.
    pub max_in_flight: Vec<usize>,
    /// (stage, action, start) of every compute action.
    pub timeline: Vec<(usize, Action, usize)>,
}

impl Schedule {
    /// Builds the schedule for `p` stages, `m` microbatches and `v` chunks per stage (1 except for
    /// interleaving). Errors name the setting that cannot work.
    pub fn new(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Result<Schedule> {
        let what = format!("{kind:?} schedule with {p} stages, {m} microbatches, {v} chunks");
        if p == 0 || m == 0 || v == 0 {
            return Err(Error::invalid(what, "stages, microbatches and chunks must all be at least 1"));
        }
        match kind {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZeroBubbleH1 if v != 1 => {
                return Err(Error::invalid(what, "only the interleaved schedule takes more than one chunk per stage"))
            }
            ScheduleKind::Interleaved1F1B if v < 2 => {
                return Err(Error::invalid(what, "interleaving needs at least 2 chunks per stage (use 1F1B for 1)"))
            }
            ScheduleKind::Interleaved1F1B if !m.is_multiple_of(p) => {
                return Err(Error::invalid(
                    what,
                    format!("interleaving needs microbatches divisible by stages ({m} % {p} != 0)"),
                ))
            }
            ScheduleKind::OneFOneB if m < p => {
                return Err(Error::invalid(
                    what,
                    format!("1F1B needs at least as many microbatches as stages ({m} < {p})"),
                ))
            }
            _ => {}
        }
        let compute: Vec<Vec<Action>> = match kind {
            ScheduleKind::ZeroBubbleH1 => zb_h1(p, m),
            _ => (0..p)
                .map(|s| match kind {
                    ScheduleKind::GPipe => gpipe(m),
                    ScheduleKind::OneFOneB => one_f_one_b(p, m, s),
                    _ => interleaved(p, m, v, s),
                })
                .collect(),
        };
        let actions = compute.into_iter().enumerate().map(|(s, list)| with_comm(&list, s, p, v)).collect();
        Ok(Schedule { kind, stages: p, microbatches: m, chunks: v, actions })
    }

    /// The virtual stage of `chunk` on `stage`.
    pub fn virtual_stage(&self, stage: usize, chunk: usize) -> usize {
        chunk * self.stages + stage
    }

    /// The most activations a stage of this schedule keeps (microbatch-chunks in flight).
    pub fn in_flight_bound(&self) -> usize {
        match self.kind {
            ScheduleKind::GPipe => self.microbatches,
            // ZB-H1: every stage up to 1F1B's first stage (activations held until the weight gradient)
            ScheduleKind::OneFOneB | ScheduleKind::ZeroBubbleH1 => self.stages.min(self.microbatches),
            // Megatron's warm-up: (p - 1) * 2 + (v - 1) * p forwards, plus the one in the steady state.
            ScheduleKind::Interleaved1F1B => {
                ((self.stages - 1) * 2 + (self.chunks - 1) * self.stages + 1).min(self.microbatches * self.chunks)
            }
        }
    }

    /// The bubble fraction theory predicts with unit-time compute actions: forward and backward per
    /// chunk, or forward, input gradient and weight gradient for ZB-H1 (whose bubble is (p - 1) units
    /// per stage, against 3 (p - 1) for 1F1B with the same costs).
    pub fn ideal_bubble_fraction(&self) -> f64 {
        let (p, m, v) = (self.stages as f64, self.microbatches as f64, self.chunks as f64);
        match self.kind {
            ScheduleKind::ZeroBubbleH1 => (p - 1.0) / (3.0 * m + p - 1.0),
            _ => (p - 1.0) / (v * m + p - 1.0),
        }
    }

    /// Runs the schedule with unit-time compute actions and free communication. Fails on a deadlock,
    /// naming the stages that are stuck and what they wait for.
    pub fn simulate(&self) -> Result<Simulation> {
        let weight_grad = if self.splits_backward() { 1 } else { 0 };
        simulate(self, Costs { forward: 1, input_grad: 1, weight_grad })
    }

    /// As [`simulate`](Self::simulate), with the given costs (to compare split and unsplit backwards
    /// doing the same work).
    pub fn simulate_with(&self, costs: Costs) -> Result<Simulation> {
        simulate(self, costs)
    }

    /// Whether backward is split into input and weight gradients.
    pub fn splits_backward(&self) -> bool {
        self.kind == ScheduleKind::ZeroBubbleH1
    }
}

fn gpipe(m: usize) -> Vec<Action> {
    let mut a: Vec<Action> = (0..m).map(|mb| Action::Forward { mb, chunk: 0 }).collect();
    a.extend((0..m).map(|mb| Action::Backward { mb, chunk: 0 }));
    a
}

fn one_f_one_b(p: usize, m: usize, s: usize) -> Vec<Action> {
    let warmup = (p - s - 1).min(m);
    let mut a = Vec::with_capacity(2 * m);
    let (mut f, mut b) = (0, 0);
    for _ in 0..warmup {
        a.push(Action::Forward { mb: f, chunk: 0 });
        f += 1;
    }
    while f < m {
        a.push(Action::Forward { mb: f, chunk: 0 });
        f += 1;
        a.push(Action::Backward { mb: b, chunk: 0 });
        b += 1;
    }
    while b < m {
        a.push(Action::Backward { mb: b, chunk: 0 });
        b += 1;
    }
    a
}

/// Megatron-LM's interleaved 1F1B: microbatches go in groups of p through chunk 0, then chunk 1, ...;
/// backwards in the same groups from the last chunk down.
fn interleaved(p: usize, m: usize, v: usize, s: usize) -> Vec<Action> {
    let total = m * v;
    let fwd = |k: usize| Action::Forward { mb: (k / (p * v)) * p + k % p, chunk: (k / p) % v };
    let bwd = |k: usize| Action::Backward { mb: (k / (p * v)) * p + k % p, chunk: v - 1 - (k / p) % v };
    let warmup = ((p - s - 1) * 2 + (v - 1) * p).min(total);
    let mut a = Vec::with_capacity(2 * total);
    let (mut f, mut b) = (0, 0);
    while f < warmup {
        a.push(fwd(f));
        f += 1;
    }
    while f < total {
        a.push(fwd(f));
        f += 1;
        a.push(bwd(b));
        b += 1;
    }
    while b < total {
        a.push(bwd(b));
        b += 1;
    }
    a
}

/// ZB-H1 by list scheduling with unit-time F, B and W: at each step a stage runs the first of F, B, W
/// that is ready, F only while it holds fewer than 1F1B's share of forwards not yet through B
/// (`p - s`) and fewer than `p` microbatches not yet through W (1F1B's first stage's peak). W thus fills
/// the time a stage would wait, and the idle time per stage drops from 1F1B's 3 (p - 1) units to p - 1.
fn zb_h1(p: usize, m: usize) -> Vec<Vec<Action>> {
    let (mut f, mut b, mut w) = (vec![0; p], vec![0; p], vec![0; p]);
    let mut f_end: Vec<Vec<usize>> = vec![vec![usize::MAX; m]; p];
    let mut b_end: Vec<Vec<usize>> = vec![vec![usize::MAX; m]; p];
    let mut out: Vec<Vec<Action>> = vec![Vec::with_capacity(3 * m); p];
    let mut t = 0;
    while (0..p).any(|s| w[s] < m) {
        let mut picks = Vec::with_capacity(p);
        for s in 0..p {
            let f_ready = f[s] < m && f[s] - b[s] < p - s && f[s] - w[s] < p && (s == 0 || f_end[s - 1][f[s]] <= t);
            let b_ready = b[s] < f[s] && f_end[s][b[s]] <= t && (s == p - 1 || b_end[s + 1][b[s]] <= t);
            if f_ready {
                picks.push((s, Action::Forward { mb: f[s], chunk: 0 }));
            } else if b_ready {
                picks.push((s, Action::Backward { mb: b[s], chunk: 0 }));
            } else if w[s] < b[s] {
                picks.push((s, Action::BackwardWeight { mb: w[s], chunk: 0 }));
            }
        }
        for (s, a) in picks {
            match a {
                Action::Forward { mb, .. } => {
                    f_end[s][mb] = t + 1;
                    f[s] += 1;
                }
                Action::Backward { mb, .. } => {
                    b_end[s][mb] = t + 1;
                    b[s] += 1;
                }
                _ => w[s] += 1,
            }
            out[s].push(a);
        }
        t += 1;
    }
    out
}

/// Adds the receives before and sends after each compute action.
fn with_comm(list: &[Action], s: usize, p: usize, v: usize) -> Vec<Action> {
    let last = p * v - 1;
    let mut out = Vec::with_capacity(list.len() * 3);
    for &a in list {
        match a {
            Action::Forward { mb, chunk } => {
                let vs = chunk * p + s;
                if vs > 0 {
                    out.push(Action::RecvActivation { mb, chunk });
                }
                out.push(a);
                if vs < last {
                    out.push(Action::SendActivation { mb, chunk });
                }
            }
            Action::Backward { mb, chunk } => {
                let vs = chunk * p + s;
                if vs < last {
                    out.push(Action::RecvGrad { mb, chunk });
                }
                out.push(a);
                if vs > 0 {
                    out.push(Action::SendGrad { mb, chunk });
                }
            }
            other => out.push(other),
        }
    }
    out
}

fn simulate(sch: &Schedule, costs: Costs) -> Result<Simulation> {
    let split = sch.splits_backward();
    let cost = |a: Action| match a {
        Action::Forward { .. } => costs.forward,
        Action::Backward { .. } if split => costs.input_grad,
        Action::Backward { .. } => costs.input_grad + costs.weight_grad,
        _ => costs.weight_grad,
    };
    use std::collections::HashMap;
    let (p, v) = (sch.stages, sch.chunks);
    let vstage = |s: usize, chunk: usize| chunk * p + s;
    // When each (kind, mb, virtual stage) result became available to its consumer.
    let mut fwd_done: HashMap<(usize, usize), usize> = HashMap::new(); // (mb, vs) -> end time
    let mut bwd_done: HashMap<(usize, usize), usize> = HashMap::new();
    let mut pos = vec![0usize; p];
    let mut free_at = vec![0usize; p];
    let mut busy = vec![0usize; p];
    let mut in_flight = vec![0usize; p];
    let mut max_in_flight = vec![0usize; p];
    let mut timeline = Vec::new();
    let total: usize = sch.actions.iter().map(|a| a.len()).sum();
    let mut done = 0;
    let last = p * v - 1;
    while done < total {
        let mut progressed = false;
        for s in 0..p {
            // Run this stage as far as it can go now.
            while pos[s] < sch.actions[s].len() {
                let a = sch.actions[s][pos[s]];
                let ready_at = match a {
                    Action::RecvActivation { mb, chunk } => fwd_done.get(&(mb, vstage(s, chunk) - 1)).copied(),
                    Action::RecvGrad { mb, chunk } => bwd_done.get(&(mb, vstage(s, chunk) + 1)).copied(),
                    Action::Forward { mb, chunk } => {
                        let vs = vstage(s, chunk);
                        if vs == 0 {
                            Some(0)
                        } else {
                            fwd_done.get(&(mb, vs - 1)).copied()
                        }
                    }
                    Action::Backward { mb, chunk } => {
                        let vs = vstage(s, chunk);
                        let own = fwd_done.get(&(mb, vs)).copied();
                        if vs == last {
                            own
                        } else {
                            own.and(bwd_done.get(&(mb, vs + 1)).copied())
                        }
                    }
                    Action::BackwardWeight { mb, chunk } => bwd_done.get(&(mb, vstage(s, chunk))).copied(),
                    Action::SendActivation { .. } | Action::SendGrad { .. } => Some(0),
                };
                let Some(t) = ready_at else { break };
                match a {
                    Action::Forward { mb, chunk }
                    | Action::Backward { mb, chunk }
                    | Action::BackwardWeight { mb, chunk } => {
                        let start = t.max(free_at[s]);
                        let end = start + cost(a);
                        free_at[s] = end;
                        busy[s] += cost(a);
                        timeline.push((s, a, start));
                        match a {
                            Action::Forward { .. } => {
                                fwd_done.insert((mb, vstage(s, chunk)), end);
                                in_flight[s] += 1;
                                max_in_flight[s] = max_in_flight[s].max(in_flight[s]);
                            }
                            Action::Backward { .. } => {
                                bwd_done.insert((mb, vstage(s, chunk)), end);
                                if !split {
                                    in_flight[s] -= 1;
                                }
                            }
                            // the activations are kept until the weight gradient is computed
                            _ => in_flight[s] -= 1,
                        }
                    }
                    _ => {}
                }
                pos[s] += 1;
                done += 1;
                progressed = true;
            }
        }
        if !progressed {
            let stuck: Vec<String> = (0..p)
                .filter(|&s| pos[s] < sch.actions[s].len())
                .map(|s| format!("stage {s} waits at {:?}", sch.actions[s][pos[s]]))
                .collect();
            return Err(Error::invalid(format!("{:?} schedule", sch.kind), format!("deadlock: {}", stuck.join("; "))));
        }
    }
    let makespan = free_at.iter().copied().max().unwrap_or(0);
    let busy_total: usize = busy.iter().sum();
    let bubble_fraction = 1.0 - busy_total as f64 / (p * makespan) as f64;
    Ok(Simulation { makespan, bubble_fraction, max_in_flight, timeline })
}
