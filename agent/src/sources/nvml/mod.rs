//! NVML: per-GPU health from NVIDIA's management library.
//!
//! In: `libnvidia-ml.so.1` (or `nvml.library`), loaded at run time through
//! `nvml-wrapper`, so a node without a driver runs the same binary. Out: the
//! `nvml` component (library loaded, device count against
//! `nvml.expected_gpus`), one `gpuN` component per GPU (labels uuid, pci,
//! name) with `gpuN/pcie` and `gpuN/nvlinkL`, a `gpu.xid` event per XID, a
//! `gpu.processes` event whenever the processes holding a compute context
//! on a GPU change (the driver's word: attribution's only map of ranks to
//! devices besides an XID naming a pid, never the devices a rank declares),
//! and the per-GPU `warden_gpu_*` metrics (`prom`).
//! Must never: judge a lifetime counter as a verdict (counters are deltas
//! over `nvml.window`), or let a hung NVML call hang anything but this
//! source's own thread (the runner marks it stalled; XIDs wait on a thread
//! of their own, in `nvmlEventSetWait` with a timeout).
//!
//! No library, or a driver too old to have a call: the `nvml` component is
//! UNKNOWN with the loader's words, or the signal is simply not read.

pub mod config;
mod judge;
mod prom;
mod read;
mod xid;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant, SystemTime};
use warden_core::device::DeviceId;

pub use config::NvmlConfig;
pub use judge::{
    GpuReading, GpuState, NvLinkReading, RemappedRows, XidEvent, judge_count, judge_gpu, xid_status,
};
pub use prom::count_xid;

use warden_core::events::Severity;
use warden_core::health::{ComponentReport, Status};
use warden_core::signal::{self, Report, Signal, XidSource};

/// The node-level component of this source.
pub const COMPONENT: &str = "nvml";

/// The NVML source, run by [`super::runner`].
#[derive(Debug)]
pub struct NvmlSource {
    cfg: NvmlConfig,
    /// The loaded library; `None` until it loads (retried every poll, so a
    /// driver installed after the agent started is picked up).
    nvml: Option<Arc<nvml_wrapper::Nvml>>,
    /// Windows per GPU index, kept across polls.
    gpus: BTreeMap<u32, GpuState>,
    /// XIDs from the event thread.
    xids: Option<Receiver<XidEvent>>,
    /// Tells the event thread to end when the source is dropped.
    stop: xid::Stop,
    /// Why XIDs are not watched, once (a label on `nvml`).
    xid_status: String,
    /// The compute processes last published per GPU index.
    procs: BTreeMap<u32, Vec<u32>>,
}

/// Most pids one `gpu.processes` event names (a GPU runs a few ranks;
/// MPS or a crowded node more).
const MAX_PIDS: usize = 256;

impl NvmlSource {
    /// A source reading NVML as `cfg` says.
    pub fn new(cfg: NvmlConfig) -> Self {
        Self {
            cfg,
            nvml: None,
            gpus: BTreeMap::new(),
            xids: None,
            stop: xid::Stop::default(),
            xid_status: String::new(),
            procs: BTreeMap::new(),
        }
    }

    /// True when NVML is not there by design: the library under its default
    /// name is not found at all, and the host has no NVIDIA device node (a
    /// TPU or CPU host). A library named in the config, one that loads and
    /// fails, or a host with `/dev/nvidiactl` reads UNKNOWN instead: there
    /// NVML should be there.
    fn absent_by_design(&self, e: &nvml_wrapper::error::NvmlError) -> bool {
        matches!(e, nvml_wrapper::error::NvmlError::LibloadingError(_))
            && self.cfg.library == config::NvmlConfig::default().library
            && !std::path::Path::new("/dev/nvidiactl").exists()
    }

    /// Loads the library if not loaded yet; the `nvml` component says why not.
    fn load(&mut self, now: SystemTime) -> Result<Arc<nvml_wrapper::Nvml>, ComponentReport> {
        if let Some(n) = &self.nvml {
            return Ok(n.clone());
        }
        match nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new(&self.cfg.library))
            .init()
        {
            Ok(n) => {
                let n = Arc::new(n);
                match xid::spawn(n.clone(), self.stop.clone()) {
                    Ok((rx, watched)) => {
                        self.xids = Some(rx);
                        self.xid_status = watched;
                    }
                    Err(e) => self.xid_status = format!("not watched: {e}"),
                }
                self.nvml = Some(n.clone());
                Ok(n)
            }
            Err(e) if self.absent_by_design(&e) => Err(judge::absent(
                "nvml.load",
                format!(
                    "NVML not installed (absent by design: no {:?} and no NVIDIA device node): {e}",
                    self.cfg.library
                ),
                now,
            )),
            Err(e) => Err(judge::unknown(
                "nvml.load",
                format!("cannot use NVML from {:?}: {e}", self.cfg.library),
                now,
            )),
        }
    }
}

