//! The environment, read here and nowhere else in the library: every `TCH_DIST_*` variable, and the
//! launcher's (torchrun's, tchrun's, Slurm's) through [`lookup`]. Each setting has one parser, and a
//! value it cannot read is an error naming the variable, never silently the default. Options structs'
//! `Default`s read nothing; [`GroupOptions::from_env`](crate::GroupOptions::from_env),
//! [`InitOptions::from_env`](crate::InitOptions::from_env) and the `from_env` of fault tolerance's
//! manager apply these. docs/process-groups.md has the table of every variable.
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::group::policy::{CheckPolicy, Collectives};

/// A variable as the process's environment has it: `None` when unset or blank (a value that is not
/// UTF-8 is taken as written, its odd bytes replaced, so that a parser names it rather than skip it).
pub(crate) fn lookup(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()).filter(|v| !v.trim().is_empty())
}

/// A directory the environment names, as the OS gives it.
fn dir(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// A word setting, trimmed and lowercased.
fn word(var: &str) -> Option<String> {
    lookup(var).map(|v| v.trim().to_ascii_lowercase())
}

fn bad(var: &str, msg: String) -> Error {
    Error::Env { var: var.into(), msg }
}

/// A number of seconds: positive, or also 0 where `zero` says what 0 means; `None` when unset.
pub(crate) fn seconds(var: &str, v: Option<String>, zero: Option<&str>) -> Result<Option<Duration>> {
    let Some(v) = v else { return Ok(None) };
    match v.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() && s < 1e12 => Ok(Some(Duration::from_secs_f64(s))),
        Ok(s) if s == 0.0 && zero.is_some() => Ok(Some(Duration::ZERO)),
        _ => Err(bad(
            var,
            match zero {
                Some(z) => format!("{v:?} is not a number of seconds (0 {z})"),
                None => format!("{v:?} is not a positive number of seconds"),
            },
        )),
    }
}

/// `1`/`true`/`on`/`yes` or `0`/`false`/`off`/`no`, in any case; `None` when unset.
fn switch(var: &str) -> Result<Option<bool>> {
    match word(var).as_deref() {
        None => Ok(None),
        Some("1" | "true" | "on" | "yes") => Ok(Some(true)),
        Some("0" | "false" | "off" | "no") => Ok(Some(false)),
        Some(v) => Err(bad(var, format!("{v:?} is not 1/true/on/yes or 0/false/off/no"))),
    }
}

/// `TCH_DIST_VERIFY`: agreement checks off (`0`, `false`, `off`), on (`1`, `true`, `on`), or on with a
/// policy (`always`, `once`), in any case; `None` when unset.
pub(crate) fn verify() -> Result<Option<(bool, Option<CheckPolicy>)>> {
    const VAR: &str = "TCH_DIST_VERIFY";
    Ok(match word(VAR).as_deref() {
        None => None,
        Some("0" | "false" | "off" | "no") => Some((false, None)),
        Some("1" | "true" | "on" | "yes") => Some((true, None)),
        Some("always") => Some((true, Some(CheckPolicy::Always))),
        Some("once") => Some((true, Some(CheckPolicy::Once))),
        Some(v) => return Err(bad(VAR, format!("{v:?} is not 0/off/no, 1/on/yes, always or once"))),
    })
}

/// `TCH_DIST_STRICT_NCCL`: the strict NCCL mode of the groups built from the environment.
pub(crate) fn strict_nccl() -> Result<Option<bool>> {
    switch("TCH_DIST_STRICT_NCCL")
}

/// `TCH_DIST_COLLECTIVES`: `auto`, `native` or `ring`.
pub(crate) fn collectives() -> Result<Option<Collectives>> {
    const VAR: &str = "TCH_DIST_COLLECTIVES";
    Ok(match word(VAR).as_deref() {
        None => None,
        Some("auto") => Some(Collectives::Auto),
        Some("native") => Some(Collectives::Native),
        Some("ring") => Some(Collectives::Ring),
        Some(v) => return Err(bad(VAR, format!("{v:?} is not auto, native or ring"))),
    })
}

/// `TCH_DIST_HEARTBEAT_TIMEOUT_SECS`: `Some(None)` turns the heartbeat timeout off (0).
pub(crate) fn heartbeat_timeout() -> Result<Option<Option<Duration>>> {
    const VAR: &str = "TCH_DIST_HEARTBEAT_TIMEOUT_SECS";
    Ok(seconds(VAR, lookup(VAR), Some("turns the heartbeat timeout off"))?.map(|d| Some(d).filter(|d| !d.is_zero())))
}

/// `TCH_DIST_TIMEOUT_SECS`: the collective timeout, from the launcher's or `lookup`'s variables.
pub(crate) fn timeout(vars: &dyn Fn(&str) -> Option<String>) -> Result<Option<Duration>> {
    const VAR: &str = "TCH_DIST_TIMEOUT_SECS";
    seconds(VAR, vars(VAR), None)
}

