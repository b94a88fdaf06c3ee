//! A Llama-style language model (the architecture of tch-rs's `examples/llama`: a fused `c_attn`
//! projection read in three slices, RMSNorm scales made with `vs.ones`, rotary embeddings passed to each
//! block, a SwiGLU MLP, no biases), trained on characters under DDP, FSDP, HSDP or tensor parallelism
//! through a `parallelize::Plan`, with tch's own `nn::AdamW`, saved to and resumed from a sharded
//! checkpoint in any layout (docs/porting.md walks through it):
//!
//!   tchrun --nproc-per-node 1 -- tch_llama --corpus FILE                  # one process
//!   tchrun --nproc-per-node 2 -- tch_llama --corpus FILE --dp 2           # DDP
//!   tchrun --nproc-per-node 2 -- tch_llama --corpus FILE --fsdp 2         # FSDP, a unit per block
//!   tchrun --nproc-per-node 4 -- tch_llama --corpus FILE --hsdp 2x2       # HSDP
//!   tchrun --nproc-per-node 2 -- tch_llama --corpus FILE --tp 2           # tensor parallel
//!
//! `--checkpoint DIR` saves the model and tch's optimizer there after the last step; `--resume` first
//! loads the newest checkpoint there (saved in any layout) and goes on from its step.
use std::io::Write;
use std::sync::Arc;

use clap::Parser;

#[path = "common/degrees.rs"]
mod degrees;
use degrees::Degrees;
use tch::data::TextData;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, IndexOp, Kind, Tensor};
use tch_dist::checkpoint::{Checkpointer, StateDict};
use tch_dist::parallel_dims::ParallelMesh;
use tch_dist::parallelize::{self, Linear, Plan, Style, Unit};
use tch_dist::{DistModule, ProcessGroup};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug)]
#[command(about = "a Llama-style model under DDP, FSDP, HSDP or tensor parallelism")]
struct Args {
    /// The training text (characters).
    #[arg(long)]
    corpus: String,
    #[command(flatten)]
    degrees: Degrees,
    #[arg(long, default_value_t = 4)]
    layers: i64,
    #[arg(long, default_value_t = 256)]
    n_embd: i64,
    #[arg(long, default_value_t = 8)]
    n_head: i64,
    #[arg(long, default_value_t = 128)]
    block_size: i64,
    /// Sequences per step, over all data-parallel ranks.
    #[arg(long, default_value_t = 32)]
    batch_size: i64,
    #[arg(long, default_value_t = 0.001)]
    lr: f64,
    /// The step to stop after (counted from the start, resumed runs included).
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Where the first rank writes `step loss` lines.
    #[arg(long)]
    losses: Option<String>,
    /// A sharded checkpoint of the model and the optimizer is saved here after the last step.
    #[arg(long)]
    checkpoint: Option<String>,
    /// Load the newest checkpoint under --checkpoint first, and go on from its step.
    #[arg(long)]
    resume: bool,
}

#[derive(Debug, Clone, Copy)]
struct Config {
    vocab_size: i64,
    n_layer: i64,
    n_head: i64,
    n_embd: i64,
}

fn linear(p: nn::Path, i: i64, o: i64) -> Linear {
    parallelize::linear(&p, i, o, nn::LinearConfig { bias: false, ..Default::default() }).unwrap()
}

/// Root-mean-square normalisation with a learned scale (starting at one, for training).
#[derive(Debug)]
struct RmsNorm {
    scale: Tensor,
}

impl RmsNorm {
    fn new(p: nn::Path, size: i64) -> Self {
        RmsNorm { scale: p.ones("scale", &[size]) }
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let ms = (xs * xs).mean_dim(-1, true, Kind::Float);
        xs * (ms + 1e-5).rsqrt() * &self.scale
    }
}

/// SwiGLU: `c_proj(silu(c_fc1 x) * c_fc2 x)`.
#[derive(Debug)]
struct Mlp {
    c_fc1: Linear,
    c_fc2: Linear,
    c_proj: Linear,
}

