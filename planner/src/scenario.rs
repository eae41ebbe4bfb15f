//! The planner's inputs: the job, its failure rate and fault classes, the
//! checkpoint, warden's and the baseline's recovery times; their validation
//! and the named presets.
//!
//! Every default is a figure with a source (docs/goodput.md, "Planner
//! inputs", lists them): warden's own times come from docs/benchmarks.md and
//! the agent's configuration defaults; the rest are stated assumptions that a
//! finished job's ledger (`--from-ledger`) or the user replaces.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A scenario the planner cannot simulate, with the key and value at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScenarioError {
    /// One input is out of its range.
    #[error("{key} = {value}: {why}")]
    Invalid {
        /// The input's name, as in the scenario JSON (dotted).
        key: String,
        /// The value given.
        value: String,
        /// What it must be.
        why: String,
    },
    /// `--preset` named no preset.
    #[error("unknown preset {0:?} (known: llama3)")]
    UnknownPreset(String),
    /// A ledger file that does not follow the agreed shape.
    #[error("ledger file: {0}")]
    Ledger(String),
    /// The embedded fleet bench results give no restart round.
    #[error("{0} (set warden.round_s)")]
    Fleet(String),
}

/// The restart round across hosts a plan uses, and where it came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundFigure {
    /// Seconds on top of the local restart.
    pub seconds: f64,
    /// The fleet bench's figure it was read from; `None`: given.
    pub fleet: Option<crate::fleet::RoundEstimate>,
}

fn invalid(key: &str, value: impl std::fmt::Display, why: &str) -> ScenarioError {
    ScenarioError::Invalid {
        key: key.to_owned(),
        value: value.to_string(),
        why: why.to_owned(),
    }
}

/// How warden recovers from a fault of a class (the scheduler-requeue
/// baseline requeues the whole job for every class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recovery {
    /// A hang: the processes live on, their process groups are aborted and
    /// rebuilt, state comes back from the local tier (warden's first answer
    /// to transient software faults). A crash of the class has no process
    /// left to restart in: it is restarted in job.
    InProcess,
    /// `warden run` kills and respawns the workers on the same nodes; state
    /// from the local tier (warden's answer to infrastructure faults).
    InJob,
    /// The node must go: hot-swap to a free spare, else scale the job down by
    /// one data-parallel replica until the node comes back from repair; the
    /// lost shard comes from a peer's replica.
    ReplaceNode,
    /// Announced in advance (firmware, configuration): a checkpoint is saved
    /// first, so no progress is lost; then an in-job restart.
    Planned,
}

/// One class of interruption: its share of all interruptions and how it
/// shows and is answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterruptionClass {
    /// A name for reports ("gpu", "network", ...).
    pub name: String,
    /// Relative weight among the classes (counts or fractions; normalised).
    pub share: f64,
    /// The fraction of this class's faults that hang the job (found by a
    /// timeout) rather than crash it (found at once).
    pub hang_fraction: f64,
    /// What warden does about it.
    pub recovery: Recovery,
}

/// The checkpoint: what a save stalls and where a restore reads from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Checkpoint {
    /// Seconds a save blocks training (the copy out of GPU memory; the write
    /// to the local tier and the replication run behind it), when given.
    /// Unset: each rank's share of the checkpoint at [`Checkpoint::stall_gibps`]
    /// ([`Scenario::save_stall_s`]).
    pub save_stall_s: Option<f64>,
    /// How fast an async save's stall copies a rank's state, GiB/s: the copy
    /// into the saver's reused pinned buffer on the training stream, the rest
    /// behind it. Measured on an H100 (docs/benchmarks.md, "Async saves on an
    /// H100", 1 GiB: the GPU held 19.7 ms, 1.01x a `cudaMemcpy` of the same
    /// bytes into pinned memory over PCIe 5): 50.8 GiB/s. The CPU's figure,
    /// memcpy-bound, was 8.3 GiB/s.
    pub stall_gibps: f64,
    /// The whole checkpoint (all ranks), GiB.
    pub size_gib: f64,
    /// Read throughput of a node's local tier (tmpfs or NVMe), GiB/s.
    pub local_gibps: f64,
    /// Throughput of a node's shard from a peer's replica over the network, GiB/s.
    pub peer_gibps: f64,
    /// Aggregate read throughput of durable storage for the whole job, GiB/s.
    /// By default Llama 3's store ([`LLAMA3_STORE_GIBPS`]).
    pub durable_gibps: f64,
}

