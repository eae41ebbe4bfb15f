//! The job-wide straggler exchange without all-to-all, at the edge: the
//! task that reports this host's part to each job's aggregator, and the
//! `ReportToAggregator` handler that aggregates.
//!
//! In: the detector's [`Report`] (sketches per section, own scores) and the
//! hang board's positions, every `straggler.exchange_interval` and at once
//! when a hang snapshot is taken. Out: each job's statistics into the
//! detector ([`Stragglers::take_job_wide`]) and the collector's hang
//! verdicts into the hang board. Never: a call to every peer (one per
//! aggregator reached, a few when the first ones are down), an unbounded
//! count or size from a caller (checked here, naming the field; the
//! aggregator's limits refuse with RESOURCE_EXHAUSTED naming the limit).
//!
//! Who aggregates: for a job handed over by its launchers
//! (`SetCheckpointPeers`), the first live agent of its peer list in node
//! rank order; for the rest, the first live one of `straggler.peers` and
//! this agent's `api.tcp` sorted as strings (every host of a static fleet
//! lists the same set, so all agree). "Live": it answered; a candidate that
//! failed is skipped for three intervals, and every host tries the
//! candidates in the same order, so when the aggregator is lost the next
//! takes over within one interval plus `straggler.peer_timeout`, and a
//! returning one takes over again. When this agent is first it aggregates
//! its own report in place.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};
use warden_core::detect::culprit::{self, Blame};
use warden_core::detect::positions::{JobPositions, MAX_JOBS};
use warden_core::detect::sdc::aggregate::{JobSteps, JobValues};
use warden_core::detect::straggler::aggregate::{
    AggregateError, JobReport, JobWide, Report, SectionStat, SectionStatValues,
};
use warden_core::detect::straggler::exchange::{self, MAX_BATCH_RANKS};
use warden_core::detect::straggler::score::MAX_SECTIONS;
use warden_core::detect::straggler::sketch::Sketch;
use warden_core::detect::straggler::{Batch, Stragglers, Summary};
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;

use super::peer_auth::Caller;
use super::stragglers::score_pb;
use crate::state::AgentState;
use crate::tls::connect::PeerConnector;

/// Hosts a verdict notice names (the count says how many were read).
const MAX_NOTICE_HOSTS: usize = 64;

/// A report on the wire.
pub fn report_pb(
    r: &Report,
    positions: &[JobPositions],
    values: &[JobValues],
) -> pb::AggregateReport {
    pb::AggregateReport {
        host: r.host.clone(),
        relative_threshold: r.relative_threshold,
        z_threshold: r.z_threshold,
        jobs: r
            .jobs
            .iter()
            .map(|j| pb::JobSketches {
                job_id: j.job.clone(),
                sections: j
                    .sections
                    .iter()
                    .map(|(name, sk)| {
                        let (keys, counts) = sk.bins().unzip();
                        pb::SectionSketch {
                            section: name.clone(),
                            keys,
                            counts,
                        }
                    })
                    .collect(),
                scores: j.scores.iter().map(score_pb).collect(),
            })
            .collect(),
        positions: super::positions::to_pb(positions),
        values: super::positions::job_values_to_pb(values),
    }
}

fn bad_text(s: &str, max: usize) -> bool {
    s.is_empty() || s.len() > max || s.chars().any(char::is_control)
}

