//! The evidence rules: each reads one kind of trigger or one window of
//! observations and adds what it says to an incident's evidence. The
//! combiner ([`Engine::diagnose`]) runs them in order and weighs the
//! votes ([`super::conclude`]). One function per rule, so a new kind of
//! evidence is a new function and a line in the combiner.

use std::collections::BTreeSet;
use std::time::SystemTime;

use super::{
    DeviceMap, Engine, ExceptionSeen, Observation, Observed, Open, Trigger, clip, conclude,
    normalize, trigger_at, within,
};
use crate::attribute::FaultClass;
use crate::attribute::diagnosis::{Diagnosis, Evidence, IncidentRecord};
use crate::attribute::rules;
use crate::device::DeviceId;
use crate::health::{ReasonKind, Status};
use crate::rank::RankKey;

/// What the rules gather for one incident, for the combiner.
#[derive(Debug, Default)]
struct Gathered {
    /// The evidence so far, in the order found.
    ev: Vec<Evidence>,
    /// The failure's signature, for the same-failure-at-the-same-step rule.
    signature: String,
    /// The step it happened at, first known.
    step: Option<u64>,
    /// The failed rank's exit code, first known.
    exit_code: Option<i32>,
    /// The incident's processes (for host signals that name a pid).
    pids: Vec<u32>,
    /// What happened, for the diagnosis' summary.
    what: Vec<String>,
    /// The driver's own recovery verdict that points somewhere, the
    /// strongest (the last of equals) among the evidence: the combiner
    /// lets it win.
    verdict: Option<Evidence>,
}

impl Gathered {
    /// Adds a health reason's evidence, of kind `kind`, keeping the
    /// driver's verdict aside for the combiner.
    fn push_reason(&mut self, e: Evidence, kind: ReasonKind) {
        if kind == ReasonKind::DriverVerdict
            && e.points_to.is_some()
            && self.verdict.as_ref().is_none_or(|v| e.weight >= v.weight)
        {
            self.verdict = Some(e.clone());
        }
        self.ev.push(e);
    }
}

impl Engine {
    /// The diagnosis of open incident `i`, its signature, step and exit
    /// code: every rule over the incident's triggers, then the rules over
    /// the window around it, then the combiner.
    pub(super) fn diagnose(
        &self,
        i: usize,
        now: SystemTime,
        devices: &DeviceMap,
    ) -> (Diagnosis, String, Option<u64>, Option<i32>) {
        let open = &self.open[i];
        let rec = &open.record;
        let mut g = Gathered::default();
        let first_at = open
            .triggers
            .iter()
            .map(trigger_at)
            .min()
            .unwrap_or(rec.opened_at);
        for t in &open.triggers {
            match t {
                Trigger::Crash { .. } => self.crash(&mut g, t),
                Trigger::Hang { .. } => self.hang(&mut g, t),
                Trigger::Hardware { component, .. } => g.what.push(format!("{component} failed")),
                Trigger::Verdict { .. } => verdict(&mut g, t),
                Trigger::Straggler { .. } => straggler(&mut g, t),
                Trigger::Sdc { .. } => sdc(&mut g, t),
            }
        }
        // Hardware and host signals on the incident's devices (or naming
        // one of its processes) within the window before it.
        let from = first_at
            .checked_sub(self.cfg.hardware_window)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let to = now.max(first_at + self.cfg.settle);

        self.peer_exceptions(&mut g, open, from, to);
        let devs: BTreeSet<String> = rec.devices.iter().cloned().collect();
        let job_down = open.triggers.iter().any(|t| t.kind().job_down());
        self.device_observations(&mut g, devices, &devs, job_down, from, to);
        health_held(&mut g, devices, &devs);
        self.xid_repeat(&mut g, devices, &devs, rec, now);
        self.repeat_at_step(&mut g, rec, job_down, now);
        (
            conclude(g.ev, g.verdict, &g.what),
            g.signature,
            g.step,
            g.exit_code,
        )
    }