/// The durable store of the Llama 3 run: "Tectonic ... supports a
/// sustainable throughput of 2 TB/s and a peak throughput of 7 TB/s", with
/// checkpoint writes that "saturate the storage fabric for short durations"
/// ("The Llama 3 Herd of Models", section 3.3.1, Storage). 2 TB/s in GiB/s.
/// It is the store's published throughput, not a measured restore of the
/// job (no restore time is published): the baseline's read of the whole
/// checkpoint may be slower, never faster.
pub const LLAMA3_STORE_GIBPS: f64 = 2.0e12 / 1_073_741_824.0;

impl Default for Checkpoint {
    fn default() -> Self {
        Self {
            save_stall_s: None,
            stall_gibps: 50.8,
            size_gib: 1024.0,
            // Measured (docs/benchmarks.md, checkpoint tiers, 1 GiB shard):
            // a restore with the copy in the local tmpfs tier, 138 ms
            // (7.8 GB/s); from a peer's replica, 287 ms (3.7 GB/s) over
            // loopback on two cores, both agents on one machine.
            local_gibps: 7.2,
            peer_gibps: 3.5,
            durable_gibps: LLAMA3_STORE_GIBPS,
        }
    }
}

/// The job's own times, which both warden and the baseline pay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobTimes {
    /// Seconds per training step (warden's hang threshold is calibrated from it).
    pub step_s: f64,
    /// Seconds from new worker processes to the first step, cold: imports,
    /// process-group set-up, compiling the model (not the restore). What a
    /// scheduler's requeue pays. Measured (docs/benchmarks.md,
    /// "Compilation cache": a crash to the first step of a new process with
    /// neither a standby interpreter nor a compile cache, for a small
    /// `torch.compile`d model on the CPU).
    pub startup_s: f64,
}

impl Default for JobTimes {
    fn default() -> Self {
        Self {
            step_s: 5.0,
            startup_s: COLD_START_S,
        }
    }
}

/// The cold start measured by tests/bench/compile_cache.sh (docs/benchmarks.md,
/// "Compilation cache"): a crash to the end of the first step of a new
/// process with no standby and no cache, median of 3 runs 14.25 s, less the
/// 0.2 s to the crash's detection.
const COLD_START_S: f64 = 14.0;
/// The warm start measured by the same runs (a standby interpreter and the
/// compile cache in the tier): a crash to the end of the first step, median
/// 1.78 s, less the crash detection and the launcher's restart
/// (`crash_detection_s` 0.203 s, `in_job_restart_s` 0.13 s).
const WARM_START_S: f64 = 1.45;

