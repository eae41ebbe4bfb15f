//! Running the agent: claim the socket, bind the listeners, start the work
//! loop, tell systemd, and shut down cleanly on SIGTERM/SIGINT.
//!
//! In: a validated [`Config`]. Out: a serving agent until a signal (or
//! [`AgentState::shutdown`]) stops it, then the socket file removed and
//! in-flight calls given `agent.shutdown_grace` to finish. Never: start a
//! second agent on a socket another one serves.

pub mod instance;
pub mod notify;
pub mod peer_listener;
pub mod work_loop;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinSet;
use tonic::transport::Server;
use tonic_health::ServingStatus;
use warden_proto::v1::agent_server::AgentServer;

use crate::api::caller::LocalPeer;
use crate::api::local_accept::local_connections;
use crate::api::{AgentService, metrics_http, nvhcd};
use crate::config::Config;
use crate::listen::admission::Quotas;
use crate::listen::conn_watch::TrackLayer;
use crate::sources::runner::Sources;
use crate::state::AgentState;
use warden_core::events::{NewEvent, Severity};

/// Why the agent could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The socket is taken or unusable.
    #[error(transparent)]
    Instance(#[from] instance::InstanceError),
    /// A listener could not be bound.
    #[error("cannot listen on {what} {addr}: {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// Its address.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A source's thread could not be started.
    #[error("cannot start a source thread: {0}")]
    Threads(std::io::Error),
    /// A source could not be set up from its section (the TPU runtime's
    /// threads, a scenario file gone bad since it was checked).
    #[error("cannot set up the sources: {0}")]
    Sources(std::io::Error),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    /// The heartbeat slots (or the stack-dump directory) could not be set up.
    #[error("cannot set up the heartbeat slots: {0}")]
    Slots(#[from] warden_slot::SlotError),
    /// The state directory is not the agent's alone (a symlink, another
    /// owner's), or could not be made.
    #[error("agent.state_dir: {0}")]
    StateDir(#[from] warden_core::fsafe::FsError),
    /// The reflection service could not be built from our descriptors.
    #[error("cannot build the reflection service: {0}")]
    Reflection(String),
    /// The TLS files named by `api.tls_*` do not load.
    #[error("cannot use the TLS files: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

impl DaemonError {
    /// True when the failure is another agent holding the socket.
    pub fn is_already_running(&self) -> bool {
        matches!(
            self,
            DaemonError::Instance(instance::InstanceError::AlreadyRunning { .. })
        )
    }
}

/// Binds an optional TCP listener (`addr` empty: off); returns it with the
/// address actually bound (port 0 resolved).
async fn bind_optional(
    what: &'static str,
    addr: &str,
) -> Result<Option<(TcpListener, String)>, DaemonError> {
    if addr.is_empty() {
        return Ok(None);
    }
    let l = listen(addr).await.map_err(|source| DaemonError::Bind {
        what,
        addr: addr.to_owned(),
        source,
    })?;
    let bound = l.local_addr().map_or(addr.to_owned(), |a| a.to_string());
    Ok(Some((l, bound)))
}

/// The listen backlog of the TCP listeners. tokio's `TcpListener::bind`
/// asks for 1,024: a burst of more connections at once (every host of a
/// one-group job calling its aggregator as the job starts) overflows it,
/// and those past it wait for their SYN to be sent again, 1 s and then
/// 2 s later (docs/benchmarks.md, "over the network": 1,023 hosts took
/// 1.3 s to connect, 255 took 0.14 s). The kernel caps it at
/// `net.core.somaxconn` (4,096 by default since Linux 5.4).
const TCP_BACKLOG: u32 = 4096;

/// Binds a TCP listener on `addr` (an address or `host:port`, each of its
/// addresses tried in turn) with [`TCP_BACKLOG`].
async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        };
        let bound = socket.and_then(|s| {
            // As `TcpListener::bind`: a restarted agent binds again at
            // once, past connections of its last life in TIME_WAIT.
            s.set_reuseaddr(true)?;
            s.bind(a)?;
            s.listen(TCP_BACKLOG)
        });
        match bound {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{addr} resolves to no address"),
        )
    }))
}

/// Runs the agent until SIGTERM/SIGINT or until `state.shutdown` is cancelled.
pub async fn run(config: Config, config_source: String) -> Result<(), DaemonError> {
    serve(config, config_source, None).await
}

/// Runs the agent inside another program until `shutdown` is cancelled:
/// `warden run` on a host where no wardend serves. Apart from [`run`]
/// because the host program owns the process's signals: the launcher
/// forwards SIGINT/SIGTERM to its workers, stops them, and only then stops
/// the agent, which must still be serving (StopRanks) meanwhile; so no
/// signal handler is installed here.
pub async fn run_embedded(
    config: Config,
    config_source: String,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), DaemonError> {
    serve(config, config_source, Some(shutdown)).await
}

