//! The one place a [`Signal`] becomes the wire and log event: its kind,
//! severity, subject, message and ordered evidence.
//!
//! In: a signal. Out: the [`NewEvent`] the bus stamps with an id and a time.
//! Never: a second rendering elsewhere (docs/api.md lists these kinds and
//! fields; the table test in tests.rs pins each one).

use super::{
    CkptRestored, CkptSaved, GateFailed, GpuProcesses, HangVerdict, HealthChanged, OomKill,
    RankException, RankExited, RankHang, RankRegistered, Report, RestartRequested, SdcSuspect,
    Signal, Straggler, Xid, XidSource,
};
use super::{NewEvent, Severity};
use crate::device::DeviceId;
use crate::health::{ReasonKind, Status};
use crate::rank::RankState;
use crate::verdict::Action;
use crate::verdict::{FaultClass, IncidentRecord};

impl Signal {
    /// The dotted kind the signal renders as.
    pub fn kind(&self) -> &'static str {
        match self {
            Signal::RankRegistered(_) => "rank.registered",
            Signal::RankException(_) => "rank.exception",
            Signal::RankExited(_) => "rank.exited",
            Signal::RankDeregistered { .. } => "rank.deregistered",
            Signal::RankHang(_) => "rank.hang",
            Signal::RankRecovered { .. } => "rank.recovered",
            Signal::RankStraggler(_) => "rank.straggler",
            Signal::RankStragglerCleared { .. } => "rank.straggler_cleared",
            Signal::RankSdcSuspect(_) => "rank.sdc_suspect",
            Signal::HangVerdict(_) => "job.hang_verdict",
            Signal::RestartRequested(_) => "restart.requested",
            Signal::CkptSaved(_) => "ckpt.saved",
            Signal::CkptRestored(_) => "ckpt.restored",
            Signal::Xid(x) => match x.source {
                XidSource::Nvml => "gpu.xid",
                XidSource::Kmsg => "kmsg.xid",
            },
            Signal::OomKill(_) => "kmsg.oom_kill",
            Signal::GpuProcesses(_) => "gpu.processes",
            Signal::GateFailed(_) => "gate.failed",
            Signal::HealthChanged(_) => "health.changed",
            Signal::IncidentDiagnosed(_) => "incident.diagnosed",
            Signal::IncidentDecided(_) => "incident.decided",
            Signal::Notice(e) => e.kind,
        }
    }

    /// The event as watchers, logs and metrics see it.
    pub fn render(&self) -> NewEvent {
        let kind = self.kind();
        match self {
            Signal::RankRegistered(r) => registered(r),
            Signal::RankException(r) => exception(r),
            Signal::RankExited(r) => exited(r),
            Signal::RankDeregistered { key } => NewEvent::new(
                Severity::Info,
                kind,
                key.to_string(),
                format!("{key} left cleanly"),
            ),
            Signal::RankHang(h) => hang(h),
            Signal::RankRecovered { key, step, pid } => NewEvent::new(
                Severity::Info,
                kind,
                key.to_string(),
                format!("{key} makes progress again (step {step})"),
            )
            .with("step", step)
            .with("pid", pid),
            Signal::RankStraggler(s) => straggler(s),
            Signal::RankStragglerCleared { key, report } => {
                reported(Severity::Info, kind, key.to_string(), report)
            }
            Signal::RankSdcSuspect(s) => sdc_suspect(s),
            Signal::HangVerdict(v) => hang_verdict(v),
            Signal::RestartRequested(r) => restart_requested(r),
            Signal::CkptSaved(c) => ckpt_saved(c),
            Signal::CkptRestored(c) => ckpt_restored(c),
            Signal::Xid(x) => xid(kind, x),
            Signal::OomKill(o) => oom_kill(o),
            Signal::GpuProcesses(g) => gpu_processes(g),
            Signal::GateFailed(g) => gate_failed(g),
            Signal::HealthChanged(h) => health_changed(h),
            Signal::IncidentDiagnosed(r) => incident_diagnosed(r),
            Signal::IncidentDecided(r) => incident_decided(r),
            Signal::Notice(e) => e.clone(),
        }
    }
}

fn reported(severity: Severity, kind: &'static str, subject: String, r: &Report) -> NewEvent {
    let mut ev = NewEvent::new(severity, kind, subject, r.message.clone());
    ev.evidence.clone_from(&r.evidence);
    ev
}

