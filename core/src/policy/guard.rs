//! Node-level rules over the incident history: the lemon rule, the cordon
//! circuit breaker and dry run.
//!
//! In: a decision the policy (or the hook) took, the incident it answers,
//! and this node's incident history (the journal, so the rules hold across
//! agent restarts). Out: the decision, changed where a rule applies, with
//! the rule's reason and the incidents it counted.
//! Never: I/O, a clock of its own (`now` is passed in), or a cordon the
//! breaker holds back.
//!
//! - The lemon rule ([`lemon`]): a node whose incidents of the configured
//!   classes repeat, across jobs, within a window is cordoned, whatever
//!   each incident's own decision was. Counting starts again after each
//!   lemon decision, so a node uncordoned after repair is not cordoned
//!   again by the incidents that condemned it.
//! - The circuit breaker ([`breaker`]): past `max_cordons` cordon decisions
//!   within its window on this node, a further cordon is not carried out
//!   (a fleet-wide false positive must not drain the fleet): the job is
//!   stopped for a person to look (or left running when it was not down).
//! - Dry run ([`dry_run`]): the decision is recorded as taken, marked so
//!   nothing acts on it.
//! - The rank's word ([`hold_rank_word`]): every rule here counts and
//!   takes only incidents whose diagnosis evidence the agent read itself
//!   supports ([`crate::attribute::Diagnosis::corroborated`]); a cordon of
//!   one that rests on a rank's word (its exception, exit, SDC values) is
//!   never carried out, whoever proposed it, the hook included.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::attribute::IncidentRecord;
use crate::config::ConfigError;
use crate::verdict::{Action, Decision, FaultClass, exit_code_for};

/// `decided_by` of a decision the lemon rule took (a later lemon count
/// starts after it).
pub const LEMON_DECIDED_BY: &str = "lemon rule";

/// The rule name a decision held back on a rank's word cites.
pub const RANK_WORD_RULE: &str = "policy.rank_word";

/// What a cordon becomes when only a rank's word supports it: a job that
/// is down restarts (while its class's budget allows, `restart_allowed`)
/// or stops; a running one goes on. Never anything beyond the rank's own
/// job.
pub fn instead_of_rank_word_cordon(job_down: bool, restart_allowed: bool) -> Action {
    match (job_down, restart_allowed) {
        (true, true) => Action::RestartInJob,
        (true, false) => Action::Stop,
        (false, _) => Action::Continue,
    }
}

/// Holds back a cordon of an incident whose diagnosis no evidence the
/// agent read supports (a hook's choice: the built-in policy already
/// never proposes one). Returns whether it held the decision.
pub fn hold_rank_word(decision: &mut Decision, record: &IncidentRecord) -> bool {
    if decision.action != Action::Cordon || record.diagnosis.corroborated() {
        return false;
    }
    let instead = instead_of_rank_word_cordon(record.kind.job_down(), false);
    decision.reason = format!(
        "{}: suspected on the rank's word only, no evidence the agent read itself: never cordoned ({RANK_WORD_RULE}); {instead} instead; {} proposed: {}",
        record.diagnosis.class, decision.decided_by, decision.reason
    );
    decision.decided_by = format!("{} ({RANK_WORD_RULE})", decision.decided_by);
    decision.action = instead;
    decision.backoff = Duration::ZERO;
    decision.exit_code = exit_code_for(instead, record.diagnosis.class, false, record.exit_code);
    true
}

/// `[policy.lemon]`: when repeated incidents make the node a lemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LemonConfig {
    /// Cordon a node whose incidents repeat; false: each incident is
    /// decided on its own.
    pub enabled: bool,
    /// This many incidents of `classes` within `window` (this one
    /// included), in any jobs, cordon the node.
    pub incidents: u32,
    /// How far back incidents count.
    #[serde(with = "crate::config::duration")]
    pub window: Duration,
    /// The fault classes that count. The default counts hardware only: an
    /// `unknown` crash is as often the code's as the node's; add "unknown"
    /// to count unexplained failures too. Whatever the class, only
    /// incidents the agent's own evidence supports count (never a rank's
    /// word: its exception, exit or reported values).
    pub classes: Vec<FaultClass>,
}

