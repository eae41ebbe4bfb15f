//! `--nproc-per-node`: a count, or torchrun's words for one (`gpu`,
//! `auto`, `cpu`), resolved as torchrun resolves them before anything
//! starts.
//!
//! torchrun asks torch (`torch.cuda.device_count()`, `os.cpu_count()`);
//! the launcher has no torch, so it asks NVML for the GPUs (the library
//! the agent uses; `$WARDEN_NVML_LIBRARY` to point elsewhere), limited to
//! `CUDA_VISIBLE_DEVICES` as CUDA limits torch, and the system for the
//! CPUs. `xpu` (Intel GPUs) asks torch itself, in the workers' interpreter
//! (`torch.xpu.device_count()`, as torchrun does), since nothing else here
//! counts them; no XPU (or no torch) is an error, as torchrun's "Xpu is not
//! available".

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
    /// One per Intel XPU, as torch counts them.
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
/// sees (an error when NVML cannot be loaded), `cpus` the CPUs online,
/// `xpus` the Intel XPUs torch sees ([`torch_xpus`]).
pub fn resolve(
    spec: NProc,
    gpus: impl FnOnce() -> Result<u32, String>,
    cpus: impl FnOnce() -> u32,
    xpus: impl FnOnce() -> Result<u32, String>,
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
        NProc::Xpu => match xpus() {
            Ok(n) if n > 0 => n,
            Ok(_) => {
                return Err(
                    "--nproc-per-node xpu: Xpu is not available (torch.xpu sees no device here)"
                        .into(),
                );
            }
            Err(e) => return Err(format!("--nproc-per-node xpu: cannot count the XPUs: {e}")),
        },
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

/// How long the interpreter may take to import torch and count XPUs.
const XPU_PROBE: std::time::Duration = std::time::Duration::from_secs(120);

/// The Intel XPUs torch sees, asked of `python` (the workers' interpreter)
/// as torchrun asks its own: `torch.xpu.device_count()` when
/// `torch.xpu.is_available()`, else 0. Bounded by [`XPU_PROBE`]; an
/// interpreter that cannot run, has no torch or prints anything else is an
/// error naming it.
pub fn torch_xpus(python: &str) -> Result<u32, String> {
    use std::io::Read;
    let code = "import torch, sys\n\
                x = getattr(torch, 'xpu', None)\n\
                sys.stdout.write(str(x.device_count() if x is not None and x.is_available() else 0))\n";
    let mut child = std::process::Command::new(python)
        .args(["-c", code])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {python:?}: {e}"))?;
    let deadline = std::time::Instant::now() + XPU_PROBE;
    // A start-up probe, once, before anything runs: polling its exit is
    // simpler than a thread and costs nothing a job would notice.
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{python:?} did not answer within {XPU_PROBE:?}"));
            }
            Err(e) => return Err(format!("waiting for {python:?}: {e}")),
        }
    };
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.by_ref().take(64).read_to_string(&mut out);
    }
    if !status.success() {
        return Err(format!("{python:?} could not import torch ({status})"));
    }
    out.trim()
        .parse::<u32>()
        .map_err(|_| format!("{python:?} answered {out:?}, not a count"))
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
        assert_eq!(resolve(NProc::Count(3), none, || 64, || Ok(0)), Ok(3));
        assert_eq!(resolve(NProc::Cpu, none, || 64, || Ok(0)), Ok(64));
        // auto: GPUs when there are any, else CPUs.
        assert_eq!(resolve(NProc::Auto, none, || 16, || Ok(0)), Ok(16));
        assert_eq!(resolve(NProc::Auto, || Ok(0), || 16, || Ok(0)), Ok(16));
        let e = resolve(NProc::Gpu, none, || 16, || Ok(0)).unwrap_err();
        assert!(
            e.contains("cannot count the GPUs: NVML not loadable"),
            "{e}"
        );
        assert!(resolve(NProc::Gpu, || Ok(0), || 16, || Ok(0)).is_err());
        // xpu: torch's count, and torchrun's error without one.
        assert_eq!(resolve(NProc::Xpu, none, || 16, || Ok(2)), Ok(2));
        assert!(
            resolve(NProc::Xpu, || Ok(8), || 16, || Ok(0))
                .unwrap_err()
                .contains("Xpu is not available")
        );
        assert!(
            resolve(NProc::Xpu, none, || 16, || Err("no torch".into()))
                .unwrap_err()
                .contains("cannot count the XPUs: no torch")
        );
        assert!(
            resolve(NProc::Cpu, none, || 4096, || Ok(0))
                .unwrap_err()
                .contains("at most 1024")
        );
        assert_eq!(visible_devices("0,1,2"), 3);
        assert_eq!(visible_devices("2,,3"), 1);
        assert_eq!(visible_devices(""), 0);
    }
}
