use super::*;
use crate::detect::straggler::sim::SimRng;
use std::time::Instant;

/// A simulated data-parallel job: per step, a loss curve each rank sees
/// through its own data (5% noise per rank), and a gradient norm that moves
/// 25% from step to step (log-normal) and that every rank shares after the
/// all-reduce, up to rounding. Ranks report in a shuffled order, some a
/// tick late, as the agent's scan would see them.
struct Sim {
    rng: SimRng,
    ranks: u32,
    det: SdcDetector,
    /// (rank, from step, factor on its gradient norm)
    corrupt: Option<(u32, u64, f64)>,
    /// Per rank, reports not yet delivered (oldest first).
    queued: Vec<Vec<(u64, f64, f64)>>,
}

impl Sim {
    fn new(seed: u64, ranks: u32) -> Self {
        Self {
            rng: SimRng::new(seed),
            ranks,
            det: SdcDetector::new(SdcConfig::default()),
            corrupt: None,
            queued: vec![Vec::new(); ranks as usize],
        }
    }

    /// Runs steps `from..to`; returns every finding.
    fn run(&mut self, from: u64, to: u64) -> Vec<SdcFinding> {
        let mut out = Vec::new();
        for step in from..to {
            let t = step as f64;
            let loss = 2.0 * (-t / 3000.0).exp() + 0.5;
            let grad = (1.0 + 0.5 * (-t / 2000.0).exp()) * (0.25 * self.rng.normal()).exp();
            for rank in 0..self.ranks {
                let l = loss * (1.0 + 0.05 * self.rng.normal());
                let mut g = grad * (1.0 + 1e-7 * self.rng.normal());
                if let Some((r, s, f)) = self.corrupt
                    && r == rank
                    && step >= s
                {
                    g *= f;
                }
                self.queued[rank as usize].push((step, l, g));
            }
            // Ranks are read in a shuffled order; a rank's records in order,
            // one in five a tick late.
            let mut order: Vec<u32> = (0..self.ranks).collect();
            for i in (1..order.len()).rev() {
                let j = (self.rng.next_u64() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
            for rank in order {
                if self.rng.uniform() < 0.2 {
                    continue;
                }
                for (s, l, g) in std::mem::take(&mut self.queued[rank as usize]) {
                    self.det.observe("job", rank, 1, s, Some(l), Some(g));
                }
            }
            out.extend(self.det.judge(Instant::now()));
        }
        out
    }
}

#[test]
fn ten_thousand_clean_steps_flag_nothing() {
    for (seed, ranks) in [(1, 2), (2, 2), (3, 3), (4, 8), (5, 16)] {
        let mut sim = Sim::new(seed, ranks);
        let found = sim.run(0, 10_000);
        assert!(
            found.is_empty(),
            "seed {seed}, {ranks} ranks: {} false flags, first {:?}",
            found.len(),
            found.first()
        );
    }
}

#[test]
fn a_corrupted_rank_among_many_is_flagged_at_the_first_bad_step() {
    let mut sim = Sim::new(7, 8);
    assert!(sim.run(0, 200).is_empty());
    sim.corrupt = Some((3, 200, 10.0));
    let found = sim.run(200, 300);
    assert_eq!(found.len(), 1, "reported once: {found:?}");
    let f = &found[0];
    assert_eq!(
        (f.rank, f.step, f.metric, f.basis),
        (3, 200, Metric::GradNorm, Basis::Peers)
    );
    assert_eq!(f.ranks, 8);
    assert!(f.score.unwrap() > 100.0);
    let med = f.job_median.unwrap();
    assert!((f.value / med - 10.0).abs() < 0.01, "{f:?}");
}

#[test]
fn with_two_ranks_the_one_that_jumped_is_flagged() {
    for (seed, bad) in [(11, 1), (12, 0)] {
        let mut sim = Sim::new(seed, 2);
        assert!(sim.run(0, 100).is_empty());
        sim.corrupt = Some((bad, 100, 8.0));
        let found = sim.run(100, 200);
        assert_eq!(found.len(), 1, "seed {seed}: {found:?}");
        let f = &found[0];
        assert_eq!((f.rank, f.step, f.basis), (bad, 100, Basis::OwnHistory));
        assert!(f.own_median.is_some() && f.score.unwrap() >= 12.0, "{f:?}");
    }
}

#[test]
fn non_finite_values_on_some_ranks_are_flagged_on_all_they_are_not() {
    let mut det = SdcDetector::new(SdcConfig::default());
    det.observe("j", 0, 1, 5, Some(1.0), Some(2.0));
    det.observe("j", 1, 1, 5, Some(f64::NAN), Some(2.0));
    let found = det.judge(Instant::now());
    assert_eq!(found.len(), 1);
    let f = &found[0];
    assert_eq!(
        (f.rank, f.step, f.metric, f.basis),
        (1, 5, Metric::Loss, Basis::NonFinite)
    );
    assert!(f.value.is_nan() && f.job_median == Some(1.0) && f.score.is_none());
    // Every rank diverged: the model, not a device.
    det.observe("j", 0, 1, 6, Some(f64::INFINITY), None);
    det.observe("j", 1, 1, 6, Some(f64::NAN), None);
    assert!(det.judge(Instant::now()).is_empty());
    // A rank alone: nothing to compare with, a NaN is still a NaN.
    det.observe("solo", 0, 1, 1, None, Some(f64::NAN));
    assert_eq!(det.judge(Instant::now())[0].basis, Basis::NonFiniteAlone);
}

#[test]
fn a_step_waits_for_its_ranks_then_for_the_lag_only() {
    let mut det = SdcDetector::new(SdcConfig::default());
    det.observe("j", 0, 1, 1, Some(1.0), None);
    det.observe("j", 1, 1, 1, Some(1.0), None);
    det.observe("j", 2, 1, 1, Some(1.0), None);
    assert!(det.judge(Instant::now()).is_empty());
    // Rank 2 falls silent; rank 1 goes NaN at step 2: judged once the job is
    // past the lag without rank 2.
    det.observe("j", 0, 1, 2, Some(1.0), None);
    det.observe("j", 1, 1, 2, Some(f64::NAN), None);
    assert!(det.judge(Instant::now()).is_empty(), "waits for rank 2");
    for s in 3..=10 {
        det.observe("j", 0, 1, s, Some(1.0), None);
        det.observe("j", 1, 1, s, Some(1.0), None);
    }
    let found = det.judge(Instant::now());
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].rank, found[0].step), (1, 2));
    // Re-read records are ignored; a new generation starts steps afresh.
    det.observe("j", 1, 1, 2, Some(f64::NAN), None);
    assert!(det.judge(Instant::now()).is_empty());
    det.observe("j", 0, 2, 2, Some(1.0), None);
    det.observe("j", 1, 2, 2, Some(f64::NAN), None);
    det.observe("j", 2, 2, 2, Some(1.0), None);
    let found = det.judge(Instant::now());
    assert_eq!(found.len(), 1, "clean since, so reported again: {found:?}");
    assert_eq!((found[0].rank, found[0].step), (1, 2));
}

