//! Process groups over c10d's own backends: Gloo (CPU tensors, and CUDA tensors) and NCCL (CUDA tensors,
//! `cuda` feature). One group may hold both, a backend per device type (see [`BackendConfig`]); each
//! collective runs on the one for its tensors' device.
mod all_to_all;
mod backend;
mod checks;
mod engine;
pub(crate) mod flat;
pub(crate) mod loop_check;
pub(crate) mod meta;
mod p2p;
pub(crate) mod policy;
pub(crate) mod ring;
pub(crate) mod shim_op;
mod strict;
pub(crate) mod tensor_meta;

use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Tensor};

pub use backend::{Backend, BackendConfig};
pub(crate) use checks::Scope;
pub(crate) use engine::shutdown_all;
use engine::Engine;
pub use p2p::P2pOp;
pub use policy::CheckPolicy;
pub use policy::Collectives;
use strict::Strict;

use crate::error::{Error, Result};
use crate::ffi::c10d::{Pg, Posted};
use crate::ffi::check;
use crate::flight::GroupTrace;
use crate::store::Store;
use crate::work::{Finish, Handle, Work, WorkTrace};

/// PyTorch's default collective timeout for Gloo is 30 minutes; a stuck job should fail sooner by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Reduction operators, as `torch.distributed.ReduceOp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Product,
    Min,
    Max,
}

impl ReduceOp {
    fn code(self) -> i32 {
        // c10d::ReduceOp::RedOpType order.
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
        }
    }
}

/// Options for building a group on an existing store.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    /// The engine per device type: `Backend::Gloo.into()`, `BackendConfig::NCCL`, or
    /// `BackendConfig::CPU_GLOO_CUDA_NCCL`.
    pub backend: BackendConfig,
    pub timeout: Duration,
    /// Gloo: the address to bind (e.g. "127.0.0.1"); `None` binds like PyTorch (hostname, else loopback).
    pub hostname: Option<String>,
    /// Gloo worker threads; 0 means PyTorch's default (2 per device).
    pub threads: usize,
    /// Before each collective, check that all ranks pass the same operation, dtype and shape (one small
    /// all_gather), and before each recv, that the sender's tensor matches. Gloo aborts the process on a
    /// size mismatch, so this is on by default; turn it off (`TCH_DIST_VERIFY=0` under `from_env`) to save the round
    /// trip once a program is known to be consistent. DDP's bucket collectives never pay it: their shapes
    /// are checked once, at construction.
    pub verify: bool,
    /// With `verify` on, when checks run: by default every time on Gloo and at each kind's first call on
    /// NCCL, where each is a host round trip in front of work that takes microseconds (see
    /// [`CheckPolicy`] and `src/group/checks.rs` for what that leaves unchecked). `TCH_DIST_VERIFY=always` or
    /// `once` sets it for the groups built [`from_env`](Self::from_env).
    pub checks: CheckPolicy,
    /// The GPU this rank's NCCL engine uses (PyTorch's `device_id`); `None`: rank modulo the GPU count.
    pub cuda_device: Option<usize>,
    /// The strict NCCL mode of the Gloo engine (see the `strict` module): point-to-point follows NCCL's
    /// ordering rules, so that code which would hang on several GPUs fails here with an error. For tests;
    /// `TCH_DIST_STRICT_NCCL=1` turns it on for the groups built [`from_env`](Self::from_env).
    pub strict_nccl: bool,
    /// How flat all-gathers and reduce-scatters (ZeRO, FSDP) run; by default the engine's fastest
    /// (`TCH_DIST_COLLECTIVES` sets it under [`from_env`](Self::from_env)).
    pub collectives: Collectives,
    /// A rank waiting on the host for a collective ends the wait when another rank's heartbeat (published
    /// every second by the flight recorder, whatever that rank computes) has not changed for this long:
    /// a stopped or cut-off rank is named within it, not after the collective timeout. A slow rank that is
    /// alive is never named. `None` turns it off. Default 60 s, or under [`from_env`](Self::from_env) `TCH_DIST_HEARTBEAT_TIMEOUT_SECS`
    /// (0 turns it off). On NCCL, and for plain Gloo send and recv, waits are not watched (NCCL's `wait`
    /// does not block the host): there the collective timeout applies.
    pub heartbeat_timeout: Option<Duration>,
}

/// The heartbeat timeout when none is set: 60 s.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            backend: BackendConfig::GLOO,
            timeout: DEFAULT_TIMEOUT,
            hostname: None,
            threads: 0,
            verify: true,
            checks: CheckPolicy::OnceOnNccl,
            cuda_device: None,
            strict_nccl: false,
            collectives: Collectives::Auto,
            heartbeat_timeout: Some(DEFAULT_HEARTBEAT_TIMEOUT),
        }
    }
}

impl GroupOptions {
    /// The defaults with the process's settings applied: `TCH_DIST_VERIFY` (`verify`, `checks`),
    /// `TCH_DIST_STRICT_NCCL`, `TCH_DIST_COLLECTIVES` and `TCH_DIST_HEARTBEAT_TIMEOUT_SECS`
    /// (docs/process-groups.md lists them). A value that cannot be read is an error naming the variable.
    /// [`ProcessGroup::from_env`] and [`ProcessGroup::init`] build with these; `Default` reads nothing.
    pub fn from_env() -> Result<GroupOptions> {
        GroupOptions::default().with_env()
    }

