//! NVIDIA's node health check protocol (`nvhcd.HealthCheckService`), served
//! on a Unix socket of its own (`[nvhcd] socket`) so nvidia-resiliency-ext
//! (`--ft-node-health-check-endpoint PATH`) asks wardend instead of running
//! a health-check script.
//!
//! The answer comes from the health model, never from a fresh probe: a call
//! costs a snapshot. `output` is a JSON object:
//! `{"fail_count": N, "failed_checks": [{"component", "kind", "status",
//! "reasons": [{"signal", "value", "threshold", "message"}]}],
//! "degraded_checks": [...], "node_status": "..."}`.
//!
//! Only FAILED components count in `fail_count`: NVRx treats `fail_count > 0`
//! as "this node is unhealthy" and takes it out of the job, which is what a
//! FAILED component means; a DEGRADED one (a flapping link, low free space)
//! is listed in `degraded_checks` for the log but does not evict the node.
//! UNKNOWN does not count either (a stalled source is not evidence of a bad
//! node). `success` and `exit_code` agree with `fail_count` (true and 0 when
//! healthy, false and 1 when not), as a health-check script's would. The
//! request's `args` (`--group prolog epilog ...`) are echoed in `output` and
//! otherwise ignored: the model already covers every group it has sources for.

use std::sync::Arc;

use serde_json::json;
use tonic::{Request, Response, Status as GrpcStatus};
use warden_proto::nvhcd::health_check_service_server::HealthCheckService;
use warden_proto::nvhcd::{HealthCheckRequest, HealthCheckResponse};

use crate::state::AgentState;
use warden_core::health::{NodeSnapshot, Status};

pub use crate::config::nvhcd::NvhcdConfig;

/// Builds the answer from a snapshot of the model. Pure.
pub fn answer(snapshot: &NodeSnapshot, args: &[String]) -> HealthCheckResponse {
    let describe = |status: Status| -> Vec<serde_json::Value> {
        snapshot
            .components
            .iter()
            .filter(|c| c.status == status)
            .map(|c| {
                json!({
                    "component": c.id,
                    "kind": c.kind,
                    "status": c.status.as_str(),
                    "reasons": c.reasons.iter().map(|r| json!({
                        "signal": r.signal,
                        "value": r.value,
                        "threshold": r.threshold,
                        "message": r.message,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect()
    };
    let failed = describe(Status::Failed);
    let healthy = failed.is_empty();
    let output = json!({
        "fail_count": failed.len(),
        "failed_checks": failed,
        "degraded_checks": describe(Status::Degraded),
        "node_status": snapshot.status.as_str(),
        "components": snapshot.components.len(),
        "args": args,
        "source": "wardend",
    });
    HealthCheckResponse {
        success: healthy,
        exit_code: i32::from(!healthy),
        output: output.to_string(),
        error: String::new(),
    }
}

/// The `nvhcd.HealthCheckService` implementation.
#[derive(Debug, Clone)]
pub struct NvhcdService {
    state: Arc<AgentState>,
}

impl NvhcdService {
    /// Answers from `state`'s health model.
    pub fn new(state: Arc<AgentState>) -> Self {
        Self { state }
    }
}

#[tonic::async_trait]
impl HealthCheckService for NvhcdService {
    async fn run_health_check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, GrpcStatus> {
        // Counted and timed like every call of the agent's own service.
        super::observe::observed("nvhcd.RunHealthCheck", async {
            let snapshot = self.state.health.snapshot();
            Ok(Response::new(answer(&snapshot, &request.into_inner().args)))
        })
        .await
    }
}

/// Binds `path` with permission bits `mode`, replacing a socket file left
/// by a crashed agent (the caller holds the agent's instance lock, so no
/// live agent serves it).
pub fn bind(path: &str, mode: u32, gid: Option<u32>) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        std::fs::remove_file(path)?;
    }
    let l = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    // The API socket's group too (`api.socket_group`): NVRx runs as the
    // job's user, a member of that group, not as root.
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(std::io::Error::from)?;
    }
    Ok(l)
}

/// Serves `nvhcd.HealthCheckService` on `listener` until shutdown, then
/// removes the socket file at `path`. Each connection goes through
/// [`crate::api::uds_authority::AuthorityFilter`], so grpcio's default
/// `:authority` (the percent-encoded socket path) is served.
///
/// Its connections and requests count under the API socket's quotas: the
/// same uids reach both.
pub async fn serve(
    listener: tokio::net::UnixListener,
    path: String,
    state: Arc<AgentState>,
    quotas: crate::listen::admission::Quotas,
) {
    let stop = state.shutdown.clone();
    // NVRx's grpcio client names the socket path as `:authority`: the
    // connections come through crate::api::uds_authority's filter.
    let incoming = crate::api::local_accept::local_connections(
        "nvhcd.socket",
        listener,
        state.clone(),
        quotas.unix,
        quotas.requests,
    );
    let svc = warden_proto::nvhcd::health_check_service_server::HealthCheckServiceServer::new(
        NvhcdService::new(state),
    );
    let result = tonic::transport::Server::builder()
        .layer(crate::listen::conn_watch::TrackLayer::<
            crate::api::caller::LocalPeer,
        >::new())
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, stop.cancelled())
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "nvhcd socket server failed");
    }
    let _ = std::fs::remove_file(&path);
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::SystemTime;

    use super::*;
    use warden_core::health::{ComponentReport, HealthModel, Reason, ReasonKind};

    fn report(id: &str, status: Status) -> ComponentReport {
        ComponentReport {
            id: id.into(),
            kind: "test".into(),
            labels: BTreeMap::new(),
            status_override: None,
            reasons: vec![Reason {
                status,
                kind: ReasonKind::Judged,
                signal: "s".into(),
                value: "v".into(),
                threshold: String::new(),
                window: String::new(),
                since: SystemTime::now(),
                message: format!("{id} is {}", status.as_str()),
            }],
        }
    }

    #[test]
    fn only_failed_components_fail_the_check() {
        let model = HealthModel::new();
        model.report(report("nic/eth0", Status::Degraded), SystemTime::now());
        let a = answer(&model.snapshot(), &[]);
        assert!(a.success);
        let out: serde_json::Value = serde_json::from_str(&a.output).unwrap_or_default();
        assert_eq!(out["fail_count"], 0);
        assert_eq!(out["degraded_checks"][0]["component"], "nic/eth0");

        model.report(report("tpu0", Status::Failed), SystemTime::now());
        let a = answer(&model.snapshot(), &["--group".into()]);
        assert!(!a.success);
        assert_eq!(a.exit_code, 1);
        let out: serde_json::Value = serde_json::from_str(&a.output).unwrap_or_default();
        assert_eq!(out["fail_count"], 1);
        assert_eq!(out["failed_checks"][0]["component"], "tpu0");
    }
}