fn registered(r: &RankRegistered) -> NewEvent {
    let key = &r.key;
    let who = if r.pid == 0 {
        format!(
            "pid {} in a PID namespace the agent cannot see: its exit and process state are not watched",
            r.declared_pid
        )
    } else {
        format!("pid {}", r.pid)
    };
    let mut ev = NewEvent::new(
        Severity::Info,
        "rank.registered",
        key.to_string(),
        format!("{key} registered ({who}, slot {})", r.slot),
    )
    .with("pid", r.pid)
    .with("declared_pid", r.declared_pid)
    .with("local_rank", r.local_rank)
    .with("world_size", r.world_size)
    .with("host", &r.host)
    .with("slot", r.slot)
    .with("registered_by", if r.by_self { "self" } else { "launcher" });
    if r.declared_devices.is_empty() {
        ev = ev
            .with("devices", DeviceId::Gpu(r.local_rank).to_string())
            .with("devices_from", "local_rank (the client named none)");
    } else {
        ev = ev
            .with("devices", r.declared_devices.join(","))
            .with("devices_from", "client");
    }
    if let Some(old) = r.replaced_pid {
        ev = ev.with("replaced_pid", old);
    }
    ev
}

fn exception(r: &RankException) -> NewEvent {
    let key = &r.key;
    NewEvent::new(
        if r.uncaught {
            Severity::Error
        } else {
            Severity::Warning
        },
        "rank.exception",
        key.to_string(),
        format!(
            "{key} {} {}: {}",
            if r.uncaught { "dies of" } else { "reports" },
            r.exception_type,
            r.message.lines().next().unwrap_or("")
        ),
    )
    .with("exception_type", &r.exception_type)
    .with("message", &r.message)
    .with("step", step_or_unknown(r.step))
    .with("pid", r.pid)
    .with("generation", r.generation)
    .with("uncaught", r.uncaught)
    .with("traceback", &r.traceback)
    .with("awaits_decision", r.awaits_decision)
}

/// A step as events show it: `unknown` when no client reported one.
fn step_or_unknown(step: Option<u64>) -> String {
    step.map_or_else(|| "unknown".to_owned(), |s| s.to_string())
}

fn exited(r: &RankExited) -> NewEvent {
    let (key, exit, was) = (&r.key, &r.exit, r.state_before);
    let how = match (exit.code, exit.signal) {
        (code, signal) if was == RankState::Stopping => match (code, signal) {
            (Some(c), _) => format!("was stopped by its launcher (exit code {c})"),
            (None, Some(sig)) => format!("was stopped by its launcher (signal {sig})"),
            (None, None) => "was stopped by its launcher".to_owned(),
        },
        (Some(0), _) => "exited with code 0".to_owned(),
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(sig)) => format!(
            "was killed by signal {sig} ({})",
            nix::sys::signal::Signal::try_from(sig).map_or("unknown", |s| s.as_str())
        ),
        (None, None) => "exited (status unknown)".to_owned(),
    };
    let mut ev = NewEvent::new(
        r.severity(),
        "rank.exited",
        key.to_string(),
        match r.step {
            Some(step) => format!(
                "{key} (pid {}) {how} at step {step} in '{}' without deregistering",
                r.pid, r.section
            ),
            None => format!(
                "{key} (pid {}) {how} without deregistering; no step reported (no client)",
                r.pid
            ),
        },
    )
    .with("pid", r.pid)
    .with("declared_pid", r.declared_pid)
    .with("step", step_or_unknown(r.step))
    .with("section", &r.section)
    .with("state_before", was.as_str())
    .with("status_source", &exit.source);
    if let Some(c) = exit.code {
        ev = ev.with("exit_code", c);
    }
    if let Some(s) = exit.signal {
        ev = ev.with("signal", s);
    }
    if let Some(stop) = r.stopped_by.as_ref().filter(|_| was == RankState::Stopping) {
        let by = if stop.kind == crate::signal::StopKind::Preempted {
            "notice"
        } else {
            "launcher"
        };
        ev = ev.with("stopped_by", format!("{by}: {}", stop.why));
    }
    ev
}

fn hang(h: &RankHang) -> NewEvent {
    let mut ev = reported(Severity::Error, "rank.hang", h.key.to_string(), &h.report);
    if h.stack_requested {
        ev = ev.with("stack", "requested: follows as a rank.stack event");
    }
    ev
}

fn straggler(s: &Straggler) -> NewEvent {
    reported(
        Severity::Warning,
        "rank.straggler",
        s.key.to_string(),
        &s.report,
    )
}

