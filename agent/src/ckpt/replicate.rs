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

/// How many reconcile ticks (`checkpoint.retry_interval` each, 2 s by
/// default) pass between asks of a peer that, by this agent's record,
/// already holds every own shard of a job: a peer restarted on an empty
/// tier (tmpfs lost) would otherwise never get them again. Every 15th
/// (30 s by default), so a settled job costs each peer one listing a half
/// minute, not one a tick.
pub const RECHECK_TICKS: u32 = 15;

/// Runs until shutdown.
pub async fn run(events: Arc<EventBus>, shutdown: CancellationToken, ck: Arc<Checkpoints>) {
    let Some(mut work) = ck.take_work() else {
        return;
    };
    let mut uploads = Uploads::default();
    let mut tick = tokio::time::interval(ck.cfg.retry_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut ticks: u32 = 0;
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
            ticks = ticks.wrapping_add(1);
            let recheck = ticks.is_multiple_of(RECHECK_TICKS);
            for (job, own) in by_job(own) {
                for peer in ck.peers.targets(&job) {
                    reconcile(&events, &ck, &peer, &job, own.clone(), recheck).await;
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
/// holds (those it already has are remembered as sent). When every shard
/// is recorded as sent the peer is not asked, unless `recheck`; whenever
/// it is asked, a recorded copy it no longer holds is sent again
/// ([`lost_copies`]).
async fn reconcile(
    events: &EventBus,
    ck: &Arc<Checkpoints>,
    peer: &Peer,
    job: &str,
    own: Vec<Manifest>,
    recheck: bool,
) {
    let addr = &peer.member.addr;
    let (sent, own): (Vec<Manifest>, Vec<Manifest>) = own
        .into_iter()
        .partition(|m| ck.sent.contains(addr, &m.key(), &m.xxh3));
    if own.is_empty() && !recheck {
        return;
    }
    let Ok(held) = peer.held(job, ck.cfg.peer_timeout).await else {
        return;
    };
    let mut own = own;
    for m in lost_copies(sent, &held) {
        tracing::warn!(shard = %m.key(), peer = %addr,
            "checkpoint replica gone from its peer (its tier lost?); sending it again");
        ck.sent.forget_at(addr, &m.key());
        own.push(m);
    }
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

/// Of the shards recorded as sent to a peer, those it no longer holds and
/// did not prune: it holds no shard of the job at a later step. A peer
/// prunes a replica by the job's retention, which keeps the newest steps,
/// so a shard missing beside a later step may be pruned and is not pushed
/// back (that would fight its retention); one missing with nothing later
/// was lost (a peer restarted on an empty tmpfs). The later step may be
/// anyone's: a peer back on an empty tier whose own ranks (or another
/// host's) commit a later step before this host's recheck goes without
/// this host's older copies until this host saves again. A replica the peer's
/// scrub found corrupt is not listed, so it is sent again here, replacing
/// the bad copy.
fn lost_copies(sent: Vec<Manifest>, held: &HashSet<(ShardKey, u64)>) -> Vec<Manifest> {
    let newest = held.iter().map(|(k, _)| k.step).max();
    sent.into_iter()
        .filter(|m| !held.contains(&(m.key(), m.hash().unwrap_or(0))))
        .filter(|m| newest.is_none_or(|n| n <= m.step))
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(step: u64, rank: u32) -> Manifest {
        Manifest {
            job_id: "job".into(),
            step,
            rank,
            world_size: 4,
            size_bytes: 1,
            xxh3: format!("{:016x}", u64::from(rank) + step),
            origin: "h0".into(),
            committed_unix: 0,
        }
    }

    fn held(ms: &[Manifest]) -> HashSet<(ShardKey, u64)> {
        ms.iter().map(|m| (m.key(), m.hash().unwrap())).collect()
    }

    fn keys(ms: &[Manifest]) -> Vec<(u64, u32)> {
        ms.iter().map(|m| (m.step, m.rank)).collect()
    }

    #[test]
    fn a_sent_copy_is_sent_again_only_when_the_peer_lost_it_not_when_it_pruned_it() {
        let sent = vec![shard(10, 0), shard(20, 0), shard(20, 1)];
        // Still there: nothing to send.
        assert!(lost_copies(sent.clone(), &held(&sent)).is_empty());
        // The peer's tier is empty (it came back on a new tmpfs): all of them.
        assert_eq!(
            keys(&lost_copies(sent.clone(), &HashSet::new())),
            [(10, 0), (20, 0), (20, 1)]
        );
        // Step 10 gone beside step 20: its retention pruned it; rank 1 of
        // step 20 gone with step 20 there: lost.
        assert_eq!(
            keys(&lost_copies(sent.clone(), &held(&[shard(20, 0)]))),
            [(20, 1)]
        );
        // Another checksum there is not this copy.
        let mut other = shard(20, 0);
        other.xxh3 = "00000000000000ff".into();
        assert_eq!(
            keys(&lost_copies(vec![shard(20, 0)], &held(&[other]))),
            [(20, 0)]
        );
        // A later step of the job there (another host's): nothing older is pushed back.
        assert!(lost_copies(sent, &held(&[shard(30, 3)])).is_empty());
    }
}
