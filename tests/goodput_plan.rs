//! `warden goodput plan` through the real `warden` binary: the plan as JSON
//! and as a table, the SVG file, a ledger's figures taken in, bad input
//! refused with its name. No agent is involved: the planner only simulates.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{Finished, WARDEN, run};
use serde_json::Value;

/// Generous for a busy machine; a plan this size takes well under a second.
const PLAN_WAIT: Duration = Duration::from_secs(60);

/// A small plan: 1,024 GPUs, 5 days, 40 repetitions, 9 intervals.
const SMALL: &[&str] = &[
    "goodput", "plan", "--gpus", "1024", "--days", "5", "--reps", "40", "--points", "9",
];

fn warden(args: &[&str]) -> Finished {
    run(Command::new(WARDEN).args(args), PLAN_WAIT)
}

fn plan_json(extra: &[&str]) -> Value {
    let mut args = vec!["--json"];
    args.extend_from_slice(SMALL);
    args.extend_from_slice(extra);
    let out = warden(&args);
    assert_eq!(out.code(), 0, "{out:?}");
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

#[test]
fn plan_json_has_both_series_and_writes_the_svg() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("plot.svg");
    let doc = plan_json(&["--svg", svg.to_str().unwrap(), "--seed", "5"]);
    assert_eq!(doc["scenario"]["gpus"], 1024);
    assert_eq!(doc["nodes"], 128);
    assert_eq!(doc["scenario"]["sweep"]["seed"], 5);
    for series in ["warden", "baseline"] {
        let points = doc[series]["points"].as_array().unwrap();
        assert_eq!(points.len(), 9, "{series}");
        let g = doc[series]["optimum"]["goodput"]["mean"].as_f64().unwrap();
        assert!(g > 0.0 && g < 1.0, "{series}: {g}");
    }
    assert!(
        doc["warden"]["optimum"]["goodput"]["mean"].as_f64()
            > doc["baseline"]["optimum"]["goodput"]["mean"].as_f64()
    );
    assert_eq!(doc["svg"], svg.to_str().unwrap());
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg ") && plot.trim_end().ends_with("</svg>"));
    assert_eq!(plot.matches("<polyline").count(), 2);
    // Without a free spare a node of the cluster's pool joins, unless the
    // job is elastic (`--scale-down`): then it runs short until repair.
    assert_eq!(doc["scenario"]["without_spare"], "pool");
    assert_eq!(doc["warden"]["optimum"]["breakdown"]["scaled_down"], 0.0);
    let elastic = plan_json(&["--seed", "5", "--scale-down"]);
    assert_eq!(elastic["scenario"]["without_spare"], "scale_down");
    assert!(
        elastic["warden"]["optimum"]["breakdown"]["scaled_down"]
            .as_f64()
            .is_some_and(|x| x > 0.0),
        "{}",
        elastic["warden"]["optimum"]["breakdown"]
    );
    // A scenario file's scale-down, switched back to the pool by flag.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("elastic.json");
    std::fs::write(&file, r#"{"without_spare": "scale_down"}"#).unwrap();
    let file = file.to_str().unwrap();
    let from_file = plan_json(&["--seed", "5", "--scenario", file]);
    assert_eq!(from_file["scenario"]["without_spare"], "scale_down");
    let back = plan_json(&["--seed", "5", "--scenario", file, "--pool"]);
    assert_eq!(back["scenario"]["without_spare"], "pool");
    let both = warden(&["goodput", "plan", "--scale-down", "--pool"]);
    assert_ne!(both.code(), 0, "{both:?}");
    // Spares back from repair (one multi-node allocation): the repair
    // counts, and more spares than one are worth something.
    let repaired = plan_json(&[
        "--seed",
        "5",
        "--spare-refill",
        "repair",
        "--repair-hours",
        "48",
    ]);
    assert_eq!(repaired["scenario"]["spare_refill"], "repair");
    assert_eq!(repaired["scenario"]["repair_hours"], 48.0);
    // Same seed, same plan, from a second process.
    let again = plan_json(&["--seed", "5"]);
    assert_eq!(again["warden"], doc["warden"]);
    assert_eq!(again["baseline"], doc["baseline"]);
}

#[test]
fn plan_table_reads_and_the_ledger_replaces_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger.json");
    std::fs::write(
        &ledger,
        r#"{"job": "toy", "wall_s": 1000, "recovery": {"startup_s": 12.5, "detection_s": 0.4, "restarts": 2}}"#,
    )
    .unwrap();
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--from-ledger", ledger.to_str().unwrap()]);
    let out = warden(&args);
    assert_eq!(out.code(), 0, "{out:?}");
    for needle in [
        "goodput plan: 1,024 GPUs (128 nodes x 8)",
        "best checkpoint interval",
        "scheduler requeue",
        "from the ledger: job.startup_s=12.5, warden.detection_s=0.4 (over 2 restarts",
        "spares",
    ] {
        assert!(
            out.stdout.contains(needle),
            "{needle:?} missing:\n{}",
            out.stdout
        );
    }
    // Issue 32 point 4: the Llama 3 plan assumes nothing but the job's own
    // step time (the checkpoint's size is the job's too, and unlabelled).
    let llama3 = warden(&["goodput", "plan", "--preset", "llama3", "--reps", "20"]);
    assert_eq!(llama3.code(), 0, "{llama3:?}");
    let assumed: Vec<&str> = llama3
        .stdout
        .match_indices("(assumed)")
        .map(|(at, _)| llama3.stdout[..at].rsplit([';', ':']).next().unwrap_or(""))
        .collect();
    assert_eq!(assumed, [" step 5.0 s "], "{}", llama3.stdout);
    let mut json_args = vec!["--json"];
    json_args.extend_from_slice(&args);
    let doc: Value = serde_json::from_str(&warden(&json_args).stdout).unwrap();
    assert_eq!(doc["scenario"]["job"]["startup_s"], 12.5);
    assert_eq!(doc["scenario"]["warden"]["detection_s"], 0.4);
    // Flags win over the ledger.
    json_args.extend_from_slice(&["--startup", "30"]);
    let doc: Value = serde_json::from_str(&warden(&json_args).stdout).unwrap();
    assert_eq!(doc["scenario"]["job"]["startup_s"], 30.0);
}

