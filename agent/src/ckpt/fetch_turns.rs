//! One fetch of a shard at a time on this agent.
//!
//! A sharded checkpoint's reader has every rank read the coordinator's
//! shard for the checkpoint's metadata (`WardenStorageReader.read_metadata`
//! under torch.distributed.checkpoint), and items that DCP saved on one
//! rank only are read from that rank's shard by every other. So at a
//! restart the 8 ranks of a host restore rank 0's shard at once, and each
//! used to fetch it from a holder over the network on its own: 8 copies of
//! one shard into one tier, and at 12,500 hosts 100,000 fetches on rank
//! 0's two or three holders (issue 30). A restore now takes the shard's
//! turn before it fetches; the restores that waited find the copy the
//! first one brought into the local tier, and read it there
//! ([`super::restore`]).
//!
//! A turn whose holder found no valid copy says so ([`Turn::failed`]): the
//! restores waiting behind it then try side by side, as before, rather
//! than one after another through the same failing holders (8 ranks would
//! wait 8 times as long for the same answer).
//!
//! In: a shard's key. Out: the key's turn, held until dropped.
//! Never: makes a restore of one shard wait for another's; keeps a key's
//! entry once nobody holds or awaits its turn, past the next turn taken
//! here (a waiter that went away leaves one until then).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

use super::layout::ShardKey;

/// The turns of the shards being fetched here.
#[derive(Debug, Default)]
pub struct FetchTurns {
    turns: Mutex<HashMap<ShardKey, Arc<tokio::sync::Mutex<LastFetch>>>>,
}

/// What the last holder of a key's turn got.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum LastFetch {
    /// Nothing yet, or the copy.
    #[default]
    NotFailed,
    /// Every copy it tried failed.
    Failed,
}

/// A shard's turn: no other restore here fetches it while this is held.
#[derive(Debug)]
pub struct Turn<'a> {
    turns: &'a FetchTurns,
    key: ShardKey,
    guard: Option<OwnedMutexGuard<LastFetch>>,
}

impl FetchTurns {
    /// Waits for `key`'s turn, behind any restore of it under way here.
    pub async fn take(&self, key: &ShardKey) -> Turn<'_> {
        let lock = {
            let mut m = self.turns.lock().unwrap_or_else(|p| p.into_inner());
            // Keys nobody holds or awaits (their last waiter went away).
            m.retain(|_, l| Arc::strong_count(l) > 1);
            m.entry(key.clone()).or_default().clone()
        };
        Turn {
            turns: self,
            key: key.clone(),
            guard: Some(lock.lock_owned().await),
        }
    }

    /// How many keys have an entry (tests).
    pub fn len(&self) -> usize {
        self.turns.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no key has one.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Turn<'_> {
    /// Whether the turn's holder before this one found no valid copy.
    pub fn after_a_failure(&self) -> bool {
        self.guard.as_deref() == Some(&LastFetch::Failed)
    }

    /// Says what this holder got, for those waiting.
    pub fn record(&mut self, got: LastFetch) {
        if let Some(g) = self.guard.as_mut() {
            **g = got;
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut m = self.turns.turns.lock().unwrap_or_else(|p| p.into_inner());
        // The map's own reference only: nobody else holds or awaits it.
        if m.get(&self.key).is_some_and(|l| Arc::strong_count(l) == 1) {
            m.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn key(rank: u32) -> ShardKey {
        ShardKey {
            job_id: "job".into(),
            step: 10,
            rank,
        }
    }

    #[tokio::test]
    async fn a_shards_turn_is_one_at_a_time_and_leaves_nothing_behind() {
        let turns = Arc::new(FetchTurns::default());
        let first = turns.take(&key(0)).await;
        // Another shard's turn does not wait.
        let other = tokio::time::timeout(Duration::from_secs(5), turns.take(&key(1)))
            .await
            .expect("another shard's turn is not held up");
        // The same shard's does, until the first is dropped.
        let t2 = turns.clone();
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let waiter = tokio::spawn(async move {
            let _t = t2.take(&key(0)).await;
            tx.send(()).await.expect("send");
        });
        tokio::task::yield_now().await;
        assert!(rx.try_recv().is_err(), "the second took a held turn");
        drop(first);
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the turn passes on")
            .expect("the waiter's word");
        waiter.await.expect("waiter");
        drop(other);
        assert!(turns.is_empty(), "{} entries left", turns.len());
    }

    /// The current-thread runtime runs the waiter only where this test
    /// yields: it awaits the turn, the holder lets go, and it is aborted
    /// before it runs again.
    #[tokio::test]
    async fn a_waiter_hears_that_the_turn_before_failed() {
        let turns = FetchTurns::default();
        let mut first = turns.take(&key(0)).await;
        assert!(!first.after_a_failure());
        first.record(LastFetch::Failed);
        // The entry kept alive by a clone of its lock, as a waiter keeps it.
        let lock = turns.turns.lock().expect("map")[&key(0)].clone();
        drop(first);
        let second = turns.take(&key(0)).await;
        assert!(second.after_a_failure());
        drop(second);
        drop(lock);
        // Nobody waits: the entry goes, and the next holder starts afresh.
        drop(turns.take(&key(1)).await);
        assert!(!turns.take(&key(0)).await.after_a_failure());
    }

    #[tokio::test]
    async fn a_waiter_that_goes_away_leaves_no_entry_past_the_next_turn() {
        let turns = Arc::new(FetchTurns::default());
        let held = turns.take(&key(0)).await;
        let t2 = turns.clone();
        let waiter = tokio::spawn(async move {
            let _t = t2.take(&key(0)).await;
            std::future::pending::<()>().await;
        });
        tokio::task::yield_now().await;
        drop(held);
        waiter.abort();
        assert!(waiter.await.expect_err("aborted").is_cancelled());
        assert_eq!(
            turns.len(),
            1,
            "the waiter's entry stays until a turn is taken"
        );
        drop(turns.take(&key(7)).await);
        assert!(turns.is_empty(), "{} entries left", turns.len());
    }
}