    /// A rank's exit: the exit rule, the rank's exception around it or the
    /// OOM killer's word on its pid, which then explains the exit.
    fn crash(&self, g: &mut Gathered, t: &Trigger) {
        let Trigger::Crash {
            key,
            at,
            event_id,
            code,
            signal,
            step: s,
            section,
            pid,
        } = t
        else {
            return;
        };
        let Gathered {
            ev,
            signature,
            step,
            exit_code,
            pids,
            what,
            ..
        } = g;
        *step = step.or(*s);
        *exit_code = exit_code.or(*code);
        if let Some(p) = pid.or_else(|| self.ranks.get(key).map(|m| m.pid)) {
            pids.push(p);
        }
        let (rule, class, weight, note) = rules::exit_rule(*code, *signal);
        let value = match (code, signal) {
            (_, Some(s)) => format!("signal {s}"),
            (Some(c), None) => format!("code {c}"),
            _ => "unknown".into(),
        };
        what.push(format!(
            "{key} {} at step {} in '{section}'",
            match (code, signal) {
                (_, Some(s)) => format!("was killed by signal {s}"),
                (Some(c), None) => format!("exited with code {c}"),
                _ => "exited".into(),
            },
            s.map_or("?".into(), |v| v.to_string())
        ));
        let exception = self
            .exceptions
            .get(key)
            .filter(|x| within(x.at, *at - self.cfg.hardware_window, *at + self.cfg.settle));
        // A SIGKILL right after the kernel's OOM killer named
        // this pid: the host ran out of memory.
        let oom = pid.and_then(|p| {
            self.observations.iter().find(|o| {
                o.kind == Observed::OomKill
                    && o.pid == Some(p)
                    && within(o.at, *at - self.cfg.hardware_window, *at + self.cfg.settle)
            })
        });
        match (exception, oom) {
            (_, Some(o)) => {
                *signature = format!("oom_kill:{}", o.value);
                ev.push(Evidence {
                                at: o.at,
                                source: o.source.clone(),
                                signal: o.signal.clone(),
                                subject: key.to_string(),
                                value: format!("pid {p}", p = o.pid.unwrap_or(0)),
                                points_to: Some(FaultClass::UserError),
                                weight: 0.6,
                                note: "the kernel's OOM killer killed this rank: host memory exhausted, most often by the job's own data loading".into(),
                                event_id: o.event_id,
                            });
            }
            (Some(x), None) => {
                *step = step.or(x.step);
                let first_line = x.message.lines().next().unwrap_or("");
                *signature = format!("exception:{}:{}", x.exception_type, normalize(first_line));
                let (class, weight, note, name) =
                    match rules::exception_rule(&x.exception_type, &x.message) {
                        Some(r) => (r.class, r.weight, r.note.to_owned(), r.name),
                        None => (
                            FaultClass::Unknown,
                            0.35,
                            "an exception no rule knows".to_owned(),
                            "exception.other",
                        ),
                    };
                ev.push(Evidence {
                    at: x.at,
                    source: "rank".into(),
                    signal: "exception".into(),
                    subject: key.to_string(),
                    value: format!("{}: {}", x.exception_type, clip(first_line, 200)),
                    points_to: Some(class),
                    weight,
                    note: format!("{note} [{name}]"),
                    event_id: x.event_id,
                });
            }
            (None, None) => {
                *signature = format!("exit:{value}");
            }
        }
        ev.push(Evidence {
            at: *at,
            source: "rank".into(),
            signal: if signal.is_some() {
                "exit.signal"
            } else {
                "exit.code"
            }
            .into(),
            subject: key.to_string(),
            value,
            // The exception, when there is one, explains the exit.
            points_to: (exception.is_none() && oom.is_none()).then_some(class),
            weight: if exception.is_none() && oom.is_none() {
                weight
            } else {
                0.0
            },
            note: format!("{note} [{rule}]"),
            event_id: *event_id,
        });
    }

