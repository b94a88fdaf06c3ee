//! tch-dist's binaries, tests and examples find libtorch without LD_LIBRARY_PATH (an rpath to the
//! directory tch-dist-sys built against), and crates above learn that directory too
//! (`DEP_TCH_DIST_LIBTORCH_LIB`, for the one line of their own build script that embeds it).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_DIST_SHIM_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_DIST_SHIM_LIBTORCH_LIB") else {
        panic!("tch-dist: tch-dist-sys did not report its libtorch directory (DEP_TCH_DIST_SHIM_LIBTORCH_LIB)");
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:libtorch_lib={lib}");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // rustc links with --as-needed, which would drop libtorch_cuda from a binary that names none of its
        // symbols and leave CUDA invisible at run time (its backends register as the library loads).
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-lc10_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
