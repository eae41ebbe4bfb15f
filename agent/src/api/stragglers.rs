//! The straggler detector at the edge: GetStragglers and the
//! ExchangeStragglerSummaries call of `warden.v1.Peer` (older agents'
//! summaries; the service itself is `api::peer_service`, the aggregator's
//! report `api::aggregate`). No task here calls every peer any more: the
//! last all-to-all (SDC values) went to the aggregator with issue 30.
//!
//! Why here: the detector (`detect::straggler`) knows nothing of tonic; this
//! module turns its scores and summaries into protobuf and back, bad input
//! into gRPC statuses, and owns the network calls to peers. A peer that is
//! down is logged once (and once more when it is back), retried every
//! `straggler.exchange_interval`, and never holds up anything else: each
//! call is bounded by `straggler.peer_timeout` and runs off the work loop.

use std::time::Instant;

use tonic::{Request, Response, Status};
use warden_proto::v1 as pb;

use super::peer_auth::Caller;
use crate::exchange::positions;
use crate::exchange::wire::{score_from_pb, score_pb};
use crate::state::AgentState;
use crate::tls::accept::PeerInfo;
use warden_core::detect::straggler::score::SectionMedian;
use warden_core::detect::straggler::{Batch, Stragglers, Summary, exchange};

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

/// Whether `caller` is a peer this agent knows by its certificate: one it
/// exchanged with, or a checkpoint peer.
pub(super) fn known_peer(state: &AgentState, caller: &Caller) -> bool {
    caller.identity().is_some_and(|id| {
        state.straggler_peers_seen.contains(id)
            || state
                .checkpoints
                .as_ref()
                .is_ok_and(|ck| ck.peers.knows(id))
    })
}

/// ExchangeStragglerSummaries: an older agent's summaries, positions and
/// values taken (checked, naming the field), answered with this agent's
/// (all of them to an older agent, its values alone to a newer one).
pub fn exchange(
    state: &AgentState,
    req: Request<pb::StragglerSummaries>,
) -> Result<Response<pb::StragglerSummaries>, Status> {
    if !state.config.straggler.enabled {
        return Err(Status::failed_precondition(format!(
            "straggler detection is off on {} (straggler.enabled = false)",
            state.host
        )));
    }
    let caller = Caller::of(req.extensions().get::<PeerInfo>());
    let mut req = req.into_inner();
    let legacy = !req.ranks.is_empty() || !req.positions.is_empty();
    let positions = std::mem::take(&mut req.positions);
    let values = std::mem::take(&mut req.values);
    let batch = batch_from_pb(req)
        .map_err(|e| Status::invalid_argument(format!("straggler summaries: {e}")))?;
    let positions = positions::from_pb(&batch.host, positions)
        .map_err(|e| Status::invalid_argument(format!("straggler summaries: {e}")))?;
    // An older agent's values are checked and not judged here: its
    // ranks are judged by it, and ours by the job's aggregator.
    positions::values_from_pb(values)
        .map_err(|e| Status::invalid_argument(format!("straggler summaries: {e}")))?;
    if batch.host == state.host {
        return Err(Status::failed_precondition(format!(
            "the summaries come from host {:?}, this agent's own name: give each agent \
             its own agent.host_name, and do not list an agent among its own peers",
            batch.host
        )));
    }
    super::peer_auth::straggler(&caller, &batch.host, known_peer(state, &caller))?;
    let det = state.stragglers();
    let host = batch.host.clone();
    det.merge_remote(batch, Instant::now());
    state.hang_board.merge_remote(&host, positions);
    // A newer agent sends values only and is answered alike; an
    // older one sends everything and still gets everything.
    if legacy {
        Ok(Response::new(outgoing(state, &det)))
    } else {
        Ok(Response::new(values_only(state, &det)))
    }
}

/// This agent's answer to an older agent's exchange: its summaries and
/// positions (an older agent still scores and judges from them).
fn outgoing(state: &AgentState, det: &Stragglers) -> pb::StragglerSummaries {
    let mut batch = batch_pb(&det.outbox(Instant::now()));
    batch.positions = positions::to_pb(&state.hang_board.outbox());
    if state.config.sdc.enabled {
        batch.values = positions::values_to_pb(&state.peer_values.legacy_outbox());
    }
    batch
}

/// The answer to an agent of the release before per-step aggregates, which
/// still sends its values to every peer: this agent's values, so it can
/// compare its ranks with ours (this agent no longer calls anyone for
/// values: they go to the job's aggregator, `exchange::report`).
fn values_only(state: &AgentState, det: &Stragglers) -> pb::StragglerSummaries {
    pb::StragglerSummaries {
        host: det.host().to_owned(),
        ranks: Vec::new(),
        positions: Vec::new(),
        values: if state.config.sdc.enabled {
            positions::values_to_pb(&state.peer_values.legacy_outbox())
        } else {
            Vec::new()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};
    use warden_core::detect::straggler::Score;

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
