//! Coordination across hosts, through etcd: one [`Coordinator`] per
//! launcher (`warden run`) of a job that spans hosts.
//!
//! In: the launcher's [`CoordConfig`] (etcd endpoints, job id, this host's
//! id and address, `min_nodes..=max_nodes`, spare or not), its restart
//! requests and its departure. Out: [`Round`]s: for each epoch, who runs
//! workers, at which node rank, with which world size and rendezvous
//! address and port; and [`CoordError::LeaseLost`] when this host is out
//! of the job and must stop its workers at once.
//!
//! How (docs/architecture.md, "Across hosts: coord/"): each launcher
//! registers `<prefix>/<job>/members/<host>` under a lease it keeps alive;
//! the job's `epoch` only goes up, each step in one txn with its round
//! record (`rounds/<epoch>`), compared on the epoch so that exactly one
//! host writes it; every launcher watches the job's keys and reads the
//! same record. A restart request, a member lost (lease expired, left,
//! rejoined), or a host that could grow the round each advance the epoch;
//! the assignment is a pure function of etcd's state ([`plan`]). etcd
//! carries the consensus; nothing here votes.
//!
//! Must never: block a caller on etcd without a deadline, let two hosts
//! disagree on a round (only stored records count), or keep reporting a
//! round after the lease is lost.
//!
//! The launcher's loop: [`Coordinator::join`] ->
//! [`Coordinator::wait_for_round`] -> spawn workers with
//! [`Round::worker_env`] -> on a local failure decision
//! [`Coordinator::request_restart`] -> on [`Coordinator::next_round`]
//! (any new epoch) stop the workers and wait for the next round -> on a
//! cordon or the end [`Coordinator::leave`].

pub mod access;
mod bounded;
pub mod config;
mod connect;
pub mod cordon_share;
pub mod deciders;
mod diagnose;
pub mod error;
pub mod etcd_flags;
pub mod join_read;
pub mod keys;
pub mod layout;
mod lease_route;
pub mod notice;
mod paged;
mod patience;
pub mod plan;
pub mod records;
pub mod reports;
pub mod round;
mod session;
mod waits;

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, TxnOp};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use access::{ClientIdentity, Credentials, EtcdAccess, EtcdTlsFiles, Password};
pub use config::CoordConfig;
pub use connect::etcd_cannot_serve_now;
pub use error::CoordError;
pub use lease_route::member_order;
pub use plan::{CkptPeer, Limits, RoundRecord};
pub use round::Round;
pub use session::{JobEnd, Outcome};

use keys::Keys;
use session::{Advance, Departure, Inner};

/// What a coordinator knows now; watched by the launcher
/// ([`Coordinator::rounds`]).
#[derive(Debug, Clone, Default)]
pub struct CoordState {
    /// The round of the current epoch; `None` before the first.
    pub round: Option<Round>,
    /// How many hosts are live (member keys present). On a host that does
    /// not decide rounds (past the first [`deciders::DECIDERS`] by join: it
    /// watches no member key but their deletions), the current round's
    /// members and standby instead. A count, not the list: this state is
    /// published on every watch event, and a list of every host made each
    /// time was a third of a deciding host's CPU while 2,048 hosts joined
    /// (issue 30); [`Coordinator::live_hosts`] makes the list on demand.
    pub live: usize,
    /// Set when a host ended the job at the current epoch.
    pub ended: Option<JobEnd>,
    /// Set once the coordinator is out of the job (its lease lost); from
    /// then on every call returns this error.
    pub failed: Option<CoordError>,
    /// How many times this launcher regained its membership under a new
    /// lease after etcd expired the old one (its workers kept running).
    pub rejoins: u32,
    /// Set while the membership lease has lapsed by this host's clock (no
    /// keep-alive answered for a TTL, or etcd expired it) and is not yet
    /// kept or regained: what since, and why.
    pub lease_lapsed: Option<String>,
    /// The etcd endpoint the lease's keep-alives go through now, with
    /// several endpoints: it moves to the next when one leaves a
    /// keep-alive unanswered (`coord/lease_route.rs`). `None` with one endpoint.
    pub lease_endpoint: Option<String>,
    /// The newest notice of a coming stop a host of the job published
    /// ([`Coordinator::publish_notice`]), with the epoch of its round.
    pub notice: Option<(u64, records::NoticeRecord)>,
    /// The etcd endpoint the job's watch goes through now, with several
    /// endpoints: it moves to the next when the member leaves the watch
    /// unanswered (no event and no answer to a progress request for a
    /// sixth of the TTL each), and watches on from the last revision seen.
    /// `None` with one endpoint.
    pub watch_endpoint: Option<String>,
}

