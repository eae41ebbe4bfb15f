//! Reading one GPU through NVML. Every call may fail on its own: NOT_SUPPORTED
//! (or a symbol an old driver lacks) leaves the signal unread, and the call
//! is named in the GPU's `unread` label so an operator sees what this GPU's
//! health is judged without; GPU_IS_LOST or RESET_REQUIRED from any call
//! marks the GPU lost.

use std::collections::{BTreeMap, BTreeSet};

use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor,
};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::NVML_FI_DEV_GET_GPU_RECOVERY_ACTION;
use nvml_wrapper::{Device, Nvml};

use super::judge::{GpuReading, NvLinkReading, RemappedRows};

/// Most NVLinks a GPU has (NVML_NVLINK_MAX_LINKS).
const MAX_LINKS: u32 = 18;

/// What the calls of one reading said besides their values.
#[derive(Debug, Default)]
struct Calls {
    /// The first call that found the GPU lost, and what it said.
    lost: Option<String>,
    /// Calls that answered with another error (NOT_SUPPORTED, a symbol the
    /// driver lacks, no permission): their signals are not read.
    unread: BTreeSet<&'static str>,
}

/// Keeps the value of a call, noting a lost GPU or an unread signal.
fn keep<T>(r: Result<T, NvmlError>, call: &'static str, calls: &mut Calls) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e @ (NvmlError::GpuLost | NvmlError::ResetRequired)) => {
            if calls.lost.is_none() {
                calls.lost = Some(format!("{call}: {e}"));
            }
            None
        }
        Err(_) => {
            calls.unread.insert(call);
            None
        }
    }
}

/// Reads everything this source judges from GPU `index`.
pub fn gpu(nvml: &Nvml, index: u32) -> GpuReading {
    let mut r = GpuReading {
        index,
        ..GpuReading::default()
    };
    let dev = match nvml.device_by_index(index) {
        Ok(d) => d,
        Err(e) => {
            r.lost = Some(format!("nvmlDeviceGetHandleByIndex: {e}"));
            return r;
        }
    };
    let calls = &mut Calls::default();
    let mut labels = BTreeMap::new();
    if let Some(v) = keep(dev.uuid(), "nvmlDeviceGetUUID", calls) {
        labels.insert("uuid".to_owned(), v);
    }
    if let Some(v) = keep(dev.pci_info(), "nvmlDeviceGetPciInfo", calls) {
        labels.insert("pci".to_owned(), v.bus_id);
    }
    if let Some(v) = keep(dev.name(), "nvmlDeviceGetName", calls) {
        labels.insert("name".to_owned(), v);
    }
    r.labels = labels;
    let ecc = |e, c| dev.total_ecc_errors(e, c);
    r.ecc_uncorrected_volatile = keep(
        ecc(MemoryError::Uncorrected, EccCounter::Volatile),
        "nvmlDeviceGetTotalEccErrors",
        calls,
    );
    r.ecc_corrected_volatile = keep(
        ecc(MemoryError::Corrected, EccCounter::Volatile),
        "nvmlDeviceGetTotalEccErrors",
        calls,
    );
    r.ecc_uncorrected_aggregate = keep(
        ecc(MemoryError::Uncorrected, EccCounter::Aggregate),
        "nvmlDeviceGetTotalEccErrors",
        calls,
    );
    let sbe = keep(
        dev.retired_pages(RetirementCause::MultipleSingleBitEccErrors),
        "nvmlDeviceGetRetiredPages",
        calls,
    );
    let dbe = keep(
        dev.retired_pages(RetirementCause::DoubleBitEccError),
        "nvmlDeviceGetRetiredPages",
        calls,
    );
    if sbe.is_some() || dbe.is_some() {
        let n = sbe.map_or(0, |v| v.len()) + dbe.map_or(0, |v| v.len());
        r.retired_pages = u64::try_from(n).ok();
    }
    r.retired_pending = keep(
        dev.are_pages_pending_retired(),
        "nvmlDeviceGetRetiredPagesPendingStatus",
        calls,
    );
    r.remapped = keep(
        remapped_rows(nvml, &dev),
        "nvmlDeviceGetRemappedRows",
        calls,
    );
    r.pcie_replays = keep(
        dev.pcie_replay_counter(),
        "nvmlDeviceGetPcieReplayCounter",
        calls,
    )
    .map(u64::from);
    let gen_cur = keep(
        dev.current_pcie_link_gen(),
        "nvmlDeviceGetCurrPcieLinkGeneration",
        calls,
    );
    let gen_max = keep(
        dev.max_pcie_link_gen(),
        "nvmlDeviceGetMaxPcieLinkGeneration",
        calls,
    );
    r.pcie_gen = gen_cur.zip(gen_max);
    let w_cur = keep(
        dev.current_pcie_link_width(),
        "nvmlDeviceGetCurrPcieLinkWidth",
        calls,
    );
    let w_max = keep(
        dev.max_pcie_link_width(),
        "nvmlDeviceGetMaxPcieLinkWidth",
        calls,
    );
    r.pcie_width = w_cur.zip(w_max);
    r.clock_events = keep(
        dev.current_throttle_reasons().map(|r| r.bits()),
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        calls,
    );
    r.temperature = keep(
        dev.temperature(TemperatureSensor::Gpu),
        "nvmlDeviceGetTemperature",
        calls,
    );
    r.power_mw = keep(dev.power_usage(), "nvmlDeviceGetPowerUsage", calls);
    r.recovery_action = keep(recovery_action(&dev), "nvmlDeviceGetFieldValues", calls);
    for link in 0..MAX_LINKS {
        let w = dev.link_wrapper_for(link);
        // The first link NVML refuses ends the list (fewer links, or none):
        // unread only when it is the first.
        let active = match w.is_active() {
            Ok(a) => a,
            Err(e) => {
                if link == 0 || matches!(e, NvmlError::GpuLost | NvmlError::ResetRequired) {
                    keep(Err::<(), _>(e), "nvmlDeviceGetNvLinkState", calls);
                }
                break;
            }
        };
        let counter = |c, calls: &mut Calls| {
            keep(w.error_counter(c), "nvmlDeviceGetNvLinkErrorCounter", calls)
        };
        let flit = counter(ErrorCounter::DlCrcFlit, calls);
        let data = counter(ErrorCounter::DlCrcData, calls);
        r.links.push(NvLinkReading {
            link,
            active,
            replay: counter(ErrorCounter::DlReplay, calls),
            recovery: counter(ErrorCounter::DlRecovery, calls),
            crc: match (flit, data) {
                (None, None) => None,
                (f, d) => Some(f.unwrap_or(0) + d.unwrap_or(0)),
            },
        });
    }
    r.lost = calls.lost.take();
    r.unread = std::mem::take(&mut calls.unread)
        .into_iter()
        .map(str::to_owned)
        .collect();
    r
}

