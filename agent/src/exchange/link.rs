//! The exchange's one call to another host, in the exchange's own terms: a
//! host's report sent to an aggregator (or to a group leader that relays
//! it), and the job-wide answer. A port: [`AggregatorLink`] and
//! [`AggregatorDial`] are implemented by the transport
//! (`crate::peer_link::exchange`, over `warden.v1.Peer`), which imports this
//! stage and never the other way round.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use warden_core::detect::positions::JobPositions;
use warden_core::detect::sdc::aggregate::JobValues;
use warden_core::detect::straggler::aggregate::HostReport;

use super::aggregate::Here;
use crate::ckpt::Peer;

/// Why a report sent to a host brought no answer, as the reporting task
/// acts on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallFailed {
    /// A group leader that is up but could not relay: its message. The
    /// member keeps it as leader and tries no other host this interval.
    RelayFailed(String),
    /// A group leader's word that the aggregator refused this report alone:
    /// its message. Both are up; no other host would take the report.
    AggregatorRefused(String),
    /// The host refused the report for the report's own sake (a field it
    /// got wrong, a limit it passed): its message. It is up, and any other
    /// would refuse the same report.
    ReportRefused(String),
    /// Any other refusal, as the host worded it.
    Refused(String),
    /// It answered with something that makes no sense: what.
    BadAnswer(String),
    /// No answer within this long.
    Silent(Duration),
}

impl std::fmt::Display for CallFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RelayFailed(why)
            | Self::AggregatorRefused(why)
            | Self::ReportRefused(why)
            | Self::Refused(why) => f.write_str(why),
            Self::BadAnswer(why) => write!(f, "bad answer: {why}"),
            Self::Silent(d) => write!(f, "no answer within {}", humantime::format_duration(*d)),
        }
    }
}

/// One host's calls, as the transport carries them.
#[async_trait::async_trait]
pub trait AggregatorLink: Send + Sync + std::fmt::Debug {
    /// Sends this host's report (its straggler part, hang positions and
    /// SDC values) and waits at most `limit` for the job-wide answer.
    async fn report(
        &self,
        report: &HostReport,
        positions: &[JobPositions],
        values: &[JobValues],
        limit: Duration,
    ) -> Result<Here, CallFailed>;

    /// The transport's own handle, for the transport's relays to pass a
    /// member's report on as it came.
    fn as_any(&self) -> &dyn Any;
}

/// Makes the link to a host: through a job's checkpoint peer (sharing its
/// connection), or dialed by address. Connections are made lazily.
pub trait AggregatorDial: Send + Sync + std::fmt::Debug {
    /// The link through a job's peer, when its transport can share it.
    fn through(&self, peer: &Peer) -> Option<Arc<dyn AggregatorLink>>;

    /// The link to the host at `addr`; None (logged) when its address is
    /// unusable.
    fn by_addr(&self, addr: &str) -> Option<Arc<dyn AggregatorLink>>;
}
