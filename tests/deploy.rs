//! The deployment files as shipped: the Kubernetes manifests pass the
//! Kubernetes schemas (kubernetes-validate, strict: an unknown field fails),
//! the agent configs inside them pass `wardend --check-config`, the
//! node-problem-detector plugin config runs `warden health --plugin`, and
//! the systemd unit passes `systemd-analyze verify`.
//!
//! Needs kubernetes-validate installed for the tests' Python
//! (`bash tests/run-all.sh` does it); running them in a container engine is
//! tests/container.rs.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::manifests::{container, kubernetes, object};
use common::{WARDEND, python, repo_root, run};

/// The oldest Kubernetes with native sidecars on by default (1.29) and the
/// gRPC probes (1.27) is older than this; 1.31 is a version every current
/// cloud offers.
const KUBERNETES: &str = "1.31.0";

const FILES: &[&str] = &[
    "daemonset.yaml",
    "training-job.yaml",
    "npd-warden-plugin.yaml",
];

fn validator() -> PathBuf {
    let bin = python()
        .parent()
        .expect("the interpreter sits in a bin directory")
        .join("kubernetes-validate");
    assert!(
        bin.exists(),
        "no kubernetes-validate beside {}: `{} -m pip install kubernetes-validate` (tests/run-all.sh does)",
        python().display(),
        python().display()
    );
    bin
}

fn validate(paths: &[PathBuf]) -> common::Finished {
    run(
        Command::new(validator())
            .args(["--strict", "--kubernetes-version", KUBERNETES])
            .args(paths),
        Duration::from_secs(60),
    )
}

