//! Quotas on the connections a caller can hold, and accept loops that
//! survive running out of descriptors.
//!
//! In: each connection a listener accepts (the Unix socket, `metrics.listen`,
//! `api.tcp`), with who it is from: a uid (SO_PEERCRED) or a source IP.
//! Out: a [`Ticket`] the connection holds for its life, or a refusal (the
//! connection is closed at once, counted in
//! `warden_api_connections_refused_total`, and logged at most once per
//! [`LOG_EVERY`]). Never: let one uid or one source address hold more than
//! its share, let all callers together take the descriptors the agent
//! needs for itself (its journals, `/proc`, slot memory, pidfds), or log
//! once per failed accept.
//!
//! Why (issue 29): 1,100 idle connections to the metrics port or the Unix
//! socket exhausted the agent's descriptors; every accept then failed at
//! once, was retried at once and warned once, which cut the API off for
//! 12-30 s, turned `host/memory` UNKNOWN (it could not open
//! `/proc/meminfo`) and logged gigabytes.
//!
//! The total is one budget over every listener ([`FdBudget`]), computed
//! from the agent's `RLIMIT_NOFILE`: the limit less a reserve for the
//! agent's own files, and at most `api.max_connections`. Admins (root, the
//! agent's uid, `api.admin_group`) are exempt from the per-uid cap, and the
//! last [`ADMIN_RESERVE`] places of the budget are theirs alone, so an
//! operator can always reach the agent, even while other users flood it.

use std::collections::HashMap;
use std::hash::Hash;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Shortest gap between two log lines of one [`RateLimitedLog`].
pub const LOG_EVERY: Duration = Duration::from_secs(10);
/// Descriptors kept for the agent itself besides two per rank slot (its
/// memfd and the rank's pidfd): journals, state files, `/proc` reads, the
/// source threads' files, the slot socket's connections in flight.
pub const FD_RESERVE_FIXED: u64 = 256;
/// Places of the connection budget only admins may take.
pub const ADMIN_RESERVE: usize = 32;
/// The first pause after an accept failed for want of resources; doubled
/// at each failure in a row up to [`ACCEPT_BACKOFF_MAX`].
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest pause between accepts while descriptors are short.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// A warning that repeats (an accept error, a refusal): logged at most
/// once per [`LOG_EVERY`], with how many were left out since.
#[derive(Debug)]
pub struct RateLimitedLog {
    what: &'static str,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimitedLog {
    /// A limiter for warnings about `what` (a listener, say).
    pub const fn new(what: &'static str) -> Self {
        Self {
            what,
            state: Mutex::new((None, 0)),
        }
    }

    /// Logs `msg` unless a line went out less than [`LOG_EVERY`] ago; then
    /// it is only counted, and the next line says how many were left out.
    pub fn warn(&self, msg: &str) {
        let now = Instant::now();
        let suppressed = {
            let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if s.0.is_some_and(|at| now.duration_since(at) < LOG_EVERY) {
                s.1 += 1;
                return;
            }
            let n = s.1;
            *s = (Some(now), 0);
            n
        };
        tracing::warn!(
            listener = self.what,
            suppressed_since_last = suppressed,
            "{msg}"
        );
    }
}

/// What an accept failure calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptFailure {
    /// The client went before it was accepted: nothing to do.
    Client,
    /// The agent is out of a resource (descriptors, buffers, memory): pause
    /// before the next accept, or the loop spins on the same error.
    Resources,
    /// Anything else: pause briefly too.
    Other,
}

/// Classifies an accept error by its errno, for [`Acceptor::failed`].
pub fn classify(e: &io::Error) -> AcceptFailure {
    match e.raw_os_error() {
        Some(libc::ECONNABORTED | libc::EPROTO | libc::EPERM | libc::EINTR | libc::EAGAIN) => {
            AcceptFailure::Client
        }
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
            AcceptFailure::Resources
        }
        _ => AcceptFailure::Other,
    }
}

