//! Pipeline parity: for each schedule, each form (stage threads, stage processes) and recomputation on
//! and off, a few optimizer steps leave the parameters of the unsplit model trained on the full batch,
//! and the loss curves match. Also the manual split, partitions, and bad settings.
use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::pipe::{self, data, data_rows, layers, BATCH, STEPS};
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::pipeline::schedule::ScheduleKind;
use tch_dist::pipeline::split::SplitModel;
use tch_dist::pipeline::{Partition, Pipeline, PipelineConfig, PipelineRank};
use tch_dist::ProcessGroup;

/// float32 sums in another order (per-microbatch gradients added up): observed ~1e-8.
const TOL: f64 = 1e-6;

/// (schedule, stages, microbatches, chunks, partition sizes over p*v parts)
fn settings() -> Vec<Setting> {
    vec![
        (ScheduleKind::GPipe, 2, 4, 1, vec![4, 4]),
        (ScheduleKind::OneFOneB, 2, 4, 1, vec![3, 5]),
        (ScheduleKind::OneFOneB, 3, 4, 1, vec![3, 3, 2]),
        (ScheduleKind::GPipe, 4, 2, 1, vec![2, 2, 2, 2]),
        (ScheduleKind::Interleaved1F1B, 2, 4, 2, vec![2, 2, 2, 2]),
    ]
}

fn train_threads(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
    sizes: &[usize],
    recompute: bool,
) -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let l = layers();
    let part = Partition::sizes(sizes, l.len()).unwrap();
    let mut pipe = Pipeline::new(
        &l,
        &part,
        &vec![Device::Cpu; p],
        PipelineConfig { schedule: kind, microbatches: m, chunks: v, recompute, ..Default::default() },
    )
    .unwrap();
    let mut opts: Vec<_> = pipe.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, pipe::LR).unwrap()).collect();
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let (x, y) = data(s);
        let r = pipe.step(&x, &y, &pipe::loss).unwrap();
        assert_eq!(r.spans.len(), 2 * m * v * p);
        losses.push(r.loss);
        opts.iter_mut().for_each(|o| o.step());
        pipe.zero_grad().unwrap();
        let kept =
            pipe.var_stores().iter().flat_map(|vs| vs.trainable_variables()).filter(|v| v.grad().defined()).count();
        assert_eq!(kept, 0, "zero_grad drops the gradients (set_to_none)");
    }
    (losses, pipe::named(&pipe.var_stores()))
}

#[test]
fn threads_match_the_unsplit_model_for_every_schedule() {
    let (ref_losses, ref_params) = pipe::reference();
    for (kind, p, m, v, sizes) in settings() {
        for recompute in [false, true] {
            let (losses, params) = train_threads(kind, p, m, v, &sizes, recompute);
            let d = pipe::max_diff(&params, &ref_params);
            assert!(d < TOL, "{kind:?} p={p} m={m} v={v} recompute={recompute}: params differ by {d:e}");
            for (a, b) in losses.iter().zip(&ref_losses) {
                assert!((a - b).abs() < TOL, "{kind:?} recompute={recompute}: losses {losses:?} vs {ref_losses:?}");
            }
        }
    }
}

#[test]
#[ignore = "stage process spawned by processes_match_the_unsplit_model"]
fn worker_pipeline_stage() {
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let kind: ScheduleKind = std::env::var("PIPE_SCHEDULE").unwrap().parse().unwrap();
    let m: usize = std::env::var("PIPE_M").unwrap().parse().unwrap();
    let v: usize = std::env::var("PIPE_V").unwrap().parse().unwrap();
    let recompute = std::env::var("PIPE_RECOMPUTE").unwrap() == "1";
    let sizes: Vec<usize> = std::env::var("PIPE_SIZES").unwrap().split(',').map(|s| s.parse().unwrap()).collect();
    let l = layers();
    let part = Partition::sizes(&sizes, l.len()).unwrap();
    let mut stage = PipelineRank::build(
        pg.clone(),
        &l,
        &part,
        PipelineConfig { schedule: kind, microbatches: m, chunks: v, recompute, ..Default::default() },
    )
    .unwrap();
    let mut opts: Vec<_> =
        stage.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, pipe::LR).unwrap()).collect();
    let rows =
        std::env::var("PIPE_ROWS").map_or(vec![BATCH; STEPS], |r| r.split(',').map(|x| x.parse().unwrap()).collect());
    for (s, &n) in rows.iter().enumerate() {
        let (x, y) = data_rows(s, n);
        let r = stage.step(&x, &y, &pipe::loss).unwrap();
        if let Some(l) = r.loss {
            println!("loss {s} {:.12}", l.double_value(&[]));
        }
        opts.iter_mut().for_each(|o| o.step());
        stage.zero_grad().unwrap();
    }
    for (name, t) in pipe::named(&stage.var_stores()) {
        let v = Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).unwrap();
        println!("param {name} {}", v.iter().map(|x| format!("{x:.12e}")).collect::<Vec<_>>().join(" "));
    }
    pg.barrier().unwrap();
}

