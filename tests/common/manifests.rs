//! The shipped deployment files (deploy/, systemd/) as data: Kubernetes YAML
//! read through PyYAML in the tests' Python environment (kubernetes-validate
//! brings it), so tests check and run what the files say rather than a copy.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::{python, repo_root, run};

/// Every document of `deploy/kubernetes/<file>`, as JSON.
pub fn kubernetes(file: &str) -> Vec<Value> {
    let path = repo_root().join("deploy/kubernetes").join(file);
    let out = run(
        Command::new(python()).args([
            "-c",
            "import json, sys, yaml\n\
             print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
            &path.to_string_lossy(),
        ]),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success(),
        "cannot read {} as YAML (is PyYAML installed for {}? bash tests/run-all.sh installs kubernetes-validate, which brings it): {}",
        path.display(),
        python().display(),
        out.stderr
    );
    serde_json::from_str(&out.stdout).expect("PyYAML's documents as JSON")
}

/// The document of `kind` named `name` in `file`.
pub fn object(file: &str, kind: &str, name: &str) -> Value {
    kubernetes(file)
        .into_iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/kubernetes/{file}"))
}

/// The container `name` of a pod spec (containers or initContainers).
pub fn container<'a>(pod_spec: &'a Value, name: &str) -> &'a Value {
    ["containers", "initContainers"]
        .iter()
        .filter_map(|k| pod_spec[*k].as_array())
        .flatten()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name} in {pod_spec}"))
}