fn sdc_suspect(s: &SdcSuspect) -> NewEvent {
    reported(
        Severity::Warning,
        "rank.sdc_suspect",
        s.key.to_string(),
        &s.report,
    )
}

fn hang_verdict(v: &HangVerdict) -> NewEvent {
    let culprits: Vec<String> = v
        .culprits
        .iter()
        .map(|b| format!("{}@{}", b.rank, b.host))
        .collect();
    let charged = if v.culprits.is_empty() {
        "no culprit named".to_owned()
    } else if v.charges_this_host() {
        "this host".to_owned()
    } else {
        format!("waited on {}", v.waited_on().join(", "))
    };
    let mut ev = NewEvent::new(
        Severity::Warning,
        "job.hang_verdict",
        format!("job/{}", v.job),
        format!("job {}: {}", v.job, v.summary),
    )
    .with("host", &v.host)
    .with("culprits", culprits.join(","))
    .with("charged", charged)
    .with("waiting", join(&v.waiting))
    .with("hosts", v.hosts.join(","))
    .with("hang_event", v.hang_event);
    if !v.missing.is_empty() {
        ev = ev.with("missing", join(&v.missing));
    }
    for b in &v.culprits {
        ev = ev.with(format!("why.{}", b.rank), &b.why);
    }
    ev
}