/// The error handling of one accept loop: a rate-limited warning naming
/// the real cause (`EMFILE`: the agent's descriptor limit), and a pause
/// that grows while failures go on.
#[derive(Debug)]
pub struct Acceptor {
    log: RateLimitedLog,
    backoff: Duration,
}

impl Acceptor {
    /// The accept loop of `listener` (a name for logs and metrics).
    pub const fn new(listener: &'static str) -> Self {
        Self {
            log: RateLimitedLog::new(listener),
            backoff: ACCEPT_BACKOFF_MIN,
        }
    }

    /// A connection was accepted: failures no longer run.
    pub fn succeeded(&mut self) {
        self.backoff = ACCEPT_BACKOFF_MIN;
    }

    /// An accept failed with `e`: counted, logged (rate-limited, with the
    /// errno and what it means), then paused as the cause calls for.
    pub async fn failed(&mut self, e: &io::Error) {
        let kind = classify(e);
        let cause = match e.raw_os_error() {
            Some(libc::EMFILE) => {
                "the agent reached its open-file limit (EMFILE, RLIMIT_NOFILE); connections wait in the backlog"
            }
            Some(libc::ENFILE) => "the system-wide open-file table is full (ENFILE)",
            Some(libc::ENOBUFS | libc::ENOMEM) => "out of kernel memory for sockets",
            _ => "",
        };
        metrics::counter!("warden_api_accept_errors_total", "listener" => self.log.what, "errno" => errno_name(e)).increment(1);
        if kind == AcceptFailure::Client {
            return;
        }
        self.log.warn(&format!("accept failed: {e} {cause}"));
        let pause = if kind == AcceptFailure::Resources {
            let p = self.backoff;
            self.backoff = (self.backoff * 2).min(ACCEPT_BACKOFF_MAX);
            p
        } else {
            ACCEPT_BACKOFF_MIN
        };
        tokio::time::sleep(pause).await;
    }
}

fn errno_name(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EMFILE) => "EMFILE",
        Some(libc::ENFILE) => "ENFILE",
        Some(libc::ENOBUFS) => "ENOBUFS",
        Some(libc::ENOMEM) => "ENOMEM",
        Some(libc::ECONNABORTED) => "ECONNABORTED",
        Some(libc::EPROTO) => "EPROTO",
        Some(libc::EPERM) => "EPERM",
        Some(libc::EINTR) => "EINTR",
        Some(libc::EAGAIN) => "EAGAIN",
        _ => "other",
    }
}

/// The agent's descriptor limit (`RLIMIT_NOFILE`), raised first from its
/// soft value to the hard one (as systemd leaves a service at 1024 soft):
/// the number the connection budget is computed from.
pub fn nofile_limit() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct passed, which lives here.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return 1024;
    }
    if l.rlim_cur < l.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: l.rlim_max,
            rlim_max: l.rlim_max,
        };
        // SAFETY: setrlimit reads only the struct passed; raising the soft
        // limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            l.rlim_cur = l.rlim_max;
        }
    }
    l.rlim_cur
}

/// How many connections the agent takes in all: `nofile` less the
/// descriptors it keeps for itself (a fixed reserve and two per rank
/// slot), at most `configured` (`api.max_connections`), and at least a
/// quarter of `nofile` so a tiny limit still serves someone.
pub fn connection_cap(nofile: u64, max_ranks: u32, configured: u32) -> usize {
    let reserve = FD_RESERVE_FIXED + 2 * u64::from(max_ranks);
    let from_fds = nofile.saturating_sub(reserve).max(nofile / 4);
    usize::try_from(from_fds.min(u64::from(configured))).unwrap_or(usize::MAX)
}

/// The connections open over every listener, against the cap
/// [`connection_cap`] computed.
#[derive(Debug)]
pub struct FdBudget {
    cap: usize,
    admin_reserve: usize,
    open: AtomicUsize,
}

