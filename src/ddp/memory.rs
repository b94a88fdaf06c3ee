//! Where DDP's memory goes: parameters, gradients, buckets.
use std::collections::HashSet;

use tch::Tensor;

use super::DistributedDataParallel;
use crate::error::Result;

/// Bytes held by a DDP model on its device, and the allocator's view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DdpMemory {
    pub parameters: i64,
    /// Gradients stored outside the buckets (0 with `gradient_as_bucket_view` once grads are views).
    pub gradients: i64,
    pub buckets: i64,
    /// [`crate::memory::allocated`] on the parameters' device.
    pub allocated: i64,
    pub peak: i64,
}

fn bytes(t: &Tensor) -> i64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as i64
}

impl<M> DistributedDataParallel<M> {
    /// Parameters, gradients and buckets in bytes, plus the device's allocated and peak bytes.
    pub fn memory_breakdown(&self) -> Result<DdpMemory> {
        let st = match self.reducer.state.lock() {
            Ok(s) => s,
            Err(e) => e.into_inner(),
        };
        let device = st.params.first().map_or(tch::Device::Cpu, |p| p.device());
        let mut m = DdpMemory::default();
        let mut bucket_ranges: Vec<(u64, u64)> = Vec::new();
        for b in &st.buckets {
            m.buckets += bytes(&b.flat);
            let start = b.flat.data_ptr() as u64;
            bucket_ranges.push((start, start + bytes(&b.flat) as u64));
        }
        let mut seen = HashSet::new();
        for p in &st.params {
            m.parameters += bytes(p);
            let g = p.grad();
            if g.defined() {
                let ptr = g.data_ptr() as u64;
                let inside = bucket_ranges.iter().any(|&(s, e)| ptr >= s && ptr < e);
                if !inside && seen.insert(ptr) {
                    m.gradients += bytes(&g);
                }
            }
        }
        m.allocated = crate::memory::allocated(device)?;
        m.peak = crate::memory::peak(device)?;
        Ok(m)
    }
}
