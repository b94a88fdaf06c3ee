//! A Llama 3 trainer a user can fork: the architecture of Hugging Face's `LlamaForCausalLM` (RMSNorm,
//! rotary embeddings in its rotate-half convention, SwiGLU, grouped-query attention through SDPA, tied
//! or untied embeddings), its variables named as Hugging Face names them, so a model directory loads
//! with no map; every layout is degrees on the command line (docs/llama.md):
//!
//!   tchrun --nproc-per-node 2 -- llama --from-hf DIR --data train.bin --dp-shard 2 --steps 100 --to-hf OUT
//!   tchrun --nproc-per-node 2 -- llama --config config.json --data train.bin --tp 2
//!
//! `--data` is little-endian u16 token ids (nanoGPT's `train.bin`; `--data-dtype u32` for larger
//! vocabularies); step `s` reads the global batch of sequences `s * batch * dp ..`, each rank its rows.
//! `--dump-logits FILE` writes the first global batch's input ids and logits (before any step) from
//! rank 0, for comparisons with `transformers`.
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use clap::Parser;
use tch::{Device, Kind, Tensor};
use tch_dist::amp::AutocastGuard;
use tch_dist::checkpoint::hf::{save_hf_stores, HfCheckpoint, HfPart, HfSaveOptions, HfSlot};
use tch_dist::checkpoint::{Checkpointer, StateDict};
use tch_dist::ddp::DdpOptions;
use tch_dist::fsdp::FsdpOptions;
use tch_dist::nn::{self, Module};
use tch_dist::nn::{Linear, Unit};
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::parallel_dims::{ParallelDims, ParallelMesh};
use tch_dist::parallelize::{Parallel, Plan, Style};
use tch_dist::pipeline::{LayerList, Partition, PipelineConfig, PipelineRank};
use tch_dist::recompute::Checkpointed;
use tch_dist::throughput::{transformer_flops_per_token, Throughput, ThroughputConfig};
use tch_dist::{DistModule, ProcessGroup};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug)]
#[command(about = "a Llama 3 model from and to Hugging Face checkpoints, under any layout")]
struct Args {
    /// A Hugging Face model directory to start from (config.json and safetensors).
    #[arg(long)]
    from_hf: Option<String>,
    /// Without --from-hf: a Hugging Face config.json for a freshly initialised model.
    #[arg(long)]
    config: Option<String>,
    /// Where the trained model is written as a Hugging Face directory (with --from-hf's generation config
    /// and tokenizer files, or --tokenizer's tokenizer.json, beside it).
    #[arg(long)]
    to_hf: Option<String>,
    /// Token ids, little-endian (u16 unless --data-dtype u32); with --tokenizer, text.
    #[arg(long)]
    data: Option<String>,
    #[arg(long, default_value = "u16", value_parser = ["u16", "u32"])]
    data_dtype: String,
    /// A Hugging Face tokenizer.json: --data is then text, tokenised with it (Hugging Face's tokenizers).
    #[arg(long)]
    tokenizer: Option<String>,
    #[arg(long, default_value_t = 10)]
    steps: usize,
    #[arg(long, default_value_t = 128)]
    seq_len: i64,
    /// Sequences per step on each data-parallel rank.
    #[arg(long, default_value_t = 4)]
    batch: i64,
    /// The peak learning rate (AdamW), after --warmup, decaying on a cosine to a tenth at --steps.
    #[arg(long, default_value_t = 3e-4)]
    lr: f64,
    #[arg(long, default_value_t = 1)]
    dp_shard: usize,
    #[arg(long, default_value_t = 1)]
    dp_replicate: usize,
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline stages (untied embeddings only).
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Microbatches per step, which divide --batch: gradient accumulation (under --pp, the pipeline's;
    /// by default 1, or --pp's stages).
    #[arg(long)]
    microbatches: Option<usize>,
    /// Steps of linear warm-up of the learning rate, before its cosine decay to a tenth at --steps.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// A sharded checkpoint (model, optimizer, position in the data) is saved here every
    /// --checkpoint-every steps and after the last.
    #[arg(long)]
    checkpoint: Option<String>,
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// First load the newest checkpoint under --checkpoint and go on from its step.
    #[arg(long)]
    resume: bool,
    /// Compute in bfloat16 (FSDP's param_dtype under --dp-shard, autocast otherwise); the variables,
    /// AdamW's state and the reductions stay float32.
    #[arg(long)]
    bf16: bool,
    /// Recompute each decoder layer's activations in backward instead of keeping them.
    #[arg(long)]
    recompute: bool,
    /// Every rank reports what loading --from-hf read and cost (else rank 0 alone).
    #[arg(long)]
    load_report: bool,
    /// Loss, learning rate, throughput and memory every N steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// The first global batch's `input_ids` and `logits`, before any step, as safetensors (written by
    /// the reporting rank, on the last pipeline stage).
    #[arg(long)]
    dump_logits: Option<String>,
    /// Seeds a fresh model's initialisation.
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

/// What the model needs of a Hugging Face `config.json`.
#[derive(Clone, Debug)]
struct Config {
    vocab: i64,
    hidden: i64,
    intermediate: i64,
    layers: i64,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    eps: f64,
    tied: bool,
    init_std: f64,
    /// The rotary frequencies, `[head_dim / 2]`.
    inv_freq: Vec<f64>,
}

impl Config {
    fn from_json(v: &serde_json::Value) -> Result<Config> {
        let int = |k: &str| v.get(k).and_then(|x| x.as_i64()).ok_or(format!("config.json: no integer {k:?}"));
        let float = |k: &str, d: f64| v.get(k).and_then(|x| x.as_f64()).unwrap_or(d);
        for (k, ok) in [("hidden_act", "silu"), ("model_type", "llama")] {
            if let Some(x) = v.get(k).and_then(|x| x.as_str()).filter(|x| *x != ok) {
                return Err(format!("config.json: {k} {x:?}: this model is {ok:?}").into());
            }
        }
        for k in ["attention_bias", "mlp_bias"] {
            if v.get(k).and_then(|x| x.as_bool()) == Some(true) {
                return Err(format!("config.json: {k} true: this model has no biases").into());
            }
        }
        let (hidden, heads) = (int("hidden_size")?, int("num_attention_heads")?);
        let head_dim = int("head_dim").unwrap_or(hidden / heads);
        Ok(Config {
            vocab: int("vocab_size")?,
            hidden,
            intermediate: int("intermediate_size")?,
            layers: int("num_hidden_layers")?,
            heads,
            kv_heads: int("num_key_value_heads").unwrap_or(heads),
            head_dim,
            eps: float("rms_norm_eps", 1e-6),
            tied: v.get("tie_word_embeddings").and_then(|x| x.as_bool()).unwrap_or(false),
            init_std: float("initializer_range", 0.02),
            inv_freq: inv_freq(v, head_dim)?,
        })
    }
}

impl Config {
    /// Training FLOPs per token at `seq_len` (torchtitan's count; the embeddings left out).
    fn flops_per_token(&self, seq_len: i64) -> f64 {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate + 2 * h;
        let params = self.layers * layer + h + if self.tied { 0 } else { h * self.vocab };
        transformer_flops_per_token(params, self.layers, self.heads, self.head_dim, seq_len)
    }
}

/// `transformers`' rotary frequencies: `rope_parameters` (or the older `rope_theta` and `rope_scaling`),
/// of type "default" or "llama3" (Llama 3.1's long-context scaling).
fn inv_freq(v: &serde_json::Value, head_dim: i64) -> Result<Vec<f64>> {
    let rope = v.get("rope_parameters").or_else(|| v.get("rope_scaling")).filter(|r| !r.is_null());
    let get = |k: &str| rope.and_then(|r| r.get(k)).and_then(|x| x.as_f64());
    let theta = get("rope_theta").or_else(|| v.get("rope_theta").and_then(|x| x.as_f64())).unwrap_or(10000.0);
    let base: Vec<f64> = (0..head_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)).collect();
    let kind = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(|x| x.as_str());
    match kind.unwrap_or("default") {
        "default" => Ok(base),
        "llama3" => {
            let need = |k: &str| get(k).ok_or(format!("config.json: llama3 rope scaling without {k:?}"));
            let (factor, low, high) = (need("factor")?, need("low_freq_factor")?, need("high_freq_factor")?);
            let old = need("original_max_position_embeddings")?;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            Ok(base
                .into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect())
        }
        other => Err(format!("config.json: rope type {other:?} (this model knows \"default\" and \"llama3\")").into()),
    }
}

fn linear(p: nn::Path, i: i64, o: i64, cfg: &Config) -> Linear {
    let ws_init = nn::Init::Randn { mean: 0.0, stdev: cfg.init_std };
    // main checked what the split needs (heads and sizes divisible by --tp)
    nn::linear(p, i, o, nn::LinearConfig { ws_init, bias: false, ..Default::default() })
}

/// `weight * x / rms(x)`, computed in float32 as `transformers` does.
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(p: nn::Path, cfg: &Config) -> Self {
        RmsNorm { weight: p.ones("weight", &[cfg.hidden]), eps: cfg.eps }
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let x = xs.to_kind(Kind::Float);
        let x = &x * (x.square().mean_dim(-1, true, Kind::Float) + self.eps).rsqrt();
        &self.weight * x.to_kind(xs.kind())
    }
}

