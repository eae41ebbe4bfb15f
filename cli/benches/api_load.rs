//! Load on the agent's API, against the real `wardend` over its Unix socket
//! (issue 22, "Load figures"):
//!
//! 1. Health queries: GetNodeHealth at a fixed rate (default 1,000/s for
//!    60 s, open loop: a request leaves every millisecond whether or not the
//!    previous one answered), latency p50 / p99 / max; side by side with the
//!    floor any Unix-socket service pays, a raw echo of 64 bytes over a
//!    Unix stream at the same rate.
//! 2. Watch streams: the agent's RSS before, with 500 WatchEvents streams
//!    open (each delivered 20 events), and after they closed.
//! 3. Register/exit cycles: 1,000 real processes (`sleep`, children of this
//!    bench, registered by it as their launcher would), each registered,
//!    killed, its `rank.exited` awaited on the event stream, its job's
//!    goodput closed; the agent's descriptors, threads and RSS before and
//!    after.
//!
//! Run: `cargo bench -p warden-cli --bench api_load` (release build).
//! `WARDEN_BENCH_SECS` (default 60), `WARDEN_BENCH_RATE` (default 1000),
//! `WARDEN_BENCH_STREAMS` (default 500), `WARDEN_BENCH_CYCLES` (default
//! 1000) change the load. Prints a markdown table for docs/benchmarks.md.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Agent, connect};
use tokio_stream::StreamExt;
use warden_client::slot;
use warden_proto::v1 as pb;

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn start_agent() -> Agent {
    let dir = tempfile::Builder::new()
        .prefix("warden-bench-")
        .tempdir()
        .unwrap();
    let ckpt = dir.path().join("ckpt");
    Agent::start(dir, |socket, state| {
        format!(
            "[api]\nsocket = \"{}\"\nmax_streams_per_uid = 1024\nmax_streams = 1024\n\
             [metrics]\nlisten = \"\"\n[agent]\nstate_dir = \"{}\"\n[log]\nlevel = \"warn\"\n\
             [nvml]\nenabled = false\n[kmsg]\nenabled = false\n[dcgm]\nenabled = false\n\
             [checkpoint]\ndir = \"{}\"\n",
            socket.display(),
            state.display(),
            ckpt.display()
        )
    })
}

/// One line of /proc/PID/status, as a number (kB for VmRSS).
fn proc_status(pid: u32, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim_start_matches(':').split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn rss_mib(pid: u32) -> f64 {
    proc_status(pid, "VmRSS") as f64 / 1024.0
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// p50, p99, max of `lat` (microseconds), as milliseconds.
fn percentiles(lat: &mut [u64]) -> (f64, f64, f64) {
    lat.sort_unstable();
    let at = |q: f64| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let i = ((lat.len() as f64 - 1.0) * q).round() as usize;
        lat[i] as f64 / 1000.0
    };
    (at(0.5), at(0.99), at(1.0))
}

/// Fires `call` every `1/rate` s for `secs` s, each on its own task;
/// returns the latencies in microseconds and how many failed.
async fn open_loop<F, Fut>(rate: u64, secs: u64, call: F) -> (Vec<u64>, usize)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(usize::try_from(rate * secs).unwrap());
    for _ in 0..rate * secs {
        tick.tick().await;
        let fut = call();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let ok = fut.await;
            (u64::try_from(t.elapsed().as_micros()).unwrap(), ok)
        }));
    }
    let mut lat = Vec::with_capacity(tasks.len());
    let mut failed = 0;
    for t in tasks {
        let (us, ok) = t.await.unwrap();
        if ok {
            lat.push(us);
        } else {
            failed += 1;
        }
    }
    (lat, failed)
}

