//! A layout from degrees (`ParallelDims`): every group it hands out holds the ranks the mesh's layout
//! says (itself checked against PyTorch's `init_device_mesh` in tests/tp/mesh.rs), the batch rows split
//! over the data-parallel ranks exactly once, one rank reports, and the loss is averaged where it should be.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{Kind, Tensor};
use tch_dist::mesh::MeshLayout;
use tch_dist::parallel_dims::{ParallelDims, DIMS, REST};
use tch_dist::{ProcessGroup, ReduceOp};

/// The world ranks of `g`, in its rank order (each member adds its world rank at its own place).
fn members(g: &Arc<ProcessGroup>, world: &ProcessGroup) -> Vec<usize> {
    let mut t = Tensor::zeros([g.size() as i64], (Kind::Int64, tch::Device::Cpu));
    let _ = t.get(g.rank() as i64).fill_(world.rank() as i64);
    g.allreduce(&mut t, ReduceOp::Sum).unwrap();
    Vec::<i64>::try_from(t).unwrap().into_iter().map(|r| r as usize).collect()
}

struct Seen {
    rank: usize,
    groups: Vec<(&'static str, Vec<usize>)>,
    rows: std::ops::Range<i64>,
    reporter: bool,
    /// `None` where `average_loss` was refused (a stage before the last, which has no loss).
    loss: Option<f64>,
}

fn check(world_size: usize, dims: ParallelDims) {
    let res = common::run_threads(world_size, Duration::from_secs(60), move |world| {
        let pm = dims.build(&world).unwrap();
        let mut groups = vec![
            ("pp", members(pm.pp_group(), &world)),
            ("tp", members(pm.tp_group(), &world)),
            ("cp", members(pm.cp_group(), &world)),
            ("batch", members(pm.batch_group(), &world)),
            ("loss", members(pm.loss_group(), &world)),
            ("fsdp", members(pm.fsdp_group(), &world)),
            ("replicate", members(pm.replicate_group(), &world)),
        ];
        if let Some(g) = pm.expert_group() {
            groups.push(("ep", members(g, &world)));
        }
        if let Some(g) = pm.expert_replica_group() {
            groups.push(("ep_replicas", members(g, &world)));
        }
        // a float64 scalar in, float32 out, the caller's tensor left as it was
        let mine = Tensor::from(world.rank() as f64);
        let loss = match pm.average_loss(&mine) {
            Ok(l) => Some(l.double_value(&[])),
            Err(e) => {
                assert!(e.to_string().contains("which has no loss"), "{e}");
                None
            }
        };
        assert_eq!(mine.double_value(&[]), world.rank() as f64, "average_loss wrote into the caller's loss");
        assert_eq!(pm.rank(), world.rank());
        Seen { rank: world.rank(), groups, rows: pm.rows(24).unwrap(), reporter: pm.is_reporter(), loss }
    });
    let d = dims.resolve(world_size).unwrap();
    let shape: Vec<(&str, usize)> = DIMS.iter().copied().zip([d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp]).collect();
    let layout = MeshLayout::new(&shape).unwrap();
    let flat = |r, names: &[&str]| layout.flat_group_ranks(r, names).unwrap();
    let mut rows_seen = vec![0; 24];
    for s in &res {
        let r = s.rank;
        let batch = flat(r, &["dp_replicate", "dp_shard"]);
        for (name, got) in &s.groups {
            let want = match *name {
                "batch" => batch.clone(),
                "loss" => flat(r, &["dp_replicate", "dp_shard", "cp"]),
                "fsdp" => flat(r, &["dp_shard", "cp"]),
                "replicate" => flat(r, &["dp_replicate"]),
                "ep" => {
                    let at = batch.iter().position(|&b| b == r).unwrap();
                    batch[at / d.ep * d.ep..at / d.ep * d.ep + d.ep].to_vec()
                }
                "ep_replicas" => {
                    let at = batch.iter().position(|&b| b == r).unwrap();
                    batch.iter().copied().skip(at % d.ep).step_by(d.ep).collect()
                }
                dim => flat(r, &[dim]),
            };
            assert_eq!(got, &want, "{dims:?}: rank {r}'s {name} group");
        }
        assert_eq!(s.groups.iter().any(|(n, _)| *n == "ep"), d.ep > 1, "{dims:?}: rank {r} has an expert group");
        // the batch ranks split the rows; every other rank reads what its batch peers at its place read
        let place = batch.iter().position(|&b| b == r).unwrap() as i64;
        assert_eq!(s.rows, place * 24 / d.dp() as i64..(place + 1) * 24 / d.dp() as i64, "rank {r}'s rows");
        if layout.coordinates(r).unwrap()[0] == 0 && (layout.coordinates(r).unwrap()[3..]).iter().all(|&c| c == 0) {
            s.rows.clone().for_each(|i| rows_seen[i as usize] += 1);
        }
        let group = flat(r, &["dp_replicate", "dp_shard", "cp"]);
        let mean = group.iter().sum::<usize>() as f64 / group.len() as f64;
        let last_stage = layout.coordinates(r).unwrap()[0] + 1 == d.pp;
        match s.loss {
            Some(l) => assert!(last_stage && (l - mean).abs() < 1e-12, "rank {r}'s loss over {group:?}: {l} vs {mean}"),
            None => assert!(!last_stage, "rank {r}, on the last stage, was refused its loss"),
        }
    }
    assert_eq!(rows_seen, vec![1; 24], "{dims:?}: each row of the batch read by one data-parallel rank");
    let reporters: Vec<usize> = res.iter().filter(|s| s.reporter).map(|s| s.rank).collect();
    assert_eq!(reporters.len(), 1, "{dims:?}: one reporting rank, got {reporters:?}");
    let at = layout.coordinates(reporters[0]).unwrap();
    assert!(at[0] == d.pp - 1 && at[1..].iter().all(|&c| c == 0), "{dims:?}: the reporter is on the last stage");
}

#[test]
fn every_group_holds_the_ranks_of_its_purpose_on_8_ranks() {
    check(8, ParallelDims { pp: 2, dp_replicate: 2, dp_shard: REST, ..Default::default() });
    check(8, ParallelDims { dp_replicate: 2, dp_shard: 2, tp: 2, ep: 2, ..Default::default() });
    check(8, ParallelDims { dp_shard: 2, cp: 2, tp: 2, ..Default::default() });
    check(8, ParallelDims { dp_replicate: REST, ep: 4, ..Default::default() });
}

#[test]
fn degrees_that_do_not_fit_the_world_are_refused_on_every_rank() {
    let res = common::run_threads(4, Duration::from_secs(20), |world| {
        ParallelDims { tp: 3, ..Default::default() }.build(&world).err().map(|e| e.to_string())
    });
    for e in res {
        let e = e.expect("refused");
        assert!(e.contains("multiply to 3, not the world size 4"), "{e}");
    }
}

/// The loss averaged on one rank only (the rank that prints) meets the other's next collective: both fail
/// at once, and the error names `average_loss` as where the lone rank was: the strict mode as the lone
/// call, plain Gloo in the call sites.
#[test]
fn average_loss_called_on_one_rank_only_is_named() {
    for strict in [false, true] {
        let opts = tch_dist::GroupOptions { strict_nccl: strict, ..common::gloo_opts(Duration::from_secs(30)) };
        let res = common::run_threads_with(2, opts, |world| {
            let dims = ParallelDims { dp_replicate: 2, ..Default::default() }.build(&world).unwrap();
            let loss = Tensor::from(1.0f32);
            // rank 1 goes on to the data-parallel group's next collective (DDP's, in a training loop)
            let r = if world.rank() == 0 { dims.average_loss(&loss).map(|_| ()) } else { dims.loss_group().barrier() };
            r.err().map(|e| e.to_string())
        });
        for e in res {
            let e = e.expect("refused on both ranks");
            let named = if strict { "ParallelMesh::average_loss alone" } else { "(in \"ParallelMesh::average_loss\")" };
            assert!(e.contains(named), "strict {strict}: {e}");
        }
    }
}
