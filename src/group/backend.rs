//! Which engine serves which tensors: a [`Backend`] per device type, as PyTorch's `BackendConfig`
//! ("gloo", "nccl", "cpu:gloo,cuda:nccl").
use crate::error::{Error, Result};

/// A communication engine of c10d.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// CPU tensors, and CUDA tensors for the collectives (send/recv stage CUDA tensors through the CPU).
    Gloo,
    /// CUDA tensors only (`cuda` feature).
    Nccl,
}

impl Backend {
    /// Gloo for CPU tensors, NCCL for CUDA ones (as `torch.distributed` picks).
    pub fn for_device(device: tch::Device) -> Backend {
        match device {
            tch::Device::Cuda(_) => Backend::Nccl,
            _ => Backend::Gloo,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Backend> {
        match s.trim().to_ascii_lowercase().as_str() {
            "gloo" => Ok(Backend::Gloo),
            "nccl" => Ok(Backend::Nccl),
            other => Err(Error::invalid("backend", format!("unknown backend {other:?} (gloo or nccl)"))),
        }
    }
}

/// The backend for each device type of a group. One group may hold two engines, Gloo for CPU tensors
/// and NCCL for CUDA tensors, and every collective goes to the one for its tensors' device, as in
/// PyTorch's `init_process_group("cpu:gloo,cuda:nccl")`.
///
/// ```
/// use tch_dist::{Backend, BackendConfig};
/// let both: BackendConfig = "cpu:gloo,cuda:nccl".parse()?;
/// assert_eq!(both, BackendConfig::CPU_GLOO_CUDA_NCCL);
/// assert_eq!(BackendConfig::from(Backend::Nccl).cpu, None); // NCCL alone takes no CPU tensors
/// assert_eq!(both.to_string(), "cpu:gloo,cuda:nccl");
/// # Ok::<(), tch_dist::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    /// The engine for CPU tensors (only Gloo takes them).
    pub cpu: Option<Backend>,
    /// The engine for CUDA tensors.
    pub cuda: Option<Backend>,
}

impl BackendConfig {
    /// PyTorch's "gloo": one Gloo engine for CPU and CUDA tensors.
    pub const GLOO: BackendConfig = BackendConfig { cpu: Some(Backend::Gloo), cuda: Some(Backend::Gloo) };
    /// PyTorch's "nccl": CUDA tensors only.
    pub const NCCL: BackendConfig = BackendConfig { cpu: None, cuda: Some(Backend::Nccl) };
    /// PyTorch's "cpu:gloo,cuda:nccl": Gloo for CPU tensors (and the group's metadata), NCCL for CUDA.
    pub const CPU_GLOO_CUDA_NCCL: BackendConfig = BackendConfig { cpu: Some(Backend::Gloo), cuda: Some(Backend::Nccl) };

    /// Gloo for a CPU device; Gloo and NCCL for a CUDA device.
    pub fn for_device(device: tch::Device) -> BackendConfig {
        match device {
            tch::Device::Cuda(_) => BackendConfig::CPU_GLOO_CUDA_NCCL,
            _ => BackendConfig::GLOO,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.cpu == Some(Backend::Nccl) {
            return Err(Error::invalid("backend config", "NCCL cannot take CPU tensors: use cpu:gloo"));
        }
        if self.cpu.is_none() && self.cuda.is_none() {
            return Err(Error::invalid("backend config", "no backend for any device"));
        }
        Ok(())
    }

    /// Whether NCCL is part of it.
    pub fn has_nccl(&self) -> bool {
        self.cuda == Some(Backend::Nccl)
    }

    /// The engines to build: (store prefix, backend, serves CPU, serves CUDA). One engine when both
    /// device types name the same backend, under the first device's prefix, as PyTorch registers it.
    pub(crate) fn engines(&self) -> Vec<(&'static str, Backend, bool, bool)> {
        match (self.cpu, self.cuda) {
            (Some(a), Some(b)) if a == b => vec![("cpu/", a, true, true)],
            (cpu, cuda) => {
                let mut v = Vec::new();
                if let Some(b) = cpu {
                    v.push(("cpu/", b, true, false));
                }
                if let Some(b) = cuda {
                    v.push(("cuda/", b, false, true));
                }
                v
            }
        }
    }
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig::GLOO
    }
}

impl From<Backend> for BackendConfig {
    fn from(b: Backend) -> Self {
        match b {
            Backend::Gloo => BackendConfig::GLOO,
            Backend::Nccl => BackendConfig::NCCL,
        }
    }
}

impl std::fmt::Display for BackendConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.cpu, self.cuda) {
            (Some(a), Some(b)) if a == b => write!(f, "{a}"),
            (None, Some(Backend::Nccl)) => write!(f, "nccl"),
            (cpu, cuda) => {
                let parts: Vec<String> =
                    [("cpu", cpu), ("cuda", cuda)].iter().filter_map(|(d, b)| b.map(|b| format!("{d}:{b}"))).collect();
                write!(f, "{}", parts.join(","))
            }
        }
    }
}

impl std::str::FromStr for BackendConfig {
    type Err = Error;
    /// "gloo", "nccl", or "device:backend" pairs such as "cpu:gloo,cuda:nccl".
    fn from_str(s: &str) -> Result<BackendConfig> {
        if !s.contains(':') {
            return Ok(s.parse::<Backend>()?.into());
        }
        let mut c = BackendConfig { cpu: None, cuda: None };
        for pair in s.split(',') {
            let bad = || {
                Error::invalid("backend", format!("{pair:?} in {s:?} is not device:backend (e.g. cpu:gloo,cuda:nccl)"))
            };
            let (dev, b) = pair.split_once(':').ok_or_else(bad)?;
            let slot = match dev.trim().to_ascii_lowercase().as_str() {
                "cpu" => &mut c.cpu,
                "cuda" => &mut c.cuda,
                _ => return Err(bad()),
            };
            if slot.is_some() {
                return Err(Error::invalid("backend", format!("device {dev:?} named twice in {s:?}")));
            }
            *slot = Some(b.parse()?);
        }
        c.validate()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_display_and_engines() {
        for s in ["gloo", "nccl", "cpu:gloo,cuda:nccl", "cuda:gloo"] {
            let c: BackendConfig = s.parse().unwrap();
            assert_eq!(c.to_string(), s);
        }
        assert_eq!("cpu:gloo,cuda:gloo".parse::<BackendConfig>().unwrap(), BackendConfig::GLOO);
        assert_eq!(BackendConfig::GLOO.engines(), vec![("cpu/", Backend::Gloo, true, true)]);
        assert_eq!(BackendConfig::NCCL.engines(), vec![("cuda/", Backend::Nccl, false, true)]);
        assert_eq!(
            BackendConfig::CPU_GLOO_CUDA_NCCL.engines(),
            vec![("cpu/", Backend::Gloo, true, false), ("cuda/", Backend::Nccl, false, true)]
        );
        let e = "cpu:nccl".parse::<BackendConfig>().unwrap_err().to_string();
        assert!(e.contains("NCCL cannot take CPU tensors"), "{e}");
        let e = "cpu:gloo,cpu:gloo".parse::<BackendConfig>().unwrap_err().to_string();
        assert!(e.contains("named twice"), "{e}");
        assert!("mpi".parse::<BackendConfig>().is_err());
        assert!("tpu:gloo".parse::<BackendConfig>().is_err());
    }
}
