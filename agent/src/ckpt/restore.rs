//! Restore and listing: every copy of a job's shards, wherever it lives,
//! and the nearest valid one fetched into the local tier.
//!
//! In: a job (and rank). Out: the newest step complete for every rank across
//! this agent, its peers and the durable store, and the rank's shard in the
//! local tier, checked against its checksum. A copy that fails its check is
//! reported (`ckpt.corrupt`) and the next one is tried: local, then peers,
//! then the durable store.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::holdings::{self, JobStep, JobView};
use super::layout::ShardKey;
use super::manifest::{self, Manifest};
use super::{Checkpoints, collect, subject};
use warden_core::events::{NewEvent, Severity};
use warden_core::signal::{CkptRestored, Signal};

/// The most ranks a NoSuchStep error names (the first ones missing).
const MAX_MISSING_LISTED: usize = 64;

/// How many times `checkpoint.peer_timeout` a restore gives the holders it
/// could not ask the first time, before it says it cannot see the job's
/// steps. A peer slow under load answers the second ask; a dead one costs
/// the rank's start this long, once.
const RETRY_TIMEOUT_FACTOR: u32 = 3;
use warden_core::events::EventBus;

/// Where a copy lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// This agent's tier.
    Local,
    /// A peer agent: its address and host name.
    Peer {
        /// `host:port`.
        addr: String,
        /// Its agent.host_name.
        host: String,
    },
    /// The durable store.
    Durable,
}

impl Holder {
    /// "local", "peer", "durable".
    pub fn tier(&self) -> &'static str {
        match self {
            Holder::Local => "local",
            Holder::Peer { .. } => "peer",
            Holder::Durable => "durable",
        }
    }
}

/// One copy of one shard.
#[derive(Debug, Clone)]
pub struct Copy {
    /// Where.
    pub holder: Holder,
    /// What its holder says of it.
    pub manifest: Manifest,
}

/// Every known copy of a job's shards: step -> rank -> copies, nearest
/// first.
#[derive(Debug, Clone, Default)]
pub struct CopiesView {
    /// The copies.
    pub steps: BTreeMap<(String, u64), BTreeMap<u32, Vec<Copy>>>,
    /// Holders that could not be asked, with why.
    pub unreachable: Vec<String>,
    /// Local copies a scrub marked corrupt: (job, step) -> rank -> why.
    /// Shown by listings; never counted or restored.
    pub corrupt: BTreeMap<(String, u64), BTreeMap<u32, String>>,
    /// The job-wide count of a view gathered through the collector
    /// ([`super::collect`]): step -> its world size and the ranks with a
    /// copy anywhere. `steps` then holds only the copies of the restoring
    /// rank's holders, and completeness is read here. None: `steps` holds
    /// every copy of the job.
    pub counts: Option<BTreeMap<u64, JobStep>>,
    /// The peers (`host:port`) this gather asked that could not answer (a
    /// peer the gather did not ask is not here): a listing shows the
    /// copies this agent sent to these ([`super::sent`]), as their holders
    /// confirmed them when sent.
    pub unanswered: std::collections::BTreeSet<String>,
}

impl CopiesView {
    fn add(&mut self, holder: Holder, m: Manifest) {
        self.steps
            .entry((m.job_id.clone(), m.step))
            .or_default()
            .entry(m.rank)
            .or_default()
            .push(Copy {
                holder,
                manifest: m,
            });
    }

    /// What the peer at `addr` listed (the shards `keep` takes), or why it
    /// could not be asked: a shard it described wrongly, or the peer, is
    /// named unreachable.
    fn add_peer(
        &mut self,
        addr: &str,
        listed: Result<super::link::PeerHoldings, String>,
        keep: impl Fn(&Manifest) -> bool,
    ) {
        match listed {
            Ok(listing) => {
                for m in listing.shards {
                    match m {
                        Ok(m) if keep(&m) => self.add(
                            Holder::Peer {
                                addr: addr.to_owned(),
                                host: listing.host.clone(),
                            },
                            m,
                        ),
                        Ok(_) => {}
                        Err(e) => self.unreachable.push(format!("{addr}: {e}")),
                    }
                }
            }
            Err(e) => {
                self.unanswered.insert(addr.to_owned());
                self.unreachable.push(format!("peer {addr}: {e}"));
            }
        }
    }

