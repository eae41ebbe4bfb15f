//! JAX multi-process jobs (`warden run --jax`, or a program found to
//! import jax): what each worker needs for `jax.distributed.initialize()`
//! called with no arguments.
//!
//! In: the attempt's worker environment ([`WorkerEnv`]), a local rank, the
//! attempt's coordinator port, the launcher's own environment as a lookup;
//! for the detection, the program's argv and working directory.
//! Out: the variables to add to that worker's environment (pure, so a
//! table of cases tests them); whether a program is a JAX program.
//! Never: drop torchrun's variables (a JAX worker keeps every one), or
//! read more than [`DETECT_MAX_BYTES`] of a program.
//!
//! What JAX reads (jax 0.10 to 0.12, `jax/_src/distributed.py` and
//! `jax/_src/clusters/`): `initialize()` takes the coordinator's address
//! from `JAX_COORDINATOR_ADDRESS`, and the number of processes and this
//! process's id only from a cluster it detects, in order Open MPI, Slurm,
//! Cloud TPU, Kubernetes. Slurm's detection reads nothing but the task
//! variables (`SLURM_JOB_ID`, `SLURM_STEP_NODELIST`, `SLURM_NTASKS`,
//! `SLURM_PROCID`, `SLURM_LOCALID`; the node list only for an address,
//! which `JAX_COORDINATOR_ADDRESS` already gives), so each worker is given
//! them as `srun` gives one task per device: `SLURM_NTASKS` the job's
//! workers, `SLURM_PROCID` the global rank, `SLURM_LOCALID` the local
//! rank, which JAX also takes as the one local device the process drives.
//! Under a real Slurm step these must be set per worker anyway: the step's
//! own (one task per node) would give every worker of a node the same
//! process id. `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` are set too, for
//! scripts that pass them to `initialize()` themselves (JAX does not read
//! them).

use std::io::Read;
use std::path::Path;

use crate::env::WorkerEnv;

/// How much of a program the detection reads: its imports are at the top.
pub const DETECT_MAX_BYTES: u64 = 256 * 1024;

/// The coordinator's port for an attempt: `free` (a port free now, picked
/// anew for each attempt) when the launcher picks MASTER_PORT itself on one
/// node, so a restarted `initialize()` never meets the previous attempt's
/// coordinator; else MASTER_PORT + 1 (MASTER_PORT - 1 at the top of the
/// range), which every host computes alike and which moves with
/// MASTER_PORT's round across hosts (etcd).
pub fn coordinator_port(master_port: u16, free: Option<u16>) -> u16 {
    match free {
        Some(p) if p != master_port => p,
        _ => master_port.checked_add(1).unwrap_or(master_port - 1),
    }
}