async fn serve(
    config: Config,
    config_source: String,
    embedded: Option<tokio_util::sync::CancellationToken>,
) -> Result<(), DaemonError> {
    let socket: PathBuf = config.socket_path();
    let claim = instance::claim(&socket)?;
    // The state dir (journals, incidents, calibrations, the node condition)
    // is the agent's: created 0750, refused when a symlink or another
    // user's, closed again when someone else could write it.
    warden_core::fsafe::Dir::ensure(&config.state_dir(), warden_core::fsafe::STATE_DIR_MODE)?;
    let peer_tls = peer_listener::peer_tls(&config)?;
    let mut state = AgentState::with_peer_tls(config, config_source, peer_tls)?;
    if let Some(host) = &embedded {
        state.shutdown = host.child_token();
    }
    let state = Arc::new(state);
    // Subscribed before anything publishes, so attribution sees every
    // registration and signal.
    let attribution = crate::attribute::task::start(state.attribution(), state.take_escalations());
    let goodput = crate::goodput::task::start(
        &state.events,
        state.goodput.clone(),
        state.shutdown.clone(),
        state.config.goodput.series_after_end,
    );
    let cfg = &state.config;

    let uds = UnixListener::bind(&socket).map_err(|source| DaemonError::Bind {
        what: "unix socket",
        addr: socket.display().to_string(),
        source,
    })?;
    let mode = cfg.socket_mode().unwrap_or(0o660);
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(mode)).map_err(|source| {
        DaemonError::Bind {
            what: "unix socket (chmod)",
            addr: socket.display().to_string(),
            source,
        }
    })?;
    if let Ok(Some(gid)) = cfg.socket_gid() {
        nix::unistd::chown(&socket, None, Some(nix::unistd::Gid::from_raw(gid))).map_err(|e| {
            DaemonError::Bind {
                what: "unix socket (chown to api.socket_group)",
                addr: socket.display().to_string(),
                source: std::io::Error::from(e),
            }
        })?;
    }
    state.add_endpoint("unix", socket.display().to_string());
    // Beside it, the slot socket: each registered rank receives its sealed
    // slot memory there (SCM_RIGHTS), with the API socket's mode and group.
    let slot_path = warden_slot::socket::socket_path(&socket);
    let slot_listener =
        crate::api::slot_socket::bind(&slot_path, mode, cfg.socket_gid().ok().flatten()).map_err(
            |source| DaemonError::Bind {
                what: "slot socket",
                addr: slot_path.display().to_string(),
                source,
            },
        )?;
    state.add_endpoint("slots", slot_path.display().to_string());

    let tcp = bind_optional("tcp", &cfg.api.tcp).await?;
    if let Some((_, addr)) = &tcp {
        state.add_endpoint("tcp", addr.clone());
    }
    let metrics = bind_optional("metrics", &cfg.metrics.listen).await?;
    if let Some((_, addr)) = &metrics {
        state.add_endpoint("metrics", format!("http://{addr}/metrics"));
    }
    let metrics_handle = metrics_http::install(cfg.metrics.max_job_series);
    // One budget of connections over every listener, within the
    // descriptors the agent may open (issue 29).
    let nofile = crate::listen::admission::nofile_limit();
    let quotas = Quotas::new(cfg.quotas(), nofile);
    state.set_stranger_connections(quotas.budget.stranger_cap());
    tracing::info!(
        nofile,
        connections = quotas.budget.cap(),
        per_uid = cfg.api.max_connections_per_uid,
        "connection quotas"
    );

    let mut signals = match embedded {
        Some(_) => None,
        None => Some((
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .map_err(DaemonError::Signals)?,
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
                .map_err(DaemonError::Signals)?,
        )),
    };

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<AgentServer<AgentService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(warden_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(warden_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    let router = Server::builder()
        // Each request finds its connection's LocalPeer, and counts as open
        // for the idle rule.
        .layer(TrackLayer::<LocalPeer>::new())
        // Checkpoint shards stream through here: windows that keep a fast
        // link busy (small defaults cap a stream well below loopback speed).
        .initial_stream_window_size(crate::peer_link::channel::STREAM_WINDOW)
        .initial_connection_window_size(crate::peer_link::channel::CONN_WINDOW)
        .max_frame_size(crate::peer_link::channel::FRAME)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(AgentServer::new(AgentService::new(state.clone())))
        .add_service(crate::api::peer_service::PeerRoutes::new(state.clone()));

    let mut tasks = JoinSet::new();
    tasks.spawn(attribution);
    if let Ok(ck) = &state.checkpoints {
        crate::ckpt::report_recovered(&state.events, ck);
        tasks.spawn(crate::ckpt::replicate::run(
            state.events.clone(),
            state.shutdown.clone(),
            ck.clone(),
        ));
        tasks.spawn(crate::ckpt::scrub::run(
            state.events.clone(),
            state.shutdown.clone(),
            ck.clone(),
        ));
        tasks.spawn(crate::ckpt::police_staging(
            state.events.clone(),
            state.shutdown.clone(),
            ck.clone(),
        ));
    }
    tasks.spawn(goodput);
    if let Some(slurm) = crate::act::slurm::start(
        cfg.slurm.clone(),
        &state.host,
        &state.slurm,
        state.events.clone(),
        state.shutdown.clone(),
    ) {
        tasks.spawn(slurm);
    }
    crate::notice::start(
        &cfg.notice,
        &cfg.host.sysfs_root,
        &state.notices,
        &state.events,
        &state.shutdown,
        &mut tasks,
    );
    tasks.spawn(crate::api::slot_socket::serve(
        slot_listener,
        slot_path.clone(),
        state.clone(),
    ));
    {
        let stop = state.shutdown.clone();
        let incoming = local_connections(
            "api.socket",
            uds,
            state.clone(),
            quotas.unix.clone(),
            quotas.requests.clone(),
        );
        tasks.spawn(async move {
            if let Err(e) = router
                .serve_with_incoming_shutdown(incoming, stop.cancelled())
                .await
            {
                tracing::error!(error = %e, "unix socket server failed");
            }
        });
    }
    // TCP serves the peer agents only (warden.v1.Peer), behind mutual TLS:
    // the rest of the API is local, on the Unix socket.
    if let Some((l, _)) = tcp {
        tasks.spawn(peer_listener::serve(state.clone(), l, quotas.clone()));
    }
    if let (Some((l, _)), Some(handle)) = (metrics, metrics_handle) {
        let st = state.clone();
        let metrics_limits = quotas.metrics.clone();
        tasks.spawn(async move {
            if let Err(e) = metrics_http::serve(l, handle, st, metrics_limits).await {
                tracing::error!(error = %e, "metrics server failed");
            }
        });
    }
    if !cfg.nvhcd.socket.is_empty() {
        let path = cfg.nvhcd.socket.clone();
        let gid = cfg.socket_gid().ok().flatten();
        let l = nvhcd::bind(&path, mode, gid).map_err(|source| DaemonError::Bind {
            what: "nvhcd socket (bind, chmod to api.socket_mode, chown to api.socket_group)",
            addr: path.clone(),
            source,
        })?;
        state.add_endpoint("nvhcd", path.clone());
        tasks.spawn(nvhcd::serve(l, path, state.clone(), quotas.clone()));
    }
    let watchdog = notify::Watchdog::from_env();
    let watchdog_period = watchdog.period();

    let mut started = NewEvent::new(
        Severity::Info,
        "agent.started",
        "agent",
        format!("wardend {} serving on {}", crate::VERSION, socket.display()),
    )
    .with("pid", std::process::id())
    .with("config", &state.config_source);
    for (kind, addr) in state.endpoints() {
        started = started.with(kind, addr);
    }
    if let Some(pid) = &claim.replaced_stale {
        started = started.with("replaced_stale_socket_of_pid", pid);
    }
    if let Some(p) = watchdog_period {
        started = started.with("watchdog_ping_every", humantime::format_duration(p));
    }
    // Published before the work loop starts, so it is the agent's first
    // event and a watcher resuming after it misses nothing.
    state.events.publish(started);
    if let Some(watch) = peer_listener::start(&state) {
        tasks.spawn(async move {
            let _ = watch.await;
        });
    }
    let sources = Sources::default();
    for source in crate::sources::registry::configured(state.config.sources())
        .map_err(DaemonError::Sources)?
    {
        sources
            .spawn(state.health_reporter(), state.shutdown.clone(), source)
            .map_err(DaemonError::Threads)?;
    }
    tasks.spawn(work_loop::run(state.clone(), watchdog, sources));
    notify::ready(&format!("serving on {}", socket.display()));

    let signal = match &mut signals {
        Some((sigterm, sigint)) => tokio::select! {
            _ = sigterm.recv() => "SIGTERM",
            _ = sigint.recv() => "SIGINT",
            () = state.shutdown.cancelled() => "shutdown request",
        },
        None => {
            state.shutdown.cancelled().await;
            "shutdown request"
        }
    };
    state.events.publish(
        NewEvent::new(
            Severity::Info,
            "agent.stopping",
            "agent",
            format!("wardend stopping on {signal}"),
        )
        .with("signal", signal),
    );
    notify::stopping();
    health_reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
    health_reporter
        .set_not_serving::<AgentServer<AgentService>>()
        .await;
    state.shutdown.cancel();
    let grace = state.config.agent.shutdown_grace;
    let drained =
        tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            grace = %humantime::format_duration(grace),
            "in-flight calls did not finish within the shutdown grace; closing them"
        );
        tasks.abort_all();
    }
    // The work loop's last scans may have handed steps to the ledger after
    // the goodput task's own last flush: fold and journal them now that
    // nothing else runs.
    state.goodput.flush();
    state
        .registry()
        .save_calibrations(std::time::Duration::ZERO, true);
    drop(claim);
    tracing::info!("wardend stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_listener_takes_a_name_or_an_address_and_refuses_one_already_taken() {
        let l = listen("127.0.0.1:0").await.expect("bind port 0");
        let addr = l.local_addr().expect("bound").to_string();
        // A second agent on the same address is refused, as before the
        // backlog was set: SO_REUSEADDR does not share a listening port.
        let e = listen(&addr).await.expect_err("the port is taken");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
        let named = listen("localhost:0").await.expect("bind a name");
        assert!(named.local_addr().expect("bound").ip().is_loopback());
    }
}