    /// The world size of a step: what its shards say (the largest, should
    /// they disagree).
    pub fn world_size(ranks: &BTreeMap<u32, Vec<Copy>>) -> u32 {
        ranks
            .values()
            .flatten()
            .map(|c| c.manifest.world_size)
            .max()
            .unwrap_or(0)
    }

    /// Every rank below the world size has a copy.
    pub fn complete(ranks: &BTreeMap<u32, Vec<Copy>>) -> bool {
        let w = Self::world_size(ranks);
        w > 0 && (0..w).all(|r| ranks.get(&r).is_some_and(|c| !c.is_empty()))
    }

    /// Whether `step` of `job` has a copy of every rank.
    pub fn step_complete(&self, job: &str, step: u64) -> bool {
        match &self.counts {
            Some(c) => c.get(&step).is_some_and(JobStep::complete),
            None => self
                .steps
                .get(&(job.to_owned(), step))
                .is_some_and(Self::complete),
        }
    }

    /// The newest complete step of `job`.
    pub fn newest_complete(&self, job: &str) -> Option<u64> {
        if let Some(c) = &self.counts {
            return c.iter().rev().find(|(_, s)| s.complete()).map(|(&s, _)| s);
        }
        self.steps
            .iter()
            .rev()
            .filter(|((j, _), _)| j == job)
            .find(|(_, ranks)| Self::complete(ranks))
            .map(|((_, s), _)| *s)
    }
}

/// Asks the local tier, every peer and the durable store about `job`
/// (every job when empty; the durable store only for a named job), each
/// peer within `checkpoint.peer_timeout`; a gather of the same job already
/// under way here is shared ([`super::shared_gather`]).
pub async fn gather(ck: &Arc<Checkpoints>, job: &str) -> Arc<CopiesView> {
    gather_within(ck, job, ck.cfg.peer_timeout).await
}

/// [`gather`] with each peer given `limit` to answer.
async fn gather_within(ck: &Arc<Checkpoints>, job: &str, limit: Duration) -> Arc<CopiesView> {
    ck.gathers
        .view(job, &[], limit, ck.sealing.sealed(), || {
            gather_now(ck, job, limit)
        })
        .await
}

/// The view a restore of `rank` works from, each holder given `limit`:
/// for a job that restores through the collector ([`collect::collects`]),
/// the job-wide count and the copies of the rank's holders and those of
/// `beside` (the job's other ranks registered here: at a restart they
/// restore at once), shared by the restores of the same ranks under way
/// here, so that a host's 8 ranks make one ask of the collector and list
/// each holder once; else [`gather_within`]. A gather under way whose
/// ranks include this one is joined, though the sets differ (a rank that
/// registered since it started computes a larger one).
async fn gather_for(
    ck: &Arc<Checkpoints>,
    job: &str,
    rank: u32,
    beside: &[u32],
    limit: Duration,
) -> Arc<CopiesView> {
    if !collect::collects(ck, job) {
        return gather_within(ck, job, limit).await;
    }
    let part = host_part(rank, beside);
    ck.gathers
        .view_covering(
            job,
            (rank, &part),
            limit,
            ck.sealing.sealed(),
            |ranks| async move { gather_collected(ck, job, &ranks, limit).await },
        )
        .await
}

/// The ranks a restore of `rank` gathers for: with `beside`, sorted, each
/// once; `rank` alone where they are more than one ask may name.
fn host_part(rank: u32, beside: &[u32]) -> Vec<u32> {
    let mut part: Vec<u32> = beside.iter().copied().chain([rank]).collect();
    part.sort_unstable();
    part.dedup();
    if part.len() > holdings::MAX_VIEW_RANKS {
        return vec![rank];
    }
    part
}

