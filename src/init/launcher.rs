//! What the launcher or scheduler that started this process says about its place in the job: torchrun's
//! (and tchrun's, and a Kubeflow PyTorchJob's) variables, else Slurm's; and which device a rank takes.
//! Read through a lookup function, so that every rule is tested with variables made up in the test.
use tch::Device;

use crate::error::{Error, Result};

/// A variable lookup: the process's environment ([`process_vars`]) in a process, a table in tests.
pub type Vars<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process's own environment (read as every setting is, by `src/settings.rs`).
pub fn process_vars(var: &str) -> Option<String> {
    crate::settings::lookup(var)
}

/// The port Slurm jobs rendezvous on without `MASTER_PORT`: 15000 plus the last four digits of
/// `SLURM_JOB_ID` (PyTorch Lightning's rule), so that two jobs sharing a first node differ.
pub fn slurm_port(job_id: &str) -> Option<u16> {
    let digits: String = job_id.chars().rev().take_while(|c| c.is_ascii_digit()).take(4).collect();
    let tail: String = digits.chars().rev().collect();
    tail.parse::<u16>().ok().map(|t| 15000 + t)
}

/// The first host of a Slurm host list: `node[01-04,07],gpu5` gives `node01`, `rack[1-2]-n[3,5]` gives
/// `rack1-n3`.
pub fn first_host(list: &str) -> Option<String> {
    // the first entry: up to a comma outside brackets
    let mut depth = 0;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = list[..end].trim();
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']')? + open;
        // a range's first value, written as it is (zero padding kept)
        let first = rest[open + 1..close].split([',', '-']).next()?.trim();
        if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    (!host.is_empty() && !host.contains(']')).then_some(host)
}

/// Which launcher's variables were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun, tchrun, a Kubeflow PyTorchJob, or anything that sets `RANK` and `WORLD_SIZE`.
    Torchrun,
    /// `srun` (no `RANK`; `SLURM_PROCID` and `SLURM_STEP_NUM_TASKS`).
    Slurm,
}

/// One process's place in the job, as its launcher gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRank {
    pub launcher: Launcher,
    pub rank: usize,
    pub world_size: usize,
    /// The rank among this node's processes, if the launcher says.
    pub local_rank: Option<usize>,
    pub master_addr: String,
    pub master_port: u16,
}

fn get(vars: Vars, var: &str) -> Option<String> {
    vars(var).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

fn num<T: std::str::FromStr>(vars: Vars, var: &str) -> Result<Option<T>> {
    match get(vars, var) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| Error::Env { var: var.into(), msg: format!("{v:?} is not a valid number here") }),
    }
}

fn need<T>(v: Option<T>, var: &str, hint: &str) -> Result<T> {
    v.ok_or_else(|| Error::Env { var: var.into(), msg: format!("is not set ({hint})") })
}