    /// These options with the process's settings applied over them (see [`from_env`](Self::from_env)).
    pub fn with_env(mut self) -> Result<GroupOptions> {
        if let Some((verify, checks)) = crate::settings::verify()? {
            self.verify = verify;
            self.checks = checks.unwrap_or(self.checks);
        }
        self.strict_nccl = crate::settings::strict_nccl()?.unwrap_or(self.strict_nccl);
        self.collectives = crate::settings::collectives()?.unwrap_or(self.collectives);
        self.heartbeat_timeout = crate::settings::heartbeat_timeout()?.unwrap_or(self.heartbeat_timeout);
        Ok(self)
    }
}

/// A group of `size` ranks that run collectives together; this process is `rank`.
///
/// ```no_run
/// use tch_dist::{ProcessGroup, ReduceOp};
/// let pg = ProcessGroup::from_env()?;          // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
/// let mut t = tch::Tensor::ones([4], (tch::Kind::Float, tch::Device::Cpu));
/// pg.allreduce(&mut t, ReduceOp::Sum)?;          // every element is now WORLD_SIZE
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub struct ProcessGroup {
    /// The engine for CPU tensors, and the one for CUDA tensors (the same one for a Gloo-only group).
    cpu: Option<Arc<Engine>>,
    cuda: Option<Arc<Engine>>,
    config: BackendConfig,
    /// The GPU of the NCCL engine, where metadata goes when the group has no CPU engine.
    cuda_device: Option<usize>,
    /// The device was given (PyTorch's `device_id`): communicators are made eagerly, subgroups' split.
    bound: bool,
    rank: usize,
    size: usize,
    timeout: Duration,
    verify: bool,
    checks: CheckPolicy,
    /// The agreement checks run once so far.
    checked: checks::Checked,
    hostname: Option<String>,
    // The group's rendezvous store: kept alive with the group (as Python does), and the parent of
    // subgroups' stores.
    store: Store,
    /// Sequence numbers, the flight recorder and published progress.
    trace: Arc<GroupTrace>,
    /// Calls of `meta::outcome` so far (the same on every rank): keys their messages in the store.
    outcomes: std::sync::atomic::AtomicU64,
    /// The Gloo engine's point-to-point under NCCL's rules, in the strict mode.
    strict: Option<Strict>,
    collectives: Collectives,
    /// Flat collectives run as rings so far (the same on every rank): their message tags.
    rings: std::sync::atomic::AtomicU64,
    /// How many times each subgroup (name and ranks) was formed from this group so far: every member
    /// forms it alike, so the count numbers each formation the same on all of them (PyTorch numbers every
    /// group it forms) and a second formation never reads the first one's rendezvous keys.
    formations: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    /// Each member's rank in the group this one was formed from at the root (the world, for a job's
    /// groups): what errors name a peer by, beside its rank here.
    world_ranks: Arc<[usize]>,
}

pub(crate) fn describe(t: &Tensor) -> String {
    format!("{:?}{:?} on {:?}", t.kind(), t.size(), t.device())
}

/// Returns once every rank's engines are built (PyTorch's `_store_based_barrier` after `new_group`).
/// Gloo's connecting side returns as soon as it sent its greeting: a rank that then dropped the group at
/// once (no collective) closed the socket while its peer was still accepting, which failed that peer's
/// formation with "Connection closed by peer" (7% of 2-rank formations under load).
fn formed(store: &Store, (rank, size): (usize, usize), timeout: Duration) -> Result<()> {
    if size == 1 {
        return Ok(());
    }
    // a formation again under the same prefix (a quorum group rebuilt under one id) counts on: each
    // `size` arrivals are one formation's, which waits for its own key
    let n = store.add("tdx-formed/count", 1)?;
    let formation = (n - 1) / size as i64;
    if n % size as i64 == 0 {
        store.set(&format!("tdx-formed/{formation}"), b"1")?;
    }
    store.wait(&format!("tdx-formed/{formation}"), timeout).map_err(|e| {
        let arrived = store
            .add("tdx-formed/count", 0)
            .map_or_else(|_| "?".to_string(), |n| (n - formation * size as i64).to_string());
        e.in_op(format!("group formation (rank {rank} of {size})")).with_note(&format!(
            "{arrived} of {size} ranks finished connecting; one that never arrived failed or is still building it"
        ))
    })
}

impl ProcessGroup {
    /// Builds a group on `store`, one engine per backend of `opts.backend`, each under the store prefix
    /// PyTorch gives it (`cpu/`, `cuda/`). Blocks until all `size` ranks joined, at most `opts.timeout`.
    pub fn new(store: &Store, rank: usize, size: usize, opts: &GroupOptions) -> Result<ProcessGroup> {
        ProcessGroup::new_named(store, (rank, size), opts, "default", false)
    }

    /// [`new`](Self::new) with the name the flight recorder gives the group; `connect`: its NCCL
    /// communicator is created now even without a bound device (a group whose membership its caller
    /// handles at formation, as fault tolerance's quorum groups: a member lost before the first
    /// collective would otherwise hold the others in NCCL's lazy creation until the timeout).
    pub(crate) fn new_named(
        store: &Store,
        (rank, size): (usize, usize),
        opts: &GroupOptions,
        name: &str,
        connect: bool,
    ) -> Result<ProcessGroup> {
        let how = Formation { split: None, connect, bound: opts.cuda_device.is_some(), world: None };
        ProcessGroup::create(store, (rank, size), opts, name, how)
    }

