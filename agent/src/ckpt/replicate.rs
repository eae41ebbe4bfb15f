//! The task behind every commit: replicas to peers, uploads to the durable
//! store, retention.
//!
//! In: own shards as they are committed, and a timer. Out: pushes to the
//! placement targets, uploads, pruned steps, events.
//!
//! Replication is reconciled, not queued: every `retry_interval` the task
//! asks each target what it holds and sends what is missing, so a peer
//! that was down, or an agent restarted mid-copy, catches up without a
//! journal of pending work. A commit triggers the same push at once.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::layout::ShardKey;
use super::manifest::Manifest;
use super::{Checkpoints, Peer, subject};
use warden_core::events::EventBus;
use warden_core::events::{NewEvent, Severity};

/// Runs until shutdown.
pub async fn run(events: Arc<EventBus>, shutdown: CancellationToken, ck: Arc<Checkpoints>) {
    let Some(mut work) = ck.take_work() else {
        return;
    };
    let mut uploads = Uploads::default();
    let mut tick = tokio::time::interval(ck.cfg.retry_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let mut fresh: Vec<Manifest> = tokio::select! {
            () = shutdown.cancelled() => return,
            m = work.recv() => match m {
                Some(m) => {
                    let mut v = vec![m];
                    while let Ok(m) = work.try_recv() { v.push(m); }
                    v
                }
                None => return,
            },
            _ = tick.tick() => Vec::new(),
        };
        let jobs: BTreeSet<String> = fresh.iter().map(|m| m.job_id.clone()).collect();
        let pushed = !fresh.is_empty();
        // Retention before the push when there is no durable store (whose
        // uploads of due steps come first): the steps these commits make
        // old are not pushed, and their room (a GiB of tmpfs per shard) is
        // given back before the new shards are sent rather than after.
        if ck.durable.is_none() {
            prune(&events, &ck, &jobs, &mut fresh).await;
        }
        if !pushed {
            // Reconcile: every own shard, job by job, against what each of
            // the job's targets says it holds. The record of what was sent
            // keeps only shards still here (retention, room made, a bad
            // copy removed: every way a shard leaves the tier).
            let own = own_shards(&ck).await;
            ck.sent
                .keep_only(&own.iter().map(Manifest::key).collect::<HashSet<_>>());
            for (job, own) in by_job(own) {
                for peer in ck.peers.targets(&job) {
                    reconcile(&events, &ck, &peer, &job, own.clone()).await;
                }
            }
        } else {
            for (job, ms) in by_job(std::mem::take(&mut fresh)) {
                for peer in ck.peers.targets(&job) {
                    send(&events, &ck, &peer, &ms).await;
                }
            }
        }
        if ck.durable.is_some() {
            upload_due(&events, &ck, &mut uploads).await;
            prune(&events, &ck, &jobs, &mut fresh).await;
        }
    }
}

/// Applies retention to `jobs`; what it removed is forgotten as sent and
/// dropped from `fresh`.
async fn prune(
    events: &EventBus,
    ck: &Arc<Checkpoints>,
    jobs: &BTreeSet<String>,
    fresh: &mut Vec<Manifest>,
) {
    for job in jobs {
        let (ck2, job) = (ck.clone(), job.clone());
        let gone = tokio::task::spawn_blocking(move || ck2.tier.prune(&job))
            .await
            .unwrap_or_default();
        for k in gone {
            ck.sent.forget(&k);
            fresh.retain(|m| m.key() != k);
            events.publish(
                NewEvent::new(
                    Severity::Info,
                    "ckpt.pruned",
                    subject(&k),
                    format!("{k} pruned (checkpoint.keep_steps)"),
                )
                .with("job_id", &k.job_id)
                .with("rank", k.rank)
                .with("step", k.step),
            );
        }
    }
}

/// The shards this host's ranks saved (not peers' replicas), read off the
/// tier on a blocking thread.
async fn own_shards(ck: &Arc<Checkpoints>) -> Vec<Manifest> {
    let ck = ck.clone();
    tokio::task::spawn_blocking(move || {
        ck.tier
            .list(None)
            .into_iter()
            .filter(|m| m.origin == ck.host)
            .collect()
    })
    .await
    .unwrap_or_default()
}

