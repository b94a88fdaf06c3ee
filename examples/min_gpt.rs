//! tch-rs's own `examples/min-gpt` (a Rust port of karpathy's minGPT; tch-rs is MIT/Apache-2.0), made
//! distributed through a `parallelize::Plan`: its model code is tch's, built while the plan is entered,
//! except that the linear layers come from `tch_dist::nn::linear`, each block passes through
//! `tch_dist::nn::unit`, and attention views its heads as `-1` (this rank's heads under tensor
//! parallelism). Each layout is a launch and a
//! plan, not a model change (docs/min-gpt.md):
//!
//!   tchrun --nproc-per-node 1 -- min_gpt --corpus FILE              # one process
//!   tchrun --nproc-per-node 2 -- min_gpt --corpus FILE --dp 2       # DDP
//!   tchrun --nproc-per-node 2 -- min_gpt --corpus FILE --fsdp 2     # FSDP, a unit per block
//!   tchrun --nproc-per-node 4 -- min_gpt --corpus FILE --hsdp 2x2   # HSDP
//!   tchrun --nproc-per-node 2 -- min_gpt --corpus FILE --tp 2       # Megatron-style TP
//!
//! Training is min-gpt's: tch's own `nn::AdamW` over the VarStore with its two weight-decay groups,
//! `backward_step_clip(&loss, 0.5)`, character-level `TextData` batches (each data-parallel rank takes
//! its rows of the same global batch).
use std::io::Write;

use clap::Parser;

#[path = "common/degrees.rs"]
mod degrees;
use degrees::Degrees;
use tch::data::TextData;
use tch::{Device, IndexOp, Kind, Tensor};
use tch_dist::nn::{self, Linear, ModuleT, OptimizerConfig};
use tch_dist::parallel_dims::ParallelMesh;
use tch_dist::parallelize::{Plan, Style};
use tch_dist::ProcessGroup;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug)]
#[command(about = "tch-rs's min-gpt under DDP, FSDP, HSDP or tensor parallelism")]
struct Args {
    /// The training text (characters).
    #[arg(long)]
    corpus: String,
    #[command(flatten)]
    degrees: Degrees,
    #[arg(long, default_value_t = 8)]
    layers: i64,
    #[arg(long, default_value_t = 512)]
    n_embd: i64,
    #[arg(long, default_value_t = 8)]
    n_head: i64,
    #[arg(long, default_value_t = 128)]
    block_size: i64,
    /// Sequences per step, over all data-parallel ranks.
    #[arg(long, default_value_t = 64)]
    batch_size: i64,
    /// Dropout of attention, residuals and embeddings (min-gpt's 0.1).
    #[arg(long, default_value_t = 0.1)]
    pdrop: f64,
    #[arg(long, default_value_t = 0.0003)]
    lr: f64,
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Where the first rank writes `step loss` lines.
    #[arg(long)]
    losses: Option<String>,
}

// ---- tch-rs's min-gpt model code; changes are marked `// plan` ----

#[derive(Debug, Copy, Clone)]
struct Config {
    vocab_size: i64,
    n_embd: i64,
    n_head: i64,
    n_layer: i64,
    block_size: i64,
    attn_pdrop: f64,
    resid_pdrop: f64,
    embd_pdrop: f64,
}

// Weight decay only applies to the weight matrixes in the linear layers
const NO_WEIGHT_DECAY_GROUP: usize = 0;
const WEIGHT_DECAY_GROUP: usize = 1;

// plan: tch's linear layer with min-gpt's initialisation (weights N(0, 0.02), zero biases), split as the
// plan says for its path (min-gpt's own kept the bias in the no-decay group; tch's layer keeps weight
// and bias in the path's group)
const W: nn::Init = nn::Init::Randn { mean: 0.0, stdev: 0.02 };
const INIT: nn::LinearConfig = nn::LinearConfig { ws_init: W, bs_init: Some(nn::Init::Const(0.0)), bias: true };