#[test]
fn config_is_validated() {
    assert!(SdcConfig::default().validate("t").is_ok());
    let bad = SdcConfig {
        min_history: 40,
        ..SdcConfig::default()
    };
    assert!(bad.validate("t").is_err());
    let bad = SdcConfig {
        z_threshold: f64::NAN,
        ..SdcConfig::default()
    };
    assert!(bad.validate("t").is_err());
}

/// A job over `hosts` hosts of `per` ranks each: every host's detector
/// reports to one aggregator (in host order, as the exchange would within
/// an interval), and each host judges its own ranks from the answer.
struct Fleet {
    hosts: Vec<SdcDetector>,
    agg: aggregate::SdcAggregator,
    per: u32,
    hosts_n: u32,
    t0: Instant,
}

impl Fleet {
    fn new(hosts: u32, per: u32) -> Self {
        Self {
            hosts: (0..hosts)
                .map(|_| SdcDetector::new(SdcConfig::default()))
                .collect(),
            agg: aggregate::SdcAggregator::new(std::time::Duration::from_secs(60), 8),
            per,
            hosts_n: hosts,
            t0: Instant::now(),
        }
    }

    /// Every rank's values at `step` from `value(rank)`; then two rounds
    /// of reports (the first settles the step, the second carries the
    /// answer). Returns the findings with the reporting host, and the
    /// largest answer a host got (steps x values named).
    fn step(
        &mut self,
        step: u64,
        value: impl Fn(u32) -> (Option<f64>, Option<f64>),
    ) -> (Vec<(usize, SdcFinding)>, usize) {
        for (h, det) in self.hosts.iter_mut().enumerate() {
            for i in 0..self.per {
                let rank = h as u32 * self.per + i;
                let (l, g) = value(rank);
                det.observe("job", rank, 1, step, l, g);
            }
        }
        let mut out = Vec::new();
        let mut largest = 0;
        for _ in 0..2 {
            for (h, det) in self.hosts.iter_mut().enumerate() {
                let mut report = det.report();
                for j in &mut report {
                    j.world = self.hosts_n * self.per;
                }
                let answer = self.agg.report(&format!("h{h}"), report, self.t0).unwrap();
                let size: usize = answer
                    .iter()
                    .flat_map(|j| &j.steps)
                    .flat_map(|s| s.metrics.iter().flatten())
                    .map(|m| 1 + m.lowest.len() + m.highest.len() + m.non_finite_at.len())
                    .sum();
                largest = largest.max(size);
                out.extend(det.take_answer(answer).into_iter().map(|f| (h, f)));
            }
        }
        (out, largest)
    }
}

