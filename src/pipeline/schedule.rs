//! Pipeline schedules as plain data: for each stage, the ordered list of actions it performs in one
//! training step. Unit tests (and `simulate`) check them for deadlocks, completeness, activation memory
//! and bubble size without running a model.
//!
//! Stages are numbered 0..p. With interleaving, stage `s` holds `v` model chunks; chunk `c` of stage `s`
//! is virtual stage `c * p + s`, so activations go 0 → 1 → … → p-1 → (chunk 1 of stage 0) → ….
//!
//! ```
//! use tch_dist::pipeline::schedule::{Schedule, Kind};
//! let s = Schedule::new(Kind::OneFOneB, 2, 4, 1)?;
//! let sim = s.simulate()?;
//! assert!((sim.bubble_fraction - 1.0 / 5.0).abs() < 1e-12); // (p-1)/(m+p-1)
//! # Ok::<(), tch_dist::Error>(())
//! ```
use crate::error::{Error, Result};

/// Which schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// All forwards, then all backwards (GPipe): m activations in flight per stage.
    GPipe,
    /// One forward, one backward (PipeDream-Flush): at most p activations in flight.
    OneFOneB,
    /// 1F1B over v model chunks per stage (Megatron-LM): bubble shrinks by v; needs m % p == 0.
    Interleaved1F1B,
}

impl std::str::FromStr for Kind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Kind> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Kind::GPipe),
            "1f1b" => Ok(Kind::OneFOneB),
            "interleaved" | "interleaved1f1b" | "interleaved-1f1b" => Ok(Kind::Interleaved1F1B),
            _ => Err(Error::invalid("schedule", format!("unknown schedule {s:?} (gpipe, 1f1b, interleaved)"))),
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
    Backward {
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
    pub kind: Kind,
    pub stages: usize,
    pub microbatches: usize,
    pub chunks: usize,
    pub actions: Vec<Vec<Action>>,
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
    pub fn new(kind: Kind, p: usize, m: usize, v: usize) -> Result<Schedule> {
        let what = format!("{kind:?} schedule with {p} stages, {m} microbatches, {v} chunks");
        if p == 0 || m == 0 || v == 0 {
            return Err(Error::invalid(what, "stages, microbatches and chunks must all be at least 1"));
        }
        match kind {
            Kind::GPipe | Kind::OneFOneB if v != 1 => {
                return Err(Error::invalid(what, "only the interleaved schedule takes more than one chunk per stage"))
            }
            Kind::Interleaved1F1B if v < 2 => {
                return Err(Error::invalid(what, "interleaving needs at least 2 chunks per stage (use 1F1B for 1)"))
            }
            Kind::Interleaved1F1B if !m.is_multiple_of(p) => {
                return Err(Error::invalid(
                    what,
                    format!("interleaving needs microbatches divisible by stages ({m} % {p} != 0)"),
                ))
            }
            Kind::OneFOneB if m < p => {
                return Err(Error::invalid(
                    what,
                    format!("1F1B needs at least as many microbatches as stages ({m} < {p})"),
                ))
            }
            _ => {}
        }
        let compute: Vec<Vec<Action>> = (0..p)
            .map(|s| match kind {
                Kind::GPipe => gpipe(m),
                Kind::OneFOneB => one_f_one_b(p, m, s),
                Kind::Interleaved1F1B => interleaved(p, m, v, s),
            })
            .collect();
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
            Kind::GPipe => self.microbatches,
            Kind::OneFOneB => self.stages,
            // Megatron's warm-up: (p - 1) * 2 + (v - 1) * p forwards, plus the one in the steady state.
            Kind::Interleaved1F1B => {
                ((self.stages - 1) * 2 + (self.chunks - 1) * self.stages + 1).min(self.microbatches * self.chunks)
            }
        }
    }

    /// The bubble fraction theory predicts with unit-time forward and backward per chunk.
    pub fn ideal_bubble_fraction(&self) -> f64 {
        let (p, m, v) = (self.stages as f64, self.microbatches as f64, self.chunks as f64);
        (p - 1.0) / (v * m + p - 1.0)
    }

    /// Runs the schedule with unit-time compute and free communication. Fails on a deadlock, naming the
    /// stages that are stuck and what they wait for.
    pub fn simulate(&self) -> Result<Simulation> {
        simulate(self)
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

fn simulate(sch: &Schedule) -> Result<Simulation> {
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
                    Action::SendActivation { .. } | Action::SendGrad { .. } => Some(0),
                };
                let Some(t) = ready_at else { break };
                match a {
                    Action::Forward { mb, chunk } | Action::Backward { mb, chunk } => {
                        let start = t.max(free_at[s]);
                        free_at[s] = start + 1;
                        busy[s] += 1;
                        timeline.push((s, a, start));
                        if matches!(a, Action::Forward { .. }) {
                            fwd_done.insert((mb, vstage(s, chunk)), start + 1);
                            in_flight[s] += 1;
                            max_in_flight[s] = max_in_flight[s].max(in_flight[s]);
                        } else {
                            bwd_done.insert((mb, vstage(s, chunk)), start + 1);
                            in_flight[s] -= 1;
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
