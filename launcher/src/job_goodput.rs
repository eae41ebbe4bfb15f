//! A multi-host job's goodput across its hosts, through etcd.
//!
//! Each host's agent accounts its own ranks. While the job runs, the
//! launcher copies its host's breakdown into etcd every [`EVERY`]
//! (`crate::coord::reports`), so `warden goodput --etcd` shows the whole
//! job live; when the job ends here it stores the final one, reads every
//! host's, and prints and writes their sum ([`JOB_GOODPUT_FILE`]). The last
//! host to finish sums every final report; an earlier one says which hosts
//! were still running.
//!
//! Never: hold the job up for etcd (the copies run on a task, the end is
//! bounded by [`TIMEOUT`]), or fail the job over goodput.

use std::path::Path;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use super::output::Console;
use crate::coord::reports::Reports;

/// How often the host's live breakdown is copied into etcd.
pub const EVERY: Duration = Duration::from_secs(10);
/// Bound on each etcd or agent request made for goodput.
pub const TIMEOUT: Duration = Duration::from_secs(3);
/// The file, next to the per-rank logs, with the job-wide breakdown.
pub const JOB_GOODPUT_FILE: &str = "goodput-job.json";

/// Where the job's reports live and who this host is.
#[derive(Debug, Clone)]
pub struct JobWide {
    /// etcd endpoints.
    pub endpoints: Vec<String>,
    /// TLS and the user for etcd, as the coordinator's.
    pub access: crate::coord::EtcdAccess,
    /// The key prefix of jobs.
    pub prefix: String,
    /// The job id.
    pub job: String,
    /// This host's id in the job.
    pub host: String,
}

impl JobWide {
    async fn reports(&self) -> Result<Reports, crate::coord::CoordError> {
        Reports::connect(
            &self.endpoints,
            &self.access,
            &self.prefix,
            &self.job,
            TIMEOUT,
        )
        .await
    }
}

/// Copies this host's breakdown of the job into etcd every [`EVERY`] until
/// `stop`; failures are logged and tried again at the next turn.
pub fn keep_published(
    jw: JobWide,
    client: AgentClient<Channel>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reports: Option<Reports> = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(EVERY) => {}
            }
            let mut c = client.clone();
            let req = pb::GetGoodputRequest {
                job_id: jw.job.clone(),
            };
            let mine = match tokio::time::timeout(TIMEOUT, c.get_goodput(req)).await {
                Ok(Ok(r)) => r.into_inner().jobs.into_iter().next(),
                _ => None,
            };
            let Some(mine) = mine else { continue };
            if reports.is_none() {
                reports = jw.reports().await.ok();
            }
            if let Some(r) = &reports
                && let Err(e) = r.publish(&jw.host, &mine).await
            {
                tracing::debug!(error = %e, "launcher: goodput not copied to etcd; next turn");
                reports = None;
            }
        }
    })
}

/// At the job's end here: stores this host's final breakdown (`mine`),
/// sums every host's, prints the sum and writes it into `log_dir`.
pub async fn finish(
    jw: &JobWide,
    mine: Option<&pb::JobGoodput>,
    log_dir: &Path,
    console: &Console,
) {
    let summed = async {
        let reports = jw.reports().await?;
        if let Some(m) = mine {
            reports.publish(&jw.host, m).await?;
        }
        reports.read().await
    };
    let found = match summed.await {
        Ok(f) => f,
        Err(e) => {
            console.say(format!("no job-wide goodput: {e}"));
            return;
        }
    };
    for b in &found.bad {
        console.say(format!("job-wide goodput: skipped {b}"));
    }
    let Some(job) = warden_agent::goodput::job_wide::merge(&found.reports) else {
        return;
    };
    let running: Vec<&str> = found
        .reports
        .iter()
        .filter(|(_, r)| r.open)
        .map(|(h, _)| h.as_str())
        .collect();
    console.say(format!(
        "job-wide goodput, {} host{} ({}){}:",
        job.hosts.len(),
        if job.hosts.len() == 1 { "" } else { "s" },
        job.hosts.join(", "),
        if running.is_empty() {
            String::new()
        } else {
            format!("; still running, as last reported: {}", running.join(", "))
        }
    ));
    super::show_goodput(
        &job,
        &log_dir.join(JOB_GOODPUT_FILE),
        "job-wide goodput",
        console,
    );
}
