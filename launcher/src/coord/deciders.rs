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
//! the deciders' markers, to take a decider's place.
//!
//! **Who decides, in O(1) per join** (issue 30: etcd 3.4 answers a range
//! sorted by create revision by reading and decoding every key's record
//! from its backend before it sorts and limits, so a joining read of the
//! first [`DECIDERS`] by join cost O(N) per join and O(N^2) for a job). A
//! joining host's own member key is the newest by join (its register txn
//! creates it), so it is among the first [`DECIDERS`] exactly when there
//! are at most [`DECIDERS`] member keys. Each live marker (below) names a
//! member key that stood before the joiner's (a marker is written after
//! its host's member key, under the same lease, and deleted with it at
//! leave): with [`DECIDERS`] markers in the register txn's read, the
//! joiner is not among the first and nothing more is asked
//! ([`settled_by_markers`]). Only while fewer stand (a job's first hosts,
//! or deciders lost and not yet replaced) does it count the member keys at
//! that revision ([`count_members`], [`newest_decides`]): etcd 3.4 counts
//! by walking its index over the range, no record read but O(N) all the
//! same (0.57 / 0.88 / 1.94 ms of etcd CPU per count at 1,000 / 4,000 /
//! 12,500 keys, a one-key read 0.48 ms). In the fleet bench at 12,500
//! hosts the joiners' registration took 57 s of etcd CPU while every
//! joiner counted in its register txn, about 30 s since.
//!
//! **Whom a host that does not decide watches for.** Every host that
//! decides writes a marker, `deciders/<host>` under its lease
//! ([`super::keys::Keys::decider`]), when it starts deciding (at join, when
//! it takes a place, again after a rejoin). A host that does not decide
//! reads the markers at join and watches them (puts and deletions): its
//! set is the live deciders, and a decider's loss (its lease gone, its
//! leave) is one event for it, where the member keys' deletions were one
//! per lost host and a watch etcd matched against every join. A marker not
//! yet written when a host joins reaches it through that watch.
//!
//! When fewer than half of [`DECIDERS`] markers are left, the host asks
//! etcd for the first [`DECIDERS`] by join ([`first_by_join`], the sorted
//! read: rare); if it is among them now, it decides from then on: it
//! writes its marker, reads every member and watches them all. Every host
//! that does not decide sees the same loss and asks too, so the hosts next
//! by join take the places, and their markers bring the set back. A host
//! never stops deciding once it has begun (an extra decider costs its own
//! reads; a missing one could leave a round unwritten). The launchers of
//! one job run one warden version: a decider of a version before the
//! markers writes none, so a later host would not see its loss.
//!
//! In: the markers (and their count), a count of member keys, a marker's
//! deletion, the answer of [`first_by_join`]. Out: whether this host
//! decides; whether to ask again.
//! Never: make a host that is among the first [`DECIDERS`] a non-decider;
//! read, sort or count every member key per join once [`DECIDERS`]
//! markers stand; ask etcd again on a marker's deletion unless fewer than
//! half of [`DECIDERS`] are left.

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
    let mut options = GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(i64::try_from(DECIDERS).unwrap_or(i64::MAX));
    if revision > 0 {
        options = options.with_revision(revision);
    }
    let read = MembersRead {
        endpoints,
        timeout,
        client,
        keys,
    };
    let resp = read.get("get (first hosts by join)", options).await?;
    Ok(from_keys(keys, resp.kvs()))
}

/// One read of the member keys' range, within the request deadline: what
/// [`first_by_join`] and [`count_members`] ask etcd, each with its options.
struct MembersRead<'a> {
    endpoints: &'a str,
    timeout: std::time::Duration,
    client: &'a Client,
    keys: &'a Keys,
}

impl MembersRead<'_> {
    async fn get(
        &self,
        op: &'static str,
        options: GetOptions,
    ) -> Result<etcd_client::GetResponse, CoordError> {
        let prefix = self.keys.members();
        let mut kv = self.client.kv_client();
        super::bounded::call(
            self.endpoints,
            self.timeout,
            op,
            &prefix,
            kv.get(prefix.as_str(), Some(options)),
        )
        .await
    }
}

