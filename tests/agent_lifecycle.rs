//! System tests of the agent's life: config checks and exit codes, the
//! systemd notify protocol, one agent per socket, clean and unclean ends.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Home, TestAgent, WAIT, WARDEND, config_toml, evidence, run};
use nix::sys::signal::Signal;
use warden_proto::v1 as pb;

/// sysexits EX_CONFIG: the unit's RestartPreventExitStatus.
const EXIT_CONFIG: i32 = 78;
/// sysexits EX_TEMPFAIL: another agent serves the socket.
const EXIT_ALREADY_RUNNING: i32 = 75;

/// The shipped, documented config.
fn shipped_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/wardend.toml")
}

/// Writes `text` as-is (no merging: it may be broken on purpose).
fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write the config");
    path
}

fn wardend(args: &[&std::ffi::OsStr]) -> common::Finished {
    run(Command::new(WARDEND).args(args), WAIT)
}

#[test]
fn bad_configs_exit_78_naming_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("wardend.sock");
    // Each would otherwise be a runnable config on a scratch socket, so an
    // agent that accepted it would start (and be killed at the deadline)
    // rather than touch the machine's real socket or a fixed port.
    let cases = [
        (
            "unknown-key.toml",
            config_toml(&socket, "[api]\nsockt = \"/tmp/x.sock\"\n"),
            "api.sockt",
        ),
        (
            "bad-value.toml",
            config_toml(&socket, "[agent]\ntick = \"5s\"\n"),
            "agent.tick",
        ),
        (
            "bad-type.toml",
            config_toml(&socket, "[events]\nretain = \"many\"\n"),
            "events.retain",
        ),
        (
            "broken.toml",
            format!("[api\nsocket = \"{}\"\n", socket.display()),
            "broken.toml",
        ),
    ];
    for (name, text, named) in cases {
        let path = write_config(dir.path(), name, &text);
        let out = wardend(&["--config".as_ref(), path.as_os_str()]);
        assert_eq!(out.code(), EXIT_CONFIG, "{name}: {out:?}");
        assert!(
            out.stderr.contains(named),
            "{name}: stderr must name {named}: {out:?}"
        );
        assert!(!socket.exists(), "{name}: no socket for a refused config");

        let out = wardend(&["--check-config".as_ref(), path.as_os_str()]);
        assert_eq!(out.code(), EXIT_CONFIG, "--check-config {name}: {out:?}");
        assert!(out.stderr.contains(named), "--check-config {name}: {out:?}");
    }
    let missing = dir.path().join("missing.toml");
    let out = wardend(&["--config".as_ref(), missing.as_os_str()]);
    assert_eq!(out.code(), EXIT_CONFIG, "{out:?}");
    assert!(out.stderr.contains("missing.toml"), "{out:?}");
}

#[test]
fn check_config_accepts_a_good_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        dir.path(),
        "good.toml",
        &config_toml(
            &dir.path().join("wardend.sock"),
            "[agent]\ntick = \"50ms\"\n[events]\nretain = 10\n",
        ),
    );
    let out = wardend(&["--check-config".as_ref(), path.as_os_str()]);
    assert_eq!(out.code(), 0, "{out:?}");
    assert!(
        !dir.path().join("wardend.sock").exists(),
        "checking does not start an agent"
    );
}

#[test]
fn shipped_config_is_valid_and_documents_every_default() {
    let shipped = shipped_config();
    let out = wardend(&["--check-config".as_ref(), shipped.as_os_str()]);
    assert_eq!(out.code(), 0, "{out:?}");

    let printed = wardend(&["--print-config".as_ref()]);
    assert_eq!(printed.code(), 0, "{printed:?}");
    let defaults: toml::Table = printed.stdout.parse().expect("--print-config prints TOML");
    let text = std::fs::read_to_string(&shipped).expect("read systemd/wardend.toml");
    let documented: toml::Table = text.parse().expect("systemd/wardend.toml is TOML");
    let mut documented_keys = Vec::new();
    flatten("", &documented, &mut documented_keys);
    let mut default_keys = Vec::new();
    flatten("", &defaults, &mut default_keys);
    let missing: Vec<_> = default_keys
        .iter()
        .filter(|k| !documented_keys.contains(k))
        .collect();
    let extra: Vec<_> = documented_keys
        .iter()
        .filter(|k| !default_keys.contains(k))
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "systemd/wardend.toml must set every key to its default, as `wardend --print-config` shows them.\n\
         missing or different there: {missing:#?}\nnot defaults: {extra:#?}"
    );
    assert_eq!(documented, defaults);
}

/// `table.key = value` lines for every leaf (and every empty table), so a
/// mismatch is reported key by key.
fn flatten(prefix: &str, table: &toml::Table, out: &mut Vec<String>) {
    if table.is_empty() && !prefix.is_empty() {
        out.push(format!("{prefix} = {{}}"));
    }
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            toml::Value::Table(t) => flatten(&path, t, out),
            v => out.push(format!("{path} = {v}")),
        }
    }
}

