//! A client's options: the registration's identity, where the agent is, the
//! link's timings, the rank's devices, from the environment or given.
//!
//! In: environment variables (`WARDEN_*`, torchrun's `RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `CUDA_VISIBLE_DEVICES`) or explicit values. Out: validated
//! [`ConnectOptions`]; [`ClientError`] only for a value that cannot be
//! used, naming it. Never: fail for anything about the agent (absent,
//! slow, gone): that is the link's business and never an error.

use std::path::PathBuf;
use std::time::Duration;

#[cfg(doc)]
use super::{Client, LinkStatus};

/// Errors from building a client's options. Agent trouble is never an error.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// An environment variable holds something that is not a number.
    #[error("environment variable {var}={value:?} is not a valid {what}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        what: &'static str,
    },
    /// The job id is empty.
    #[error("job id must not be empty")]
    EmptyJobId,
    /// The world size is zero or a rank does not fit in it.
    #[error("rank {rank} is out of range for world size {world_size}")]
    BadRank {
        /// The global rank.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// The background thread could not be started.
    #[error("cannot start the client's background thread: {0}")]
    Thread(std::io::Error),
    /// A device name the agent would refuse (so the rank could never register).
    #[error("device name {name:?} {why}")]
    BadDevice {
        /// The name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// More devices than the agent accepts for one rank.
    #[error("{count} devices named; at most {MAX_DEVICES}")]
    TooManyDevices {
        /// How many were named.
        count: usize,
    },
}

/// Most devices one rank may name; the agent refuses a registration with more.
pub const MAX_DEVICES: usize = 16;
/// Longest device name, in bytes; the agent refuses longer ones.
pub const MAX_DEVICE_NAME: usize = 128;

/// How to reach the agent and who this rank is.
///
/// Why a struct apart from the client: defaults come from the launcher's
/// environment, and C, Python and Rust callers override single fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// The agent's socket (default: [`crate::paths::client_socket_path`]).
    pub socket_path: PathBuf,
    /// Job id (`WARDEN_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else "default").
    pub job_id: String,
    /// Global rank (`RANK`, else 0).
    pub global_rank: u32,
    /// Rank on this host (`LOCAL_RANK`, else the global rank).
    pub local_rank: u32,
    /// Ranks in the job (`WORLD_SIZE`, else global rank + 1).
    pub world_size: u32,
    /// How long `connect` waits for the first registration attempt.
    pub connect_timeout: Duration,
    /// How often the background thread checks that the agent is still there.
    pub probe_interval: Duration,
    /// The signal on which this process writes a dump of all its threads'
    /// stacks to [`LinkStatus::stack_dump_path`], so the agent can attach it
    /// to a hang; 0 when the process has no such handler (plain Rust and C
    /// clients, unless they set `WARDEN_STACK_DUMP_SIGNAL` and handle it).
    /// The Python package sets it and installs faulthandler.
    pub stack_dump_signal: i32,
    /// The accelerators this rank drives ("gpu5", "GPU-8f3c...", "MIG-..."),
    /// sent at registration so the agent ties a GPU fault to the ranks it
    /// hurts and a rank's crash to its GPU. Empty: the agent assumes
    /// `gpu<local_rank>`, the torchrun convention. From the environment:
    /// see [`devices_from_env`].
    pub devices: Vec<String>,
    /// The most [`Client::report_exception`] may take, connect and answer
    /// included (default 1 s): a dying process must never hang on it.
    pub exception_report_timeout: Duration,
}

/// The default of [`ConnectOptions::exception_report_timeout`].
pub const EXCEPTION_REPORT_TIMEOUT: Duration = Duration::from_secs(1);

