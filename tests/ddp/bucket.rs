//! Our bucket assignment against libtorch's own `c10d::compute_bucket_assignment_by_size`, on many random
//! layouts of sizes, dtypes, devices and limits.
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind};
use tch_dist::ddp::bucket::{assign, TensorSpec};
use tch_dist::reference::libtorch_bucket_assignment;

const KINDS: [Kind; 4] = [Kind::Float, Kind::Double, Kind::Half, Kind::Int64];

#[test]
fn matches_libtorch_on_random_layouts() {
    let mut rng = StdRng::seed_from_u64(7);
    for case in 0..500 {
        let n = rng.random_range(1..40);
        let kinds_used = rng.random_range(1..=KINDS.len());
        let two_devices = rng.random_bool(0.3);
        let mut numels = Vec::new();
        let mut kinds = Vec::new();
        let mut devs = Vec::new();
        for _ in 0..n {
            // mostly small tensors, some large, some empty
            let numel = match rng.random_range(0..10) {
                0 => 0,
                1..=6 => rng.random_range(1..5_000),
                _ => rng.random_range(5_000..2_000_000),
            };
            numels.push(numel as i64);
            kinds.push(KINDS[rng.random_range(0..kinds_used)]);
            devs.push(if two_devices { rng.random_range(0..2) as u8 } else { 0 });
        }
        let n_limits = rng.random_range(1..4);
        let limits: Vec<u64> = (0..n_limits).map(|_| rng.random_range(1..4_000_000)).collect();
        let theirs = libtorch_bucket_assignment(&numels, &kinds, &devs, &limits).unwrap();
        let specs: Vec<TensorSpec> = (0..n)
            .map(|i| TensorSpec {
                numel: numels[i] as usize,
                kind: kinds[i],
                // the reference builds device 0 as meta and 1 as CPU tensors: only distinctness matters
                device: if devs[i] == 0 { Device::Cpu } else { Device::Cuda(0) },
            })
            .collect();
        let lim: Vec<usize> = limits.iter().map(|&l| l as usize).collect();
        let ours = assign(&specs, &lim, None);
        assert_eq!(ours, theirs, "case {case}: numels {numels:?} kinds {kinds:?} devs {devs:?} limits {limits:?}");
    }
}

#[test]
fn explicit_order_walks_in_that_order_without_sorting() {
    let specs: Vec<TensorSpec> = [300, 300, 300, 300].iter().map(|&n| TensorSpec::cpu(n, Kind::Float)).collect();
    // 1,200 B each; first limit 1 KB closes after one tensor, then 2.4 KB closes after two.
    let b = assign(&specs, &[1000, 2400], Some(&[3, 1, 2, 0]));
    assert_eq!(b, vec![vec![3], vec![1, 2], vec![0]]);
    let b = assign(&specs, &[1000, 2400], None);
    assert_eq!(b, vec![vec![0], vec![1, 2], vec![3]]);
}
