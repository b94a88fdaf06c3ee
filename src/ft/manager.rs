//! The manager: one per process of a replica. Each step it joins a quorum at the lighthouse, rebuilds the
//! replicate group when the members changed (same process, a new store prefix), heals this replica from
//! a healthy one when it is behind, and after backward says whether the step may be committed.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::heal;
use super::hook::{FsdpReplicas, ReplicateHook};
use super::state::{check_state, load_state, state_of, ReplicaState};
use super::wire::{Connection, Quorum, Request, Response};
use crate::error::{Error, Result};
use crate::group::{GroupOptions, ProcessGroup, ReduceOp};
use crate::optim::Optimizer;
use crate::store::{Store, TcpStoreOptions};

/// A replica's settings.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// This replica's name, the same on each of its ranks (e.g. `"replica-2"`); quorums sort by it.
    pub replica_id: String,
    /// `host:port` of the lighthouse.
    pub lighthouse: String,
    /// Collective timeout of the replicate groups, and the longest wait for one to form.
    pub timeout: Duration,
    /// A member of the replicate group that stops heartbeating this long ends waits on it (a member
    /// cut off by the network, which closes no connection).
    pub peer_heartbeat_timeout: Duration,
    /// How often the lighthouse hears from this replica.
    pub heartbeat_interval: Duration,
    /// How long [`Manager::start_step`] keeps trying to join a quorum before it gives up (the lighthouse
    /// is unreachable: this replica is cut off, and must not train alone).
    pub quorum_timeout: Duration,
    /// Gloo: the address the replicate groups bind (this node's), `None` binds like PyTorch.
    pub hostname: Option<String>,
    /// At step 0 every replica takes the first member's parameters, so that replicas need not be
    /// initialised alike.
    pub init_sync: bool,
}

impl ManagerConfig {
    pub fn new(replica_id: &str, lighthouse: &str) -> Self {
        ManagerConfig {
            replica_id: replica_id.to_string(),
            lighthouse: lighthouse.to_string(),
            timeout: Duration::from_secs(60),
            peer_heartbeat_timeout: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(100),
            quorum_timeout: Duration::from_secs(120),
            hostname: None,
            init_sync: true,
        }
    }

    /// From `TCH_DIST_REPLICA_ID` and `TCH_DIST_LIGHTHOUSE` (as `tchrun --replica-id --lighthouse` set
    /// them). Also read: `TCH_DIST_FT_TIMEOUT_SECS` (`timeout`), `TCH_DIST_FT_QUORUM_TIMEOUT_SECS`,
    /// `TCH_DIST_FT_PEER_HEARTBEAT_SECS` (`peer_heartbeat_timeout`) and `TCH_DIST_HOSTNAME` (`hostname`,
    /// from `tchrun --local-addr`).
    pub fn from_env() -> Result<Self> {
        use crate::settings::ft_seconds;
        let (replica, lighthouse) = crate::settings::replica()?;
        let mut c = ManagerConfig::new(&replica, &lighthouse);
        c.timeout = ft_seconds("TCH_DIST_FT_TIMEOUT_SECS")?.unwrap_or(c.timeout);
        c.quorum_timeout = ft_seconds("TCH_DIST_FT_QUORUM_TIMEOUT_SECS")?.unwrap_or(c.quorum_timeout);
        c.peer_heartbeat_timeout = ft_seconds("TCH_DIST_FT_PEER_HEARTBEAT_SECS")?.unwrap_or(c.peer_heartbeat_timeout);
        c.hostname = crate::settings::hostname(&crate::settings::lookup);
        Ok(c)
    }
}

/// What the manager and its communication hook share.
#[derive(Default)]
pub(crate) struct Shared {
    /// This step's replicate group (rank = this replica's place in the quorum).
    pub(crate) group: Mutex<Option<Arc<ProcessGroup>>>,
    /// The first failure of this step's cross-replica reduction.
    pub(crate) failure: Mutex<Option<Error>>,
    /// Replicas taking part in this step.
    pub(crate) participants: AtomicUsize,
}

impl Shared {
    pub(crate) fn fail(&self, e: Error) {
        if let Ok(mut f) = self.failure.lock() {
            f.get_or_insert(e);
        }
    }
    pub(crate) fn failed(&self) -> bool {
        self.failure.lock().map(|f| f.is_some()).unwrap_or(true)
    }
    pub(crate) fn group(&self) -> Option<Arc<ProcessGroup>> {
        self.group.lock().ok().and_then(|g| g.clone())
    }
}