/// Manifests grouped by job.
fn by_job(ms: Vec<Manifest>) -> BTreeMap<String, Vec<Manifest>> {
    let mut out: BTreeMap<String, Vec<Manifest>> = BTreeMap::new();
    for m in ms {
        out.entry(m.job_id.clone()).or_default().push(m);
    }
    out
}

/// Sends `peer` the own shards of `job` it lacks, after asking what it
/// holds (those it already has are remembered as sent).
async fn reconcile(
    events: &EventBus,
    ck: &Arc<Checkpoints>,
    peer: &Peer,
    job: &str,
    own: Vec<Manifest>,
) {
    let addr = &peer.member.addr;
    let own: Vec<Manifest> = own
        .into_iter()
        .filter(|m| !ck.sent.contains(addr, &m.key(), &m.xxh3))
        .collect();
    if own.is_empty() {
        return;
    }
    let Ok(held) = peer.held(job, ck.cfg.peer_timeout).await else {
        return;
    };
    let todo: Vec<Manifest> = own
        .into_iter()
        .filter(|m| {
            let there = held.contains(&(m.key(), m.hash().unwrap_or(0)));
            if there {
                ck.sent.record(addr, &peer.name, &m.key(), &m.xxh3);
            }
            !there
        })
        .collect();
    send(events, ck, peer, &todo).await;
}

/// Pushes `todo` to `peer` one shard at a time; stops at the first failure
/// (the peer is likely down: the next reconcile tries again).
async fn send(events: &EventBus, ck: &Arc<Checkpoints>, peer: &Peer, todo: &[Manifest]) {
    let addr = &peer.member.addr;
    for m in todo {
        let key = m.key();
        if ck.sent.contains(addr, &key, &m.xxh3) {
            continue;
        }
        let path = ck.tier.layout().data(&key);
        let (ck2, k2) = (ck.clone(), key.clone());
        let file = match tokio::task::spawn_blocking(move || ck2.tier.open_data(&k2)).await {
            Ok(Ok((f, _))) => f,
            Ok(Err(e)) => {
                tracing::warn!(shard = %key, error = %e, "checkpoint shard not replicated");
                continue;
            }
            Err(e) => {
                tracing::warn!(shard = %key, error = %e, "checkpoint shard not replicated");
                continue;
            }
        };
        let started = Instant::now();
        let pushed = peer
            .push(
                m,
                file,
                path,
                ck.cfg.chunk_bytes,
                ck.cfg.replication_bytes_per_sec,
            )
            .await;
        match pushed {
            Ok(host) => {
                let secs = started.elapsed().as_secs_f64();
                ck.sent.record(addr, &host, &key, &m.xxh3);
                metrics::counter!("warden_ckpt_replicated_bytes_total").increment(m.size_bytes);
                events.publish(
                    NewEvent::new(
                        Severity::Info,
                        "ckpt.replicated",
                        subject(&key),
                        format!(
                            "{key} copied to {} ({}) in {:.1} ms",
                            host,
                            peer.member.addr,
                            secs * 1e3
                        ),
                    )
                    .with("job_id", &key.job_id)
                    .with("rank", key.rank)
                    .with("step", key.step)
                    .with("peer", &peer.member.addr)
                    .with("bytes", m.size_bytes)
                    .with("ms", format!("{:.3}", secs * 1e3)),
                );
            }
            Err(s) => {
                metrics::counter!("warden_ckpt_replication_failures_total").increment(1);
                tracing::warn!(shard = %key, peer = %peer.member.addr, error = %s,
                    "checkpoint replication failed; retried every checkpoint.retry_interval");
                events.publish(
                    NewEvent::new(
                        Severity::Warning,
                        "ckpt.replication_failed",
                        subject(&key),
                        format!("{key} not copied to {}: {s}", peer.member.addr),
                    )
                    .with("job_id", &key.job_id)
                    .with("rank", key.rank)
                    .with("step", key.step)
                    .with("peer", &peer.member.addr),
                );
                // The peer is likely down: leave the rest to the next tick.
                return;
            }
        }
    }
}