/// `host:port`, with an IPv6 address in brackets (what JAX's gRPC expects).
pub fn coordinator_address(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The variables JAX's `initialize()` reads for local worker `local_rank`
/// of the attempt `wenv`, its coordinator at `port` on rank 0's host.
/// `inherited` looks up the launcher's environment: a Slurm step's job id
/// and node list are kept as they are.
pub fn env(
    wenv: &WorkerEnv,
    local_rank: u32,
    port: u16,
    inherited: impl Fn(&str) -> Option<String>,
) -> Vec<(String, String)> {
    let rank = wenv.global_rank(local_rank).to_string();
    let world = wenv.world_size.to_string();
    let mut v: Vec<(String, String)> = vec![
        (
            "JAX_COORDINATOR_ADDRESS".into(),
            coordinator_address(&wenv.master_addr, port),
        ),
        ("JAX_NUM_PROCESSES".into(), world.clone()),
        ("JAX_PROCESS_ID".into(), rank.clone()),
        ("SLURM_NTASKS".into(), world),
        ("SLURM_PROCID".into(), rank),
        ("SLURM_LOCALID".into(), local_rank.to_string()),
    ];
    // Present for JAX's Slurm detection; outside Slurm, the launcher's pid
    // (a number, as Slurm's ids are) and rank 0's host.
    if inherited("SLURM_JOB_ID").is_none() {
        v.push(("SLURM_JOB_ID".into(), wenv.launcher_pid.to_string()));
    }
    if inherited("SLURM_STEP_NODELIST").is_none() {
        v.push(("SLURM_STEP_NODELIST".into(), wenv.master_addr.clone()));
    }
    v
}

/// Whether `argv` runs a Python program that imports jax: the script (a
/// first or second word ending in `.py`), or with `-m` the module's file
/// under `cwd`, has a line `import jax...` or `from jax... import`.
/// Anything else (a shell script, a module not found) is not detected:
/// `--jax` says so.
pub fn detect(argv: &[String], cwd: &Path) -> bool {
    let Some(file) = program_file(argv, cwd) else {
        return false;
    };
    let Ok(f) = std::fs::File::open(&file) else {
        return false;
    };
    let mut bytes = Vec::new();
    if f.take(DETECT_MAX_BYTES).read_to_end(&mut bytes).is_err() {
        return false;
    }
    // Lossy: a program cut inside a character, or not UTF-8, is still read.
    let text = String::from_utf8_lossy(&bytes);
    imports_jax(&text)
}

/// The program's file: `X.py` among the first two words (`train.py ...`,
/// `python3 train.py ...`), or `-m pkg.mod` as `pkg/mod.py` or
/// `pkg/mod/__main__.py` under `cwd`.
fn program_file(argv: &[String], cwd: &Path) -> Option<std::path::PathBuf> {
    if let Some(i) = argv.iter().position(|a| a == "-m") {
        let module = argv.get(i + 1)?;
        let rel: std::path::PathBuf = module.split('.').collect();
        return [rel.with_extension("py"), rel.join("__main__.py")]
            .into_iter()
            .map(|p| cwd.join(p))
            .find(|p| p.is_file());
    }
    let script = argv.iter().take(2).find(|a| a.ends_with(".py"))?;
    Some(cwd.join(script))
}

/// A line that imports jax: `import jax`, `import jax.numpy as jnp`,
/// `from jax import ...`, `from jax.experimental import ...` (not `jaxlib`
/// or `jaxtyping`, which are other packages).
pub fn imports_jax(text: &str) -> bool {
    text.lines().any(|line| {
        let l = line.trim_start();
        let rest = l
            .strip_prefix("import ")
            .or_else(|| l.strip_prefix("from "))
            .map(str::trim_start);
        rest.and_then(|r| r.strip_prefix("jax"))
            .is_some_and(|after| after.is_empty() || after.starts_with(['.', ' ', ',', '\t']))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wenv() -> WorkerEnv {
        WorkerEnv {
            job_id: "j".into(),
            nproc_per_node: 2,
            nnodes: 2,
            node_rank: 1,
            rank_offset: 2,
            world_size: 4,
            epoch: None,
            role: "default".into(),
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            restart_count: 0,
            max_restarts: 3,
            socket: "/run/warden/wardend.sock".into(),
            attempt_dir: "/logs/j/attempt_0".into(),
            launcher_pid: 42,
        }
    }

    fn get<'a>(v: &'a [(String, String)], k: &str) -> Option<&'a str> {
        v.iter().find(|(n, _)| n == k).map(|(_, x)| x.as_str())
    }

    #[test]
    fn each_worker_is_one_slurm_task_of_the_job() {
        let v = env(&wenv(), 1, 29501, |_| None);
        for (k, want) in [
            ("JAX_COORDINATOR_ADDRESS", "10.0.0.1:29501"),
            ("JAX_NUM_PROCESSES", "4"),
            ("JAX_PROCESS_ID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_ID", "42"),
            ("SLURM_STEP_NODELIST", "10.0.0.1"),
        ] {
            assert_eq!(get(&v, k), Some(want), "{k}");
        }
    }

    #[test]
    fn a_slurm_steps_job_id_and_nodes_are_kept_its_task_counts_are_not() {
        let v = env(&wenv(), 0, 29501, |k| match k {
            "SLURM_JOB_ID" => Some("777".into()),
            "SLURM_STEP_NODELIST" => Some("node[1-2]".into()),
            "SLURM_NTASKS" => Some("2".into()),
            _ => None,
        });
        assert_eq!(get(&v, "SLURM_JOB_ID"), None, "inherited as is");
        assert_eq!(get(&v, "SLURM_STEP_NODELIST"), None, "inherited as is");
        assert_eq!(get(&v, "SLURM_NTASKS"), Some("4"), "one task per worker");
        assert_eq!(get(&v, "SLURM_PROCID"), Some("2"));
    }

    #[test]
    fn coordinator_ports_and_addresses() {
        assert_eq!(coordinator_port(29500, Some(41000)), 41000);
        assert_eq!(
            coordinator_port(29500, Some(29500)),
            29501,
            "never MASTER_PORT"
        );
        assert_eq!(coordinator_port(29500, None), 29501);
        assert_eq!(coordinator_port(65535, None), 65534);
        assert_eq!(coordinator_address("::1", 5), "[::1]:5");
        assert_eq!(coordinator_address("[::1]", 5), "[::1]:5");
        assert_eq!(coordinator_address("node0", 5), "node0:5");
    }

    #[test]
    fn jax_imports_are_found_and_lookalikes_are_not() {
        for yes in [
            "import jax\n",
            "import os\n  import jax.numpy as jnp\n",
            "from jax import numpy\n",
            "from jax.experimental import mesh_utils\n",
            "import jax, numpy\n",
        ] {
            assert!(imports_jax(yes), "{yes:?}");
        }
        for no in [
            "import jaxlib\n",
            "from jaxtyping import Array\n",
            "# import jax\n",
            "x = 'import jax'\n",
            "import torch\n",
        ] {
            assert!(!imports_jax(no), "{no:?}");
        }
    }

    #[test]
    fn detection_reads_the_script_or_the_module() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("t.py"), "import jax\n").unwrap();
        std::fs::write(dir.path().join("u.py"), "import torch\n").unwrap();
        std::fs::create_dir_all(dir.path().join("pkg")).unwrap();
        std::fs::write(dir.path().join("pkg/train.py"), "from jax import numpy\n").unwrap();
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert!(detect(&s(&["python3", "t.py", "-x"]), dir.path()));
        assert!(detect(&s(&["t.py"]), dir.path()));
        assert!(!detect(&s(&["python3", "u.py"]), dir.path()));
        assert!(detect(&s(&["python3", "-m", "pkg.train"]), dir.path()));
        assert!(!detect(&s(&["python3", "-m", "pkg.absent"]), dir.path()));
        assert!(!detect(&s(&["bash", "job.sh"]), dir.path()));
        assert!(!detect(&s(&["python3", "missing.py"]), dir.path()));
    }
}
