//! `warden goodput plan`: the goodput planner (crate `warden-planner`) on
//! the command line. No agent is needed: it simulates, it does not ask.
//!
//! Inputs are layered: the defaults (or `--preset`, or a `--scenario` JSON
//! file), then a finished job's ledger (`--from-ledger`), then the flags,
//! the most explicit, last. The plan prints as a table, or as JSON with the
//! global `--json`; `--svg` writes the plot.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use warden_planner::Scenario;
use warden_planner::scenario::Recovery;

/// `--spare-refill`'s values (`warden_planner::scenario::SpareRefill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpareRefillArg {
    /// The failed host's launcher requeued on a free node.
    Requeue,
    /// The failed node back from repair.
    Repair,
}

/// `warden goodput plan`'s flags; unset ones keep the scenario's value.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// A named preset: llama3 (16,384 GPUs, 466 interruptions in 54 days,
    /// the paper's split of causes).
    #[arg(long, conflicts_with = "scenario")]
    pub preset: Option<String>,
    /// A scenario JSON file (every input; docs/goodput.md, "Planner inputs").
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// A finished job's ledger JSON: its measured recovery means replace
    /// the defaults.
    #[arg(long)]
    pub from_ledger: Option<PathBuf>,
    /// Accelerators in the job.
    #[arg(long)]
    pub gpus: Option<u64>,
    /// Accelerators per node.
    #[arg(long)]
    pub gpus_per_node: Option<u64>,
    /// Mean time between interruptions caused by one node, hours.
    #[arg(long, conflicts_with = "preset")]
    pub mtbf_node_hours: Option<f64>,
    /// Days simulated.
    #[arg(long)]
    pub days: Option<f64>,
    /// Seconds a checkpoint save stalls training.
    #[arg(long)]
    pub save_stall: Option<f64>,
    /// The whole checkpoint, GiB.
    #[arg(long)]
    pub ckpt_size: Option<f64>,
    /// Seconds per step (warden's hang threshold is calibrated from it).
    #[arg(long)]
    pub step: Option<f64>,
    /// Seconds from new workers to the first step (imports, process groups).
    #[arg(long)]
    pub startup: Option<f64>,
    /// Minutes the baseline's scheduler takes to requeue the job; also what
    /// a node of the cluster's pool costs warden when no spare is free.
    #[arg(long)]
    pub requeue_min: Option<f64>,
    /// Shortest checkpoint interval tried, minutes of training.
    #[arg(long)]
    pub interval_min: Option<f64>,
    /// Longest checkpoint interval tried, minutes of training.
    #[arg(long)]
    pub interval_max: Option<f64>,
    /// Intervals tried (log-spaced).
    #[arg(long)]
    pub points: Option<usize>,
    /// Repetitions per interval.
    #[arg(long)]
    pub reps: Option<usize>,
    /// Random seed: the same seed gives the same plan.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Hot spare nodes beside the job.
    #[arg(long)]
    pub spares: Option<u32>,
    /// Without a free spare, a node fault scales the job down until the
    /// node is repaired (an elastic job, `--nnodes MIN:N`). Default: the
    /// job waits for a node of the cluster's pool, which joins at the
    /// baseline's requeue and a cold start-up (a fixed-size job).
    #[arg(long)]
    pub scale_down: bool,
    /// Without a free spare, a node of the cluster's pool joins (the
    /// default): overrides a scenario file's `"without_spare": "scale_down"`.
    #[arg(long, conflicts_with = "scale_down")]
    pub pool: bool,
    /// How a spare taken comes back with the pool: `requeue` (the default:
    /// the failed host's launcher requeued on a free node, which needs one
    /// scheduler job per host with the job's `--rdzv-id`) or `repair` (the
    /// failed node back from repair: one multi-node allocation).
    #[arg(long, value_enum)]
    pub spare_refill: Option<SpareRefillArg>,
    /// Hours before a failed node comes back, to end a scale-down or
    /// refill a spare: used with `--scale-down` or `--spare-refill repair`
    /// only (refused otherwise, as it would set nothing).
    #[arg(long)]
    pub repair_hours: Option<f64>,
    /// Nodes per data-parallel replica (scale-down removes a whole one).
    #[arg(long)]
    pub replica_nodes: Option<u64>,
    /// The job declares its state (`warden.heal.declare`): a fault that
    /// leaves a live replica heals in this many seconds with the step in
    /// flight redone (0.27: docs/benchmarks.md, "Heal from a live replica").
    #[arg(long)]
    pub heal_s: Option<f64>,
    /// With --heal-s: a lost node's ranks heal from other hosts' replicas
    /// too, when a spare takes its place (built: `warden run` over etcd).
    #[arg(long, requires = "heal_s")]
    pub heal_across_hosts: bool,
    /// Write the plot of goodput against interval to this SVG file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// Builds the scenario from the layers.