#[derive(Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.down_proj.forward(&(self.gate_proj.forward(xs).silu() * self.up_proj.forward(xs)))
    }
}

#[derive(Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    head_dim: i64,
    gqa: bool,
}

/// `x * cos + rotate_half(x) * sin`, `x` of shape `[b, heads, t, head_dim]`.
fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let halves = x.chunk(2, -1);
    let rotated = Tensor::cat(&[halves[1].neg(), halves[0].shallow_clone()], -1);
    x * cos + rotated * sin
}

impl Attention {
    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().expect("activations are [batch, seq, hidden]");
        // -1 heads: all of them in one process, this rank's under tensor parallelism
        let heads = |y: Tensor| y.reshape([b, t, -1, self.head_dim]).transpose(1, 2);
        let q = rotary(&heads(self.q_proj.forward(x)), cos, sin);
        let k = rotary(&heads(self.k_proj.forward(x)), cos, sin);
        let v = heads(self.v_proj.forward(x));
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, self.gqa);
        self.o_proj.forward(&y.transpose(1, 2).reshape([b, t, -1]))
    }
}

#[derive(Debug)]
struct Layer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl Layer {
    fn new(p: nn::Path, cfg: &Config) -> Self {
        let (a, m) = (&p / "self_attn", &p / "mlp");
        let (h, q, kv) = (cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        Layer {
            input_layernorm: RmsNorm::new(&p / "input_layernorm", cfg),
            self_attn: Attention {
                q_proj: linear(&a / "q_proj", h, q, cfg),
                k_proj: linear(&a / "k_proj", h, kv, cfg),
                v_proj: linear(&a / "v_proj", h, kv, cfg),
                o_proj: linear(&a / "o_proj", q, h, cfg),
                head_dim: cfg.head_dim,
                gqa: cfg.kv_heads != cfg.heads,
            },
            post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", cfg),
            mlp: Mlp {
                gate_proj: linear(&m / "gate_proj", h, cfg.intermediate, cfg),
                up_proj: linear(&m / "up_proj", h, cfg.intermediate, cfg),
                down_proj: linear(&m / "down_proj", cfg.intermediate, h, cfg),
            },
        }
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let x = x + self.self_attn.forward(&self.input_layernorm.forward(x), cos, sin);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
}

/// A decoder layer with its own rotary frequencies: a module of the activations alone.
#[derive(Debug)]
struct Decoder {
    layer: Layer,
    inv_freq: Tensor,
}

impl Module for Decoder {
    fn forward(&self, x: &Tensor) -> Tensor {
        let (cos, sin) = rope(&self.inv_freq, x.size()[1]);
        self.layer.forward(x, &cos, &sin)
    }
}

/// A decoder layer, its activations kept or recomputed in backward (`--recompute`: torchtitan's full
/// activation checkpointing, per layer).
#[derive(Debug)]
enum Block {
    Kept(Box<Decoder>),
    Recomputed(Checkpointed<Decoder>),
}

impl Block {
    fn new(p: nn::Path, cfg: &Config, recompute: bool) -> Block {
        let inv_freq = Tensor::from_slice(&cfg.inv_freq).to_kind(Kind::Float).to_device(p.device());
        let d = Decoder { layer: Layer::new(p, cfg), inv_freq };
        if recompute {
            Block::Recomputed(Checkpointed::new(d))
        } else {
            Block::Kept(Box::new(d))
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Block::Kept(d) => d.forward(x),
            Block::Recomputed(d) => d.forward(x),
        }
    }
}

#[derive(Debug)]
struct Llama {
    embed_tokens: nn::Embedding,
    layers: Vec<Unit<Block>>,
    norm: RmsNorm,
    /// `None` when tied: the embedding's weight.
    lm_head: Option<Linear>,
}

impl Llama {
    /// Hugging Face's names: `model.embed_tokens`, `model.layers.{i}.…`, `model.norm`, `lm_head`.
    fn new(root: nn::Path, cfg: &Config, recompute: bool) -> Self {
        let m = &root / "model";
        let embed =
            nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: cfg.init_std }, ..Default::default() };
        let layers = (0..cfg.layers)
            .map(|i| {
                let p = &m / "layers" / i;
                // an FSDP unit per layer
                nn::unit(&p, Block::new(p.clone(), cfg, recompute))
            })
            .collect();
        Llama {
            embed_tokens: nn::embedding(&m / "embed_tokens", cfg.vocab, cfg.hidden, embed),
            layers,
            norm: RmsNorm::new(&m / "norm", cfg),
            lm_head: (!cfg.tied).then(|| linear(&root / "lm_head", cfg.hidden, cfg.vocab, cfg)),
        }
    }
}

