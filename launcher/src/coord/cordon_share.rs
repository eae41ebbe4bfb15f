//! The cap on the share of a job's hosts cordoned within a window
//! (`warden run --max-cordon-share`): a cordon storm (a bad driver push, a
//! detector false positive) must not send every host of a job to the
//! scheduler as faulty.
//!
//! In: the job's hosts as etcd shows them (live members, and the hosts
//! that left with why and when: `departures/<host>`), this host, the
//! window and the cap. Out: the hosts cordoned in the window, this one
//! included, out of the job's hosts, and whether that passes the cap.
//! Never: I/O, or a clock of its own (`now_ms` is passed in).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::rule_stop::{self, RuleStop, StopEvidence, StopRule};

/// The prefix of a departure's reason for a cordon ([`super::Leave::Cordoned`]).
pub const CORDONED: &str = "cordoned: ";

/// The job's cordons in the window.
#[derive(Debug, Clone, PartialEq)]
pub struct CordonShare {
    /// Hosts cordoned within the window, this one included, sorted.
    pub cordoned: Vec<String>,
    /// The job's hosts: live members and hosts that left.
    pub hosts: usize,
    /// True when `cordoned / hosts` exceeds the cap.
    pub over: bool,
}

impl CordonShare {
    /// One line for the console and the logs.
    pub fn describe(&self, max_share: f64, window: Duration) -> String {
        format!(
            "{} of the job's {} hosts cordoned within {} ({}); --max-cordon-share {max_share}",
            self.cordoned.len(),
            self.hosts,
            humantime::format_duration(window),
            self.cordoned.join(", ")
        )
    }

    /// The stop for the agent (ReportJobStop): one evidence item per host
    /// cordoned in the window, then the job's host count.
    pub fn report(&self, why: &str, max_share: f64, window: Duration, exit_code: i32) -> RuleStop {
        let within = format!("within {}", humantime::format_duration(window));
        let mut evidence: Vec<StopEvidence> = self
            .cordoned
            .iter()
            .take(rule_stop::MAX_EVIDENCE - 1)
            .map(|h| StopEvidence {
                subject: format!("host/{h}"),
                signal: "host.cordoned".into(),
                value: within.clone(),
                note: "counted toward the job's cordon share".into(),
            })
            .collect();
        evidence.push(StopEvidence {
            subject: "job".into(),
            signal: "job.hosts".into(),
            value: self.hosts.to_string(),
            note: format!(
                "{} of {} hosts cordoned {within}: over --max-cordon-share {max_share}",
                self.cordoned.len(),
                self.hosts
            ),
        });
        RuleStop {
            rule: StopRule::CordonShare,
            summary: why.to_owned(),
            limit: format!(
                "--max-cordon-share {max_share} --cordon-share-window {}",
                humantime::format_duration(window)
            ),
            exit_code,
            evidence,
            incident: None,
        }
    }
}

/// Counts the cordons of the job's hosts within `window` before `now_ms`,
/// as if `host` were cordoned now. `departures`: host -> (reason, when in
/// ms since the epoch).
pub fn cordon_share<'a>(
    members: impl IntoIterator<Item = &'a str>,
    departures: &BTreeMap<String, (String, u64)>,
    host: &str,
    now_ms: u64,
    window: Duration,
    max_share: f64,
) -> CordonShare {
    let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
    let since = now_ms.saturating_sub(window_ms);
    let mut hosts: BTreeSet<&str> = members.into_iter().collect();
    hosts.extend(departures.keys().map(String::as_str));
    hosts.insert(host);
    let mut cordoned: BTreeSet<&str> = departures
        .iter()
        .filter(|(_, (reason, at))| reason.starts_with(CORDONED) && *at >= since)
        .map(|(h, _)| h.as_str())
        .collect();
    cordoned.insert(host);
    #[allow(clippy::cast_precision_loss)]
    let share = cordoned.len() as f64 / hosts.len() as f64;
    CordonShare {
        cordoned: cordoned.into_iter().map(str::to_owned).collect(),
        hosts: hosts.len(),
        over: share > max_share,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);
    const NOW: u64 = 10_000_000;

    fn gone(reason: &str, ago_ms: u64) -> (String, u64) {
        (reason.to_owned(), NOW - ago_ms)
    }

    #[test]
    fn counts_recent_cordons_among_the_jobs_hosts() {
        let mut departures = BTreeMap::new();
        departures.insert("a".to_owned(), gone("cordoned: xid 79", 60_000));
        // Too old, or not a cordon: not counted (but still the job's).
        departures.insert("b".to_owned(), gone("cordoned: xid 79", 2 * 3_600_000));
        departures.insert("c".to_owned(), gone("stopped: SIGTERM", 1_000));
        let members = ["d", "e", "f", "g", "h"];
        let s = cordon_share(members, &departures, "d", NOW, HOUR, 0.25);
        assert_eq!(s.cordoned, vec!["a", "d"]);
        assert_eq!(s.hosts, 8);
        assert!(!s.over, "2 of 8 is the cap, not past it");
        let s = cordon_share(members, &departures, "d", NOW, HOUR, 0.2);
        assert!(s.over, "2 of 8 is past 0.2");
        assert!(
            s.describe(0.2, HOUR)
                .starts_with("2 of the job's 8 hosts cordoned within 1h (a, d)"),
            "{}",
            s.describe(0.2, HOUR)
        );
        // What the agent is told (ReportJobStop): each host, then the count.
        let r = s.report("cordon share cap: ...", 0.2, HOUR, 87);
        assert_eq!(r.rule, StopRule::CordonShare);
        assert_eq!(r.exit_code, 87);
        assert_eq!(r.limit, "--max-cordon-share 0.2 --cordon-share-window 1h");
        let items: Vec<String> = r
            .evidence
            .iter()
            .map(|e| format!("{} {}={}", e.subject, e.signal, e.value))
            .collect();
        assert_eq!(
            items,
            vec![
                "host/a host.cordoned=within 1h",
                "host/d host.cordoned=within 1h",
                "job job.hosts=8"
            ]
        );
    }

    #[test]
    fn a_cap_of_one_never_holds() {
        let mut departures = BTreeMap::new();
        departures.insert("a".to_owned(), gone("cordoned: x", 0));
        let s = cordon_share(["b"], &departures, "b", NOW, HOUR, 1.0);
        assert_eq!((s.cordoned.len(), s.hosts), (2, 2));
        assert!(!s.over);
    }
}
