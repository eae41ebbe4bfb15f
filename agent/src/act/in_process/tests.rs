//! The glue's tests against a real agent state: real registrations and
//! slots, child processes frozen with SIGSTOP, the events on the bus and
//! the escalations the attribution task would receive.
//!
//! In: an `AgentState` of a temporary directory. Out: assertions on the
//! slots, streams, events and escalations. Never: a stand-in for the
//! registry or the bus.

use std::sync::Arc;
use std::time::{Duration, Instant};

use warden_core::policy::{Action, Replacement};
use warden_slot::ControlWord;

use super::*;
use crate::config::Config;
use crate::ranks::registry::{RegisterRequest, Registration};
use crate::state::AgentState;

fn agent(timeout: Duration) -> (tempfile::TempDir, Arc<AgentState>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::default();
    cfg.api.socket = dir.path().join("w.sock").display().to_string();
    cfg.agent.state_dir = dir.path().join("state").display().to_string();
    cfg.restart.in_process_timeout = timeout;
    let state = Arc::new(AgentState::new(cfg, "test".into()).unwrap());
    (dir, state)
}

fn register(state: &AgentState, job: &str, rank: u32) -> Registration {
    let reg = state
        .registry()
        .register(&RegisterRequest::for_test(job, rank, 4), 0)
        .unwrap();
    // The client echoes its generation once it maps the slot.
    state
        .registry()
        .slots()
        .slot(reg.slot_index)
        .unwrap()
        .attach_writer(reg.generation, std::process::id());
    reg
}

fn key(job: &str, rank: u32) -> RankKey {
    RankKey {
        job: job.into(),
        rank,
    }
}

async fn event(state: &AgentState, kind: &str) -> Arc<warden_core::events::Event> {
    event_about(state, kind, "").await
}

/// The first event of `kind` about `subject` ("": any).
async fn event_about(
    state: &AgentState,
    kind: &str,
    subject: &str,
) -> Arc<warden_core::events::Event> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (events, _) = state.events.list(0, 0);
        if let Some(e) = events
            .into_iter()
            .find(|e| e.kind == kind && (subject.is_empty() || e.subject == subject))
        {
            return e;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {kind} event: {:?}",
            state.events.list(0, 0).0
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// No event of `kind` is in the agent's ring.
fn never_published(state: &AgentState, kind: &str) -> bool {
    published(state, kind) == 0
}

/// How many events of `kind` are in the agent's ring.
fn published(state: &AgentState, kind: &str) -> usize {
    state
        .events
        .list(0, 0)
        .0
        .iter()
        .filter(|e| e.kind == kind)
        .count()
}

fn evidence<'a>(e: &'a warden_core::events::Event, k: &str) -> &'a str {
    e.evidence
        .iter()
        .find(|(key, _)| key == k)
        .map_or("", |(_, v)| v.as_str())
}