impl Drop for NvmlSource {
    fn drop(&mut self) {
        self.stop.set();
    }
}

impl crate::sources::SourceKind for NvmlSource {
    const NAME: &'static str = "nvml";
    type Config = NvmlConfig;

    fn config<'a>(settings: &crate::sources::settings::Settings<'a>) -> &'a NvmlConfig {
        settings.nvml
    }

    fn validate(cfg: &NvmlConfig, origin: &str) -> Result<(), warden_core::config::ConfigError> {
        cfg.validate(origin)
    }

    fn build(
        cfg: &NvmlConfig,
        settings: &crate::sources::settings::Settings<'_>,
    ) -> std::io::Result<Option<Box<dyn crate::sources::Source>>> {
        let _ = settings;
        Ok(cfg
            .enabled
            .then(|| Box::new(Self::new(cfg.clone())) as Box<dyn crate::sources::Source>))
    }
}

impl super::Source for NvmlSource {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        let mut poll = super::Poll::default();
        let nvml = match self.load(now) {
            Ok(n) => n,
            Err(report) => {
                poll.reports.push(report);
                return poll;
            }
        };
        let mono = Instant::now();
        // XIDs first, so this poll's reports carry them.
        if let Some(rx) = &self.xids {
            for x in rx.try_iter() {
                let status = xid_status(x.xid);
                count_xid(&DeviceId::Gpu(x.gpu).to_string(), x.xid, "nvml");
                let severity = match status {
                    Status::Failed => Severity::Error,
                    Status::Degraded => Severity::Warning,
                    _ => Severity::Info,
                };
                poll.events.push(Signal::Xid(signal::Xid {
                    source: XidSource::Nvml,
                    severity,
                    component: DeviceId::Gpu(x.gpu).to_string(),
                    xid: x.xid,
                    pid: None,
                    report: Report::new(format!("XID {} on gpu{} ({})", x.xid, x.gpu, x.pci))
                        .with("gpu", x.gpu)
                        .with("xid", x.xid)
                        .with("pci", &x.pci)
                        .with("status", status.as_str()),
                }));
                self.gpus
                    .entry(x.gpu)
                    .or_insert_with(|| GpuState::new(&self.cfg))
                    .note_xid(mono, now, x);
            }
        }
        let count = match nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                poll.reports.push(judge::unknown(
                    "nvml.device_count",
                    format!("NVML cannot count GPUs: {e}"),
                    now,
                ));
                return poll;
            }
        };
        let mut labels = BTreeMap::new();
        labels.insert("library".into(), self.cfg.library.clone());
        labels.insert("xid".into(), self.xid_status.clone());
        poll.reports
            .push(judge_count(count, &self.cfg, labels, now));
        for index in 0..count {
            let reading = read::gpu(&nvml, index);
            prom::record(&reading);
            let st = self
                .gpus
                .entry(index)
                .or_insert_with(|| GpuState::new(&self.cfg));
            poll.reports
                .extend(judge_gpu(&reading, st, &self.cfg, mono, now));
            if let Some(pids) = compute_pids(&nvml, index)
                && self.procs.get(&index) != Some(&pids)
            {
                poll.events.push(Signal::GpuProcesses(signal::GpuProcesses {
                    component: DeviceId::Gpu(index).to_string(),
                    pids: pids.clone(),
                }));
                self.procs.insert(index, pids);
            }
        }
        // A GPU seen before that NVML no longer counts is gone, not healthy.
        for index in self.gpus.keys().copied().filter(|i| *i >= count) {
            let gone = GpuReading {
                index,
                lost: Some(format!("no longer counted by NVML ({count} GPUs)")),
                ..GpuReading::default()
            };
            let mut st = GpuState::new(&self.cfg);
            poll.reports
                .extend(judge_gpu(&gone, &mut st, &self.cfg, mono, now));
        }
        poll
    }
}

/// The pids NVML lists with a compute context on GPU `index`, ascending,
/// at most [`MAX_PIDS`]; None when NVML cannot say (an old driver, a lost
/// GPU): then nothing is published and the last set stands.
fn compute_pids(nvml: &nvml_wrapper::Nvml, index: u32) -> Option<Vec<u32>> {
    let device = nvml.device_by_index(index).ok()?;
    let mut pids: Vec<u32> = device
        .running_compute_processes()
        .ok()?
        .into_iter()
        .map(|p| p.pid)
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids.truncate(MAX_PIDS);
    Some(pids)
}
