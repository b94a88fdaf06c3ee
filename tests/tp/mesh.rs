//! Device meshes: the layout (rank ↔ coordinates, each dimension's groups) equals PyTorch's
//! `init_device_mesh` for the same shapes (PyTorch asked here); real groups on 8 ranks reduce along each
//! dimension among exactly those ranks; bad meshes are refused by name.
use crate::common;

use std::process::Command;
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use tch_dist::mesh::{DeviceMesh, MeshLayout};
use tch_dist::ReduceOp;

const T: Duration = Duration::from_secs(60);

fn parse(spec: &str) -> Vec<(String, usize)> {
    spec.split(',')
        .map(|d| {
            let (n, s) = d.split_once('=').unwrap();
            (n.to_string(), s.parse().unwrap())
        })
        .collect()
}

#[test]
fn layouts_equal_pytorchs_init_device_mesh() {
    let specs = ["dp=4", "dp=2,tp=4", "dp=3,tp=2", "pp=2,dp=2,tp=2", "pp=2,dp=3,tp=2"];
    let o = Command::new(common::python()).arg(common::repo_path("tests/py/mesh_ref.py")).args(specs).output().unwrap();
    assert!(o.status.success(), "{}", common::show(&o));
    let mut seen = 0;
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let dims = parse(v["shape"].as_str().unwrap());
        let dims: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        let layout = MeshLayout::new(&dims).unwrap();
        let rank = v["rank"].as_u64().unwrap() as usize;
        let coords: Vec<usize> = v["coords"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap() as usize).collect();
        assert_eq!(layout.coordinates(rank).unwrap(), coords, "{dims:?}: rank {rank}'s coordinates");
        assert_eq!(layout.rank(&coords).unwrap(), rank);
        for (name, _) in &dims {
            let want: Vec<usize> =
                v["groups"][name].as_array().unwrap().iter().map(|c| c.as_u64().unwrap() as usize).collect();
            assert_eq!(layout.group_ranks(rank, name).unwrap(), want, "{dims:?}: rank {rank}'s {name} group");
        }
        seen += 1;
    }
    assert_eq!(seen, 4 + 8 + 6 + 8 + 12, "one line per rank of every mesh");
}

#[test]
fn each_dimensions_group_reduces_among_its_ranks_on_8_ranks() {
    let res = common::run_threads(8, T, |world| {
        let mesh = DeviceMesh::new(&world, &[("pp", 2), ("dp", 2), ("tp", 2)]).unwrap();
        let mut out = Vec::new();
        for (i, name) in ["pp", "dp", "tp"].into_iter().enumerate() {
            let g = mesh.group(name).unwrap();
            assert_eq!(g.size(), 2);
            assert_eq!(g.rank(), mesh.coordinate(name).unwrap(), "the group's rank is the coordinate");
            assert_eq!(mesh.coordinates()[i], mesh.coordinate(name).unwrap());
            // the sum of the world ranks in this rank's group
            let mut t = Tensor::from_slice(&[world.rank() as i64]).to_kind(Kind::Int64).to_device(Device::Cpu);
            g.allreduce(&mut t, ReduceOp::Sum).unwrap();
            out.push(t.int64_value(&[0]) as usize);
        }
        (world.rank(), out)
    });
    let layout = MeshLayout::new(&[("pp", 2), ("dp", 2), ("tp", 2)]).unwrap();
    for (rank, sums) in res {
        for (name, got) in ["pp", "dp", "tp"].into_iter().zip(sums) {
            let want: usize = layout.group_ranks(rank, name).unwrap().iter().sum();
            assert_eq!(got, want, "rank {rank}'s {name} group");
        }
    }
}

/// A newcomer builds a warm-up model's mesh and then the real one: two formations of the same groups.
/// Each must be a group of its own (before, the second read the first's rendezvous keys and hung until
/// the timeout). Both meshes and two flattenings of the same dimensions reduce, interleaved.
#[test]
fn the_same_mesh_built_twice_gives_two_working_meshes() {
    let dims = [("dp", 2), ("tp", 2)];
    let started = std::time::Instant::now();
    let res = common::run_threads(4, Duration::from_secs(20), move |world| {
        let first = DeviceMesh::new(&world, &dims).unwrap();
        let second = DeviceMesh::new(&world, &dims).unwrap();
        let flat_a = first.flatten(&world, &["dp", "tp"]).unwrap();
        let flat_b = first.flatten(&world, &["dp", "tp"]).unwrap();
        let mut out = Vec::new();
        for round in 0..3i64 {
            for (k, g) in [second.group("tp"), first.group("tp"), first.group("dp"), second.group("dp")]
                .into_iter()
                .map(|g| g.unwrap())
                .chain([flat_b.clone(), flat_a.clone()])
                .enumerate()
            {
                let mut t = Tensor::from_slice(&[world.rank() as i64 * 10 + round + k as i64]);
                g.allreduce(&mut t, ReduceOp::Sum).unwrap();
                out.push(t.int64_value(&[0]));
            }
        }
        (world.rank(), out)
    });
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    let layout = MeshLayout::new(&dims).unwrap();
    for (rank, sums) in res {
        let mut it = sums.into_iter();
        for round in 0..3i64 {
            for (k, ranks) in [
                layout.group_ranks(rank, "tp").unwrap(),
                layout.group_ranks(rank, "tp").unwrap(),
                layout.group_ranks(rank, "dp").unwrap(),
                layout.group_ranks(rank, "dp").unwrap(),
                (0..4).collect(),
                (0..4).collect(),
            ]
            .into_iter()
            .enumerate()
            {
                let want: i64 = ranks.iter().map(|&r| r as i64 * 10 + round + k as i64).sum();
                assert_eq!(it.next(), Some(want), "rank {rank}, round {round}, group {k} ({ranks:?})");
            }
        }
    }
}

#[test]
fn bad_meshes_are_refused_by_name() {
    let e = |dims: &[(&str, usize)]| MeshLayout::new(dims).unwrap_err().to_string();
    assert!(e(&[("dp", 2), ("dp", 2)]).contains("\"dp\""));
    assert!(e(&[("tp", 0)]).contains("\"tp\" has size 0"));
    let l = MeshLayout::new(&[("dp", 2), ("tp", 2)]).unwrap();
    assert!(l.group_ranks(0, "pp").unwrap_err().to_string().contains("no dimension \"pp\""));
    assert!(l.coordinates(4).unwrap_err().to_string().contains("rank 4"));
    // the world does not match the shape; ranks disagree on the shape
    let errs = common::run_threads(2, T, |world| {
        let wrong = DeviceMesh::new(&world, &[("dp", 2), ("tp", 2)]).err().map(|e| e.to_string());
        let dims: &[(&str, usize)] = if world.rank() == 0 { &[("dp", 2)] } else { &[("dp", 1), ("tp", 2)] };
        let differ = DeviceMesh::new(&world, dims).err().map(|e| e.to_string());
        (wrong, differ)
    });
    for (wrong, differ) in errs {
        let wrong = wrong.expect("a 4-rank mesh on 2 ranks");
        assert!(wrong.contains("holds 4 ranks, the group 2"), "{wrong}");
        let differ = differ.expect("ranks with different meshes");
        assert!(differ.contains("ranks build different meshes") && differ.contains("rank 1"), "{differ}");
    }
}