/// Reads the job's layout: torchrun's variables when `RANK` is set, else Slurm's when `SLURM_PROCID` is.
/// `MASTER_ADDR` and `MASTER_PORT` win over Slurm's host list and port rule when set.
pub fn job_rank(vars: Vars) -> Result<JobRank> {
    let (launcher, rank, world_size, local_rank, addr, port) = if get(vars, "RANK").is_some() {
        let hint = "torchrun and tchrun set it";
        (
            Launcher::Torchrun,
            need(num(vars, "RANK")?, "RANK", hint)?,
            need(num(vars, "WORLD_SIZE")?, "WORLD_SIZE", hint)?,
            num(vars, "LOCAL_RANK")?,
            need(get(vars, "MASTER_ADDR"), "MASTER_ADDR", hint)?,
            need(num(vars, "MASTER_PORT")?, "MASTER_PORT", hint)?,
        )
    } else if get(vars, "SLURM_PROCID").is_some() {
        // srun's tasks carry the step's variables; a batch script or an salloc shell has SLURM_PROCID
        // (0) and the job's task count too, but is one process, not a rank of them
        let Some(world) = num(vars, "SLURM_STEP_NUM_TASKS")? else {
            return Err(Error::Env {
                var: "RANK".into(),
                msg: "is not set, and this is not a task of srun (SLURM_PROCID is set but not SLURM_STEP_NUM_TASKS: \
                      a batch script or an salloc shell): start the program with srun, tchrun or torchrun"
                    .into(),
            });
        };
        let hint = "srun sets it for each task";
        let addr = match get(vars, "MASTER_ADDR") {
            Some(a) => a,
            None => {
                let list = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                    .iter()
                    .find_map(|v| get(vars, v).map(|l| (*v, l)));
                match list {
                    Some((var, l)) => first_host(&l).ok_or_else(|| Error::Env {
                        var: var.into(),
                        msg: format!("{l:?} is not a Slurm host list whose first host can be read"),
                    })?,
                    None => need(
                        get(vars, "SLURM_LAUNCH_NODE_IPADDR"),
                        "SLURM_STEP_NODELIST",
                        "nor SLURM_JOB_NODELIST, SLURM_NODELIST, SLURM_LAUNCH_NODE_IPADDR or MASTER_ADDR: the host \
                         of rank 0",
                    )?,
                }
            }
        };
        let port = match num(vars, "MASTER_PORT")? {
            Some(p) => p,
            None => {
                let job = need(get(vars, "SLURM_JOB_ID"), "SLURM_JOB_ID", "or MASTER_PORT")?;
                slurm_port(&job).ok_or_else(|| Error::Env {
                    var: "SLURM_JOB_ID".into(),
                    msg: format!("{job:?} does not end in digits; set MASTER_PORT"),
                })?
            }
        };
        (
            Launcher::Slurm,
            need(num(vars, "SLURM_PROCID")?, "SLURM_PROCID", hint)?,
            world,
            num(vars, "SLURM_LOCALID")?,
            addr,
            port,
        )
    } else {
        return Err(Error::Env {
            var: "RANK".into(),
            msg: "is not set, and neither is SLURM_PROCID: start the program with tchrun, torchrun or srun \
                  (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                .into(),
        });
    };
    if world_size == 0 {
        let w = if launcher == Launcher::Slurm { "SLURM_STEP_NUM_TASKS" } else { "WORLD_SIZE" };
        return Err(Error::Env { var: w.into(), msg: "must be at least 1".into() });
    }
    if rank >= world_size {
        let (r, w) = match launcher {
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
            Launcher::Torchrun => ("RANK", "WORLD_SIZE"),
        };
        return Err(Error::Env { var: r.into(), msg: format!("{r}={rank} is not below {w}={world_size}") });
    }
    Ok(JobRank { launcher, rank, world_size, local_rank, master_addr: addr, master_port: port })
}

/// A node's place in a job whose launchers were started by `srun`, one per node (`srun
/// --ntasks-per-node=1 tchrun ...`): what `tchrun` takes from Slurm where its options are not given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmNode {
    pub nnodes: usize,
    pub node_rank: usize,
    /// The first host of the step's node list (or `MASTER_ADDR`), where node 0's launcher serves the store.
    pub master_addr: String,
    /// `MASTER_PORT`, else [`slurm_port`] of the job id.
    pub master_port: u16,
}

