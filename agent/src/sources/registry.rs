//! The one list of the agent's sources: which run, from the configuration.
//!
//! In: the agent's [`Config`]. Out: every configured source, boxed, in the
//! order the daemon starts them (the host's memory first, the GPU libraries
//! last), each built by its own module's constructor. Never: starts
//! anything (the daemon hands each to [`super::runner::Sources::spawn`]).
//!
//! Why a list here and not in the daemon: adding a source is one module
//! and one line below (docs/architecture.md, "Adding a source"); the
//! daemon neither names nor configures any.

use super::Source;
use super::dcgm::DcgmConfig;
use super::host_config::HostConfig;
use super::kmsg::KmsgConfig;
use super::nvml::NvmlConfig;
use super::tpu::TpuConfig;
use crate::ckpt::config::CheckpointConfig;

/// The sections of the agent's configuration the sources read
/// (`config::Config::sources` hands them over). Why not the whole
/// `Config`: the configuration names every source's section, so a list
/// that read the whole of it made the two folders import each other.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    /// `[host]`.
    pub host: &'a HostConfig,
    /// `[kmsg]`.
    pub kmsg: &'a KmsgConfig,
    /// `[nvml]`.
    pub nvml: &'a NvmlConfig,
    /// `[dcgm]`.
    pub dcgm: &'a DcgmConfig,
    /// `[tpu]`.
    pub tpu: &'a TpuConfig,
    /// `[checkpoint]`: the host's disk source watches the tier's filesystem.
    pub checkpoint: &'a CheckpointConfig,
}

/// Every source `cfg` turns on, with the ones given from outside (tests,
/// the simulated twin) after the kernel log, as before. Fails only when a
/// source cannot be set up (the TPU runtime's threads).
pub fn configured(
    cfg: Settings<'_>,
    extra: Vec<Box<dyn Source>>,
) -> std::io::Result<Vec<Box<dyn Source>>> {
    let mut out: Vec<Box<dyn Source>> = vec![Box::new(super::host_memory::HostMemory::new(
        cfg.host.clone(),
    ))];
    if cfg.kmsg.enabled {
        out.push(Box::new(super::kmsg::Kmsg::new(cfg.kmsg.clone())));
    }
    out.extend(extra);
    out.push(Box::new(super::host_net::HostNet::new(cfg.host.clone())));
    if let Some(disk) = super::host_disk::HostDisk::new(cfg.host.clone(), cfg.checkpoint) {
        out.push(Box::new(disk));
    }
    if let Some(tpu) = super::tpu::Tpu::new(cfg.tpu.clone(), cfg.host)? {
        out.push(Box::new(tpu));
    }
    if cfg.nvml.enabled {
        out.push(Box::new(super::nvml::NvmlSource::new(cfg.nvml.clone())));
    }
    if cfg.dcgm.enabled {
        out.push(Box::new(super::dcgm::DcgmSource::new(
            cfg.dcgm.clone(),
            cfg.nvml.enabled,
        )));
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
        let names: Vec<_> = configured(cfg.sources(), Vec::new())
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
        let names: Vec<_> = configured(cfg.sources(), Vec::new())
            .expect("sources")
            .iter()
            .map(|s| s.name())
            .collect();
        assert_eq!(names.last(), Some(&"nvml"), "{names:?}");
    }
}
