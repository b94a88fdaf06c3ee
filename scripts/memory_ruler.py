"""The tch-dist CPU memory ruler for Python processes.

Loads libtch_dist_memory.so (built by `cargo build` from tch-dist-sys/csrc/memory.cpp, the very code the Rust side
uses) and installs its counting allocator under PyTorch's CPU allocator, so PyTorch and tch-dist are
measured with one ruler. Import it and call install() before creating any tensor you want counted.

The library is found through TCH_DIST_MEMORY_LIB, else target/{release,debug}/ of this repository.
"""
import ctypes
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_lib = None


def library_path():
    env = os.environ.get("TCH_DIST_MEMORY_LIB")
    if env:
        return env
    for profile in ("release", "debug"):
        p = os.path.join(_HERE, "..", "target", profile, "libtch_dist_memory.so")
        if os.path.exists(p):
            return os.path.abspath(p)
    raise FileNotFoundError("libtch_dist_memory.so not found: build the crate first (cargo build)")


def _load():
    global _lib
    if _lib is None:
        import torch  # noqa: F401  (libc10 must be loaded before our library resolves against it)

        _lib = ctypes.CDLL(library_path())
        _lib.tdx_cpu_allocated.restype = ctypes.c_int64
        _lib.tdx_cpu_peak.restype = ctypes.c_int64
    return _lib


def install():
    if _load().tdx_cpu_counter_install() != 0:
        raise RuntimeError("could not install the counting CPU allocator")


def allocated():
    return _load().tdx_cpu_allocated()


def peak():
    return _load().tdx_cpu_peak()


def reset_peak():
    """The peak from now on starts at what is allocated now."""
    _load().tdx_cpu_reset_peak()


def reset_peak():
    _load().tdx_cpu_reset_peak()
