//! Straggler detection: a rank whose own work is slower than the rest of
//! its job's, found from the section durations in the heartbeat slots, and
//! explained from its GPUs' health and the host's CPU.
//!
//! In: each rank's completed steps with their sections (the scan pushes them
//! into [`RankSamples`] on the rank's registry entry; the agent lends them
//! as [`LiveRank`]s), the health model, the rank's CPU run-queue delay and
//! the load average ([`HostProbe`], read by the agent), and peers' summaries
//! of the ranks they own. Out: per-rank scores (GetStragglers, `warden stragglers`), events
//! `rank.straggler` / `rank.straggler_cleared`, metrics
//! `warden_straggler_*`, and summaries of this agent's ranks for peers.
//! Never: block the scan (the registry lock is held only to copy a few
//! kilobytes out; scoring runs outside it), or flag a rank another agent
//! owns (that agent can explain it; this one shows its verdict).
//!
//! The submodules are pure: [`score`] (windows, median and MAD, scores,
//! hysteresis), [`explain`] (the sentence and cause class), [`exchange`]
//! (summaries and the peers' store), [`samples`] (the per-rank ring),
//! [`config`]. This file is the driver the agent calls once per tick
//! (`warden_agent::ranks::stragglers::tick`: [`Stragglers::copy_out`] under
//! the registry lock, then [`Stragglers::score`] outside it); a rank
//! is scored every `stride_steps` of its new steps. Whoever runs the
//! detector owns it (the agent state holds it for the work loop and the
//! API) and starts the peer exchange (`api::stragglers`) when
//! [`Stragglers::claim_exchange`] says so: this module knows no gRPC.

pub mod aggregate;
pub mod config;
pub mod exchange;
pub mod explain;
pub mod samples;
pub mod score;
pub mod sim;
pub mod sketch;
pub mod tree;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

pub use config::StragglerConfig;
pub use exchange::{Batch, Score, Summary};
pub use samples::RankSamples;

use self::explain::CpuFacts;
use self::score::{
    Classifier, JobRank, MAX_SECTIONS, Params, RankTrack, Scorer, SectionMedian, Transition,
};
use crate::health::HealthModel;
use crate::rank::RankKey;
use crate::signal::{Report, Signal, Straggler};
use crate::verdict::FaultClass;

/// The detector of one agent: its config, what it knows of its own ranks,
/// and what peers said of theirs.
#[derive(Debug)]
pub struct Stragglers {
    cfg: StragglerConfig,
    params: Params,
    classifier: Classifier,
    /// This agent's host name: the owner named on its ranks' scores.
    host: String,
    inner: Mutex<Inner>,
    /// Whether the peer exchange task was started (once, on the first tick).
    exchange_started: AtomicBool,
}

#[derive(Debug, Default)]
struct Inner {
    scorer: Scorer,
    local: BTreeMap<RankKey, Local>,
    remote: exchange::RemoteStore,
    /// Each job's statistics from its aggregator, with when they came:
    /// while fresh (within `summary_ttl`), the job's own ranks are scored
    /// against them rather than against the peers' summaries.
    job_wide: BTreeMap<String, (Instant, aggregate::JobWide)>,
}

/// What the detector keeps of one of its own ranks.
#[derive(Debug, Default)]
struct Local {
    /// The registration whose samples these are (a new one starts afresh).
    generation: u64,
    /// The rank's pushed-step count at its last window.
    scored_pushed: u64,
    pid: u32,
    local_rank: u32,
    declared_devices: Vec<String>,
    /// Its compute sections over its latest window.
    medians: Vec<SectionMedian>,
    /// A window was taken this tick and waits to be judged.
    fresh: bool,
    /// When its latest window was taken, and the usual time between its
    /// windows (a moving average): a rank that stops stepping (stopped,
    /// hung, stuck in a checkpoint) must not hold its old medians up as the
    /// job's for the others to be compared with.
    last_window_at: Option<Instant>,
    window_every: Option<Duration>,
    kinds: score::SectionKinds,
    track: RankTrack,
    score: Option<Score>,
    flagged_since: Option<SystemTime>,
    /// The main thread's schedstat run_delay (ns) and when it was read.
    cpu_sample: Option<(u64, Instant)>,
    /// Share of wall time waiting for a CPU since the previous window.
    cpu_wait: Option<f64>,
}

