//! The one list of the agent's sources: which run, from the configuration.
//!
//! In: the sections of the agent's configuration the sources read
//! ([`Settings`], `super::settings`). Out: every configured source, boxed, in the order the
//! daemon starts them (the host's memory first, the GPU libraries last),
//! each built by its kind's [`SourceKind::build`]; and the check of every
//! kind's section ([`validate`]). Never: starts anything (the daemon hands
//! each to [`super::runner::Sources::spawn`]).
//!
//! Why a list here and not in the daemon: adding a source is its module,
//! its `impl SourceKind`, and one line in [`KINDS`]
//! (docs/architecture.md, "Adding a source"); the daemon
//! and the configuration's checks name none.

use super::dcgm::DcgmSource;
use super::host_disk::HostDisk;
use super::host_memory::HostMemory;
use super::host_net::HostNet;
use super::kmsg::Kmsg;
use super::nvml::NvmlSource;
use super::settings::Settings;
use super::simulated::Simulated;
use super::tpu::Tpu;
use super::{Source, SourceKind};
use warden_core::config::ConfigError;

/// A kind of source as the list holds it: its name, its section's check
/// and its build, from its [`SourceKind`] impl.
struct Entry {
    name: &'static str,
    validate: fn(&Settings<'_>, &str) -> Result<(), ConfigError>,
    build: Build,
}

type Build = fn(&Settings<'_>) -> std::io::Result<Option<Box<dyn Source>>>;

const fn entry<K: SourceKind>() -> Entry {
    Entry {
        name: K::NAME,
        validate: validate_kind::<K>,
        build: build_kind::<K>,
    }
}

fn validate_kind<K: SourceKind>(s: &Settings<'_>, origin: &str) -> Result<(), ConfigError> {
    K::validate(K::config(s), origin)
}

fn build_kind<K: SourceKind>(s: &Settings<'_>) -> std::io::Result<Option<Box<dyn Source>>> {
    K::build(K::config(s), s)
}

/// Every kind, in the order they start: the host's memory first, then the
/// kernel log and a simulated node, then the host's network and disk, and
/// the accelerators' libraries last (their first calls can take seconds).
const KINDS: &[Entry] = &[
    entry::<HostMemory>(),
    entry::<Kmsg>(),
    entry::<Simulated>(),
    entry::<HostNet>(),
    entry::<HostDisk>(),
    entry::<Tpu>(),
    entry::<NvmlSource>(),
    entry::<DcgmSource>(),
];

/// Every kind's name, in the order they start.
pub fn names() -> impl Iterator<Item = &'static str> {
    KINDS.iter().map(|e| e.name)
}

/// Checks every kind's section of `cfg`: the first bad key, named.
pub fn validate(cfg: Settings<'_>, origin: &str) -> Result<(), ConfigError> {
    KINDS.iter().try_for_each(|e| (e.validate)(&cfg, origin))
}

/// Every source `cfg` turns on. Fails only when a source cannot be set up
/// (the TPU runtime's threads, a scenario file gone bad since it was
/// checked).
pub fn configured(cfg: Settings<'_>) -> std::io::Result<Vec<Box<dyn Source>>> {
    let mut out: Vec<Box<dyn Source>> = Vec::new();
    for e in KINDS {
        out.extend((e.build)(&cfg)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_default_config_runs_the_host_sources_and_the_gpu_ones_when_on() {
        let mut cfg = Config::default();
        cfg.kmsg.enabled = false;
        cfg.nvml.enabled = false;
        cfg.dcgm.enabled = false;
        cfg.tpu.enabled = false;
        let names: Vec<_> = configured(cfg.sources())
            .expect("sources")
            .iter()
            .map(|s| s.name())
            .collect();
        assert!(names.starts_with(&["host"]), "{names:?}");
        assert!(
            !names.contains(&"nvml") && !names.contains(&"kmsg"),
            "{names:?}"
        );
        cfg.nvml.enabled = true;
        let names: Vec<_> = configured(cfg.sources())
            .expect("sources")
            .iter()
            .map(|s| s.name())
            .collect();
        assert_eq!(names.last(), Some(&"nvml"), "{names:?}");
        // Each built source answers to its kind's name, in the list's order.
        let kinds: Vec<_> = super::names().collect();
        let mut at = 0;
        for n in &names {
            let i = kinds[at..]
                .iter()
                .position(|k| k == n)
                .unwrap_or_else(|| panic!("{n} is not a kind after {:?}", &kinds[..at]));
            at += i + 1;
        }
    }

    #[test]
    fn every_kind_checks_its_own_section() {
        let mut cfg = Config::default();
        cfg.host.memory_failed_below_percent = 50.0;
        cfg.host.memory_degraded_below_percent = 10.0;
        let e = validate(cfg.sources(), "test.toml").expect_err("bad [host] memory thresholds");
        assert!(
            e.to_string().contains("host.memory_failed_below_percent"),
            "{e}"
        );
        let mut cfg = Config::default();
        cfg.host.sysfs_root = "relative".into();
        let e = validate(cfg.sources(), "test.toml").expect_err("a relative sysfs_root");
        assert!(e.to_string().contains("host.sysfs_root"), "{e}");
        assert!(validate(Config::default().sources(), "test.toml").is_ok());
    }
}
