//! Launch consistency at rendezvous: before any engine is built, every rank says in the store what it was
//! launched as (world size, node, processes per node, host, process id), and rank 0 compares them. A
//! world size that differs between ranks, two processes given the same `RANK`, or launchers that disagree
//! on `--nproc-per-node` would otherwise leave every rank waiting in the engine's rendezvous until the
//! timeout, naming nothing; here they end every rank within moments, with the values and the ranks.
//!
//! The protocol, in `tch_dist/launch/` of the store the group is built on:
//! - each rank claims its rank (`add claims/R`): a second claim is a duplicate `RANK`;
//! - it publishes its launch as `rank/R`, then compares it with rank 0's;
//! - rank 0 reads every rank's launch and writes the verdict (`ok`, or what is wrong);
//! - any rank that finds a disagreement writes it as the verdict, so the ones still waiting learn it.
//!
//! Only for groups whose ranks are all tch-dist's (agreement checks on): PyTorch's ranks publish none of
//! this.
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::store::Store;

const PREFIX: &str = "tch_dist/launch/";
const VERDICT: &str = "verdict";
const OK: &[u8] = b"ok";
/// Processes that claimed a rank, and those that read a failed verdict.
const ARRIVED: &str = "arrived";
const READ: &str = "read";
/// Rank 0's latest word on who is missing, which the waiting ranks repeat.
const WAITING: &str = "waiting";

/// When a rank still waiting says so on stderr: first after [`FIRST_REPORT`], then every [`REPORT_EVERY`].
const FIRST_REPORT: Duration = Duration::from_secs(5);
const REPORT_EVERY: Duration = Duration::from_secs(30);

/// A rank's reports while it waits at rendezvous: silence until the timeout would look like a hang.
struct Reports {
    start: Instant,
    next: Instant,
}

impl Reports {
    fn new() -> Reports {
        let start = Instant::now();
        Reports { start, next: start + FIRST_REPORT }
    }

    /// Whether a report is due now (and the next one scheduled).
    fn due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        self.next = now + REPORT_EVERY;
        true
    }

    fn waited(&self) -> u64 {
        self.start.elapsed().as_secs()
    }
}

/// What one rank was launched as.
#[derive(Clone, Debug, PartialEq)]
struct Launch {
    rank: usize,
    world: usize,
    /// torchrun's and tchrun's `GROUP_RANK` and `LOCAL_WORLD_SIZE`, when set.
    node: Option<usize>,
    per_node: Option<usize>,
    host: String,
    pid: u32,
}

impl Launch {
    fn of_this_process(rank: usize, world: usize) -> Launch {
        let (node, per_node) = crate::settings::node_and_per_node();
        Launch { rank, world, node, per_node, host: crate::ffi::hostname(), pid: std::process::id() }
    }

    fn encode(&self) -> String {
        let opt = |v: Option<usize>| v.map_or("-".to_string(), |v| v.to_string());
        format!("{}\t{}\t{}\t{}\t{}", self.world, opt(self.node), opt(self.per_node), self.pid, self.host)
    }

    fn decode(rank: usize, text: &[u8]) -> Option<Launch> {
        let text = String::from_utf8_lossy(text);
        let f: Vec<&str> = text.splitn(5, '\t').collect();
        let opt = |i: usize| f.get(i).and_then(|s| s.parse().ok());
        Some(Launch {
            rank,
            world: f.first()?.parse().ok()?,
            node: opt(1),
            per_node: opt(2),
            pid: f.get(3)?.parse().ok()?,
            host: f.get(4)?.to_string(),
        })
    }

    /// `rank 2 (WORLD_SIZE=4, node 1 with 2 processes, pid 4711 on host-a)`
    fn describe(&self) -> String {
        let node = match (self.node, self.per_node) {
            (Some(n), Some(p)) => format!(", node {n} with {p} process{}", if p == 1 { "" } else { "es" }),
            _ => String::new(),
        };
        format!("rank {} (WORLD_SIZE={}{node}, pid {} on {})", self.rank, self.world, self.pid, self.host)
    }
}