/// warden's recovery times. Defaults: docs/benchmarks.md and the agent's
/// configuration defaults (agent/src/config, core/src/policy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WardenTimes {
    /// A crashed worker's death to the agent's decision (pidfd, 200 ms
    /// settle window): 203 ms in "In-job restart under `warden run`".
    pub crash_detection_s: f64,
    /// `[hang] floor`: a calibrated hang threshold is never shorter (3 s).
    pub hang_floor_s: f64,
    /// `[hang] multiplier` x the p99 step time is the calibrated threshold (3).
    pub hang_multiplier: f64,
    /// `[agent] tick`: the scan period added to any threshold (100 ms).
    pub tick_s: f64,
    /// A hung rank's threshold crossed to every rank of the job stepping
    /// again in the same processes on a new process group, for the classes
    /// that restart in process (their crashes restart in job): 0.28 s, the
    /// median of 10 in docs/benchmarks.md "Faults side by side" (real
    /// torch, gloo, 2 ranks, one hung in Python while the other waits in
    /// all_reduce: the agent's hang verdict to every rank's next step).
    /// Not the 0.61 ms of "In-process restart latency", which ends at
    /// `RestartRequested` raised in one rank.
    pub in_process_s: f64,
    /// The agent's decision to every rank of the job stepping again after a
    /// crash under `warden run` with standby interpreters (warm, the
    /// default): 0.33 s from the crash (median of 10, "Faults side by
    /// side") less the 0.203 s to the decision. The job's own start-up beyond a small DDP model's
    /// is `job.startup_s`.
    pub in_job_restart_s: f64,
    /// The restarted workers' start-up under `warden run`: a standby
    /// interpreter (imports done before the crash) and the compile cache in
    /// the tier (nothing compiled again). Measured (docs/benchmarks.md,
    /// "Compilation cache": the crash to the end of the first step of a
    /// small `torch.compile`d model on the CPU, less `crash_detection_s` and
    /// `in_job_restart_s`). A job's own loading beyond that is its to add.
    pub warm_start_s: f64,
    /// The restart round across hosts through etcd, on top of the local
    /// restart. Unset: the fleet bench's restart round at the scenario's
    /// node count (docs/benchmarks.md, "Fleet"; planner/data/fleet.json),
    /// measured there or read off its fitted curve ([`Scenario::round`]).
    pub round_s: Option<f64>,
    /// Measured mean detection (ledger `detection_s`): replaces the crash and
    /// hang model above when set.
    pub detection_s: Option<f64>,
    /// Measured mean restart downtime (ledger `restart_downtime_s`, incident
    /// to first step, restore excluded): replaces `in_job_restart_s` +
    /// `warm_start_s` for warden's in-job restarts when set.
    pub restart_downtime_s: Option<f64>,
    /// Measured mean restore (ledger `restore_s`): replaces the local tier's
    /// modelled restore time when set.
    pub restore_s: Option<f64>,
    /// The heal from a live replica (`warden.heal.declare`), for a job that
    /// declares its state: a fault that leaves a replica of the lost state
    /// alive to every rank stepping again at the step it was on, the step in
    /// flight redone and nothing read back. 0.27 s: the median of 10 in
    /// docs/benchmarks.md "Heal from a live replica" (real torch, gloo, 4
    /// ranks, SIGKILL to every rank stepping). Unset: no heal (today's
    /// default for a job that does not declare its state).
    pub heal_s: Option<f64>,
    /// A lost node's ranks heal too, on a spare, from replicas on other
    /// hosts (`warden run` over etcd: the survivors heal into the round
    /// that gives the spare the lost node's place; docs/benchmarks.md,
    /// "Heal across hosts": 6.1-6.7 s from the kill to every rank stepping
    /// with a 3 s lease TTL, detection and the rejoin grace included, of
    /// which 0.4-0.7 s after the spare had its place). Without a free spare
    /// the job scales down, and a round of another world size restarts in
    /// job (no heal). The lost host's detection is modelled as a crash's,
    /// as for every node fault: the lease TTL is not.
    pub heal_across_hosts: bool,
    /// A lost node's heal on a spare, from the round that gives the spare
    /// its place to every rank stepping: 0.6 s, docs/benchmarks.md "Heal
    /// across hosts" (0.38-0.74 s over 6 runs, 1 rank per host, gloo, CPU).
    /// The detection before it is the node fault's (`crash_detection_s`).
    pub heal_node_s: f64,
    /// A rank's own crash heals inside the round across hosts (with
    /// `heal_across_hosts`): its launcher heals it from its standby, the
    /// survivors on every host stay and join the next attempt on the
    /// round's store. 0.43 s from the kill to every rank stepping:
    /// docs/benchmarks.md "Heal across hosts", the median of 6 (2 hosts x
    /// 2 ranks, gloo, CPU, load 17-21). On one host the crash heals in
    /// `heal_s`. After the crash's detection.
    pub heal_rank_hosts_s: f64,
}

impl Default for WardenTimes {
    fn default() -> Self {
        Self {
            crash_detection_s: 0.203,
            hang_floor_s: 3.0,
            hang_multiplier: 3.0,
            tick_s: 0.1,
            in_process_s: 0.28,
            in_job_restart_s: 0.13,
            warm_start_s: WARM_START_S,
            round_s: None,
            detection_s: None,
            restart_downtime_s: None,
            restore_s: None,
            heal_s: None,
            heal_across_hosts: false,
            heal_node_s: 0.6,
            heal_rank_hosts_s: 0.43,
        }
    }
}

