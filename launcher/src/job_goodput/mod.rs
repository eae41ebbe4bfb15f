//! A multi-host job's goodput across its hosts, through etcd.
//!
//! Each host's agent accounts its own ranks. While the job runs, the
//! launcher copies its host's breakdown into etcd every [`EVERY`]
//! (`crate::coord::reports`), so `warden goodput --etcd` shows the whole
//! job live; when the job ends here it stores the final one, reads every
//! host's, and prints and writes their sum ([`JOB_GOODPUT_FILE`]). A host
//! whose peers are still running waits up to [`LATE_REPORTS`] for their
//! final reports and writes the sum again as they arrive, so the file holds
//! every host's final numbers however the launchers' ends interleave. A
//! live copy never replaces a final report (`Reports::publish_live`).
//!
//! Never: hold the job up for etcd (the copies run on a task, the end is
//! bounded by [`TIMEOUT`] per request and [`LATE_REPORTS`] in all), or fail
//! the job over goodput.
//!
//! The sum itself is [`merge`]: pure, on the reports as stored.

pub mod merge;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use super::output::Console;
use tokio::time::Instant;

use crate::coord::reports::{Found, Reports};

/// How often the host's live breakdown is copied into etcd.
pub const EVERY: Duration = Duration::from_secs(10);
/// How often it is tried until the first copy lands. A host with no copy
/// in etcd is not known to be running: a launcher whose job ends first
/// would not wait for its final report, and a job shorter than [`EVERY`]
/// got a job-wide sum of one host (tests/multihost.rs, on an idle machine,
/// where its 9 s job ended before the first copy).
pub const FIRST_EVERY: Duration = Duration::from_secs(1);
/// Bound on each etcd or agent request made for goodput.
pub const TIMEOUT: Duration = Duration::from_secs(3);
/// The file, next to the per-rank logs, with the job-wide breakdown.
pub const JOB_GOODPUT_FILE: &str = "goodput-job.json";

/// Where the job's reports live and who this host is.
#[derive(Debug, Clone)]
pub struct GoodputHome {
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

impl GoodputHome {
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
/// `stop` (every [`FIRST_EVERY`] until the first copy lands); failures are
/// logged and tried again at the next turn.
pub fn keep_published(
    jw: GoodputHome,
    client: AgentClient<Channel>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reports: Option<Reports> = None;
        // The key's mod revision after this task's last copy.
        let mut after: Option<i64> = None;
        // A copy landed once: failures after it wait EVERY (not a retry a
        // second from every host while etcd is in trouble).
        let mut landed = false;
        loop {
            let every = if landed { EVERY } else { FIRST_EVERY };
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            let mut c = client.clone();
            let req = pb::GetGoodputRequest {
                job_id: jw.job.clone(),
            };
            let mine = match tokio::time::timeout(TIMEOUT, c.get_goodput(req)).await {
                Ok(Ok(r)) => r.into_inner().jobs.into_iter().next(),
                _ => None,
            };
            let Some(mut mine) = mine else { continue };
            // A live copy is never a final report, whatever the ledger
            // says of the moment (between two attempts no rank of the job
            // is live here, and GetGoodput answers `open: false`): only
            // the job's end here ([`finish`]) stores a closed one, which
            // the other hosts' launchers wait for.
            mine.open = true;
            if reports.is_none() {
                reports = jw.reports().await.ok();
            }
            let Some(r) = &reports else { continue };
            match r.publish_live(&jw.host, &mine, after).await {
                Ok(Some(revision)) => {
                    after = Some(revision);
                    landed = true;
                }
                // The final report is in (the job ended here): never
                // replace it with a live copy.
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "launcher: goodput not copied to etcd; next turn");
                    reports = None;
                    // A copy that timed out may have landed: learn the
                    // key's revision again before the next one.
                    after = None;
                }
            }
        }
    })
}