/// A report from a peer, checked; the error names the field.
#[allow(clippy::type_complexity)]
pub fn report_from_pb(
    p: pb::AggregateReport,
) -> Result<(Report, Vec<JobPositions>, Vec<JobValues>), String> {
    if bad_text(&p.host, 255) {
        return Err(format!(
            "host must be 1 to 255 characters without control characters (got {:?})",
            p.host
        ));
    }
    for (field, v) in [
        ("relative_threshold", p.relative_threshold),
        ("z_threshold", p.z_threshold),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!("{field} must be a positive number (got {v})"));
        }
    }
    if p.jobs.len() > MAX_JOBS {
        return Err(format!("jobs: {} jobs; at most {MAX_JOBS}", p.jobs.len()));
    }
    let total: usize = p.jobs.iter().map(|j| j.scores.len()).sum();
    if total > MAX_BATCH_RANKS {
        return Err(format!(
            "jobs: {total} scores in all; at most {MAX_BATCH_RANKS}"
        ));
    }
    let positions = super::positions::from_pb(&p.host, p.positions)?;
    let values = super::positions::job_values_from_pb(p.values)?;
    let mut jobs = Vec::with_capacity(p.jobs.len());
    let mut seen = std::collections::HashSet::new();
    for (i, j) in p.jobs.into_iter().enumerate() {
        if bad_text(&j.job_id, 128) {
            return Err(format!(
                "jobs[{i}].job_id must be 1 to 128 characters without control characters (got {:?})",
                j.job_id
            ));
        }
        if !seen.insert(j.job_id.clone()) {
            return Err(format!("jobs[{i}]: job {:?} appears twice", j.job_id));
        }
        if j.sections.len() > MAX_SECTIONS {
            return Err(format!(
                "jobs[{i}].sections: {} sections; at most {MAX_SECTIONS}",
                j.sections.len()
            ));
        }
        let mut sections = Vec::with_capacity(j.sections.len());
        for (k, s) in j.sections.into_iter().enumerate() {
            if bad_text(&s.section, 64) {
                return Err(format!(
                    "jobs[{i}].sections[{k}].section must be 1 to 64 characters (got {:?})",
                    s.section
                ));
            }
            if sections.iter().any(|(n, _)| *n == s.section) {
                return Err(format!(
                    "jobs[{i}].sections[{k}]: section {:?} appears twice",
                    s.section
                ));
            }
            if s.keys.len() != s.counts.len() {
                return Err(format!(
                    "jobs[{i}].sections[{k}]: {} keys but {} counts",
                    s.keys.len(),
                    s.counts.len()
                ));
            }
            let sk = Sketch::from_bins(s.keys.into_iter().zip(s.counts))
                .map_err(|e| format!("jobs[{i}].sections[{k}]: {e}"))?;
            sections.push((s.section, sk));
        }
        // The scores are checked as the legacy exchange checks them.
        let batch = Batch {
            host: p.host.clone(),
            ranks: j
                .scores
                .iter()
                .map(|s| Summary {
                    job: j.job_id.clone(),
                    rank: s.global_rank,
                    sections: Vec::new(),
                    window_seq: 0,
                    score: Some(super::stragglers::score_from_pb(s)),
                })
                .collect(),
        };
        exchange::validate(&batch).map_err(|e| format!("jobs[{i}].scores: {e}"))?;
        let scores = batch
            .ranks
            .into_iter()
            .filter_map(|s| s.score)
            .map(|mut sc| {
                sc.job.clone_from(&j.job_id);
                sc.host.clone_from(&p.host);
                sc
            })
            .collect();
        jobs.push(JobReport {
            job: j.job_id,
            sections,
            scores,
        });
    }
    Ok((
        Report {
            host: p.host,
            relative_threshold: p.relative_threshold,
            z_threshold: p.z_threshold,
            jobs,
        },
        positions,
        values,
    ))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// An answer on the wire.
pub fn answer_pb(host: &str, here: &Here) -> pb::AggregateAnswer {
    let (wide, verdicts) = (&here.wide, &here.verdicts);
    pb::AggregateAnswer {
        host: host.to_owned(),
        values: super::positions::step_stats_to_pb(&here.values),
        values_aggregated: here.values_aggregated,
        jobs: wide
            .iter()
            .map(|w| pb::JobStats {
                job_id: w.job.clone(),
                sections: w
                    .sections
                    .iter()
                    .map(|s| pb::SectionStats {
                        section: s.section.clone(),
                        n: s.stat.n,
                        median_ns: s.stat.median_ns,
                        sigma_ns: s.stat.sigma_ns,
                        over: s.stat.over,
                    })
                    .collect(),
                top: w.top.iter().map(score_pb).collect(),
                hosts: w.hosts,
                ranks: w.ranks,
            })
            .collect(),
        verdicts: verdicts
            .iter()
            .map(|(job, at, v)| pb::HangVerdictNotice {
                job_id: job.clone(),
                judged_at_unix_ms: unix_ms(*at),
                culprits: v
                    .culprits
                    .iter()
                    .take(culprit::MAX_POSITIONS)
                    .map(|b| pb::HangBlame {
                        global_rank: b.rank,
                        host: b.host.clone(),
                        why: b.why.clone(),
                    })
                    .collect(),
                waiting: culprit::ranks_list(&v.waiting),
                missing: culprit::ranks_list(&v.missing),
                hosts: v.hosts.iter().take(MAX_NOTICE_HOSTS).cloned().collect(),
                hosts_read: u32::try_from(v.hosts.len()).unwrap_or(u32::MAX),
                summary: v.summary.clone(),
            })
            .collect(),
    }
}