#[test]
fn processes_match_the_unsplit_model() {
    let reference = pipe::reference();
    for setting in settings() {
        for recompute in [false, true] {
            check_processes(&setting, recompute, None, &reference);
        }
    }
}

/// Batches that shrink and grow between steps: receives are posted ahead for the shapes of the step
/// before, so a changed shape goes through the transport's placeholder path, both ways (activations
/// and gradients), and training still equals the unsplit model on the same batches.
#[test]
fn processes_carry_shapes_that_change_between_steps() {
    let rows = [BATCH, BATCH / 2, BATCH];
    let reference = pipe::reference_rows(&rows);
    for setting in [(ScheduleKind::OneFOneB, 2, 2, 1, vec![3, 5]), (ScheduleKind::GPipe, 2, 2, 1, vec![4, 4])] {
        check_processes(&setting, false, Some(&rows), &reference);
    }
}

/// (schedule, stages, microbatches, chunks, partition sizes), as `settings` gives them.
type Setting = (ScheduleKind, usize, usize, usize, Vec<usize>);

/// Stage processes train `setting` on batches of `rows[s]` rows (8 each by default) and must end as the
/// unsplit model did (`reference`: its losses and parameters).
fn check_processes(
    setting: &Setting,
    recompute: bool,
    rows: Option<&[i64]>,
    reference: &(Vec<f64>, BTreeMap<String, Tensor>),
) {
    let (kind, p, m, v, sizes) = setting;
    let (ref_losses, ref_params) = reference;
    let sizes_s = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    let env = [
        ("PIPE_SCHEDULE", format!("{kind:?}").replace("OneFOneB", "1f1b").replace("Interleaved1F1B", "interleaved")),
        ("PIPE_M", m.to_string()),
        ("PIPE_V", v.to_string()),
        ("PIPE_RECOMPUTE", (recompute as u8).to_string()),
        ("PIPE_SIZES", sizes_s),
        ("TCH_DIST_TIMEOUT_SECS", "60".to_string()),
        ("PIPE_ROWS", rows.unwrap_or(&[BATCH; STEPS]).iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",")),
    ];
    let outs = common::run_ranks_ok(&common::test_name!("worker_pipeline_stage"), *p, &env, Duration::from_secs(120));
    let mut params = BTreeMap::new();
    let mut losses = Vec::new();
    for o in &outs {
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            // libtest prints "test pipeline::worker_pipeline_stage ... " without a newline before our output
            let line = ["param ", "loss "].iter().filter_map(|k| line.find(k)).min().map_or("", |i| &line[i..]);
            let mut it = line.split_whitespace();
            match it.next() {
                Some("param") => {
                    let name = it.next().unwrap().to_string();
                    let vals: Vec<f64> = it.map(|x| x.parse().unwrap()).collect();
                    params.insert(name, Tensor::from_slice(&vals));
                }
                Some("loss") => losses.push(it.nth(1).unwrap().parse::<f64>().unwrap()),
                _ => {}
            }
        }
    }
    let reference: BTreeMap<String, Tensor> =
        ref_params.iter().map(|(k, t)| (k.clone(), t.to_kind(Kind::Double).flatten(0, -1))).collect();
    let d = pipe::max_diff(&params, &reference);
    assert!(d < TOL, "{kind:?} p={p} m={m} v={v} recompute={recompute}: params differ by {d:e}");
    assert_eq!(losses.len(), ref_losses.len());
    for (a, b) in losses.iter().zip(ref_losses) {
        assert!((a - b).abs() < TOL, "{kind:?}: losses {losses:?} vs {ref_losses:?}");
    }
}

