//! The first lines tchrun prints after a failed attempt: which rank caused it, and that rank's error line.
//! The cause is the flight recorder's culprit when the dumps name one, else the first rank to fail; a
//! rank that exited with code 0 is never it (it finished its loop: the others ran more steps than it).
use std::collections::BTreeMap;

use tch_dist::flight::Analysis;

pub(super) fn exited_normally(how: &str) -> bool {
    how == "exit code 0"
}

/// How a worker's exit reads when tchrun stopped it (it did not end on its own).
pub(super) const STOPPED: &str = ", after tchrun stopped it";

/// Whether an error line only says that a peer went away (a connection closed under a collective, the
/// store gone): what a rank meets when another failed, not a failure of its own.
fn lost_a_peer(line: &str) -> bool {
    const SAYS: [&str; 12] = [
        "Connection closed by peer",
        "Connection closed by remote peer",
        "Connection reset by peer",
        "Connection refused",
        "Broken pipe",
        "failed to recv, got 0 bytes",
        "remote process exited",
        "peer gone",
        "the store went away",
        "connection broke",
        "timed out after",
        "Application timeout caused pair closure",
    ];
    SAYS.iter().any(|s| line.contains(s))
}

/// The headline: `culprit: rank R (why named): <its error line>`, and a hint when ranks ended their loops
/// at different steps.
pub(super) fn headline(
    first_failed: usize,
    analysis: Option<&Analysis>,
    tails: &BTreeMap<usize, Vec<String>>,
    exits: &BTreeMap<usize, String>,
) -> Vec<String> {
    let done: Vec<usize> = exits.iter().filter(|(_, how)| exited_normally(how)).map(|(&r, _)| r).collect();
    let named: Vec<usize> =
        analysis.map(|a| a.culprits.iter().copied().filter(|r| !done.contains(r)).collect()).unwrap_or_default();
    // a rank the recorder names (it never entered a collective) whose own error says it waited on a rank
    // that failed was held up by that one (a pipeline stage waiting for its neighbour)
    let passed: Vec<Option<usize>> =
        named.iter().map(|r| tails.get(r).and_then(|t| error_line(t)).and_then(|l| passed_on(&l))).collect();
    let through_errors = named.iter().zip(&passed).any(|(r, p)| p.is_some_and(|p| p != *r));
    let mut named: Vec<usize> = named.iter().zip(&passed).map(|(&r, p)| p.unwrap_or(r)).collect();
    named.sort_unstable();
    named.dedup();
    let told = named_in_errors(tails).filter(|r| !done.contains(r));
    named = not_stopped_beside_failed(named, tails, exits);
    let on_its_own = |r: &usize| exits.get(r).is_some_and(|how| !how.ends_with(STOPPED) && !exited_normally(how));
    // the first to fail may only have lost a peer (under tensor parallelism no dump names anyone): the one
    // other rank that failed on its own with an error of its own is the cause. Not when several did, nor
    // when a rank ended on its own by a signal with nothing printed (killed: it may be the cause).
    let line_of = |r: usize| tails.get(&r).and_then(|t| error_line(t));
    let silent_kill = exits.iter().any(|(r, how)| on_its_own(r) && how.starts_with("signal") && line_of(*r).is_none());
    let own: Vec<usize> = exits
        .keys()
        .copied()
        .filter(|&r| r != first_failed && on_its_own(&r) && line_of(r).is_some_and(|l| !lost_a_peer(&l)))
        .collect();
    let cause = match (line_of(first_failed), &own[..]) {
        (Some(l), [one]) if lost_a_peer(&l) && !silent_kill => Some(*one),
        _ => None,
    };
    // the recorder names every rank that never entered a collective (all of a subgroup's members when a
    // rank outside it waits); the ranks' own errors say which one of them caused it
    let picked = told.filter(|t| named.len() > 1 && named.contains(t));
    if let Some(t) = picked {
        named = vec![t];
    }
    let (culprits, why) = match (named.is_empty(), told) {
        (false, _) if through_errors || picked.is_some() => {
            (named, "named by the flight recorder and the ranks' errors")
        }
        (false, _) => (named, "named by the flight recorder"),
        (true, Some(r)) => (vec![r], "named in the ranks' errors"),
        (true, None) => match cause {
            Some(c) => (vec![c], "failed with an error of its own; the first to fail had lost a peer"),
            None => (vec![first_failed], "the first to fail"),
        },
    };
    let mut lines = Vec::new();
    for r in culprits {
        let ended = exits.get(&r).map_or(String::new(), |how| format!("; it ended with {how}"));
        let error = tails.get(&r).and_then(|t| error_line(t));
        let error = error.unwrap_or_else(|| format!("no error line in its output{ended}"));
        // the rank that found it says why (an agreement check's odd one out), where the culprit's own
        // line is only what it met next (a peer gone)
        let why_line =
            tails.iter().filter(|(&k, _)| k != r).filter_map(|(&k, t)| error_line(t).map(|l| (k, l))).find(|(_, l)| {
                (names_odd_one(l, r) && !error.contains("the odd one out"))
                    || (blamed_by_world_rank(l) == Some(r) && !error.starts_with("Error: "))
            });
        lines.push(format!("culprit: rank {r} ({why}): {error}"));
        if let Some((k, l)) = why_line {
            lines.push(format!("why: rank {k} found it: {l}"));
        }
    }
    if !done.is_empty() {
        let names: Vec<String> = done.iter().map(|r| format!("rank {r}")).collect();
        lines.push(format!(
            "{} exited normally (exit code 0) while other ranks still ran collectives: the ranks ran different \
             numbers of steps. For uneven inputs, run DDP's loop inside `ddp.join(..)`, or give every rank the \
             same number of batches (`DistributedSampler` pads to equal counts)",
            names.join(", ")
        ));
    }
    lines
}

