//! Timelines of pipeline steps: Chrome's trace-event JSON (chrome://tracing, Perfetto) and a PNG picture
//! in which the bubble is the white space.
use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// One forward or backward of one microbatch-chunk on one stage; times in seconds (wall clock).
#[derive(Clone, Debug, PartialEq)]
pub struct ActionSpan {
    pub stage: usize,
    pub forward: bool,
    pub mb: usize,
    pub chunk: usize,
    pub start: f64,
    pub end: f64,
}

/// Idle share of the stages' time between the first start and the last end.
pub fn bubble_fraction(spans: &[ActionSpan], stages: usize) -> f64 {
    if spans.is_empty() || stages == 0 {
        return 0.0;
    }
    let t0 = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
    let t1 = spans.iter().map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
    let busy: f64 = spans.iter().map(|s| s.end - s.start).sum();
    1.0 - busy / (stages as f64 * (t1 - t0))
}

/// Writes `spans` as Chrome trace events: one row (thread) per stage, one complete event per span.
pub fn write_chrome_trace(path: &Path, spans: &[ActionSpan]) -> Result<()> {
    let io = |e: std::io::Error| Error::invalid(format!("write trace {}", path.display()), e.to_string());
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let t0 = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
    writeln!(f, "{{\"traceEvents\":[").map_err(io)?;
    for (i, s) in spans.iter().enumerate() {
        let name = format!(
            "{}{}{}",
            if s.forward { "F" } else { "B" },
            s.mb,
            if s.chunk > 0 { format!(".{}", s.chunk) } else { String::new() }
        );
        let sep = if i + 1 < spans.len() { "," } else { "" };
        writeln!(
            f,
            "{{\"name\":\"{name}\",\"cat\":\"{}\",\"ph\":\"X\",\"pid\":0,\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"microbatch\":{},\"chunk\":{}}}}}{sep}",
            if s.forward { "forward" } else { "backward" },
            s.stage,
            (s.start - t0) * 1e6,
            (s.end - s.start) * 1e6,
            s.mb,
            s.chunk
        )
        .map_err(io)?;
    }
    writeln!(f, "],\"displayTimeUnit\":\"ms\"}}").map_err(io)?;
    f.flush().map_err(io)
}

/// Draws the timeline: one row per stage, forwards in blue, backwards in green (darker for later
/// chunks), idle time white. With the `plot` feature (plotters).
#[cfg(feature = "plot")]
pub fn write_png(path: &Path, spans: &[ActionSpan], stages: usize) -> Result<()> {
    let bars: Vec<crate::plot::Bar> = spans
        .iter()
        .map(|sp| {
            let shade = (sp.chunk as u8).saturating_mul(40);
            let color =
                if sp.forward { (60, 110u8.saturating_sub(shade), 220) } else { (40, 170u8.saturating_sub(shade), 80) };
            crate::plot::Bar { row: sp.stage, start: sp.start, end: sp.end, color }
        })
        .collect();
    let labels: Vec<String> = (0..stages).map(|s| format!("stage {s}")).collect();
    crate::plot::draw(path, &labels, 60, &bars)
}