/// Most ranks a compact list from a peer may expand to.
const MAX_LIST_RANKS: usize = 1 << 20;

/// "0-2,5" back to ranks; the error names what was wrong.
fn parse_ranks(s: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: u32 = a.parse().map_err(|_| format!("{part:?} is not a rank"))?;
        let b: u32 = b.parse().map_err(|_| format!("{part:?} is not a rank"))?;
        if b < a || out.len() + (b - a) as usize >= MAX_LIST_RANKS {
            return Err(format!("{part:?}: a bad or too large range"));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// The answer from an aggregator, checked; the error names the field.
fn answer_from_pb(p: pb::AggregateAnswer) -> Result<Here, String> {
    if p.jobs.len() > MAX_JOBS || p.verdicts.len() > MAX_JOBS {
        return Err(format!("more than {MAX_JOBS} jobs"));
    }
    let mut wide = Vec::with_capacity(p.jobs.len());
    for (i, j) in p.jobs.into_iter().enumerate() {
        if j.sections.len() > MAX_SECTIONS * 2 {
            return Err(format!("jobs[{i}].sections: too many"));
        }
        if j.top.len() > warden_core::detect::straggler::aggregate::TOP_SCORES {
            return Err(format!("jobs[{i}].top: too many"));
        }
        let mut sections = Vec::new();
        for s in j.sections {
            let ok = s.median_ns.is_finite()
                && s.median_ns > 0.0
                && s.sigma_ns.is_finite()
                && s.sigma_ns > 0.0;
            if !ok || bad_text(&s.section, 64) {
                return Err(format!("jobs[{i}].sections: bad section {:?}", s.section));
            }
            sections.push(SectionStat {
                section: s.section,
                stat: SectionStatValues {
                    n: s.n,
                    median_ns: s.median_ns,
                    sigma_ns: s.sigma_ns,
                    over: s.over,
                },
            });
        }
        let top: Vec<_> = j
            .top
            .iter()
            .map(super::stragglers::score_from_pb)
            .filter(|s| s.job == j.job_id && !bad_text(&s.host, 255))
            .collect();
        wide.push(JobWide {
            job: j.job_id,
            sections,
            top,
            hosts: j.hosts,
            ranks: j.ranks,
        });
    }
    let mut verdicts = Vec::new();
    for (i, v) in p.verdicts.into_iter().enumerate() {
        if v.culprits.len() > culprit::MAX_POSITIONS || v.hosts.len() > MAX_NOTICE_HOSTS {
            return Err(format!("verdicts[{i}]: too many culprits or hosts"));
        }
        let at = UNIX_EPOCH + Duration::from_millis(v.judged_at_unix_ms);
        verdicts.push((
            v.job_id,
            at,
            culprit::Verdict {
                culprits: v
                    .culprits
                    .into_iter()
                    .map(|b| Blame {
                        rank: b.global_rank,
                        host: b.host,
                        why: b.why,
                    })
                    .collect(),
                waiting: parse_ranks(&v.waiting)
                    .map_err(|e| format!("verdicts[{i}].waiting: {e}"))?,
                missing: parse_ranks(&v.missing)
                    .map_err(|e| format!("verdicts[{i}].missing: {e}"))?,
                hosts: v.hosts,
                summary: v.summary,
            },
        ));
    }
    Ok(Here {
        wide,
        verdicts,
        values: super::positions::step_stats_from_pb(p.values)?,
        values_aggregated: p.values_aggregated,
    })
}

/// What an aggregator answered (here or over the wire).
#[derive(Debug, Default)]
pub struct Here {
    /// The straggler statistics of the report's jobs.
    pub wide: Vec<JobWide>,
    /// Fresh hang verdicts of its jobs.
    pub verdicts: Vec<(String, SystemTime, culprit::Verdict)>,
    /// The settled steps of its values (SDC).
    pub values: Vec<JobSteps>,
    /// Whether the aggregator aggregates values (an older one does not).
    pub values_aggregated: bool,
}

/// Aggregates `report` here (a peer's, or this agent's own when it is
/// first in order): the statistics of its jobs, their fresh verdicts and
/// the settled steps of its values. A report carrying a hang snapshot
/// starts the collector's judgement. A report past a limit changes nothing
/// (the error names the limit).
pub fn aggregate_here(
    state: &Arc<AgentState>,
    report: Report,
    positions: Vec<JobPositions>,
    values: Vec<JobValues>,
) -> Result<Here, String> {
    let host = report.host.clone();
    let aggregated = state.config.sdc.enabled;
    let values = if aggregated && !values.is_empty() {
        state
            .sdc_aggregator
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .report(&host, values, Instant::now())
            .map_err(|e| e.to_string())?
    } else {
        Vec::new()
    };
    let mut jobs: Vec<String> = report.jobs.iter().map(|j| j.job.clone()).collect();
    jobs.extend(positions.iter().map(|p| p.job.clone()));
    let hung: Vec<String> = positions
        .iter()
        .filter(|p| p.hang)
        .map(|p| p.job.clone())
        .collect();
    let wide = {
        let mut agg = state
            .aggregator
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        agg.report(report, Instant::now())
            .map_err(|e: AggregateError| e.to_string())?
    };
    if host != state.host {
        state.hang_board.merge_remote(&host, positions);
    }
    for job in hung {
        tokio::spawn(crate::ranks::verdict::collect(
            state.hang_board.clone(),
            job,
            state.config.hang.verdict_wait,
        ));
    }
    jobs.sort();
    jobs.dedup();
    let verdicts = state
        .hang_board
        .announced_for(jobs.iter().map(String::as_str));
    Ok(Here {
        wide,
        verdicts,
        values,
        values_aggregated: aggregated,
    })
}

/// Serves `ReportToAggregator` (the Peer service calls it).
pub fn report_to_aggregator(
    state: &Arc<AgentState>,
    caller: &Caller,
    remote: Option<SocketAddr>,
    req: pb::AggregateReport,
) -> Result<pb::AggregateAnswer, Status> {
    if !state.config.straggler.enabled {
        return Err(Status::failed_precondition(format!(
            "straggler detection is off on {} (straggler.enabled = false)",
            state.host
        )));
    }
    let (report, positions, values) = report_from_pb(req)
        .map_err(|e| Status::invalid_argument(format!("aggregate report: {e}")))?;
    if report.host == state.host {
        return Err(Status::failed_precondition(format!(
            "the report comes from host {:?}, this agent's own name: give each agent its own \
             agent.host_name",
            report.host
        )));
    }
    let known = super::stragglers::known_peer(state, caller)
        || (caller.identity().is_some()
            && from_configured_peer(&state.config.straggler.peers, remote));
    super::peer_auth::straggler(caller, &report.host, known)?;
    // A peer speaks only for jobs it is a member of, where this agent
    // knows the job's members (handed over by its launchers); a static
    // fleet's jobs are known to nobody and any known peer may report.
    if let Ok(ck) = &state.checkpoints {
        let named = report
            .jobs
            .iter()
            .map(|j| &j.job)
            .chain(positions.iter().map(|p| &p.job))
            .chain(values.iter().map(|v| &v.job));
        for job in named {
            if !ck.peers.order_of(job).is_empty() {
                super::peer_auth::job_member(caller, job, &ck.peers.names_of_job(job))?;
            }
        }
    }
    let here = aggregate_here(state, report, positions, values)
        .map_err(|e| Status::resource_exhausted(format!("aggregate report: {e}")))?;
    Ok(answer_pb(&state.host, &here))
}

/// Whether a static fleet's aggregator takes this caller: with
/// `straggler.peers` configured, any agent whose certificate the cluster CA
/// signed (the caller's identity is proved; it reports only for its own
/// host). The aggregator is called by peers it never dialed itself, so the
/// legacy rule (only agents it dialed) cannot hold; docs/security.md.
fn from_configured_peer(peers: &[String], _remote: Option<SocketAddr>) -> bool {
    !peers.is_empty()
}

/// The aggregator candidates of `job` in order (addresses; this agent's
/// own is `me`).
fn candidates(state: &AgentState, job: &str, statics: &[String]) -> Vec<String> {
    if let Ok(ck) = &state.checkpoints {
        let order = ck.peers.order_of(job);
        if !order.is_empty() {
            return order;
        }
    }
    statics.to_vec()
}

/// One candidate and what is known of it.
#[derive(Debug, Default)]
struct Link {
    client: Option<PeerClient<Channel>>,
    /// When it last failed, and the failure logged.
    down: Option<(Instant, String)>,
}

/// Starts the task that reports to the aggregators every
/// `straggler.exchange_interval`, until the agent shuts down.
pub fn spawn_reports(state: Arc<AgentState>, det: Arc<Stragglers>) {
    tokio::spawn(report_loop(state, det));
}

async fn report_loop(state: Arc<AgentState>, det: Arc<Stragglers>) {
    let cfg = det.config().clone();
    let me = state.config.api.tcp.clone();
    let mut statics: Vec<String> = cfg.peers.clone();
    if !me.is_empty() {
        statics.push(me.clone());
    }
    statics.sort();
    statics.dedup();
    let mut links: HashMap<String, Link> = HashMap::new();
    let mut ticker = tokio::time::interval(cfg.exchange_interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let skip_for = cfg.exchange_interval * 3;
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticker.tick() => {}
            () = state.hang_board.exchange_now.notified() => {}
        }
        let report = det.report(Instant::now());
        let positions = state.hang_board.outbox();
        let values = if state.config.sdc.enabled {
            state.peer_values.outbox()
        } else {
            Vec::new()
        };
        // Jobs by their candidate list: one call per aggregator.
        let mut groups: BTreeMap<Vec<String>, Group> = BTreeMap::new();
        let empty = || Report {
            host: report.host.clone(),
            relative_threshold: report.relative_threshold,
            z_threshold: report.z_threshold,
            jobs: Vec::new(),
        };
        for j in &report.jobs {
            let c = candidates(&state, &j.job, &statics);
            groups
                .entry(c)
                .or_insert_with(|| (empty(), Vec::new(), Vec::new()))
                .0
                .jobs
                .push(j.clone());
        }
        for p in &positions {
            let c = candidates(&state, &p.job, &statics);
            groups
                .entry(c)
                .or_insert_with(|| (empty(), Vec::new(), Vec::new()))
                .1
                .push(p.clone());
        }
        let worlds = job_worlds(&state);
        for mut v in values {
            let c = candidates(&state, &v.job, &statics);
            v.world = worlds.get(&v.job).copied().unwrap_or(0);
            groups
                .entry(c)
                .or_insert_with(|| (empty(), Vec::new(), Vec::new()))
                .2
                .push(v);
        }
        let mut calls = JoinSet::new();
        let now = Instant::now();
        for (order, (mut rep, mut pos, vals)) in groups {
            if order.is_empty() {
                // No candidate at all (no peers, no api.tcp, nothing handed
                // over): the values are judged here, in place; the
                // straggler part and positions have nobody to go to.
                if vals.is_empty() {
                    continue;
                }
                rep.jobs.clear();
                pos.clear();
                let state = state.clone();
                let limit = cfg.peer_timeout;
                let plan = vec![(String::new(), None)];
                calls.spawn(async move { send(&state, plan, rep, pos, vals, limit).await });
                continue;
            }
            // The first candidate not known down (all down: try them all).
            let up: Vec<String> = order
                .iter()
                .filter(|a| {
                    links
                        .get(*a)
                        .and_then(|l| l.down.as_ref())
                        .is_none_or(|(at, _)| now.saturating_duration_since(*at) >= skip_for)
                })
                .cloned()
                .collect();
            let tries = if up.is_empty() { order } else { up };
            let mut plan = Vec::new();
            for addr in tries {
                if addr == me || addr.is_empty() {
                    plan.push((addr, None));
                    break;
                }
                let link = links.entry(addr.clone()).or_default();
                if link.client.is_none() {
                    link.client = client_for(&state, &addr, &cfg);
                }
                plan.push((addr, link.client.clone()));
            }
            if order_is_local_only(&plan)
                && rep.jobs.is_empty()
                && pos.is_empty()
                && vals.is_empty()
            {
                continue;
            }
            let state = state.clone();
            let limit = cfg.peer_timeout;
            calls.spawn(async move { send(&state, plan, rep, pos, vals, limit).await });
        }
        let stop = state.shutdown.clone();
        loop {
            let joined = tokio::select! {
                () = stop.cancelled() => return,
                j = calls.join_next() => j,
            };
            let Some(joined) = joined else { break };
            let Ok(outcome) = joined else { continue };
            for (addr, err) in outcome.failed {
                let link = links.entry(addr.clone()).or_default();
                metrics::counter!("warden_straggler_exchanges_total", "result" => "error")
                    .increment(1);
                if link.down.is_none() {
                    tracing::warn!(
                        aggregator = %addr,
                        error = %err,
                        "straggler aggregator unreachable; the next in order takes over (logged once)"
                    );
                }
                link.down = Some((Instant::now(), err));
            }
            if let Some(addr) = outcome.answered {
                metrics::counter!("warden_straggler_exchanges_total", "result" => "ok")
                    .increment(1);
                if let Some(l) = links.get_mut(&addr)
                    && l.down.take().is_some()
                {
                    tracing::info!(aggregator = %addr, "straggler aggregator answers again");
                }
            }
            let now = Instant::now();
            let Some(here) = outcome.here else { continue };
            for w in here.wide {
                det.take_job_wide(w, now);
            }
            for (job, at, v) in here.verdicts {
                state.hang_board.announce(&job, at, v);
            }
            if here.values_aggregated {
                state.peer_values.receive(here.values);
            } else {
                // An older aggregator (or one with sdc off): judged with
                // this host's ranks alone.
                state.peer_values.alone(outcome.value_jobs);
            }
        }
    }
}

fn order_is_local_only(plan: &[(String, Option<PeerClient<Channel>>)]) -> bool {
    plan.iter().all(|(_, c)| c.is_none())
}

/// A client for an aggregator at `addr`: a job's peer's (handed over) or
/// one dialed by address (its certificate's name is remembered, so that
/// its own reports are taken).
fn client_for(
    state: &AgentState,
    addr: &str,
    cfg: &warden_core::detect::straggler::StragglerConfig,
) -> Option<PeerClient<Channel>> {
    if let Ok(ck) = &state.checkpoints
        && let Some(p) = ck.peers.find(addr)
    {
        return Some(p.client);
    }
    Endpoint::from_shared(format!("http://{addr}"))
        .map(|e| {
            PeerClient::new(
                e.connect_timeout(cfg.peer_timeout)
                    .timeout(cfg.peer_timeout)
                    .connect_with_connector_lazy(
                        PeerConnector::new(state.peer_tls.clone(), "")
                            .recording(state.straggler_peers_seen.clone()),
                    ),
            )
        })
        .map_err(|e| tracing::warn!(peer = %addr, error = %e, "unusable aggregator address"))
        .ok()
}

/// One aggregator's share of a report: straggler part, positions, values.
type Group = (Report, Vec<JobPositions>, Vec<JobValues>);

/// The world size of each of this host's jobs, as its ranks registered it.
fn job_worlds(state: &AgentState) -> HashMap<String, u32> {
    let reg = state.registry();
    reg.ranks
        .iter()
        .map(|(k, r)| (k.job.clone(), r.world_size))
        .collect()
}

/// What one report's tries came to.
#[derive(Debug, Default)]
struct Outcome {
    answered: Option<String>,
    failed: Vec<(String, String)>,
    here: Option<Here>,
    /// The jobs whose values the report carried.
    value_jobs: Vec<String>,
}

/// Tries the candidates in `plan` in order until one answers (None: this
/// agent, aggregating in place).
async fn send(
    state: &Arc<AgentState>,
    plan: Vec<(String, Option<PeerClient<Channel>>)>,
    report: Report,
    positions: Vec<JobPositions>,
    values: Vec<JobValues>,
    limit: Duration,
) -> Outcome {
    let mut out = Outcome {
        value_jobs: values.iter().map(|v| v.job.clone()).collect(),
        ..Outcome::default()
    };
    let wire = report_pb(&report, &positions, &values);
    for (addr, client) in plan {
        let Some(mut client) = client else {
            match aggregate_here(state, report, positions, values) {
                Ok(here) => out.here = Some(here),
                Err(e) => tracing::warn!(error = %e, "this agent's own report was refused"),
            }
            return out;
        };
        let r = tokio::time::timeout(limit, client.report_to_aggregator(wire.clone())).await;
        let r = match r {
            Err(_) => Err(format!(
                "no answer within {}",
                humantime::format_duration(limit)
            )),
            Ok(Err(s)) => Err(format!("{}: {}", s.code(), s.message())),
            Ok(Ok(resp)) => {
                answer_from_pb(resp.into_inner()).map_err(|e| format!("bad answer: {e}"))
            }
        };
        match r {
            Ok(here) => {
                out.answered = Some(addr);
                out.here = Some(here);
                return out;
            }
            Err(e) => out.failed.push((addr, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use warden_core::detect::straggler::Score;

    #[test]
    fn reports_survive_the_wire_and_bad_ones_name_the_field() {
        let mut sk = Sketch::default();
        sk.add(1e7);
        sk.add(1.3e7);
        let r = Report {
            host: "h".into(),
            relative_threshold: 1.1,
            z_threshold: 3.0,
            jobs: vec![JobReport {
                job: "j".into(),
                sections: vec![("forward".into(), sk)],
                scores: vec![Score {
                    job: "j".into(),
                    rank: 3,
                    host: "h".into(),
                    section: "forward".into(),
                    relative: 1.3,
                    flagged: true,
                    ..Score::default()
                }],
            }],
        };
        let (back, pos, _) = report_from_pb(report_pb(&r, &[], &[])).unwrap();
        assert_eq!(back, r);
        assert!(pos.is_empty());
        let mut bad = report_pb(&r, &[], &[]);
        bad.jobs[0].sections[0].counts.pop();
        let e = report_from_pb(bad).unwrap_err();
        assert!(
            e.contains("jobs[0].sections[0]: 2 keys but 1 counts"),
            "{e}"
        );
        let mut bad = report_pb(&r, &[], &[]);
        bad.jobs[0].sections[0].keys = vec![0; 5000];
        bad.jobs[0].sections[0].counts = vec![1; 5000];
        let e = report_from_pb(bad).unwrap_err();
        assert!(e.contains("5000 bins; at most 4096"), "{e}");
        let mut bad = report_pb(&r, &[], &[]);
        bad.z_threshold = f64::NAN;
        assert!(report_from_pb(bad).unwrap_err().contains("z_threshold"));
        let mut bad = report_pb(&r, &[], &[]);
        bad.jobs.push(bad.jobs[0].clone());
        assert!(report_from_pb(bad).unwrap_err().contains("appears twice"));
    }

    #[test]
    fn compact_rank_lists_round_trip_and_are_bounded() {
        let ranks = vec![0, 1, 2, 5, 7, 8];
        assert_eq!(parse_ranks(&culprit::ranks_list(&ranks)).unwrap(), ranks);
        assert!(parse_ranks("0-4294967295").is_err());
        assert!(parse_ranks("5-2").is_err());
        assert!(parse_ranks("x").is_err());
    }
}
