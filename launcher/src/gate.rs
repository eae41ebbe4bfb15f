//! Before respawning: the GPUs have let go of the stopped workers, and the
//! node is fit to run them again.
//!
//! GPU release: a process that exited has released its device memory, but
//! the driver may take a moment to tear down its contexts, and a new worker
//! allocating meanwhile can fail with out-of-memory. When NVML loads, wait
//! (bounded) until none of the stopped pids is among any GPU's compute
//! processes. Without NVML there is nothing to ask: the wait is skipped and
//! the launcher says so once.
//!
//! Health gate, in two steps. First the agent's GetNodeHealth: a cordoned
//! node (`node/cordon` FAILED) or a FAILED GPU refuses the restart on this
//! node (exit 86: run the job elsewhere). Then the agent's RunHealthGate:
//! `dcgmi diag` where DCGM is installed, else the fast NVML check (device
//! count, GPU lost, recovery action, pending remaps and retirements,
//! NVLinks); a failure there refuses too, and the agent has already opened
//! the incident that takes the node out. No answer from the agent lets it
//! go on, said so: the gate must not turn an agent outage into a job
//! outage.

use std::time::{Duration, Instant};

use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

/// How long the health gate waits for the agent.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the diagnostic step may take, the agent's own `dcgm.gate_timeout`
/// included (a level-1 `dcgmi diag` takes seconds; deeper levels minutes).
const DIAG_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// How often the GPUs are asked again.
const GPU_POLL: Duration = Duration::from_millis(50);

/// What the GPU release wait found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuRelease {
    /// No stopped pid holds a GPU (after this long).
    Released(Duration),
    /// NVML is not loadable here: nothing to wait for.
    NoNvml(String),
    /// These pids still held a GPU when the wait ran out.
    TimedOut(Vec<u32>),
}

/// Waits until none of `pids` holds a GPU, at most `timeout`, through the
/// NVML library at `library` (loaded for the wait, on a blocking thread).
pub async fn gpu_release(pids: Vec<u32>, timeout: Duration, library: String) -> GpuRelease {
    let task = tokio::task::spawn_blocking(move || gpu_release_blocking(&pids, timeout, &library));
    task.await
        .unwrap_or_else(|e| GpuRelease::NoNvml(format!("the NVML wait failed: {e}")))
}

fn gpu_release_blocking(pids: &[u32], timeout: Duration, library: &str) -> GpuRelease {
    let nvml = match nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new(library))
        .init()
    {
        Ok(n) => n,
        Err(e) => return GpuRelease::NoNvml(format!("NVML not loadable from {library:?}: {e}")),
    };
    let started = Instant::now();
    loop {
        let holding = holders(&nvml, pids);
        if holding.is_empty() {
            return GpuRelease::Released(started.elapsed());
        }
        if started.elapsed() >= timeout {
            return GpuRelease::TimedOut(holding);
        }
        std::thread::sleep(GPU_POLL);
    }
}

/// The pids among `pids` that some GPU lists as a compute process.
fn holders(nvml: &nvml_wrapper::Nvml, pids: &[u32]) -> Vec<u32> {
    let count = nvml.device_count().unwrap_or(0);
    let mut out = Vec::new();
    for i in 0..count {
        let Ok(dev) = nvml.device_by_index(i) else {
            continue;
        };
        for p in dev.running_compute_processes().unwrap_or_default() {
            if pids.contains(&p.pid) && !out.contains(&p.pid) {
                out.push(p.pid);
            }
        }
    }
    out
}

/// What the health gate decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateResult {
    /// Go on.
    Pass,
    /// Go on, but the agent could not be asked (why).
    Unchecked(String),
    /// Do not restart on this node (why).
    Refused(String),
}

/// Asks the agent whether the node may run the workers of `job` again.
pub async fn health_gate(client: &mut AgentClient<Channel>, job: &str) -> GateResult {
    let asked = tokio::time::timeout(
        HEALTH_TIMEOUT,
        client.get_node_health(pb::GetNodeHealthRequest {}),
    )
    .await;
    match asked {
        Ok(Ok(h)) => match judge(&h.into_inner()) {
            GateResult::Pass => diagnose(client, job).await,
            other => other,
        },
        Ok(Err(e)) => GateResult::Unchecked(format!("GetNodeHealth failed: {}", e.message())),
        Err(_) => GateResult::Unchecked(format!(
            "the agent did not answer GetNodeHealth within {}",
            humantime::format_duration(HEALTH_TIMEOUT)
        )),
    }
}

