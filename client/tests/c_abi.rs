//! Compiles `tests/c/heartbeat.c` against the built `libwarden_client.so`
//! and runs it with no agent: every call must succeed and the program exit 0.

// Test helpers outside #[test] functions may unwrap too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/deps/`, where this test binary lives. Building the
/// library for this test builds every crate type it declares there, the
/// cdylib included, from the same sources and in the same cargo run.
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().to_owned()
}

#[test]
fn c_program_runs_without_an_agent() {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // The cdylib `cargo test` built next to this test. The test used to run
    // `cargo build -p warden-client` itself: that build unified features
    // for warden-client alone and overwrote the rlib (a cdylib crate's
    // outputs carry no hash), so every later doctest of a crate that links
    // warden-client failed with "can't find crate" in the full CI run.
    let lib_dir = deps_dir();
    assert!(
        lib_dir.join("libwarden_client.so").exists(),
        "no libwarden_client.so in {}: cargo test builds it with the tests",
        lib_dir.display()
    );
    let scratch = tempfile::tempdir().unwrap();
    let exe = scratch.path().join("heartbeat");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let out = Command::new(&cc)
        .arg("-std=c11")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-O2")
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c/heartbeat.c"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lwarden_client")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cc} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe)
        .env("WARDEN_SOCKET", scratch.path().join("no-agent.sock"))
        .env_remove("RANK")
        .env_remove("LOCAL_RANK")
        .env_remove("WORLD_SIZE")
        // cargo test puts target/<profile> ahead in LD_LIBRARY_PATH, and a
        // `cargo build` there leaves an older libwarden_client.so that would
        // win over the runpath; the program must load the one it linked.
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "heartbeat.c failed: {:?}\nstdout:\n{stdout}\nstderr:\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("ok"), "{stdout}");
    eprintln!("{stdout}");
}
