//! The nodes' rendezvous through a TCPStore, after torchrun's c10d rendezvous: membership is formed in
//! rounds. A node joins the open round; the first to join leads it, and closes it once `max` nodes have
//! joined, or `min` have and no one else came for the last-call period. Nodes are numbered in the order
//! they joined. A node that finds the round closed registers as waiting (so the running nodes restart to
//! take it in) and joins the next. While a round runs, each node heartbeats; any node ending the round
//! (a failed worker, a lost node, a waiting newcomer) posts why, and every node stops its workers and
//! joins the next round.
//!
//! Keys, under `tchrun/{run_id}/`: `round` (the newest closed round), `r{k}/joined` (a counter),
//! `r{k}/closed` (the member count, or why it failed), `r{k}/master` (where rank 0's store listens),
//! `r{k}/hb/{node}`, `r{k}/waiting`, `r{k}/end` (why it ended), `r{k}/done`, `job/end`, `job/acks`
//! (nodes that saw the end: the host keeps the store up until all have).
use std::time::{Duration, Instant};

use super::invalid;
use tch_dist::store::{Store, TcpStoreOptions};
use tch_dist::{Error, Result};

use super::elastic::ElasticConfig;

/// One closed round, from this node's side.
#[derive(Clone, Debug)]
pub(crate) struct Round {
    pub index: u64,
    pub node_rank: usize,
    pub nodes: usize,
    pub master_addr: String,
    pub master_port: u16,
}

/// Why joining ended without a round.
pub(crate) enum NoRound {
    /// The job finished (or was aborted) while this node waited: the message says which.
    JobEnded(String),
    Failed(Error),
}

impl From<Error> for NoRound {
    fn from(e: Error) -> Self {
        NoRound::Failed(e)
    }
}

pub(crate) struct Rendezvous {
    store: Store,
    cfg: ElasticConfig,
    /// Whether this launcher hosts the store (it must outlive the job, as torchrun's c10d host).
    pub hosting: bool,
}

const POLL: Duration = Duration::from_millis(50);

fn text(v: Vec<u8>) -> String {
    String::from_utf8_lossy(&v).to_string()
}

impl Rendezvous {
    /// Hosts the store at the endpoint if it can bind it, else connects to it.
    pub fn connect(cfg: &ElasticConfig, run_id: &str) -> Result<Rendezvous> {
        let (host, port) = (cfg.endpoint_host.as_str(), cfg.endpoint_port);
        let mut server = TcpStoreOptions::server(host, port, 1).timeout(cfg.timeout);
        server.num_workers = None;
        server.wait_workers = false;
        server.multi_tenant = false;
        let (store, hosting) = match Store::tcp(&server) {
            Ok(s) => (s, true),
            Err(_) => {
                let mut client = TcpStoreOptions::client(host, port, 1).timeout(cfg.timeout);
                client.num_workers = None;
                client.wait_workers = false;
                let s = Store::tcp(&client).map_err(|e| {
                    invalid(
                        format!("tchrun --rdzv-endpoint {host}:{port}"),
                        format!("cannot host or reach the rendezvous store: {e}"),
                    )
                })?;
                (s, false)
            }
        };
        let store = store.prefixed(&format!("tchrun/{run_id}/"))?;
        Ok(Rendezvous { store, cfg: cfg.clone(), hosting })
    }

    fn count(&self, key: &str) -> Result<i64> {
        self.store.add(key, 0)
    }

    fn read(&self, key: &str) -> Result<Option<String>> {
        Ok(if self.store.check(key)? { Some(text(self.store.get(key)?)) } else { None })
    }

    /// Why the job ended, if it did.
    pub fn job_end(&self) -> Result<Option<String>> {
        self.read("job/end")
    }

    /// Ends the job for every node (finished, or aborted with a reason).
    pub fn end_job(&self, why: &str) -> Result<()> {
        if !self.store.check("job/end")? {
            self.store.set("job/end", why.as_bytes())?;
        }
        Ok(())
    }

    /// Says this node has seen the job's end (the host waits for every node's before its store goes).
    pub fn ack_end(&self) -> Result<()> {
        self.store.add("job/acks", 1).map(|_| ())
    }

    /// The host: waits until `nodes` nodes have seen the end, at most `limit`.
    pub fn await_acks(&self, nodes: usize, limit: Duration) {
        let start = Instant::now();
        while start.elapsed() < limit {
            match self.count("job/acks") {
                Ok(n) if n as usize >= nodes => return,
                Err(_) => return,
                _ => std::thread::sleep(POLL),
            }
        }
    }