impl Mlp {
    fn new(p: nn::Path, n_embd: i64) -> Self {
        let hidden = 8 * n_embd / 3;
        let hidden = (hidden + 63) / 64 * 64;
        Mlp {
            c_fc1: linear(&p / "c_fc1", n_embd, hidden),
            c_fc2: linear(&p / "c_fc2", n_embd, hidden),
            c_proj: linear(&p / "c_proj", hidden, n_embd),
        }
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.c_proj.forward(&(self.c_fc1.forward(xs).silu() * self.c_fc2.forward(xs)))
    }
}

/// Causal self-attention with one fused projection for queries, keys and values.
#[derive(Debug)]
struct Attention {
    c_attn: Linear,
    c_proj: Linear,
    head_dim: i64,
}

/// Rotates pairs of `x`'s last dimension (`[b, heads, t, head_dim]`) by the angles in `rope`
/// (`[t, head_dim / 2, 2]`: cosines and sines).
fn rotary(x: &Tensor, rope: &Tensor) -> Tensor {
    let mut dims = x.size();
    let d = dims.pop().unwrap_or(0);
    let x = x.reshape([dims.clone(), vec![d / 2, 2]].concat());
    let (re, im) = (x.select(-1, 0), x.select(-1, 1));
    let (cos, sin) = (rope.select(-1, 0), rope.select(-1, 1));
    Tensor::stack(&[&re * &cos - &im * &sin, &re * &sin + &im * &cos], -1).reshape([dims, vec![d]].concat())
}

impl Attention {
    fn new(p: nn::Path, cfg: Config) -> Self {
        Attention {
            c_attn: linear(&p / "c_attn", cfg.n_embd, 3 * cfg.n_embd),
            c_proj: linear(&p / "c_proj", cfg.n_embd, cfg.n_embd),
            head_dim: cfg.n_embd / cfg.n_head,
        }
    }

    fn forward(&self, x: &Tensor, rope: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().unwrap();
        let qkv = self.c_attn.forward(x).chunk(3, -1);
        // -1 heads: all of them in one process, this rank's under tensor parallelism
        let heads = |y: &Tensor| y.reshape([b, t, -1, self.head_dim]).transpose(1, 2);
        let rope = rope.narrow(0, 0, t);
        let (q, k, v) = (rotary(&heads(&qkv[0]), &rope), rotary(&heads(&qkv[1]), &rope), heads(&qkv[2]));
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
        self.c_proj.forward(&y.transpose(1, 2).reshape([b, t, -1]))
    }
}

#[derive(Debug)]
struct Block {
    rms_1: RmsNorm,
    attn: Attention,
    rms_2: RmsNorm,
    mlp: Mlp,
}

impl Block {
    fn new(p: nn::Path, cfg: Config) -> Self {
        Block {
            rms_1: RmsNorm::new(&p / "rms_1", cfg.n_embd),
            attn: Attention::new(&p / "attn", cfg),
            rms_2: RmsNorm::new(&p / "rms_2", cfg.n_embd),
            mlp: Mlp::new(&p / "mlp", cfg.n_embd),
        }
    }

    /// Two inputs: the activations and the rotary table.
    fn forward(&self, x: &Tensor, rope: &Tensor) -> Tensor {
        let x = self.attn.forward(&self.rms_1.forward(x), rope) + x;
        self.mlp.forward(&self.rms_2.forward(&x)) + x
    }
}

#[derive(Debug)]
struct Llama {
    wte: nn::Embedding,
    blocks: Vec<Unit<Block>>,
    ln_f: RmsNorm,
    lm_head: Linear,
    rope: Tensor,
}

impl Llama {
    fn new(p: nn::Path, cfg: Config, context: i64) -> Self {
        let t = &p / "transformer";
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let bp = &t / "h" / i;
                parallelize::unit(&bp, Block::new(bp.clone(), cfg)).unwrap() // an FSDP unit per block
            })
            .collect();
        Llama {
            wte: nn::embedding(&t / "wte", cfg.vocab_size, cfg.n_embd, Default::default()),
            blocks,
            ln_f: RmsNorm::new(&t / "ln_f", cfg.n_embd),
            lm_head: linear(&p / "lm_head", cfg.n_embd, cfg.vocab_size),
            rope: rope_table(cfg.n_embd / cfg.n_head, context).to_device(p.device()),
        }
    }
}

