//! System tests of the agent's API: the real `wardend`, asked over its Unix
//! socket (and TCP) by gRPC clients and over HTTP by a Prometheus scrape.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::HashSet;

use common::{
    MEMORY_NEVER_LOW, TestAgent, WAIT, endpoint, eventually, evidence, http_get, sample, within,
};
use tokio_stream::StreamExt;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use warden_cli::Target;
use warden_proto::v1 as pb;

/// Every machine has less than 100% of its memory available: DEGRADED
/// (and never FAILED), deterministically.
const MEMORY_ALWAYS_LOW: &str =
    "[host]\nmemory_degraded_below_percent = 100.0\nmemory_failed_below_percent = 0.0\n";

fn status(s: i32) -> pb::Status {
    pb::Status::try_from(s).unwrap_or(pb::Status::Unspecified)
}

fn component<'a>(h: &'a pb::NodeHealth, id: &str) -> Option<&'a pb::Component> {
    h.components.iter().find(|c| c.id == id)
}

/// GetNodeHealth until host/memory has been read once.
async fn health_with_memory(agent: &TestAgent) -> pb::NodeHealth {
    let mut client = agent.client().await;
    eventually(WAIT, "agent and host/memory in GetNodeHealth", async || {
        let h = client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .expect("GetNodeHealth")
            .into_inner();
        (component(&h, "host/memory").is_some() && component(&h, "agent").is_some()).then_some(h)
    })
    .await
}

#[tokio::test]
async fn grpc_health_check_serves_all_and_agent_service() {
    let agent = TestAgent::start("");
    let mut health = HealthClient::new(agent.channel().await);
    for service in ["", "warden.v1.Agent"] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .unwrap_or_else(|e| panic!("Check({service:?}): {e}"))
            .into_inner();
        assert_eq!(
            answer.status,
            ServingStatus::Serving as i32,
            "Check({service:?})"
        );
    }
    // An unknown service is NOT_FOUND, so SERVING above means something.
    let unknown = health
        .check(HealthCheckRequest {
            service: "warden.v1.Nope".to_owned(),
        })
        .await
        .expect_err("an unknown service must not be SERVING");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn reflection_lists_agent_and_health_services() {
    let agent = TestAgent::start("");
    let mut reflection = ServerReflectionClient::new(agent.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("ServerReflectionInfo")
        .into_inner();
    let first = within(WAIT, "the reflection answer", responses.next())
        .await
        .expect("one answer")
        .expect("an answer, not an error");
    let Some(MessageResponse::ListServicesResponse(list)) = first.message_response else {
        panic!("not a ListServices answer: {first:?}");
    };
    let names: HashSet<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for wanted in ["warden.v1.Agent", "grpc.health.v1.Health"] {
        assert!(names.contains(wanted), "{wanted} not in {names:?}");
    }
}

#[tokio::test]
async fn node_health_is_ok_with_agent_and_host_memory() {
    let agent = TestAgent::start(&format!(
        "[agent]\nhost_name = \"node-under-test\"\n{MEMORY_NEVER_LOW}"
    ));
    let h = health_with_memory(&agent).await;
    assert_eq!(h.host, "node-under-test");
    assert_eq!(status(h.status), pb::Status::Ok, "{h:?}");
    assert!(h.observed_at.is_some());
    let agent_c = component(&h, "agent").expect("an agent component");
    assert_eq!(status(agent_c.status), pb::Status::Ok);
    assert_eq!(
        agent_c.labels.get("version").map(String::as_str),
        Some(env!("CARGO_PKG_VERSION"))
    );
    let memory = component(&h, "host/memory").expect("host/memory");
    assert_eq!(status(memory.status), pb::Status::Ok, "{memory:?}");
    assert!(
        memory.reasons.is_empty(),
        "an OK component without findings: {memory:?}"
    );
}

#[tokio::test]
async fn low_memory_degrades_host_memory_with_evidence() {
    let agent = TestAgent::start(MEMORY_ALWAYS_LOW);
    let h = health_with_memory(&agent).await;
    assert_eq!(
        status(h.status),
        pb::Status::Degraded,
        "the node is the worst of its parts: {h:?}"
    );
    let memory = component(&h, "host/memory").expect("host/memory");
    assert_eq!(status(memory.status), pb::Status::Degraded, "{memory:?}");
    let reason = memory.reasons.first().expect("a reason for DEGRADED");
    assert_eq!(status(reason.status), pb::Status::Degraded);
    assert_eq!(reason.signal, "memory.available_percent");
    assert!(
        reason.value.ends_with('%'),
        "value with its unit: {reason:?}"
    );
    assert!(
        reason.threshold.contains("100"),
        "threshold as configured: {reason:?}"
    );
    assert!(!reason.message.is_empty());
    assert!(reason.since.is_some());
}

#[tokio::test]
async fn agent_info_reports_identity_endpoints_and_config() {
    let agent = TestAgent::start("[events]\nretain = 77\n");
    let info = agent.info().await;
    assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(info.pid, agent.pid());
    assert!(info.uptime.is_some());
    assert!(info.started_at.is_some());
    assert!(!info.host.is_empty());
    assert_eq!(
        endpoint(&info, "unix"),
        agent.socket().display().to_string()
    );
    let metrics = endpoint(&info, "metrics");
    let port = metrics
        .strip_prefix("http://127.0.0.1:")
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("metrics endpoint {metrics}"));
    assert_ne!(
        port.parse::<u16>().expect("a port"),
        0,
        "the port actually bound"
    );
    assert!(
        info.endpoints.iter().all(|e| e.kind != "tcp"),
        "tcp is off by default"
    );

    let config: toml::Table = info.config_toml.parse().expect("config_toml is TOML");
    assert_eq!(
        config["events"]["retain"].as_integer(),
        Some(77),
        "{config}"
    );
    assert_eq!(
        config["api"]["socket"].as_str(),
        Some(agent.socket().to_str().expect("a UTF-8 path"))
    );
    // Defaults are filled in.
    assert_eq!(
        config["agent"]["shutdown_grace"].as_str(),
        Some("5s"),
        "{config}"
    );
    assert_eq!(info.config_source, agent.home.config.display().to_string());
    // What it takes that an older agent does not, for launchers to publish.
    assert_eq!(
        info.capabilities,
        ["ckpt-ring-by-place", "ckpt-job-replicas"]
    );
}

