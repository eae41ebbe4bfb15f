//! The etcd side of a coordinator: the lease kept alive, the job's keys
//! read and watched into a [`View`], rounds written in one txn.
//!
//! Two tasks per coordinator: the lease keeper (a keep-alive every third of
//! the TTL; one left unanswered for a sixth of it moves the next stream to
//! another endpoint, [`super::lease_route`]; a whole TTL without an answer,
//! or an answer of TTL 0, is the lease lost) and the driver (one watch on the job's prefix; after each
//! batch of events it asks [`plan::decide`] whether a round is due and, if
//! so, tries to write it). Both stop on the coordinator's cancellation
//! token. Every request has a deadline.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, KeyValue, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchFilterType, WatchOptions,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;

use super::config::ETCD_EXPIRY_SWEEP;
use super::join_read::JoinRead;
use super::keys::{KEEP_ROUNDS, KeyKind, Keys};
use super::layout::{self, LayoutError, LayoutRef};
use super::lease_route::{LeaseRoute, answer_deadline};
use super::plan::{
    self, Limits, Member, MemberRecord, RoundMember, RoundRecord, Standing, Trigger,
};
use super::waits::{Wait, Waits};
use super::{CoordConfig, CoordError, CoordState, Round};

/// How a job ended, as stored at `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The training completed.
    Finished,
    /// A host stopped the whole job (a user error: no restart can fix it).
    Failed,
}

/// The job's end marker at one epoch: written by the first host that leaves with
/// [`super::Leave::Finished`] or [`super::Leave::Failed`], so the others do
/// not restart the job around the hosts that leave after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobEnd {
    /// The epoch it ended at.
    pub epoch: u64,
    /// The host that said so.
    pub by: String,
    /// Finished or failed.
    pub outcome: Outcome,
    /// Its words.
    pub reason: String,
    /// For a failure, the exit status every launcher exits with.
    #[serde(default)]
    pub exit_code: Option<i32>,
}

/// What a host left behind at `departures/<host>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Departure {
    pub(crate) reason: String,
    pub(crate) epoch: u64,
    pub(crate) at_ms: u64,
}

/// The job's state as read from etcd: every key under the job's prefix.
#[derive(Debug, Default, Clone)]
pub(crate) struct View {
    /// The revision this view is at.
    pub(crate) revision: i64,
    pub(crate) members: BTreeMap<String, Member>,
    pub(crate) epoch: u64,
    /// Round records with their members (a layout's resolved).
    pub(crate) rounds: BTreeMap<u64, RoundRecord>,
    /// Round records whose layout base is not all here yet (its chunks are
    /// written before the record, so only a partial read sees this).
    pub(crate) unresolved: BTreeMap<u64, RoundRecord>,
    /// Every layout base in etcd: base -> chunk -> its members.
    pub(crate) layouts: BTreeMap<String, BTreeMap<u32, Vec<RoundMember>>>,
    pub(crate) departures: BTreeMap<String, String>,
    /// The same departures with when they were written (ms since the
    /// epoch), for the cordon share ([`super::cordon_share`]).
    pub(crate) departed: BTreeMap<String, (String, u64)>,
    pub(crate) ends: BTreeMap<u64, JobEnd>,
    /// Notices of a coming stop, by the epoch of their round (one is kept
    /// in etcd: each notice's txn deletes the older ones).
    pub(crate) notices: BTreeMap<u64, super::records::NoticeRecord>,
    /// The live members against the current round, kept per member event
    /// ([`plan::Standing`]): what the round checks read, so that an event
    /// costs O(log N), not a scan of every host.
    pub(crate) standing: Standing,
    /// The current round changed since `standing` was built: rebuild it
    /// (once per batch of events).
    stale: bool,
    /// This host's view of the current round, made once per round (or
    /// lease), not per event: (epoch, lease, round without its standby).
    round_cache: Option<(u64, i64, Round)>,
    /// This host decides rounds ([`super::deciders`]): `members` holds
    /// every live member. When false, `members` is empty, the epoch
    /// follows the round records, and this host writes a round only when
    /// asked for a restart (of the current round's members).
    pub(crate) decider: bool,
    /// For a host that does not decide: the deciders by their markers
    /// (host -> its member key's create revision), kept by the watch.
    pub(crate) deciders: BTreeMap<String, i64>,
    /// A host that does not decide must ask etcd again for the deciders.
    pub(crate) recheck: bool,
    /// The create revision of this host's member key (its join), for the
    /// end markers of a host that does not decide.
    pub(crate) joined_at: i64,
    /// Each end marker's revision, by epoch.
    end_revisions: BTreeMap<u64, i64>,
}

impl View {
    fn current(&self) -> Option<&RoundRecord> {
        self.rounds.get(&self.epoch)
    }

