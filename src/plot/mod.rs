//! Bars on rows, time left to right, each row named at its left, drawn as a PNG (the `plot` feature,
//! through plotters): a pipeline's schedule, a timeline's tracks.
mod font;

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

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
/// The picture's width, in pixels.
const WIDTH: u32 = 1200;
/// Labels longer than this many characters are cut.
const LABEL_CHARS: usize = 28;

/// Draws a row of `row` pixels per label (8 of them a gap), the label at its left in a 5x7 font, and the
/// bars on the rows, scaled so that the earliest start and the latest end fill the rest of 1200 pixels.
pub(crate) fn draw(path: &Path, labels: &[String], row: u32, bars: &[Bar]) -> Result<()> {
    let h = labels.len() as u32 * row + 2 * PAD;
    let root = BitMapBackend::new(path, (WIDTH, h)).into_drawing_area();
    paint(&root, labels, row, bars).map_err(|e| Error::invalid(format!("write {}", path.display()), e))
}

fn paint<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    labels: &[String],
    row: u32,
    bars: &[Bar],
) -> std::result::Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    // glyphs as large as the row allows (7 font pixels, with room for the gap)
    let scale = ((row * 3 / 4) / font::HEIGHT).max(1);
    let chars = labels.iter().map(|l| l.chars().count().min(LABEL_CHARS)).max().unwrap_or(0) as u32;
    let left = PAD + if chars > 0 { chars * font::ADVANCE * scale + PAD } else { 0 };
    let t0 = bars.iter().map(|b| b.start).fold(f64::INFINITY, f64::min);
    let t1 = bars.iter().map(|b| b.end).fold(f64::NEG_INFINITY, f64::max);
    let scale_t = (WIDTH - left - PAD) as f64 / (t1 - t0).max(1e-12);
    let gap = (row / 8).max(1) as i32;
    for (r, label) in labels.iter().enumerate() {
        let y = (PAD + r as u32 * row) as i32;
        root.draw(&Rectangle::new(
            [(left as i32, y), ((WIDTH - PAD) as i32, y + row as i32 - gap)],
            RGBColor(235, 235, 235).filled(),
        ))
        .map_err(e)?;
        let text: String = label.chars().take(LABEL_CHARS).collect();
        let top = y + (row as i32 - gap - (font::HEIGHT * scale) as i32) / 2;
        for (x, dy) in font::pixels(&text, scale) {
            let (x, dy) = ((PAD + x) as i32, top + dy as i32);
            // a filled rectangle stops short of its far corner: one font pixel is `scale` wide
            root.draw(&Rectangle::new([(x, dy), (x + scale as i32, dy + scale as i32)], BLACK.filled())).map_err(e)?;
        }
    }
    for b in bars {
        let x0 = left as i32 + ((b.start - t0) * scale_t) as i32;
        let x1 = (left as i32 + ((b.end - t0) * scale_t) as i32).max(x0 + 1);
        let y = (PAD + b.row as u32 * row) as i32;
        let (r, g, bl) = b.color;
        root.draw(&Rectangle::new([(x0, y), (x1 - 1, y + row as i32 - gap)], RGBColor(r, g, bl).filled()))
            .map_err(e)?;
    }
    root.present().map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The picture in memory (RGB), with `labels` and one bar per row.
    fn picture(labels: &[&str]) -> Vec<u8> {
        let row = 24;
        let h = labels.len() as u32 * row + 2 * PAD;
        let mut buf = vec![0u8; (WIDTH * h * 3) as usize];
        let labels: Vec<String> = labels.iter().map(|s| s.to_string()).collect();
        let bars: Vec<Bar> =
            (0..labels.len()).map(|r| Bar { row: r, start: 0.0, end: 1.0 + r as f64, color: (40, 170, 80) }).collect();
        {
            let root = BitMapBackend::with_buffer(&mut buf, (WIDTH, h)).into_drawing_area();
            paint(&root, &labels, row, &bars).unwrap();
        }
        buf
    }

    fn black_in(buf: &[u8], x: std::ops::Range<u32>, y: std::ops::Range<u32>) -> usize {
        let px = |x: u32, y: u32| &buf[((y * WIDTH + x) * 3) as usize..][..3];
        y.flat_map(|y| x.clone().map(move |x| (x, y))).filter(|&(x, y)| px(x, y) == [0, 0, 0]).count()
    }

    #[test]
    fn each_row_is_named_at_its_left_and_the_bars_start_after_the_names() {
        let named = picture(&["rank 0", "rank 1 collectives"]);
        let (row0, row1) = (PAD..PAD + 24, PAD + 24..PAD + 48);
        // scale 2: "rank 0" is 6 characters of 12 pixels
        let gutter = PAD..PAD + 18 * 12;
        assert!(black_in(&named, gutter.clone(), row0.clone()) > 20, "row 0's name is drawn");
        assert!(black_in(&named, gutter.clone(), row1.clone()) > black_in(&named, gutter.clone(), row0));
        assert!(black_in(&named, PAD + 6 * 12..PAD + 18 * 12, PAD..PAD + 24) == 0, "no more than its 6 letters");
        // the bars keep off the names: the left edge of row 1's bar is green, past the gutter
        let green = |x: u32, y: u32| named[((y * WIDTH + x) * 3) as usize..][..3] == [40, 170, 80];
        let left = PAD + 18 * 12 + PAD;
        assert!(green(left + 1, PAD + 30) && !green(left - 2, PAD + 30));
        // without names, no text and the bars start at the margin
        let bare = picture(&["", ""]);
        assert_eq!(black_in(&bare, 0..WIDTH, 0..2 * 24 + 2 * PAD), 0);
        let green = |x: u32, y: u32| bare[((y * WIDTH + x) * 3) as usize..][..3] == [40, 170, 80];
        assert!(green(PAD + 1, PAD + 30));
    }
}