#[test]
fn split_model_forward_and_gradients_equal_the_unsplit_model() {
    let l = layers();
    let whole = l.build_stage(0..l.len(), Device::Cpu).unwrap();
    let split = SplitModel::new(&l, &Partition::cuts(&[4], l.len()).unwrap(), &[Device::Cpu, Device::Cpu]).unwrap();
    let (x, y) = data(0);
    let (a, b) = (whole.forward(&x), split.forward(&x));
    assert_eq!((&a - &b).abs().max().double_value(&[]), 0.0);
    pipe::loss(&a, &y).backward();
    pipe::loss(&b, &y).backward();
    let grads = |stores: &[&nn::VarStore]| -> BTreeMap<String, Tensor> {
        stores.iter().flat_map(|vs| vs.variables().into_iter().map(|(n, t)| (n, t.grad().copy()))).collect()
    };
    let (ga, gb) = (grads(&[&whole.vs]), grads(&split.var_stores()));
    assert_eq!(ga.len(), 10);
    assert_eq!(pipe::max_diff(&ga, &gb), 0.0);
}

#[test]
fn partitions_by_hand_and_balanced() {
    assert_eq!(Partition::cuts(&[3], 5).unwrap().sizes, vec![3, 2]);
    assert_eq!(Partition::sizes(&[3, 2], 5).unwrap().ranges(), vec![0..3, 3..5]);
    assert!(Partition::sizes(&[3, 3], 5).unwrap_err().to_string().contains("covers 6 layers, the model has 5"));
    assert!(Partition::cuts(&[3, 2], 5).unwrap_err().to_string().contains("increase strictly"));
    assert!(Partition::balanced(&[1.0; 3], 4).unwrap_err().to_string().contains("cannot cut 3 layers into 4"));
    // the heavy layer gets a stage alone
    assert_eq!(Partition::balanced(&[1.0, 1.0, 10.0, 1.0, 1.0], 3).unwrap().sizes, vec![2, 1, 2]);
    // by parameter bytes of the real list: l1 (16x16) and l2 (16x12) are the heavy ones
    let l = layers();
    let bytes: Vec<f64> = l.param_bytes().unwrap().into_iter().map(|b| b as f64).collect();
    assert_eq!(bytes[1], 0.0, "activations have no parameters");
    let p = Partition::balanced(&bytes, 2).unwrap();
    let cost = |r: std::ops::Range<usize>| bytes[r].iter().sum::<f64>();
    let r = p.ranges();
    let total: f64 = bytes.iter().sum();
    assert!(cost(r[0].clone()).max(cost(r[1].clone())) <= 0.65 * total, "{p:?} {bytes:?}");
    // by profiled time
    let times = l.profile_times(&data(0).0, 3).unwrap();
    assert_eq!(times.len(), l.len());
    assert!(times.iter().all(|&t| t > 0.0));
    assert_eq!(Partition::balanced(&times, 3).unwrap().stages(), 3);
}

