//! Training throughput as torchtitan logs it: tokens per second, TFLOP/s and MFU (model FLOPs
//! utilisation) per rank, and peak memory, measured over the steps since the last report.
//!
//! ```no_run
//! use tch_dist::throughput::{transformer_flops_per_token, Throughput, ThroughputConfig};
//! # fn step() {}
//! let world = tch_dist::ProcessGroup::from_env()?;
//! // a 12-layer, 12-head model of 85M parameters besides its embeddings, 1024 tokens of context
//! let flops_per_token = transformer_flops_per_token(85_000_000, 12, 12, 64, 1024);
//! let device = world.device(); // this rank's device (cuda:LOCAL_RANK, or the CPU)
//! let mut meter = Throughput::new(ThroughputConfig { flops_per_token, device, ..Default::default() })?;
//! for i in 1..=100 {
//!     step();
//!     meter.add_tokens(8.0 * 1024.0); // the tokens this rank's step processed
//!     if i % 10 == 0 {
//!         println!("step {i}  {}", meter.report()?); // tok/s 41,210  tflops 312.4  mfu 31.6%  mem 41.2 GiB
//!     }
//! }
//! # Ok::<(), tch_dist::Error>(())
//! ```
//!
//! For another kind of model, the FLOPs per token are those of one sample's forward and backward
//! divided by what the caller counts as its tokens (about 6 per parameter for dense layers), and
//! [`Throughput::add_tokens`] counts the same unit.
use std::time::Instant;

use tch::Device;

use crate::error::{Error, Result};

/// FLOPs of one token's forward and backward through a decoder-only transformer, as torchtitan counts
/// them: `6 N + 12 L H Q T`, where `N` is the parameters besides the token embedding (each used in one
/// multiply-add forward and two backward), and the second term attention's scores and weighted sums
/// (`L` layers, `H` heads of `Q` dimensions, `T` tokens of context).
pub fn transformer_flops_per_token(params: i64, layers: i64, heads: i64, head_dim: i64, seq_len: i64) -> f64 {
    6.0 * params as f64 + 12.0 * (layers * heads * head_dim * seq_len) as f64
}

/// A device's dense bfloat16 peak in FLOP/s from its name as CUDA reports it (torchtitan's table): A100,
/// H100 (SXM, PCIe, NVL), H200, B200; `None` for any other.
pub fn peak_flops(device_name: &str) -> Option<f64> {
    let n = device_name;
    if n.contains("A100") {
        Some(312e12)
    } else if n.contains("H100") {
        Some(if n.contains("NVL") {
            835e12
        } else if n.contains("PCIe") {
            756e12
        } else {
            989e12
        })
    } else if n.contains("H200") {
        Some(989e12)
    } else if n.contains("B200") {
        Some(2.25e15)
    } else {
        None
    }
}

/// What [`Throughput`] needs: the model's FLOPs per token, the device it runs on, and its peak.
#[derive(Clone, Debug, PartialEq)]
pub struct ThroughputConfig {
    /// FLOPs of one token's forward and backward ([`transformer_flops_per_token`] for transformers).
    pub flops_per_token: f64,
    /// The device the rank computes on: its peak memory is reported, and a CUDA device is synchronised
    /// before each report so that the interval covers the work queued in it.
    pub device: Device,
    /// The device's dense peak in FLOP/s for the compute dtype; `None`: [`peak_flops`] of the CUDA
    /// device's name (no MFU on the CPU or on a GPU not in the table).
    pub peak_flops: Option<f64>,
}

impl Default for ThroughputConfig {
    fn default() -> Self {
        ThroughputConfig { flops_per_token: 0.0, device: Device::Cpu, peak_flops: None }
    }
}

