//! A group leader's relay: a member's report passed on along the two-level
//! tree (`warden_core::detect::straggler::tree`), to group 0's hosts in
//! order, within one `straggler.peer_timeout` in all; the
//! first answer is handed back. When every host of group 0 is down,
//! the report is aggregated here ([`crate::exchange::aggregate::aggregate_here`]).
//! Used where `straggler.relay_batch_window` is 0, and for each report of a
//! batch an older aggregator would not take whole ([`super::batch`]).
//!
//! In: the member's report, on the wire (it is passed on as it came, marked
//! `relayed`) and decoded. Out: the answer, or [`RelayError`]. The edge
//! (`api::aggregate`) decodes, authorizes, and maps the error to a status.

use std::time::Duration;

use warden_proto::v1 as pb;

use super::call::{RELAY_FAILED, call};
use super::tonic_aggregator::client_of;
use super::wire::answer_pb;
use crate::exchange::Exchange;
use crate::exchange::aggregate::aggregate_here;
use crate::exchange::routes::Hop;

/// Why a relay brought no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayError {
    /// Aggregated here and refused: a limit passed (the error names it).
    Refused(String),
    /// No host answered: [`RELAY_FAILED`], with each host's failure. This
    /// leader is up, so its member keeps it as leader.
    NoneAnswered(String),
    /// The aggregator refused this report alone (an item of a batch it
    /// took, or a relayed report it refused for the report's own sake,
    /// [`REPORT_REFUSED`](super::call::REPORT_REFUSED)): its status (a
    /// gRPC code) and message, handed back to the member as is.
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
/// the plan reaches this agent (every host of group 0 is down), the
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
    for Hop { addr, link, .. } in plan {
        let Some(mut client) = link.as_deref().and_then(client_of) else {
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
            Err(e) => {
                // The aggregator refused this report for its own sake: it
                // is up (nothing noted failed), and the next host would
                // refuse the same report.
                if let Some(s) = e.report_refused() {
                    metrics::counter!("warden_straggler_relays_total", "result" => "refused")
                        .increment(1);
                    return Err(RelayError::Aggregator {
                        code: s.code() as i32,
                        message: s.message().to_owned(),
                    });
                }
                e.to_string()
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use super::super::batch::tests::{Aggregating, down, exchange, hop, serve};
    use super::super::wire::report_from_pb;

    /// A member's report, as a leader decodes it.
    fn report(host: &str) -> (pb::AggregateReport, Decoded) {
        let req = pb::AggregateReport {
            host: host.into(),
            relative_threshold: 1.06,
            z_threshold: 4.0,
            ..Default::default()
        };
        let decoded = report_from_pb(req.clone()).unwrap();
        (req, decoded)
    }

    /// An aggregator that refuses a relayed report for the report's own
    /// sake (a limit): the leader hands its status back, notes no host
    /// failed, and tries no other host; another member's report is taken
    /// by the same aggregator.
    #[tokio::test]
    async fn a_report_refused_for_its_own_sake_skips_no_host() {
        let dir = tempfile::tempdir().unwrap();
        let ex = exchange(dir.path());
        let agg = Arc::new(Aggregating {
            refuse: "m1".into(),
            ..Default::default()
        });
        let next = Arc::new(Aggregating::default());
        let (agg_hop, next_hop) = (serve(agg.clone()).await, serve(next.clone()).await);
        let plan = vec![agg_hop.clone(), next_hop];
        let (req, decoded) = report("m1");
        let err = relay(&ex, plan.clone(), req, decoded, Duration::from_secs(5))
            .await
            .unwrap_err();
        let RelayError::Aggregator { code, message } = err else {
            panic!("{err:?}")
        };
        assert_eq!(code, tonic::Code::ResourceExhausted as i32);
        assert!(message.contains("already keeps 1024 jobs"), "{message}");
        assert_eq!(
            next.singles.load(Ordering::SeqCst),
            0,
            "no other host tried"
        );
        // Not noted failed: the first failure noted now is the first.
        assert!(ex.routes.failed(&agg_hop.addr, "probe".into()));
        ex.routes.answered(&agg_hop.addr);

        let (req, decoded) = report("m2");
        let answer = relay(&ex, plan, req, decoded, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(answer.host, "agg, for m2");
        assert_eq!(agg.singles.load(Ordering::SeqCst), 2);
    }

    /// A host that does not answer is still noted failed, and the next
    /// takes the report.
    #[tokio::test]
    async fn a_host_down_is_noted_failed_and_the_next_takes_the_report() {
        let dir = tempfile::tempdir().unwrap();
        let ex = exchange(dir.path());
        let next = Arc::new(Aggregating::default());
        let gone = down();
        let plan = vec![hop(&gone), serve(next.clone()).await];
        let (req, decoded) = report("m1");
        let answer = relay(&ex, plan, req, decoded, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(answer.host, "agg, for m1");
        assert!(
            !ex.routes.failed(&gone, "probe".into()),
            "noted failed before"
        );
    }
}
