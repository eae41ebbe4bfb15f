//! The plan end to end through the library: reproducibility, the spares
//! table, the report, the SVG.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use warden_planner::scenario::{Scenario, ScenarioError, WithoutSpare};
use warden_planner::{plan, report, svg};

/// The Llama 3 preset, small enough to run in a second.
fn small(seed: u64) -> Scenario {
    let mut s = Scenario::preset("llama3").unwrap();
    s.days = 10.0;
    s.sweep.reps = 60;
    s.sweep.points = 15;
    s.sweep.seed = seed;
    s
}

#[test]
fn same_seed_same_plan_other_seed_differs() {
    let a = plan(&small(7), None).unwrap();
    let b = plan(&small(7), None).unwrap();
    assert_eq!(a, b);
    assert_eq!(report::json(&a), report::json(&b));
    let c = plan(&small(8), None).unwrap();
    assert_ne!(a.warden.points, c.warden.points);
    assert_ne!(a.baseline.points, c.baseline.points);
}

#[test]
fn warden_beats_the_requeue_baseline_and_parts_sum_to_one() {
    let p = plan(&small(1), None).unwrap();
    assert!(
        p.warden.optimum.goodput.mean > p.baseline.optimum.goodput.mean,
        "{} vs {}",
        p.warden.optimum.goodput.mean,
        p.baseline.optimum.goodput.mean
    );
    for s in [&p.warden, &p.baseline] {
        let b = &s.optimum.breakdown;
        assert!((b.total() - 1.0).abs() < 1e-9, "{}: {b:?}", s.name);
        assert!((b.productive - s.optimum.goodput.mean).abs() < 1e-12);
        for pt in &s.points {
            assert!(pt.p5 <= pt.mean && pt.mean <= pt.p95, "{pt:?}");
        }
    }
    // The baseline never scales down; nor does warden by default, where a
    // node of the cluster's pool takes a failed one's place as in the
    // baseline's requeue. An elastic job without spares does.
    assert_eq!(p.baseline.optimum.breakdown.scaled_down, 0.0);
    assert_eq!(p.warden.optimum.breakdown.scaled_down, 0.0);
    let mut s = small(1);
    s.without_spare = WithoutSpare::ScaleDown;
    let q = plan(&s, None).unwrap();
    assert!(q.warden.optimum.breakdown.scaled_down > 0.0);
}

#[test]
fn spares_remove_the_scale_down_loss() {
    let mut s = small(3);
    s.spares = 16;
    s.without_spare = WithoutSpare::ScaleDown;
    let p = plan(&s, None).unwrap();
    let counts: Vec<u32> = p.spares.iter().map(|r| r.spares).collect();
    assert_eq!(counts, vec![0, 1, 2, 4, 8, 16]);
    let none = &p.spares[0];
    let most = &p.spares[5];
    assert!(
        most.goodput.mean > none.goodput.mean,
        "{most:?} vs {none:?}"
    );
    assert!(most.gained_gpu_hours > 0.0);
    assert!((most.spare_gpu_hours - 16.0 * 8.0 * 240.0).abs() < 1e-6);
    // With 16 spares against ~2 node faults a day and a day's repair, the
    // main series never scales down.
    assert!(p.warden.optimum.breakdown.scaled_down < 1e-4);
}