fn linear(vs: nn::Path, in_dim: i64, out_dim: i64) -> Linear {
    nn::linear(vs.set_group(WEIGHT_DECAY_GROUP), in_dim, out_dim, INIT)
}

fn linear_no_bias(vs: nn::Path, in_dim: i64, out_dim: i64) -> Linear {
    let cfg = nn::LinearConfig { bias: false, ..INIT };
    nn::linear(vs.set_group(WEIGHT_DECAY_GROUP), in_dim, out_dim, cfg)
}

fn causal_self_attention(p: &nn::Path, cfg: Config) -> impl ModuleT {
    let key = linear(p / "key", cfg.n_embd, cfg.n_embd);
    let query = linear(p / "query", cfg.n_embd, cfg.n_embd);
    let value = linear(p / "value", cfg.n_embd, cfg.n_embd);
    let proj = linear(p / "proj", cfg.n_embd, cfg.n_embd);
    let mask_init = Tensor::ones([cfg.block_size, cfg.block_size], (Kind::Float, p.device())).tril(0);
    let mask_init = mask_init.view([1, 1, cfg.block_size, cfg.block_size]);
    // let mask = p.var_copy("mask", &mask_init);
    let mask = mask_init;
    nn::func_t(move |xs, train| {
        let (sz_b, sz_t, sz_c) = xs.size3().unwrap();
        let sizes = [sz_b, sz_t, -1, sz_c / cfg.n_head]; // plan: this rank's heads
        let k = xs.apply(&key).view(sizes).transpose(1, 2);
        let q = xs.apply(&query).view(sizes).transpose(1, 2);
        let v = xs.apply(&value).view(sizes).transpose(1, 2);
        let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / f64::sqrt(sizes[3] as f64));
        let att = att.masked_fill(&mask.i((.., .., ..sz_t, ..sz_t)).eq(0.), f64::NEG_INFINITY);
        let att = att.softmax(-1, Kind::Float).dropout(cfg.attn_pdrop, train);
        let ys = att.matmul(&v).transpose(1, 2).contiguous().view([sz_b, sz_t, -1]); // plan
        ys.apply(&proj).dropout(cfg.resid_pdrop, train)
    })
}

fn block(p: &nn::Path, cfg: Config) -> impl ModuleT {
    let ln1 = nn::layer_norm(p / "ln1", vec![cfg.n_embd], Default::default());
    let ln2 = nn::layer_norm(p / "ln2", vec![cfg.n_embd], Default::default());
    let attn = causal_self_attention(p, cfg);
    let lin1 = linear(p / "lin1", cfg.n_embd, 4 * cfg.n_embd);
    let lin2 = linear(p / "lin2", 4 * cfg.n_embd, cfg.n_embd);
    nn::func_t(move |xs, train| {
        let xs = xs + xs.apply(&ln1).apply_t(&attn, train);
        let ys = xs.apply(&ln2).apply(&lin1).gelu("none").apply(&lin2).dropout(cfg.resid_pdrop, train);
        xs + ys
    })
}

fn gpt(p: nn::Path, cfg: Config) -> impl ModuleT {
    let p = &p.set_group(NO_WEIGHT_DECAY_GROUP);
    let tok_emb = nn::embedding(p / "tok_emb", cfg.vocab_size, cfg.n_embd, Default::default());
    let pos_emb = p.zeros("pos_emb", &[1, cfg.block_size, cfg.n_embd]);
    let ln_f = nn::layer_norm(p / "ln_f", vec![cfg.n_embd], Default::default());
    let head = linear_no_bias(p / "head", cfg.n_embd, cfg.vocab_size);
    let mut blocks = nn::seq_t();
    for block_idx in 0..cfg.n_layer {
        let bp = p / block_idx;
        blocks = blocks.add(nn::unit(&bp, block(&bp, cfg))); // plan: an FSDP unit
    }
    nn::func_t(move |xs, train| {
        let (_sz_b, sz_t) = xs.size2().unwrap();
        let tok_emb = xs.apply(&tok_emb);
        let pos_emb = pos_emb.i((.., ..sz_t, ..));
        (tok_emb + pos_emb).dropout(cfg.embd_pdrop, train).apply_t(&blocks, train).apply(&ln_f).apply(&head)
    })
}