    /// The live members a round is made of: every live member on a
    /// decider; on any other host the current round's members, taken as
    /// live (a restart it asks for keeps them; a decider replaces any
    /// that is gone in the round after).
    fn live(&self) -> Vec<Member> {
        if self.decider {
            return self.members.values().cloned().collect();
        }
        self.current()
            .map(|r| {
                r.members
                    .iter()
                    .map(|rm| Member {
                        record: MemberRecord {
                            host: rm.host.clone(),
                            addr: rm.addr.clone(),
                            nproc_per_node: rm.nproc_per_node,
                            spare: false,
                            min_nodes: r.min_nodes,
                            max_nodes: r.max_nodes,
                            pid: 0,
                            joined_at_ms: 0,
                            ckpt_peer: rm.ckpt_peer.clone(),
                            incarnation: rm.incarnation,
                            // Its agent took the ring by place where the
                            // round says every agent did.
                            ckpt_ring_by_place: r.ckpt_ring_by_place,
                            // The most the round says: a decider after it
                            // takes the same most.
                            ckpt_replicas: (r.ckpt_replicas > 0).then_some(r.ckpt_replicas),
                        },
                        lease: rm.lease,
                        join_revision: 0,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The live hosts as this host knows them, sorted: every member on a
    /// decider; on any other host the current round's members and standby.
    pub(crate) fn live_hosts(&self) -> Vec<String> {
        if self.decider {
            return self.members.keys().cloned().collect();
        }
        let mut hosts: Vec<String> = self
            .current()
            .map(|r| {
                r.members
                    .iter()
                    .map(|m| m.host.clone())
                    .chain(r.standby.iter().cloned())
                    .collect()
            })
            .unwrap_or_default();
        hosts.sort();
        hosts
    }

    /// How many hosts [`View::live_hosts`] names, in O(1).
    pub(crate) fn live_count(&self) -> usize {
        if self.decider {
            return self.members.len();
        }
        self.current()
            .map_or(0, |r| r.members.len() + r.standby.len())
    }

    /// Builds `standing` again if the current round changed.
    pub(crate) fn settle(&mut self) {
        if self.stale {
            self.standing = Standing::new(self.rounds.get(&self.epoch), &self.members);
            self.stale = false;
        }
    }

    /// After `host`'s member key was written or deleted.
    fn member_changed(&mut self, host: &str) {
        if !self.stale {
            self.standing
                .member_changed(self.rounds.get(&self.epoch), &self.members, host);
        }
    }

    /// A round record read from etcd: with its members, or among the
    /// unresolved until its base is here.
    fn put_round(&mut self, epoch: u64, record: RoundRecord) -> Result<(), LayoutError> {
        self.unresolved.remove(&epoch);
        match self.resolve(record)? {
            Ok(r) => {
                self.stale |= epoch == self.epoch;
                self.rounds.insert(epoch, r);
            }
            Err(r) => {
                self.rounds.remove(&epoch);
                self.stale |= epoch == self.epoch;
                self.unresolved.insert(epoch, r);
            }
        }
        Ok(())
    }

    /// Drops the round records before `epoch` (etcd deletes each once
    /// [`KEEP_ROUNDS`] newer ones stand), and any of them unresolved.
    fn forget_rounds_before(&mut self, epoch: u64) {
        self.rounds = self.rounds.split_off(&epoch);
        self.unresolved = self.unresolved.split_off(&epoch);
    }

    /// A chunk of a layout base read from etcd: kept, and the records
    /// waiting for it resolved.
    fn put_chunk(
        &mut self,
        base: &str,
        chunk: u32,
        members: Vec<RoundMember>,
    ) -> Result<(), LayoutError> {
        self.layouts
            .entry(base.to_owned())
            .or_default()
            .insert(chunk, members);
        let waiting: Vec<u64> = self
            .unresolved
            .iter()
            .filter(|(_, r)| r.layout.as_ref().is_some_and(|l| l.base == base))
            .map(|(e, _)| *e)
            .collect();
        let mut first_err = None;
        for epoch in waiting {
            if let Some(r) = self.unresolved.remove(&epoch)
                && let Err(e) = self.put_round(epoch, r)
            {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// `record` with its members made from its layout (`Ok(Ok)`), or as it
    /// is while its base is not all here (`Ok(Err)`).
    fn resolve(
        &self,
        mut record: RoundRecord,
    ) -> Result<Result<RoundRecord, RoundRecord>, LayoutError> {
        let Some(l) = &record.layout else {
            record.check_members()?;
            return Ok(Ok(record));
        };
        match self.base_members(l)? {
            Some(base) => {
                record.members = layout::apply(&base, l, record.nnodes)?;
                record.check_members()?;
                Ok(Ok(record))
            }
            None => Ok(Err(record)),
        }
    }

    /// The members of `l`'s base, when every chunk of it is here.
    fn base_members(&self, l: &LayoutRef) -> Result<Option<Vec<RoundMember>>, LayoutError> {
        layout::joined(self.layouts.get(&l.base), l)
    }

    /// The end marker of the current epoch, while a member of its round is
    /// still live: once they are all gone, the job id is free for a new run
    /// (whose hosts come with new leases).
    ///
    /// A host that does not decide knows no member but itself: the end
    /// marker holds for it when it was written after this host joined (a
    /// host that joins once the job ended is of a new run, whose deciders
    /// start it).
    fn ended(&self) -> Option<&JobEnd> {
        self.current()?;
        let end = self.ends.get(&self.epoch)?;
        if self.decider {
            self.standing.any_member_live().then_some(end)
        } else {
            let written = self.end_revisions.get(&self.epoch).copied();
            written.is_some_and(|w| w > self.joined_at).then_some(end)
        }
    }
}

/// How many times [`Inner::load`] reads again when etcd compacted the
/// revision it was reading at: a compaction interval shorter than a
/// paged read is the only cause, so a second attempt almost always holds.
const LOAD_ATTEMPTS: u32 = 3;

/// How this launcher's member key came to be ([`Inner::register`]).
#[derive(Debug)]
pub(crate) enum Registered {
    /// The register txn wrote it, and read the job at its revision.
    Now(Box<JoinRead>, i64),
    /// An earlier attempt whose answer was lost wrote it: the job must be
    /// read again.
    Earlier,
}

/// What came of an attempt to advance the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Advance {
    /// This host wrote the round of this epoch.
    Advanced(u64),
    /// The view was already past the expected epoch: this one.
    Stale(u64),
    /// Another host advanced it first (the txn's compare failed).
    LostRace,
    /// Another host holds the claim to write the next round's layout base
    /// ([`Keys::base_claim`]): it writes the round; this host waits for it.
    Claimed,
}

/// Who writes the next round's layout base ([`Inner::claim_base`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Claim {
    /// This host: it writes the base and the round.
    Mine,
    /// Another host, named: it writes them.
    Theirs(String),
    /// Nobody: the epoch moved on meanwhile.
    EpochMoved,
}

/// What the coordinator's tasks and calls share.
pub(crate) struct Inner {
    pub(crate) cfg: CoordConfig,
    pub(crate) keys: Keys,
    pub(crate) limits: Limits,
    /// The endpoints, comma-separated, for errors.
    pub(crate) endpoints: String,
    pub(crate) client: Client,
    /// The membership lease now: replaced when a lapsed lease is rejoined.
    pub(crate) lease: AtomicI64,
    /// This launcher's incarnation ([`MemberRecord::incarnation`]): drawn
    /// at join, kept across rejoins.
    pub(crate) incarnation: u64,
    /// The create revision of this host's member key: set when it
    /// registers or rejoins.
    pub(crate) joined_at: AtomicI64,
    /// This host decides rounds ([`super::deciders`]): once true, for good.
    pub(crate) decides: AtomicBool,
    pub(crate) view: Mutex<View>,
    pub(crate) state: watch::Sender<CoordState>,
    pub(crate) stop: CancellationToken,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("job", &self.cfg.job)
            .field("host", &self.cfg.host)
            .field("endpoints", &self.endpoints)
            .field("lease", &format_args!("{:x}", self.lease()))
            .finish_non_exhaustive()
    }
}

/// Milliseconds since the Unix epoch, for records people read.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// `key`'s bytes as text, for logs and errors.
fn key_text(kv: &KeyValue) -> String {
    String::from_utf8_lossy(kv.key()).into_owned()
}

impl Inner {
    /// Runs one etcd request under the request deadline, naming the
    /// request and key in its error.
    pub(crate) async fn call<T>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, CoordError> {
        super::bounded::call(&self.endpoints, self.cfg.request_timeout, op, key, fut).await
    }

    /// The membership lease now.
    pub(crate) fn lease(&self) -> i64 {
        self.lease.load(Ordering::Acquire)
    }

    pub(crate) fn lock_view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads the job's current state into a fresh view: the epoch, every
    /// member and departure (paged, [`super::paged`]), and only the current
    /// epoch's round record and end marker (not the older rounds kept for
    /// people), all at one revision. A read that etcd's compaction
    /// overtook is made again at the newest revision, at most
    /// [`LOAD_ATTEMPTS`] times.
    pub(crate) async fn load(&self) -> Result<View, CoordError> {
        self.load_noticed().await.map(|(view, _)| view)
    }

    /// [`Self::load`], with the newest notice of a coming stop, whatever
    /// its round, as the register txn reads it.
    async fn load_noticed(&self) -> Result<(View, Option<KeyValue>), CoordError> {
        let mut attempt = 1;
        loop {
            match self.load_once().await {
                Err(e) if super::paged::compacted(&e) && attempt < LOAD_ATTEMPTS => {
                    tracing::debug!(host = %self.cfg.host, error = %e, "coord: the read was compacted under us; reading again");
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    async fn load_once(&self) -> Result<(View, Option<KeyValue>), CoordError> {
        let base = self.keys.base();
        let txn = Txn::new().and_then(super::join_read::ops(&self.keys));
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(super::paged::RECEIVE_LIMIT);
        let resp = self.call("txn (read the job)", base, kv.txn(txn)).await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let read = JoinRead::parse(resp.op_responses(), 0).map_err(|e| CoordError::Corrupt {
            key: base.to_owned(),
            problem: e.to_string(),
        })?;
        let notice = read.notice.first().cloned();
        let view = self.view_from(read, revision, false).await?;
        Ok((view, notice))
    }

    /// [`Self::load_noticed`] for a launcher that is registered but has no
    /// view yet: asked again while etcd does not answer
    /// ([`super::patience`], up to `rejoin_timeout`).
    pub(crate) async fn load_patiently(&self) -> Result<(View, Option<KeyValue>), CoordError> {
        let mut patience = super::patience::Patience::new(self.cfg.rejoin_timeout);
        loop {
            let err = match self.load_noticed().await {
                Ok(done) => return Ok(done),
                Err(e) => e,
            };
            let wait = patience.again(err.clone())?;
            tracing::warn!(host = %self.cfg.host, error = %err, ?wait, "coord: could not read the job after registering; reading again");
            tokio::select! {
                () = self.stop.cancelled() => return Err(self.stopped_error()),
                () = sleep(wait) => {}
            }
        }
    }

    /// A fresh view from the joining read's answer at `revision`
    /// ([`super::join_read`]): the epoch, whether this host decides (then
    /// every member, paged), the departures, the current epoch's round
    /// record and end marker (not the older rounds kept for people), and
    /// every layout base; a range longer than the txn's page is read on at
    /// the same revision. `registered`: the read is this host's register
    /// txn's, so its member key is the newest by join
    /// ([`super::deciders`]: then a count says whether it decides).
    pub(crate) async fn view_from(
        &self,
        read: JoinRead,
        revision: i64,
        registered: bool,
    ) -> Result<View, CoordError> {
        let mut view = View {
            revision,
            // Until the deciders are known: the epoch key is read as is.
            decider: true,
            ..View::default()
        };
        for kv in &read.epoch {
            self.apply_put(&mut view, kv);
        }
        // Whether this host decides rounds: then it reads every member;
        // else none (issue 30: a join read every member before it). Just
        // registered (its key the newest by join), the deciders' markers
        // say, or while fewer than a full set stand, a count of the member
        // keys; reading the job again, the first hosts by join in a sorted
        // read (etcd 3.4 reads every member record for it: O(N), so not
        // per join). A host that does not decide watches for the deciders
        // by their markers ([`super::deciders`]).
        view.joined_at = self.joined_at.load(Ordering::Acquire);
        view.decider = if self.decides.load(Ordering::Acquire) {
            true
        } else if registered {
            match super::deciders::settled_by_markers(read.deciders.count) {
                Some(decides) => decides,
                None => super::deciders::newest_decides(
                    super::deciders::count_members(
                        &self.endpoints,
                        self.cfg.request_timeout,
                        &self.client,
                        &self.keys,
                        revision,
                    )
                    .await?,
                ),
            }
        } else {
            let first = super::deciders::first_by_join(
                &self.endpoints,
                self.cfg.request_timeout,
                &self.client,
                &self.keys,
                revision,
            )
            .await?;
            super::deciders::decides(&first, &self.cfg.host)
        };
        if view.decider {
            self.decides.store(true, Ordering::Release);
            super::paged::read_prefix(
                &self.endpoints,
                self.cfg.request_timeout,
                &self.client,
                &self.keys.members(),
                revision,
                |kv| self.apply_put(&mut view, kv),
            )
            .await?;
        } else {
            self.read_on(&mut view, &read.deciders, &self.keys.deciders())
                .await?;
        }
        self.read_on(&mut view, &read.departures, &self.keys.departures())
            .await?;
        // The current round and end marker: the newest of each, if it is
        // the current epoch's (a decider that has not yet written the next
        // epoch's round is not a record of this epoch).
        let (round, end) = (self.keys.round(view.epoch), self.keys.end(view.epoch));
        let notice = self.keys.notice(view.epoch);
        for kv in read.round.iter().chain(&read.end).chain(&read.notice) {
            if kv.key() == round.as_bytes()
                || kv.key() == end.as_bytes()
                || kv.key() == notice.as_bytes()
            {
                self.apply_put(&mut view, kv);
            }
        }
        // Every layout base, not only the current round's: a base written
        // at or before this read for a round committed after it reaches
        // this host by no watch event (issue 30: the third host of a job
        // missed its first round's base and formed the job again). Only
        // the current base and a writer's next one are there, a few MB at
        // 16,384 hosts, paged.
        self.read_on(&mut view, &read.layouts, &self.keys.layouts())
            .await?;
        view.stale = true;
        view.settle();
        Ok(view)
    }

    /// A page of the joining read into the view, and the rest of its
    /// range after it, paged at the view's revision.
    async fn read_on(
        &self,
        view: &mut View,
        page: &super::join_read::Page,
        prefix: &str,
    ) -> Result<(), CoordError> {
        for kv in &page.kvs {
            self.apply_put(view, kv);
        }
        if let Some(from) = super::join_read::after(page) {
            let revision = view.revision;
            super::paged::read_prefix_from(
                &self.endpoints,
                self.cfg.request_timeout,
                &self.client,
                prefix,
                from,
                revision,
                |kv| self.apply_put(view, kv),
            )
            .await?;
        }
        Ok(())
    }

    /// A key written: into the view. A value this version cannot read is
    /// logged and skipped, never fatal: it may be a newer version's.
    fn apply_put(&self, view: &mut View, kv: &KeyValue) {
        let key = key_text(kv);
        let Some(kind) = self.keys.classify(&key) else {
            return;
        };
        let parsed: Result<(), String> = match kind {
            // A host that does not decide keeps no member (its watch sends
            // none but deletions; this is a defence).
            KeyKind::Member(_) if !view.decider => Ok(()),
            KeyKind::Member(host) => serde_json::from_slice::<MemberRecord>(kv.value())
                .map_err(|e| e.to_string())
                .and_then(|record| {
                    // The rounds know a member by the host in its record, the
                    // view by its key: they must agree.
                    if record.host != host {
                        return Err(format!("the record names host {:?}", record.host));
                    }
                    if let Some(problem) = record.problem() {
                        // The key holds no usable member now: one it held
                        // before is gone with it.
                        if view.members.remove(host).is_some() {
                            view.member_changed(host);
                        }
                        return Err(problem);
                    }
                    view.members.insert(
                        host.to_owned(),
                        Member {
                            record,
                            lease: kv.lease(),
                            join_revision: kv.create_revision(),
                        },
                    );
                    view.member_changed(host);
                    Ok(())
                }),
            KeyKind::Epoch => std::str::from_utf8(kv.value())
                .map_err(|e| e.to_string())
                .and_then(|s| s.trim().parse::<u64>().map_err(|e| e.to_string()))
                .map(|e| {
                    // A host that does not decide does not watch the epoch
                    // key: it follows the round records (each written in the
                    // txn that moves the epoch). Only its load reads the key
                    // (as a decider's view until the deciders are known).
                    if view.decider {
                        view.epoch = e;
                        view.stale = true;
                    }
                }),
            KeyKind::Round(epoch) => serde_json::from_slice::<RoundRecord>(kv.value())
                .map_err(|e| e.to_string())
                .and_then(|r| {
                    if !view.decider && epoch > view.epoch {
                        view.epoch = epoch;
                        view.stale = true;
                        // Its watch leaves out deletions ([`open_watch`]):
                        // the rounds etcd no longer keeps go here.
                        view.forget_rounds_before(epoch.saturating_sub(KEEP_ROUNDS));
                    }
                    view.put_round(epoch, r).map_err(|e| e.to_string())
                }),
            KeyKind::LayoutChunk(base, chunk) => layout::read_chunk(kv.value())
                .map_err(|e| e.to_string())
                .and_then(|m| view.put_chunk(base, chunk, m).map_err(|e| e.to_string())),
            KeyKind::Departure(host) => serde_json::from_slice::<Departure>(kv.value())
                .map_err(|e| e.to_string())
                .map(|d| {
                    view.departed
                        .insert(host.to_owned(), (d.reason.clone(), d.at_ms));
                    view.departures.insert(host.to_owned(), d.reason);
                }),
            KeyKind::End(epoch) => serde_json::from_slice::<JobEnd>(kv.value())
                .map_err(|e| e.to_string())
                .map(|e| {
                    view.ends.insert(epoch, e);
                    view.end_revisions.insert(epoch, kv.mod_revision());
                }),
            KeyKind::Notice(epoch) => serde_json::from_slice(kv.value())
                .map_err(|e| e.to_string())
                .map(|n| {
                    view.notices.insert(epoch, n);
                    // One is in etcd; a few in memory at most.
                    while view.notices.len() > 4 {
                        view.notices.pop_first();
                    }
                }),
            // A host that does not decide keeps the deciders it watches
            // for; a decider has every member and needs no marker.
            KeyKind::Decider(_) => {
                if !view.decider {
                    view.deciders.extend(super::deciders::from_marker(
                        &self.keys,
                        kv.key(),
                        kv.value(),
                    ));
                }
                Ok(())
            }
            KeyKind::Other => Ok(()),
        };
        if let Err(problem) = parsed {
            tracing::warn!(
                job = %self.cfg.job,
                %key,
                %problem,
                "coord: unreadable value in etcd, ignored"
            );
        }
    }

    /// A key deleted (or expired with its lease): out of the view.
    fn apply_delete(&self, view: &mut View, key: &str) {
        match self.keys.classify(key) {
            // A host that does not decide keeps no member; it watches the
            // deciders' markers instead.
            Some(KeyKind::Member(_)) if !view.decider => {}
            Some(KeyKind::Decider(host)) => {
                if !view.decider {
                    view.recheck |= super::deciders::deleted(&mut view.deciders, host);
                }
            }
            Some(KeyKind::Member(host)) => {
                view.members.remove(host);
                view.member_changed(host);
            }
            Some(KeyKind::Epoch) => {
                if view.decider {
                    view.epoch = 0;
                    view.stale = true;
                }
            }
            Some(KeyKind::Round(epoch)) => {
                view.stale |= epoch == view.epoch;
                view.rounds.remove(&epoch);
                view.unresolved.remove(&epoch);
            }
            Some(KeyKind::LayoutChunk(base, chunk)) => {
                if let Some(chunks) = view.layouts.get_mut(base) {
                    chunks.remove(&chunk);
                    if chunks.is_empty() {
                        view.layouts.remove(base);
                    }
                }
            }
            Some(KeyKind::Departure(host)) => {
                view.departed.remove(host);
                view.departures.remove(host);
            }
            Some(KeyKind::End(epoch)) => {
                view.ends.remove(&epoch);
                view.end_revisions.remove(&epoch);
            }
            Some(KeyKind::Notice(epoch)) => {
                view.notices.remove(&epoch);
            }
            Some(KeyKind::Other) | None => {}
        }
    }

    /// Replaces the view and publishes it.
    pub(crate) fn set_view(&self, view: View) {
        *self.lock_view() = view;
        self.publish();
    }

    /// Publishes the view to everyone waiting on the coordinator; logs a
    /// new round once.
    pub(crate) fn publish(&self) {
        let (round, live, ended, notice) = {
            let mut guard = self.lock_view();
            let view = &mut *guard;
            view.settle();
            let lease = self.lease();
            let current = view.rounds.get(&view.epoch);
            let cache = &mut view.round_cache;
            let round = current.map(|r| {
                let mut round = match &*cache {
                    Some((epoch, l, cached)) if *epoch == r.epoch && *l == lease => cached.clone(),
                    _ => {
                        let made = Round::from_record(
                            &self.cfg.job,
                            r,
                            &self.cfg.host,
                            lease,
                            self.incarnation,
                        );
                        *cache = Some((r.epoch, lease, made.clone()));
                        made
                    }
                };
                // Who is on standby now, not when the round formed: a
                // spare that joins a full round makes no new one. (A host
                // that does not decide knows the round's own list only.)
                if view.decider {
                    round.standby = view.standing.standby();
                }
                round
            });
            let notice = view.notices.last_key_value().map(|(e, n)| (*e, n.clone()));
            (round, view.live_count(), view.ended().cloned(), notice)
        };
        self.state.send_modify(|s| {
            if let Some(r) = &round
                && s.round.as_ref().is_none_or(|old| old.epoch != r.epoch)
            {
                tracing::info!(
                    job = %self.cfg.job,
                    host = %self.cfg.host,
                    epoch = r.epoch,
                    node_rank = ?r.node_rank,
                    nnodes = r.nnodes,
                    world_size = r.world_size,
                    master = %format_args!("{}:{}", r.master_addr, r.master_port),
                    waiting = r.waiting,
                    members = %super::round::named_briefly(&r.members),
                    reason = %r.reason,
                    decided_by = %r.decided_by,
                    "coord: new round"
                );
            }
            s.round = round;
            s.live = live;
            s.ended = ended;
            s.notice = notice;
        });
    }

    /// Marks the coordinator failed (the lease is lost): every waiter gets
    /// the error; the tasks stop.
    pub(crate) fn fail(&self, err: CoordError) {
        tracing::error!(job = %self.cfg.job, host = %self.cfg.host, error = %err, "coord: failed");
        self.state.send_modify(|s| {
            if s.failed.is_none() {
                s.failed = Some(err);
            }
        });
        self.stop.cancel();
    }

    /// Tries to advance the epoch from `expected` to `expected + 1`, with
    /// the round [`plan::assign`] makes of this host's view, in one txn whose
    /// compare on the epoch key lets exactly one host win.
    ///
    /// The record carries its members as a delta from the current layout
    /// base ([`layout`]): a few bytes when the members are the same or
    /// changed a little. When the delta would be long, or there is no base,
    /// this host first writes a new base in chunks (each its own put: a
    /// base of thousands of hosts is over etcd's request limit in one), then
    /// the txn, which also deletes every older base. A host that loses the
    /// race deletes the base it wrote.
    pub(crate) async fn advance(
        &self,
        expected: u64,
        reason: String,
        heal: bool,
    ) -> Result<Advance, CoordError> {
        let next = expected + 1;
        let (mut record, new_base) = {
            let view = self.lock_view();
            if view.epoch != expected {
                return Ok(Advance::Stale(view.epoch));
            }
            let live = view.live();
            if !view.decider && view.current().is_none_or(|r| r.waiting) {
                // No round to restart: the deciders make the first.
                return Ok(Advance::Stale(view.epoch));
            }
            let mut assignment = plan::assign(view.current(), &live, self.limits);
            if !view.decider {
                assignment.standby = view
                    .current()
                    .map(|r| r.standby.clone())
                    .unwrap_or_default();
            }
            let mut record = plan::record(
                next,
                assignment,
                self.limits,
                reason,
                self.cfg.host.clone(),
                now_ms(),
            );
            record.heal = heal;
            let delta = view
                .current()
                .and_then(|r| r.layout.as_ref())
                .and_then(|l| Some((l, view.base_members(l).ok()??)))
                .map(|(l, base)| (l, layout::delta(&base, &record.members)))
                .filter(|(_, d)| d.len() <= layout::MAX_SEGMENTS);
            let (layout, new_base) = if record.members.is_empty() {
                (None, None)
            } else if let Some((l, segments)) = delta {
                (
                    Some(LayoutRef {
                        base: l.base.clone(),
                        chunks: l.chunks,
                        len: l.len,
                        segments,
                    }),
                    None,
                )
            } else {
                let base = Keys::layout_base(next, &self.cfg.host);
                let chunks = layout::chunks(&record.members).map_err(|e| CoordError::Corrupt {
                    key: self.keys.layout(&base),
                    problem: format!("cannot encode the layout: {e}"),
                })?;
                let len = u32::try_from(record.members.len()).unwrap_or(u32::MAX);
                (
                    Some(LayoutRef {
                        base: base.clone(),
                        chunks: u32::try_from(chunks.len()).unwrap_or(u32::MAX),
                        len,
                        segments: vec![layout::Segment::Base { from: 0, len }],
                    }),
                    Some((base, chunks)),
                )
            };
            record.layout = layout;
            (record, new_base)
        };
        if record.layout.is_some() {
            // Stored without its members: they are the layout's.
            record.members = Vec::new();
        }
        let round_key = self.keys.round(next);
        let json = serde_json::to_string(&record).map_err(|e| CoordError::Corrupt {
            key: round_key.clone(),
            problem: format!("cannot encode the round: {e}"),
        })?;
        if new_base.is_some() {
            match self.claim_base(expected).await? {
                Claim::Mine => {}
                Claim::Theirs(holder) => {
                    tracing::debug!(job = %self.cfg.job, host = %self.cfg.host, epoch = next, %holder, "coord: another host writes the round's layout base");
                    return Ok(Advance::Claimed);
                }
                Claim::EpochMoved => return Ok(Advance::LostRace),
            }
        }
        if let Some((base, chunks)) = &new_base
            && let Err(e) = self.put_base(base, chunks).await
        {
            self.forget_base(base, next).await;
            return Err(e);
        }
        let epoch_key = self.keys.epoch();
        let compare = self.epoch_is(expected);
        let mut ops = vec![
            TxnOp::put(epoch_key.as_str(), next.to_string(), None),
            TxnOp::put(round_key.as_str(), json, None),
        ];
        if new_base.is_some() {
            // Every older base: the new round names this one, and the
            // rounds kept for people before it keep their headers only.
            ops.push(TxnOp::delete(
                self.keys.layouts(),
                // `layouts/<next:020>` sorts before this round's own
                // `layouts/<next:020>-<host>/...`: those stay.
                Some(DeleteOptions::new().with_range(format!("{}{next:020}", self.keys.layouts()))),
            ));
            // Every older round's claim; this round's stays (under this
            // host's lease), so a decider whose view still lags finds it
            // held, and the next round that writes a base deletes it.
            ops.push(TxnOp::delete(
                self.keys.base_claim(0),
                Some(DeleteOptions::new().with_range(self.keys.base_claim(next))),
            ));
        }
        if next > KEEP_ROUNDS {
            let oldest = next - KEEP_ROUNDS;
            ops.push(TxnOp::delete(
                self.keys.round(0),
                Some(DeleteOptions::new().with_range(self.keys.round(oldest))),
            ));
            ops.push(TxnOp::delete(
                self.keys.end(0),
                Some(DeleteOptions::new().with_range(self.keys.end(oldest))),
            ));
        }
        let txn = Txn::new().when([compare]).and_then(ops);
        let mut client = self.client.clone();
        let resp = self
            .call("txn (advance epoch)", &epoch_key, client.txn(txn))
            .await;
        // Only a txn known to have failed frees its base: one that went
        // unanswered (a leader lost mid-way) may have committed, and then
        // its round names this base.
        let lost = matches!(&resp, Ok(r) if !r.succeeded());
        if lost && let Some((base, _)) = &new_base {
            self.forget_base(base, next).await;
        }
        if resp?.succeeded() {
            tracing::debug!(job = %self.cfg.job, host = %self.cfg.host, epoch = next, reason = %record.reason, new_base = new_base.is_some(), "coord: advanced the epoch");
            Ok(Advance::Advanced(next))
        } else {
            Ok(Advance::LostRace)
        }
    }

    /// Writes a layout base's chunks, one put each.
    async fn put_base(&self, base: &str, chunks: &[Vec<u8>]) -> Result<(), CoordError> {
        for (i, chunk) in chunks.iter().enumerate() {
            let key = self
                .keys
                .layout_chunk(base, u32::try_from(i).unwrap_or(u32::MAX));
            let mut client = self.client.clone();
            self.call(
                "put (layout)",
                &key,
                client.put(key.as_str(), chunk.as_slice(), None),
            )
            .await?;
        }
        Ok(())
    }

    /// The compare that holds while the epoch is still `expected`.
    fn epoch_is(&self, expected: u64) -> Compare {
        let epoch_key = self.keys.epoch();
        if expected == 0 {
            Compare::version(epoch_key.as_str(), CompareOp::Equal, 0)
        } else {
            Compare::value(epoch_key.as_str(), CompareOp::Equal, expected.to_string())
        }
    }

    /// Claims the writing of the layout base of the round after `expected`,
    /// in one txn: while the epoch is still `expected`, create-if-absent,
    /// under this host's lease.
    ///
    /// Why: every host receives every base (a 0.23 MB base to each of
    /// 2,048 hosts is 0.47 GB through etcd), and the writers' line alone
    /// let a second decider write its own base when the first's had not
    /// reached it within its turn (the fan-out of that base to every host
    /// is what delays it), or when its view had not yet seen the round the
    /// first one wrote (a watch through a lagging member): both seen at
    /// 2,048 hosts (issue 30). A tiny claim reaches etcd before any base
    /// does, and the epoch's compare turns away a writer that lags. A
    /// claim holder that dies takes its claim with its lease, and the next
    /// decider in line claims in its place.
    async fn claim_base(&self, expected: u64) -> Result<Claim, CoordError> {
        let key = self.keys.base_claim(expected + 1);
        let epoch_key = self.keys.epoch();
        let txn = Txn::new()
            .when([
                self.epoch_is(expected),
                Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::put(
                key.as_str(),
                self.cfg.host.as_str(),
                Some(PutOptions::new().with_lease(self.lease())),
            )])
            .or_else([
                TxnOp::get(epoch_key.as_str(), None),
                TxnOp::get(key.as_str(), None),
            ]);
        let mut client = self.client.clone();
        let resp = self
            .call("txn (claim the layout base)", &key, client.txn(txn))
            .await?;
        if resp.succeeded() {
            return Ok(Claim::Mine);
        }
        let mut reads = resp.op_responses().into_iter().filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(
                g.kvs()
                    .first()
                    .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
            ),
            _ => None,
        });
        let (epoch, holder) = (reads.next().flatten(), reads.next().flatten());
        let moved = match epoch {
            None => expected != 0,
            Some(e) => e != expected.to_string(),
        };
        Ok(match holder {
            _ if moved => Claim::EpochMoved,
            Some(h) if h == self.cfg.host => Claim::Mine,
            Some(h) => Claim::Theirs(h),
            // Gone between the compare and the read (its lease expired):
            // the next try claims it.
            None => Claim::Theirs(String::from("(a host whose claim just expired)")),
        })
    }

    /// Deletes a base this host wrote for the round of `epoch` that it did
    /// not make, and its claim to write that round's base, so that the
    /// next writer in line need not wait for this host's lease; a failure
    /// only leaves them for the next new base's txn to delete.
    async fn forget_base(&self, base: &str, epoch: u64) {
        let claim = self.keys.base_claim(epoch);
        let mut client = self.client.clone();
        let mine = Txn::new()
            .when([Compare::value(
                claim.as_str(),
                CompareOp::Equal,
                self.cfg.host.as_str(),
            )])
            .and_then([TxnOp::delete(claim.as_str(), None)]);
        if let Err(e) = self
            .call("txn (drop the claim)", &claim, client.txn(mine))
            .await
        {
            tracing::debug!(host = %self.cfg.host, %base, error = %e, "coord: could not drop the claim to write a layout base");
        }
        let prefix = self.keys.layout(base);
        let mut client = self.client.clone();
        let deleted = self
            .call(
                "delete (layout)",
                &prefix,
                client.delete(prefix.as_str(), Some(DeleteOptions::new().with_prefix())),
            )
            .await;
        if let Err(e) = deleted {
            tracing::debug!(host = %self.cfg.host, %base, error = %e, "coord: could not delete an unused layout base");
        }
    }

    /// The epoch as etcd has it now.
    pub(crate) async fn read_epoch(&self) -> Result<u64, CoordError> {
        let key = self.keys.epoch();
        let mut client = self.client.clone();
        let resp = self
            .call("get", &key, client.get(key.as_str(), None))
            .await?;
        match resp.kvs().first() {
            None => Ok(0),
            Some(kv) => std::str::from_utf8(kv.value())
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(|| CoordError::Corrupt {
                    key: key.clone(),
                    problem: format!("not an epoch: {:?}", String::from_utf8_lossy(kv.value())),
                }),
        }
    }

    /// Says in etcd that this host decides rounds: its marker
    /// (`deciders/<host>`, its member key's create revision) under its
    /// lease, which joining hosts read to learn the deciders in O(1)
    /// ([`super::deciders`]). Best effort: a marker that is not written
    /// leaves the set short, and a joining host that finds fewer than half
    /// of them reads the first hosts by join instead.
    pub(crate) async fn mark_decider(&self) {
        let key = self.keys.decider(&self.cfg.host);
        let joined = self.joined_at.load(Ordering::Acquire).to_string();
        let lease = self.lease();
        let mut client = self.client.clone();
        let put = client.put(
            key.as_str(),
            joined,
            Some(PutOptions::new().with_lease(lease)),
        );
        if let Err(e) = self.call("put (decider's marker)", &key, put).await {
            tracing::warn!(host = %self.cfg.host, error = %e, "coord: could not mark this host as one that decides rounds; joining hosts read who decides the slower way");
        }
    }

    /// Registers this host under its lease, unless a live launcher holds
    /// the host id: then waits for its key to go, up to `join_timeout`.
    /// The same txn reads the job ([`super::join_read`]): what it returns,
    /// at the revision of the registration. A txn etcd does not answer is
    /// asked again ([`super::patience`]); one whose answer was lost but
    /// which wrote the key is known by the key's lease, this launcher's
    /// own ([`Registered::Earlier`]).
    pub(crate) async fn register(&self) -> Result<Registered, CoordError> {
        let key = self.keys.member(&self.cfg.host);
        let json = self.member_json(&key)?;
        let lease = self.lease();
        let started = Instant::now();
        let mut told = false;
        let mut patience = super::patience::Patience::new(self.cfg.rejoin_timeout);
        loop {
            let mut ops = vec![
                TxnOp::put(
                    key.as_str(),
                    json.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::delete(self.keys.departure(&self.cfg.host), None),
            ];
            let writes = ops.len();
            // The reads see the writes before them: this host's own
            // member key is among the first by join if it is one of them.
            ops.extend(super::join_read::ops(&self.keys));
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then(ops)
                .or_else([TxnOp::get(key.as_str(), None)]);
            let mut kv = self
                .client
                .kv_client()
                .max_decoding_message_size(super::paged::RECEIVE_LIMIT);
            let resp = match self.call("txn (register member)", &key, kv.txn(txn)).await {
                Ok(resp) => resp,
                Err(e) => {
                    let wait = patience.again(e.clone())?;
                    tracing::warn!(host = %self.cfg.host, %key, error = %e, ?wait, "coord: etcd did not answer the register txn; asking again");
                    tokio::select! {
                        () = self.stop.cancelled() => return Err(self.stopped_error()),
                        () = sleep(wait) => {}
                    }
                    continue;
                }
            };
            if resp.succeeded() {
                // The txn's revision is the member key's create revision.
                let revision = resp.header().map_or(0, |h| h.revision());
                self.joined_at.store(revision, Ordering::Release);
                let read = JoinRead::parse(resp.op_responses(), writes).map_err(|e| {
                    CoordError::Corrupt {
                        key: key.clone(),
                        problem: e.to_string(),
                    }
                })?;
                return Ok(Registered::Now(Box::new(read), revision));
            }
            let holder = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                    let addr = serde_json::from_slice::<MemberRecord>(kv.value())
                        .map_or_else(|_| "?".to_owned(), |m| m.addr);
                    (addr, kv.lease(), kv.create_revision())
                }),
                _ => None,
            });
            if let Some((_, holder_lease, created)) = &holder
                && *holder_lease == lease
            {
                // An earlier attempt of this launcher's wrote it (the lease
                // is this launcher's alone); its answer was lost.
                tracing::info!(host = %self.cfg.host, %key, retried = patience.retried(), "coord: registered by an attempt whose answer was lost");
                self.joined_at.store(*created, Ordering::Release);
                return Ok(Registered::Earlier);
            }
            let holder = holder.map(|(addr, lease, _)| (addr, lease));
            let waited = started.elapsed();
            if let Some((holder_addr, holder_lease)) = holder
                && waited >= self.cfg.join_timeout
            {
                return Err(CoordError::HostTaken {
                    host: self.cfg.host.clone(),
                    key,
                    holder_addr,
                    holder_lease,
                    waited,
                });
            }
            if !told {
                told = true;
                tracing::info!(job = %self.cfg.job, host = %self.cfg.host, %key, "coord: host id still held (a previous launcher's lease?); waiting");
            }
            tokio::select! {
                () = self.stop.cancelled() => return Err(self.stopped_error()),
                () = sleep(Duration::from_millis(250)) => {}
            }
        }
    }

    /// This launcher's member record, encoded.
    fn member_json(&self, key: &str) -> Result<String, CoordError> {
        let record = MemberRecord {
            host: self.cfg.host.clone(),
            addr: self.cfg.addr.clone(),
            nproc_per_node: self.cfg.nproc_per_node,
            spare: self.cfg.spare,
            min_nodes: self.cfg.min_nodes,
            max_nodes: self.cfg.max_nodes,
            pid: std::process::id(),
            joined_at_ms: now_ms(),
            ckpt_peer: self.cfg.ckpt_peer.clone(),
            incarnation: self.incarnation,
            ckpt_ring_by_place: self.cfg.ckpt_ring_by_place,
            ckpt_replicas: self.cfg.ckpt_replicas,
        };
        serde_json::to_string(&record).map_err(|e| CoordError::Corrupt {
            key: key.to_owned(),
            problem: format!("cannot encode the member record: {e}"),
        })
    }

    /// Grants a lease of the configured TTL.
    pub(crate) async fn grant(&self) -> Result<i64, CoordError> {
        let mut client = self.client.clone();
        let key = self.keys.member(&self.cfg.host);
        self.call(
            "lease grant",
            &key,
            client.lease_grant(self.cfg.ttl_secs(), None),
        )
        .await
        .map(|r| r.id())
    }

    /// Regains membership after etcd expired this launcher's lease: a new
    /// lease, and the member key written again under it with the same
    /// incarnation, so the current round still counts this host in and
    /// its workers go on. Fails for good ([`RejoinError::Final`]) only on
    /// a real conflict: another launcher holds the host id, or the job
    /// ended; an etcd error is worth another try.
    async fn rejoin(&self) -> Result<i64, RejoinError> {
        if self.stop.is_cancelled() {
            // Leaving: nothing to regain (the caller's wait sees the stop).
            return Err(RejoinError::Retry(self.stopped_error()));
        }
        let key = self.keys.member(&self.cfg.host);
        let ended = {
            let view = self.lock_view();
            view.ends.get(&view.epoch).cloned()
        };
        if let Some(end) = ended {
            return Err(RejoinError::Final(CoordError::Ended {
                job: self.cfg.job.clone(),
                by: end.by,
                outcome: end.outcome,
                reason: end.reason,
                exit_code: end.exit_code,
            }));
        }
        let lease = self.grant().await.map_err(RejoinError::Retry)?;
        let json = self.member_json(&key).map_err(RejoinError::Final)?;
        let put = || {
            TxnOp::put(
                key.as_str(),
                json.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            )
        };
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([put()])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let mut client = self.client.clone();
        let resp = self
            .call("txn (re-register member)", &key, client.txn(txn))
            .await
            .map_err(RejoinError::Retry)?;
        let mut joined_at = resp.header().map_or(0, |h| h.revision());
        if !resp.succeeded() {
            let holder = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                    let record = serde_json::from_slice::<MemberRecord>(kv.value()).ok();
                    joined_at = kv.create_revision();
                    (record, kv.lease(), kv.mod_revision())
                }),
                _ => None,
            });
            match holder {
                // An earlier attempt of ours got through (its answer was
                // lost): write it again under this lease, if unchanged.
                Some((Some(r), _, rev)) if r.incarnation == self.incarnation => {
                    let txn = Txn::new()
                        .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, rev)])
                        .and_then([put()]);
                    let ok = self
                        .call("txn (re-register member)", &key, client.txn(txn))
                        .await
                        .map_err(RejoinError::Retry)?
                        .succeeded();
                    if !ok {
                        return Err(RejoinError::Retry(CoordError::Corrupt {
                            key: key.clone(),
                            problem: "the member key changed while rejoining".into(),
                        }));
                    }
                }
                Some((record, holder_lease, _)) => {
                    return Err(RejoinError::Final(CoordError::HostTaken {
                        host: self.cfg.host.clone(),
                        key: key.clone(),
                        holder_addr: record.map_or_else(|| "?".to_owned(), |r| r.addr),
                        holder_lease,
                        waited: Duration::ZERO,
                    }));
                }
                // Gone between the compare and the get: try again.
                None => {
                    return Err(RejoinError::Retry(CoordError::Corrupt {
                        key: key.clone(),
                        problem: "the member key vanished while rejoining".into(),
                    }));
                }
            }
        }
        self.joined_at.store(joined_at, Ordering::Release);
        self.lock_view().joined_at = joined_at;
        let old = self.lease.swap(lease, Ordering::AcqRel);
        tracing::warn!(
            job = %self.cfg.job,
            host = %self.cfg.host,
            old_lease = %format_args!("{old:x}"),
            new_lease = %format_args!("{lease:x}"),
            "coord: rejoined the job under a new lease (the old one expired in etcd); workers kept running"
        );
        self.state.send_modify(|s| {
            s.rejoins += 1;
            s.lease_lapsed = None;
        });
        self.publish();
        // The marker went with the old lease.
        if self.decides.load(Ordering::Acquire) {
            self.mark_decider().await;
        }
        Ok(lease)
    }

    /// The error to give once the tasks have stopped: the failure if there
    /// was one.
    pub(crate) fn stopped_error(&self) -> CoordError {
        self.state
            .borrow()
            .failed
            .clone()
            .unwrap_or_else(|| CoordError::Stopped {
                host: self.cfg.host.clone(),
            })
    }
}

