//! Starting a group the way `torch.distributed.init_process_group` does: from `torchrun`'s environment or
//! from explicit values, with the same store layout so that Python and Rust ranks can share one group.
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::group::{BackendConfig, GroupOptions, ProcessGroup, DEFAULT_TIMEOUT};
use crate::store::{Store, TcpStoreOptions};

mod consistency;
pub mod launcher;

/// Everything `init_process_group` needs.
#[derive(Clone, Debug)]
pub struct InitOptions {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub timeout: Duration,
    /// `None`: chosen from `device`: Gloo for CPU; for CUDA, Gloo for CPU tensors and NCCL for CUDA
    /// tensors in one group (PyTorch's "cpu:gloo,cuda:nccl").
    pub backend: Option<BackendConfig>,
    /// This rank's device; a CUDA device is the one its NCCL engine binds to (PyTorch's `device_id`).
    pub device: tch::Device,
    /// Gloo: the address to bind; `None` binds like PyTorch.
    pub hostname: Option<String>,
}

impl InitOptions {
    pub fn new(rank: usize, world_size: usize, master_addr: &str, master_port: u16) -> Self {
        InitOptions {
            rank,
            world_size,
            master_addr: master_addr.to_string(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
            backend: None,
            device: tch::Device::Cpu,
            hostname: None,
        }
    }

    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    /// `Backend::Gloo`, `Backend::Nccl`, or a [`BackendConfig`] such as `"cpu:gloo,cuda:nccl".parse()?`.
    pub fn backend(mut self, b: impl Into<BackendConfig>) -> Self {
        self.backend = Some(b.into());
        self
    }
    pub fn device(mut self, d: tch::Device) -> Self {
        self.device = d;
        self
    }

    /// Reads the job's layout from its launcher: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT` as `torchrun`, `tchrun` and a Kubeflow PyTorchJob set them; without `RANK`, Slurm's
    /// `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_LOCALID` and the first host of the step's node list (see
    /// [`launcher::job_rank`]), so that `srun my-trainer` needs no launcher. The device follows
    /// [`launcher::device`]: `cuda:LOCAL_RANK`, or `cuda:0` when one GPU is visible to the process, or the
    /// CPU on a machine without GPUs, never silently the CPU on one with them (`TCH_DIST_DEVICE=cpu`
    /// asks for it). [`ProcessGroup::init`] makes a CUDA device the current one. `TCH_DIST_TIMEOUT_SECS`
    /// and `TCH_DIST_BACKEND` override the timeout and backend; `TCH_DIST_HOSTNAME` (`tchrun
    /// --local-addr`) is the address Gloo binds.
    pub fn from_env() -> Result<Self> {
        InitOptions::from_vars(&launcher::process_vars, crate::memory::cuda_device_count())
    }

    /// [`from_env`](Self::from_env) over the variables `vars` gives, on a machine with `visible_gpus`.
    pub fn from_vars(vars: launcher::Vars, visible_gpus: usize) -> Result<Self> {
        let p = launcher::job_rank(vars)?;
        let mut o = InitOptions::new(p.rank, p.world_size, &p.master_addr, p.master_port);
        o.device = launcher::device(vars, p.local_rank, visible_gpus)?;
        o.timeout = crate::settings::timeout(vars)?.unwrap_or(o.timeout);
        o.hostname = crate::settings::hostname(vars).filter(|h| !h.trim().is_empty());
        if let Some(v) = vars("TCH_DIST_BACKEND") {
            o.backend = Some(v.parse().map_err(|_| Error::Env {
                var: "TCH_DIST_BACKEND".into(),
                msg: format!("{v:?} is not gloo, nccl or device:backend pairs such as cpu:gloo,cuda:nccl"),
            })?);
        }
        Ok(o)
    }
}

impl ProcessGroup {
    /// Joins the group described by `torchrun`'s environment variables (see [`InitOptions::from_env`]).
    pub fn from_env() -> Result<ProcessGroup> {
        ProcessGroup::init(&InitOptions::from_env()?)
    }

