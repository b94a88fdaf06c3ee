//! The collective scenario shared by the thread, process and Python-interop tests: every collective, each
//! result checked element by element against its closed form. tests/py/interop_rank.py is its PyTorch twin.
use tch::{Device, Kind, Tensor};
use tch_dist::{P2pOp, ProcessGroup, ReduceOp};

pub fn f32s(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).expect("to vec")
}

pub fn filled(v: f64, n: i64) -> Tensor {
    Tensor::full([n], v, (Kind::Float, Device::Cpu))
}

/// Runs every collective and checks each element against the closed-form answer.
pub fn scenario(pg: &ProcessGroup) {
    let (r, w) = (pg.rank(), pg.size());
    let rf = r as f64;
    let sum_r1: f64 = (1..=w).map(|x| x as f64).sum(); // sum of (rank + 1)

    // allreduce: sum, avg, min, max, product, and an integer dtype
    let base = Tensor::arange_start(1, 6, (Kind::Float, Device::Cpu));
    let mut t = &base * (rf + 1.0);
    pg.allreduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(f32s(&t), (1..6).map(|i| (i as f64 * sum_r1) as f32).collect::<Vec<_>>(), "sum");

    let mut t = &base * (rf + 1.0);
    pg.allreduce(&mut t, ReduceOp::Avg).unwrap();
    let want: Vec<f32> = (1..6).map(|i| (i as f64 * sum_r1 / w as f64) as f32).collect();
    for (a, b) in f32s(&t).iter().zip(&want) {
        assert!((a - b).abs() < 1e-5, "avg: {a} vs {b}");
    }

    let mut t = Tensor::from_slice(&[rf as f32, -(rf as f32)]);
    pg.allreduce(&mut t, ReduceOp::Max).unwrap();
    assert_eq!(f32s(&t), vec![(w - 1) as f32, 0.0], "max");
    let mut t = Tensor::from_slice(&[rf as f32, -(rf as f32)]);
    pg.allreduce(&mut t, ReduceOp::Min).unwrap();
    assert_eq!(f32s(&t), vec![0.0, -((w - 1) as f32)], "min");

    let mut t = Tensor::from_slice(&[rf as f32 + 1.0, 2.0]);
    pg.allreduce(&mut t, ReduceOp::Product).unwrap();
    let fact: f32 = (1..=w).map(|x| x as f32).product();
    assert_eq!(f32s(&t), vec![fact, 2f32.powi(w as i32)], "product");

    let mut t = Tensor::from_slice(&[r as i64 * 1_000_000_007, 1]);
    pg.allreduce(&mut t, ReduceOp::Sum).unwrap();
    let want_i: i64 = (0..w as i64).map(|q| q * 1_000_000_007).sum();
    assert_eq!(Vec::<i64>::try_from(&t).unwrap(), vec![want_i, w as i64], "int64 sum");

    // broadcast from the last rank, 2-D
    let root = w - 1;
    let mut t = Tensor::full([3, 4], rf, (Kind::Double, Device::Cpu));
    pg.broadcast(&mut t, root).unwrap();
    assert!(f32s(&t).iter().all(|&x| x == root as f32), "broadcast");

    // all_gather
    let input = Tensor::from_slice(&[rf as f32 * 10.0, rf as f32 * 10.0 + 1.0, rf as f32 * 10.0 + 2.0]);
    let mut outs: Vec<Tensor> = (0..w).map(|_| Tensor::zeros([3], (Kind::Float, Device::Cpu))).collect();
    pg.all_gather(&mut outs, &input).unwrap();
    for (k, o) in outs.iter().enumerate() {
        let k = k as f32;
        assert_eq!(f32s(o), vec![k * 10.0, k * 10.0 + 1.0, k * 10.0 + 2.0], "all_gather slot {k}");
    }

    // reduce_scatter: inputs[k] on rank q holds q + 100k; rank r gets sum_q (q + 100 r)
    let inputs: Vec<Tensor> = (0..w).map(|k| filled(rf + 100.0 * k as f64, 4)).collect();
    let mut out = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    pg.reduce_scatter(&mut out, &inputs, ReduceOp::Sum).unwrap();
    let want = (0..w).map(|q| q as f32).sum::<f32>() + 100.0 * rf as f32 * w as f32;
    assert_eq!(f32s(&out), vec![want; 4], "reduce_scatter");

    // send/recv around a ring, in one batch: posted one by one, NCCL would deadlock (the strict mode says so)
    let next = (r + 1) % w;
    let prev = (r + w - 1) % w;
    let msg = Tensor::from_slice(&[rf as f32, 7.0]);
    let got = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    pg.batch_isend_irecv(vec![P2pOp::send(&msg, next).tag(3), P2pOp::recv(&got, prev).tag(3)])
        .and_then(|w| w.wait())
        .unwrap();
    assert_eq!(f32s(&got), vec![prev as f32, 7.0], "recv from rank {prev}");

    // plain send and recv between pairs (0, 1), (2, 3), ...: the even rank sends first, the odd one
    // receives first, an order NCCL can run
    let partner = r ^ 1;
    if partner < w {
        let mut got = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        if r % 2 == 0 {
            pg.send(&msg, partner, 4).unwrap();
            pg.recv(&mut got, partner, 4).unwrap();
        } else {
            pg.recv(&mut got, partner, 4).unwrap();
            pg.send(&msg, partner, 4).unwrap();
        }
        assert_eq!(f32s(&got), vec![partner as f32, 7.0], "recv from rank {partner}");
    }

    // two outstanding async works, waited in reverse order: both complete with correct results
    let mut a = filled(rf + 1.0, 1 << 16);
    let mut b = filled(2.0 * (rf + 1.0), 1 << 10);
    let wa = pg.allreduce_async(&mut a, ReduceOp::Sum).unwrap();
    let wb = pg.allreduce_async(&mut b, ReduceOp::Sum).unwrap();
    wb.wait().unwrap();
    wa.wait().unwrap();
    assert!(f32s(&a).iter().all(|&x| x == sum_r1 as f32), "first async");
    assert!(f32s(&b).iter().all(|&x| x == 2.0 * sum_r1 as f32), "second async");

    // all_to_all_single, uneven: rank r sends rank s (r + s + 1) rows of 2, each 1000 r + 10 s + row
    let rows = |n: usize, base: usize| {
        (Tensor::arange(n as i64, (Kind::Float, Device::Cpu)) + base as f64).unsqueeze(1).repeat([1, 2])
    };
    let in_splits: Vec<usize> = (0..w).map(|s| r + s + 1).collect();
    let out_splits: Vec<usize> = (0..w).map(|q| q + r + 1).collect();
    let input = Tensor::cat(&(0..w).map(|s| rows(r + s + 1, 1000 * r + 10 * s)).collect::<Vec<_>>(), 0);
    let mut output = Tensor::zeros([out_splits.iter().sum::<usize>() as i64, 2], (Kind::Float, Device::Cpu));
    pg.all_to_all_single(&mut output, &input, &out_splits, &in_splits).unwrap();
    let want: Vec<f32> =
        (0..w).flat_map(|q| (0..q + r + 1).flat_map(move |j| [(1000 * q + 10 * r + j) as f32; 2])).collect();
    assert_eq!(f32s(&output), want, "all_to_all_single with uneven splits");

    // all_to_all_single in equal chunks: chunk s of rank r is [2s, 2s + 1] + 100 r
    let input = Tensor::arange(2 * w as i64, (Kind::Float, Device::Cpu)) + 100.0 * rf;
    let mut output = Tensor::zeros([2 * w as i64], (Kind::Float, Device::Cpu));
    pg.all_to_all_single(&mut output, &input, &[], &[]).unwrap();
    let want: Vec<f32> = (0..w).flat_map(|q| [(2 * r + 100 * q) as f32, (2 * r + 1 + 100 * q) as f32]).collect();
    assert_eq!(f32s(&output), want, "all_to_all_single in equal chunks");

    // all_to_all, a tensor per peer of its own shape: rank r sends rank s a [s + 1, r + 1] block valued
    // 1000 r + 10 s + index (PyTorch's twin sends the same bytes as one all_to_all_single)
    let block = |from: usize, to: usize| {
        (Tensor::arange(((to + 1) * (from + 1)) as i64, (Kind::Float, Device::Cpu)) + (1000 * from + 10 * to) as f64)
            .view([to as i64 + 1, from as i64 + 1])
    };
    let inputs: Vec<Tensor> = (0..w).map(|s| block(r, s)).collect();
    let mut outputs: Vec<Tensor> =
        (0..w).map(|q| Tensor::zeros([r as i64 + 1, q as i64 + 1], (Kind::Float, Device::Cpu))).collect();
    pg.all_to_all(&mut outputs, &inputs).unwrap();
    for (q, o) in outputs.iter().enumerate() {
        assert_eq!(f32s(o), f32s(&block(q, r)), "all_to_all from rank {q}");
    }

    pg.barrier().unwrap();
}
