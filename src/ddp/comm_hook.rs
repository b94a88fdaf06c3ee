//! Communication hooks: how a ready bucket is reduced across ranks (PyTorch's `register_comm_hook` with
//! its built-in `allreduce_hook`, `fp16_compress_hook`, `bf16_compress_hook`).
use tch::{Kind, Tensor};

use crate::error::Result;
use crate::group::{ProcessGroup, ReduceOp};
use crate::work::Work;

/// The reduction a bucket goes through. Gradients are already divided by the world size when they are
/// copied into the bucket, so every hook sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CommHook {
    /// SUM-allreduce of the bucket as it is (PyTorch's default).
    #[default]
    Allreduce,
    /// Cast the bucket to float16, allreduce, cast back: half the bytes on the wire.
    Fp16Compress,
    /// Cast the bucket to bfloat16, allreduce, cast back: half the bytes, float32's range.
    Bf16Compress,
}

/// A bucket reduction in flight; `finish` writes the result into the bucket.
pub(crate) struct InFlight {
    pub bucket: usize,
    work: Work,
    compressed: Option<Tensor>,
}

impl CommHook {
    fn wire_kind(self) -> Option<Kind> {
        match self {
            CommHook::Allreduce => None,
            CommHook::Fp16Compress => Some(Kind::Half),
            CommHook::Bf16Compress => Some(Kind::BFloat16),
        }
    }

    /// Starts reducing `flat` (bucket number `bucket`).
    pub(crate) fn launch(self, pg: &ProcessGroup, bucket: usize, flat: &Tensor) -> Result<InFlight> {
        match self.wire_kind() {
            Some(k) if flat.kind() != k => {
                let mut c = flat.f_to_kind(k)?;
                let work = pg.allreduce_unverified(&mut c, ReduceOp::Sum)?;
                Ok(InFlight { bucket, work, compressed: Some(c) })
            }
            _ => {
                let mut t = flat.shallow_clone();
                let work = pg.allreduce_unverified(&mut t, ReduceOp::Sum)?;
                Ok(InFlight { bucket, work, compressed: None })
            }
        }
    }
}

impl InFlight {
    /// Waits for the reduction and leaves its result in `flat`.
    pub(crate) fn finish(self, flat: &mut Tensor) -> Result<()> {
        self.work.wait()?;
        if let Some(c) = self.compressed {
            flat.f_copy_(&c)?;
        }
        Ok(())
    }
}