    /// Builds the group, its NCCL communicator as `how` says.
    fn create(
        store: &Store,
        (rank, size): (usize, usize),
        opts: &GroupOptions,
        name: &str,
        how: Formation,
    ) -> Result<ProcessGroup> {
        let Formation { split, connect, bound, world } = how;
        if size == 0 || rank >= size {
            return Err(Error::invalid(
                "ProcessGroup::new",
                format!("rank {rank} is not in a group of size {size} (need 0 <= rank < size)"),
            ));
        }
        opts.backend.validate()?;
        let cuda_device = if opts.backend.has_nccl() {
            let n = crate::memory::cuda_device_count();
            // PyTorch's rule: the bound device, else the current one
            let d = opts.cuda_device.or_else(crate::memory::current_cuda_device).unwrap_or(0);
            if n > 0 && d >= n {
                return Err(Error::invalid(
                    format!("nccl process group (rank {rank} of {size})"),
                    format!("cuda_device {d} does not exist: this machine has {n} GPU(s)"),
                ));
            }
            Some(d)
        } else {
            None
        };
        let trace = GroupTrace::new(name, (rank, size), world.clone(), store, opts.heartbeat_timeout);
        let desc = if name == "default" { "default_pg" } else { name.split(' ').next().unwrap_or(name) };
        let (mut cpu, mut cuda) = (None, None);
        for (prefix, backend, serves_cpu, serves_cuda) in opts.backend.engines() {
            let how = engine::Creation {
                name,
                desc,
                split: split.as_ref().map(|(e, c)| (&**e, *c)),
                // a bound device (PyTorch's device_id) makes the communicator when the group is built
                eager: bound || connect,
            };
            let e =
                Engine::new(&store.prefixed(prefix)?, backend, (rank, size), opts, cuda_device, how, trace.clone())?;
            if serves_cpu {
                cpu = Some(e.clone());
            }
            if serves_cuda {
                cuda = Some(e);
            }
        }
        let strict = match (&cpu, opts.strict_nccl) {
            (Some(e), true) if e.backend == Backend::Gloo => Some(Strict::new(
                e.clone(),
                (rank, size),
                store.prefixed("tdx-strict/")?,
                opts.timeout,
                bound || connect,
                trace.clone(),
            )?),
            _ => None,
        };
        // beside PyTorch ranks (verification off: PyTorch's exact protocol) there is no barrier: they
        // would never arrive at it
        if opts.verify {
            formed(store, (rank, size), opts.timeout)?;
        }
        Ok(ProcessGroup {
            cpu,
            cuda,
            config: opts.backend,
            cuda_device,
            bound,
            rank,
            size,
            timeout: opts.timeout,
            verify: opts.verify,
            checks: opts.checks,
            checked: checks::Checked::default(),
            hostname: opts.hostname.clone(),
            store: store.clone(),
            trace,
            outcomes: std::sync::atomic::AtomicU64::new(0),
            strict,
            collectives: opts.collectives,
            rings: std::sync::atomic::AtomicU64::new(0),
            formations: Default::default(),
            world_ranks: world.unwrap_or_else(|| (0..size).collect()),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world rank of this group's rank `group_rank` (PyTorch's `get_global_rank`): its rank in the
    /// group this one was formed from at the root, through [`new_subgroup`](Self::new_subgroup) or a mesh
    /// (the world group made by [`from_env`](Self::from_env) for a launched job; a group made by
    /// [`new`](Self::new) is its own root, its ranks its own). `None` when the group has no such rank.
    pub fn global_rank(&self, group_rank: usize) -> Option<usize> {
        self.world_ranks.get(group_rank).copied()
    }

    /// Every member's world rank, in group rank order (PyTorch's `get_process_group_ranks`).
    pub fn global_ranks(&self) -> &[usize] {
        &self.world_ranks
    }

    /// This rank enters the collective call `name` of the public API on this group (`state_dict`, a
    /// checkpoint's save or load) until the guard drops: a rank that makes it while its peers do not is
    /// found within a heartbeat check instead of the timeout (see the flight recorder's progress).
    pub(crate) fn enter_call(&self, name: &str) -> crate::flight::CallGuard {
        self.trace.enter_call(name)
    }

    /// This rank leaves the group for good (its collectives are abandoned): the other ranks' host waits
    /// on it end within a heartbeat check instead of the timeout.
    pub(crate) fn leave(&self) {
        self.trace.leave();
    }

    /// Whether [`set_survivable`](Self::set_survivable) was called.
    pub(crate) fn is_survivable(&self) -> bool {
        self.trace.is_survivable()
    }

    /// Failures of this group are the caller's to survive: reported without flight-recorder dumps.
    pub(crate) fn set_survivable(&self) {
        self.trace.set_survivable();
    }
    /// The group's name (`default`, or the name a subgroup or mesh dimension was given).
    pub fn name(&self) -> &str {
        &self.trace.name
    }
    pub fn size(&self) -> usize {
        self.size
    }
    /// PyTorch's "default backend" of the group: NCCL when it has it, else Gloo.
    pub fn backend(&self) -> Backend {
        if self.config.has_nccl() {
            Backend::Nccl
        } else {
            Backend::Gloo
        }
    }
    /// The engine per device type.
    pub fn backend_config(&self) -> BackendConfig {
        self.config
    }
    /// The engine that takes tensors on `device`, if any.
    pub fn backend_for(&self, device: Device) -> Option<Backend> {
        self.slot(device).map(|e| e.backend)
    }
    /// The GPU of the group's NCCL engine.
    pub fn cuda_device(&self) -> Option<usize> {
        self.cuda_device
    }
    /// This rank's device, where its model and batches belong: the GPU its NCCL engine binds
    /// ([`ProcessGroup::from_env`] picks `cuda:LOCAL_RANK`, or the one GPU a task sees), else the CPU
    /// (torchtitan's `torch.device(f"cuda:{LOCAL_RANK}")`).
    pub fn device(&self) -> Device {
        self.cuda_device.map_or(Device::Cpu, Device::Cuda)
    }
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// A group of the given ranks of this one (as `torch.distributed.new_group`), with the same backends.
    /// The members must call it; a rank that is not one of them may, and gets `None` at once without
    /// talking to anyone (unlike PyTorch's `new_group`, which every rank of the group calls). `name` keeps
    /// different subgroups of the same ranks apart. Member `ranks[i]` is rank `i` of the subgroup, whose
    /// world rank [`global_rank`](Self::global_rank) gives.
    pub fn new_subgroup(&self, ranks: &[usize], name: &str) -> Result<Option<ProcessGroup>> {
        match self.subgroup_plan(ranks, name, false)? {
            Some(plan) => plan.form().map(Some),
            None => Ok(None),
        }
    }

    /// [`new_subgroup`](Self::new_subgroup) for one part of a partition of this group's ranks that every
    /// rank forms at once, each its own part (a mesh dimension's groups, a flattening): with a bound
    /// device, the NCCL communicator is split from this group's (c10d's split, one `ncclCommSplit`
    /// that every rank of this group joins) instead of initialised on its own.
    pub(crate) fn new_partition_subgroup(&self, ranks: &[usize], name: &str) -> Result<Option<ProcessGroup>> {
        match self.subgroup_plan(ranks, name, true)? {
            Some(plan) => plan.form().map(Some),
            None => Ok(None),
        }
    }

    /// [`new_subgroup`](Self::new_subgroup) whose forming ends early when a member's heartbeat in this
    /// group stands still for the heartbeat timeout (or it left), instead of at the group timeout: a
    /// member that died before joining is found as in any collective. The forming goes on, on a thread of
    /// its own, until it succeeds or times out; its group is then dropped.
    pub(crate) fn new_subgroup_watched(&self, ranks: &[usize], name: &str) -> Result<Option<ProcessGroup>> {
        let Some(mut plan) = self.subgroup_plan(ranks, name, false)? else { return Ok(None) };
        plan.connect = true;
        if !self.trace.watches_heartbeats() {
            return plan.form().map(Some);
        }
        // a forming given up on still waits in the store until its timeout: on a connection of its own,
        // or this rank's next use of the store would wait behind it
        plan.store = plan.store.connection()?;
        let what = format!("forming group {}", plan.label);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("tdx-subgroup".into())
            .spawn(move || {
                // the receiver may have given up: the group is dropped here then
                let _ = tx.send(plan.form());
            })
            .map_err(|e| Error::invalid("new_subgroup", format!("cannot start a thread to form the group: {e}")))?;
        let mut watch = crate::flight::HeartbeatWatch::default();
        loop {
            match rx.recv_timeout(crate::flight::HEARTBEAT_CHECK_EVERY) {
                Ok(formed) => return formed.map(Some),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::invalid("new_subgroup", format!("{what}: the forming thread ended")))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Some(e) = self.trace.frozen_peer_among(&mut watch, &what, Some(ranks)) {
                // formed meanwhile after all: the group is the answer
                if let Ok(Ok(g)) = rx.try_recv() {
                    return Ok(Some(g));
                }
                return Err(e);
            }
        }
    }

    /// What forming the subgroup of `ranks` needs; `None` when this rank is not one of them. `partition`:
    /// every rank of this group forms its own part of one partition now (see
    /// [`new_partition_subgroup`](Self::new_partition_subgroup)).
    fn subgroup_plan(&self, ranks: &[usize], name: &str, partition: bool) -> Result<Option<SubgroupPlan>> {
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.size) {
            return Err(Error::invalid("new_subgroup", format!("rank {r} is not in a group of size {}", self.size)));
        }
        let Some(me) = ranks.iter().position(|&r| r == self.rank) else { return Ok(None) };
        let members = ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",");
        let formation = {
            let mut f = self.formations.lock().unwrap_or_else(|e| e.into_inner());
            let n = f.entry(format!("{name}/{members}")).or_insert(0);
            *n += 1;
            *n
        };
        let key = format!("subgroup/{name}/{members}/{formation}/");
        let opts = GroupOptions {
            backend: self.config,
            timeout: self.timeout,
            hostname: self.hostname.clone(),
            threads: 0,
            verify: self.verify,
            checks: self.checks,
            // the parent's device, bound or not (a forming thread's current device may be another)
            cuda_device: self.cuda_device,
            strict_nccl: self.strict.is_some(),
            collectives: self.collectives,
            heartbeat_timeout: self.trace.heartbeat_timeout(),
        };
        // named by its members' world ranks: the same on every member, and unique across the job (a
        // subgroup's own ranks repeat from one parent to the next)
        let world: Arc<[usize]> = ranks.iter().map(|&r| self.world_ranks[r]).collect();
        let label = match formation {
            1 => format!("{name} {:?}", world),
            n => format!("{name}#{n} {:?}", world),
        };
        // the color tells the parts apart: each part's lowest rank
        let split = match (&self.cuda, partition && self.bound) {
            (Some(e), true) if e.backend == Backend::Nccl => {
                Some((e.clone(), ranks.iter().copied().min().unwrap_or(0) as i32))
            }
            _ => None,
        };
        Ok(Some(SubgroupPlan {
            store: self.store.prefixed(&key)?,
            me,
            size: ranks.len(),
            opts,
            label,
            split,
            connect: false,
            bound: self.bound,
            world,
        }))
    }

