//! What the tier knows of a job's checkpoints, as people and launchers
//! read it: every step with a copy, each rank's shard and where its copies
//! are, good or marked corrupt. `ListCheckpoints` answers with this (the
//! edge turns it into the protocol's message), and so does the launcher's
//! notice summary through that call.
//!
//! In: a [`CopiesView`] gathered by [`super::restore::gather`], and a
//! [`Scope`] (how much of each step, which ranks). Out: a [`Listing`],
//! newest step first within each job, each step with its counts whatever
//! the scope. Never: a corrupt copy counted toward a step's completeness
//! (it is listed, with why, and only that); a listing of every shard of a
//! large job unless asked for by name: 12,500 hosts of 8 ranks are 100,000
//! shards a step, about 10 MB, past a client's default 4 MiB receive limit
//! (the launcher's progress check and `warden ckpt ls` would fail where
//! they matter most).

use std::collections::{BTreeMap, BTreeSet};

use super::Checkpoints;
use super::holdings::MAX_MISSING;
use super::restore::{CopiesView, Copy, Holder};

/// Every step with a copy, and the holders that could not be asked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Listing {
    /// By job, newest step first within each.
    pub steps: Vec<StepListing>,
    /// Holders that could not be asked, with why.
    pub unreachable: Vec<String>,
    /// Every step's shards were left out (see [`Detail`]).
    pub summarized: bool,
    /// The counts came from the job's collector (`CopiesView::counts`).
    pub collected: bool,
}

/// How much of each step's shards a listing carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Detail {
    /// Every shard asked for, unless more than [`MAX_DEFAULT_SHARDS`]: then
    /// none.
    #[default]
    Default,
    /// None: the counts alone.
    Summary,
    /// Every shard asked for, however many.
    All,
}

/// The most shards a listing carries unless every one is asked for: a
/// table a person can read, and about 100 KB on the wire.
pub const MAX_DEFAULT_SHARDS: usize = 1024;

/// The most ranks one listing may name: a job's world is bounded well
/// below this (`MAX_WORLD_SIZE`); a longer list is a caller's mistake.
pub const MAX_SCOPE_RANKS: usize = 65_536;

/// What a listing carries of each step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// How much.
    pub detail: Detail,
    /// Only these ranks' shards; `None`: every rank's.
    pub ranks: Option<BTreeSet<u32>>,
}

/// One step of one job.
#[derive(Debug, Clone, PartialEq)]
pub struct StepListing {
    /// The job.
    pub job: String,
    /// The step.
    pub step: u64,
    /// What the step's shards say the world was.
    pub world_size: u32,
    /// Whether a good copy of every rank's shard is known.
    pub complete: bool,
    /// Each rank with a copy (of those in scope), ascending; empty when
    /// the listing is summarized.
    pub shards: Vec<ShardListing>,
    /// The step's counts over every rank, whatever the scope.
    pub counts: StepCounts,
}

/// A step's counts over every rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepCounts {
    /// Ranks with a good copy.
    pub ranks_with_copy: u32,
    /// The sum of those ranks' shard sizes, where known.
    pub size_bytes: u64,
    /// How many ranks `size_bytes` adds up: all with a copy, or fewer where
    /// the collector knows no size for some (`holdings::Tally`).
    pub sized_ranks: u32,
    /// Good copies over every tier.
    pub good_copies: u32,
    /// Copies a scrub marked corrupt.
    pub corrupt_copies: u32,
    /// The first ranks below the world size with no good copy, ascending
    /// ([`MAX_MISSING`] at most, the bound of the collector's job view).
    pub missing: Vec<u32>,
}

/// One rank's shard of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardListing {
    /// The rank.
    pub rank: u32,
    /// Its size, from its first good copy's manifest (0 when none is good).
    pub size_bytes: u64,
    /// Its content hash, from the same manifest (0 when none is good).
    pub xxh3: u64,
    /// Its copies, nearest first; a local copy marked corrupt last.
    pub copies: Vec<CopyListing>,
}

/// Where one copy is.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyListing {
    /// `local`, `peer` or `durable`.
    pub tier: &'static str,
    /// The host (this one or a peer) or the durable store's URL.
    pub holder: String,
    /// Why a scrub marked it corrupt; `None` for a good copy.
    pub corrupt: Option<String>,
    /// Listed from this agent's record of the push ([`super::sent`]): its
    /// holder could not be asked now.
    pub unconfirmed: bool,
}

/// How long a listing waits for saves this agent is still sealing.
pub const SEALING_WAIT_LIST: std::time::Duration = std::time::Duration::from_secs(5);

