//! The `warden.v1.Agent` service.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_server::Agent;

use super::convert;
use super::observe::observed;
use crate::events::Event;
use crate::state::AgentState;

/// A boxed server stream, as tonic wants it.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Implements warden.v1.Agent on top of the shared agent state.
#[derive(Debug, Clone)]
pub struct AgentService {
    state: Arc<AgentState>,
}

impl AgentService {
    /// A service answering from `state`.
    pub fn new(state: Arc<AgentState>) -> Self {
        Self { state }
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn get_node_health(
        &self,
        _req: Request<pb::GetNodeHealthRequest>,
    ) -> Result<Response<pb::NodeHealth>, Status> {
        observed("GetNodeHealth", async {
            let snap = self.state.health.snapshot();
            Ok(Response::new(convert::node_health(&self.state.host, &snap)))
        })
        .await
    }

    type WatchHealthStream = BoxStream<pb::NodeHealth>;

    async fn watch_health(
        &self,
        _req: Request<pb::WatchHealthRequest>,
    ) -> Result<Response<Self::WatchHealthStream>, Status> {
        observed("WatchHealth", async {
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
            Ok(Response::new(
                Box::pin(ReceiverStream::new(rx)) as Self::WatchHealthStream
            ))
        })
        .await
    }

    async fn list_events(
        &self,
        req: Request<pb::ListEventsRequest>,
    ) -> Result<Response<pb::ListEventsResponse>, Status> {
        observed("ListEvents", async {
            let req = req.into_inner();
            let limit = usize::try_from(req.limit).unwrap_or(usize::MAX);
            let (events, dropped) = self.state.events.list(req.after_id, limit);
            Ok(Response::new(pb::ListEventsResponse {
                events: events.iter().map(|e| convert::event(e)).collect(),
                oldest_retained_id: dropped,
            }))
        })
        .await
    }

    type WatchEventsStream = BoxStream<pb::Event>;

    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        observed("WatchEvents", async {
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
            Ok(Response::new(
                Box::pin(ReceiverStream::new(rx)) as Self::WatchEventsStream
            ))
        })
        .await
    }

    async fn get_agent_info(
        &self,
        _req: Request<pb::GetAgentInfoRequest>,
    ) -> Result<Response<pb::AgentInfo>, Status> {
        observed("GetAgentInfo", async {
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
            }))
        })
        .await
    }

    async fn register_rank(
        &self,
        _req: Request<pb::RegisterRankRequest>,
    ) -> Result<Response<pb::RegisterRankResponse>, Status> {
        observed("RegisterRank", async {
            Err(Status::unimplemented(
                "this wardend does not accept heartbeat registrations yet",
            ))
        })
        .await
    }

    async fn deregister_rank(
        &self,
        _req: Request<pb::DeregisterRankRequest>,
    ) -> Result<Response<pb::DeregisterRankResponse>, Status> {
        observed("DeregisterRank", async {
            Err(Status::unimplemented(
                "this wardend does not accept heartbeat registrations yet",
            ))
        })
        .await
    }

    async fn get_ranks(
        &self,
        _req: Request<pb::GetRanksRequest>,
    ) -> Result<Response<pb::GetRanksResponse>, Status> {
        observed("GetRanks", async {
            Ok(Response::new(pb::GetRanksResponse { ranks: Vec::new() }))
        })
        .await
    }
}

/// Sends the backlog, then live events, until the watcher leaves or the
/// agent stops. A watcher too slow for the broadcast catches up from the ring.
async fn forward_events(
    state: Arc<AgentState>,
    sub: crate::events::Subscription,
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
                tracing::debug!(skipped = n, "event watcher lagged; catching up from the ring");
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