/// The answer of a read of the first member keys by join: host id ->
/// create revision.
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

/// How many member keys there were at `revision` (the register txn's):
/// a count-only range, asked only when the markers did not settle it
/// ([`settled_by_markers`]).
pub(crate) async fn count_members(
    endpoints: &str,
    timeout: std::time::Duration,
    client: &Client,
    keys: &Keys,
    revision: i64,
) -> Result<i64, CoordError> {
    let options = GetOptions::new()
        .with_prefix()
        .with_count_only()
        .with_revision(revision);
    let read = MembersRead {
        endpoints,
        timeout,
        client,
        keys,
    };
    let resp = read.get("get (count of members)", options).await?;
    Ok(resp.count())
}

/// Whether a host whose member key was just created decides, from the
/// count of deciders' markers its register txn read: `Some(false)` with
/// [`DECIDERS`] or more (each names an older live member key), `None`
/// when fewer stand and only a count of the member keys can say.
pub(crate) fn settled_by_markers(markers: i64) -> Option<bool> {
    usize::try_from(markers)
        .is_ok_and(|n| n >= DECIDERS)
        .then_some(false)
}

/// A decider's marker ([`super::keys::Keys::decider`]): its host id and
/// the create revision it names (0 when unreadable: only the host id is
/// used, to watch for the decider's loss). `None` for any other key.
pub(crate) fn from_marker(keys: &Keys, key: &[u8], value: &[u8]) -> Option<(String, i64)> {
    let key = std::str::from_utf8(key).ok()?;
    let host = key.strip_prefix(keys.deciders().as_str())?;
    let joined = std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Some((host.to_owned(), joined))
}

/// Whether a host whose member key was just created (the newest by join)
/// decides, given how many member keys there are with it: it is among the
/// first [`DECIDERS`] by join exactly when there are at most that many.
pub(crate) fn newest_decides(members: i64) -> bool {
    usize::try_from(members).is_ok_and(|n| n <= DECIDERS)
}

/// Whether `host` decides, given the first hosts by join etcd answered:
/// it is among them, or there are fewer than [`DECIDERS`] members (its
/// own key is one of them).
pub(crate) fn decides(first: &BTreeMap<String, i64>, host: &str) -> bool {
    first.len() < DECIDERS || first.contains_key(host)
}

/// After the deletion of `host`'s marker: whether a non-decider that knew
/// `first` as the deciders should ask etcd again (`first` is updated).
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
    fn the_newest_host_decides_only_among_the_first_by_count() {
        assert!(newest_decides(1));
        assert!(newest_decides(8));
        assert!(!newest_decides(9));
        assert!(!newest_decides(2_048));
        // A count etcd could not give (negative) is no licence to decide.
        assert!(!newest_decides(-1));
    }

    #[test]
    fn a_full_set_of_markers_settles_a_join_and_fewer_ask_for_the_count() {
        assert_eq!(settled_by_markers(8), Some(false));
        assert_eq!(settled_by_markers(9), Some(false));
        // A job's first hosts, or deciders lost and not yet replaced.
        assert_eq!(settled_by_markers(7), None);
        assert_eq!(settled_by_markers(0), None);
        assert_eq!(settled_by_markers(-1), None);
    }

    #[test]
    fn a_marker_names_its_decider() {
        let keys = Keys::new("/w", "j");
        let kv = |host: &str, value: &str| {
            from_marker(&keys, keys.decider(host).as_bytes(), value.as_bytes())
        };
        assert_eq!(kv("a", "12"), Some(("a".to_owned(), 12)));
        assert_eq!(kv("b", "junk"), Some(("b".to_owned(), 0)));
        // A member key, or another job's marker, is no marker of this job.
        assert_eq!(from_marker(&keys, keys.member("a").as_bytes(), b"1"), None);
        let other = Keys::new("/w", "k");
        assert_eq!(
            from_marker(&keys, other.decider("a").as_bytes(), b"1"),
            None
        );
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
