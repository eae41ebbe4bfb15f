//! The job's per-host goodput reports in etcd (`<prefix>/~goodput/<job>/<host>`:
//! beside the job's coordination keys, not under them, so that rewriting
//! them every 10 s wakes no coordinator; `super::keys`).
//!
//! Each agent accounts only its own ranks; the job's launchers meet in etcd
//! anyway, so each keeps its host's report there (while the job runs and
//! when it ends), and anyone with the endpoints sums them
//! (`job_goodput::merge`): the last launcher to finish prints the
//! whole job, and `warden goodput --etcd` shows it live. The keys have no
//! lease: a host that died or was cordoned still counts in the job's time.
//!
//! Never: block a launcher on etcd past `timeout`, or take a report that
//! does not decode for a host's numbers (it is named and skipped).

use std::collections::BTreeSet;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, EventType, Txn, TxnOp, WatchOptions};
use prost::Message;
use tokio::time::{Instant, sleep_until};
use warden_proto::v1 as pb;

use super::CoordError;
use super::access::EtcdAccess;
use super::keys::Keys;

/// A client for reading and writing reports, every request bounded by
/// `timeout`.
#[derive(Clone)]
pub struct Reports {
    client: Client,
    keys: Keys,
    endpoints: String,
    timeout: Duration,
}

impl std::fmt::Debug for Reports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reports")
            .field("keys", &self.keys)
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

/// What a read found: the hosts' reports, and the keys that could not be
/// read as one (with why).
#[derive(Debug, Default)]
pub struct Found {
    /// Host id and its report, sorted by host.
    pub reports: Vec<(String, pb::JobGoodput)>,
    /// `key: problem` for each value that did not decode.
    pub bad: Vec<String>,
    /// The etcd revision the read saw (where a watch for later reports
    /// starts).
    pub revision: i64,
}

impl Found {
    /// The hosts whose report is still a live copy (their job had not
    /// ended there when they wrote it).
    pub fn running(&self) -> Vec<&str> {
        self.reports
            .iter()
            .filter(|(_, r)| r.open)
            .map(|(h, _)| h.as_str())
            .collect()
    }

    /// Takes in `kv`, a report under `prefix` (None: the key was deleted):
    /// the host's report replaced, added in host order (host ids are ASCII,
    /// and etcd hands keys in byte order, so a paged read appends), or
    /// dropped; a value that does not decode drops the host's report and
    /// is named in `bad`, as a read would have it.
    fn take(&mut self, prefix: &str, key: &[u8], value: Option<&[u8]>) {
        let key = String::from_utf8_lossy(key);
        let Some(host) = key.strip_prefix(prefix) else {
            return;
        };
        let at = self.reports.binary_search_by(|(h, _)| h.as_str().cmp(host));
        let named = || format!("{key}: ");
        if !self.bad.is_empty() {
            let named = named();
            self.bad.retain(|b| !b.starts_with(&named));
        }
        match (value.map(pb::JobGoodput::decode), at) {
            (Some(Ok(r)), Ok(i)) => self.reports[i].1 = r,
            (Some(Ok(r)), Err(i)) => self.reports.insert(i, (host.to_owned(), r)),
            (Some(Err(e)), at) => {
                if let Ok(i) = at {
                    self.reports.remove(i);
                }
                self.bad.push(format!("{}not a JobGoodput: {e}", named()));
            }
            (None, Ok(i)) => {
                self.reports.remove(i);
            }
            (None, Err(_)) => {}
        }
    }

    /// [`Found::running`] less the hosts in `gone`.
    fn awaited(&self, gone: &BTreeSet<String>) -> usize {
        self.reports
            .iter()
            .filter(|(h, r)| r.open && !gone.contains(h))
            .count()
    }
}

