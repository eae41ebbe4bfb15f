//! System tests of the `warden` CLI against a real `wardend`.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{
    Finished, MEMORY_NEVER_LOW, STARTUP, Streaming, TestAgent, WAIT, WARDEN, eventually, http_get,
    run,
};
use nix::sys::signal::Signal;
use serde_json::Value;

/// `warden --socket <agent's socket> ARGS...`, with a deadline.
fn warden(agent: &TestAgent, args: &[&str]) -> Finished {
    let out = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(args),
        WAIT,
    );
    assert_eq!(
        out.code(),
        0,
        "warden {args:?}: {out:?}\n--- wardend stderr ---\n{}",
        agent.stderr()
    );
    out
}

/// Runs `warden health` until host/memory has been read once (the agent's
/// first reading races the test's first call).
async fn health_output(agent: &TestAgent, args: &[&str]) -> String {
    eventually(WAIT, "host/memory in warden health", async || {
        let out = warden(agent, args);
        out.stdout.contains("host/memory").then_some(out.stdout)
    })
    .await
}

#[tokio::test]
async fn health_prints_headline_and_component_rows() {
    let agent = TestAgent::start(&format!(
        "[agent]\nhost_name = \"cli-node\"\n{MEMORY_NEVER_LOW}"
    ));
    let stdout = health_output(&agent, &["health"]).await;
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("node cli-node: OK"), "{stdout}");
    let row = |id: &str| {
        stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .unwrap_or_else(|| panic!("no row for {id}:\n{stdout}"))
    };
    assert!(row("host/memory").contains("OK"), "{stdout}");
    assert!(row("agent").contains("OK"), "{stdout}");
}

#[tokio::test]
async fn health_json_is_one_document() {
    let agent = TestAgent::start(&format!(
        "[agent]\nhost_name = \"cli-node\"\n{MEMORY_NEVER_LOW}"
    ));
    let stdout = health_output(&agent, &["--json", "health"]).await;
    let doc: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(doc["status"], "OK", "{doc}");
    assert_eq!(doc["host"], "cli-node", "{doc}");
    let ids: Vec<&str> = doc["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert!(
        ids.contains(&"agent") && ids.contains(&"host/memory"),
        "{ids:?}"
    );
}

#[test]
fn info_shows_version_pid_and_endpoints() {
    let agent = TestAgent::start("");
    let out = warden(&agent, &["info"]);
    let field = |name: &str| {
        out.stdout
            .lines()
            .find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some(name)).then(|| words.collect::<Vec<_>>().join(" "))
            })
            .unwrap_or_else(|| panic!("no {name} row:\n{}", out.stdout))
    };
    assert_eq!(field("version"), env!("CARGO_PKG_VERSION"));
    assert_eq!(field("pid"), agent.pid().to_string());
    assert_eq!(field("unix"), agent.socket().display().to_string());

    let out = warden(&agent, &["--json", "info"]);
    let doc: Value =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout));
    assert_eq!(doc["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(doc["pid"], agent.pid());
}

#[test]
fn events_json_is_ndjson_with_agent_started() {
    let agent = TestAgent::start("");
    let out = warden(&agent, &["--json", "events"]);
    let events: Vec<Value> = out
        .stdout
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("not one JSON object per line ({e}): {l:?}"))
        })
        .collect();
    let started = events
        .iter()
        .find(|e| e["kind"] == "agent.started")
        .unwrap_or_else(|| panic!("no agent.started in {events:?}"));
    assert_eq!(started["subject"], "agent");
    assert_eq!(started["evidence"]["pid"], agent.pid().to_string());
    assert!(started["id"].as_u64().is_some_and(|id| id > 0), "{started}");
}

#[tokio::test]
async fn events_follow_prints_live_events() {
    let mut agent = TestAgent::start(MEMORY_NEVER_LOW);
    let metrics = agent.metrics_url().await;
    let mut follow = Streaming::spawn(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["events", "--follow", "--json"]),
        agent.home.path().join("warden-follow.stderr"),
    );
    // The backlog comes first...
    follow.wait_line(STARTUP, "agent.started", |l| {
        l.contains("\"agent.started\"")
    });
    // ...then the CLI opens its watch; the agent counts a watch once it is
    // subscribed, so an event made after that must reach the CLI.
    eventually(WAIT, "the CLI's WatchEvents call", async || {
        let body = http_get(&metrics);
        body.lines()
            .any(|l| {
                l.starts_with("warden_api_requests_total{")
                    && l.contains("method=\"WatchEvents\"")
                    && l.contains("code=\"OK\"")
            })
            .then_some(())
    })
    .await;
    agent.signal(Signal::SIGTERM);
    let line = follow.wait_line(WAIT, "agent.stopping", |l| l.contains("\"agent.stopping\""));
    let event: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(event["evidence"]["signal"], "SIGTERM", "{event}");
    assert_eq!(
        agent.exited(WAIT).await.code(),
        Some(0),
        "{}",
        agent.stderr()
    );
    // The stream ending is news to a follower: it says so and fails.
    let status = follow.wait_exit(WAIT);
    assert!(!status.success(), "{status}");
    assert!(
        follow.stderr().contains("closed the event stream"),
        "{}",
        follow.stderr()
    );
}

#[test]
fn no_agent_fails_naming_the_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nobody-here.sock");
    let out = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(&socket)
            .arg("health"),
        WAIT,
    );
    assert_ne!(out.code(), 0, "{out:?}");
    assert!(
        out.stderr.contains(&socket.display().to_string()),
        "{out:?}"
    );
    assert!(out.stdout.is_empty(), "{out:?}");
}
