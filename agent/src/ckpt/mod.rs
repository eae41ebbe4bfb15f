//! Checkpoint tiers: a local tier on tmpfs or NVMe, replicas on peer
//! agents in other failure domains, and an optional durable store.
//!
//! In: ranks' saves (BeginShard, then their own write, then CommitShard),
//! replicas pushed by peers, restore and listing requests. Out: committed
//! shards, replicas sent, uploads, events (`ckpt.saved`, `ckpt.replicated`,
//! `ckpt.uploaded`, `ckpt.restored`, `ckpt.corrupt`, ...).
//!
//! Contract: a rank's save costs it one write into the tier plus two local
//! calls; hashing, replication and upload happen here afterwards, never on
//! the rank's time. A shard is listed, replicated, uploaded or restored only
//! once its manifest says it is whole; every copy is checked against its
//! checksum before use.

pub mod accept;
pub mod collect;
pub mod commit;
pub mod config;
pub mod durable;
pub mod fan_in;
pub mod fetch_turns;
pub mod holdings;
pub mod job_peers;
pub mod layout;
pub mod link;
pub mod link_error;
pub mod listing;
pub mod manifest;
pub mod order;
pub mod peer_pages;
pub mod peerset;
pub mod placement;
pub mod receive;
pub mod replicate;
pub mod restore;
pub mod retention;
pub mod scrub;
pub mod sent;
pub mod shared_gather;
pub mod tier;
pub mod user_cache;

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

pub use config::CheckpointConfig;
use layout::ShardKey;
use manifest::Manifest;
use tier::LocalTier;

/// One peer agent: configured, or handed over by a job's launcher.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Its address and failure domain.
    pub member: placement::RingMember,
    /// Its identity (the name its certificate carries, its
    /// `agent.host_name`); empty when unknown (`api.insecure`, an older
    /// launcher): such a peer is dialed but never authorized for a job.
    pub name: String,
    /// The calls to it ([`link`]), connected lazily; shared by the copies
    /// of a peer known under the same identity.
    pub link: Arc<dyn link::PeerLink>,
}

impl Peer {
    /// The peer agent at `addr` in failure domain `domain` (empty: a domain
    /// of its own) whose certificate carries `name`, dialed through `dial`
    /// with `timeout` to connect.
    pub fn new(
        addr: &str,
        domain: &str,
        name: &str,
        timeout: std::time::Duration,
        dial: &dyn link::PeerDial,
    ) -> Result<Self, String> {
        Ok(Self::on(
            addr,
            domain,
            name,
            dial.dial(addr, name, timeout)?,
        ))
    }

    /// The same over a link already made to it.
    pub fn on(addr: &str, domain: &str, name: &str, link: Arc<dyn link::PeerLink>) -> Self {
        Self {
            member: placement::RingMember::at(addr, domain),
            name: name.to_owned(),
            link,
        }
    }
}

/// Everything the checkpoint calls and tasks share.
#[derive(Debug)]
pub struct Checkpoints {
    /// `[checkpoint]`.
    pub cfg: CheckpointConfig,
    /// This host's name (manifests' origin).
    pub host: String,
    /// The local tier.
    pub tier: LocalTier,
    /// The peer agents, configured and handed over per job (restores ask
    /// every one that matters to the job; replicas go to the placement's
    /// targets among them).
    pub peers: peerset::PeerSet,
    /// Peer lists handed over in pages, waiting for their last page.
    pub peer_pages: peer_pages::PeerPages,
    /// The durable store, when configured.
    pub durable: Option<durable::Durable>,
    /// Commits being sealed.
    pub sealing: Sealing,
    /// The gathers of a job's copies under way, shared by the ranks that
    /// restore at once.
    pub gathers: shared_gather::InFlight,
    /// Whose turn it is to fetch each shard being restored here: the ranks
    /// that restore one shard at once fetch it once ([`fetch_turns`]).
    pub fetch_turns: fetch_turns::FetchTurns,
    /// The collections of a job's holdings under way on this agent as its
    /// collector ([`collect`]), shared by the asks that come meanwhile and
    /// within `peer_timeout` after.
    pub collections: shared_gather::InFlight<holdings::Counted>,
    /// The listings of a group this agent leads, asked by the job's
    /// collectors, shared as the collections are.
    pub group_listings: shared_gather::InFlight<holdings::Holdings>,
    /// How many collections and group listings each peer may start here
    /// per `peer_timeout` ([`collect::STARTS_PER_PEER`]).
    pub collect_quota: crate::access::quota::Quota<String>,
    /// The copies of this agent's shards its peers confirmed ([`sent`]):
    /// what replication skips, and what a listing shows for a holder that
    /// cannot answer now.
    pub sent: sent::Sent,
    work: mpsc::UnboundedSender<Manifest>,
    work_rx: Mutex<Option<mpsc::UnboundedReceiver<Manifest>>>,
}

