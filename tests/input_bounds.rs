//! System tests of the real binaries against inputs that used to hang or
//! crash them (issue 22, "Crashes"):
//! - a config, scenario or planner file that is a device, a FIFO or huge
//!   is refused at once with an error naming the path and what it is, and
//!   so is a TLS CA file that is a FIFO or a device;
//! - every printing `warden` subcommand, and `wardend --print-config`,
//!   whose stdout reader has gone (`warden ckpt ls | head`) ends quietly
//!   with status 0 instead of panicking on the broken pipe.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Finished, TestAgent, WAIT, WARDEN, WARDEND, config_toml, run, scrub};

/// sysexits EX_CONFIG: the unit's RestartPreventExitStatus.
const EXIT_CONFIG: i32 = 78;

/// A FIFO nobody writes to: a plain `open` for reading blocks on it for
/// ever, which is what hung `wardend --check-config` before.
fn fifo(dir: &Path) -> PathBuf {
    let p = dir.join("config.fifo");
    nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    p
}

/// A sparse file of 4 GiB: `fstat` says how large it is without the test
/// writing (or the agent reading) a byte of it.
fn huge(dir: &Path) -> PathBuf {
    let p = dir.join("huge.toml");
    let f = std::fs::File::create(&p).expect("create");
    f.set_len(4 << 30).expect("set_len");
    p
}

/// Just over the 1 MiB cap, in real bytes (a valid TOML comment).
fn just_over_cap(dir: &Path) -> PathBuf {
    let p = dir.join("big.toml");
    let mut text = vec![b'#'; (1 << 20) + 1];
    text[1 << 20] = b'\n';
    std::fs::write(&p, text).expect("write");
    p
}

/// The bad files, each with the words its refusal must carry.
fn bad_files(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    vec![
        (PathBuf::from("/dev/zero"), "is a character device"),
        (fifo(dir), "is a FIFO"),
        (dir.to_owned(), "is a directory"),
        (
            huge(dir),
            "larger than the 1048576-byte cap (4294967296 bytes)",
        ),
        (just_over_cap(dir), "larger than the 1048576-byte cap"),
    ]
}

/// `WAIT` (10 s) bounds each command, far above what a refusal takes;
/// a regression to an unbounded read or a blocked open fails here.
fn wardend(args: &[&std::ffi::OsStr]) -> Finished {
    run(Command::new(WARDEND).args(args), WAIT)
}

fn assert_refused(out: &Finished, code: i32, path: &Path, why: &str) {
    assert_eq!(out.code(), code, "{}: {out:?}", path.display());
    assert!(
        out.stderr.contains(&path.display().to_string()) && out.stderr.contains(why),
        "{}: the error must name the path and say `{why}`: {out:?}",
        path.display()
    );
    assert!(!out.stderr.contains("panicked"), "{out:?}");
}

#[test]
fn check_config_refuses_devices_fifos_and_huge_files_at_once() {
    let t = tempfile::tempdir().unwrap();
    for (path, why) in bad_files(t.path()) {
        let out = wardend(&["--check-config".as_ref(), path.as_os_str()]);
        assert_refused(&out, EXIT_CONFIG, &path, why);
    }
}

#[test]
fn config_and_scenario_flags_refuse_a_fifo_and_dev_zero() {
    let t = tempfile::tempdir().unwrap();
    let fifo = fifo(t.path());
    let out = wardend(&["--config".as_ref(), fifo.as_os_str()]);
    assert_refused(&out, EXIT_CONFIG, &fifo, "is a FIFO");
    let out = wardend(&["--simulate".as_ref(), "/dev/zero".as_ref()]);
    assert_refused(
        &out,
        EXIT_CONFIG,
        Path::new("/dev/zero"),
        "character device",
    );
}

#[test]
fn a_tls_ca_that_is_a_fifo_or_a_device_stops_the_start_at_once() {
    let t = tempfile::tempdir().unwrap();
    let fifo = fifo(t.path());
    for (key, bad, why) in [
        ("tls_ca", fifo.clone(), "is a FIFO"),
        (
            "tls_ca",
            PathBuf::from("/dev/zero"),
            "is a character device",
        ),
    ] {
        // The CA is read first; the other two paths are never reached.
        let mut api = toml::Table::new();
        api.insert("tcp".into(), "127.0.0.1:0".into());
        for k in ["tls_ca", "tls_cert", "tls_key"] {
            let p = if k == key {
                bad.clone()
            } else {
                t.path().join(format!("{k}.pem"))
            };
            api.insert(k.into(), p.display().to_string().into());
        }
        let mut extra = toml::Table::new();
        extra.insert("api".into(), api.into());
        let cfg = t.path().join(format!("{key}.toml"));
        std::fs::write(
            &cfg,
            config_toml(&t.path().join("w.sock"), &extra.to_string()),
        )
        .unwrap();
        let out = wardend(&["--config".as_ref(), cfg.as_os_str()]);
        assert_ne!(out.code(), 0, "{out:?}");
        assert!(
            out.stderr.contains(&format!("api.{key}")),
            "the error must name the key: {out:?}"
        );
        assert_refused(&out, out.code(), &bad, why);
    }
}

