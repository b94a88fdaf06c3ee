//! The schedules, simulated with unit-time forward and backward: no deadlock, every microbatch forwarded
//! and backwarded exactly once per virtual stage, activations in flight within the schedule's bound, and
//! the bubble the formulas predict. Impossible settings are refused with a clear error.
use std::collections::HashMap;

use tch_dist::pipeline::schedule::{Action, Costs, Schedule, ScheduleKind};

fn check(kind: ScheduleKind, p: usize, m: usize, v: usize) {
    let s = Schedule::new(kind, p, m, v).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} v={v}: {e}"));
    let sim = s.simulate().unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} v={v}: {e}"));
    // exactly once each
    for stage in 0..p {
        let mut count: HashMap<(u8, usize, usize), usize> = HashMap::new();
        for a in &s.actions[stage] {
            match *a {
                Action::Forward { mb, chunk } => *count.entry((0, mb, chunk)).or_default() += 1,
                Action::Backward { mb, chunk } => *count.entry((1, mb, chunk)).or_default() += 1,
                Action::BackwardWeight { mb, chunk } => *count.entry((2, mb, chunk)).or_default() += 1,
                _ => {}
            }
        }
        let kinds = if s.splits_backward() { 3 } else { 2 };
        assert_eq!(count.len(), kinds * m * v, "{kind:?} p={p} m={m} v={v} stage {stage}");
        assert!(count.values().all(|&c| c == 1), "{kind:?} p={p} m={m} v={v} stage {stage}: {count:?}");
    }
    // memory bound
    for (stage, &f) in sim.max_in_flight.iter().enumerate() {
        assert!(
            f <= s.in_flight_bound(),
            "{kind:?} p={p} m={m} v={v}: stage {stage} holds {f} > {}",
            s.in_flight_bound()
        );
    }
    if kind == ScheduleKind::OneFOneB {
        assert_eq!(sim.max_in_flight[0], p.min(m), "1F1B's first stage holds p activations");
    }
    if kind == ScheduleKind::GPipe {
        assert_eq!(sim.max_in_flight[0], m);
    }
    // bubble
    let want = s.ideal_bubble_fraction();
    assert!(
        (sim.bubble_fraction - want).abs() < 1e-12,
        "{kind:?} p={p} m={m} v={v}: bubble {} vs formula {want} (makespan {})",
        sim.bubble_fraction,
        sim.makespan
    );
}

#[test]
fn gpipe_for_many_settings() {
    for p in 1..=8 {
        for m in 1..=16 {
            check(ScheduleKind::GPipe, p, m, 1);
        }
    }
}

#[test]
fn one_f_one_b_for_many_settings() {
    for p in 1..=8 {
        for m in p..=20 {
            check(ScheduleKind::OneFOneB, p, m, 1);
        }
    }
}

#[test]
fn interleaved_for_many_settings() {
    for p in 1..=6 {
        for v in 2..=4 {
            for k in 1..=4 {
                check(ScheduleKind::Interleaved1F1B, p, k * p, v);
            }
        }
    }
}

#[test]
fn interleaving_shrinks_the_bubble() {
    let plain = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap().simulate().unwrap();
    let inter = Schedule::new(ScheduleKind::Interleaved1F1B, 4, 8, 2).unwrap().simulate().unwrap();
    assert!(inter.bubble_fraction < plain.bubble_fraction);
}

#[test]
fn zero_bubble_h1_for_many_settings() {
    for p in 1..=8 {
        for m in p..=24 {
            check(ScheduleKind::ZeroBubbleH1, p, m, 1);
        }
    }
}

/// With equal times for F, B and W (an unsplit backward costs B + W), ZB-H1 idles a third of what 1F1B
/// does, and no stage holds more activations than 1F1B's first.
#[test]
fn zero_bubble_h1_has_a_third_of_the_1f1b_bubble_in_its_memory() {
    let costs = Costs { forward: 1, input_grad: 1, weight_grad: 1 };
    for p in 2..=8 {
        for m in p..=24 {
            let zb = Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1).unwrap().simulate_with(costs).unwrap();
            let base = Schedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap().simulate_with(costs).unwrap();
            let (idle_zb, idle_base) = (zb.makespan - 3 * m, base.makespan - 3 * m);
            assert_eq!(3 * idle_zb, idle_base, "p={p} m={m}: idle {idle_zb} vs 1F1B's {idle_base}");
            let most = |v: &[usize]| v.iter().copied().max().unwrap_or(0);
            assert!(most(&zb.max_in_flight) <= most(&base.max_in_flight), "p={p} m={m}: {:?}", zb.max_in_flight);
        }
    }
}

#[test]
fn impossible_settings_are_refused() {
    let e = |k, p, m, v| Schedule::new(k, p, m, v).unwrap_err().to_string();
    assert!(e(ScheduleKind::OneFOneB, 4, 2, 1).contains("at least as many microbatches as stages (2 < 4)"));
    assert!(e(ScheduleKind::Interleaved1F1B, 4, 6, 2).contains("divisible by stages (6 % 4 != 0)"));
    assert!(e(ScheduleKind::Interleaved1F1B, 4, 8, 1).contains("at least 2 chunks"));
    assert!(e(ScheduleKind::GPipe, 2, 4, 2).contains("only the interleaved schedule"));
    assert!(e(ScheduleKind::GPipe, 0, 4, 1).contains("at least 1"));
    assert!("zigzag".parse::<ScheduleKind>().unwrap_err().to_string().contains("unknown schedule"));
}

#[test]
fn a_schedule_that_deadlocks_is_caught() {
    // Stage 1 wants microbatch 1's activation before microbatch 0's backward can flow: fine. But a stage 0
    // that waits for a gradient before sending any activation can never proceed.
    let mut s = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
    s.actions[0].retain(|a| !matches!(a, Action::Forward { .. } | Action::SendActivation { .. }));
    s.actions[0].push(Action::Forward { mb: 0, chunk: 0 });
    let e = s.simulate().unwrap_err().to_string();
    assert!(e.contains("deadlock") && e.contains("stage 0 waits at RecvGrad"), "{e}");
}

#[test]
fn the_runtime_refuses_zero_bubble_schedules_by_name() {
    let layers = tch_dist::pipeline::LayerList::new()
        .add("a", |p| tch::nn::linear(p, 2, 2, Default::default()))
        .add("b", |p| tch::nn::linear(p, 2, 2, Default::default()));
    let part = tch_dist::pipeline::Partition::sizes(&[1, 1], 2).unwrap();
    let cpu = [tch::Device::Cpu, tch::Device::Cpu];
    let Err(e) = tch_dist::pipeline::Pipeline::new(
        &layers,
        &part,
        &cpu,
        tch_dist::pipeline::PipelineConfig {
            schedule: ScheduleKind::ZeroBubbleH1,
            microbatches: 4,
            chunks: 1,
            ..Default::default()
        },
    ) else {
        panic!("ZB-H1 accepted by the runtime")
    };
    let e = e.to_string();
    assert!(e.contains("ZeroBubbleH1 is schedule data for simulation"), "{e}");
}