#[tokio::test]
async fn events_record_start_and_health_change_and_resume_after_an_id() {
    let agent = TestAgent::start(MEMORY_ALWAYS_LOW);
    let events = eventually(WAIT, "a health.changed event for host/memory", async || {
        let events = agent.events().await;
        events
            .iter()
            .any(|e| e.kind == "health.changed" && e.subject == "host/memory")
            .then_some(events)
    })
    .await;
    let ids: Vec<u64> = events.iter().map(|e| e.id).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids increase: {ids:?}");

    let started = events
        .iter()
        .find(|e| e.kind == "agent.started")
        .expect("agent.started");
    assert_eq!(started.subject, "agent");
    assert_eq!(
        evidence(started, "pid"),
        Some(agent.pid().to_string().as_str())
    );
    assert_eq!(evidence(started, "replaced_stale_socket_of_pid"), None);

    let changed = events
        .iter()
        .find(|e| e.kind == "health.changed" && e.subject == "host/memory")
        .expect("health.changed");
    assert_eq!(evidence(changed, "from"), Some("NEW"));
    assert_eq!(evidence(changed, "to"), Some("DEGRADED"));
    assert_eq!(
        evidence(changed, "signal"),
        Some("memory.available_percent")
    );
    for key in ["value", "threshold"] {
        assert!(
            evidence(changed, key).is_some_and(|v| !v.is_empty()),
            "evidence {key} in {changed:?}"
        );
    }
    assert_eq!(
        pb::Severity::try_from(changed.severity),
        Ok(pb::Severity::Warning)
    );

    // agent.started opens the agent's life: every finding comes after it.
    assert!(
        started.id < changed.id,
        "agent.started ({}) must precede the first health.changed ({}): {events:?}",
        started.id,
        changed.id
    );
    // A watcher resuming after agent.started is given what followed it,
    // first of all the health change, and not agent.started again.
    let mut stream = agent
        .client()
        .await
        .watch_events(pb::WatchEventsRequest {
            after_id: Some(started.id),
        })
        .await
        .expect("WatchEvents")
        .into_inner();
    let first = within(WAIT, "the first resumed event", stream.next())
        .await
        .expect("an event")
        .expect("an event, not an error");
    assert_eq!(
        first.id, changed.id,
        "resumed with {first:?}, events {events:?}"
    );
    assert_eq!(first.kind, "health.changed");
}