impl Default for LemonConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            incidents: 3,
            window: Duration::from_secs(24 * 60 * 60),
            classes: vec![
                FaultClass::CorrectableHardware,
                FaultClass::UncorrectableHardware,
            ],
        }
    }
}

/// `[policy.circuit_breaker]`: the cap on automatic cordons of this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// At most this many cordon decisions within `window`; a further one
    /// is reported and not carried out. 0: no cap.
    pub max_cordons: u32,
    /// The cap's window.
    #[serde(with = "crate::config::duration")]
    pub window: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            max_cordons: 3,
            window: Duration::from_secs(60 * 60),
        }
    }
}

impl LemonConfig {
    /// Refuses a rule that would cordon on every incident or never count.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        if self.incidents < 2 {
            return Err(invalid(
                "policy.lemon.incidents",
                self.incidents.to_string(),
                "must be at least 2 (one incident is not a repeat)",
            ));
        }
        if self.window.is_zero() {
            return Err(invalid(
                "policy.lemon.window",
                humantime::format_duration(self.window).to_string(),
                "must be longer than 0s",
            ));
        }
        if self.enabled && self.classes.is_empty() {
            return Err(invalid(
                "policy.lemon.classes",
                "[]".into(),
                "must name at least one class (or set policy.lemon.enabled = false)",
            ));
        }
        Ok(())
    }
}

impl BreakerConfig {
    /// Refuses a window the cap cannot count in.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        if self.max_cordons > 0 && self.window.is_zero() {
            return Err(ConfigError::invalid(
                origin,
                "policy.circuit_breaker.window",
                humantime::format_duration(self.window).to_string(),
                "must be longer than 0s",
            ));
        }
        Ok(())
    }
}

/// The lemon rule's finding.
#[derive(Debug, Clone, PartialEq)]
pub struct Lemon {
    /// The incidents counted, oldest first, the current one last.
    pub incidents: Vec<String>,
    /// Their jobs (an empty name: a device with no job on it).
    pub jobs: BTreeSet<String>,
}

/// Whether `current` makes this node a lemon, given the `history` (any
/// order; `current`'s own earlier versions are ignored).
pub fn lemon(
    cfg: &LemonConfig,
    history: &[IncidentRecord],
    current: &IncidentRecord,
    now: SystemTime,
) -> Option<Lemon> {
    // A launcher's own stop, or a hang whose culprit runs elsewhere, is
    // not this node's failure.
    // Nor is one only a rank's word supports: ranks cannot vote a node out.
    if !cfg.enabled
        || !current.kind.charges_node()
        || !current.waited_on.is_empty()
        || !cfg.classes.contains(&current.diagnosis.class)
        || !current.diagnosis.corroborated()
    {
        return None;
    }
    let others = || history.iter().filter(|r| r.id != current.id);
    let window_start = now
        .checked_sub(cfg.window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    // Counting starts again after the last lemon decision.
    let last_lemon = others()
        .flat_map(|r| r.decision.iter().chain(r.superseded.iter()))
        .filter(|d| d.decided_by.starts_with(LEMON_DECIDED_BY))
        .map(|d| d.decided_at)
        .max();
    let since = last_lemon.map_or(window_start, |l| l.max(window_start));
    let mut counted: Vec<&IncidentRecord> = others()
        .filter(|r| {
            r.decision.is_some()
                && r.kind.charges_node()
                && r.waited_on.is_empty()
                && cfg.classes.contains(&r.diagnosis.class)
                && r.diagnosis.corroborated()
                && r.opened_at >= since
                && last_lemon.is_none_or(|l| r.opened_at > l)
        })
        .collect();
    counted.sort_by_key(|r| r.opened_at);
    counted.push(current);
    if counted.len() < cfg.incidents as usize {
        return None;
    }
    Some(Lemon {
        incidents: counted.iter().map(|r| r.id.clone()).collect(),
        jobs: counted.iter().map(|r| r.job.clone()).collect(),
    })
}

/// Turns `decision` into the lemon rule's cordon (a decision that already
/// cordons only gains the rule's name, so counting starts again after it).
pub fn apply_lemon(cfg: &LemonConfig, decision: &mut Decision, class: FaultClass, found: &Lemon) {
    let jobs: Vec<&str> = found
        .jobs
        .iter()
        .map(|j| if j.is_empty() { "(no job)" } else { j.as_str() })
        .collect();
    decision.reason = format!(
        "lemon node: {} incidents of {} in {} on this node ({}; jobs: {}): policy.lemon; the policy alone said {}: {}",
        found.incidents.len(),
        cfg.classes
            .iter()
            .map(|c| c.as_str())
            .collect::<Vec<_>>()
            .join("/"),
        humantime::format_duration(cfg.window),
        found.incidents.join(", "),
        jobs.join(", "),
        decision.action,
        decision.reason
    );
    decision.action = Action::Cordon;
    decision.decided_by = LEMON_DECIDED_BY.into();
    decision.backoff = Duration::ZERO;
    decision.exit_code = exit_code_for(Action::Cordon, class, false, None);
}

/// The circuit breaker's state for a decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Breaker {
    /// Cordon decisions within the window before this one, oldest first.
    pub recent: Vec<String>,
    /// True when the cap is reached: a further cordon is held back.
    pub open: bool,
}

