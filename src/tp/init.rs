//! tch's initialisations drawn for one rank's slice. A tensor-parallel layer created by `new` holds on
//! each rank exactly the slice of the tensor tch's own layer (`nn::linear`, `nn::embedding`) would draw
//! after the same seed, and the generator ends where that layer leaves it, so the layers created after
//! it draw alike too: a model on any tensor-parallel size starts from the one-process model's values.
//! The whole tensor never exists: it is drawn a block of rows at a time and all but the slice dropped
//! (the time of drawing it whole, the memory of one block).
//!
//! The draws are the CPU generator's, whatever the layer's device (Megatron's CPU initialisation):
//! CUDA's generator places its draws by kernel launch, so a slice of a CUDA draw cannot be drawn alone.
//! This relies on ATen's CPU kernels: `uniform_` draws one number per element in order, and `normal_`
//! transforms blocks of 16 draws (the last 16 elements drawn again when the count is not a multiple of
//! 16); blocks are cut to keep both. `tests/alone/tp_init.rs` checks every rank against tch's layers.
use tch::nn::init::{FanInOut, NormalOrUniform};
use tch::nn::Init;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// Elements drawn at once, at most (rounded to whole rows).
const BLOCK: i64 = 1 << 16;

/// What an [`Init`] draws, with its fan taken from the whole tensor's shape.
enum Draw {
    Const(f64),
    Uniform {
        lo: f64,
        up: f64,
    },
    Normal {
        mean: f64,
        std: f64,
    },
    /// Needs the whole tensor (a QR decomposition of it).
    Whole(Init),
}

fn draw_of(init: Init, global: &[i64]) -> Draw {
    match init {
        Init::Const(c) => Draw::Const(c),
        Init::Uniform { lo, up } => Draw::Uniform { lo, up },
        Init::Randn { mean, stdev } => Draw::Normal { mean, std: stdev },
        Init::Kaiming { dist, fan, non_linearity } => {
            let fan = fan_of(fan, global);
            let std = non_linearity.gain() / (fan as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => Draw::Uniform { lo: -(3f64.sqrt() * std), up: 3f64.sqrt() * std },
                NormalOrUniform::Normal => Draw::Normal { mean: 0.0, std },
            }
        }
        Init::Orthogonal { .. } => Draw::Whole(init),
    }
}

/// tch's fan of a weight of shape `dims` (`FanInOut::for_weight_dims`).
fn fan_of(fan: FanInOut, dims: &[i64]) -> i64 {
    let receptive: i64 = dims.iter().skip(2).product();
    match fan {
        FanInOut::FanIn => dims.get(1).map_or(1, |d| d * receptive),
        FanInOut::FanOut => dims.first().map_or(1, |d| d * receptive),
    }
}

/// Draws `[rows, rest...]` as tch would (`nn::init::f_init` on the CPU).
fn draw_block(d: &Draw, shape: &[i64], kind: Kind) -> Result<Tensor> {
    let opts = (kind, Device::Cpu);
    Ok(match *d {
        Draw::Const(c) => Tensor::f_full(shape, c, opts)?,
        Draw::Uniform { lo, up } => Tensor::f_zeros(shape, opts)?.f_uniform_(lo, up)?,
        Draw::Normal { mean, std } => {
            let r = Tensor::f_randn(shape, opts)?;
            // tch's own arithmetic, so the values match to the bit
            if mean == 0.0 && (std - 1.0).abs() <= f64::EPSILON {
                r
            } else {
                r.f_mul_scalar(std)?.f_add_scalar(mean)?
            }
        }
        Draw::Whole(init) => tch::nn::f_init(init, shape, Device::Cpu, kind)?,
    })
}