/// The devices a rank drives, from its environment (a pure function of the
/// variables, so a table of cases tests it).
///
/// - `WARDEN_DEVICES` (`warden_devices`), comma-separated, wins and is used
///   as given: the launcher or the user knows best (a rank driving several
///   GPUs, a UUID, a PCI bus id).
/// - Else `CUDA_VISIBLE_DEVICES` (`cuda_visible`) when set and not empty.
///   With several entries the rank drives the one at its `local_rank`: the
///   launcher gave every rank the node's list and each rank selects its own
///   device by local rank (`torch.cuda.set_device(local_rank)`), so entry
///   `local_rank` is the physical device behind it. With one entry, the
///   launcher pinned the rank to that device. A number `N` names the GPU
///   the agent calls `gpuN` (NVML's index; CUDA's numbering agrees under
///   `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and on nodes of identical GPUs); a UUID
///   (`GPU-...`, `MIG-...`) is kept as is, for the agent to match against
///   NVML's UUIDs, since it names the device whatever the order. A negative
///   entry (`-1`: "no GPU") or a local rank past the list's end names
///   nothing.
/// - Else nothing: the agent assumes `gpu<local_rank>`, which is right for
///   torchrun's one-process-per-GPU default without `CUDA_VISIBLE_DEVICES`.
///
/// Names the agent would refuse (empty, control characters, longer than
/// [`MAX_DEVICE_NAME`]) are dropped and at most [`MAX_DEVICES`] kept, so a
/// malformed variable costs the device attribution, never the registration.
pub fn devices_from_env(
    warden_devices: Option<&str>,
    cuda_visible: Option<&str>,
    local_rank: u32,
) -> Vec<String> {
    let names: Vec<String> = if let Some(list) = warden_devices.filter(|v| !v.trim().is_empty()) {
        list.split(',').map(|d| d.trim().to_owned()).collect()
    } else if let Some(list) = cuda_visible.filter(|v| !v.trim().is_empty()) {
        let entries: Vec<&str> = list.split(',').map(str::trim).collect();
        let mine = match entries.as_slice() {
            [one] => Some(*one),
            many => usize::try_from(local_rank)
                .ok()
                .and_then(|i| many.get(i).copied()),
        };
        match mine {
            Some(e) if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) => {
                // Leading zeros ("01") name the same GPU as "1". The
                // agent's spelling (core's `DeviceId::Gpu`, which this
                // crate does not link; a test of the agent's holds the two
                // together).
                let n = e.trim_start_matches('0');
                vec![format!("gpu{}", if n.is_empty() { "0" } else { n })]
            }
            Some(e) if e.starts_with('-') => Vec::new(),
            Some(e) => vec![e.to_owned()],
            None => Vec::new(),
        }
    } else {
        Vec::new()
    };
    names
        .into_iter()
        .filter(|d| device_name_problem(d).is_none())
        .take(MAX_DEVICES)
        .collect()
}

/// Why the agent would refuse `name` as a device name, if it would.
fn device_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_DEVICE_NAME {
        Some("is longer than 128 bytes")
    } else if name.chars().any(char::is_control) {
        Some("holds control characters")
    } else {
        None
    }
}

/// [`devices_from_env`] of this process's environment.
fn env_devices(local_rank: u32) -> Vec<String> {
    let var = |v: &str| std::env::var(v).ok();
    devices_from_env(
        var("WARDEN_DEVICES").as_deref(),
        var("CUDA_VISIBLE_DEVICES").as_deref(),
        local_rank,
    )
}

fn env_u32(var: &'static str) -> Result<Option<u32>, ClientError> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => {
            v.trim().parse().map(Some).map_err(|_| ClientError::BadEnv {
                var,
                value: v,
                what: "non-negative integer",
            })
        }
        _ => Ok(None),
    }
}

impl ConnectOptions {
    /// Options from the environment the launchers set (torchrun, `warden run`).
    ///
    /// A malformed variable is an error so the caller can report it; use
    /// [`ConnectOptions::from_env_lossy`] to fall back to defaults instead.
    pub fn from_env() -> Result<ConnectOptions, ClientError> {
        let job_id = ["WARDEN_JOB_ID", "TORCHELASTIC_RUN_ID"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "default".to_owned());
        let global_rank = env_u32("RANK")?.unwrap_or(0);
        let local_rank = env_u32("LOCAL_RANK")?.unwrap_or(global_rank);
        let world_size = env_u32("WORLD_SIZE")?.unwrap_or(global_rank.saturating_add(1));
        let stack_dump_signal = env_u32("WARDEN_STACK_DUMP_SIGNAL")?
            .and_then(|s| i32::try_from(s).ok())
            .unwrap_or(0);
        Ok(ConnectOptions {
            socket_path: crate::paths::client_socket_path(),
            job_id,
            global_rank,
            local_rank,
            world_size,
            connect_timeout: Duration::from_secs(1),
            probe_interval: Duration::from_secs(1),
            stack_dump_signal,
            devices: env_devices(local_rank),
            exception_report_timeout: EXCEPTION_REPORT_TIMEOUT,
        })
    }

