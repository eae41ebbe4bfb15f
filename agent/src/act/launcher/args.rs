//! `warden run`'s command line: torchrun's flags (both `--nproc-per-node`
//! and `--nproc_per_node` spellings), so a job script swaps the command and
//! keeps its arguments, plus what warden adds (the agent, the stop grace,
//! the decision wait).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// Which agent the launcher uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AgentMode {
    /// The local wardend when one answers, else one embedded in the launcher.
    Auto,
    /// The local wardend only; fail (exit 1) when none answers.
    Local,
    /// Always embed an agent, even when a wardend runs (a private socket).
    Embedded,
}

/// `warden run [OPTIONS] [--] COMMAND [ARGS]...`
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Exit status: 0 all workers succeeded; a worker's own code when the agent \
                  diagnosed a user error; 86 this node is at fault (cordon, scale-down, refused \
                  health gate); 87 restart budget or --max-restarts spent; 1 launcher error; \
                  2 bad arguments; 128+N the launcher got signal N (130 SIGINT, 143 SIGTERM). \
                  See docs/operations.md."
)]
pub struct RunArgs {
    /// Workers on this node (one per GPU, usually).
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub nproc_per_node: u32,
    /// Nodes in the job: N, or MIN:MAX (elastic: needs a coordinator
    /// across hosts, see --rdzv-backend).
    #[arg(long, default_value = "1", value_parser = parse_nnodes)]
    pub nnodes: NNodes,
    /// This node's rank among the job's nodes (GROUP_RANK).
    #[arg(long = "node-rank", alias = "node_rank", default_value_t = 0)]
    pub node_rank: u32,
    /// Address of the rank-0 node (MASTER_ADDR).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,
    /// Port of the rank-0 store (MASTER_PORT). Default: a free port picked
    /// anew for every attempt on a single node (no stale store to trip
    /// over), 29500 across nodes.
    #[arg(long = "master-port", alias = "master_port")]
    pub master_port: Option<u16>,
    /// torchrun's rendezvous endpoint, `HOST[:PORT]`: taken as the master
    /// address and port (static rendezvous).
    #[arg(long = "rdzv-endpoint", alias = "rdzv_endpoint")]
    pub rdzv_endpoint: Option<String>,
    /// torchrun's rendezvous backend: `static` or `c10d` (both mean a
    /// static rendezvous on --rdzv-endpoint here); `etcd` needs the
    /// job-wide coordinator.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend")]
    pub rdzv_backend: Option<String>,
    /// In-job restarts allowed before giving up with 87 (torchrun's
    /// meaning). Default: the agent's policy budgets decide.
    #[arg(long = "max-restarts", alias = "max_restarts")]
    pub max_restarts: Option<u32>,
    /// The job's id (TORCHELASTIC_RUN_ID, WARDEN_JOB_ID). Default:
    /// $WARDEN_JOB_ID, else `<host>-<pid>`.
    #[arg(long = "rdzv-id", alias = "rdzv_id", visible_alias = "job-id")]
    pub job_id: Option<String>,
    /// A single-node job on a free local port (torchrun's --standalone).
    #[arg(long)]
    pub standalone: bool,
    /// The worker role's name (ROLE_NAME).
    #[arg(long, default_value = "default")]
    pub role: String,
    /// Per-rank logs go to `<LOG_DIR>/<job>/attempt_<n>/rank_<r>.{stdout,stderr}.log`.
    /// Default: $XDG_STATE_HOME/warden/runs (~/.local/state/warden/runs).
    #[arg(long = "log-dir", alias = "log_dir")]
    pub log_dir: Option<PathBuf>,
    /// How long stopped workers get between SIGTERM and SIGKILL.
    #[arg(long = "stop-grace", default_value = "5s", value_parser = humantime::parse_duration)]
    pub stop_grace: Duration,
    /// How long a failed worker waits for the agent's decision before the
    /// launcher treats the failure as class unknown.
    #[arg(long = "decision-timeout", default_value = "5s", value_parser = humantime::parse_duration)]
    pub decision_timeout: Duration,
    /// How long a restart waits for the GPUs to release the stopped
    /// workers (NVML); then it goes on and says so.
    #[arg(long = "gpu-release-timeout", default_value = "30s", value_parser = humantime::parse_duration)]
    pub gpu_release_timeout: Duration,
    /// Run COMMAND as given, not through the Python interpreter, even when
    /// it ends in `.py` (torchrun's --no-python).
    #[arg(long = "no-python", alias = "no_python", conflicts_with = "module")]
    pub no_python: bool,
    /// COMMAND is a Python module (`python3 -m COMMAND`), as torchrun's -m.
    #[arg(short = 'm', long)]
    pub module: bool,
    /// Which agent to use.
    #[arg(long, value_enum, default_value_t = AgentMode::Auto)]
    pub agent: AgentMode,
    /// Config of the embedded agent (wardend's TOML); its socket is always
    /// private to this launcher.
    #[arg(long = "agent-config")]
    pub agent_config: Option<PathBuf>,
    /// Also write the run's summary (attempts, restarts, their diagnoses and
    /// timings) to FILE as JSON.
    #[arg(long = "summary-json")]
    pub summary_json: Option<PathBuf>,
    /// Do not copy the workers' output to the console (log files only).
    #[arg(long)]
    pub quiet: bool,
    /// The training command: `train.py ARGS` (run with python3), `-m MODULE
    /// ARGS`, or any executable (`python3 train.py`, `bash job.sh`).
    #[arg(required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// `--nnodes`: a fixed count or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NNodes {
    /// The fewest nodes the job runs on.
    pub min: u32,
    /// The most.
    pub max: u32,
}