    /// A rank's hang: its pattern across the local ranks and its process
    /// state.
    fn hang(&self, g: &mut Gathered, t: &Trigger) {
        let Trigger::Hang {
            key,
            at,
            event_id,
            step: s,
            section,
            pattern,
            process_state,
            wchan,
        } = t
        else {
            return;
        };
        let Gathered {
            ev,
            signature,
            step,
            pids,
            what,
            ..
        } = g;
        *step = step.or(*s);
        if let Some(m) = self.ranks.get(key) {
            pids.push(m.pid);
        }
        what.push(format!(
            "{key} hung at step {} in '{section}'",
            s.map_or("?".into(), |v| v.to_string())
        ));
        if signature.is_empty() {
            *signature = format!("hang:{section}");
        }
        let (class, weight, note) = if pattern.contains("collective") {
            (
                FaultClass::TransientSoftware,
                rules::COLLECTIVE_HANG_WEIGHT,
                "every local rank is stuck in the same place: a collective hang (a peer elsewhere, NCCL or the network); a restart usually clears it [hang.collective]",
            )
        } else if process_state.starts_with('D') {
            (
                FaultClass::Infrastructure,
                rules::KERNEL_BLOCKED_WEIGHT,
                "blocked in the kernel (uninterruptible sleep): storage, a file system or a driver [hang.kernel_blocked]",
            )
        } else if pattern.contains("stuck alone") {
            (
                FaultClass::TransientSoftware,
                rules::LONE_HANG_WEIGHT,
                "this rank is stuck alone while its peers progress: look at this rank and its device [hang.alone]",
            )
        } else {
            (
                FaultClass::TransientSoftware,
                rules::LONE_HANG_WEIGHT,
                "no progress past the threshold [hang.other]",
            )
        };
        ev.push(Evidence {
            at: *at,
            source: "hang".into(),
            signal: "hang.pattern".into(),
            subject: key.to_string(),
            value: if wchan.is_empty() || wchan == "-" {
                clip(pattern, 200)
            } else {
                format!("{} (wchan {wchan})", clip(pattern, 180))
            },
            points_to: Some(class),
            weight,
            note: note.into(),
            event_id: *event_id,
        });
    }

    /// The exceptions of the job's other ranks around a crash, as context.
    fn peer_exceptions(&self, g: &mut Gathered, open: &Open, from: SystemTime, to: SystemTime) {
        let rec = &open.record;
        let ev = &mut g.ev;
        // The exceptions of the job's other ranks around a crash (a peer
        // failing in a collective when a rank died: gloo's "Connection
        // closed by peer"), as context: a consequence of the failure or its
        // cause, never a vote (the rank that failed first is what the
        // incident is about).
        let crashed: Vec<&RankKey> = open
            .triggers
            .iter()
            .filter(|t| matches!(t, Trigger::Crash { .. }))
            .filter_map(Trigger::key)
            .collect();
        let mut peers: Vec<(&RankKey, &ExceptionSeen)> = self
            .exceptions
            .iter()
            .filter(|(k, x)| k.job == rec.job && !crashed.contains(k) && within(x.at, from, to))
            .collect();
        if crashed.is_empty() {
            peers.clear();
        }
        peers.sort_by_key(|(k, _)| k.rank);
        for (k, x) in peers {
            let first_line = x.message.lines().next().unwrap_or("");
            let name = rules::exception_rule(&x.exception_type, &x.message)
                .map_or("exception.other", |r| r.name);
            ev.push(Evidence {
                at: x.at,
                source: "rank".into(),
                signal: "exception.peer".into(),
                subject: k.to_string(),
                value: format!("{}: {}", x.exception_type, clip(first_line, 200)),
                points_to: None,
                weight: 0.0,
                note: format!(
                    "a peer's exception around the failure: its consequence (a collective that lost the failed rank) or its cause [{name}]"
                ),
                event_id: x.event_id,
            });
        }
    }

    /// Hardware and host signals on the incident's devices, naming one of
    /// its processes, or node-wide for a job that went down.
    fn device_observations(
        &self,
        g: &mut Gathered,
        devices: &DeviceMap,
        devs: &BTreeSet<String>,
        job_down: bool,
        from: SystemTime,
        to: SystemTime,
    ) {
        for o in self.observations.iter().filter(|o| within(o.at, from, to)) {
            let comp = devices.resolve(&o.component);
            let on_device = devs.contains(&comp);
            let by_pid = o.pid.is_some_and(|p| g.pids.contains(&p));
            // Node-wide troubles (a NIC, host memory, the checkpoint disk)
            // count for a job that went down on this node.
            let node_wide = job_down
                && !DeviceId::is_gpu(&comp)
                && o.kind != Observed::OomKill
                && o.class.is_some_and(|c| c == FaultClass::Infrastructure);
            if !(on_device || by_pid || node_wide) {
                continue;
            }
            let kind = match o.kind {
                Observed::Health(kind) => kind,
                Observed::OomKill | Observed::Xid(_) | Observed::Gate => ReasonKind::Judged,
            };
            g.push_reason(
                Evidence {
                    at: o.at,
                    source: o.source.clone(),
                    signal: o.signal.clone(),
                    subject: comp,
                    value: o.value.clone(),
                    points_to: o.class,
                    weight: o.weight,
                    note: o.note.clone(),
                    event_id: o.event_id,
                },
                kind,
            );
        }
    }