/// Row boundaries of the blocks: each a multiple of 16 elements (but the last), the last at least 16.
fn blocks(rows: i64, row_len: i64) -> Vec<i64> {
    let unit = 16 / gcd(row_len.max(1), 16);
    let per = ((BLOCK / row_len.max(1)).max(1) + unit - 1) / unit * unit;
    let mut cuts: Vec<i64> = (0..rows).step_by(per as usize).collect();
    cuts.push(rows);
    // a last block under 16 elements would be drawn one by one (another stream): joined to the one before
    if cuts.len() > 2 && (rows - cuts[cuts.len() - 2]) * row_len < 16 {
        cuts.remove(cuts.len() - 2);
    }
    cuts
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `[start, start + len)` along `dim`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Part {
    pub dim: usize,
    pub start: i64,
    pub len: i64,
}

impl Part {
    /// Rank `rank`'s equal part of `n` along `dim`, of `parts`.
    pub(crate) fn even(dim: usize, n: i64, rank: usize, parts: usize) -> Part {
        let len = n / parts as i64;
        Part { dim, start: rank as i64 * len, len }
    }
}

/// The part `[start, start + len)` along `dim` of the tensor of shape `global` that `init` would give,
/// on `device`, in `kind`; the CPU generator advanced as far as drawing the whole tensor advances it.
pub(crate) fn slice(what: &str, init: Init, global: &[i64], part: Part, opts: (Kind, Device)) -> Result<Tensor> {
    if part.dim == 0 {
        return rows(what, init, global, &[(part.start, part.len)], opts);
    }
    draw(what, init, global, &Pick::Along(part), opts)
}

/// The rows `[start, start + len)` of each range, in order and concatenated, of the tensor `init` would
/// give (a head-parallel QKV projection's queries, keys and values of one rank's heads); the generator
/// advanced as by the whole tensor.
pub(crate) fn rows(
    what: &str,
    init: Init,
    global: &[i64],
    ranges: &[(i64, i64)],
    opts: (Kind, Device),
) -> Result<Tensor> {
    draw(what, init, global, &Pick::Rows(ranges), opts)
}

/// Which elements of the drawn tensor to keep.
enum Pick<'a> {
    /// Ascending, disjoint row ranges (start, len).
    Rows(&'a [(i64, i64)]),
    /// One range along a dimension other than the first.
    Along(Part),
}

fn draw(what: &str, init: Init, global: &[i64], pick: &Pick, (kind, device): (Kind, Device)) -> Result<Tensor> {
    let bad = |start: i64, len: i64, dim: usize| {
        Error::invalid(
            what.to_string(),
            format!("no part [{start}, {}) along dimension {dim} of {global:?}", start + len),
        )
    };
    match pick {
        Pick::Rows(ranges) => {
            let mut end = 0;
            for &(start, len) in ranges.iter() {
                if global.is_empty() || start < end || len < 0 || start + len > global[0] {
                    return Err(bad(start, len, 0));
                }
                end = start + len;
            }
        }
        Pick::Along(Part { dim, start, len }) => {
            if *dim >= global.len() || *start < 0 || *len < 0 || start + len > global[*dim] {
                return Err(bad(*start, *len, *dim));
            }
        }
    }
    let d = draw_of(init, global);
    let (rows, rest) = (global[0], &global[1..]);
    let row_len: i64 = rest.iter().product();
    let numel = rows * row_len;
    let whole = matches!(d, Draw::Whole(_)) || numel < 16 || rows <= 1;
    let cuts = if whole { vec![0, rows] } else { blocks(rows, row_len) };
    let mut parts = Vec::new();
    for w in cuts.windows(2) {
        let (r0, r1) = (w[0], w[1]);
        let shape = [[r1 - r0].as_slice(), rest].concat();
        let wanted: Vec<(i64, i64)> = match pick {
            Pick::Rows(ranges) => ranges
                .iter()
                .map(|&(start, len)| (start.max(r0), (start + len).min(r1)))
                .filter(|(a, z)| a < z)
                .collect(),
            Pick::Along(_) => vec![(r0, r1)],
        };
        if wanted.is_empty() {
            if !matches!(d, Draw::Const(_)) {
                // drawn only to move the generator on, as the whole tensor's draw would
                let _ = draw_block(&d, &shape, kind)?;
            }
            continue;
        }
        let b = draw_block(&d, &shape, kind)?;
        for (a, z) in wanted {
            parts.push(match pick {
                Pick::Rows(_) => b.f_narrow(0, a - r0, z - a)?,
                Pick::Along(Part { dim, start, len }) => b.f_narrow(*dim as i64, *start, *len)?,
            });
        }
    }
    if parts.is_empty() {
        let mut shape = global.to_vec();
        match pick {
            Pick::Rows(_) => shape[0] = 0,
            Pick::Along(p) => shape[p.dim] = 0,
        }
        return Ok(Tensor::f_empty(shape, (kind, device))?);
    }
    let t = if parts.len() == 1 { parts.remove(0) } else { Tensor::f_cat(&parts, 0)? };
    Ok(t.f_contiguous()?.f_to_device(device)?)
}
