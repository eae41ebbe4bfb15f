//! What the launcher tells its agent when it ends the job by a rule of its
//! own (no progress across restarts, 88; the job's share of cordoned hosts,
//! 87), so the stop shows in `warden incidents`, events and metrics like
//! the agent's own decisions (ReportJobStop).
//!
//! In: the rule's observations. Out: a [`RuleStop`] the executor sends at
//! the job's end. Never: I/O; an unbounded list (the machine keeps at most
//! [`MAX_EVIDENCE`] items, the newest). The report's types are
//! `crate::rule_stop`'s, a leaf that the hosts' seam and the cordon-share
//! rule name too without importing the machine.

pub use crate::rule_stop::{MAX_EVIDENCE, RuleStop, StopEvidence, StopRule, keep_newest};

/// The evidence of one failed attempt's progress observation: the newest
/// complete checkpoint (when the tier answered) and the step its ranks
/// resumed from (when they reported one), each with the rule's `note`.
pub fn attempt_evidence(
    attempt: u32,
    p: &super::Progress,
    note: &str,
) -> impl Iterator<Item = StopEvidence> {
    let subject = format!("attempt/{attempt}");
    let checkpoint = p.listed.then(|| StopEvidence {
        subject: subject.clone(),
        signal: "checkpoint.newest".into(),
        value: p
            .checkpoint
            .map_or_else(|| "none".to_owned(), |s| s.to_string()),
        note: note.to_owned(),
    });
    let resumed = p.resumed_from.map(|s| StopEvidence {
        subject: subject.clone(),
        signal: "resumed_from".into(),
        value: s.to_string(),
        note: note.to_owned(),
    });
    let unobserved = (!p.listed && p.resumed_from.is_none()).then(|| StopEvidence {
        subject: subject.clone(),
        signal: "progress".into(),
        value: "unknown".into(),
        note: if p.note.is_empty() {
            note.to_owned()
        } else {
            format!("{note} ({})", p.note)
        },
    });
    checkpoint.into_iter().chain(resumed).chain(unobserved)
}

#[cfg(test)]
mod tests {
    use super::super::Progress;
    use super::*;

    #[test]
    fn an_attempts_evidence_is_what_was_observed() {
        let p = Progress {
            checkpoint: Some(30),
            listed: true,
            resumed_from: Some(30),
            note: String::new(),
        };
        let e: Vec<_> = attempt_evidence(2, &p, "no progress").collect();
        assert_eq!(e.len(), 2);
        assert_eq!(
            (
                e[0].subject.as_str(),
                e[0].signal.as_str(),
                e[0].value.as_str()
            ),
            ("attempt/2", "checkpoint.newest", "30")
        );
        assert_eq!(
            (e[1].signal.as_str(), e[1].value.as_str()),
            ("resumed_from", "30")
        );
        let none = Progress {
            note: "the agent did not answer".into(),
            ..Progress::default()
        };
        let e: Vec<_> = attempt_evidence(3, &none, "not judged").collect();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].value, "unknown");
        assert!(e[0].note.contains("did not answer"), "{:?}", e[0]);
    }

    #[test]
    fn the_log_keeps_the_newest() {
        let mut log = Vec::new();
        for i in 0..(MAX_EVIDENCE + 10) {
            keep_newest(
                &mut log,
                [StopEvidence {
                    subject: format!("attempt/{i}"),
                    signal: "resumed_from".into(),
                    value: "0".into(),
                    note: String::new(),
                }],
            );
        }
        assert_eq!(log.len(), MAX_EVIDENCE);
        assert_eq!(log[0].subject, "attempt/10");
    }
}
