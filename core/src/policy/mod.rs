//! Policy: from a diagnosis and its context to a remediation decision.
//!
//! In: a [`Diagnosis`], whether the job is down (a crash or hang) or still
//! running (a hardware event, a straggler), and the remediations already
//! spent in the budget window. Out: a [`Decision`]: the action, why, the
//! attempt against the budget, the backoff, and the exit status a launcher
//! stopping on it returns. The user's hook ([`hook`]) may then override it.
//! Pure: no I/O here (the hook runs in the attribution task).

pub mod guard;
pub mod hook;

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

pub use crate::verdict::{
    Action, Decision, EXIT_BUDGET_SPENT, EXIT_NODE_FAULT, PastDecision, Replacement, exit_code_for,
};

use crate::attribute::{Diagnosis, IncidentRecord};
use crate::config::ConfigError;
use crate::verdict::FaultClass;

/// What to do for one fault class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassPolicy {
    /// When the job is down (a rank crashed or hung): the n-th incident of
    /// this class in the window takes the n-th action (the last repeats).
    pub on_failure: Vec<Action>,
    /// When the job still runs (a hardware event, a straggler).
    pub on_running: Action,
    /// Restarts of this class allowed within `window`.
    pub budget: u32,
    /// The budget's window.
    #[serde(with = "crate::config::duration")]
    pub window: Duration,
    /// What happens once the budget is spent.
    pub exhausted: Action,
}

impl ClassPolicy {
    fn new(on_failure: &[Action], on_running: Action, budget: u32, exhausted: Action) -> Self {
        Self {
            on_failure: on_failure.to_vec(),
            on_running,
            budget,
            window: Duration::from_secs(60 * 60),
            exhausted,
        }
    }
}

/// `[policy]`: remediation per fault class, backoff, the node condition
/// file and the user's hook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Wait before the second restart of a class in its window; doubles
    /// with each further one. The first restart is immediate: waiting
    /// before it only loses goodput.
    #[serde(with = "crate::config::duration")]
    pub backoff_initial: Duration,
    /// The backoff's ceiling.
    #[serde(with = "crate::config::duration")]
    pub backoff_max: Duration,
    /// Where the node condition (cordoned or not) is written for cluster
    /// tools, as a Kubernetes NodeCondition in JSON. Empty: the state
    /// directory's node-condition.json.
    pub condition_file: String,
    /// Report every action instead of taking it: decisions are taken,
    /// recorded and published as usual (their reason says "dry run: would
    /// ..."), but nothing acts on them: no cordon, no Slurm drain, no
    /// in-process restart, and launchers are told to continue.
    pub dry_run: bool,
    /// The user's executable that may override each decision.
    pub hook: hook::HookConfig,
    /// Cordon a node whose hardware incidents repeat across jobs.
    pub lemon: guard::LemonConfig,
    /// The cap on automatic cordons of this node.
    pub circuit_breaker: guard::BreakerConfig,
    /// A bug in the training code: restarting fails the same way.
    pub user_error: ClassPolicy,
    /// A collective timeout, a driver hiccup: restarting usually helps.
    pub transient_software: ClassPolicy,
    /// Hardware that handled its error (XID 94, corrected ECC bursts).
    pub correctable_hardware: ClassPolicy,
    /// Hardware that needs a reset or repair (XID 48/79, GPU lost).
    pub uncorrectable_hardware: ClassPolicy,
    /// The network, fabric or host around the job.
    pub infrastructure: ClassPolicy,
    /// Not enough evidence: restart a little, then stop and tell a person.
    pub unknown: ClassPolicy,
    /// What a silent-data-corruption suspect (an incident of kind `sdc`,
    /// the job still running) gets, whatever its class: report it, or
    /// restart the job from its last checkpoint (`restart_in_job`, counted
    /// against the class's budget). Default report: a suspicion should not
    /// cost a job its progress until an operator trusts the detector.
    pub sdc: SdcAction,
}

/// `policy.sdc`: the answer to an SDC suspect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SdcAction {
    /// Record and publish the incident; the job goes on (`continue`).
    #[default]
    Report,
    /// Restart the job in place from its last checkpoint (`restart_in_job`).
    Restart,
}