/// The agent's diagnostic gate (RunHealthGate).
async fn diagnose(client: &mut AgentClient<Channel>, job: &str) -> GateResult {
    let asked = tokio::time::timeout(
        DIAG_TIMEOUT,
        client.run_health_gate(pb::RunHealthGateRequest {
            level: 0,
            job_id: job.to_owned(),
        }),
    )
    .await;
    match asked {
        Ok(Ok(r)) => judge_diag(&r.into_inner()),
        Ok(Err(e)) => GateResult::Unchecked(format!("RunHealthGate failed: {}", e.message())),
        Err(_) => GateResult::Unchecked(format!(
            "the agent's diagnostic gate did not answer within {}",
            humantime::format_duration(DIAG_TIMEOUT)
        )),
    }
}

/// The diagnostic gate's verdict as the launcher's.
pub fn judge_diag(r: &pb::HealthGateResult) -> GateResult {
    if r.passed {
        return GateResult::Pass;
    }
    let why: Vec<String> = r
        .failures
        .iter()
        .map(|f| format!("{} {} on {}: {}", r.ran, f.test, f.entity, f.message))
        .collect();
    GateResult::Refused(if why.is_empty() {
        format!("{} failed", r.ran)
    } else {
        why.join("; ")
    })
}

/// The gate as a pure function of the node's health: a cordon or a FAILED
/// GPU refuses.
pub fn judge(h: &pb::NodeHealth) -> GateResult {
    let failed = pb::Status::Failed as i32;
    let mut why = Vec::new();
    for c in &h.components {
        if c.status != failed {
            continue;
        }
        let gpu = c.kind == "gpu"
            || (!c.id.contains('/') && warden_core::device::DeviceId::is_gpu(&c.id));
        if c.id == "node/cordon" || gpu {
            let reason = c
                .reasons
                .iter()
                .find(|r| r.status == failed)
                .map_or(String::new(), |r| format!(": {}", r.message));
            why.push(format!("{} FAILED{reason}", c.id));
        }
    }
    if why.is_empty() {
        GateResult::Pass
    } else {
        GateResult::Refused(why.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comp(id: &str, kind: &str, status: pb::Status) -> pb::Component {
        pb::Component {
            id: id.into(),
            kind: kind.into(),
            status: status as i32,
            reasons: vec![pb::Reason {
                status: status as i32,
                message: "why".into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn cordon_and_failed_gpus_refuse_others_pass() {
        let mut h = pb::NodeHealth {
            components: vec![
                comp("host/memory", "host", pb::Status::Degraded),
                comp("gpu0", "gpu", pb::Status::Ok),
                comp("nic/eth0", "nic", pb::Status::Failed),
            ],
            ..Default::default()
        };
        assert_eq!(judge(&h), GateResult::Pass);
        h.components.push(comp("gpu3", "gpu", pb::Status::Failed));
        assert_eq!(judge(&h), GateResult::Refused("gpu3 FAILED: why".into()));
        h.components
            .push(comp("node/cordon", "node", pb::Status::Failed));
        assert!(matches!(judge(&h), GateResult::Refused(w) if w.contains("node/cordon")));
    }

    #[test]
    fn a_failed_diagnostic_refuses_naming_the_test() {
        let r = pb::HealthGateResult {
            passed: false,
            ran: "dcgmi diag -r 1".into(),
            failures: vec![pb::GateFailure {
                test: "memory".into(),
                entity: "gpu1".into(),
                status: "Fail".into(),
                message: "3 uncorrectable errors".into(),
                severity: "isolate".into(),
            }],
            ..Default::default()
        };
        assert_eq!(
            judge_diag(&r),
            GateResult::Refused("dcgmi diag -r 1 memory on gpu1: 3 uncorrectable errors".into())
        );
        assert_eq!(
            judge_diag(&pb::HealthGateResult {
                passed: true,
                ..Default::default()
            }),
            GateResult::Pass
        );
    }

    #[tokio::test]
    async fn no_nvml_skips_the_wait() {
        let r = gpu_release(
            vec![1],
            Duration::from_millis(10),
            "/nonexistent/libnvidia-ml.so.1".into(),
        )
        .await;
        assert!(matches!(r, GpuRelease::NoNvml(_)), "{r:?}");
    }
}