/// `named` without the ranks tchrun stopped that printed no error, when one of them failed on its own:
/// the recorder names every rank that never entered a collective, the ones tchrun stopped among them.
/// A rank the ranks' errors blame is kept (a hung rank tchrun stopped, which the others' timeouts name).
pub(super) fn not_stopped_beside_failed(
    mut named: Vec<usize>,
    tails: &BTreeMap<usize, Vec<String>>,
    exits: &BTreeMap<usize, String>,
) -> Vec<usize> {
    let on_its_own = |r: &usize| exits.get(r).is_some_and(|how| !how.ends_with(STOPPED) && !exited_normally(how));
    let told = named_in_errors(tails);
    if named.iter().any(on_its_own) {
        named.retain(|r| on_its_own(r) || told == Some(*r) || tails.get(r).and_then(|t| error_line(t)).is_some());
    }
    named
}

/// Whether `line` names rank `r` as an agreement check's odd one out (rank 1, not rank 12).
fn names_odd_one(line: &str, r: usize) -> bool {
    odd_one_in(line) == Some(r)
}

/// The world rank an agreement check names as the odd one out: `the odd one out: rank 1`, or in a
/// subgroup `the odd one out: rank 2 (world rank 3)`.
fn odd_one_in(line: &str) -> Option<usize> {
    const MARK: &str = "the odd one out: rank ";
    let rest = &line[line.find(MARK)? + MARK.len()..];
    let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    let group_rank = rest[..digits].parse().ok()?;
    let world = rest[digits..].strip_prefix(" (world rank ").and_then(|w| {
        let end = w.find(|c: char| !c.is_ascii_digit())?;
        w[..end].parse().ok()
    });
    Some(world.unwrap_or(group_rank))
}

/// The world rank a group's error blames: `rank 1 (world rank 3) of group dp [2, 3] has published no
/// heartbeat`, `... never entered collective #4`, `... left group`, `... entered #4 but`; a rank named
/// without its world rank is one whose rank is the same in the world. A rank's own place
/// (`on rank 0 (world rank 2) of 2`) is not blame.
fn blamed_by_world_rank(line: &str) -> Option<usize> {
    const BLAMES: [&str; 4] = [" of group ", " never entered", " left group", " entered #"];
    let number = |s: &str| -> Option<(usize, usize)> {
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        Some((s[..end].parse().ok()?, end))
    };
    line.match_indices("rank ").find_map(|(at, m)| {
        let rest = &line[at + m.len()..];
        let (r, end) = number(rest)?;
        let after = &rest[end..];
        let (r, after) = match after.strip_prefix(" (world rank ") {
            Some(w) => {
                let (w, end) = number(w)?;
                (w, after[" (world rank ".len() + end..].strip_prefix(')')?)
            }
            None => (r, after),
        };
        BLAMES.iter().any(|b| after.starts_with(b)).then_some(r)
    })
}