/// What users have today: the job exits and the scheduler requeues it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Baseline {
    /// A crash to the whole job torn down (torchrun's monitor sees the dead
    /// worker, the scheduler kills the other nodes' steps). Default:
    /// measured, 0.85 s (`tests/bench/baseline_teardown.sh`: a worker's
    /// SIGKILL to `srun --kill-on-bad-exit=1` returning, two nodes of
    /// `torchrun --max-restarts 0` on a one-node Slurm 22.05, median of 7):
    /// a floor for many nodes, so the baseline is not made to look worse
    /// than it is.
    pub crash_detection_s: f64,
    /// A hang to the job torn down: PyTorch's NCCL watchdog, whose default
    /// process-group timeout is 10 minutes.
    pub hang_detection_s: f64,
    /// The torn-down job to its batch script running on nodes again.
    /// Default: measured, 2.95 s (`tests/bench/baseline_requeue.sh`: a
    /// failed job's successor, submitted beforehand with
    /// `--dependency=afternotok`, from the failed step's `srun` returning to
    /// the successor's script, on an idle one-node Slurm 22.05, median of
    /// 5): the fastest of the ways back measured there. Slurm's own requeue
    /// (`scontrol requeue`, or an exit code `RequeueExit` names) holds the
    /// job until its credentials expire (`cred_expire`, 120 s by default)
    /// and then the scheduler's next pass: 171 s there, 177 s after an exit
    /// `RequeueExit` names. A floor: no queue, no allocation of thousands
    /// of nodes, so the baseline is not made to look worse than it is.
    /// Warden pays it too for a node of the cluster's pool when no spare
    /// is free ([`WithoutSpare::Pool`]).
    pub requeue_s: f64,
    /// The baseline's save stall when it differs from warden's (a
    /// synchronous save to durable storage); unset: the same.
    pub save_stall_s: Option<f64>,
}

impl Default for Baseline {
    fn default() -> Self {
        Self {
            crash_detection_s: 0.85,
            hang_detection_s: 600.0,
            requeue_s: 2.95,
            save_stall_s: None,
        }
    }
}

/// The sweep over checkpoint intervals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SweepConfig {
    /// Shortest interval (seconds of training between saves); unset: a fifth
    /// of the Young/Daly interval.
    pub interval_min_s: Option<f64>,
    /// Longest interval; unset: five times the Young/Daly interval.
    pub interval_max_s: Option<f64>,
    /// Intervals tried, log-spaced between the two.
    pub points: usize,
    /// Repetitions of each point (independent random failure histories).
    pub reps: usize,
    /// The seed of the whole run: the same seed gives the same report.
    pub seed: u64,
}

impl Default for SweepConfig {
    fn default() -> Self {
        Self {
            interval_min_s: None,
            interval_max_s: None,
            points: 41,
            reps: 1000,
            seed: 1,
        }
    }
}

/// What warden does about a node fault when no hot spare is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WithoutSpare {
    /// A fixed-size job (`warden run --nnodes N`): its launchers hold a
    /// waiting round until the scheduler or the platform starts a launcher
    /// on a free node of the cluster, which joins the round and restores
    /// its shard from a peer. The node comes from the pool the baseline's
    /// requeue takes its replacement from, at the same cost
    /// (`baseline.requeue_s`), plus that host's cold start-up (`job.startup_s`);
    /// the failed node is repaired outside the job. A spare taken is
    /// refilled the same way, at the same cost: the failed host's launcher,
    /// requeued on a free node (exit 86: requeue elsewhere), joins the full
    /// round as a standby. The default, because it assumes what the
    /// baseline assumes: a free node in the cluster.
    #[default]
    Pool,
    /// An elastic job (`--nnodes MIN:N`): the survivors close ranks and the
    /// job runs a replica short until the node is repaired
    /// (`repair_hours`), then scales up again.
    ScaleDown,
}

/// How a spare taken into a failed node's place comes back (with the
/// cluster's pool, [`WithoutSpare::Pool`]; an elastic job's spares come
/// back from repair).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpareRefill {
    /// The failed host's launcher, requeued on a free node of the pool
    /// (exit 86: requeue elsewhere), joins the full round as a standby:
    /// after the fault's detection, the baseline's requeue and a cold
    /// start-up, with no round. Needs one scheduler job per host, each
    /// with the job's `--rdzv-id` (docs/operations.md, "Keeping the
    /// spares"). The default, as the pool is.
    #[default]
    Requeue,
    /// The failed node itself, back from repair (`repair_hours`): one
    /// multi-node allocation, where no single host is requeued.
    Repair,
}