/// What the durable uploads have done so far.
#[derive(Debug, Default)]
struct Uploads {
    /// When each job last had a step made due by time.
    last: BTreeMap<String, Instant>,
    /// Steps chosen for upload (by number or by time).
    due: BTreeSet<(String, u64)>,
    /// Shards uploaded, with the checksum they had.
    done: HashSet<(ShardKey, String)>,
}

/// Uploads the own shards of due steps: a step is due when its number is a
/// multiple of `every_steps`, or when it is a job's newest step `every`
/// after the last one made due by time. Shards are uploaded one by one as
/// they are committed, so a rank that commits after its host's others
/// still gets its shard uploaded.
async fn upload_due(events: &EventBus, ck: &Arc<Checkpoints>, up: &mut Uploads) {
    let Some(store) = ck.durable.as_ref() else {
        return;
    };
    let own = own_shards(ck).await;
    let every = &ck.cfg.durable;
    let mut newest: BTreeMap<&str, u64> = BTreeMap::new();
    for m in &own {
        let n = newest.entry(m.job_id.as_str()).or_default();
        *n = (*n).max(m.step);
        if every.every_steps > 0 && m.step % every.every_steps == 0 {
            up.due.insert((m.job_id.clone(), m.step));
        }
    }
    if every.every > Duration::ZERO {
        for (job, step) in newest {
            if up.last.get(job).is_none_or(|t| t.elapsed() >= every.every) {
                up.due.insert((job.to_owned(), step));
                up.last.insert(job.to_owned(), Instant::now());
            }
        }
    }
    // Forget what retention removed.
    let present: HashSet<ShardKey> = own.iter().map(Manifest::key).collect();
    up.done.retain(|(k, _)| present.contains(k));
    up.due
        .retain(|(j, s)| own.iter().any(|m| m.job_id == *j && m.step == *s));

    let mut todo: BTreeMap<(&str, u64), Vec<&Manifest>> = BTreeMap::new();
    for m in &own {
        if up.due.contains(&(m.job_id.clone(), m.step))
            && !up.done.contains(&(m.key(), m.xxh3.clone()))
        {
            todo.entry((m.job_id.as_str(), m.step)).or_default().push(m);
        }
    }
    for ((job, step), shards) in todo {
        let started = Instant::now();
        let mut bytes = 0u64;
        let mut failed = None;
        for m in &shards {
            let (ck2, k2) = (ck.clone(), m.key());
            let opened = tokio::task::spawn_blocking(move || ck2.tier.open_data(&k2))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()));
            let up_one = match opened {
                Ok((f, _)) => store.upload(m, f).await,
                Err(e) => Err(e),
            };
            match up_one {
                Ok(()) => {
                    bytes += m.size_bytes;
                    up.done.insert((m.key(), m.xxh3.clone()));
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        match failed {
            None => {
                metrics::counter!("warden_ckpt_uploaded_bytes_total").increment(bytes);
                events.publish(
                    NewEvent::new(
                        Severity::Info,
                        "ckpt.uploaded",
                        format!("job/{job}"),
                        format!(
                            "job {job} step {step}: {} shards uploaded to {} in {:.1} ms",
                            shards.len(),
                            store.url(),
                            started.elapsed().as_secs_f64() * 1e3
                        ),
                    )
                    .with("job_id", job)
                    .with("step", step)
                    .with("bytes", bytes)
                    .with("url", store.url()),
                );
            }
            Some(e) => {
                tracing::warn!(job, step, error = %e, "checkpoint upload failed; retried");
                events.publish(
                    NewEvent::new(
                        Severity::Warning,
                        "ckpt.upload_failed",
                        format!("job/{job}"),
                        format!("job {job} step {step} not uploaded: {e}"),
                    )
                    .with("job_id", job)
                    .with("step", step),
                );
            }
        }
    }
}