/// Why a rejoin attempt failed.
enum RejoinError {
    /// etcd did not answer or refused for now: try again.
    Retry(CoordError),
    /// A real conflict: out of the job.
    Final(CoordError),
}

/// What came of one keep-alive stream.
enum Stream {
    /// Stopped (the coordinator left or dropped).
    Stopped,
    /// etcd says the lease expired.
    Expired(&'static str),
    /// The stream failed or no answer came before the lease's end by this
    /// host's clock: open another.
    Broken,
}

/// Keeps the membership alive until stopped.
///
/// A keep-alive every third of the TTL. When none is answered for a whole
/// TTL (counted from when the last answered one was sent, so this host
/// never believes in its lease longer than etcd does) the lease has lapsed
/// by this host's clock: that is logged, the workers keep running, and the
/// keeper keeps trying. etcd back with the lease alive (an etcd restarted on
/// its data keeps its leases): nothing happened. etcd says the lease expired:
/// [`Inner::rejoin`] grants a new lease and re-registers, same incarnation,
/// same place in the round. Only after `rejoin_timeout` without regaining
/// the membership, or on a real conflict (another launcher took the host
/// id, the job ended), is the coordinator failed with the lease lost.
pub(crate) async fn keep_lease(inner: Arc<Inner>, granted_at: Instant) {
    let ttl = inner.cfg.lease_ttl;
    let retry = (ttl / 3).min(Duration::from_millis(200));
    let mut expires = granted_at + ttl;
    // Since when the membership is in doubt (the lease lapsed by our clock,
    // or etcd said it expired), and whether that was said in the log.
    let mut doubt: Option<Instant> = None;
    let mut expired_in_etcd = false;
    let mut route = LeaseRoute::new(&inner.cfg.endpoints, &inner.cfg.host);
    loop {
        let now = Instant::now();
        if doubt.is_none() && (now >= expires || expired_in_etcd) {
            doubt = Some(now);
            tracing::warn!(
                job = %inner.cfg.job,
                host = %inner.cfg.host,
                lease = %format_args!("{:x}", inner.lease()),
                endpoints = %inner.endpoints,
                rejoin_timeout = ?inner.cfg.rejoin_timeout,
                "coord: membership lease lapsed (no keep-alive answered for a TTL, or etcd expired it); \
                 workers keep running; keeping or regaining it"
            );
            let why = if expired_in_etcd {
                "etcd expired it".to_owned()
            } else {
                format!(
                    "no keep-alive answered for {ttl:?} by etcd at {}",
                    inner.endpoints
                )
            };
            inner.state.send_modify(|s| s.lease_lapsed = Some(why));
        }
        if let Some(since) = doubt
            && now.duration_since(since) >= inner.cfg.rejoin_timeout
        {
            inner.fail(CoordError::LeaseLost {
                host: inner.cfg.host.clone(),
                lease: inner.lease(),
                reason: format!(
                    "not regained within {:?} (etcd at {})",
                    inner.cfg.rejoin_timeout, inner.endpoints
                ),
            });
            return;
        }
        if expired_in_etcd {
            match inner.rejoin().await {
                // Left (or dropped) while rejoining: the new lease must not
                // keep a member key of a launcher that is gone.
                Ok(lease) if inner.stop.is_cancelled() => {
                    let mut client = inner.client.clone();
                    let key = format!("lease {lease:x}");
                    let _ = inner
                        .call("lease revoke", &key, client.lease_revoke(lease))
                        .await;
                    return;
                }
                Ok(_) => {
                    expired_in_etcd = false;
                    doubt = None;
                    expires = Instant::now() + ttl;
                }
                Err(RejoinError::Final(e)) => {
                    inner.fail(e);
                    return;
                }
                Err(RejoinError::Retry(e)) => {
                    tracing::warn!(host = %inner.cfg.host, error = %e, "coord: rejoin attempt failed; retrying");
                    tokio::select! {
                        () = inner.stop.cancelled() => return,
                        () = sleep(retry) => {}
                    }
                }
            }
            continue;
        }
        match keep_alive_stream(&inner, &mut expires, &mut doubt, &mut route).await {
            Stream::Stopped => return,
            Stream::Expired(how) => {
                tracing::warn!(host = %inner.cfg.host, lease = %format_args!("{:x}", inner.lease()), "coord: etcd says the lease expired ({how}); rejoining");
                expired_in_etcd = true;
            }
            Stream::Broken => {
                tokio::select! {
                    () = inner.stop.cancelled() => return,
                    () = sleep(retry) => {}
                }
            }
        }
    }
}

/// One keep-alive stream on the current lease, through the endpoint
/// `route` is at, until it breaks or leaves a keep-alive unanswered for
/// [`LeaseRoute::answer_wait`] (then `route` moves to the next endpoint,
/// [`super::lease_route`]): each answered keep-alive moves `expires`, and
/// the first one after a doubt clears it (logged).
async fn keep_alive_stream(
    inner: &Inner,
    expires: &mut Instant,
    doubt: &mut Option<Instant>,
    route: &mut LeaseRoute,
) -> Stream {
    let ttl = inner.cfg.lease_ttl;
    let interval = ttl / 3;
    let deadline = answer_deadline(ttl, inner.cfg.request_timeout);
    let lease = inner.lease();
    let give_up = |route: &mut LeaseRoute, why: &str| {
        tracing::debug!(host = %inner.cfg.host, endpoint = %route.endpoint(), %why, "coord: lease keep-alive stream given up; the next one goes to the next endpoint");
        route.move_on();
        Stream::Broken
    };
    let client = tokio::select! {
        () = inner.stop.cancelled() => return Stream::Stopped,
        c = route.client(&inner.client, &inner.cfg.access, deadline, ttl) => c,
    };
    let mut client = match client {
        Ok(c) => c,
        Err(e) => return give_up(route, &e.to_string()),
    };
    let mut renewed = |expires: &mut Instant, sent: Instant, granted: Duration| {
        *expires = sent + granted;
        if let Some(since) = doubt.take() {
            tracing::warn!(
                job = %inner.cfg.job,
                host = %inner.cfg.host,
                lease = %format_args!("{lease:x}"),
                in_doubt = ?since.elapsed(),
                "coord: membership lease kept: etcd answered again and still has it"
            );
            inner.state.send_modify(|s| s.lease_lapsed = None);
        }
    };
    let sent = Instant::now();
    let wait = route.answer_wait(sent, *expires, ttl, inner.cfg.request_timeout);
    let opened = tokio::select! {
        () = inner.stop.cancelled() => return Stream::Stopped,
        r = tokio::time::timeout(wait, client.lease_keep_alive(lease)) => r,
    };
    let (mut keeper, mut stream) = match opened {
        // Opening sends one keep-alive and checks its answer.
        Ok(Ok(pair)) => {
            renewed(expires, sent, ttl);
            if route.can_move() {
                let endpoint = route.endpoint().to_owned();
                inner.state.send_if_modified(|s| {
                    let changed = s.lease_endpoint.as_deref() != Some(endpoint.as_str());
                    s.lease_endpoint = Some(endpoint);
                    changed
                });
            }
            pair
        }
        Ok(Err(etcd_client::Error::LeaseKeepAliveError(msg))) if msg.contains("not found") => {
            return Stream::Expired("lease not found");
        }
        Ok(Err(e)) => return give_up(route, &e.to_string()),
        Err(_) => return give_up(route, "the stream's first keep-alive went unanswered"),
    };
    loop {
        tokio::select! {
            () = inner.stop.cancelled() => return Stream::Stopped,
            () = sleep(interval) => {}
        }
        let sent = Instant::now();
        // A live member answers in milliseconds, one under load in seconds;
        // one that has not answered when a third of the TTL is left is
        // paused or gone: the next stream goes elsewhere while the lease
        // still runs (a doubt is decided by the caller).
        let wait = route.answer_wait(sent, *expires, ttl, inner.cfg.request_timeout);
        let answer = tokio::select! {
            () = inner.stop.cancelled() => return Stream::Stopped,
            () = sleep_until(sent + wait) => {
                return give_up(route, "a keep-alive went unanswered");
            }
            r = async {
                keeper.keep_alive().await?;
                stream.message().await
            } => r,
        };
        match answer {
            Ok(Some(resp)) if resp.ttl() > 0 => {
                let granted = u64::try_from(resp.ttl()).unwrap_or(0);
                renewed(expires, sent, Duration::from_secs(granted));
            }
            Ok(Some(_)) => return Stream::Expired("keep-alive answered TTL 0"),
            Ok(None) | Err(_) => return give_up(route, "the stream ended"),
        }
    }
}

/// The driver: watches the job's keys from `revision + 1`, keeps the view
/// and the published state current, and writes the rounds that
/// [`plan::decide`] says are due (at once, or after the last call).
///
/// A host that decides rounds watches the job's whole prefix; any other
/// watches it without the member keys' puts ([`open_watch`]), and asks
/// again who decides when half the deciders it knew are gone.
pub(crate) async fn drive(inner: Arc<Inner>, revision: i64) {
    let mut driver = Driver::default();
    // How far each watched prefix has been seen ([`watched`], then every
    // other key). A decider's one watch moves them together.
    let mut seen = [revision; WATCHED + 1];
    let prefixes = watched(&inner.keys);
    let ttl = inner.cfg.lease_ttl;
    // With several endpoints the watch goes through one member at a time
    // and leaves it when it stops answering (issue 30: a round took 12 s
    // for a host whose watch was on a paused member): after `deadline` of
    // silence the stream is asked for its progress, and a member that
    // does not answer that within the request deadline (`answer_wait`, at
    // least `deadline`) is left; the watch opens again on the next
    // endpoint from what was seen, so no event is lost. The answer gets
    // the whole request deadline, not a sixth of the TTL: a member only
    // slow under load (2,048 hosts on 3 members at load 16-23) must not be
    // left, since the next member then sends everything since the last
    // revision again, adding to the load that slowed the first. With one endpoint there is nowhere to go: no probe, the
    // shared client, the request deadline, as before.
    let deadline = answer_deadline(ttl, inner.cfg.request_timeout);
    let answer_wait = inner.cfg.request_timeout.max(deadline);
    let mut route = LeaseRoute::new(&inner.cfg.endpoints, &inner.cfg.host);
    let open_limit = if route.can_move() {
        deadline
    } else {
        inner.cfg.request_timeout
    };
    loop {
        let decider = inner.lock_view().decider;
        let client = tokio::select! {
            () = inner.stop.cancelled() => return,
            c = route.client(&inner.client, &inner.cfg.access, deadline, ttl) => c,
        };
        let base = inner.keys.base().to_owned();
        let watched = match client {
            Ok(client) => {
                // A round record of thousands of hosts is larger than gRPC's
                // default 4 MiB once etcd batches a few into one message.
                let mut client = client
                    .watch_client()
                    .max_decoding_message_size(super::paged::RECEIVE_LIMIT);
                tokio::select! {
                    () = inner.stop.cancelled() => return,
                    r = super::bounded::call(
                        &inner.endpoints,
                        open_limit,
                        "watch",
                        &base,
                        open_watch(&mut client, &inner.keys, decider, seen),
                    ) => r,
                }
            }
            Err(e) => Err(e),
        };
        let mut stream = match watched {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(host = %inner.cfg.host, endpoint = %route.endpoint(), error = %e, "coord: cannot watch; retrying on the next endpoint");
                route.move_on();
                tokio::select! {
                    () = inner.stop.cancelled() => return,
                    () = sleep(Duration::from_millis(200)) => {}
                }
                continue;
            }
        };
        if route.can_move() {
            let endpoint = route.endpoint().to_owned();
            inner.state.send_if_modified(|s| {
                let changed = s.watch_endpoint.as_deref() != Some(endpoint.as_str());
                s.watch_endpoint = Some(endpoint);
                changed
            });
        }
        // When the stream was last heard from, and when it was asked for
        // its progress since.
        let mut heard = Instant::now();
        let mut asked: Option<Instant> = None;
        // Evaluate once on (re)start: the view may already call for a round.
        driver.evaluate(&inner).await;
        loop {
            let wake = driver.wake;
            let check = route.can_move().then(|| match asked {
                Some(at) => at + answer_wait,
                None => heard + deadline,
            });
            let message = tokio::select! {
                () = inner.stop.cancelled() => return,
                () = sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => None,
                () = sleep_until(check.unwrap_or_else(Instant::now)), if check.is_some() => {
                    if asked.is_some() {
                        tracing::warn!(host = %inner.cfg.host, endpoint = %route.endpoint(), unanswered = ?answer_wait, "coord: the watch's member does not answer; watching on the next endpoint from the last revision seen");
                        route.move_on();
                        break;
                    }
                    if stream.request_progress().await.is_err() {
                        route.move_on();
                        break;
                    }
                    asked = Some(Instant::now());
                    continue;
                }
                m = stream.message() => {
                    heard = Instant::now();
                    asked = None;
                    Some(m)
                }
            };
            match message {
                None => {}
                Some(Ok(Some(resp))) => {
                    if resp.canceled() || resp.compact_revision() > 0 {
                        // History compacted past us: read the current state
                        // again (paged, so it fits however large the job) and
                        // watch on from there, never from the compacted
                        // revision again.
                        tracing::warn!(host = %inner.cfg.host, compact_revision = resp.compact_revision(), reason = %resp.cancel_reason(), "coord: watch cancelled; reloading");
                        let Some(view) = reload(&inner).await else {
                            return;
                        };
                        seen = [view.revision; WATCHED + 1];
                        inner.set_view(view);
                        break;
                    }
                    if !resp.events().is_empty() {
                        let recheck = {
                            let mut view = inner.lock_view();
                            for event in resp.events() {
                                let Some(kv) = event.kv() else { continue };
                                let range = range_of(&prefixes, kv.key());
                                seen[range] = seen[range].max(kv.mod_revision());
                                match event.event_type() {
                                    EventType::Put => inner.apply_put(&mut view, kv),
                                    EventType::Delete => {
                                        inner.apply_delete(&mut view, &key_text(kv))
                                    }
                                }
                            }
                            view.revision = seen.iter().copied().max().unwrap_or(0);
                            let epoch = view.epoch;
                            view.rounds.retain(|e, _| *e >= epoch);
                            view.unresolved.retain(|e, _| *e >= epoch);
                            view.ends.retain(|e, _| *e >= epoch);
                            view.end_revisions.retain(|e, _| *e >= epoch);
                            view.settle();
                            std::mem::take(&mut view.recheck)
                        };
                        inner.publish();
                        if recheck {
                            match deciders_again(&inner).await {
                                Recheck::Stopped => return,
                                Recheck::Same => {}
                                Recheck::Decides(view) => {
                                    seen = [view.revision; WATCHED + 1];
                                    inner.set_view(*view);
                                    break;
                                }
                            }
                        }
                    }
                }
                Some(Ok(None)) | Some(Err(_)) => {
                    tracing::warn!(host = %inner.cfg.host, endpoint = %route.endpoint(), "coord: watch ended; re-watching on the next endpoint");
                    route.move_on();
                    tokio::select! {
                        () = inner.stop.cancelled() => return,
                        () = sleep(Duration::from_millis(100)) => {}
                    }
                    break;
                }
            }
            driver.evaluate(&inner).await;
        }
    }
}