/// Everything the planner simulates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scenario {
    /// Accelerators in the job.
    pub gpus: u64,
    /// Accelerators per node (a node is what fails and what is swapped).
    pub gpus_per_node: u64,
    /// Mean time between interruptions caused by one node, hours; the job's
    /// rate is the node count times the node's.
    pub node_mtbf_hours: f64,
    /// Length of the simulated run, days.
    pub days: f64,
    /// The classes of interruption and their shares.
    pub classes: Vec<InterruptionClass>,
    /// Save stall, checkpoint size and tier throughputs.
    pub checkpoint: Checkpoint,
    /// Step time and start-up.
    pub job: JobTimes,
    /// warden's recovery times.
    pub warden: WardenTimes,
    /// The scheduler-requeue baseline's times.
    pub baseline: Baseline,
    /// Hot spare nodes held beside the job.
    pub spares: u32,
    /// What warden does about a node fault when no hot spare is free.
    pub without_spare: WithoutSpare,
    /// How a spare taken comes back with the pool (`scale_down`: always
    /// from repair).
    pub spare_refill: SpareRefill,
    /// Hours before a failed node comes back, to the spare pool or to the
    /// scaled-down job: with `scale_down`, or `spare_refill: repair`.
    /// Otherwise the repair happens outside the job and moves nothing in
    /// the plan ([`Scenario::uses_repair`]).
    pub repair_hours: f64,
    /// Nodes of one data-parallel replica: scaling down removes a whole one.
    pub replica_nodes: u64,
    /// The interval sweep and the repetitions.
    pub sweep: SweepConfig,
}

/// Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4 and its
/// table of root causes): 466 interruptions in 54 days on 16,384 H100s in
/// 8-GPU servers, 47 planned and 419 unexpected.
pub const LLAMA3_INTERRUPTIONS: f64 = 466.0;
/// Days of the Llama 3 pre-training snapshot.
pub const LLAMA3_DAYS: f64 = 54.0;
/// GPUs of the Llama 3 405B run.
pub const LLAMA3_GPUS: u64 = 16_384;

/// The Llama 3 interruptions grouped by how warden answers them (the counts
/// are the paper's; which recovery and hang fraction each group gets is ours,
/// documented in docs/goodput.md).
pub fn llama3_classes() -> Vec<InterruptionClass> {
    let class = |name: &str, share: f64, hang_fraction: f64, recovery| InterruptionClass {
        name: name.to_owned(),
        share,
        hang_fraction,
        recovery,
    };
    let hangs = BYTEROBUST_HANG_FRACTION;
    vec![
        // Faulty GPU 148, HBM3 72, SRAM 19, GPU system processor 17, silent
        // data corruption 6, thermal interface and sensor 6.
        class("gpu", 268.0, hangs, Recovery::ReplaceNode),
        // Unplanned host maintenance 32, NIC 7, SSD 3, power supply 3,
        // chassis 2, IO expansion board 2, CPU 2, system memory 2.
        class("host", 53.0, hangs, Recovery::ReplaceNode),
        // Network switch or cable 35.
        class("network", 35.0, hangs, Recovery::InJob),
        // Software bug 54, NCCL watchdog timeout 7, dependency 2.
        class("software", 63.0, hangs, Recovery::InProcess),
        // Planned: automated maintenance, firmware, configuration updates.
        // Announced, so never a hang.
        class("planned", 47.0, 0.0, Recovery::Planned),
    ]
}

/// The share of a large training fleet's failures that were hangs, found
/// by a timeout rather than at once: ByteRobust ("Robust LLM Training
/// Infrastructure at ByteDance", SOSP '25), Table 1, 5,506 job hangs among
/// the 45,783 failures of 778,135 training jobs over three months (its
/// 9,582 manual restarts, code and data changes, left out: they are not
/// failures; with them the table's 9.9%). Why one share for every unplanned
/// class: no record splits hangs by cause (ByteRobust's Table 2 gives only
/// the root cause of 26 hangs, 21 infrastructure and 5 user code), and the
/// per-class guesses it replaces (a dead link hanging every collective,
/// software's hangs being Llama 3's 7 watchdog timeouts) were not measured.
pub const BYTEROBUST_HANG_FRACTION: f64 = 5506.0 / 45783.0;