impl Local {
    /// Usual intervals between windows after which a rank's medians leave
    /// the comparison: one missed window is enough (the others' next
    /// windows would otherwise be judged against its past).
    const STALE_AFTER_WINDOWS: f64 = 1.5;

    /// Whether its latest window is too old to stand for it now.
    fn stale(&self, now: Instant) -> bool {
        match (self.last_window_at, self.window_every) {
            (Some(at), Some(every)) => {
                now.saturating_duration_since(at) > every.mul_f64(Self::STALE_AFTER_WINDOWS)
            }
            _ => false,
        }
    }

    /// Notes a window taken at `now`.
    fn note_window(&mut self, now: Instant) {
        if let Some(prev) = self.last_window_at {
            let dt = now.saturating_duration_since(prev);
            self.window_every = Some(match self.window_every {
                None => dt,
                Some(e) => e.mul_f64(0.75) + dt.mul_f64(0.25),
            });
        }
        self.last_window_at = Some(now);
    }
}

/// A running (or hung) rank as the detector reads it, lent by the owner of
/// the rank registry (the agent) for [`Stragglers::copy_out`].
#[derive(Debug, Clone, Copy)]
pub struct LiveRank<'a> {
    /// The rank.
    pub key: &'a RankKey,
    /// Its registration's generation: a new one starts its windows afresh.
    pub generation: u64,
    /// Its process, for the CPU probe.
    pub pid: u32,
    /// Its local rank, shown on its score.
    pub local_rank: u32,
    /// The devices it declared, to explain a flag from their health.
    pub devices: &'a [String],
    /// Its completed steps' sections, pushed by the scan.
    pub samples: &'a RankSamples,
}

/// What [`Stragglers::copy_out`] took under the registry lock, for
/// [`Stragglers::score`] to use outside it.
#[derive(Debug, Default)]
pub struct CopyOut {
    copied: Vec<Copied>,
    live: BTreeSet<RankKey>,
}

/// The host facts a flag is explained with, read by the agent: the core
/// reads no `/proc`.
pub struct HostProbe<'a> {
    /// A process's cumulative run-queue delay in nanoseconds
    /// (`/proc/<pid>/schedstat`), `None` when unreadable.
    pub run_delay_ns: &'a dyn Fn(u32) -> Option<u64>,
    /// The host's one-minute load average, `None` when unreadable.
    pub loadavg: &'a dyn Fn() -> Option<f64>,
}

impl std::fmt::Debug for HostProbe<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostProbe")
    }
}

/// A rank's new steps, copied out of the registry.
#[derive(Debug)]
struct Copied {
    key: RankKey,
    generation: u64,
    pid: u32,
    local_rank: u32,
    devices: Vec<String>,
    samples: RankSamples,
}

impl Stragglers {
    /// A detector with `cfg`, owning the ranks of `host`.
    pub fn new(cfg: StragglerConfig, host: String) -> Self {
        Self {
            params: Params::from(&cfg),
            classifier: Classifier::new(&cfg),
            cfg,
            host,
            inner: Mutex::new(Inner::default()),
            exchange_started: AtomicBool::new(false),
        }
    }

    /// True the first time it is asked: whoever runs the detector starts
    /// the peer exchange then (once per detector).
    pub fn claim_exchange(&self) -> bool {
        !self.exchange_started.swap(true, Ordering::AcqRel)
    }

    /// The config in force.
    pub fn config(&self) -> &StragglerConfig {
        &self.cfg
    }