#[tokio::test]
async fn every_rank_is_asked_through_slot_and_stream_and_both_acks_count() {
    let (_dir, state) = agent(Duration::from_secs(30));
    let r0 = register(&state, "j", 0);
    let r1 = register(&state, "j", 1);
    register(&state, "other", 0);
    let mut rx1 = subscribe(&state.in_process(), &key("j", 1), r1.generation).unwrap();
    assert!(rx1.borrow_and_update().is_none());

    let asked = request(&state.in_process(), "j", "drill", "").unwrap();
    assert_eq!((asked.ranks.clone(), asked.restart_count), (vec![0, 1], 1));
    assert!(!asked.joined);
    // The slot holds the request, for ranks of the job only.
    let word = |slot| state.registry().slots().snapshot(slot).unwrap().control;
    let want = ControlWord::restart(asked.seq as u32, 1);
    assert_eq!(ControlWord::decode(word(r0.slot_index)), Some(want));
    assert_eq!(ControlWord::decode(word(r1.slot_index)), Some(want));
    // The stream too, addressed to the registration in force.
    rx1.changed().await.unwrap();
    let msg = rx1.borrow_and_update().clone().unwrap();
    assert_eq!(
        (msg.generation, msg.request.seq),
        (r1.generation, asked.seq)
    );
    assert_eq!(msg.request.reason, "drill");
    // Asked again while in flight: joined, nobody asked twice.
    let again = request(&state.in_process(), "j", "again", "").unwrap();
    assert!(again.joined);
    assert_eq!(again.seq, asked.seq);

    // Rank 1 by AckControl (a stale generation is refused), rank 0 by
    // its slot's ack word.
    assert!(matches!(
        ack(
            &state.in_process(),
            &key("j", 1),
            r1.generation + 1,
            asked.seq
        ),
        Err(ControlError::StaleGeneration { .. })
    ));
    assert!(
        !ack(
            &state.in_process(),
            &key("j", 1),
            r1.generation,
            asked.seq + 7
        )
        .unwrap()
    );
    assert!(ack(&state.in_process(), &key("j", 1), r1.generation, asked.seq).unwrap());
    assert!(rx1.borrow().is_none(), "off the stream once acknowledged");
    state
        .registry()
        .slots()
        .writer(r0.slot_index)
        .unwrap()
        .ack(asked.seq);
    let done = event(&state, "restart.acknowledged").await;
    assert_eq!(evidence(&done, "acknowledged"), "0,1");
    assert!(
        evidence(&done, "latency.rank.0").ends_with("(slot)"),
        "{done:?}"
    );
    assert!(
        evidence(&done, "latency.rank.1").ends_with("(rpc)"),
        "{done:?}"
    );

    // The next request is new: count 2, another sequence number.
    let next = request(&state.in_process(), "j", "", "").unwrap();
    assert_eq!(next.restart_count, 2);
    assert_ne!(next.seq, asked.seq);
}

#[tokio::test]
async fn silence_escalates_the_incident_and_a_rank_that_leaves_is_handled() {
    let (_dir, state) = agent(Duration::from_millis(200));
    let mut escalations = state.take_escalations().unwrap();
    let r0 = register(&state, "j", 0);
    let r1 = register(&state, "j", 1);
    let asked = request(&state.in_process(), "j", "hang", "inc-7").unwrap();
    // Rank 1 leaves: handled by its launcher. Rank 0 stays silent.
    assert!(state.registry().deregister(&key("j", 1), r1.generation));
    let timeout = event(&state, "restart.in_process_timeout").await;
    assert_eq!(evidence(&timeout, "unacknowledged"), "0");
    assert_eq!(evidence(&timeout, "escalated_to"), "restart_in_job");
    let e = escalations.recv().await.unwrap();
    assert_eq!(
        (e.incident.as_str(), e.action),
        ("inc-7", Action::RestartInJob)
    );
    assert!(e.reason.contains("did not acknowledge"), "{}", e.reason);
    // Over: a late acknowledgement is accepted and ignored.
    assert!(!ack(&state.in_process(), &key("j", 0), r0.generation, asked.seq).unwrap());
    assert!(never_published(&state, "restart.acknowledged"));
}

/// A launcher's heal asks by hand (no incident); the hang the agent then
/// finds joins it. A rank that can never answer (blocked in a gloo
/// collective) must still end in an escalation: before, the timeout
/// escalated nothing and the job waited for the collective's timeout.
#[tokio::test]
async fn an_incident_that_joins_a_request_asked_by_hand_is_escalated_at_its_timeout() {
    let (_dir, state) = agent(Duration::from_millis(300));
    let mut escalations = state.take_escalations().unwrap();
    let _r0 = register(&state, "j", 0);
    let r1 = register(&state, "j", 1);
    let asked = request(&state.in_process(), "j", "heal of rank 2", "").unwrap();
    let joined = request(&state.in_process(), "j", "hang", "inc-9").unwrap();
    assert!(joined.joined);
    assert_eq!(joined.seq, asked.seq);
    // A later incident does not take it over from the first.
    let again = request(&state.in_process(), "j", "hang", "inc-10").unwrap();
    assert!(again.joined);
    assert!(ack(&state.in_process(), &key("j", 1), r1.generation, asked.seq).unwrap());
    let timeout = event(&state, "restart.in_process_timeout").await;
    assert_eq!(evidence(&timeout, "unacknowledged"), "0");
    assert_eq!(evidence(&timeout, "incident"), "inc-9");
    assert_eq!(evidence(&timeout, "escalated_to"), "restart_in_job");
    let e = escalations.recv().await.unwrap();
    assert_eq!(
        (e.incident.as_str(), e.action),
        ("inc-9", Action::RestartInJob)
    );
}