impl Module for Llama {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let mut x = self.wte.forward(ids);
        for block in &self.blocks {
            x = block.forward_with(&x, |b, x| b.forward(x, &self.rope));
        }
        self.lm_head.forward(&self.ln_f.forward(&x))
    }
}

/// `[context, head_dim / 2, 2]`: the cosine and sine of position × frequency.
fn rope_table(head_dim: i64, context: i64) -> Tensor {
    let freqs = Tensor::arange_start_step(0, head_dim, 2, (Kind::Float, Device::Cpu)) / head_dim as f64;
    let freqs = (freqs * -(10000f64.ln())).exp();
    let angles = Tensor::arange(context, (Kind::Float, Device::Cpu)).outer(&freqs);
    Tensor::stack(&[angles.cos(), angles.sin()], -1)
}

/// Tensor parallelism by name (the fused projection split block by block), and the data parallelism
/// of the flags.
fn plan(dims: &ParallelMesh) -> Plan {
    dims.plan()
        .style("*.attn.c_attn", Style::colwise_fused(3))
        .styles(&["*.c_fc1", "*.c_fc2"], Style::colwise())
        .style("*.c_proj", Style::rowwise())
}

fn main() -> Result<()> {
    let a = Args::parse();
    tch::set_num_threads(1);
    let world = Arc::new(ProcessGroup::from_env()?);
    let dims = a.degrees.dims()?.build(&world)?;
    let rows = dims.rows(a.batch_size)?; // this rank's rows of each batch
    let data = TextData::new(&a.corpus).map_err(|e| format!("--corpus {}: {e}", a.corpus))?;
    let cfg = Config { vocab_size: data.labels(), n_layer: a.layers, n_head: a.n_head, n_embd: a.n_embd };
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = plan(&dims);
    tch::manual_seed(42); // every rank and every layout: the same model
    let model = plan.build(&vs, || Llama::new(vs.root(), cfg, a.block_size))?;
    let mut opt = nn::AdamW::default().build(&vs, a.lr)?; // after the model: under FSDP, over its shards

    let mut start = 0;
    let mut ck = a.checkpoint.as_ref().map(|dir| Checkpointer::new(world.clone(), dir)).transpose()?;
    if let (true, Some(ck)) = (a.resume, ck.as_mut()) {
        let step = ck.load(StateDict::new().var_store("model", &vs).tch_optimizer("optim", &mut opt, &vs))?;
        start = step.ok_or("--resume: no checkpoint under --checkpoint")? as usize;
    }

    // the same batches on every rank; each data-parallel rank trains on its rows
    tch::manual_seed(1);
    let batches = data.iter_shuffle(a.block_size + 1, a.batch_size);
    let mut out = match (&a.losses, world.rank()) {
        (Some(f), 0) => Some(std::fs::OpenOptions::new().create(true).append(true).open(f)?),
        _ => None,
    };
    for (step, batch) in batches.enumerate().take(a.steps).skip(start) {
        let batch = batch.i(rows.clone());
        let xs = batch.narrow(1, 0, a.block_size).to_kind(Kind::Int64);
        let ys = batch.narrow(1, 1, a.block_size).to_kind(Kind::Int64);
        let logits = model.forward(&xs);
        let loss = logits.view([-1, cfg.vocab_size]).cross_entropy_for_logits(&ys.view([-1]));
        opt.zero_grad();
        model.backward(&loss)?; // DDP's and FSDP's reductions; plain autograd otherwise
        opt.step();
        // averaged (a collective: on every rank alike) and read only where it is shown or written
        let logs = step.is_multiple_of(20) || step + 1 == a.steps;
        if logs || a.losses.is_some() {
            let l = dims.average_loss(&loss)?.double_value(&[]);
            if world.rank() == 0 && logs {
                println!("step {step}: loss {l:.4}");
            }
            if let Some(f) = out.as_mut() {
                writeln!(f, "{step} {l:.8}")?;
            }
        }
    }
    if let Some(ck) = ck.as_mut() {
        ck.save(a.steps as u64, StateDict::new().var_store("model", &vs).tch_optimizer("optim", &mut opt, &vs))?;
    }
    Ok(())
}