    /// This agent's host name.
    pub fn host(&self) -> &str {
        &self.host
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// First half of a tick, run by the registry's owner under its lock:
    /// copies out the new steps of the ranks that are `stride_steps` past
    /// their last score (a few kilobytes), and notes which ranks still run.
    /// `live` is every Running or Hung rank.
    pub fn copy_out<'a>(&self, live: impl IntoIterator<Item = LiveRank<'a>>) -> CopyOut {
        let inner = self.lock();
        let stride = self.cfg.stride_steps as u64;
        let mut out = CopyOut::default();
        for e in live {
            out.live.insert(e.key.clone());
            let pushed = e.samples.pushed();
            let base = match inner.local.get(e.key) {
                Some(l) if l.generation == e.generation => l.scored_pushed,
                _ => 0,
            };
            if pushed >= base + stride {
                out.copied.push(Copied {
                    key: e.key.clone(),
                    generation: e.generation,
                    pid: e.pid,
                    local_rank: e.local_rank,
                    devices: e.devices.to_vec(),
                    samples: e.samples.clone(),
                });
            }
        }
        out
    }

    /// Second half of a tick, outside the registry lock: scores every rank
    /// with new steps against its whole job (explaining a flag from
    /// `health` and `probe`), and returns the flag changes for the caller
    /// to publish. `now` is the tick's monotonic time, `wall` the same
    /// moment on the wall clock (the flags' and summaries' stamps).
    pub fn score(
        &self,
        copy: CopyOut,
        health: &HealthModel,
        probe: &HostProbe<'_>,
        now: Instant,
        wall: SystemTime,
    ) -> Vec<Signal> {
        let mut events = Vec::new();
        let mut inner = self.lock();
        let Inner {
            scorer,
            local,
            remote,
            job_wide,
        } = &mut *inner;
        let ttl = self.cfg.summary_ttl;
        job_wide.retain(|_, (at, _)| now.saturating_duration_since(*at) < ttl);
        let CopyOut { copied, live } = copy;

        // Ranks that stopped running leave; a flag they held is lifted.
        let gone: Vec<RankKey> = local
            .keys()
            .filter(|k| !live.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(l) = local.remove(&key)
                && l.track.hysteresis.flagged
            {
                let section = l.score.as_ref().map_or("", |s| s.section.as_str());
                events.push(Signal::RankStragglerCleared {
                    report: Report::new(format!("{key} is no longer scored: it stopped running"))
                        .with("section", section)
                        .with("why", "the rank stopped running"),
                    key,
                });
            }
        }

        if copied.is_empty() {
            remote.expire(now, self.cfg.summary_ttl);
            return events;
        }
        let started = Instant::now();
        let mut jobs = BTreeSet::new();
        for c in copied {
            let l = local.entry(c.key.clone()).or_default();
            if l.generation != c.generation {
                *l = Local {
                    generation: c.generation,
                    track: std::mem::take(&mut l.track),
                    score: l.score.take(),
                    flagged_since: l.flagged_since,
                    ..Local::default()
                };
            }
            l.scored_pushed = c.samples.pushed();
            l.pid = c.pid;
            l.local_rank = c.local_rank;
            l.declared_devices = c.devices;
            score::window_medians(
                &c.samples,
                &self.classifier,
                &mut l.kinds,
                self.params.window,
                &mut l.medians,
            );
            l.fresh = true;
            l.note_window(now);
            let sample = (probe.run_delay_ns)(c.pid).map(|d| (d, now));
            l.cpu_wait = match (l.cpu_sample, sample) {
                (Some((d0, t0)), Some((d1, t1))) if t1 > t0 => {
                    Some(d1.saturating_sub(d0) as f64 / (t1 - t0).as_nanos() as f64)
                }
                _ => None,
            };
            l.cpu_sample = sample.or(l.cpu_sample);
            jobs.insert(c.key.job);
        }
        remote.expire(now, self.cfg.summary_ttl);
        let remote_ranks = remote.ranks();

        let mut snapshot: Option<crate::health::NodeSnapshot> = None;
        let mut host_cpu: Option<(Option<f64>, usize)> = None;
        let scored_at = wall;
        for job in jobs {
            // The job's section table and its ranks, from here and peers.
            let mut names: Vec<String> = Vec::new();
            let mut ranks: Vec<JobRank> = Vec::new();
            let mut own: Vec<(RankKey, usize)> = Vec::new();
            for (key, l) in local.range(job_range(&job)) {
                if !l.fresh && l.stale(now) {
                    continue;
                }
                let mut r = JobRank::new(key.rank);
                for m in &l.medians {
                    if let Some(i) = add(&mut names, &m.section) {
                        r.median_ns[i] = m.median_ns;
                        r.samples[i] = m.samples;
                    }
                }
                if l.fresh {
                    own.push((key.clone(), ranks.len()));
                }
                ranks.push(r);
            }
            // The aggregator's statistics, when it answers: the job's own
            // ranks against the whole job, O(sections), whatever its size.
            let wide = job_wide.get(&job).map(|(_, w)| w);
            for st in wide.iter().flat_map(|w| &w.sections) {
                add(&mut names, &st.section);
            }
            for (_, s) in remote_ranks
                .iter()
                .filter(|(_, s)| wide.is_none() && s.job == job)
            {
                let key = RankKey {
                    job: job.clone(),
                    rank: s.rank,
                };
                if local.contains_key(&key) {
                    continue;
                }
                let mut r = JobRank::new(s.rank);
                for m in &s.sections {
                    if let Some(i) = add(&mut names, &m.section) {
                        r.median_ns[i] = m.median_ns;
                        r.samples[i] = m.samples;
                    }
                }
                ranks.push(r);
            }
            match wide {
                Some(w) => {
                    let stats: Vec<Option<(score::Spread, usize)>> = names
                        .iter()
                        .map(|n| {
                            let st = w.sections.iter().find(|s| &s.section == n)?;
                            let sp = st.spread()?;
                            let over = if sp.n >= self.params.min_ranks {
                                usize::try_from(st.stat.over).unwrap_or(usize::MAX)
                            } else {
                                0
                            };
                            Some((sp, over))
                        })
                        .collect();
                    scorer.prepare_job_wide(&stats);
                }
                None => scorer.prepare(&self.params, names.len(), &ranks),
            }
            for (key, idx) in own {
                let Some(l) = local.get_mut(&key) else {
                    continue;
                };
                l.fresh = false;
                let rs = scorer.judge_rank(&self.params, &names, &ranks[idx], &mut l.track);
                for (s, name) in names.iter().enumerate() {
                    let rel = rs.relative[s];
                    if rel.is_finite() {
                        metrics::gauge!(
                            "warden_straggler_relative",
                            "job" => key.job.clone(),
                            "rank" => key.rank.to_string(),
                            "section" => name.clone()
                        )
                        .set(rel);
                    }
                }
                let transition = match rs.section {
                    Some(_) => l.track.hysteresis.update(
                        rs.verdict.over,
                        self.params.flag_after,
                        self.params.clear_after,
                    ),
                    None => Transition::None,
                };
                let flagged = l.track.hysteresis.flagged;
                if transition == Transition::Flagged {
                    l.flagged_since = Some(scored_at);
                }
                let section = rs
                    .section
                    .and_then(|s| names.get(s))
                    .cloned()
                    .unwrap_or_else(|| {
                        l.medians
                            .first()
                            .map(|m| m.section.clone())
                            .unwrap_or_default()
                    });
                let components = snapshot.get_or_insert_with(|| health.snapshot());
                let devices = explain::resolve_devices(
                    &l.declared_devices,
                    l.local_rank,
                    &components.components,
                );
                let mut sc = Score {
                    job: key.job.clone(),
                    rank: key.rank,
                    host: self.host.clone(),
                    section: section.clone(),
                    relative: if rs.section.is_some() {
                        rs.verdict.relative
                    } else {
                        0.0
                    },
                    individual: if rs.section.is_some() {
                        rs.verdict.individual
                    } else {
                        0.0
                    },
                    robust_z: rs.verdict.z,
                    flagged,
                    consecutive: l.track.hysteresis.run,
                    flagged_since: if flagged { l.flagged_since } else { None },
                    explanation: String::new(),
                    cause_class: String::new(),
                    samples: if rs.section.is_some() {
                        rs.samples
                    } else {
                        l.medians.first().map_or(0, |m| m.samples)
                    },
                    devices: devices.clone(),
                    rank_median_ns: rs.rank_median_ns,
                    job_median_ns: rs.job_median_ns,
                    ranks_compared: u32::try_from(rs.ranks).unwrap_or(u32::MAX),
                    scored_at: Some(scored_at),
                };
                let mut facts = Vec::new();
                if flagged && !rs.verdict.over {
                    // Clearing down: keep the reason it was flagged for.
                    if let Some(prev) = &l.score {
                        sc.explanation.clone_from(&prev.explanation);
                        sc.cause_class.clone_from(&prev.cause_class);
                    }
                } else if flagged {
                    let (load, cores) = *host_cpu.get_or_insert_with(|| {
                        (
                            (probe.loadavg)(),
                            std::thread::available_parallelism().map_or(1, usize::from),
                        )
                    });
                    let cpu = CpuFacts {
                        wait_share: l.cpu_wait,
                        load,
                        cores,
                    };
                    let e = if self.cfg.explain {
                        explain::explain(
                            key.rank,
                            &section,
                            sc.relative,
                            &devices,
                            &components.components,
                            &cpu,
                            self.cfg.cpu_wait_share,
                        )
                    } else {
                        explain::Explanation {
                            sentence: format!(
                                "rank {} is {:.0}% slower in {section} (straggler.explain is off)",
                                key.rank,
                                (sc.relative - 1.0) * 100.0
                            ),
                            cause_class: explain::CauseClass::Unknown,
                            facts: Vec::new(),
                        }
                    };
                    sc.explanation = e.sentence;
                    sc.cause_class = e.cause_class.as_str().to_owned();
                    facts = e.facts;
                }
                match transition {
                    Transition::Flagged => {
                        metrics::counter!("warden_straggler_flags_total").increment(1);
                        events.push(self.flagged_event(&key, &sc, facts));
                    }
                    Transition::Cleared => {
                        let was = l.score.as_ref().and_then(|s| s.flagged_since);
                        events.push(self.cleared_event(&key, &sc, was, scored_at));
                        l.flagged_since = None;
                    }
                    Transition::None => {}
                }
                l.score = Some(sc);
            }
            let flagged = local
                .range(job_range(&job))
                .filter(|(_, l)| l.track.hysteresis.flagged)
                .count();
            metrics::gauge!("warden_stragglers_flagged", "job" => job.clone()).set(flagged as f64);
        }
        metrics::histogram!("warden_straggler_scoring_seconds")
            .record(started.elapsed().as_secs_f64());
        events
    }