#[tokio::test]
async fn nothing_to_restart_is_said() {
    let (_dir, state) = agent(Duration::from_secs(1));
    assert!(matches!(
        request(&state.in_process(), "nobody", "", ""),
        Err(RestartError::NoLiveRanks { .. })
    ));
    assert!(matches!(
        request(&state.in_process(), "", "", ""),
        Err(RestartError::EmptyJob)
    ));
    assert!(matches!(
        subscribe(&state.in_process(), &key("nobody", 0), 1),
        Err(ControlError::UnknownRank { .. })
    ));
}

/// A child process (`sleep`) registered as rank `rank` of `job`, held by
/// its process handle as the API holds a client's; killed on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn register_child(
    state: &AgentState,
    job: &str,
    (rank, world): (u32, u32),
) -> (Child, Registration) {
    let child = Child(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let uid = nix::unistd::getuid().as_raw();
    let process = crate::ranks::process::RankProcess::verify(pid, std::process::id(), uid).unwrap();
    let mut req = RegisterRequest::for_test(job, rank, world);
    req.pid = pid;
    req.declared_pid = pid;
    req.process = Some(process);
    let reg = state.registry().register(&req, 0).unwrap();
    state
        .registry()
        .slots()
        .slot(reg.slot_index)
        .unwrap()
        .attach_writer(reg.generation, pid);
    (child, reg)
}

fn signal(child: &Child, sig: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.0.id()).unwrap());
    nix::sys::signal::kill(pid, sig).unwrap();
}

/// A rank frozen with SIGSTOP is handed to its launcher at once (well
/// before the timeout), its peer keeps its in-process restart, and the
/// launcher's StopRanks for the frozen rank alone ends the request.
#[tokio::test]
async fn a_stopped_rank_is_replaced_at_once_and_the_others_restart_in_process() {
    let (_dir, state) = agent(Duration::from_secs(30));
    let mut escalations = state.take_escalations().unwrap();
    let r0 = register(&state, "j", 0);
    let (frozen, _r1) = register_child(&state, "j", (1, 4));
    signal(&frozen, nix::sys::signal::Signal::SIGSTOP);
    let t0 = Instant::now();
    let asked = request(&state.in_process(), "j", "hang", "inc-3").unwrap();
    assert_eq!(asked.ranks, vec![0, 1]);
    let e = escalations.recv().await.unwrap();
    let waited = t0.elapsed();
    assert!(waited >= STOPPED_FOR, "replaced after {waited:?}");
    assert!(
        waited < Duration::from_secs(10),
        "replaced after {waited:?}"
    );
    assert_eq!(
        (e.incident.as_str(), e.action),
        ("inc-3", Action::RestartInProcess)
    );
    assert_eq!(
        e.replace,
        Some(Replacement {
            ranks: vec![1],
            restart_count: asked.restart_count
        })
    );
    assert!(e.reason.contains("rank 1 stopped"), "{}", e.reason);
    let ev = event(&state, "restart.replace_ranks").await;
    assert_eq!(evidence(&ev, "ranks"), "1");
    assert_eq!(evidence(&ev, "carried"), "true");
    // Rank 0 answers; the launcher stops rank 1 alone (StopRanks).
    assert!(ack(&state.in_process(), &key("j", 0), r0.generation, asked.seq).unwrap());
    let stop = warden_core::signal::StopReason {
        kind: warden_core::signal::StopKind::Restart,
        why: "replacing rank 1".into(),
    };
    assert_eq!(state.registry().mark_stopping("j", &[1], &stop), vec![1]);
    let done = event(&state, "restart.acknowledged").await;
    assert_eq!(evidence(&done, "acknowledged"), "0");
    assert_eq!(evidence(&done, "gone"), "1 (replaced by its launcher)");
    // Asked once only.
    assert!(escalations.try_recv().is_err());
    assert!(never_published(&state, "restart.in_process_timeout"));
}

