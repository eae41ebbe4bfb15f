//! The Prometheus endpoint: `/metrics` in the text exposition format.
//!
//! The recorder is process-global (the `metrics` facade), installed once;
//! every part of the agent records through the facade and this module only
//! renders. Build info and uptime are refreshed at scrape time.
//!
//! Any local user reaches the port, so its connections are held to quotas
//! ([`QuotaListener`]): `metrics.max_connections_per_source` per source
//! address, the agent's shared connection budget in all, and the
//! [`crate::listen::conn_watch::Rules::Http1`] timeouts (issue 29: 1,100 idle
//! connections took every descriptor of the agent).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::{TcpListener, TcpStream};

use crate::listen::admission::{Acceptor, ConnLimits, Ticket};
use crate::listen::conn_watch::{Rules, Watched};

use crate::state::AgentState;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the global recorder once; None if another one was installed.
/// Job-labelled series go to a set of their own holding at most
/// `max_job_series` ([`crate::telemetry::job_series`]).
pub fn install(max_job_series: usize) -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let prom = PrometheusBuilder::new().build_recorder();
            let handle = prom.handle();
            let router = crate::telemetry::job_series::Router::new(prom, max_job_series);
            match metrics::set_global_recorder(router) {
                Ok(()) => {
                    describe();
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics recorder not installed; /metrics will be empty");
                    None
                }
            }
        })
        .clone()
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        "warden_build_info",
        "Always 1; the labels carry the agent's version"
    );
    describe_gauge!(
        "warden_uptime_seconds",
        Unit::Seconds,
        "Seconds since the agent started"
    );
    describe_counter!(
        "warden_events_total",
        "Events published, by kind and severity"
    );
    describe_counter!(
        "warden_api_connections_refused_total",
        "Connections closed at accept by a quota, by listener and reason (per_caller, total)"
    );
    describe_gauge!(
        "warden_api_connections_open",
        "Connections open now under the quotas, by listener"
    );
    describe_counter!(
        "warden_api_connections_closed_total",
        "Connections the agent closed for breaking a rule (no preface, idle), by reason"
    );
    describe_counter!(
        "warden_api_accept_errors_total",
        "Failed accepts, by listener and errno (EMFILE: the agent's open-file limit)"
    );
    describe_counter!(
        "warden_api_requests_total",
        "gRPC requests handled, by method and status code"
    );
    describe_histogram!(
        "warden_api_request_duration_seconds",
        Unit::Seconds,
        "Time to handle a gRPC request (for streams: to open it)"
    );
    describe_gauge!(
        "warden_component_status",
        "Health of each component: 0 OK, 1 UNKNOWN, 2 DEGRADED, 3 FAILED"
    );
    describe_gauge!(
        "warden_gpu_ecc_errors",
        "ECC errors NVML counts on a GPU since driver load (kind corrected or uncorrected)"
    );
    describe_counter!(
        "warden_gpu_xids_total",
        "XIDs seen on a GPU, by XID and by the source that saw it (nvml, kmsg)"
    );
    describe_gauge!(
        "warden_gpu_nvlink_errors",
        "NVLink error counters NVML keeps, per link (counter replay, recovery, crc)"
    );
    describe_gauge!(
        "warden_gpu_clock_event_reasons",
        "Clock event (throttle) reasons bitmask, as NVML reports it"
    );
    describe_gauge!(
        "warden_gpu_temperature_celsius",
        "GPU temperature in degrees Celsius"
    );
    describe_gauge!("warden_gpu_power_watts", "GPU power draw in watts");
    describe_gauge!(
        "warden_node_cordoned",
        "1 while a decision has the node cordoned (until `warden uncordon`), else 0"
    );
    describe_gauge!(
        "warden_circuit_breaker_open",
        "1 while [policy.circuit_breaker] max_cordons cordon decisions lie within its window (a further cordon is held), else 0"
    );
    describe_counter!(
        "warden_circuit_breaker_held_total",
        "Cordons the circuit breaker did not carry out"
    );
    describe_counter!(
        "warden_lemon_cordons_total",
        "Cordons decided by the lemon rule (repeated incidents on this node)"
    );
    describe_counter!(
        "warden_metrics_job_series_dropped_total",
        "Job-labelled series not recorded because metrics.max_job_series were held"
    );
    describe_counter!(
        "warden_dry_run_decisions_total",
        "Decisions reported and not acted on in dry run, by the action that would have been taken"
    );
}

#[derive(Clone)]
struct Scrape {
    handle: PrometheusHandle,
    state: Arc<AgentState>,
}

async fn render(State(s): State<Scrape>) -> String {
    metrics::gauge!("warden_build_info", "version" => crate::VERSION).set(1.0);
    metrics::gauge!("warden_uptime_seconds").set(s.state.started.elapsed().as_secs_f64());
    // Read from the store at each scrape, as the component statuses below:
    // always what the store says, across restarts and uncordons.
    let cordoned = s.state.incident_store().cordon().is_some();
    metrics::gauge!("warden_node_cordoned").set(if cordoned { 1.0 } else { 0.0 });
    // Likewise the circuit breaker: open while the window holds the cap.
    let journal = s.state.incident_store().all();
    let open = warden_core::policy::guard::breaker(
        &s.state.config.policy.circuit_breaker,
        &journal,
        "",
        false,
        std::time::SystemTime::now(),
    )
    .open;
    metrics::gauge!("warden_circuit_breaker_open").set(if open { 1.0 } else { 0.0 });
    for c in s.state.health.snapshot().components {
        let level = match c.status {
            warden_core::health::Status::Absent => -1.0,
            warden_core::health::Status::Ok => 0.0,
            warden_core::health::Status::Unknown => 1.0,
            warden_core::health::Status::Degraded => 2.0,
            warden_core::health::Status::Failed => 3.0,
        };
        metrics::gauge!("warden_component_status", "component" => c.id, "kind" => c.kind)
            .set(level);
    }
    let (jobs, dropped) = crate::telemetry::job_series::render();
    metrics::counter!("warden_metrics_job_series_dropped_total").absolute(dropped);
    s.handle.run_upkeep();
    // The job series come after the others: no metric name has series in
    // both (every series of a job metric carries the job label).
    let mut text = s.handle.render();
    text.push_str(&jobs);
    text
}

/// The metrics listener with its quotas: what axum accepts from.
#[derive(Debug)]
pub struct QuotaListener {
    inner: TcpListener,
    limits: Arc<ConnLimits<IpAddr>>,
    acceptor: Acceptor,
}

impl axum::serve::Listener for QuotaListener {
    type Io = Watched<TcpStream, Ticket<IpAddr>>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, remote) = match self.inner.accept().await {
                Ok(a) => {
                    self.acceptor.succeeded();
                    a
                }
                Err(e) => {
                    self.acceptor.failed(&e).await;
                    continue;
                }
            };
            // Past a cap the connection is closed at once (dropped here).
            let Ok(ticket) = self.limits.admit(remote.ip(), false) else {
                continue;
            };
            return (Watched::new(tcp, Rules::Http1, ticket), remote);
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// Serves `/metrics` on `listener` until the agent shuts down, within
/// `limits`.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    state: Arc<AgentState>,
    limits: Arc<ConnLimits<IpAddr>>,
) -> std::io::Result<()> {
    let stop = state.shutdown.clone();
    let app = Router::new()
        .route("/metrics", get(render))
        .with_state(Scrape { handle, state });
    let listener = QuotaListener {
        inner: listener,
        limits,
        acceptor: Acceptor::new("metrics.listen"),
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
}
