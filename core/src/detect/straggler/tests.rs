//! The detector on a seeded simulated job: the benchmark's two criteria
//! (smaller than the bench, so it runs in seconds in debug builds). The
//! driver against a real registry and event bus is tested in the agent
//! (`warden_agent::ranks::stragglers`).

use super::sim::{Jitter, SimJob};
use super::*;

/// 1,024 ranks for 2,000 steps with 3% jitter drawn by `model`: no flag.
fn no_flags(model: Jitter, seed: u64) {
    let cfg = StragglerConfig::default();
    let mut job = SimJob::new(&cfg, 1024, 0.03, model, seed);
    let changes = job.run(2_000);
    assert!(
        changes.is_empty(),
        "{model:?}: {} flag changes, first {:?} ({} rank-windows over)",
        changes.len(),
        changes.first(),
        job.over_windows
    );
}

#[test]
fn no_rank_is_flagged_under_three_percent_jitter_per_section() {
    no_flags(Jitter::PerSection, 1);
}

#[test]
fn no_rank_is_flagged_under_three_percent_step_jitter() {
    no_flags(Jitter::PerStep, 2);
}

#[test]
fn a_rank_ten_percent_slower_is_flagged_within_twenty_steps() {
    let cfg = StragglerConfig::default();
    let mut job = SimJob::new(&cfg, 1024, 0.03, Jitter::PerSection, 7);
    assert!(job.run(40).is_empty());
    // Onsets at every phase of the scoring stride, on different ranks.
    for (i, rank) in [17u32, 300, 511, 780, 1023].into_iter().enumerate() {
        for _ in 0..=i {
            job.run_step();
        }
        job.slow[rank as usize] = 1.10;
        let took = job.steps_to_flag(rank, 100);
        assert!(
            took.is_some_and(|s| s <= 20),
            "rank {rank} (onset at step {}): flagged after {took:?} steps",
            job.step
        );
        job.slow[rank as usize] = 1.0;
    }
}

#[test]
fn a_rank_slow_from_its_first_step_is_flagged_by_step_twenty() {
    let cfg = StragglerConfig::default();
    let mut job = SimJob::new(&cfg, 1024, 0.03, Jitter::PerSection, 11);
    job.slow[42] = 1.10;
    let took = job.steps_to_flag(42, 100);
    assert!(took.is_some_and(|s| s <= 20), "{took:?}");
}

// ------------------------------------------------------------------ driver