/// ListCheckpoints as a use case: the saves still sealing here waited for
/// (at most [`SEALING_WAIT_LIST`]), every holder of `job`'s shards asked
/// (`""`: every job), and the steps listed within `scope`. A summary of a
/// job that restores through the collector ([`super::collect::collects`])
/// asks the collector instead, one ask of this host's group leader shared
/// there with every other host's (a launcher's progress check at a failure
/// every host sees at once was every host asking every other: 156 million
/// listings at 12,500 hosts, issue 30); the copies a scrub marked corrupt
/// are then this agent's alone (each host marks its own). A listing of at most
/// [`MAX_COLLECTED_RANKS`] named ranks of such a job asks it and the
/// ranks' holders ([`super::restore::gather_ranks`]).
pub async fn of_job(ck: &std::sync::Arc<Checkpoints>, job: &str, scope: &Scope) -> Listing {
    ck.sealing.settled(SEALING_WAIT_LIST).await;
    if scope.detail == Detail::Summary && super::collect::collects(ck, job) {
        match super::collect::job_view(ck, job, &[0], ck.cfg.peer_timeout).await {
            // Only while the counts cover this host's newest step (see
            // `restore::gather_ranks`): else the whole job, as before.
            Ok(v) => {
                let view = super::restore::counted_by(ck, job, v).await;
                if super::restore::counts_the_newest(&view, job) {
                    return listing(ck, job, &view, scope);
                }
            }
            Err(e) => {
                tracing::warn!(job, error = %e, "listing the job's counts without the collector")
            }
        }
    }
    let view = match &scope.ranks {
        Some(ranks) if ranks.len() <= MAX_COLLECTED_RANKS => {
            super::restore::gather_ranks(ck, job, ranks).await
        }
        _ => super::restore::gather(ck, job).await,
    };
    listing(ck, job, &view, scope)
}

/// The most named ranks whose listing asks the collector and their holders
/// rather than every host: a host's ranks (the launcher's notice check),
/// or a few a person names. One ask of the collector names them all.
pub const MAX_COLLECTED_RANKS: usize = super::holdings::MAX_VIEW_RANKS;

/// The listing of `view` (of `job`; `""`: every job) within `scope` (see
/// the module). A view with the collector's counts (`CopiesView::counts`,
/// the copies of some ranks only) takes each step's completeness and counts
/// from them; a step the collection did not count (saved since) is judged
/// from the copies in view, as every view is.
pub fn listing(ck: &Checkpoints, job: &str, view: &CopiesView, scope: &Scope) -> Listing {
    let none = BTreeMap::new();
    let none_bad = BTreeMap::new();
    let counted = view.counts.as_ref().filter(|_| !job.is_empty());
    let counted_keys: Vec<(String, u64)> = counted
        .into_iter()
        .flat_map(|c| c.keys().map(|&step| (job.to_owned(), step)))
        .collect();
    let keys: BTreeSet<&(String, u64)> = view
        .steps
        .keys()
        .chain(view.corrupt.keys())
        .chain(&counted_keys)
        .collect();
    let mut steps: Vec<StepListing> = keys
        .into_iter()
        .map(|key| {
            let (j, step) = key;
            let ranks = view.steps.get(key).unwrap_or(&none);
            let bad = view.corrupt.get(key).unwrap_or(&none_bad);
            let all: BTreeSet<u32> = ranks.keys().chain(bad.keys()).copied().collect();
            let count = counted.filter(|_| j == job).and_then(|c| c.get(step));
            let world_size = count.map_or_else(|| CopiesView::world_size(ranks), |c| c.world);
            StepListing {
                job: j.clone(),
                step: *step,
                world_size,
                complete: count.map_or_else(|| CopiesView::complete(ranks), |c| c.complete()),
                shards: all
                    .into_iter()
                    .filter(|r| scope.ranks.as_ref().is_none_or(|want| want.contains(r)))
                    .map(|rank| {
                        let copies = ranks.get(&rank).map(Vec::as_slice).unwrap_or_default();
                        let mut s = shard(ck, rank, copies, bad.get(&rank));
                        s.copies.extend(sent_unheard(ck, &view.unanswered, copies));
                        s
                    })
                    .collect(),
                counts: match count {
                    Some(c) => counted_step(c, bad.len()),
                    None => counts(ranks, bad.len(), world_size),
                },
            }
        })
        .collect();
    steps.sort_by(|a, b| a.job.cmp(&b.job).then(b.step.cmp(&a.step)));
    let listed: usize = steps.iter().map(|s| s.shards.len()).sum();
    let summarized = match scope.detail {
        Detail::Summary => true,
        Detail::Default => listed > MAX_DEFAULT_SHARDS,
        Detail::All => false,
    };
    if summarized {
        for s in &mut steps {
            s.shards = Vec::new();
        }
    }
    Listing {
        steps,
        unreachable: view.unreachable.clone(),
        summarized,
        collected: counted.is_some(),
    }
}

