//! The copies this agent's replication made on its peers, as their holders
//! confirmed them.
//!
//! Why kept where listings see them: a listing asks each holder what it
//! holds, and a holder that cannot answer now (its agent stopped with its
//! job's launcher, its host preempted by the same notice) used to leave the
//! shard listed on this host alone, though the holder had committed the
//! copy and said so. The notice's summary then said "on this host only"
//! for a save that had left it. Replication also skips a shard once sent,
//! and this is the record it skips by; it checks the record against each
//! peer's own word every [`super::replicate::RECHECK_TICKS`] ticks, so a
//! peer that came back with an empty tier gets its copies again.
//!
//! In: a push the peer acknowledged (its `PushShardResponse`, after its
//! commit), a reconcile that found the shard on the peer, a shard the tier
//! pruned, the own shards the tier still holds. Out: whether a shard with a
//! checksum was sent to an address, and the holders a shard was sent to.
//! Never: counted toward a step's completeness or used for a restore (a
//! copy is fetched only from a holder that answers for it); remembered past
//! the shard's stay in the tier (retention forgets a pruned shard at once;
//! each reconcile keeps only the own shards the tier still holds, whatever
//! removed the others).

use std::collections::HashMap;
use std::sync::Mutex;

use super::layout::ShardKey;

/// One copy a peer confirmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentCopy {
    /// The peer's `host:port`.
    pub addr: String,
    /// Its name (its agent's host name; its address when unknown).
    pub host: String,
    /// The checksum of what was sent (xxh3-64, 16 hex digits).
    pub xxh3: String,
}

/// Every confirmed copy of this agent's own shards, by shard.
#[derive(Debug, Default)]
pub struct Sent {
    copies: Mutex<HashMap<ShardKey, Vec<SentCopy>>>,
}

impl Sent {
    /// Whether `key` with checksum `xxh3` is on the peer at `addr`.
    pub fn contains(&self, addr: &str, key: &ShardKey, xxh3: &str) -> bool {
        self.lock()
            .get(key)
            .is_some_and(|v| v.iter().any(|c| c.addr == addr && c.xxh3 == xxh3))
    }

    /// Records that the peer at `addr` (named `host`) holds `key` with
    /// checksum `xxh3`; a copy of other bytes it held before is replaced.
    pub fn record(&self, addr: &str, host: &str, key: &ShardKey, xxh3: &str) {
        let mut all = self.lock();
        let v = all.entry(key.clone()).or_default();
        v.retain(|c| c.addr != addr);
        v.push(SentCopy {
            addr: addr.to_owned(),
            host: if host.is_empty() { addr } else { host }.to_owned(),
            xxh3: xxh3.to_owned(),
        });
    }

    /// Forgets `key` (the tier pruned it: its peers prune their copies by
    /// the same retention).
    pub fn forget(&self, key: &ShardKey) {
        self.lock().remove(key);
    }

    /// Forgets the copy of `key` on the peer at `addr` (the peer no longer
    /// holds it: its tier was lost with a restart), keeping the others.
    pub fn forget_at(&self, addr: &str, key: &ShardKey) {
        let mut all = self.lock();
        if let Some(v) = all.get_mut(key) {
            v.retain(|c| c.addr != addr);
            if v.is_empty() {
                all.remove(key);
            }
        }
    }

    /// Forgets every shard but `present` (the own shards the tier holds):
    /// what left the tier by any path is not remembered past the next
    /// reconcile.
    pub fn keep_only(&self, present: &std::collections::HashSet<ShardKey>) {
        self.lock().retain(|k, _| present.contains(k));
    }

    /// The peers (`host:port`) any shard of `ranks` of `job` was sent to.
    pub fn addrs_of(&self, job: &str, ranks: &[u32]) -> Vec<String> {
        let mut out: Vec<String> = self
            .lock()
            .iter()
            .filter(|(k, _)| k.job_id == job && ranks.contains(&k.rank))
            .flat_map(|(_, v)| v.iter().map(|c| c.addr.clone()))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The peers `key` with checksum `xxh3` was sent to.
    pub fn holders(&self, key: &ShardKey, xxh3: &str) -> Vec<SentCopy> {
        self.lock()
            .get(key)
            .map(|v| v.iter().filter(|c| c.xxh3 == xxh3).cloned().collect())
            .unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ShardKey, Vec<SentCopy>>> {
        // A panic elsewhere while holding it leaves a map that is still
        // whole (every change above is one call on it).
        self.copies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(step: u64) -> ShardKey {
        ShardKey {
            job_id: "j".into(),
            step,
            rank: 0,
        }
    }

    #[test]
    fn a_copy_is_known_by_address_and_checksum_until_pruned() {
        let s = Sent::default();
        s.record("10.0.0.2:7070", "h2", &key(1), "aa");
        s.record("10.0.0.3:7070", "", &key(1), "aa");
        assert!(s.contains("10.0.0.2:7070", &key(1), "aa"));
        assert!(!s.contains("10.0.0.2:7070", &key(1), "bb"));
        assert!(!s.contains("10.0.0.2:7070", &key(2), "aa"));
        let hosts: Vec<String> = s
            .holders(&key(1), "aa")
            .into_iter()
            .map(|c| c.host)
            .collect();
        assert_eq!(hosts, ["h2", "10.0.0.3:7070"]);
        // New bytes under the same key (a rank saved the step again) replace
        // the old on that peer; the other still holds the old.
        s.record("10.0.0.2:7070", "h2", &key(1), "bb");
        assert_eq!(s.holders(&key(1), "aa").len(), 1);
        assert_eq!(s.holders(&key(1), "bb").len(), 1);
        s.forget(&key(1));
        assert!(s.holders(&key(1), "bb").is_empty());
        assert!(!s.contains("10.0.0.3:7070", &key(1), "aa"));
        // Only the shards still in the tier are kept.
        s.record("10.0.0.2:7070", "h2", &key(2), "aa");
        s.record("10.0.0.2:7070", "h2", &key(3), "aa");
        s.keep_only(&[key(3)].into_iter().collect());
        assert!(!s.contains("10.0.0.2:7070", &key(2), "aa"));
        assert!(s.contains("10.0.0.2:7070", &key(3), "aa"));
        // Where a rank's shards went, for a listing to ask.
        assert_eq!(s.addrs_of("j", &[0]), ["10.0.0.2:7070"]);
        assert!(s.addrs_of("j", &[1]).is_empty() && s.addrs_of("k", &[0]).is_empty());
    }
}
