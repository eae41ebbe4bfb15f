//! The two ways a shard becomes committed in this tier: a rank's own
//! (CommitShard) and a peer's replica (PushShard).
//!
//! In: a checked key (or a peer's manifest, its sender already
//! authorized at the edge), the staged file's token or the incoming
//! stream. Out: the shard committed, durably, with its events
//! (`ckpt.saved` / `ckpt.commit_failed`, `ckpt.replica_stored`,
//! `ckpt.pruned`) and its hand-over to replication and upload; a domain
//! error otherwise. Never: a shard committed on disk but not announced or
//! not handed on (a rank's commit runs to its end in a task of its own,
//! whatever happens to the caller); a protobuf type or the agent's state.

use std::path::PathBuf;
use std::sync::Arc;

use warden_core::events::{EventBus, NewEvent, Severity};
use warden_core::signal::{CkptSaved, Signal};

use super::layout::ShardKey;
use super::manifest::Manifest;
use super::receive::{self, ShardStream};
use super::tier::TierError;
use super::{Checkpoints, IncomingError, subject};

/// Why a rank's own shard was not committed.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// The tier refused: a bad name, no room, the filesystem.
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The commit's task died.
    #[error("checkpoint commit task: {0}")]
    Task(String),
}

/// A rank's shard `k`, staged under `token` (`size` bytes, of a job of
/// `world` ranks), renamed into place, hashed, synced and its manifest
/// written durably before this returns: "committed" means it survives the
/// agent's death. `ckpt.saved` (with the rank's `stall_ms`) is published
/// and the shard handed to replication and upload.
pub async fn own_shard(
    ck: Arc<Checkpoints>,
    events: Arc<EventBus>,
    k: ShardKey,
    token: String,
    size: u64,
    world: u32,
    stall_ms: f64,
) -> Result<PathBuf, CommitError> {
    // The commit runs to its end in a task of its own: a rank whose
    // connection drops mid-seal must not leave a shard committed on disk
    // but never announced (`ckpt.saved`) nor handed to replication and
    // upload. The answer waits for it all the same.
    let task = tokio::spawn(async move {
        // Restores and listings wait for commits in flight.
        let _sealing = ck.seal_guard();
        let (ck2, k2) = (ck.clone(), k.clone());
        let sealed = tokio::task::spawn_blocking(move || {
            let (path, file) = ck2.tier.place(&k2, &token, size)?;
            let host = ck2.host.clone();
            ck2.tier.seal(&k2, file, world, &host).map(|m| (path, m))
        })
        .await
        .map_err(|e| CommitError::Task(e.to_string()))
        .and_then(|r| r.map_err(CommitError::Tier));
        let (path, m) = match sealed {
            Ok(v) => v,
            Err(e) => {
                failed(&events, &k, &e.to_string());
                return Err(e);
            }
        };
        metrics::counter!("warden_ckpt_saved_bytes_total").increment(m.size_bytes);
        metrics::histogram!("warden_ckpt_save_stall_seconds").record(stall_ms / 1e3);
        events.publish(Signal::CkptSaved(CkptSaved {
            subject: subject(&k),
            shard: k.to_string(),
            job: k.job_id.clone(),
            rank: k.rank,
            step: k.step,
            stall_ms,
            bytes: m.size_bytes,
            xxh3: m.xxh3.clone(),
        }));
        ck.committed(m);
        Ok(path)
    });
    task.await.map_err(|e| CommitError::Task(e.to_string()))?
}

fn failed(events: &EventBus, k: &ShardKey, why: &str) {
    tracing::error!(shard = %k, error = why, "checkpoint shard not committed");
    events.publish(
        NewEvent::new(
            Severity::Error,
            "ckpt.commit_failed",
            subject(k),
            format!("{k} was not committed: {why}"),
        )
        .with("job_id", &k.job_id)
        .with("rank", k.rank)
        .with("step", k.step),
    );
}

/// A peer's replica described by `m`, whose first chunk's bytes are
/// `first` and the rest in `stream`, checked against `m` as it is written
/// and committed here (`ckpt.replica_stored`). The job's retention runs
/// after, off the pusher's time.
pub async fn replica(
    ck: Arc<Checkpoints>,
    events: Arc<EventBus>,
    m: Manifest,
    first: Vec<bytes::Bytes>,
    mut stream: impl ShardStream,
) -> Result<(), IncomingError> {
    let k = m.key();
    let (stream, want) = (&mut stream, &m);
    ck.bring_in(&m, |staged, path| async move {
        receive::receive(stream, first, want, staged, path).await
    })
    .await?;
    // Retention after the answer: the pusher's time ends with the commit,
    // not with deleting the step this replica replaces (a GiB of tmpfs
    // freed is tens of ms). Retention removes only listed shards older
    // than the newest complete steps, so it can run beside later pushes.
    let (ev2, job) = (events.clone(), k.job_id.clone());
    tokio::spawn(async move {
        let ck2 = ck.clone();
        let gone = tokio::task::spawn_blocking(move || ck2.tier.prune(&job))
            .await
            .unwrap_or_default();
        for k in gone {
            ev2.publish(
                NewEvent::new(
                    Severity::Info,
                    "ckpt.pruned",
                    subject(&k),
                    format!("{k} replica pruned (checkpoint.keep_steps)"),
                )
                .with("job_id", &k.job_id)
                .with("rank", k.rank)
                .with("step", k.step),
            );
        }
    });
    events.publish(
        NewEvent::new(
            Severity::Info,
            "ckpt.replica_stored",
            subject(&k),
            format!("{k} replica from {} stored", m.origin),
        )
        .with("job_id", &k.job_id)
        .with("rank", k.rank)
        .with("step", k.step)
        .with("origin", &m.origin)
        .with("bytes", m.size_bytes),
    );
    Ok(())
}
