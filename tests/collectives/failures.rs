//! Failures end in errors within the timeout, never in hangs: a rank that never joins, a rank that dies
//! mid-collective, and tensors whose sizes disagree across ranks.
use crate::common;

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use tch_dist::DistModule;
use tch_dist::{Error, ProcessGroup, ReduceOp, Store};

#[test]
fn rank_that_never_joins_times_out_with_an_error() {
    let store = Store::hash().unwrap();
    let start = Instant::now();
    // Rank 1 of 2 never shows up.
    let e = ProcessGroup::new(&store, 0, 2, &common::gloo_opts(Duration::from_secs(2))).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e, Error::Timeout { .. }), "expected a timeout, got {e:?}");
    assert!(e.to_string().contains("rank 0 of 2"), "{e}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn tcp_rendezvous_without_peers_times_out() {
    let port = common::free_port();
    let o = tch_dist::InitOptions::new(0, 2, "127.0.0.1", port).timeout(Duration::from_secs(2));
    let start = Instant::now();
    let e = ProcessGroup::init(&o).unwrap_err();
    assert!(e.is_peer_failure(), "expected timeout, got {e:?}");
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn wait_with_a_short_timeout_reports_timeout() {
    // Rank 1 delays its part; rank 0 waits only 200 ms and must get Error::Timeout, then the full result.
    let res = common::run_threads(2, Duration::from_secs(30), |mut pg| {
        pg.set_verify(false); // the agreement check would block until rank 1 arrives
        let mut t = Tensor::ones([8], (Kind::Float, Device::Cpu));
        // the first collective connects the group (in the strict mode, as NCCL's lazy creation of the
        // communicator, it waits for every rank)
        pg.allreduce(&mut t.ones_like(), ReduceOp::Sum).unwrap();
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            pg.allreduce(&mut t, ReduceOp::Sum).unwrap();
            return None;
        }
        let w = pg.allreduce_async(&mut t, ReduceOp::Sum).unwrap();
        let start = Instant::now();
        let e = w.wait_timeout(Duration::from_millis(200)).unwrap_err();
        Some((e, start.elapsed()))
    });
    let (e, took) = res[0].as_ref().expect("rank 0 result");
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(*took < Duration::from_secs(1), "{took:?}");
}

#[test]
#[ignore = "rank process spawned by dead_rank_makes_others_fail"]
fn worker_dies_mid_training() {
    let pg = ProcessGroup::from_env().expect("init");
    let mut t = Tensor::ones([1 << 20], (Kind::Float, Device::Cpu));
    for step in 0..1000 {
        if pg.rank() == 1 && step == 3 {
            std::process::exit(17); // dies without a word, mid-run
        }
        if let Err(e) = pg.allreduce(&mut t, ReduceOp::Sum) {
            println!("rank {} step {step} error: {e}", pg.rank());
            std::process::exit(3);
        }
        let _ = t.fill_(1.0);
    }
    println!("rank {} finished without noticing", pg.rank());
}

#[test]
fn dead_rank_makes_others_fail() {
    let start = Instant::now();
    let env = [("TCH_DIST_TIMEOUT_SECS", "10".to_string())];
    let outs = common::wait_all(
        common::spawn_ranks(&common::test_name!("worker_dies_mid_training"), 3, &env),
        Duration::from_secs(60),
    );
    let took = start.elapsed();
    assert_eq!(outs[1].status.code(), Some(17), "{}", common::show(&outs[1]));
    for r in [0, 2] {
        let text = String::from_utf8_lossy(&outs[r].stdout).to_string();
        assert_eq!(outs[r].status.code(), Some(3), "rank {r}: {}", common::show(&outs[r]));
        assert!(text.contains("error:") && text.contains("allreduce"), "rank {r}: {text}");
    }
    assert!(took < Duration::from_secs(40), "took {took:?}");
}