    /// The group's store (its rendezvous; also where ranks leave messages for each other).
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// Whether point-to-point follows NCCL's rules on the Gloo engine (see [`GroupOptions::strict_nccl`]).
    pub fn is_strict_nccl(&self) -> bool {
        self.strict.is_some()
    }

    /// Whether collectives on `device` follow NCCL's cost model and rules: the NCCL engine, or the strict
    /// mode that runs Gloo under them (so that the path NCCL takes is the one the CPU tests run). A
    /// collective then has a fixed launch cost, and layers above issue few, large ones.
    pub(crate) fn nccl_rules(&self, device: Device) -> bool {
        self.is_strict_nccl() || self.backend_for(device) == Some(Backend::Nccl)
    }

    /// Whether collectives check agreement across ranks first (see [`GroupOptions::verify`]).
    pub fn verifies(&self) -> bool {
        self.verify
    }
    pub fn set_verify(&mut self, on: bool) {
        self.verify = on;
    }

    /// Where the group's own metadata travels (see [`meta`]): CPU when an engine takes CPU tensors, else
    /// the NCCL engine's GPU.
    pub(crate) fn meta_device(&self) -> Device {
        match (&self.cpu, self.cuda_device) {
            (None, Some(d)) => Device::Cuda(d),
            _ => Device::Cpu,
        }
    }

