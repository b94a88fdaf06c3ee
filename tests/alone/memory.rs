//! The memory rulers: the CPU counter sees exactly what tensors hold, and PyTorch measured with the same
//! ruler (ctypes) reports the same bytes for the same model. CUDA stats are in tests/cuda.rs.
use crate::common;

use std::process::Command;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::memory;

#[test]
fn cpu_counter_counts_tensors_and_peak() {
    let _alone = common::alone();
    memory::install_cpu_counter().unwrap();
    assert!(memory::cpu_counter_installed());
    let before = memory::allocated(Device::Cpu).unwrap();
    let t = Tensor::zeros([1000, 250], (Kind::Float, Device::Cpu));
    let during = memory::allocated(Device::Cpu).unwrap();
    // a margin below our tensor, for Gloo's and the runtime's own small allocations
    assert!(during - before >= 1_000_000, "counted {}", during - before);
    memory::reset_peak(Device::Cpu).unwrap();
    let p0 = memory::peak(Device::Cpu).unwrap();
    drop(t);
    let big = Tensor::zeros([4_000_000], (Kind::Float, Device::Cpu));
    assert!(memory::peak(Device::Cpu).unwrap() >= p0 + 16_000_000 - 1_000_000);
    drop(big);
}

#[test]
fn kernels_that_use_raw_allocate_work_under_the_counter() {
    let _alone = common::alone();
    // gelu's CPU kernel takes scratch memory through Allocator::raw_allocate, which requires the
    // DataPtr's context to be its data pointer (a first version of the counter failed this).
    memory::install_cpu_counter().unwrap();
    let x = Tensor::randn([64, 8192], (Kind::Float, Device::Cpu));
    let y = x.f_gelu("none").unwrap();
    assert_eq!(y.size(), vec![64, 8192]);
}

#[test]
#[ignore = "process spawned by rust_and_pytorch_agree_on_linear_1000"]
fn worker_linear_memory() {
    memory::install_cpu_counter().unwrap();
    let before = memory::allocated(Device::Cpu).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(vs.root(), 1000, 1000, Default::default());
    println!("{}", memory::allocated(Device::Cpu).unwrap() - before);
}

fn last_number(out: &std::process::Output) -> i64 {
    let s = String::from_utf8_lossy(&out.stdout);
    s.lines().filter_map(|l| l.trim().parse().ok()).next_back().unwrap_or_else(|| panic!("{}", common::show(out)))
}

#[test]
fn rust_and_pytorch_agree_on_linear_1000() {
    let _alone = common::alone();
    // Each in its own process so that nothing else allocates meanwhile.
    let rust = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", common::test_name!("worker_linear_memory").as_str(), "--nocapture"])
        .output()
        .unwrap();
    let py = Command::new(common::python())
        .arg(common::repo_path("tests/py/linear_memory.py"))
        .env("TCH_DIST_MEMORY_LIB", memory::ruler_library_path())
        .output()
        .unwrap();
    assert!(py.status.success(), "{}", common::show(&py));
    let (r, p) = (last_number(&rust), last_number(&py));
    // weight 1000x1000 + bias 1000, float32
    assert_eq!(r, (1000 * 1000 + 1000) * 4, "Rust counted {r}");
    assert_eq!(r, p, "Rust {r} vs PyTorch {p}");
}
