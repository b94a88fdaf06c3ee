//! Compiles the C++ shim in `csrc/` against the libtorch that torch-sys found, reports that libtorch's
//! directory to the crates above (`DEP_TCH_DIST_SHIM_LIBTORCH_LIB`, and the `LIBTORCH_LIB` constant), and
//! builds the memory ruler alone as `libtch_dist_memory.so` for Python processes (ctypes).
use std::env;
use std::path::{Path, PathBuf};

/// Compiled with the `testing` feature only: libtorch's own implementations that tests compare against.
const TESTING: &[&str] = &["csrc/reference.cpp", "csrc/layout.cpp", "csrc/op_counter.cpp"];

const SOURCES: &[&str] = &[
    "csrc/error.cpp",
    "csrc/store.cpp",
    "csrc/group.cpp",
    "csrc/hooks.cpp",
    "csrc/memory.cpp",
    "csrc/tp.cpp",
    "csrc/all_to_all_op.cpp",
    "csrc/function.cpp",
    "csrc/sync_bn.cpp",
    "csrc/amp.cpp",
    "csrc/random.cpp",
    "csrc/marker.cpp",
    "csrc/recompute.cpp",
    "csrc/storage.cpp",
    "csrc/identity.cpp",
    "csrc/optim.cpp",
    "csrc/tch_optim.cpp",
    "csrc/adamw_single.cpp",
    "csrc/sync_debug.cpp",
    "csrc/stream.cpp",
];

fn libtorch_lib() -> PathBuf {
    // torch-sys declares `links = "tch"` and prints `cargo:libtorch_lib=...`.
    for var in ["DEP_TCH_LIBTORCH_LIB", "DEP_TORCH_SYS_LIBTORCH_LIB"] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(v) = env::var(var) {
            return PathBuf::from(v);
        }
    }
    panic!(
        "tch-dist: torch-sys did not report its libtorch directory (DEP_TCH_LIBTORCH_LIB); \
         run scripts/setup.sh and build through scripts/env.sh"
    );
}

fn base_build(torch: &Path) -> cc::Build {
    let mut b = cc::Build::new();
    b.cpp(true)
        .pic(true)
        .warnings(false)
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .include("csrc/gloo_decl")
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        // Without it ProcessGroupGloo.hpp is silently empty.
        .flag("-DUSE_C10D_GLOO")
        // each float operation rounds on its own, as written (adamw_single.cpp reproduces ATen's roundings)
        .flag("-ffp-contract=off")
        .flag_if_supported("-Wno-c++20-extensions");
    b
}

fn main() {
    let lib = libtorch_lib();
    let torch = lib.parent().expect("libtorch lib dir has a parent").to_path_buf();
    let site_packages = torch.parent().expect("torch dir has a parent").to_path_buf();
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();

    let testing = env::var_os("CARGO_FEATURE_TESTING").is_some();
    for f in SOURCES.iter().chain(TESTING) {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-changed=csrc/tch_dist.h");
    println!("cargo:rerun-if-changed=csrc/common.h");
    println!("cargo:rerun-if-changed=csrc/node_ptr.h");
    println!("cargo:rerun-if-changed=csrc/adamw_single.h");
    println!("cargo:rerun-if-changed=csrc/gloo_decl");

    let mut b = base_build(&torch);
    if cuda {
        let nv = site_packages.join("nvidia");
        b.define("TDX_CUDA", None)
            .define("USE_C10D_NCCL", None)
            .define("USE_CUDA", None)
            .include(nv.join("cu13/include"))
            .include(nv.join("cu13/include/cccl"))
            .include(nv.join("nccl/include"));
    }
    b.files(SOURCES);
    if testing {
        b.files(TESTING);
    }
    b.compile("tch_dist_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    if cuda {
        // the shim calls into c10d's NCCL group and the CUDA caching allocator
        println!("cargo:rustc-link-lib=torch_cuda");
        println!("cargo:rustc-link-lib=c10_cuda");
        // dlsym (csrc/sync_debug.cpp); part of libc since glibc 2.34, a library of its own before
        println!("cargo:rustc-link-lib=dl");
    }
    // Link arguments do not pass to the crates above: each package's build script that links binaries
    // (tch-dist's, tchrun's) embeds the rpath and, with CUDA, libtorch_cuda, from this directory.
    println!("cargo:libtorch_lib={}", lib.display());
    println!("cargo:rustc-env=TCH_DIST_LIBTORCH_LIB={}", lib.display());

    build_memory_ruler(&torch, &lib);
}

/// The same `csrc/memory.cpp`, as a shared library a Python process can load with ctypes.
fn build_memory_ruler(torch: &Path, lib: &Path) {
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let so = out.join("libtch_dist_memory.so");
    let compiler = base_build(torch).get_compiler();
    let mut cmd = compiler.to_command();
    cmd.arg("-shared")
        .arg("-o")
        .arg(&so)
        .arg("csrc/memory.cpp")
        .arg(format!("-L{}", lib.display()))
        .arg("-lc10")
        .arg(format!("-Wl,-rpath,{}", lib.display()));
    let status = cmd.status().expect("running the C++ compiler for libtch_dist_memory.so");
    assert!(status.success(), "building libtch_dist_memory.so failed");
    println!("cargo:rustc-env=TCH_DIST_MEMORY_LIB={}", so.display());
    // Also next to the binaries (target/<profile>/), where scripts look for it.
    if let Some(profile_dir) = out.ancestors().nth(3) {
        let _ = std::fs::copy(&so, profile_dir.join("libtch_dist_memory.so"));
    }
}