    fn flagged_event(&self, key: &RankKey, sc: &Score, facts: Vec<(String, String)>) -> Signal {
        let mut report = Report::new(format!("{key} is a straggler: {}", sc.explanation))
        .with("section", &sc.section)
        .with("relative", format!("{:.2}", sc.relative))
        .with("individual", format!("{:.2}", sc.individual))
        .with("robust_z", format!("{:.1}", sc.robust_z))
        .with("samples", sc.samples)
        .with("job_median", fmt_ns(sc.job_median_ns))
        .with("rank_median", fmt_ns(sc.rank_median_ns))
        .with("devices", sc.devices.join(","))
        .with("explanation", &sc.explanation)
        .with("cause_class", &sc.cause_class)
        .with("host", &self.host)
        .with("ranks_compared", sc.ranks_compared)
        .with(
            "rule",
            format!(
                "relative >= {} and robust z >= {} (or individual >= {} under {} ranks) in {} consecutive windows of {} steps",
                self.cfg.relative_threshold,
                self.cfg.z_threshold,
                self.cfg.individual_threshold,
                self.cfg.min_ranks,
                self.cfg.flag_after,
                self.cfg.window_steps
            ),
        );
        report.evidence.extend(facts);
        Signal::RankStraggler(Straggler {
            key: key.clone(),
            section: sc.section.clone(),
            relative: format!("{:.2}", sc.relative),
            explanation: sc.explanation.clone(),
            cause: match sc.cause_class.as_str() {
                "correctable_hardware" => FaultClass::CorrectableHardware,
                "uncorrectable_hardware" => FaultClass::UncorrectableHardware,
                "infrastructure" => FaultClass::Infrastructure,
                _ => FaultClass::Unknown,
            },
            report,
        })
    }