/// The prefixes a host that does not decide watches, each its own watch
/// on one stream: the departures, the end markers, the layout bases, the
/// deciders' markers and the round records. Not the member keys (issue
/// 30: even with etcd's `NOPUT` filter, every join was matched against
/// every such host's watch in etcd, O(N) per join; a lost host that does
/// not decide was an event on every host): a host that does not decide
/// only needs the deciders' loss, and their markers go with their leases.
/// Not the epoch key:
/// such a host follows the round records, so a round's txn is one event
/// for it, not two.
fn watched(keys: &Keys) -> [String; WATCHED] {
    [
        keys.departures(),
        keys.ends(),
        keys.layouts(),
        keys.deciders(),
        keys.rounds(),
        keys.notices(),
    ]
}

/// How many prefixes [`watched`] names.
const WATCHED: usize = 6;

/// Which of the [`watched`] prefixes `key` is under; [`WATCHED`] for any
/// other key (the epoch key, which only a decider watches).
fn range_of(watched: &[String; WATCHED], key: &[u8]) -> usize {
    watched
        .iter()
        .position(|p| key.starts_with(p.as_bytes()))
        .unwrap_or(WATCHED)
}

/// Opens the job's watch, each range from after what was `seen` of it.
/// A decider: one watch of the whole prefix. Any other host: the
/// [`watched`] prefixes, no member key, so that a host joining costs it
/// nothing (issue 30).
async fn open_watch(
    client: &mut etcd_client::WatchClient,
    keys: &Keys,
    decider: bool,
    seen: [i64; WATCHED + 1],
) -> Result<etcd_client::WatchStream, etcd_client::Error> {
    if decider {
        let from = seen.iter().copied().max().unwrap_or(0) + 1;
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        return client.watch(keys.base(), Some(options)).await;
    }
    let mut stream: Option<etcd_client::WatchStream> = None;
    for (i, prefix) in watched(keys).iter().enumerate() {
        let mut options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(seen[i] + 1);
        if *prefix == keys.rounds() {
            // A round's txn deletes the round [`KEEP_ROUNDS`] before it:
            // that delete rode in every such host's message of each round
            // once 16 were made, about 60 bytes a host (issue 30). The
            // view forgets old rounds itself ([`View::forget_rounds_before`]).
            options = options.with_filters([WatchFilterType::NoDelete]);
        }
        match &mut stream {
            None => stream = Some(client.watch(prefix.as_str(), Some(options)).await?),
            Some(s) => s.watch(prefix.as_str(), Some(options)).await?,
        }
    }
    stream.ok_or_else(|| etcd_client::Error::WatchError("no prefix to watch".into()))
}