/// The rotary table of positions `0..t`: `(cos, sin)`, each `[t, head_dim]` (the frequencies twice).
fn rope(inv_freq: &Tensor, t: i64) -> (Tensor, Tensor) {
    let freqs = Tensor::arange(t, (Kind::Float, inv_freq.device())).outer(inv_freq);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos(), emb.sin())
}

impl Module for Llama {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let mut x = self.embed_tokens.forward(ids);
        for layer in &self.layers {
            x = layer.forward(&x);
        }
        let x = self.norm.forward(&x);
        match &self.lm_head {
            Some(head) => head.forward(&x),
            None => x.matmul(&self.embed_tokens.ws().tr()),
        }
    }
}

/// The model as pipeline layers (`--pp`): the embedding, each decoder layer (with its own rotary
/// table) and the head, each under its layer's name, then Hugging Face's (`layer3.model.layers.3.mlp…`).
/// The embedding and the head sit in different stages, so their weights cannot be tied.
fn layer_list(cfg: &Config, seed: i64, recompute: bool) -> LayerList {
    #[derive(Debug)]
    struct Head(RmsNorm, Linear);
    impl Module for Head {
        fn forward(&self, x: &Tensor) -> Tensor {
            self.1.forward(&self.0.forward(x))
        }
    }
    let c = cfg.clone();
    let init =
        nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: cfg.init_std }, ..Default::default() };
    let mut list = LayerList::new()
        .seed(seed)
        .add("embed", move |p| nn::embedding(p / "model" / "embed_tokens", c.vocab, c.hidden, init));
    for i in 0..cfg.layers {
        let c = cfg.clone();
        list = list.add(&format!("layer{i}"), move |p| Block::new(p / "model" / "layers" / i, &c, recompute));
    }
    let c = cfg.clone();
    list.add("head", move |p| {
        Head(RmsNorm::new(p / "model" / "norm", &c), linear(p / "lm_head", c.hidden, c.vocab, &c))
    })
}

