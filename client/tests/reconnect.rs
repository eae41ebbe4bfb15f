//! The client against an in-process stand-in agent on a temp Unix socket:
//! registration, the slot the agent reads, loss of the agent, and
//! re-registration carrying the training state over, and in-process
//! restart requests (the `Control` stream, the slot's control word, the
//! acknowledgement).

// Test helpers outside #[test] functions may unwrap too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use warden_client::slot::{ControlWord, SECTION_FORWARD, SECTION_STEP, SlotSnapshot, SlotTable};
use warden_client::{Client, ConnectOptions, ExceptionReport, ReportError, RestartVia};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_server::{Agent, AgentServer};

/// Just enough of an agent: hands out slots and records what it was told.
struct FakeAgent {
    slots: Arc<SlotTable>,
    next_generation: AtomicU64,
    registered: Arc<Mutex<Vec<pb::RegisterRankRequest>>>,
    deregistered: Arc<Mutex<Vec<pb::DeregisterRankRequest>>>,
    exceptions: Arc<Mutex<Vec<pb::ReportExceptionRequest>>>,
    /// How long ReportException takes to answer (an agent that stalls).
    report_delay: Duration,
    /// What the Control streams push.
    control: tokio::sync::broadcast::Sender<pb::ControlMessage>,
    control_opened: Arc<Mutex<Vec<pb::ControlRequest>>>,
    acks: Arc<Mutex<Vec<pb::AckControlRequest>>>,
}

type Stream<T> = tokio_stream::Empty<Result<T, Status>>;