impl Reports {
    /// Connects to etcd at `endpoints`, with `access`'s TLS and user, for
    /// the job `job` under `prefix`; fails when the user may not read the
    /// job's reports.
    pub async fn connect(
        endpoints: &[String],
        access: &EtcdAccess,
        prefix: &str,
        job: &str,
        timeout: Duration,
    ) -> Result<Self, CoordError> {
        let keys = Keys::new(prefix, job);
        let client = super::connect::connect(super::connect::EtcdDial {
            endpoints,
            access,
            timeout,
            keep_alive: None,
            probe: &keys.goodputs(),
            // A CLI read or a launcher's report: one deadline's worth.
            patience: timeout,
        })
        .await?;
        Ok(Self {
            client,
            keys,
            endpoints: endpoints.join(","),
            timeout,
        })
    }

    async fn call<T>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, CoordError> {
        super::bounded::call(&self.endpoints, self.timeout, op, key, fut).await
    }

    /// Stores `host`'s report (replacing its previous one).
    pub async fn publish(&self, host: &str, report: &pb::JobGoodput) -> Result<(), CoordError> {
        let key = self.keys.goodput(host);
        let mut c = self.client.clone();
        self.call(
            "put",
            &key,
            c.put(key.as_str(), report.encode_to_vec(), None),
        )
        .await
        .map(|_| ())
    }