/// Hugging Face's name of a tensor -> its path in [`layer_list`]'s stages.
fn staged(name: &str) -> HfSlot {
    let layer = match name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()) {
        Some(i) => format!("layer{i}"),
        None if name.starts_with("model.embed_tokens.") => "embed".into(),
        None => "head".into(),
    };
    HfSlot::Var(format!("{layer}.{name}"))
}

/// A stage's path -> Hugging Face's name (the layer's name dropped).
fn unstaged(var: &str, _shape: &[i64]) -> Vec<HfPart> {
    vec![HfPart::whole(var.split_once('.').map_or(var, |(_, n)| n))]
}

/// The layout's data parallelism, and tensor parallelism by Hugging Face's names (Megatron's split:
/// q, k, v, gate and up by columns, o and down by rows).
fn plan(mesh: &ParallelMesh, bf16: bool) -> Plan {
    // --bf16: FSDP gathers and computes in bfloat16, its gradients reduced in float32 (FSDP2's
    // MixedPrecisionPolicy); the other layouts compute under autocast
    let fsdp = if bf16 { FsdpOptions::default().param_dtype(Kind::BFloat16) } else { FsdpOptions::default() };
    mesh.plan_with(DdpOptions::default(), fsdp)
        .styles(&["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"], Style::colwise())
        .styles(&["*.o_proj", "*.down_proj"], Style::rowwise())
}