#[tonic::async_trait]
impl Agent for FakeAgent {
    async fn get_node_health(
        &self,
        _: Request<pb::GetNodeHealthRequest>,
    ) -> Result<Response<pb::NodeHealth>, Status> {
        Err(Status::unimplemented("fake"))
    }
    type WatchHealthStream = Stream<pb::NodeHealth>;
    async fn watch_health(
        &self,
        _: Request<pb::WatchHealthRequest>,
    ) -> Result<Response<Self::WatchHealthStream>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn list_events(
        &self,
        _: Request<pb::ListEventsRequest>,
    ) -> Result<Response<pb::ListEventsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    type WatchEventsStream = Stream<pb::Event>;
    async fn watch_events(
        &self,
        _: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_agent_info(
        &self,
        _: Request<pb::GetAgentInfoRequest>,
    ) -> Result<Response<pb::AgentInfo>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn register_rank(
        &self,
        req: Request<pb::RegisterRankRequest>,
    ) -> Result<Response<pb::RegisterRankResponse>, Status> {
        let req = req.into_inner();
        let index = req
            .previous_slot
            .filter(|&i| i < self.slots.slot_count())
            .unwrap_or(0);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        self.slots
            .claim(index, generation, req.pid)
            .map_err(|e| Status::internal(e.to_string()))?;
        self.registered.lock().unwrap().push(req);
        Ok(Response::new(pb::RegisterRankResponse {
            slot_index: index,
            slot_size: warden_client::slot::SLOT_SIZE as u32,
            generation,
            ..Default::default()
        }))
    }
    async fn deregister_rank(
        &self,
        req: Request<pb::DeregisterRankRequest>,
    ) -> Result<Response<pb::DeregisterRankResponse>, Status> {
        self.deregistered.lock().unwrap().push(req.into_inner());
        Ok(Response::new(pb::DeregisterRankResponse {}))
    }
    async fn get_ranks(
        &self,
        _: Request<pb::GetRanksRequest>,
    ) -> Result<Response<pb::GetRanksResponse>, Status> {
        Ok(Response::new(pb::GetRanksResponse::default()))
    }
    async fn report_exception(
        &self,
        req: Request<pb::ReportExceptionRequest>,
    ) -> Result<Response<pb::ReportExceptionResponse>, Status> {
        tokio::time::sleep(self.report_delay).await;
        self.exceptions.lock().unwrap().push(req.into_inner());
        Ok(Response::new(pb::ReportExceptionResponse::default()))
    }
    async fn get_incidents(
        &self,
        _: Request<pb::GetIncidentsRequest>,
    ) -> Result<Response<pb::GetIncidentsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn uncordon(
        &self,
        _: Request<pb::UncordonRequest>,
    ) -> Result<Response<pb::UncordonResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_stragglers(
        &self,
        _: Request<pb::GetStragglersRequest>,
    ) -> Result<Response<pb::GetStragglersResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn begin_shard(
        &self,
        _: Request<pb::BeginShardRequest>,
    ) -> Result<Response<pb::BeginShardResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn commit_shard(
        &self,
        _: Request<pb::CommitShardRequest>,
    ) -> Result<Response<pb::CommitShardResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn restore(
        &self,
        _: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn list_checkpoints(
        &self,
        _: Request<pb::ListCheckpointsRequest>,
    ) -> Result<Response<pb::ListCheckpointsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn set_checkpoint_peers(
        &self,
        _: Request<pb::SetCheckpointPeersRequest>,
    ) -> Result<Response<pb::SetCheckpointPeersResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_goodput(
        &self,
        _: Request<pb::GetGoodputRequest>,
    ) -> Result<Response<pb::GetGoodputResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn close_goodput(
        &self,
        _: Request<pb::CloseGoodputRequest>,
    ) -> Result<Response<pb::GetGoodputResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn claim_job(
        &self,
        _: Request<pb::ClaimJobRequest>,
    ) -> Result<Response<pb::ClaimJobResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn release_job(
        &self,
        _: Request<pb::ReleaseJobRequest>,
    ) -> Result<Response<pb::ReleaseJobResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    type WatchIncidentsStream = tokio_stream::Empty<Result<pb::Incident, Status>>;
    async fn watch_incidents(
        &self,
        _: Request<pb::WatchIncidentsRequest>,
    ) -> Result<Response<Self::WatchIncidentsStream>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn stop_ranks(
        &self,
        _: Request<pb::StopRanksRequest>,
    ) -> Result<Response<pb::StopRanksResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn report_job_stop(
        &self,
        _: Request<pb::ReportJobStopRequest>,
    ) -> Result<Response<pb::ReportJobStopResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn request_restart(
        &self,
        _: Request<pb::RequestRestartRequest>,
    ) -> Result<Response<pb::RequestRestartResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn run_health_gate(
        &self,
        _: Request<pb::RunHealthGateRequest>,
    ) -> Result<Response<pb::HealthGateResult>, Status> {
        Err(Status::unimplemented("fake"))
    }
    type ControlStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::ControlMessage, Status>> + Send>,
    >;
    async fn control(
        &self,
        req: Request<pb::ControlRequest>,
    ) -> Result<Response<Self::ControlStream>, Status> {
        use tokio_stream::StreamExt;
        let rx = self.control.subscribe();
        self.control_opened.lock().unwrap().push(req.into_inner());
        let stream =
            tokio_stream::wrappers::BroadcastStream::new(rx).filter_map(|m| m.ok().map(Ok));
        Ok(Response::new(Box::pin(stream)))
    }
    async fn ack_control(
        &self,
        req: Request<pb::AckControlRequest>,
    ) -> Result<Response<pb::AckControlResponse>, Status> {
        self.acks.lock().unwrap().push(req.into_inner());
        Ok(Response::new(pb::AckControlResponse {}))
    }
}

/// A running fake agent; stops (and stops answering) when dropped.
struct Running {
    slots: Arc<SlotTable>,
    registered: Arc<Mutex<Vec<pb::RegisterRankRequest>>>,
    deregistered: Arc<Mutex<Vec<pb::DeregisterRankRequest>>>,
    exceptions: Arc<Mutex<Vec<pb::ReportExceptionRequest>>>,
    control: tokio::sync::broadcast::Sender<pb::ControlMessage>,
    control_opened: Arc<Mutex<Vec<pb::ControlRequest>>>,
    acks: Arc<Mutex<Vec<pb::AckControlRequest>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    fn start(dir: &Path, first_generation: u64) -> Running {
        Self::start_with_report_delay(dir, first_generation, Duration::ZERO)
    }

    fn start_with_report_delay(dir: &Path, first_generation: u64, delay: Duration) -> Running {
        let socket = dir.join("wardend.sock");
        let _ = std::fs::remove_file(&socket);
        let slots = Arc::new(SlotTable::new(4).unwrap());
        let slot_socket = warden_client::slot_socket::socket_path(&socket);
        let _ = std::fs::remove_file(&slot_socket);
        let handoff = slots.clone();
        let registered = Arc::new(Mutex::new(Vec::new()));
        let deregistered = Arc::new(Mutex::new(Vec::new()));
        let exceptions = Arc::new(Mutex::new(Vec::new()));
        let control = tokio::sync::broadcast::channel(16).0;
        let control_opened = Arc::new(Mutex::new(Vec::new()));
        let acks = Arc::new(Mutex::new(Vec::new()));
        let agent = FakeAgent {
            slots: slots.clone(),
            next_generation: AtomicU64::new(first_generation),
            registered: registered.clone(),
            deregistered: deregistered.clone(),
            exceptions: exceptions.clone(),
            report_delay: delay,
            control: control.clone(),
            control_opened: control_opened.clone(),
            acks: acks.clone(),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::UnixListener::bind(&socket).unwrap();
                let fds = std::os::unix::net::UnixListener::bind(&slot_socket).unwrap();
                // The slot socket, as the agent serves it, minus the peer
                // check: the memory of the slot carrying the generation asked for.
                std::thread::spawn(move || {
                    for conn in fds.incoming() {
                        let Ok(mut conn) = conn else { return };
                        let mut req = [0u8; warden_client::slot_socket::REQUEST_LEN];
                        if std::io::Read::read_exact(&mut conn, &mut req).is_err() {
                            continue;
                        }
                        let g = warden_client::slot_socket::decode_request(&req).unwrap();
                        let index = (0..handoff.slot_count())
                            .find(|&i| handoff.snapshot(i).unwrap().generation == g);
                        let fd = index.and_then(|i| handoff.memory(i)).map(|m| m.fd());
                        let _ = warden_client::slot_socket::send_reply(
                            std::os::fd::AsRawFd::as_raw_fd(&conn),
                            fd.ok_or("no such generation"),
                        );
                    }
                });
                ready_tx.send(()).unwrap();
                tonic::transport::Server::builder()
                    .add_service(AgentServer::new(agent))
                    .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
        });
        ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        Running {
            slots,
            registered,
            deregistered,
            exceptions,
            control,
            control_opened,
            acks,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        // The server's runtime (and every connection it holds) dies with the thread.
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn options(socket: PathBuf) -> ConnectOptions {
    ConnectOptions {
        socket_path: socket,
        job_id: "job-1".to_owned(),
        global_rank: 3,
        local_rank: 1,
        world_size: 8,
        connect_timeout: Duration::from_secs(10),
        probe_interval: Duration::from_millis(50),
        stack_dump_signal: 0,
        devices: vec!["gpu5".to_owned()],
        exception_report_timeout: Duration::from_secs(1),
    }
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn agent_view(agent: &Running, index: u32) -> SlotSnapshot {
    agent.slots.snapshot(index).unwrap()
}

#[test]
fn registers_and_the_agent_reads_the_slot() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start(dir.path(), 100);
    let client = Client::connect_with(options(dir.path().join("wardend.sock"))).unwrap();
    assert!(client.is_connected(), "{:?}", client.status());
    {
        let req = &agent.registered.lock().unwrap()[0];
        assert_eq!((req.job_id.as_str(), req.global_rank), ("job-1", 3));
        assert_eq!((req.local_rank, req.world_size), (1, 8));
        assert_eq!(req.pid, std::process::id());
        assert_eq!(req.slot_layout_version, warden_client::slot::LAYOUT_VERSION);
        assert_eq!(req.previous_slot, None);
        assert_eq!(req.devices, ["gpu5"]);
    }

    client.heartbeat();
    client.step_begin(5);
    let fwd = client.section("forward");
    let attn = client.section("attention");
    let s = agent_view(&agent, 0);
    assert!(s.writer_is_owner());
    assert_eq!(s.writer_pid, std::process::id());
    assert_eq!((s.step, s.step_open), (5, true));
    let open: Vec<&str> = s
        .open_sections
        .iter()
        .map(|o| s.section_name(o.id))
        .collect();
    assert_eq!(open, ["step", "forward", "attention"]);
    drop(attn);
    drop(fwd);
    client.step_end(5);
    let s = agent_view(&agent, 0);
    assert_eq!(s.steps_completed, 1);
    assert_eq!(s.recent_steps[0].sections[0].id, SECTION_FORWARD);

    client.close();
    assert!(!client.is_connected());
    assert_eq!(agent.deregistered.lock().unwrap()[0].generation, 100);
    // Still usable after close: writes go to the private slot.
    client.heartbeat();
    client.step_begin(6);
    assert_eq!(agent_view(&agent, 0).step, 5);
    assert_eq!(client.snapshot().unwrap().step, 6);
}

#[test]
fn survives_the_agent_going_away_and_coming_back() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("wardend.sock");
    let agent = Running::start(dir.path(), 1);
    let client = Client::connect_with(options(socket)).unwrap();
    assert!(client.is_connected(), "{:?}", client.status());
    client.step_begin(1);
    let fwd = client.section_id("forward");
    client.section_open(fwd);

    // The agent dies; its successor hands out fresh slot memory.
    drop(agent);
    eventually("client notices the agent is gone", || {
        !client.is_connected()
    });
    // Training goes on, unaware.
    client.section_close(fwd);
    client.step_end(1);
    client.step_begin(2);
    let user = client.section_id("my-phase");
    client.section_open(user);
    let local = client.snapshot().unwrap();
    assert_eq!((local.step, local.steps_completed), (2, 1));

    let agent = Running::start(dir.path(), 1000);
    eventually("client re-registers", || client.is_connected());
    let req = agent.registered.lock().unwrap()[0].clone();
    assert_eq!(req.previous_slot, Some(0));
    let s = agent_view(&agent, 0);
    assert!(s.writer_is_owner());
    assert_eq!(s.generation, 1000);
    assert_eq!((s.step, s.step_open, s.steps_completed), (2, true, 1));
    let open: Vec<u32> = s.open_sections.iter().map(|o| o.id).collect();
    assert_eq!(open, [SECTION_STEP, user.get()]);
    assert_eq!(s.section_name(user.get()), "my-phase");
    assert_eq!(s.recent_steps[0].step, 1);

    // Hot-path writes land in the new slot.
    client.section_close(user);
    client.step_end(2);
    assert_eq!(agent_view(&agent, 0).steps_completed, 2);
    assert_eq!(client.status().registrations, 2);
}

#[test]
fn no_agent_means_a_quick_disconnected_client() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path().join("nobody-here.sock"));
    opts.connect_timeout = Duration::from_secs(5);
    let t0 = Instant::now();
    let client = Client::connect_with(opts).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(!client.is_connected());
    assert!(
        client
            .status()
            .last_error
            .unwrap()
            .contains("nobody-here.sock")
    );
    client.heartbeat();
    client.step_begin(1);
    drop(client.section("forward"));
    client.step_end(1);
    assert_eq!(client.snapshot().unwrap().steps_completed, 1);
    let t0 = Instant::now();
    client.close();
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn invalid_options_are_the_only_error() {
    let mut o = options(PathBuf::from("/nonexistent"));
    o.world_size = 2;
    assert!(Client::connect_with(o.clone()).is_err());
    o.world_size = 8;
    o.job_id.clear();
    assert!(Client::connect_with(o).is_err());
}

#[test]
fn a_dead_agent_is_noticed_even_when_its_slot_memory_stays() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start(dir.path(), 1);
    let client = Client::connect_with(options(dir.path().join("wardend.sock"))).unwrap();
    assert!(client.is_connected());
    let slots = agent.slots.clone();
    drop(agent); // the memory stays; only the liveness probe (GetNodeHealth) can tell
    eventually("client notices the agent is gone", || {
        !client.is_connected()
    });
    client.step_begin(9);
    assert_eq!(
        slots.snapshot(0).unwrap().step,
        0,
        "no writes into a lost slot"
    );
}

#[test]
fn a_forked_child_never_writes_the_parents_slot() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start(dir.path(), 1);
    let client = Client::connect_with(options(dir.path().join("wardend.sock"))).unwrap();
    assert!(client.is_connected());
    client.step_begin(1);
    // SAFETY: the child only does atomic stores through the client and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let ok = !client.is_connected();
        client.step_begin(666);
        client.heartbeat();
        // SAFETY: _exit skips destructors (the parent owns the client).
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waiting for the child we just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert_eq!(status, 0, "child saw itself connected");
    assert_eq!(agent_view(&agent, 0).step, 1);
    assert!(client.is_connected());
}