#[tokio::test]
async fn live_watcher_sees_agent_stopping_then_the_stream_ends() {
    let mut agent = TestAgent::start(MEMORY_NEVER_LOW);
    let mut stream = agent
        .client()
        .await
        .watch_events(pb::WatchEventsRequest { after_id: None })
        .await
        .expect("WatchEvents")
        .into_inner();
    agent.signal(nix::sys::signal::Signal::SIGTERM);
    let first = within(WAIT, "agent.stopping on the live stream", stream.next())
        .await
        .expect("an event before the stream ends")
        .expect("an event, not an error");
    // Live only: agent.started happened before the watch and is not replayed.
    assert_eq!(first.kind, "agent.stopping", "{first:?}");
    assert_eq!(evidence(&first, "signal"), Some("SIGTERM"));
    let end = within(WAIT, "the end of the stream", stream.next()).await;
    assert!(
        end.is_none(),
        "the stream ends cleanly after agent.stopping: {end:?}"
    );
    let status = agent.exited(WAIT).await;
    assert_eq!(status.code(), Some(0), "{status}\n{}", agent.stderr());
}

/// api.tcp binds (its port resolved in GetAgentInfo) but serves only the
/// peer agents: the CLI's `--addr` says where the API is instead. TLS is
/// beside the point here, so the port runs with `api.insecure = true`
/// (tests/security/tls.rs covers TLS and the warning).
#[tokio::test]
async fn tcp_endpoint_is_for_peers_and_the_cli_says_so() {
    let agent = TestAgent::start(
        "[api]\ntcp = \"127.0.0.1:0\"\ninsecure = true\n[agent]\nhost_name = \"tcp-node\"\n",
    );
    let info = agent.info().await;
    let addr = endpoint(&info, "tcp");
    let port = addr
        .strip_prefix("127.0.0.1:")
        .unwrap_or_else(|| panic!("tcp endpoint {addr}"));
    assert_ne!(
        port.parse::<u16>().expect("a port"),
        0,
        "the port actually bound"
    );
    let e = Target::Tcp(addr.clone())
        .connect()
        .await
        .expect_err("the Agent API is not on TCP");
    assert!(format!("{e:#}").contains("Unix socket"), "{e:#}");
}