/// The copies of `ranks` of `job` and the job's counts: for a job that
/// restores through the collector, its view for those ranks
/// ([`gather_collected`]); else the whole job's ([`gather`]). A listing of
/// a host's own ranks (the launcher's notice check, every 200 ms of a
/// notice's window) asked every host of the job; this asks the collector
/// and the ranks' holders, each holder once.
///
/// Only while the counts cover what this host sees: a collection is kept
/// for `peer_timeout`, so one taken while the job was saving a step (every
/// rank saves at a notice) counts it incomplete, or not at all, for that
/// long, and the notice check would name the step before and stop waiting
/// for the new one's replica. Where the newest step in view is not counted
/// complete, the whole job is gathered, as before.
pub async fn gather_ranks(
    ck: &Arc<Checkpoints>,
    job: &str,
    ranks: &std::collections::BTreeSet<u32>,
) -> Arc<CopiesView> {
    if !collect::collects(ck, job) || ranks.is_empty() {
        return gather(ck, job).await;
    }
    // A rank past any world size holds nothing, and would have every
    // collector refuse the one ask that names it (the others with it).
    let ranks: Vec<u32> = ranks
        .iter()
        .copied()
        .filter(|&r| r < warden_core::rank::MAX_WORLD_SIZE)
        .collect();
    if ranks.is_empty() {
        return gather(ck, job).await;
    }
    let view = gather_collected(ck, job, &ranks, ck.cfg.peer_timeout).await;
    if counts_the_newest(&view, job) {
        Arc::new(view)
    } else {
        gather(ck, job).await
    }
}

/// This agent's copies of `job`, with the collector's view `jv` as the
/// job's counts: a summary's view, one ask where a gather asks every host.
pub async fn counted_by(ck: &Arc<Checkpoints>, job: &str, jv: JobView) -> CopiesView {
    let mut view = CopiesView::default();
    add_local(ck, job, &mut view).await;
    view.unreachable = jv.unreachable;
    view.counts = Some(jv.steps);
    view
}

/// Whether `view`'s collector counts complete the newest step of `job`
/// that the view holds a copy of (true where it holds none, or has no
/// counts: the whole job's view). See [`gather_ranks`] for why.
pub fn counts_the_newest(view: &CopiesView, job: &str) -> bool {
    let newest = view
        .steps
        .keys()
        .filter(|(j, _)| j == job)
        .map(|(_, s)| *s)
        .max();
    match (newest, &view.counts) {
        (Some(s), Some(c)) => c.get(&s).is_some_and(JobStep::complete),
        _ => true,
    }
}

/// One gather through the collector: the local tier, the job's view for
/// `ranks` (one ask; each host's listing within `limit`), the copies its
/// holders list of `ranks` (each holder once, within `limit`), and the
/// durable store, whose steps count as complete where it holds every rank
/// itself. The ranks an older agent on the way left unanswered are asked
/// one by one, as before. `ranks` is never empty (both callers see to it).
async fn gather_collected(
    ck: &Arc<Checkpoints>,
    job: &str,
    ranks: &[u32],
    limit: Duration,
) -> CopiesView {
    let mut view = CopiesView::default();
    add_local(ck, job, &mut view).await;
    let first = collect::job_view(ck, job, ranks, limit).await;
    // A view with no step (the collectors silent, or nothing saved) holds
    // no rank's copies: the others are not asked apart, to the same answer.
    let left: Vec<u32> = match &first {
        Ok(v) if !v.steps.is_empty() => ranks
            .iter()
            .copied()
            .filter(|r| !v.ranks.contains(r))
            .collect(),
        _ => Vec::new(),
    };
    let apart = futures_join(left.iter().map(|&rank| {
        let (ck, job) = (ck.clone(), job.to_owned());
        async move { collect::job_view(&ck, &job, &[rank], limit).await }
    }))
    .await;
    if apart.len() < left.len() {
        // A task of the asks died: the whole job, rather than a view that
        // misses a rank's holders.
        return gather_now(ck, job, limit).await;
    }
    let mut jvs = Vec::with_capacity(1 + apart.len());
    for v in std::iter::once(first).chain(apart) {
        match v {
            Ok(v) => jvs.push(v),
            Err(e) => {
                tracing::warn!(job, ?ranks, error = %e, "restoring without the collector");
                return gather_now(ck, job, limit).await;
            }
        }
    }
    for jv in &jvs {
        view.unreachable.extend(jv.unreachable.iter().cloned());
    }
    view.unreachable.sort();
    view.unreachable.dedup();
    let me = ck.peers.my_addr();
    // This agent's copies are read above; the collector names them under
    // the address the job knows it by.
    let known_as = ck.peers.known_as(job);
    let mut holders: Vec<String> = jvs
        .iter()
        .flat_map(|jv| jv.steps.values())
        .flat_map(|s| s.holders.values().flatten())
        .map(|h| h.addr.clone())
        // And the peers this agent sent these ranks' shards to: one that
        // stopped lists nothing to the collector, so only an ask of its own
        // says it could not answer (a listing then shows the copy it
        // confirmed when sent, `sent_unheard`).
        .chain(ck.sent.addrs_of(job, ranks))
        .filter(|a| a != me && *a != known_as && !a.is_empty() && a != holdings::DURABLE)
        .collect();
    holders.sort();
    holders.dedup();
    // The counts are the job's, the same in every view; a view whose ask
    // went unanswered has none (the collectors silent for it).
    let counted = jvs.iter().position(|jv| !jv.steps.is_empty()).unwrap_or(0);
    view.counts = jvs.into_iter().nth(counted).map(|jv| jv.steps);
    let asks = holders.into_iter().map(|addr| {
        let (ck, job) = (ck.clone(), job.to_owned());
        async move {
            let r = match ck.peer(&addr) {
                Some(p) => p.list(&job, limit).await.map_err(|e| e.to_string()),
                None => Err("not one of this agent's peers".to_owned()),
            };
            (addr, r)
        }
    });
    // The holders and the durable store, at once.
    let (listed, durable) = tokio::join!(futures_join(asks), durable_ranks(ck, job, ranks));
    for (addr, r) in listed {
        view.add_peer(&addr, r, |m| ranks.contains(&m.rank));
    }
    let (found, failed) = durable;
    for m in found {
        view.add(Holder::Durable, m);
    }
    view.unreachable.extend(failed);
    view.unreachable.sort();
    view.unreachable.dedup();
    view
}

