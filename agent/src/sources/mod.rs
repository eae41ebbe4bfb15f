//! Sources: where readings about the node come from.
//!
//! In: the machine (procfs, sysfs, and later NVML, DCGM, the kernel log, the
//! TPU runtime). Out: [`crate::health::ComponentReport`]s. Never: block the
//! API or the work loop for long; a source reads, judges against its
//! thresholds and returns.

pub mod host_memory;
