//! Merging the ranks' dumps: which collective the job is stuck in, which ranks never entered it, what
//! each rank did last, and where ranks disagree on what a collective is.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::record::{Dump, Entry, EntryState};
use crate::error::{Error, Result};

/// The verdict, one finding per line.
#[derive(Clone, Debug, Default)]
pub struct Analysis {
    pub findings: Vec<String>,
    /// Ranks named as the cause (never entered the collective the others wait in, or died).
    pub culprits: Vec<usize>,
}

impl std::fmt::Display for Analysis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.findings {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

fn describe(e: &Entry) -> String {
    let label = if e.label.is_empty() { String::new() } else { format!(", {}", e.label) };
    format!("#{} {}{label}", e.seq, e.op)
}

/// Reads every `rank<R>.json` in `dir`. `world`: how many ranks the job had (ranks without a dump are
/// named); `exits`: how tchrun saw each rank end, where known.
pub fn analyze(dir: &Path, world: Option<usize>, exits: &BTreeMap<usize, String>) -> Result<Analysis> {
    let mut dumps: BTreeMap<usize, Dump> = BTreeMap::new();
    let read = std::fs::read_dir(dir)
        .map_err(|e| Error::invalid(format!("flight dumps in {}", dir.display()), e.to_string()))?;
    for f in read.flatten() {
        let name = f.file_name().to_string_lossy().to_string();
        if !(name.starts_with("rank") && name.ends_with(".json")) {
            continue;
        }
        let text = std::fs::read_to_string(f.path())
            .map_err(|e| Error::invalid(f.path().display().to_string(), e.to_string()))?;
        let d: Dump = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(f.path().display().to_string(), format!("not a flight dump: {e}")))?;
        // a dump of a rank this job does not have is another job's, left in a reused folder
        if world.is_none_or(|w| d.rank < w) {
            dumps.insert(d.rank, d);
        }
    }
    Ok(merge(&dumps, world, exits))
}