impl Checkpoints {
    /// Opens the tier and the store; the error says which and why.
    pub fn open(
        cfg: &CheckpointConfig,
        host: &str,
        my_addr: &str,
        dial: Arc<dyn link::PeerDial>,
    ) -> Result<Self, String> {
        let tier = LocalTier::open(
            std::path::Path::new(&cfg.dir),
            host,
            cfg.keep_steps,
            cfg.max_bytes,
        )
        .map_err(|e| format!("checkpoint.dir: {e}"))?;
        let mut peers = Vec::new();
        for p in &cfg.peers {
            peers.push(Peer::new(
                &p.addr,
                &p.domain,
                &p.name,
                cfg.peer_timeout,
                &*dial,
            )?);
        }
        let addr = if my_addr.is_empty() { host } else { my_addr };
        let me = placement::RingMember {
            addr: addr.to_owned(),
            domain: if cfg.domain.is_empty() {
                addr.to_owned()
            } else {
                cfg.domain.clone()
            },
        };
        if cfg.replicas > 0 && !cfg.peers.is_empty() && warden_core::config::unspecified_addr(addr)
        {
            // A configured fleet's ring is computed on every host from its
            // list: this agent at 0.0.0.0 here, at its real address on the
            // others, so they disagree on whose replicas go where and the
            // placement rule refuses them. A launcher's job is told the
            // published address instead (SetCheckpointPeers.self_addr).
            tracing::warn!(
                api_tcp = addr,
                "api.tcp is on an unspecified address while [[checkpoint.peers]] are configured: \
                 the peers place this agent's replicas by the address they list for it, this \
                 agent by {addr}, so the placement rule refuses replicas meant for it; set \
                 api.tcp to the address the peers list"
            );
        }
        let peers = peerset::PeerSet::new(me, cfg.replicas, cfg.peer_timeout, dial, peers);
        if cfg.replicas > 0 && !cfg.peers.is_empty() && peers.targets("").len() < cfg.replicas {
            tracing::warn!(
                wanted = cfg.replicas,
                placed = peers.targets("").len(),
                "too few checkpoint peers outside this host's failure domain for checkpoint.replicas"
            );
        }
        let durable = if cfg.durable.url.is_empty() {
            None
        } else {
            Some(
                durable::Durable::open(&cfg.durable.url)
                    .map_err(|e| format!("checkpoint.durable.url: {e}"))?,
            )
        };
        let (work, work_rx) = mpsc::unbounded_channel();
        Ok(Self {
            cfg: cfg.clone(),
            host: host.to_owned(),
            tier,
            peers,
            peer_pages: peer_pages::PeerPages::default(),
            durable,
            sealing: Sealing::default(),
            gathers: shared_gather::InFlight::default(),
            fetch_turns: fetch_turns::FetchTurns::default(),
            collections: shared_gather::InFlight::keeping(cfg.peer_timeout),
            group_listings: shared_gather::InFlight::keeping(cfg.peer_timeout),
            collect_quota: crate::access::quota::Quota::new(
                collect::STARTS_PER_PEER,
                cfg.peer_timeout,
            ),
            sent: sent::Sent::default(),
            work,
            work_rx: Mutex::new(Some(work_rx)),
        })
    }