#[test]
fn mismatched_sizes_error_on_every_rank_naming_the_shapes() {
    // Unchecked, Gloo aborts the process here ("Received data size doesn't match expected size").
    let start = Instant::now();
    let res = common::run_threads(2, Duration::from_secs(10), |pg| {
        let n = if pg.rank() == 0 { 1000 } else { 3000 };
        let mut t = Tensor::ones([n], (Kind::Float, Device::Cpu));
        let e = pg.allreduce(&mut t, ReduceOp::Sum).unwrap_err();
        // the group stays usable afterwards
        let mut ok = Tensor::ones([2], (Kind::Float, Device::Cpu));
        pg.allreduce(&mut ok, ReduceOp::Sum).unwrap();
        e
    });
    assert!(start.elapsed() < Duration::from_secs(30));
    for e in &res {
        assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
        let s = e.to_string();
        assert!(s.contains("rank 0: Float[1000]") && s.contains("rank 1: Float[3000]"), "{s}");
    }
}

#[test]
fn all_to_all_splits_that_do_not_pair_up_are_refused_on_every_rank() {
    // Unchecked, Gloo aborts the process here, and NCCL writes past the chunk or hangs.
    let res = common::run_threads(2, Duration::from_secs(10), |pg| {
        let input = Tensor::ones([3, 2], (Kind::Float, Device::Cpu));
        let mut out = Tensor::zeros([2, 2], (Kind::Float, Device::Cpu));
        // both ranks send [1, 2] rows and expect [1, 1]: rank 1 gets 2 rows from each, expecting 1
        let e = pg.all_to_all_single(&mut out, &input, &[1, 1], &[1, 2]).unwrap_err();
        // refused locally, before any rank talks: splits that do not cover the tensor
        let local = pg.all_to_all_single(&mut out, &input, &[1, 1], &[1, 1]).unwrap_err();
        // the group stays usable afterwards
        let mut ok = Tensor::zeros([2, 2], (Kind::Float, Device::Cpu));
        pg.all_to_all_single(&mut ok, &Tensor::ones([2, 2], (Kind::Float, Device::Cpu)), &[], &[]).unwrap();
        (e, local)
    });
    for (e, local) in &res {
        assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
        let s = e.to_string();
        assert!(s.contains("rank 0 sends 2 rows to rank 1, which expects 1"), "{s}");
        assert!(s.contains("rank 1 sends 2 rows to rank 1, which expects 1"), "{s}");
        let l = local.to_string();
        assert!(l.contains("input_splits [1, 1] add up to 2 rows; the input has 3"), "{l}");
    }
}

#[test]
fn mismatched_send_recv_is_refused_by_the_receiver() {
    let res = common::run_threads(2, Duration::from_secs(10), |pg| {
        if pg.rank() == 0 {
            pg.send(&Tensor::ones([2, 5], (Kind::Float, Device::Cpu)), 1, 9).map_err(|e| e.to_string())
        } else {
            let mut t = Tensor::zeros([10], (Kind::Float, Device::Cpu));
            pg.recv(&mut t, 0, 9).map_err(|e| e.to_string())
        }
    });
    assert!(res[0].is_ok(), "sender: {:?}", res[0]);
    let e = res[1].as_ref().unwrap_err();
    assert!(e.contains("rank 0 sent Float[2, 5] but rank 1 posted Float[10]"), "{e}");
}