/// The driver's recovery action (r570+): field
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, 230 in NVIDIA's `nvml.h` (as in
/// nvml-wrapper-sys' bindings and pynvml). An older driver answers the field
/// with NOT_SUPPORTED (or lacks `nvmlDeviceGetFieldValues`): not read.
fn recovery_action(dev: &Device<'_>) -> Result<u64, NvmlError> {
    let mut got = dev.field_values_for(&[FieldId(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)])?;
    let sample = got.pop().ok_or(NvmlError::NotSupported)??;
    match sample.value? {
        SampleValue::U32(v) => Ok(u64::from(v)),
        SampleValue::U64(v) => Ok(v),
        SampleValue::I64(v) => u64::try_from(v).map_err(|_| NvmlError::NotSupported),
        SampleValue::F64(_) => Err(NvmlError::NotSupported),
    }
}

/// `nvmlDeviceGetRemappedRows`, which nvml-wrapper does not wrap.
fn remapped_rows(nvml: &Nvml, dev: &Device<'_>) -> Result<RemappedRows, NvmlError> {
    let sym = nvml
        .lib()
        .nvmlDeviceGetRemappedRows
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let (mut corr, mut unc, mut pending, mut failure) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: the handle comes from this live `Nvml` (the device borrows it),
    // and the four out-pointers are valid, distinct `c_uint`s on our stack,
    // as the NVML signature requires.
    let ret = unsafe {
        sym(
            dev.handle(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failure,
        )
    };
    nvml_try(ret)?;
    Ok(RemappedRows {
        corrected: corr,
        uncorrected: unc,
        pending: pending != 0,
        failure: failure != 0,
    })
}