    /// Stores a live copy of `host`'s report only if nothing wrote its key
    /// since `after` (the key's mod revision this publisher last saw; None:
    /// as it is now). Returns the key's new mod revision, or None when
    /// something else wrote it: the launcher's final report
    /// ([`Reports::publish`]), which a live copy must never replace. A
    /// live copy still in flight when the job ended (a request that timed
    /// out here may still reach etcd) then fails its compare instead of
    /// overwriting the final one.
    pub async fn publish_live(
        &self,
        host: &str,
        report: &pb::JobGoodput,
        after: Option<i64>,
    ) -> Result<Option<i64>, CoordError> {
        let key = self.keys.goodput(host);
        let mut c = self.client.clone();
        let after = match after {
            Some(r) => r,
            None => {
                let now = self.call("get", &key, c.get(key.as_str(), None)).await?;
                now.kvs().first().map_or(0, |kv| kv.mod_revision())
            }
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, after)])
            .and_then([TxnOp::put(key.as_str(), report.encode_to_vec(), None)]);
        let r = self.call("txn", &key, c.txn(txn)).await?;
        Ok(r.succeeded()
            .then(|| r.header().map_or(after, |h| h.revision())))
    }

    /// Of `hosts`, those neither a member of the job (a member key, under
    /// its launcher's lease) nor gone by a leave of their own (a departure
    /// record, written in the leave's txn, before that launcher stores its
    /// final report): their leases ran out with no leave. The caller asks
    /// only of hosts its last round no longer holds, so a host rejoining
    /// within the coordinators' grace is never among them; one cut off
    /// from etcd for longer may still store a final report later, which
    /// `warden goodput --etcd` then shows. The keys alone, in
    /// pages: tens of bytes a host, so any number of hosts fits (the
    /// reports' own read at the end is O(N) a host already).
    pub async fn lost_among(&self, hosts: &[&str]) -> Result<BTreeSet<String>, CoordError> {
        let mut lost: BTreeSet<String> = hosts.iter().map(|h| (*h).to_owned()).collect();
        if lost.is_empty() {
            return Ok(lost);
        }
        for prefix in [self.keys.members(), self.keys.departures()] {
            super::paged::read_keys(&self.endpoints, self.timeout, &self.client, &prefix, |kv| {
                if let Some(host) = kv.key().strip_prefix(prefix.as_bytes()) {
                    lost.remove(String::from_utf8_lossy(host).as_ref());
                }
            })
            .await?;
        }
        Ok(lost)
    }

    /// Waits until no report in `found` is a live copy any more (every
    /// host stored its final one), the hosts in `gone` aside (lost:
    /// [`Reports::lost_among`], or the caller itself), or until `until`;
    /// each change under the job's reports is applied as the watch brings
    /// it (no etcd read a change: reading every host's report again on
    /// each, as before, made a job's end O(N) reads a change at every
    /// waiting host; counting who is still awaited stays O(N) in memory).
    /// Returns `found` with the changes (as it was if etcd failed: the
    /// caller keeps what it has).
    pub async fn await_final(
        &self,
        mut found: Found,
        gone: &BTreeSet<String>,
        until: Instant,
    ) -> Found {
        if found.awaited(gone) == 0 {
            return found;
        }
        let prefix = self.keys.goodputs();
        let mut c = self.client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(found.revision + 1);
        let watched = tokio::select! {
            () = sleep_until(until) => return found,
            r = self.call("watch", &prefix, c.watch(prefix.as_str(), Some(options))) => r,
        };
        let Ok(mut stream) = watched else {
            return found;
        };
        loop {
            let message = tokio::select! {
                () = sleep_until(until) => return found,
                m = stream.message() => m,
            };
            let resp = match message {
                Ok(Some(resp)) if !resp.canceled() => resp,
                _ => return found,
            };
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                let value = (event.event_type() == EventType::Put).then(|| kv.value());
                found.take(&prefix, kv.key(), value);
            }
            if found.awaited(gone) == 0 {
                return found;
            }
        }
    }

    /// Every host's report of the job, read in pages at one revision
    /// ([`super::paged`]), so a job of any size fits the receive limit.
    pub async fn read(&self) -> Result<Found, CoordError> {
        let prefix = self.keys.goodputs();
        let mut found = Found::default();
        let revision = super::paged::read_prefix(
            &self.endpoints,
            self.timeout,
            &self.client,
            &prefix,
            0,
            |kv| found.take(&prefix, kv.key(), Some(kv.value())),
        )
        .await?;
        found.revision = revision;
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFIX: &str = "/w/~goodput/j/";

    fn report(open: bool, ranks: u32) -> Vec<u8> {
        pb::JobGoodput {
            open,
            ranks,
            ..Default::default()
        }
        .encode_to_vec()
    }

    fn take(found: &mut Found, host: &str, value: Option<&[u8]>) {
        found.take(PREFIX, format!("{PREFIX}{host}").as_bytes(), value);
    }

    fn hosts(found: &Found) -> Vec<(&str, bool, u32)> {
        found
            .reports
            .iter()
            .map(|(h, r)| (h.as_str(), r.open, r.ranks))
            .collect()
    }

    #[test]
    fn a_change_replaces_inserts_in_order_or_drops_the_hosts_report() {
        let mut found = Found::default();
        take(&mut found, "h-b", Some(&report(true, 2)));
        take(&mut found, "h-a", Some(&report(true, 2)));
        take(&mut found, "h-c", Some(&report(true, 2)));
        assert_eq!(
            hosts(&found),
            [("h-a", true, 2), ("h-b", true, 2), ("h-c", true, 2)]
        );
        // The final report replaces the live copy.
        take(&mut found, "h-b", Some(&report(false, 4)));
        assert_eq!(found.running(), ["h-a", "h-c"]);
        assert_eq!(hosts(&found)[1], ("h-b", false, 4));
        // A value that does not decode drops the host's report and is named.
        take(&mut found, "h-c", Some(b"\xff\xff\xff"));
        assert_eq!(found.running(), ["h-a"]);
        assert_eq!(found.bad.len(), 1, "{:?}", found.bad);
        assert!(found.bad[0].starts_with("/w/~goodput/j/h-c: "));
        // A good one after it: counted again, no longer named as bad.
        take(&mut found, "h-c", Some(&report(false, 2)));
        assert!(found.bad.is_empty(), "{:?}", found.bad);
        assert_eq!(hosts(&found)[2], ("h-c", false, 2));
        // A deleted key drops the host; a key outside the prefix is not a report.
        take(&mut found, "h-a", None);
        found.take(PREFIX, b"/w/~goodput/other/h-z", Some(&report(true, 2)));
        assert_eq!(hosts(&found), [("h-b", false, 4), ("h-c", false, 2)]);
        assert!(found.running().is_empty());
    }
}
