//! Checks against the linked libtorch: the declaration-only gloo headers (tch-dist-sys/csrc/gloo_decl) agree with the
//! library's object layout, and libtorch's own DDP bucket assignment is reachable.
use tch::Kind;
use tch_dist::reference;

#[test]
fn gloo_declaration_headers_match_libtorch() {
    let what = reference::gloo_layout_check().expect("layout check");
    println!("{what}");
    assert!(what.contains("sizeof(ProcessGroupGloo)="), "{what}");
}

#[test]
fn libtorch_bucket_assignment_is_reachable() {
    // 3 float tensors of 1 MiB each with a 1 MiB limit: one bucket each, sorted by index.
    let n = 1 << 18;
    let b = reference::libtorch_bucket_assignment(&[n, n, n], &[Kind::Float; 3], &[0, 0, 0], &[1 << 20]).unwrap();
    assert_eq!(b, vec![vec![0], vec![1], vec![2]]);
    // dtypes never share a bucket
    let b = reference::libtorch_bucket_assignment(&[4, 4], &[Kind::Float, Kind::Double], &[0, 0], &[1 << 20]).unwrap();
    assert_eq!(b.len(), 2);
}