    /// Where a small value computed from tensors (a norm, an overflow flag) is reduced without a host
    /// sync: the NCCL engine's GPU when the group has one, else the CPU.
    pub(crate) fn scalar_device(&self) -> Device {
        match (self.cuda.as_ref().map(|e| e.backend), self.cuda_device) {
            (Some(Backend::Nccl), Some(d)) => Device::Cuda(d),
            _ => Device::Cpu,
        }
    }

    pub(crate) fn slot(&self, device: Device) -> Option<&Engine> {
        match device {
            Device::Cpu => self.cpu.as_deref(),
            Device::Cuda(_) => self.cuda.as_deref(),
            _ => None,
        }
    }

    /// The engine for tensors on `device`, or an error naming the device and the group's backends,
    /// raised before any engine sees the tensor (NCCL given a CPU tensor would fail deep inside).
    pub(crate) fn engine(&self, device: Device, desc: &dyn Fn() -> String) -> Result<&Engine> {
        self.slot(device).ok_or_else(|| {
            let hint = match device {
                Device::Cpu => format!(
                    "; NCCL takes CUDA tensors only: move it to cuda:{}, or build the group with a CPU \
                     backend too (BackendConfig::CPU_GLOO_CUDA_NCCL, PyTorch's \"cpu:gloo,cuda:nccl\")",
                    self.cuda_device.unwrap_or(0)
                ),
                Device::Cuda(_) => "; build the group with a CUDA backend (nccl, or gloo)".to_string(),
                _ => "; only CPU and CUDA tensors are supported".to_string(),
            };
            Error::invalid(
                desc(),
                format!("the tensor is on {device:?}, and this group ({}) has no backend for it{hint}", self.config),
            )
        })
    }

    fn ctx(&self) -> String {
        format!("{} of {} ({})", self.trace.who(self.rank), self.size, self.config)
    }

    /// Rank `r` of this group as errors name it: with its world rank when that differs.
    pub(crate) fn who(&self, r: usize) -> String {
        self.trace.who(r)
    }

    /// The engine's op code for `op`, and what to do after the wait. Gloo has no AVG: it runs SUM and
    /// the finish step divides by the group size.
    fn reduction(&self, e: &Engine, desc: &str, op: ReduceOp, t: &Tensor) -> Result<(i32, Option<Finish>)> {
        if op != ReduceOp::Avg {
            return Ok((op.code(), None));
        }
        if !t.is_floating_point() {
            return Err(Error::invalid(desc.to_string(), "ReduceOp::Avg needs a floating-point tensor"));
        }
        if e.backend != Backend::Gloo {
            return Ok((op.code(), None));
        }
        let mut target = t.shallow_clone();
        let n = self.size as f64;
        let finish: Finish = Box::new(move || {
            let _ = target.f_div_scalar_(n)?;
            Ok(())
        });
        Ok((ReduceOp::Sum.code(), Some(finish)))
    }

    /// Starts an operation on engine `e` through `start` and wraps the handle it returns.
    fn launch(
        &self,
        e: &Engine,
        op: String,
        start: impl FnOnce(&Pg) -> Posted,
        finish: Option<Finish>,
    ) -> Result<Work> {
        let timeout = self.timeout;
        let stream_wait = e.backend == Backend::Nccl;
        let post = |desc: &dyn Fn() -> String| {
            let (code, work) = start(e.pg());
            check(code, timeout, desc)?;
            let work = work.ok_or_else(|| Error::invalid(desc(), "shim returned no work"))?;
            Ok(Handle::Engine { work, stream_wait })
        };
        match self.strict_for(e).filter(|_| !crate::flight::is_p2p(&op)) {
            // in the strict mode a collective is a unit of the group's stream, as on NCCL
            Some(s) => self.launch_with(e, op, finish, |desc| {
                let what = desc();
                let ticket = s.post_collective(what.clone(), || {
                    let h = post(desc)?;
                    Ok(Work::with_handle(h, timeout, Box::new(move || what.clone()), None))
                })?;
                Ok(Handle::Ticket(ticket))
            }),
            None => self.launch_with(e, op, finish, post),
        }
    }

    /// Starts an operation through `start`, which returns what to wait on, recorded by the flight
    /// recorder as `op`.
    fn launch_with(
        &self,
        e: &Engine,
        op: String,
        finish: Option<Finish>,
        start: impl FnOnce(&dyn Fn() -> String) -> Result<Handle>,
    ) -> Result<Work> {
        let (seq, recording) = self.trace.enter(&op, e.backend.name());
        let p2p = crate::flight::is_p2p(&op);
        let ctx =
            format!("{} of {} ({}, #{seq} of group {})", self.who(self.rank), self.size, e.backend, self.trace.name);
        let desc = move || format!("{op} on {ctx}");
        let handle = match start(&desc) {
            Ok(h) => h,
            Err(err) => {
                if let Some(r) = &recording {
                    r.end(Some(&err.to_string()));
                }
                return Err(self.trace.on_failure(seq, p2p, err));
            }
        };
        let traced = WorkTrace { group: self.trace.clone(), seq, p2p, recording };
        Ok(Work::with_handle(handle, self.timeout, Box::new(desc), finish).traced(traced))
    }

