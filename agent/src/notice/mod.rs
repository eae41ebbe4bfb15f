//! Notices of a coming stop: a preemption, a host maintenance, a node
//! taint, or the scheduler's SIGTERM to `warden run --term-grace`.
//!
//! In: the host's sources ([`gce`], [`aws`], [`kubernetes`], each an async
//! task, off unless enabled or detected on its cloud: [`detect`]), and a
//! launcher's StopRanks with kind PREEMPTED (its own SIGTERM: one job).
//! Out: on every tick ([`NoticeBoard::apply`]) the notice word in each affected
//! rank's slot (the client reads it at its step boundary, saves and leaves
//! with status 85), the ranks marked as stopping on a notice (their exits
//! are planned stops in the goodput ledger, never incidents), the
//! `notice` component of the health model, `notice.raised` /
//! `notice.cleared` events and the `warden_notice_*` metrics.
//! Never: stop a process itself (the ranks leave, their launcher ends the
//! job), block a tick (sources hand their findings over a lock held for a
//! few assignments), or let a job's notice reach another job.

pub mod aws;
pub mod config;
pub mod detect;
pub mod gce;
pub mod kubernetes;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warden_core::events::health_reporter::Reporter;
use warden_core::events::{NewEvent, Severity};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};
use warden_core::rank::RankState;
use warden_core::signal::{StopKind, StopReason};
use warden_slot::NoticeWord;

use crate::ranks::registry::Registry;

/// The health component notices show on.
pub const COMPONENT: &str = "notice";

/// Where a notice came from (its index is the slot word's `source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum NoticeSource {
    /// The launcher's SIGTERM (`--term-grace`), for its job alone.
    Launcher = 0,
    /// The GCE metadata server.
    Gce = 1,
    /// EC2's instance metadata service.
    Aws = 2,
    /// A Kubernetes node taint.
    Kubernetes = 3,
}

impl NoticeSource {
    /// The name in events, metrics and the client (`warden.notice().source`).
    pub fn name(self) -> &'static str {
        match self {
            NoticeSource::Launcher => "launcher",
            NoticeSource::Gce => "gce",
            NoticeSource::Aws => "aws",
            NoticeSource::Kubernetes => "kubernetes",
        }
    }
}

/// One notice: who, what, and when the stop comes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// Who gave it.
    pub source: NoticeSource,
    /// What it said, for people (`instance/preempted = TRUE`).
    pub what: String,
    /// When the stop comes, as far as the source says.
    pub deadline: Option<SystemTime>,
    /// When the agent learned of it.
    pub raised: SystemTime,
}

impl Notice {
    /// The word set in the slots.
    pub fn word(&self) -> u64 {
        let deadline_unix_s = self
            .deadline
            .and_then(|d| d.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX));
        NoticeWord {
            source: self.source as u8,
            deadline_unix_s,
        }
        .encode()
    }

    fn deadline_text(&self) -> String {
        self.deadline.map_or("not said".to_owned(), |d| {
            humantime::format_rfc3339_seconds(d).to_string()
        })
    }
}

/// What the sources found and what the ticks did about it.
#[derive(Debug, Default)]
struct Inner {
    /// Host notices, by what raised them (`gce/instance/preempted`):
    /// every job of the host.
    host: BTreeMap<String, Notice>,
    /// Job notices (a launcher's SIGTERM), by job id.
    jobs: BTreeMap<String, Notice>,
    /// The step at whose boundary every rank of the job saves: named at
    /// the first telling, or by the launcher's StopRanks (across hosts, the
    /// step the job's hosts agreed on), which replaces it.
    told: BTreeMap<String, u64>,
    /// Jobs whose `notice.raised` was published (once each).
    announced: BTreeSet<String>,
    /// Per-source trouble (unreachable, refused file), for the health reason.
    trouble: BTreeMap<NoticeSource, String>,
    /// The sources running, for the component's label.
    running: BTreeSet<NoticeSource>,
    /// The health component needs a new report.
    dirty: bool,
}

/// The notices standing on this host: written by the sources and StopRanks,
/// read by the work loop's tick.
#[derive(Debug, Clone, Default)]
pub struct NoticeBoard {
    inner: Arc<Mutex<Inner>>,
}

/// Longest `what` kept from a source (a server's value is untrusted).
const MAX_WHAT: usize = 200;

