// The one line a crate that depends on tch-dist adds so that its binaries find libtorch without tchrun
// (tch-dist reports the directory it built against).
fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_DIST_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