/// A rank that merely stays silent is not replaced; nor is a job whose
/// every rank is stopped (suspended as a whole): both wait for the
/// timeout and escalate to `restart_in_job`, as before. A job's only
/// local rank, with peers on other hosts, is replaced; and with no
/// incident (asked by hand) the replacement is said, not escalated.
#[tokio::test]
async fn a_silent_rank_or_a_job_stopped_as_a_whole_waits_for_the_timeout() {
    let (_dir, state) = agent(Duration::from_millis(800));
    let mut escalations = state.take_escalations().unwrap();
    let (_running, _) = register_child(&state, "run", (0, 2));
    let (frozen, _) = register_child(&state, "all", (0, 2));
    let (frozen2, _) = register_child(&state, "all", (1, 2));
    let (alone, _) = register_child(&state, "hosts", (3, 8));
    let (by_hand, _) = register_child(&state, "hand", (1, 8));
    for c in [&frozen, &frozen2, &alone, &by_hand] {
        signal(c, nix::sys::signal::Signal::SIGSTOP);
    }
    request(&state.in_process(), "hosts", "hang", "inc-h").unwrap();
    let e = escalations.recv().await.unwrap();
    assert_eq!(e.incident, "inc-h");
    assert_eq!(e.replace.map(|r| r.ranks), Some(vec![3]));
    request(&state.in_process(), "hand", "drill", "").unwrap();
    let by_hand_event = event_about(&state, "restart.replace_ranks", "job/hand").await;
    assert_eq!(evidence(&by_hand_event, "carried"), "false");
    request(&state.in_process(), "run", "hang", "inc-r").unwrap();
    request(&state.in_process(), "all", "hang", "inc-a").unwrap();
    // At the timeout: the silent rank, the suspended job, and the
    // hosts' job whose replacement no launcher carried out.
    let mut got = Vec::new();
    for _ in 0..3 {
        let e = escalations.recv().await.unwrap();
        assert_eq!(e.action, Action::RestartInJob, "{e:?}");
        assert!(e.replace.is_none(), "{e:?}");
        got.push(e.incident);
    }
    got.sort();
    assert_eq!(got, vec!["inc-a", "inc-h", "inc-r"]);
    // Neither of these two was replaced; only the hosts' job and the
    // one asked by hand were said to be.
    let replaced: Vec<String> = state
        .events
        .list(0, 0)
        .0
        .iter()
        .filter(|e| e.kind == "restart.replace_ranks")
        .map(|e| e.subject.clone())
        .collect();
    assert_eq!(replaced.len(), 2, "{replaced:?}");
    assert!(
        replaced.iter().all(|s| s == "job/hosts" || s == "job/hand"),
        "{replaced:?}"
    );
    assert!(escalations.try_recv().is_err());
}

/// The timeout as configured by default (30 s), in tokio's paused time:
/// a silent rank is waited for the whole timeout and not a tick longer,
/// without the test taking 30 s.
#[tokio::test(start_paused = true)]
async fn silence_is_waited_for_exactly_the_timeout() {
    let (_dir, state) = agent(Duration::from_secs(30));
    let mut escalations = state.take_escalations().unwrap();
    register(&state, "j", 0);
    let t0 = tokio::time::Instant::now();
    request(&state.in_process(), "j", "hang", "inc-9").unwrap();
    let e = escalations.recv().await.unwrap();
    let waited = t0.elapsed();
    assert_eq!(e.incident, "inc-9");
    assert!(
        waited >= Duration::from_secs(30) && waited < Duration::from_secs(30) + ACK_POLL * 2,
        "escalated after {waited:?}, the timeout is 30 s"
    );
    let timeout = event(&state, "restart.in_process_timeout").await;
    assert_eq!(evidence(&timeout, "unacknowledged"), "0");
}