fn clip(s: &str) -> String {
    warden_core::text::clip_line(s, MAX_WHAT)
}

impl NoticeBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A source started.
    pub fn running(&self, source: NoticeSource) {
        let mut g = self.lock();
        g.running.insert(source);
        g.dirty = true;
    }

    /// A host source raises (or renews) its notice; the next tick tells
    /// every rank of the host.
    /// `id` names what raised it (`gce/instance/preempted`), so one key
    /// clearing leaves another's notice standing.
    pub fn raise_host(&self, id: &str, n: Notice) {
        let mut g = self.lock();
        let n = Notice {
            what: clip(&n.what),
            ..n
        };
        let same = g.host.get(id).is_some_and(|o| o.what == n.what);
        if !same {
            metrics::counter!("warden_notices_total", "source" => n.source.name()).increment(1);
            g.host.insert(id.to_owned(), n);
            g.dirty = true;
        }
    }

    /// A host source's notice no longer stands (a maintenance cancelled).
    /// Ranks already told keep their word until their job stops: a rank
    /// that saved and left is not called back.
    pub fn clear_host(&self, id: &str) {
        let mut g = self.lock();
        if g.host.remove(id).is_some() {
            g.dirty = true;
        }
    }

    /// A source cannot be read (`None`: it answers again).
    pub fn trouble(&self, source: NoticeSource, why: Option<String>) {
        let mut g = self.lock();
        let changed = match why {
            Some(w) => g.trouble.insert(source, clip(&w)).as_deref() != Some(&clip(&w)),
            None => g.trouble.remove(&source).is_some(),
        };
        g.dirty |= changed;
    }

    /// A launcher's notice for its job (StopRanks, kind PREEMPTED).
    pub fn raise_job(&self, job: &str, n: Notice) {
        let mut g = self.lock();
        if !g.jobs.contains_key(job) {
            metrics::counter!("warden_notices_total", "source" => n.source.name()).increment(1);
        }
        g.jobs.insert(job.to_owned(), n);
        g.dirty = true;
    }

    /// Names the step at whose boundary `job`'s ranks save, for the
    /// launcher's StopRanks (kind PREEMPTED), and returns it. `fixed`: the
    /// step the job's hosts agreed on (it replaces any named before; the
    /// next tick writes it into every slot). Else the step named before,
    /// or one at least `lead` ahead of the furthest rank at the job's
    /// recent step time ([`save_step`]). None: no rank of the job holds a
    /// slot here to name it from, or no lead was asked for (one host: the
    /// next tick names it as it writes it into the slots).
    pub fn name_step(
        &self,
        job: &str,
        reg: &Registry,
        fixed: Option<u64>,
        lead: Duration,
    ) -> Option<u64> {
        let ranks: Vec<&crate::ranks::registry::RankEntry> = reg
            .ranks
            .values()
            .filter(|e| e.key.job == job && e.holds_slot && e.state != RankState::Exited)
            .collect();
        let steps: Vec<u64> = ranks
            .iter()
            .filter_map(|e| reg.slots().current_step(e.slot).ok())
            .collect();
        let mut g = self.lock();
        if let Some(step) = fixed {
            if let Some(past) = steps.iter().copied().filter(|s| *s > step).max() {
                // Told too late: those ranks save their next boundary's step
                // instead (save_on_notice saves at any step from the one named).
                tracing::warn!(
                    job,
                    step,
                    furthest = past,
                    "a rank of the job is past the step its hosts named for the notice"
                );
            }
            g.told.insert(job.to_owned(), step);
            g.dirty = true;
            return Some(step);
        }
        if let Some(step) = g.told.get(job) {
            return Some(*step);
        }
        if lead.is_zero() {
            // No lead (one host): the tick names it as it writes the
            // slots, so no rank passes the step between the two.
            return None;
        }
        let furthest = steps.iter().copied().max()?;
        let step = save_step(furthest, step_time_ns(ranks.iter().copied()), lead);
        g.told.insert(job.to_owned(), step);
        Some(step)
    }

    /// The host notice with the earliest deadline.
    pub fn host_notice(&self) -> Option<Notice> {
        first(self.lock().host.values())
    }

    /// Tells the ranks, on every tick: with a host notice, every live rank
    /// of the host is marked as stopping on it; each rank so marked (by a
    /// host notice, or by its launcher's StopRanks) gets the notice word in
    /// its slot again (a rank whose slot was rebuilt sees it within a
    /// tick). Returns one `notice.raised` event per newly told job, for the
    /// caller to publish once the registry's lock is released.
    pub fn tell(&self, reg: &mut Registry) -> Vec<NewEvent> {
        let (host, jobs) = {
            let g = self.lock();
            (first(g.host.values()), g.jobs.clone())
        };
        if host.is_none() && jobs.is_empty() {
            return Vec::new();
        }
        if let Some(n) = &host {
            let stop = StopReason {
                kind: StopKind::Preempted,
                why: format!("notice from {}: {}", n.source.name(), n.what),
            };
            // Only ranks not already stopping for another reason (a
            // restart's StopRanks): theirs stands.
            let mut fresh: BTreeMap<String, Vec<u32>> = BTreeMap::new();
            for e in reg.ranks.values() {
                if matches!(e.state, RankState::Running | RankState::Hung) {
                    fresh.entry(e.key.job.clone()).or_default().push(e.key.rank);
                }
            }
            for (job, ranks) in fresh {
                reg.mark_stopping(&job, &ranks, &stop);
            }
        }
        let mut by_job: BTreeMap<String, Vec<(u32, u32)>> = BTreeMap::new();
        for (job, rank, slot) in reg
            .ranks
            .values()
            .filter(|e| {
                e.holds_slot
                    && e.state == RankState::Stopping
                    && e.stop_reason
                        .as_ref()
                        .is_some_and(|s| s.kind == StopKind::Preempted)
            })
            .map(|e| (e.key.job.clone(), e.key.rank, e.slot))
            .collect::<Vec<_>>()
        {
            by_job.entry(job).or_default().push((rank, slot));
        }
        let mut out = Vec::new();
        for (job, ranks) in by_job {
            // The earlier stop of the host's notice and the job's, the
            // host's on a tie: a launcher that passes its host's notice on
            // (StopRanks with the same deadline) does not change what the
            // ranks read (`warden.notice().source` stays `gce`).
            let Some(n) = first(host.iter().chain(jobs.get(&job))) else {
                continue;
            };
            let n = &n;
            // The save step: the one after the furthest rank's, read from
            // the slots now (a scan's reading may be a tick old, and a rank
            // already past the step named would save another one). Fixed
            // at the first telling, so every rank gets the same.
            // A host notice on one host of a job that spans hosts leads by
            // the steps [`ACROSS_HOSTS_LEAD`] takes, as a launcher's SIGTERM
            // does: the launcher, told by the `notice.raised` event below,
            // publishes the step for the other hosts, whose ranks (in
            // lockstep with these) must not have passed it by then.
            let known = self.lock().told.get(&job).copied();
            let step = known.unwrap_or_else(|| {
                let furthest = ranks
                    .iter()
                    .filter_map(|&(_, slot)| reg.slots().current_step(slot).ok())
                    .max()
                    .unwrap_or(0);
                let lead = if jobs.contains_key(&job) || !spans_hosts(reg, &job) {
                    Duration::ZERO
                } else {
                    across_hosts_lead(n.deadline, SystemTime::now())
                };
                let of_job = reg.ranks.values().filter(|e| e.key.job == job);
                save_step(furthest, step_time_ns(of_job), lead)
            });
            for &(rank, slot) in &ranks {
                if let Err(e) = reg.slots().set_notice(slot, n.word(), step) {
                    tracing::warn!(job, rank, error = %e, "cannot set the notice in the slot");
                }
            }
            {
                let mut g = self.lock();
                g.told.insert(job.clone(), step);
                if !g.announced.insert(job.clone()) {
                    continue;
                }
            }
            let mut ranks: Vec<u32> = ranks.iter().map(|r| r.0).collect();
            ranks.sort_unstable();
            let left = n
                .deadline
                .and_then(|d| d.duration_since(SystemTime::now()).ok())
                .map_or("-".to_owned(), |d| format!("{}s", d.as_secs()));
            out.push(
                NewEvent::new(
                    Severity::Warning,
                    "notice.raised",
                    format!("job/{job}"),
                    format!(
                        "notice from {}: {}; job {job}'s ranks save at the boundary of step {step} and leave (deadline {})",
                        n.source.name(),
                        n.what,
                        n.deadline_text()
                    ),
                )
                .with("job", &job)
                .with("source", n.source.name())
                .with("what", &n.what)
                .with("deadline", n.deadline_text())
                .with("deadline_unix_ms", deadline_unix_ms(n.deadline))
                .with("time_left", left)
                .with("save_at_step", step)
                .with(
                    "ranks",
                    ranks.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
                ),
            );
        }
        out
    }

    /// Forgets a job's notice once none of its ranks is left (its next
    /// run is a new start).
    pub fn forget_ended(&self, reg: &Registry) {
        let mut g = self.lock();
        let live: BTreeSet<&str> = reg
            .ranks
            .values()
            .filter(|e| e.state != RankState::Exited)
            .map(|e| e.key.job.as_str())
            .collect();
        let before = g.jobs.len() + g.told.len();
        g.jobs.retain(|j, _| live.contains(j.as_str()));
        g.told.retain(|j, _| live.contains(j.as_str()));
        g.announced.retain(|j| live.contains(j.as_str()));
        if g.jobs.len() + g.told.len() != before {
            g.dirty = true;
        }
    }

    /// Shows the `notice` component (when it moved): DEGRADED while a host notice stands (the
    /// host is going away), OK otherwise, with the job notices and any
    /// source's trouble as reasons.
    pub fn report(&self, health: &Reporter) {
        let (report, gauges) = {
            let mut g = self.lock();
            if !g.dirty {
                return;
            }
            g.dirty = false;
            let now = SystemTime::now();
            let mut reasons = Vec::new();
            for n in g.host.values() {
                reasons.push(Reason {
                    status: Status::Degraded,
                    kind: ReasonKind::Judged,
                    signal: format!("notice.{}", n.source.name()),
                    value: n.what.clone(),
                    threshold: String::new(),
                    window: String::new(),
                    since: n.raised,
                    message: format!(
                        "notice from {}: {} (stop by {}); every job on this host saves and leaves",
                        n.source.name(),
                        n.what,
                        n.deadline_text()
                    ),
                });
            }
            for (job, n) in &g.jobs {
                reasons.push(Reason {
                    status: Status::Ok,
                    kind: ReasonKind::Judged,
                    signal: format!("notice.{}", n.source.name()),
                    value: job.clone(),
                    threshold: String::new(),
                    window: String::new(),
                    since: n.raised,
                    message: format!(
                        "job {job}: notice from {}: {} (stop by {})",
                        n.source.name(),
                        n.what,
                        n.deadline_text()
                    ),
                });
            }
            for (s, why) in &g.trouble {
                reasons.push(Reason {
                    status: Status::Ok,
                    kind: ReasonKind::Judged,
                    signal: format!("notice.{}.unreadable", s.name()),
                    value: why.clone(),
                    threshold: String::new(),
                    window: String::new(),
                    since: now,
                    message: format!("notice source {} cannot be read: {why}", s.name()),
                });
            }
            let mut labels = BTreeMap::new();
            labels.insert(
                "sources".to_owned(),
                if g.running.is_empty() {
                    "launcher only".to_owned()
                } else {
                    g.running
                        .iter()
                        .map(|s| s.name())
                        .collect::<Vec<_>>()
                        .join(",")
                },
            );
            labels.insert("jobs_noticed".to_owned(), g.jobs.len().to_string());
            let status = if g.host.is_empty() {
                Status::Ok
            } else {
                Status::Degraded
            };
            let gauges: Vec<(NoticeSource, f64)> = [
                NoticeSource::Launcher,
                NoticeSource::Gce,
                NoticeSource::Aws,
                NoticeSource::Kubernetes,
            ]
            .into_iter()
            .map(|s| {
                let on = g
                    .host
                    .values()
                    .chain(g.jobs.values())
                    .any(|n| n.source == s);
                (s, if on { 1.0 } else { 0.0 })
            })
            .collect();
            (
                ComponentReport {
                    id: COMPONENT.to_owned(),
                    kind: COMPONENT.to_owned(),
                    labels,
                    status_override: Some(status),
                    reasons,
                },
                gauges,
            )
        };
        for (s, v) in gauges {
            metrics::gauge!("warden_notice_active", "source" => s.name()).set(v);
        }
        health.apply_from(COMPONENT, report);
    }
}

