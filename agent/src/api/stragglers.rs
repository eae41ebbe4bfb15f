//! The straggler detector at the edge: GetStragglers, the `warden.v1.Peer`
//! service that takes peers' summaries, and the task that sends ours.
//!
//! Why here: the detector (`detect::straggler`) knows nothing of tonic; this
//! module turns its scores and summaries into protobuf and back, bad input
//! into gRPC statuses, and owns the network calls to peers. A peer that is
//! down is logged once (and once more when it is back), retried every
//! `straggler.exchange_interval`, and never holds up anything else: each
//! call is bounded by `straggler.peer_timeout` and runs off the work loop.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;
use warden_proto::v1::peer_server::Peer;

use super::convert;
use super::observe::observed;
use super::peer_auth::Caller;
use crate::state::AgentState;
use crate::tls::accept::PeerInfo;
use crate::tls::connect::PeerConnector;
use warden_core::detect::straggler::score::SectionMedian;
use warden_core::detect::straggler::{Batch, Score, Stragglers, Summary, exchange};

/// Answers GetStragglers from the agent's straggler scores: its own ranks'
/// and its peers', job-wide.
pub fn get_stragglers(
    state: &AgentState,
    req: pb::GetStragglersRequest,
) -> pb::GetStragglersResponse {
    let Some(det) = state.stragglers_if_made() else {
        return pb::GetStragglersResponse {
            ranks: Vec::new(),
            hosts: vec![state.host.clone()],
        };
    };
    let (scores, hosts) = det.scores(&req.job_id, req.flagged_only, Instant::now());
    pb::GetStragglersResponse {
        ranks: scores.iter().map(score_pb).collect(),
        hosts,
    }
}

fn opt_time(t: Option<SystemTime>) -> Option<prost_types::Timestamp> {
    t.map(convert::timestamp)
}