/// `TCH_DIST_HOSTNAME`: the address Gloo binds (`tchrun --local-addr`).
pub(crate) fn hostname(vars: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    vars("TCH_DIST_HOSTNAME")
}

/// `TCH_DIST_TRACE_DIR`: where the flight recorder dumps.
pub(crate) fn trace_dir() -> Option<PathBuf> {
    dir("TCH_DIST_TRACE_DIR")
}

/// The flight recorder's entries: `TCH_DIST_TRACE_ENTRIES`, else PyTorch's names for it
/// (`TORCH_FR_BUFFER_SIZE`, the older `TORCH_NCCL_TRACE_BUFFER_SIZE`); 2000 by default, 0 turns it off.
/// Read once, where the ring is made: the first one set decides; a bad value there is reported and the
/// default used.
pub(crate) fn trace_entries() -> usize {
    for var in ["TCH_DIST_TRACE_ENTRIES", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"] {
        if let Some(v) = lookup(var) {
            return v.trim().parse().unwrap_or_else(|_| {
                eprintln!("tch-dist: {var}={v:?} is not a count of entries; the default 2000 is used");
                2000
            });
        }
    }
    2000
}

/// `TCH_DIST_TIMELINE_DIR`: where each rank's timeline is written at exit.
pub(crate) fn timeline_dir() -> Option<PathBuf> {
    dir("TCH_DIST_TIMELINE_DIR")
}

/// `TCH_DIST_TIMELINE_EVENTS`: the most events a timeline keeps (100,000 by default). Read once, where the
/// timeline starts: a bad value there is reported and the default used.
pub(crate) fn timeline_events() -> usize {
    const VAR: &str = "TCH_DIST_TIMELINE_EVENTS";
    match lookup(VAR).map(|v| (v.trim().parse(), v)) {
        None => 100_000,
        Some((Ok(n), _)) => n,
        Some((Err(_), v)) => {
            eprintln!("tch-dist: {VAR}={v:?} is not a count of events; the default 100000 is used");
            100_000
        }
    }
}

/// The launcher's `RANK`, for naming a rank's files.
pub(crate) fn launch_rank() -> Option<usize> {
    lookup("RANK").and_then(|r| r.trim().parse().ok())
}

/// torchrun's (and tchrun's) `GROUP_RANK` and `LOCAL_WORLD_SIZE`, when set.
pub(crate) fn node_and_per_node() -> (Option<usize>, Option<usize>) {
    let var = |v: &str| lookup(v).and_then(|s| s.trim().parse().ok());
    (var("GROUP_RANK"), var("LOCAL_WORLD_SIZE"))
}

/// `TCH_DIST_REPLICA_ID` and `TCH_DIST_LIGHTHOUSE` (fault tolerance; `tchrun --replica-id --lighthouse`).
pub(crate) fn replica() -> Result<(String, String)> {
    let need =
        |v: &str| lookup(v).ok_or_else(|| bad(v, "is not set (tchrun --replica-id and --lighthouse set it)".into()));
    Ok((need("TCH_DIST_REPLICA_ID")?, need("TCH_DIST_LIGHTHOUSE")?))
}

/// A fault tolerance timeout: `TCH_DIST_FT_TIMEOUT_SECS`, `TCH_DIST_FT_QUORUM_TIMEOUT_SECS` or
/// `TCH_DIST_FT_PEER_HEARTBEAT_SECS`.
pub(crate) fn ft_seconds(var: &str) -> Result<Option<Duration>> {
    seconds(var, lookup(var), None)
}

/// Tests of healing: the fault `TCH_DIST_FT_FAULT` names, on a worker's first start only
/// (`TORCHELASTIC_RESTART_COUNT` unset or 0).
#[cfg(feature = "testing")]
pub(crate) fn ft_fault() -> Option<String> {
    let first_start = lookup("TORCHELASTIC_RESTART_COUNT").is_none_or(|c| c.trim() == "0");
    lookup("TCH_DIST_FT_FAULT").filter(|_| first_start)
}

#[cfg(test)]
mod tests {
    use super::seconds;
    use std::time::Duration;

    #[test]
    fn seconds_are_read_one_way_and_a_bad_value_names_its_variable() {
        let s = |v: &str, zero| seconds("X_SECS", Some(v.to_string()), zero);
        assert_eq!(s("1.5", None).unwrap(), Some(Duration::from_millis(1500)));
        assert_eq!(s(" 2 ", None).unwrap(), Some(Duration::from_secs(2)));
        assert_eq!(s("0", Some("turns it off")).unwrap(), Some(Duration::ZERO));
        for v in ["0", "-1", "ten", "inf", "NaN"] {
            let e = s(v, None).unwrap_err().to_string();
            assert!(e.contains("X_SECS") && e.contains("positive number of seconds"), "{v}: {e}");
        }
        assert!(s("x", Some("turns it off")).unwrap_err().to_string().contains("(0 turns it off)"));
        assert_eq!(seconds("X_SECS", None, None).unwrap(), None);
    }
}
