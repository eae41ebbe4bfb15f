//! Issue 29 ("Trust, round two"), points 6 and 11a and the quotas, replayed
//! by a member of the socket group against a real root wardend:
//! - the health gate on demand: 40 concurrent RunHealthGate calls at level
//!   4 (`dcgmi diag -r 4`, which stresses every GPU of every tenant) and at
//!   the highest level allowed; the diag runs are counted by a stand-in
//!   `dcgmi` (the outer boundary, as tests/dcgm.rs fakes it) that logs each
//!   start and end and notices an overlap;
//! - a flood of ReportJobStop (the issue measured 576 calls in 0.6 s);
//! - register/close cycles with new job ids (3,000 of them), leaving
//!   journals, ledger entries and job-labelled metric series;
//! - job claims: one uid owns at most 256 jobs.
//!
//! Each is shown bounded, and the victim's (root's) job unchanged.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::common::users::{self, block_on, call_result, socket_arg};
use crate::common::{TestAgent, WAIT, eventually, scrape, within};

type Channel = tonic::transport::Channel;

async fn client(args: &Value) -> AgentClient<Channel> {
    AgentClient::new(
        warden_cli::Target::Unix(socket_arg(args))
            .channel()
            .await
            .expect("the member connects (it is in the socket group)"),
    )
}

fn register(job: &str, pid: u32) -> pb::RegisterRankRequest {
    pb::RegisterRankRequest {
        job_id: job.to_owned(),
        global_rank: 0,
        local_rank: 0,
        world_size: 1,
        pid,
        host: "gates".to_owned(),
        slot_layout_version: warden_client::slot::LAYOUT_VERSION,
        previous_slot: None,
        stack_dump_signal: 0,
        devices: Vec::new(),
    }
}

fn number(args: &Value, key: &str) -> u64 {
    args[key]
        .as_u64()
        .unwrap_or_else(|| panic!("the attack's {key:?}"))
}

// ---------------------------------------------------------------- the gate

/// dcgmi's JSON for a pass (DCGM 4's shape).
const DIAG_PASS: &str = r#"{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [{"category": "Deployment", "tests": [{"name": "software", "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"}], "test_summary": {"status": "Pass"}}]}]}}"#;

/// A stand-in `dcgmi` that logs `start <pid> <args>` and `end <pid>` to
/// `runs.log`, and `overlap <pid>` when another run is in progress (its
/// marker directory exists), takes `secs` seconds, and passes.
struct Dcgmi {
    dir: tempfile::TempDir,
}

impl Dcgmi {
    fn new(secs: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().display();
        let json = dir.path().join("pass.json");
        std::fs::write(&json, DIAG_PASS).unwrap();
        let script = format!(
            "#!/bin/sh\n\
             echo \"start $$ $*\" >> {d}/runs.log\n\
             if ! mkdir {d}/running 2>/dev/null; then echo \"overlap $$\" >> {d}/runs.log; fi\n\
             sleep {secs}\n\
             rmdir {d}/running 2>/dev/null\n\
             echo \"end $$\" >> {d}/runs.log\n\
             cat {}\n",
            json.display()
        );
        let path = dir.path().join("dcgmi");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("dcgmi")
    }

