//! `warden goodput`: where each job's accelerator time went, as a table
//! with percentages and the top causes of badput, or JSON. The same JSON is
//! what `warden run` writes next to a job's logs when it ends.

use anyhow::{Context, Result};
use serde_json::{Map, Value, json};
use warden_proto::v1 as pb;

use warden_launcher::connect::Target;
pub use warden_launcher::goodput_view::{job_json, render, top_causes};

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
    #[arg(long, default_value = warden_launcher::coord::config::DEFAULT_PREFIX)]
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
    let reports = warden_launcher::coord::reports::Reports::connect(
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
    let Some(sum) = warden_launcher::job_goodput::merge::merge(&found.reports) else {
        anyhow::bail!(
            "no goodput reports for job {job} in etcd at {} under {prefix}/~goodput/{job}/ (a launcher copies its host's every 10 s once the job runs)",
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
