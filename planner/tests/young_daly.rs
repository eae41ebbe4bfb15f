//! The simulation against the closed form where the closed form's
//! assumptions hold: exponential failures, one class that always loses the
//! progress since the last save, a fixed save cost.

#![allow(clippy::unwrap_used)]

use warden_planner::scenario::{InterruptionClass, Recovery, Scenario, SweepConfig};
use warden_planner::young_daly;

/// 1,000 nodes at a 1,000 h node MTBF: one interruption an hour; a 4 s save:
/// Young's interval 170 s, Daly's 167 s (1.6% apart, inside the 5%).
fn young_daly_scenario(seed: u64) -> Scenario {
    let mut s = Scenario {
        gpus: 8_000,
        gpus_per_node: 8,
        node_mtbf_hours: 1_000.0,
        days: 30.0,
        classes: vec![InterruptionClass {
            name: "crash".into(),
            share: 1.0,
            hang_fraction: 0.0,
            recovery: Recovery::InJob,
        }],
        sweep: SweepConfig {
            interval_min_s: Some(85.0),
            interval_max_s: Some(340.0),
            points: 41,
            reps: 2_000,
            seed,
        },
        ..Scenario::default()
    };
    s.checkpoint.save_stall_s = Some(4.0);
    s
}

#[test]
fn simulated_optimum_is_within_5_percent_of_young_daly() {
    for seed in [1, 2, 3] {
        let s = young_daly_scenario(seed);
        let plan = warden_planner::plan(&s, None).unwrap();
        let young = young_daly::young_interval(4.0, 3600.0);
        let daly = young_daly::daly_interval(4.0, 3600.0);
        assert!((plan.warden.young_interval_s - young).abs() < 1e-9);
        let got = plan.warden.optimum.interval_s;
        let off = (got - young).abs() / young;
        eprintln!(
            "seed {seed}: simulated optimum {got:.1} s (grid {:.1} s), Young {young:.1} s, Daly {daly:.1} s, {:.2}% off Young",
            plan.warden.optimum.grid_interval_s,
            off * 100.0
        );
        assert!(
            off < 0.05,
            "seed {seed}: optimum {got} s vs Young {young} s"
        );
        // Daly's higher-order interval is the sharper reference here.
        let off_daly = (got - daly).abs() / daly;
        assert!(
            off_daly < 0.02,
            "seed {seed}: optimum {got} s vs Daly {daly} s"
        );
    }
}