/// A subgroup's errors name a peer by its world rank too; `global_rank(s)` map a group's ranks to the
/// world's (PyTorch's `get_global_rank`, `get_process_group_ranks`), through a subgroup of a subgroup.
#[test]
fn a_subgroup_names_its_peers_by_their_world_ranks() {
    let res = common::run_threads(4, Duration::from_secs(20), |pg| {
        assert_eq!(pg.global_ranks(), [0, 1, 2, 3]);
        let odd = pg.new_subgroup(&[1, 3], "odd").unwrap()?;
        assert_eq!((odd.global_ranks(), odd.global_rank(1), odd.global_rank(2)), (&[1, 3][..], Some(3), None));
        // listed in reverse: the subgroup's rank 0 is world rank 3
        let rev = odd.new_subgroup(&[1, 0], "rev").unwrap().unwrap();
        assert_eq!(rev.global_ranks(), [3, 1]);
        Some(if pg.rank() == 3 {
            odd.send(&Tensor::ones([2, 5], (Kind::Float, Device::Cpu)), 0, 9).map_err(|e| e.to_string())
        } else {
            let mut t = Tensor::zeros([10], (Kind::Float, Device::Cpu));
            odd.recv(&mut t, 1, 9).map_err(|e| e.to_string())
        })
    });
    assert!(res[0].is_none() && res[2].is_none(), "{res:?}");
    assert!(res[3].as_ref().unwrap().is_ok(), "sender: {:?}", res[3]);
    let e = res[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(e.contains("rank 1 (world rank 3) sent Float[2, 5] but rank 0 (world rank 1) posted Float[10]"), "{e}");
}

/// A TCPStore client whose server is gone fails each later call at once with the first error, through
/// every handle over that connection, instead of failing on the socket again (which c10d reports with a
/// warning and a C++ stack trace every time).
#[test]
fn a_store_whose_server_is_gone_fails_later_calls_with_the_first_error() {
    use tch_dist::store::TcpStoreOptions;
    let port = common::free_port();
    let opts = |o: TcpStoreOptions| TcpStoreOptions { wait_workers: false, ..o.timeout(Duration::from_secs(5)) };
    let server = Store::tcp(&opts(TcpStoreOptions::server("127.0.0.1", port, 2))).unwrap();
    let client = Store::tcp(&opts(TcpStoreOptions::client("127.0.0.1", port, 2))).unwrap();
    let view = client.prefixed("job/").unwrap();
    client.set("a", b"1").unwrap();
    assert!(view.check("a").is_ok_and(|set| !set));
    drop(server);
    let first = (0..50).find_map(|_| {
        std::thread::sleep(Duration::from_millis(20));
        client.check("a").err()
    });
    let first = first.expect("the client never noticed its server had gone");
    assert!(first.is_peer_failure(), "{first:?}");
    for e in [client.get("a").unwrap_err(), view.set("b", b"2").unwrap_err(), view.check("b").unwrap_err()] {
        assert!(e.is_peer_failure(), "{e:?}");
        assert!(e.to_string().contains("the store's connection broke earlier (its server is gone)"), "{e}");
    }
}

#[test]
fn different_operations_at_the_same_point_are_reported() {
    let res = common::run_threads(2, Duration::from_secs(10), |pg| {
        let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
        if pg.rank() == 0 {
            pg.allreduce(&mut t, ReduceOp::Sum).unwrap_err().to_string()
        } else {
            pg.broadcast(&mut t, 0).unwrap_err().to_string()
        }
    });
    for e in res {
        assert!(e.contains("different operations"), "{e}");
    }
}

/// A backward whose collectives lose a peer fails with that error's own kind, across autograd: a peer
/// failure (what elastic recovery restarts on), not a string in a tch error. DDP: rank 1 runs the
/// forward, never the backward; FSDP: the same, so rank 0's backward gathers and reduces alone.
#[test]
fn a_backward_that_loses_its_peer_fails_with_a_peer_failure_for_ddp_and_fsdp() {
    use std::sync::Arc;
    use tch::nn;
    use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
    use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
    for wrapper in ["DDP", "FSDP"] {
        let res = common::run_threads(2, Duration::from_secs(2), move |pg| {
            let rank = pg.rank();
            let pg = Arc::new(pg);
            let vs = nn::VarStore::new(Device::Cpu);
            let x = Tensor::ones([4, common::model::IN], (Kind::Float, Device::Cpu));
            // a step: the forward, and the backward when asked
            let step: Box<dyn Fn(bool) -> tch_dist::Result<()>> = if wrapper == "DDP" {
                let ddp = DistributedDataParallel::new(
                    &vs,
                    common::model::mlp(&vs),
                    DdpOptions::default().process_group(pg.clone()),
                )
                .unwrap();
                Box::new(move |back| {
                    let y = ddp.f_forward(&x)?.sum(Kind::Float);
                    if back {
                        ddp.backward(&y)?;
                    }
                    Ok(())
                })
            } else {
                let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone())).unwrap();
                let p = vs.root() / "l";
                let unit = fsdp.fully_shard(&p, nn::linear(&p, common::model::IN, 64, Default::default())).unwrap();
                let model = fsdp.finish(unit).unwrap();
                Box::new(move |back| {
                    let y = model.f_forward(&x)?.sum(Kind::Float);
                    if back {
                        model.backward(&y)?;
                    }
                    Ok(())
                })
            };
            if rank == 1 {
                step(false).unwrap();
                std::thread::sleep(Duration::from_secs(4)); // silent, while rank 0's backward waits
                return None;
            }
            Some(step(true).expect_err("a backward without its peer"))
        });
        let e = res[0].as_ref().expect("rank 0's error");
        assert!(e.is_peer_failure(), "{wrapper}: expected a peer failure, got {e:?}");
    }
}