/// Why a launcher leaves the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leave {
    /// Its workers completed: the job is over; the other hosts are not
    /// restarted around it (an end marker is written).
    Finished,
    /// The job failed for good here (a user error): the end marker tells
    /// the other launchers to stop too, and with which exit status (the
    /// failed rank's own, so the scheduler sees the same from every host).
    Failed {
        /// Why.
        reason: String,
        /// The exit status the launchers exit with.
        exit_code: i32,
    },
    /// This node is cordoned (a hardware fault): the others go on without
    /// it, with a spare in its place or on fewer hosts.
    Cordoned(String),
    /// The launcher was told to stop (SIGTERM): as a cordon for the others.
    Stopped(String),
}

impl Leave {
    fn reason(&self) -> String {
        match self {
            Leave::Finished => "finished".to_owned(),
            Leave::Failed { reason, exit_code } => format!("failed: {reason} (exit {exit_code})"),
            Leave::Cordoned(r) => format!("{}{r}", cordon_share::CORDONED),
            Leave::Stopped(r) => format!("stopped: {r}"),
        }
    }
}

/// One launcher's membership in a multi-host job.
///
/// Dropping it stops its lease keep-alive without revoking the lease, so
/// the other hosts see it go after one TTL, exactly as if the launcher had
/// been killed; [`Coordinator::leave`] is the clean way out.
pub struct Coordinator {
    inner: Arc<Inner>,
    /// The notice that stood in etcd when this launcher joined, judged
    /// ([`notice::stop_underway`]).
    at_join: Option<notice::NoticeAtJoin>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("inner", &self.inner)
            .finish()
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.inner.stop.cancel();
    }
}

