//! Agent-side heartbeat benchmarks, against the real `wardend` binary:
//!
//! 1. Detection latency with 64 ranks: from a rank's last slot write to the
//!    `rank.hang` event on the event stream, against its threshold + one tick.
//! 2. Agent CPU while 1,024 ranks heartbeat at 100 Hz through their slots,
//!    side by side with the baseline a socket-based monitor pays: a Unix
//!    socket server receiving one length-prefixed message per heartbeat.
//!
//! Run: `cargo bench -p warden-cli --bench ranks_load` (release build).
//! Prints a markdown table for docs/benchmarks.md.

// A benchmark program: failing loudly on set-up errors is what it should do.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Agent, connect};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use warden_client::clock;
use warden_client::slot::{self, SlotMemory};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

type Client = AgentClient<Channel>;

fn start_agent(extra: &str) -> Agent {
    Agent::start(tempfile::tempdir().unwrap(), |socket, state| {
        format!(
            "[api]\nsocket = \"{}\"\n[metrics]\nlisten = \"\"\n[agent]\nstate_dir = \"{}\"\n[log]\nlevel = \"warn\"\n{extra}",
            socket.display(),
            state.display()
        )
    })
}

/// Registers `n` ranks of job `job` (all in this process) and returns each
/// one's slot memory, received over the slot socket as a rank receives it,
/// with its generation.
async fn register(c: &mut Client, socket: &Path, job: &str, n: u32) -> Vec<(SlotMemory, u64)> {
    let mut out = Vec::new();
    let slot_socket = warden_client::slot_socket::socket_path(socket);
    for rank in 0..n {
        let r = c
            .register_rank(pb::RegisterRankRequest {
                job_id: job.into(),
                global_rank: rank,
                local_rank: rank,
                world_size: n,
                pid: std::process::id(),
                host: "bench".into(),
                slot_layout_version: slot::LAYOUT_VERSION,
                previous_slot: None,
                stack_dump_signal: 0,
                devices: Vec::new(),
            })
            .await
            .unwrap()
            .into_inner();
        let fd =
            warden_client::slot_socket::fetch(&slot_socket, r.generation, Duration::from_secs(10))
                .unwrap();
        out.push((SlotMemory::open(fd).unwrap(), r.generation));
    }
    out
}

fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn self_cpu_ticks() -> u64 {
    cpu_ticks(std::process::id())
}

fn ticks_per_sec() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// Writes heartbeats into every slot at `hz` until `stop`; every 10th
/// heartbeat also closes a step with sections, as a training loop would.
fn drive(
    slots: Vec<(SlotMemory, u64)>,
    hz: u64,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let writers: Vec<_> = slots
            .iter()
            .map(|(m, g)| {
                m.slot().attach_writer(*g, std::process::id());
                m.writer()
            })
            .collect();
        let period = Duration::from_nanos(1_000_000_000 / hz);
        let mut next = Instant::now();
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let now = clock::now_ns();
            for w in &writers {
                if n.is_multiple_of(10) {
                    w.step_begin(n / 10, now);
                    w.section_open(slot::SECTION_FORWARD, now);
                } else if n % 10 == 9 {
                    w.section_close(slot::SECTION_FORWARD, now);
                    w.step_end(n / 10, now);
                } else {
                    w.heartbeat();
                }
            }
            n += 1;
            next += period;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
        }
        n
    })
}

async fn detection_latency() -> Vec<(f64, f64)> {
    let agent = start_agent("[hang.timeouts]\nforward = \"1s\"\n[ranks]\nmax_per_process = 64\n");
    let mut c = connect(&agent.socket()).await;
    let slots = register(&mut c, &agent.socket(), "latency", 64).await;
    let mut events = c
        .watch_events(pb::WatchEventsRequest { after_id: None })
        .await
        .unwrap()
        .into_inner();
    let writers: Vec<_> = slots
        .iter()
        .map(|(m, g)| {
            m.slot().attach_writer(*g, std::process::id());
            m.writer()
        })
        .collect();
    let mut results = Vec::new();
    for round in 0..8usize {
        let victim = (round * 7) % 64;
        // Everyone steps at 50 Hz for a moment, then the victim stops in
        // "forward" while the others go on.
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut step = (round as u64) * 1000;
        let mut last_write = 0;
        while Instant::now() < deadline {
            let now = clock::now_ns();
            for w in &writers {
                w.step_begin(step, now);
                w.section_open(slot::SECTION_FORWARD, now);
            }
            last_write = clock::now_ns();
            std::thread::sleep(Duration::from_millis(10));
            let now = clock::now_ns();
            for (i, w) in writers.iter().enumerate() {
                if i != victim || Instant::now() + Duration::from_millis(30) < deadline {
                    w.section_close(slot::SECTION_FORWARD, now);
                    w.step_end(step, now);
                }
            }
            step += 1;
            tokio::task::yield_now().await;
        }
        // The victim's last write was its section_open at `last_write`;
        // the others keep heartbeating until the event comes.
        let got = loop {
            let next = tokio::time::timeout(Duration::from_millis(10), events.next()).await;
            match next {
                Ok(Some(Ok(e)))
                    if e.kind == "rank.hang" && e.subject.ends_with(&format!("/rank/{victim}")) =>
                {
                    break clock::syscall_now();
                }
                Ok(Some(Ok(_))) => {}
                Ok(other) => panic!("event stream ended: {other:?}"),
                Err(_) => {
                    for (i, w) in writers.iter().enumerate() {
                        if i != victim {
                            w.heartbeat();
                        }
                    }
                }
            }
        };
        let latency = (got - last_write) as f64 / 1e9;
        results.push((latency, latency - 1.0));
        // Let the victim recover.
        let now = clock::now_ns();
        writers[victim].section_close(slot::SECTION_FORWARD, now);
        writers[victim].step_end(step, now);
    }
    results
}

