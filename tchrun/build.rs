//! tchrun finds libtorch without LD_LIBRARY_PATH: an rpath to the directory tch-dist was built against.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_DIST_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_DIST_LIBTORCH_LIB") else {
        panic!("tchrun: tch-dist did not report its libtorch directory (DEP_TCH_DIST_LIBTORCH_LIB)");
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
}