/// Ranks launched with different world sizes, described for the user.
fn disagreement(launches: &[&Launch]) -> String {
    let listing: Vec<String> = launches.iter().map(|l| l.describe()).collect();
    let mut msg = format!("ranks were launched with different world sizes: {}", listing.join("; "));
    let per_node: Vec<(usize, usize)> = launches
        .iter()
        .filter_map(|l| l.node.zip(l.per_node))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if per_node.iter().map(|p| p.1).collect::<std::collections::BTreeSet<_>>().len() > 1 {
        let nodes: Vec<String> = per_node.iter().map(|(n, p)| format!("{p} on node {n}")).collect();
        msg.push_str(&format!(
            "; the launchers disagree on --nproc-per-node ({}): give every node's launcher the same \
             --nnodes and --nproc-per-node",
            nodes.join(", ")
        ));
    } else {
        msg.push_str("; every rank must be given the same WORLD_SIZE");
    }
    msg
}

fn fail(store: &Store, msg: String) -> Error {
    // the others may be waiting for the verdict: this one ends them too (best effort: the store may be
    // the thing that is failing)
    let _ = store.set(VERDICT, msg.as_bytes());
    let _ = store.add(READ, 1);
    Error::mismatch("launch check at rendezvous", msg)
}

/// Rank 0 hosts the store: after a failed check it stays until every process that arrived has read the
/// verdict (or a moment has passed), so that none of them sees the store vanish instead of the reason.
fn linger(store: &Store) {
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        match (store.add(ARRIVED, 0), store.add(READ, 0)) {
            (Ok(arrived), Ok(read)) if read < arrived => std::thread::sleep(Duration::from_millis(10)),
            _ => return,
        }
    }
}

/// What this rank's failure to reach the store during the check means.
fn store_gone(e: Error) -> Error {
    Error::PeerGone {
        op: "launch check at rendezvous".into(),
        msg: format!("the store went away (rank 0, its host, ended: see its error): {e}"),
    }
}

/// Sleeps a little longer each time, from 5 ms to 100 ms: quick when ranks start together, light on the
/// store when one is slow to start.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Backoff {
        Backoff(Duration::from_millis(5))
    }
    fn sleep(&mut self) {
        std::thread::sleep(self.0);
        self.0 = (self.0 * 2).min(Duration::from_millis(100));
    }
}

/// The check, on `base` (the store the group is built on, before its prefixes), within `timeout`.
pub(crate) fn check_launch(base: &Store, rank: usize, world: usize, timeout: Duration) -> Result<()> {
    let store = base.prefixed(PREFIX)?;
    let me = Launch::of_this_process(rank, world);
    let deadline = Instant::now() + timeout;
    store.add(ARRIVED, 1)?;
    let claims = store.add(&format!("claims/{rank}"), 1)?;
    if claims > 1 {
        // the first claimant's launch, if it got as far as publishing it
        let first = store
            .check(&format!("rank/{rank}"))
            .ok()
            .filter(|&b| b)
            .and_then(|_| store.get(&format!("rank/{rank}")).ok())
            .and_then(|v| Launch::decode(rank, &v));
        if first.as_ref().is_some_and(|l| l.pid == me.pid && l.host == me.host) {
            return Err(fail(
                &store,
                format!(
                    "this process (RANK={rank}) initialised a group on this store twice while the first was alive: \
                     destroy the first (or drop its last handle) before building another from the environment"
                ),
            ));
        }
        let other = first.map_or("another process".to_string(), |l| format!("pid {} on {}", l.pid, l.host));
        return Err(fail(
            &store,
            format!(
                "RANK={rank} was given to two processes: {other} and pid {} on {}; every process of a job needs \
                 its own RANK below WORLD_SIZE={world}",
                me.pid, me.host
            ),
        ));
    }
    store.set(&format!("rank/{rank}"), me.encode().as_bytes())?;
    if rank == 0 {
        let r = rank_zero(&store, &me, deadline, timeout);
        if r.is_err() {
            linger(&store);
        }
        return r;
    }
    others(&store, &me, deadline, timeout).map_err(|e| match e {
        Error::Mismatch { .. } | Error::Timeout { .. } => e,
        other => store_gone(other),
    })
}