fn oom(uncaught: bool) -> ExceptionReport {
    ExceptionReport {
        exception_type: "RuntimeError".to_owned(),
        message: "CUDA out of memory. Tried to allocate 2.00 GiB".to_owned(),
        traceback: "Traceback (most recent call last):\n  File \"train.py\", line 3, in forward\n"
            .to_owned(),
        step: None,
        uncaught,
    }
}

#[test]
fn an_exception_is_reported_as_this_registration_at_the_current_step() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start(dir.path(), 40);
    let client = Client::connect_with(options(dir.path().join("wardend.sock"))).unwrap();
    assert!(client.is_connected(), "{:?}", client.status());
    client.step_begin(3);
    client.report_exception(&oom(false)).unwrap();
    client.step_end(3);
    client
        .report_exception(&ExceptionReport {
            step: Some(11),
            ..oom(false)
        })
        .unwrap();
    {
        let got = agent.exceptions.lock().unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        let r = &got[0];
        assert_eq!((r.job_id.as_str(), r.global_rank), ("job-1", 3));
        assert_eq!((r.generation, r.pid), (40, std::process::id()));
        assert_eq!((r.step, r.uncaught), (3, false));
        assert_eq!(r.exception_type, "RuntimeError");
        assert_eq!(r.message, "CUDA out of memory. Tried to allocate 2.00 GiB");
        assert!(r.traceback.contains("in forward"), "{}", r.traceback);
        assert_eq!(got[1].step, 11);
    }
    // A caught exception changes nothing about a clean close.
    client.close();
    assert_eq!(agent.deregistered.lock().unwrap().len(), 1);
}

