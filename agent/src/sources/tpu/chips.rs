//! TPU chips as sysfs shows them: PCI devices of vendor `0x1ae0` under
//! `<sysfs>/bus/pci/devices`, with their device nodes (`/dev/accelN` for
//! v2-v4, `/dev/vfio/<iommu group>` for v5e and later).

use std::collections::BTreeMap;
use std::path::Path;

/// Google's PCI vendor id.
pub const VENDOR: &str = "0x1ae0";

/// One chip found in sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chip {
    /// PCI addresses of the chip's functions.
    pub pci: Vec<String>,
    /// PCI device id (`0x0063`).
    pub device_id: String,
    /// Generation (`v5e`) where the device id is known.
    pub generation: Option<&'static str>,
    /// HBM per chip, GiB, where known.
    pub hbm_gib: Option<u32>,
    /// The device node the runtime opens, where found.
    pub dev: Option<String>,
}

/// Generation, HBM per chip (GiB) and PCI devices per chip of a device id.
pub fn generation(device_id: &str, subsystem: &str) -> Option<(&'static str, u32, usize)> {
    Some(match device_id {
        "0x0027" if subsystem == "0x004e" => ("v2", 8, 2),
        "0x0027" => ("v3", 16, 2),
        "0x005e" => ("v4", 32, 1),
        "0x0063" => ("v5e", 16, 1),
        "0x0062" => ("v5p", 95, 1),
        "0x006f" => ("v6e", 32, 1),
        "0x0076" => ("7x", 192, 2),
        _ => return None,
    })
}

fn read_trim(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Finds the TPU chips under `<sysfs_root>/bus/pci/devices`, in PCI order.
/// Functions of one PCI slot (`domain:bus:dev`) are one device; generations
/// with two devices per chip have consecutive devices paired.
pub fn discover(sysfs_root: &Path) -> Vec<Chip> {
    let base = sysfs_root.join("bus/pci/devices");
    let Ok(entries) = std::fs::read_dir(&base) else {
        return Vec::new();
    };
    // slot -> (functions, device id, subsystem, dev node)
    let mut slots: BTreeMap<String, (Vec<String>, String, String, Option<String>)> =
        BTreeMap::new();
    for e in entries.flatten() {
        let Ok(addr) = e.file_name().into_string() else {
            continue;
        };
        let dir = base.join(&addr);
        if read_trim(&dir.join("vendor")).as_deref() != Some(VENDOR) {
            continue;
        }
        let device_id = read_trim(&dir.join("device")).unwrap_or_default();
        let subsystem = read_trim(&dir.join("subsystem_device")).unwrap_or_default();
        let accel = std::fs::read_dir(dir.join("accel")).ok().and_then(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .min()
        });
        let dev = accel.map(|a| format!("/dev/{a}")).or_else(|| {
            std::fs::read_link(dir.join("iommu_group"))
                .ok()
                .and_then(|l| Some(format!("/dev/vfio/{}", l.file_name()?.to_str()?)))
        });
        let slot = addr
            .rsplit_once('.')
            .map_or(addr.as_str(), |(s, _)| s)
            .to_owned();
        let entry = slots
            .entry(slot)
            .or_insert_with(|| (Vec::new(), device_id, subsystem, None));
        entry.0.push(addr);
        entry.0.sort();
        if entry.3.is_none() {
            entry.3 = dev;
        }
    }
    let mut chips: Vec<Chip> = Vec::new();
    let mut pending: Option<Chip> = None;
    for (_, (pci, device_id, subsystem, dev)) in slots {
        let generation_info = generation(&device_id, &subsystem);
        let per_chip = generation_info.map_or(1, |g| g.2);
        if let Some(mut first) = pending.take() {
            if first.device_id == device_id {
                first.pci.extend(pci);
                chips.push(first);
                continue;
            }
            chips.push(first);
        }
        let chip = Chip {
            pci,
            device_id,
            generation: generation_info.map(|g| g.0),
            hbm_gib: generation_info.map(|g| g.1),
            dev,
        };
        if per_chip > 1 {
            pending = Some(chip);
        } else {
            chips.push(chip);
        }
    }
    chips.extend(pending);
    chips
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(root: &Path, addr: &str, vendor: &str, device: &str) {
        let dir = root.join("bus/pci/devices").join(addr);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap_or_default();
        std::fs::write(dir.join("device"), format!("{device}\n")).unwrap_or_default();
    }

    #[test]
    fn finds_chips_and_pairs_two_device_generations() {
        let Ok(tmp) = tempfile::tempdir() else {
            panic!("tempdir")
        };
        let root = tmp.path();
        device(root, "0000:00:04.0", "0x1ae0", "0x0063");
        device(root, "0000:00:05.0", "0x1ae0", "0x0063");
        device(root, "0000:00:06.0", "0x10de", "0x2330");
        let chips = discover(root);
        assert_eq!(chips.len(), 2);
        assert_eq!(chips[0].generation, Some("v5e"));
        assert_eq!(chips[1].pci, vec!["0000:00:05.0".to_owned()]);

        let Ok(tmp) = tempfile::tempdir() else {
            panic!("tempdir")
        };
        let root = tmp.path();
        for a in [
            "0000:00:04.0",
            "0000:00:05.0",
            "0000:00:06.0",
            "0000:00:07.0",
        ] {
            device(root, a, "0x1ae0", "0x0076");
        }
        let chips = discover(root);
        assert_eq!(chips.len(), 2, "7x: two devices per chip");
        assert_eq!(chips[0].hbm_gib, Some(192));
        assert!(discover(Path::new("/nonexistent")).is_empty());
    }
}
