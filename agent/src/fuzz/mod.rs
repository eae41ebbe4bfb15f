//! Fuzzing on stable Rust: every parser of input the agent did not write
//! itself, driven by proptest (cargo-fuzz needs nightly).
//!
//! In: for each target in [`targets::TARGETS`], arbitrary bytes and
//! structure-aware mutations of valid seeds ([`mutate`]). Out: a failed
//! test when an input panics, hangs (runs past [`CASE_DEADLINE`]), or
//! breaks the target's property (an error that says nothing, a config
//! that does not print back, ...). Never: runs unbounded in CI: each
//! property runs [`CI_CASES`] cases unless `PROPTEST_CASES` asks for more
//! (docs/testing.md: long sessions).
//!
//! Failures found by proptest are kept in `agent/proptest-regressions/`
//! (committed, replayed first on every run); inputs worth keeping by hand
//! live in `tests/fixtures/fuzz-corpus/<target>/` and are replayed by
//! [`corpus`].

mod corpus;
mod mutate;
mod seeds;
mod targets;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::Config;

/// Cases per property in CI: 24 properties at this count take about
/// 15 s of one core in a debug build (docs/testing.md has the figures).
pub(crate) const CI_CASES: u32 = 256;

/// One case may take this long before it counts as a hang. A case takes
/// milliseconds; the margin is for a loaded 2-core CI machine.
pub(crate) const CASE_DEADLINE: Duration = Duration::from_secs(20);

/// The largest arbitrary input: far above every seed, small enough that a
/// case stays fast.
const MAX_INPUT: usize = 8 << 10;

/// proptest's config: `PROPTEST_CASES` when set, else [`CI_CASES`].
fn config() -> Config {
    let mut c = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = CI_CASES;
    }
    c
}

/// Runs `target` on `input` on its own thread; a case still running after
/// [`CASE_DEADLINE`] fails as a hang (its thread is left behind), a panic
/// is passed on as it was.
pub(crate) fn bounded(name: &str, target: fn(&[u8]), input: Vec<u8>) {
    bounded_within(name, target, input, CASE_DEADLINE);
}

fn bounded_within(name: &str, target: fn(&[u8]), input: Vec<u8>, deadline: Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        target(&input);
        let _ = tx.send(());
    });
    match rx.recv_timeout(deadline) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = handle.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{name}: the case ran past {deadline:?} (a hang)")
        }
    }
}

fn target(name: &str) -> fn(&[u8]) {
    targets::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| *f)
        .unwrap_or_else(|| panic!("no fuzz target {name}"))
}

fn arbitrary() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..MAX_INPUT)
}

/// Declares, for each target, a property over arbitrary bytes and one over
/// mutations of its seeds.
macro_rules! fuzz {
    ($($name:ident: $structured:expr;)*) => {
        $(
            mod $name {
                use super::*;
                proptest! {
                    #![proptest_config(config())]
                    #[test]
                    fn arbitrary_bytes(input in arbitrary()) {
                        bounded(stringify!($name), target(stringify!($name)), input);
                    }
                    #[test]
                    fn mutated_seeds(input in $structured) {
                        bounded(stringify!($name), target(stringify!($name)), input);
                    }
                }
            }
        )*
        /// Every target has its two properties.
        #[test]
        fn every_target_is_fuzzed() {
            let fuzzed = [$(stringify!($name)),*];
            for (name, _) in targets::TARGETS {
                assert!(fuzzed.contains(name), "target {name} has no properties");
            }
        }
    };
}

fuzz! {
    config: prop_oneof![
        mutate::toml(seeds::config_tables()).prop_map(String::into_bytes),
        mutate::bytes(seeds::config()),
    ];
    slot_header: mutate::bytes(seeds::slot_header());
    slot_record: mutate::bytes(seeds::slot_record());
    manifest: prop_oneof![
        mutate::json(seeds::json(&seeds::manifest())).prop_map(|v| v.to_string().into_bytes()),
        mutate::bytes(seeds::manifest()),
    ];
    incident_journal: prop_oneof![
        mutate::json(seeds::json_lines(&seeds::incident_journal()))
            .prop_map(|v| format!("{v}\n").into_bytes()),
        mutate::bytes(seeds::incident_journal()),
    ];
    goodput_journal: prop_oneof![
        mutate::json(seeds::json_lines(&seeds::goodput_journal()))
            .prop_map(|v| format!("{v}\n").into_bytes()),
        mutate::bytes(seeds::goodput_journal()),
    ];
    shard_framing: mutate::bytes(seeds::shard_framing());
    hook_output: prop_oneof![
        mutate::json(seeds::json(&seeds::hook_output())).prop_map(|v| v.to_string().into_bytes()),
        mutate::bytes(seeds::hook_output()),
    ];
    kmsg_lines: mutate::bytes(seeds::kmsg_lines());
    dcgmi_json: prop_oneof![
        mutate::json(seeds::json(&seeds::dcgmi_json())).prop_map(|v| v.to_string().into_bytes()),
        mutate::bytes(seeds::dcgmi_json()),
    ];
    nvhcd: mutate::bytes(seeds::nvhcd());
    tpu_runtime: mutate::bytes(seeds::tpu_runtime());
    flight_recorder: prop_oneof![
        mutate::json(seeds::json(&seeds::flight_recorder())).prop_map(|v| v.to_string().into_bytes()),
        mutate::bytes(seeds::flight_recorder()),
    ];
    peer_positions: mutate::bytes(seeds::peer_positions());
    peer_holdings: mutate::bytes(seeds::peer_holdings());
}

/// The seeds themselves pass every target (a seed that fails is a bug in
/// the seed or the parser, found before any mutation).
#[test]
fn seeds_pass() {
    let all: [(&str, Vec<Vec<u8>>); 15] = [
        ("config", seeds::config()),
        ("slot_header", seeds::slot_header()),
        ("slot_record", seeds::slot_record()),
        ("manifest", seeds::manifest()),
        ("incident_journal", seeds::incident_journal()),
        ("goodput_journal", seeds::goodput_journal()),
        ("shard_framing", seeds::shard_framing()),
        ("hook_output", seeds::hook_output()),
        ("kmsg_lines", seeds::kmsg_lines()),
        ("dcgmi_json", seeds::dcgmi_json()),
        ("nvhcd", seeds::nvhcd()),
        ("tpu_runtime", seeds::tpu_runtime()),
        ("flight_recorder", seeds::flight_recorder()),
        ("peer_positions", seeds::peer_positions()),
        ("peer_holdings", seeds::peer_holdings()),
    ];
    for (name, seeds) in all {
        assert!(!seeds.is_empty(), "{name} has no seeds");
        for s in seeds {
            bounded(name, target(name), s);
        }
    }
}

/// The harness itself: a panicking target fails the case with its own
/// message, a hanging one fails as a hang instead of blocking the run.
#[test]
fn the_harness_reports_panics_and_hangs() {
    fn panics(_: &[u8]) {
        panic!("boom");
    }
    fn hangs(_: &[u8]) {
        std::thread::sleep(Duration::from_secs(3600));
    }
    let p = std::panic::catch_unwind(|| bounded("panics", panics, Vec::new())).unwrap_err();
    assert_eq!(p.downcast_ref::<&str>(), Some(&"boom"));
    let p = std::panic::catch_unwind(|| {
        bounded_within("hangs", hangs, Vec::new(), Duration::from_millis(50))
    })
    .unwrap_err();
    let m = p.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(m.contains("hangs: the case ran past 50ms (a hang)"), "{m}");
}
