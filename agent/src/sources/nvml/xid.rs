//! XIDs through an NVML event set, on a thread of its own: `nvmlEventSetWait`
//! blocks (with a timeout, in a loop), which the poll must never do.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use warden_core::device::DeviceId;

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::{NvmlError, nvml_try};

use super::judge::XidEvent;

/// How long one wait blocks; bounds how late the thread notices `Stop`.
const WAIT_MS: u32 = 500;

/// Set when the source is dropped; the thread ends after its current wait.
#[derive(Debug, Clone, Default)]
pub struct Stop(Arc<AtomicBool>);

impl Stop {
    /// Asks the thread to end.
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Registers every GPU for critical XID events and starts the waiting
/// thread. Ok: the receiver and what it watches ("watched", or which GPUs
/// refused). An error (no GPU accepts the events, no event set) says why
/// XIDs are not watched; GPU health is still read.
pub fn spawn(nvml: Arc<Nvml>, stop: Stop) -> Result<(Receiver<XidEvent>, String), String> {
    let (tx, rx) = channel();
    let (ready_tx, ready_rx) = channel();
    std::thread::Builder::new()
        .name("nvml-xid".into())
        .spawn(move || run(&nvml, &stop, &tx, &ready_tx))
        .map_err(|e| format!("cannot start the XID thread: {e}"))?;
    match ready_rx.recv() {
        Ok(Ok(watched)) => Ok((rx, watched)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the XID thread ended at start".into()),
    }
}

fn run(nvml: &Nvml, stop: &Stop, tx: &Sender<XidEvent>, ready: &Sender<Result<String, String>>) {
    let set = match register(nvml) {
        Ok((set, refused)) => {
            let watched = if refused.is_empty() {
                "watched".to_owned()
            } else {
                tracing::warn!(refused = %refused.join(", "), "some GPUs refuse XID events");
                format!("watched, except {}", refused.join(", "))
            };
            let _ = ready.send(Ok(watched));
            set
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    while !stop.is_set() {
        match set.wait(WAIT_MS) {
            Ok(ev) => {
                if !ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    continue;
                }
                let gpu = ev.device.index().unwrap_or(u32::MAX);
                let pci = ev.device.pci_info().map(|p| p.bus_id).unwrap_or_default();
                if tx
                    .send(XidEvent {
                        gpu,
                        xid: match ev.event_data {
                            Some(XidError::Value(v)) => v,
                            _ => 0,
                        },
                        pci,
                    })
                    .is_err()
                {
                    return;
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "nvmlEventSetWait failed; XIDs no longer watched");
                return;
            }
        }
    }
}

/// Registers every GPU it can for critical XIDs on one event set. Through
/// the raw `nvmlDeviceRegisterEvents`: nvml-wrapper's `register_events`
/// frees the whole set when one GPU refuses, which would drop the GPUs
/// registered before it. Returns the set and, per GPU that refused, why.
fn register(nvml: &Nvml) -> Result<(nvml_wrapper::EventSet<'_>, Vec<String>), String> {
    let sym = nvml
        .lib()
        .nvmlDeviceRegisterEvents
        .as_ref()
        .map_err(|e| format!("nvmlDeviceRegisterEvents: {e}"))?;
    let set = nvml
        .create_event_set()
        .map_err(|e| format!("nvmlEventSetCreate: {e}"))?;
    let count = nvml
        .device_count()
        .map_err(|e| format!("nvmlDeviceGetCount: {e}"))?;
    let mut refused = Vec::new();
    for i in 0..count {
        let dev = match nvml.device_by_index(i) {
            Ok(d) => d,
            Err(e) => {
                refused.push(format!(
                    "{} (nvmlDeviceGetHandleByIndex: {e})",
                    DeviceId::Gpu(i)
                ));
                continue;
            }
        };
        // SAFETY: both handles come from this live `Nvml` (the device and
        // the set borrow it) and the set is not freed while registering; a
        // failed registration leaves the set as it was (NVML's contract),
        // so it stays valid for the GPUs already registered.
        let ret = unsafe {
            sym(
                dev.handle(),
                EventTypes::CRITICAL_XID_ERROR.bits(),
                set.handle(),
            )
        };
        if let Err(e) = nvml_try(ret) {
            refused.push(format!(
                "{} (nvmlDeviceRegisterEvents: {e})",
                DeviceId::Gpu(i)
            ));
        }
    }
    if count > 0 && refused.len() == usize::try_from(count).unwrap_or(usize::MAX) {
        return Err(format!(
            "no GPU accepts XID event registration: {}",
            refused.join(", ")
        ));
    }
    Ok((set, refused))
}
