//! examples/tch_llama.rs, examples/tch_llama_plain.rs (a Llama-style model in one process, tch alone:
//! a fused `c_attn` read in three slices, RMSNorm, rotary embeddings passed to each block, SwiGLU)
//! ported to every layout by `--parallel` degrees, small (2 blocks, 32 features, 4 heads, 16 characters),
//! trained by tch's own `nn::AdamW`:
//! - under DDP 2, FSDP 2, HSDP 2 × 2, TP 2 and TP 2 × FSDP 2, 15 steps give the plain program's losses
//!   within 1e-4, and the loss falls;
//! - saved after 5 steps in one layout with tch's optimizer (`StateDict::tch_optimizer`) and resumed in
//!   another, the next 5 steps give the losses of one process that never stopped, within 1e-4;
//! - the port adds or rewrites at most 15 code lines of the plain program for DDP, FSDP or HSDP, or TP
//!   alone
//!   (`cargo test --test models tch_llama::the_port -- --nocapture` prints the counts).
use crate::common;

const MODEL: [&str; 10] =
    ["--layers", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--batch-size", "8"];

#[test]
fn every_layout_trains_like_one_process() {
    let layouts: [(usize, &[&str]); 5] = [
        (2, &["--parallel", "dp_replicate=2"]),
        (2, &["--parallel", "dp_shard=2"]),
        (4, &["--parallel", "dp_replicate=2,dp_shard=2"]),
        (2, &["--parallel", "tp=2"]),
        (4, &["--parallel", "dp_shard=2,tp=2"]),
    ];
    let args = [&MODEL[..], &["--lr", "0.003", "--steps", "15"]].concat();
    common::layouts_train_like("tch_llama_plain", "tch_llama", &args, 15, &layouts, 1e-4);
}

#[test]
fn tch_s_adamw_saved_in_one_layout_resumes_in_another() {
    let dir = std::env::temp_dir().join(format!("tch-dist-tch-llama-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = common::corpus();
    let run = |procs: usize, layout: &[&str], steps: &str, extra: &[&str], file: &str| {
        let args =
            [&["--corpus", corpus.as_str(), "--lr", "0.003", "--steps", steps][..], &MODEL, layout, extra].concat();
        common::example_losses("tch_llama", procs, &args, &dir.join(file))
    };
    let reference = run(1, &[], "10", &[], "one.txt");
    assert_eq!(reference.len(), 10);
    for (i, (save, resume)) in [
        ((2, &["--parallel", "dp_shard=2"][..]), (2, &["--parallel", "tp=2"][..])),
        ((4, &["--parallel", "dp_replicate=2,dp_shard=2"]), (2, &["--parallel", "dp_replicate=2"])),
    ]
    .into_iter()
    .enumerate()
    {
        let ck = dir.join(format!("ck{i}"));
        let ck = ck.to_str().unwrap();
        let first = run(save.0, save.1, "5", &["--checkpoint", ck], &format!("a{i}.txt"));
        let then = run(resume.0, resume.1, "10", &["--checkpoint", ck, "--resume"], &format!("b{i}.txt"));
        assert_eq!((first.len(), then.len()), (5, 5), "{save:?} -> {resume:?}");
        for (s, (want, got)) in reference.iter().zip(first.iter().chain(&then)).enumerate() {
            assert!((want - got).abs() <= 1e-4, "{save:?} -> {resume:?}, step {s}: one process {want}, resumed {got}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The code lines of a Rust file (comments and blank lines left out, spaces collapsed), each with the
/// features its port tag names: `// [tp fsdp] ...` after the code, or, after a line that opens a block,
/// on the next line for the whole block.
fn code_lines(src: &str) -> Vec<(String, Vec<String>)> {
    let tags = |comment: &str| -> Vec<String> {
        let c = comment.trim();
        match (c.starts_with('['), c.find(']')) {
            (true, Some(end)) => c[1..end].split_whitespace().map(String::from).collect(),
            _ => Vec::new(),
        }
    };
    let lines: Vec<&str> = src.lines().collect();
    let mut out = Vec::new();
    let mut block: Option<(usize, Vec<String>)> = None;
    for (i, raw) in lines.iter().enumerate() {
        let t = raw.trim();
        if t.is_empty() || t.starts_with("//") {
            continue;
        }
        let indent = raw.len() - raw.trim_start().len();
        let (code, mut own) = match t.split_once(" // ") {
            Some((code, comment)) => (code, tags(comment)),
            None => (t, Vec::new()),
        };
        if let Some((_, b)) = &block {
            own.extend(b.iter().cloned());
        }
        if block.as_ref().is_some_and(|(at, _)| *at == indent) {
            block = None;
        } else if block.is_none() && code.ends_with('{') {
            let next = lines.get(i + 1).map(|l| l.trim()).unwrap_or("");
            if let Some(comment) = next.strip_prefix("//") {
                let b = tags(comment);
                if !b.is_empty() {
                    own.extend(b.iter().cloned());
                    block = Some((indent, b));
                }
            }
        }
        out.push((code.split_whitespace().collect::<Vec<_>>().join(" "), own));
    }
    out
}

/// The lines of `port` that are not in a longest common subsequence with `plain`: what the port adds
/// or rewrites. A tagged line is the port's by its tag, so it never pairs with a plain line (an added `}`
/// would otherwise pair with the plain program's and leave another line counted in its place).
fn changed<'a>(plain: &[(String, Vec<String>)], port: &'a [(String, Vec<String>)]) -> Vec<&'a (String, Vec<String>)> {
    let same = |a: &(String, Vec<String>), b: &(String, Vec<String>)| a.0 == b.0 && b.1.is_empty();
    let (n, m) = (plain.len(), port.len());
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] =
                if same(&plain[i], &port[j]) { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while j < m {
        if i < n && same(&plain[i], &port[j]) {
            (i, j) = (i + 1, j + 1);
        } else if i < n && lcs[i + 1][j] >= lcs[i][j + 1] {
            i += 1;
        } else {
            out.push(&port[j]);
            j += 1;
        }
    }
    out
}

#[test]
fn the_port_changes_at_most_15_lines_for_ddp_fsdp_or_tp_alone() {
    let read = |f: &str| std::fs::read_to_string(format!("{}/examples/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let (plain, port) = (read("tch_llama_plain.rs"), read("tch_llama.rs"));
    assert!(!plain.contains("tch_dist"), "the plain program is tch alone");
    let (plain, port) = (code_lines(&plain), code_lines(&port));
    let changed = changed(&plain, &port);
    let known = ["dp", "fsdp", "tp", "flags", "checkpoint"];
    for (line, tags) in &changed {
        assert!(tags.iter().all(|t| known.contains(&t.as_str())), "{line}: tags {tags:?}, known {known:?}");
    }
    // a line without a tag is for every layout; a tagged one for the layouts that need its features
    let count = |features: &[&str]| {
        changed
            .iter()
            .filter(|(_, tags)| tags.is_empty() || tags.iter().any(|t| features.contains(&t.as_str())))
            .count()
    };
    let layouts: [(&str, &[&str]); 5] = [
        ("DDP", &["dp"]),
        ("FSDP or HSDP", &["dp", "fsdp"]),
        ("TP", &["tp"]),
        ("TP with FSDP", &["dp", "fsdp", "tp"]),
        ("every layout, chosen by --parallel", &["dp", "fsdp", "tp", "flags"]),
    ];
    for (name, features) in layouts {
        println!("{name}: {} lines", count(features));
    }
    let ck = changed.iter().filter(|(_, tags)| tags.iter().any(|t| t == "checkpoint")).count();
    println!("a checkpoint of the model and the optimizer in any layout: {ck} more lines");
    println!("all changed lines: {}", changed.len());
    for (name, features) in &layouts[..3] {
        assert!(count(features) <= 15, "{name}: {} lines changed, over 15:\n{changed:#?}", count(features));
    }
    // the counting sees a change: the plain program against itself changes nothing
    assert!(self::changed(&plain, &plain).is_empty() && count(&["dp"]) > 0);
}