impl Default for Scenario {
    /// The Llama 3 cluster's size and failure rate over 30 days.
    fn default() -> Self {
        let nodes = LLAMA3_GPUS / 8;
        #[allow(clippy::cast_precision_loss)]
        let node_mtbf_hours = LLAMA3_DAYS * 24.0 * nodes as f64 / LLAMA3_INTERRUPTIONS;
        Self {
            gpus: LLAMA3_GPUS,
            gpus_per_node: 8,
            node_mtbf_hours,
            days: 30.0,
            classes: llama3_classes(),
            checkpoint: Checkpoint::default(),
            job: JobTimes::default(),
            warden: WardenTimes::default(),
            baseline: Baseline::default(),
            spares: 0,
            without_spare: WithoutSpare::default(),
            spare_refill: SpareRefill::default(),
            repair_hours: 24.0,
            replica_nodes: 1,
            sweep: SweepConfig::default(),
        }
    }
}

/// Figures taken from a finished job's ledger, kept for the report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LedgerFigures {
    /// Which scenario keys the ledger set, with their values.
    pub applied: Vec<(String, f64)>,
    /// Restarts the ledger's means were measured over.
    pub restarts: Option<u64>,
    /// Saves the save-stall mean was measured over.
    pub saves: Option<u64>,
}

impl Scenario {
    /// The restart round across hosts: `warden.round_s` when given, else
    /// the fleet bench's figure at this job's node count (a job of one
    /// node has no round). The error says the embedded results cannot be
    /// read (a build from a broken data file).
    pub fn round(&self) -> Result<RoundFigure, ScenarioError> {
        if let Some(s) = self.warden.round_s {
            return Ok(RoundFigure {
                seconds: s,
                fleet: None,
            });
        }
        if self.nodes() <= 1 {
            return Ok(RoundFigure {
                seconds: 0.0,
                fleet: None,
            });
        }
        let estimate = crate::fleet::embedded()
            .and_then(|r| r.round_at(self.nodes()))
            .map_err(|e| ScenarioError::Fleet(e.to_string()))?;
        Ok(RoundFigure {
            seconds: estimate.seconds,
            fleet: Some(estimate),
        })
    }

    /// A named preset: `llama3` is the Llama 3 405B run itself (its GPUs,
    /// its rate, its fault split, its 54 days).
    pub fn preset(name: &str) -> Result<Self, ScenarioError> {
        match name {
            "llama3" => Ok(Self {
                days: LLAMA3_DAYS,
                ..Self::default()
            }),
            other => Err(ScenarioError::UnknownPreset(other.to_owned())),
        }
    }

    /// Whether `repair_hours` moves the plan: the job scales down until a
    /// node is back, or its spares come back from repair.
    pub fn uses_repair(&self) -> bool {
        self.without_spare == WithoutSpare::ScaleDown || self.spare_refill == SpareRefill::Repair
    }

    /// Nodes in the job.
    pub fn nodes(&self) -> u64 {
        self.gpus / self.gpus_per_node.max(1)
    }

    /// Seconds simulated.
    pub fn horizon_s(&self) -> f64 {
        self.days * 86_400.0
    }

    /// The job's mean time between interruptions at full size, seconds.
    pub fn job_mtbf_s(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let nodes = self.nodes() as f64;
        self.node_mtbf_hours * 3600.0 / nodes
    }

    /// warden's save stall: given, or each rank's share of the checkpoint
    /// copied at the measured async-save rate.
    pub fn save_stall_s(&self) -> f64 {
        self.checkpoint.save_stall_s.unwrap_or_else(|| {
            #[allow(clippy::cast_precision_loss)]
            let ranks = self.gpus.max(1) as f64;
            self.checkpoint.size_gib / ranks / self.checkpoint.stall_gibps
        })
    }

    /// The baseline's save stall.
    pub fn baseline_save_stall_s(&self) -> f64 {
        self.baseline
            .save_stall_s
            .unwrap_or_else(|| self.save_stall_s())
    }

