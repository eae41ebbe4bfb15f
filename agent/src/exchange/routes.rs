//! Whom this agent reports a job's part to, and where it relays a report
//! it receives: the job's order (node rank order from the launchers'
//! round, or the static fleet's sorted addresses) cut into the two-level
//! tree of [`warden_core::detect::straggler::tree`], and what is known of
//! each host on the way (its client, whether it failed lately).
//!
//! Shared by the reporting task (`exchange::report`) and the relay at the
//! edge (`api::aggregate`), so that a leader which found the aggregator
//! down skips it for its members' reports too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};
use warden_core::detect::straggler::tree;
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;

use crate::ckpt::Checkpoints;
use crate::tls::PeerTls;
use crate::tls::connect::{PeerConnector, SeenNames};

/// At most this many hosts are tried for one report in one interval: the
/// ones after are tried in the next intervals, once these are known down.
pub const MAX_TRIES: usize = 8;

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

/// Why a call to an aggregator (or a leader) brought no answer.
#[derive(Debug)]
pub enum CallFailed {
    /// It answered with an error.
    Refused(tonic::Status),
    /// No answer within this long.
    Silent(Duration),
}

impl CallFailed {
    /// A leader's answer that it is up but could not relay ([`RELAY_FAILED`]).
    pub fn relay_failed(&self) -> Option<&str> {
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
    pub fn aggregator_refused(&self) -> Option<&str> {
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

impl std::fmt::Display for CallFailed {
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
) -> Result<pb::AggregateAnswer, CallFailed> {
    match tokio::time::timeout(limit, client.report_to_aggregator(report)).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        Ok(Err(s)) => Err(CallFailed::Refused(s)),
        Err(_) => Err(CallFailed::Silent(limit)),
    }
}

/// Sends a group leader's `batch` of its members' reports through
/// `client`, waiting at most `limit`.
pub async fn call_batch(
    client: &mut PeerClient<Channel>,
    batch: pb::AggregateBatch,
    limit: Duration,
) -> Result<pb::AggregateBatchAnswer, CallFailed> {
    match tokio::time::timeout(limit, client.report_batch_to_aggregator(batch)).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        Ok(Err(s)) => Err(CallFailed::Refused(s)),
        Err(_) => Err(CallFailed::Silent(limit)),
    }
}

/// One host to try, in order.
#[derive(Debug, Clone)]
pub struct Hop {
    /// Its `api.tcp` address.
    pub addr: String,
    /// None: this agent (aggregate in place).
    pub client: Option<PeerClient<Channel>>,
    /// It relays what it receives (a group leader): its answer may take
    /// two calls.
    pub relays: bool,
}

/// One host and what is known of it.
#[derive(Debug, Default)]
struct Link {
    client: Option<PeerClient<Channel>>,
    /// When it last failed, and the failure logged.
    down: Option<(Instant, String)>,
}

/// The routes of this agent's jobs and the links along them.
#[derive(Debug)]
pub struct Routes {
    /// This agent's own address (`api.tcp`).
    me: String,
    /// `straggler.peers` and `me`, sorted: the order of a job that no
    /// launcher handed over.
    statics: Vec<String>,
    /// `me`'s index in `statics`.
    statics_me: Option<usize>,
    fan_out: u32,
    links: Mutex<HashMap<String, Link>>,
    /// How a host is dialed and who its jobs' hosts are.
    dial: Dial,
}

/// What [`Routes`] needs to find a job's order and dial a host: the
/// checkpoint tier's peer set (the jobs' hosts, handed over by their
/// launchers, with their clients), and for a host dialed by address the
/// peer TLS, the names seen on such links and the call limit.
#[derive(Debug)]
pub struct Dial {
    /// The checkpoint tier, when it is on: its peer set.
    pub checkpoints: Option<Arc<Checkpoints>>,
    /// The agents' mutual TLS (or none).
    pub peer_tls: PeerTls,
    /// The certificate names of the hosts dialed by address.
    pub seen: Arc<SeenNames>,
    /// `straggler.peer_timeout`.
    pub peer_timeout: Duration,
}

impl Routes {
    /// The routes of an agent at `me` with `straggler.peers` = `peers`.
    pub fn new(me: &str, peers: &[String], fan_out: u32, dial: Dial) -> Self {
        if !peers.is_empty() && warden_core::config::unspecified_addr(me) {
            // The static order is every host's list sorted: this agent at
            // 0.0.0.0 sorts first here and elsewhere where its real address
            // does, so hosts disagree on the aggregator.
            tracing::warn!(
                api_tcp = me,
                "api.tcp is on an unspecified address while straggler.peers are configured: \
                 this agent takes itself for the first of the static fleet, the peers do not, \
                 so the fleet's hosts disagree on the job-wide aggregator; set api.tcp to the \
                 address the peers list"
            );
        }
        let mut statics = peers.to_vec();
        if !me.is_empty() {
            statics.push(me.to_owned());
        }
        statics.sort();
        statics.dedup();
        let statics_me = statics.iter().position(|a| a == me);
        Self {
            me: me.to_owned(),
            statics,
            statics_me,
            fan_out,
            links: Mutex::new(HashMap::new()),
            dial,
        }
    }