impl Coordinator {
    /// Joins the job: connects, grants a lease of `lease_ttl` and keeps it
    /// alive on a task, registers this host under it (waiting up to
    /// `join_timeout` if a previous launcher's lease still holds the host
    /// id), reads the job's state and starts watching it.
    ///
    /// Joining may itself call for a new round (the job grows, or this host
    /// was in the current round under an earlier lease and its workers are
    /// gone); [`Coordinator::wait_for_round`] waits for it.
    pub async fn join(cfg: CoordConfig) -> Result<Self, CoordError> {
        cfg.validate()?;
        let endpoints = cfg.endpoints.join(",");
        let keys = Keys::new(&cfg.prefix, &cfg.job);
        let joining = Instant::now();
        let client = connect::connect(connect::EtcdDial {
            endpoints: &cfg.endpoints,
            access: &cfg.access,
            timeout: cfg.request_timeout,
            keep_alive: Some(cfg.lease_ttl / 3),
            probe: keys.base(),
            patience: cfg.rejoin_timeout,
        })
        .await?;
        let member_key = keys.member(&cfg.host);
        // From here on, an etcd that does not answer is asked again
        // ([`patience`]). A grant whose answer was lost leaves a lease
        // with no key under it, which etcd drops after the TTL.
        // One budget for the join: what the first read spent is gone.
        let mut patience =
            patience::Patience::new(cfg.rejoin_timeout.saturating_sub(joining.elapsed()));
        let (lease, granted_at) = loop {
            let granted_at = Instant::now();
            let mut c = client.clone();
            let grant = c.lease_grant(cfg.ttl_secs(), None);
            match bounded::call(
                &endpoints,
                cfg.request_timeout,
                "lease grant",
                &member_key,
                grant,
            )
            .await
            {
                Ok(r) => break (r.id(), granted_at),
                Err(e) => {
                    let wait = patience.again(e.clone())?;
                    tracing::warn!(job = %cfg.job, host = %cfg.host, error = %e, ?wait, "coord: etcd did not grant the membership lease; asking again");
                    tokio::time::sleep(wait).await;
                }
            }
        };
        let limits = Limits {
            min_nodes: cfg.min_nodes,
            max_nodes: cfg.max_nodes,
            base_port: cfg.base_port,
            port_span: cfg.port_span,
        };
        let (state, _) = watch::channel(CoordState::default());
        let inner = Arc::new(Inner {
            cfg,
            keys,
            limits,
            endpoints,
            client,
            lease: AtomicI64::new(lease),
            incarnation: incarnation(),
            joined_at: AtomicI64::new(0),
            decides: std::sync::atomic::AtomicBool::new(false),
            view: Mutex::new(session::View::default()),
            state,
            stop: CancellationToken::new(),
        });
        // From here on, a failure drops `me`, which stops the keeper.
        let mut me = Self {
            inner: Arc::clone(&inner),
            at_join: None,
        };
        tokio::spawn(session::keep_lease(Arc::clone(&inner), granted_at));
        let registered = match inner.register().await {
            Ok(r) => r,
            Err(e) => {
                me.revoke().await;
                return Err(e);
            }
        };
        // The register txn read the job; a page beyond it that etcd's
        // compaction overtook is read again whole, at the newest revision,
        // as is the job when the txn's answer was lost
        // ([`session::Registered::Earlier`]) or a read after it got none.
        let (view, standing) = match registered {
            session::Registered::Now(read, at) => {
                // The newest notice, whatever its round (the view keeps
                // the current round's only): judged once the view says
                // who is in.
                let standing = read.notice.first().cloned();
                let view = match inner.view_from(*read, at, true).await {
                    Err(e) if paged::compacted(&e) || e.etcd_busy() => {
                        inner.load_patiently().await.map(|(view, _)| view)
                    }
                    r => r,
                };
                (view, standing)
            }
            session::Registered::Earlier => match inner.load_patiently().await {
                Ok((view, notice)) => (Ok(view), notice),
                Err(e) => (Err(e), None),
            },
        };
        let view = match view {
            Ok(v) => v,
            Err(e) => {
                me.revoke().await;
                return Err(e);
            }
        };
        for m in view.members.values() {
            let r = &m.record;
            if (r.min_nodes, r.max_nodes) != (inner.cfg.min_nodes, inner.cfg.max_nodes) {
                tracing::warn!(
                    job = %inner.cfg.job,
                    host = %inner.cfg.host,
                    other = %r.host,
                    ours = %format_args!("{}:{}", inner.cfg.min_nodes, inner.cfg.max_nodes),
                    theirs = %format_args!("{}:{}", r.min_nodes, r.max_nodes),
                    "coord: hosts of the job disagree on --nnodes; each round uses its writer's"
                );
            }
        }
        me.at_join = standing.and_then(|kv| inner.notice_at_join(&kv, &view));
        let revision = view.revision;
        let decider = view.decider;
        inner.set_view(view);
        if decider {
            // Off the join's path: the marker only spares later joiners
            // a slower read.
            let marking = Arc::clone(&inner);
            tokio::spawn(async move { marking.mark_decider().await });
        }
        tracing::info!(
            job = %inner.cfg.job,
            host = %inner.cfg.host,
            lease = %format_args!("{lease:x}"),
            endpoints = %inner.endpoints,
            "coord: joined"
        );
        tokio::spawn(session::drive(Arc::clone(&inner), revision));
        if let Some(e) = inner.state.borrow().failed.clone() {
            return Err(e);
        }
        Ok(me)
    }

    /// The notice of a coming stop that stood in etcd when this launcher
    /// joined, whatever its round, and whether the job's stop on it was
    /// underway then ([`notice::stop_underway`]) or it is a previous
    /// run's. `None`: no notice stood.
    pub fn notice_at_join(&self) -> Option<&notice::NoticeAtJoin> {
        self.at_join.as_ref()
    }

    /// This host's id.
    pub fn host(&self) -> &str {
        &self.inner.cfg.host
    }

    /// This host's membership lease, as etcd names it.
    pub fn lease_id(&self) -> i64 {
        self.inner.lease()
    }

    /// The job's hosts cordoned within `window` as etcd shows them now,
    /// this one counted as cordoned, against `max_share`
    /// ([`cordon_share::cordon_share`]).
    pub fn cordon_share(&self, window: Duration, max_share: f64) -> cordon_share::CordonShare {
        let view = self.inner.lock_view();
        let live = view.live_hosts();
        cordon_share::cordon_share(
            live.iter().map(String::as_str),
            &view.departed,
            &self.inner.cfg.host,
            session::now_ms(),
            window,
            max_share,
        )
    }

    /// The live hosts, sorted, as [`CoordState::live`] counts them: every
    /// member on a host that decides rounds, else the current round's
    /// members and standby. O(N): for errors and people, not per event.
    pub fn live_hosts(&self) -> Vec<String> {
        self.inner.lock_view().live_hosts()
    }

    /// What the coordinator knows now.
    pub fn state(&self) -> CoordState {
        self.inner.state.borrow().clone()
    }

