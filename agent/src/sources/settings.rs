//! The sections of the agent's configuration the sources read.
//!
//! Apart from the list of sources (`registry.rs`), which imports every
//! source: each source's `impl SourceKind` takes these, and a `Settings`
//! kept in the list made every source and the list import each other.
//! Each section's type is named from its own file (`dcgm/config.rs`,
//! `kmsg/config.rs`...), never from the source beside it.

use super::dcgm::config::DcgmConfig;
use super::host_config::HostConfig;
use super::kmsg::config::KmsgConfig;
use super::nvml::config::NvmlConfig;
use super::simulated::config::SimulatedConfig;
use super::tpu::config::TpuConfig;
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
    /// `[simulated]`.
    pub simulated: &'a SimulatedConfig,
    /// `[checkpoint]`: the host's disk source watches the tier's filesystem.
    pub checkpoint: &'a CheckpointConfig,
}