#[test]
fn after_an_uncaught_exception_close_leaves_the_exit_to_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start(dir.path(), 1);
    let client = Client::connect_with(options(dir.path().join("wardend.sock"))).unwrap();
    assert!(client.is_connected(), "{:?}", client.status());
    client.report_exception(&oom(true)).unwrap();
    assert!(agent.exceptions.lock().unwrap()[0].uncaught);
    let t0 = Instant::now();
    drop(client);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(
        agent.deregistered.lock().unwrap().is_empty(),
        "a dying rank must not deregister: the agent is to see its exit"
    );
}

#[test]
fn a_stalled_agent_costs_a_report_its_deadline_and_no_more() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start_with_report_delay(dir.path(), 1, Duration::from_secs(30));
    let mut opts = options(dir.path().join("wardend.sock"));
    opts.exception_report_timeout = Duration::from_millis(300);
    let client = Client::connect_with(opts).unwrap();
    assert!(client.is_connected(), "{:?}", client.status());
    let t0 = Instant::now();
    let r = client.report_exception(&oom(true));
    let took = t0.elapsed();
    assert!(matches!(r, Err(ReportError::TimedOut(_))), "{r:?}");
    assert!(took >= Duration::from_millis(250), "{took:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(agent.exceptions.lock().unwrap().is_empty());
}

