//! `warden goodput`: where each job's accelerator time went, as a table
//! with percentages and the top causes of badput, or JSON. The same JSON is
//! what `warden run` writes next to a job's logs when it ends.

use anyhow::{Context, Result};
use serde_json::{Map, Value, json};
use warden_proto::v1 as pb;

use super::Target;

/// `warden goodput [--job J] [--json]` and its subcommands.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct GoodputArgs {
    /// Only this job.
    #[arg(long)]
    pub job: Option<String>,
    /// Sum a multi-host job's breakdown over its hosts from etcd (the
    /// reports its launchers keep there) instead of asking this host's
    /// agent; needs --job. Endpoints comma-separated, as --rdzv-endpoint.
    #[arg(long, value_name = "ENDPOINTS", requires = "job")]
    pub etcd: Option<String>,
    /// The jobs' key prefix in etcd (as the launchers were given).
    #[arg(long, default_value = crate::coord::config::DEFAULT_PREFIX)]
    pub etcd_prefix: String,
    /// TLS and authentication to etcd, as `warden run`'s.
    #[command(flatten)]
    pub etcd_access: super::etcd_flags::EtcdFlags,
    /// A subcommand instead of the report.
    #[command(subcommand)]
    pub cmd: Option<GoodputCmd>,
}

/// What `warden goodput` does besides the report.
#[derive(Debug, clap::Subcommand)]
pub enum GoodputCmd {
    /// Before a run: the goodput to expect, the checkpoint interval that
    /// maximises it and what hot spares are worth, from a seeded simulation
    /// of failures and recoveries, warden beside the scheduler-requeue
    /// baseline. See docs/goodput.md.
    Plan(Box<super::goodput_plan::PlanArgs>),
}

/// Runs `warden goodput` (the report).
pub async fn run(target: &Target, args: &GoodputArgs, as_json: bool) -> Result<()> {
    if let (Some(endpoints), Some(job)) = (&args.etcd, &args.job) {
        return job_wide(endpoints, args, job, as_json).await;
    }
    let mut c = target.connect().await?;
    let r = c
        .get_goodput(pb::GetGoodputRequest {
            job_id: args.job.clone().unwrap_or_default(),
        })
        .await
        .with_context(|| format!("GetGoodput from {target}"))?
        .into_inner();
    if as_json {
        outln!(
            "{}",
            json!({ "jobs": r.jobs.iter().map(job_json).collect::<Vec<_>>() })
        )?;
        return Ok(());
    }
    if r.jobs.is_empty() {
        outln!("no jobs accounted yet")?;
    }
    for (i, j) in r.jobs.iter().enumerate() {
        if i > 0 {
            outln!()?;
        }
        out!("{}", render(j))?;
    }
    Ok(())
}

/// `warden goodput --etcd E --job J`: every host's report of the job from
/// etcd, each host's goodput on a line, then their sum as one table.
async fn job_wide(endpoints: &str, args: &GoodputArgs, job: &str, as_json: bool) -> Result<()> {
    let prefix = args.etcd_prefix.as_str();
    let endpoints: Vec<String> = endpoints
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect();
    args.etcd_access.check_endpoints("--etcd", &endpoints)?;
    let access = args.etcd_access.access()?;
    let reports = crate::coord::reports::Reports::connect(
        &endpoints,
        &access,
        prefix,
        job,
        std::time::Duration::from_secs(5),
    )
    .await?;
    let found = reports.read().await?;
    for b in &found.bad {
        eprintln!("skipped {b}");
    }
    let Some(sum) = crate::goodput::job_wide::merge(&found.reports) else {
        anyhow::bail!(
            "no goodput reports for job {job} in etcd at {} under {prefix}/{job}/goodput/ (a launcher copies its host's every 10 s once the job runs)",
            endpoints.join(",")
        );
    };
    if as_json {
        let hosts: Map<String, Value> = found
            .reports
            .iter()
            .map(|(h, r)| (h.clone(), job_json(r)))
            .collect();
        outln!("{}", json!({ "job": job_json(&sum), "hosts": hosts }))?;
        return Ok(());
    }
    for (h, r) in &found.reports {
        outln!(
            "{h}: goodput {:.1}% of {:.1} accelerator-s ({} rank{}){}",
            r.goodput * 100.0,
            r.accelerator_seconds,
            r.ranks,
            if r.ranks == 1 { "" } else { "s" },
            if r.open { ", running" } else { "" }
        )?;
    }
    outln!()?;
    out!("{}", render(&sum))?;
    Ok(())
}