    /// Joins round `first` or a later one, and waits for it to close. `local_addr`: where this node's
    /// workers can be reached, published if it becomes node 0.
    pub fn join(&self, first: u64, local_addr: &str) -> std::result::Result<Round, NoRound> {
        let deadline = Instant::now() + self.cfg.timeout;
        let newest = self.read("round")?.and_then(|r| r.parse::<u64>().ok()).unwrap_or(0);
        let mut r = first.max(newest);
        loop {
            if let Some(why) = self.job_end()? {
                return Err(NoRound::JobEnded(why));
            }
            let idx = (self.store.add(&format!("r{r}/joined"), 1)? - 1) as usize;
            let closed = if idx == 0 { self.lead(r, deadline)? } else { self.await_close(r, deadline)? };
            let nodes = match closed {
                Ok(n) => n,
                Err(why) => return Err(NoRound::Failed(invalid("tchrun rendezvous", why))),
            };
            if idx >= nodes {
                // too late for this round: wait for the next, and tell the running nodes
                self.store.add(&format!("r{r}/waiting"), 1)?;
                eprintln!("tchrun: round {r} is closed ({nodes} nodes); waiting for the next");
                r += 1;
                continue;
            }
            let key = format!("r{r}/master");
            if idx == 0 {
                let port = tch_dist::store::free_port(local_addr).map_err(|e| invalid("tchrun", e.to_string()))?;
                self.store.set(&key, format!("{local_addr}:{port}").as_bytes())?;
            }
            self.store.wait(&key, self.cfg.timeout)?;
            let master = text(self.store.get(&key)?);
            let (addr, port) = master
                .rsplit_once(':')
                .and_then(|(a, p)| p.parse().ok().map(|p| (a.to_string(), p)))
                .ok_or_else(|| invalid("tchrun rendezvous", format!("bad master address {master:?}")))?;
            return Ok(Round { index: r, node_rank: idx, nodes, master_addr: addr, master_port: port });
        }
    }

    /// As round `r`'s first node: closes it when `max` joined, or `min` did and the last call passed.
    fn lead(&self, r: u64, deadline: Instant) -> Result<std::result::Result<usize, String>> {
        let joined = format!("r{r}/joined");
        let mut min_since: Option<Instant> = None;
        loop {
            let n = self.count(&joined)? as usize;
            if n >= self.cfg.min_nodes && min_since.is_none() {
                min_since = Some(Instant::now());
            }
            let last_call_over = min_since.is_some_and(|t| t.elapsed() >= self.cfg.last_call);
            if n >= self.cfg.max_nodes || last_call_over {
                let nodes = n.min(self.cfg.max_nodes);
                self.store.set(&format!("r{r}/closed"), nodes.to_string().as_bytes())?;
                self.store.set("round", r.to_string().as_bytes())?;
                return Ok(Ok(nodes));
            }
            if Instant::now() >= deadline {
                let why = format!(
                    "{n} of at least {} nodes joined round {r} within {:?} (--rdzv-timeout)",
                    self.cfg.min_nodes, self.cfg.timeout
                );
                self.store.set(&format!("r{r}/closed"), format!("failed: {why}").as_bytes())?;
                return Ok(Err(why));
            }
            if let Some(why) = self.job_end()? {
                return Ok(Err(format!("the job ended: {why}")));
            }
            std::thread::sleep(POLL);
        }
    }

    fn await_close(&self, r: u64, deadline: Instant) -> Result<std::result::Result<usize, String>> {
        let key = format!("r{r}/closed");
        loop {
            if let Some(v) = self.read(&key)? {
                return Ok(match v.parse::<usize>() {
                    Ok(n) => Ok(n),
                    Err(_) => Err(v.trim_start_matches("failed: ").to_string()),
                });
            }
            if Instant::now() >= deadline {
                return Ok(Err(format!(
                    "round {r} did not close within {:?} (--rdzv-timeout): fewer than {} nodes came",
                    self.cfg.timeout, self.cfg.min_nodes
                )));
            }
            if let Some(why) = self.job_end()? {
                return Ok(Err(format!("the job ended: {why}")));
            }
            std::thread::sleep(POLL);
        }
    }

    pub fn heartbeat(&self, r: &Round, beat: u64) -> Result<()> {
        self.store.set(&format!("r{}/hb/{}", r.index, r.node_rank), beat.to_string().as_bytes())
    }

    /// Node `k`'s last heartbeat in round `r`.
    pub fn heartbeat_of(&self, r: &Round, k: usize) -> Result<Option<String>> {
        self.read(&format!("r{}/hb/{k}", r.index))
    }

    /// Ends round `r` for everyone (the first reason stays).
    pub fn end_round(&self, r: &Round, why: &str) -> Result<()> {
        let key = format!("r{}/end", r.index);
        if !self.store.check(&key)? {
            self.store.set(&key, why.as_bytes())?;
        }
        Ok(())
    }

    pub fn round_end(&self, r: &Round) -> Result<Option<String>> {
        self.read(&format!("r{}/end", r.index))
    }

    /// Nodes waiting to join after round `r`.
    pub fn waiting(&self, r: &Round) -> Result<i64> {
        self.count(&format!("r{}/waiting", r.index))
    }

    /// Marks this node's workers finished; returns how many nodes' are.
    pub fn done(&self, r: &Round, delta: i64) -> Result<usize> {
        Ok(self.store.add(&format!("r{}/done", r.index), delta)? as usize)
    }
}