/// What happened at the start of a step: the quorum, and whether this replica was rebuilt or healed.
#[derive(Clone, Debug)]
pub struct StepStart {
    pub quorum: Quorum,
    /// The replicate group was rebuilt (the members changed, or the last step failed).
    pub reconfigured: bool,
    /// This replica was behind and took a healthy one's state.
    pub healed_from: Option<String>,
    /// Replicas this one sent its state to.
    pub sent_to: Vec<String>,
    /// Attempts that failed before this one (peers lost while the quorum formed or during healing).
    pub retries: usize,
}

/// Fault tolerance for one process of a replica (torchft's `Manager`). See the [module](super) docs.
pub struct Manager {
    cfg: ManagerConfig,
    /// The replica's own ranks (its FSDP/TP/DDP group); `None` for a one-rank replica.
    inner: Option<Arc<ProcessGroup>>,
    shared: Arc<Shared>,
    step: u64,
    /// The quorum this replica's last committed step was taken in (0: none, or resumed from disk).
    commit_quorum: u64,
    quorum: Option<Quorum>,
    store: Option<(String, Store)>,
    conn: Option<Connection>,
    reconfigure: bool,
    heartbeat_stop: Arc<AtomicBool>,
    heartbeat: Option<std::thread::JoinHandle<()>>,
}

impl Manager {
    /// A manager for this process. `inner`: the replica's own group when it has several ranks (local
    /// rank 0 speaks to the lighthouse for all of them; local rank `l` joins the replicate group of the
    /// replicas' ranks `l`).
    pub fn new(cfg: ManagerConfig, inner: Option<Arc<ProcessGroup>>) -> Result<Manager> {
        if cfg.replica_id.is_empty() {
            return Err(Error::invalid("ManagerConfig::replica_id", "is empty"));
        }
        let inner = inner.filter(|g| g.size() > 1);
        let stop = Arc::new(AtomicBool::new(false));
        let heartbeat = if inner.as_ref().is_none_or(|g| g.rank() == 0) {
            Some(start_heartbeat(&cfg, stop.clone())?)
        } else {
            None
        };
        Ok(Manager {
            cfg,
            inner,
            shared: Arc::new(Shared::default()),
            step: 0,
            commit_quorum: 0,
            quorum: None,
            store: None,
            conn: None,
            // a process that starts (or restarts) always gets a new group: the others' group of the same
            // members, if they still hold one, was made with its previous process
            reconfigure: true,
            heartbeat_stop: stop,
            heartbeat,
        })
    }

    /// Steps committed so far: the step this replica trains next.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Resumes at `step` committed steps, from a checkpoint the caller loaded into the model and the
    /// optimizer: the fallback when every replica was lost. This replica reports that step to the
    /// quorum; replicas further on heal it, and it heals those behind (a fresh one, or one that found an
    /// older checkpoint).
    pub fn resume(&mut self, step: u64) {
        self.step = step;
        self.commit_quorum = 0;
    }
    pub fn replica_id(&self) -> &str {
        &self.cfg.replica_id
    }
    /// The current quorum (after the first [`start_step`](Self::start_step)).
    pub fn quorum(&self) -> Option<&Quorum> {
        self.quorum.as_ref()
    }
    /// Replicas taking part in this step: the gradient is their mean (torchft's global batch).
    pub fn participants(&self) -> usize {
        self.shared.participants.load(Ordering::SeqCst)
    }
    /// The failure that made the last [`should_commit`](Self::should_commit) say no.
    pub fn last_failure(&self) -> Option<String> {
        self.shared.failure.lock().ok().and_then(|f| f.as_ref().map(|e| e.to_string()))
    }

    /// The DDP communication hook that averages each bucket over the replicas of the step (after the
    /// replica's own ranks, when it has several): give it to `DdpOptions::comm_hook` of a DDP over the
    /// replica's own group (a one-rank group for a one-rank replica).
    pub fn comm_hook(&self) -> Arc<dyn crate::ddp::CommHook> {
        Arc::new(ReplicateHook { shared: self.shared.clone() })
    }

    /// HSDP's replicate dimension over the replicas of each step: give it to
    /// [`FsdpOptions::replicas`](crate::fsdp::FsdpOptions::replicas) of an FSDP over the replica's own
    /// group, and the model to [`start_step`](Self::start_step). Each reduce-scattered chunk is summed
    /// over the step's replicas and the gradient divided by the ranks that took part.
    pub fn fsdp_replicas(&self) -> Arc<dyn crate::fsdp::Replicas> {
        Arc::new(FsdpReplicas { shared: self.shared.clone() })
    }