impl SdcAction {
    /// The action it stands for.
    pub fn action(self) -> Action {
        match self {
            SdcAction::Report => Action::Continue,
            SdcAction::Restart => Action::RestartInJob,
        }
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        use Action::{Continue, Cordon, RestartInJob, RestartInProcess, ScaleDown, Stop};
        Self {
            backoff_initial: Duration::from_secs(5),
            backoff_max: Duration::from_secs(5 * 60),
            condition_file: String::new(),
            dry_run: false,
            hook: hook::HookConfig::default(),
            lemon: guard::LemonConfig::default(),
            circuit_breaker: guard::BreakerConfig::default(),
            user_error: ClassPolicy::new(&[Stop], Continue, 0, Stop),
            transient_software: ClassPolicy::new(
                &[RestartInProcess, RestartInJob],
                Continue,
                3,
                Cordon,
            ),
            correctable_hardware: ClassPolicy::new(&[RestartInJob], Continue, 2, Cordon),
            uncorrectable_hardware: ClassPolicy::new(&[Cordon], Cordon, 3, Stop),
            infrastructure: ClassPolicy::new(&[RestartInJob], Continue, 3, ScaleDown),
            unknown: ClassPolicy::new(&[RestartInJob], Continue, 2, Stop),
            sdc: SdcAction::Report,
        }
    }
}

impl PolicyConfig {
    /// The policy for `class`.
    pub fn for_class(&self, class: FaultClass) -> &ClassPolicy {
        match class {
            FaultClass::UserError => &self.user_error,
            FaultClass::TransientSoftware => &self.transient_software,
            FaultClass::CorrectableHardware => &self.correctable_hardware,
            FaultClass::UncorrectableHardware => &self.uncorrectable_hardware,
            FaultClass::Infrastructure => &self.infrastructure,
            FaultClass::Unknown => &self.unknown,
        }
    }

    /// Refuses a policy that cannot be followed.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if self.backoff_initial > self.backoff_max {
            return Err(invalid(
                "policy.backoff_initial",
                show(self.backoff_initial),
                "must not exceed policy.backoff_max",
            ));
        }
        if !self.condition_file.is_empty()
            && !std::path::Path::new(&self.condition_file).is_absolute()
        {
            return Err(invalid(
                "policy.condition_file",
                self.condition_file.clone(),
                "must be an absolute path (or empty for the state directory's node-condition.json)",
            ));
        }
        if let Err(why) = self.hook.validate() {
            return Err(invalid(
                "policy.hook",
                format!("{:?}", self.hook.command),
                &why,
            ));
        }
        self.lemon.validate(origin)?;
        self.circuit_breaker.validate(origin)?;
        let classes: [(&'static str, &'static str, &ClassPolicy); 6] = [
            (
                "policy.user_error.on_failure",
                "policy.user_error.window",
                &self.user_error,
            ),
            (
                "policy.transient_software.on_failure",
                "policy.transient_software.window",
                &self.transient_software,
            ),
            (
                "policy.correctable_hardware.on_failure",
                "policy.correctable_hardware.window",
                &self.correctable_hardware,
            ),
            (
                "policy.uncorrectable_hardware.on_failure",
                "policy.uncorrectable_hardware.window",
                &self.uncorrectable_hardware,
            ),
            (
                "policy.infrastructure.on_failure",
                "policy.infrastructure.window",
                &self.infrastructure,
            ),
            (
                "policy.unknown.on_failure",
                "policy.unknown.window",
                &self.unknown,
            ),
        ];
        for (ladder_key, window_key, p) in classes {
            if p.on_failure.is_empty() {
                return Err(invalid(
                    ladder_key,
                    "[]".into(),
                    "must name at least one action (\"stop\" to never restart)",
                ));
            }
            if p.on_failure.contains(&Action::Continue) {
                return Err(invalid(
                    ladder_key,
                    format!(
                        "{:?}",
                        p.on_failure.iter().map(|a| a.as_str()).collect::<Vec<_>>()
                    ),
                    "\"continue\" cannot answer a crash or hang: the job is already down",
                ));
            }
            if p.window.is_zero() {
                return Err(invalid(
                    window_key,
                    show(p.window),
                    "must be longer than 0s",
                ));
            }
        }
        Ok(())
    }
}

