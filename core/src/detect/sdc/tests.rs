use super::*;
use crate::detect::straggler::sim::Rng;

/// A simulated data-parallel job: per step, a loss curve each rank sees
/// through its own data (5% noise per rank), and a gradient norm that moves
/// 25% from step to step (log-normal) and that every rank shares after the
/// all-reduce, up to rounding. Ranks report in a shuffled order, some a
/// tick late, as the agent's scan would see them.
struct Sim {
    rng: Rng,
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
            rng: Rng::new(seed),
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
            out.extend(self.det.judge());
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
    let found = det.judge();
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
    assert!(det.judge().is_empty());
    // A rank alone: nothing to compare with, a NaN is still a NaN.
    det.observe("solo", 0, 1, 1, None, Some(f64::NAN));
    assert_eq!(det.judge()[0].basis, Basis::NonFiniteAlone);
}

#[test]
fn a_step_waits_for_its_ranks_then_for_the_lag_only() {
    let mut det = SdcDetector::new(SdcConfig::default());
    det.observe("j", 0, 1, 1, Some(1.0), None);
    det.observe("j", 1, 1, 1, Some(1.0), None);
    det.observe("j", 2, 1, 1, Some(1.0), None);
    assert!(det.judge().is_empty());
    // Rank 2 falls silent; rank 1 goes NaN at step 2: judged once the job is
    // past the lag without rank 2.
    det.observe("j", 0, 1, 2, Some(1.0), None);
    det.observe("j", 1, 1, 2, Some(f64::NAN), None);
    assert!(det.judge().is_empty(), "waits for rank 2");
    for s in 3..=10 {
        det.observe("j", 0, 1, s, Some(1.0), None);
        det.observe("j", 1, 1, s, Some(1.0), None);
    }
    let found = det.judge();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].rank, found[0].step), (1, 2));
    // Re-read records are ignored; a new generation starts steps afresh.
    det.observe("j", 1, 1, 2, Some(f64::NAN), None);
    assert!(det.judge().is_empty());
    det.observe("j", 0, 2, 2, Some(1.0), None);
    det.observe("j", 1, 2, 2, Some(f64::NAN), None);
    det.observe("j", 2, 2, 2, Some(1.0), None);
    let found = det.judge();
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
