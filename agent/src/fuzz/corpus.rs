//! The kept corpus: inputs that once crashed, hung or misled a parser,
//! each replayed through its target on every test run.
//!
//! In: `tests/fixtures/fuzz-corpus/<target>/<name>`, one input per file,
//! named after what it shows (a README there says how to add one). Out: a
//! failed test naming the file when one fails again. Never: skips a
//! directory whose name is not a target (a typo would silently retire it).

use super::{bounded, targets::TARGETS};

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/fuzz-corpus");

#[test]
fn every_kept_input_passes_its_target() {
    let mut replayed = 0;
    let mut dirs: Vec<_> = std::fs::read_dir(CORPUS)
        .unwrap_or_else(|e| panic!("{CORPUS}: {e}"))
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .collect();
    dirs.sort_by_key(std::fs::DirEntry::file_name);
    for dir in dirs {
        let name = dir.file_name().to_string_lossy().into_owned();
        let target = TARGETS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| *f)
            .unwrap_or_else(|| panic!("{CORPUS}/{name}: no fuzz target of that name"));
        let mut files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .filter_map(|e| Some(e.ok()?.path()))
            .collect();
        files.sort();
        for f in files {
            let input = std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            let shown = f.display().to_string();
            if let Err(p) = std::panic::catch_unwind(|| bounded(&name, target, input)) {
                let why = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                panic!("{shown} fails again: {why}");
            }
            replayed += 1;
        }
    }
    assert!(replayed > 0, "the corpus in {CORPUS} is empty");
}