#[tokio::test]
async fn metrics_endpoint_serves_prometheus_text() {
    const CALLS: usize = 3;
    let agent = TestAgent::start(MEMORY_NEVER_LOW);
    let url = agent.metrics_url().await;
    let mut client = agent.client().await;
    for _ in 0..CALLS {
        client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .expect("GetNodeHealth");
    }
    let body = tokio::task::spawn_blocking(move || http_get(&url))
        .await
        .expect("the scrape");
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
        .unwrap_or_else(|e| panic!("not Prometheus text ({e}):\n{body}"));

    assert_eq!(
        sample(
            &scrape,
            "warden_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );
    assert!(
        sample(&scrape, "warden_uptime_seconds", &[]) > 0.0,
        "{body}"
    );
    assert!(
        sample(&scrape, "warden_events_total", &[("kind", "agent.started")]) >= 1.0,
        "{body}"
    );
    #[allow(clippy::cast_precision_loss)]
    let calls = CALLS as f64;
    assert_eq!(
        sample(
            &scrape,
            "warden_api_requests_total",
            &[("method", "GetNodeHealth"), ("code", "OK")]
        ),
        calls,
        "{body}"
    );
}

/// ReportJobStop over the socket: recorded and served as an incident of
/// the job, kept after an agent restart, and bounded in what a caller can
/// make the agent keep.
#[tokio::test]
async fn a_launchers_stop_is_recorded_and_bounded() {
    let mut agent = TestAgent::start(MEMORY_NEVER_LOW);
    let mut c = agent.client().await;
    let report = |job: &str, evidence: usize| pb::ReportJobStopRequest {
        job_id: job.into(),
        reason: pb::JobStopReason::NoProgress as i32,
        summary: "no progress in 3 restarts in a row".into(),
        exit_code: 88,
        limit: "--max-no-progress-restarts 3".into(),
        evidence: (0..evidence)
            .map(|i| pb::JobStopEvidence {
                subject: format!("attempt/{i}"),
                signal: "resumed_from".into(),
                value: "0".into(),
                note: "x".repeat(10_000),
            })
            .collect(),
        incident_id: String::new(),
    };
    let id = c
        .report_job_stop(report("j", 4))
        .await
        .expect("ReportJobStop")
        .into_inner()
        .incident_id;
    assert!(id.starts_with("inc-"), "{id}");
    // A huge evidence list, no reason, no job: refused, nothing kept.
    for bad in [
        report("j", 65),
        pb::ReportJobStopRequest {
            reason: 0,
            ..report("j", 1)
        },
        report("", 1),
    ] {
        let e = c.report_job_stop(bad).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }
    // At most 16 of one job: a caller looping on the call is refused.
    for _ in 1..16 {
        c.report_job_stop(report("j", 1))
            .await
            .expect("below the cap");
    }
    let e = c.report_job_stop(report("j", 1)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    let listed = |r: pb::GetIncidentsResponse| {
        r.incidents
            .into_iter()
            .filter(|i| i.kind == "no_progress")
            .collect::<Vec<_>>()
    };
    let stops = listed(
        c.get_incidents(pb::GetIncidentsRequest {
            job_id: "j".into(),
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner(),
    );
    assert_eq!(stops.len(), 16);
    let first = stops.iter().find(|i| i.id == id).expect("the first stop");
    let d = first.diagnosis.as_ref().unwrap();
    assert_eq!(d.evidence.len(), 4);
    assert!(d.evidence.iter().all(|e| e.note.len() <= 256));
    // Kept across a restart of the agent (its journal).
    agent.sigterm_and_wait(WAIT);
    let agent = TestAgent::start_in(agent.home.clone());
    let mut c = agent.client().await;
    let after = listed(
        c.get_incidents(pb::GetIncidentsRequest {
            job_id: "j".into(),
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner(),
    );
    assert_eq!(after.len(), 16);
}

/// Thousands of calls on one long-lived Unix-socket connection all succeed,
/// on that one connection: six tasks share one channel (as a launcher's or
/// a rank's client does) and make 5,000 unary calls between them through
/// the `:authority` filter, the request tracking layer and h2's
/// per-connection limits (locally reset streams, empty and small DATA
/// frames, all counted per connection). The channel dials through a connector that counts its dials,
/// so a connection dropped midway cannot hide behind tonic's reconnect.
#[tokio::test(flavor = "multi_thread")]
async fn five_thousand_calls_on_one_connection_all_succeed() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const WORKERS: usize = 6;
    const CALLS: usize = 5_000;
    let agent = TestAgent::start("");
    let dials = Arc::new(AtomicUsize::new(0));
    let path = agent.socket().to_owned();
    let counted = dials.clone();
    let channel = tonic::transport::Endpoint::from_static("http://wardend.local")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .expect("dial the agent");
    let client = pb::agent_client::AgentClient::new(channel);
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..WORKERS {
        let mut c = client.clone();
        workers.spawn(async move {
            let mut failed = Vec::new();
            for i in (w..CALLS).step_by(WORKERS) {
                // Three methods in turn, so the client's HPACK table holds
                // several paths, as a real client's does.
                let r = match i % 3 {
                    0 => c.get_agent_info(pb::GetAgentInfoRequest {}).await.map(drop),
                    1 => c
                        .get_node_health(pb::GetNodeHealthRequest {})
                        .await
                        .map(drop),
                    _ => c
                        .get_goodput(pb::GetGoodputRequest::default())
                        .await
                        .map(drop),
                };
                if let Err(e) = r {
                    failed.push(format!("call {i}: {:?} {}", e.code(), e.message()));
                }
            }
            failed
        });
    }
    let failed: Vec<String> = within(std::time::Duration::from_secs(120), "5,000 calls", async {
        let mut all = Vec::new();
        while let Some(r) = workers.join_next().await {
            all.extend(r.expect("a worker"));
        }
        all
    })
    .await;
    assert!(
        failed.is_empty(),
        "{} of {CALLS} calls failed, first: {:?}\n--- wardend stderr ---\n{}",
        failed.len(),
        &failed[..failed.len().min(5)],
        agent.stderr()
    );
    assert_eq!(
        dials.load(Ordering::SeqCst),
        1,
        "every call on the one connection (no redial)"
    );
}