/// Rank numbers as `0,1,2` (the form every event's `ranks` field takes).
pub fn join(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn restart_requested(r: &RestartRequested) -> NewEvent {
    NewEvent::new(
        Severity::Warning,
        "restart.requested",
        format!("job/{}", r.job),
        format!(
            "job {}: ranks {} asked to restart in process (restart {}, seq {}): {}",
            r.job,
            join(&r.ranks),
            r.restart_count,
            r.seq,
            r.reason
        ),
    )
    .with("seq", r.seq)
    .with("restart_count", r.restart_count)
    .with("ranks", join(&r.ranks))
    .with("incident", &r.incident)
    .with("reason", &r.reason)
    .with("timeout", humantime::format_duration(r.timeout))
}

fn ckpt_saved(c: &CkptSaved) -> NewEvent {
    NewEvent::new(
        Severity::Info,
        "ckpt.saved",
        c.subject.clone(),
        format!(
            "{} saved ({} bytes, {:.2} ms of the step)",
            c.shard, c.bytes, c.stall_ms
        ),
    )
    .with("job_id", &c.job)
    .with("rank", c.rank)
    .with("step", c.step)
    .with("stall_ms", format!("{:.3}", c.stall_ms))
    .with("bytes", c.bytes)
    .with("xxh3", &c.xxh3)
}

fn ckpt_restored(c: &CkptRestored) -> NewEvent {
    NewEvent::new(
        Severity::Info,
        "ckpt.restored",
        c.subject.clone(),
        format!(
            "{} restored from the {} tier ({}) in {:.1} ms",
            c.shard, c.tier, c.source, c.duration_ms
        ),
    )
    .with("job_id", &c.job)
    .with("rank", c.rank)
    .with("step", c.step)
    .with("duration_ms", format!("{:.3}", c.duration_ms))
    .with("tier", &c.tier)
    .with("source", &c.source)
    .with("bytes", c.bytes)
}

fn xid(kind: &'static str, x: &Xid) -> NewEvent {
    reported(x.severity, kind, x.component.clone(), &x.report)
}

fn oom_kill(o: &OomKill) -> NewEvent {
    NewEvent::new(
        Severity::Error,
        "kmsg.oom_kill",
        o.component.clone(),
        format!(
            "the kernel's OOM killer killed process {} ({})",
            o.pid, o.process
        ),
    )
    .with("pid", o.pid)
    .with("process", &o.process)
    .with("line", &o.line)
}

fn gpu_processes(g: &GpuProcesses) -> NewEvent {
    let pids: Vec<String> = g.pids.iter().map(u32::to_string).collect();
    NewEvent::new(
        Severity::Info,
        "gpu.processes",
        g.component.clone(),
        if pids.is_empty() {
            format!("no process holds a compute context on {}", g.component)
        } else {
            format!(
                "processes {} hold a compute context on {} (NVML)",
                pids.join(", "),
                g.component
            )
        },
    )
    .with("pids", pids.join(","))
}

fn gate_failed(g: &GateFailed) -> NewEvent {
    let first = g.failures.first();
    let mut ev = NewEvent::new(
        Severity::Critical,
        "gate.failed",
        first.map_or("node", |f| f.entity.as_str()),
        format!(
            "health gate failed ({}): {}",
            g.ran,
            g.failures
                .iter()
                .map(|f| format!("{} on {}: {}", f.test, f.entity, f.message))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    )
    .with("ran", &g.ran)
    .with("duration", &g.duration)
    .with("job", &g.job)
    .with("note", &g.note);
    if let Some(f) = first {
        ev = ev
            .with("test", &f.test)
            .with("entity", &f.entity)
            .with("message", &f.message)
            .with("severity", &f.severity);
    }
    ev
}

fn health_changed(h: &HealthChanged) -> NewEvent {
    let severity = match h.to {
        Status::Absent | Status::Ok | Status::Unknown => Severity::Info,
        Status::Degraded => Severity::Warning,
        Status::Failed => Severity::Error,
    };
    let from = h.from.map_or("NEW", |s| s.as_str());
    let mut event = NewEvent::new(
        severity,
        "health.changed",
        h.component.clone(),
        match &h.reason {
            Some(r) => format!("{} {from} -> {}: {}", h.component, h.to, r.message),
            None => format!("{} {from} -> {}", h.component, h.to),
        },
    )
    .with("from", from)
    .with("to", h.to);
    if let Some(r) = &h.reason {
        event = event
            .with("signal", &r.signal)
            .with("value", &r.value)
            .with("threshold", &r.threshold);
        // What the finding is to attribution, as its source set it (a
        // judged one says nothing: the field's absence).
        if r.kind != ReasonKind::Judged {
            event = event.with("reason_kind", r.kind.as_str());
        }
        if !r.window.is_empty() {
            event = event.with("window", &r.window);
        }
    }
    event
}

/// How loud a decided incident is: a node taken out of service or a job
/// stopped is critical, so is uncorrectable hardware; going on regardless
/// is a warning.
fn incident_severity(r: &IncidentRecord) -> Severity {
    match (r.diagnosis.class, r.decision.as_ref().map(|d| d.action)) {
        (_, Some(Action::Cordon | Action::Stop | Action::ScaleDown)) => Severity::Critical,
        (FaultClass::UncorrectableHardware, _) => Severity::Critical,
        (_, Some(Action::Continue)) => Severity::Warning,
        _ => Severity::Error,
    }
}

fn incident_diagnosed(r: &IncidentRecord) -> NewEvent {
    let diag = &r.diagnosis;
    let mut ev = NewEvent::new(
        incident_severity(r),
        "incident.diagnosed",
        r.id.clone(),
        format!(
            "{}: {} ({:.0}%): {}",
            r.id,
            diag.class,
            diag.confidence * 100.0,
            diag.summary
        ),
    )
    .with("kind", r.kind.as_str())
    .with("class", diag.class)
    .with("confidence", format!("{:.2}", diag.confidence))
    .with("rule", &diag.rule)
    .with("job", &r.job)
    .with("ranks", join(&r.ranks))
    .with("devices", r.devices.join(","))
    .with("revision", r.superseded.len() + 1);
    for (i, e) in diag.evidence.iter().enumerate().take(12) {
        ev = ev.with(
            format!("evidence.{}", i + 1),
            format!(
                "{} {} {}={} -> {} ({})",
                e.source,
                e.subject,
                e.signal,
                e.value,
                e.points_to.map_or("context", FaultClass::as_str),
                e.note
            ),
        );
    }
    ev
}

fn incident_decided(r: &IncidentRecord) -> NewEvent {
    let Some(dec) = &r.decision else {
        return NewEvent::new(
            incident_severity(r),
            "incident.decided",
            r.id.clone(),
            format!("{}: no decision", r.id),
        )
        .with("class", r.diagnosis.class)
        .with("job", &r.job);
    };
    let ev = NewEvent::new(
        incident_severity(r),
        "incident.decided",
        r.id.clone(),
        format!("{}: {} ({})", r.id, dec.action, dec.reason),
    )
    .with("action", dec.action)
    .with("reason", &dec.reason)
    .with("decided_by", &dec.decided_by)
    .with("attempt", dec.attempt)
    .with("budget", dec.budget)
    .with("backoff", humantime::format_duration(dec.backoff))
    .with("exit_code", dec.exit_code)
    .with("class", r.diagnosis.class)
    .with("job", &r.job);
    match &dec.replace {
        // A frozen rank its launcher replaces while the others restart in
        // process.
        Some(rep) => ev
            .with("replace_ranks", join(&rep.ranks))
            .with("replace_restart_count", rep.restart_count),
        None => ev,
    }
}