    /// An application XID that keeps coming back on one GPU alone, at
    /// different steps: the GPU's, not the code's.
    fn xid_repeat(
        &self,
        g: &mut Gathered,
        devices: &DeviceMap,
        devs: &BTreeSet<String>,
        rec: &IncidentRecord,
        now: SystemTime,
    ) {
        let (ev, step) = (&mut g.ev, g.step);
        // An application XID that keeps coming back on one GPU, while the
        // other GPUs see none, points at that GPU.
        for d in devs {
            let since = now
                .checked_sub(self.cfg.xid_repeat_window)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            let user_xid = |o: &&Observation| {
                o.xid().is_some() && o.class == Some(FaultClass::UserError) && o.at >= since
            };
            let here: Vec<&Observation> = self
                .observations
                .iter()
                .filter(user_xid)
                .filter(|o| devices.resolve(&o.component) == *d)
                .collect();
            let elsewhere = self
                .observations
                .iter()
                .filter(user_xid)
                .any(|o| devices.resolve(&o.component) != *d);
            if here.len() >= self.cfg.xid_repeat_count as usize && !elsewhere {
                let steps_differ = self.differs_across_history(&rec.job, step, &rec.id);
                if steps_differ {
                    // The application XIDs on this GPU are read again: not
                    // the code's, the GPU's.
                    let is_xid = |e: &Evidence| {
                        self.observations
                            .iter()
                            .any(|o| o.event_id == e.event_id && o.xid().is_some())
                    };
                    for e in ev.iter_mut().filter(|e| {
                        is_xid(e) && e.subject == *d && e.points_to == Some(FaultClass::UserError)
                    }) {
                        e.points_to = None;
                        e.weight = 0.0;
                        e.note = format!("{} (repeats on this GPU: see xid.repeat)", e.note);
                    }
                    ev.push(Evidence {
                        at: here.last().map_or(now, |o| o.at),
                        source: "history".into(),
                        signal: "xid.repeat".into(),
                        subject: d.clone(),
                        value: format!(
                            "{} application XIDs in {}",
                            here.len(),
                            humantime::format_duration(self.cfg.xid_repeat_window)
                        ),
                        points_to: Some(FaultClass::UncorrectableHardware),
                        weight: rules::XID_REPEAT_WEIGHT,
                        note: "application XIDs keep coming back on this GPU alone, at different steps: the GPU, not the code [xid.repeat_on_gpu]".into(),
                        event_id: 0,
                    });
                }
            }
        }
    }

    /// The same failure at the same step as an earlier incident of the job.
    fn repeat_at_step(
        &self,
        g: &mut Gathered,
        rec: &IncidentRecord,
        job_down: bool,
        now: SystemTime,
    ) {
        let (ev, signature, step) = (&mut g.ev, &g.signature, g.step);
        // The same failure at the same step after a restart is the code's;
        // except a kill from outside (SIGKILL, SIGTERM: an operator, the
        // scheduler, a chaos test; the OOM killer has its own signature),
        // which no code does to itself, so two at one step are chance.
        let external = matches!(signature.as_str(), "exit:signal 9" | "exit:signal 15");
        if job_down && !signature.is_empty() && !external && step.is_some() {
            let since = now
                .checked_sub(self.cfg.history_window)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            if let Some(prev) = self
                .closed
                .iter()
                .chain(self.open.iter().map(|o| &o.record))
                .filter(|r| r.id != rec.id && r.job == rec.job && r.opened_at >= since)
                .find(|r| r.signature == *signature && r.step == step)
            {
                ev.push(Evidence {
                    at: prev.opened_at,
                    source: "history".into(),
                    signal: "repeat_at_step".into(),
                    subject: format!("job/{}", rec.job),
                    value: format!("{} at step {}", prev.id, step.unwrap_or(0)),
                    points_to: Some(FaultClass::UserError),
                    weight: rules::REPEAT_AT_STEP_WEIGHT,
                    note: "the same failure at the same step before a restart: the code, not the machine [history.repeat_at_step]".into(),
                    event_id: 0,
                });
            }
        }
    }
}

