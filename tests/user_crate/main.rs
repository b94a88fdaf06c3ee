//! A new user's crate (tests/user_crate/: tch's model and optimizer with its zero_grad, a
//! DistributedSampler, DDP), copied outside this repository and built as a package of its own with
//! tch-dist as a path dependency, trains on 2 ranks under tchrun with no environment variables set. Its
//! build script is the README's one line that embeds libtorch's directory, so its binary also runs
//! without tchrun (torchrun's variables set by hand, no LD_LIBRARY_PATH).
#[path = "../common/mod.rs"]
mod common;

use std::process::Command;

#[test]
fn a_new_users_crate_trains_on_two_ranks_under_tchrun_and_alone_without_a_library_path() {
    let dir = std::env::temp_dir().join(format!("tdx-user-crate-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let template = std::fs::read_to_string(common::repo_path("tests/user_crate/Cargo.toml.in")).unwrap();
    std::fs::write(dir.join("Cargo.toml"), template.replace("@TCH_DIST@", env!("CARGO_MANIFEST_DIR"))).unwrap();
    std::fs::copy(common::repo_path("tests/user_crate/src/main.rs"), dir.join("src/main.rs")).unwrap();
    std::fs::copy(common::repo_path("tests/user_crate/build.rs"), dir.join("build.rs")).unwrap();
    // the same dependency versions as this repository, so the shared target directory is reused
    std::fs::copy(common::repo_path("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    // built in this repository's target directory, whose dependencies it reuses (cargo releases the
    // directory's lock once the tests are built)
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| common::repo_path("target"), Into::into);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Command::new(cargo).arg("build").current_dir(&dir).env("CARGO_TARGET_DIR", &target).output().unwrap();
    assert!(built.status.success(), "{}", common::show(&built));
    let bin = target.join("debug/my-trainer");

    // one process, started by hand: torchrun's variables, no library path
    let alone = Command::new(&bin)
        .env_remove("LD_LIBRARY_PATH")
        .envs([("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")])
        .env("MASTER_PORT", common::free_port().to_string())
        .output()
        .unwrap();
    assert!(alone.status.success(), "{}", common::show(&alone));
    assert!(String::from_utf8_lossy(&alone.stdout).contains("rank 0 of 1: last loss"), "{}", common::show(&alone));

    let run = Command::new(common::tchrun())
        .args(["--standalone", "--nproc-per-node", "2", "--"])
        .arg(&bin)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{}", common::show(&run));
    for r in 0..2 {
        assert!(out.contains(&format!("[rank{r}]: rank {r} of 2: last loss")), "{out}");
    }
    assert_eq!(out.matches("parameters equal across ranks: true").count(), 2, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
