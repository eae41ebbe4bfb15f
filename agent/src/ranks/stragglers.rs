//! The agent's half of straggler detection: each tick, the ranks' new
//! steps are copied out of the registry under its lock and scored outside
//! it by [`warden_core::detect::straggler::Stragglers`], with the host's
//! CPU facts read from `/proc`.

use std::time::{Instant, SystemTime};

use warden_core::detect::straggler::{HostProbe, LiveRank, Stragglers};
use warden_core::health::HealthModel;
use warden_core::rank::RankState;
use warden_core::signal::Signal;

use super::procfs;
use super::registry::SharedRegistry;

/// One tick of the work loop: the detector's flag changes, for the caller to
/// publish. The registry lock is held only for the copy. `now` and `wall`
/// are the tick's time on the monotonic and the wall clock.
pub fn tick(
    det: &Stragglers,
    registry: &SharedRegistry,
    health: &HealthModel,
    now: Instant,
    wall: SystemTime,
) -> Vec<Signal> {
    let copy = {
        let reg = registry.lock();
        det.copy_out(
            reg.ranks
                .values()
                .filter(|e| matches!(e.state, RankState::Running | RankState::Hung))
                .map(|e| LiveRank {
                    key: &e.key,
                    generation: e.generation,
                    pid: e.pid,
                    local_rank: e.local_rank,
                    devices: &e.devices,
                    samples: &e.straggler,
                }),
        )
    };
    let probe = HostProbe {
        run_delay_ns: &|pid| procfs::schedstat(pid).map(|s| s.run_delay_ns),
        loadavg: &procfs::loadavg,
    };
    det.score(copy, health, &probe, now, wall)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant, SystemTime};

    use super::*;
    use crate::config::Config;
    use crate::ranks::registry::{RegisterRequest, Registry};
    use warden_core::detect::straggler::{Batch, Summary, score};
    use warden_core::events::EventBus;
    use warden_core::events::health_reporter::Reporter;
    use warden_core::health::{ComponentReport, HealthModel, Reason, Status};
    use warden_core::rank::RankKey;

    /// What the work loop hands the detector, without the rest of an agent.
    struct Rig {
        config: Config,
        registry: SharedRegistry,
        health: Reporter,
        det: Stragglers,
    }

    fn agent(edit: impl FnOnce(&mut Config)) -> (tempfile::TempDir, Rig) {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.api.socket = dir.path().join("w.sock").display().to_string();
        cfg.agent.state_dir = dir.path().join("state").display().to_string();
        cfg.agent.host_name = "host-a".into();
        edit(&mut cfg);
        let registry =
            Registry::new(&cfg.slot_dir(), &cfg.state_dir(), cfg.ranks.max_ranks).unwrap();
        let rig = Rig {
            registry: SharedRegistry::new(registry),
            health: Reporter {
                model: Arc::new(HealthModel::new()),
                events: Arc::new(EventBus::new(cfg.events.retain)),
            },
            det: Stragglers::new(cfg.straggler.clone(), cfg.host_name()),
            config: cfg,
        };
        (dir, rig)
    }

    /// One tick of the work loop's driver: the detector's flag changes published.
    fn tick(rig: &Rig, now: Instant) {
        for signal in super::tick(
            &rig.det,
            &rig.registry,
            &rig.health.model,
            now,
            SystemTime::now(),
        ) {
            rig.health.events.publish(signal);
        }
    }

    fn register(state: &Rig, job: &str, rank: u32) {
        state
            .registry
            .lock()
            .register(
                &RegisterRequest {
                    host: "host-a".into(),
                    ..RegisterRequest::for_test(job, rank, 64)
                },
                0,
            )
            .unwrap();
    }

    /// Pushes `steps` steps into each rank: forward 10 ms x its factor.
    fn feed(state: &Rig, job: &str, factors: &[f64], steps: usize) {
        let mut reg = state.registry.lock();
        for (rank, f) in factors.iter().enumerate() {
            let key = RankKey {
                job: job.into(),
                rank: rank as u32,
            };
            let e = reg.ranks.get_mut(&key).unwrap();
            for i in 0..steps {
                // A little deterministic spread, as real timers have.
                let fwd = (10e6 * f * (1.0 + 0.002 * (i % 3) as f64)) as u64;
                e.straggler.push_step(
                    fwd + 8_000_000,
                    [("forward", fwd), ("allreduce", 5_000_000)],
                );
            }
        }
    }

    fn kinds(state: &Rig, kind: &str) -> Vec<Arc<warden_core::events::Event>> {
        state
            .health
            .events
            .list(0, 0)
            .0
            .into_iter()
            .filter(|e| e.kind == kind)
            .collect()
    }

    #[test]
    fn the_driver_flags_explains_and_clears() {
        let (_dir, state) = agent(|_| {});
        for r in 0..4 {
            register(&state, "j", r);
        }
        state.health.apply(ComponentReport {
            id: "gpu2".into(),
            kind: "gpu".into(),
            labels: [("temperature".to_owned(), "92 C".to_owned())].into(),
            status_override: None,
            reasons: vec![Reason {
                status: Status::Degraded,
                kind: warden_core::health::ReasonKind::Judged,
                signal: "clocks.event_reasons".into(),
                value: "0x40".into(),
                threshold: String::new(),
                window: String::new(),
                since: SystemTime::now(),
                message: "clocks held down".into(),
            }],
        });
        let factors = [1.0, 1.0, 1.3, 1.0];
        let now = Instant::now();
        // min_steps (10) first, then windows every 5 steps: flagged on the
        // second window over.
        feed(&state, "j", &factors, 10);
        tick(&state, now);
        assert!(kinds(&state, "rank.straggler").is_empty());
        feed(&state, "j", &factors, 5);
        tick(&state, now);
        let flagged = kinds(&state, "rank.straggler");
        assert_eq!(flagged.len(), 1);
        let ev = &flagged[0];
        assert_eq!(ev.subject, "job/j/rank/2");
        let get = |k: &str| {
            ev.evidence
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        assert_eq!(get("section"), "forward");
        assert_eq!(get("relative"), "1.30");
        assert_eq!(get("devices"), "gpu2");
        assert_eq!(get("cause_class"), "correctable_hardware");
        assert_eq!(get("gpu_temperature"), "gpu2 92 C");
        assert!(
            get("explanation").starts_with(
                "rank 2 is 30% slower in forward; gpu2 reports HW thermal slowdown (clocks.event_reasons)"
            ),
            "{}",
            get("explanation")
        );
        for k in ["individual", "samples", "job_median", "rank_median"] {
            assert!(!get(k).is_empty(), "{k}");
        }
        let det = &state.det;
        let (scores, hosts) = det.scores("", true, now);
        assert_eq!(hosts, ["host-a"]);
        assert_eq!(scores.len(), 1);
        assert_eq!((scores[0].rank, scores[0].flagged), (2, true));
        assert!(scores[0].flagged_since.is_some());

        // Back to normal: cleared after three windows under.
        let fast = [1.0; 4];
        feed(&state, "j", &fast, 10);
        tick(&state, now);
        let (scores, _) = det.scores("j", true, now);
        assert!(
            scores[0]
                .explanation
                .starts_with("rank 2 is 30% slower in forward"),
            "while clearing down, the reason it was flagged for stays: {}",
            scores[0].explanation
        );
        for _ in 0..2 {
            feed(&state, "j", &fast, 10);
            tick(&state, now);
        }
        let cleared = kinds(&state, "rank.straggler_cleared");
        assert_eq!(cleared.len(), 1, "{cleared:?}");
        assert!(det.scores("j", true, now).0.is_empty());
    }

    #[test]
    fn peers_summaries_make_the_comparison_job_wide() {
        let (_dir, state) = agent(|_| {});
        register(&state, "j", 0);
        register(&state, "j", 1);
        let now = Instant::now();
        // Two local ranks, one slower from the start: too few to compare.
        for _ in 0..6 {
            feed(&state, "j", &[1.0, 1.3], 5);
            tick(&state, now);
        }
        assert!(kinds(&state, "rank.straggler").is_empty());
        // Two more ranks on host-b, as fast as rank 0: rank 1 stands out.
        let det = &state.det;
        let remote = |rank| Summary {
            job: "j".into(),
            rank,
            sections: vec![score::SectionMedian {
                section: "forward".into(),
                median_ns: 10e6,
                samples: 40,
            }],
            window_seq: 9,
            score: None,
        };
        det.merge_remote(
            Batch {
                host: "host-b".into(),
                ranks: vec![remote(2), remote(3)],
            },
            now,
        );
        for _ in 0..2 {
            feed(&state, "j", &[1.0, 1.3], 5);
            tick(&state, now);
        }
        let flagged = kinds(&state, "rank.straggler");
        assert_eq!(flagged.len(), 1);
        assert_eq!(flagged[0].subject, "job/j/rank/1");
        let (scores, hosts) = det.scores("j", false, now);
        assert_eq!(hosts, ["host-a", "host-b"]);
        let by_host: Vec<(u32, &str)> = scores.iter().map(|s| (s.rank, s.host.as_str())).collect();
        assert_eq!(
            by_host,
            [(0, "host-a"), (1, "host-a"), (2, "host-b"), (3, "host-b")]
        );
        assert_eq!(scores[1].ranks_compared, 4);
        // Our summaries carry our verdict for the peers.
        let out = det.outbox(now);
        assert_eq!(out.host, "host-a");
        assert!(out.ranks[1].score.as_ref().is_some_and(|s| s.flagged));
        // A peer that goes quiet is forgotten after summary_ttl.
        let later = now + state.config.straggler.summary_ttl + Duration::from_secs(1);
        assert_eq!(det.scores("j", false, later).1, ["host-a"]);
    }

    #[test]
    fn a_rank_that_stops_stepping_leaves_the_comparison() {
        let (_dir, state) = agent(|_| {});
        register(&state, "j", 0);
        register(&state, "j", 1);
        let t0 = Instant::now();
        let at = |i: u64| t0 + Duration::from_millis(100 * i);
        // min_steps first, then both ranks alike for a few windows.
        feed(&state, "j", &[1.0, 1.0], 5);
        for i in 0..6 {
            feed(&state, "j", &[1.0, 1.0], 5);
            tick(&state, at(i));
        }
        // Rank 0 stops (stopped, hung, in a long checkpoint); rank 1 goes on,
        // 15% slower than before, as the whole job would once rank 0 is back.
        // Against rank 0's old medians it would look 7% slower than the job
        // and 15% slower than its best: two windows of that would flag it.
        let one = RankKey {
            job: "j".into(),
            rank: 1,
        };
        for i in 6..12 {
            {
                let mut reg = state.registry.lock();
                let e = reg.ranks.get_mut(&one).unwrap();
                for _ in 0..10 {
                    e.straggler.push_step(
                        19_500_000,
                        [("forward", 11_500_000), ("allreduce", 5_000_000)],
                    );
                }
            }
            tick(&state, at(i));
        }
        assert!(
            kinds(&state, "rank.straggler").is_empty(),
            "{:?}",
            kinds(&state, "rank.straggler")
        );
        let det = &state.det;
        let (scores, _) = det.scores("j", false, at(12));
        let one = scores.iter().find(|s| s.rank == 1).unwrap();
        assert_eq!(
            one.ranks_compared, 1,
            "rank 0's old window no longer counts"
        );
        assert!(
            det.outbox(at(12)).ranks.iter().all(|r| r.rank != 0),
            "nor is it sent to peers"
        );
    }
}
