//! The `warden.v1.Agent` service.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_server::Agent;

use super::caller::{self, LocalPeer};
use super::convert;
use super::observe::observed;
use super::streams::{StreamGate, StreamPermit};
use crate::act::in_process;
use crate::ranks::admit;
use crate::ranks::{RankKey, RegisterError};
use crate::state::AgentState;
use warden_core::events::Event;

pub use super::streams::BoxStream;

/// Implements warden.v1.Agent on top of the shared agent state.
#[derive(Debug, Clone)]
pub struct AgentService {
    state: Arc<AgentState>,
    /// The caps on open server streams (`api.max_streams_per_uid`,
    /// `api.max_streams`), shared by every connection.
    streams: Arc<StreamGate>,
    /// The Control streams open now, one per registered rank.
    controls: Arc<super::control::ControlStreams>,
}

impl AgentService {
    /// A service answering from `state`.
    pub fn new(state: Arc<AgentState>) -> Self {
        let streams = StreamGate::new(
            state.config.api.max_streams_per_uid,
            state.config.api.max_streams,
        );
        Self {
            state,
            streams,
            controls: Arc::default(),
        }
    }

    /// Opens a server stream for `peer` past the stream caps: `stream`
    /// holds its place until the client drops it.
    fn held<T: Send + 'static>(
        &self,
        call: &str,
        peer: &LocalPeer,
        stream: BoxStream<T>,
    ) -> Result<BoxStream<T>, Status> {
        let permit = self.streams.open(call, peer.uid)?;
        Ok(Box::pin(Held {
            inner: stream,
            _permit: permit,
        }))
    }

    /// Every call's frame, written once: records it ([`observed`]: its
    /// count by status and its duration, under `call`), authorizes its
    /// caller for the job `job` names in the request ([`Self::guard`]),
    /// then runs `body` with the caller and the request. A handler only
    /// decodes, calls the stage it serves, and maps errors.
    async fn serve<T, R, Fut>(
        &self,
        call: &'static str,
        req: Request<T>,
        job: fn(&T) -> &str,
        body: impl FnOnce(LocalPeer, Request<T>) -> Fut,
    ) -> Result<R, Status>
    where
        Fut: Future<Output = Result<R, Status>>,
    {
        observed(call, async move {
            let peer = self.guard(&req, call, job(req.get_ref()))?;
            body(peer, req).await
        })
        .await
    }

    /// The Unix-socket caller of `req`, allowed to make `call` about `job`
    /// (empty: no job) under [`crate::access::authz`]'s rules; else
    /// PERMISSION_DENIED naming the rule.
    fn guard<T>(&self, req: &Request<T>, call: &str, job: &str) -> Result<LocalPeer, Status> {
        let peer = caller::local_peer(req.extensions(), call)?;
        if let Err(e) = self.state.authz.check(peer, call, job) {
            metrics::counter!("warden_api_refused_total", "call" => call.to_owned()).increment(1);
            tracing::warn!(call, caller = %peer, job, reason = e.message(), "call refused");
            return Err(e);
        }
        Ok(peer.clone())
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn get_node_health(
        &self,
        req: Request<pb::GetNodeHealthRequest>,
    ) -> Result<Response<pb::NodeHealth>, Status> {
        self.serve(
            "GetNodeHealth",
            req,
            |_| "",
            |_peer, _req| async move {
                let snap = self.state.health.snapshot();
                Ok(Response::new(convert::node_health(&self.state.host, &snap)))
            },
        )
        .await
    }

    type WatchHealthStream = BoxStream<pb::NodeHealth>;

    async fn watch_health(
        &self,
        req: Request<pb::WatchHealthRequest>,
    ) -> Result<Response<Self::WatchHealthStream>, Status> {
        self.serve(
            "WatchHealth",
            req,
            |_| "",
            |peer, _req| async move {
                let permit = self.streams.open("WatchHealth", peer.uid)?;
                let state = self.state.clone();
                let (tx, rx) = mpsc::channel(16);
                let mut changes = state.health.subscribe();
                tokio::spawn(async move {
                    loop {
                        changes.mark_unchanged();
                        let snap = state.health.snapshot();
                        if tx
                            .send(Ok(convert::node_health(&state.host, &snap)))
                            .await
                            .is_err()
                        {
                            return;
                        }
                        tokio::select! {
                            () = state.shutdown.cancelled() => return,
                            () = tx.closed() => return,
                            r = changes.changed() => if r.is_err() { return },
                        }
                    }
                });
                Ok(Response::new(Box::pin(Held {
                    inner: Box::pin(ReceiverStream::new(rx)),
                    _permit: permit,
                }) as Self::WatchHealthStream))
            },
        )
        .await
    }

    async fn list_events(
        &self,
        req: Request<pb::ListEventsRequest>,
    ) -> Result<Response<pb::ListEventsResponse>, Status> {
        self.serve(
            "ListEvents",
            req,
            |_| "",
            |_peer, req| async move {
                let req = req.into_inner();
                let limit = usize::try_from(req.limit).unwrap_or(usize::MAX);
                let (events, dropped) = self.state.events.list(req.after_id, limit);
                Ok(Response::new(pb::ListEventsResponse {
                    events: events.iter().map(|e| convert::event(e)).collect(),
                    oldest_retained_id: dropped,
                }))
            },
        )
        .await
    }

    type WatchEventsStream = BoxStream<pb::Event>;

    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        self.serve(
            "WatchEvents",
            req,
            |_| "",
            |peer, req| async move {
                let permit = self.streams.open("WatchEvents", peer.uid)?;
                let after = req.into_inner().after_id;
                let sub = self.state.events.subscribe(after);
                if sub.missed {
                    tracing::debug!(
                        after = ?after,
                        "event watcher resumes after an id the ring no longer holds"
                    );
                }
                let (tx, rx) = mpsc::channel(64);
                tokio::spawn(forward_events(self.state.clone(), sub, tx));
                Ok(Response::new(Box::pin(Held {
                    inner: Box::pin(ReceiverStream::new(rx)),
                    _permit: permit,
                }) as Self::WatchEventsStream))
            },
        )
        .await
    }

    async fn get_agent_info(
        &self,
        req: Request<pb::GetAgentInfoRequest>,
    ) -> Result<Response<pb::AgentInfo>, Status> {
        self.serve(
            "GetAgentInfo",
            req,
            |_| "",
            |_peer, _req| async move {
                let s = &self.state;
                Ok(Response::new(pb::AgentInfo {
                    version: crate::VERSION.to_owned(),
                    host: s.host.clone(),
                    pid: std::process::id(),
                    started_at: Some(convert::timestamp(s.started_at)),
                    uptime: Some(convert::duration(s.started.elapsed())),
                    endpoints: s
                        .endpoints()
                        .into_iter()
                        .map(|(kind, address)| pb::Endpoint { kind, address })
                        .collect(),
                    config_toml: s.config.to_toml(),
                    config_source: s.config_source.clone(),
                    capabilities: crate::CAPABILITIES
                        .iter()
                        .map(|c| (*c).to_owned())
                        .collect(),
                }))
            },
        )
        .await
    }

    async fn register_rank(
        &self,
        req: Request<pb::RegisterRankRequest>,
    ) -> Result<Response<pb::RegisterRankResponse>, Status> {
        self.serve(
            "RegisterRank",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                let r = req.into_inner();
                let declared = admit::Declared {
                    job_id: r.job_id,
                    global_rank: r.global_rank,
                    local_rank: r.local_rank,
                    world_size: r.world_size,
                    pid: r.pid,
                    host: r.host,
                    layout_version: r.slot_layout_version,
                    stack_dump_signal: r.stack_dump_signal,
                    devices: r.devices,
                };
                let caller = admit::PeerCred {
                    pid: peer.pid,
                    owner: peer.owner(),
                    name: peer.to_string(),
                };
                let a = admit::register(
                    &self.state.exit_handles(),
                    self.state.config.ranks.max_world_size,
                    declared,
                    &caller,
                )
                .map_err(admit_status)?;
                Ok(Response::new(pb::RegisterRankResponse {
                    slot_index: a.slot_index,
                    slot_size: a.slot_size,
                    generation: a.generation,
                    stack_dump_path: a.stack_dump_path.display().to_string(),
                }))
            },
        )
        .await
    }

    async fn deregister_rank(
        &self,
        req: Request<pb::DeregisterRankRequest>,
    ) -> Result<Response<pb::DeregisterRankResponse>, Status> {
        self.serve(
            "DeregisterRank",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                let r = req.into_inner();
                let key = RankKey {
                    job: r.job_id,
                    rank: r.global_rank,
                };
                admit::deregister(&self.state.ranks, &self.state.events, key, r.generation)
                    .map_err(admit_status)?;
                Ok(Response::new(pb::DeregisterRankResponse {}))
            },
        )
        .await
    }

    async fn get_ranks(
        &self,
        req: Request<pb::GetRanksRequest>,
    ) -> Result<Response<pb::GetRanksResponse>, Status> {
        self.serve(
            "GetRanks",
            req,
            |_| "",
            |_peer, req| async move {
                let job = req.into_inner().job_id;
                let now = warden_slot::clock::syscall_now();
                let reg = self.state.registry();
                let ranks = reg
                    .ranks
                    .values()
                    .filter(|e| job.is_empty() || e.key.job == job)
                    .map(|e| convert::rank_info(e, now))
                    .collect();
                Ok(Response::new(pb::GetRanksResponse { ranks }))
            },
        )
        .await
    }

    async fn report_exception(
        &self,
        req: Request<pb::ReportExceptionRequest>,
    ) -> Result<Response<pb::ReportExceptionResponse>, Status> {
        self.serve(
            "ReportException",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                let r = req.into_inner();
                if r.job_id.is_empty() {
                    return Err(Status::invalid_argument("job_id must be set"));
                }
                if r.exception_type.is_empty() {
                    return Err(Status::invalid_argument("exception_type must be set"));
                }
                let reported = admit::Reported {
                    key: RankKey {
                        job: r.job_id,
                        rank: r.global_rank,
                    },
                    exception_type: r.exception_type,
                    message: r.message,
                    traceback: r.traceback,
                    step: r.step,
                    pid: r.pid,
                    generation: r.generation,
                    uncaught: r.uncaught,
                    awaits_decision: r.awaits_decision,
                };
                let answer = in_process::exception::report(
                    &self.state.in_process(),
                    &self.state.config.policy,
                    reported,
                );
                Ok(Response::new(
                    answer.map_or_else(Default::default, convert::exception_answer),
                ))
            },
        )
        .await
    }

    async fn get_incidents(
        &self,
        req: Request<pb::GetIncidentsRequest>,
    ) -> Result<Response<pb::GetIncidentsResponse>, Status> {
        self.serve(
            "GetIncidents",
            req,
            |_| "",
            |_peer, req| async move {
                let r = req.into_inner();
                let store = self.state.incident_store();
                let incidents = store
                    .list(&r.job_id, r.limit as usize)
                    .iter()
                    .map(convert::incident)
                    .collect();
                Ok(Response::new(pb::GetIncidentsResponse {
                    incidents,
                    cordoned: store.cordon().is_some(),
                }))
            },
        )
        .await
    }

    async fn uncordon(
        &self,
        req: Request<pb::UncordonRequest>,
    ) -> Result<Response<pb::UncordonResponse>, Status> {
        self.serve(
            "Uncordon",
            req,
            |_| "",
            |_peer, req| async move {
                let reason = admit::clip_head(&req.into_inner().reason, 512);
                let was_cordoned =
                    crate::attribute::task::uncordon(&self.state.attribution(), &reason);
                Ok(Response::new(pb::UncordonResponse { was_cordoned }))
            },
        )
        .await
    }

    type WatchIncidentsStream = BoxStream<pb::Incident>;

    async fn watch_incidents(
        &self,
        req: Request<pb::WatchIncidentsRequest>,
    ) -> Result<Response<Self::WatchIncidentsStream>, Status> {
        self.serve(
            "WatchIncidents",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                let stream =
                    super::launcher_api::watch_incidents(&self.state, req.into_inner(), peer.uid)
                        .await?;
                self.held("WatchIncidents", &peer, stream)
                    .map(Response::new)
            },
        )
        .await
    }

    async fn stop_ranks(
        &self,
        req: Request<pb::StopRanksRequest>,
    ) -> Result<Response<pb::StopRanksResponse>, Status> {
        self.serve(
            "StopRanks",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                super::launcher_api::stop_ranks(&self.state, req.into_inner())
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn report_job_stop(
        &self,
        req: Request<pb::ReportJobStopRequest>,
    ) -> Result<Response<pb::ReportJobStopResponse>, Status> {
        self.serve(
            "ReportJobStop",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                super::job_stop::report_job_stop(&self.state, req.get_ref(), peer.uid)
                    .map(Response::new)
            },
        )
        .await
    }

    async fn request_restart(
        &self,
        req: Request<pb::RequestRestartRequest>,
    ) -> Result<Response<pb::RequestRestartResponse>, Status> {
        self.serve(
            "RequestRestart",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                super::control::request_restart(&self.state, req.into_inner())
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    type ControlStream = BoxStream<pb::ControlMessage>;

    async fn control(
        &self,
        req: Request<pb::ControlRequest>,
    ) -> Result<Response<Self::ControlStream>, Status> {
        self.serve(
            "Control",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                let permit = self.streams.open_control(peer.uid)?;
                let stream = super::control::control_one_per_rank(
                    &self.state,
                    &self.controls,
                    req.into_inner(),
                )
                .await?;
                Ok(Response::new(Box::pin(Held {
                    inner: stream,
                    _permit: permit,
                }) as Self::ControlStream))
            },
        )
        .await
    }

    async fn ack_control(
        &self,
        req: Request<pb::AckControlRequest>,
    ) -> Result<Response<pb::AckControlResponse>, Status> {
        self.serve(
            "AckControl",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                super::control::ack_control(&self.state, req.into_inner())
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn run_health_gate(
        &self,
        req: Request<pb::RunHealthGateRequest>,
    ) -> Result<Response<pb::HealthGateResult>, Status> {
        // A job named: its owner's (or an admin's) only, so a gate's
        // failing verdict is never attached to another user's job.
        self.serve(
            "RunHealthGate",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                super::gate::run(&self.state, req.into_inner(), peer.uid)
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn get_stragglers(
        &self,
        req: Request<pb::GetStragglersRequest>,
    ) -> Result<Response<pb::GetStragglersResponse>, Status> {
        self.serve(
            "GetStragglers",
            req,
            |_| "",
            |_peer, req| async move {
                Ok(Response::new(super::stragglers::get_stragglers(
                    &self.state,
                    req.into_inner(),
                )))
            },
        )
        .await
    }

    async fn begin_shard(
        &self,
        req: Request<pb::BeginShardRequest>,
    ) -> Result<Response<pb::BeginShardResponse>, Status> {
        self.serve(
            "BeginShard",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                let owner = Some(peer.owner());
                super::ckpt::begin_shard(&self.state, req.into_inner(), owner)
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn commit_shard(
        &self,
        req: Request<pb::CommitShardRequest>,
    ) -> Result<Response<pb::CommitShardResponse>, Status> {
        self.serve(
            "CommitShard",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                super::ckpt::commit_shard(&self.state, req.into_inner())
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreResponse>, Status> {
        self.serve(
            "Restore",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                let owner = Some(peer.owner());
                super::ckpt::restore(&self.state, req.into_inner(), owner)
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn list_checkpoints(
        &self,
        req: Request<pb::ListCheckpointsRequest>,
    ) -> Result<Response<pb::ListCheckpointsResponse>, Status> {
        self.serve(
            "ListCheckpoints",
            req,
            |_| "",
            |_peer, req| async move {
                super::ckpt::list_checkpoints(&self.state, req.into_inner())
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn set_checkpoint_peers(
        &self,
        req: Request<pb::SetCheckpointPeersRequest>,
    ) -> Result<Response<pb::SetCheckpointPeersResponse>, Status> {
        self.serve(
            "SetCheckpointPeers",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                super::ckpt::set_checkpoint_peers(&self.state, req.into_inner())
                    .await
                    .map(Response::new)
            },
        )
        .await
    }

    async fn get_goodput(
        &self,
        req: Request<pb::GetGoodputRequest>,
    ) -> Result<Response<pb::GetGoodputResponse>, Status> {
        self.serve(
            "GetGoodput",
            req,
            |_| "",
            |_peer, req| async move {
                super::goodput::get_goodput(&self.state, &req.into_inner()).map(Response::new)
            },
        )
        .await
    }

    async fn close_goodput(
        &self,
        req: Request<pb::CloseGoodputRequest>,
    ) -> Result<Response<pb::GetGoodputResponse>, Status> {
        self.serve(
            "CloseGoodput",
            req,
            |r| &r.job_id,
            |_peer, req| async move {
                let req = req.into_inner();
                let closed = super::goodput::close_goodput(&self.state, &req)?;
                // The job is over: its owner's claim goes with it.
                self.state.authz.release(&req.job_id);
                Ok(Response::new(closed))
            },
        )
        .await
    }

    async fn claim_job(
        &self,
        req: Request<pb::ClaimJobRequest>,
    ) -> Result<Response<pb::ClaimJobResponse>, Status> {
        self.serve(
            "ClaimJob",
            req,
            |r| &r.job_id,
            |peer, req| async move {
                let compile_cache_dir = super::ckpt::user_cache(&self.state, &peer).await;
                if let Some(why) = compile_cache_dir.as_ref().err() {
                    tracing::warn!(job = req.get_ref().job_id, caller = %peer, why, "no compilation cache folder for the job");
                }
                Ok(Response::new(pb::ClaimJobResponse {
                    owner_uid: peer.uid,
                    compile_cache_dir: compile_cache_dir.unwrap_or_default(),
                }))
            },
        )
        .await
    }

    async fn release_job(
        &self,
        req: Request<pb::ReleaseJobRequest>,
    ) -> Result<Response<pb::ReleaseJobResponse>, Status> {
        self.serve(
            "ReleaseJob",
            req,
            |_| "",
            |peer, req| async move {
                let job = req.into_inner().job_id;
                if job.is_empty() {
                    return Err(Status::invalid_argument("ReleaseJob: job_id is required"));
                }
                let had = self
                    .state
                    .authz
                    .release_by_admin(&self.state.events, &job, &peer);
                Ok(Response::new(pb::ReleaseJobResponse {
                    released: had.is_some(),
                    owner_uid: had.unwrap_or(0),
                }))
            },
        )
        .await
    }
}

/// The status for a rank's word not taken.
fn admit_status(e: admit::AdmitError) -> Status {
    use admit::AdmitError as E;
    let msg = e.to_string();
    match e {
        E::Invalid(_) | E::Register(RegisterError::Invalid(_)) => Status::invalid_argument(msg),
        E::NotItsProcess { .. } => Status::permission_denied(msg),
        E::ClientHolds { .. } | E::Register(RegisterError::Held { .. }) => {
            Status::already_exists(msg)
        }
        E::Register(RegisterError::LayoutMismatch { .. }) => Status::failed_precondition(msg),
        E::Register(
            RegisterError::Full(_)
            | RegisterError::PerProcess { .. }
            | RegisterError::PerUid { .. },
        ) => Status::resource_exhausted(msg),
        E::Register(RegisterError::Slot(_)) => Status::internal(msg),
        E::NotRegistered { .. } => Status::not_found(msg),
    }
}

/// Sends the backlog, then live events, until the watcher leaves or the
/// agent stops. A watcher too slow for the broadcast catches up from the ring.
async fn forward_events(
    state: Arc<AgentState>,
    sub: warden_core::events::Subscription,
    tx: mpsc::Sender<Result<pb::Event, Status>>,
) {
    use tokio::sync::broadcast::error::RecvError;
    let mut last = 0u64;
    let send = |e: &Arc<Event>| tx.send(Ok(convert::event(e)));
    for e in &sub.backlog {
        if send(e).await.is_err() {
            return;
        }
        last = e.id;
    }
    let mut live = sub.live;
    loop {
        let received = tokio::select! {
            () = state.shutdown.cancelled() => {
                // Events published before the shutdown (agent.stopping among
                // them) still reach the watcher; then the stream ends.
                while let Ok(e) = live.try_recv() {
                    if e.id > last && send(&e).await.is_err() {
                        return;
                    }
                }
                return;
            }
            () = tx.closed() => return,
            r = live.recv() => r,
        };
        match received {
            Ok(e) if e.id > last => {
                if send(&e).await.is_err() {
                    return;
                }
                last = e.id;
            }
            Ok(_) => {}
            Err(RecvError::Lagged(n)) => {
                tracing::debug!(
                    skipped = n,
                    "event watcher lagged; catching up from the ring"
                );
                let (missed, _) = state.events.list(last, 0);
                for e in &missed {
                    if send(e).await.is_err() {
                        return;
                    }
                    last = e.id;
                }
            }
            Err(RecvError::Closed) => return,
        }
    }
}

/// A server stream with its place under the stream caps: the place is
/// freed when the stream is dropped (the client cancelled or went away).
struct Held<T> {
    inner: BoxStream<T>,
    _permit: StreamPermit,
}

impl<T> Stream for Held<T> {
    type Item = Result<T, Status>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}