/// How many manifests a gather reads from the durable store at once (a
/// host's 64 ranks and five steps: five round trips).
const DURABLE_READS: usize = 64;

/// `ranks`' copies of `job` in the durable store, and what could not be
/// read, if anything: the store's steps (one LIST of step names), then each rank's
/// manifest in each step, [`DURABLE_READS`] at once (a host's ranks share
/// one gather: read in turn, that was 8 times one rank's wait). Failed
/// reads are one line, with how many (a failing store would otherwise name
/// every shard, into a restore's error message). The job's
/// count of what the store holds comes from the collector, which lists the
/// store once for every restoring host.
async fn durable_ranks(
    ck: &Arc<Checkpoints>,
    job: &str,
    ranks: &[u32],
) -> (Vec<super::manifest::Manifest>, Option<String>) {
    let Some(d) = &ck.durable else {
        return (Vec::new(), None);
    };
    let steps = match d.steps(job).await {
        Ok(s) => s,
        Err(e) => return (Vec::new(), Some(format!("durable {}: {e}", d.url()))),
    };
    let gate = Arc::new(tokio::sync::Semaphore::new(DURABLE_READS));
    let mut reads = Vec::with_capacity(steps.len() * ranks.len());
    for &step in &steps {
        for &rank in ranks {
            let key = ShardKey {
                job_id: job.to_owned(),
                step,
                rank,
            };
            let (ck, gate) = (ck.clone(), gate.clone());
            reads.push(async move {
                let _turn = gate.acquire_owned().await;
                let got = match &ck.durable {
                    Some(d) => d.manifest(&key).await,
                    None => Ok(None),
                };
                (key, got)
            });
        }
    }
    let asked = reads.len();
    let (mut found, mut failed) = (Vec::new(), Vec::new());
    let done = futures_join(reads.into_iter()).await;
    let lost = asked - done.len();
    for (key, got) in done {
        match got {
            Ok(Some(m)) if m.key() == key => found.push(m),
            Ok(Some(m)) => tracing::warn!(
                job, step = key.step, rank = key.rank, names = %m.key(),
                "a durable manifest names another shard than its place; left out"
            ),
            Ok(None) => {}
            Err(e) => failed.push(e),
        }
    }
    let gone = failed.len() + lost;
    let why = match failed.first() {
        Some(e) => format!("first: {e}"),
        None => "a read's task ended".to_owned(),
    };
    let failed = (gone > 0).then(|| {
        format!(
            "durable {}: {gone} of {asked} manifest reads failed ({why})",
            d.url()
        )
    });
    (found, failed)
}