/// At the job's end here: stores this host's final breakdown (`mine`),
/// sums every host's, prints the sum and writes it into `log_dir`. When
/// some hosts are still running and `wait` (the job ends on every host, not
/// on this one alone), waits up to [`LATE_REPORTS`] for their final
/// reports and writes the file again as they arrive: the hosts of a job
/// end within moments of each other, and the last launcher to end may read
/// before a peer's final report is in. Not for a host lost from the job:
/// out of `last_round` (this host's last round's hosts and spares) and
/// neither a member nor gone by a leave ([`Reports::lost_among`]).
///
/// In a job of more than [`EVERY_HOST_SUMS_UP_TO`] hosts only node rank 0
/// of this host's last round sums ([`summed_at`]); every other host stores
/// its final report and says where the sum is.
pub async fn finish(
    jw: &GoodputHome,
    mine: Option<&pb::JobGoodput>,
    log_dir: &Path,
    console: &Console,
    wait: bool,
    last_round: &crate::etcd::RoundHosts,
) {
    let reports = match jw.reports().await {
        Ok(r) => r,
        Err(e) => {
            console.say(format!("no job-wide goodput: {e}"));
            return;
        }
    };
    if let Some(at) = summed_at(&jw.host, last_round) {
        if let Some(m) = mine
            && let Err(e) = reports.publish(&jw.host, m).await
        {
            console.say(format!("this host's final goodput is not in etcd: {e}"));
        }
        console.say(format!(
            "job-wide goodput: summed at {at} (node rank 0 of this host's last round, into its {JOB_GOODPUT_FILE}), \
             not at each of the job's {} hosts; `warden goodput --etcd ENDPOINTS --job {}` sums it from anywhere",
            last_round.members.len(),
            jw.job
        ));
        return;
    }
    let summed = async {
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
    show_job(&found, log_dir, console, false);
    if !wait || found.running().is_empty() {
        return;
    }
    let before = found.running().len();
    // A host lost meanwhile stores no final report: waiting LATE_REPORTS
    // for it only held every survivor's exit (10 s after each heal across
    // hosts). Lost: out of this host's last round (the coordinators
    // dropped it after its lease and their grace ran out; one rejoining
    // within the grace is still in it) and neither a member nor gone by a
    // leave of its own.
    let in_round = last_round.all();
    let outside: Vec<&str> = found
        .running()
        .into_iter()
        .filter(|h| !in_round.contains(h))
        .collect();
    let gone = match reports.lost_among(&outside).await {
        Ok(gone) => gone,
        Err(e) => {
            tracing::debug!(error = %e, "launcher: the job's members not read; waiting for every host's final goodput");
            BTreeSet::new()
        }
    };
    if !gone.is_empty() {
        console.say(format!(
            "job-wide goodput: not waiting for the final report of {}: lost (out of this host's last round, neither a member of the job nor gone by a leave of its own); its last live copy counts",
            gone.iter().map(String::as_str).collect::<Vec<_>>().join(", ")
        ));
    }
    // Nor for this host: its own report is still the live copy only when
    // its agent could not close the ledger (`mine` is None), and nothing
    // more of its will come.
    let mut skip = gone;
    skip.insert(jw.host.clone());
    let late = reports
        .await_final(found, &skip, Instant::now() + LATE_REPORTS)
        .await;
    if late.running().len() < before {
        show_job(&late, log_dir, console, true);
    }
}

/// Up to this many hosts in its last round, every host's launcher sums
/// the job at its end: each reads every host's report and watches every
/// final one come in, O(N) a host and O(N²) a job (here 4,096 reports).
/// At 16,384 hosts that was 268 million reports read through etcd at one
/// job end; past this, only node rank 0 sums ([`summed_at`]).
pub const EVERY_HOST_SUMS_UP_TO: usize = 64;

/// Where the job-wide sum is made when not here: node rank 0 of this
/// host's last round, for a job of more than [`EVERY_HOST_SUMS_UP_TO`]
/// hosts. None: this host sums (a small job, node rank 0 itself, or a host
/// that saw no round). A node rank 0 lost after that round leaves the job
/// with no sum at its end; `warden goodput --etcd` makes it.
pub fn summed_at<'a>(host: &str, last_round: &'a crate::etcd::RoundHosts) -> Option<&'a str> {
    let first = last_round.members.first()?;
    (last_round.members.len() > EVERY_HOST_SUMS_UP_TO && first != host).then_some(first.as_str())
}

/// How long a launcher whose job ended waits for the other hosts' final
/// goodput reports ([`finish`]).
pub const LATE_REPORTS: Duration = Duration::from_secs(10);

/// Prints the sum of `found`'s reports and writes it into `log_dir`
/// (`again`: a rewrite after late reports arrived).
fn show_job(found: &Found, log_dir: &Path, console: &Console, again: bool) {
    for b in &found.bad {
        console.say(format!("job-wide goodput: skipped {b}"));
    }
    let Some(job) = merge::merge(&found.reports) else {
        return;
    };
    let running = found.running();
    console.say(format!(
        "job-wide goodput{}, {} host{} ({}){}:",
        if again {
            " (updated: late final reports)"
        } else {
            ""
        },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::RoundHosts;

    fn round(n: usize) -> RoundHosts {
        RoundHosts {
            members: (0..n).map(|i| format!("h{i}")).collect(),
            spares: vec!["spare".into()],
        }
    }

    #[test]
    fn past_64_hosts_only_node_rank_0_sums_the_job() {
        // Small: every host sums.
        let small = round(EVERY_HOST_SUMS_UP_TO);
        assert_eq!(summed_at("h5", &small), None);
        assert_eq!(summed_at("spare", &small), None);
        // Large: node rank 0 sums; the others, spares included, point at it.
        let large = round(EVERY_HOST_SUMS_UP_TO + 1);
        assert_eq!(summed_at("h0", &large), None);
        assert_eq!(summed_at("h5", &large), Some("h0"));
        assert_eq!(summed_at("spare", &large), Some("h0"));
        // No round seen: this host sums, as before.
        assert_eq!(summed_at("h5", &RoundHosts::default()), None);
    }
}