    fn check_peer(&self, what: &str, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::invalid(
                what.to_string(),
                format!("rank {peer} is out of range for a group of size {} ({})", self.size, self.ctx()),
            ));
        }
        Ok(())
    }

    /// Reduces `t` across all ranks in place; every rank gets the result.
    pub fn allreduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.allreduce_async(t, op)?.wait()
    }

    /// Asynchronous [`allreduce`](Self::allreduce). Gloo has no AVG: it runs SUM and divides on `wait`.
    pub fn allreduce_async(&self, t: &mut Tensor, op: ReduceOp) -> Result<Work> {
        let desc = || format!("allreduce({op:?}) of {}", describe(t));
        // refuse bad input before talking to other ranks
        let e = self.engine(t.device(), &desc)?;
        let (code, finish) = self.reduction(e, &desc(), op, t)?;
        meta::agree_on_op(self, "allreduce", 1, t, op.code() as i64)?;
        self.launch_allreduce(e, t, desc(), code, finish)
    }

    /// [`allreduce_async`](Self::allreduce_async) without the agreement check, for callers that
    /// established agreement once (DDP buckets).
    pub(crate) fn allreduce_unverified(&self, t: &mut Tensor, op: ReduceOp) -> Result<Work> {
        let desc = || format!("allreduce({op:?}) of {}", describe(t));
        let e = self.engine(t.device(), &desc)?;
        let (code, finish) = self.reduction(e, &desc(), op, t)?;
        self.launch_allreduce(e, t, desc(), code, finish)
    }

    fn launch_allreduce(
        &self,
        e: &Engine,
        t: &mut Tensor,
        desc: String,
        code: i32,
        finish: Option<Finish>,
    ) -> Result<Work> {
        // the shim copies the at::Tensor (shared storage)
        self.launch(e, desc, |pg| pg.allreduce(t, code), finish)
    }

    /// Copies `t` from rank `root` to every rank, in place.
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        self.broadcast_async(t, root)?.wait()
    }

    pub fn broadcast_async(&self, t: &mut Tensor, root: usize) -> Result<Work> {
        self.check_peer("broadcast root", root)?;
        self.engine(t.device(), &|| format!("broadcast from rank {root} of {}", describe(t)))?;
        meta::agree_on_op(self, "broadcast", 2, t, root as i64)?;
        self.broadcast_unverified(t, root)
    }

    pub(crate) fn broadcast_unverified(&self, t: &mut Tensor, root: usize) -> Result<Work> {
        let desc = format!("broadcast from rank {root} of {}", describe(t));
        let e = self.engine(t.device(), &|| desc.clone())?;
        self.launch(e, desc, |pg| pg.broadcast(t, root), None)
    }

    /// Gathers every rank's `input` into `outputs[r]` (one tensor per rank, same shape as `input`).
    pub fn all_gather(&self, outputs: &mut [Tensor], input: &Tensor) -> Result<()> {
        self.all_gather_async(outputs, input)?.wait()
    }

    pub fn all_gather_async(&self, outputs: &mut [Tensor], input: &Tensor) -> Result<Work> {
        self.engine(input.device(), &|| format!("all_gather of {}", describe(input)))?;
        meta::agree_on_op(self, "all_gather", 3, input, 0)?;
        self.all_gather_unverified(outputs, input)
    }

    pub(crate) fn all_gather_unverified(&self, outputs: &mut [Tensor], input: &Tensor) -> Result<Work> {
        let desc = || format!("all_gather of {}", describe(input));
        let e = self.engine(input.device(), &desc)?;
        if outputs.len() != self.size {
            return Err(Error::invalid(desc(), format!("{} output tensors for {} ranks", outputs.len(), self.size)));
        }
        check_like(&desc(), outputs, input)?;
        self.launch(e, desc(), |pg| pg.allgather(outputs, input), None)
    }

    /// Reduces `inputs[r]` across ranks and leaves rank r's result in `output` (one input per rank).
    pub fn reduce_scatter(&self, output: &mut Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_async(output, inputs, op)?.wait()
    }

    pub fn reduce_scatter_async(&self, output: &mut Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        let desc = format!("reduce_scatter({op:?}) into {}", describe(output));
        let e = self.engine(output.device(), &|| desc.clone())?;
        if inputs.len() != self.size {
            return Err(Error::invalid(desc, format!("{} input tensors for {} ranks", inputs.len(), self.size)));
        }
        check_like(&desc, inputs, output)?;
        let (code, finish) = self.reduction(e, &desc, op, output)?;
        meta::agree_on_op(self, "reduce_scatter", 4, output, op.code() as i64)?;
        self.launch(e, desc, |pg| pg.reduce_scatter(output, inputs, code), finish)
    }

    /// Sends `t` to rank `dst`; `tag` must match the receiver's.
    pub fn send(&self, t: &Tensor, dst: usize, tag: i32) -> Result<()> {
        self.send_async(t, dst, tag)?.wait()
    }

    /// With verification on, a small header (dtype and shape) goes first on tag `tag + 2^30`, so the
    /// receiver can refuse a mismatched tensor cleanly.
    pub fn send_async(&self, t: &Tensor, dst: usize, tag: i32) -> Result<Work> {
        self.check_peer("send destination", dst)?;
        if dst == self.rank {
            return Err(Error::invalid("send", format!("rank {dst} cannot send to itself")));
        }
        self.engine(t.device(), &|| format!("send of {} to {}", describe(t), self.who(dst)))?;
        // the strict mode checks every message's size itself
        let header = if self.strict.is_none() && self.checks_now(Scope::SendTo(dst), "p2p", t.device()) {
            let h = Tensor::from_slice(&meta::fingerprint(5, t, 0)).f_to_device(self.meta_device())?;
            Some(self.send_raw(&h, dst, header_tag(tag))?)
        } else {
            None
        };
        let mut work = self.send_raw(t, dst, tag)?;
        if let Some(h) = header {
            work.wait_first(h);
        }
        Ok(work)
    }

    /// Gloo's send and recv take the tensor's memory as host memory: CUDA tensors go through a CPU copy.
    fn staged(&self, e: &Engine, t: &Tensor) -> bool {
        e.backend == Backend::Gloo && t.device() != Device::Cpu
    }

    pub(crate) fn send_raw(&self, t: &Tensor, dst: usize, tag: i32) -> Result<Work> {
        let desc = || format!("send of {} to {} (tag {tag})", describe(t), self.who(dst));
        let e = self.engine(t.device(), &desc)?;
        let (t, _) = self.stage(e, t, true)?;
        if let Some(s) = self.strict_for(e) {
            let op = strict::Op { send: true, peer: dst, tensor: t };
            return self.launch_with(e, desc(), None, |d| Ok(Handle::Ticket(s.post_single(op, d())?)));
        }
        // c10d's send work keeps its own reference to the tensor
        self.launch(e, desc(), |pg| pg.send(&t, dst, tag), None)
    }

    /// The strict mode, for operations on engine `e`.
    /// Not once the engine is shut down: the engine then refuses the operation, naming the shutdown.
    fn strict_for(&self, e: &Engine) -> Option<&Strict> {
        self.strict.as_ref().filter(|_| e.backend == Backend::Gloo && !e.is_shut())
    }

    /// What Gloo's send or recv takes for `t`: the tensor itself, or a host copy (and for a receive, the
    /// step that copies it back after the wait).
    fn stage(&self, e: &Engine, t: &Tensor, send: bool) -> Result<(Tensor, Option<Finish>)> {
        if !self.staged(e, t) {
            return Ok((t.shallow_clone(), None));
        }
        if send {
            return Ok((t.f_to_device(Device::Cpu)?, None));
        }
        let host = Tensor::f_empty(t.size(), (t.kind(), Device::Cpu))?;
        let (mut dst, src_host) = (t.shallow_clone(), host.shallow_clone());
        let finish: Finish = Box::new(move || {
            dst.f_copy_(&src_host)?;
            Ok(())
        });
        Ok((host, Some(finish)))
    }

    /// Receives into `t` (which must have the sender's shape and dtype) from rank `src`.
    pub fn recv(&self, t: &mut Tensor, src: usize, tag: i32) -> Result<()> {
        self.recv_async(t, src, tag)?.wait()
    }

    /// With verification on, this first receives the sender's header (blocking), and on a dtype or shape
    /// mismatch drains the message into a scratch tensor and returns [`Error::Mismatch`].
    pub fn recv_async(&self, t: &mut Tensor, src: usize, tag: i32) -> Result<Work> {
        self.check_peer("recv source", src)?;
        if src == self.rank {
            return Err(Error::invalid("recv", format!("rank {src} cannot receive from itself")));
        }
        self.engine(t.device(), &|| format!("recv of {} from {}", describe(t), self.who(src)))?;
        if self.strict.is_none() && self.checks_now(Scope::RecvFrom(src), "p2p", t.device()) {
            let mine = meta::fingerprint(5, t, 0);
            let mut h = Tensor::f_zeros([mine.len() as i64], (tch::Kind::Int64, self.meta_device()))?;
            self.recv_raw(&mut h, src, header_tag(tag))?.wait()?;
            let theirs = Vec::<i64>::try_from(h.f_to_device(Device::Cpu)?)?;
            if theirs[..] != mine[..] {
                let msg = format!(
                    "{} sent {} but {} posted {}",
                    self.who(src),
                    tensor_meta::render(&theirs[2..]),
                    self.who(self.rank),
                    tensor_meta::render(&mine[2..])
                );
                if let Some(mut scratch) = tensor_meta::empty(&theirs[2..], t.device()) {
                    self.recv_raw(&mut scratch, src, tag)?.wait()?;
                }
                return Err(Error::mismatch(format!("recv from {} (tag {tag})", self.who(src)), msg));
            }
        }
        self.recv_raw(t, src, tag)
    }

    pub(crate) fn recv_raw(&self, t: &mut Tensor, src: usize, tag: i32) -> Result<Work> {
        let desc = || format!("recv of {} from {} (tag {tag})", describe(t), self.who(src));
        let e = self.engine(t.device(), &desc)?;
        let (into, finish) = self.stage(e, t, false)?;
        if let Some(s) = self.strict_for(e) {
            let op = strict::Op { send: false, peer: src, tensor: into };
            return self.launch_with(e, desc(), finish, |d| Ok(Handle::Ticket(s.post_single(op, d())?)));
        }
        // c10d's recv work keeps its own reference to the tensor
        self.launch(e, desc(), |pg| pg.recv(&into, src, tag), finish)
    }

    /// Blocks until every rank reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async()?.wait()
    }

    /// On the CPU engine when there is one, as PyTorch's `barrier()` picks for a multi-backend group.
    pub fn barrier_async(&self) -> Result<Work> {
        let e = self.engine(self.meta_device(), &|| "barrier".to_string())?;
        // a barrier against another collective would pair with its messages: checked like the others
        let nothing = Tensor::f_zeros([0], (tch::Kind::Int64, self.meta_device()))?;
        meta::agree_on_op(self, "barrier", 8, &nothing, 0)?;
        self.launch(e, "barrier".to_string(), |pg| pg.barrier(), None)
    }

    /// Sets the timeout of later collectives.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        for e in [&self.cpu, &self.cuda].into_iter().flatten() {
            e.set_timeout(timeout).map_err(|err| err.in_op(format!("set_timeout on {}", self.ctx())))?;
        }
        if let Some(s) = &self.strict {
            s.set_timeout(timeout);
        }
        self.timeout = timeout;
        Ok(())
    }

    /// The engine's handle for tensors on `device` (the tensor-parallel operators run inside autograd).
    pub(crate) fn engine_pg(&self, device: Device, desc: &dyn Fn() -> String) -> Result<&Pg> {
        Ok(self.engine(device, desc)?.pg())
    }

    /// Records, in the flight recorder, a collective that the shim runs itself (TP's operators, inside
    /// autograd) on the engine for `device`: its entry, ended by the caller (None when recording is off).
    pub(crate) fn record_external(&self, device: Device, op: &str) -> Option<crate::flight::Recording> {
        self.external_recorder(device)?.record(op)
    }

    /// What [`ProcessGroup::record_external`] records with, to keep beyond a borrow of the group (a
    /// backward's entry).
    pub(crate) fn external_recorder(&self, device: Device) -> Option<ExternalRecorder> {
        Some(ExternalRecorder { trace: self.trace.clone(), backend: self.backend_for(device)?.name() })
    }
}