/// The training data: token ids read from a file on demand, or a text tokenised once (`--tokenizer`).
/// Sequence `i` is tokens `i * seq_len ..` (wrapping), and the position in the data is the next sequence
/// to read.
enum Tokens {
    File { file: std::fs::File, width: u64, count: u64 },
    Text(Vec<u32>),
}

impl Tokens {
    fn open(path: &str, dtype: &str, tokenizer: Option<&str>) -> Result<Tokens> {
        if let Some(t) = tokenizer {
            let tok = tokenizers::Tokenizer::from_file(t).map_err(|e| format!("--tokenizer {t}: {e}"))?;
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("--data {path} (text, for --tokenizer): {e}"))?;
            let ids = tok.encode(text, false).map_err(|e| format!("--tokenizer {t} on --data {path}: {e}"))?;
            return Ok(Tokens::Text(ids.get_ids().to_vec()));
        }
        let file = std::fs::File::open(path).map_err(|e| format!("--data {path}: {e}"))?;
        let width = if dtype == "u32" { 4 } else { 2 };
        let count = file.metadata()?.len() / width;
        Ok(Tokens::File { file, width, count })
    }

    fn count(&self) -> u64 {
        match self {
            Tokens::File { count, .. } => *count,
            Tokens::Text(ids) => ids.len() as u64,
        }
    }

    /// Sequences `position + rows` of `len + 1` tokens each, as int64 `[rows, len + 1]`.
    fn batch(&self, position: i64, rows: std::ops::Range<i64>, len: i64) -> Result<Tensor> {
        let (span, count) = ((len + 1) as u64, self.count());
        if count < span {
            return Err(format!("--data holds {count} tokens, fewer than one sequence of {span}").into());
        }
        let starts = (count - span) / len as u64 + 1; // windows that fit
        let mut ids = Vec::with_capacity((rows.end - rows.start) as usize * span as usize);
        for r in rows {
            let at = (position + r) as u64 % starts * len as u64;
            match self {
                Tokens::File { file, width, .. } => {
                    let mut buf = vec![0u8; (span * width) as usize];
                    file.read_exact_at(&mut buf, at * width)?;
                    ids.extend(buf.chunks(*width as usize).map(|c| match c {
                        [a, b] => u16::from_le_bytes([*a, *b]) as i64,
                        _ => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
                    }));
                }
                Tokens::Text(all) => ids.extend(all[at as usize..(at + span) as usize].iter().map(|&t| t as i64)),
            }
        }
        Ok(Tensor::from_slice(&ids).view([-1, span as i64]))
    }
}

/// The model in either form: whole (DDP, FSDP, TP) or this rank's pipeline stages.
enum Model {
    Whole(Parallel<Llama>, nn::VarStore),
    Staged(PipelineRank),
}

fn cross_entropy(logits: &Tensor, y: &Tensor) -> Tensor {
    logits.to_kind(Kind::Float).view([-1, logits.size()[2]]).cross_entropy_for_logits(&y.reshape([-1]))
}