/// A record of `job` deciding `restart_in_process` about rank 1, its one
/// piece of evidence seen at `at`.
fn decided(job: &str, at: std::time::SystemTime) -> warden_core::attribute::IncidentRecord {
    use warden_core::attribute::{Diagnosis, Evidence, FaultClass, IncidentKind, IncidentRecord};
    IncidentRecord {
        id: "inc-5".into(),
        opened_at: at,
        updated_at: at,
        kind: IncidentKind::Crash,
        host: "test".into(),
        job: job.into(),
        ranks: vec![1],
        devices: Vec::new(),
        diagnosis: Diagnosis {
            class: FaultClass::TransientSoftware,
            confidence: 0.6,
            summary: "rank 1 left blocked in a collective".into(),
            rule: "test".into(),
            evidence: vec![Evidence {
                at,
                source: "rank".into(),
                signal: "exit.code".into(),
                subject: format!("job/{job}/rank/1"),
                value: "75".into(),
                points_to: None,
                weight: 0.5,
                note: String::new(),
                event_id: 0,
            }],
        },
        decision: None,
        superseded: Vec::new(),
        signature: String::new(),
        step: None,
        exit_code: Some(75),
        waited_on: Vec::new(),
    }
}

/// A launcher heals a rank's exit at once (RequestRestart, the rank
/// started again) while the agent's diagnosis of the same exit settles.
/// The diagnosis's `restart_in_process` comes after that restart was
/// answered: asking again would restart the healed ranks into another
/// attempt than the replacement's (the job hung, issue 31). It is said,
/// not asked; a decision about newer evidence is asked as before.
#[tokio::test]
async fn a_decision_a_restart_asked_after_its_evidence_already_carried_out_is_not_asked_again() {
    let (_dir, state) = agent(Duration::from_secs(30));
    let r0 = register(&state, "j", 0);
    let r1 = register(&state, "j", 1);
    let exit_seen = std::time::SystemTime::now() - Duration::from_millis(50);
    let healed = request(&state.in_process(), "j", "heal of rank 2", "").unwrap();
    for (rank, r) in [(0, &r0), (1, &r1)] {
        assert!(
            ack(
                &state.in_process(),
                &key("j", rank),
                r.generation,
                healed.seq
            )
            .unwrap()
        );
    }
    event(&state, "restart.acknowledged").await;

    start(&state.in_process(), &decided("j", exit_seen));
    let said = event(&state, "restart.already_done").await;
    assert_eq!(evidence(&said, "incident"), "inc-5");
    assert!(
        said.message.contains("asked") && said.message.contains("every rank answered it"),
        "{said:?}"
    );
    // Nothing was asked: the next request is the job's second.
    assert_eq!(published(&state, "restart.requested"), 1);

    // Evidence newer than the last restart: asked.
    start(
        &state.in_process(),
        &decided("j", std::time::SystemTime::now() + Duration::from_millis(1)),
    );
    assert_eq!(published(&state, "restart.requested"), 2);
    let next = request(&state.in_process(), "j", "", "").unwrap();
    assert!(next.joined, "the decision's request is in flight");
    assert_eq!(next.restart_count, 2);
}

/// A host whose only rank of a job died, its replicas on other hosts: its
/// launcher heals it and asks with `replacing` (issue 31, two faults in a
/// row across hosts). No rank lives here to ask: the restart is recorded
/// (the count advances), not refused, and the agent's own decision about
/// the crash, which would find no rank and escalate to a restart in job of
/// a heal under way, is said to be done already. A request that is not
/// `replacing` is still refused.
#[tokio::test]
async fn a_launcher_replacing_a_hosts_only_rank_records_the_restart_and_the_decision_is_done() {
    let (_dir, state) = agent(Duration::from_secs(30));
    let exit_seen = std::time::SystemTime::now() - Duration::from_millis(50);
    assert!(matches!(
        request(&state.in_process(), "j", "", ""),
        Err(RestartError::NoLiveRanks { .. })
    ));
    let asked = request_replacing(&state.in_process(), "j", "heal of rank 0", "").unwrap();
    assert_eq!(
        (asked.ranks.clone(), asked.restart_count, asked.joined),
        (Vec::new(), 1, false)
    );
    start(&state.in_process(), &decided("j", exit_seen));
    let said = event(&state, "restart.already_done").await;
    assert!(said.message.contains("asked"), "{said:?}");
    assert_eq!(published(&state, "restart.requested"), 0);
    let again = request_replacing(&state.in_process(), "j", "heal again", "").unwrap();
    assert_eq!(again.restart_count, 2, "the count only grows");
}