#[test]
fn without_an_agent_a_report_returns_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let client = Client::connect_with(options(dir.path().join("nobody-here.sock"))).unwrap();
    assert!(!client.is_connected());
    let t0 = Instant::now();
    let r = client.report_exception(&oom(true));
    assert!(
        matches!(&r, Err(ReportError::NotRegistered(why)) if why.contains("nobody-here.sock")),
        "{r:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_millis(100),
        "{:?}",
        t0.elapsed()
    );
}

fn restart_message(seq: u64, count: u32, reason: &str) -> pb::ControlMessage {
    pb::ControlMessage {
        kind: pb::control_message::Kind::Restart as i32,
        seq,
        restart_count: count,
        incident_id: "inc-1".into(),
        reason: reason.into(),
        flight_recorder_path: String::new(),
    }
}

#[test]
fn a_restart_request_on_the_stream_reaches_the_callback_and_the_ack_goes_back() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start(dir.path(), 500);
    let client = Client::connect_with(options(dir.path().join("wardend.sock"))).unwrap();
    assert!(client.is_connected());
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    client.on_restart(move |r| {
        let _ = tx.lock().unwrap().send(r.clone());
    });
    eventually("the Control stream opened", || {
        !agent.control_opened.lock().unwrap().is_empty()
    });
    let opened = agent.control_opened.lock().unwrap()[0].clone();
    assert_eq!(
        (
            opened.job_id.as_str(),
            opened.global_rank,
            opened.generation
        ),
        ("job-1", 3, 500)
    );

    let sent = Instant::now();
    agent
        .control
        .send(restart_message(77, 1, "rank 0 hung"))
        .unwrap();
    let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert!(
        sent.elapsed() < Duration::from_secs(1),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(
        (
            got.seq,
            got.restart_count,
            got.reason.as_str(),
            got.incident_id.as_str()
        ),
        (77, 1, "rank 0 hung", "inc-1")
    );
    assert_eq!(got.via, RestartVia::Stream);
    assert_eq!(client.restart_pending().map(|r| r.seq), Some(77));
    // The same request again (the slot, a replay): not new.
    agent
        .control
        .send(restart_message(77, 1, "rank 0 hung"))
        .unwrap();
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());

    assert!(!client.ack_restart(76));
    assert!(client.ack_restart(77));
    assert!(client.restart_pending().is_none());
    let index = client.status().slot_index.unwrap();
    assert_eq!(agent.slots.ack_word(index).unwrap(), (77, 500));
    eventually("AckControl reached the agent", || {
        !agent.acks.lock().unwrap().is_empty()
    });
    let ack = agent.acks.lock().unwrap()[0].clone();
    assert_eq!(
        (
            ack.job_id.as_str(),
            ack.global_rank,
            ack.generation,
            ack.seq
        ),
        ("job-1", 3, 500, 77)
    );
}