#[test]
fn goodput_plan_refuses_a_fifo_scenario_and_a_huge_ledger() {
    let t = tempfile::tempdir().unwrap();
    let fifo = fifo(t.path());
    let out = run(
        Command::new(WARDEN)
            .args(["goodput", "plan", "--scenario"])
            .arg(&fifo),
        WAIT,
    );
    assert_refused(&out, 1, &fifo, "is a FIFO");
    let big = huge(t.path());
    let out = run(
        Command::new(WARDEN)
            .args(["goodput", "plan", "--from-ledger"])
            .arg(&big),
        WAIT,
    );
    assert_refused(&out, 1, &big, "larger than the 1048576-byte cap");
}

/// Runs `cmd` with its stdout on a pipe whose read end is already closed:
/// the first write fails with EPIPE, as when `head` has read its lines and
/// exited. Returns the exit status and stderr.
fn run_into_closed_pipe(cmd: &mut Command) -> (std::process::ExitStatus, String) {
    scrub(cmd);
    let (read_end, write_end) = nix::unistd::pipe().expect("pipe");
    drop(read_end);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    // The parent's copy of the write end went into `Stdio` and is closed
    // by `spawn`, so nobody but the child holds the pipe.
    let mut stderr = child.stderr.take().expect("piped stderr");
    let drain = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("poll") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still running after {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (status, drain.join().unwrap_or_default())
}

#[test]
fn every_printing_subcommand_ends_quietly_on_a_closed_pipe() {
    let agent = TestAgent::start("");
    let commands: &[&[&str]] = &[
        &["info"],
        &["info", "--config"],
        &["--json", "info"],
        &["health"],
        &["--json", "health"],
        &["events"],
        &["--json", "events"],
        &["ranks"],
        &["--json", "ranks"],
        &["incidents"],
        &["--json", "incidents"],
        &["stragglers"],
        &["--json", "stragglers"],
        &["ckpt", "ls"],
        &["--json", "ckpt", "ls"],
        &["goodput"],
        &["--json", "goodput"],
    ];
    for args in commands {
        let (status, stderr) = run_into_closed_pipe(
            Command::new(WARDEN)
                .arg("--socket")
                .arg(agent.socket())
                .args(*args),
        );
        assert_eq!(
            status.code(),
            Some(0),
            "warden {args:?} on a closed pipe: {status:?}\n{stderr}"
        );
        assert!(
            stderr.is_empty(),
            "warden {args:?} on a closed pipe must say nothing: {stderr}"
        );
    }
    // The planner needs no agent.
    let (status, stderr) =
        run_into_closed_pipe(Command::new(WARDEN).args(["goodput", "plan", "--preset", "llama3"]));
    assert_eq!(status.code(), Some(0), "goodput plan: {stderr}");
}

#[test]
fn a_real_head_that_stops_early_sees_no_panic() {
    let agent = TestAgent::start("");
    // `warden events --json | head -n 1`: head exits after one line while
    // warden may still be writing. Either order ends with status 0.
    let mut head = Command::new("head")
        .args(["-n", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("head");
    let head_in = head.stdin.take().expect("head stdin");
    let mut warden = Command::new(WARDEN);
    warden
        .arg("--socket")
        .arg(agent.socket())
        .args(["--json", "events", "--limit", "1000"]);
    scrub(&mut warden);
    let out = warden
        .stdout(Stdio::from(std::os::fd::OwnedFd::from(head_in)))
        .stderr(Stdio::piped())
        .output()
        .expect("warden events");
    let head_out = head.wait_with_output().expect("head");
    let line = String::from_utf8_lossy(&head_out.stdout);
    assert!(
        line.starts_with('{') && line.lines().count() == 1,
        "head must have read one event: {head_out:?}"
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
}

#[test]
fn print_config_ends_quietly_on_a_closed_pipe() {
    let (status, stderr) = run_into_closed_pipe(Command::new(WARDEND).arg("--print-config"));
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
