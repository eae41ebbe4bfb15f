//! The pre-restart health gate: `dcgmi diag -r LEVEL -j` where dcgmi is
//! installed, parsed from its JSON and exit code; elsewhere, or when dcgmi
//! cannot give a verdict (a runtime error, garbage, a timeout), the fast
//! NVML check read from the health model: device count as expected, no GPU
//! lost, recovery action NONE, no pending row remap or page retirement,
//! NVLinks up. A failed gate becomes an incident (event `gate.failed`)
//! whose decision sends the node to the node-level path (cordon, hot-swap,
//! scale down) instead of restarting onto bad hardware.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::DcgmConfig;
use warden_core::health::{NodeSnapshot, Status};
use warden_core::taxonomy::signals::HealthSignal;

/// One failed test or check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagFailure {
    /// The diagnostic test ("memory", "pcie") or NVML signal.
    pub test: String,
    /// The entity: "gpu1", "node".
    pub entity: String,
    /// "Fail", "Warn", FAILED...
    pub status: String,
    /// What it said.
    pub message: String,
    /// DCGM's severity ("isolate", "reset"...), when it gave one.
    pub severity: String,
}

/// The gate's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateOutcome {
    /// True when the node may take the restart.
    pub passed: bool,
    /// What ran: "dcgmi diag -r 1" or "nvml check".
    pub ran: String,
    /// How long it took (badput of its own kind in the goodput ledger).
    pub duration: Duration,
    /// What failed.
    pub failures: Vec<DiagFailure>,
    /// Why this check and not another (dcgmi absent, dcgmi gave no verdict).
    pub note: String,
}

/// Why dcgmi gave no verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiagError {
    /// Not installed (or not executable).
    Absent(String),
    /// Past the deadline; killed.
    Timeout(Duration),
    /// It ran but said nothing usable: its runtime error, or output that
    /// is not the JSON we know.
    NoVerdict(String),
}

impl std::fmt::Display for DiagError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiagError::Absent(w) => write!(f, "dcgmi is not available: {w}"),
            DiagError::Timeout(d) => write!(
                f,
                "dcgmi diag did not finish within {} (dcgm.gate_timeout); killed",
                humantime::format_duration(*d)
            ),
            DiagError::NoVerdict(w) => write!(f, "dcgmi gave no verdict: {w}"),
        }
    }
}

/// Runs `dcgmi diag -r level -j` within `cfg.gate_timeout`.
pub async fn run_dcgmi(cfg: &DcgmConfig, level: u32) -> Result<GateOutcome, DiagError> {
    let started = Instant::now();
    let mut cmd = tokio::process::Command::new(&cfg.dcgmi);
    cmd.args(["diag", "-r", &level.to_string(), "-j"])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(cfg.gate_timeout, cmd.output()).await {
        Err(_) => return Err(DiagError::Timeout(cfg.gate_timeout)),
        Ok(Err(e)) => return Err(DiagError::Absent(format!("{}: {e}", cfg.dcgmi))),
        Ok(Ok(o)) => o,
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut outcome = parse(&stdout, out.status.code())?;
    outcome.ran = format!("dcgmi diag -r {level}");
    outcome.duration = started.elapsed();
    Ok(outcome)
}

/// Reads dcgmi's JSON (DCGM 4's `"DCGM Diagnostic"` or 3's `"DCGM GPU
/// Diagnostic"`) and exit code (0 pass, 226 a test failed, 205 a failure
/// whose severity is isolate). Defensive: NVIDIA publishes no schema.
pub fn parse(stdout: &str, exit_code: Option<i32>) -> Result<GateOutcome, DiagError> {
    let v: Value = serde_json::from_str(stdout.trim()).map_err(|e| {
        DiagError::NoVerdict(format!(
            "output is not JSON ({e}); exit code {}",
            exit_code.map_or("none".into(), |c| c.to_string())
        ))
    })?;
    let root = v
        .get("DCGM Diagnostic")
        .or_else(|| v.get("DCGM GPU Diagnostic"))
        .ok_or_else(|| {
            DiagError::NoVerdict("no \"DCGM Diagnostic\" object in the output".into())
        })?;
    if let Some(err) = root.get("runtime_error").and_then(Value::as_str) {
        return Err(DiagError::NoVerdict(format!("runtime error: {err}")));
    }
    let categories = root
        .get("test_categories")
        .and_then(Value::as_array)
        .ok_or_else(|| DiagError::NoVerdict("no test_categories in the output".into()))?;
    let mut failures = Vec::new();
    for cat in categories {
        for test in cat
            .get("tests")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let name = test.get("name").and_then(Value::as_str).unwrap_or("?");
            for res in test
                .get("results")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let status = res.get("status").and_then(Value::as_str).unwrap_or("");
                if !status.eq_ignore_ascii_case("fail") {
                    continue;
                }
                let entity = entity_name(res);
                let warnings: Vec<&Value> = res
                    .get("warnings")
                    .and_then(Value::as_array)
                    .map(|w| w.iter().collect())
                    .unwrap_or_default();
                let message = warnings
                    .iter()
                    .filter_map(|w| w.get("warning").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("; ");
                let severity = warnings
                    .iter()
                    .filter_map(|w| w.get("error_severity").and_then(Value::as_str))
                    .next()
                    .unwrap_or("")
                    .to_owned();
                failures.push(DiagFailure {
                    test: name.to_owned(),
                    entity,
                    status: status.to_owned(),
                    message,
                    severity,
                });
            }
        }
    }
    let failed_exit = matches!(exit_code, Some(205 | 226));
    if failed_exit && failures.is_empty() {
        failures.push(DiagFailure {
            test: "dcgmi".into(),
            entity: "node".into(),
            status: "Fail".into(),
            message: format!(
                "exit code {} and no failing test in the JSON",
                exit_code.unwrap_or_default()
            ),
            severity: if exit_code == Some(205) {
                "isolate".into()
            } else {
                String::new()
            },
        });
    }
    if exit_code == Some(205) {
        for f in failures.iter_mut().filter(|f| f.severity.is_empty()) {
            f.severity = "isolate".into();
        }
    }
    Ok(GateOutcome {
        passed: failures.is_empty(),
        ran: String::new(),
        duration: Duration::ZERO,
        failures,
        note: String::new(),
    })
}