/// A rank other than 0: compares its launch with rank 0's, then waits for the verdict.
fn others(store: &Store, me: &Launch, deadline: Instant, timeout: Duration) -> Result<()> {
    let world = me.world;
    // rank 0's launch: a different world size is found here, by this rank, even when rank 0 waits for
    // ranks that will never come
    let mut backoff = Backoff::new();
    let mut reports = Reports::new();
    let zero = loop {
        if let Some(l) = published(store, 0)? {
            break l;
        }
        verdict(store)?;
        if reports.due() {
            eprintln!(
                "tch-dist: rank {}: rank 0 has not arrived after {} s (it serves the store at MASTER_ADDR/MASTER_PORT); \
                 waiting for up to {} s more (the group timeout)",
                me.rank,
                reports.waited(),
                deadline.saturating_duration_since(Instant::now()).as_secs()
            );
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                op: "launch check at rendezvous".into(),
                timeout,
                msg: format!(
                    "rank 0 did not arrive (this is {}); with PyTorch's ranks in the job, set TCH_DIST_VERIFY=0 on \
                     the Rust ones (PyTorch's ranks publish no launch record)",
                    me.describe()
                ),
            });
        }
        backoff.sleep();
    };
    if zero.world != world {
        return Err(fail(store, disagreement(&[&zero, me])));
    }
    let mut backoff = Backoff::new();
    loop {
        if verdict(store)? {
            return Ok(());
        }
        if reports.due() {
            // rank 0's word on who is missing, else the count
            let word = match waiting_word(store) {
                Some(w) => format!("rank 0 says: {w}"),
                None => {
                    format!("{} of {world} ranks have arrived after {} s", store.add(ARRIVED, 0)?, reports.waited())
                }
            };
            eprintln!("tch-dist: rank {}: waiting for the other ranks at rendezvous; {word}", me.rank);
        }
        if Instant::now() >= deadline {
            // rank 0 times out at about the same moment: its verdict names the missing ranks
            std::thread::sleep(Duration::from_secs(1));
            if verdict(store)? {
                return Ok(());
            }
            let word = waiting_word(store).map_or(String::new(), |w| format!(" (rank 0 said: {w})"));
            return Err(Error::Timeout {
                op: "launch check at rendezvous".into(),
                timeout,
                msg: format!("rank 0 did not confirm that every rank arrived{word}"),
            });
        }
        backoff.sleep();
    }
}

/// Rank 0 reads every rank's launch as it arrives and writes the verdict.
fn rank_zero(store: &Store, me: &Launch, deadline: Instant, timeout: Duration) -> Result<()> {
    let mut seen: Vec<Option<Launch>> = vec![None; me.world];
    seen[0] = Some(me.clone());
    let mut backoff = Backoff::new();
    let mut reports = Reports::new();
    loop {
        // a verdict written by another rank (a duplicate RANK, a larger world) ends this one too
        verdict(store)?;
        for (r, slot) in seen.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
            *slot = published(store, r)?;
        }
        let odd: Vec<&Launch> = seen.iter().flatten().filter(|l| l.world != me.world).collect();
        if !odd.is_empty() {
            let mut all = vec![me];
            all.extend(odd);
            return Err(fail(store, disagreement(&all)));
        }
        let missing: Vec<String> =
            seen.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(r, _)| r.to_string()).collect();
        if missing.is_empty() {
            store.set(VERDICT, OK)?;
            return Ok(());
        }
        if reports.due() {
            let left = deadline.saturating_duration_since(Instant::now()).as_secs();
            let msg = format!(
                "{} of {} ranks have arrived after {} s; waiting for {} {} (not started yet, or started with \
                 another MASTER_ADDR/MASTER_PORT or WORLD_SIZE) for up to {left} s more (the group timeout)",
                me.world - missing.len(),
                me.world,
                reports.waited(),
                if missing.len() == 1 { "rank" } else { "ranks" },
                shorten(&missing),
            );
            eprintln!("tch-dist: rank 0: {msg}");
            let _ = store.set(WAITING, msg.as_bytes());
        }
        if Instant::now() >= deadline {
            let msg = format!(
                "{} {} of WORLD_SIZE={} did not arrive (not started, or started with another \
                 MASTER_ADDR/MASTER_PORT)",
                if missing.len() == 1 { "rank" } else { "ranks" },
                missing.join(", "),
                me.world
            );
            let _ = store.set(VERDICT, msg.as_bytes());
            return Err(Error::Timeout { op: "launch check at rendezvous".into(), timeout, msg });
        }
        backoff.sleep();
    }
}