/// The cordon decisions in `history` within the breaker's window (the
/// incident `excluding` left out), and whether the cap is reached. A node
/// `cordoned_now` is never held back: a further cordon decision changes
/// nothing on it, and its launcher must still hear "node fault" (86).
pub fn breaker(
    cfg: &BreakerConfig,
    history: &[IncidentRecord],
    excluding: &str,
    cordoned_now: bool,
    now: SystemTime,
) -> Breaker {
    let since = now
        .checked_sub(cfg.window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    // Only cordons on the agent's own evidence count: a journal from before
    // the rule (when a rank's word could cordon) must not hold a real one.
    let mut recent: Vec<(SystemTime, String)> = history
        .iter()
        .filter(|r| r.id != excluding && r.diagnosis.corroborated())
        .filter_map(|r| {
            r.decision
                .iter()
                .chain(r.superseded.iter())
                .filter(|d| d.action == Action::Cordon && d.decided_at >= since)
                .map(|d| d.decided_at)
                .min()
                .map(|at| (at, r.id.clone()))
        })
        .collect();
    recent.sort();
    let open = !cordoned_now && cfg.max_cordons > 0 && recent.len() >= cfg.max_cordons as usize;
    Breaker {
        recent: recent.into_iter().map(|(_, id)| id).collect(),
        open,
    }
}

/// Holds back a cordon the open breaker forbids: a job that is down stops
/// (exit 87: a person should look), one still running goes on. Returns
/// whether it held the decision.
pub fn apply_breaker(
    cfg: &BreakerConfig,
    decision: &mut Decision,
    class: FaultClass,
    job_down: bool,
    state: &Breaker,
) -> bool {
    if decision.action != Action::Cordon || !state.open {
        return false;
    }
    let instead = if job_down {
        Action::Stop
    } else {
        Action::Continue
    };
    decision.reason = format!(
        "circuit breaker open: {} cordons in {} on this node already ({}), policy.circuit_breaker.max_cordons = {}; not cordoned, {instead} instead; it would have cordoned: {}",
        state.recent.len(),
        humantime::format_duration(cfg.window),
        state.recent.join(", "),
        cfg.max_cordons,
        decision.reason
    );
    decision.action = instead;
    decision.decided_by = format!("{} (circuit breaker)", decision.decided_by);
    decision.exit_code = exit_code_for(instead, class, true, None);
    true
}

/// Marks `decision` as not to be acted on: its reason says what would have
/// been done.
pub fn dry_run(decision: &mut Decision) {
    decision.dry_run = true;
    decision.reason = format!("dry run: would {}: {}", decision.action, decision.reason);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribute::{Diagnosis, Evidence, IncidentKind};

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    fn dec(action: Action, at: SystemTime, by: &str) -> Decision {
        Decision {
            action,
            reason: "policy said so".into(),
            decided_by: by.into(),
            attempt: 1,
            budget: 2,
            backoff: Duration::ZERO,
            exit_code: 0,
            decided_at: at,
            dry_run: false,
            replace: None,
        }
    }

    fn rec(
        id: &str,
        job: &str,
        class: FaultClass,
        at: SystemTime,
        action: Action,
    ) -> IncidentRecord {
        IncidentRecord {
            id: id.into(),
            opened_at: at,
            updated_at: at,
            kind: IncidentKind::Crash,
            host: "h".into(),
            job: job.into(),
            ranks: vec![0],
            devices: vec!["gpu0".into()],
            diagnosis: Diagnosis {
                class,
                confidence: 0.9,
                summary: String::new(),
                rule: String::new(),
                evidence: vec![said_by("kmsg", class, at)],
            },
            decision: Some(dec(action, at, "policy")),
            superseded: Vec::new(),
            signature: String::new(),
            step: None,
            exit_code: Some(1),
            waited_on: Vec::new(),
        }
    }

    /// An evidence item from `source` pointing at `class`.
    fn said_by(source: &str, class: FaultClass, at: SystemTime) -> Evidence {
        Evidence {
            at,
            source: source.into(),
            signal: "xid".into(),
            subject: "gpu0".into(),
            value: "79".into(),
            points_to: Some(class),
            weight: 0.9,
            note: String::new(),
            event_id: 1,
        }
    }

    /// [`rec`] whose only evidence is a rank's own exception.
    fn rank_word(
        id: &str,
        job: &str,
        class: FaultClass,
        at: SystemTime,
        action: Action,
    ) -> IncidentRecord {
        let mut r = rec(id, job, class, at, action);
        r.diagnosis.evidence = vec![said_by("rank", class, at), said_by("sdc", class, at)];
        r
    }

    #[test]
    fn a_ranks_word_never_counts_toward_the_lemon_rule_or_the_breaker() {
        let cfg = LemonConfig::default();
        let forged = vec![
            rank_word("inc-1", "a", Hw, t(0), RestartInJob),
            rank_word("inc-2", "b", Hw, t(600), Cordon),
        ];
        let cur = rank_word("inc-3", "c", Hw, t(1200), Continue);
        assert_eq!(lemon(&cfg, &forged, &cur, t(1200)), None, "forged only");
        let real = rec("inc-4", "d", Hw, t(1300), Continue);
        assert_eq!(
            lemon(&cfg, &forged, &real, t(1300)),
            None,
            "forged history does not make a real incident the third"
        );
        let b = BreakerConfig {
            max_cordons: 1,
            window: Duration::from_secs(3600),
        };
        let state = breaker(&b, &forged, "inc-9", false, t(1400));
        assert!(state.recent.is_empty() && !state.open, "{state:?}");
        // The agent's own evidence counts as before.
        let mut history = forged.clone();
        history.push(rec("inc-5", "e", Hw, t(1350), Cordon));
        let state = breaker(&b, &history, "inc-9", false, t(1400));
        assert_eq!(
            (state.recent.clone(), state.open),
            (vec!["inc-5".to_owned()], true)
        );
    }

    #[test]
    fn a_hooks_cordon_on_a_ranks_word_is_held() {
        let r = rank_word(
            "inc-1",
            "a",
            FaultClass::UncorrectableHardware,
            t(0),
            Cordon,
        );
        let mut d = dec(Cordon, t(0), "hook");
        assert!(hold_rank_word(&mut d, &r));
        assert_eq!(
            (d.action, d.decided_by.as_str()),
            (Stop, "hook (policy.rank_word)")
        );
        assert!(d.reason.contains("the rank's word only"), "{}", d.reason);
        let real = rec(
            "inc-2",
            "a",
            FaultClass::UncorrectableHardware,
            t(0),
            Cordon,
        );
        let mut d = dec(Cordon, t(0), "hook");
        assert!(!hold_rank_word(&mut d, &real));
        assert_eq!(d.action, Cordon);
    }

    use Action::{Continue, Cordon, RestartInJob, Stop};
    use FaultClass::{CorrectableHardware as Hw, Unknown, UserError};

    #[test]
    fn repeats_across_jobs_make_a_lemon() {
        let cfg = LemonConfig::default();
        let history = vec![
            rec("inc-1", "a", Hw, t(0), RestartInJob),
            rec("inc-2", "b", Hw, t(600), RestartInJob),
        ];
        let cur = rec("inc-3", "b", Hw, t(1200), RestartInJob);
        let found = lemon(&cfg, &history, &cur, t(1200)).expect("a lemon");
        assert_eq!(found.incidents, vec!["inc-1", "inc-2", "inc-3"]);
        assert_eq!(
            found.jobs.iter().cloned().collect::<Vec<_>>(),
            vec!["a", "b"]
        );
        let mut d = cur.decision.clone().unwrap();
        apply_lemon(&cfg, &mut d, Hw, &found);
        assert_eq!(d.action, Cordon);
        assert_eq!(d.exit_code, super::super::EXIT_NODE_FAULT);
        assert_eq!(d.decided_by, LEMON_DECIDED_BY);
        assert!(d.reason.contains("inc-1, inc-2, inc-3"), "{}", d.reason);
        assert!(d.reason.contains("jobs: a, b"), "{}", d.reason);
    }

    #[test]
    fn what_does_not_count() {
        let cfg = LemonConfig::default();
        let now = t(100_000);
        // Outside the window, another class, undecided, the current
        // incident's own earlier version.
        let mut undecided = rec("inc-3", "a", Hw, t(99_000), RestartInJob);
        undecided.decision = None;
        let history = vec![
            rec("inc-1", "a", Hw, t(0), RestartInJob),
            rec("inc-2", "a", UserError, t(99_000), Stop),
            undecided,
            rec("inc-4", "a", Unknown, t(99_500), RestartInJob),
            rec("inc-5", "a", Hw, t(99_600), RestartInJob),
            rec("inc-6", "a", Hw, t(99_900), RestartInJob),
        ];
        let cur = rec("inc-6", "a", Hw, t(99_900), RestartInJob);
        assert_eq!(lemon(&cfg, &history, &cur, now), None);
        // Unknown counts once configured.
        let with_unknown = LemonConfig {
            classes: vec![Hw, Unknown],
            ..cfg.clone()
        };
        let found = lemon(&with_unknown, &history, &cur, now).expect("a lemon");
        assert_eq!(found.incidents, vec!["inc-4", "inc-5", "inc-6"]);
        // Disabled, or a class the rule does not count.
        let off = LemonConfig {
            enabled: false,
            ..with_unknown
        };
        assert_eq!(lemon(&off, &history, &cur, now), None);
        let user = rec("inc-7", "a", UserError, now, Stop);
        assert_eq!(lemon(&cfg, &history, &user, now), None);
        // A hang another host's rank caused: neither counted nor counting.
        let mut waited = rec("inc-8", "a", Unknown, t(99_950), RestartInJob);
        waited.waited_on = vec!["rank 3 on host-b".into()];
        assert_eq!(lemon(&with_unknown_cfg(), &history, &waited, now), None);
        let mut history = history;
        history.retain(|r| r.id != "inc-4");
        history.push(waited);
        assert_eq!(
            lemon(&with_unknown_cfg(), &history, &cur, now),
            None,
            "the waited-on hang made a third count"
        );
        // A launcher's own stop (no progress, cordon share) is never
        // charged to the node, whatever its class.
        let mut stops = history.clone();
        for s in stops.iter_mut().filter(|r| r.diagnosis.class == Unknown) {
            s.kind = IncidentKind::NoProgress;
        }
        let mut stop = rec("inc-8", "a", Unknown, now, Stop);
        stop.kind = IncidentKind::CordonShare;
        assert_eq!(lemon(&with_unknown_cfg(), &stops, &stop, now), None);
        let cur = rec("inc-9", "a", Unknown, now, RestartInJob);
        let found = lemon(&with_unknown_cfg(), &stops, &cur, now).expect("a lemon");
        assert_eq!(
            found.incidents,
            vec!["inc-5", "inc-6", "inc-9"],
            "the stop inc-4 is not counted"
        );
    }

    fn with_unknown_cfg() -> LemonConfig {
        LemonConfig {
            classes: vec![Hw, Unknown],
            ..LemonConfig::default()
        }
    }

    #[test]
    fn counting_starts_again_after_a_lemon_cordon() {
        let cfg = LemonConfig::default();
        let mut lemon_rec = rec("inc-3", "a", Hw, t(20), Cordon);
        lemon_rec.decision.as_mut().unwrap().decided_by = LEMON_DECIDED_BY.into();
        let history = vec![
            rec("inc-1", "a", Hw, t(0), RestartInJob),
            rec("inc-2", "a", Hw, t(10), RestartInJob),
            lemon_rec,
            rec("inc-4", "b", Hw, t(30), RestartInJob),
        ];
        let cur = rec("inc-5", "b", Hw, t(40), RestartInJob);
        assert_eq!(lemon(&cfg, &history, &cur, t(40)), None);
        let mut more = history.clone();
        more.push(cur);
        let cur = rec("inc-6", "c", Hw, t(50), RestartInJob);
        let found = lemon(&cfg, &more, &cur, t(50)).expect("a lemon again");
        assert_eq!(found.incidents, vec!["inc-4", "inc-5", "inc-6"]);
    }

    #[test]
    fn the_breaker_holds_the_cordon_past_the_cap() {
        let cfg = BreakerConfig {
            max_cordons: 2,
            window: Duration::from_secs(3600),
        };
        let hw = FaultClass::UncorrectableHardware;
        let mut history = vec![
            // Outside the window: not counted.
            rec("inc-0", "", hw, t(0), Cordon),
            rec("inc-1", "", hw, t(5000), Cordon),
            rec("inc-2", "a", Hw, t(5100), RestartInJob),
        ];
        let state = breaker(&cfg, &history, "inc-3", false, t(6000));
        assert_eq!(state.recent, vec!["inc-1"]);
        assert!(!state.open);
        let mut d = dec(Cordon, t(6000), "policy");
        assert!(!apply_breaker(&cfg, &mut d, hw, true, &state));
        assert_eq!(d.action, Cordon);
        history.push(rec("inc-3", "", hw, t(6000), Cordon));

        let state = breaker(&cfg, &history, "inc-4", false, t(6100));
        assert_eq!(state.recent, vec!["inc-1", "inc-3"]);
        assert!(state.open);
        // A node cordoned now stays so: nothing to hold back.
        assert!(!breaker(&cfg, &history, "inc-4", true, t(6100)).open);
        // A job that is down stops for a person; a running one goes on.
        let mut down = dec(Cordon, t(6100), "policy");
        assert!(apply_breaker(&cfg, &mut down, hw, true, &state));
        assert_eq!(down.action, Stop);
        assert_eq!(down.exit_code, super::super::EXIT_BUDGET_SPENT);
        assert_eq!(down.decided_by, "policy (circuit breaker)");
        assert!(
            down.reason.contains("circuit breaker open: 2 cordons"),
            "{}",
            down.reason
        );
        assert!(down.reason.contains("inc-1, inc-3"), "{}", down.reason);
        let mut running = dec(Cordon, t(6100), "hook");
        assert!(apply_breaker(&cfg, &mut running, hw, false, &state));
        assert_eq!(running.action, Continue);
        // Anything but a cordon passes.
        let mut restart = dec(RestartInJob, t(6100), "policy");
        assert!(!apply_breaker(&cfg, &mut restart, Hw, true, &state));
        // No cap.
        let off = BreakerConfig {
            max_cordons: 0,
            ..cfg
        };
        assert!(!breaker(&off, &history, "inc-4", false, t(6100)).open);
    }

    #[test]
    fn dry_run_says_what_it_would_do() {
        let mut d = dec(Cordon, t(0), "policy");
        dry_run(&mut d);
        assert!(d.dry_run);
        assert_eq!(
            d.action, Cordon,
            "the decision itself is kept, for the budgets"
        );
        assert_eq!(d.reason, "dry run: would cordon: policy said so");
    }

    #[test]
    fn validation_names_the_key() {
        let bad = LemonConfig {
            incidents: 1,
            ..LemonConfig::default()
        };
        let e = bad.validate("x").unwrap_err().to_string();
        assert!(e.contains("policy.lemon.incidents"), "{e}");
        let bad = LemonConfig {
            classes: Vec::new(),
            ..LemonConfig::default()
        };
        let e = bad.validate("x").unwrap_err().to_string();
        assert!(e.contains("policy.lemon.classes"), "{e}");
        let bad = BreakerConfig {
            max_cordons: 1,
            window: Duration::ZERO,
        };
        let e = bad.validate("x").unwrap_err().to_string();
        assert!(e.contains("policy.circuit_breaker.window"), "{e}");
    }
}
