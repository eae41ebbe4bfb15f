//! Device ids: the one spelling of an accelerator's (and its links') health
//! component, so that the sources that name devices and the attribution,
//! straggler and gate code that match them cannot drift apart.
//!
//! In: an index (NVML's, DCGM's, the kernel log's, a rank's local rank) or a
//! component id as the health model holds it. Out: [`DeviceId`]: `gpu<N>`
//! for GPU N, `tpu<N>`, and any other component kept as given; and what a
//! component id is about ([`DeviceId::of_component`]: a GPU, a GPU's link
//! `gpu<N>/nvlink<L>`, a NIC `nic/<name>`, an NVSwitch). Never: I/O.

use std::fmt;

/// An accelerator or device a health component is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceId {
    /// GPU `N` as NVML and DCGM index it on this host (`gpu<N>`).
    Gpu(u32),
    /// TPU chip `N` (`tpu<N>`).
    Tpu(u32),
    /// Another part of the TPUs (`tpu-core/<N>`, the runtime), as given.
    TpuPart(String),
    /// A NIC (`nic/<name>`).
    Nic(String),
    /// An NVSwitch (`nvswitch...`).
    NvSwitch(String),
    /// Anything else, as given.
    Other(String),
}

impl DeviceId {
    /// The GPU index a device name gives as a bare number (`3`, `03`, what
    /// follows `cuda:`); None for anything else, a number past `u32` too,
    /// so that `03` and `3` name the same component (`gpu3`).
    pub fn gpu_index(name: &str) -> Option<u32> {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        name.parse().ok()
    }

    /// The component id of link `link` of GPU `index`: `gpu<N>/nvlink<L>`.
    pub fn gpu_link(index: impl fmt::Display, link: impl fmt::Display) -> String {
        format!("gpu{index}/nvlink{link}")
    }

    /// The component id of TPU core `core` as the runtime numbers it, its
    /// chip not known: `tpu-core/<N>` (a [`DeviceId::TpuPart`]).
    pub fn tpu_core(core: impl fmt::Display) -> String {
        format!("tpu-core/{core}")
    }

    /// The component id of a GPU the kernel log names by its PCI address
    /// only, when no GPU of this host has that address: `gpu-<pci>`. Its
    /// index unknown, it is no [`DeviceId::Gpu`] (attribution weighs no
    /// device by a guess); kept as given.
    pub fn gpu_at_unknown_pci(pci: &str) -> String {
        format!("gpu-{pci}")
    }

    /// What a component id is about. A GPU's link (`gpu3/nvlink2`) is about
    /// GPU 3; a name that only starts like one (`gpux`) is `Other`.
    pub fn of_component(id: &str) -> Self {
        let head = id.split('/').next().unwrap_or(id);
        let index = |prefix: &str| {
            head.strip_prefix(prefix)
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
        };
        if let Some(n) = index("gpu") {
            DeviceId::Gpu(n)
        } else if let Some(n) = index("tpu") {
            DeviceId::Tpu(n)
        } else if id.starts_with("tpu") {
            DeviceId::TpuPart(id.to_owned())
        } else if let Some(name) = id.strip_prefix("nic/") {
            DeviceId::Nic(name.to_owned())
        } else if id.starts_with("nvswitch") {
            DeviceId::NvSwitch(id.to_owned())
        } else {
            DeviceId::Other(id.to_owned())
        }
    }

    /// Whether a component id is a GPU or one of its parts.
    pub fn is_gpu(id: &str) -> bool {
        matches!(Self::of_component(id), DeviceId::Gpu(_))
    }

    /// Whether a component id is a device (GPU, TPU, NIC, NVSwitch), not a
    /// host-wide component (memory, a disk, the cordon).
    pub fn is_device(id: &str) -> bool {
        !matches!(Self::of_component(id), DeviceId::Other(_))
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Gpu(n) => write!(f, "gpu{n}"),
            DeviceId::Tpu(n) => write!(f, "tpu{n}"),
            DeviceId::Nic(name) => write!(f, "nic/{name}"),
            DeviceId::TpuPart(s) | DeviceId::NvSwitch(s) | DeviceId::Other(s) => f.write_str(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_parts_belong_to_their_device() {
        assert_eq!(DeviceId::Gpu(3).to_string(), "gpu3");
        assert_eq!(DeviceId::gpu_index("03"), Some(3));
        assert_eq!(DeviceId::gpu_index("99999999999"), None);
        assert_eq!(DeviceId::gpu_index("3a"), None);
        assert_eq!(DeviceId::gpu_index(""), None);
        assert_eq!(
            DeviceId::of_component(&DeviceId::Tpu(2).to_string()),
            DeviceId::Tpu(2)
        );
        assert_eq!(
            DeviceId::of_component(&DeviceId::tpu_core(5)),
            DeviceId::TpuPart("tpu-core/5".into())
        );
        // A GPU known only by its PCI address is no GPU index: kept as given.
        let unmapped = DeviceId::gpu_at_unknown_pci("0000:3b:00.0");
        assert_eq!(unmapped, "gpu-0000:3b:00.0");
        assert!(!DeviceId::is_gpu(&unmapped));
        assert_eq!(DeviceId::gpu_link(3, 2), "gpu3/nvlink2");
        assert_eq!(DeviceId::of_component("gpu3"), DeviceId::Gpu(3));
        assert_eq!(DeviceId::of_component("gpu3/nvlink2"), DeviceId::Gpu(3));
        assert_eq!(DeviceId::of_component("tpu0"), DeviceId::Tpu(0));
        assert_eq!(
            DeviceId::of_component("nic/eth0"),
            DeviceId::Nic("eth0".into())
        );
        assert!(DeviceId::is_device("nvswitch0"));
        assert!(!DeviceId::is_gpu("gpux") && !DeviceId::is_device("gpux"));
        assert!(!DeviceId::is_device("host/memory") && !DeviceId::is_device("disk/checkpoint"));
        assert!(DeviceId::is_device("tpu-core/3"));
        for id in [
            "gpu7",
            "tpu1",
            "tpu-core/3",
            "nic/ib0",
            "nvswitch2",
            "host/memory",
        ] {
            assert_eq!(DeviceId::of_component(id).to_string(), id);
        }
    }
}
