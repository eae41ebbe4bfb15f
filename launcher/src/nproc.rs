//! `--nproc-per-node`: a count, or torchrun's words for one (`gpu`,
//! `auto`, `cpu`), resolved as torchrun resolves them before anything
//! starts.
//!
//! torchrun asks torch (`torch.cuda.device_count()`, `os.cpu_count()`);
//! the launcher has no torch, so it asks NVML for the GPUs (the library
//! the agent uses; `$WARDEN_NVML_LIBRARY` to point elsewhere), limited to
//! `CUDA_VISIBLE_DEVICES` as CUDA limits torch, and the system for the
//! CPUs. `xpu` (Intel GPUs) is refused by name: nothing here counts them.

use std::fmt;

/// Most workers one node may run.
pub const MAX: u32 = 1024;

/// What `--nproc-per-node` said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NProc {
    /// A number.
    Count(u32),
    /// One per visible GPU; an error without one.
    Gpu,
    /// One per visible GPU, else one per CPU.
    Auto,
    /// One per CPU.
    Cpu,
    /// One per Intel XPU: refused.
    Xpu,
}

impl Default for NProc {
    fn default() -> Self {
        Self::Count(1)
    }
}

impl fmt::Display for NProc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Count(n) => write!(f, "{n}"),
            Self::Gpu => f.write_str("gpu"),
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Xpu => f.write_str("xpu"),
        }
    }
}

/// Parses `--nproc-per-node`.
pub fn parse(s: &str) -> Result<NProc, String> {
    match s.trim() {
        "gpu" => Ok(NProc::Gpu),
        "auto" => Ok(NProc::Auto),
        "cpu" => Ok(NProc::Cpu),
        "xpu" => Ok(NProc::Xpu),
        n => n
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX).contains(n))
            .map(NProc::Count)
            .ok_or_else(|| format!("{s:?}: give 1 to {MAX}, or gpu, auto, cpu")),
    }
}

/// The count `spec` stands for on this node. `gpus` counts the GPUs NVML
/// sees (an error when NVML cannot be loaded), `cpus` the CPUs online.
pub fn resolve(
    spec: NProc,
    gpus: impl FnOnce() -> Result<u32, String>,
    cpus: impl FnOnce() -> u32,
) -> Result<u32, String> {
    let visible = |n: u32| match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => n.min(visible_devices(&v)),
        Err(_) => n,
    };
    let n = match spec {
        NProc::Count(n) => n,
        NProc::Gpu => match gpus() {
            Ok(n) if visible(n) > 0 => visible(n),
            Ok(_) => {
                return Err(
                    "--nproc-per-node gpu: no GPU is visible here (NVML found none, or CUDA_VISIBLE_DEVICES hides them all)"
                        .into(),
                );
            }
            Err(e) => return Err(format!("--nproc-per-node gpu: cannot count the GPUs: {e}")),
        },
        NProc::Auto => match gpus().map(visible) {
            Ok(n) if n > 0 => n,
            _ => cpus(),
        },
        NProc::Cpu => cpus(),
        NProc::Xpu => {
            return Err(
                "--nproc-per-node xpu: warden cannot count Intel XPUs; give the count as a number"
                    .into(),
            );
        }
    };
    if !(1..=MAX).contains(&n) {
        return Err(format!(
            "--nproc-per-node {spec} is {n} workers here; at most {MAX}: give a number"
        ));
    }
    Ok(n)
}

/// Devices CUDA shows for `CUDA_VISIBLE_DEVICES=value`: the entries up to
/// the first empty one (CUDA stops at the first it cannot read).
fn visible_devices(value: &str) -> u32 {
    let n = value
        .split(',')
        .map(str::trim)
        .take_while(|e| !e.is_empty() && *e != "-1")
        .count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The GPUs NVML sees, through `library`.
pub fn nvml_gpus(library: &str) -> Result<u32, String> {
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new(library))
        .init()
        .map_err(|e| format!("NVML not loadable from {library:?}: {e}"))?;
    nvml.device_count()
        .map_err(|e| format!("NVML device count: {e}"))
}

/// CPUs online, as Python's `os.cpu_count()` counts them.
pub fn cpus_online() -> u32 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchruns_words_are_read_and_a_bad_count_is_named() {
        assert_eq!(parse("8"), Ok(NProc::Count(8)));
        assert_eq!(parse("gpu"), Ok(NProc::Gpu));
        assert_eq!(parse("auto"), Ok(NProc::Auto));
        assert_eq!(parse("cpu"), Ok(NProc::Cpu));
        assert!(parse("0").unwrap_err().contains("give 1 to 1024"));
        assert!(parse("many").is_err());
    }

    #[test]
    fn each_word_resolves_as_torchrun_would() {
        let none = || Err::<u32, String>("NVML not loadable".into());
        assert_eq!(resolve(NProc::Count(3), none, || 64), Ok(3));
        assert_eq!(resolve(NProc::Cpu, none, || 64), Ok(64));
        // auto: GPUs when there are any, else CPUs.
        assert_eq!(resolve(NProc::Auto, none, || 16), Ok(16));
        assert_eq!(resolve(NProc::Auto, || Ok(0), || 16), Ok(16));
        let e = resolve(NProc::Gpu, none, || 16).unwrap_err();
        assert!(
            e.contains("cannot count the GPUs: NVML not loadable"),
            "{e}"
        );
        assert!(resolve(NProc::Gpu, || Ok(0), || 16).is_err());
        assert!(
            resolve(NProc::Xpu, || Ok(8), || 16)
                .unwrap_err()
                .contains("XPU")
        );
        assert!(
            resolve(NProc::Cpu, none, || 4096)
                .unwrap_err()
                .contains("at most 1024")
        );
        assert_eq!(visible_devices("0,1,2"), 3);
        assert_eq!(visible_devices("2,,3"), 1);
        assert_eq!(visible_devices(""), 0);
    }
}