/// What came of asking again who decides.
enum Recheck {
    /// The coordinator stopped.
    Stopped,
    /// Still not a decider (the deciders it knows are updated).
    Same,
    /// This host decides now: the job read again, every member in it.
    Decides(Box<View>),
}

/// A host that does not decide, after half the deciders it knew are gone:
/// asks etcd for the first hosts by join again (backing off from 250 ms
/// to 5 s while etcd does not answer); among them, it decides from now on
/// and reads the job again.
async fn deciders_again(inner: &Inner) -> Recheck {
    let mut backoff = Duration::from_millis(250);
    let first = loop {
        match super::deciders::first_by_join(
            &inner.endpoints,
            inner.cfg.request_timeout,
            &inner.client,
            &inner.keys,
            0,
        )
        .await
        {
            Ok(first) => break first,
            Err(e) => {
                tracing::warn!(host = %inner.cfg.host, error = %e, retry_in = ?backoff, "coord: cannot read who decides rounds");
            }
        }
        tokio::select! {
            () = inner.stop.cancelled() => return Recheck::Stopped,
            () = sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    };
    if !super::deciders::decides(&first, &inner.cfg.host) {
        // The hosts before it by join see the same loss and take the
        // places: their markers reach this host's watch.
        return Recheck::Same;
    }
    inner.decides.store(true, Ordering::Release);
    tracing::info!(job = %inner.cfg.job, host = %inner.cfg.host, "coord: half the hosts that decided rounds are gone; this host decides rounds now");
    inner.mark_decider().await;
    match reload(inner).await {
        Some(view) => Recheck::Decides(Box::new(view)),
        None => Recheck::Stopped,
    }
}

/// Reads the job's state again after the watch lost its history, until it
/// succeeds (backing off from 250 ms to 5 s between attempts, each one a
/// fresh read at the newest revision) or the coordinator stops (`None`).
async fn reload(inner: &Inner) -> Option<View> {
    let mut backoff = Duration::from_millis(250);
    loop {
        match inner.load().await {
            Ok(view) => return Some(view),
            Err(e) => {
                tracing::warn!(host = %inner.cfg.host, error = %e, retry_in = ?backoff, "coord: reload failed");
            }
        }
        tokio::select! {
            () = inner.stop.cancelled() => return None,
            () = sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Whether another host than `host` has written chunks of a layout base
/// for round `epoch` (bases are named `<epoch:020>-<writer>`,
/// [`Keys::layout_base`]): it is writing that round now.
fn base_in_progress(
    layouts: &BTreeMap<String, BTreeMap<u32, Vec<RoundMember>>>,
    epoch: u64,
    host: &str,
) -> bool {
    let prefix = format!("{epoch:020}-");
    layouts
        .range(prefix.clone()..)
        .take_while(|(base, _)| base.starts_with(&prefix))
        .any(|(base, _)| base.strip_prefix(&prefix) != Some(host))
}

/// The driver's timers.
#[derive(Debug, Default)]
struct Driver {
    /// A round that waits: the last call's timer and each vanished
    /// member's ([`Waits`]).
    waits: Waits,
    /// The last attempt to advance: from which epoch, and until when not to
    /// try again from it (the watch brings the result first).
    attempt: Option<(u64, Instant)>,
    /// When to evaluate again without an event.
    wake: Option<Instant>,
    /// A round due while this host is not first in line to write it
    /// ([`Standing::writer_place`]): since when, at which epoch.
    standing_by: Option<(u64, Instant)>,
}

/// How long each place in the writers' line waits for the ones before it
/// before it writes the round itself: the first writes at once; the next
/// after this, and so on, capped at [`WRITER_LINE`] places. A writer that
/// is alive but stalled (SIGSTOP, a long GC pause) costs the round this
/// much; two that race cost one failed txn.
const WRITER_STEP: Duration = Duration::from_millis(500);

/// Places in the writers' line that wait in turn; the rest wait as the
/// last of them.
const WRITER_LINE: usize = 8;

/// How long a decider waits, from seeing a member's key vanish with its
/// lease, for its launcher to re-register: the grace runs from the lease's
/// end, which etcd's sweep reports up to [`ETCD_EXPIRY_SWEEP`] late.
fn rejoin_wait(grace: Duration) -> Duration {
    grace.saturating_sub(ETCD_EXPIRY_SWEEP)
}

impl Driver {
    /// Asks the plan whether a round is due and writes it if so.
    async fn evaluate(&mut self, inner: &Inner) {
        let now = Instant::now();
        self.wake = None;
        let (trigger, epoch, place, base_by_another, lost) = {
            let mut view = inner.lock_view();
            if !view.decider {
                // Rounds are the deciders' (a restart request aside).
                self.waits.clear();
                self.standing_by = None;
                return;
            }
            view.settle();
            let trigger = plan::decide(
                view.current(),
                &view.standing,
                &view.members,
                &view.departures,
                view.ended().is_some(),
                inner.limits,
            );
            // Whom the rejoin grace waits for, read only when it does.
            let lost = match (&trigger, view.current()) {
                (Trigger::AfterRejoinGrace(_), Some(r)) => view.standing.lost_hosts(r),
                _ => Vec::new(),
            };
            (
                trigger,
                view.epoch,
                view.standing.decider_place(
                    &inner.cfg.host,
                    super::deciders::DECIDERS,
                    WRITER_LINE,
                ),
                base_in_progress(&view.layouts, view.epoch + 1, &inner.cfg.host),
                lost,
            )
        };
        let (reason, wait) = match trigger {
            Trigger::None => {
                self.waits.clear();
                self.standing_by = None;
                return;
            }
            Trigger::Now(reason) => (reason, None),
            Trigger::AfterLastCall(reason) => (reason, Some(Wait::LastCall(inner.cfg.last_call))),
            Trigger::AfterRejoinGrace(reason) => (
                reason,
                Some(Wait::RejoinGrace {
                    grace: rejoin_wait(inner.cfg.rejoin_grace),
                    lost: &lost,
                }),
            ),
        };
        if let Some(wait) = wait
            && let Some(due) = self.waits.until(epoch, wait, now)
        {
            self.wake = Some(due);
            return;
        }
        if place > 0 {
            // Another host is first in line: it writes, and this one only
            // if the round is still due after its turn.
            let since = match self.standing_by {
                Some((e, t)) if e == epoch => t,
                _ => {
                    self.standing_by = Some((epoch, now));
                    now
                }
            };
            let mut turn = since + WRITER_STEP * u32::try_from(place).unwrap_or(u32::MAX);
            if base_by_another {
                // A host before this one is writing the round's layout base
                // (its chunks are here, its txn not yet): it is at work, not
                // stalled. A second base would be sent to every host too
                // (issue 30: four deciders each wrote the first round's
                // 0.5 MB base while 2,048 hosts joined on a loaded machine,
                // 1.9 GB from etcd). Its turn waits the request deadline
                // more, so a writer that died mid-way still costs a bound.
                turn += inner.cfg.request_timeout;
            }
            if now < turn {
                self.wake = Some(turn);
                return;
            }
        }
        if let Some((e, until)) = self.attempt
            && e == epoch
            && now < until
        {
            self.wake = Some(until);
            return;
        }
        let backoff = match inner.advance(epoch, reason, false).await {
            Ok(_) => {
                self.waits.clear();
                inner.cfg.request_timeout
            }
            Err(e) => {
                tracing::warn!(host = %inner.cfg.host, error = %e, "coord: could not advance the epoch; retrying");
                Duration::from_millis(250)
            }
        };
        let until = Instant::now() + backoff;
        self.attempt = Some((epoch, until));
        self.wake = Some(until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rejoin_grace_runs_from_the_leases_end() {
        assert_eq!(
            rejoin_wait(Duration::from_secs(5)),
            Duration::from_millis(4500)
        );
        assert_eq!(rejoin_wait(Duration::from_millis(300)), Duration::ZERO);
    }

    #[test]
    fn a_host_that_does_not_decide_forgets_the_rounds_etcd_no_longer_keeps() {
        let record = |epoch| RoundRecord {
            epoch,
            members: Vec::new(),
            standby: Vec::new(),
            waiting: true,
            nnodes: 0,
            world_size: 0,
            master_addr: String::new(),
            master_port: 0,
            min_nodes: 1,
            max_nodes: 1,
            reason: String::new(),
            decided_by: String::new(),
            decided_at_ms: 0,
            layout: None,
            heal: false,
            nproc: 0,
            members_digest: String::new(),
            hosts_digest: String::new(),
            ckpt_ring_by_place: false,
            ckpt_replicas: 0,
            ckpt_window: 0,
        };
        let mut view = View::default();
        for e in 1..=40 {
            view.rounds.insert(e, record(e));
        }
        view.unresolved.insert(3, record(3));
        view.unresolved.insert(39, record(39));
        view.forget_rounds_before(40 - KEEP_ROUNDS);
        assert_eq!(view.rounds.keys().next(), Some(&24));
        assert_eq!(view.rounds.len(), 17, "the current round and the 16 kept");
        assert_eq!(view.unresolved.keys().collect::<Vec<_>>(), [&39]);
    }

    #[test]
    fn a_round_made_from_a_base_of_other_members_is_refused_by_its_digest() {
        let member = |i: u32| RoundMember {
            host: format!("h{i}"),
            addr: format!("127.0.0.{}", i + 2),
            nproc_per_node: 8,
            lease: i64::from(i) + 1,
            ckpt_peer: None,
            incarnation: u64::from(i) + 100,
        };
        let members: Vec<_> = (0..6).map(member).collect();
        let stored = |members: &[RoundMember]| {
            let mut r = plan::record(
                2,
                plan::Assignment {
                    members: Vec::new(),
                    standby: Vec::new(),
                },
                Limits {
                    min_nodes: 1,
                    max_nodes: 8,
                    base_port: 29500,
                    port_span: 100,
                },
                "t".into(),
                "h0".into(),
                0,
            );
            r.nnodes = 6;
            r.world_size = 48;
            r.waiting = false;
            r.nproc = 8;
            r.members_digest = layout::digest(members);
            r.layout = Some(LayoutRef {
                base: Keys::layout_base(2, "h0"),
                chunks: 1,
                len: 6,
                segments: vec![layout::Segment::Base { from: 0, len: 6 }],
            });
            r
        };
        // The base the record was written against: the round resolves.
        let mut view = View::default();
        view.put_chunk(&Keys::layout_base(2, "h0"), 0, members.clone())
            .unwrap();
        view.put_round(2, stored(&members)).unwrap();
        assert_eq!(
            view.rounds.get(&2).map(|r| r.members.clone()),
            Some(members.clone())
        );
        // A base of the same length with two hosts in each other's places
        // (a base not the one the record was written against): refused
        // by name, with no round made of it.
        let mut crossed = members.clone();
        crossed.swap(1, 2);
        let mut view = View::default();
        view.put_round(2, stored(&members)).unwrap();
        let e = view
            .put_chunk(&Keys::layout_base(2, "h0"), 0, crossed)
            .unwrap_err();
        assert!(e.to_string().contains("digest"), "{e}");
        assert!(!view.rounds.contains_key(&2));
    }

    #[test]
    fn a_base_for_the_next_round_by_another_host_is_a_writer_at_work() {
        let mut layouts: BTreeMap<String, BTreeMap<u32, Vec<RoundMember>>> = BTreeMap::new();
        layouts.insert(Keys::layout_base(4, "host-a"), BTreeMap::new());
        // The current round's base: nobody is writing round 5.
        assert!(!base_in_progress(&layouts, 5, "host-b"));
        // This host's own base for round 5 is not another writer.
        layouts.insert(Keys::layout_base(5, "host-b"), BTreeMap::new());
        assert!(!base_in_progress(&layouts, 5, "host-b"));
        // Another host's is; a host id that starts like this one's too.
        layouts.insert(Keys::layout_base(5, "host-b2"), BTreeMap::new());
        assert!(base_in_progress(&layouts, 5, "host-b"));
        assert!(base_in_progress(&layouts, 5, "host-a"));
        assert!(!base_in_progress(&layouts, 6, "host-a"));
    }
}
