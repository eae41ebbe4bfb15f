//! The exchange's calls on the wire: `ReportToAggregator` and
//! `ReportBatchToAggregator` over tonic, the messages a leader and an
//! aggregator answer refusals with, and those refusals read back into the
//! exchange's [`CallFailed`].

use std::time::Duration;

use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;

use crate::exchange::link::CallFailed;

/// The start of the message a leader answers when it could not relay a
/// report (gRPC `ABORTED`): the leader itself is up, so the member does
/// not skip it.
pub const RELAY_FAILED: &str = "relay to the job's aggregator failed";

/// The start of the message a leader answers with when the aggregator took
/// its batch but refused the member's report alone (the aggregator's own
/// code follows, and its message): the leader is up and the aggregator
/// too, so the member skips neither, and tries no other host for it (the
/// same report would be refused there).
pub const AGGREGATOR_REFUSED: &str = "the job's aggregator refused this report";

/// The start of the message an agent refuses one report with for the
/// report's own sake (gRPC INVALID_ARGUMENT: a field it got wrong;
/// RESOURCE_EXHAUSTED: a limit it passed): the agent is up, and any other
/// would refuse the same report, so the caller does not skip it and tries
/// no other host for the report. Agents have answered so since before
/// batches.
pub const REPORT_REFUSED: &str = "aggregate report";

/// The message a report refused for its own sake is answered with:
/// [`REPORT_REFUSED`] and why.
pub fn report_refused(why: impl std::fmt::Display) -> String {
    format!("{REPORT_REFUSED}: {why}")
}

/// Why a call to an aggregator (or a leader) brought no answer, as tonic
/// gave it.
#[derive(Debug)]
pub enum RpcFailed {
    /// It answered with an error.
    Refused(tonic::Status),
    /// No answer within this long.
    Silent(Duration),
}

impl RpcFailed {
    /// A leader's answer that it is up but could not relay ([`RELAY_FAILED`]).
    fn relay_failed(&self) -> Option<&str> {
        match self {
            Self::Refused(s)
                if s.code() == tonic::Code::Aborted && s.message().starts_with(RELAY_FAILED) =>
            {
                Some(s.message())
            }
            _ => None,
        }
    }

    /// A leader's answer that the aggregator refused this report alone
    /// ([`AGGREGATOR_REFUSED`]).
    fn aggregator_refused(&self) -> Option<&str> {
        match self {
            Self::Refused(s) if s.message().starts_with(AGGREGATOR_REFUSED) => Some(s.message()),
            _ => None,
        }
    }

    /// An agent's answer that it refused this report for the report's own
    /// sake ([`REPORT_REFUSED`]): the status, as the agent answered it.
    pub fn report_refused(&self) -> Option<&tonic::Status> {
        match self {
            Self::Refused(s)
                if matches!(
                    s.code(),
                    tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted
                ) && s
                    .message()
                    .strip_prefix(REPORT_REFUSED)
                    .is_some_and(|rest| rest.starts_with(':')) =>
            {
                Some(s)
            }
            _ => None,
        }
    }
}

impl std::fmt::Display for RpcFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(s) => write!(f, "{}: {}", s.code(), s.message()),
            Self::Silent(d) => write!(f, "no answer within {}", humantime::format_duration(*d)),
        }
    }
}

/// Sends `report` through `client`, waiting at most `limit`: the one call
/// of the reporting task and of a leader's relay.
pub async fn call(
    client: &mut PeerClient<Channel>,
    report: pb::AggregateReport,
    limit: Duration,
) -> Result<pb::AggregateAnswer, RpcFailed> {
    timed(limit, client.report_to_aggregator(report)).await
}

/// Sends a group leader's `batch` of its members' reports through
/// `client`, waiting at most `limit`.
pub async fn call_batch(
    client: &mut PeerClient<Channel>,
    batch: pb::AggregateBatch,
    limit: Duration,
) -> Result<pb::AggregateBatchAnswer, RpcFailed> {
    timed(limit, client.report_batch_to_aggregator(batch)).await
}

/// A call's answer within `limit`, or why there was none.
async fn timed<T>(
    limit: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, RpcFailed> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        Ok(Err(s)) => Err(RpcFailed::Refused(s)),
        Err(_) => Err(RpcFailed::Silent(limit)),
    }
}

impl RpcFailed {
    /// The failure in the exchange's terms, read in the order the reporting
    /// task acts on: a leader that could not relay, a leader's word that
    /// the aggregator refused the report alone, a refusal for the report's
    /// own sake, then any other.
    pub fn to_call(&self) -> CallFailed {
        if let Some(why) = self.relay_failed() {
            return CallFailed::RelayFailed(why.to_owned());
        }
        if let Some(why) = self.aggregator_refused() {
            return CallFailed::AggregatorRefused(why.to_owned());
        }
        if let Some(s) = self.report_refused() {
            return CallFailed::ReportRefused(s.message().to_owned());
        }
        match self {
            Self::Refused(_) => CallFailed::Refused(self.to_string()),
            Self::Silent(d) => CallFailed::Silent(*d),
        }
    }
}