/// One report: the steps since the previous one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThroughputReport {
    pub tokens_per_s: f64,
    /// Model FLOP/s, in units of 10^12.
    pub tflops: f64,
    /// Model FLOPs utilisation, in percent of the peak (where the peak is known).
    pub mfu: Option<f64>,
    /// Peak bytes: on a GPU CUDA's allocated (`max_memory_allocated`) over the interval (its peak is
    /// reset at each report, as torchtitan does); on the CPU the process's resident-set high-water mark
    /// since it started (the kernel's, which cannot be reset).
    pub peak_memory: i64,
    /// CUDA's peak reserved bytes over the interval (`max_memory_reserved`: what torchtitan logs), on a
    /// GPU.
    pub peak_reserved: Option<i64>,
}

impl std::fmt::Display for ThroughputReport {
    /// `tok/s 41,210  tflops 312.4  mfu 31.6%  mem 41.2 GiB` (mfu left out where the peak is unknown;
    /// memory: CUDA's reserved peak on a GPU, as torchtitan logs, else [`peak_memory`](Self::peak_memory);
    /// TFLOP/s below 10 with 3 decimals, so that a small model's show).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tok/s {}  ", thousands(self.tokens_per_s.round() as i64))?;
        if self.tflops < 10.0 {
            write!(f, "tflops {:.3}", self.tflops)?;
        } else {
            write!(f, "tflops {:.1}", self.tflops)?;
        }
        if let Some(m) = self.mfu {
            write!(f, "  mfu {m:.1}%")?;
        }
        let mem = self.peak_reserved.unwrap_or(self.peak_memory);
        write!(f, "  mem {:.1} GiB", mem as f64 / (1u64 << 30) as f64)
    }
}

fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Measures tokens per second, TFLOP/s, MFU and peak memory over the steps between reports.
#[derive(Debug)]
pub struct Throughput {
    config: ThroughputConfig,
    peak: Option<f64>,
    since: Instant,
    tokens: f64,
    /// A token count that was negative or not finite (reported by the next report).
    bad_tokens: Option<f64>,
}

impl Throughput {
    /// Starts measuring now (on CUDA, from a reset of the allocator's peak). Errors name a FLOP count
    /// that is negative or not finite, or a peak that is not a finite number above 0.
    pub fn new(config: ThroughputConfig) -> Result<Self> {
        let bad = |what: &str, bound: &str, v: f64| {
            Error::invalid("ThroughputConfig", format!("{what} must be a finite number {bound}, not {v}"))
        };
        if !(config.flops_per_token.is_finite() && config.flops_per_token >= 0.0) {
            return Err(bad("flops_per_token", ">= 0", config.flops_per_token));
        }
        let peak = match (config.peak_flops, config.device) {
            (Some(p), _) if !(p.is_finite() && p > 0.0) => return Err(bad("peak_flops", "> 0", p)),
            (Some(p), _) => Some(p),
            (None, Device::Cuda(i)) => crate::memory::cuda_device_name(i).as_deref().and_then(peak_flops),
            (None, _) => None,
        };
        if let Device::Cuda(_) = config.device {
            crate::memory::reset_peak(config.device)?;
        }
        Ok(Throughput { config, peak, since: Instant::now(), tokens: 0.0, bad_tokens: None })
    }

    /// The tokens this rank processed in a step (its rows of the batch times their length; ranks that
    /// process the same tokens together, as tensor- or context-parallel ones, each count their share).
    /// A count that is negative or not finite is refused by the next [`report`](Self::report).
    pub fn add_tokens(&mut self, tokens: f64) {
        if tokens.is_finite() && tokens >= 0.0 {
            self.tokens += tokens;
        } else {
            self.bad_tokens.get_or_insert(tokens);
        }
    }

