//! Elastic launching: `tchrun --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`. Each launcher (node) joins
//! a rendezvous round ([`super::rendezvous`]), runs its workers as node `k` of the round's `n`, and
//! watches the others through the store: when any worker on any node fails, a node's launcher stops
//! heartbeating, or a node waits to join, every node stops its workers and the survivors form the next
//! round (at least MIN nodes, ranks reassigned, `TORCHELASTIC_RESTART_COUNT` = the round). Failures count
//! against `--max-restarts`; membership changes do not. Workers resume from their latest checkpoint,
//! resharded to the new world size by [`tch_dist::checkpoint::Checkpointer`].
//!
//! The launcher that hosts the rendezvous store (the first to bind the endpoint) must live as long as
//! the job, as with torchrun's c10d rendezvous.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::invalid;
use super::rendezvous::{NoRound, Rendezvous, Round};
use super::{describe_status, report_failure, Attempt, LaunchConfig};
use tch_dist::{Error, Result};

/// Membership bounds and the rendezvous's timing.
#[derive(Clone, Debug)]
pub struct ElasticConfig {
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub endpoint_host: String,
    pub endpoint_port: u16,
    /// How long a round stays open for more nodes once `min_nodes` have joined.
    pub last_call: Duration,
    /// How long to wait for a round to form before failing with an error.
    pub timeout: Duration,
    /// A node whose heartbeat has not changed for this long is taken as lost.
    pub heartbeat_timeout: Duration,
    /// Where this node's workers are reachable (for rank 0's store); default: the local address of the
    /// route to the endpoint.
    pub local_addr: Option<String>,
}

impl ElasticConfig {
    pub fn validate(&self) -> Result<()> {
        if self.min_nodes == 0 || self.max_nodes < self.min_nodes {
            return Err(invalid(
                "tchrun --nnodes",
                format!("{}:{} is not MIN:MAX with 1 <= MIN <= MAX", self.min_nodes, self.max_nodes),
            ));
        }
        if self.endpoint_host.trim().is_empty() {
            return Err(invalid("tchrun --rdzv-endpoint", "no host"));
        }
        Ok(())
    }
}

/// `N` or `MIN:MAX`.
pub fn parse_nnodes(s: &str) -> Result<(usize, usize)> {
    let bad = || invalid("tchrun --nnodes", format!("{s:?} is not N or MIN:MAX"));
    match s.split_once(':') {
        Some((a, b)) => Ok((a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?)),
        None => {
            let n = s.trim().parse().map_err(|_| bad())?;
            Ok((n, n))
        }
    }
}

/// The local address of the route to `host:port` (no packet is sent).
fn route_to(host: &str, port: u16) -> String {
    std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect((host, port)).map(|()| s))
        .and_then(|s| s.local_addr())
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "127.0.0.1".into())
}

/// Heartbeats of this node in a round, from a thread of its own (so a long stop of the workers does
/// not look like a lost node); stops when dropped.
struct Beat {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Beat {
    fn start(rdzv: Arc<Rendezvous>, round: Round, every: Duration) -> Beat {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut n = 0u64;
            while !s.load(Ordering::SeqCst) {
                if rdzv.heartbeat(&round, n).is_err() {
                    break;
                }
                n += 1;
                std::thread::sleep(every);
            }
        });
        Beat { stop, handle: Some(handle) }
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Watches a running round: why it ended, if it did (checked a few times a second).
struct Watch<'a> {
    rdzv: &'a Rendezvous,
    round: &'a Round,
    cfg: &'a ElasticConfig,
    last_check: Instant,
    /// Each other node's last heartbeat and when it last changed.
    beats: Vec<(Option<String>, Instant)>,
}

impl<'a> Watch<'a> {
    fn new(rdzv: &'a Rendezvous, round: &'a Round, cfg: &'a ElasticConfig) -> Self {
        let now = Instant::now();
        Watch { rdzv, round, cfg, last_check: now, beats: vec![(None, now); round.nodes] }
    }

    fn check(&mut self) -> Result<Option<String>> {
        if self.last_check.elapsed() < Duration::from_millis(200) {
            return Ok(None);
        }
        self.last_check = Instant::now();
        let store_gone = |e: Error| {
            invalid(
                "tchrun rendezvous",
                format!(
                    "the store at {}:{} is gone (its launcher died?): {e}",
                    self.cfg.endpoint_host, self.cfg.endpoint_port
                ),
            )
        };
        if let Some(why) = self.rdzv.round_end(self.round).map_err(store_gone)? {
            return Ok(Some(why));
        }
        if let Some(why) = self.rdzv.job_end().map_err(store_gone)? {
            return Ok(Some(format!("job ended: {why}")));
        }
        let waiting = self.rdzv.waiting(self.round).map_err(store_gone)?;
        if waiting > 0 && self.round.nodes < self.cfg.max_nodes {
            let why = format!("membership: {waiting} node(s) waiting to join");
            self.rdzv.end_round(self.round, &why).map_err(store_gone)?;
            return Ok(Some(why));
        }
        for k in (0..self.round.nodes).filter(|&k| k != self.round.node_rank) {
            let beat = self.rdzv.heartbeat_of(self.round, k).map_err(store_gone)?;
            let (last, since) = &mut self.beats[k];
            if beat != *last {
                *last = beat;
                *since = Instant::now();
            } else if since.elapsed() > self.cfg.heartbeat_timeout {
                let why = format!("failure: node {k} lost (no heartbeat for {:?})", self.cfg.heartbeat_timeout);
                self.rdzv.end_round(self.round, &why).map_err(store_gone)?;
                return Ok(Some(why));
            }
        }
        Ok(None)
    }
}