impl FdBudget {
    /// A budget of `cap` connections, the last [`ADMIN_RESERVE`] (or an
    /// eighth of `cap`, if fewer) for admins.
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            admin_reserve: ADMIN_RESERVE.min(cap / 8),
            open: AtomicUsize::new(0),
        })
    }

    /// A budget with no cap: for counts that only have per-caller caps.
    pub fn unbounded() -> Arc<Self> {
        Arc::new(Self {
            cap: usize::MAX,
            admin_reserve: 0,
            open: AtomicUsize::new(0),
        })
    }

    /// The cap.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// How many connections a caller who is not an admin may hold: the cap
    /// less the admins' reserve (at least one).
    pub fn stranger_cap(&self) -> usize {
        self.cap.saturating_sub(self.admin_reserve).max(1)
    }

    /// Connections open now, over every listener.
    pub fn open_now(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Takes a place: non-admins only below `cap - ADMIN_RESERVE`.
    fn take(&self, admin: bool) -> Result<(), usize> {
        let limit = if admin { self.cap } else { self.stranger_cap() };
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| limit)
    }

    fn give(&self) {
        let _ = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            });
    }
}

/// The connection quotas of every listener, from the config and the
/// agent's descriptor limit.
#[derive(Debug, Clone)]
pub struct Quotas {
    /// The budget over every listener.
    pub budget: Arc<FdBudget>,
    /// The Unix socket, per uid (`api.max_connections_per_uid`).
    pub unix: Arc<ConnLimits<u32>>,
    /// `metrics.listen`, per source address
    /// (`metrics.max_connections_per_source`).
    pub metrics: Arc<ConnLimits<std::net::IpAddr>>,
    /// `api.tcp` connections, in the budget only.
    pub tcp: Arc<ConnLimits<std::net::IpAddr>>,
    /// `api.tcp` handshakes in progress, per source address
    /// (`api.max_handshakes_per_source`).
    pub handshakes: Arc<ConnLimits<std::net::IpAddr>>,
    /// Requests and streams open per uid on the Unix sockets
    /// (`api.max_requests_per_uid`).
    pub requests: Arc<super::conn_watch::RequestLimiter>,
}

/// The keys the quotas are made from (`config::Config::quotas` reads them
/// from the agent's configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaSettings {
    /// `ranks.max_ranks`: descriptors kept for the ranks' slots and pidfds.
    pub max_ranks: u32,
    /// `api.max_connections`.
    pub max_connections: u32,
    /// `api.max_connections_per_uid`.
    pub max_connections_per_uid: u32,
    /// `metrics.max_connections_per_source`.
    pub max_connections_per_source: u32,
    /// `api.max_handshakes_per_source`.
    pub max_handshakes_per_source: u32,
    /// `api.max_requests_per_uid`.
    pub max_requests_per_uid: u32,
}

impl Quotas {
    /// The quotas `config` asks for within `nofile` descriptors.
    pub fn new(config: QuotaSettings, nofile: u64) -> Self {
        let cap = connection_cap(nofile, config.max_ranks, config.max_connections);
        let budget = FdBudget::new(cap);
        Self {
            unix: ConnLimits::new(
                "api.socket",
                "api.max_connections_per_uid",
                config.max_connections_per_uid,
                budget.clone(),
            ),
            metrics: ConnLimits::new(
                "metrics.listen",
                "metrics.max_connections_per_source",
                config.max_connections_per_source,
                budget.clone(),
            ),
            tcp: ConnLimits::new("api.tcp", "api.max_connections", u32::MAX, budget.clone()),
            handshakes: ConnLimits::new(
                "api.tcp handshakes",
                "api.max_handshakes_per_source",
                config.max_handshakes_per_source,
                FdBudget::unbounded(),
            ),
            requests: super::conn_watch::RequestLimiter::new(config.max_requests_per_uid),
            budget,
        }
    }
}

