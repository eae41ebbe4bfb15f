//! What the tier knows of a job's checkpoints, as people and launchers
//! read it: every step with a copy, each rank's shard and where its copies
//! are, good or marked corrupt. `ListCheckpoints` answers with this (the
//! edge turns it into the protocol's message), and so does the launcher's
//! notice summary through that call.
//!
//! In: a [`CopiesView`] gathered by [`super::restore::gather`]. Out: a
//! [`Listing`], newest step first within each job. Never: a corrupt copy
//! counted toward a step's completeness (it is listed, with why, and only
//! that).

use std::collections::{BTreeMap, BTreeSet};

use super::Checkpoints;
use super::restore::{CopiesView, Copy, Holder};

/// Every step with a copy, and the holders that could not be asked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Listing {
    /// By job, newest step first within each.
    pub steps: Vec<StepListing>,
    /// Holders that could not be asked, with why.
    pub unreachable: Vec<String>,
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
    /// Each rank with a copy, ascending.
    pub shards: Vec<ShardListing>,
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
}

/// How long a listing waits for saves this agent is still sealing.
pub const SEALING_WAIT_LIST: std::time::Duration = std::time::Duration::from_secs(5);

/// ListCheckpoints as a use case: the saves still sealing here waited for
/// (at most [`SEALING_WAIT_LIST`]), every holder of `job`'s shards asked
/// (`""`: every job), and the steps listed.
pub async fn of_job(ck: &std::sync::Arc<Checkpoints>, job: &str) -> Listing {
    ck.sealing.settled(SEALING_WAIT_LIST).await;
    let view = super::restore::gather(ck, job).await;
    listing(ck, &view)
}

/// The listing of `view` (see the module).
pub fn listing(ck: &Checkpoints, view: &CopiesView) -> Listing {
    let none = BTreeMap::new();
    let none_bad = BTreeMap::new();
    let keys: BTreeSet<&(String, u64)> = view.steps.keys().chain(view.corrupt.keys()).collect();
    let mut steps: Vec<StepListing> = keys
        .into_iter()
        .map(|key| {
            let (job, step) = key;
            let ranks = view.steps.get(key).unwrap_or(&none);
            let bad = view.corrupt.get(key).unwrap_or(&none_bad);
            let all: BTreeSet<u32> = ranks.keys().chain(bad.keys()).copied().collect();
            StepListing {
                job: job.clone(),
                step: *step,
                world_size: CopiesView::world_size(ranks),
                complete: CopiesView::complete(ranks),
                shards: all
                    .into_iter()
                    .map(|rank| {
                        let copies = ranks.get(&rank).map(Vec::as_slice).unwrap_or_default();
                        shard(ck, rank, copies, bad.get(&rank))
                    })
                    .collect(),
            }
        })
        .collect();
    steps.sort_by(|a, b| a.job.cmp(&b.job).then(b.step.cmp(&a.step)));
    Listing {
        steps,
        unreachable: view.unreachable.clone(),
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
