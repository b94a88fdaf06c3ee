//! Draws a timeline (`tchrun --trace-out trace.json`) as a PNG: `timeline_png trace.json trace.png`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, trace, png] = args.as_slice() else {
        return Err("usage: timeline_png TRACE.json OUT.png".into());
    };
    let rows = tch_dist::timeline::write_png(std::path::Path::new(trace), std::path::Path::new(png))?;
    println!("{png}: {rows} tracks");
    Ok(())
}