    /// A receiver that changes with every new round, membership change,
    /// end marker or failure: for a launcher that selects on it.
    pub fn rounds(&self) -> watch::Receiver<CoordState> {
        self.inner.state.subscribe()
    }

    /// The first round after `after_epoch`, waiting or not: the signal to
    /// stop the workers of round `after_epoch`. Waits as long as it takes
    /// (a launcher selects on it beside its workers); fails when the lease
    /// is lost or the job ended.
    pub async fn next_round(&self, after_epoch: u64) -> Result<Round, CoordError> {
        self.wait(after_epoch, false).await
    }

    /// The first round after `after_epoch` that is not waiting for hosts:
    /// what to start workers for (if this host has a node rank in it; a
    /// standby spare has none and waits for the next). Gives up after
    /// `timeout` with [`CoordError::NotEnoughNodes`] (or
    /// [`CoordError::NoRound`] when enough hosts are there).
    pub async fn wait_for_round(
        &self,
        after_epoch: u64,
        timeout: Duration,
    ) -> Result<Round, CoordError> {
        match tokio::time::timeout(timeout, self.wait(after_epoch, true)).await {
            Ok(r) => r,
            Err(_) => {
                let min_nodes = self.inner.cfg.min_nodes;
                let live = self.state().live;
                Err(if live < usize::try_from(min_nodes).unwrap_or(usize::MAX) {
                    CoordError::NotEnoughNodes {
                        job: self.inner.cfg.job.clone(),
                        live,
                        hosts: self.live_hosts().join(","),
                        min_nodes,
                        waited: timeout,
                    }
                } else {
                    CoordError::NoRound {
                        job: self.inner.cfg.job.clone(),
                        after_epoch,
                        live,
                        waited: timeout,
                    }
                })
            }
        }
    }

    async fn wait(&self, after_epoch: u64, runnable: bool) -> Result<Round, CoordError> {
        let mut rx = self.inner.state.subscribe();
        loop {
            {
                let s = rx.borrow_and_update();
                if let Some(e) = &s.failed {
                    return Err(e.clone());
                }
                if let Some(end) = &s.ended {
                    return Err(CoordError::Ended {
                        job: self.inner.cfg.job.clone(),
                        by: end.by.clone(),
                        outcome: end.outcome,
                        reason: end.reason.clone(),
                        exit_code: end.exit_code,
                    });
                }
                if let Some(r) = &s.round
                    && r.epoch > after_epoch
                    && !(runnable && r.waiting)
                {
                    return Ok(r.clone());
                }
            }
            if rx.changed().await.is_err() {
                return Err(self.inner.stopped_error());
            }
        }
    }

    /// Asks for a new round because of a local failure seen in round
    /// `seen_epoch`: advances the epoch to `seen_epoch + 1` with a new round
    /// of the live hosts, unless it has already moved on (another host saw
    /// the failure first); either way returns the epoch now current, so
    /// one failure makes one round whoever reports it.
    pub async fn request_restart(&self, seen_epoch: u64, reason: &str) -> Result<u64, CoordError> {
        self.request_round(seen_epoch, reason, false).await
    }

    /// [`Self::request_restart`], and with `heal` a round this host heals
    /// its workers into in process: the round says so
    /// ([`RoundRecord::heal`]), and a host that keeps its place heals
    /// its own workers too instead of restarting them from the checkpoint.
    /// A round that moved on already (another host asked first), or one
    /// another host is writing with a new layout base (its own, for its
    /// own reason), is kept as it is: that round says what it is, and a
    /// host whose heal meets it judges it on arrival (`keeps_place`).
    pub async fn request_round(
        &self,
        seen_epoch: u64,
        reason: &str,
        heal: bool,
    ) -> Result<u64, CoordError> {
        if let Some(e) = self.inner.state.borrow().failed.clone() {
            return Err(e);
        }
        let reason = format!("restart requested by {}: {reason}", self.inner.cfg.host);
        match self.inner.advance(seen_epoch, reason, heal).await? {
            Advance::Advanced(e) | Advance::Stale(e) => Ok(e),
            Advance::LostRace | Advance::Claimed => self.inner.read_epoch().await,
        }
    }