/// Ranks at different metadata exchanges get an error naming each one's, not a Gloo abort: rank 0 runs
/// an extra DDP forward (its loop check gathers 3 integers) while rank 1 averages a loss for logging
/// (the allreduce's agreement check gathers 10): the newcomer's min-gpt port, which aborted the process.
#[test]
fn an_extra_forward_on_one_rank_against_a_logging_allreduce_is_an_error_on_both() {
    use std::sync::Arc;
    use tch::nn;
    use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
    let start = Instant::now();
    let res = common::run_threads(2, Duration::from_secs(10), move |pg| {
        let rank = pg.rank();
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let ddp =
            DistributedDataParallel::new(&vs, common::model::mlp(&vs), DdpOptions::default().process_group(pg.clone()))
                .unwrap();
        let x = Tensor::ones([4, common::model::IN], (Kind::Float, Device::Cpu));
        ddp.backward(&ddp.f_forward(&x).unwrap().sum(Kind::Float)).unwrap();
        if rank == 0 {
            ddp.f_forward(&x).map(|_| ()).expect_err("an extra forward against a logging allreduce")
        } else {
            let mut loss = Tensor::from(1.0f32);
            pg.allreduce(&mut loss, ReduceOp::Sum).expect_err("a logging allreduce against an extra forward")
        }
    });
    assert!(start.elapsed() < Duration::from_secs(8), "took {:?}", start.elapsed());
    for (r, e) in res.iter().enumerate() {
        assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {e:?}");
        let msg = e.to_string();
        assert!(msg.contains("different metadata exchanges") && msg.contains("rank 0: a gather of 3 Int64"), "{msg}");
        assert!(msg.contains("rank 1: a gather of 10 Int64"), "{msg}");
        // each rank's call site, on every rank
        assert!(msg.contains("call sites: rank 0 at \"DDP forward\", rank 1 at \"allreduce"), "{msg}");
    }
}

/// One rank's collective in the fuzz below.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Call {
    op: u64,
    kind: Kind,
    numel: i64,
    root: usize,
}

/// A small deterministic generator: every rank draws the same cases.
struct Draw(u64);

impl Draw {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }
    fn call(&mut self, world: usize) -> Call {
        let kinds = [Kind::Float, Kind::Double, Kind::Int64, Kind::Int];
        // sizes from 0 to 1 MiB of float32
        let numel = match self.next(4) {
            0 => 0,
            1 => 1 + self.next(8) as i64,
            _ => self.next(1 << 18) as i64,
        };
        Call { op: self.next(7), kind: kinds[self.next(4) as usize], numel, root: self.next(world as u64) as usize }
    }
}