/// Leaves the job with `code` once it ended: the host keeps its store up until the round's nodes saw
/// the end (each acknowledges), so none of them finds it gone.
fn leave(rdzv: &Rendezvous, nodes: usize, code: i32) -> Result<i32> {
    let _ = rdzv.ack_end();
    if rdzv.hosting {
        rdzv.await_acks(nodes, Duration::from_secs(30));
    }
    Ok(code)
}

pub(super) fn run(cfg: &LaunchConfig, e: &ElasticConfig) -> Result<i32> {
    e.validate()?;
    let rdzv = Arc::new(Rendezvous::connect(e, &cfg.run_id)?);
    if rdzv.hosting {
        eprintln!("tchrun: hosting the rendezvous store at {}:{}", e.endpoint_host, e.endpoint_port);
    }
    let local_addr = e.local_addr.clone().unwrap_or_else(|| route_to(&e.endpoint_host, e.endpoint_port));
    let every = (e.heartbeat_timeout / 5).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let (mut next, mut failures) = (0u64, 0usize);
    loop {
        let round = match rdzv.join(next, &local_addr) {
            Ok(r) => r,
            Err(NoRound::JobEnded(why)) => {
                eprintln!("tchrun: the job ended before this node could join ({why})");
                return Ok(if why == "finished" { 0 } else { 1 }); // not a member: no one waits for it
            }
            Err(NoRound::Failed(err)) => return Err(err),
        };
        next = round.index + 1;
        eprintln!(
            "tchrun: round {}: node {} of {}, world size {}",
            round.index,
            round.node_rank,
            round.nodes,
            round.nodes * cfg.nproc_per_node
        );
        let mut rc = cfg.clone();
        rc.nnodes = round.nodes;
        rc.node_rank = round.node_rank;
        rc.master_addr = round.master_addr.clone();
        rc.master_port = round.master_port;
        rc.elastic = None;
        let _beat = Beat::start(rdzv.clone(), round.clone(), every);
        let mut watch = Watch::new(&rdzv, &round, e);
        let outcome = super::attempt(&rc, round.index as usize, &mut || watch.check());
        let ended = match outcome {
            Err(err) => {
                let _ = rdzv.end_round(&round, &format!("failure: node {}: {err}", round.node_rank));
                return Err(err);
            }
            Ok(Attempt::Interrupted) => {
                let _ = rdzv.end_round(&round, &format!("failure: node {} was interrupted", round.node_rank));
                eprintln!("tchrun: interrupted; workers stopped");
                return Ok(130);
            }
            Ok(Attempt::Failed { rank, status, tails, exits }) => {
                report_failure(&rc, round.index as usize, rank, &status, &tails, &exits);
                let why = format!(
                    "failure: rank {rank} on node {} failed with {}",
                    round.node_rank,
                    describe_status(&status)
                );
                rdzv.end_round(&round, &why)?;
                why
            }
            Ok(Attempt::Stopped(why)) => {
                eprintln!("tchrun: round {}: {why}; stopped this node's workers", round.index);
                why
            }
            Ok(Attempt::Succeeded) => {
                // the exit barrier: every node's workers finish, or the round ends and all go again
                rdzv.done(&round, 1)?;
                loop {
                    if rdzv.done(&round, 0)? >= round.nodes {
                        rdzv.end_job("finished")?;
                        return leave(&rdzv, round.nodes, 0);
                    }
                    if let Some(why) = watch.check()? {
                        eprintln!("tchrun: round {}: {why} after this node's workers finished", round.index);
                        break why;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        if let Some(rest) = ended.strip_prefix("job ended: ") {
            return leave(&rdzv, round.nodes, if rest == "finished" { 0 } else { 1 });
        }
        if ended.starts_with("failure") {
            failures += 1;
            if failures > cfg.max_restarts {
                let why = format!("aborted after {failures} failure(s), --max-restarts {}: {ended}", cfg.max_restarts);
                eprintln!("tchrun: {why}");
                rdzv.end_job(&why)?;
                return leave(&rdzv, round.nodes, 1);
            }
        }
        eprintln!("tchrun: forming round {next} ({} failure(s) of {} allowed so far)", failures, cfg.max_restarts);
    }
}