/// What the policy is told besides the diagnosis.
#[derive(Debug, Clone)]
pub struct Context<'a> {
    /// True when a rank crashed or hung: the job cannot go on as it is.
    pub job_down: bool,
    /// The failed rank's own exit status, when it exited with one.
    pub exit_code: Option<i32>,
    /// Earlier decisions for the same job (or the node, without a job).
    pub history: &'a [PastDecision],
    /// Now.
    pub now: SystemTime,
    /// The incident is an SDC suspect (kind `sdc`): `policy.sdc` answers it
    /// while the job runs.
    pub sdc: bool,
}

/// The built-in decision for `diag` in `ctx`.
pub fn decide(cfg: &PolicyConfig, diag: &Diagnosis, ctx: &Context<'_>) -> Decision {
    let p = cfg.for_class(diag.class);
    let since = ctx
        .now
        .checked_sub(p.window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let spent = ctx
        .history
        .iter()
        .filter(|d| d.class == diag.class && d.at >= since && d.action.is_restart())
        .count();
    let spent = u32::try_from(spent).unwrap_or(u32::MAX);
    let window = humantime::format_duration(p.window);
    let (step, key) = if ctx.job_down {
        let n = (spent as usize).min(p.on_failure.len() - 1);
        (p.on_failure[n], format!("policy.{}.on_failure", diag.class))
    } else if ctx.sdc {
        (cfg.sdc.action(), "policy.sdc".to_owned())
    } else {
        (p.on_running, format!("policy.{}.on_running", diag.class))
    };
    let (action, reason, attempt) = if step.is_restart() {
        let attempt = spent + 1;
        if attempt > p.budget {
            (
                p.exhausted,
                format!(
                    "{}: the budget of {} in {window} is spent ({spent} already): policy.{}.exhausted",
                    diag.class, p.budget, diag.class
                ),
                attempt,
            )
        } else {
            (
                step,
                format!(
                    "{}: {step}, {attempt} of {} in {window}: {key}",
                    diag.class, p.budget
                ),
                attempt,
            )
        }
    } else {
        (step, format!("{}: {key} says {step}", diag.class), spent)
    };
    // A cordon takes the node from every job: it needs evidence the agent
    // read itself. On a rank's word only (its exception, exit, SDC values)
    // the rank's own job is restarted within the class's budget, then
    // stopped; a running job goes on (docs/security.md, "What the agent
    // believes from a rank").
    let (action, reason) = if action == Action::Cordon && !diag.corroborated() {
        let instead = guard::instead_of_rank_word_cordon(ctx.job_down, attempt <= p.budget);
        (
            instead,
            format!(
                "{}: suspected on the rank's word only, no evidence the agent read itself: never cordoned ({}); {instead} instead; it would have cordoned: {reason}",
                diag.class,
                guard::RANK_WORD_RULE
            ),
        )
    } else {
        (action, reason)
    };
    let backoff = if action.is_restart() && attempt >= 2 {
        let factor = 2u32.saturating_pow(attempt - 2);
        cfg.backoff_initial
            .saturating_mul(factor)
            .min(cfg.backoff_max)
    } else {
        Duration::ZERO
    };
    Decision {
        action,
        reason,
        decided_by: "policy".into(),
        attempt,
        budget: p.budget,
        backoff,
        exit_code: exit_code_for(action, diag.class, attempt > p.budget, ctx.exit_code),
        decided_at: ctx.now,
        dry_run: false,
        replace: None,
    }
}

/// The rules that come before the user's hook, in the order the agent runs
/// them: the lemon rule turns `decision` into a cordon when `record` makes
/// the node a lemon (the hook may still overrule it). Returns the finding.
/// Shared by the agent and the scenario replay, so a recorded scenario
/// checks the agent's own sequence.
pub fn before_hook(
    policy: &PolicyConfig,
    journal: &[IncidentRecord],
    record: &IncidentRecord,
    decision: &mut Decision,
    now: SystemTime,
) -> Option<guard::Lemon> {
    let found = guard::lemon(&policy.lemon, journal, record, now)?;
    guard::apply_lemon(&policy.lemon, decision, record.diagnosis.class, &found);
    Some(found)
}

/// The rules that come after the user's hook, so no hook gets past them:
/// the circuit breaker (the node is `cordoned` now or not), then dry run.
/// Returns the breaker's state when it held a cordon back.
pub fn after_hook(
    policy: &PolicyConfig,
    journal: &[IncidentRecord],
    record: &IncidentRecord,
    decision: &mut Decision,
    cordoned: bool,
    now: SystemTime,
) -> Option<guard::Breaker> {
    guard::hold_rank_word(decision, record);
    let cfg = &policy.circuit_breaker;
    let state = guard::breaker(cfg, journal, &record.id, cordoned, now);
    let held = guard::apply_breaker(
        cfg,
        decision,
        record.diagnosis.class,
        record.kind.job_down(),
        &state,
    );
    if policy.dry_run {
        guard::dry_run(decision);
    }
    held.then_some(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A diagnosis of `class` on evidence the agent read (the kernel log).
    fn diag(class: FaultClass) -> Diagnosis {
        said_by("kmsg", class)
    }

    /// A diagnosis of `class` whose evidence came from `source`.
    fn said_by(source: &str, class: FaultClass) -> Diagnosis {
        Diagnosis {
            class,
            confidence: 0.8,
            summary: String::new(),
            rule: String::new(),
            evidence: vec![crate::attribute::Evidence {
                at: SystemTime::UNIX_EPOCH,
                source: source.into(),
                signal: "xid".into(),
                subject: "gpu0".into(),
                value: String::new(),
                points_to: Some(class),
                weight: 0.8,
                note: String::new(),
                event_id: 0,
            }],
        }
    }

    #[test]
    fn a_ranks_word_restarts_its_job_and_never_cordons() {
        let cfg = PolicyConfig::default();
        let now = SystemTime::now();
        let ecc = said_by("rank", FaultClass::UncorrectableHardware);
        let mut history = Vec::new();
        let mut got = Vec::new();
        for _ in 0..4 {
            let dec = decide(&cfg, &ecc, &ctx(&history, now));
            assert!(
                dec.action == Action::Stop || dec.reason.contains("policy.rank_word"),
                "{}",
                dec.reason
            );
            got.push((dec.action, dec.exit_code));
            history.push(PastDecision {
                at: now,
                class: ecc.class,
                action: dec.action,
            });
        }
        use Action::*;
        assert_eq!(
            got,
            vec![
                (RestartInJob, 0),
                (RestartInJob, 0),
                (RestartInJob, 0),
                (Stop, EXIT_BUDGET_SPENT)
            ]
        );
        // A hang or timeout past its budget: stopped, not cordoned.
        let hang = said_by("hang", FaultClass::TransientSoftware);
        let spent: Vec<PastDecision> = (0..3)
            .map(|_| PastDecision {
                at: now,
                class: hang.class,
                action: RestartInJob,
            })
            .collect();
        assert_eq!(decide(&cfg, &hang, &ctx(&spent, now)).action, Stop);
        // Running: goes on.
        let running = Context {
            job_down: false,
            exit_code: None,
            history: &[],
            now,
            sdc: false,
        };
        assert_eq!(decide(&cfg, &ecc, &running).action, Continue);
    }

    fn ctx(history: &[PastDecision], now: SystemTime) -> Context<'_> {
        Context {
            job_down: true,
            exit_code: Some(3),
            history,
            now,
            sdc: false,
        }
    }

    #[test]
    fn an_sdc_suspect_is_reported_or_restarted_as_policy_sdc_says() {
        let now = SystemTime::now();
        let running = Context {
            job_down: false,
            exit_code: None,
            history: &[],
            now,
            sdc: true,
        };
        let mut cfg = PolicyConfig::default();
        let d = diag(FaultClass::UncorrectableHardware);
        let dec = decide(&cfg, &d, &running);
        assert_eq!(dec.action, Action::Continue, "default: report, not cordon");
        assert!(
            dec.reason.contains("policy.sdc says continue"),
            "{}",
            dec.reason
        );
        cfg.sdc = SdcAction::Restart;
        let dec = decide(&cfg, &d, &running);
        assert_eq!((dec.action, dec.attempt), (Action::RestartInJob, 1));
        assert!(dec.reason.contains("policy.sdc"), "{}", dec.reason);
        let parsed: PolicyConfig = toml::from_str("sdc = \"restart\"").unwrap();
        assert_eq!(parsed.sdc, SdcAction::Restart);
    }

    #[test]
    fn transient_ladder_backoff_and_budget() {
        let cfg = PolicyConfig::default();
        let now = SystemTime::now();
        let d = diag(FaultClass::TransientSoftware);
        let mut history = Vec::new();
        let mut got = Vec::new();
        for _ in 0..4 {
            let dec = decide(&cfg, &d, &ctx(&history, now));
            got.push((dec.action, dec.attempt, dec.backoff, dec.exit_code));
            history.push(PastDecision {
                at: now,
                class: d.class,
                action: dec.action,
            });
        }
        use Action::*;
        assert_eq!(
            got,
            vec![
                (RestartInProcess, 1, Duration::ZERO, 0),
                (RestartInJob, 2, Duration::from_secs(5), 0),
                (RestartInJob, 3, Duration::from_secs(10), 0),
                (Cordon, 4, Duration::from_secs(20), EXIT_NODE_FAULT),
            ]
        );
    }

    #[test]
    fn old_restarts_fall_out_of_the_window() {
        let cfg = PolicyConfig::default();
        let now = SystemTime::now();
        let long_ago = now - Duration::from_secs(2 * 3600);
        let history: Vec<PastDecision> = (0..5)
            .map(|_| PastDecision {
                at: long_ago,
                class: FaultClass::Unknown,
                action: Action::RestartInJob,
            })
            .collect();
        let dec = decide(&cfg, &diag(FaultClass::Unknown), &ctx(&history, now));
        assert_eq!((dec.action, dec.attempt), (Action::RestartInJob, 1));
    }

    #[test]
    fn user_error_stops_with_the_ranks_code_and_spent_budget_with_87() {
        let cfg = PolicyConfig::default();
        let now = SystemTime::now();
        let dec = decide(&cfg, &diag(FaultClass::UserError), &ctx(&[], now));
        assert_eq!((dec.action, dec.exit_code), (Action::Stop, 3));
        let history: Vec<PastDecision> = (0..2)
            .map(|_| PastDecision {
                at: now,
                class: FaultClass::Unknown,
                action: Action::RestartInJob,
            })
            .collect();
        let dec = decide(&cfg, &diag(FaultClass::Unknown), &ctx(&history, now));
        assert_eq!(
            (dec.action, dec.exit_code),
            (Action::Stop, EXIT_BUDGET_SPENT)
        );
        assert!(dec.reason.contains("budget"), "{}", dec.reason);
    }

    #[test]
    fn a_running_job_gets_on_running() {
        let cfg = PolicyConfig::default();
        let now = SystemTime::now();
        let c = Context {
            job_down: false,
            exit_code: None,
            history: &[],
            now,
            sdc: false,
        };
        let dec = decide(&cfg, &diag(FaultClass::CorrectableHardware), &c);
        assert_eq!((dec.action, dec.attempt), (Action::Continue, 0));
        let dec = decide(&cfg, &diag(FaultClass::UncorrectableHardware), &c);
        assert_eq!((dec.action, dec.attempt), (Action::Cordon, 1));
    }

    #[test]
    fn validation_names_the_key() {
        let mut cfg = PolicyConfig::default();
        cfg.transient_software.on_failure.clear();
        let e = cfg.validate("t.toml").unwrap_err().to_string();
        assert!(e.contains("policy.transient_software.on_failure"), "{e}");
        let mut cfg = PolicyConfig::default();
        cfg.unknown.on_failure = vec![Action::Continue];
        let e = cfg.validate("t.toml").unwrap_err().to_string();
        assert!(
            e.contains("policy.unknown.on_failure") && e.contains("continue"),
            "{e}"
        );
        let cfg = PolicyConfig {
            backoff_initial: Duration::from_secs(600),
            ..PolicyConfig::default()
        };
        assert!(
            cfg.validate("t.toml")
                .unwrap_err()
                .to_string()
                .contains("policy.backoff_initial")
        );
        #[derive(Debug, serde::Deserialize)]
        struct File {
            #[allow(dead_code)]
            policy: PolicyConfig,
        }
        let bad: Result<PolicyConfig, _> = crate::config::parse_toml::<File>(
            "[policy.user_error]\non_failure = [\"reboot\"]\non_running = \"continue\"\nbudget = 0\nwindow = \"1h\"\nexhausted = \"stop\"\n",
        )
        .map(|c| c.policy);
        let (key, msg) = bad.unwrap_err();
        assert!(key.contains("policy.user_error.on_failure"), "{key}: {msg}");
        assert!(msg.contains("reboot"), "{msg}");
    }
}