/// The analysis of dumps already read (rank -> dump).
pub(crate) fn merge(dumps: &BTreeMap<usize, Dump>, world: Option<usize>, exits: &BTreeMap<usize, String>) -> Analysis {
    let mut a = Analysis::default();
    let world = world.or_else(|| {
        dumps.values().flat_map(|d| d.entries.iter()).filter(|e| e.group == "default").map(|e| e.group_size).max()
    });
    let missing: Vec<usize> = world.map(|w| (0..w).filter(|r| !dumps.contains_key(r)).collect()).unwrap_or_default();
    if dumps.is_empty() {
        a.findings.push("no flight-recorder dumps to read".into());
    }
    // 1. the collective the others are stuck in: the earliest unfinished one, per group
    let mut stuck: BTreeMap<String, (u64, Entry)> = BTreeMap::new();
    for d in dumps.values() {
        for e in d.entries.iter().filter(|e| e.state != EntryState::Completed) {
            let slot = stuck.entry(e.group.clone()).or_insert((e.seq, e.clone()));
            if e.seq < slot.0 {
                *slot = (e.seq, e.clone());
            }
        }
    }
    // who belongs to each group, in world ranks, as the dumps recorded it
    let members: BTreeMap<&str, &Vec<usize>> =
        dumps.values().flat_map(|d| d.groups.iter()).map(|(g, m)| (g.as_str(), m)).collect();
    let mut culprits = BTreeSet::new();
    // ranks that never entered a collective while they waited in another one: held up, not the cause
    let mut held = BTreeSet::new();
    for (group, (seq, e)) in &stuck {
        let waiting: Vec<String> = dumps
            .values()
            .filter_map(|d| {
                let x = d.entries.iter().find(|x| x.group == *group && x.seq == *seq)?;
                let how = match (&x.state, &x.error) {
                    (EntryState::Failed, Some(err)) => format!("failed: {}", first_clause(err)),
                    _ => "still waiting".into(),
                };
                Some(format!("rank {} ({how})", d.rank))
            })
            .collect();
        a.findings.push(format!(
            "stuck in collective {} of group {group}: entered by {}",
            describe(e),
            waiting.join(", ")
        ));
        // members of the group that never entered it: from their own dumps, or from what the others read
        // of their published progress
        for d in dumps.values() {
            let last = d.entries.iter().filter(|x| x.group == *group).max_by_key(|x| x.seq);
            if let Some(l) = last.filter(|l| l.seq < *seq) {
                // a rank that exited with code 0 finished its loop: the others ran more steps than it
                if exits.get(&d.rank).is_none_or(|s| s != "exit code 0") {
                    culprits.insert(d.rank);
                }
                // its most recent operation, in another group, not finished: it waits there
                let waits = d.entries.last().filter(|x| x.group != *group && x.state != EntryState::Completed);
                let note = match waits {
                    Some(w) => {
                        held.insert(d.rank);
                        format!(" (it waits in {} of group {})", describe(w), w.group)
                    }
                    None => String::new(),
                };
                a.findings.push(format!(
                    "rank {} never entered #{seq}: its last collective in {group} was {}{note}",
                    d.rank,
                    describe(l)
                ));
            }
        }
        if let Some(m) = members.get(group.as_str()).filter(|_| group != "default") {
            for &r in m.iter().filter(|r| !dumps.contains_key(r)) {
                let exit = exits.get(&r).map(|s| format!("; tchrun saw it end with {s}")).unwrap_or_default();
                if exits.get(&r).is_none_or(|s| s != "exit code 0") {
                    culprits.insert(r);
                }
                a.findings.push(format!("rank {r} of {group} left no dump{exit}"));
            }
        }
        if group == "default" {
            for &r in &missing {
                let seen =
                    dumps.values().flat_map(|d| d.peers.iter()).filter(|p| p.rank == r && p.seen).max_by_key(|p| p.seq);
                let exit = exits.get(&r).map(|s| format!("; tchrun saw it end with {s}")).unwrap_or_default();
                let progress = match seen {
                    Some(p) if p.seq == 0 => format!("; it never entered #{seq} (it had published no collective)"),
                    Some(p) if p.seq < *seq => {
                        let label = if p.label.is_empty() { String::new() } else { format!(", {}", p.label) };
                        format!(
                            "; it never entered #{seq}: its last published collective was #{} ({}{label})",
                            p.seq, p.op
                        )
                    }
                    Some(p) => format!("; it had entered #{}", p.seq),
                    None => String::new(),
                };
                // a rank that exited with code 0 finished its loop: the others ran more steps than it
                let finished = exits.get(&r).is_some_and(|s| s == "exit code 0");
                if seen.is_none_or(|p| p.seq < *seq) && !finished {
                    culprits.insert(r);
                }
                a.findings.push(format!("rank {r} left no dump{progress}{exit}"));
            }
        }
    }
    // 2. ranks that disagree on what the same collective is
    let mut by_key: BTreeMap<(String, u64), Vec<(usize, &Entry)>> = BTreeMap::new();
    for d in dumps.values() {
        for e in &d.entries {
            by_key.entry((e.group.clone(), e.seq)).or_default().push((d.rank, e));
        }
    }
    for ((group, seq), list) in by_key {
        // point-to-point messages pair up by sender and receiver, not by sequence number
        if list.iter().any(|(_, e)| super::record::is_p2p(&e.op)) {
            continue;
        }
        let ops: BTreeSet<&str> = list.iter().map(|(_, e)| e.op.as_str()).collect();
        if ops.len() > 1 {
            let who: Vec<String> = list.iter().map(|(r, e)| format!("rank {r}: {}", e.op)).collect();
            a.findings.push(format!("collective #{seq} of group {group} differs between ranks: {}", who.join("; ")));
        }
    }
    // 3. what each rank did last
    for d in dumps.values() {
        if let Some(l) = d.entries.last() {
            a.findings.push(format!(
                "rank {} last recorded {} in group {} ({:?})",
                d.rank,
                describe(l),
                l.group,
                l.state
            ));
        }
    }
    if stuck.is_empty() && !dumps.is_empty() {
        a.findings.push("every recorded collective completed".into());
    }
    // the cause is a rank not held up elsewhere, when there is one (a cycle of waits names them all)
    let free: Vec<usize> = culprits.iter().copied().filter(|r| !held.contains(r)).collect();
    a.culprits = if free.is_empty() { culprits.into_iter().collect() } else { free };
    if !a.culprits.is_empty() {
        let names: Vec<String> = a.culprits.iter().map(|r| format!("rank {r}")).collect();
        a.findings.insert(0, format!("culprit: {}", names.join(", ")));
    }
    a
}

