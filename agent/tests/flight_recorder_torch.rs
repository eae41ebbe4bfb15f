//! The flight-recorder request end to end, with real torch: the agent's API
//! served in process on a Unix socket (so the test can call
//! `hang::flight::request_dump`, which nothing outside the agent triggers
//! yet), two real gloo ranks (tests/fixtures/torch_flight_rank.py) with the
//! real `warden` package and its native client. Rank 0 waits in an
//! all_reduce rank 1 has not reached.
//!
//! 1. Each rank answers on its `Control` stream: the native client runs
//!    `warden._torch.dump_flight_recorder`, which writes torch's dump; the
//!    agent parses it, and `compare` names rank 1 behind rank 0's
//!    all_reduce.
//! 2. Rank 1 frozen with SIGSTOP never answers: that is the answer, "no
//!    flight-recorder dump within 2s".
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` (else the repository's
//! `.venv/bin/python`) with the current `warden` package; skips, saying
//! so, when torch is not importable and `WARDEN_REQUIRE_TORCH` is unset.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use warden_agent::api::AgentService;
use warden_agent::api::caller::LocalConn;
use warden_agent::config::Config;
use warden_agent::hang::flight::request_dump;
use warden_agent::ranks::RankKey;
use warden_agent::state::AgentState;
use warden_core::detect::flight_recorder::compare;
use warden_proto::v1::agent_server::AgentServer;

/// Importing torch takes seconds on a loaded 2-core machine.
const SLOW: Duration = Duration::from_secs(120);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the agent crate sits in the workspace")
        .to_owned()
}

/// The interpreter with torch and warden, or None (skipped) without torch.
fn python() -> Option<PathBuf> {
    let py = std::env::var_os("WARDEN_TEST_PYTHON")
        .filter(|p| !p.is_empty())
        .map_or_else(|| repo_root().join(".venv/bin/python"), PathBuf::from);
    let ok = Command::new(&py)
        .args([
            "-c",
            "import torch.distributed as d, warden; assert d.is_gloo_available()",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let required = std::env::var_os("WARDEN_REQUIRE_TORCH").is_some_and(|v| !v.is_empty());
        assert!(
            !required,
            "WARDEN_REQUIRE_TORCH is set but {} cannot import torch and warden",
            py.display()
        );
        eprintln!("SKIPPED: {} cannot import torch and warden", py.display());
        return None;
    }
    Some(py)
}

/// The agent's API on a Unix socket, in this process.
async fn serve(dir: &Path) -> (Arc<AgentState>, PathBuf) {
    let sock = dir.join("w.sock");
    let mut cfg = Config::default();
    cfg.api.socket = sock.display().to_string();
    cfg.agent.state_dir = dir.join("state").display().to_string();
    let state = Arc::new(AgentState::new(cfg, "test".into()).expect("agent state"));
    let uds = tokio::net::UnixListener::bind(&sock).expect("bind the API socket");
    let slot_path = warden_slot::socket::socket_path(&sock);
    let slots = warden_agent::api::slot_socket::bind(&slot_path, 0o660, None)
        .expect("bind the slot socket");
    tokio::spawn(warden_agent::api::slot_socket::serve(
        slots,
        slot_path,
        state.clone(),
    ));
    let incoming = UnixListenerStream::new(uds).map(|c| c.and_then(LocalConn::accept));
    let stop = state.shutdown.clone();
    let router = tonic::transport::Server::builder()
        .add_service(AgentServer::new(AgentService::new(state.clone())));
    tokio::spawn(async move {
        let _ = router
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
            .await;
    });
    (state, sock)
}

/// A rank process, killed when dropped; its stdout lines on a channel.
struct Rank {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Rank {
    fn spawn(py: &Path, sock: &Path, rank: u32, store: &Path, release: &Path, err: &Path) -> Self {
        let mut child = Command::new(py)
            .arg(repo_root().join("tests/fixtures/torch_flight_rank.py"))
            .arg(store)
            .arg(release)
            .env("WARDEN_SOCKET", sock)
            .env("WARDEN_JOB_ID", "fr")
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("WARDEN_STACK_DUMP_SIGNAL")
            .env_remove("TORCHELASTIC_RUN_ID")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(err).expect("stderr file"))
            .spawn()
            .expect("spawn a rank");
        let out = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        Rank { child, lines }
    }

    fn wait_line(&self, prefix: &str, err: &Path) -> String {
        let deadline = Instant::now() + SLOW;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!(
                    "no {prefix:?} line within {SLOW:?}; stderr:\n{}",
                    std::fs::read_to_string(err).unwrap_or_default()
                ),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_ranks_flight_recorder_is_requested_read_and_compared() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (state, sock) = serve(dir.path()).await;
    let store = dir.path().join("store");
    let release = dir.path().join("release");
    let errs = [dir.path().join("rank0.err"), dir.path().join("rank1.err")];
    let r0 = Rank::spawn(&py, &sock, 0, &store, &release, &errs[0]);
    let r1 = Rank::spawn(&py, &sock, 1, &store, &release, &errs[1]);
    r0.wait_line("ready ", &errs[0]);
    r1.wait_line("ready ", &errs[1]);
    let handles = state.in_process();
    let key = |rank| RankKey {
        job: "fr".into(),
        rank,
    };

    // Rank 0 prints "ready" just before its all_reduce: ask until the dump
    // shows it enqueued, and the barrier before it recorded as completed
    // (gloo completes a barrier's work asynchronously: a dump taken just
    // after #5 was enqueued can still show #4 pending, as a loaded machine
    // saw).
    let deadline = Instant::now() + SLOW;
    let p0 = loop {
        let p = request_dump(&handles, &key(0), Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("rank 0's dump: {e}"));
        if p.first().is_some_and(|g| {
            g.last_enqueued == Some(5) && g.pending.as_deref() == Some("gloo:all_reduce #5")
        }) {
            break p;
        }
        assert!(
            Instant::now() < deadline,
            "rank 0 never showed #5 enqueued and pending: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(p0[0].pg, "0:default_pg", "{p0:?}");
    assert_eq!(
        p0[0].pending.as_deref(),
        Some("gloo:all_reduce #5"),
        "{p0:?}"
    );
    let p1 = request_dump(&handles, &key(1), Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("rank 1's dump: {e}"));
    assert_eq!(p1[0].last_enqueued, Some(4), "{p1:?}");
    let behind = compare(&[(0, p0), (1, p1)]);
    assert_eq!(behind.len(), 1, "{behind:?}");
    assert_eq!(
        behind[0].evidence,
        "rank 1 enqueued collective #4 on pg 0:default_pg, rank 0 is at #5 (gloo:all_reduce)"
    );

    // Frozen: no answer within the wait, and that is the answer.
    let pid1 = nix::unistd::Pid::from_raw(i32::try_from(r1.child.id()).unwrap());
    nix::sys::signal::kill(pid1, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let t0 = Instant::now();
    let e = request_dump(&handles, &key(1), Duration::from_secs(2))
        .await
        .expect_err("a stopped rank cannot answer");
    assert_eq!(e, "no flight-recorder dump within 2s");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    nix::sys::signal::kill(pid1, nix::sys::signal::Signal::SIGCONT).unwrap();

    std::fs::write(&release, b"go").unwrap();
    r0.wait_line("done ", &errs[0]);
    r1.wait_line("done ", &errs[1]);
    state.shutdown.cancel();
}
