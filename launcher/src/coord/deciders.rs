//! Which hosts of a job decide its rounds (issue 30: joining 2,048 hosts).
//!
//! A host that decides rounds must know every live member: it watches every
//! member key and reads them all when it joins. If every host did, each
//! join would be a watch event on every host already in (N^2 / 2 events
//! for a job of N) and a read of every member before it (N^2 / 2 records):
//! 49.7 s to join 2,048 hosts, where the goal is 10 s. Only the writers'
//! line needs that knowledge, and only its first host writes. So the
//! **first [`DECIDERS`] live hosts by join** (their member keys' create
//! revisions, the same order for every reader) decide; every later host
//! reads and watches the rounds, layouts, departures and end markers, and
//! of the member keys only their deletions, to take a decider's place.
//!
//! A host that does not decide keeps the first [`DECIDERS`] it was told
//! of. When fewer than half of them are left (lost, left, or their lease
//! expired), it asks etcd again for the first [`DECIDERS`] by join (one
//! request of [`DECIDERS`] keys, no values); if it is among them now, it
//! decides from then on: it reads every member and watches them all. A
//! host never stops deciding once it has begun (an extra decider costs its
//! own reads; a missing one could leave a round unwritten).
//!
//! In: a member key's deletion, the answer of [`first_by_join`]. Out:
//! whether this host decides; whether to ask again.
//! Never: make a host that is among the first [`DECIDERS`] a non-decider;
//! ask etcd again on a member key's deletion unless half the deciders it
//! knows are gone (a lost host costs each other host an event, not a
//! request).

use std::collections::BTreeMap;

use etcd_client::{Client, GetOptions, KeyValue, SortOrder, SortTarget};

use super::CoordError;
use super::keys::Keys;

/// How many hosts decide rounds: the writers' line (`session::WRITER_LINE`
/// places, each waiting its turn) is theirs.
pub const DECIDERS: usize = 8;

/// The first [`DECIDERS`] member keys by create revision at `revision`
/// (0: the newest): host id -> create revision. One request; etcd sorts
/// its member keys (no values sent).
pub(crate) async fn first_by_join(
    endpoints: &str,
    timeout: std::time::Duration,
    client: &Client,
    keys: &Keys,
    revision: i64,
) -> Result<BTreeMap<String, i64>, CoordError> {
    let prefix = keys.members();
    let mut options = GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(i64::try_from(DECIDERS).unwrap_or(i64::MAX));
    if revision > 0 {
        options = options.with_revision(revision);
    }
    let mut kv = client.kv_client();
    let resp = super::bounded::call(
        endpoints,
        timeout,
        "get (first hosts by join)",
        &prefix,
        kv.get(prefix.as_str(), Some(options)),
    )
    .await?;
    Ok(from_keys(keys, resp.kvs()))
}

/// The answer of a read of the first member keys by join (here, or in
/// the joining txn, [`super::join_read`]): host id -> create revision.
pub(crate) fn from_keys(keys: &Keys, kvs: &[KeyValue]) -> BTreeMap<String, i64> {
    let prefix = keys.members();
    kvs.iter()
        .filter_map(|kv| {
            let key = std::str::from_utf8(kv.key()).ok()?;
            let host = key.strip_prefix(prefix.as_str())?;
            Some((host.to_owned(), kv.create_revision()))
        })
        .collect()
}

/// Whether `host` decides, given the first hosts by join etcd answered:
/// it is among them, or there are fewer than [`DECIDERS`] members (its
/// own key is one of them).
pub(crate) fn decides(first: &BTreeMap<String, i64>, host: &str) -> bool {
    first.len() < DECIDERS || first.contains_key(host)
}

/// After the deletion of `host`'s member key: whether a non-decider that
/// knew `first` as the deciders should ask etcd again (`first` is updated).
pub(crate) fn deleted(first: &mut BTreeMap<String, i64>, host: &str) -> bool {
    first.remove(host).is_some() && first.len() < DECIDERS.div_ceil(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first(n: usize) -> BTreeMap<String, i64> {
        (0..n)
            .map(|i| (format!("h{i}"), i64::try_from(i).unwrap_or(0)))
            .collect()
    }

    #[test]
    fn the_first_hosts_by_join_decide_and_a_small_job_all_of_it() {
        assert!(decides(&first(DECIDERS), "h0"));
        assert!(decides(&first(DECIDERS), "h7"));
        assert!(!decides(&first(DECIDERS), "h8"));
        // Fewer members than deciders: every host is among them.
        assert!(decides(&first(3), "late"));
    }

    #[test]
    fn a_non_decider_asks_again_only_when_half_the_deciders_are_gone() {
        let mut f = first(DECIDERS);
        // Another host's deletion: nothing to ask.
        assert!(!deleted(&mut f, "h99"));
        assert!(!deleted(&mut f, "h0"));
        assert!(!deleted(&mut f, "h1"));
        assert!(!deleted(&mut f, "h2"));
        assert_eq!(f.len(), 5);
        assert!(!deleted(&mut f, "h3"));
        // 3 of 8 left: fewer than half.
        assert!(deleted(&mut f, "h4"));
        // The same deletion seen twice (a watch replayed) asks once.
        assert!(!deleted(&mut f, "h4"));
    }
}