fn first_clause(err: &str) -> &str {
    err.split("; ").next().unwrap_or(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(group: &str, seq: u64, state: EntryState) -> Entry {
        Entry {
            id: seq,
            group: group.into(),
            group_rank: 0,
            group_size: 2,
            seq,
            collective_seq: seq,
            p2p_seq: 0,
            op: "allreduce(Sum) of Float[4] on Cpu".into(),
            backend: "gloo".into(),
            label: String::new(),
            enqueued: 0.0,
            ended: None,
            state,
            error: None,
        }
    }

    fn dump(rank: usize, entries: Vec<Entry>, groups: &[(&str, &[usize])]) -> (usize, Dump) {
        let groups = groups.iter().map(|(g, m)| (g.to_string(), m.to_vec())).collect();
        let d = Dump {
            rank,
            pid: 1,
            host: "h".into(),
            time: 0.0,
            reason: String::new(),
            peers: Vec::new(),
            entries,
            groups,
        };
        (rank, d)
    }

    /// A folder reused from a larger job (tchrun's default folder under a reused pid) holds a dump of a
    /// rank this job does not have: it is not read.
    #[test]
    fn a_dump_of_a_rank_beyond_the_world_is_another_jobs() {
        use EntryState::Failed;
        let dir = std::env::temp_dir().join(format!("tdx-analyze-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (_, old) = dump(2, vec![entry("mesh-tp [2, 3]", 7, Failed)], &[("default", &[0, 1, 2, 3])]);
        std::fs::write(dir.join("rank2.json"), serde_json::to_string(&old).unwrap()).unwrap();
        let (_, mine) = dump(0, vec![entry("default", 3, Failed)], &[("default", &[0, 1])]);
        std::fs::write(dir.join("rank0.json"), serde_json::to_string(&mine).unwrap()).unwrap();
        let a = analyze(&dir, Some(2), &BTreeMap::new()).unwrap().to_string();
        let all = analyze(&dir, None, &BTreeMap::new()).unwrap().to_string();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!a.contains("mesh-tp"), "{a}");
        assert!(all.contains("mesh-tp"), "without a world size every dump is read: {all}");
    }

    /// A 2 x 2 mesh (tp [0, 1], [2, 3]; dp [0, 2], [1, 3]) whose world rank 3 stopped in step 7: rank 2
    /// waits for it in tp, so it never entered dp's #7, where rank 0 waits for it. Rank 3 is the cause,
    /// not rank 2 (held up in tp), and it is named though it left no dump.
    #[test]
    fn a_rank_held_up_in_another_group_is_not_the_cause() {
        use EntryState::{Completed, Failed};
        let (tp, dp) = ("mesh-tp [2, 3]", "mesh-dp [0, 2]");
        let dumps = BTreeMap::from([
            dump(0, vec![entry(dp, 6, Completed), entry(dp, 7, Failed)], &[("default", &[0, 1, 2, 3]), (dp, &[0, 2])]),
            dump(
                2,
                vec![entry(dp, 6, Completed), entry(tp, 7, Failed)],
                &[("default", &[0, 1, 2, 3]), (tp, &[2, 3]), (dp, &[0, 2])],
            ),
        ]);
        let a = merge(&dumps, Some(4), &BTreeMap::new());
        assert_eq!(a.culprits, [3], "{a}");
        let text = a.to_string();
        assert!(text.contains("rank 2 never entered #7") && text.contains("(it waits in #7"), "{text}");
        assert!(text.contains("rank 3 of mesh-tp [2, 3] left no dump"), "{text}");
        // a cycle of waits (each waits in a collective the other never entered) names both
        let pair = "mesh-tp [0, 1]";
        let cycle = BTreeMap::from([
            dump(0, vec![entry(pair, 6, Completed), entry("default", 5, Failed)], &[(pair, &[0, 1])]),
            dump(1, vec![entry("default", 4, Completed), entry(pair, 7, Failed)], &[(pair, &[0, 1])]),
        ]);
        assert_eq!(merge(&cycle, Some(2), &BTreeMap::new()).culprits, [0, 1]);
    }
}