impl Model {
    fn build(a: &Args, mesh: &ParallelMesh, cfg: &Config, microbatches: usize, device: Device) -> Result<Model> {
        if a.pp == 1 {
            let vs = nn::VarStore::new(device);
            tch::manual_seed(a.seed); // every rank and every layout: the same fresh model
            let model = plan(mesh, a.bf16).build(&vs, || Llama::new(vs.root(), cfg, a.recompute))?;
            return Ok(Model::Whole(model, vs));
        }
        if cfg.tied {
            return Err(
                "--pp: tie_word_embeddings is true, and the embedding and the head sit in different stages".into()
            );
        }
        let layers = layer_list(cfg, a.seed, a.recompute);
        let part = Partition::balanced(&vec![1.0; layers.len()], a.pp)?;
        let pcfg = PipelineConfig { microbatches, plan: plan(mesh, a.bf16), device, ..Default::default() };
        Ok(Model::Staged(PipelineRank::build(mesh.pp_group().clone(), &layers, &part, pcfg)?))
    }

    fn stores(&self) -> Vec<&nn::VarStore> {
        match self {
            Model::Whole(_, vs) => vec![vs],
            Model::Staged(stage) => stage.var_stores(),
        }
    }

    /// What the optimizer steps (FSDP's shards).
    fn parameters(&self) -> Vec<Tensor> {
        match self {
            Model::Whole(_, vs) => vs.trainable_variables(),
            Model::Staged(stage) => stage.parameters(),
        }
    }

    /// Hugging Face's name -> the variable's path.
    fn slot(&self) -> fn(&str) -> HfSlot {
        match self {
            Model::Whole(..) => HfSlot::same,
            Model::Staged(_) => staged,
        }
    }

    /// The variable's path -> Hugging Face's name.
    fn hf_names(&self) -> fn(&str, &[i64]) -> Vec<HfPart> {
        match self {
            Model::Whole(..) => HfPart::same,
            Model::Staged(_) => unstaged,
        }
    }

    /// Forward and backward of a batch in `m` microbatches, each's mean loss over `m` (the batch's mean
    /// over its tokens, whatever the split), the gradients reduced once, after the last. Returns the
    /// loss where this rank has it (under a pipeline, the last stage), and with `keep` each
    /// microbatch's logits there.
    fn step(
        &mut self,
        xs: &Tensor,
        ys: &Tensor,
        m: usize,
        keep: bool,
        bf16: bool,
    ) -> Result<(Option<Tensor>, Vec<Tensor>)> {
        // bfloat16 matmuls and attention, float32 where autocast keeps it (and in RMSNorm, the loss)
        let _autocast = bf16.then(|| AutocastGuard::new(xs.device(), Kind::BFloat16)).transpose()?;
        let kept = Arc::new(std::sync::Mutex::new(Vec::new()));
        match self {
            Model::Whole(model, _) => {
                let mut total: Option<Tensor> = None; // on the loss's device
                let (xs, ys) = (xs.chunk(m as i64, 0), ys.chunk(m as i64, 0));
                for (i, (x, y)) in xs.iter().zip(&ys).enumerate() {
                    model.set_requires_gradient_sync(i + 1 == m); // DDP's and FSDP's no_sync
                    let logits = model.forward(x);
                    if keep {
                        kept.lock().expect("not poisoned").push(logits.detach().to_kind(Kind::Float));
                    }
                    let loss = cross_entropy(&logits, y) / m as f64;
                    model.backward(&loss)?;
                    let loss = loss.detach();
                    total = Some(match total {
                        Some(t) => t + loss,
                        None => loss,
                    });
                }
                Ok((total, std::mem::take(&mut *kept.lock().expect("not poisoned"))))
            }
            Model::Staged(stage) => {
                let k = kept.clone();
                let loss = move |logits: &Tensor, y: &Tensor| {
                    if keep {
                        k.lock().expect("not poisoned").push(logits.detach().to_kind(Kind::Float));
                    }
                    cross_entropy(logits, y)
                };
                let report = stage.step(xs, ys, &loss)?;
                Ok((report.loss, std::mem::take(&mut *kept.lock().expect("not poisoned"))))
            }
        }
    }

    fn zero_grad(&self) -> Result<()> {
        match self {
            Model::Whole(model, _) => model.zero_grad()?,
            Model::Staged(stage) => stage.zero_grad()?,
        }
        Ok(())
    }
}

