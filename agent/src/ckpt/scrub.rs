//! Background scrub: committed shards re-read and checked, at a bounded
//! rate, so a copy whose bytes changed (a flipped bit in memory or on
//! disk) is found before a restore needs it.
//!
//! In: the local tier's committed shards, `checkpoint.scrub_bytes_per_sec`
//! and `checkpoint.scrub_interval`. Out: a `.bad` marker beside a corrupt
//! copy (see [`super::tier::LocalTier::mark_bad`]), a `ckpt.corrupt` event
//! and `warden_ckpt_scrub_corrupt_total`; `warden_ckpt_scrubbed_bytes_total`
//! for the work done. Never: more than the configured bytes per second,
//! or a mark on a copy that was replaced while it was read.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::layout::ShardKey;
use super::manifest::{self, Manifest};
use super::{Checkpoints, subject};
use warden_core::events::EventBus;
use warden_core::events::{NewEvent, Severity};

/// Bytes read between two checks of the rate.
const BLOCK: usize = 1 << 20;

/// Runs passes over the tier until shutdown; returns at once when the
/// scrub is off.
pub async fn run(events: Arc<EventBus>, shutdown: CancellationToken, ck: Arc<Checkpoints>) {
    let rate = ck.cfg.scrub_bytes_per_sec;
    if rate == 0 {
        return;
    }
    let stop = shutdown;
    loop {
        let ck2 = ck.clone();
        let stop2 = stop.clone();
        let found = tokio::task::spawn_blocking(move || pass(&ck2, rate, &stop2))
            .await
            .unwrap_or_default();
        for (k, why) in found {
            report(&events, &k, &why);
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(ck.cfg.scrub_interval) => {}
        }
    }
}

/// One pass: every committed shard checked; returns those marked corrupt.
fn pass(ck: &Checkpoints, rate: u64, stop: &CancellationToken) -> Vec<(ShardKey, String)> {
    let mut pace = Pace::new(rate);
    let mut bad = Vec::new();
    for m in ck.tier.list(None) {
        if stop.is_cancelled() {
            break;
        }
        let key = m.key();
        // Pruned or saved again since the listing: nothing to check.
        let Ok((mut f, now)) = ck.tier.open_data(&key) else {
            continue;
        };
        if now != m {
            continue;
        }
        let Ok(ino) = f.metadata().map(|md| md.ino()) else {
            continue;
        };
        let path = ck.tier.layout().data(&key);
        if check(&mut f, &path, &m, &mut pace, stop).is_err() {
            break;
        }
        if let Some(why) = pace.last_error.take() {
            match ck.tier.mark_bad(&key, &m, ino, &why) {
                Ok(true) => bad.push((key, why)),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(shard = %key, error = %e, "could not mark a corrupt checkpoint shard")
                }
            }
        }
    }
    bad
}

/// The scrub was asked to stop.
struct Stop;

/// Reads `f` at the pace's rate and checks it against `m`; a mismatch is
/// left in `pace.last_error`.
fn check(
    f: &mut std::fs::File,
    path: &std::path::Path,
    m: &Manifest,
    pace: &mut Pace,
    stop: &CancellationToken,
) -> Result<(), Stop> {
    let mut throttled = Throttled { f, pace, stop };
    match manifest::verify(&mut throttled, path, m) {
        Ok(()) => Ok(()),
        Err(_) if stop.is_cancelled() => Err(Stop),
        Err(e) if e.starts_with("corrupt") => {
            throttled.pace.last_error = Some(e.trim_start_matches("corrupt: ").to_owned());
            Ok(())
        }
        // An I/O error is not evidence of corruption: the next pass retries.
        Err(e) => {
            tracing::debug!(shard = %m.key(), error = %e, "checkpoint scrub could not read a shard");
            Ok(())
        }
    }
}

/// A reader that keeps to the pace, and fails once asked to stop.
struct Throttled<'a> {
    f: &'a mut std::fs::File,
    pace: &'a mut Pace,
    stop: &'a CancellationToken,
}

impl Read for Throttled<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.stop.is_cancelled() {
            return Err(std::io::Error::other("the agent is stopping"));
        }
        let n = buf.len().min(BLOCK);
        let got = self.f.read(buf.get_mut(..n).unwrap_or_default())?;
        self.pace.spend(got as u64);
        Ok(got)
    }
}

/// Keeps a running average at or below `rate` bytes per second.
#[derive(Debug)]
struct Pace {
    rate: u64,
    since: Instant,
    spent: u64,
    last_error: Option<String>,
}

impl Pace {
    fn new(rate: u64) -> Self {
        Self {
            rate,
            since: Instant::now(),
            spent: 0,
            last_error: None,
        }
    }

    /// Counts `n` bytes read and sleeps until they fit the rate.
    fn spend(&mut self, n: u64) {
        self.spent += n;
        metrics::counter!("warden_ckpt_scrubbed_bytes_total").increment(n);
        let due = Duration::from_secs_f64(self.spent as f64 / self.rate as f64);
        if let Some(wait) = due.checked_sub(self.since.elapsed()) {
            std::thread::sleep(wait);
        }
    }
}

fn report(events: &EventBus, k: &ShardKey, why: &str) {
    tracing::warn!(shard = %k, error = why, "checkpoint scrub found a corrupt shard; marked, restores use another copy");
    metrics::counter!("warden_ckpt_scrub_corrupt_total").increment(1);
    metrics::counter!("warden_ckpt_corrupt_total", "tier" => "local").increment(1);
    events.publish(
        NewEvent::new(
            Severity::Warning,
            "ckpt.corrupt",
            subject(k),
            format!(
                "{k}: scrub found the local copy corrupt ({why}); marked, restores use another copy"
            ),
        )
        .with("job_id", &k.job_id)
        .with("rank", k.rank)
        .with("step", k.step)
        .with("tier", "local")
        .with("source", "scrub")
        .with("reason", why),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_holds_the_rate() {
        let mut p = Pace::new(10 << 20);
        let t = Instant::now();
        for _ in 0..4 {
            p.spend(1 << 20);
        }
        // 4 MiB at 10 MiB/s: at least 0.4 s.
        assert!(
            t.elapsed() >= Duration::from_millis(390),
            "{:?}",
            t.elapsed()
        );
    }
}
