//! System tests of `warden health --plugin` (node-problem-detector's
//! custom-plugin contract), `warden incidents` and `warden uncordon` against
//! a real `wardend`.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{
    Finished, MEMORY_NEVER_LOW, TestAgent, WAIT, WARDEN, XID79_AT_START, eventually, run,
};
use serde_json::{Value, json};

/// `warden --socket SOCKET ARGS...`, with a deadline; any exit status.
fn warden_at(socket: &Path, args: &[&str]) -> Finished {
    run(
        Command::new(WARDEN).arg("--socket").arg(socket).args(args),
        WAIT,
    )
}

/// `warden ARGS...` against `agent`; fails the test unless it exits 0.
fn warden_ok(agent: &TestAgent, args: &[&str]) -> Finished {
    let out = warden_at(agent.socket(), args);
    assert_eq!(
        out.code(),
        0,
        "warden {args:?}: {out:?}\n--- wardend stderr ---\n{}",
        agent.stderr()
    );
    out
}

/// The plugin's contract on every run: exactly one line of at most 80
/// bytes on stdout and nothing on stderr. Returns that line.
fn plugin_line(out: &Finished) -> &str {
    assert!(out.stderr.is_empty(), "stderr in plugin mode: {out:?}");
    assert!(out.stdout.ends_with('\n'), "{out:?}");
    let line = out.stdout.trim_end_matches('\n');
    assert!(!line.contains('\n'), "more than one line: {out:?}");
    assert!(
        line.len() <= 80,
        "{} bytes, NPD keeps 80: {line:?}",
        line.len()
    );
    line
}

#[test]
fn plugin_on_a_healthy_node_exits_0_with_ok() {
    let agent = TestAgent::start(MEMORY_NEVER_LOW);
    let out = warden_at(agent.socket(), &["health", "--plugin"]);
    let line = plugin_line(&out);
    assert_eq!(out.code(), 0, "{out:?}\n{}", agent.stderr());
    assert!(line.starts_with("OK"), "{line:?}");
}

#[test]
fn plugin_without_an_agent_exits_2_with_unknown() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nobody-here.sock");
    let out = warden_at(&socket, &["health", "--plugin"]);
    let line = plugin_line(&out);
    assert_eq!(out.code(), 2, "{out:?}");
    assert!(line.starts_with("UNKNOWN"), "{line:?}");
    assert!(line.contains("cannot reach wardend"), "{line:?}");
}

#[tokio::test]
async fn plugin_on_a_failed_gpu_exits_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let scenario = dir.path().join("xid79.toml");
    std::fs::write(&scenario, XID79_AT_START).expect("write the scenario");
    let scenario = scenario.display().to_string();
    let agent = TestAgent::start_with(MEMORY_NEVER_LOW, &[("WARDEN_SIMULATE", scenario.as_str())]);
    // The scripted XID is played once the source runs: poll until it lands.
    let out = eventually(WAIT, "warden health --plugin to exit 1", async || {
        let out = warden_at(agent.socket(), &["health", "--plugin"]);
        (out.code() == 1).then_some(out)
    })
    .await;
    let line = plugin_line(&out);
    // A policy may also cordon the node for an XID 79; either says why.
    assert!(
        line.starts_with("FAILED gpu0") || line.starts_with("CORDONED"),
        "{line:?}"
    );
}

#[test]
fn uncordon_on_a_node_not_cordoned_says_so_and_exits_0() {
    let agent = TestAgent::start(MEMORY_NEVER_LOW);
    let out = warden_ok(&agent, &["uncordon", "--reason", "test"]);
    assert!(out.stdout.contains("not cordoned"), "{out:?}");

    let out = warden_ok(&agent, &["--json", "uncordon"]);
    let doc: Value =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout));
    assert_eq!(doc, json!({"was_cordoned": false}));
}

#[test]
fn incidents_on_a_fresh_agent_are_none() {
    let agent = TestAgent::start(MEMORY_NEVER_LOW);
    let out = warden_ok(&agent, &["incidents"]);
    assert_eq!(out.stdout, "no incidents\n", "{out:?}");

    let out = warden_ok(&agent, &["incidents", "--json"]);
    let doc: Value =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout));
    assert_eq!(doc, json!({"incidents": [], "cordoned": false}));
}