/// Why a connection was refused, naming the key that bounds it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The caller already holds its share.
    #[error(
        "{who} already holds {held} connections to {listener}, the most one may ({key} = {max})"
    )]
    PerCaller {
        /// The listener.
        listener: &'static str,
        /// The caller (a uid, a source address).
        who: String,
        /// Connections it holds.
        held: usize,
        /// The config key of the cap.
        key: &'static str,
        /// The cap.
        max: usize,
    },
    /// The agent holds as many connections as its descriptors allow.
    #[error(
        "the agent holds {limit} connections, the most it takes (api.max_connections, less a reserve of descriptors for itself and places kept for admins)"
    )]
    Total {
        /// The limit that applied.
        limit: usize,
    },
}

/// One listener's per-caller counts, over the shared [`FdBudget`].
#[derive(Debug)]
pub struct ConnLimits<K> {
    listener: &'static str,
    key: &'static str,
    per_caller: usize,
    budget: Arc<FdBudget>,
    counts: Mutex<HashMap<K, usize>>,
    log: RateLimitedLog,
    /// `warden_api_connections_refused_total` for this listener, by reason
    /// (per caller, total): registered once, as a flood counts thousands.
    refused: [metrics::Counter; 2],
    /// `warden_api_connections_open` for this listener.
    open: metrics::Gauge,
}

/// A connection's place under the quotas; dropping it frees the place.
#[derive(Debug)]
pub struct Ticket<K: Eq + Hash> {
    limits: Arc<ConnLimits<K>>,
    caller: K,
}

impl<K: Eq + Hash + Clone + std::fmt::Display> ConnLimits<K> {
    /// Quotas for `listener`: `per_caller` connections per caller (the
    /// config key `key`), within `budget`.
    pub fn new(
        listener: &'static str,
        key: &'static str,
        per_caller: u32,
        budget: Arc<FdBudget>,
    ) -> Arc<Self> {
        Arc::new(Self {
            listener,
            key,
            per_caller: usize::try_from(per_caller).unwrap_or(usize::MAX),
            budget,
            counts: Mutex::new(HashMap::new()),
            log: RateLimitedLog::new(listener),
            refused: ["per_caller", "total"].map(|reason| {
                metrics::counter!("warden_api_connections_refused_total", "listener" => listener, "reason" => reason)
            }),
            open: metrics::gauge!("warden_api_connections_open", "listener" => listener),
        })
    }

    /// A place for one more connection of `caller`; `admin` callers are not
    /// held to the per-caller cap and may use the admins' reserve. A
    /// refusal is counted and logged (rate-limited) here.
    pub fn admit(self: &Arc<Self>, caller: K, admin: bool) -> Result<Ticket<K>, Refusal> {
        let r = self.try_admit(caller, admin);
        if let Err(e) = &r {
            self.count_refusal(e);
        }
        r
    }

    /// As [`ConnLimits::admit`], deciding whether the caller is an admin
    /// only when that matters (it is held to its cap otherwise): `admin`
    /// may cost system calls (SO_PEERGROUPS), which a flood of refused
    /// connections should not.
    pub fn admit_lazy(
        self: &Arc<Self>,
        caller: K,
        admin: impl FnOnce() -> bool,
    ) -> Result<Ticket<K>, Refusal> {
        let r = match self.try_admit(caller.clone(), false) {
            Err(_) if admin() => self.try_admit(caller, true),
            r => r,
        };
        if let Err(e) = &r {
            self.count_refusal(e);
        }
        r
    }

    fn count_refusal(&self, e: &Refusal) {
        let i = match e {
            Refusal::PerCaller { .. } => 0,
            Refusal::Total { .. } => 1,
        };
        self.refused[i].increment(1);
        self.log.warn(&format!("connection refused: {e}"));
    }

