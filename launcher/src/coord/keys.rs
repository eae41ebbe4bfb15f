//! The job's key layout in etcd, in one place.
//!
//! ```text
//! <prefix>/<job>/members/<host>       member record (JSON), under the host's lease
//! <prefix>/<job>/epoch                the current epoch, decimal; absent = 0
//! <prefix>/<job>/rounds/<epoch:020>   the round of that epoch (JSON), written in the
//!                                     same txn that advances `epoch`; the last
//!                                     KEEP_ROUNDS are kept. Its members are a
//!                                     delta from a layout base (`layout.rs`)
//! <prefix>/<job>/layouts/<base>/<chunk:06>
//!                                     a base's members (a zlib-compressed JSON array per chunk),
//!                                     written before the round that first names
//!                                     it; `<base>` is `<epoch:020>-<writer host>`;
//!                                     bases older than the current one are deleted
//!                                     in the txn of the round that names a new one
//! <prefix>/<job>/claims/<epoch:020>   the host writing the layout base of the round of
//!                                     that epoch, under its lease: one writer per base
//!                                     (create-if-absent while the epoch is the one
//!                                     before); deleted by the txn of a later round
//!                                     that names a new base
//! <prefix>/<job>/departures/<host>    why a host left (JSON), written with its leave
//! <prefix>/<job>/ends/<epoch:020>     the job finished or failed at that epoch (JSON);
//!                                     the first host to say so writes it
//! <prefix>/<job>/notices/<epoch:020>  a notice of a coming stop in the round of that
//!                                     epoch and the step every rank saves at (JSON);
//!                                     the first host to get one writes it, once, and
//!                                     deletes older ones in the same txn
//! <prefix>/<job>/deciders/<host>      the host decides rounds: its member key's create
//!                                     revision, decimal; under the host's lease, written
//!                                     when it starts deciding (`deciders.rs`)
//!
//! <prefix>/~goodput/<job>/<host>      the host's goodput breakdown of the job (a
//!                                     protobuf-encoded warden.v1.JobGoodput), updated
//!                                     while it runs and final when it ends; no lease
//! ```
//!
//! Epochs are zero-padded so that rounds sort by epoch and old ones can be
//! deleted with one range.
//!
//! Every launcher watches `<prefix>/<job>/`, so only what the coordinators
//! act on lives there: nothing under it changes on a timer. The goodput
//! reports, rewritten by every launcher every 10 s, live beside it under
//! `<prefix>/~goodput/`: still inside `<prefix>/` (one etcd role grant
//! covers both), and no job's keys can collide with them, since `~` is not
//! allowed in a job id (`CoordConfig::validate`).

/// How many round records are kept behind the current one.
pub const KEEP_ROUNDS: u64 = 16;

/// The keys of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    base: String,
    /// `<prefix>/~goodput/<job>/`: outside the watched `base`.
    reports: String,
}

/// The segment under the prefix that holds every job's goodput reports: a
/// character no job id may hold, so it is never a job's own prefix.
pub const REPORTS_SEGMENT: &str = "~goodput";