    /// The figures since the last report (or since [`new`](Self::new)), then starts a new interval (all
    /// zero where no tokens were added). On CUDA it waits for the device first (a host sync: report
    /// every N steps, not every step).
    pub fn report(&mut self) -> Result<ThroughputReport> {
        if let Some(t) = self.bad_tokens.take() {
            return Err(Error::invalid("Throughput::add_tokens", format!("a token count must be >= 0, not {t}")));
        }
        let (peak_memory, peak_reserved) = match self.config.device {
            Device::Cuda(i) => {
                // tch's synchronize panics on a CUDA error: that becomes this call's error
                std::panic::catch_unwind(|| tch::Cuda::synchronize(i as i64)).map_err(|_| Error::Unavailable {
                    what: format!("cuda:{i}"),
                    msg: "synchronising the device for a throughput report failed".into(),
                })?;
                let peaks = (crate::memory::peak(self.config.device)?, Some(crate::memory::cuda_peak_reserved(i)?));
                crate::memory::reset_peak(self.config.device)?;
                peaks
            }
            _ => (crate::memory::peak_rss()?, None),
        };
        let secs = self.since.elapsed().as_secs_f64().max(f64::MIN_POSITIVE);
        let tokens_per_s = self.tokens / secs;
        let flops = tokens_per_s * self.config.flops_per_token;
        self.since = Instant::now();
        self.tokens = 0.0;
        Ok(ThroughputReport {
            tokens_per_s,
            tflops: flops / 1e12,
            mfu: self.peak.map(|p| 100.0 * flops / p),
            peak_memory,
            peak_reserved,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_follow_the_device_name() {
        assert_eq!(peak_flops("NVIDIA H100 80GB HBM3"), Some(989e12));
        assert_eq!(peak_flops("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(peak_flops("NVIDIA H100 NVL"), Some(835e12));
        assert_eq!(peak_flops("NVIDIA H200"), Some(989e12));
        assert_eq!(peak_flops("NVIDIA A100-SXM4-80GB"), Some(312e12));
        assert_eq!(peak_flops("NVIDIA B200"), Some(2.25e15));
        assert_eq!(peak_flops("Tesla T4"), None);
    }

    /// The report is the interval's tokens over its seconds, times the FLOPs per token, against the peak;
    /// the interval restarts at each report.
    #[test]
    fn a_report_divides_the_interval_tokens_by_its_time() {
        let cfg = ThroughputConfig { flops_per_token: 1e9, peak_flops: Some(1e12), ..Default::default() };
        let mut m = Throughput::new(cfg).unwrap();
        let t0 = Instant::now();
        m.add_tokens(500.0);
        std::thread::sleep(std::time::Duration::from_millis(200));
        m.add_tokens(500.0);
        let r = m.report().unwrap();
        let secs = t0.elapsed().as_secs_f64();
        // 1000 tokens in a little over 0.2 s
        assert!(r.tokens_per_s <= 1000.0 / 0.2 && r.tokens_per_s >= 1000.0 / secs, "{r:?} over {secs} s");
        assert!((r.tflops - r.tokens_per_s * 1e9 / 1e12).abs() < 1e-9);
        assert!((r.mfu.unwrap() - 100.0 * r.tflops * 1e12 / 1e12).abs() < 1e-9);
        assert!(r.peak_memory > 0 && r.peak_reserved.is_none());
        let s = r.to_string();
        assert!(
            s.starts_with("tok/s ") && s.contains("  tflops ") && s.contains("  mfu ") && s.ends_with(" GiB"),
            "{s}"
        );
        // a new interval: no tokens yet
        assert_eq!(m.report().unwrap().tokens_per_s, 0.0);
    }

    #[test]
    fn counts_as_torchtitan_and_refuses_bad_figures() {
        // 6N + 12 L H Q T
        assert_eq!(transformer_flops_per_token(1000, 2, 4, 8, 16), 6000.0 + 12.0 * 2.0 * 4.0 * 8.0 * 16.0);
        assert_eq!(thousands(41210), "41,210");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000_000), "1,000,000");
        let e = Throughput::new(ThroughputConfig { flops_per_token: f64::NAN, ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("flops_per_token"), "{e}");
        let e = Throughput::new(ThroughputConfig { peak_flops: Some(0.0), ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("peak_flops must be a finite number > 0"), "{e}");
        let mut m = Throughput::new(ThroughputConfig::default()).unwrap();
        m.add_tokens(-5.0);
        let e = m.report().unwrap_err();
        assert!(e.to_string().contains("token count must be >= 0, not -5"), "{e}");
        assert_eq!(m.report().unwrap().tokens_per_s, 0.0);
    }
}