    /// Hands a newly committed own shard to the replication and upload task.
    pub fn committed(&self, m: Manifest) {
        let _ = self.work.send(m);
    }

    /// The queue of committed shards, taken once by the task.
    pub fn take_work(&self) -> Option<mpsc::UnboundedReceiver<Manifest>> {
        self.work_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// The peer at `addr`, configured or handed over for a job.
    pub fn peer(&self, addr: &str) -> Option<Peer> {
        self.peers.find(addr)
    }
}

/// Why a copy from elsewhere did not become a committed shard here.
#[derive(Debug, thiserror::Error)]
pub enum IncomingError {
    /// No room, or the filesystem said no.
    #[error(transparent)]
    Tier(#[from] tier::TierError),
    /// Filling the staging file failed: the source's words (a message
    /// starting "corrupt" when the bytes did not match the manifest).
    #[error("{0}")]
    Fill(String),
    /// A blocking task died.
    #[error("checkpoint task: {0}")]
    Task(String),
}

impl Checkpoints {
    /// Brings a copy described by `m` (a peer's replica, a restore from a
    /// peer or the durable store) into the local tier: room made, `fill`
    /// writes and checks the staging file (created by the agent under a
    /// random name, given open, with its path for messages), the file
    /// committed under `m`.
    /// Whatever fails, and if the caller is dropped half way (a gRPC
    /// handler whose peer went), no staging file is left behind.
    pub async fn bring_in<F>(
        self: &Arc<Self>,
        m: &Manifest,
        fill: impl FnOnce(std::fs::File, std::path::PathBuf) -> F,
    ) -> Result<std::path::PathBuf, IncomingError>
    where
        F: std::future::Future<Output = Result<(), String>>,
    {
        let task = |e: tokio::task::JoinError| IncomingError::Task(e.to_string());
        let (ck, key, size) = (self.clone(), m.key(), m.size_bytes);
        let (file, token) = tokio::task::spawn_blocking(move || ck.tier.begin_incoming(&key, size))
            .await
            .map_err(task)??;
        let guard = tier::StagedGuard::new(&self.tier, token.clone());
        let path = self.tier.layout().staging().join(&token);
        fill(file, path).await.map_err(IncomingError::Fill)?;
        let (ck, m) = (self.clone(), m.clone());
        let path = tokio::task::spawn_blocking(move || ck.tier.install(&token, &m))
            .await
            .map_err(task)??;
        guard.keep();
        Ok(path)
    }
}

/// Logs and publishes what the tier found at start: `ckpt.recovered` for
/// half-written files removed, `ckpt.quarantined` (an error) for a step
/// moved whole to `<dir>/.quarantine` because a manifest in it does not
/// read (or left in place, not listed, when even that failed).
pub fn report_recovered(events: &warden_core::events::EventBus, ck: &Checkpoints) {
    use warden_core::events::{NewEvent, Severity};
    for r in ck.tier.take_recovered() {
        let path = r.path.display().to_string();
        let subj = r.key.as_ref().map_or_else(|| "ckpt".to_owned(), subject);
        let mut e = match &r.fate {
            tier::Fate::Removed => {
                tracing::warn!(path = %path, why = %r.why, "checkpoint tier: half-written file removed at start");
                metrics::counter!("warden_ckpt_recovered_removed_total").increment(1);
                NewEvent::new(
                    Severity::Warning,
                    "ckpt.recovered",
                    subj,
                    format!("removed at start: {path}: {}", r.why),
                )
            }
            tier::Fate::Quarantined(to) => {
                let to = to.display().to_string();
                tracing::error!(path = %path, moved_to = %to, why = %r.why,
                    "checkpoint tier: step moved to the quarantine at start, nothing deleted; inspect it, then remove it");
                metrics::counter!("warden_ckpt_quarantined_total").increment(1);
                NewEvent::new(
                    Severity::Error,
                    "ckpt.quarantined",
                    subj,
                    format!(
                        "step {path} moved to {to} at start, nothing deleted: {}; an admin inspects it and removes it",
                        r.why
                    ),
                )
                .with("moved_to", &to)
            }
            tier::Fate::LeftInPlace(err) => {
                tracing::error!(path = %path, why = %r.why, error = %err,
                    "checkpoint tier: step could not be moved to the quarantine; left in place, not listed");
                metrics::counter!("warden_ckpt_quarantined_total").increment(1);
                NewEvent::new(
                    Severity::Error,
                    "ckpt.quarantined",
                    subj,
                    format!(
                        "step {path} left in place, not listed, nothing deleted: {}; moving it to the quarantine failed: {err}",
                        r.why
                    ),
                )
            }
        }
        .with("path", &path)
        .with("why", &r.why);
        if let Some(k) = &r.key {
            e = e
                .with("job_id", &k.job_id)
                .with("rank", k.rank)
                .with("step", k.step);
        }
        events.publish(e);
    }
}

/// How often staging files handed to ranks are checked against the size
/// their BeginShard declared.
pub const STAGING_POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// Until shutdown, every [`STAGING_POLL`]: cuts staging files written past
/// their declared size ([`tier::LocalTier::police_staging`]) and reports
/// each once: logged, counted (`warden_ckpt_staging_overrun_total`) and
/// published as `ckpt.staging_overrun` against the job's rank.
pub async fn police_staging(
    events: Arc<warden_core::events::EventBus>,
    shutdown: tokio_util::sync::CancellationToken,
    ck: Arc<Checkpoints>,
) {
    use warden_core::events::{NewEvent, Severity};
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(STAGING_POLL) => {}
        }
        let ck2 = ck.clone();
        let found = tokio::task::spawn_blocking(move || ck2.tier.police_staging())
            .await
            .unwrap_or_default();
        for o in found {
            tracing::warn!(shard = %o.key, declared = o.declared, found = o.found,
                "staging file written past its declared size: cut to nothing, its commit refused");
            metrics::counter!("warden_ckpt_staging_overrun_total").increment(1);
            events.publish(
                NewEvent::new(
                    Severity::Warning,
                    "ckpt.staging_overrun",
                    subject(&o.key),
                    format!(
                        "{}: the rank wrote its staging file past the {} bytes it declared ({} found); cut to nothing, its commit refused",
                        o.key, o.declared, o.found
                    ),
                )
                .with("job_id", &o.key.job_id)
                .with("rank", o.key.rank)
                .with("step", o.key.step)
                .with("declared_bytes", o.declared)
                .with("found_bytes", o.found),
            );
        }
    }
}