    /// Starts a step: joins the next quorum, rebuilds the replicate group if the members changed, and
    /// when this replica is behind, takes the model's tensors (a VarStore's variables, an FSDP model's
    /// shards: see [`ReplicaState`]), optimizer state and step of a healthy one (or sends its own to
    /// those behind). Peers lost meanwhile make it try again, until
    /// `quorum_timeout`.
    pub fn start_step(&mut self, model: &dyn ReplicaState, opt: &mut dyn Optimizer) -> Result<StepStart> {
        // cut off means no answer from the lighthouse for quorum_timeout: time spent in quorums that then
        // failed (a peer lost while the group formed) does not count
        let mut heard = Instant::now();
        let mut retries = 0;
        loop {
            match self.try_start(model, opt, &mut heard) {
                Ok(mut s) => {
                    s.retries = retries;
                    return Ok(s);
                }
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(e)) => {
                    self.reconfigure = true;
                    self.retire_group();
                    if heard.elapsed() >= self.cfg.quorum_timeout {
                        return Err(Error::PeerGone {
                            op: format!("fault tolerance (replica {})", self.cfg.replica_id),
                            msg: format!(
                                "no quorum could be joined within {:?} (quorum_timeout): this replica is cut \
                                 off and stops rather than train alone; last error: {e}",
                                self.cfg.quorum_timeout
                            ),
                        });
                    }
                    retries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    fn try_start(
        &mut self,
        model: &dyn ReplicaState,
        opt: &mut dyn Optimizer,
        heard: &mut Instant,
    ) -> std::result::Result<StepStart, Attempt> {
        if let Ok(mut f) = self.shared.failure.lock() {
            *f = None;
        }
        let q = self.fetch_quorum()?;
        *heard = Instant::now();
        let me = q.rank_of(&self.cfg.replica_id).ok_or_else(|| {
            Attempt::Retry(Error::PeerGone {
                op: "quorum".into(),
                msg: format!("replica {} is not in quorum {}", self.cfg.replica_id, q.id),
            })
        })?;
        // every rank of the replica builds and heals, then they agree before any state changes: one
        // whose heal failed while another's succeeded would leave the replica's ranks apart
        let reconfigured = self.quorum.as_ref().is_none_or(|old| old.id != q.id) || self.shared.group().is_none();
        let outcome = self.prepare(&q, me, reconfigured, model, opt);
        if let Some(g) = &self.inner {
            let mut flag = Tensor::from_slice(&[outcome.is_ok() as i64]);
            g.allreduce(&mut flag, ReduceOp::Min).map_err(Attempt::Fatal)?;
            if flag.f_int64_value(&[0]).map_err(|e| Attempt::Fatal(e.into()))? == 0 {
                return Err(outcome.err().unwrap_or_else(|| {
                    Attempt::Retry(Error::PeerGone {
                        op: "fault tolerance".into(),
                        msg: "another rank of this replica could not start the step".into(),
                    })
                }));
            }
        }
        let (received, sent_to) = outcome?;
        let healed_from = match received {
            Some((src, step, state)) => {
                load_state(model, opt, &state).map_err(Attempt::Fatal)?;
                self.step = step;
                self.commit_quorum = q.members[src].commit_quorum;
                Some(q.members[src].replica.clone())
            }
            None => None,
        };
        self.shared.participants.store(q.members.len(), Ordering::SeqCst);
        self.quorum = Some(q.clone());
        self.reconfigure = false;
        Ok(StepStart { quorum: q, reconfigured, healed_from, sent_to, retries: 0 })
    }

    /// Builds the quorum's group when it is new, and heals: what was received (its sender, step and
    /// state, not applied yet), and who this replica sent its state to.
    fn prepare(
        &mut self,
        q: &Quorum,
        me: usize,
        reconfigured: bool,
        model: &dyn ReplicaState,
        opt: &mut dyn Optimizer,
    ) -> std::result::Result<(Option<Received>, Vec<String>), Attempt> {
        if reconfigured {
            self.retire_group();
            let g = self.build_group(q, me).map_err(attempt)?;
            match self.shared.group.lock() {
                Ok(mut slot) => *slot = Some(Arc::new(g)),
                Err(_) => return Err(Attempt::Fatal(Error::invalid("fault tolerance", "a lock was poisoned"))),
            }
        }
        self.heal(q, me, model, opt)
    }

    /// Local rank 0 asks the lighthouse; the replica's other ranks get its answer over their own group.
    fn fetch_quorum(&mut self) -> std::result::Result<Quorum, Attempt> {
        let answer = if self.inner.as_ref().is_none_or(|g| g.rank() == 0) {
            self.ask_lighthouse()
        } else {
            Response::Refused(String::new())
        };
        let answer = match &self.inner {
            Some(g) => share(g, &answer).map_err(Attempt::Fatal)?,
            None => answer,
        };
        match answer {
            Response::Quorum(q) => Ok(q),
            Response::Refused(why) => Err(Attempt::Retry(Error::PeerGone {
                op: format!("quorum (replica {})", self.cfg.replica_id),
                msg: why,
            })),
            Response::Ok => Err(Attempt::Retry(Error::invalid("quorum", "the lighthouse answered no quorum"))),
        }
    }

    fn ask_lighthouse(&mut self) -> Response {
        let req = Request::Quorum {
            replica: self.cfg.replica_id.clone(),
            step: self.step,
            commit_quorum: self.commit_quorum,
            reconfigure: self.reconfigure,
        };
        let attempt = |conn: &mut Option<Connection>, cfg: &ManagerConfig| -> Result<Response> {
            if conn.is_none() {
                *conn = Some(Connection::open(&cfg.lighthouse, Duration::from_secs(2))?);
            }
            match conn.as_mut() {
                Some(c) => c.call(&req, cfg.quorum_timeout),
                None => Err(Error::invalid("lighthouse", "no connection")),
            }
        };
        match attempt(&mut self.conn, &self.cfg) {
            Ok(r) => r,
            Err(e) => {
                self.conn = None;
                Response::Refused(e.to_string())
            }
        }
    }

    fn build_group(&mut self, q: &Quorum, me: usize) -> Result<ProcessGroup> {
        let store = match &self.store {
            Some((addr, s)) if *addr == q.store => s,
            _ => {
                let (host, port) = q
                    .store
                    .rsplit_once(':')
                    .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h.to_string(), p)))
                    .ok_or_else(|| Error::invalid("quorum", format!("bad store address {:?}", q.store)))?;
                let s = Store::tcp(&TcpStoreOptions::client(&host, port, 1).timeout(self.cfg.timeout))?;
                &self.store.insert((q.store.clone(), s)).1
            }
        };
        let local = self.inner.as_ref().map_or(0, |g| g.rank());
        let opts = GroupOptions {
            timeout: self.cfg.timeout,
            hostname: self.cfg.hostname.clone(),
            heartbeat_timeout: Some(self.cfg.peer_heartbeat_timeout),
            // the process's settings (verification, strict mode), as its other groups have them
            ..GroupOptions::from_env()?
        };
        let prefixed = store.prefixed(&format!("ft/{}/{local}/", q.id))?;
        let g = ProcessGroup::new_named(&prefixed, (me, q.members.len()), &opts, "replicate", true)?;
        g.set_survivable();
        Ok(g)
    }