    /// `f` over `job`'s order and this agent's index in it: its hosts
    /// handed over by its launchers, or the static fleet's.
    fn with_order<T>(&self, job: &str, f: impl FnOnce(&[String], Option<usize>) -> T) -> T {
        match &self.dial.checkpoints {
            Some(ck) => ck.peers.with_order(job, |o, me| {
                if o.is_empty() {
                    f(&self.statics, self.statics_me)
                } else {
                    f(o, me)
                }
            }),
            None => f(&self.statics, self.statics_me),
        }
    }

    /// The hosts to try for `job`'s report now, in order (at most
    /// [`MAX_TRIES`], ending at this agent when it is reached): along the
    /// tree's route, those not known down (a host that failed is skipped
    /// for `skip_for`); when every one is down, the route as it is.
    pub fn plan(&self, job: &str, skip_for: Duration) -> Vec<Hop> {
        self.with_order(job, |order, me| {
            let k = tree::fan_out(order.len(), self.fan_out);
            let route = tree::route(order.len(), me, k);
            self.hops(order, route, skip_for, |i| tree::relays(i, k))
        })
    }

    /// Where a report received for `job` goes when this agent is a group
    /// leader: the hosts before its group in order, then this agent
    /// (aggregate in place). None: it aggregates (it is in group 0, or
    /// not in the job's order).
    pub fn relay_plan(&self, job: &str, skip_for: Duration) -> Option<Vec<Hop>> {
        self.with_order(job, |order, me| {
            let k = tree::fan_out(order.len(), self.fan_out);
            let route = tree::relay(order.len(), me, k)?;
            Some(self.hops(order, route, skip_for, |_| false))
        })
    }

    /// The hosts of `route` (indices into `order`) to try now.
    fn hops(
        &self,
        order: &[String],
        route: impl Iterator<Item = usize> + Clone,
        skip_for: Duration,
        relays: impl Fn(usize) -> bool,
    ) -> Vec<Hop> {
        let now = Instant::now();
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        let up = |a: &str| {
            links
                .get(a)
                .and_then(|l| l.down.as_ref())
                .is_none_or(|(at, _)| now.saturating_duration_since(*at) >= skip_for)
        };
        let mine = |a: &str| a == self.me || a.is_empty();
        // The first hosts not known down, up to this agent; when all are
        // down, the route as it is.
        let mut picked: Vec<usize> = Vec::new();
        for i in route.clone() {
            let a = order[i].as_str();
            if mine(a) || up(a) {
                picked.push(i);
                if mine(a) || picked.len() == MAX_TRIES {
                    break;
                }
            }
        }
        if picked.is_empty() {
            for i in route {
                picked.push(i);
                if mine(&order[i]) || picked.len() == MAX_TRIES {
                    break;
                }
            }
        }
        picked
            .into_iter()
            .map(|i| {
                let addr = &order[i];
                if mine(addr) {
                    return Hop {
                        addr: addr.clone(),
                        client: None,
                        relays: false,
                    };
                }
                let link = links.entry(addr.clone()).or_default();
                if link.client.is_none() {
                    link.client = self.dial.client_for(addr);
                }
                Hop {
                    addr: addr.clone(),
                    client: link.client.clone(),
                    relays: relays(i),
                }
            })
            .collect()
    }

    /// Records that `addr` failed with `err`; true when it had not (log
    /// once).
    pub fn failed(&self, addr: &str, err: String) -> bool {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        let link = links.entry(addr.to_owned()).or_default();
        let first = link.down.is_none();
        link.down = Some((Instant::now(), err));
        first
    }

    /// Records that `addr` answered; true when it had been down.
    pub fn answered(&self, addr: &str) -> bool {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.get_mut(addr).is_some_and(|l| l.down.take().is_some())
    }

    /// [`Self::failed`], with the first failure of a run logged; `from`
    /// says who called ("this host", "a group leader").
    pub fn note_failed(&self, addr: &str, err: String, from: &str) {
        if self.failed(addr, err.clone()) {
            tracing::warn!(
                aggregator = %addr,
                error = %err,
                from,
                "straggler aggregator unreachable; the next in order takes over (logged once)"
            );
        }
    }

    /// [`Self::answered`], with the return of a host that was down logged.
    pub fn note_answered(&self, addr: &str) {
        if self.answered(addr) {
            tracing::info!(aggregator = %addr, "straggler aggregator answers again");
        }
    }
}

impl Dial {
    /// A client for the host at `addr`: a job's peer's (handed over) or
    /// one dialed by address (its certificate's name is remembered, so that
    /// its own reports are taken).
    fn client_for(&self, addr: &str) -> Option<PeerClient<Channel>> {
        if let Some(ck) = &self.checkpoints
            && let Some(p) = ck.peers.find(addr)
            && let Some(client) = crate::peer_link::tonic_peer::client_of(&*p.link)
        {
            return Some(client);
        }
        let limit = self.peer_timeout;
        Endpoint::from_shared(format!("http://{addr}"))
            .map(|e| {
                PeerClient::new(
                    e.connect_timeout(limit)
                        .timeout(limit * 2)
                        .connect_with_connector_lazy(
                            PeerConnector::new(self.peer_tls.clone(), "")
                                .recording(self.seen.clone()),
                        ),
                )
            })
            .map_err(|e| tracing::warn!(peer = %addr, error = %e, "unusable aggregator address"))
            .ok()
    }
}