/// A rank the ranks' own error lines blame: a peer a subgroup's error names by its world rank, the one a
/// passed-on failure names (`rank 1 failed: ...`, a pipeline stage or a checkpoint), or the odd one out
/// of an agreement check.
fn named_in_errors(tails: &BTreeMap<usize, Vec<String>>) -> Option<usize> {
    // a blamed rank whose own error passes on another's failure was only waiting for that one
    let own = |r: usize| tails.get(&r).and_then(|t| error_line(t)).and_then(|l| passed_on(&l)).unwrap_or(r);
    let lines: Vec<String> = tails.values().filter_map(|t| error_line(t)).collect();
    let failed = lines.iter().find_map(|l| passed_on(l));
    let blamed = lines.iter().find_map(|l| blamed_by_world_rank(l)).map(own);
    blamed.or(failed).or_else(|| lines.iter().find_map(|l| odd_one_in(l)))
}

/// The rank whose failure an error line passes on: the innermost of a chain (`rank 1 failed: ... rank 2
/// failed: ...`).
fn passed_on(line: &str) -> Option<usize> {
    let at = line.rfind(" failed: ")?;
    let head = &line[..at];
    let r = head.rfind("rank ")?;
    head[r + 5..].parse().ok()
}

/// The line of a rank's output that says what went wrong: the last `Error: ` line (a `main` that returned
/// an error), else a panic's message, else C++'s `what():`; never a backtrace frame. A libtorch message
/// printed with its frames (`Torch("... \nException raised from ...")`) keeps its first line only.
pub(super) fn error_line(tail: &[String]) -> Option<String> {
    let first_line = |l: &str| l.split("\\n").next().unwrap_or(l).trim_end().to_string();
    if let Some(l) = tail.iter().rev().find(|l| l.starts_with("Error: ")) {
        return Some(first_line(l));
    }
    // a panic: "thread 'main' panicked at src/main.rs:3:5:" and its message on the next line
    if let Some(i) = tail.iter().rposition(|l| l.contains("panicked at")) {
        let msg = tail.get(i + 1).filter(|m| !is_frame(m)).map_or("", |m| m.as_str());
        return Some(first_line(&format!("{} {msg}", tail[i].trim())));
    }
    // a command-line parser's refusal (clap's `error: ...`)
    if let Some(l) = tail.iter().rev().find(|l| l.starts_with("error: ")) {
        return Some(first_line(l));
    }
    tail.iter().rev().find(|l| l.contains("what():")).map(|l| first_line(l.trim()))
}