/// `None` outside a task of srun (no `SLURM_STEP_NUM_NODES`: not under Slurm, or in a batch script or an
/// salloc shell, where tchrun's own defaults hold); an error when the step does not run one task per
/// node.
pub fn slurm_node(vars: Vars) -> Result<Option<SlurmNode>> {
    let Some(nnodes) = num::<usize>(vars, "SLURM_STEP_NUM_NODES")? else { return Ok(None) };
    let hint = "srun sets it";
    let job = need(get(vars, "SLURM_JOB_ID"), "SLURM_JOB_ID", hint)?;
    let node_rank: usize = need(num(vars, "SLURM_NODEID")?, "SLURM_NODEID", hint)?;
    if let Some(tasks) = num::<usize>(vars, "SLURM_STEP_NUM_TASKS")? {
        if tasks != nnodes {
            return Err(Error::Env {
                var: "SLURM_STEP_NUM_TASKS".into(),
                msg: format!(
                    "{tasks} tasks on {nnodes} nodes: tchrun starts the workers of its node itself, so srun must \
                    start one tchrun per node (srun --ntasks-per-node=1 tchrun --nproc-per-node=GPUS ...)"
                ),
            });
        }
    }
    if node_rank >= nnodes {
        return Err(Error::Env {
            var: "SLURM_NODEID".into(),
            msg: format!("node {node_rank} is not below the step's {nnodes} nodes"),
        });
    }
    let master_addr = match get(vars, "MASTER_ADDR") {
        Some(a) => a,
        None => {
            let (var, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                .iter()
                .find_map(|v| get(vars, v).map(|l| (*v, l)))
                .ok_or_else(|| Error::Env { var: "SLURM_JOB_NODELIST".into(), msg: format!("is not set ({hint})") })?;
            first_host(&list).ok_or_else(|| Error::Env {
                var: var.into(),
                msg: format!("{list:?} is not a Slurm host list whose first host can be read"),
            })?
        }
    };
    let master_port = match num(vars, "MASTER_PORT")? {
        Some(p) => p,
        None => slurm_port(&job).ok_or_else(|| Error::Env {
            var: "SLURM_JOB_ID".into(),
            msg: format!("{job:?} does not end in digits; set MASTER_PORT"),
        })?,
    };
    Ok(Some(SlurmNode { nnodes, node_rank, master_addr, master_port }))
}

/// The device a rank takes (PyTorch's rule for `LOCAL_RANK`, and a scheduler's one-GPU binding):
/// - `TCH_DIST_DEVICE=cpu` (or `cuda`, `cuda:N`) decides;
/// - no GPU visible: the CPU;
/// - `LOCAL_RANK` below the visible count: `cuda:LOCAL_RANK`;
/// - exactly one GPU visible (`CUDA_VISIBLE_DEVICES` or a scheduler's binding, as Slurm's
///   `--gpus-per-task=1` and a one-GPU Kubernetes pod give): `cuda:0`;
/// - anything else is an error naming `LOCAL_RANK`, the visible count and `CUDA_VISIBLE_DEVICES`, never
///   a silent fall to the CPU.
pub fn device(vars: Vars, local_rank: Option<usize>, visible_gpus: usize) -> Result<Device> {
    let visible = || match get(vars, "CUDA_VISIBLE_DEVICES") {
        Some(v) => format!("CUDA_VISIBLE_DEVICES={v:?}"),
        None => "CUDA_VISIBLE_DEVICES is not set".to_string(),
    };
    if let Some(want) = get(vars, "TCH_DIST_DEVICE") {
        let bad = |msg: String| Error::Env { var: "TCH_DIST_DEVICE".into(), msg };
        return match want.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => match (local_rank, visible_gpus) {
                (_, 0) => Err(bad(format!("asks for CUDA, but no GPU is visible ({})", visible()))),
                (Some(l), n) if l < n => Ok(Device::Cuda(l)),
                (_, 1) => Ok(Device::Cuda(0)),
                (l, n) => Err(bad(format!(
                    "asks for CUDA; LOCAL_RANK={} and {n} GPUs are visible ({}): give cuda:N",
                    l.map_or("unset".to_string(), |l| l.to_string()),
                    visible()
                ))),
            },
            other => match other.strip_prefix("cuda:").and_then(|i| i.parse::<usize>().ok()) {
                Some(i) if i < visible_gpus => Ok(Device::Cuda(i)),
                Some(i) => {
                    Err(bad(format!("asks for cuda:{i}, but {visible_gpus} GPU(s) are visible ({})", visible())))
                }
                None => Err(bad(format!("{other:?} is not cpu, cuda or cuda:N"))),
            },
        };
    }
    match (local_rank, visible_gpus) {
        (_, 0) => Ok(Device::Cpu),
        (Some(l), n) if l < n => Ok(Device::Cuda(l)),
        (_, 1) => Ok(Device::Cuda(0)),
        (l, n) => Err(Error::Env {
            var: "LOCAL_RANK".into(),
            msg: format!(
                "{} with {n} GPUs visible to this process ({}): each process needs a GPU of its own; bind one \
                 GPU per process (CUDA_VISIBLE_DEVICES, --gpus-per-task=1), start at most {n} processes per node, \
                 or set TCH_DIST_DEVICE=cpu to train on the CPU",
                match l {
                    Some(l) => format!("LOCAL_RANK={l} is not below the visible count"),
                    None => "LOCAL_RANK is not set".to_string(),
                },
                visible()
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn slurm_host_lists_give_their_first_host() {
        assert_eq!(first_host("node[01-04,07],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("gpu5,node[1-2]").as_deref(), Some("gpu5"));
        assert_eq!(first_host("rack[1-2]-n[3,5]").as_deref(), Some("rack1-n3"));
        assert_eq!(first_host("a100-[007-009]").as_deref(), Some("a100-007"));
        assert_eq!(first_host("single").as_deref(), Some("single"));
        assert_eq!(first_host("bad[x-y]"), None);
        assert_eq!(first_host("open[1-2"), None);
        assert_eq!(slurm_port("123456"), Some(15000 + 3456));
        assert_eq!(slurm_port("7"), Some(15007));
        assert_eq!(slurm_port("abc"), None);
    }

    #[test]
    fn srun_alone_gives_a_job_rank() {
        let v = vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_STEP_NUM_TASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[003-006]"),
            ("SLURM_JOB_ID", "4242"),
        ]);
        let p = job_rank(&v).unwrap();
        assert_eq!(
            p,
            JobRank {
                launcher: Launcher::Slurm,
                rank: 5,
                world_size: 16,
                local_rank: Some(1),
                master_addr: "gpu003".into(),
                master_port: 19242
            }
        );
        // MASTER_ADDR and MASTER_PORT win; the step's list before the job's
        let v = vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NODELIST", "b[1-2]"),
            ("SLURM_JOB_NODELIST", "a[1-9]"),
            ("MASTER_PORT", "29400"),
        ]);
        let p = job_rank(&v).unwrap();
        assert_eq!((p.master_addr.as_str(), p.master_port), ("b1", 29400));
        let v = vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("MASTER_ADDR", "10.0.0.9"),
            ("SLURM_JOB_ID", "1"),
        ]);
        assert_eq!(job_rank(&v).unwrap().master_addr, "10.0.0.9");
        let v = vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"),
            ("SLURM_JOB_ID", "1"),
        ]);
        assert_eq!(job_rank(&v).unwrap().master_addr, "10.1.2.3");
    }

    #[test]
    fn torchrun_wins_over_slurm_and_mistakes_are_named() {
        // torchrun started under an allocation: its variables are the ones that describe this process
        let v = vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "h0"),
            ("MASTER_PORT", "29500"),
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
        ]);
        let p = job_rank(&v).unwrap();
        assert_eq!((p.launcher, p.rank, p.world_size, p.local_rank), (Launcher::Torchrun, 3, 8, Some(3)));
        let err = |pairs: &[(&str, &str)]| job_rank(&vars(pairs)).unwrap_err().to_string();
        let e = err(&[]);
        assert!(e.contains("RANK") && e.contains("SLURM_PROCID"), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_JOB_NODELIST", "n1"),
            ("SLURM_JOB_ID", "9"),
        ]);
        assert!(e.contains("SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS=2"), "{e}");
        let e = err(&[("SLURM_PROCID", "0"), ("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_JOB_ID", "9")]);
        assert!(
            e.contains("SLURM_STEP_NODELIST") && e.contains("SLURM_JOB_NODELIST") && e.contains("MASTER_ADDR"),
            "{e}"
        );
        let e =
            err(&[("SLURM_PROCID", "0"), ("SLURM_STEP_NUM_TASKS", "0"), ("SLURM_JOB_ID", "9"), ("MASTER_ADDR", "h")]);
        assert!(e.contains("SLURM_STEP_NUM_TASKS") && e.contains("at least 1"), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_JOB_NODELIST", "n[x]"),
            ("SLURM_JOB_ID", "9"),
        ]);
        assert!(e.contains("\"n[x]\""), "{e}");
        let e = err(&[("RANK", "0"), ("WORLD_SIZE", "two"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]);
        assert!(e.contains("WORLD_SIZE") && e.contains("\"two\""), "{e}");
    }

    #[test]
    fn tchrun_under_srun_takes_its_node_from_slurm() {
        assert_eq!(slurm_node(&vars(&[("SLURM_PROCID", "0")])).unwrap(), None);
        // salloc's shell or a batch script: the job's variables, no step: tchrun's defaults hold
        let alloc =
            vars(&[("SLURM_JOB_ID", "77"), ("SLURM_NNODES", "1"), ("SLURM_NTASKS", "8"), ("SLURM_NODEID", "0")]);
        assert_eq!(slurm_node(&alloc).unwrap(), None);
        let v = vars(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_NUM_NODES", "4"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_JOB_NODELIST", "dgx[10-13]"),
        ]);
        let n = slurm_node(&v).unwrap().unwrap();
        assert_eq!(n, SlurmNode { nnodes: 4, node_rank: 2, master_addr: "dgx10".into(), master_port: 15077 });
        let v = vars(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_NODEID", "0"),
            ("SLURM_STEP_NUM_TASKS", "16"),
            ("SLURM_JOB_NODELIST", "dgx[10-11]"),
        ]);
        let e = slurm_node(&v).unwrap_err().to_string();
        assert!(e.contains("16 tasks on 2 nodes") && e.contains("--ntasks-per-node=1"), "{e}");
    }

    #[test]
    fn devices_follow_local_rank_and_one_gpu_bindings_never_falling_to_the_cpu() {
        let none = vars(&[]);
        assert_eq!(device(&none, Some(3), 8).unwrap(), Device::Cuda(3));
        // Slurm's --gpus-per-task=1, a one-GPU pod: LOCAL_RANK 1 sees one GPU, its own
        assert_eq!(device(&none, Some(1), 1).unwrap(), Device::Cuda(0));
        assert_eq!(device(&none, None, 1).unwrap(), Device::Cuda(0));
        assert_eq!(device(&none, Some(5), 0).unwrap(), Device::Cpu);
        let cvd = vars(&[("CUDA_VISIBLE_DEVICES", "0,1")]);
        let e = device(&cvd, Some(2), 2).unwrap_err().to_string();
        assert!(
            e.contains("LOCAL_RANK=2") && e.contains("2 GPUs") && e.contains("CUDA_VISIBLE_DEVICES=\"0,1\""),
            "{e}"
        );
        assert!(e.contains("TCH_DIST_DEVICE=cpu"), "{e}");
        let e = device(&none, None, 4).unwrap_err().to_string();
        assert!(e.contains("LOCAL_RANK is not set") && e.contains("CUDA_VISIBLE_DEVICES is not set"), "{e}");
        // asked for
        let cpu = vars(&[("TCH_DIST_DEVICE", "cpu")]);
        assert_eq!(device(&cpu, Some(2), 2).unwrap(), Device::Cpu);
        let one = vars(&[("TCH_DIST_DEVICE", "cuda:1")]);
        assert_eq!(device(&one, Some(0), 2).unwrap(), Device::Cuda(1));
        assert!(device(&one, Some(0), 1).unwrap_err().to_string().contains("cuda:1"));
        let cuda = vars(&[("TCH_DIST_DEVICE", "cuda")]);
        assert!(device(&cuda, Some(0), 0).unwrap_err().to_string().contains("no GPU is visible"));
        assert!(device(&vars(&[("TCH_DIST_DEVICE", "tpu")]), None, 0).unwrap_err().to_string().contains("\"tpu\""));
    }
}