/// A Unix-socket echo server on its own thread: one thread per connection,
/// 64-byte messages echoed back.
fn echo_server(path: &std::path::Path) {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while c.read_exact(&mut buf).is_ok() {
                    if c.write_all(&buf).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

async fn health_load(agent: &Agent, rate: u64, secs: u64) -> Vec<String> {
    let pid = agent.pid();
    let client = connect(&agent.socket()).await;
    // Warm the connection.
    for _ in 0..100 {
        client
            .clone()
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .unwrap();
    }
    let cpu0 = cpu_ticks(pid);
    let started = Instant::now();
    let (mut lat, failed) = open_loop(rate, secs, || {
        let mut c = client.clone();
        async move { c.get_node_health(pb::GetNodeHealthRequest {}).await.is_ok() }
    })
    .await;
    let wall = started.elapsed().as_secs_f64();
    let cpu = (cpu_ticks(pid) - cpu0) as f64 / clk_tck() / wall * 100.0;
    let (p50, p99, max) = percentiles(&mut lat);

    // The baseline: a raw echo over a Unix stream, a pool of connections
    // (one per in-flight request) so it is open loop too.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("echo.sock");
    echo_server(&path);
    let pool: Arc<std::sync::Mutex<Vec<UnixStream>>> = Arc::default();
    let (mut base, base_failed) = open_loop(rate, secs, || {
        let pool = pool.clone();
        let path = path.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let popped = pool.lock().unwrap().pop();
                let mut s = popped.unwrap_or_else(|| UnixStream::connect(&path).unwrap());
                let mut buf = [7u8; 64];
                let ok = s.write_all(&buf).is_ok() && s.read_exact(&mut buf).is_ok();
                pool.lock().unwrap().push(s);
                ok
            })
            .await
            .unwrap_or(false)
        }
    })
    .await;
    let (b50, b99, bmax) = percentiles(&mut base);
    vec![
        format!(
            "| GetNodeHealth, {rate}/s for {secs} s ({} answered, {failed} failed) | {p50:.2} ms | {p99:.2} ms | {max:.2} ms | agent CPU {cpu:.0}% of a core |",
            lat.len()
        ),
        format!(
            "| baseline: raw 64-byte echo over a Unix stream, {rate}/s for {secs} s ({} answered, {base_failed} failed) | {b50:.2} ms | {b99:.2} ms | {bmax:.2} ms | |",
            base.len()
        ),
    ]
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &text[text.rfind(')').unwrap() + 1..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn register_req(job: &str, pid: u32) -> pb::RegisterRankRequest {
    pb::RegisterRankRequest {
        job_id: job.into(),
        global_rank: 0,
        local_rank: 0,
        world_size: 1,
        pid,
        host: "bench".into(),
        slot_layout_version: slot::LAYOUT_VERSION,
        previous_slot: None,
        stack_dump_signal: 0,
        devices: Vec::new(),
    }
}

/// Publishes two events (rank.registered, rank.deregistered) for `job`.
async fn two_events(
    c: &mut warden_proto::v1::agent_client::AgentClient<tonic::transport::Channel>,
    job: &str,
) {
    let r = c
        .register_rank(register_req(job, std::process::id()))
        .await
        .unwrap()
        .into_inner();
    c.deregister_rank(pb::DeregisterRankRequest {
        job_id: job.into(),
        global_rank: 0,
        generation: r.generation,
    })
    .await
    .unwrap();
}

async fn streams_load(agent: &Agent, n: usize) -> Vec<String> {
    let pid = agent.pid();
    let before = rss_mib(pid);
    let mut streams = Vec::with_capacity(n);
    // Several connections, as several watchers would be.
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(connect(&agent.socket()).await);
    }
    for i in 0..n {
        let mut c = clients[i % clients.len()].clone();
        let s = c
            .watch_events(pb::WatchEventsRequest { after_id: None })
            .await
            .unwrap()
            .into_inner();
        streams.push(s);
    }
    let mut c = clients[0].clone();
    for i in 0..10 {
        two_events(&mut c, &format!("streams-{i}")).await;
    }
    // Every stream receives its 20 events (the agent converted and sent
    // them all).
    for s in &mut streams {
        for _ in 0..20 {
            tokio::time::timeout(Duration::from_secs(30), s.next())
                .await
                .expect("an event on every stream")
                .unwrap()
                .unwrap();
        }
    }
    let open = rss_mib(pid);
    let fds_open = fds(pid);
    drop(streams);
    drop(clients);
    // The agent frees each stream when it sees the client's reset; give it
    // a moment, then read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = rss_mib(pid);
    vec![format!(
        "| {n} WatchEvents streams (20 events each) | {before:.1} MiB | {open:.1} MiB ({fds_open} fds) | {after:.1} MiB | {:.0} KiB per stream |",
        (open - before) * 1024.0 / n as f64
    )]
}

async fn cycles_load(agent: &Agent, n: usize) -> Vec<String> {
    let pid = agent.pid();
    let mut c = connect(&agent.socket()).await;
    let mut events = c
        .watch_events(pb::WatchEventsRequest { after_id: None })
        .await
        .unwrap()
        .into_inner();
    // One cycle to warm up what stays (the goodput directory, the owners
    // file), then the figures before.
    let mut cycle = async |i: usize| {
        let mut child = Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let job = format!("cycle-{i}");
        c.register_rank(register_req(&job, child.id()))
            .await
            .unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        let want = format!("job/{job}/rank/0");
        loop {
            let e = tokio::time::timeout(Duration::from_secs(30), events.next())
                .await
                .expect("rank.exited within 30 s")
                .unwrap()
                .unwrap();
            if e.kind == "rank.exited" && e.subject == want {
                break;
            }
        }
        // The launcher closes the job; the ledger may not have it yet.
        let _ = c
            .close_goodput(pb::CloseGoodputRequest { job_id: job })
            .await;
    };
    cycle(0).await;
    let (f0, t0, r0) = (fds(pid), proc_status(pid, "Threads"), rss_mib(pid));
    let started = Instant::now();
    for i in 1..=n {
        cycle(i).await;
    }
    let took = started.elapsed().as_secs_f64();
    // Journals of jobs whose close came before the ledger had them close
    // when idle (10 flushes).
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (f1, t1, r1) = (fds(pid), proc_status(pid, "Threads"), rss_mib(pid));
    vec![format!(
        "| {n} register/exit cycles of real processes ({:.1} ms each) | {f0} fds, {t0} threads, {r0:.1} MiB | {f1} fds, {t1} threads, {r1:.1} MiB |",
        took * 1000.0 / n as f64
    )]
}

fn main() {
    let secs = env_or("WARDEN_BENCH_SECS", 60);
    let rate = env_or("WARDEN_BENCH_RATE", 1000);
    let streams = usize::try_from(env_or("WARDEN_BENCH_STREAMS", 500)).unwrap();
    let cycles = usize::try_from(env_or("WARDEN_BENCH_CYCLES", 1000)).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let agent = start_agent();
        println!("| load | p50 | p99 | max | |\n|---|---|---|---|---|");
        for line in health_load(&agent, rate, secs).await {
            println!("{line}");
        }
        println!();
        println!(
            "| streams | agent RSS before | with them open | after they closed | |\n|---|---|---|---|---|"
        );
        for line in streams_load(&agent, streams).await {
            println!("{line}");
        }
        println!();
        println!("| cycles | before | after |\n|---|---|---|");
        for line in cycles_load(&agent, cycles).await {
            println!("{line}");
        }
    });
}