#[test]
fn one_rank_departing_among_many_hosts_is_flagged_by_its_owner_only() {
    // 200 hosts x 8 ranks: past the exact range, so the sketch's median.
    let mut f = Fleet::new(200, 8);
    let mut rng = SimRng::new(3);
    let noise: Vec<f64> = (0..1600).map(|_| 0.05 * rng.normal()).collect();
    let clean = |s: u64| move |r: u32| (Some(2.0 * (1.0 + noise_at(r, s))), Some(3.0));
    fn noise_at(r: u32, s: u64) -> f64 {
        (f64::from(r) * 0.37 + s as f64 * 0.11).sin() * 0.05
    }
    let _ = noise;
    for s in 0..20 {
        let (found, _) = f.step(s, clean(s));
        assert!(found.is_empty(), "step {s}: {found:?}");
    }
    let (found, largest) = f.step(20, |r| {
        let (l, g) = clean(20)(r);
        (l, if r == 1234 { g.map(|g| g * 10.0) } else { g })
    });
    assert_eq!(found.len(), 1, "{found:?}");
    let (host, fd) = &found[0];
    assert_eq!(*host, 1234 / 8, "the owner reports it");
    assert_eq!(
        (fd.rank, fd.step, fd.metric, fd.basis),
        (1234, 20, Metric::GradNorm, Basis::Peers)
    );
    assert_eq!(fd.ranks, 1600);
    let med = fd.job_median.unwrap();
    assert!((med - 3.0).abs() <= 3.0 * sketch::ALPHA, "{med}");
    // What a host is answered does not grow with the job: one step, two
    // metrics, each with its counts and at most 3 x EXTREMES values.
    assert!(largest <= 2 * (1 + 3 * aggregate::EXTREMES), "{largest}");
    // The aggregator named the rank among the highest.
    let w = f.agg.report("h0", f.hosts[0].report(), f.t0).unwrap();
    assert!(w[0].steps.is_empty(), "h0 has nothing pending: {w:?}");
}

#[test]
fn a_non_finite_value_on_one_host_is_flagged_there_and_everywhere_is_not() {
    let mut f = Fleet::new(3, 2);
    let (found, _) = f.step(1, |r| (Some(if r == 4 { f64::NAN } else { 1.0 }), None));
    assert_eq!(found.len(), 1, "{found:?}");
    let (host, fd) = &found[0];
    assert_eq!((*host, fd.rank, fd.basis), (2, 4, Basis::NonFinite));
    assert_eq!((fd.job_median, fd.ranks), (Some(1.0), 6));
    // Every rank non-finite: the model diverged, nobody is flagged.
    let (found, _) = f.step(2, |_| (Some(f64::INFINITY), None));
    assert!(found.is_empty(), "{found:?}");
}

#[test]
fn two_ranks_on_two_hosts_the_one_that_jumped_is_flagged_by_its_owner() {
    for bad in [0u32, 1] {
        let mut f = Fleet::new(2, 1);
        let mut rng = SimRng::new(11 + u64::from(bad));
        for s in 0..60 {
            let g = (0.25 * rng.normal()).exp();
            let (found, _) = f.step(s, |_| (None, Some(g)));
            assert!(found.is_empty(), "step {s}: {found:?}");
        }
        let (found, _) = f.step(60, |r| (None, Some(if r == bad { 40.0 } else { 1.0 })));
        assert_eq!(found.len(), 1, "{found:?}");
        let (host, fd) = &found[0];
        assert_eq!(
            (*host, fd.rank, fd.basis),
            (bad as usize, bad, Basis::OwnHistory)
        );
        assert!(
            fd.own_median.is_some() && fd.score.unwrap() >= 12.0,
            "{fd:?}"
        );
    }
}