/// This agent's own copies of `job` (every job when empty), and those a
/// scrub marked corrupt.
async fn add_local(ck: &Arc<Checkpoints>, job: &str, view: &mut CopiesView) {
    let ck2 = ck.clone();
    let j = job.to_owned();
    let local = tokio::task::spawn_blocking(move || {
        ck2.tier.list(if j.is_empty() { None } else { Some(&j) })
    })
    .await
    .unwrap_or_default();
    for m in local {
        view.add(Holder::Local, m);
    }
    let (ck2, j) = (ck.clone(), job.to_owned());
    let bad = tokio::task::spawn_blocking(move || {
        ck2.tier
            .list_bad(if j.is_empty() { None } else { Some(&j) })
    })
    .await
    .unwrap_or_default();
    for (k, why) in bad {
        view.corrupt
            .entry((k.job_id, k.step))
            .or_default()
            .insert(k.rank, why);
    }
}

/// What the durable store holds of `job` (a named job only).
async fn add_durable(ck: &Arc<Checkpoints>, job: &str, view: &mut CopiesView) {
    if let (Some(d), false) = (&ck.durable, job.is_empty()) {
        match d.list(job).await {
            Ok(ms) => {
                for m in ms {
                    view.add(Holder::Durable, m);
                }
            }
            Err(e) => view.unreachable.push(format!("durable {}: {e}", d.url())),
        }
    }
}

/// One gather, run now.
async fn gather_now(ck: &Arc<Checkpoints>, job: &str, limit: Duration) -> CopiesView {
    let mut view = CopiesView::default();
    add_local(ck, job, &mut view).await;
    let asks = ck.peers.of_job(job).into_iter().map(|p| {
        let job = job.to_owned();
        async move {
            let r = p.list(&job, limit).await.map_err(|e| e.to_string());
            (p.member.addr.clone(), r)
        }
    });
    for (addr, r) in futures_join(asks).await {
        view.add_peer(&addr, r, |_| true);
    }
    add_durable(ck, job, &mut view).await;
    view
}

/// Runs futures concurrently and collects their outputs in order.
async fn futures_join<F>(fs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = fs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        if let Ok(v) = h.await {
            out.push(v);
        }
    }
    out
}

/// What a restore found.
#[derive(Debug)]
pub struct RestoreFound {
    /// The step.
    pub step: u64,
    /// The shard in the local tier.
    pub path: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Where it came from.
    pub holder: Holder,
    /// The holder, for a person.
    pub source: String,
    /// Copies passed over, with why.
    pub skipped: Vec<String>,
}

/// Why a restore gave no shard.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The step asked for is not complete anywhere.
    #[error(
        "job {job} has no complete step {step} (ranks with no copy, the first {MAX_MISSING_LISTED} at most: {missing:?})"
    )]
    NoSuchStep {
        /// The job.
        job: String,
        /// The step.
        step: u64,
        /// Ranks without a copy.
        missing: Vec<u32>,
    },
    /// No step in reach, and some holders could not be asked: the step may
    /// be on them. The edge answers ABORTED (a decided answer, after the
    /// second ask): a client retries it at a higher level (the job's
    /// restart), not the call itself, as it would UNAVAILABLE.
    #[error(
        "job {job}: {what} among the holders that answered, and these could not be asked (the checkpoint may be on them; the restore can be tried again): {}",
        holders.join("; "),
        what = if *step == 0 { "no complete step".to_owned() } else { format!("step {step} is not complete") }
    )]
    Unreachable {
        /// The job.
        job: String,
        /// The step asked for (0: the newest).
        step: u64,
        /// Each holder not asked, with why.
        holders: Vec<String>,
    },
    /// Every copy of the rank's shard failed.
    #[error("job {job} step {step} rank {rank}: no valid copy: {}", tried.join("; "))]
    NoValidCopy {
        /// The job.
        job: String,
        /// The step.
        step: u64,
        /// The rank.
        rank: u32,
        /// What was tried.
        tried: Vec<String>,
    },
    /// The copy was found and is in the local tier, but it could not be
    /// handed to the calling rank's uid.
    #[error("handing the restored shard to its rank: {0}")]
    HandOver(#[source] super::tier::TierError),
    /// The hand-over's blocking task failed.
    #[error("checkpoint task: {0}")]
    Task(String),
}

/// How long a restore waits for saves this agent is still sealing: they
/// count, so a rank restoring right after a save finds it.
pub const SEALING_WAIT_RESTORE: Duration = Duration::from_secs(30);