fn header_tag(tag: i32) -> i32 {
    tag.wrapping_add(1 << 30)
}

fn check_like(desc: &str, ts: &[Tensor], like: &Tensor) -> Result<()> {
    let (kind, size, device) = (like.kind(), like.size(), like.device());
    for (i, t) in ts.iter().enumerate() {
        if t.kind() != kind || t.size() != size || t.device() != device {
            return Err(Error::mismatch(
                desc.to_string(),
                format!("tensor {i} is {} but must match {}", describe(t), describe(like)),
            ));
        }
    }
    Ok(())
}

/// A group's flight-recorder side for collectives the shim runs itself.
pub(crate) struct ExternalRecorder {
    trace: Arc<GroupTrace>,
    backend: &'static str,
}

impl ExternalRecorder {
    pub(crate) fn record(&self, op: &str) -> Option<crate::flight::Recording> {
        self.trace.enter(op, self.backend).1
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup({})", self.ctx())
    }
}

/// A subgroup about to be formed (see [`ProcessGroup::new_subgroup`]).
struct SubgroupPlan {
    store: Store,
    me: usize,
    size: usize,
    opts: GroupOptions,
    label: String,
    split: Option<(Arc<Engine>, i32)>,
    connect: bool,
    /// The parent's device was given: the subgroup's is too.
    bound: bool,
    /// The members' world ranks.
    world: Arc<[usize]>,
}