fn socket_monitor_baseline(ranks: usize, hz: u64, secs: u64) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mon.sock");
    let listener = UnixListener::bind(&path).unwrap();
    // The monitor: one thread per connection reading length-prefixed frames,
    // as a socket-based rank monitor does; measured in a child process so
    // its CPU is apart from the senders'.
    let mon = Command::new(std::env::current_exe().unwrap())
        .arg("--socket-monitor")
        .arg(&path)
        .stdin(Stdio::null())
        .spawn();
    drop(listener);
    let _ = std::fs::remove_file(&path);
    let mut mon = match mon {
        Ok(m) => m,
        Err(e) => panic!("cannot start the monitor: {e}"),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(Instant::now() < deadline, "monitor did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    let per_thread = ranks / 8;
    for _ in 0..8 {
        let path = path.clone();
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut conns: Vec<UnixStream> = (0..per_thread)
                .map(|_| UnixStream::connect(&path).unwrap())
                .collect();
            let period = Duration::from_nanos(1_000_000_000 / hz);
            let mut next = Instant::now();
            let msg = [8u8, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
            while !stop.load(Ordering::Relaxed) {
                for c in &mut conns {
                    let _ = c.write_all(&msg);
                }
                next += period;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                }
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(1));
    let t0 = cpu_ticks(mon.id());
    std::thread::sleep(Duration::from_secs(secs));
    let t1 = cpu_ticks(mon.id());
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let _ = mon.kill();
    let _ = mon.wait();
    (t1 - t0) as f64 / ticks_per_sec() / secs as f64 * 100.0
}

fn run_socket_monitor(path: &str) {
    let listener = UnixListener::bind(path).unwrap();
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        std::thread::spawn(move || {
            let mut len = [0u8; 4];
            let mut body = [0u8; 64];
            loop {
                if conn.read_exact(&mut len).is_err() {
                    return;
                }
                let n = (u32::from_le_bytes(len) as usize).min(64);
                if conn.read_exact(&mut body[..n]).is_err() {
                    return;
                }
            }
        });
    }
}

async fn agent_cpu(ranks: u32, hz: u64, secs: u64) -> (f64, f64, u64) {
    let agent = start_agent(
        "[ranks]\nmax_ranks = 1100\nmax_per_process = 1100\nmax_ranks_per_uid = 1100\n",
    );
    let mut c = connect(&agent.socket()).await;
    let slots = register(&mut c, &agent.socket(), "cpu", ranks).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = drive(slots, hz, stop.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pid = agent.pid();
    let (a0, s0) = (cpu_ticks(pid), self_cpu_ticks());
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (a1, s1) = (cpu_ticks(pid), self_cpu_ticks());
    stop.store(true, Ordering::Relaxed);
    let rounds = writer.join().unwrap();
    let tps = ticks_per_sec();
    (
        (a1 - a0) as f64 / tps / secs as f64 * 100.0,
        (s1 - s0) as f64 / tps / secs as f64 * 100.0,
        rounds,
    )
}

/// Raises this process's soft descriptor limit to its hard one (the agent
/// started from here inherits it): 1,024 ranks are 1,024 slot memories,
/// each a descriptor in the agent and one here.
fn raise_nofile() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write/read only the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

fn main() {
    raise_nofile();
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--socket-monitor") {
        run_socket_monitor(&args[i + 1]);
        return;
    }
    // cargo bench passes --bench; `cargo test` runs benches with no flag:
    // keep that run short.
    let quick = !args.iter().any(|a| a == "--bench");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let lat = rt.block_on(detection_latency());
    let secs = if quick { 2 } else { 10 };
    let (agent_pct, writer_pct, rounds) = rt.block_on(agent_cpu(1024, 100, secs));
    let base_pct = socket_monitor_baseline(1024, 100, secs);

    let mut over: Vec<f64> = lat.iter().map(|(_, o)| o * 1000.0).collect();
    over.sort_by(f64::total_cmp);
    println!(
        "## Hang detection latency, 64 ranks, threshold 1 s, tick 100 ms ({} hangs)",
        lat.len()
    );
    println!("| | min | median | max |");
    println!("|---|---|---|---|");
    println!(
        "| last write -> rank.hang event, minus the threshold (ms) | {:.0} | {:.0} | {:.0} |",
        over[0],
        over[over.len() / 2],
        over[over.len() - 1]
    );
    println!();
    println!("## CPU, 1,024 ranks x 100 Hz heartbeats ({secs} s, {rounds} rounds written)");
    println!("| monitor | CPU (% of one core) |");
    println!("|---|---|");
    println!("| wardend: shared-memory slots, scanned every 100 ms | {agent_pct:.2} |");
    println!(
        "| baseline: Unix-socket monitor, one length-prefixed message per heartbeat | {base_pct:.2} |"
    );
    println!("| (the benchmark's own slot writer, for scale) | {writer_pct:.2} |");
}