/// A rank's Restore, as a use case: the saves still sealing here waited
/// for (at most [`SEALING_WAIT_RESTORE`]), the shard found ([`restore`]),
/// and, for a calling rank (`owner`), handed to its uid so that it can
/// open the path. `beside`: the job's other ranks registered here, whose
/// restores at a restart share this one's gather. The edge decodes and
/// checks the request and maps [`RestoreError`] to a status.
pub async fn for_rank(
    events: &EventBus,
    ck: &Arc<Checkpoints>,
    job: &str,
    (rank, beside): (u32, &[u32]),
    step: u64,
    owner: Option<super::tier::Owner>,
) -> Result<Option<RestoreFound>, RestoreError> {
    ck.sealing.settled(SEALING_WAIT_RESTORE).await;
    let Some(found) = restore(events, ck, job, (rank, beside), step).await? else {
        return Ok(None);
    };
    if let Some(o) = owner {
        let (ck2, k2) = (ck.clone(), found.manifest.key());
        tokio::task::spawn_blocking(move || ck2.tier.hand_over(&k2, o))
            .await
            .map_err(|e| RestoreError::Task(e.to_string()))?
            .map_err(RestoreError::HandOver)?;
    }
    Ok(Some(found))
}

/// Restores `rank`'s shard of `step` (0: newest complete). `Ok(None)`: no
/// complete step exists anywhere, every holder having answered; where one
/// could not be asked, [`RestoreError::Unreachable`] instead, so a rank
/// never starts over at step 0 while its job's checkpoint sits on a peer
/// that was slow to answer.
pub async fn restore(
    events: &EventBus,
    ck: &Arc<Checkpoints>,
    job: &str,
    (rank, beside): (u32, &[u32]),
    step: u64,
) -> Result<Option<RestoreFound>, RestoreError> {
    let started = Instant::now();
    let mut view = gather_for(ck, job, rank, beside, ck.cfg.peer_timeout).await;
    let found = |v: &CopiesView| {
        if step == 0 {
            v.newest_complete(job)
        } else {
            v.step_complete(job, step).then_some(step)
        }
    };
    if found(&view).is_none() && !view.unreachable.is_empty() {
        // A holder that did not answer may hold the step: ask again, longer,
        // rather than start the rank over (or call a step missing) on a
        // peer's slowness.
        let longer = ck.cfg.peer_timeout * RETRY_TIMEOUT_FACTOR;
        view = gather_for(ck, job, rank, beside, longer).await;
        if found(&view).is_none() && !view.unreachable.is_empty() {
            return Err(RestoreError::Unreachable {
                job: job.to_owned(),
                step,
                holders: view.unreachable.clone(),
            });
        }
    }
    let step = if step == 0 {
        match view.newest_complete(job) {
            Some(s) => s,
            None => return Ok(None),
        }
    } else {
        step
    };
    if !view.step_complete(job, step) {
        if let Some(c) = view.counts.as_ref().and_then(|c| c.get(&step)) {
            return Err(RestoreError::NoSuchStep {
                job: job.to_owned(),
                step,
                missing: c.missing.clone(),
            });
        }
        let ranks = view.steps.get(&(job.to_owned(), step));
        let w = ranks.map(CopiesView::world_size).unwrap_or(0);
        // Bounded whatever the world size says: the first ranks missing
        // are what a person reads.
        let missing = (0..w.max(rank.saturating_add(1)))
            .filter(|r| ranks.is_none_or(|m| !m.contains_key(r)))
            .take(MAX_MISSING_LISTED)
            .collect();
        return Err(RestoreError::NoSuchStep {
            job: job.to_owned(),
            step,
            missing,
        });
    };
    let key = ShardKey {
        job_id: job.to_owned(),
        step,
        rank,
    };
    let mut copies = view
        .steps
        .get(&(job.to_owned(), step))
        .and_then(|r| r.get(&rank))
        .cloned()
        .unwrap_or_default();
    if copies.is_empty() && !view.unreachable.is_empty() {
        // Counted complete by the collector, but the rank's holders could
        // not be listed: the restore can be tried again.
        return Err(RestoreError::Unreachable {
            job: job.to_owned(),
            step,
            holders: view.unreachable.clone(),
        });
    }
    // The ranks here that restore this shard at once fetch it once: the
    // ones that waited read the copy the first brought in, and check it
    // side by side, the turn let go (a local copy needs none). Behind a
    // turn that found no valid copy, they try side by side too.
    let mut turn = None;
    if !copies.iter().any(|c| c.holder == Holder::Local) {
        let t = ck.fetch_turns.take(&key).await;
        if let Some(here) = brought_in(ck, &key, &copies).await {
            copies.push(here);
        } else if !t.after_a_failure() {
            turn = Some(t);
        }
    }
    // This host by its name and its address: hosts misconfigured with one
    // name still spread.
    let me = format!("{} {}", ck.host, ck.peers.my_addr());
    nearest_first(&mut copies, &me, &key);
    let mut skipped = Vec::new();
    for c in copies {
        let source = match &c.holder {
            Holder::Local => ck.host.clone(),
            Holder::Peer { addr, host } => format!("{host} ({addr})"),
            Holder::Durable => ck
                .durable
                .as_ref()
                .map(|d| d.url().to_owned())
                .unwrap_or_default(),
        };
        match fetch(ck, &key, &c).await {
            Ok(path) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                metrics::counter!("warden_ckpt_restores_total", "tier" => c.holder.tier())
                    .increment(1);
                events.publish(Signal::CkptRestored(CkptRestored {
                    subject: subject(&key),
                    shard: key.to_string(),
                    job: job.to_string(),
                    rank,
                    step,
                    duration_ms: ms,
                    tier: c.holder.tier().to_string(),
                    source: source.clone(),
                    bytes: c.manifest.size_bytes,
                }));
                return Ok(Some(RestoreFound {
                    step,
                    path,
                    manifest: c.manifest,
                    holder: c.holder,
                    source,
                    skipped,
                }));
            }
            Err(e) => {
                let why = format!("{} copy at {source}: {e}", c.holder.tier());
                if e.starts_with("corrupt") {
                    metrics::counter!("warden_ckpt_corrupt_total", "tier" => c.holder.tier())
                        .increment(1);
                    events.publish(
                        NewEvent::new(
                            Severity::Warning,
                            "ckpt.corrupt",
                            subject(&key),
                            format!("{key}: {why}; trying the next copy"),
                        )
                        .with("job_id", job)
                        .with("rank", rank)
                        .with("step", step)
                        .with("tier", c.holder.tier())
                        .with("source", &source),
                    );
                }
                skipped.push(why);
            }
        }
    }
    if let Some(t) = turn.as_mut() {
        t.record(super::fetch_turns::LastFetch::Failed);
    }
    drop(turn);
    Err(RestoreError::NoValidCopy {
        job: job.to_owned(),
        step,
        rank,
        tried: skipped,
    })
}

