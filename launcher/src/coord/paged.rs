//! Reads of a key range in pages, so that no answer outgrows the client's
//! receive limit however many hosts a job has (issue 30: one range of a
//! 1,150-host job's keys passed gRPC's default 4 MiB and no host could
//! join).
//!
//! In: a client, a key prefix, the revision to read at (0: the newest),
//! and what to do with each key-value. Out: every key-value under the
//! prefix at one revision, in key order, handed over page by page; the
//! revision read at.
//! Never: read two pages at different revisions (the first page's
//! revision pins the rest, so a paged read is one snapshot); ask for a
//! page without the request deadline; loop: each page starts right after
//! the last key of the one before, so K keys take ceil(K / PAGE_KEYS)
//! requests.

use std::time::Duration;

use etcd_client::{Client, GetOptions, KeyValue};

use super::CoordError;

/// Keys per page. Member and departure records are under 1 KiB (a host id
/// and address of at most 128 characters each, a few numbers), so a page
/// of them is under 256 KiB.
pub(crate) const PAGE_KEYS: i64 = 256;

/// The largest answer the coordination clients accept, reads and watch
/// messages alike (gRPC's default is 4 MiB). A page of [`PAGE_KEYS`] keys
/// reaches it only if their values average 256 KiB, which no warden writes
/// (docs/operations.md, "Scale"); a watch message reaches it only if etcd
/// batches more than 64 MiB of changes into one (a watcher far behind).
/// Past it a read fails with "decoded message length too large", named
/// with its key range, and is retried like any etcd error.
pub(crate) const RECEIVE_LIMIT: usize = 64 * 1024 * 1024;

/// The key right after every key that starts with `prefix` (etcd's prefix
/// range end).
pub(crate) fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the keyspace.
    vec![0]
}

/// Reads every key under `prefix` at `revision` (0: the newest), page by
/// page, handing each key-value to `each`; returns the revision read at.
pub(crate) async fn read_prefix(
    endpoints: &str,
    timeout: Duration,
    client: &Client,
    prefix: &str,
    revision: i64,
    each: impl FnMut(&KeyValue),
) -> Result<i64, CoordError> {
    let from = prefix.as_bytes().to_vec();
    read_prefix_from(endpoints, timeout, client, prefix, from, revision, each).await
}

/// [`read_prefix`] of the keys alone (their values left in etcd: a
/// question of who is there, not what they say), at the newest revision.
pub(crate) async fn read_keys(
    endpoints: &str,
    timeout: Duration,
    client: &Client,
    prefix: &str,
    each: impl FnMut(&KeyValue),
) -> Result<i64, CoordError> {
    let from = prefix.as_bytes().to_vec();
    read_pages(endpoints, timeout, client, prefix, from, 0, true, each).await
}

/// [`read_prefix`] from key `from` on (a page read elsewhere, such as in
/// the joining txn, ended right before it).
pub(crate) async fn read_prefix_from(
    endpoints: &str,
    timeout: Duration,
    client: &Client,
    prefix: &str,
    from: Vec<u8>,
    revision: i64,
    each: impl FnMut(&KeyValue),
) -> Result<i64, CoordError> {
    read_pages(
        endpoints, timeout, client, prefix, from, revision, false, each,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn read_pages(
    endpoints: &str,
    timeout: Duration,
    client: &Client,
    prefix: &str,
    from: Vec<u8>,
    revision: i64,
    keys_only: bool,
    mut each: impl FnMut(&KeyValue),
) -> Result<i64, CoordError> {
    let mut kv = client.kv_client().max_decoding_message_size(RECEIVE_LIMIT);
    let end = prefix_end(prefix);
    let mut from = from;
    let mut revision = revision;
    loop {
        let mut options = GetOptions::new()
            .with_range(end.clone())
            .with_limit(PAGE_KEYS);
        if keys_only {
            options = options.with_keys_only();
        }
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let resp = super::bounded::call(
            endpoints,
            timeout,
            "get (page)",
            prefix,
            kv.get(from.clone(), Some(options)),
        )
        .await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        for kv in resp.kvs() {
            each(kv);
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                // The next page starts right after the last key read.
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok(revision),
        }
    }
}

/// Whether `err` is etcd saying the revision asked for was compacted away
/// (a paged read that took longer than the compaction interval): read
/// again at the newest.
pub(crate) fn compacted(err: &CoordError) -> bool {
    matches!(err, CoordError::Etcd { source, .. }
        if source.to_string().contains("required revision has been compacted"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_next_key_after_the_prefix() {
        assert_eq!(prefix_end("/a/b/"), b"/a/b0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
