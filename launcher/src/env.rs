//! The worker environment: what PyTorch's distributed code expects from
//! torchrun, and what the warden client needs. Pure: the launcher's own
//! environment comes in as a lookup, so a table of cases tests it.

use std::path::{Path, PathBuf};

/// Everything a worker's environment depends on for one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    /// The job's id (TORCHELASTIC_RUN_ID, WARDEN_JOB_ID).
    pub job_id: String,
    /// Workers on this node.
    pub nproc_per_node: u32,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node's rank.
    pub node_rank: u32,
    /// The global rank of this node's local rank 0 (the workers of the
    /// nodes before it).
    pub rank_offset: u32,
    /// Workers in the job across all nodes.
    pub world_size: u32,
    /// The job-wide round (WARDEN_ROUND_EPOCH), across hosts.
    pub epoch: Option<u64>,
    /// The worker role (ROLE_NAME).
    pub role: String,
    /// Rank 0's address.
    pub master_addr: String,
    /// Rank 0's store port for this attempt.
    pub master_port: u16,
    /// In-job restarts so far (0 on the first attempt).
    pub restart_count: u32,
    /// The restart cap the workers are told (TORCHELASTIC_MAX_RESTARTS).
    pub max_restarts: u32,
    /// The agent's socket, for the warden client.
    pub socket: PathBuf,
    /// This attempt's log directory (torch's error files go there).
    pub attempt_dir: PathBuf,
    /// The launcher's pid, marking the job's processes (orphan sweep).
    pub launcher_pid: u32,
}

/// Name of the variable marking a process as one of this launcher's job
/// (inherited by everything the workers start): the orphan sweep kills a
/// reparented process carrying it, even one that left the worker's session.
pub const MARKER: &str = "WARDEN_LAUNCHER_PID";

impl WorkerEnv {
    /// The global rank of local worker `local_rank`.
    pub fn global_rank(&self, local_rank: u32) -> u32 {
        self.rank_offset + local_rank
    }

    /// Variables to set for local worker `local_rank`; `inherited` looks
    /// up the launcher's own environment (for defaults it must not override).
    pub fn for_rank(
        &self,
        local_rank: u32,
        inherited: impl Fn(&str) -> Option<String>,
    ) -> Vec<(String, String)> {
        let world = self.world_size;
        let rank = self.global_rank(local_rank);
        let mut v: Vec<(String, String)> = vec![
            ("RANK".into(), rank.to_string()),
            ("LOCAL_RANK".into(), local_rank.to_string()),
            ("WORLD_SIZE".into(), world.to_string()),
            ("LOCAL_WORLD_SIZE".into(), self.nproc_per_node.to_string()),
            ("GROUP_RANK".into(), self.node_rank.to_string()),
            ("GROUP_WORLD_SIZE".into(), self.nnodes.to_string()),
            ("ROLE_RANK".into(), rank.to_string()),
            ("ROLE_WORLD_SIZE".into(), world.to_string()),
            ("ROLE_NAME".into(), self.role.clone()),
            ("MASTER_ADDR".into(), self.master_addr.clone()),
            ("MASTER_PORT".into(), self.master_port.to_string()),
            (
                "TORCHELASTIC_RESTART_COUNT".into(),
                self.restart_count.to_string(),
            ),
            (
                "TORCHELASTIC_MAX_RESTARTS".into(),
                self.max_restarts.to_string(),
            ),
            ("TORCHELASTIC_RUN_ID".into(), self.job_id.clone()),
            // Rank 0 hosts a fresh store for every attempt: no key of the
            // previous attempt can be read back (torchrun's reused agent
            // store is how its restarted workers read stale addresses).
            ("TORCHELASTIC_USE_AGENT_STORE".into(), "False".into()),
            // The signals the launcher passes on to its workers, as
            // torchrun says its own (`--signals-to-handle`).
            (
                "TORCHELASTIC_SIGNALS_TO_HANDLE".into(),
                crate::torchrun_flags::FORWARDED.join(","),
            ),
            (
                "TORCHELASTIC_ERROR_FILE".into(),
                error_file(&self.attempt_dir, rank).display().to_string(),
            ),
            (
                warden_client::paths::SOCKET_ENV.into(),
                self.socket.display().to_string(),
            ),
            ("WARDEN_JOB_ID".into(), self.job_id.clone()),
            (
                "WARDEN_RESTART_COUNT".into(),
                self.restart_count.to_string(),
            ),
            (MARKER.into(), self.launcher_pid.to_string()),
        ];
        if let Some(e) = self.epoch {
            v.push(("WARDEN_ROUND_EPOCH".into(), e.to_string()));
        }
        // Defaults torchrun sets, kept when the user set them.
        let mut default = |k: &str, val: &str| {
            if inherited(k).is_none() {
                v.push((k.into(), val.into()));
            }
        };
        if self.nproc_per_node > 1 {
            // torchrun: N workers each with all cores oversubscribe the CPU.
            default("OMP_NUM_THREADS", "1");
        }
        default("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
        // Output goes through a pipe: unbuffered, so a line shows (prefixed,
        // in the rank's log) when printed, and a crash loses none of it.
        default("PYTHONUNBUFFERED", "1");
        v
    }
}

/// Where torch's `@record` writes the error of global rank `rank`.
pub fn error_file(attempt_dir: &Path, rank: u32) -> PathBuf {
    attempt_dir.join(format!("rank_{rank}.error.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> WorkerEnv {
        WorkerEnv {
            job_id: "j".into(),
            nproc_per_node: 4,
            nnodes: 2,
            node_rank: 1,
            rank_offset: 4,
            world_size: 8,
            epoch: None,
            role: "default".into(),
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            restart_count: 2,
            max_restarts: 3,
            socket: "/run/warden/wardend.sock".into(),
            attempt_dir: "/logs/j/attempt_2".into(),
            launcher_pid: 42,
        }
    }

    fn get<'a>(v: &'a [(String, String)], k: &str) -> Option<&'a str> {
        v.iter().find(|(n, _)| n == k).map(|(_, x)| x.as_str())
    }