/// The case of a frozen replacement during a heal (issue 31): the agent's
/// restart is in flight when a survivor blocked in a collective leaves
/// (exit 75); its launcher heals it within that restart (its request
/// joins). The diagnosis of that exit, newer than the request, comes once
/// every rank answered: the rank that left answered it after its exit, so
/// it is not asked again. A rank that answered before the evidence is.
#[tokio::test]
async fn a_decision_about_a_rank_that_left_during_the_last_restart_is_not_asked_again() {
    let (_dir, state) = agent(Duration::from_secs(30));
    let r0 = register(&state, "j", 0);
    let r1 = register(&state, "j", 1);
    let asked = request(&state.in_process(), "j", "hang", "inc-4").unwrap();
    assert!(ack(&state.in_process(), &key("j", 0), r0.generation, asked.seq).unwrap());
    let before_exit = std::time::SystemTime::now();
    let exit_seen = before_exit + Duration::from_millis(1);
    while std::time::SystemTime::now() <= exit_seen {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Rank 1 leaves: handled by its launcher; the request is answered.
    assert!(state.registry().deregister(&key("j", 1), r1.generation));
    event(&state, "restart.acknowledged").await;

    start(&state.in_process(), &decided("j", exit_seen));
    let said = event(&state, "restart.already_done").await;
    assert!(said.message.contains("ranks 1 answered"), "{said:?}");
    assert_eq!(published(&state, "restart.requested"), 1);

    // About rank 0, which acknowledged before that evidence: asked.
    let mut about_0 = decided("j", exit_seen);
    about_0.ranks = vec![0];
    start(&state.in_process(), &about_0);
    assert_eq!(published(&state, "restart.requested"), 2);
}

/// A rank that already took the request in flight and then reports a
/// transient exception (its new attempt failed while the job's other ranks
/// still tear down the old one) is told to leave at once: joining would
/// answer with the request it took, and it would wait for it in vain.
#[tokio::test]
async fn an_exception_from_a_rank_that_took_the_request_in_flight_is_not_joined_to_it() {
    let (_dir, state) = agent(Duration::from_secs(30));
    let r0 = register(&state, "j", 0);
    register(&state, "j", 1);
    let asked = request(&state.in_process(), "j", "drill", "").unwrap();
    // A collective time-out, a transient class, as rank `r` reports it.
    let timed_out = |r: u32| {
        exception::decide(
            &state.in_process(),
            &state.config.policy,
            &key("j", r),
            "RuntimeError",
            "watchdog caught collective operation timeout",
        )
    };
    let joins = |a: &exception::ExceptionAnswer| matches!(a, exception::ExceptionAnswer::Restart { seq, .. } if *seq == asked.seq);
    // Before rank 0 took it: its exception joins the request in flight.
    let joined = timed_out(0);
    assert!(joins(&joined), "{joined:?}");
    // Rank 0 takes it; rank 1 has not yet.
    assert!(ack(&state.in_process(), &key("j", 0), r0.generation, asked.seq).unwrap());
    match timed_out(0) {
        exception::ExceptionAnswer::Stop { reason, .. } => assert!(
            reason.contains(&format!(
                "after it took in-process restart request {}",
                asked.seq
            )),
            "{reason}"
        ),
        other => panic!("rank 0 was answered {other:?}"),
    }
    // Rank 1, still asked, joins as before.
    let one = timed_out(1);
    assert!(joins(&one), "{one:?}");
}