/// Badput causes by share, largest first (productive left out, zero
/// shares left out).
pub fn top_causes(j: &pb::JobGoodput) -> Vec<&pb::GoodputPart> {
    let mut bad: Vec<&pb::GoodputPart> = j
        .parts
        .iter()
        .filter(|p| p.cause != "productive" && p.accelerator_seconds > 0.0)
        .collect();
    bad.sort_by(|a, b| b.fraction.total_cmp(&a.fraction));
    bad
}

/// One job as JSON: parts in accelerator-seconds and fractions, the top
/// causes, and the `recovery` means the planner reads (`--from-ledger`).
pub fn job_json(j: &pb::JobGoodput) -> Value {
    let mut parts = Map::new();
    for p in &j.parts {
        parts.insert(
            p.cause.clone(),
            json!({ "accelerator_s": p.accelerator_seconds, "fraction": p.fraction }),
        );
    }
    let rec = j.recovery.unwrap_or_default();
    json!({
        "job_id": j.job_id,
        "wall_s": j.wall_seconds,
        "ranks": j.ranks,
        "accelerator_s": j.accelerator_seconds,
        "goodput": j.goodput,
        "open": j.open,
        "hosts": j.hosts,
        "parts": parts,
        "top_causes": top_causes(j).iter().take(3).map(|p| p.cause.clone()).collect::<Vec<_>>(),
        "recovery": {
            "step_s": rec.step_s,
            "startup_s": rec.startup_s,
            "detection_s": rec.detection_s,
            "restart_downtime_s": rec.restart_downtime_s,
            "restore_s": rec.restore_s,
            "save_stall_s": rec.save_stall_s,
            "restarts": rec.restarts,
            "saves": rec.saves,
        },
    })
}

/// One job as a table with percentages and its top causes.
pub fn render(j: &pb::JobGoodput) -> String {
    let mut out = format!(
        "job {}: goodput {:.1}% of {:.1} accelerator-s ({} rank{}{} x {:.1} s wall){}\n",
        j.job_id,
        j.goodput * 100.0,
        j.accelerator_seconds,
        j.ranks,
        if j.ranks == 1 { "" } else { "s" },
        match j.hosts.len() {
            0 => String::new(),
            1 => " on 1 host".to_owned(),
            n => format!(" on {n} hosts"),
        },
        j.wall_seconds,
        if j.open { ", running" } else { "" }
    );
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(vec!["CAUSE", "ACCEL-S", "SHARE"]);
    for p in &j.parts {
        if p.accelerator_seconds == 0.0 && p.cause != "productive" {
            continue;
        }
        t.add_row(vec![
            p.cause.clone(),
            format!("{:.2}", p.accelerator_seconds),
            format!("{:.1}%", p.fraction * 100.0),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    let top = top_causes(j);
    if top.is_empty() {
        out.push_str("no badput\n");
    } else {
        out.push_str(&format!(
            "top causes: {}\n",
            top.iter()
                .take(3)
                .map(|p| format!("{} {:.1}%", p.cause, p.fraction * 100.0))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if let Some(r) = &j.recovery
        && (r.restarts > 0 || r.saves > 0)
    {
        let f = |v: Option<f64>| v.map_or("-".to_owned(), |s| format!("{s:.2} s"));
        out.push_str(&format!(
            "recovery: {} restart{} (detection {}, downtime {}, restore {}), {} save{} (stall {})\n",
            r.restarts,
            if r.restarts == 1 { "" } else { "s" },
            f(r.detection_s),
            f(r.restart_downtime_s),
            f(r.restore_s),
            r.saves,
            if r.saves == 1 { "" } else { "s" },
            f(r.save_stall_s),
        ));
    }
    out
}
