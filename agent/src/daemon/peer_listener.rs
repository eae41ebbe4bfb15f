//! The `api.tcp` listener's set-up: the node's TLS set loaded, the peer
//! service served on TCP behind the mutual-TLS accept path, rotations
//! watched, and the loud warning when the port runs without
//! authentication.
//!
//! In: the validated config and the bound listener. Out: a task serving
//! `warden.v1.Peer` (and nothing else) on TCP until shutdown; events
//! `tls.reloaded`, `tls.reload_failed` and `api.insecure`; the health
//! component `agent/api.tcp` (DEGRADED with `api.insecure = true`).
//! Never: serve warden.v1.Agent, reflection or health on TCP, nor start
//! with TLS files that do not load.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::net::TcpListener;
use tonic::transport::Server;

use crate::config::Config;
use crate::state::AgentState;
use crate::tls::reload::{self, Reload, Reloader};
use crate::tls::{PeerTls, TlsError, accept};
use warden_core::events::{NewEvent, Severity};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};

/// The component that shows how the TCP port is protected.
pub const COMPONENT: &str = "agent/api.tcp";

/// The peer TLS mode the config asks for, its files loaded (an error here
/// stops the agent: it names the key and the file).
pub fn peer_tls(config: &Config) -> Result<PeerTls, TlsError> {
    match config.api.tls_files() {
        Some(files) => Ok(PeerTls::Mutual(Arc::new(Reloader::open(
            files,
            &config.host_name(),
        )?))),
        None => Ok(PeerTls::Insecure),
    }
}

/// Serves `warden.v1.Peer` on `listener` through the accept path of
/// `state.peer_tls` until the agent shuts down.
pub async fn serve(
    state: Arc<AgentState>,
    listener: TcpListener,
    quotas: crate::listen::admission::Quotas,
) {
    let stop = state.shutdown.clone();
    let rules = crate::listen::conn_watch::Rules::Grpc {
        preface: state.config.api.preface_timeout,
        idle: state.config.api.idle_timeout,
    };
    let incoming = accept::incoming(
        listener,
        state.peer_tls.clone(),
        stop.clone(),
        accept::TcpQuotas {
            connections: quotas.tcp,
            handshakes: quotas.handshakes,
            rules,
        },
    );
    let router = Server::builder()
        // Each request finds its connection's PeerInfo, and counts as open
        // for the idle rule.
        .layer(crate::listen::conn_watch::TrackLayer::<accept::PeerInfo>::new())
        // Checkpoint shards stream through here: windows that keep a fast
        // link busy (small defaults cap a stream well below link speed).
        .initial_stream_window_size(crate::peer_link::channel::STREAM_WINDOW)
        .initial_connection_window_size(crate::peer_link::channel::CONN_WINDOW)
        .max_frame_size(crate::peer_link::channel::FRAME)
        .add_service(crate::api::peer_service::PeerRoutes::new(state.clone()));
    if let Err(e) = router
        .serve_with_incoming_shutdown(incoming, stop.cancelled())
        .await
    {
        tracing::error!(error = %e, "tcp server failed");
    }
}

/// Starts watching the TLS files (mutual TLS), or warns loudly that the
/// port and the agent's dials are unauthenticated (`api.insecure`).
pub fn start(state: &Arc<AgentState>) -> Option<tokio::task::JoinHandle<()>> {
    match &state.peer_tls {
        PeerTls::Mutual(r) => {
            let st = state.clone();
            Some(tokio::spawn(reload::watch(
                r.clone(),
                state.shutdown.clone(),
                move |outcome| reported(&st, outcome),
            )))
        }
        PeerTls::Insecure => {
            if state.config.api.insecure {
                warn_insecure(state);
            }
            None
        }
    }
}

fn reported(state: &AgentState, outcome: Reload) {
    match outcome {
        Reload::Unchanged => {}
        Reload::Loaded(identity) => {
            tracing::info!(%identity, "api.tls_*: new TLS files in force for new connections");
            state.events.publish(
                NewEvent::new(
                    Severity::Info,
                    "tls.reloaded",
                    "agent",
                    format!("TLS files reloaded; this node is {identity} to its peers"),
                )
                .with("identity", identity),
            );
        }
        Reload::Refused(e) => {
            tracing::error!(error = %e, "api.tls_*: the changed TLS files do not load; the previous ones stay in force");
            state.events.publish(
                NewEvent::new(
                    Severity::Error,
                    "tls.reload_failed",
                    "agent",
                    format!("changed TLS files refused, previous ones kept: {e}"),
                )
                .with("error", e),
            );
        }
    }
}

/// What the warning says, in the log, the event and `warden health`.
const INSECURE: &str = "api.insecure = true: the TCP port and the agent's dials to its peers are \
     plain TCP with no authentication; anyone who reaches the port can push, fetch and list \
     checkpoint shards and send straggler summaries, and the peers' identities are unknown, so \
     no per-job authorization is applied";

fn warn_insecure(state: &AgentState) {
    tracing::warn!(tcp = %state.config.api.tcp, "{INSECURE}");
    state.events.publish(
        NewEvent::new(Severity::Warning, "api.insecure", "agent", INSECURE)
            .with("tcp", &state.config.api.tcp),
    );
    let now = SystemTime::now();
    state.health.report_from(
        "api",
        ComponentReport {
            id: COMPONENT.into(),
            kind: "agent".into(),
            labels: BTreeMap::from([("address".to_owned(), state.config.api.tcp.clone())]),
            status_override: None,
            reasons: vec![Reason {
                status: Status::Degraded,
                kind: ReasonKind::Judged,
                signal: "api.tcp.authentication".into(),
                value: "none".into(),
                threshold: "mutual TLS (api.tls_ca, api.tls_cert, api.tls_key)".into(),
                window: String::new(),
                since: now,
                message: INSECURE.into(),
            }],
        },
        now,
    );
}