#[test]
fn a_restart_request_in_the_slot_alone_is_seen_within_milliseconds() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Running::start(dir.path(), 900);
    let client = Client::connect_with(options(dir.path().join("wardend.sock"))).unwrap();
    assert!(client.is_connected());
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    client.on_restart(move |r| {
        let _ = tx.lock().unwrap().send((r.clone(), Instant::now()));
    });
    let index = client.status().slot_index.unwrap();
    let sent = Instant::now();
    agent
        .slots
        .set_control(index, ControlWord::restart(12, 2).encode())
        .unwrap();
    let (got, at) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert!(at - sent < Duration::from_millis(200), "{:?}", at - sent);
    assert_eq!(
        (got.seq, got.restart_count, got.via),
        (12, 2, RestartVia::Slot)
    );
    // The stream's copy fills in the reason without a second callback.
    eventually("the Control stream opened", || {
        !agent.control_opened.lock().unwrap().is_empty()
    });
    agent
        .control
        .send(restart_message(12, 2, "asked by hand"))
        .unwrap();
    eventually("the reason from the stream", || {
        client
            .restart_pending()
            .is_some_and(|r| r.reason == "asked by hand")
    });
    assert!(rx.try_recv().is_err());
    assert!(client.ack_restart(12));
    assert_eq!(agent.slots.ack_word(index).unwrap().0, 12);
}
