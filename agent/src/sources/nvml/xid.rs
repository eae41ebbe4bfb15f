//! XIDs through an NVML event set, on a thread of its own: `nvmlEventSetWait`
//! blocks (with a timeout, in a loop), which the poll must never do.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;

use super::judge::Xid;

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
/// thread. An error (no GPU supports the events, no event set) says why
/// XIDs are not watched; GPU health is still read.
pub fn spawn(nvml: Arc<Nvml>, stop: Stop) -> Result<Receiver<Xid>, String> {
    let (tx, rx) = channel();
    let (ready_tx, ready_rx) = channel();
    std::thread::Builder::new()
        .name("nvml-xid".into())
        .spawn(move || run(&nvml, &stop, &tx, &ready_tx))
        .map_err(|e| format!("cannot start the XID thread: {e}"))?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(rx),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the XID thread ended at start".into()),
    }
}

fn run(nvml: &Nvml, stop: &Stop, tx: &Sender<Xid>, ready: &Sender<Result<(), String>>) {
    let set = match register(nvml) {
        Ok(set) => {
            let _ = ready.send(Ok(()));
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
                    .send(Xid {
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

fn register(nvml: &Nvml) -> Result<nvml_wrapper::EventSet<'_>, String> {
    let mut set = nvml
        .create_event_set()
        .map_err(|e| format!("nvmlEventSetCreate: {e}"))?;
    let count = nvml
        .device_count()
        .map_err(|e| format!("nvmlDeviceGetCount: {e}"))?;
    let mut registered = 0;
    for i in 0..count {
        let Ok(dev) = nvml.device_by_index(i) else {
            continue;
        };
        set = match dev.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => {
                registered += 1;
                s
            }
            // The wrapper frees the set on failure: start a new one.
            Err(_) => nvml
                .create_event_set()
                .map_err(|e| format!("nvmlEventSetCreate: {e}"))?,
        };
    }
    if registered == 0 && count > 0 {
        return Err("no GPU accepts XID event registration".into());
    }
    Ok(set)
}