    fn cleared_event(
        &self,
        key: &RankKey,
        sc: &Score,
        since: Option<SystemTime>,
        now: SystemTime,
    ) -> Signal {
        let mut ev = Report::new(format!(
            "{key} no longer straggles: {:.2} x the job's median in {}",
            sc.relative, sc.section
        ))
        .with("section", &sc.section)
        .with("relative", format!("{:.2}", sc.relative))
        .with("individual", format!("{:.2}", sc.individual))
        .with(
            "why",
            format!(
                "{} consecutive windows under the thresholds",
                self.cfg.clear_after
            ),
        );
        if let Some(d) = since.and_then(|s| now.duration_since(s).ok()) {
            ev = ev.with(
                "flagged_for",
                humantime::format_duration(Duration::from_secs(d.as_secs())),
            );
        }
        Signal::RankStragglerCleared {
            key: key.clone(),
            report: ev,
        }
    }

    /// This host's report to its jobs' aggregator as of `now`: per job,
    /// a sketch per compute section over its ranks that have enough
    /// samples to be judged (a rank that stopped stepping is left out),
    /// and its ranks' scores.
    pub fn report(&self, now: Instant) -> aggregate::HostReport {
        let inner = self.lock();
        let mut jobs: BTreeMap<&str, aggregate::JobPart> = BTreeMap::new();
        for (k, l) in &inner.local {
            if l.medians.is_empty() || l.stale(now) {
                continue;
            }
            let j = jobs
                .entry(k.job.as_str())
                .or_insert_with(|| aggregate::JobPart {
                    job: k.job.clone(),
                    ..aggregate::JobPart::default()
                });
            for m in &l.medians {
                if (m.samples as usize) < self.params.min_steps {
                    continue;
                }
                let at = j.sections.iter().position(|(n, _)| *n == m.section);
                match at {
                    Some(i) => j.sections[i].1.add(m.median_ns),
                    None if j.sections.len() < MAX_SECTIONS => {
                        let mut sk = sketch::Sketch::default();
                        sk.add(m.median_ns);
                        j.sections.push((m.section.clone(), sk));
                    }
                    None => {}
                }
            }
            j.scores.push(l.score.clone().unwrap_or_else(|| {
                Score {
                    job: k.job.clone(),
                    rank: k.rank,
                    host: self.host.clone(),
                    section: l
                        .medians
                        .first()
                        .map(|m| m.section.clone())
                        .unwrap_or_default(),
                    samples: l.medians.first().map_or(0, |m| m.samples),
                    ..Score::default()
                }
            }));
        }
        aggregate::HostReport {
            host: self.host.clone(),
            relative_threshold: self.params.relative_threshold,
            z_threshold: self.params.z_threshold,
            jobs: jobs.into_values().collect(),
        }
    }

