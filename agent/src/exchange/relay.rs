//! A group leader's relay: a member's report passed on along the two-level
//! tree (`warden_core::detect::straggler::tree`), to the hosts before the
//! leader's group in order, within one `straggler.peer_timeout` in all; the
//! first answer is handed back. When every host before the group is down,
//! the report is aggregated here ([`super::aggregate::aggregate_here`]).
//! Used where `straggler.relay_batch_window` is 0, and for each report of a
//! batch an older aggregator would not take whole ([`super::batch`]).
//!
//! In: the member's report, on the wire (it is passed on as it came, marked
//! `relayed`) and decoded. Out: the answer, or [`RelayError`]. The edge
//! (`api::aggregate`) decodes, authorizes, and maps the error to a status.

use std::time::Duration;

use warden_proto::v1 as pb;

use super::Exchange;
use super::aggregate::aggregate_here;
use super::routes::{Hop, RELAY_FAILED, call};
use super::wire::answer_pb;

/// Why a relay brought no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayError {
    /// Aggregated here and refused: a limit passed (the error names it).
    Refused(String),
    /// No host answered: [`RELAY_FAILED`], with each host's failure. This
    /// leader is up, so its member keeps it as leader.
    NoneAnswered(String),
    /// The aggregator took the batch but refused this report alone: its
    /// status (a gRPC code) and message, handed back to the member as is.
    Aggregator {
        /// The gRPC status code.
        code: i32,
        /// The aggregator's message.
        message: String,
    },
}

/// A report as decoded: its straggler part, positions and values.
pub type Decoded = (
    warden_core::detect::straggler::aggregate::HostReport,
    Vec<warden_core::detect::positions::JobPositions>,
    Vec<warden_core::detect::sdc::aggregate::JobValues>,
);

/// Passes a member's report on along `plan`, within one
/// `straggler.peer_timeout` in all, and hands back the first answer; when
/// the plan reaches this agent (every host before its group is down), the
/// report is aggregated here. None answering: ABORTED, [`RELAY_FAILED`]
/// (this agent is up: the member keeps it as its leader).
pub async fn relay(
    ex: &Exchange,
    plan: Vec<Hop>,
    mut req: pb::AggregateReport,
    decoded: Decoded,
    limit: Duration,
) -> Result<pb::AggregateAnswer, RelayError> {
    req.relayed = true;
    let deadline = tokio::time::Instant::now() + limit;
    let routes = &ex.routes;
    let mut errors = Vec::new();
    for Hop { addr, client, .. } in plan {
        let Some(mut client) = client else {
            metrics::counter!("warden_straggler_relays_total", "result" => "here").increment(1);
            return here(ex, decoded);
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let err = match call(&mut client, req.clone(), left).await {
            Ok(answer) => {
                metrics::counter!("warden_straggler_relays_total", "result" => "ok").increment(1);
                routes.note_answered(&addr);
                return Ok(answer);
            }
            Err(e) => e.to_string(),
        };
        routes.note_failed(&addr, err.clone(), "this group leader");
        errors.push(format!("{addr}: {err}"));
        if tokio::time::Instant::now() >= deadline {
            break;
        }
    }
    metrics::counter!("warden_straggler_relays_total", "result" => "failed").increment(1);
    Err(RelayError::NoneAnswered(format!(
        "{RELAY_FAILED}: {}",
        errors.join("; ")
    )))
}

/// A relayed report aggregated at this leader itself (every host before
/// its group is down), and its answer.
pub fn here(
    ex: &Exchange,
    (report, positions, values): Decoded,
) -> Result<pb::AggregateAnswer, RelayError> {
    aggregate_here(ex, report, positions, values)
        .map(|h| answer_pb(&ex.host, &h))
        .map_err(RelayError::Refused)
}
