//! Zero-code mode: what the launcher tells the agent about workers that
//! never import warden.
//!
//! In: a worker just spawned (its pid, ranks, devices), and later its exit
//! with the last traceback its stderr showed ([`super::output::Traceback`]).
//! Out: RegisterRank on the worker's behalf, so the agent watches its exit
//! and process state (no heartbeats: the hang and straggler detectors have
//! nothing to judge it on); ReportException on its behalf for each
//! traceback (or C++ `terminate`) its stderr shows, as it shows, so its
//! crash, or a peer's, is attributed by the same exception rules as a
//! client's report. Never: replace the worker's own client: a
//! worker that registers itself takes over the launcher's registration (the
//! agent refuses the launcher's over the client's), and its exceptions are
//! its client's to report.

use std::time::Duration;

use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use tokio::sync::watch;

use super::agent::Seen;
use super::output::{Console, Traceback};

/// How long one RegisterRank or ReportException may take: the worker runs
/// on either way.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Who a worker is, for its registration.
#[derive(Debug, Clone)]
pub struct WorkerId {
    /// The job.
    pub job: String,
    /// Its global rank.
    pub rank: u32,
    /// Its local rank.
    pub local_rank: u32,
    /// The job's world size.
    pub world_size: u32,
    /// Its pid.
    pub pid: u32,
    /// This host's name.
    pub host: String,
    /// The accelerators it drives, as a client would name them from its
    /// environment (`WARDEN_DEVICES`, else its entry of
    /// `CUDA_VISIBLE_DEVICES`; empty: the agent assumes `gpu<local_rank>`).
    pub devices: Vec<String>,
}

impl WorkerId {
    /// The devices of a worker with environment `env` (what the launcher
    /// sets) over the launcher's own (what it inherits).
    pub fn devices_of(env: &[(String, String)], local_rank: u32) -> Vec<String> {
        let var = |k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .or_else(|| std::env::var(k).ok())
        };
        warden_client::devices_from_env(
            var("WARDEN_DEVICES").as_deref(),
            var("CUDA_VISIBLE_DEVICES").as_deref(),
            local_rank,
        )
    }
}

/// Registers `w` with the agent on its behalf. Err: the agent's status;
/// PERMISSION_DENIED means another user owns the job at the agent now (the
/// launcher then stops the job); anything else is said on the console and
/// the job runs on (the agent then cannot diagnose the worker's failure and
/// the launcher decides alone, as before).
pub async fn register(client: &AgentClient<Channel>, w: &WorkerId) -> Result<(), tonic::Status> {
    let req = pb::RegisterRankRequest {
        job_id: w.job.clone(),
        global_rank: w.rank,
        local_rank: w.local_rank,
        world_size: w.world_size,
        pid: w.pid,
        host: w.host.clone(),
        slot_layout_version: warden_client::slot::LAYOUT_VERSION,
        previous_slot: None,
        stack_dump_signal: 0,
        devices: w.devices.clone(),
    };
    let mut c = client.clone();
    match tokio::time::timeout(CALL_TIMEOUT, c.register_rank(req)).await {
        Ok(Ok(_)) => Ok(()),
        // The worker's client was first: its registration stands.
        Ok(Err(s)) if s.code() == tonic::Code::AlreadyExists => Ok(()),
        Ok(Err(s)) => Err(s),
        Err(_) => Err(tonic::Status::deadline_exceeded(format!(
            "no answer within {}",
            humantime::format_duration(CALL_TIMEOUT)
        ))),
    }
}

/// Reports every traceback worker `w`'s stderr completes, as it appears
/// (before the process is gone: a peer's error must reach the agent while
/// the incident of the rank that failed first is still being diagnosed),
/// unless the worker registered itself (its client reports its own
/// exceptions, with their step). Ends when the stderr pump ends.
pub async fn report_tracebacks(
    client: AgentClient<Channel>,
    w: WorkerId,
    mut tracebacks: watch::Receiver<Option<Traceback>>,
    seen: watch::Receiver<Seen>,
    console: Console,
) {
    while tracebacks.changed().await.is_ok() {
        let Some(tb) = tracebacks.borrow_and_update().clone() else {
            continue;
        };
        if seen.borrow().self_registered.contains(&w.pid) {
            continue;
        }
        if let Err(e) = report(&client, &w, &tb).await {
            console.say(format!(
                "could not report rank {}'s {} to the agent: {e}",
                w.rank, tb.exception_type
            ));
        }
    }
}

/// Tells the agent that worker `w` printed `tb`, as its client would have.
/// Not `uncaught`: the launcher saw it printed; whether it ended the
/// process is for the exit to say. Err: why not.
async fn report(client: &AgentClient<Channel>, w: &WorkerId, tb: &Traceback) -> Result<(), String> {
    let req = pb::ReportExceptionRequest {
        job_id: w.job.clone(),
        global_rank: w.rank,
        generation: 0,
        pid: w.pid,
        exception_type: tb.exception_type.clone(),
        message: tb.message.clone(),
        traceback: tb.text.clone(),
        step: 0,
        uncaught: false,
        awaits_decision: false,
    };
    let mut c = client.clone();
    match tokio::time::timeout(CALL_TIMEOUT, c.report_exception(req)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(s.message().to_owned()),
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(CALL_TIMEOUT)
        )),
    }
}