#[test]
fn invalid_inputs_are_named() {
    type Mutation = Box<dyn Fn(&mut Scenario)>;
    let cases: Vec<(Mutation, &str)> = vec![
        (Box::new(|s| s.gpus = 0), "gpus = 0"),
        (Box::new(|s| s.gpus_per_node = 3), "gpus_per_node = 3"),
        (
            Box::new(|s| s.node_mtbf_hours = -1.0),
            "node_mtbf_hours = -1",
        ),
        (
            Box::new(|s| s.checkpoint.save_stall_s = Some(-2.0)),
            "checkpoint.save_stall_s = -2",
        ),
        (Box::new(|s| s.job.step_s = f64::NAN), "job.step_s = NaN"),
        (Box::new(|s| s.sweep.reps = 0), "sweep.reps = 0"),
        (
            Box::new(|s| {
                s.sweep.interval_min_s = Some(600.0);
                s.sweep.interval_max_s = Some(60.0);
            }),
            "sweep.interval_max_s = 60",
        ),
        (
            Box::new(|s| s.classes[0].hang_fraction = 1.5),
            "classes[0].hang_fraction = 1.5",
        ),
        (Box::new(|s| s.replica_nodes = 3), "replica_nodes = 3"),
    ];
    for (mutate, want) in cases {
        let mut s = small(1);
        mutate(&mut s);
        let e = plan(&s, None).unwrap_err();
        assert!(matches!(e, ScenarioError::Invalid { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.starts_with(want), "{msg:?} should start with {want:?}");
    }
}

#[test]
fn report_table_and_json_carry_both_series() {
    let p = plan(&small(1), None).unwrap();
    let t = report::table(&p);
    for needle in [
        "best checkpoint interval",
        "scheduler requeue",
        "lost progress",
        "spares",
    ] {
        assert!(t.contains(needle), "{needle} missing:\n{t}");
    }
    let j = report::json(&p);
    assert_eq!(j["warden"]["points"].as_array().unwrap().len(), 15);
    assert_eq!(j["baseline"]["name"], "scheduler requeue");
    assert!(j["warden"]["optimum"]["interval_s"].as_f64().unwrap() > 0.0);
    assert_eq!(j["scenario"]["gpus"], 16_384);
}

/// A minimal XML well-formedness check: every tag closes in order,
/// attributes are quoted, no stray `<` or `&`.
fn check_xml(doc: &str) -> Vec<String> {
    let mut stack: Vec<String> = Vec::new();
    let mut seen = Vec::new();
    let mut rest = doc;
    while let Some(open) = rest.find('<') {
        let text = &rest[..open];
        assert!(!text.contains('>'), "stray '>' in text {text:?}");
        for (i, _) in text.match_indices('&') {
            let ent = &text[i..];
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;"]
                    .iter()
                    .any(|e| ent.starts_with(e)),
                "bare & in {text:?}"
            );
        }
        let close = rest[open..].find('>').expect("unterminated tag") + open;
        let tag = &rest[open + 1..close];
        assert!(!tag.contains('<'), "'<' inside tag {tag:?}");
        assert_eq!(tag.matches('"').count() % 2, 0, "unbalanced quotes {tag:?}");
        if let Some(name) = tag.strip_prefix('/') {
            let top = stack.pop().expect("closing tag without opening");
            assert_eq!(top, name.trim(), "mismatched </{name}>");
        } else {
            let name: String = tag
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '/')
                .collect();
            seen.push(name.clone());
            if !tag.ends_with('/') {
                stack.push(name);
            }
        }
        rest = &rest[close + 1..];
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
    assert!(rest.trim().is_empty());
    seen
}

#[test]
fn svg_is_well_formed_with_both_series_axes_and_legend() {
    let p = plan(&small(1), None).unwrap();
    let doc = svg::render(&p);
    assert!(doc.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    let tags = check_xml(&doc);
    assert_eq!(tags.iter().filter(|t| *t == "polyline").count(), 2);
    assert_eq!(tags.iter().filter(|t| *t == "polygon").count(), 2);
    assert!(doc.contains("data-name=\"warden\""));
    assert!(doc.contains("data-name=\"scheduler requeue\""));
    assert!(doc.contains("class=\"legend\""));
    assert!(doc.contains("checkpoint interval (minutes"));
    assert!(doc.contains("goodput (%)"));
    assert!(doc.contains("class=\"x-ticks\"") && doc.contains("class=\"y-ticks\""));
    // Each polyline has one point per interval.
    for line in doc.lines().filter(|l| l.starts_with("<polyline")) {
        let pts = line
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(pts.split(' ').count(), 15, "{line}");
        for xy in pts.split(' ') {
            let (x, y) = xy.split_once(',').unwrap();
            let (x, y): (f64, f64) = (x.parse().unwrap(), y.parse().unwrap());
            assert!(
                (0.0..=760.0).contains(&x) && (0.0..=460.0).contains(&y),
                "{xy}"
            );
        }
    }
}