fn entity_name(res: &Value) -> String {
    let group = res
        .get("entity_group")
        .and_then(Value::as_str)
        .unwrap_or("GPU")
        .to_lowercase();
    let id = res
        .get("entity_id")
        .and_then(Value::as_u64)
        .or_else(|| res.get("gpu_id").and_then(Value::as_u64));
    match id {
        Some(i) => format!("{group}{i}"),
        None => group,
    }
}

/// The fast NVML check, from what the NVML source last judged.
pub fn nvml_check(node: &NodeSnapshot) -> GateOutcome {
    let started = Instant::now();
    let nvml = node.components.iter().find(|c| c.id == "nvml");
    let mut note = String::new();
    if nvml.is_none_or(|c| c.status == Status::Unknown) {
        note = "NVML is not available: no GPU was checked".into();
    }
    let mut failures = Vec::new();
    for c in &node.components {
        for r in &c.reasons {
            // Which signals fail it is the taxonomy's to say.
            if HealthSignal::of(&r.signal).fails_gpu_gate() && r.status >= Status::Degraded {
                failures.push(DiagFailure {
                    test: r.signal.clone(),
                    entity: c.id.split('/').next().unwrap_or(&c.id).to_owned(),
                    status: r.status.as_str().to_owned(),
                    message: r.message.clone(),
                    severity: String::new(),
                });
            }
        }
    }
    GateOutcome {
        passed: failures.is_empty(),
        ran: "nvml check".into(),
        duration: started.elapsed(),
        failures,
        note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASS: &str = r#"{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [
        {"category": "Deployment", "tests": [{"name": "software", "results": [
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"}],
            "test_summary": {"status": "Pass"}}]}]}}"#;
    const FAIL_MEM: &str = r#"{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [
        {"category": "Hardware", "tests": [{"name": "memory", "results": [
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Fail",
             "warnings": [{"warning": "Memory test found 3 uncorrectable errors on GPU 1", "error_id": 4,
                           "error_category": 2, "error_severity": "isolate"}]}],
            "test_summary": {"status": "Fail"}}]}]}}"#;

    #[test]
    fn pass_fail_runtime_error_and_garbage() {
        let ok = parse(PASS, Some(0)).unwrap();
        assert!(ok.passed, "{ok:?}");
        let bad = parse(FAIL_MEM, Some(205)).unwrap();
        assert!(!bad.passed);
        assert_eq!(bad.failures.len(), 1);
        assert_eq!(bad.failures[0].entity, "gpu1");
        assert_eq!(bad.failures[0].test, "memory");
        assert_eq!(bad.failures[0].severity, "isolate");
        assert!(bad.failures[0].message.contains("uncorrectable"));
        let rt = parse(
            r#"{"DCGM Diagnostic": {"version": "4.2.3", "runtime_error": "Unable to connect to the host engine"}}"#,
            Some(226),
        );
        assert!(matches!(rt, Err(DiagError::NoVerdict(m)) if m.contains("host engine")));
        assert!(matches!(
            parse("Segmentation fault", Some(139)),
            Err(DiagError::NoVerdict(_))
        ));
        // A failing exit with JSON that lists nothing still fails.
        let odd = parse(PASS, Some(226)).unwrap();
        assert!(!odd.passed);
    }
}
