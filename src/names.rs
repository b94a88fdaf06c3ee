//! Names close to a name that matched nothing (a style pattern, a checkpoint's tensor), for errors that
//! suggest what was meant.

/// Edit distance from `pattern` (its stars dropped) to `path`, where a leading star lets the pattern start
/// anywhere in the path and a trailing one end anywhere.
pub(crate) fn distance(pattern: &str, path: &str) -> usize {
    let p: Vec<char> = pattern.chars().filter(|&c| c != '*').collect();
    let s: Vec<char> = path.chars().collect();
    let (free_start, free_end) = (pattern.starts_with('*'), pattern.ends_with('*'));
    // row j: the cost of the pattern's first i characters against the path's first j
    let mut row: Vec<usize> = (0..=s.len()).map(|j| if free_start { 0 } else { j }).collect();
    for (i, &pc) in p.iter().enumerate() {
        let mut next = vec![i + 1; s.len() + 1];
        for (j, &sc) in s.iter().enumerate() {
            next[j + 1] = (row[j] + usize::from(pc != sc)).min(row[j + 1] + 1).min(next[j] + 1);
        }
        row = next;
    }
    if free_end {
        row.into_iter().min().unwrap_or(0)
    } else {
        row[s.len()]
    }
}

/// The (at most 3) paths of `built` closest to `pattern`, one per last component.
pub(crate) fn closest(pattern: &str, built: &[String]) -> Vec<String> {
    let mut ranked: Vec<(usize, &String)> = built.iter().map(|b| (distance(pattern, b), b)).collect();
    ranked.sort();
    let mut out: Vec<String> = Vec::new();
    for (_, b) in ranked {
        let last = |x: &str| x.rsplit('.').next().unwrap_or(x).to_string();
        if !out.iter().any(|o| last(o) == last(b)) {
            out.push(b.clone());
        }
        if out.len() == 3 {
            break;
        }
    }
    out
}