    /// Refuses a scenario that cannot be simulated, naming the input.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        if self.gpus == 0 {
            return Err(invalid("gpus", self.gpus, "must be at least 1"));
        }
        if self.gpus_per_node == 0 {
            return Err(invalid(
                "gpus_per_node",
                self.gpus_per_node,
                "must be at least 1",
            ));
        }
        if !self.gpus.is_multiple_of(self.gpus_per_node) {
            return Err(invalid(
                "gpus_per_node",
                self.gpus_per_node,
                &format!("must divide gpus ({}) into whole nodes", self.gpus),
            ));
        }
        positive("node_mtbf_hours", self.node_mtbf_hours)?;
        positive("days", self.days)?;
        positive("repair_hours", self.repair_hours)?;
        if self.replica_nodes == 0 || !self.nodes().is_multiple_of(self.replica_nodes) {
            return Err(invalid(
                "replica_nodes",
                self.replica_nodes,
                &format!("must be at least 1 and divide the {} nodes", self.nodes()),
            ));
        }
        if self.classes.is_empty() {
            return Err(invalid("classes", "[]", "must name at least one class"));
        }
        for (i, c) in self.classes.iter().enumerate() {
            non_negative(&format!("classes[{i}].share"), c.share)?;
            let h = c.hang_fraction;
            if !(0.0..=1.0).contains(&h) {
                return Err(invalid(
                    &format!("classes[{i}].hang_fraction"),
                    h,
                    "must be between 0 and 1",
                ));
            }
        }
        if self.classes.iter().map(|c| c.share).sum::<f64>() <= 0.0 {
            return Err(invalid(
                "classes",
                "shares summing to 0",
                "at least one class needs a share above 0",
            ));
        }
        let c = &self.checkpoint;
        if let Some(v) = c.save_stall_s {
            non_negative("checkpoint.save_stall_s", v)?;
        }
        positive("checkpoint.stall_gibps", c.stall_gibps)?;
        non_negative("checkpoint.size_gib", c.size_gib)?;
        positive("checkpoint.local_gibps", c.local_gibps)?;
        positive("checkpoint.peer_gibps", c.peer_gibps)?;
        positive("checkpoint.durable_gibps", c.durable_gibps)?;
        positive("job.step_s", self.job.step_s)?;
        non_negative("job.startup_s", self.job.startup_s)?;
        let w = &self.warden;
        for (key, v) in [
            ("warden.crash_detection_s", w.crash_detection_s),
            ("warden.hang_floor_s", w.hang_floor_s),
            ("warden.hang_multiplier", w.hang_multiplier),
            ("warden.tick_s", w.tick_s),
            ("warden.in_process_s", w.in_process_s),
            ("warden.in_job_restart_s", w.in_job_restart_s),
            ("warden.warm_start_s", w.warm_start_s),
            ("warden.heal_node_s", w.heal_node_s),
            ("warden.heal_rank_hosts_s", w.heal_rank_hosts_s),
        ] {
            non_negative(key, v)?;
        }
        for (key, v) in [
            ("warden.round_s", w.round_s),
            ("warden.detection_s", w.detection_s),
            ("warden.restart_downtime_s", w.restart_downtime_s),
            ("warden.restore_s", w.restore_s),
            ("warden.heal_s", w.heal_s),
            ("baseline.save_stall_s", self.baseline.save_stall_s),
        ] {
            if let Some(v) = v {
                non_negative(key, v)?;
            }
        }
        // The restart round from the fleet bench's results, when not given.
        self.round()?;
        let b = &self.baseline;
        non_negative("baseline.crash_detection_s", b.crash_detection_s)?;
        non_negative("baseline.hang_detection_s", b.hang_detection_s)?;
        non_negative("baseline.requeue_s", b.requeue_s)?;
        let s = &self.sweep;
        if s.points < 3 {
            return Err(invalid("sweep.points", s.points, "must be at least 3"));
        }
        if s.reps == 0 {
            return Err(invalid("sweep.reps", s.reps, "must be at least 1"));
        }
        if let Some(v) = s.interval_min_s {
            positive("sweep.interval_min_s", v)?;
        }
        if let Some(v) = s.interval_max_s {
            positive("sweep.interval_max_s", v)?;
        }
        if let (Some(lo), Some(hi)) = (s.interval_min_s, s.interval_max_s)
            && hi <= lo
        {
            return Err(invalid(
                "sweep.interval_max_s",
                hi,
                &format!("must be above sweep.interval_min_s ({lo})"),
            ));
        }
        Ok(())
    }

    /// Takes a finished job's measured means from its ledger JSON: the
    /// object under `"recovery"` (docs/goodput.md, "Planner inputs"). Absent
    /// figures keep their defaults; other keys of the file are ignored.
    pub fn apply_ledger(&mut self, ledger: &Value) -> Result<LedgerFigures, ScenarioError> {
        let recovery = ledger
            .get("recovery")
            .ok_or_else(|| ScenarioError::Ledger("no \"recovery\" object".into()))?;
        let recovery = recovery.as_object().ok_or_else(|| {
            ScenarioError::Ledger(format!("\"recovery\" is {recovery}, not an object"))
        })?;
        let number = |key: &str| -> Result<Option<f64>, ScenarioError> {
            match recovery.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
                    _ => Err(ScenarioError::Ledger(format!(
                        "recovery.{key} = {v}: must be a number of seconds, 0 or more"
                    ))),
                },
            }
        };
        let count = |key: &str| -> Result<Option<u64>, ScenarioError> {
            match recovery.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                    ScenarioError::Ledger(format!(
                        "recovery.{key} = {v}: must be a whole number, 0 or more"
                    ))
                }),
            }
        };
        let mut figures = LedgerFigures {
            restarts: count("restarts")?,
            saves: count("saves")?,
            ..LedgerFigures::default()
        };
        let mut take = |key: &str, target: &str, slot: &mut f64| -> Result<(), ScenarioError> {
            if let Some(v) = number(key)? {
                *slot = v;
                figures.applied.push((target.to_owned(), v));
            }
            Ok(())
        };
        take("step_s", "job.step_s", &mut self.job.step_s)?;
        take("startup_s", "job.startup_s", &mut self.job.startup_s)?;
        if let Some(v) = number("save_stall_s")? {
            self.checkpoint.save_stall_s = Some(v);
            figures
                .applied
                .push(("checkpoint.save_stall_s".to_owned(), v));
        }
        for (key, target, slot) in [
            (
                "detection_s",
                "warden.detection_s",
                &mut self.warden.detection_s,
            ),
            (
                "restart_downtime_s",
                "warden.restart_downtime_s",
                &mut self.warden.restart_downtime_s,
            ),
            ("restore_s", "warden.restore_s", &mut self.warden.restore_s),
        ] {
            if let Some(v) = number(key)? {
                *slot = Some(v);
                figures.applied.push((target.to_owned(), v));
            }
        }
        Ok(figures)
    }
}