/// Rank 0's latest report of who is missing, if it made one.
fn waiting_word(store: &Store) -> Option<String> {
    match store.check(WAITING) {
        Ok(true) => store.get(WAITING).ok().map(|v| String::from_utf8_lossy(&v).to_string()),
        _ => None,
    }
}

/// `ranks` listed, the middle of a long list elided.
fn shorten(ranks: &[String]) -> String {
    if ranks.len() <= 8 {
        return ranks.join(", ");
    }
    format!("{}, ... {} more ..., {}", ranks[..4].join(", "), ranks.len() - 6, ranks[ranks.len() - 2..].join(", "))
}

/// Rank `r`'s launch, if it has published it.
fn published(store: &Store, r: usize) -> Result<Option<Launch>> {
    let key = format!("rank/{r}");
    if !store.check(&key)? {
        return Ok(None);
    }
    let v = store.get(&key)?;
    Launch::decode(r, &v)
        .map(Some)
        .ok_or_else(|| Error::invalid("launch check at rendezvous", format!("rank {r}'s launch record is unreadable")))
}

/// Ok(true) once rank 0 said every rank arrived; the error another rank wrote, if it did.
fn verdict(store: &Store) -> Result<bool> {
    if !store.check(VERDICT)? {
        return Ok(false);
    }
    let v = store.get(VERDICT)?;
    if v == OK {
        return Ok(true);
    }
    let _ = store.add(READ, 1);
    Err(Error::mismatch("launch check at rendezvous", String::from_utf8_lossy(&v).to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(rank: usize, world: usize, node: usize, per_node: usize) -> Launch {
        Launch { rank, world, node: Some(node), per_node: Some(per_node), host: "h".into(), pid: 7 }
    }

    #[test]
    fn a_launch_record_round_trips() {
        let l = launch(3, 4, 1, 2);
        assert_eq!(Launch::decode(3, l.encode().as_bytes()), Some(l));
        let bare = Launch { node: None, per_node: None, ..launch(1, 2, 0, 0) };
        assert_eq!(Launch::decode(1, bare.encode().as_bytes()), Some(bare));
    }

    #[test]
    fn launchers_that_disagree_on_processes_per_node_are_named() {
        let (a, b) = (launch(0, 2, 0, 1), launch(2, 4, 1, 2));
        let m = disagreement(&[&a, &b]);
        assert!(m.contains("rank 0 (WORLD_SIZE=2, node 0 with 1 process,"), "{m}");
        assert!(m.contains("rank 2 (WORLD_SIZE=4, node 1 with 2 processes,"), "{m}");
        assert!(m.contains("--nproc-per-node (1 on node 0, 2 on node 1)"), "{m}");
        let m = disagreement(&[&launch(0, 2, 0, 1), &launch(1, 3, 0, 1)]);
        assert!(m.contains("same WORLD_SIZE") && !m.contains("nproc"), "{m}");
    }

    #[test]
    fn ranks_of_one_process_on_a_shared_store_pass_and_a_second_init_is_refused_by_name() {
        let store = Store::hash().unwrap();
        let t = Duration::from_secs(5);
        let s1 = store.clone();
        let one = std::thread::spawn(move || check_launch(&s1, 1, 2, t));
        check_launch(&store, 0, 2, t).unwrap();
        one.join().unwrap().unwrap();
        let twice = check_launch(&store, 1, 2, t).unwrap_err().to_string();
        assert!(twice.contains("initialised a group on this store twice"), "{twice}");
    }
}