    /// Rendezvous through a TCPStore at `master_addr:master_port` (rank 0 serves it) and build the group,
    /// with the same store prefixes as PyTorch's default group, so Python ranks can join.
    pub fn init(o: &InitOptions) -> Result<ProcessGroup> {
        if o.world_size == 0 || o.rank >= o.world_size {
            return Err(Error::invalid(
                "init_process_group",
                format!("rank {} is not in a world of size {}", o.rank, o.world_size),
            ));
        }
        let backend = o.backend.unwrap_or_else(|| BackendConfig::for_device(o.device));
        // With agreement checks on (every rank is tch-dist's), the launch check below waits for the ranks
        // and names a world size or RANK that disagrees; the store's own wait for its workers would only
        // time out. PyTorch's ranks (checks off) expect PyTorch's store.
        let opts = GroupOptions {
            backend,
            timeout: o.timeout,
            hostname: o.hostname.clone(),
            cuda_device: None,
            ..GroupOptions::from_env()?
        };
        let checked = opts.verify;
        let base = if o.rank == 0 {
            TcpStoreOptions {
                wait_workers: !checked,
                ..TcpStoreOptions::server(&o.master_addr, o.master_port, o.world_size)
            }
        } else {
            TcpStoreOptions::client(&o.master_addr, o.master_port, o.world_size)
        };
        let store = Store::tcp(&base.timeout(o.timeout))?;
        if checked {
            consistency::check_launch(&store, o.rank, o.world_size, o.timeout)?;
        }
        let cuda_device = match o.device {
            tch::Device::Cuda(i) => {
                // what torchrun users do with torch.cuda.set_device(local_rank): memory allocated without
                // a device of its own (NCCL's, the caching allocator's) goes to this rank's GPU
                crate::memory::set_cuda_device(i)?;
                Some(i)
            }
            _ => None,
        };
        let opts = GroupOptions { cuda_device, ..opts };
        ProcessGroup::on_default_store(&store, o.rank, o.world_size, &opts)
    }

    /// Builds the default group on an existing store with PyTorch's key layout (`default_pg` / group name
    /// `0/` / then, per engine, `cpu/` or `cuda/`).
    pub fn on_default_store(
        store: &Store,
        rank: usize,
        world_size: usize,
        opts: &GroupOptions,
    ) -> Result<ProcessGroup> {
        ProcessGroup::new(&store.prefixed("default_pg")?.prefixed("0/")?, rank, world_size, opts)
    }
}

static GLOBAL: RwLock<Option<Arc<ProcessGroup>>> = RwLock::new(None);

/// Sets up the process-wide default group (what `torch.distributed.init_process_group` does).
pub fn init_process_group(o: &InitOptions) -> Result<Arc<ProcessGroup>> {
    let pg = Arc::new(ProcessGroup::init(o)?);
    set_default_group(pg.clone())?;
    Ok(pg)
}

/// Installs `pg` as the default group; fails if one is already set.
pub fn set_default_group(pg: Arc<ProcessGroup>) -> Result<()> {
    let mut g = GLOBAL.write().map_err(|_| Error::invalid("default group", "lock poisoned"))?;
    if g.is_some() {
        return Err(Error::invalid("init_process_group", "the default process group is already initialised"));
    }
    *g = Some(pg);
    Ok(())
}

/// The default group, if initialised.
pub fn default_group() -> Option<Arc<ProcessGroup>> {
    GLOBAL.read().ok().and_then(|g| g.clone())
}

/// Shuts down every group of the process, as PyTorch's `destroy_process_group()` does: the newest first
/// (subgroups before the groups they came from), each one's pending collectives completing before its
/// communicators go; then forgets the default group. Handles still held elsewhere (a DDP model's, say)
/// stay valid objects, but their collectives fail with an error naming the shutdown. The same happens
/// at the process's exit to whatever is left, so that a program returning from `main` with collectives
/// in flight loses none of them. A group given up on after a frozen peer is aborted, never waited for.
pub fn destroy_process_group() -> Result<()> {
    let r = crate::group::shutdown_all();
    if let Ok(mut g) = GLOBAL.write() {
        *g = None;
    }
    r
}