fn run_call(pg: &ProcessGroup, c: Call) -> tch_dist::Result<()> {
    let opts = (c.kind, Device::Cpu);
    let n = pg.size() as i64;
    let mut t = Tensor::ones([c.numel], opts);
    match c.op {
        0 => pg.allreduce(&mut t, ReduceOp::Sum),
        1 => pg.broadcast(&mut t, c.root),
        2 => pg.all_gather(&mut (0..n).map(|_| t.zeros_like()).collect::<Vec<_>>(), &t),
        3 => {
            pg.reduce_scatter(&mut t, &(0..n).map(|_| Tensor::ones([c.numel], opts)).collect::<Vec<_>>(), ReduceOp::Sum)
        }
        4 => pg.all_gather_into_tensor(&mut Tensor::zeros([c.numel * n], opts), &t),
        5 => pg.reduce_scatter_tensor(&mut t, &Tensor::ones([c.numel * n], opts), ReduceOp::Sum),
        _ => pg.barrier(),
    }
}

/// Random pairs of different collectives (operation, dtype, root, sizes from 0 to 1 MiB) on 2 and 3 ranks:
/// one rank's differs from the others'. Every rank gets an error within 2 s, and no signal ends the
/// process (Gloo aborts it when ranks' messages differ in size and nothing checked them first).
#[test]
fn a_fuzz_of_mismatched_collectives_ends_in_an_error_on_every_rank() {
    for world in [2usize, 3] {
        for case in 0..24u64 {
            let results = common::run_threads(world, Duration::from_secs(10), move |pg| {
                let mut d = Draw(0x9e37_79b9_7f4a_7c15 ^ (case * 7919 + world as u64));
                let base = d.call(world);
                let odd = d.next(world as u64) as usize;
                let mut other = base;
                while other == base
                    || (base.op == 6 && other.op == 6)
                    || (base.op == other.op && base.op != 1 && other.kind == base.kind && other.numel == base.numel)
                {
                    other = d.call(world);
                }
                let mine = if pg.rank() == odd { other } else { base };
                let start = Instant::now();
                let r = run_call(&pg, mine);
                (format!("{mine:?} against {base:?}"), r.map_err(|e| e.to_string()), start.elapsed())
            });
            for (rank, (what, r, took)) in results.iter().enumerate() {
                let e = r
                    .as_ref()
                    .err()
                    .unwrap_or_else(|| panic!("world {world} case {case} rank {rank}: {what} succeeded"));
                assert!(
                    e.contains("mismatch") || e.contains("disagree"),
                    "world {world} case {case} rank {rank}: {what}: {e}"
                );
                assert!(*took < Duration::from_secs(2), "world {world} case {case} rank {rank}: {what} took {took:?}");
            }
        }
    }
}

/// A collective made of several operations (Gloo's ring all-gather: a chain of sends and receives) that
/// times out reports the timeout it was given, not what was left of it for its last part.
#[test]
fn a_chained_collective_alone_reports_its_whole_timeout() {
    let opts = tch_dist::GroupOptions {
        verify: false,
        strict_nccl: false,
        collectives: tch_dist::Collectives::Ring,
        ..common::gloo_opts(Duration::from_secs(3))
    };
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let out = common::run_threads_with(3, opts, move |pg| {
        if pg.rank() != 0 {
            // alive, in no collective, until rank 0 has its error
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(20));
            }
            return None;
        }
        let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let mut out = Tensor::zeros([12], (Kind::Float, Device::Cpu));
        let start = Instant::now();
        let e = pg.all_gather_into_tensor(&mut out, &x).unwrap_err();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        Some((e, start.elapsed()))
    });
    let (e, took) = out[0].as_ref().unwrap();
    assert!(matches!(e, Error::Timeout { timeout, .. } if *timeout == Duration::from_secs(3)), "{e}");
    assert!(*took < Duration::from_secs(20), "took {took:?}");
}
