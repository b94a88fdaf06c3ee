//! `data::DistributedSampler` against PyTorch's `torch.utils.data.DistributedSampler`, run by PyTorch on
//! the same arguments: hundreds of (n, world, rank, seed, epoch, drop_last, shuffle) combinations. And
//! the batch iterator.
use crate::common;

use std::io::Write;
use std::process::{Command, Stdio};

use tch::{Device, Kind, Tensor};
use tch_dist::data::{Batches, DistributedSampler, SamplerOptions};

#[test]
fn sampler_indices_equal_pytorchs() {
    let _alone = common::alone();
    let mut combos = Vec::new();
    for n in [0usize, 1, 2, 5, 10, 17, 100, 1001] {
        for world in [1usize, 2, 3, 4, 7] {
            for rank in 0..world {
                for (seed, epoch) in [(0u64, 0u64), (0, 3), (42, 1), (1 << 40, 7)] {
                    for drop_last in [false, true] {
                        for shuffle in [false, true] {
                            combos.push((n, world, rank, seed, epoch, drop_last, shuffle));
                        }
                    }
                }
            }
        }
    }
    let mut child = Command::new(common::python())
        .arg(common::repo_path("tests/py/sampler_ref.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for c in &combos {
            writeln!(stdin, "{} {} {} {} {} {} {}", c.0, c.1, c.2, c.3, c.4, c.5 as u8, c.6 as u8).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", common::show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), combos.len());
    let mut shuffled_nonempty = 0;
    for (c, line) in combos.iter().zip(lines) {
        let theirs: Vec<i64> = line.split_whitespace().map(|s| s.parse().unwrap()).collect();
        let mut s =
            DistributedSampler::new(c.0, c.1, c.2, SamplerOptions { shuffle: c.6, seed: c.3, drop_last: c.5 }).unwrap();
        s.set_epoch(c.4);
        let ours = s.indices().unwrap();
        assert_eq!(ours, theirs, "(n, world, rank, seed, epoch, drop_last, shuffle) = {c:?}");
        assert_eq!(ours.len(), s.len());
        if c.6 && c.0 > 2 {
            shuffled_nonempty += 1;
        }
    }
    assert!(shuffled_nonempty > 500, "{shuffled_nonempty}");
}

#[test]
fn sampler_leaves_the_global_generator_alone_and_refuses_bad_ranks() {
    let _alone = common::alone();
    tch::manual_seed(5);
    let a = Tensor::rand([3], (Kind::Float, Device::Cpu));
    tch::manual_seed(5);
    let _ = DistributedSampler::new(50, 2, 1, SamplerOptions::default()).unwrap().indices().unwrap();
    let b = Tensor::rand([3], (Kind::Float, Device::Cpu));
    assert!(a.equal(&b));
    let e = DistributedSampler::new(10, 2, 2, SamplerOptions::default()).unwrap_err().to_string();
    assert!(e.contains("rank 2 is not in 0..2"), "{e}");
}

#[test]
fn batches_cover_the_indices_in_order() {
    let _alone = common::alone();
    let xs = Tensor::arange(20, (Kind::Float, Device::Cpu)).view([10, 2]);
    let ys = Tensor::arange(10, (Kind::Int64, Device::Cpu));
    let idx = vec![9, 0, 3, 3, 7];
    let got: Vec<(Tensor, Tensor)> = Batches::new(&xs, &ys, idx.clone(), 2).unwrap().collect();
    assert_eq!(got.len(), 3);
    let ys_seen: Vec<i64> = got.iter().flat_map(|(_, y)| Vec::<i64>::try_from(y).unwrap()).collect();
    assert_eq!(ys_seen, idx);
    assert_eq!(Vec::<f32>::try_from(got[0].0.reshape([-1])).unwrap(), [18.0, 19.0, 0.0, 1.0]);
    assert_eq!(Batches::new(&xs, &ys, idx.clone(), 2).unwrap().drop_last().count(), 2);
    let e = Batches::new(&xs, &ys, vec![10], 2).unwrap_err().to_string();
    assert!(e.contains("index 10 is outside the 10 rows"), "{e}");
}