    /// Members behind take the state of one that holds the quorum's (the highest step, and of those the
    /// latest commit quorum: see [`Quorum::healthy`]; at step 0 with `init_sync`, the first member's),
    /// assigned round robin; each sender sends to its own in turn.
    fn heal(
        &mut self,
        q: &Quorum,
        me: usize,
        model: &dyn ReplicaState,
        opt: &mut dyn Optimizer,
    ) -> std::result::Result<(Option<Received>, Vec<String>), Attempt> {
        let sources = if q.max_step() == 0 && self.cfg.init_sync { vec![0] } else { q.healthy() };
        let behind: Vec<usize> = (0..q.members.len()).filter(|i| !sources.contains(i)).collect();
        if behind.is_empty() {
            return Ok((None, Vec::new()));
        }
        let g = self.shared.group().ok_or_else(|| {
            Attempt::Retry(Error::PeerGone { op: "healing".into(), msg: "no replicate group".into() })
        })?;
        let (mut got, mut to) = (None, Vec::new());
        for (k, &r) in behind.iter().enumerate() {
            let src = sources[k % sources.len()];
            if src == me {
                let _s = crate::timeline::span("fault tolerance", || format!("send state to {}", q.members[r].replica));
                let name = format!("heal-{}-{k}", q.max_step());
                heal::send(&g, r, &name, self.step, &state_of(model, opt).map_err(Attempt::Fatal)?).map_err(attempt)?;
                to.push(q.members[r].replica.clone());
            } else if r == me {
                let _s = crate::timeline::span("fault tolerance", || "receive state".to_string());
                let name = format!("heal-{}-{k}", q.max_step());
                let (step, state) = heal::recv(&g, src, &name).map_err(attempt)?;
                check_state(model, &state).map_err(Attempt::Fatal)?;
                got = Some((src, step, state));
            }
        }
        Ok((got, to))
    }

