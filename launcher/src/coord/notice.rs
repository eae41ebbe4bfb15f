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
//! A launcher that joins while a notice stands ([`stop_underway`]): the
//! job's stop on it is underway (this launcher exits 85 at its first
//! rendezvous, as the job's other hosts do) or over (a previous run's
//! notice, never acted on). In: the notice, its key's revision, the oldest
//! other live member's create revision, this host's clock. Out: which.
//!
//! Never: write a second notice for a round (create-if-absent, one txn),
//! keep more than one notice in etcd (the txn deletes the older rounds'),
//! or put anything under a key that changes on a timer: one write per
//! notice, O(1) per host; read more at a join than the joining read has
//! (the newest notice, the members or the deciders' markers).

use etcd_client::{Compare, CompareOp, DeleteOptions, KeyValue, Txn, TxnOp, TxnOpResponse};

use super::CoordError;
use super::keys::KeyKind;
use super::records::NoticeRecord;
use super::session::{Inner, View, now_ms};

/// Longest reason kept in a record (a person's words, for the console).
const MAX_REASON: usize = 300;

/// The longest a stop on a notice lasts after it was written: the
/// launcher's window is at most an hour (the machine's `notice_window`),
/// whatever deadline a record says.
pub const MAX_STOP_MS: u64 = 3_600_000;

/// The notice that stood in etcd when this launcher joined, and what it
/// made of it ([`stop_underway`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoticeAtJoin {
    /// The epoch of the notice's round.
    pub epoch: u64,
    /// The notice.
    pub record: NoticeRecord,
    /// The job's stop on it was underway: this launcher starts nothing.
    pub underway: bool,
}

/// Whether the job is stopping on a notice that stood in etcd when this
/// launcher joined (true), or the notice is a previous run's (false).
///
/// The rule: **underway** when both hold:
/// - a launcher that was in the job when the notice was written is in it
///   still: another live member's key was created before the notice's
///   (`oldest_other`, the oldest other live member's create revision,
///   below `notice_revision`, the notice key's). Every launcher in the job
///   when a notice comes stops on it (its workers save and it exits 85, a
///   standby spare at once, one between rounds at its rendezvous), so
///   such a member is one still saving and leaving. Revisions, not
///   clocks: etcd orders them, whatever the hosts' clocks say;
/// - the stop's deadline is ahead by this host's clock: the record's
///   `deadline_ms` (0: not said), and never later than [`MAX_STOP_MS`]
///   after it was written. Past it every launcher of that run has gone
///   (its window is over, the scheduler's kill came); a member left over
///   (its lease not yet expired, a launcher wedged) does not hold the
///   notice up any longer.
///
/// Otherwise the notice is **a previous run's**: every launcher that was
/// in the job then is gone, so this one is of the job's next run (a
/// requeued job joins with no member older than the notice, even within
/// the deadline), or the stop is over.
///
/// A newer round formed since the notice does not decide it: the hosts
/// that leave on the notice make rounds themselves (a member lost), and
/// the next run's rounds are made by members younger than the notice.
/// What the rule cannot see: a member of that run that re-registered
/// under a new lease after the notice (its lease lapsed) counts as
/// younger; if it is the last one left, the joiner waits as a next run's
/// would, bounded by its join timeout.
pub fn stop_underway(
    notice: &NoticeRecord,
    notice_revision: i64,
    oldest_other: Option<i64>,
    now_ms: u64,
) -> bool {
    let latest = notice.at_ms.saturating_add(MAX_STOP_MS);
    let ends = match notice.deadline_ms {
        0 => latest,
        d => d.min(latest),
    };
    now_ms < ends && oldest_other.is_some_and(|rev| rev < notice_revision)
}

impl Inner {
    /// The newest notice as the joining read found it (`kv`), judged
    /// against the view read with it ([`stop_underway`]): the oldest other
    /// live member is the oldest of every member on a host that decides,
    /// else of the deciders' markers (the first live hosts by join, each
    /// with its member key's create revision: the oldest live member is
    /// always among them). `None`: no notice, or one this version cannot
    /// read (never acted on).
    pub(crate) fn notice_at_join(&self, kv: &KeyValue, view: &View) -> Option<NoticeAtJoin> {
        let key = String::from_utf8_lossy(kv.key());
        let Some(KeyKind::Notice(epoch)) = self.keys.classify(&key) else {
            return None;
        };
        let record: NoticeRecord = serde_json::from_slice(kv.value()).ok()?;
        let me = self.cfg.host.as_str();
        let oldest_other = if view.decider {
            view.members
                .iter()
                .filter(|(host, _)| host.as_str() != me)
                .map(|(_, m)| m.join_revision)
                .min()
        } else {
            view.deciders
                .iter()
                .filter(|(host, _)| host.as_str() != me)
                .map(|(_, rev)| *rev)
                .min()
        };
        let underway = stop_underway(&record, kv.mod_revision(), oldest_other, now_ms());
        Some(NoticeAtJoin {
            epoch,
            record,
            underway,
        })
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000;

    fn notice(at_ms: u64, deadline_ms: u64) -> NoticeRecord {
        NoticeRecord {
            by: "host-b".into(),
            step: 151,
            deadline_ms,
            reason: "notice from gce".into(),
            at_ms,
        }
    }

    #[test]
    fn a_notice_whose_hosts_are_still_leaving_stops_a_joiner() {
        // Written 5 s ago at revision 40, 35 s of its window left; a
        // member from revision 12 is still in the job.
        let n = notice(NOW - 5_000, NOW + 35_000);
        assert!(stop_underway(&n, 40, Some(12), NOW));
        // No deadline said: the longest window bounds it.
        assert!(stop_underway(&notice(NOW - 5_000, 0), 40, Some(12), NOW));
    }

    #[test]
    fn a_previous_runs_notice_is_not_acted_on() {
        let n = notice(NOW - 5_000, NOW + 35_000);
        // Requeued within the window: every member joined after it.
        assert!(!stop_underway(&n, 40, Some(41), NOW));
        // The first host of the next run: nobody else is in the job.
        assert!(!stop_underway(&n, 40, None, NOW));
        // The window is over: a member left over does not hold it up.
        assert!(!stop_underway(&n, 40, Some(12), NOW + 35_000));
        // Nor does a deadline beyond the longest window.
        let far = notice(NOW - MAX_STOP_MS, u64::MAX);
        assert!(!stop_underway(&far, 40, Some(12), NOW));
        assert!(!stop_underway(
            &notice(NOW - MAX_STOP_MS, 0),
            40,
            Some(12),
            NOW
        ));
    }
}