/// A step's counts as the collector took them, with the copies of it here
/// a scrub marked corrupt (each host marks its own).
fn counted_step(s: &super::holdings::JobStep, corrupt: usize) -> StepCounts {
    let tally = s.tally.unwrap_or_default();
    StepCounts {
        ranks_with_copy: s.present,
        size_bytes: tally.size_bytes,
        sized_ranks: tally.sized_ranks,
        good_copies: u32::try_from(tally.copies).unwrap_or(u32::MAX),
        corrupt_copies: u32::try_from(corrupt).unwrap_or(u32::MAX),
        missing: s.missing.clone(),
    }
}

/// A step's counts, from its good copies by rank (`ranks`), how many of its
/// ranks' local copies are marked corrupt, and its world size.
fn counts(ranks: &BTreeMap<u32, Vec<Copy>>, corrupt: usize, world_size: u32) -> StepCounts {
    let with_copy = || ranks.iter().filter(|(_, c)| !c.is_empty());
    let ranks_with_copy = u32::try_from(with_copy().count()).unwrap_or(u32::MAX);
    StepCounts {
        ranks_with_copy,
        // Every copy here has its manifest, and its size.
        sized_ranks: ranks_with_copy,
        size_bytes: with_copy()
            .filter_map(|(_, c)| c.first())
            .map(|c| c.manifest.size_bytes)
            .fold(0u64, u64::saturating_add),
        good_copies: u32::try_from(ranks.values().map(Vec::len).sum::<usize>()).unwrap_or(u32::MAX),
        corrupt_copies: u32::try_from(corrupt).unwrap_or(u32::MAX),
        missing: (0..world_size)
            .filter(|r| ranks.get(r).is_none_or(Vec::is_empty))
            .take(MAX_MISSING)
            .collect(),
    }
}

/// One rank's shard: its good copies, then the local copy a scrub marked
/// corrupt, if one was.
fn shard(ck: &Checkpoints, rank: u32, copies: &[Copy], corrupt: Option<&String>) -> ShardListing {
    let mut out: Vec<CopyListing> = copies
        .iter()
        .map(|c| CopyListing {
            tier: c.holder.tier(),
            holder: holder_name(ck, &c.holder),
            corrupt: None,
            unconfirmed: false,
        })
        .collect();
    if let Some(why) = corrupt {
        out.push(CopyListing {
            tier: Holder::Local.tier(),
            holder: ck.host.clone(),
            corrupt: Some(if why.is_empty() {
                "marked corrupt".to_owned()
            } else {
                why.clone()
            }),
            unconfirmed: false,
        });
    }
    ShardListing {
        rank,
        size_bytes: copies.first().map(|c| c.manifest.size_bytes).unwrap_or(0),
        xxh3: copies
            .first()
            .and_then(|c| c.manifest.hash().ok())
            .unwrap_or(0),
        copies: out,
    }
}

/// The copies of an own shard (its local copy among `copies`) that this
/// agent sent to peers which this listing's gather asked and which could
/// not answer (an agent stopped with its job's launcher, a host that went
/// with the same notice), as the holders confirmed them when sent: a peer
/// that answered, or was not asked, is not spoken for. Listed only, marked
/// `unconfirmed`, never counted toward a step's completeness (a restore
/// fetches only from a holder that answers).
fn sent_unheard(
    ck: &Checkpoints,
    unanswered: &BTreeSet<String>,
    copies: &[Copy],
) -> Vec<CopyListing> {
    let Some(own) = copies
        .iter()
        .find(|c| c.holder == Holder::Local && c.manifest.origin == ck.host)
    else {
        return Vec::new();
    };
    ck.sent
        .holders(&own.manifest.key(), &own.manifest.xxh3)
        .into_iter()
        .filter(|c| unanswered.contains(&c.addr))
        .filter(|c| {
            !copies
                .iter()
                .any(|h| matches!(&h.holder, Holder::Peer { addr, .. } if *addr == c.addr))
        })
        .map(|c| CopyListing {
            tier: "peer",
            holder: format!("{} (sent; not answering now)", c.host),
            corrupt: None,
            unconfirmed: true,
        })
        .collect()
}

/// The name a person reads for a holder.
fn holder_name(ck: &Checkpoints, h: &Holder) -> String {
    match h {
        Holder::Local => ck.host.clone(),
        Holder::Peer { host, .. } => host.clone(),
        Holder::Durable => ck
            .durable
            .as_ref()
            .map(|d| d.url().to_owned())
            .unwrap_or_default(),
    }
}
