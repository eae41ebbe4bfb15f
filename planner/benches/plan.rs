//! One planner run at the scale: 100,000 GPUs (12,500 nodes of 8)
//! over 30 days, 1,000 repetitions, the Llama 3 failure rate and classes
//! (about 1,580 interruptions per repetition), the default 41-point sweep
//! for warden and the baseline, and the spares table. Beside it, in the same
//! run: the closed-form Young/Daly evaluation and a single repetition.
//!
//! `cargo bench -p warden-planner --bench plan` (PLAN_BENCH_RUNS, default 3).
//! Target: under 10 s on the project's 2-core machine.

// A bench binary: a failure is an abort with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use warden_planner::scenario::{Recovery, Scenario};
use warden_planner::young_daly;

fn scenario(reps: usize) -> Scenario {
    let mut s = Scenario {
        gpus: 100_000,
        gpus_per_node: 8,
        days: 30.0,
        ..Scenario::default()
    };
    s.sweep.reps = reps;
    s
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let runs: usize = std::env::var("PLAN_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let s = scenario(1000);
    s.validate().unwrap();

    // Baseline 1: the closed form over the same 41-point grid, both series.
    let unplanned: f64 = {
        let total: f64 = s.classes.iter().map(|c| c.share).sum();
        s.classes
            .iter()
            .filter(|c| c.recovery != Recovery::Planned)
            .map(|c| c.share / total)
            .sum()
    };
    let m = s.job_mtbf_s();
    let lossy = m / unplanned;
    let c = s.save_stall_s();
    let closed: Vec<Duration> = (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            let young = young_daly::young_interval(c, lossy);
            let grid = warden_planner::sweep::log_grid(young / 5.0, young * 5.0, 41);
            let best = grid
                .iter()
                .map(|&tau| young_daly::expected_goodput(tau, c, m, 60.0, unplanned))
                .fold(0.0, f64::max);
            std::hint::black_box((young, young_daly::daly_interval(c, lossy), best));
            t0.elapsed()
        })
        .collect();

    // Baseline 2: a single repetition of the full plan.
    let one: Vec<Duration> = (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            std::hint::black_box(warden_planner::plan(&scenario(1), None).unwrap());
            t0.elapsed()
        })
        .collect();

    // The run the target is about.
    let mut plan = None;
    let full: Vec<Duration> = (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            plan = Some(warden_planner::plan(&s, None).unwrap());
            t0.elapsed()
        })
        .collect();
    let plan = plan.unwrap();
    let full_median = median(full.clone());
    println!(
        "planner: {} GPUs, {} days, {} reps, {} interruptions expected per rep, {} threads",
        s.gpus,
        s.days,
        s.sweep.reps,
        plan.interruptions_expected.round(),
        threads
    );
    println!("| case | runs | median | min | max |");
    println!("|---|---|---|---|---|");
    for (name, v) in [
        (
            "closed form (Young, Daly, 41-point first-order curve)",
            closed,
        ),
        ("plan, 1 repetition", one),
        ("plan, 1,000 repetitions", full),
    ] {
        let min = *v.iter().min().unwrap();
        let max = *v.iter().max().unwrap();
        println!(
            "| {name} | {runs} | {:?} | {min:?} | {max:?} |",
            median(v.clone())
        );
    }
    println!(
        "warden best {:.1} min at {:.2}%, baseline best {:.1} min at {:.2}%",
        plan.warden.optimum.interval_s / 60.0,
        plan.warden.optimum.goodput.mean * 100.0,
        plan.baseline.optimum.interval_s / 60.0,
        plan.baseline.optimum.goodput.mean * 100.0
    );
    if full_median > Duration::from_secs(10) {
        eprintln!("planner bench: {full_median:?} is over the 10 s target");
        std::process::exit(1);
    }
}
