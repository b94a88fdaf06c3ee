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

    pg.barrier().unwrap();
}