/// How far ahead of the furthest rank, in time, the step saved on a notice
/// lies when the job spans hosts: the other hosts are told through etcd or
/// torch's store meanwhile (a launcher reads it from its watch, or its
/// rendezvous helper at its next 0.5 s poll, and tells its agent), and
/// their ranks, in lockstep with these, must not have passed it. At most a
/// quarter of the notice's window ([`across_hosts_lead`]). The launcher
/// asks for the same lead on its own SIGTERM.
pub const ACROSS_HOSTS_LEAD: Duration = Duration::from_secs(2);

/// [`ACROSS_HOSTS_LEAD`], or a quarter of the time left before `deadline`
/// when that is shorter (a short window keeps most of itself for the save).
pub fn across_hosts_lead(deadline: Option<SystemTime>, now: SystemTime) -> Duration {
    deadline.map_or(ACROSS_HOSTS_LEAD, |d| {
        ACROSS_HOSTS_LEAD.min(d.duration_since(now).unwrap_or_default() / 4)
    })
}

/// Whether `job` has ranks on other hosts: a rank here declared a world
/// larger than the ranks of the job registered here (the launcher
/// registers its workers as it spawns them, so on one host they are all
/// here from the start).
fn spans_hosts(reg: &Registry, job: &str) -> bool {
    let mut here = BTreeSet::new();
    let mut world = 0;
    for e in reg.ranks.values().filter(|e| e.key.job == job) {
        here.insert(e.key.rank);
        world = world.max(e.world_size);
    }
    usize::try_from(world).is_ok_and(|w| w > here.len())
}