/// What a key under the job's prefix is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind<'a> {
    /// `members/<host>`.
    Member(&'a str),
    /// `epoch`.
    Epoch,
    /// `rounds/<epoch>`.
    Round(u64),
    /// `departures/<host>`.
    Departure(&'a str),
    /// `ends/<epoch>`.
    End(u64),
    /// `layouts/<base>/<chunk>`.
    LayoutChunk(&'a str, u32),
    /// `notices/<epoch>`.
    Notice(u64),
    /// `deciders/<host>`.
    Decider(&'a str),
    /// Anything else (a newer version's key): ignored.
    Other,
}

impl Keys {
    /// The keys of `job` under `prefix` (validated: starts with '/', no
    /// trailing '/', job is one segment).
    pub fn new(prefix: &str, job: &str) -> Self {
        Self {
            base: format!("{prefix}/{job}/"),
            reports: format!("{prefix}/{REPORTS_SEGMENT}/{job}/"),
        }
    }

    /// `<prefix>/<job>/`: every key of the job, for the one watch.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// A host's member key.
    pub fn member(&self, host: &str) -> String {
        format!("{}members/{host}", self.base)
    }

    /// The prefix of all member keys.
    pub fn members(&self) -> String {
        format!("{}members/", self.base)
    }

    /// The epoch key.
    pub fn epoch(&self) -> String {
        format!("{}epoch", self.base)
    }

    /// The round record of `epoch`.
    pub fn round(&self, epoch: u64) -> String {
        format!("{}rounds/{epoch:020}", self.base)
    }

    /// The prefix of every round record.
    pub fn rounds(&self) -> String {
        format!("{}rounds/", self.base)
    }

    /// The prefix of every end marker.
    pub fn ends(&self) -> String {
        format!("{}ends/", self.base)
    }

    /// Where a host's reason for leaving goes.
    pub fn departure(&self, host: &str) -> String {
        format!("{}departures/{host}", self.base)
    }

    /// The prefix of all departures.
    pub fn departures(&self) -> String {
        format!("{}departures/", self.base)
    }

    /// The job's end marker at `epoch`.
    pub fn end(&self, epoch: u64) -> String {
        format!("{}ends/{epoch:020}", self.base)
    }

    /// The notice of a coming stop in the round of `epoch`.
    pub fn notice(&self, epoch: u64) -> String {
        format!("{}notices/{epoch:020}", self.base)
    }

    /// The prefix of every notice.
    pub fn notices(&self) -> String {
        format!("{}notices/", self.base)
    }

    /// Where a host that decides rounds says so.
    pub fn decider(&self, host: &str) -> String {
        format!("{}deciders/{host}", self.base)
    }

    /// The prefix of every decider's marker.
    pub fn deciders(&self) -> String {
        format!("{}deciders/", self.base)
    }

    /// The prefix of every layout base.
    pub fn layouts(&self) -> String {
        format!("{}layouts/", self.base)
    }

    /// The prefix of one base's chunks.
    pub fn layout(&self, base: &str) -> String {
        format!("{}layouts/{base}/", self.base)
    }

    /// One chunk of a base.
    pub fn layout_chunk(&self, base: &str, chunk: u32) -> String {
        format!("{}layouts/{base}/{chunk:06}", self.base)
    }

    /// Who writes the layout base of the round of `epoch`: the one host
    /// that created this key (its host id, under its lease).
    pub fn base_claim(&self, epoch: u64) -> String {
        format!("{}claims/{epoch:020}", self.base)
    }

    /// The name of the base written with the round of `epoch` by `host`:
    /// bases sort by epoch, and two hosts racing for one epoch write apart.
    pub fn layout_base(epoch: u64, host: &str) -> String {
        format!("{epoch:020}-{host}")
    }

    /// Where a host's goodput report of the job goes: outside [`Keys::base`],
    /// so the coordinators' watch never sees a report change.
    pub fn goodput(&self, host: &str) -> String {
        format!("{}{host}", self.reports)
    }

    /// The prefix of all the job's goodput reports.
    pub fn goodputs(&self) -> String {
        self.reports.clone()
    }

    /// What `key` is; `None` when it is not under this job.
    pub fn classify<'a>(&self, key: &'a str) -> Option<KeyKind<'a>> {
        let rest = key.strip_prefix(self.base.as_str())?;
        Some(if let Some(host) = rest.strip_prefix("members/") {
            KeyKind::Member(host)
        } else if rest == "epoch" {
            KeyKind::Epoch
        } else if let Some(epoch) = rest.strip_prefix("rounds/") {
            epoch.parse().map_or(KeyKind::Other, KeyKind::Round)
        } else if let Some(host) = rest.strip_prefix("departures/") {
            KeyKind::Departure(host)
        } else if let Some(epoch) = rest.strip_prefix("ends/") {
            epoch.parse().map_or(KeyKind::Other, KeyKind::End)
        } else if let Some(epoch) = rest.strip_prefix("notices/") {
            epoch.parse().map_or(KeyKind::Other, KeyKind::Notice)
        } else if let Some(host) = rest.strip_prefix("deciders/") {
            KeyKind::Decider(host)
        } else if let Some(layout) = rest.strip_prefix("layouts/") {
            match layout.rsplit_once('/') {
                Some((base, chunk)) if !base.is_empty() && !base.contains('/') => chunk
                    .parse()
                    .map_or(KeyKind::Other, |c| KeyKind::LayoutChunk(base, c)),
                _ => KeyKind::Other,
            }
        } else {
            KeyKind::Other
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_classify() {
        let k = Keys::new("/warden/jobs", "j1");
        assert_eq!(k.member("h-a"), "/warden/jobs/j1/members/h-a");
        assert_eq!(k.round(7), "/warden/jobs/j1/rounds/00000000000000000007");
        assert_eq!(k.classify(&k.member("h-a")), Some(KeyKind::Member("h-a")));
        assert_eq!(k.classify(&k.epoch()), Some(KeyKind::Epoch));
        assert_eq!(k.classify(&k.round(7)), Some(KeyKind::Round(7)));
        assert_eq!(
            k.classify(&k.departure("h-b")),
            Some(KeyKind::Departure("h-b"))
        );
        assert_eq!(k.classify(&k.end(3)), Some(KeyKind::End(3)));
        assert_eq!(k.decider("h-a"), "/warden/jobs/j1/deciders/h-a");
        assert_eq!(k.classify(&k.decider("h-a")), Some(KeyKind::Decider("h-a")));
        assert!(k.decider("h-a").starts_with(&k.deciders()));
        assert_eq!(k.notice(3), "/warden/jobs/j1/notices/00000000000000000003");
        assert_eq!(k.classify(&k.notice(3)), Some(KeyKind::Notice(3)));
        assert!(k.notice(3).starts_with(&k.notices()));
        let base = Keys::layout_base(4, "h-a");
        assert_eq!(
            k.layout_chunk(&base, 2),
            "/warden/jobs/j1/layouts/00000000000000000004-h-a/000002"
        );
        assert_eq!(
            k.classify(&k.layout_chunk(&base, 2)),
            Some(KeyKind::LayoutChunk(base.as_str(), 2))
        );
        assert!(k.layout_chunk(&base, 0).starts_with(&k.layout(&base)));
        assert_eq!(
            k.classify("/warden/jobs/j1/layouts/a/b/000001"),
            Some(KeyKind::Other)
        );
        assert_eq!(k.classify("/warden/jobs/j1/future"), Some(KeyKind::Other));
        // Another job whose name starts with this one's is not this job.
        assert_eq!(k.classify("/warden/jobs/j10/epoch"), None);
        // Rounds sort by epoch as strings.
        assert!(k.round(9) < k.round(10));
    }

    #[test]
    fn goodput_reports_are_outside_every_watched_job_prefix() {
        let k = Keys::new("/warden/jobs", "j1");
        assert_eq!(k.goodput("h-a"), "/warden/jobs/~goodput/j1/h-a");
        // Not under the job's watched prefix: a report written every 10 s
        // wakes no coordinator.
        assert!(!k.goodput("h-a").starts_with(k.base()));
        assert_eq!(k.classify(&k.goodput("h-a")), None);
        // Still under the role's one grant, `<prefix>/`.
        assert!(k.goodputs().starts_with("/warden/jobs/"));
        // No job id can be the reports' segment: its `~` is refused.
        let mut c = crate::coord::CoordConfig::new(
            vec!["127.0.0.1:2379".into()],
            REPORTS_SEGMENT,
            "h",
            "127.0.0.2",
        );
        c.min_nodes = 1;
        c.max_nodes = 1;
        assert!(c.validate().is_err());
    }
}