impl SubgroupPlan {
    fn form(self) -> Result<ProcessGroup> {
        let how = Formation { split: self.split, connect: self.connect, bound: self.bound, world: Some(self.world) };
        ProcessGroup::create(&self.store, (self.me, self.size), &self.opts, &self.label, how)
    }
}

/// How a group's NCCL communicator comes to be.
struct Formation {
    /// Split from this engine's, with this color.
    split: Option<(Arc<Engine>, i32)>,
    /// Created when the group forms even without a bound device.
    connect: bool,
    /// The device was given (PyTorch's `device_id`): created when the group forms.
    bound: bool,
    /// A subgroup's members' world ranks (`None`: a root group, whose ranks are its own).
    world: Option<Arc<[usize]>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-rank Gloo group whose routing table says "NCCL only" (no GPU here to build a real one):
    /// the routing check runs before any engine sees the tensor, so this is the path a real NCCL-only
    /// group takes with a CPU tensor.
    fn nccl_only_routing() -> ProcessGroup {
        let store = Store::hash().unwrap();
        let mut pg = ProcessGroup::new(&store, 0, 1, &GroupOptions::default()).unwrap();
        pg.cuda = pg.cpu.take();
        pg.config = BackendConfig::NCCL;
        pg.cuda_device = Some(0);
        pg
    }

    #[test]
    fn a_groups_device_is_its_nccl_engines_gpu_or_the_cpu() {
        let store = Store::hash().unwrap();
        let gloo = ProcessGroup::new(&store.prefixed("gloo").unwrap(), 0, 1, &GroupOptions::default()).unwrap();
        assert_eq!(gloo.device(), Device::Cpu);
        assert_eq!(nccl_only_routing().device(), Device::Cuda(0));
    }

    #[test]
    fn nccl_only_group_refuses_cpu_tensors_by_name() {
        let pg = nccl_only_routing();
        let mut t = Tensor::ones([4], (tch::Kind::Float, Device::Cpu));
        for e in [
            pg.allreduce(&mut t, ReduceOp::Sum).unwrap_err(),
            pg.broadcast(&mut t, 0).unwrap_err(),
            pg.all_gather(&mut [t.zeros_like()], &t).unwrap_err(),
        ] {
            let s = e.to_string();
            assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
            assert!(s.contains("on Cpu") && s.contains("(nccl) has no backend for it"), "{s}");
            assert!(s.contains("NCCL takes CUDA tensors only"), "{s}");
        }
        // metadata would travel on the GPU
        assert_eq!(pg.meta_device(), Device::Cuda(0));
    }
}