fn parse_nnodes(s: &str) -> Result<NNodes, String> {
    let num = |v: &str| {
        v.trim()
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=65536).contains(n))
            .ok_or_else(|| format!("{v:?} is not a node count in 1..=65536"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (num(s)?, num(s)?),
    };
    if min > max {
        return Err(format!("{s:?}: MIN is above MAX"));
    }
    Ok(NNodes { min, max })
}

/// Why the arguments cannot be followed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    /// `--node-rank` outside `--nnodes`.
    #[error("--node-rank {rank} is not below --nnodes {nnodes}")]
    NodeRank {
        /// The node rank given.
        rank: u32,
        /// The node count given.
        nnodes: u32,
    },
    /// A job id the agent would refuse.
    #[error("job id {0:?} must be 1 to 128 characters, without control characters")]
    JobId(String),
    /// `--standalone` with several nodes.
    #[error("--standalone runs on one node; --nnodes is {0}")]
    Standalone(u32),
    /// `--rdzv-endpoint` that is not HOST[:PORT].
    #[error("--rdzv-endpoint {0:?} is not HOST[:PORT]")]
    Endpoint(String),
    /// What needs a coordinator across hosts, which this launcher does not
    /// have built in yet (the `coord::Coordinator` seam).
    #[error(
        "{0} needs the job-wide coordinator (etcd), which `warden run` does not wire in yet; run one host with --nnodes N and a static rendezvous"
    )]
    NeedsCoordinator(String),
    /// More ranks than a u32 holds.
    #[error("--nnodes {nnodes} x --nproc-per-node {nproc} ranks is too many")]
    WorldSize {
        /// Nodes.
        nnodes: u32,
        /// Workers per node.
        nproc: u32,
    },
}

impl RunArgs {
    /// Checks what clap cannot: ranges across flags, the job id.
    pub fn validate(&self) -> Result<(), ArgsError> {
        if self.nnodes.min != self.nnodes.max {
            return Err(ArgsError::NeedsCoordinator(format!(
                "--nnodes {}:{}",
                self.nnodes.min, self.nnodes.max
            )));
        }
        if let Some(b) = self.rdzv_backend.as_deref()
            && !matches!(b, "static" | "c10d")
        {
            return Err(ArgsError::NeedsCoordinator(format!("--rdzv-backend {b}")));
        }
        let nnodes = self.nnodes.max;
        if self.node_rank >= nnodes {
            return Err(ArgsError::NodeRank {
                rank: self.node_rank,
                nnodes,
            });
        }
        if self.standalone && nnodes != 1 {
            return Err(ArgsError::Standalone(nnodes));
        }
        if nnodes.checked_mul(self.nproc_per_node).is_none() {
            return Err(ArgsError::WorldSize {
                nnodes,
                nproc: self.nproc_per_node,
            });
        }
        if let Some(id) = &self.job_id {
            valid_job_id(id)?;
        }
        self.endpoint()?;
        Ok(())
    }