#[test]
fn notify_ready_status_watchdog_and_stopping() {
    let mut agent = TestAgent::start_with("", &[("WATCHDOG_USEC", "200000")]);
    let ready = agent
        .notifications
        .iter()
        .find(|m| m.lines().any(|l| l == "READY=1"))
        .expect("READY=1")
        .clone();
    assert!(
        ready
            .lines()
            .any(|l| l.starts_with("STATUS=") && l.len() > "STATUS=".len()),
        "READY=1 comes with a status line: {ready:?}"
    );

    // 200ms watchdog: pings every 100ms; two within 2s even on a busy box.
    let deadline = Instant::now() + Duration::from_secs(2);
    let pings = |a: &TestAgent| {
        a.notifications
            .iter()
            .filter(|m| m.lines().any(|l| l == "WATCHDOG=1"))
            .count()
    };
    while pings(&agent) < 2 {
        if agent.recv_notify(deadline).is_none() {
            panic!(
                "fewer than 2 WATCHDOG=1 within 2s: {:?}\n--- wardend stderr ---\n{}",
                agent.notifications,
                agent.stderr()
            );
        }
    }

    agent.signal(Signal::SIGTERM);
    agent.wait_notify(WAIT, "STOPPING=1", |l| l == "STOPPING=1");
    let status = agent.wait_exit(WAIT);
    assert_eq!(status.code(), Some(0), "{status}");
}

#[test]
fn no_watchdog_pings_without_watchdog_usec() {
    let mut agent = TestAgent::start("");
    // The work loop ticks every 100ms; were it pinging, 500ms would show it.
    let deadline = Instant::now() + Duration::from_millis(500);
    while agent.recv_notify(deadline).is_some() {}
    assert!(
        agent
            .notifications
            .iter()
            .all(|m| !m.lines().any(|l| l == "WATCHDOG=1")),
        "{:?}",
        agent.notifications
    );
}

#[test]
fn second_agent_on_the_same_socket_exits_75_naming_the_first() {
    let first = TestAgent::start("");
    let mut second = TestAgent::spawn(first.home.clone(), &[]);
    let status = second.wait_exit(WAIT);
    assert_eq!(
        status.code(),
        Some(EXIT_ALREADY_RUNNING),
        "{}",
        second.stderr()
    );
    let stderr = second.stderr();
    assert!(
        stderr.contains(&first.pid().to_string()),
        "names pid {}: {stderr}",
        first.pid()
    );
    assert!(
        stderr.contains(&first.socket().display().to_string()),
        "{stderr}"
    );
    while second
        .recv_notify(Instant::now() + Duration::from_millis(50))
        .is_some()
    {}
    assert!(
        !second.notifications.iter().any(|m| m.contains("READY=1")),
        "the second agent never reports ready: {:?}",
        second.notifications
    );
    assert!(
        first.socket().exists(),
        "the first agent's socket is left alone"
    );
}

#[tokio::test]
async fn first_agent_keeps_serving_after_a_second_is_refused() {
    let first = TestAgent::start("");
    let mut second = TestAgent::spawn(first.home.clone(), &[]);
    assert_eq!(second.wait_exit(WAIT).code(), Some(EXIT_ALREADY_RUNNING));
    let info = first.info().await;
    assert_eq!(info.pid, first.pid());
}

#[test]
fn sigterm_exits_0_and_removes_the_socket() {
    let mut agent = TestAgent::start("");
    assert!(agent.socket().exists());
    let status = agent.sigterm_and_wait(WAIT);
    assert_eq!(status.code(), Some(0), "{status}\n{}", agent.stderr());
    assert!(!agent.socket().exists(), "socket file left behind");
}

#[tokio::test]
async fn stale_socket_of_a_killed_agent_is_replaced() {
    let mut crashed = TestAgent::start("");
    let crashed_pid = crashed.pid();
    crashed.sigkill_and_wait();
    assert!(
        crashed.socket().exists(),
        "a SIGKILLed agent cannot remove its socket"
    );

    let home: Arc<Home> = crashed.home.clone();
    let agent = TestAgent::start_in(home);
    let h = agent
        .client()
        .await
        .get_node_health(pb::GetNodeHealthRequest {})
        .await
        .expect("the new agent serves")
        .into_inner();
    assert!(!h.host.is_empty());
    let events = agent.events().await;
    let started = events
        .iter()
        .find(|e| e.kind == "agent.started")
        .expect("agent.started");
    assert_eq!(
        evidence(started, "pid"),
        Some(agent.pid().to_string().as_str())
    );
    assert_eq!(
        evidence(started, "replaced_stale_socket_of_pid"),
        Some(crashed_pid.to_string().as_str()),
        "{started:?}"
    );
}

fn socket_mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .expect("the socket exists")
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn socket_mode_defaults_to_0660() {
    let agent = TestAgent::start("");
    assert_eq!(
        socket_mode(agent.socket()),
        0o660,
        "{:o}",
        socket_mode(agent.socket())
    );
}

#[test]
fn socket_mode_follows_the_config() {
    let agent = TestAgent::start("[api]\nsocket_mode = \"0600\"\n");
    assert_eq!(
        socket_mode(agent.socket()),
        0o600,
        "{:o}",
        socket_mode(agent.socket())
    );
}
