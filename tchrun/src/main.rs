//! `tchrun`: start N copies of a program as one distributed job, as `torchrun` does.
//!
//!   tchrun --standalone --nproc-per-node 2 -- ./target/release/examples/train_ddp --epochs 5
//!   tchrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 4 -- prog
//!   tchrun --nnodes 2:4 --rdzv-endpoint 10.0.0.1:29400 --nproc-per-node 4 --max-restarts 3 -- prog
//!
//! The last form is elastic (torchrun's c10d rendezvous): run it on every node; nodes form rounds of
//! 2 to 4 through the store at the endpoint, and when a worker or a node fails, or a node joins, all
//! restart together as the next round.
//!
//! Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
//! MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_RUN_ID, and
//! libtorch's lib directory at the end of LD_LIBRARY_PATH, so a program built without an rpath to
//! libtorch (any crate that depends on tch-dist) starts; with several workers per node and
//! OMP_NUM_THREADS unset, OMP_NUM_THREADS=1, as torchrun sets it. Works for any program, PyTorch scripts
//! included.
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
mod launch;

use launch::LaunchConfig;

#[derive(Parser, Debug)]
#[command(
    name = "tchrun",
    version,
    about = "Launch a distributed job: N workers per node, torchrun's environment",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    sub: Option<Sub>,
    /// Workers on this node.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Number of nodes (machines, or launchers on one machine): N, or MIN:MAX with --rdzv-endpoint.
    /// Default 1, or the step's node count under srun.
    #[arg(long)]
    nnodes: Option<String>,
    /// This node's index, 0..nnodes (without --rdzv-endpoint; the rendezvous assigns it otherwise).
    /// Default 0, or SLURM_NODEID under srun.
    #[arg(long)]
    node_rank: Option<usize>,
    /// Elastic: HOST:PORT of the rendezvous store (hosted by the first launcher that binds it).
    #[arg(long, value_name = "HOST:PORT", conflicts_with_all = ["node_rank", "master_addr", "master_port"])]
    rdzv_endpoint: Option<String>,
    /// Elastic: seconds a round stays open for more nodes once MIN have joined.
    #[arg(long, default_value_t = 5.0)]
    rdzv_last_call: f64,
    /// Elastic: seconds to wait for a round to form (then fail).
    #[arg(long, default_value_t = 900.0)]
    rdzv_timeout: f64,
    /// Elastic: seconds without a heartbeat after which a node is taken as lost.
    #[arg(long, default_value_t = 15.0)]
    rdzv_heartbeat_timeout: f64,
    /// The address this node's workers are reached at: their Gloo groups bind it (TCH_DIST_HOSTNAME), and
    /// elastic rounds advertise it (default there: the route to the endpoint).
    #[arg(long)]
    local_addr: Option<String>,
    /// Address of rank 0's node, where the TCPStore listens. Default 127.0.0.1, or under srun the first
    /// host of the step's node list.
    #[arg(long)]
    master_addr: Option<String>,
    /// Default 29500, or under srun MASTER_PORT, else 15000 + the job id's last four digits.
    #[arg(long)]
    master_port: Option<u16>,
    /// One node on this machine: loopback and a free port (overrides the master options).
    #[arg(long, conflicts_with_all = ["nnodes", "node_rank", "master_addr", "master_port"])]
    standalone: bool,
    /// Restart the whole group this many times after a failure.
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// Also write each worker's output to `DIR/rank<R>.restart<K>.log`.
    #[arg(long, value_name = "DIR")]
    redirect_logs: Option<PathBuf>,
    /// Job id given to workers as TORCHELASTIC_RUN_ID.
    #[arg(long, default_value = "none")]
    run_id: String,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 5.0)]
    grace_secs: f64,
    /// Where workers dump their flight recorders when a collective fails (read back to name the culprit);
    /// default: the --redirect-logs directory, else a directory under the system's temporary one.
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<PathBuf>,
    /// Write a timeline of this node's ranks to FILE when they end: forward, backward, optimizer steps,
    /// pipeline actions and every collective, one track per rank (Chrome trace-event JSON: open it in
    /// ui.perfetto.dev or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    trace_out: Option<PathBuf>,
    /// Fault tolerance: this node's workers form the replica ID (TCH_DIST_REPLICA_ID), which survives the
    /// loss of other replicas (see `tchrun lighthouse` and tch_dist::ft).
    #[arg(long, value_name = "ID", requires = "lighthouse")]
    replica_id: Option<String>,
    /// Fault tolerance: HOST:PORT of the lighthouse that forms each step's quorum (TCH_DIST_LIGHTHOUSE).
    #[arg(long, value_name = "HOST:PORT", requires = "replica_id")]
    lighthouse: Option<String>,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// Merge flight-recorder dumps (`rank<R>.json`) from a failed run: which collective the job is stuck in,
    /// which ranks never entered it, what each did last, where ranks disagree.
    Analyze {
        dir: PathBuf,
        /// Ranks in the job (those without a dump are named).
        #[arg(long)]
        world: Option<usize>,
    },
    /// Serve the lighthouse of fault-tolerant replicas (tch_dist::ft): it forms each step's quorum from
    /// the replicas whose heartbeats arrive and hosts the store their replicate groups meet in. Runs until
    /// stopped; start replicas with `tchrun --replica-id ID --lighthouse HOST:PORT`.
    Lighthouse {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:29510")]
        bind: String,
        /// No quorum forms with fewer replicas.
        #[arg(long, default_value_t = 1)]
        min_replicas: usize,
        /// Seconds without a heartbeat after which a replica is taken as lost (a replica whose process
        /// ends is lost at once).
        #[arg(long, default_value_t = 5.0)]
        heartbeat_timeout: f64,
        /// Seconds a quorum waits for live replicas that have not asked, once min-replicas have.
        #[arg(long, default_value_t = 60.0)]
        join_timeout: f64,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Some(Sub::Analyze { dir, world }) = &cli.sub {
        match tch_dist::flight::analyze(dir, *world, &Default::default()) {
            Ok(a) => {
                print!("{a}");
                std::process::exit(if a.culprits.is_empty() { 0 } else { 1 });
            }
            Err(e) => {
                eprintln!("tchrun analyze: {e}");
                std::process::exit(2);
            }
        }
    }
    let secs = |flag: &str, v: f64| match Duration::try_from_secs_f64(v) {
        Ok(d) => d,
        Err(_) => {
            eprintln!("tchrun: --{flag} {v} is not a number of seconds from 0 up");
            std::process::exit(2);
        }
    };
    if let Some(Sub::Lighthouse { bind, min_replicas, heartbeat_timeout, join_timeout }) = &cli.sub {
        let cfg = tch_dist::ft::LighthouseConfig {
            bind: bind.clone(),
            min_replicas: *min_replicas,
            heartbeat_timeout: secs("heartbeat-timeout", *heartbeat_timeout),
            join_timeout: secs("join-timeout", *join_timeout),
        };
        match tch_dist::ft::Lighthouse::start(cfg) {
            Ok(l) => {
                println!(
                    "tchrun lighthouse: listening on {} (replicate groups meet in the store at {})",
                    l.addr(),
                    l.store_addr()
                );
                loop {
                    std::thread::park();
                }
            }
            Err(e) => {
                eprintln!("tchrun lighthouse: {e}");
                std::process::exit(2);
            }
        }
    }
    let grace = secs("grace-secs", cli.grace_secs);
    // under srun (one tchrun per node), what the options leave out comes from Slurm
    let complete =
        cli.nnodes.is_some() && cli.node_rank.is_some() && cli.master_addr.is_some() && cli.master_port.is_some();
    let slurm = if cli.standalone || cli.rdzv_endpoint.is_some() || complete {
        None
    } else {
        tch_dist::init::launcher::slurm_node(&tch_dist::init::launcher::process_vars).unwrap_or_else(|e| {
            eprintln!("tchrun: under srun: {e}");
            std::process::exit(2);
        })
    };
    let nnodes = cli.nnodes.clone().or_else(|| slurm.as_ref().map(|s| s.nnodes.to_string())).unwrap_or("1".into());
    let (min_nodes, max_nodes) = launch::parse_nnodes(&nnodes).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let elastic = match &cli.rdzv_endpoint {
        Some(ep) => {
            let Some((host, port)) = ep.rsplit_once(':').and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h, p)))
            else {
                eprintln!("tchrun: --rdzv-endpoint {ep:?} is not HOST:PORT");
                std::process::exit(2);
            };
            Some(launch::ElasticConfig {
                min_nodes,
                max_nodes,
                endpoint_host: host.to_string(),
                endpoint_port: port,
                last_call: secs("rdzv-last-call", cli.rdzv_last_call),
                timeout: secs("rdzv-timeout", cli.rdzv_timeout),
                heartbeat_timeout: secs("rdzv-heartbeat-timeout", cli.rdzv_heartbeat_timeout),
                local_addr: cli.local_addr.clone(),
            })
        }
        None if min_nodes != max_nodes => {
            eprintln!("tchrun: --nnodes {nnodes} (MIN:MAX) needs --rdzv-endpoint");
            std::process::exit(2);
        }
        None => None,
    };
    let trace_dir =
        cli.trace_dir.clone().or_else(|| cli.redirect_logs.as_ref().map(|d| d.join("flight"))).unwrap_or_else(|| {
            // the pid and the start time: a later launch that reuses the pid does not meet this one's dumps
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            std::env::temp_dir().join(format!("tchrun-{}-{}-flight", std::process::id(), t.as_secs()))
        });
    let (master_addr, master_port) = if cli.standalone {
        match launch::free_port() {
            Ok(p) => ("127.0.0.1".to_string(), p),
            Err(e) => {
                eprintln!("tchrun: {e}");
                std::process::exit(2);
            }
        }
    } else {
        (
            cli.master_addr
                .clone()
                .or_else(|| slurm.as_ref().map(|s| s.master_addr.clone()))
                .unwrap_or("127.0.0.1".into()),
            cli.master_port.or(slurm.as_ref().map(|s| s.master_port)).unwrap_or(29500),
        )
    };
    let cfg = LaunchConfig {
        nproc_per_node: cli.nproc_per_node,
        nnodes: if cli.standalone { 1 } else { min_nodes },
        node_rank: if cli.standalone { 0 } else { cli.node_rank.or(slurm.as_ref().map(|s| s.node_rank)).unwrap_or(0) },
        master_addr,
        master_port,
        max_restarts: cli.max_restarts,
        redirect_logs: cli.redirect_logs,
        run_id: cli.run_id,
        grace,
        tail_lines: 20,
        program: cli.command[0].clone(),
        args: cli.command[1..].to_vec(),
        libtorch_dir: launch::libtorch_dir(),
        trace_dir: Some(trace_dir),
        timeline_dir: cli
            .trace_out
            .as_ref()
            .map(|_| std::env::temp_dir().join(format!("tchrun-{}-timeline", std::process::id()))),
        elastic,
        env: cli
            .replica_id
            .iter()
            .map(|r| ("TCH_DIST_REPLICA_ID".to_string(), r.clone()))
            .chain(cli.lighthouse.iter().map(|l| ("TCH_DIST_LIGHTHOUSE".to_string(), l.clone())))
            .chain(cli.local_addr.iter().map(|a| ("TCH_DIST_HOSTNAME".to_string(), a.clone())))
            .collect(),
    };
    let result = launch::run(&cfg);
    if let (Some(out), Some(dir)) = (&cli.trace_out, &cfg.timeline_dir) {
        match tch_dist::timeline::merge(dir, out) {
            Ok(ranks) => eprintln!(
                "tchrun: timeline of {} rank(s) in {} (open it in ui.perfetto.dev)",
                ranks.len(),
                out.display()
            ),
            Err(e) => eprintln!("tchrun: --trace-out: {e}"),
        }
        let _ = std::fs::remove_dir_all(dir);
    }
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("{e}"); // names the flag or program, prefixed "tchrun"
            std::process::exit(2);
        }
    }
}
