//! When a step's transfers go out. On NCCL a batch of sends and receives runs on the group's one stream,
//! after every batch its rank posted before, so two ranks that post the batches they share in different
//! orders wait on each other for good. Each transfer is given the time its tensor is made in the
//! schedule's simulation (the end of the compute that produces it); a rank posts one batch per such time,
//! holding every transfer of that time it sends or receives, in time order. Every pair of ranks then
//! meets batch by batch in one order, whatever the real durations, and a compute finds each tensor it
//! needs in a batch posted before it (it started no earlier than the tensor was made).
use std::collections::BTreeMap;

use super::schedule::{Action, Costs, Schedule};
use super::transport::{Key, Payload};
use crate::error::{Error, Result};

/// One thing a rank does in a step, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Compute(Action),
    /// The batch of one time: what this rank sends (made by the compute just before) and receives.
    Exchange {
        sends: Vec<(usize, Key)>,
        recvs: Vec<(usize, Key)>,
    },
}

/// A transfer: from, to, what.
type Transfer = (usize, usize, Key);

/// Each rank's steps.
pub(crate) fn plan(sch: &Schedule) -> Result<Vec<Vec<Step>>> {
    let (p, v) = (sch.stages, sch.chunks);
    let last = p * v - 1;
    // every compute lasts one time unit but an unsplit backward two: any durations give an order that
    // every rank can follow; these keep the batches near the schedule's own timing
    let costs = Costs { forward: 1, input_grad: 1, weight_grad: 1 };
    let cost = |a: Action| match a {
        Action::Backward { .. } if !sch.splits_backward() => 2,
        _ => 1,
    };
    let sim = sch.simulate_with(costs)?;
    let mut events: BTreeMap<usize, Vec<Transfer>> = BTreeMap::new();
    let mut computes: Vec<Vec<(usize, Action)>> = vec![Vec::new(); p];
    for &(s, a, start) in &sim.timeline {
        computes[s].push((start, a));
        let end = start + cost(a);
        let out = match a {
            Action::Forward { mb, chunk } if chunk * p + s < last => {
                Some(((s + 1) % p, (Payload::Activation, mb, chunk * p + s + 1)))
            }
            Action::Backward { mb, chunk } if chunk * p + s > 0 => {
                Some(((s + p - 1) % p, (Payload::Grad, mb, chunk * p + s - 1)))
            }
            _ => None,
        };
        if let Some((to, key)) = out {
            events.entry(end).or_default().push((s, to, key));
        }
    }
    let mut plans = Vec::with_capacity(p);
    for (s, mine) in computes.into_iter().enumerate() {
        // (time, 0) for a batch, (start, 1) for a compute: a batch goes after the computes that end by
        // its time, before those that start at it
        let mut items: Vec<((usize, usize), Step)> =
            mine.into_iter().map(|(start, a)| ((start, 1), Step::Compute(a))).collect();
        for (&t, transfers) in &events {
            let sends: Vec<_> = transfers.iter().filter(|x| x.0 == s && x.1 != s).map(|x| (x.1, x.2)).collect();
            let recvs: Vec<_> = transfers.iter().filter(|x| x.1 == s && x.0 != s).map(|x| (x.0, x.2)).collect();
            if !sends.is_empty() || !recvs.is_empty() {
                items.push(((t, 0), Step::Exchange { sends, recvs }));
            }
        }
        items.sort_by_key(|(k, _)| *k);
        let steps: Vec<Step> = items.into_iter().map(|(_, st)| st).collect();
        let order: Vec<Action> = steps
            .iter()
            .filter_map(|st| match st {
                Step::Compute(a) => Some(*a),
                _ => None,
            })
            .collect();
        let want: Vec<Action> = sch.actions[s]
            .iter()
            .copied()
            .filter(|a| matches!(a, Action::Forward { .. } | Action::Backward { .. } | Action::BackwardWeight { .. }))
            .collect();
        if order != want {
            return Err(Error::invalid(
                format!("{:?} schedule, stage {s}", sch.kind),
                "its simulation runs the computes in another order than its action list",
            ));
        }
        plans.push(steps);
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::ScheduleKind;

    /// Runs the plans as NCCL would: each rank's batches in its order, a batch done once every rank it
    /// shares it with reached it; a compute waits for the batch that brought what it needs.
    fn run_like_nccl(plans: &[Vec<Step>], v: usize) -> std::result::Result<(), String> {
        let p = plans.len();
        let mut pos = vec![0usize; p];
        // the batches of each rank, in order, and how far each rank's stream got
        let batches: Vec<Vec<&Step>> =
            plans.iter().map(|pl| pl.iter().filter(|s| matches!(s, Step::Exchange { .. })).collect()).collect();
        let mut posted = vec![0usize; p];
        let mut streamed = vec![0usize; p];
        let mut arrived: Vec<std::collections::HashSet<Key>> = vec![Default::default(); p];
        let mut done: std::collections::HashSet<(usize, usize, Key)> = Default::default();
        loop {
            let mut moved = false;
            // hosts: post batches, run computes whose inputs arrived
            for r in 0..p {
                while pos[r] < plans[r].len() {
                    match &plans[r][pos[r]] {
                        Step::Exchange { .. } => posted[r] += 1,
                        Step::Compute(a) => {
                            let need = match *a {
                                Action::Forward { mb, chunk } if chunk * p + r > 0 => {
                                    Some((Payload::Activation, mb, chunk * p + r))
                                }
                                Action::Backward { mb, chunk } if chunk * p + r < p * v - 1 => {
                                    Some((Payload::Grad, mb, chunk * p + r))
                                }
                                _ => None,
                            };
                            if need.is_some_and(|k| !arrived[r].contains(&k)) {
                                break;
                            }
                        }
                    }
                    pos[r] += 1;
                    moved = true;
                }
            }
            // streams: a batch at the head of its rank's stream runs until all its transfers are done; a
            // transfer is done once the batches holding it on both sides are at their heads together
            let head = |r: usize| (streamed[r] < posted[r]).then(|| batches[r][streamed[r]]);
            let mut newly = Vec::new();
            for r in 0..p {
                let Some(Step::Exchange { sends, .. }) = head(r) else { continue };
                for &(to, k) in sends {
                    if let Some(Step::Exchange { recvs, .. }) = head(to) {
                        if recvs.contains(&(r, k)) && !done.contains(&(r, to, k)) {
                            newly.push((r, to, k));
                        }
                    }
                }
            }
            for t in newly {
                done.insert(t);
                arrived[t.1].insert(t.2);
                moved = true;
            }
            let finished: Vec<usize> = (0..p)
                .filter(|&r| match head(r) {
                    Some(Step::Exchange { sends, recvs }) => {
                        sends.iter().all(|&(to, k)| done.contains(&(r, to, k)))
                            && recvs.iter().all(|&(from, k)| done.contains(&(from, r, k)))
                    }
                    _ => false,
                })
                .collect();
            for r in finished {
                streamed[r] += 1;
                moved = true;
            }
            if (0..p).all(|r| pos[r] == plans[r].len() && streamed[r] == batches[r].len()) {
                return Ok(());
            }
            if !moved {
                let heads: Vec<String> = (0..p)
                    .map(|r| {
                        format!(
                            "rank {r}: at {:?}, stream head {:?}",
                            plans[r].get(pos[r]),
                            batches[r].get(streamed[r])
                        )
                    })
                    .collect();
                return Err(format!(
                    "stuck: steps {pos:?}, batches done {streamed:?} of {posted:?}: {}",
                    heads.join("; ")
                ));
            }
        }
    }

    #[test]
    fn every_schedule_runs_to_the_end_under_nccls_ordering() {
        for (kind, p, m, v) in [
            (ScheduleKind::GPipe, 2, 4, 1),
            (ScheduleKind::GPipe, 4, 8, 1),
            (ScheduleKind::OneFOneB, 2, 4, 1),
            (ScheduleKind::OneFOneB, 3, 3, 1),
            (ScheduleKind::OneFOneB, 4, 8, 1),
            (ScheduleKind::Interleaved1F1B, 2, 4, 2),
            (ScheduleKind::Interleaved1F1B, 4, 8, 3),
        ] {
            let sch = Schedule::new(kind, p, m, v).unwrap();
            let plans = plan(&sch).unwrap();
            run_like_nccl(&plans, v).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} v={v}: {e}"));
            // every transfer is sent once and received once
            let sends: usize = plans
                .iter()
                .flatten()
                .map(|s| if let Step::Exchange { sends, .. } = s { sends.len() } else { 0 })
                .sum();
            let recvs: usize = plans
                .iter()
                .flatten()
                .map(|s| if let Step::Exchange { recvs, .. } = s { recvs.len() } else { 0 })
                .sum();
            assert_eq!(sends, recvs);
            assert_eq!(sends, 2 * m * (p * v - 1), "{kind:?}");
        }
    }

    #[test]
    fn a_schedule_posting_sends_before_its_receives_one_by_one_would_not() {
        // the check above can fail: 1F1B with each transfer in a batch of its own, in action order
        let sch = Schedule::new(ScheduleKind::OneFOneB, 3, 3, 1).unwrap();
        let plans: Vec<Vec<Step>> = (0..3)
            .map(|s| {
                sch.actions[s]
                    .iter()
                    .filter_map(|&a| match a {
                        Action::RecvActivation { mb, chunk } => Some(Step::Exchange {
                            sends: vec![],
                            recvs: vec![((s + 2) % 3, (Payload::Activation, mb, chunk * 3 + s))],
                        }),
                        Action::SendActivation { mb, chunk } => Some(Step::Exchange {
                            sends: vec![((s + 1) % 3, (Payload::Activation, mb, chunk * 3 + s + 1))],
                            recvs: vec![],
                        }),
                        Action::RecvGrad { mb, chunk } => Some(Step::Exchange {
                            sends: vec![],
                            recvs: vec![((s + 1) % 3, (Payload::Grad, mb, chunk * 3 + s))],
                        }),
                        Action::SendGrad { mb, chunk } => Some(Step::Exchange {
                            sends: vec![((s + 2) % 3, (Payload::Grad, mb, chunk * 3 + s - 1))],
                            recvs: vec![],
                        }),
                        Action::Forward { .. } | Action::Backward { .. } => Some(Step::Compute(a)),
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        assert!(run_like_nccl(&plans, 1).is_err());
    }
}