    #[test]
    fn ranks_and_sizes_follow_torchrun() {
        let v = env().for_rank(3, |_| None);
        for (k, want) in [
            ("RANK", "7"),
            ("LOCAL_RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "2"),
            ("ROLE_RANK", "7"),
            ("ROLE_WORLD_SIZE", "8"),
            ("ROLE_NAME", "default"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_RUN_ID", "j"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            (
                "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            ),
            (
                "TORCHELASTIC_ERROR_FILE",
                "/logs/j/attempt_2/rank_7.error.json",
            ),
            ("WARDEN_SOCKET", "/run/warden/wardend.sock"),
            ("WARDEN_JOB_ID", "j"),
            ("WARDEN_RESTART_COUNT", "2"),
            ("WARDEN_LAUNCHER_PID", "42"),
            ("OMP_NUM_THREADS", "1"),
            ("PYTHONUNBUFFERED", "1"),
        ] {
            assert_eq!(get(&v, k), Some(want), "{k}");
        }
    }

    #[test]
    fn user_defaults_win_and_one_worker_keeps_its_threads() {
        let v = env().for_rank(0, |k| (k == "OMP_NUM_THREADS").then(|| "8".into()));
        assert_eq!(
            get(&v, "OMP_NUM_THREADS"),
            None,
            "inherited, not overridden"
        );
        let mut one = env();
        one.nproc_per_node = 1;
        assert_eq!(get(&one.for_rank(0, |_| None), "OMP_NUM_THREADS"), None);
        assert_eq!(get(&one.for_rank(0, |_| None), "WARDEN_ROUND_EPOCH"), None);
    }

    #[test]
    fn a_round_across_hosts_sets_offset_world_and_epoch() {
        // Node 1 of a round whose node 0 runs 2 workers: uneven hosts.
        let mut e = env();
        e.nproc_per_node = 4;
        e.rank_offset = 2;
        e.world_size = 6;
        e.epoch = Some(7);
        let v = e.for_rank(3, |_| None);
        for (k, want) in [
            ("RANK", "5"),
            ("WORLD_SIZE", "6"),
            ("GROUP_RANK", "1"),
            ("WARDEN_ROUND_EPOCH", "7"),
        ] {
            assert_eq!(get(&v, k), Some(want), "{k}");
        }
    }
}