/// The job-wide hang verdict joined to the incident: context, no vote.
fn verdict(g: &mut Gathered, t: &Trigger) {
    let Trigger::Verdict {
        job,
        at,
        event_id,
        summary,
        charged,
        waited_on,
        culprits,
    } = t
    else {
        return;
    };
    let Gathered { ev, what, .. } = g;
    let (value, note) = if *charged {
        (
                            clip(&culprits.join("; "), 400),
                            "job-wide, the agents' positions put the culprit on this host: it is charged with the hang [hang.job_wide]".to_owned(),
                        )
    } else if !waited_on.is_empty() {
        what.push(format!("waited on {}", waited_on.join(", ")));
        (
            clip(&culprits.join("; "), 400),
            format!(
                "job-wide, this host's ranks waited on {}: the culprit's host is charged, not this one [hang.job_wide]",
                waited_on.join(", ")
            ),
        )
    } else {
        (
            clip(summary, 400),
            "job-wide, the positions name no culprit [hang.job_wide]".to_owned(),
        )
    };
    ev.push(Evidence {
        at: *at,
        source: "peers".into(),
        signal: "hang.verdict".into(),
        subject: format!("job/{job}"),
        value,
        points_to: None,
        weight: 0.0,
        note,
        event_id: *event_id,
    });
}

/// A flagged straggler, with the cause its explanation found.
fn straggler(g: &mut Gathered, t: &Trigger) {
    let Trigger::Straggler {
        key,
        at,
        event_id,
        section,
        relative,
        explanation,
        cause,
    } = t
    else {
        return;
    };
    let Gathered { ev, what, .. } = g;
    what.push(format!(
        "{key} straggles in '{section}' ({relative}x its peers)"
    ));
    ev.push(Evidence {
        at: *at,
        source: "straggler".into(),
        signal: "straggler".into(),
        subject: key.to_string(),
        value: format!("{relative}x in {section}"),
        points_to: Some(*cause),
        weight: if *cause == FaultClass::Unknown {
            0.3
        } else {
            rules::STRAGGLER_WEIGHT
        },
        note: format!("{explanation} [straggler]"),
        event_id: *event_id,
    });
}

/// A rank's SDC suspect values against the job's.
fn sdc(g: &mut Gathered, t: &Trigger) {
    let Trigger::Sdc {
        key,
        at,
        event_id,
        step,
        metric,
        value,
        job_median,
        basis,
    } = t
    else {
        return;
    };
    let Gathered { ev, what, .. } = g;
    let rule = rules::sdc_rule(basis);
    let median = job_median.map_or_else(|| "none".to_owned(), |m| format!("{m:.6}"));
    what.push(format!(
        "{key} reported {metric} {value:.6} at step {step} (job median {median})"
    ));
    ev.push(Evidence {
        at: *at,
        source: "sdc".into(),
        signal: "sdc".into(),
        subject: key.to_string(),
        value: format!("{metric}={value:.6} at step {step}, job median {median}"),
        points_to: Some(rule.class),
        weight: rule.weight,
        note: format!("{} [{}]", rule.note, rule.name),
        event_id: *event_id,
    });
}

/// What the health model holds now about the incident's devices, where
/// no event already said it.
fn health_held(g: &mut Gathered, devices: &DeviceMap, devs: &BTreeSet<String>) {
    // What the health model holds now about the devices, where no event
    // already said it (a second reason of a component already FAILED
    // changes no status and publishes nothing).
    for d in devs {
        for r in devices.reasons.get(d).into_iter().flatten() {
            if matches!(r.kind, ReasonKind::Xid | ReasonKind::AboutXids)
                || g.ev.iter().any(|e| e.subject == *d && e.signal == r.signal)
            {
                continue;
            }
            let Some(rule) = rules::signal_rule(&r.signal) else {
                continue;
            };
            let (class, weight, note) = match r.status {
                Status::Failed => (
                    Some(rule.failed),
                    rule.weight,
                    format!("{} (FAILED, held now)", rule.note),
                ),
                Status::Degraded if rule.degraded.is_some() => (
                    rule.degraded,
                    rule.weight,
                    format!("{} (DEGRADED, held now)", rule.note),
                ),
                Status::Degraded => (
                    None,
                    0.0,
                    format!(
                        "{} (DEGRADED, held now): a warning about the next save, not a cause of this failure",
                        rule.note
                    ),
                ),
                // A finding the source judged harmless (under its
                // threshold): shown as weighed, pointing nowhere.
                _ => (
                    None,
                    0.0,
                    "under its threshold: not a fault on its own".to_owned(),
                ),
            };
            g.push_reason(
                Evidence {
                    at: r.since,
                    source: "health".into(),
                    signal: r.signal.clone(),
                    subject: d.clone(),
                    value: r.value.clone(),
                    points_to: class,
                    weight,
                    note,
                    event_id: 0,
                },
                r.kind,
            );
        }
    }
}