#[test]
fn a_hostile_report_is_bounded_or_refused_and_changes_nothing_when_refused() {
    let t0 = Instant::now();
    let mut a = aggregate::SdcAggregator::new(std::time::Duration::from_secs(60), 8);
    let rank = |rank: u32, steps: std::ops::Range<u64>| aggregate::RankValues {
        rank,
        generation: 1,
        steps: steps
            .map(|step| aggregate::StepValue {
                step,
                values: [Some(step as f64), Some(1.0)],
                departs_own: [false, false],
            })
            .collect(),
    };
    let job = |name: &str, ranks: Vec<aggregate::RankValues>| aggregate::JobValues {
        job: name.into(),
        active: 1_000_000,
        world: 0,
        ranks,
    };
    // 10,000 distinct steps in one report: at most MAX_OPEN_STEPS stay
    // open, at most MAX_SETTLED settled, and the answer names only what
    // was settled of what was asked.
    let w = a
        .report("h", vec![job("j", vec![rank(0, 0..10_000)])], t0)
        .unwrap();
    assert!(a.open_steps("j") <= aggregate::MAX_OPEN_STEPS);
    assert!(
        w[0].steps.len() <= aggregate::MAX_SETTLED,
        "{}",
        w[0].steps.len()
    );
    // A rank claiming step u64::MAX settles what is open (stale), and the
    // other ranks' later steps are still taken and settled.
    a.report(
        "h",
        vec![job("j", vec![rank(1, u64::MAX - 1..u64::MAX)])],
        t0,
    )
    .unwrap();
    assert_eq!(a.open_steps("j"), 1, "only the claimed step stays open");
    // Extremes stay bounded however many ranks give a step.
    let many: Vec<aggregate::RankValues> = (10..5_000).map(|r| rank(r, 20_000..20_001)).collect();
    let w = a.report("h2", vec![job("k", many)], t0).unwrap();
    assert!(w[0].steps.is_empty(), "waits for its million active ranks");
    for _ in 0..aggregate::MAX_OPEN_STEPS {
        // Crowding settles the oldest open step.
        let s = 30_000 + a.open_steps("k") as u64;
        a.report("h2", vec![job("k", vec![rank(7, s..s + 1)])], t0)
            .unwrap();
    }
    let many: Vec<aggregate::RankValues> = (10..5_000).map(|r| rank(r, 20_000..20_001)).collect();
    let w = a.report("h2", vec![job("k", many)], t0).unwrap();
    let m = w[0].steps[0].metrics[0].as_ref().unwrap();
    assert_eq!(m.count, 4_990);
    assert!(m.lowest.len() <= aggregate::EXTREMES && m.highest.len() <= aggregate::EXTREMES);
    // Past MAX_JOBS: refused, naming the limit, and nothing kept.
    for i in a.jobs()..aggregate::MAX_JOBS {
        a.report("h", vec![job(&format!("x{i}"), vec![])], t0)
            .unwrap();
    }
    let err = a
        .report("h", vec![job("one-too-many", vec![rank(0, 0..1)])], t0)
        .unwrap_err();
    assert!(err.to_string().contains("1024 jobs"), "{err}");
    assert_eq!(a.jobs(), aggregate::MAX_JOBS);
    assert_eq!(a.ranks_of("one-too-many"), 0);
}

#[test]
fn two_ranks_judged_in_one_late_batch_still_flag_the_one_that_jumped() {
    // A host whose exchange runs every 2 s sees a whole short job before
    // the first answer: the histories are built as the steps are judged,
    // in order, within the batch.
    let mut det = SdcDetector::new(SdcConfig::default());
    let mut rng = SimRng::new(5);
    for s in 0..60u64 {
        let g = (0.25 * rng.normal()).exp();
        det.observe("j", 0, 1, s, None, Some(g));
        det.observe(
            "j",
            1,
            1,
            s,
            None,
            Some(if s >= 30 { 100.0 * g } else { g }),
        );
    }
    let found = det.judge(Instant::now());
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0].rank, found[0].step, found[0].basis),
        (1, 30, Basis::OwnHistory)
    );
}