    fn try_admit(self: &Arc<Self>, caller: K, admin: bool) -> Result<Ticket<K>, Refusal> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let held = counts.get(&caller).copied().unwrap_or(0);
        if !admin && held >= self.per_caller {
            return Err(Refusal::PerCaller {
                listener: self.listener,
                who: caller.to_string(),
                held,
                key: self.key,
                max: self.per_caller,
            });
        }
        self.budget
            .take(admin)
            .map_err(|limit| Refusal::Total { limit })?;
        *counts.entry(caller.clone()).or_default() += 1;
        self.open.increment(1.0);
        Ok(Ticket {
            limits: self.clone(),
            caller,
        })
    }

    /// Connections `caller` holds now.
    pub fn held_by(&self, caller: &K) -> usize {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(caller)
            .copied()
            .unwrap_or(0)
    }
}

impl<K: Eq + Hash> Drop for Ticket<K> {
    fn drop(&mut self) {
        let mut counts = self
            .limits
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.caller) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.caller);
            }
        }
        drop(counts);
        self.limits.budget.give();
        self.limits.open.decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_caller_and_total_caps_name_their_key_and_admins_keep_a_reserve() {
        let budget = FdBudget::new(40);
        let l = ConnLimits::<u32>::new("unix", "api.max_connections_per_uid", 3, budget.clone());
        let a: Vec<_> = (0..3).map(|_| l.admit(1000, false).unwrap()).collect();
        let e = l.admit(1000, false).unwrap_err();
        assert!(
            e.to_string().contains("api.max_connections_per_uid = 3"),
            "{e}"
        );
        // Admins are not held to the per-caller cap.
        let root: Vec<_> = (0..5).map(|_| l.admit(0, true).unwrap()).collect();
        assert_eq!(budget.open_now(), 8);
        // Other uids fill the budget up to the admins' reserve (40 - 5).
        let mut others = Vec::new();
        for uid in 2000.. {
            match l.admit(uid, false) {
                Ok(t) => others.push(t),
                Err(Refusal::Total { limit }) => {
                    assert_eq!(limit, 35);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(budget.open_now(), 35);
        // Admins still get in, up to the cap.
        let more: Vec<_> = (0..5).map(|_| l.admit(0, true).unwrap()).collect();
        assert!(matches!(
            l.admit(0, true),
            Err(Refusal::Total { limit: 40 })
        ));
        drop((a, root, others, more));
        assert_eq!(budget.open_now(), 0);
        assert_eq!(l.held_by(&1000), 0);
    }

    #[test]
    fn the_cap_leaves_descriptors_for_the_agent() {
        // 1024 descriptors, 256 ranks: 1024 - 256 - 512 = 256 connections.
        assert_eq!(connection_cap(1024, 256, 4096), 256);
        // Configured lower: that.
        assert_eq!(connection_cap(1 << 20, 256, 4096), 4096);
        // A tiny limit still serves a quarter of it.
        assert_eq!(connection_cap(512, 256, 4096), 128);
    }

    #[test]
    fn accept_errors_are_classified_by_errno() {
        let e = |n| io::Error::from_raw_os_error(n);
        assert_eq!(classify(&e(libc::EMFILE)), AcceptFailure::Resources);
        assert_eq!(classify(&e(libc::ENFILE)), AcceptFailure::Resources);
        assert_eq!(classify(&e(libc::ECONNABORTED)), AcceptFailure::Client);
        assert_eq!(classify(&e(libc::EBADF)), AcceptFailure::Other);
    }

    #[tokio::test(start_paused = true)]
    async fn out_of_descriptors_backs_off_doubling_up_to_a_second() {
        let mut a = Acceptor::new("test");
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let start = tokio::time::Instant::now();
        for _ in 0..12 {
            a.failed(&emfile).await;
        }
        // 10+20+40+...+640 ms, then 1 s each: far from a spin.
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(1270 + 5000), "{waited:?}");
        a.succeeded();
        let start = tokio::time::Instant::now();
        a.failed(&emfile).await;
        assert_eq!(start.elapsed(), ACCEPT_BACKOFF_MIN);
    }
}