    /// After backward (DDP has waited for its buckets): whether every reduction of this step reached all
    /// the quorum's replicas, agreed by the replica's ranks. True counts the step; false means the
    /// gradients are partial: do not step the optimizer, zero them, and run the step again (the next
    /// [`start_step`](Self::start_step) rebuilds the group without the lost replica).
    pub fn should_commit(&mut self) -> Result<bool> {
        let mut ok = !self.shared.failed();
        if let Some(g) = &self.inner {
            let mut flag = Tensor::from_slice(&[ok as i64]);
            g.allreduce(&mut flag, ReduceOp::Min)?;
            ok = flag.f_int64_value(&[0])? == 1;
        }
        if ok {
            self.step += 1;
            self.commit_quorum = self.quorum.as_ref().map_or(0, |q| q.id);
        } else {
            // leave the broken group now: members still waiting in it learn at their next heartbeat
            // check, instead of waiting for the lost one's heartbeat to go stale
            self.reconfigure = true;
            self.retire_group();
        }
        Ok(ok)
    }

    /// Gives up the current replicate group. Its engine is freed on a thread of its own: c10d's
    /// destructor waits for collectives still queued on a lost peer.
    fn retire_group(&mut self) {
        let old = self.shared.group.lock().ok().and_then(|mut g| g.take());
        if let Some(g) = old {
            // the store may be out of reach (this replica cut off): neither call may hold up the caller
            let _ = std::thread::Builder::new().name("tdx-ft-retire".into()).spawn(move || {
                g.leave();
                drop(g)
            });
        }
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.heartbeat_stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
    }
}

enum Attempt {
    /// A peer or the lighthouse failed: join a new quorum.
    Retry(Error),
    /// This replica itself is broken (its own group, a bad state): give up.
    Fatal(Error),
}

impl From<Error> for Attempt {
    fn from(e: Error) -> Self {
        attempt(e)
    }
}

/// A failure of the replicate group or of healing: a lost peer is tried again with a new quorum; a bad
/// setting or a model that differs from the others' is this replica's to report.
fn attempt(e: Error) -> Attempt {
    match e {
        Error::Invalid { .. } | Error::Env { .. } | Error::Mismatch { .. } | Error::Torch(_) => Attempt::Fatal(e),
        e => Attempt::Retry(e),
    }
}

/// State received from a healthy replica: its place in the quorum, its step, its state.
type Received = (usize, u64, Vec<(String, Tensor)>);

/// Local rank 0's answer, given to the replica's other ranks.
fn share(g: &ProcessGroup, answer: &Response) -> Result<Response> {
    let text = serde_json::to_vec(answer).map_err(|e| Error::invalid("quorum", e.to_string()))?;
    let mut len = Tensor::from_slice(&[text.len() as i64]);
    g.broadcast(&mut len, 0)?;
    let n = len.f_int64_value(&[0])?;
    let mut bytes =
        if g.rank() == 0 { Tensor::from_slice(&text) } else { Tensor::f_zeros([n], (Kind::Uint8, tch::Device::Cpu))? };
    g.broadcast(&mut bytes, 0)?;
    let v = Vec::<u8>::try_from(&bytes)?;
    serde_json::from_slice(&v).map_err(|e| Error::mismatch("quorum", format!("local rank 0 sent a bad answer: {e}")))
}

fn start_heartbeat(cfg: &ManagerConfig, stop: Arc<AtomicBool>) -> Result<std::thread::JoinHandle<()>> {
    let (addr, replica, every) = (cfg.lighthouse.clone(), cfg.replica_id.clone(), cfg.heartbeat_interval);
    std::thread::Builder::new()
        .name("tdx-ft-heartbeat".into())
        .spawn(move || {
            let mut conn: Option<Connection> = None;
            while !stop.load(Ordering::SeqCst) {
                if conn.is_none() {
                    conn = Connection::open(&addr, Duration::from_secs(1)).ok();
                }
                if let Some(c) = conn.as_mut() {
                    if c.call(&Request::Heartbeat { replica: replica.clone() }, Duration::from_secs(1)).is_err() {
                        conn = None;
                    }
                }
                std::thread::sleep(every);
            }
        })
        .map_err(|e| Error::invalid("fault tolerance", format!("cannot start the heartbeat thread: {e}")))
}
