//! Timelines of pipeline steps: Chrome's trace-event JSON (chrome://tracing, Perfetto) and a PNG picture
//! in which the bubble is the white space.
use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// One forward or backward of one microbatch-chunk on one stage; times in seconds (wall clock).
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub stage: usize,
    pub forward: bool,
    pub mb: usize,
    pub chunk: usize,
    pub start: f64,
    pub end: f64,
}

/// Idle share of the stages' time between the first start and the last end.
pub fn bubble_fraction(spans: &[Span], stages: usize) -> f64 {
    if spans.is_empty() || stages == 0 {
        return 0.0;
    }
    let t0 = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
    let t1 = spans.iter().map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
    let busy: f64 = spans.iter().map(|s| s.end - s.start).sum();
    1.0 - busy / (stages as f64 * (t1 - t0))
}

/// Writes `spans` as Chrome trace events: one row (thread) per stage, one complete event per span.
pub fn write_chrome_trace(path: &Path, spans: &[Span]) -> Result<()> {
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
pub fn write_png(path: &Path, spans: &[Span], stages: usize) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: String| Error::invalid(format!("write timeline {}", path.display()), e);
    let (w, row, pad) = (1200u32, 60u32, 10u32);
    let h = stages as u32 * row + 2 * pad;
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let t0 = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
    let t1 = spans.iter().map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
    let scale = (w - 2 * pad) as f64 / (t1 - t0).max(1e-12);
    for s in 0..stages {
        let y = (pad + s as u32 * row) as i32;
        root.draw(&Rectangle::new(
            [(pad as i32, y), ((w - pad) as i32, y + row as i32 - 8)],
            RGBColor(235, 235, 235).filled(),
        ))
        .map_err(|e| err(e.to_string()))?;
    }
    for sp in spans {
        let x0 = pad as i32 + ((sp.start - t0) * scale) as i32;
        let x1 = (pad as i32 + ((sp.end - t0) * scale) as i32).max(x0 + 1);
        let y = (pad + sp.stage as u32 * row) as i32;
        let shade = (sp.chunk as u8).saturating_mul(40);
        let color = if sp.forward {
            RGBColor(60, 110u8.saturating_sub(shade), 220)
        } else {
            RGBColor(40, 170u8.saturating_sub(shade), 80)
        };
        root.draw(&Rectangle::new([(x0, y), (x1 - 1, y + row as i32 - 8)], color.filled()))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}
