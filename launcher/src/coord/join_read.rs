//! The joining read in one etcd transaction (issue 30: joining 2,048 hosts
//! took 12.7 s, most of it each host's nine requests one after another).
//!
//! A joining host used to read the epoch, then at its revision the first
//! hosts by join, the departures, the current round, its end marker and
//! the layout bases (and, since, the round's notice of a coming stop): six round trips after the register txn, each waiting
//! its turn for a core on a loaded etcd. All of them are ranges of keys
//! whose names do not depend on each other's values once the current
//! round is read as "the newest round record" (the round record is written
//! in the same txn that moves the epoch, so the newest is the current
//! one's), so they go as range ops of one txn: the register txn's own
//! success branch when joining ([`ops`] after its writes), a txn of reads
//! alone when reading the job again. One txn is one revision, so the view
//! is one snapshot as before; a range longer than a page is continued at
//! that revision by [`super::paged`].
//!
//! In: the job's [`Keys`]; the txn's op responses. Out: the ops; what
//! each read returned ([`JoinRead`]).
//! Never: read a value a host that does not decide has no use for (no
//! member record); read or sort every member key (issue 30: etcd 3.4
//! answers a sorted range by reading every key's record from its backend,
//! so a sorted read of the first hosts by join cost O(N) per join, O(N^2)
//! for a job; and etcd 3.4 walks its index over a range to count it, so a
//! count of the member keys is O(N) too: the markers read here settle
//! whether a joining host decides, and only while fewer than
//! [`super::deciders::DECIDERS`] stand is the count asked, in a request of
//! its own, [`super::deciders`]); sort
//! more than the round records and end markers (at most
//! [`super::keys::KEEP_ROUNDS`] + 1 of each) and the one notice kept.

use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget, TxnOp, TxnOpResponse};

use super::keys::Keys;
use super::paged::{PAGE_KEYS, prefix_end};

/// How many range ops [`ops`] makes.
pub const READS: usize = 7;

/// The joining read's range ops, in the order [`JoinRead::parse`] reads
/// their answers: the epoch key; a page of the deciders' markers (with
/// their count: [`super::deciders::settled_by_markers`]); a page of
/// departures; the newest round record; the newest end marker; a page of
/// layout chunks; the newest notice.
pub fn ops(keys: &Keys) -> Vec<TxnOp> {
    let newest = |prefix: String| {
        let end = prefix_end(&prefix);
        TxnOp::get(
            prefix,
            Some(
                GetOptions::new()
                    .with_range(end)
                    .with_sort(SortTarget::Key, SortOrder::Descend)
                    .with_limit(1),
            ),
        )
    };
    let page = |prefix: String| {
        let end = prefix_end(&prefix);
        TxnOp::get(
            prefix,
            Some(GetOptions::new().with_range(end).with_limit(PAGE_KEYS)),
        )
    };
    vec![
        TxnOp::get(keys.epoch(), None),
        page(keys.deciders()),
        page(keys.departures()),
        newest(keys.rounds()),
        newest(keys.ends()),
        page(keys.layouts()),
        newest(keys.notices()),
    ]
}

/// One ranged read's answer: its keys and whether more follow.
#[derive(Debug, Default, Clone)]
pub struct Page {
    /// The key-values, in key order (or the op's sort order).
    pub kvs: Vec<KeyValue>,
    /// More keys follow the last one (continue from right after it).
    pub more: bool,
    /// How many keys the range holds (all of them, not only this page's).
    pub count: i64,
}

/// What the joining read returned.
#[derive(Debug, Default, Clone)]
pub struct JoinRead {
    /// The epoch key (empty when absent: epoch 0).
    pub epoch: Vec<KeyValue>,
    /// The first page of the deciders' markers ([`super::deciders`]).
    pub deciders: Page,
    /// The first page of departures.
    pub departures: Page,
    /// The newest round record.
    pub round: Vec<KeyValue>,
    /// The newest end marker.
    pub end: Vec<KeyValue>,
    /// The first page of layout chunks.
    pub layouts: Page,
    /// The newest notice of a coming stop.
    pub notice: Vec<KeyValue>,
}

/// The txn's answer did not have the joining read's shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the joining read's txn answered {got} ops where {want} ranges were expected")]
pub struct Shape {
    /// Op responses after the skipped ones.
    pub got: usize,
    /// [`READS`].
    pub want: usize,
}

impl JoinRead {
    /// Reads the answers of [`ops`] from `responses`, after the first
    /// `skip` (the writes of a txn the reads were added to).
    pub fn parse(responses: Vec<TxnOpResponse>, skip: usize) -> Result<Self, Shape> {
        let mut pages: Vec<Page> = responses
            .into_iter()
            .skip(skip)
            .filter_map(|r| match r {
                TxnOpResponse::Get(mut g) => Some(Page {
                    more: g.more(),
                    count: g.count(),
                    kvs: g.take_kvs(),
                }),
                _ => None,
            })
            .collect();
        if pages.len() != READS {
            return Err(Shape {
                got: pages.len(),
                want: READS,
            });
        }
        let notice = pages.pop().unwrap_or_default().kvs;
        let layouts = pages.pop().unwrap_or_default();
        let end = pages.pop().unwrap_or_default().kvs;
        let round = pages.pop().unwrap_or_default().kvs;
        let departures = pages.pop().unwrap_or_default();
        let deciders = pages.pop().unwrap_or_default();
        let epoch = pages.pop().unwrap_or_default().kvs;
        Ok(Self {
            epoch,
            deciders,
            departures,
            round,
            end,
            layouts,
            notice,
        })
    }

    /// The epoch read (0 when the key is absent or unreadable).
    pub fn epoch_value(&self) -> u64 {
        self.epoch
            .first()
            .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// Where a page that said `more` continues: right after its last key.
pub fn after(page: &Page) -> Option<Vec<u8>> {
    let last = page.kvs.last()?;
    if !page.more {
        return None;
    }
    let mut from = last.key().to_vec();
    from.push(0);
    Some(from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_range_op_per_read() {
        let keys = Keys::new("/w", "j");
        assert_eq!(ops(&keys).len(), READS);
    }

    #[test]
    fn an_answer_of_another_shape_is_an_error_not_a_panic() {
        let err = JoinRead::parse(Vec::new(), 2).expect_err("no ranges");
        assert_eq!(
            err,
            Shape {
                got: 0,
                want: READS
            }
        );
        assert_eq!(after(&Page::default()), None);
    }
}
