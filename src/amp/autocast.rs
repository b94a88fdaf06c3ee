//! Autocast regions (`torch.autocast`). The state is per thread, as in libtorch: the forward must run on
//! the thread that entered the region; backward needs none (it follows the forward's dtypes).
use tch::{Device, Kind};

use crate::error::{Error, Result};
use crate::ffi;

/// An autocast region; dropping it restores the thread's previous autocast state. Autocast state is per
/// thread, so the guard stays on the thread that made it (it is not `Send`):
///
/// ```compile_fail
/// fn movable<T: Send>() {}
/// movable::<tch_dist::amp::AutocastGuard>();
/// ```
pub struct AutocastGuard {
    device: i32,
    prev_enabled: i32,
    prev_dtype: i32,
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Enters autocast to `kind` (BFloat16 or Half) for operations on `device`.
    pub fn new(device: Device, kind: Kind) -> Result<AutocastGuard> {
        if !matches!(kind, Kind::BFloat16 | Kind::Half) {
            return Err(Error::invalid("autocast", format!("dtype {kind:?}: autocast casts to BFloat16 or Half")));
        }
        let device = match device {
            Device::Cpu => 0,
            Device::Cuda(_) => 1,
            other => {
                return Err(Error::invalid("autocast", format!("device {other:?}: autocast supports the CPU and CUDA")))
            }
        };
        let (prev_enabled, prev_dtype) = ffi::autocast_enter(device, if kind == Kind::Half { 5 } else { 15 })?;
        Ok(AutocastGuard { device, prev_enabled, prev_dtype, _this_thread: std::marker::PhantomData })
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        ffi::autocast_exit(self.device, self.prev_enabled, self.prev_dtype);
    }
}

/// Runs `f` with autocast to `kind` on `device`.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let (a, b) = (Tensor::ones([2, 3], (Kind::Float, Device::Cpu)), Tensor::ones([3, 2], (Kind::Float, Device::Cpu)));
/// let c = tch_dist::amp::autocast(Device::Cpu, Kind::BFloat16, || a.matmul(&b))?;
/// assert_eq!(c.kind(), Kind::BFloat16);
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub fn autocast<T>(device: Device, kind: Kind, f: impl FnOnce() -> T) -> Result<T> {
    let _guard = AutocastGuard::new(device, kind)?;
    Ok(f())
}