fn from_time(t: Option<&prost_types::Timestamp>) -> Option<SystemTime> {
    let t = t?;
    let secs = u64::try_from(t.seconds).ok()?;
    let nanos = u32::try_from(t.nanos).ok().filter(|n| *n < 1_000_000_000)?;
    UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

/// A score as the API shows it.
pub fn score_pb(s: &Score) -> pb::StragglerScore {
    pb::StragglerScore {
        job_id: s.job.clone(),
        global_rank: s.rank,
        host: s.host.clone(),
        section: s.section.clone(),
        relative: s.relative,
        individual: s.individual,
        flagged: s.flagged,
        consecutive: s.consecutive,
        flagged_since: opt_time(s.flagged_since),
        explanation: s.explanation.clone(),
        samples: s.samples,
        robust_z: s.robust_z,
        cause_class: s.cause_class.clone(),
        devices: s.devices.clone(),
        rank_median_ns: s.rank_median_ns,
        job_median_ns: s.job_median_ns,
        ranks_compared: s.ranks_compared,
        scored_at: opt_time(s.scored_at),
    }
}

/// A score from the wire (checked by the caller).
pub fn score_from_pb(p: &pb::StragglerScore) -> Score {
    Score {
        job: p.job_id.clone(),
        rank: p.global_rank,
        host: p.host.clone(),
        section: p.section.clone(),
        relative: p.relative,
        individual: p.individual,
        robust_z: p.robust_z,
        flagged: p.flagged,
        consecutive: p.consecutive,
        flagged_since: from_time(p.flagged_since.as_ref()),
        explanation: p.explanation.clone(),
        cause_class: p.cause_class.clone(),
        samples: p.samples,
        devices: p.devices.clone(),
        rank_median_ns: p.rank_median_ns,
        job_median_ns: p.job_median_ns,
        ranks_compared: p.ranks_compared,
        scored_at: from_time(p.scored_at.as_ref()),
    }
}

/// A batch of summaries on the wire.
pub fn batch_pb(b: &Batch) -> pb::StragglerSummaries {
    pb::StragglerSummaries {
        host: b.host.clone(),
        ranks: b
            .ranks
            .iter()
            .map(|r| pb::RankSummary {
                job_id: r.job.clone(),
                global_rank: r.rank,
                sections: r
                    .sections
                    .iter()
                    .map(|s| pb::SectionMedian {
                        section: s.section.clone(),
                        median_ns: s.median_ns,
                        samples: s.samples,
                    })
                    .collect(),
                window_seq: r.window_seq,
                score: r.score.as_ref().map(score_pb),
            })
            .collect(),
        positions: Vec::new(),
        values: Vec::new(),
    }
}

/// A batch received from a peer, checked; the error names the field.
pub fn batch_from_pb(p: pb::StragglerSummaries) -> Result<Batch, String> {
    if p.ranks.len() > exchange::MAX_BATCH_RANKS {
        return Err(format!(
            "{} ranks in one batch; at most {}",
            p.ranks.len(),
            exchange::MAX_BATCH_RANKS
        ));
    }
    let batch = Batch {
        host: p.host,
        ranks: p
            .ranks
            .into_iter()
            .map(|r| Summary {
                job: r.job_id,
                rank: r.global_rank,
                sections: r
                    .sections
                    .into_iter()
                    .map(|s| SectionMedian {
                        section: s.section,
                        median_ns: s.median_ns,
                        samples: s.samples,
                    })
                    .collect(),
                window_seq: r.window_seq,
                score: r.score.as_ref().map(score_from_pb),
            })
            .collect(),
    };
    exchange::validate(&batch)?;
    Ok(batch)
}

/// `warden.v1.Peer`: takes a peer's summaries, answers with ours.
#[derive(Debug, Clone)]
pub struct PeerService {
    state: Arc<AgentState>,
}

impl PeerService {
    /// A service answering from `state`'s straggler detector.
    pub fn new(state: Arc<AgentState>) -> Self {
        Self { state }
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn exchange_straggler_summaries(
        &self,
        req: Request<pb::StragglerSummaries>,
    ) -> Result<Response<pb::StragglerSummaries>, Status> {
        observed("ExchangeStragglerSummaries", async {
            if !self.state.config.straggler.enabled {
                return Err(Status::failed_precondition(format!(
                    "straggler detection is off on {} (straggler.enabled = false)",
                    self.state.host
                )));
            }
            let caller = Caller::of(req.extensions().get::<PeerInfo>());
            let mut req = req.into_inner();
            let legacy = !req.ranks.is_empty() || !req.positions.is_empty();
            let positions = std::mem::take(&mut req.positions);
            let values = std::mem::take(&mut req.values);
            let batch = batch_from_pb(req)
                .map_err(|e| Status::invalid_argument(format!("straggler summaries: {e}")))?;
            let positions = super::positions::from_pb(&batch.host, positions)
                .map_err(|e| Status::invalid_argument(format!("straggler summaries: {e}")))?;
            let values = super::positions::values_from_pb(values)
                .map_err(|e| Status::invalid_argument(format!("straggler summaries: {e}")))?;
            if batch.host == self.state.host {
                return Err(Status::failed_precondition(format!(
                    "the summaries come from host {:?}, this agent's own name: give each agent \
                     its own agent.host_name, and do not list an agent among its own peers",
                    batch.host
                )));
            }
            let known = caller.identity().is_some_and(|id| {
                self.state.straggler_peers_seen.contains(id)
                    || self
                        .state
                        .checkpoints
                        .as_ref()
                        .is_ok_and(|ck| ck.peers.knows(id))
            });
            super::peer_auth::straggler(&caller, &batch.host, known)?;
            let det = self.state.stragglers();
            let host = batch.host.clone();
            det.merge_remote(batch, Instant::now());
            self.state.hang_board.merge_remote(&host, positions);
            self.state.peer_values.receive(values);
            // A newer agent sends values only and is answered alike; an
            // older one sends everything and still gets everything.
            if legacy {
                Ok(Response::new(outgoing(&self.state, &det)))
            } else {
                Ok(Response::new(values_only(&self.state, &det)))
            }
        })
        .await
    }

    async fn report_to_aggregator(
        &self,
        req: Request<pb::AggregateReport>,
    ) -> Result<Response<pb::AggregateAnswer>, Status> {
        observed("ReportToAggregator", async {
            let info = req.extensions().get::<PeerInfo>();
            let caller = Caller::of(info);
            let remote = info.and_then(|i| i.remote);
            super::aggregate::report_to_aggregator(&self.state, &caller, remote, req.into_inner())
                .map(Response::new)
        })
        .await
    }

    async fn push_shard(
        &self,
        req: Request<tonic::Streaming<pb::ShardChunk>>,
    ) -> Result<Response<pb::PushShardResponse>, Status> {
        observed("PushShard", async {
            let caller = Caller::of(req.extensions().get::<PeerInfo>());
            super::ckpt::push_shard(&self.state, &caller, req.into_inner())
                .await
                .map(Response::new)
        })
        .await
    }

    type FetchShardStream = tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, Status>>;

    async fn fetch_shard(
        &self,
        req: Request<pb::FetchShardRequest>,
    ) -> Result<Response<Self::FetchShardStream>, Status> {
        observed("FetchShard", async {
            let caller = Caller::of(req.extensions().get::<PeerInfo>());
            super::ckpt::fetch_shard(&self.state, &caller, req.into_inner())
                .await
                .map(Response::new)
        })
        .await
    }

    async fn list_shards(
        &self,
        req: Request<pb::ListShardsRequest>,
    ) -> Result<Response<pb::ListShardsResponse>, Status> {
        observed("ListShards", async {
            let caller = Caller::of(req.extensions().get::<PeerInfo>());
            super::ckpt::list_shards(&self.state, &caller, req.into_inner())
                .await
                .map(Response::new)
        })
        .await
    }
}

/// This agent's answer to an older agent's exchange: its summaries and
/// positions (an older agent still scores and judges from them).
fn outgoing(state: &AgentState, det: &Stragglers) -> pb::StragglerSummaries {
    let mut batch = batch_pb(&det.outbox(Instant::now()));
    batch.positions = super::positions::to_pb(&state.hang_board.outbox());
    if state.config.sdc.enabled {
        batch.values = super::positions::values_to_pb(&state.peer_values.outbox());
    }
    batch
}

/// What this agent still sends every configured peer: only its ranks'
/// reported values, for SDC (summaries and positions go to the
/// aggregator, `api::aggregate`). Empty when no rank reports values.
fn values_only(state: &AgentState, det: &Stragglers) -> pb::StragglerSummaries {
    pb::StragglerSummaries {
        host: det.host().to_owned(),
        ranks: Vec::new(),
        positions: Vec::new(),
        values: if state.config.sdc.enabled {
            super::positions::values_to_pb(&state.peer_values.outbox())
        } else {
            Vec::new()
        },
    }
}

/// One configured peer and what was last said about it in the log.
#[derive(Debug)]
struct PeerLink {
    addr: String,
    client: Option<PeerClient<Channel>>,
    /// The last failure logged, until a call succeeds again.
    down: Option<String>,
}

/// Starts the task that exchanges summaries with `straggler.peers` every
/// `straggler.exchange_interval`, until the agent shuts down.
pub fn spawn_exchange(state: Arc<AgentState>, det: Arc<Stragglers>) {
    tokio::spawn(exchange_loop(state, det));
}

async fn exchange_loop(state: Arc<AgentState>, det: Arc<Stragglers>) {
    let cfg = det.config().clone();
    let mut peers: Vec<PeerLink> = cfg
        .peers
        .iter()
        .map(|addr| PeerLink {
            addr: addr.clone(),
            // Dialed by address: the peer's certificate must be of the
            // cluster CA, and the name it proves is remembered so that
            // its own exchanges are taken (`peer_auth`).
            client: Endpoint::from_shared(format!("http://{addr}"))
                .map(|e| {
                    PeerClient::new(
                        e.connect_timeout(cfg.peer_timeout)
                            .timeout(cfg.peer_timeout)
                            .connect_with_connector_lazy(
                                PeerConnector::new(state.peer_tls.clone(), "")
                                    .recording(state.straggler_peers_seen.clone()),
                            ),
                    )
                })
                .map_err(
                    |e| tracing::warn!(peer = %addr, error = %e, "unusable straggler peer address"),
                )
                .ok(),
            down: None,
        })
        .collect();
    let mut ticker = tokio::time::interval(cfg.exchange_interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticker.tick() => {}
            // A hang snapshot to send now (ranks::verdict).
        }
        let batch = values_only(&state, &det);
        if batch.values.is_empty() {
            continue;
        }
        let configured = peers.len();
        let mut calls = JoinSet::new();
        for (i, p) in peers.iter().enumerate() {
            let Some(mut client) = p.client.clone() else {
                continue;
            };
            let batch = batch.clone();
            let limit = cfg.peer_timeout;
            calls.spawn(async move {
                let r =
                    tokio::time::timeout(limit, client.exchange_straggler_summaries(batch)).await;
                let r = match r {
                    Err(_) => Err(format!(
                        "no answer within {}",
                        humantime::format_duration(limit)
                    )),
                    Ok(Err(s)) => Err(format!("{}: {}", s.code(), s.message())),
                    Ok(Ok(resp)) => {
                        let mut resp = resp.into_inner();
                        let positions = std::mem::take(&mut resp.positions);
                        let values = std::mem::take(&mut resp.values);
                        batch_from_pb(resp)
                            .and_then(|b| {
                                let p = super::positions::from_pb(&b.host, positions)?;
                                let v = super::positions::values_from_pb(values)?;
                                Ok((b, p, v))
                            })
                            .map_err(|e| format!("bad answer: {e}"))
                    }
                };
                (i, r)
            });
        }
        let stop = state.shutdown.clone();
        loop {
            let joined = tokio::select! {
                () = stop.cancelled() => return,
                j = calls.join_next() => j,
            };
            let Some(joined) = joined else {
                // The job peers were for this round only.
                peers.truncate(configured);
                break;
            };
            let Ok((i, result)) = joined else { continue };
            let Some(p) = peers.get_mut(i) else { continue };
            match result {
                Ok((b, positions, values)) => {
                    metrics::counter!("warden_straggler_exchanges_total", "result" => "ok")
                        .increment(1);
                    if p.down.take().is_some() {
                        tracing::info!(peer = %p.addr, host = %b.host, "straggler peer answers again");
                    }
                    if b.host == det.host() {
                        continue;
                    }
                    state.hang_board.merge_remote(&b.host, positions);
                    state.peer_values.receive(values);
                    det.merge_remote(b, Instant::now());
                }
                Err(e) => {
                    metrics::counter!("warden_straggler_exchanges_total", "result" => "error")
                        .increment(1);
                    if i >= configured {
                        // A hung job's peer, asked for this round only.
                        tracing::info!(peer = %p.addr, error = %e, "a hung job's peer agent did not take its positions");
                    } else if p.down.is_none() {
                        tracing::warn!(
                            peer = %p.addr,
                            error = %e,
                            "straggler peer unreachable; retrying every {} (logged once)",
                            humantime::format_duration(cfg.exchange_interval)
                        );
                    } else {
                        tracing::debug!(peer = %p.addr, error = %e, "straggler peer still unreachable");
                    }
                    p.down = Some(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_survive_the_wire_and_bad_ones_are_refused() {
        let b = Batch {
            host: "h".into(),
            ranks: vec![Summary {
                job: "j".into(),
                rank: 3,
                sections: vec![SectionMedian {
                    section: "forward".into(),
                    median_ns: 1e7,
                    samples: 12,
                }],
                window_seq: 4,
                score: Some(Score {
                    job: "j".into(),
                    rank: 3,
                    host: "h".into(),
                    section: "forward".into(),
                    relative: 1.2,
                    flagged: true,
                    flagged_since: Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
                    ..Score::default()
                }),
            }],
        };
        assert_eq!(batch_from_pb(batch_pb(&b)).unwrap(), b);
        let mut bad = batch_pb(&b);
        bad.ranks[0].job_id.clear();
        assert!(batch_from_pb(bad).unwrap_err().contains("ranks[0].job_id"));
    }
}