    /// Takes the aggregator's answer for a job.
    pub fn take_job_wide(&self, wide: aggregate::JobWide, now: Instant) {
        self.lock().job_wide.insert(wide.job.clone(), (now, wide));
    }

    /// Takes a peer's batch (already validated).
    pub fn merge_remote(&self, batch: Batch, now: Instant) {
        self.lock().remote.merge(batch, now);
    }

    /// This agent's summaries of its own ranks, for peers, as of `now`
    /// (a rank that stopped stepping is left out).
    pub fn outbox(&self, now: Instant) -> Batch {
        let inner = self.lock();
        Batch {
            host: self.host.clone(),
            ranks: inner
                .local
                .iter()
                .filter(|(_, l)| !l.medians.is_empty() && !l.stale(now))
                .map(|(k, l)| Summary {
                    job: k.job.clone(),
                    rank: k.rank,
                    sections: l.medians.clone(),
                    window_seq: l.track.windows,
                    score: l.score.clone(),
                })
                .collect(),
        }
    }

    /// The scores this agent knows: its own ranks' and, from peers, theirs
    /// (as their owners judged them), by job and rank; and the hosts they
    /// come from, this one first. `job` empty: every job.
    pub fn scores(&self, job: &str, flagged_only: bool, now: Instant) -> (Vec<Score>, Vec<String>) {
        let mut inner = self.lock();
        inner.remote.expire(now, self.cfg.summary_ttl);
        let mut out: BTreeMap<(String, u32), Score> = BTreeMap::new();
        let mut wide_hosts: BTreeSet<String> = BTreeSet::new();
        for (k, l) in &inner.local {
            let sc = l.score.clone().unwrap_or_else(|| Score {
                job: k.job.clone(),
                rank: k.rank,
                host: self.host.clone(),
                section: l
                    .medians
                    .first()
                    .map(|m| m.section.clone())
                    .unwrap_or_default(),
                samples: l.medians.first().map_or(0, |m| m.samples),
                ..Score::default()
            });
            out.insert((k.job.clone(), k.rank), sc);
        }
        // The aggregator's most notable ranks of each job (the whole job
        // on the aggregator itself: it answers itself with everything).
        let ttl = self.cfg.summary_ttl;
        for (at, w) in inner.job_wide.values() {
            if now.saturating_duration_since(*at) >= ttl {
                continue;
            }
            for sc in &w.top {
                let key = (sc.job.clone(), sc.rank);
                if !out.contains_key(&key) && !sc.host.is_empty() {
                    wide_hosts.insert(sc.host.clone());
                    out.insert(key, sc.clone());
                }
            }
        }
        for (host, s) in inner.remote.ranks() {
            let key = (s.job.clone(), s.rank);
            if out.contains_key(&key) {
                continue;
            }
            let mut sc = s.score.clone().unwrap_or_else(|| Score {
                job: s.job.clone(),
                rank: s.rank,
                section: s
                    .sections
                    .first()
                    .map(|m| m.section.clone())
                    .unwrap_or_default(),
                samples: s.sections.first().map_or(0, |m| m.samples),
                ..Score::default()
            });
            sc.job = s.job.clone();
            sc.rank = s.rank;
            sc.host = host.to_owned();
            out.insert(key, sc);
        }
        let mut hosts = vec![self.host.clone()];
        hosts.extend(inner.remote.hosts().map(str::to_owned));
        for h in wide_hosts {
            if !hosts.contains(&h) {
                hosts.push(h);
            }
        }
        let scores = out
            .into_values()
            .filter(|s| job.is_empty() || s.job == job)
            .filter(|s| !flagged_only || s.flagged)
            .collect();
        (scores, hosts)
    }
}

/// The index of section `n` in a job's table, added while there is room.
fn add(names: &mut Vec<String>, n: &str) -> Option<usize> {
    match names.iter().position(|x| x == n) {
        Some(i) => Some(i),
        None if names.len() < MAX_SECTIONS => {
            names.push(n.to_owned());
            Some(names.len() - 1)
        }
        None => None,
    }
}

/// The registry keys of one job, for a range scan of a map by [`RankKey`].
fn job_range(job: &str) -> std::ops::RangeInclusive<RankKey> {
    RankKey {
        job: job.to_owned(),
        rank: 0,
    }..=RankKey {
        job: job.to_owned(),
        rank: u32::MAX,
    }
}

/// A duration in nanoseconds, for people ("12.34ms").
pub fn fmt_ns(ns: f64) -> String {
    if !ns.is_finite() || ns <= 0.0 {
        "-".to_owned()
    } else if ns < 1e6 {
        format!("{:.1}us", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2}ms", ns / 1e6)
    } else {
        format!("{:.3}s", ns / 1e9)
    }
}

#[cfg(test)]
mod tests;