/// `--lr` after a linear warm-up of `warmup` steps, then down a cosine to a tenth of it at `steps`
/// (torchtitan's warmup_stable_decay with no stable phase, and its `lr_min` 0.1).
fn learning_rate(a: &Args, step: usize) -> f64 {
    if step < a.warmup {
        return a.lr * (step + 1) as f64 / (a.warmup + 1) as f64;
    }
    let decay = (a.steps.saturating_sub(a.warmup)).max(1) as f64;
    let progress = ((step - a.warmup) as f64 / decay).min(1.0);
    a.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

fn main() {
    // the error's own words (a `main` returning it would print its Debug form)
    if let Err(e) = run(Args::parse()) {
        eprintln!("Error: {e}");
        std::process::exit(1);
    }
}

fn run(a: Args) -> Result<()> {
    tch_dist::memory::install_cpu_counter()?; // before any tensor, so the CPU's bytes are all counted
    tch::set_num_threads(1);
    let world = Arc::new(ProcessGroup::from_env()?);
    let dims =
        ParallelDims { pp: a.pp, dp_replicate: a.dp_replicate, dp_shard: a.dp_shard, tp: a.tp, ..Default::default() };
    let mesh = dims.build(&world)?;
    let source = a.from_hf.as_ref().map(HfCheckpoint::open).transpose()?;
    let config = match (&source, &a.config) {
        (Some(hf), None) => hf.config()?,
        (None, Some(path)) => {
            serde_json::from_slice(&std::fs::read(path).map_err(|e| format!("--config {path}: {e}"))?)?
        }
        (Some(_), Some(_)) => return Err("give --from-hf DIR or --config config.json, not both".into()),
        (None, None) => {
            return Err("give --from-hf DIR (a model to start from) or --config config.json (a fresh one)".into())
        }
    };
    let cfg = Config::from_json(&config)?;
    for (what, n) in [
        ("num_attention_heads", cfg.heads),
        ("num_key_value_heads", cfg.kv_heads),
        ("intermediate_size", cfg.intermediate),
    ] {
        if n % a.tp as i64 != 0 {
            return Err(format!("--tp {}: config.json's {what} ({n}) is not divisible by it", a.tp).into());
        }
    }
    let microbatches = a.microbatches.unwrap_or(a.pp);
    if microbatches == 0 || a.batch % microbatches as i64 != 0 {
        return Err(format!("--microbatches {microbatches} does not divide --batch {}", a.batch).into());
    }
    // the data checked before the model is built and loaded: a mistake there costs no load
    let global = a.batch * mesh.dims().dp() as i64;
    let data = a.data.as_ref().map(|p| Tokens::open(p, &a.data_dtype, a.tokenizer.as_deref())).transpose()?;
    if let Some(d) = &data {
        let _ = d.batch(0, 0..1, a.seq_len)?; // its first sequence: the file is long enough
    }
    let need_data = || data.as_ref().ok_or("--data FILE is needed to train or to dump logits");
    let device = world.device(); // the GPU NCCL binds, else the CPU
    let mut model = Model::build(&a, &mesh, &cfg, microbatches, device)?;
    if let Some(hf) = &source {
        // what loading costs on top of the model as the layout holds it (the allocator's count)
        let held = tch_dist::memory::allocated(device)?;
        tch_dist::memory::reset_peak(device)?;
        let loaded = hf.load_stores(&world, &model.stores(), model.slot())?;
        let extra = tch_dist::memory::peak(device)? - held;
        if world.rank() == 0 || a.load_report {
            let (n, bytes) = (loaded.tensors, loaded.bytes_read);
            let dir = hf.dir().display();
            println!(
                "load rank {}: {n} tensors from {dir}, {bytes} bytes read, {held} bytes held, peak +{extra}",
                world.rank()
            );
        }
    }
    if let Some(path) = &a.dump_logits {
        // every rank runs the whole first batch (collective under FSDP, TP and the pipeline); the last
        // stage has the logits
        let batch = need_data()?.batch(0, 0..global, a.seq_len)?.to_device(device);
        let (ids, ys) = (batch.narrow(1, 0, a.seq_len).contiguous(), batch.narrow(1, 1, a.seq_len));
        let (_, kept) = model.step(&ids, &ys, microbatches, true, a.bf16)?;
        model.zero_grad()?; // the step was for its logits
        if mesh.is_reporter() {
            let (ids, logits) = (ids.to_device(Device::Cpu), Tensor::cat(&kept, 0).to_device(Device::Cpu).contiguous());
            Tensor::write_safetensors(&[("input_ids", &ids), ("logits", &logits)], path)?;
        }
    }

    let mut opt = AdamW::new(model.parameters(), a.lr);
    // the position in the data (the next sequence to read) is saved and resumed with the model
    let position = Tensor::zeros([1], (Kind::Int64, Device::Cpu));
    let mut ck = a.checkpoint.as_ref().map(|dir| Checkpointer::new(world.clone(), dir)).transpose()?;
    let state = |model: &Model, opt: &mut AdamW, position: &Tensor, f: &mut dyn FnMut(&mut StateDict) -> Result<()>| {
        let mut sd = StateDict::new();
        for vs in model.stores() {
            sd.var_store("model", vs);
        }
        sd.optimizer("optim", opt).tensor("data.position", position);
        f(&mut sd)
    };
    let mut start = 0;
    if let (true, Some(ck)) = (a.resume, ck.as_mut()) {
        state(&model, &mut opt, &position, &mut |sd| {
            start = ck.load(sd)?.unwrap_or(0) as usize;
            Ok(())
        })?;
    }
    let rows = mesh.rows(global)?;
    let tokens = (rows.end - rows.start) as f64 * a.seq_len as f64 / (a.pp * a.tp) as f64;
    let mut meter =
        Throughput::new(ThroughputConfig { flops_per_token: cfg.flops_per_token(a.seq_len), ..Default::default() })?;
    for step in start..a.steps {
        let at = position.int64_value(&[0]);
        let batch = need_data()?.batch(at, rows.clone(), a.seq_len)?.to_device(device);
        let (xs, ys) = (batch.narrow(1, 0, a.seq_len), batch.narrow(1, 1, a.seq_len));
        opt.lr = learning_rate(&a, step);
        let (loss, _) = model.step(&xs, &ys, microbatches, false, a.bf16)?;
        opt.step()?;
        model.zero_grad()?;
        let _ = position.shallow_clone().fill_(at + global);
        meter.add_tokens(tokens);
        if let (Some(l), true) = (loss, step % a.log_every == 0 || step + 1 == a.steps) {
            // the mean over the ranks with the loss (a collective among them, alike on each)
            let l = mesh.average_loss(&l)?.double_value(&[]);
            if mesh.is_reporter() {
                println!("step {step}: loss {l:.6} lr {:.3e}  {}", opt.lr, meter.report()?);
            }
        }
        if let Some(ck) = ck.as_mut() {
            if (step + 1) % a.checkpoint_every == 0 || step + 1 == a.steps {
                state(&model, &mut opt, &position, &mut |sd| Ok(ck.save(step as u64 + 1, sd)?))?;
            }
        }
    }
    if let Some(dir) = &a.to_hf {
        let opts = HfSaveOptions { config: Some(config), ..Default::default() };
        save_hf_stores(&world, dir, &model.stores(), &opts, model.hf_names())?;
        if world.rank() == 0 {
            beside_the_weights(&a, std::path::Path::new(dir))?;
        }
    }
    Ok(())
}

/// What `save_pretrained` and a tokenizer's save leave beside the weights, copied from `--from-hf` (and
/// `--tokenizer` as tokenizer.json when the source had none), so that the trained directory loads and
/// generates as the source did.
fn beside_the_weights(a: &Args, dir: &std::path::Path) -> Result<()> {
    const FILES: [&str; 7] = [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
    ];
    let copy = |from: &std::path::Path, to: &std::path::Path| -> Result<()> {
        std::fs::copy(from, to).map_err(|e| format!("--to-hf {}: copying {}: {e}", dir.display(), from.display()))?;
        Ok(())
    };
    if let Some(src) = &a.from_hf {
        for f in FILES {
            let from = std::path::Path::new(src).join(f);
            if from.is_file() {
                copy(&from, &dir.join(f))?;
            }
        }
    }
    if let Some(t) = &a.tokenizer {
        if !dir.join("tokenizer.json").exists() {
            copy(std::path::Path::new(t), &dir.join("tokenizer.json"))?;
        }
    }
    Ok(())
}