    /// Tells the job's other hosts of a notice of a coming stop in the
    /// round of `epoch`: every rank saves at `step`'s boundary. Returns the
    /// round's notice: this one, or the one a host wrote first (then this
    /// host's ranks must save at its step instead).
    pub async fn publish_notice(
        &self,
        epoch: u64,
        step: u64,
        deadline_ms: u64,
        reason: &str,
    ) -> Result<records::NoticeRecord, CoordError> {
        if let Some(e) = self.inner.state.borrow().failed.clone() {
            return Err(e);
        }
        self.inner
            .publish_notice(epoch, step, deadline_ms, reason)
            .await
    }

    /// Leaves the job: deletes this host's member key and says why (and,
    /// for [`Leave::Finished`] or [`Leave::Failed`], marks the job ended) in
    /// one txn, then revokes the lease. The other hosts get a new round at
    /// once (hot-swap or scale down) rather than after a TTL.
    pub async fn leave(self, how: Leave) -> Result<(), CoordError> {
        let inner = Arc::clone(&self.inner);
        // The driver stops: this host takes no part in the next round.
        inner.stop.cancel();
        let epoch = inner.state.borrow().round.as_ref().map_or(0, |r| r.epoch);
        let member = inner.keys.member(&inner.cfg.host);
        let reason = how.reason();
        let departure = serde_json::to_string(&Departure {
            reason: reason.clone(),
            epoch,
            at_ms: session::now_ms(),
        })
        .map_err(|e| CoordError::Corrupt {
            key: inner.keys.departure(&inner.cfg.host),
            problem: e.to_string(),
        })?;
        let mut ops = vec![
            TxnOp::delete(member.as_str(), None),
            TxnOp::put(inner.keys.departure(&inner.cfg.host), departure, None),
            // Its lease's revoke would take it too; here it goes with the
            // member key, in one revision.
            TxnOp::delete(inner.keys.decider(&inner.cfg.host), None),
        ];
        let outcome = match &how {
            Leave::Finished => Some(Outcome::Finished),
            Leave::Failed { .. } => Some(Outcome::Failed),
            Leave::Cordoned(_) | Leave::Stopped(_) => None,
        };
        if let Some(outcome) = outcome {
            let end = JobEnd {
                epoch,
                by: inner.cfg.host.clone(),
                outcome,
                reason: reason.clone(),
                exit_code: match &how {
                    Leave::Failed { exit_code, .. } => Some(*exit_code),
                    _ => None,
                },
            };
            let json = serde_json::to_string(&end).map_err(|e| CoordError::Corrupt {
                key: inner.keys.end(epoch),
                problem: e.to_string(),
            })?;
            // The first host to end the job at this epoch says how; later
            // ones do not overwrite it.
            let key = inner.keys.end(epoch);
            ops.push(TxnOp::txn(
                etcd_client::Txn::new()
                    .when([Compare::version(key.as_str(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(key.as_str(), json, None)]),
            ));
        }
        // Only our own key: a later launcher may hold the host id by now.
        let txn = etcd_client::Txn::new()
            .when([Compare::lease(
                member.as_str(),
                CompareOp::Equal,
                inner.lease(),
            )])
            .and_then(ops);
        let mut client = inner.client.clone();
        let result = inner
            .call("txn (leave)", &member, client.txn(txn))
            .await
            .map(|_| ());
        tracing::info!(job = %inner.cfg.job, host = %inner.cfg.host, %reason, "coord: left the job");
        self.revoke().await;
        result
    }

    /// Revokes the lease, best effort: on failure it expires after its TTL.
    async fn revoke(&self) {
        let inner = &self.inner;
        let mut client = inner.client.clone();
        let lease = inner.lease();
        let key = format!("lease {lease:x}");
        if let Err(e) = inner
            .call("lease revoke", &key, client.lease_revoke(lease))
            .await
        {
            tracing::warn!(host = %inner.cfg.host, error = %e, "coord: could not revoke the lease; it expires on its own");
        }
    }
}

/// A launcher's incarnation: random, never 0 (0 is "an older launcher").
/// The std hasher's random keys are enough: it only has to differ from any
/// other launcher's on the same host id.
fn incarnation() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launcher holds these futures across `select!` on a multi-thread
    /// runtime: they must be `Send`. Compiled, never run.
    #[allow(dead_code)]
    fn futures_are_send(c: Coordinator, cfg: CoordConfig) {
        fn send<T: Send>(_: T) {}
        send(c.wait_for_round(0, Duration::ZERO));
        send(c.next_round(0));
        send(c.request_restart(0, ""));
        send(Coordinator::join(cfg));
        send(c.leave(Leave::Finished));
    }
}