#[test]
fn bad_input_is_refused_with_its_name() {
    for (args, want) in [
        (vec!["--gpus", "0"], "gpus = 0: must be at least 1"),
        (
            vec!["--gpus", "1024", "--gpus-per-node", "3"],
            "gpus_per_node = 3: must divide gpus (1024)",
        ),
        (vec!["--save-stall=-1"], "checkpoint.save_stall_s = -1"),
        (
            vec!["--interval-min", "10", "--interval-max", "5"],
            "sweep.interval_max_s = 300",
        ),
        (vec!["--preset", "gpt5"], "unknown preset \"gpt5\""),
        (
            vec!["--repair-hours", "4"],
            "--repair-hours sets nothing here",
        ),
    ] {
        // SMALL without its --gpus, which some cases set.
        let mut all = vec![
            "goodput", "plan", "--days", "5", "--reps", "40", "--points", "9",
        ];
        all.extend_from_slice(&args);
        let out = warden(&all);
        assert_ne!(out.code(), 0, "{args:?}: {out:?}");
        assert!(out.stderr.contains(want), "{args:?}: {:?}", out.stderr);
    }
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("bad.json");
    std::fs::write(&ledger, r#"{"recovery": {"restore_s": "fast"}}"#).unwrap();
    let mut all = SMALL.to_vec();
    all.extend_from_slice(&["--from-ledger", ledger.to_str().unwrap()]);
    let out = warden(&all);
    assert_ne!(out.code(), 0);
    assert!(
        out.stderr.contains("recovery.restore_s"),
        "{:?}",
        out.stderr
    );
    // Bare `warden goodput` is the ledger view: it needs an agent, and says
    // where it looked.
    let out = warden(&["--socket", "/nonexistent/wardend.sock", "goodput"]);
    assert_ne!(out.code(), 0);
    assert!(
        out.stderr.contains("/nonexistent/wardend.sock"),
        "{:?}",
        out.stderr
    );
}
