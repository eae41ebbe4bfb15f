//! deploy/prometheus's alert rules: valid (`promtool check rules`), firing
//! as their unit tests say (`promtool test rules`, input series in
//! warden-alerts.test.yml), and naming only metrics the agent exports:
//! each `warden_*` name in a rule's expression is recorded in agent/src and
//! documented in docs/api.md, and a real wardend that cordons its node on a
//! simulated XID 79 shows the node and GPU series the rules read.
//! promtool comes from Debian's prometheus package (tests/system-deps.sh
//! prometheus; tests/run-all.sh installs it).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{TestAgent, WAIT, XID79_AT_START, eventually, repo_root, run, sample, scrape};

fn rules_dir() -> PathBuf {
    repo_root().join("deploy/prometheus")
}

fn promtool(args: &[&str]) -> common::Finished {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("promtool").is_file()));
    assert!(
        found,
        "no `promtool` on PATH: install Debian's prometheus \
         (bash tests/system-deps.sh prometheus; tests/run-all.sh does)"
    );
    run(
        Command::new("promtool").args(args).current_dir(rules_dir()),
        WAIT * 3,
    )
}

#[test]
fn the_rules_pass_promtool_check_and_their_unit_tests() {
    let out = promtool(&["check", "rules", "warden-alerts.yml"]);
    assert_eq!(out.code(), 0, "{out:?}");
    assert!(out.stdout.contains("SUCCESS: 6 rules found"), "{out:?}");
    let out = promtool(&["test", "rules", "warden-alerts.test.yml"]);
    assert_eq!(out.code(), 0, "{out:?}");
    assert!(out.stdout.contains("SUCCESS"), "{out:?}");
}

/// Every alert of the rules file has at least one unit test that expects it
/// to fire.
#[test]
fn every_alert_has_a_firing_test() {
    let rules = std::fs::read_to_string(rules_dir().join("warden-alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(rules_dir().join("warden-alerts.test.yml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert_eq!(alerts.len(), 6, "{alerts:?}");
    for alert in alerts {
        let firing = tests
            .split("alertname: ")
            .skip(1)
            .any(|t| t.starts_with(alert) && t.contains("exp_labels"));
        assert!(
            firing,
            "no test in warden-alerts.test.yml expects {alert} to fire"
        );
    }
}

/// The `warden_*` metric names in the rules' expressions.
fn metrics_in_rules() -> BTreeSet<String> {
    let rules = std::fs::read_to_string(rules_dir().join("warden-alerts.yml")).unwrap();
    let mut names = BTreeSet::new();
    for expr in rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr: "))
    {
        let mut rest = expr;
        while let Some(i) = rest.find("warden_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            names.insert(name);
        }
    }
    names
}

fn rust_sources(dir: &Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

#[test]
fn every_metric_a_rule_names_is_recorded_and_documented() {
    let names = metrics_in_rules();
    for expected in [
        "warden_node_cordoned",
        "warden_component_status",
        "warden_rank_hangs_total",
        "warden_stragglers_flagged",
        "warden_goodput_ratio",
    ] {
        assert!(names.contains(expected), "{expected} not in {names:?}");
    }
    let mut code = String::new();
    // The daemon's crate and the core it links (the crate split moved the
    // detectors, and their metrics, to core/).
    rust_sources(&repo_root().join("agent/src"), &mut code);
    rust_sources(&repo_root().join("core/src"), &mut code);
    let api = std::fs::read_to_string(repo_root().join("docs/api.md")).unwrap();
    for name in &names {
        assert!(
            code.contains(&format!("\"{name}\"")),
            "a rule reads {name}, which neither agent/src nor core/src records"
        );
        assert!(
            api.contains(&format!("| `{name}` |")),
            "a rule reads {name}, which docs/api.md's metrics table does not list"
        );
    }
}

#[tokio::test]
async fn a_cordoned_agent_exports_what_the_node_rules_read() {
    let healthy = TestAgent::start("");
    let (scraped, body) = scrape(&healthy).await;
    assert_eq!(sample(&scraped, "warden_node_cordoned", &[]), 0.0, "{body}");

    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("xid79.toml");
    std::fs::write(&scenario, XID79_AT_START).unwrap();
    let agent = TestAgent::start_with("", &[("WARDEN_SIMULATE", scenario.to_str().unwrap())]);
    let (scraped, body) = eventually(WAIT, "warden_node_cordoned 1", async || {
        let (scraped, body) = scrape(&agent).await;
        (sample(&scraped, "warden_node_cordoned", &[]) == 1.0).then_some((scraped, body))
    })
    .await;
    // WardenGpuFailed's series: the GPU FAILED (3), labelled kind="gpu".
    assert_eq!(
        sample(
            &scraped,
            "warden_component_status",
            &[("component", "gpu0"), ("kind", "gpu")]
        ),
        3.0,
        "{body}"
    );
    assert!(body.contains("# HELP warden_node_cordoned "), "{body}");

    // Lifted: back to 0.
    let mut client = agent.client().await;
    client
        .uncordon(warden_proto::v1::UncordonRequest {
            reason: "test".into(),
        })
        .await
        .unwrap();
    let (scraped, body) = scrape(&agent).await;
    assert_eq!(sample(&scraped, "warden_node_cordoned", &[]), 0.0, "{body}");
}