// ---- the launch: a mesh and the plan for the layout ----

/// Tensor parallelism as Megatron splits a block, and the data parallelism of the flags.
fn plan(dims: &ParallelMesh) -> Plan {
    dims.plan()
        .styles(&["*.key", "*.query", "*.value", "*.lin1"], Style::colwise())
        .styles(&["*.proj", "*.lin2"], Style::rowwise())
}

fn main() -> Result<()> {
    let a = Args::parse();
    tch::set_num_threads(1);
    let world = ProcessGroup::from_env()?;
    let dims = a.degrees.dims()?.build(&world)?;
    let rows = dims.rows(a.batch_size)?; // this rank's rows of each batch
    let data = TextData::new(&a.corpus).map_err(|e| format!("--corpus {}: {e}", a.corpus))?;
    let cfg = Config {
        vocab_size: data.labels(),
        n_embd: a.n_embd,
        n_head: a.n_head,
        n_layer: a.layers,
        block_size: a.block_size,
        attn_pdrop: a.pdrop,
        resid_pdrop: a.pdrop,
        embd_pdrop: a.pdrop,
    };
    let device = Device::Cpu;
    let vs = nn::VarStore::new(device);
    let plan = plan(&dims);
    tch::manual_seed(42); // every layout starts from the same model
    let gpt = plan.build(&vs, || gpt(vs.root() / "gpt", cfg))?; // the layers and units through the plan
    let mut opt = nn::AdamW::default().build(&vs, a.lr)?;
    opt.set_weight_decay_group(NO_WEIGHT_DECAY_GROUP, 0.0);
    opt.set_weight_decay_group(WEIGHT_DECAY_GROUP, 0.1);

    // the same batches on every rank; each data-parallel rank trains on its rows
    tch::manual_seed(1);
    let batches = data.iter_shuffle(a.block_size + 1, a.batch_size);
    tch::manual_seed(100 + dims.batch_rank() as i64); // dropout differs across replicas, agrees across TP ranks
    let mut out = match (&a.losses, world.rank()) {
        (Some(f), 0) => Some(std::fs::File::create(f).map_err(|e| format!("--losses {f}: {e}"))?),
        _ => None,
    };
    let started = std::time::Instant::now();
    for (step, batch) in batches.take(a.steps).enumerate() {
        let batch = batch.i(rows.clone());
        let xs = batch.narrow(1, 0, a.block_size).to_kind(Kind::Int64).to_device(device);
        let ys = batch.narrow(1, 1, a.block_size).to_kind(Kind::Int64).to_device(device);
        let logits = xs.apply_t(&gpt, true);
        let loss = logits.view([-1, cfg.vocab_size]).cross_entropy_for_logits(&ys.view([-1]));
        opt.backward_step_clip(&loss, 0.5);
        // the loss of the global batch: the mean over the data-parallel ranks
        // averaged (a collective: on every rank alike) and read only where it is shown or written
        let logs = step.is_multiple_of(20) || step + 1 == a.steps;
        if logs || a.losses.is_some() {
            let l = dims.average_loss(&loss)?.double_value(&[]);
            if world.rank() == 0 && logs {
                println!("step {step}: loss {l:.4} ({:.1} s)", started.elapsed().as_secs_f64());
            }
            if let Some(f) = out.as_mut() {
                writeln!(f, "{step} {l:.8}")?;
            }
        }
    }
    world.barrier()?;
    Ok(())
}
