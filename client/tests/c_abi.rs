//! Compiles `tests/c/heartbeat.c` against the built `libwarden_client.so`
//! and runs it with no agent: every call must succeed and the program exit 0.

// Test helpers outside #[test] functions may unwrap too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/`, where cargo put the cdylib next to this test's `deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_owned()
}

#[test]
fn c_program_runs_without_an_agent() {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = profile_dir();
    // `cargo test` builds the library as an rlib for the tests; the cdylib
    // the C program links is built here, in the same profile, so the test
    // never links a stale or missing one.
    let mut build = Command::new(env!("CARGO"));
    build.args(["build", "-p", "warden-client", "--lib"]);
    if lib_dir.ends_with("release") {
        build.arg("--release");
    }
    let built = build.output().unwrap();
    assert!(
        built.status.success(),
        "cargo build of the cdylib failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    assert!(
        lib_dir.join("libwarden_client.so").exists(),
        "no libwarden_client.so in {} after building it",
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