/// The copy of `key` in the local tier that is one of `copies` (the same
/// bytes), when a restore that held the shard's turn before this one
/// brought it in after this restore's view was gathered.
async fn brought_in(ck: &Arc<Checkpoints>, key: &ShardKey, copies: &[Copy]) -> Option<Copy> {
    let (ck2, k) = (ck.clone(), key.clone());
    let m = tokio::task::spawn_blocking(move || ck2.tier.get(&k))
        .await
        .ok()??;
    copies
        .iter()
        .any(|c| c.manifest.xxh3 == m.xxh3 && c.manifest.size_bytes == m.size_bytes)
        .then_some(Copy {
            holder: Holder::Local,
            manifest: m,
        })
}

/// Nearest first: the local tier, the peers, the durable store. The peers
/// in an order of this host's own for this shard (rendezvous hashing of
/// this host, the shard and the holder's address): every host once took
/// the holder first by address, so a shard that every host restores (the
/// coordinator's, for a sharded checkpoint's metadata) was fetched from
/// one of its holders only. Now each holder serves its share, and a host's
/// next choice, should its first fail, is as spread.
fn nearest_first(copies: &mut [Copy], host: &str, key: &ShardKey) {
    copies.sort_by_cached_key(|c| match &c.holder {
        Holder::Local => (0, 0),
        Holder::Peer { addr, .. } => (1, spread(host, key, addr)),
        Holder::Durable => (2, 0),
    });
}