/// The job's recent step time: the largest of its ranks' median step
/// durations, as the last scan read them (None before any step ended).
fn step_time_ns<'a>(
    ranks: impl Iterator<Item = &'a crate::ranks::registry::RankEntry>,
) -> Option<u64> {
    ranks
        .filter_map(|e| e.last.as_ref())
        .filter_map(|s| {
            let mut d: Vec<u64> = s
                .recent_steps
                .iter()
                .map(|st| st.duration_ns)
                .filter(|d| *d > 0)
                .collect();
            d.sort_unstable();
            d.get(d.len() / 2).copied()
        })
        .max()
}

/// A deadline as milliseconds since the Unix epoch, as the `notice.raised`
/// event carries it for the launcher (0: none said).
fn deadline_unix_ms(deadline: Option<SystemTime>) -> u64 {
    deadline
        .and_then(|d| d.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Most steps a lead may add: a caller's number over a tiny step time is
/// bounded.
const MAX_LEAD_STEPS: u64 = 100_000;

/// The step to save at: the one after the furthest rank's `furthest`, plus
/// as many steps as `lead` takes at `step_ns` (the job's recent median step
/// time), so that ranks on other hosts, told through etcd meanwhile, have
/// not passed it. With a lead but no step time known yet: one more step.
pub fn save_step(furthest: u64, step_ns: Option<u64>, lead: Duration) -> u64 {
    let extra = if lead.is_zero() {
        0
    } else {
        match step_ns {
            Some(ns) if ns > 0 => {
                let lead_ns = u64::try_from(lead.as_nanos()).unwrap_or(u64::MAX);
                lead_ns.div_ceil(ns).min(MAX_LEAD_STEPS)
            }
            _ => 1,
        }
    };
    furthest.saturating_add(1).saturating_add(extra)
}

/// The notice whose stop comes first, in whole seconds (as the slot word
/// carries it), the first given on a tie.
fn first<'a>(it: impl Iterator<Item = &'a Notice>) -> Option<Notice> {
    it.min_by_key(|n| {
        n.deadline
            .and_then(|d| d.duration_since(UNIX_EPOCH).ok())
            .map_or(u64::MAX, |d| d.as_secs())
    })
    .cloned()
}

/// Starts the host's sources (those enabled, or detected on their cloud)
/// as tasks that end with `shutdown`.
pub fn start(
    cfg: &config::NoticeConfig,
    sysfs_root: &str,
    board: &NoticeBoard,
    events: &Arc<warden_core::events::EventBus>,
    shutdown: &tokio_util::sync::CancellationToken,
    tasks: &mut tokio::task::JoinSet<()>,
) {
    let cloud = detect::cloud(std::path::Path::new(sysfs_root));
    let on = |s: config::Switch, c: detect::Cloud| match s {
        config::Switch::On => true,
        config::Switch::Off => false,
        config::Switch::Auto => cloud == Some(c),
    };
    if on(cfg.gce.enabled, detect::Cloud::Gce) {
        board.running(NoticeSource::Gce);
        tasks.spawn(gce::run(
            cfg.gce.clone(),
            board.clone(),
            events.clone(),
            shutdown.clone(),
        ));
    }
    if on(cfg.aws.enabled, detect::Cloud::Aws) {
        board.running(NoticeSource::Aws);
        tasks.spawn(aws::run(
            cfg.aws.clone(),
            board.clone(),
            events.clone(),
            shutdown.clone(),
        ));
    }
    if !cfg.kubernetes.taints_file.is_empty() {
        board.running(NoticeSource::Kubernetes);
        tasks.spawn(kubernetes::run(
            cfg.kubernetes.clone(),
            board.clone(),
            events.clone(),
            shutdown.clone(),
        ));
    }
}

/// A source's trouble, logged and told once per change (a metadata server
/// that does not answer is logged at each change, not each retry).
pub(crate) fn say_trouble(
    board: &NoticeBoard,
    events: &warden_core::events::EventBus,
    source: NoticeSource,
    last: &mut Option<String>,
    now: Option<String>,
) {
    if *last == now {
        return;
    }
    match &now {
        Some(why) => {
            tracing::warn!(source = source.name(), error = %why, "notice source cannot be read");
            events.publish(
                NewEvent::new(
                    Severity::Warning,
                    "notice.source_error",
                    format!("notice/{}", source.name()),
                    format!("notice source {} cannot be read: {why}", source.name()),
                )
                .with("source", source.name())
                .with("error", why),
            );
        }
        None => tracing::info!(source = source.name(), "notice source answers again"),
    }
    board.trouble(source, now.clone());
    *last = now;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_save_step_leads_by_the_steps_the_lead_takes() {
        let ms = |n: u64| Duration::from_millis(n);
        // No lead: the step after the furthest rank's (one host).
        assert_eq!(save_step(110, Some(20_000_000), Duration::ZERO), 111);
        // 1 s at 20 ms a step: 50 more.
        assert_eq!(save_step(110, Some(20_000_000), ms(1000)), 161);
        // A part of a step rounds up: 1 s at 300 ms a step is 4 more.
        assert_eq!(save_step(110, Some(300_000_000), ms(1000)), 115);
        // No step time known yet: one more.
        assert_eq!(save_step(110, None, ms(1000)), 112);
        // A tiny step time is bounded.
        assert_eq!(save_step(0, Some(1), ms(60_000)), 1 + MAX_LEAD_STEPS);
        assert_eq!(save_step(u64::MAX, Some(1), ms(1)), u64::MAX);
    }

    #[test]
    fn the_lead_across_hosts_is_at_most_a_quarter_of_the_window() {
        let now = UNIX_EPOCH + Duration::from_secs(1_900_000_000);
        let s = Duration::from_secs;
        assert_eq!(across_hosts_lead(None, now), ACROSS_HOSTS_LEAD);
        assert_eq!(across_hosts_lead(Some(now + s(30)), now), ACROSS_HOSTS_LEAD);
        assert_eq!(across_hosts_lead(Some(now + s(4)), now), s(1));
        // A deadline already past: no lead to spend, save at once.
        assert_eq!(across_hosts_lead(Some(now - s(1)), now), Duration::ZERO);
        assert_eq!(
            deadline_unix_ms(Some(now + Duration::from_millis(5))),
            1_900_000_000_005
        );
        assert_eq!(deadline_unix_ms(None), 0);
    }

    #[test]
    fn the_word_carries_source_and_deadline_and_the_earliest_notice_leads() {
        let at = UNIX_EPOCH + Duration::from_secs(1_900_000_000);
        let n = Notice {
            source: NoticeSource::Gce,
            what: "instance/preempted = TRUE".into(),
            deadline: Some(at),
            raised: at,
        };
        let w = NoticeWord::decode(n.word()).expect("a notice");
        assert_eq!(w.source_name(), "gce");
        assert_eq!(w.deadline_unix_s, 1_900_000_000);
        let later = Notice {
            deadline: Some(at + Duration::from_secs(60)),
            ..n.clone()
        };
        assert_eq!(first([&later, &n].into_iter()), Some(n));
        // A server's long value is clipped, control characters replaced.
        let long = format!("a\n{}", "x".repeat(1000));
        let c = clip(&long);
        assert!(c.len() <= MAX_WHAT && !c.contains('\n'));
        assert_eq!(NoticeWord::decode(0), None);
    }
}
