//! The straggler detector against the simulation criteria, with
//! its baselines measured in the same run (docs/benchmarks.md):
//!
//! 1. 1,024 simulated ranks with 3% jitter on every compute section, for
//!    10,000 steps: no rank may be flagged (both jitter models: one factor
//!    per section, or one per step for all its sections).
//! 2. A rank 10% slower, from a random step at a random phase of the
//!    scoring stride: flagged within 20 steps (and a rank slow from its
//!    first step).
//! 3. One scoring window over 1,024 ranks: under 1 ms. Beside it: a naive
//!    scorer that allocates and fully sorts (same verdicts), and the cost of
//!    merely copying the inputs out (what the agent does under the lock).
//!
//! `cargo bench -p warden-cli --bench stragglers` (release); add
//! `-- flags`, `-- margin`, `-- detect` or `-- timing` to run one part.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use warden_core::detect::straggler::StragglerConfig;
use warden_core::detect::straggler::samples::RankSamples;
use warden_core::detect::straggler::sim::{Jitter, SECTIONS, SimJob, SimRng};

const RANKS: usize = 1024;
const STEPS: u64 = 10_000;
const JITTER: f64 = 0.03;

fn median_of(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The baseline: the same statistics, written the obvious way (a vector per
/// median, full sorts). Returns the ranks over the thresholds.
fn naive_window(samples: &[RankSamples], cfg: &StragglerConfig) -> Vec<u32> {
    let w = cfg.window_steps;
    let mut per_section: Vec<Vec<f64>> = vec![Vec::new(); SECTIONS.len()];
    let mut rank_medians: Vec<Vec<f64>> = Vec::new();
    for s in samples {
        let mut mine = Vec::new();
        for (i, (name, _)) in SECTIONS.iter().enumerate() {
            let idx = s.names().iter().position(|n| n == name).unwrap();
            let vals: Vec<f64> = s
                .rows()
                .iter()
                .rev()
                .take(w)
                .map(|r| r.ns[idx] as f64)
                .collect();
            let m = median_of(vals);
            per_section[i].push(m);
            mine.push(m);
        }
        rank_medians.push(mine);
    }
    let stats: Vec<(f64, f64)> = per_section
        .into_iter()
        .map(|v| {
            let med = median_of(v.clone());
            let mad = median_of(v.iter().map(|x| (x - med).abs()).collect());
            (med, (1.4826 * mad).max(0.01 * med))
        })
        .collect();
    let mut over = Vec::new();
    for (r, mine) in rank_medians.iter().enumerate() {
        let hit = mine.iter().zip(&stats).any(|(m, (med, sigma))| {
            m / med >= cfg.relative_threshold && (m - med) / sigma >= cfg.z_threshold
        });
        if hit {
            over.push(r as u32);
        }
    }
    over
}

fn time_median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[runs / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let part = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
    let cfg = StragglerConfig::default();
    println!(
        "straggler detector: window {} steps every {}, min_steps {}, relative >= {}, robust z >= {}, flag after {} windows, clear after {}",
        cfg.window_steps,
        cfg.stride_steps,
        cfg.min_steps,
        cfg.relative_threshold,
        cfg.z_threshold,
        cfg.flag_after,
        cfg.clear_after
    );

    if part("flags") {
        false_flags(&cfg);
    }
    if part("margin") {
        margin(&cfg);
    }
    if part("detect") {
        detection(&cfg);
    }
    if part("timing") {
        timing(&cfg);
    }
}

fn false_flags(cfg: &StragglerConfig) {
    println!(
        "\n1. {RANKS} ranks, {}% jitter, {STEPS} steps, no slow rank",
        JITTER * 100.0
    );
    println!(
        "| jitter model | flags | rank-windows over the thresholds | of rank-windows | wall |"
    );
    println!("|---|---|---|---|---|");
    for (model, seed) in [(Jitter::PerSection, 101), (Jitter::PerStep, 202)] {
        let start = Instant::now();
        let mut job = SimJob::new(cfg, RANKS, JITTER, model, seed);
        let changes = job.run(STEPS);
        let windows = (STEPS / cfg.stride_steps as u64) * RANKS as u64;
        println!(
            "| {model:?} | {} | {} | {windows} | {:.1}s |",
            changes.iter().filter(|c| c.flagged).count(),
            job.over_windows,
            start.elapsed().as_secs_f64()
        );
    }
}

/// How much noisier than 3% a job may be before the defaults flag anyone.
fn margin(cfg: &StragglerConfig) {
    println!("\nmargin: the same {RANKS} ranks and {STEPS} steps (per-section jitter), noisier");
    println!("| jitter | flags | rank-windows over the thresholds |");
    println!("|---|---|---|");
    for (jitter, seed) in [(0.04, 601), (0.05, 602), (0.06, 603)] {
        let mut job = SimJob::new(cfg, RANKS, jitter, Jitter::PerSection, seed);
        let changes = job.run(STEPS);
        println!(
            "| {}% | {} | {} |",
            jitter * 100.0,
            changes.iter().filter(|c| c.flagged).count(),
            job.over_windows
        );
    }
}

fn detection(cfg: &StragglerConfig) {
    println!(
        "\n2. a rank 10% slower ({RANKS} ranks, {}% jitter)",
        JITTER * 100.0
    );
    println!("| onset | trials | steps to flag: min | median | max | missed (100 steps) |");
    println!("|---|---|---|---|---|---|");
    let mut rng = SimRng::new(7);
    for (label, model) in [
        ("mid-run, per-section jitter", Jitter::PerSection),
        ("mid-run, per-step jitter", Jitter::PerStep),
    ] {
        let mut job = SimJob::new(cfg, RANKS, JITTER, model, 303);
        job.run(100);
        let mut took = Vec::new();
        let mut missed = 0;
        for _ in 0..40 {
            let extra = rng.next_u64() % 13;
            for _ in 0..extra {
                job.run_step();
            }
            let rank = (rng.next_u64() % RANKS as u64) as usize;
            job.slow[rank] = 1.10;
            match job.steps_to_flag(rank as u32, 100) {
                Some(s) => took.push(s),
                None => missed += 1,
            }
            job.slow[rank] = 1.0;
            // Let it clear before the next trial.
            job.run(40);
        }
        took.sort_unstable();
        println!(
            "| {label} | {} | {} | {} | {} | {missed} |",
            took.len() + missed,
            took.first().copied().unwrap_or(0),
            took.get(took.len() / 2).copied().unwrap_or(0),
            took.last().copied().unwrap_or(0)
        );
    }
    let mut took = Vec::new();
    for seed in 0..10u64 {
        let mut job = SimJob::new(cfg, RANKS, JITTER, Jitter::PerSection, 400 + seed);
        job.slow[(seed * 97 % RANKS as u64) as usize] = 1.10;
        took.push(job.steps_to_flag((seed * 97 % RANKS as u64) as u32, 100));
    }
    let found: Vec<u64> = took.iter().flatten().copied().collect();
    println!(
        "| from the rank's first step | {} | {} | {} | {} | {} |",
        took.len(),
        found.iter().min().unwrap_or(&0),
        {
            let mut f = found.clone();
            f.sort_unstable();
            f.get(f.len() / 2).copied().unwrap_or(0)
        },
        found.iter().max().unwrap_or(&0),
        took.len() - found.len()
    );
}

fn timing(cfg: &StragglerConfig) {
    let mut job = SimJob::new(cfg, RANKS, JITTER, Jitter::PerSection, 505);
    job.slow[3] = 1.10;
    job.run(64);
    let runs = 301;
    let mut changes = Vec::new();
    let ours = time_median(runs, || {
        changes.clear();
        job.score(black_box(&mut changes));
    });
    let samples: Vec<RankSamples> = job.samples().to_vec();
    let naive_over = naive_window(&samples, cfg);
    let naive = time_median(runs, || {
        black_box(naive_window(black_box(&samples), cfg));
    });
    let mut rows = Vec::with_capacity(RANKS * cfg.window_steps);
    let copy = time_median(runs, || {
        rows.clear();
        for s in black_box(job.samples()) {
            rows.extend(s.rows().iter().rev().take(cfg.window_steps).copied());
        }
        black_box(&rows);
    });
    println!("\n3. one scoring window, {RANKS} ranks x 3 compute sections (median of {runs})");
    println!("| scorer | time |");
    println!("|---|---|");
    println!(
        "| warden: window medians on the stack, job median and MAD by selection, scratch reused | {:.0} us |",
        ours.as_secs_f64() * 1e6
    );
    println!(
        "| baseline: naive (a Vec per median, full sorts) | {:.0} us |",
        naive.as_secs_f64() * 1e6
    );
    println!(
        "| floor: copying each rank's last window of step records | {:.0} us |",
        copy.as_secs_f64() * 1e6
    );
    assert_eq!(
        naive_over,
        vec![3],
        "the naive scorer agrees: rank 3 is over"
    );
}