    /// Master address and fixed port, from `--rdzv-endpoint` when given.
    pub fn endpoint(&self) -> Result<(String, Option<u16>), ArgsError> {
        let Some(ep) = &self.rdzv_endpoint else {
            return Ok((self.master_addr.clone(), self.master_port));
        };
        let bad = || ArgsError::Endpoint(ep.clone());
        // [v6]:port, host:port, host
        let (host, port) = match ep.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(':') => (h, Some(p.parse::<u16>().map_err(|_| bad())?)),
            _ => (ep.as_str(), None),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad());
        }
        Ok((host.to_owned(), port.or(self.master_port)))
    }

    /// The argv to execute: `python3 script.py ARGS` for a script, `python3
    /// -m MODULE ARGS` with `-m`, else COMMAND as given.
    pub fn argv(&self) -> Vec<String> {
        let python = || std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        if self.module {
            let mut v = vec![python(), "-m".into()];
            v.extend(self.command.iter().cloned());
            return v;
        }
        if !self.no_python && self.command.first().is_some_and(|c| c.ends_with(".py")) {
            let mut v = vec![python()];
            v.extend(self.command.iter().cloned());
            return v;
        }
        self.command.clone()
    }
}

/// Refuses a job id the agent's registry would refuse.
pub fn valid_job_id(id: &str) -> Result<(), ArgsError> {
    if id.is_empty() || id.len() > 128 || id.chars().any(char::is_control) {
        return Err(ArgsError::JobId(id.to_owned()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        run: RunArgs,
    }

    fn parse(args: &[&str]) -> RunArgs {
        let mut v = vec!["run"];
        v.extend_from_slice(args);
        Wrap::try_parse_from(v)
            .map(|w| w.run)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn torchrun_spellings_parse() {
        let a = parse(&[
            "--nproc_per_node",
            "4",
            "--max_restarts",
            "2",
            "--rdzv_id",
            "j1",
            "train.py",
            "--lr",
            "1",
        ]);
        assert_eq!(a.nproc_per_node, 4);
        assert_eq!(a.max_restarts, Some(2));
        assert_eq!(a.job_id.as_deref(), Some("j1"));
        assert_eq!(a.command, ["train.py", "--lr", "1"]);
        assert_eq!(a.argv()[1..], ["train.py", "--lr", "1"]);
    }

    #[test]
    fn explicit_interpreter_and_module() {
        let a = parse(&["--nproc-per-node", "2", "--", "python3", "t.py", "-x"]);
        assert_eq!(a.argv(), ["python3", "t.py", "-x"]);
        let m = parse(&["-m", "pkg.train", "--epochs", "3"]);
        assert_eq!(m.argv()[1..], ["-m", "pkg.train", "--epochs", "3"]);
        let n = parse(&["--no-python", "run.py"]);
        assert_eq!(n.argv(), ["run.py"]);
    }

    #[test]
    fn validation_names_the_flag() {
        let a = parse(&["--nnodes", "2", "--node-rank", "2", "t.py"]);
        assert_eq!(
            a.validate(),
            Err(ArgsError::NodeRank { rank: 2, nnodes: 2 })
        );
        let a = parse(&["--rdzv-id", "", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::JobId(_))));
        let a = parse(&["--rdzv-endpoint", "node0:29400", "t.py"]);
        assert_eq!(a.endpoint(), Ok(("node0".into(), Some(29400))));
        let a = parse(&["--rdzv-endpoint", "node0", "t.py"]);
        assert_eq!(a.endpoint(), Ok(("node0".into(), None)));
        let a = parse(&["--rdzv-endpoint", "node0:x", "t.py"]);
        assert!(a.endpoint().is_err());
        let a = parse(&["--nnodes", "2:3", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::NeedsCoordinator(_))));
        let a = parse(&["--rdzv-backend", "etcd", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::NeedsCoordinator(_))));
        assert_eq!(
            parse(&["--nnodes", "4", "t.py"]).nnodes,
            NNodes { min: 4, max: 4 }
        );
    }
}
