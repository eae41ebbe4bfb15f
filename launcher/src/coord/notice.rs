//! A notice of a coming stop across the job's hosts: one record per round,
//! naming the step at whose boundary every rank of the job saves.
//!
//! In: the step this host's agent named for its ranks (StopRanks, kind
//! PREEMPTED, with a lead that leaves the other hosts time to be told), the
//! stop's deadline and why. Out: the job's one notice for the round,
//! `<prefix>/<job>/notices/<epoch>`: this host's if it was the first, else
//! the one another host wrote first (which this host's agent is then told
//! instead), so that every host's ranks save the same step. The other
//! launchers read it from their watch ([`super::CoordState::notice`]).
//!
//! Never: write a second notice for a round (create-if-absent, one txn),
//! keep more than one notice in etcd (the txn deletes the older rounds'),
//! or put anything under a key that changes on a timer: one write per
//! notice, O(1) per host.

use etcd_client::{Compare, CompareOp, DeleteOptions, Txn, TxnOp, TxnOpResponse};

use super::CoordError;
use super::records::NoticeRecord;
use super::session::{Inner, now_ms};

/// Longest reason kept in a record (a person's words, for the console).
const MAX_REASON: usize = 300;

impl Inner {
    /// Publishes a notice for the round of `epoch` unless one stands: in one
    /// txn, create-if-absent, deleting the notices of older rounds. Returns
    /// the round's notice as etcd has it: this one, or the first host's.
    pub(crate) async fn publish_notice(
        &self,
        epoch: u64,
        step: u64,
        deadline_ms: u64,
        reason: &str,
    ) -> Result<NoticeRecord, CoordError> {
        let key = self.keys.notice(epoch);
        let mine = NoticeRecord {
            by: self.cfg.host.clone(),
            step,
            deadline_ms,
            reason: reason.chars().take(MAX_REASON).collect(),
            at_ms: now_ms(),
        };
        // A struct of strings and numbers: encoding cannot fail.
        let json = serde_json::to_string(&mine).unwrap_or_default();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key.as_str(), json.as_str(), None),
                // Every older round's notice: `notices/<0>` up to this one.
                TxnOp::delete(
                    self.keys.notice(0),
                    Some(DeleteOptions::new().with_range(key.as_str())),
                ),
            ])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let mut client = self.client.clone();
        let resp = self.call("txn (notice)", &key, client.txn(txn)).await?;
        if resp.succeeded() {
            return Ok(mine);
        }
        let theirs = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .and_then(|kv| serde_json::from_slice::<NoticeRecord>(kv.value()).ok()),
            _ => None,
        });
        // Unreadable (a newer version's record): this host's step stands
        // here; the other hosts follow whichever they can read.
        Ok(theirs.unwrap_or(mine))
    }
}