pub fn scenario(
    args: &PlanArgs,
) -> Result<(Scenario, Option<warden_planner::scenario::LedgerFigures>)> {
    let mut s = match (&args.preset, &args.scenario) {
        (Some(name), _) => Scenario::preset(name)?,
        (None, Some(path)) => {
            let text =
                warden_core::named_file::read_to_string(path, warden_core::named_file::CONFIG_CAP)
                    .with_context(|| format!("cannot read the scenario {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("scenario {}", path.display()))?
        }
        (None, None) => Scenario::default(),
    };
    let ledger = match &args.from_ledger {
        Some(path) => {
            let text =
                warden_core::named_file::read_to_string(path, warden_core::named_file::CONFIG_CAP)
                    .with_context(|| format!("cannot read the ledger {}", path.display()))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("ledger {} is not JSON", path.display()))?;
            Some(
                s.apply_ledger(&value)
                    .with_context(|| path.display().to_string())?,
            )
        }
        None => None,
    };
    let set = |slot: &mut f64, v: Option<f64>| {
        if let Some(v) = v {
            *slot = v;
        }
    };
    if let Some(v) = args.gpus {
        s.gpus = v;
    }
    if let Some(v) = args.gpus_per_node {
        s.gpus_per_node = v;
    }
    set(&mut s.node_mtbf_hours, args.mtbf_node_hours);
    set(&mut s.days, args.days);
    if let Some(v) = args.save_stall {
        s.checkpoint.save_stall_s = Some(v);
    }
    set(&mut s.checkpoint.size_gib, args.ckpt_size);
    set(&mut s.job.step_s, args.step);
    set(&mut s.job.startup_s, args.startup);
    set(
        &mut s.baseline.requeue_s,
        args.requeue_min.map(|m| m * 60.0),
    );
    set(&mut s.repair_hours, args.repair_hours);
    if let Some(v) = args.interval_min {
        s.sweep.interval_min_s = Some(v * 60.0);
    }
    if let Some(v) = args.interval_max {
        s.sweep.interval_max_s = Some(v * 60.0);
    }
    if let Some(v) = args.points {
        s.sweep.points = v;
    }
    if let Some(v) = args.reps {
        s.sweep.reps = v;
    }
    if let Some(v) = args.seed {
        s.sweep.seed = v;
    }
    if let Some(v) = args.spares {
        s.spares = v;
    }
    if args.scale_down {
        s.without_spare = warden_planner::scenario::WithoutSpare::ScaleDown;
    }
    if args.pool {
        s.without_spare = warden_planner::scenario::WithoutSpare::Pool;
    }
    if let Some(r) = args.spare_refill {
        s.spare_refill = match r {
            SpareRefillArg::Requeue => warden_planner::scenario::SpareRefill::Requeue,
            SpareRefillArg::Repair => warden_planner::scenario::SpareRefill::Repair,
        };
    }
    if args.repair_hours.is_some() && !s.uses_repair() {
        anyhow::bail!(
            "--repair-hours sets nothing here: a spare taken is refilled from the cluster's pool (the failed host's launcher requeued), and the job does not scale down; add --spare-refill repair (one multi-node allocation) or --scale-down (an elastic job)"
        );
    }
    if let Some(v) = args.replica_nodes {
        s.replica_nodes = v;
    }
    if let Some(v) = args.heal_s {
        s.warden.heal_s = Some(v);
    }
    if args.heal_across_hosts {
        s.warden.heal_across_hosts = true;
    }
    Ok((s, ledger))
}

/// Runs the planner and prints the plan.
pub fn run(args: &PlanArgs, json: bool) -> Result<()> {
    let (scenario, ledger) = scenario(args)?;
    let started = std::time::Instant::now();
    let plan = warden_planner::plan(&scenario, ledger)?;
    let took = started.elapsed();
    if let Some(path) = &args.svg {
        std::fs::write(path, warden_planner::svg::render(&plan))
            .with_context(|| format!("cannot write the plot to {}", path.display()))?;
    }
    // Written, not println!: a closed pipe (`| head`) is an error, not a panic.
    let mut text = String::new();
    if json {
        let mut doc = warden_planner::report::json(&plan);
        if let (Some(path), Some(obj)) = (&args.svg, doc.as_object_mut()) {
            obj.insert("svg".into(), path.display().to_string().into());
        }
        text = format!("{doc}\n");
    } else {
        text.push_str(&warden_planner::report::table(&plan));
        if let Some(path) = &args.svg {
            text.push_str(&format!("\nplot: {}\n", path.display()));
        }
        let planned = scenario
            .classes
            .iter()
            .any(|c| c.recovery == Recovery::Planned);
        text.push_str(&format!(
            "\n(simulated in {:.2} s; {} interruptions per repetition{})\n",
            took.as_secs_f64(),
            plan.interruptions_expected.round(),
            if planned {
                ", planned ones included"
            } else {
                ""
            }
        ));
    }
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .context("cannot write the plan to stdout")?;
    Ok(())
}
