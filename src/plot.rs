//! Bars on rows, time left to right, drawn as a PNG (the `plot` feature, through plotters): a pipeline's
//! schedule, a timeline's tracks.
use std::path::Path;

use crate::error::{Error, Result};

/// One bar: on `row`, from `start` to `end` (any unit, the same for every bar), in `color`.
pub(crate) struct Bar {
    pub(crate) row: usize,
    pub(crate) start: f64,
    pub(crate) end: f64,
    pub(crate) color: (u8, u8, u8),
}

/// The margin around the chart, in pixels.
pub(crate) const PAD: u32 = 10;

/// Draws `rows` light grey lanes of `row` pixels (8 of them a gap) across 1200 pixels, and the bars on
/// them, scaled so that the earliest start and the latest end touch the margins.
pub(crate) fn draw(path: &Path, rows: usize, row: u32, bars: &[Bar]) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: String| Error::invalid(format!("write {}", path.display()), e);
    let w = 1200u32;
    let h = rows as u32 * row + 2 * PAD;
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let t0 = bars.iter().map(|b| b.start).fold(f64::INFINITY, f64::min);
    let t1 = bars.iter().map(|b| b.end).fold(f64::NEG_INFINITY, f64::max);
    let scale = (w - 2 * PAD) as f64 / (t1 - t0).max(1e-12);
    let gap = (row / 8).max(1) as i32;
    for r in 0..rows {
        let y = (PAD + r as u32 * row) as i32;
        root.draw(&Rectangle::new(
            [(PAD as i32, y), ((w - PAD) as i32, y + row as i32 - gap)],
            RGBColor(235, 235, 235).filled(),
        ))
        .map_err(|e| err(e.to_string()))?;
    }
    for b in bars {
        let x0 = PAD as i32 + ((b.start - t0) * scale) as i32;
        let x1 = (PAD as i32 + ((b.end - t0) * scale) as i32).max(x0 + 1);
        let y = (PAD + b.row as u32 * row) as i32;
        let (r, g, bl) = b.color;
        root.draw(&Rectangle::new([(x0, y), (x1 - 1, y + row as i32 - gap)], RGBColor(r, g, bl).filled()))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}