fn positive(key: &str, v: f64) -> Result<(), ScenarioError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(invalid(key, v, "must be a finite number above 0"))
    }
}

fn non_negative(key: &str, v: f64) -> Result<(), ScenarioError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(invalid(key, v, "must be a finite number, 0 or more"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn llama3_preset_has_the_papers_rate_and_counts() {
        let s = Scenario::preset("llama3").unwrap();
        s.validate().unwrap();
        let total: f64 = s.classes.iter().map(|c| c.share).sum();
        assert!((total - LLAMA3_INTERRUPTIONS).abs() < 1e-9);
        let expected = s.horizon_s() / s.job_mtbf_s();
        assert!((expected - 466.0).abs() < 1e-6, "{expected}");
        let planned: f64 = s
            .classes
            .iter()
            .filter(|c| c.recovery == Recovery::Planned)
            .map(|c| c.share)
            .sum();
        assert!((planned - 47.0).abs() < 1e-9);
        assert_eq!(
            Scenario::preset("gpt4"),
            Err(ScenarioError::UnknownPreset("gpt4".into()))
        );
    }

    #[test]
    fn ledger_figures_replace_defaults_and_bad_ones_are_named() {
        let mut s = Scenario::default();
        let f = s
            .apply_ledger(&json!({
                "job": "x",
                "recovery": {"startup_s": 42.0, "restore_s": 1.5, "restarts": 3}
            }))
            .unwrap();
        assert_eq!(s.job.startup_s, 42.0);
        assert_eq!(s.warden.restore_s, Some(1.5));
        assert_eq!(s.job.step_s, JobTimes::default().step_s);
        assert_eq!(f.restarts, Some(3));
        assert_eq!(f.applied.len(), 2);
        let e = s
            .apply_ledger(&json!({"recovery": {"detection_s": -1}}))
            .unwrap_err();
        assert!(e.to_string().contains("recovery.detection_s"), "{e}");
        let e = s.apply_ledger(&json!({"parts": {}})).unwrap_err();
        assert!(e.to_string().contains("no \"recovery\""), "{e}");
    }
}
