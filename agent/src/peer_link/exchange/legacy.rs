//! An older agent's ExchangeStragglerSummaries (the all-to-all of the
//! releases before issue 30's aggregator): its summaries and hang positions
//! taken into this agent's detector and hang board, its values checked and
//! not judged here (its ranks are judged by it, ours by the job's
//! aggregator), and the answer an agent of its release expects.
//!
//! In: the message, decoded and checked here ([`decode`], the error names
//! the field), then authorized at the edge (`api::stragglers`). Out: the
//! answer ([`take`]). Never: a call to a peer.

use std::time::Instant;

use warden_core::detect::positions::JobPositions;
use warden_core::detect::straggler::score::SectionMedian;
use warden_core::detect::straggler::{Batch, Stragglers, Summary, exchange};
use warden_proto::v1 as pb;

use super::positions;
use super::wire::{score_from_pb, score_pb};
use crate::exchange::Exchange;

/// An older agent's message, checked.
#[derive(Debug)]
pub struct Taken {
    batch: Batch,
    positions: Vec<JobPositions>,
    /// It sent summaries or positions (an agent before per-step
    /// aggregates sends values only).
    legacy: bool,
}

impl Taken {
    /// The host it speaks for.
    pub fn host(&self) -> &str {
        &self.batch.host
    }
}

/// Checks an older agent's message; the error names the field.
pub fn decode(mut req: pb::StragglerSummaries) -> Result<Taken, String> {
    let legacy = !req.ranks.is_empty() || !req.positions.is_empty();
    let positions = std::mem::take(&mut req.positions);
    let values = std::mem::take(&mut req.values);
    let batch = batch_from_pb(req)?;
    let positions = positions::from_pb(&batch.host, positions)?;
    positions::values_from_pb(values)?;
    Ok(Taken {
        batch,
        positions,
        legacy,
    })
}

/// Takes an authorized message into the detector and the hang board, and
/// answers: a newer agent sends values only and is answered alike; an
/// older one sends everything and still gets everything.
pub fn take(ex: &Exchange, det: &Stragglers, t: Taken) -> pb::StragglerSummaries {
    let host = t.batch.host.clone();
    det.merge_remote(t.batch, Instant::now());
    ex.hang_board.merge_remote(&host, t.positions);
    if t.legacy {
        outgoing(ex, det)
    } else {
        values_only(ex, det)
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

/// This agent's answer to an older agent's exchange: its summaries and
/// positions (an older agent still scores and judges from them).
fn outgoing(ex: &Exchange, det: &Stragglers) -> pb::StragglerSummaries {
    let mut batch = batch_pb(&det.outbox(Instant::now()));
    batch.positions = positions::to_pb(&ex.hang_board.outbox());
    if ex.sdc_enabled {
        batch.values = positions::values_to_pb(&ex.peer_values.legacy_outbox());
    }
    batch
}

/// The answer to an agent of the release before per-step aggregates, which
/// still sends its values to every peer: this agent's values, so it can
/// compare its ranks with ours (this agent no longer calls anyone for
/// values: they go to the job's aggregator, `exchange::report`).
fn values_only(ex: &Exchange, det: &Stragglers) -> pb::StragglerSummaries {
    pb::StragglerSummaries {
        host: det.host().to_owned(),
        ranks: Vec::new(),
        positions: Vec::new(),
        values: if ex.sdc_enabled {
            positions::values_to_pb(&ex.peer_values.legacy_outbox())
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