/// `job/J/rank/R`, the subject of a shard's events.
pub fn subject(k: &ShardKey) -> String {
    format!("job/{}/rank/{}", k.job_id, k.rank)
}

/// Counts commits still being sealed (hashed, manifest written), so a
/// restore or listing right after a save sees it.
#[derive(Debug, Default)]
pub struct Sealing {
    n: std::sync::atomic::AtomicUsize,
    /// Commits sealed so far: a gather that started at a count still
    /// current has seen every one ([`shared_gather`]).
    sealed: std::sync::atomic::AtomicU64,
    done: tokio::sync::Notify,
}

/// Held while one commit is sealed.
#[derive(Debug)]
pub struct SealGuard(Arc<Checkpoints>);

impl Drop for SealGuard {
    fn drop(&mut self) {
        self.0
            .sealing
            .sealed
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.0
            .sealing
            .n
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.sealing.done.notify_waiters();
    }
}

impl Sealing {
    /// Commits sealed so far.
    pub fn sealed(&self) -> u64 {
        self.sealed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Waits until no commit is being sealed, at most `limit`.
    pub async fn settled(&self, limit: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.done.notified();
            if self.n.load(std::sync::atomic::Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }
}

impl Checkpoints {
    /// Marks one commit as being sealed until the guard drops.
    pub fn seal_guard(self: &Arc<Self>) -> SealGuard {
        self.sealing
            .n
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        SealGuard(self.clone())
    }
}
