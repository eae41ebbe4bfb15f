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

use warden_core::detect::straggler::tree;

use super::link::{AggregatorDial, AggregatorLink};
use crate::ckpt::Checkpoints;
use crate::ckpt::order::Order;

/// At most this many hosts are tried for one report in one interval: the
/// ones after are tried in the next intervals, once these are known down.
pub const MAX_TRIES: usize = 8;

/// One host to try, in order.
#[derive(Debug, Clone)]
pub struct Hop {
    /// Its `api.tcp` address.
    pub addr: String,
    /// None: this agent (aggregate in place).
    pub link: Option<Arc<dyn AggregatorLink>>,
    /// It relays what it receives (a group leader): its answer may take
    /// two calls.
    pub relays: bool,
}

/// One host and what is known of it.
#[derive(Debug, Default)]
struct Link {
    link: Option<Arc<dyn AggregatorLink>>,
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
    statics: Order,
    /// `me`'s index in `statics`.
    statics_me: Option<usize>,
    fan_out: u32,
    links: Mutex<HashMap<String, Link>>,
    /// How a host is dialed and who its jobs' hosts are.
    dial: Dial,
}

/// What [`Routes`] needs to find a job's order and reach a host: the
/// checkpoint tier's peer set (the jobs' hosts, handed over by their
/// launchers, with their connections), and the transport's dialer for a
/// host reached through such a peer or by address.
#[derive(Debug)]
pub struct Dial {
    /// The checkpoint tier, when it is on: its peer set.
    pub checkpoints: Option<Arc<Checkpoints>>,
    /// The transport's dialer (`peer_link::exchange`).
    pub dial: Arc<dyn AggregatorDial>,
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
            statics: Order::whole(statics),
            statics_me,
            fan_out,
            links: Mutex::new(HashMap::new()),
            dial,
        }
    }

    /// `f` over `job`'s order and this agent's index in it: its hosts
    /// handed over by its launchers, or the static fleet's.
    fn with_order<T>(&self, job: &str, f: impl FnOnce(&Order, Option<usize>) -> T) -> T {
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
    /// leader: group 0's hosts in order, then this agent
    /// (aggregate in place). None: it aggregates (it is in group 0, or
    /// not in the job's order).
    pub fn relay_plan(&self, job: &str, skip_for: Duration) -> Option<Vec<Hop>> {
        self.with_order(job, |order, me| {
            let k = tree::fan_out(order.len(), self.fan_out);
            let route = tree::relay(order.len(), me, k)?;
            Some(self.hops(order, route, skip_for, |_| false))
        })
    }

    /// The hosts of `route` (places in `order`) to try now; a place not
    /// known here (a partial view) is passed over.
    fn hops(
        &self,
        order: &Order,
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
        let route = route.filter_map(|i| order.get(i).map(|a| (i, a)));
        let mut picked: Vec<(usize, &str)> = Vec::new();
        for (i, a) in route.clone() {
            if mine(a) || up(a) {
                picked.push((i, a));
                if mine(a) || picked.len() == MAX_TRIES {
                    break;
                }
            }
        }
        if picked.is_empty() {
            for (i, a) in route {
                picked.push((i, a));
                if mine(a) || picked.len() == MAX_TRIES {
                    break;
                }
            }
        }
        picked
            .into_iter()
            .map(|(i, addr)| {
                if mine(addr) {
                    return Hop {
                        addr: addr.to_owned(),
                        link: None,
                        relays: false,
                    };
                }
                let known = links.entry(addr.to_owned()).or_default();
                if known.link.is_none() {
                    known.link = self.dial.link_for(addr);
                }
                Hop {
                    addr: addr.to_owned(),
                    link: known.link.clone(),
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
    /// The link to the host at `addr`: through a job's peer (handed over),
    /// or dialed by address (its certificate's name is remembered, so that
    /// its own reports are taken).
    fn link_for(&self, addr: &str) -> Option<Arc<dyn AggregatorLink>> {
        if let Some(ck) = &self.checkpoints
            && let Some(p) = ck.peers.find(addr)
            && let Some(link) = self.dial.through(&p)
        {
            return Some(link);
        }
        self.dial.by_addr(addr)
    }
}
