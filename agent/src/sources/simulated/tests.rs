//! Scenarios as files: the shipped examples load, their scripted faults
//! appear at their times, and bad files name the key.

use super::*;
use crate::sources::Source;

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/scenarios");

fn example(name: &str) -> SimScenario {
    SimScenario::from_file(Path::new(&format!("{EXAMPLES}/{name}.toml")))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn status_at(s: &SimScenario, t: u64, id: &str) -> Status {
    let r = s
        .state_at(Duration::from_secs(t), SystemTime::now())
        .into_iter()
        .find(|r| r.id == id)
        .unwrap_or_else(|| panic!("no {id}"));
    r.reasons
        .iter()
        .map(|r| r.status)
        .max()
        .unwrap_or(Status::Ok)
}

#[test]
fn every_shipped_scenario_loads() {
    let mut n = 0;
    for entry in std::fs::read_dir(EXAMPLES).unwrap() {
        let path = entry.unwrap().path();
        SimScenario::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
        n += 1;
    }
    assert!(n >= 6, "{n} scenarios");
}

#[test]
fn healthy_node_has_8_gpus_and_their_links() {
    let s = example("healthy-8gpu");
    let reports = s.state_at(Duration::from_secs(100), SystemTime::now());
    assert_eq!(reports.iter().filter(|r| r.kind == "gpu").count(), 8);
    assert_eq!(
        reports.iter().filter(|r| r.kind == "nvlink").count(),
        8 * 18
    );
    assert!(reports.iter().all(|r| r.reasons.is_empty()));
}

#[test]
fn xid79_fails_gpu1_at_30s() {
    let s = example("xid79-at-30s");
    assert_eq!(status_at(&s, 29, "gpu1"), Status::Ok);
    assert_eq!(status_at(&s, 30, "gpu1"), Status::Failed);
    assert_eq!(status_at(&s, 30, "gpu0"), Status::Ok);
    // The simulated GPU says its reason is an XID, as NVML's source does.
    let reports = s.state_at(Duration::from_secs(30), SystemTime::now());
    let gpu1 = reports.iter().find(|r| r.id == "gpu1").expect("gpu1");
    assert_eq!(
        gpu1.reasons.iter().map(|r| r.kind).collect::<Vec<_>>(),
        [warden_core::health::ReasonKind::Xid]
    );
    let evs = s.events_between(Some(Duration::from_secs(29)), Duration::from_secs(31));
    assert_eq!(evs.len(), 1);
    let evs: Vec<_> = evs
        .iter()
        .map(warden_core::signal::Signal::render)
        .collect();
    assert_eq!((evs[0].kind, evs[0].subject.as_str()), ("gpu.xid", "gpu1"));
    assert!(
        s.events_between(Some(Duration::from_secs(31)), Duration::from_secs(60))
            .is_empty()
    );
}

#[test]
fn ecc_degrades_then_fails() {
    let s = example("ecc-climbing");
    assert_eq!(status_at(&s, 20, "gpu3"), Status::Ok);
    assert_eq!(status_at(&s, 40, "gpu3"), Status::Degraded);
    assert_eq!(status_at(&s, 150, "gpu3"), Status::Failed);
}

#[test]
fn nvlink_thermal_and_tpu_come_and_go() {
    let s = example("nvlink-down");
    assert_eq!(status_at(&s, 16, "gpu2/nvlink5"), Status::Failed);
    assert_eq!(status_at(&s, 16, "gpu2/nvlink4"), Status::Ok);
    assert_eq!(status_at(&s, 121, "gpu2/nvlink5"), Status::Ok);
    let s = example("thermal-throttle");
    assert_eq!(status_at(&s, 30, "gpu6"), Status::Degraded);
    assert_eq!(status_at(&s, 56, "gpu6"), Status::Ok);
    let s = example("tpu-core-error");
    assert_eq!(status_at(&s, 21, "tpu2"), Status::Degraded);
    assert_eq!(status_at(&s, 61, "tpu2"), Status::Ok);
}

/// A scenario stands for the real sources: every judged reason it writes
/// is spelled as NVML's, DCGM's or the TPU source's, so attribution finds
/// the same rule for it (it wrote `ecc.uncorrected` and `clocks.thermal`,
/// names no rule knew, until the names were one table).
#[test]
fn every_judged_reason_a_scenario_writes_has_the_real_sources_rule() {
    let mut judged = 0;
    for name in [
        "ecc-climbing",
        "nvlink-down",
        "thermal-throttle",
        "tpu-core-error",
    ] {
        let s = example(name);
        for t in (0..200).step_by(5) {
            for r in s.state_at(Duration::from_secs(t), SystemTime::now()) {
                for reason in r.reasons.iter().filter(|x| x.kind == ReasonKind::Judged) {
                    judged += 1;
                    assert!(
                        warden_core::attribute::rules::signal_rule(&reason.signal).is_some(),
                        "{name} at {t}s: {} on {} has no rule",
                        reason.signal,
                        r.id
                    );
                }
            }
        }
    }
    assert!(judged > 10, "{judged} judged reasons");
}

#[test]
fn speed_scales_scenario_time() {
    let mut src = Simulated::new(example("xid79-at-30s"), Some(10.0));
    let t0 = SystemTime::now();
    assert!(src.poll(t0).events.is_empty());
    let p = src.poll(t0 + Duration::from_secs(3));
    assert_eq!(p.events.len(), 1);
    assert!(
        p.reports
            .iter()
            .any(|r| r.id == "gpu1" && !r.reasons.is_empty())
    );
}

#[test]
fn unknown_and_invalid_keys_are_named() {
    let e = SimScenario::from_toml("[[gpu]]\ncount = 2\ncolour = \"red\"\n", "s.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("colour") && e.contains("gpu[0]"), "{e}");
    let e = SimScenario::from_toml(
        "[[gpu]]\ncount = 2\n[[fault]]\nat = \"1s\"\nkind = \"xid\"\ngpu = 5\nxid = 79\n",
        "s.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("fault[0].gpu"), "{e}");
    let e = SimScenario::from_toml("[[fault]]\nat = \"1s\"\nkind = \"meteor\"\n", "s.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fault[0].kind") || e.contains("fault[0]"), "{e}");
}
