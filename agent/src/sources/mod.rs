//! Sources: where readings about the node come from.
//!
//! In: the machine (procfs, sysfs, the kernel log, and NVML, DCGM, the TPU
//! runtime where present). Out: [`warden_core::health::ComponentReport`]s and
//! events, through [`Source::poll`]. Every source runs on a thread of its own
//! ([`runner::spawn`]), so a library call that blocks or hangs stalls only
//! that source: the runner marks its components UNKNOWN with the reason and
//! the API and the work loop never wait for it. A source judges counters as
//! deltas over a window ([`warden_core::health::window`]), never lifetime totals.

pub mod dcgm;
pub mod host_config;
pub mod host_disk;
pub mod host_memory;
pub mod host_net;
pub mod kmsg;
pub mod nvml;
pub mod registry;
pub mod runner;
pub mod settings;
pub mod simulated;
pub mod tpu;

use std::time::{Duration, SystemTime};

use warden_core::health::ComponentReport;
use warden_core::signal::Signal;

/// What one poll of a source produced.
#[derive(Debug, Default)]
pub struct Poll {
    /// The current state of each component this source covers.
    pub reports: Vec<ComponentReport>,
    /// Things that happened (an XID, a link flap) with their evidence.
    pub events: Vec<Signal>,
}

/// One kind of source, as the registry ([`registry`]) knows it: its name,
/// the section of the configuration it reads, how that section is checked,
/// and how the source is built from it.
///
/// Why a trait beside [`Source`]: the registry builds and validates every
/// kind the same way from one list, so that adding a source is its folder,
/// an `impl SourceKind`, and one line in that list; neither the daemon nor
/// the configuration's checks name a source.
pub trait SourceKind {
    /// The source's name: what its [`Source::name`] returns.
    const NAME: &'static str;
    /// The section of the configuration it reads (`[kmsg]`, `[nvml]`...).
    type Config: 'static;
    /// Its section among the sections the sources read.
    fn config<'a>(settings: &settings::Settings<'a>) -> &'a Self::Config;
    /// Checks its section: a bad key is [`warden_core::config::ConfigError::Invalid`].
    fn validate(cfg: &Self::Config, origin: &str) -> Result<(), warden_core::config::ConfigError>;
    /// The source, built from its section (and the other sections it reads,
    /// from `settings`), or None when the configuration turns it off. Fails
    /// only when it cannot be set up (a thread, a runtime).
    fn build(
        cfg: &Self::Config,
        settings: &settings::Settings<'_>,
    ) -> std::io::Result<Option<Box<dyn Source>>>;
}

/// A source of health readings.
///
/// Why a trait: the runner, stall detection and the health model are the
/// same for NVML, DCGM, the kernel log, the host and the simulated twin; a
/// source only knows how to read and judge its own signals.
pub trait Source: Send + 'static {
    /// Short stable name (`host`, `kmsg`, `nvml`...), used in logs and in
    /// the reason of a stalled source.
    fn name(&self) -> &'static str;

    /// How often the runner calls [`Source::poll`]. A source that waits for
    /// events (the kernel log, NVML event sets) may block in `poll` for up
    /// to this long.
    fn interval(&self) -> Duration;

    /// Reads and judges the source's signals at `now`.
    fn poll(&mut self, now: SystemTime) -> Poll;
}