/// A backtrace or C++ stack frame, or the note that introduces one.
pub(super) fn is_frame(l: &str) -> bool {
    let t = l.trim_start();
    // Rust's frames are indented (`   3: name`, `             at file:line`); a program's own `3: ...` is not
    let indented = t.len() < l.len();
    t.starts_with("frame #")
        || (indented && t.starts_with("at "))
        || t.starts_with("Exception raised from")
        || t.starts_with("note: run with `RUST_BACKTRACE")
        || t == "stack backtrace:"
        || t == "Stack backtrace:"
        || (indented && t.split_once(": ").is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_error_line_is_found_behind_frames() {
        let t = lines(&[
            "step 3",
            r#"Error: Torch("The size of tensor a (4) must match the size of tensor b (3)\nException raised from infer_size at ...")"#,
            "   0: std::backtrace::Backtrace::create",
            "             at /rustc/library/std/src/backtrace.rs:331:13",
            "frame #3: at::native::add + 0x12 (0x7f in libtorch_cpu.so)",
        ]);
        assert_eq!(
            error_line(&t).as_deref(),
            Some(r#"Error: Torch("The size of tensor a (4) must match the size of tensor b (3)"#)
        );
        let p = lines(&["thread 'main' panicked at src/main.rs:9:5:", "boom", "note: run with `RUST_BACKTRACE=1`"]);
        assert_eq!(error_line(&p).as_deref(), Some("thread 'main' panicked at src/main.rs:9:5: boom"));
        assert_eq!(error_line(&lines(&["   0: main", "step 1"])), None);
        // a command-line parser's refusal, and a program's own numbered line that is not a frame
        let clap = lines(&["error: invalid value 'fsdp=2' for '--parallel <PARALLEL>': no degree", "", "For more"]);
        assert_eq!(
            error_line(&clap).as_deref(),
            Some("error: invalid value 'fsdp=2' for '--parallel <PARALLEL>': no degree")
        );
        assert!(
            !is_frame("3: loss 1.25") && is_frame("   3: main") && !is_frame("at step 3") && is_frame("   at x.rs:1")
        );
    }

    #[test]
    fn a_rank_that_only_lost_a_peer_gives_way_to_the_one_that_failed() {
        // tensor parallelism: rank 1 panics in its loss, rank 0's all-reduce loses it; both end between
        // two polls, and no dump names anyone
        let tails = BTreeMap::from([
            (0, lines(&["thread 'main' panicked at src/tensor.rs:300:27:", "called `Result::unwrap()` on an `Err` value: Torch(\"[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer [127.0.0.1]:1234\")"])),
            (1, lines(&["thread 'main' panicked at src/bin/mistakes.rs:164:13:", "deliberate panic in the loss"])),
        ]);
        let exits = BTreeMap::from([(0, "exit code 101".to_string()), (1, "exit code 101".to_string())]);
        let h = headline(0, None, &tails, &exits);
        assert!(
            h[0].starts_with("culprit: rank 1 (failed with an error of its own") && h[0].contains("deliberate"),
            "{h:?}"
        );
        // a peer loss with no other failure stays the first to fail
        let alone = BTreeMap::from([(0, tails[&0].clone())]);
        let h = headline(0, None, &alone, &BTreeMap::from([(0, "exit code 101".to_string())]));
        assert!(h[0].starts_with("culprit: rank 0 (the first to fail)"), "{h:?}");
    }

    #[test]
    fn a_hung_rank_that_the_errors_blame_stays_named_though_tchrun_stopped_it() {
        // subgroup [1, 2]: rank 1 hangs (stopped by tchrun, nothing printed), rank 2 times out naming it
        let a = Analysis { findings: vec![], culprits: vec![1, 2] };
        let tails = BTreeMap::from([
            (1, lines(&["step 4"])),
            (2, lines(&["Error: allreduce on rank 1 (world rank 2) of 2: rank 0 (world rank 1) of group g [1, 2] never entered #5"])),
        ]);
        let exits = BTreeMap::from([(1, format!("signal 15 (SIGTERM){STOPPED}")), (2, "exit code 1".to_string())]);
        let h = headline(2, Some(&a), &tails, &exits);
        assert!(h[0].starts_with("culprit: rank 1 "), "{h:?}");
    }

    #[test]
    fn a_peer_loss_is_not_passed_over_when_two_ranks_failed_otherwise_or_one_was_killed() {
        let lost = lines(&["Error: allreduce: Connection closed by peer [127.0.0.1]:1"]);
        let tails = BTreeMap::from([(0, lost.clone()), (1, lines(&["Error: one"])), (2, lines(&["Error: two"]))]);
        let failed = |n: usize| (0..n).map(|r| (r, "exit code 1".to_string())).collect::<BTreeMap<_, _>>();
        assert!(headline(0, None, &tails, &failed(3))[0].starts_with("culprit: rank 0 (the first to fail)"));
        let killed = BTreeMap::from([(0, lost), (1, lines(&["Error: one"])), (2, lines(&["step 3"]))]);
        let mut exits = failed(2);
        exits.insert(2, "signal 9 (SIGKILL)".to_string());
        assert!(headline(0, None, &killed, &exits)[0].starts_with("culprit: rank 0 (the first to fail)"));
    }

    #[test]
    fn a_rank_tchrun_stopped_is_not_named_beside_the_one_that_failed() {
        let a = Analysis { findings: vec![], culprits: vec![1, 2] };
        let tails = BTreeMap::from([(1, lines(&["Error: boom"])), (2, lines(&["step 4"]))]);
        let exits = BTreeMap::from([(1, "exit code 1".to_string()), (2, format!("signal 15 (SIGTERM){STOPPED}"))]);
        let h = headline(1, Some(&a), &tails, &exits);
        assert_eq!(h, vec!["culprit: rank 1 (named by the flight recorder): Error: boom"], "{h:?}");
    }

    #[test]
    fn a_rank_that_exited_normally_is_never_the_culprit() {
        let a = Analysis { findings: vec![], culprits: vec![0] };
        let tails = BTreeMap::from([(0, lines(&["done"])), (1, lines(&["Error: lost rank 0"]))]);
        let exits = BTreeMap::from([(0, "exit code 0".to_string()), (1, "exit code 1".to_string())]);
        let h = headline(1, Some(&a), &tails, &exits);
        assert_eq!(h[0], "culprit: rank 1 (the first to fail): Error: lost rank 0");
        assert!(h[1].starts_with("rank 0 exited normally") && h[1].contains("ddp.join"), "{h:?}");
        let passed_on = BTreeMap::from([
            (0, lines(&["Error: pipeline stage 0 waiting for Grad of microbatch 0: rank 1 failed: rank 1: bad"])),
            (1, lines(&["Error: pipeline stage 1: bad"])),
        ]);
        let h = headline(0, None, &passed_on, &BTreeMap::new());
        assert_eq!(h[0], "culprit: rank 1 (named in the ranks' errors): Error: pipeline stage 1: bad");
        let odd = BTreeMap::from([(0, lines(&["Error: x: mismatch: ...; the odd one out: rank 2; call sites: ..."]))]);
        assert!(
            headline(0, None, &odd, &BTreeMap::new())[0].starts_with("culprit: rank 2 (named in the ranks' errors)")
        );
        // the culprit's own line is what it met next; the finder's line, which says why, follows
        let found = BTreeMap::from([
            (0, lines(&["Error: recv: peer gone or unreachable: Connection closed by peer"])),
            (1, lines(&["Error: y: mismatch: ...; the odd one out: rank 0, which called FSDP state_dict alone"])),
        ]);
        let h = headline(1, Some(&Analysis { findings: vec![], culprits: vec![0] }), &found, &BTreeMap::new());
        assert!(h[0].starts_with("culprit: rank 0 (named by the flight recorder): Error: recv"), "{h:?}");
        assert!(h[1].starts_with("why: rank 1 found it: Error: y") && h[1].contains("state_dict alone"), "{h:?}");
        assert!(names_odd_one("x; the odd one out: rank 1, y", 1) && !names_odd_one("the odd one out: rank 12", 1));
        // the recorder names rank 1 (it never entered a collective), whose own error says it waited on rank 3
        let a1 = Analysis { findings: vec![], culprits: vec![1] };
        let held = BTreeMap::from([
            (
                1,
                lines(&[
                    "Error: pipeline stage 0 waiting for Grad of microbatch 0: rank 3 failed: pipeline stage 1: bad",
                ]),
            ),
            (3, lines(&["Error: pipeline stage 1: bad"])),
        ]);
        let h = headline(0, Some(&a1), &held, &BTreeMap::new());
        assert_eq!(
            h[0],
            "culprit: rank 3 (named by the flight recorder and the ranks' errors): Error: pipeline stage 1: bad"
        );
        // a subgroup's error names the stopped peer by its world rank, through a passed-on failure
        let stopped = BTreeMap::from([
            (
                0,
                lines(&["Error: pipeline stage 0: rank 2 failed: DDP forward on rank 0 (world rank 2) of 2: peer \
                gone or unreachable: rank 1 (world rank 3) of group dp [2, 3] has published no heartbeat for 3.0s"]),
            ),
            (
                2,
                lines(&["Error: DDP forward on rank 0 (world rank 2) of 2: peer gone or unreachable: rank 1 (world \
                rank 3) of group dp [2, 3] has published no heartbeat for 3.0s"]),
            ),
            (3, lines(&["step 2"])),
        ]);
        let h = headline(0, None, &stopped, &BTreeMap::new());
        assert!(h[0].starts_with("culprit: rank 3 (named in the ranks' errors): no error line"), "{h:?}");
        assert!(h[1].starts_with("why: rank 0 found it: Error: pipeline stage 0"), "{h:?}");
        assert_eq!(blamed_by_world_rank("x on rank 0 (world rank 2) of 2 (gloo)"), None);
        assert_eq!(blamed_by_world_rank("rank 0 of group mesh-dp [0, 2] has published no heartbeat"), Some(0));
        assert_eq!(blamed_by_world_rank("DDP forward on rank 1 of 2: rank 0 never entered #3"), Some(0));
        assert_eq!(blamed_by_world_rank("rank 1 (world rank 12) never entered collective #3"), Some(12));
        // a subgroup [1, 2, 3] disagrees; the recorder names all three (rank 0, outside it, waited), the
        // errors the odd one out by its world rank
        let all3 = Analysis { findings: vec![], culprits: vec![1, 2, 3] };
        let odd =
            "Error: allreduce: mismatch: ranks disagree on dtype/shape: ...; the odd one out: rank 2 (world rank 3)";
        let shape = BTreeMap::from([(1, lines(&[odd])), (2, lines(&[odd])), (3, lines(&[odd]))]);
        let h = headline(1, Some(&all3), &shape, &BTreeMap::new());
        assert_eq!(h.iter().filter(|l| l.starts_with("culprit: ")).count(), 1, "{h:?}");
        assert!(h[0].starts_with("culprit: rank 3 (named by the flight recorder and the ranks' errors)"), "{h:?}");
        assert_eq!(odd_one_in("the odd one out: rank 1, y"), Some(1));
        let exits = BTreeMap::from([(0, "exit code 1".to_string()), (1, "signal 15 (SIGTERM)".to_string())]);
        let h = headline(1, Some(&a), &tails, &exits);
        assert_eq!(h, vec!["culprit: rank 0 (named by the flight recorder): no error line in its output; it ended with exit code 1"
            .to_string()]);
    }
}
