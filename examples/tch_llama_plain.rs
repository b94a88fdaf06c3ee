//! The one-process program that examples/tch_llama.rs ports: a Llama-style language model (the
//! architecture of tch-rs's `examples/llama`: a fused `c_attn` projection read in three slices, RMSNorm
//! scales made with `vs.ones`, rotary embeddings passed to each block, a SwiGLU MLP, no biases), trained
//! on characters with tch's own `nn::AdamW`, and nothing of tch-dist. `diff` it against tch_llama.rs to
//! see what a port to every layout changes (docs/porting.md):
//!
//!   tch_llama_plain --corpus FILE
use std::io::Write;

use clap::Parser;

use tch::data::TextData;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, IndexOp, Kind, Tensor};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug)]
#[command(about = "a Llama-style language model")]
struct Args {
    /// The training text (characters).
    #[arg(long)]
    corpus: String,
    #[arg(long, default_value_t = 4)]
    layers: i64,
    #[arg(long, default_value_t = 256)]
    n_embd: i64,
    #[arg(long, default_value_t = 8)]
    n_head: i64,
    #[arg(long, default_value_t = 128)]
    block_size: i64,
    /// Sequences per step.
    #[arg(long, default_value_t = 32)]
    batch_size: i64,
    #[arg(long, default_value_t = 0.001)]
    lr: f64,
    /// The number of steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Where to write `step loss` lines.
    #[arg(long)]
    losses: Option<String>,
}

#[derive(Debug, Clone, Copy)]
struct Config {
    vocab_size: i64,
    n_layer: i64,
    n_head: i64,
    n_embd: i64,
}

fn linear(p: nn::Path, i: i64, o: i64) -> nn::Linear {
    nn::linear(p, i, o, nn::LinearConfig { bias: false, ..Default::default() })
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
    c_fc1: nn::Linear,
    c_fc2: nn::Linear,
    c_proj: nn::Linear,
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
    c_attn: nn::Linear,
    c_proj: nn::Linear,
    n_head: i64,
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
            n_head: cfg.n_head,
        }
    }

    fn forward(&self, x: &Tensor, rope: &Tensor) -> Tensor {
        let (b, t, c) = x.size3().unwrap();
        let qkv = self.c_attn.forward(x);
        let (q, k, v) = (&qkv.i((.., .., ..c)), &qkv.i((.., .., c..2 * c)), &qkv.i((.., .., 2 * c..)));
        let heads = |y: &Tensor| y.reshape([b, t, self.n_head, c / self.n_head]).transpose(1, 2);
        let rope = rope.narrow(0, 0, t);
        let (q, k, v) = (rotary(&heads(q), &rope), rotary(&heads(k), &rope), heads(v));
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
        self.c_proj.forward(&y.transpose(1, 2).reshape([b, t, c]))
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
    blocks: Vec<Block>,
    ln_f: RmsNorm,
    lm_head: nn::Linear,
    rope: Tensor,
}

impl Llama {
    fn new(p: nn::Path, cfg: Config, context: i64) -> Self {
        let t = &p / "transformer";
        let blocks = (0..cfg.n_layer).map(|i| Block::new(&t / "h" / i, cfg)).collect();
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
            x = block.forward(&x, &self.rope);
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

fn append(file: &String) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new().create(true).append(true).open(file)
}

fn main() -> Result<()> {
    let a = Args::parse();
    tch::set_num_threads(1);
    let data = TextData::new(&a.corpus).map_err(|e| format!("--corpus {}: {e}", a.corpus))?;
    let cfg = Config { vocab_size: data.labels(), n_layer: a.layers, n_head: a.n_head, n_embd: a.n_embd };
    let vs = nn::VarStore::new(Device::cuda_if_available());
    tch::manual_seed(42);
    let model = Llama::new(vs.root(), cfg, a.block_size);
    let mut opt = nn::AdamW::default().build(&vs, a.lr)?;

    tch::manual_seed(1);
    let batches = data.iter_shuffle(a.block_size + 1, a.batch_size).enumerate().take(a.steps);
    let mut out = a.losses.as_ref().map(append).transpose()?;
    for (step, batch) in batches {
        let batch = batch.to_device(vs.device());
        let xs = batch.narrow(1, 0, a.block_size).to_kind(Kind::Int64);
        let ys = batch.narrow(1, 1, a.block_size).to_kind(Kind::Int64);
        let logits = model.forward(&xs);
        let loss = logits.view([-1, cfg.vocab_size]).cross_entropy_for_logits(&ys.view([-1]));
        opt.backward_step(&loss);
        // read where it is shown or written (a host sync)
        let logs = step.is_multiple_of(20) || step + 1 == a.steps;
        if logs || a.losses.is_some() {
            let l = loss.double_value(&[]);
            if logs {
                println!("step {step}: loss {l:.4}");
            }
            if let Some(f) = out.as_mut() {
                writeln!(f, "{step} {l:.8}")?;
            }
        }
    }
    Ok(())
}
