use super::*;

fn tree(root: &Path) {
    std::fs::create_dir_all(root.join("inductor/ab")).expect("mkdir");
    std::fs::create_dir_all(root.join("triton")).expect("mkdir");
    std::fs::write(root.join("inductor/ab/graph.py"), b"def f(): pass\n").expect("write");
    std::fs::write(root.join("triton/k.so"), vec![7u8; 5000]).expect("write");
}

/// A tar whose one entry has the raw `name` and `kind` (the builder's own
/// path checks are passed over, as a hostile peer's would be).
fn raw_tar(out: &Path, name: &[u8], kind: tar::EntryType, data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    let mut b = tar::Builder::new(std::fs::File::create(out).expect("create"));
    b.append(&h, data).expect("append");
    b.finish().expect("finish");
}

#[test]
fn a_packed_cache_unpacks_the_same_and_leaves_links_out() {
    let t = tempfile::tempdir().expect("tempdir");
    let from = t.path().join("from");
    tree(&from);
    std::fs::write(t.path().join("secret"), b"not the cache's").expect("write");
    std::os::unix::fs::symlink(t.path().join("secret"), from.join("triton/link")).expect("link");
    let blob = t.path().join("blob.tar");
    let m = pack(&from, &blob, 1 << 20).expect("pack");
    assert_eq!((m.files, m.bytes, m.left_out), (2, 14 + 5000, 0), "{m:?}");

    let to = t.path().join("to");
    std::fs::create_dir_all(to.join("jax")).expect("mkdir");
    assert!(holds_no_file(&to));
    let u = unpack(&blob, &to, 1 << 20).expect("unpack");
    assert_eq!((u.files, u.bytes), (2, 5014));
    assert_eq!(
        std::fs::read(to.join("triton/k.so")).expect("read"),
        vec![7u8; 5000]
    );
    assert!(to.join("inductor/ab/graph.py").is_file());
    assert!(std::fs::symlink_metadata(to.join("triton/link")).is_err());
    // Not into a folder that holds files.
    assert!(matches!(
        unpack(&blob, &to, 1 << 20),
        Err(ShareError::NotEmpty(_))
    ));
}

#[test]
fn a_pack_keeps_to_the_bound() {
    let t = tempfile::tempdir().expect("tempdir");
    tree(t.path());
    let blob = tempfile::NamedTempFile::new().expect("tmp");
    let m = pack(t.path(), blob.path(), 1000).expect("pack");
    assert_eq!((m.files, m.bytes, m.left_out), (1, 14, 1), "{m:?}");
}

#[test]
fn hostile_entries_refuse_the_blob_and_leave_nothing() {
    let t = tempfile::tempdir().expect("tempdir");
    let cases: [(&[u8], tar::EntryType, &str); 6] = [
        (b"../escape", tar::EntryType::Regular, "plain relative"),
        (b"/etc/evil", tar::EntryType::Regular, "plain relative"),
        (b"a/./../../x", tar::EntryType::Regular, "plain relative"),
        (b"inductor/l", tar::EntryType::Symlink, "regular file"),
        (b"inductor/h", tar::EntryType::Link, "regular file"),
        (b"dev", tar::EntryType::Char, "regular file"),
    ];
    for (i, (name, kind, why)) in cases.iter().enumerate() {
        let blob = t.path().join(format!("b{i}.tar"));
        raw_tar(&blob, name, *kind, b"x");
        let to = t.path().join(format!("to{i}"));
        std::fs::create_dir(&to).expect("mkdir");
        let e = unpack(&blob, &to, 1 << 20).expect_err("refused");
        assert!(e.to_string().contains(why), "{name:?}: {e}");
        assert!(holds_no_file(&to), "{name:?} left a file");
    }
    assert!(!t.path().join("escape").exists());

    // Over the bound: refused, and the first file written is removed.
    let from = t.path().join("from");
    tree(&from);
    let blob = t.path().join("big.tar");
    pack(&from, &blob, 1 << 20).expect("pack");
    let to = t.path().join("small");
    std::fs::create_dir(&to).expect("mkdir");
    let e = unpack(&blob, &to, 100).expect_err("too big");
    assert!(matches!(e, ShareError::TooBig { what: "bytes", .. }), "{e}");
    assert!(holds_no_file(&to));
}

#[test]
fn the_reserved_id_fits_the_agents_bound() {
    assert_eq!(blob_job("job-1").as_deref(), Some("job-1.compile-cache"));
    assert_eq!(
        blob_job(&"x".repeat(128 - SUFFIX.len())).map(|s| s.len()),
        Some(128)
    );
    assert_eq!(blob_job(&"x".repeat(129 - SUFFIX.len())), None);
}