/// Where the holder at `addr` falls in `host`'s order for `key`.
fn spread(host: &str, key: &ShardKey, addr: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for part in [host, &key.to_string(), addr] {
        h.update(part.as_bytes());
        h.update(&[0]);
    }
    h.digest()
}

/// Brings one copy into the local tier, checked; the error says why not.
async fn fetch(ck: &Arc<Checkpoints>, key: &ShardKey, c: &Copy) -> Result<PathBuf, String> {
    match &c.holder {
        Holder::Local => {
            let ck2 = ck.clone();
            let m = c.manifest.clone();
            tokio::task::spawn_blocking(move || {
                let path = ck2.tier.layout().data(&m.key());
                let checked = ck2
                    .tier
                    .open_data(&m.key())
                    .map_err(|e| e.to_string())
                    .and_then(|(mut f, _)| manifest::verify(&mut f, &path, &m));
                match checked {
                    Ok(()) => Ok(path),
                    Err(e) => {
                        // A bad local copy is removed, so a good one can
                        // take its place.
                        ck2.tier.remove(&m.key());
                        Err(e)
                    }
                }
            })
            .await
            .map_err(|e| e.to_string())?
        }
        Holder::Peer { addr, .. } => {
            let peer = ck
                .peer(addr)
                .ok_or_else(|| format!("{addr} is no longer a peer of this agent"))?;
            let incoming = peer.fetch(key).await?;
            // What the peer sends must be what it listed.
            let told = &incoming.told;
            if told.xxh3 != c.manifest.xxh3 || told.size_bytes != c.manifest.size_bytes {
                return Err(format!(
                    "the peer now describes it as {} bytes xxh3 {}, not as listed",
                    told.size_bytes, told.xxh3
                ));
            }
            ck.bring_in(&c.manifest, |staged, path| async move {
                incoming.receive(&c.manifest, staged, path).await
            })
            .await
            .map_err(|e| e.to_string())
        }
        Holder::Durable => {
            let d = ck.durable.as_ref().ok_or("no durable store configured")?;
            ck.bring_in(&c.manifest, |staged, path| async move {
                d.fetch(&c.manifest, staged, &path).await
            })
            .await
            .map_err(|e| e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(holder: Holder) -> Copy {
        Copy {
            holder,
            manifest: Manifest {
                job_id: "job".into(),
                step: 10,
                rank: 0,
                world_size: 8,
                size_bytes: 1,
                xxh3: "0000000000000001".into(),
                origin: "h0".into(),
                committed_unix: 0,
            },
        }
    }

    fn peer(i: usize) -> Holder {
        Holder::Peer {
            addr: format!("10.0.0.{i}:7070"),
            host: format!("h{i}"),
        }
    }

    /// Issue 30: every host restores the coordinator's shard, which has
    /// three holders. Each holder is the first choice of about a third of
    /// 3,000 hosts (once all 3,000 took the same one), a host's order is
    /// the same each time, and local stays first and durable last.
    #[test]
    fn each_holder_of_a_shard_every_host_restores_serves_its_share() {
        let key = ShardKey {
            job_id: "job".into(),
            step: 10,
            rank: 0,
        };
        let mut first = [0usize; 3];
        for h in 0..3000 {
            let host = format!("host-{h:05}");
            let mut copies = vec![
                copy(Holder::Durable),
                copy(peer(2)),
                copy(peer(0)),
                copy(peer(1)),
            ];
            nearest_first(&mut copies, &host, &key);
            assert_eq!(copies[3].holder, Holder::Durable);
            let Holder::Peer { host: got, .. } = &copies[0].holder else {
                panic!("{host}: a peer is not first: {:?}", copies[0].holder);
            };
            first[got[1..].parse::<usize>().expect("h<i>")] += 1;
            let mut again = vec![
                copy(peer(1)),
                copy(peer(0)),
                copy(peer(2)),
                copy(Holder::Durable),
            ];
            nearest_first(&mut again, &host, &key);
            assert_eq!(
                again[0].holder, copies[0].holder,
                "{host}: its order changed"
            );
        }
        assert!(
            first.iter().all(|n| (850..=1150).contains(n)),
            "first choices: {first:?}"
        );
        let mut copies = vec![copy(peer(0)), copy(Holder::Durable), copy(Holder::Local)];
        nearest_first(&mut copies, "host-00000", &key);
        assert_eq!(copies[0].holder, Holder::Local);
    }
}