#[test]
fn bad_settings_give_clear_errors() {
    let l = layers();
    let part = Partition::sizes(&[4, 4], l.len()).unwrap();
    // a partition of fewer layers than the list would drop the rest: refused in either runtime, on every
    // rank alike (before any transfer)
    let short = Partition::sizes(&[3, 4], l.len() - 1).unwrap();
    let e = Pipeline::new(&l, &short, &[Device::Cpu; 2], PipelineConfig::default()).err().unwrap().to_string();
    assert!(e.contains("the partition covers 7 layers, the layer list has 8"), "{e}");
    let outs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let short = Partition::sizes(&[3, 4], 7).unwrap();
        PipelineRank::build(Arc::new(pg), &layers(), &short, PipelineConfig::default()).err().unwrap().to_string()
    });
    for e in outs {
        assert!(e.contains("PipelineRank::build") && e.contains("covers 7 layers, the layer list has 8"), "{e}");
    }
    let e = Pipeline::new(
        &l,
        &part,
        &[Device::Cpu; 2],
        PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 1, chunks: 1, ..Default::default() },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("1 < 2"), "{e}");
    let e = Pipeline::new(
        &l,
        &part,
        &[Device::Cpu; 2],
        PipelineConfig { schedule: ScheduleKind::Interleaved1F1B, microbatches: 4, chunks: 2, ..Default::default() },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("2 parts for 2 stages x 2 chunks (need 4)"), "{e}");
    let mut pipe = Pipeline::new(
        &l,
        &part,
        &[Device::Cpu; 2],
        PipelineConfig { schedule: ScheduleKind::GPipe, microbatches: 3, chunks: 1, ..Default::default() },
    )
    .unwrap();
    let (x, y) = data(0);
    let e = pipe.step(&x, &y, &pipe::loss).unwrap_err().to_string();
    assert!(e.contains("batch of 8 does not split into 3 equal microbatches"), "{e}");
    // a failing stage stops the others instead of leaving them waiting
    let mut pipe = Pipeline::new(
        &l,
        &part,
        &[Device::Cpu; 2],
        PipelineConfig { schedule: ScheduleKind::GPipe, microbatches: 2, chunks: 1, ..Default::default() },
    )
    .unwrap()
    .timeout(Duration::from_secs(20));
    let bad_target = Tensor::zeros([8, 7], (Kind::Float, Device::Cpu));
    let start = std::time::Instant::now();
    let e = pipe.step(&x, &bad_target, &pipe::loss).unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(15));
    assert!(e.contains("pipeline stage 1") && e.contains("must match the size"), "{e}");
}

#[test]
fn trace_is_chrome_json_and_timeline_is_a_png() {
    let l = layers();
    let part = Partition::sizes(&[4, 4], l.len()).unwrap();
    let mut pipe = Pipeline::new(
        &l,
        &part,
        &[Device::Cpu; 2],
        PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 4, chunks: 1, ..Default::default() },
    )
    .unwrap();
    let (x, y) = data(0);
    let r = pipe.step(&x, &y, &pipe::loss).unwrap();
    assert!(r.bubble_fraction > 0.0 && r.bubble_fraction < 1.0);
    let dir = std::env::temp_dir().join(format!("tdx-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, png) = (dir.join("t.json"), dir.join("t.png"));
    tch_dist::pipeline::trace::write_chrome_trace(&json, &r.spans).unwrap();
    tch_dist::pipeline::trace::write_png(&png, &r.spans, 2).unwrap();
    // Parsed by Python's json module: 16 complete events, two rows (tids), forward and backward kinds.
    let check = "import json,sys; t=json.load(open(sys.argv[1]))['traceEvents']; \
                 assert len(t)==16 and {e['tid'] for e in t}=={0,1} and {e['cat'] for e in t}=={'forward','backward'} \
                 and all(e['ph']=='X' and e['dur']>=0 for e in t), t; print('ok')";
    let o = std::process::Command::new(common::python()).args(["-c", check]).arg(&json).output().unwrap();
    assert!(o.status.success(), "{}", common::show(&o));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cause of a parity failure seen once under load: the reference model of one test and the stages
/// of another were built at the same moment on two test threads. Both seed the process's one CPU
/// generator (`manual_seed(seed + i)` per layer) and put it back afterwards, so each thread's draws
/// landed in the other's sequence and one model started from other values. Builds on four threads at
/// once must each give the values a build alone gives.
#[test]
fn stages_built_on_threads_at_once_start_from_the_same_values() {
    let values = |vs: &nn::VarStore| -> Vec<(String, Vec<f32>)> {
        pipe::named(&[vs]).into_iter().map(|(k, t)| (k, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap())).collect()
    };
    let l = layers();
    let alone = Arc::new(values(&l.build_stage(0..l.len(), Device::Cpu).unwrap().vs));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let alone = alone.clone();
            std::thread::spawn(move || {
                for round in 0..100 {
                    let l = layers();
                    let got = values(&l.build_stage(0..l.len(), Device::Cpu).unwrap().vs);
                    if got != *alone {
                        return Err(format!("thread {t}, build {round}: other initial values than a build alone"));
                    }
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
}