    /// The log's lines.
    fn log(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("runs.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The runs started, by their arguments.
    fn starts(&self) -> Vec<String> {
        self.log()
            .iter()
            .filter_map(|l| l.strip_prefix("start "))
            .map(|l| l.split_once(' ').map_or("", |(_, a)| a).to_owned())
            .collect()
    }
}

/// As the member: own a job (a rank of its own process), then fire
/// `args.calls` RunHealthGate calls at once at each level of `args.levels`
/// (one burst per level, one after the other), then one more call at the
/// last level. Every call's outcome comes back.
pub fn attack_gates(args: &Value) -> Value {
    block_on(async {
        let mut c = client(args).await;
        c.register_rank(register("gate-member", std::process::id()))
            .await
            .expect("the member registers a rank of its own (it may gate then)");
        let calls = number(args, "calls");
        let levels: Vec<u32> = args["levels"]
            .as_array()
            .expect("levels")
            .iter()
            .map(|l| u32::try_from(l.as_u64().expect("a level")).unwrap())
            .collect();
        let gate = |c: &AgentClient<Channel>, level: u32| {
            let mut c = c.clone();
            async move {
                call_result(
                    c.run_health_gate(pb::RunHealthGateRequest {
                        level,
                        job_id: "gate-member".into(),
                    })
                    .await,
                    |r| {
                        let r = r.into_inner();
                        json!({"passed": r.passed, "ran": r.ran, "cached": r.cached,
                               "age_s": r.cached_age.map(|d| d.seconds), "note": r.note})
                    },
                )
            }
        };
        let mut bursts = Vec::new();
        for level in &levels {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..calls {
                set.spawn(gate(&c, *level));
            }
            let mut out = Vec::new();
            while let Some(r) = set.join_next().await {
                out.push(r.expect("a call's task"));
            }
            bursts.push(json!({"level": level, "calls": out}));
        }
        let again = gate(&c, *levels.last().expect("a level")).await;
        json!({"bursts": bursts, "again": again})
    })
}

fn codes(calls: &Value) -> Vec<(String, String)> {
    calls
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| {
            (
                c["code"].as_str().unwrap_or("Ok").to_owned(),
                c["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

async fn run_gate_attack(args: Value) -> Value {
    let member = users::users().member.clone();
    within(WAIT * 9, "the gate attack", async move {
        tokio::task::spawn_blocking(move || users::run_as(&member, "gates.gate", &args))
            .await
            .expect("run the attack")
    })
    .await
    .result
}

/// Point 6 with the cache on: the level-4 burst is refused naming
/// `dcgm.gate_max_level` and starts no run; the burst at the highest level
/// allowed starts exactly one run, which every caller shares (one ran,
/// the others answered cached with their age).
#[tokio::test(flavor = "multi_thread")]
async fn forty_gates_at_level_four_start_no_run_and_forty_allowed_ones_share_one() {
    let dcgmi = Dcgmi::new("2");
    let agent = TestAgent::start_shared(&format!(
        "[dcgm]\nenabled = false\ndcgmi = {:?}\ngate_timeout = \"60s\"\n\
         gate_max_level = 2\ngate_cache_for = \"10m\"\ngate_max_per_uid = 40\n",
        dcgmi.path().display().to_string()
    ));
    let out =
        run_gate_attack(json!({"socket": agent.socket(), "calls": 40, "levels": [4, 2]})).await;
    let four = codes(&out["bursts"][0]["calls"]);
    assert_eq!(four.len(), 40);
    for (code, message) in &four {
        assert_eq!(code, "InvalidArgument", "{out}");
        assert!(
            message.contains("level 4 refused") && message.contains("dcgm.gate_max_level (2)"),
            "{out}"
        );
    }
    let two = out["bursts"][1]["calls"].as_array().expect("calls");
    assert_eq!(two.len(), 40);
    let ran: Vec<&Value> = two.iter().filter(|c| c["cached"] == false).collect();
    assert_eq!(ran.len(), 1, "one run, shared: {out}");
    for c in two {
        assert_eq!(c["ok"], true, "{out}");
        assert_eq!(c["passed"], true, "{out}");
        assert_eq!(c["ran"], "dcgmi diag -r 2", "{out}");
        if c["cached"] == true {
            assert!(c["note"].as_str().unwrap().starts_with("cached:"), "{out}");
            assert!(c["age_s"].is_u64(), "{out}");
        }
    }
    assert_eq!(out["again"]["cached"], true, "{out}");
    // What the stand-in saw: one run, at level 2, and never two at once.
    assert_eq!(dcgmi.starts(), ["diag -r 2 -j"], "{:?}", dcgmi.log());
    assert!(
        !dcgmi.log().iter().any(|l| l.starts_with("overlap")),
        "{:?}",
        dcgmi.log()
    );
}

/// Point 6 with the cache off, and the per-uid bound: 40 calls at once
/// leave at most `dcgm.gate_max_per_uid` (4) in progress; the rest are
/// refused naming the key. The runs the others asked for follow one
/// another, never overlapping, one per answered call.
#[tokio::test(flavor = "multi_thread")]
async fn gates_without_a_cache_run_one_at_a_time_and_a_uid_has_four_in_progress() {
    let dcgmi = Dcgmi::new("1");
    let agent = TestAgent::start_shared(&format!(
        "[dcgm]\nenabled = false\ndcgmi = {:?}\ngate_timeout = \"60s\"\n\
         gate_max_level = 2\ngate_cache_for = \"0s\"\ngate_max_per_uid = 4\n",
        dcgmi.path().display().to_string()
    ));
    let out = run_gate_attack(json!({"socket": agent.socket(), "calls": 40, "levels": [1]})).await;
    let calls = codes(&out["bursts"][0]["calls"]);
    let answered = calls.iter().filter(|(c, _)| c == "Ok").count();
    let refused: Vec<&(String, String)> = calls.iter().filter(|(c, _)| c != "Ok").collect();
    for (code, message) in &refused {
        assert_eq!(code, "ResourceExhausted", "{out}");
        assert!(message.contains("dcgm.gate_max_per_uid 4"), "{out}");
    }
    // 40 calls at once against runs of a second each: most are refused.
    assert!(answered >= 1 && refused.len() >= 20, "{out}");
    // Every answered call (and the last one) ran, one after another.
    wait_for_ends(&dcgmi).await;
    let starts = dcgmi.starts();
    assert_eq!(starts.len(), answered + 1, "{:?}\n{out}", dcgmi.log());
    assert!(starts.iter().all(|a| a == "diag -r 1 -j"), "{starts:?}");
    assert!(
        !dcgmi.log().iter().any(|l| l.starts_with("overlap")),
        "{:?}",
        dcgmi.log()
    );
}

/// Every run the stand-in started has ended.
async fn wait_for_ends(dcgmi: &Dcgmi) {
    eventually(WAIT, "the stand-in's runs to end", async || {
        let log = dcgmi.log();
        let starts = log.iter().filter(|l| l.starts_with("start")).count();
        let ends = log.iter().filter(|l| l.starts_with("end")).count();
        (starts == ends).then_some(())
    })
    .await;
}

// ---------------------------------------------------------------- job stops

/// As the member: own `args.job`, then send `args.calls` ReportJobStop
/// calls for it, 64 at a time. The codes and messages come back, with
/// the time the flood took.
pub fn attack_stop_flood(args: &Value) -> Value {
    block_on(async {
        let mut c = client(args).await;
        let job = args["job"].as_str().expect("job").to_owned();
        c.register_rank(register(&job, std::process::id()))
            .await
            .expect("the member registers a rank of its own job");
        let calls = number(args, "calls");
        let started = Instant::now();
        let mut out = Vec::new();
        let mut sent = 0;
        while sent < calls {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..64.min(calls - sent) {
                let mut c = c.clone();
                let job = job.clone();
                set.spawn(async move {
                    call_result(
                        c.report_job_stop(pb::ReportJobStopRequest {
                            job_id: job,
                            reason: pb::JobStopReason::NoProgress as i32,
                            summary: "flood".into(),
                            exit_code: 88,
                            ..Default::default()
                        })
                        .await,
                        |_| json!({}),
                    )
                });
                sent += 1;
            }
            while let Some(r) = set.join_next().await {
                out.push(r.expect("a call's task"));
            }
        }
        json!({"calls": out, "elapsed_s": started.elapsed().as_secs_f64()})
    })
}

async fn stopped_count(c: &mut AgentClient<Channel>, job: &str) -> (usize, usize) {
    let incidents = c
        .get_incidents(pb::GetIncidentsRequest {
            job_id: job.into(),
            limit: 0,
        })
        .await
        .expect("GetIncidents")
        .into_inner()
        .incidents
        .len();
    let events = c
        .list_events(pb::ListEventsRequest {
            after_id: 0,
            limit: 100_000,
        })
        .await
        .expect("ListEvents")
        .into_inner()
        .events
        .iter()
        .filter(|e| e.kind == "job.stopped" && e.subject == format!("job/{job}"))
        .count();
    (incidents, events)
}

/// Quotas, stops per minute: 576 calls are refused past the uid's bucket
/// (`api.job_stops_per_minute` = 10), naming the key; each accepted call
/// is one incident and one `job.stopped` event, each refused one leaves
/// nothing; another uid's stop still goes through.
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_job_stops_is_refused_past_the_rate_with_nothing_recorded() {
    let agent = TestAgent::start_shared("[api]\njob_stops_per_minute = 10\n");
    let member = users::users().member.clone();
    let args = json!({"socket": agent.socket(), "job": "flood", "calls": 576});
    let out = within(WAIT * 6, "the stop flood", async move {
        tokio::task::spawn_blocking(move || users::run_as(&member, "gates.stop_flood", &args))
            .await
            .expect("run the attack")
    })
    .await
    .result;
    let calls = codes(&out["calls"]);
    assert_eq!(calls.len(), 576);
    let accepted = calls.iter().filter(|(c, _)| c == "Ok").count();
    for (code, message) in calls.iter().filter(|(c, _)| c != "Ok") {
        assert_eq!(code, "ResourceExhausted", "{message}");
        assert!(
            message.contains("api.job_stops_per_minute")
                && message.contains(&format!("uid {}", users::users().member.uid)),
            "{message}"
        );
    }
    // The bucket: 10, plus one per 6 s the flood took.
    let elapsed = out["elapsed_s"].as_f64().expect("elapsed");
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let bound = 10 + (elapsed / 6.0).ceil() as usize;
    assert!(
        (10..=bound).contains(&accepted),
        "{accepted} accepted in {elapsed:.1}s (at most {bound})"
    );
    // Nothing but the accepted stops was recorded.
    let mut c = agent.client().await;
    let (incidents, events) = eventually(WAIT, "the stops' events", async || {
        let n = stopped_count(&mut c, "flood").await;
        (n.1 >= accepted).then_some(n)
    })
    .await;
    assert_eq!((incidents, events), (accepted, accepted));
    // Root has a bucket of its own.
    c.register_rank(register("root-job", std::process::id()))
        .await
        .expect("root registers");
    c.report_job_stop(pb::ReportJobStopRequest {
        job_id: "root-job".into(),
        reason: pb::JobStopReason::NoProgress as i32,
        exit_code: 88,
        ..Default::default()
    })
    .await
    .expect("root's stop is not the member's quota");
}

// ---------------------------------------------------------------- goodput

/// As the member: `args.cycles` times, with a new job id each time,
/// RegisterRank (its own process), DeregisterRank (a process may hold only
/// `ranks.max_per_process` live ranks), CloseGoodput; `args.workers` at
/// once, for at most `args.budget_s` seconds (a loaded machine does fewer
/// cycles; the test checks enough went through). The close is retried
/// while the agent has not yet booked the registration (NOT_FOUND),
/// within a deadline.
pub fn attack_cycles(args: &Value) -> Value {
    block_on(async {
        let c = client(args).await;
        let cycles = number(args, "cycles");
        let workers = number(args, "workers");
        let started = Instant::now();
        let budget = started + Duration::from_secs(number(args, "budget_s"));
        // Past the budget a worker stops, but only once the cycles below
        // `min_cycles` are done: a loaded machine (CI at load 25 did 435
        // in 35 s) still shows the bound, just later.
        let min_cycles = number(args, "min_cycles");
        let mut set = tokio::task::JoinSet::new();
        for w in 0..workers {
            let mut c = c.clone();
            set.spawn(async move {
                let mut errors: Vec<String> = Vec::new();
                let mut closed = 0u64;
                for i in (w..cycles).step_by(usize::try_from(workers).unwrap()) {
                    if Instant::now() > budget && i >= min_cycles {
                        break;
                    }
                    let job = format!("cycle-{i}");
                    let r = match c.register_rank(register(&job, std::process::id())).await {
                        Ok(r) => r.into_inner(),
                        Err(e) => {
                            errors.push(format!("register {job}: {}", e.message()));
                            continue;
                        }
                    };
                    if let Err(e) = c
                        .deregister_rank(pb::DeregisterRankRequest {
                            job_id: job.clone(),
                            global_rank: 0,
                            generation: r.generation,
                        })
                        .await
                    {
                        errors.push(format!("deregister {job}: {}", e.message()));
                    }
                    let deadline = Instant::now() + Duration::from_secs(10);
                    loop {
                        match c
                            .close_goodput(pb::CloseGoodputRequest {
                                job_id: job.clone(),
                            })
                            .await
                        {
                            Ok(_) => {
                                closed += 1;
                                break;
                            }
                            Err(e)
                                if e.code() == tonic::Code::NotFound
                                    && Instant::now() < deadline =>
                            {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            Err(e) => {
                                errors.push(format!("close {job}: {}", e.message()));
                                break;
                            }
                        }
                    }
                }
                (closed, errors)
            });
        }
        let mut closed = 0;
        let mut errors = Vec::new();
        while let Some(r) = set.join_next().await {
            let (n, e) = r.expect("a worker");
            closed += n;
            errors.extend(e);
        }
        errors.truncate(20);
        json!({"closed": closed, "errors": errors, "elapsed_s": started.elapsed().as_secs_f64()})
    })
}

fn journals(state: &Path) -> usize {
    std::fs::read_dir(state.join("goodput")).map_or(0, |d| {
        d.flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".jsonl"))
            .count()
    })
}

/// The jobs with series on `/metrics`, and the number of job series.
async fn job_series(agent: &TestAgent) -> (BTreeSet<String>, usize, f64) {
    let (s, _) = scrape(agent).await;
    let jobs: Vec<String> = s
        .samples
        .iter()
        .filter_map(|x| x.labels.get("job").map(str::to_owned))
        .collect();
    let dropped = s
        .samples
        .iter()
        .find(|x| x.metric == "warden_metrics_job_series_dropped_total")
        .map_or(0.0, |x| crate::common::number(&x.value));
    (jobs.iter().cloned().collect(), jobs.len(), dropped)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("the agent's status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// Point 11a: register/close cycles (up to 3,000, as many as the machine
/// does in 35 s, and at least ten times the cap however long they take)
/// leave at most
/// `goodput.max_ended_jobs` journals and ledger entries (plus the victim's
/// running job), job series capped by `metrics.max_job_series` and gone
/// `goodput.series_after_end` after their job ended; the victim keeps its
/// journal, its ledger and its series throughout.
#[tokio::test(flavor = "multi_thread")]
async fn register_close_cycles_leave_bounded_journals_ledgers_and_series() {
    const CAP: usize = 64;
    const SERIES: usize = 500;
    let agent = TestAgent::start_shared(&format!(
        "[goodput]\nmax_ended_jobs = {CAP}\nseries_after_end = \"3s\"\n\
         [metrics]\nmax_job_series = {SERIES}\n"
    ));
    let state = agent.home.path().join("state");
    let mut c = agent.client().await;
    // The victim: a running job of root's, with its series and journal.
    c.register_rank(register("victim", std::process::id()))
        .await
        .expect("the victim registers");
    eventually(WAIT, "the victim's series", async || {
        job_series(&agent).await.0.contains("victim").then_some(())
    })
    .await;
    let rss_before = rss_kib(agent.pid());

    let member = users::users().member.clone();
    let args = json!({
        "socket": agent.socket(),
        "cycles": 3000,
        "min_cycles": 10 * CAP + 6,
        "workers": 6,
        "budget_s": 35
    });
    let out = within(Duration::from_secs(240), "the cycles", async move {
        tokio::task::spawn_blocking(move || users::run_as(&member, "gates.cycles", &args))
            .await
            .expect("run the attack")
    })
    .await
    .result;
    let closed = out["closed"].as_u64().expect("closed");
    assert_eq!(out["errors"], json!([]), "{out}");
    assert!(
        closed >= 10 * CAP as u64,
        "{closed} cycles: too few to show the bound {out}"
    );

    // Bounded right after the flood, and while it ran (the cap on series
    // held: the excess was counted, not recorded).
    let (jobs, n, dropped) = job_series(&agent).await;
    assert!(n <= SERIES, "{n} job series (at most {SERIES})");
    assert!(dropped > 0.0, "the cap was reached and counted");
    assert!(jobs.contains("victim"), "{jobs:?}");
    // Within a flush: journals and ledger entries are the cap's, plus the
    // victim's.
    eventually(WAIT, "the journals pruned to the cap", async || {
        (journals(&state) <= CAP + 1).then_some(())
    })
    .await;
    let ledger: Vec<String> = c
        .get_goodput(pb::GetGoodputRequest::default())
        .await
        .expect("GetGoodput")
        .into_inner()
        .jobs
        .into_iter()
        .map(|j| j.job_id)
        .collect();
    assert!(
        ledger.len() <= CAP + 1,
        "{} jobs in the ledger",
        ledger.len()
    );
    assert!(ledger.iter().any(|j| j == "victim"), "{ledger:?}");
    // After series_after_end, only the running job has series.
    let (jobs, n, _) = eventually(WAIT, "the ended jobs' series removed", async || {
        let s = job_series(&agent).await;
        (s.0.len() == 1).then_some(s)
    })
    .await;
    assert_eq!(jobs, BTreeSet::from(["victim".to_owned()]), "{n} series");
    assert!(n >= 13, "the victim's series stay: {n}");
    let rss_after = rss_kib(agent.pid());
    eprintln!("agent RSS: {rss_before} KiB before, {rss_after} KiB after {closed} cycles");
}

// ---------------------------------------------------------------- claims

/// As the member: register (and deregister) a rank in `args.jobs` new jobs
/// without closing any; then close the first and claim one more.
pub fn attack_claims(args: &Value) -> Value {
    block_on(async {
        let mut c = client(args).await;
        let jobs = number(args, "jobs");
        let mut refused = Vec::new();
        for i in 0..jobs {
            let job = format!("claim-{i}");
            match c.register_rank(register(&job, std::process::id())).await {
                Ok(r) => {
                    c.deregister_rank(pb::DeregisterRankRequest {
                        job_id: job,
                        global_rank: 0,
                        generation: r.into_inner().generation,
                    })
                    .await
                    .expect("deregister");
                }
                Err(e) => refused.push(json!({"job": i, "code": format!("{:?}", e.code()),
                                              "message": e.message()})),
            }
        }
        let close = call_result(
            c.close_goodput(pb::CloseGoodputRequest {
                job_id: "claim-0".into(),
            })
            .await,
            |_| json!({}),
        );
        let after = call_result(
            c.register_rank(register("claim-after-close", std::process::id()))
                .await,
            |_| json!({}),
        );
        json!({"refused": refused, "close": close, "after": after})
    })
}

/// Quotas, claims: one uid owns at most 256 jobs at once (docs/security.md);
/// the 257th is refused saying so, and closing one frees a place.
#[tokio::test(flavor = "multi_thread")]
async fn a_uid_owns_at_most_256_jobs() {
    let agent = TestAgent::start_shared("");
    let member = users::users().member.clone();
    let args = json!({"socket": agent.socket(), "jobs": 258});
    let out = within(WAIT * 6, "the claims", async move {
        tokio::task::spawn_blocking(move || users::run_as(&member, "gates.claims", &args))
            .await
            .expect("run the attack")
    })
    .await
    .result;
    let refused = out["refused"].as_array().expect("refused");
    assert_eq!(refused.len(), 2, "jobs 256 and 257: {out}");
    for r in refused {
        assert!(r["job"].as_u64().unwrap() >= 256, "{out}");
        assert_eq!(r["code"], "ResourceExhausted", "{out}");
        assert!(
            r["message"]
                .as_str()
                .unwrap()
                .contains("already owns 256 jobs"),
            "{out}"
        );
    }
    assert_eq!(out["close"]["ok"], true, "{out}");
    assert_eq!(
        out["after"]["ok"], true,
        "a closed job frees a place: {out}"
    );
}