    /// [`ConnectOptions::from_env`], with defaults for malformed variables.
    pub fn from_env_lossy() -> ConnectOptions {
        match Self::from_env() {
            Ok(o) => o,
            Err(_) => {
                let mut o = ConnectOptions {
                    socket_path: crate::paths::client_socket_path(),
                    job_id: "default".to_owned(),
                    global_rank: 0,
                    local_rank: 0,
                    world_size: 1,
                    connect_timeout: Duration::from_secs(1),
                    probe_interval: Duration::from_secs(1),
                    stack_dump_signal: 0,
                    devices: Vec::new(),
                    exception_report_timeout: EXCEPTION_REPORT_TIMEOUT,
                };
                // The local rank as far as it parses (else the global rank,
                // else 0, as from_env would have it).
                let local = env_u32("LOCAL_RANK")
                    .ok()
                    .flatten()
                    .or_else(|| env_u32("RANK").ok().flatten())
                    .unwrap_or(0);
                o.devices = env_devices(local);
                if let Some(j) = ["WARDEN_JOB_ID", "TORCHELASTIC_RUN_ID"]
                    .iter()
                    .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
                {
                    o.job_id = j;
                }
                o
            }
        }
    }

    /// Checks the fields that a caller may have set by hand.
    pub fn validate(&self) -> Result<(), ClientError> {
        if self.job_id.is_empty() {
            return Err(ClientError::EmptyJobId);
        }
        if self.world_size == 0 || self.global_rank >= self.world_size {
            return Err(ClientError::BadRank {
                rank: self.global_rank,
                world_size: self.world_size,
            });
        }
        if self.devices.len() > MAX_DEVICES {
            return Err(ClientError::TooManyDevices {
                count: self.devices.len(),
            });
        }
        if let Some((name, why)) = self
            .devices
            .iter()
            .find_map(|d| device_name_problem(d).map(|why| (d, why)))
        {
            return Err(ClientError::BadDevice {
                name: name.clone(),
                why,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_from_the_environment() {
        // WARDEN_DEVICES, CUDA_VISIBLE_DEVICES, local rank -> devices
        type Case = (
            Option<&'static str>,
            Option<&'static str>,
            u32,
            &'static [&'static str],
        );
        let cases: &[Case] = &[
            (None, None, 3, &[]),
            (Some(""), Some(""), 0, &[]),
            // WARDEN_DEVICES wins, used as given (trimmed, empty entries dropped).
            (Some("GPU-abc"), Some("4,5"), 1, &["GPU-abc"]),
            (Some("gpu0, gpu1,"), None, 0, &["gpu0", "gpu1"]),
            (Some("7"), None, 0, &["7"]),
            // A list: the entry at the local rank.
            (None, Some("4,5"), 1, &["gpu5"]),
            (None, Some("4,5"), 0, &["gpu4"]),
            (None, Some("4, 5"), 1, &["gpu5"]),
            (None, Some("0,1"), 3, &[]),
            // One entry: that one, whatever the local rank.
            (None, Some("6"), 3, &["gpu6"]),
            (None, Some("06"), 0, &["gpu6"]),
            (None, Some("0"), 0, &["gpu0"]),
            (None, Some("GPU-8f3c1a"), 2, &["GPU-8f3c1a"]),
            (None, Some("MIG-1,MIG-2"), 1, &["MIG-2"]),
            // "No GPU".
            (None, Some("-1"), 0, &[]),
            (None, Some("NoDevFiles"), 0, &["NoDevFiles"]),
        ];
        for (warden, cuda, local, want) in cases {
            assert_eq!(
                devices_from_env(*warden, *cuda, *local),
                *want,
                "WARDEN_DEVICES={warden:?} CUDA_VISIBLE_DEVICES={cuda:?} LOCAL_RANK={local}"
            );
        }
    }

    #[test]
    fn device_names_the_agent_would_refuse_never_reach_it() {
        let long = "x".repeat(MAX_DEVICE_NAME + 1);
        let many = (0..40)
            .map(|i| format!("gpu{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            devices_from_env(Some(&format!("a\u{7},{long},b")), None, 0),
            ["b"]
        );
        assert_eq!(devices_from_env(Some(&many), None, 0).len(), MAX_DEVICES);

        let mut o = ConnectOptions::from_env_lossy();
        o.job_id = "j".into();
        o.global_rank = 0;
        o.world_size = 1;
        o.devices = vec!["gpu0".into()];
        assert!(o.validate().is_ok());
        o.devices = vec![String::new()];
        assert!(matches!(o.validate(), Err(ClientError::BadDevice { .. })));
        o.devices = vec!["g".into(); MAX_DEVICES + 1];
        assert!(matches!(
            o.validate(),
            Err(ClientError::TooManyDevices { count: 17 })
        ));
    }
}