#[test]
fn the_manifests_pass_the_kubernetes_schemas() {
    let dir = repo_root().join("deploy/kubernetes");
    let paths: Vec<PathBuf> = FILES.iter().map(|f| dir.join(f)).collect();
    let out = validate(&paths);
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    // One line per resource: none skipped.
    let passed = out.stdout.matches(" passed for resource ").count();
    let resources: usize = FILES.iter().map(|f| kubernetes(f).len()).sum();
    assert_eq!(passed, resources, "{}", out.stdout);

    // The validator would have said so: a misspelt field in a copy fails.
    let scratch = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(dir.join("daemonset.yaml")).unwrap();
    let broken = text.replacen("readinessProbe:", "readynessProbe:", 1);
    assert_ne!(text, broken);
    let bad = scratch.path().join("daemonset.yaml");
    std::fs::write(&bad, broken).unwrap();
    let out = validate(&[bad]);
    assert!(!out.status.success(), "{}", out.stdout);
    assert!(
        format!("{}{}", out.stdout, out.stderr).contains("readynessProbe"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
}

#[test]
fn the_daemonset_probes_the_agent_on_its_unix_socket() {
    let ds = object("daemonset.yaml", "DaemonSet", "wardend");
    let pod = &ds["spec"]["template"]["spec"];
    let agent = container(pod, "wardend");
    // api.tcp serves only peer agents behind mutual TLS: the probes ask
    // the agent over the socket the ConfigMap names.
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(
            agent[probe]["exec"]["command"],
            serde_json::json!([
                "/usr/local/bin/warden",
                "--socket",
                "/run/warden/wardend.sock",
                "info"
            ]),
            "{probe}: {agent}"
        );
    }
    let config = object("daemonset.yaml", "ConfigMap", "wardend");
    let toml: toml::Table = config["data"]["wardend.toml"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        toml["api"]["socket"].as_str(),
        Some("/run/warden/wardend.sock")
    );
    assert!(toml["api"].get("tcp").is_none(), "{toml:?}");
    assert_eq!(
        ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"],
        "9464"
    );
    assert_eq!(toml["metrics"]["listen"].as_str(), Some("0.0.0.0:9464"));
    // Least privilege: no privileged container, every capability dropped
    // but the ones the docs justify.
    let sc = &agent["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(
        sc["capabilities"]["add"],
        serde_json::json!(["KILL", "SYS_PTRACE", "DAC_READ_SEARCH"])
    );
}

#[test]
fn the_training_job_runs_wardend_as_a_native_sidecar_sharing_pids_and_volumes() {
    let job = object("training-job.yaml", "Job", "train-example");
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["shareProcessNamespace"], true);
    let sidecar = container(pod, "wardend");
    assert_eq!(sidecar["restartPolicy"], "Always");
    let trainer = container(pod, "trainer");
    // What tests/container.rs runs them with (SIDECAR_SECURITY, the
    // trainer's --cap-drop ALL).
    assert_eq!(sidecar["securityContext"]["readOnlyRootFilesystem"], true);
    for c in [sidecar, trainer] {
        assert_eq!(
            c["securityContext"]["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{}",
            c["name"]
        );
    }
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    let command: Vec<&str> = trainer["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(&command[..2], ["warden", "run"], "{command:?}");
    assert!(command.contains(&"python3"), "{command:?}");
    // Both mount the socket and the checkpoint tier, both memory-backed.
    for volume in ["warden-socket", "checkpoints"] {
        for c in [sidecar, trainer] {
            assert!(
                c["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|m| m["name"] == volume),
                "{} lacks {volume}",
                c["name"]
            );
        }
        let v = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == volume)
            .unwrap();
        assert_eq!(v["emptyDir"]["medium"], "Memory", "{v}");
    }
}

#[test]
fn the_agent_configs_in_the_manifests_pass_check_config() {
    let scratch = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for file in FILES {
        for doc in kubernetes(file) {
            let Some(toml) = doc["data"]["wardend.toml"].as_str() else {
                continue;
            };
            let path = scratch.path().join(format!("{checked}.toml"));
            std::fs::write(&path, toml).unwrap();
            let out = run(
                Command::new(WARDEND).arg("--check-config").arg(&path),
                Duration::from_secs(30),
            );
            assert_eq!(
                out.code(),
                0,
                "{file}: {}: {}{}",
                doc["metadata"]["name"],
                out.stdout,
                out.stderr
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 2, "the DaemonSet's and the sidecar's");
}

#[test]
fn the_npd_plugin_config_runs_warden_health_plugin() {
    let cm = object("npd-warden-plugin.yaml", "ConfigMap", "npd-warden-plugin");
    let monitor: serde_json::Value =
        serde_json::from_str(cm["data"]["warden-plugin.json"].as_str().unwrap())
            .expect("the monitor config is JSON");
    assert_eq!(monitor["plugin"], "custom");
    let max = monitor["pluginConfig"]["max_output_length"]
        .as_u64()
        .unwrap();
    assert!(max >= 80, "warden's plugin line is up to 80 bytes: {max}");
    let rule = &monitor["rules"][0];
    assert_eq!(rule["condition"], monitor["conditions"][0]["type"]);
    let args: Vec<&str> = rule["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.ends_with(&["health", "--plugin"]),
        "{args:?} (tests/container.rs runs this command in a bare container)"
    );
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    // The unit as shipped, with ExecStart pointing at the binary under test
    // instead of /usr/local/bin (not installed on a test machine).
    let unit = std::fs::read_to_string(repo_root().join("systemd/wardend.service")).unwrap();
    assert!(unit.contains("/usr/local/bin/wardend"));
    let scratch = tempfile::tempdir().unwrap();
    let path = scratch.path().join("wardend.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/wardend", WARDEND)).unwrap();
    let out = run(
        Command::new("systemd-analyze").arg("verify").arg(&path),
        Duration::from_secs(60),
    );
    assert!(
        out.status.success() && out.stderr.trim().is_empty(),
        "systemd-analyze verify: {:?}\n{}{}",
        out.status,
        out.stdout,
        out.stderr
    );
    // And it would complain: a misspelt directive is reported.
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/wardend", WARDEND)
            .replace("WatchdogSec=", "WatchDogSec="),
    )
    .unwrap();
    let out = run(
        Command::new("systemd-analyze").arg("verify").arg(&path),
        Duration::from_secs(60),
    );
    assert!(out.stderr.contains("WatchDogSec"), "{}", out.stderr);
}
