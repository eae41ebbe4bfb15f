//! Issue 29, floods: what one unprivileged caller can make the agent hold,
//! replayed as that caller against a real wardend, and shown bounded.
//!
//! - Control streams (4a): the member opens thousands on its own rank; one
//!   stays open (each newer replaces the older) and the agent's RSS stays
//!   flat.
//! - Connections (5): the member floods the Unix socket (its uid's cap,
//!   then the agent's descriptor budget when its `nofile` is small), the
//!   stranger floods the metrics port and `api.tcp`; the excess is closed
//!   at accept, silent connections at the preface or idle timeout, valid
//!   peers still handshake at once, `host/memory` stays readable, and the
//!   log gets a few lines, not one per refusal.
//! - Rank slots (7): the member's processes take at most
//!   `ranks.max_ranks_per_uid`; root still registers.
//!
//! Throughout each flood, root's GetNodeHealth calls are timed: p99 under
//! 50 ms, printed. The agent and the timing thread run at nice -10 so that
//! the test machine's other work does not count as the flood's doing; the
//! attacker at the ordinary priority. Floods run one at a time. Floods are bounded in count and time and stay on
//! loopback. An attacker holds its flood until the test creates its
//! release file (the attack polls for it with a deadline), so the test
//! measures while the flood is held.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use warden_proto::v1 as pb;

use crate::common::users::{self, block_on, socket_arg};
use crate::common::{Home, TestAgent, WAIT, eventually, free_port, within};

/// The most an attack holds its flood waiting for the release.
const HOLD: Duration = Duration::from_secs(40);
/// p99 of root's health calls during a flood.
const HEALTH_P99: Duration = Duration::from_millis(50);
/// Health calls timed per flood (every twentieth on a fresh connection):
/// enough that p99 is not two scheduling hiccups of a loaded machine.
const HEALTH_CALLS: usize = 1000;

// ---------------------------------------------------------------- helpers

/// Raises this process's open-file soft limit to its hard limit (an
/// attacker holding 1,100 connections needs more than 1024).
fn raise_nofile() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only the struct passed.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
    l.rlim_cur
}

/// Waits, as the attacker, for the test's release file (or [`HOLD`]).
fn wait_release(args: &Value) -> bool {
    let path = PathBuf::from(args["release"].as_str().expect("a release path"));
    let deadline = Instant::now() + HOLD;
    while Instant::now() < deadline {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// As [`wait_release`], on the attack's runtime (its streams go on being
/// served meanwhile).
async fn wait_release_async(args: &Value) -> bool {
    let path = PathBuf::from(args["release"].as_str().expect("a release path"));
    let deadline = Instant::now() + HOLD;
    while Instant::now() < deadline {
        if path.exists() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// A release file for `agent`'s attack `name`, and the function that
/// releases it.
fn release(agent: &TestAgent, name: &str) -> PathBuf {
    agent.home.path().join(format!("release-{name}"))
}

/// The sum of `metric`'s samples with `labels`, 0 when there is none.
fn metric(text: &str, metric: &str, labels: &[(&str, &str)]) -> f64 {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .expect("Prometheus text");
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| crate::common::number(&s.value))
        .sum()
}

/// GET `path` from `addr`, connecting from source address `from` (the
/// metrics port's per-source cap is what a flood from 127.0.0.1 fills).
fn get_from(from: &str, addr: &str, path: &str) -> std::io::Result<String> {
    let sock = TcpFromSocket::bind(from)?;
    let to: std::net::SocketAddr = addr.parse().expect("an address");
    sock.connect(&to.into())?;
    let mut s: std::net::TcpStream = sock.into();
    s.set_read_timeout(Some(WAIT))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body)
}

/// A not-yet-connected TCP socket bound to a chosen source address (made
/// with libc: std cannot bind before connecting, and no dependency is
/// added for it).
struct TcpFromSocket(std::os::fd::OwnedFd);

impl TcpFromSocket {
    fn bind(from: &str) -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: socket() returns a new descriptor or -1; it is owned
        // below only when valid.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let ip: std::net::Ipv4Addr = from.parse().expect("an IPv4 source");
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: `sa` is a valid sockaddr_in of the size passed.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const sa).cast(),
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(fd))
    }

    fn connect(&self, to: &SockAddrIn) -> std::io::Result<()> {
        // SAFETY: `to.0` is a valid sockaddr_in of the size passed.
        let r = unsafe {
            libc::connect(
                self.0.as_raw_fd(),
                (&raw const to.0).cast(),
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl From<TcpFromSocket> for std::net::TcpStream {
    fn from(s: TcpFromSocket) -> Self {
        std::net::TcpStream::from(s.0)
    }
}

/// An IPv4 socket address in the C layout.
struct SockAddrIn(libc::sockaddr_in);

impl From<std::net::SocketAddr> for SockAddrIn {
    fn from(a: std::net::SocketAddr) -> Self {
        let std::net::SocketAddr::V4(a) = a else {
            panic!("loopback IPv4 only: {a}");
        };
        Self(libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a.ip()).to_be(),
            },
            sin_zero: [0; 8],
        })
    }
}

/// The nice value of the agent and of the thread timing its health calls:
/// the test machine runs other work (two cores, several builds and test
/// suites at once), whose scheduling delays are no part of what a flood
/// does to the agent. The attacker runs at the ordinary priority, as an
/// unprivileged user must.
const MEASURE_NICE: libc::c_int = -10;

/// Floods run one at a time: two at once on two cores would measure each
/// other.
static ONE_FLOOD: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Times [`HEALTH_CALLS`] GetNodeHealth calls as root (every twentieth on a
/// fresh connection) on a thread of its own at [`MEASURE_NICE`]; prints
/// and returns the p99.
async fn health_p99(agent: &TestAgent, what: &str) -> Duration {
    let socket = agent.socket().to_owned();
    let what = what.to_owned();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        // SAFETY: setpriority on this thread (its tid) only.
        unsafe {
            libc::setpriority(
                libc::PRIO_PROCESS,
                libc::gettid().cast_unsigned(),
                MEASURE_NICE,
            );
        }
        let _ = tx.send(block_on(time_health(socket, &what)));
    });
    within(Duration::from_secs(120), "the health timing", rx)
        .await
        .expect("the timing thread")
}

async fn time_health(socket: PathBuf, what: &str) -> Duration {
    let target = warden_cli::Target::Unix(socket);
    let connect = || async {
        pb::agent_client::AgentClient::new(target.channel().await.expect("root connects"))
    };
    let mut c = connect().await;
    let mut times = Vec::with_capacity(HEALTH_CALLS);
    let mut fresh = Duration::ZERO;
    for i in 0..HEALTH_CALLS {
        let t = Instant::now();
        if i % 20 == 0 {
            c = connect().await;
            fresh = fresh.max(t.elapsed());
        }
        within(
            WAIT,
            "GetNodeHealth",
            c.get_node_health(pb::GetNodeHealthRequest {}),
        )
        .await
        .unwrap_or_else(|s| panic!("GetNodeHealth during {what}: {s:?}"));
        times.push(t.elapsed());
    }
    times.sort();
    let p = |q: f64| times[((times.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    let (p50, p99, max) = (p(0.5), p(0.99), times[times.len() - 1]);
    println!(
        "{what}: GetNodeHealth x{HEALTH_CALLS} as root: p50 {p50:?} p99 {p99:?} max {max:?} \
         (slowest new connection {fresh:?})"
    );
    p99
}

/// `pid`'s resident set, kiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("the agent's status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// Descriptors `pid` holds.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(Iterator::count)
        .unwrap_or(0)
}

/// The status of `host/memory` (GetNodeHealth).
async fn host_memory(agent: &TestAgent) -> String {
    agent
        .component("host/memory")
        .await
        .and_then(|c| pb::Status::try_from(c.status).ok())
        .map(|s| s.as_str_name().to_owned())
        .unwrap_or_default()
}

/// The lines of the agent's log that mention `needle`.
fn log_lines(agent: &TestAgent, needle: &str) -> usize {
    agent
        .stderr()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// Runs `attack` as `who` on a blocking thread.
fn spawn_attack(
    who: &users::Ident,
    attack: &'static str,
    args: Value,
) -> tokio::task::JoinHandle<users::Outcome> {
    let who = who.clone();
    tokio::task::spawn_blocking(move || users::run_as(&who, attack, &args))
}

// ------------------------------------------------------------ the attacks

/// As the member: registers one rank of its own and opens `n` Control
/// streams on it over `conns` connections; reports how many the agent
/// ended (each newer one replaces the older) once all are open, then
/// holds what is left until released.
pub fn attack_control(args: &Value) -> Value {
    let socket = socket_arg(args);
    let n = usize::try_from(args["n"].as_u64().expect("n")).expect("n");
    let conns = usize::try_from(args["conns"].as_u64().expect("conns")).expect("conns");
    block_on(async move {
        let target = warden_cli::Target::Unix(socket);
        let mut first = pb::agent_client::AgentClient::new(
            target.channel().await.expect("the member connects"),
        );
        let reg = first
            .register_rank(pb::RegisterRankRequest {
                job_id: "flood-control".into(),
                global_rank: 0,
                local_rank: 0,
                world_size: 1,
                pid: std::process::id(),
                host: "flood".into(),
                slot_layout_version: warden_client::slot::LAYOUT_VERSION,
                previous_slot: None,
                stack_dump_signal: 0,
                devices: Vec::new(),
            })
            .await
            .expect("the member registers its own rank")
            .into_inner();
        let mut clients = vec![first];
        for _ in 1..conns {
            clients.push(pb::agent_client::AgentClient::new(
                target.channel().await.expect("the member connects"),
            ));
        }
        let ended = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (mut opened, mut refused) = (0usize, Vec::new());
        for i in 0..n {
            let c = &mut clients[i % conns];
            match c
                .control(pb::ControlRequest {
                    job_id: "flood-control".into(),
                    global_rank: 0,
                    generation: reg.generation,
                })
                .await
            {
                Ok(s) => {
                    opened += 1;
                    let mut s = s.into_inner();
                    let ended = ended.clone();
                    tokio::spawn(async move {
                        while let Ok(Some(_)) = s.message().await {}
                        ended.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    });
                }
                Err(s) => {
                    if refused.len() < 3 {
                        refused.push(format!("{:?}: {}", s.code(), s.message()));
                    }
                }
            }
        }
        // Wait (bounded) until the agent has ended all but the last.
        let deadline = Instant::now() + Duration::from_secs(30);
        while ended.load(std::sync::atomic::Ordering::Relaxed) + 1 < opened
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ended_at_peak = ended.load(std::sync::atomic::Ordering::Relaxed);
        let released = wait_release_async(args).await;
        json!({"opened": opened, "ended": ended_at_peak, "refused": refused,
               "released": released})
    })
}

/// A connection closed sooner than this was refused at accept; later, on
/// a timeout (every timeout these tests set is longer).
const QUICK: f64 = 2.5;

/// As the member: opens `n` WatchHealth streams over two connections and
/// holds them until released; reports which were refused and why.
pub fn attack_requests(args: &Value) -> Value {
    let socket = socket_arg(args);
    let n = args["n"].as_u64().expect("n");
    block_on(async move {
        let target = warden_cli::Target::Unix(socket);
        let mut clients = Vec::new();
        for _ in 0..2 {
            clients.push(pb::agent_client::AgentClient::new(
                target.channel().await.expect("the member connects"),
            ));
        }
        let (mut held, mut refused) = (Vec::new(), Vec::new());
        for i in 0..n {
            let c = &mut clients[usize::from(i % 2 == 1)];
            match c.watch_health(pb::WatchHealthRequest {}).await {
                Ok(s) => held.push(s.into_inner()),
                Err(s) => refused.push(json!({"code": format!("{:?}", s.code()),
                                              "message": s.message()})),
            }
        }
        let released = wait_release_async(args).await;
        json!({"held": held.len(), "refused": refused, "released": released})
    })
}

/// One connection of a flood.
struct FloodConn {
    stream: Box<dyn ReadNonBlocking>,
    opened: Instant,
    /// Sent the HTTP/2 preface (or half a request, for HTTP/1).
    spoke: bool,
}

trait ReadNonBlocking: Read + Send {}
impl ReadNonBlocking for std::os::unix::net::UnixStream {}
impl ReadNonBlocking for std::net::TcpStream {}

/// The HTTP/2 client preface and an empty SETTINGS frame.
const H2_HELLO: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

fn open_one(args: &Value, spoke: bool) -> std::io::Result<FloodConn> {
    let kind = args["kind"].as_str().expect("kind");
    let stream: Box<dyn ReadNonBlocking> = if kind == "unix" {
        let mut s = std::os::unix::net::UnixStream::connect(socket_arg(args))?;
        if spoke {
            s.write_all(H2_HELLO)?;
        }
        s.set_nonblocking(true)?;
        Box::new(s)
    } else {
        let addr: std::net::SocketAddr =
            args["addr"].as_str().expect("addr").parse().expect("addr");
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        if spoke {
            s.write_all(b"GET /metrics HTTP/1.1\r\n")?;
        }
        s.set_nonblocking(true)?;
        Box::new(s)
    };
    Ok(FloodConn {
        stream,
        opened: Instant::now(),
        spoke,
    })
}

/// As the member (Unix socket) or the stranger (a TCP port): opens `n`
/// idle connections, half of them sending a first message and then
/// nothing; after each batch of 50, and every 100 ms once all are open,
/// notes which the agent closed (and after how
/// long) and opens them again, at most `max_connects` in all, until
/// released (and, with `await_late`, until it has seen the agent close a
/// silent connection, and one that spoke unless `spoke_late` is false, on
/// a timeout).
pub fn attack_connections(args: &Value) -> Value {
    let nofile = raise_nofile();
    let n = usize::try_from(args["n"].as_u64().expect("n")).expect("n");
    let max_connects = args["max_connects"].as_u64().expect("max_connects");
    let release = PathBuf::from(args["release"].as_str().expect("release"));
    let mut open: Vec<FloodConn> = Vec::new();
    let (mut connects, mut connect_errors) = (0u64, Vec::<String>::new());
    let mut quick = 0u64;
    let (mut silent_late, mut spoke_late): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    let mut most_open = 0usize;
    let deadline = Instant::now() + HOLD;
    let mut released = false;
    while Instant::now() < deadline {
        // A batch at a time, so the agent's closing of each is seen soon
        // after it happens.
        let mut batch = 0;
        while open.len() < n && connects < max_connects && batch < 50 {
            batch += 1;
            connects += 1;
            match open_one(args, open.len() % 2 == 1) {
                Ok(c) => open.push(c),
                Err(e) => {
                    if connect_errors.len() < 3 {
                        connect_errors.push(e.to_string());
                    }
                    break;
                }
            }
        }
        most_open = most_open.max(open.len());
        // Released, and (when asked) the agent has been seen closing both
        // kinds of silent connection on its timeouts.
        let seen = !args["await_late"].as_bool().unwrap_or(false)
            || (!silent_late.is_empty()
                && (!spoke_late.is_empty() || !args["spoke_late"].as_bool().unwrap_or(true)));
        if release.exists() && seen {
            released = true;
            break;
        }
        if batch == 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut buf = [0u8; 4096];
        open.retain_mut(|c| {
            // Drain what the agent sent (its SETTINGS); an end of stream or
            // a reset is the agent closing the connection.
            let closed = loop {
                match c.stream.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                    Err(_) => break true,
                }
            };
            if closed {
                let lived = c.opened.elapsed().as_secs_f64();
                // Refused at accept: at once, or after the kernel's 1 s
                // retransmission when the accept queue was full.
                if lived < QUICK {
                    quick += 1;
                } else if c.spoke {
                    spoke_late.push(lived);
                } else {
                    silent_late.push(lived);
                }
            }
            !closed
        });
    }
    let range = |v: &[f64]| {
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(0.0, f64::max);
        json!({"count": v.len(), "min_s": min, "max_s": max})
    };
    json!({
        "nofile": nofile, "connects": connects, "connect_errors": connect_errors,
        "closed_quickly": quick, "silent_closed_late": range(&silent_late),
        "spoke_closed_late": range(&spoke_late), "most_open": most_open,
        "still_open": open.len(), "released": released,
    })
}

/// As the member: registers `per_process` ranks from each of `processes`
/// processes of its own (copies of this binary running
/// `floods.rank_holder`), holds them until released, and reports what
/// each was told.
pub fn attack_ranks(args: &Value) -> Value {
    use std::process::{Command, Stdio};
    let processes = args["processes"].as_u64().expect("processes");
    let mut children = Vec::new();
    for p in 0..processes {
        let mut a = args.clone();
        a["index"] = json!(p);
        let child = Command::new(std::env::current_exe().expect("this binary"))
            .args(["--exact", "attacker", "--nocapture", "--test-threads=1"])
            .env(users::ATTACK_VAR, "floods.rank_holder")
            .env(users::ARGS_VAR, a.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a rank holder");
        children.push(child);
    }
    // Each holder prints its result once registered, then waits for its
    // stdin to close.
    let mut told = Vec::new();
    for c in &mut children {
        let mut out = std::io::BufReader::new(c.stdout.take().expect("stdout"));
        let mut line = String::new();
        loop {
            line.clear();
            let n = std::io::BufRead::read_line(&mut out, &mut line).expect("read a holder");
            if n == 0 {
                break;
            }
            if let Some((_, r)) = line.split_once(users::RESULT_PREFIX) {
                told.push(serde_json::from_str::<Value>(r).expect("JSON"));
                break;
            }
        }
    }
    let released = wait_release(args);
    for mut c in children {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    json!({"told": told, "released": released})
}

/// One of [`attack_ranks`]'s processes: registers `per_process` ranks of
/// its own, prints what it was told, and holds them until its stdin
/// closes.
pub fn attack_rank_holder(args: &Value) -> Value {
    let socket = socket_arg(args);
    let per = args["per_process"].as_u64().expect("per_process");
    let index = args["index"].as_u64().expect("index");
    let told: Vec<Value> = block_on(async move {
        let mut c = pb::agent_client::AgentClient::new(
            warden_cli::Target::Unix(socket)
                .channel()
                .await
                .expect("the member connects"),
        );
        let mut told = Vec::new();
        for r in 0..per {
            let rank = u32::try_from(index * per + r).expect("a rank");
            let out = c
                .register_rank(pb::RegisterRankRequest {
                    job_id: "flood-ranks".into(),
                    global_rank: rank,
                    local_rank: rank,
                    world_size: 1024,
                    pid: std::process::id(),
                    host: "flood".into(),
                    slot_layout_version: warden_client::slot::LAYOUT_VERSION,
                    previous_slot: None,
                    stack_dump_signal: 0,
                    devices: Vec::new(),
                })
                .await;
            told.push(users::call_result(out, |_| json!({})));
        }
        told
    });
    let result = json!({"told": told});
    println!("\n{}{result}", users::RESULT_PREFIX);
    let _ = std::io::stdout().flush();
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    result
}

// -------------------------------------------------------------- the tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_streams_are_one_per_rank_and_rss_stays_flat() {
    let _one = ONE_FLOOD.lock().await;
    let agent = agent_with("", None);
    // Warm up the paths the flood takes, then take the baseline.
    health_p99(&agent, "before the Control flood").await;
    let before = rss_kib(agent.pid());
    let n = 4000u64;
    let rel = release(&agent, "control");
    let attack = spawn_attack(
        &users::users().member,
        "floods.control",
        json!({"socket": agent.socket(), "n": n, "conns": 4, "release": rel}),
    );
    // Held: every stream asked for has reached the agent.
    eventually(Duration::from_secs(60), "the Control flood", || async {
        let (_, text) = crate::common::scrape(&agent).await;
        (metric(&text, "warden_api_requests_total", &[("method", "Control")]) >= n as f64)
            .then_some(())
    })
    .await;
    let during = rss_kib(agent.pid());
    let p99 = health_p99(&agent, "the Control flood").await;
    std::fs::write(&rel, b"").expect("release the attacker");
    let out = within(Duration::from_secs(90), "the attack", attack)
        .await
        .expect("the attack ran");
    let r = &out.result;
    println!(
        "Control flood: {r}; agent RSS {before} kiB before, {during} kiB with {n} streams asked"
    );
    assert_eq!(r["opened"], json!(n), "{r}");
    assert_eq!(r["ended"], json!(n - 1), "all but the newest ended: {r}");
    assert!(
        during < before + 20 * 1024,
        "RSS grew from {before} to {during} kiB over {n} Control streams"
    );
    assert!(p99 < HEALTH_P99, "p99 {p99:?} during the Control flood");
}

/// Starts a [`Home::shared`] agent with `toml` at [`MEASURE_NICE`], its
/// descriptors limited to `nofile` when given.
fn agent_with(toml: &str, nofile: Option<u64>) -> TestAgent {
    use std::os::unix::process::CommandExt;
    let home = std::sync::Arc::new(Home::shared(toml));
    let mut agent = TestAgent::spawn_adjusted(home, &[], |cmd| {
        // SAFETY: setpriority and setrlimit are async-signal-safe and
        // touch only the child about to exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setpriority(libc::PRIO_PROCESS, 0, MEASURE_NICE) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(n) = nofile {
                    let l = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    });
    agent.wait_ready();
    agent
}

/// The flood of `kind` on `agent`, held while root's health is timed;
/// returns the attack's outcome and the p99, with the agent's most
/// descriptors and its `host/memory` during the flood.
struct Flooded {
    out: Value,
    p99: Duration,
    most_fds: usize,
    memory: String,
    metrics: String,
}

async fn flood(
    agent: &TestAgent,
    who: &users::Ident,
    name: &str,
    args: Value,
    listener: &str,
    scrape_from: &str,
    refusals: f64,
) -> Flooded {
    let rel = release(agent, name);
    let mut args = args;
    args["release"] = json!(rel);
    args["socket"] = json!(agent.socket());
    let attack = spawn_attack(who, "floods.connections", args);
    let url = crate::common::endpoint(&agent.info().await, "metrics");
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_owned();
    let scrape = {
        let (from, addr) = (scrape_from.to_owned(), addr.clone());
        move || {
            let (from, addr) = (from.clone(), addr.clone());
            async move {
                tokio::task::spawn_blocking(move || get_from(&from, &addr, "/metrics"))
                    .await
                    .expect("scrape")
                    .unwrap_or_default()
            }
        }
    };
    // Held: the flood has met a quota `refusals` times.
    eventually(Duration::from_secs(60), "the flood to meet a quota", || {
        let scrape = scrape.clone();
        async move {
            let text = scrape().await;
            (metric(
                &text,
                "warden_api_connections_refused_total",
                &[("listener", listener)],
            ) >= refusals)
                .then_some(())
        }
    })
    .await;
    let mut most_fds = fds(agent.pid());
    let p99 = health_p99(agent, name).await;
    most_fds = most_fds.max(fds(agent.pid()));
    let memory = host_memory(agent).await;
    let metrics = scrape().await;
    std::fs::write(&rel, b"").expect("release the attacker");
    let out = within(Duration::from_secs(90), "the attack", attack)
        .await
        .expect("the attack ran")
        .result;
    println!("{name}: {out}; agent fds at most {most_fds}; host/memory {memory}");
    Flooded {
        out,
        p99,
        most_fds,
        memory,
        metrics,
    }
}

/// What every flood must leave: health answered, `host/memory` readable,
/// and a log of a few lines, not one per refusal.
fn common_asserts(agent: &TestAgent, f: &Flooded, what: &str) {
    assert!(f.p99 < HEALTH_P99, "p99 {:?} during {what}", f.p99);
    assert_ne!(f.memory, "STATUS_UNKNOWN", "host/memory during {what}");
    assert!(!f.memory.is_empty(), "host/memory reported during {what}");
    let refusals = log_lines(agent, "connection refused");
    assert!(
        refusals <= 12,
        "{refusals} log lines of refusals during {what}: they are rate-limited"
    );
    let log = agent.stderr().len();
    assert!(log < 1 << 20, "{log} bytes of log during {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uids_unix_connections_are_capped_and_silent_ones_closed() {
    let _one = ONE_FLOOD.lock().await;
    let agent = agent_with(
        "[api]\nmax_connections_per_uid = 64\npreface_timeout = \"3s\"\nidle_timeout = \"4s\"\n",
        None,
    );
    let u = users::users();
    let f = flood(
        &agent,
        &u.member,
        "unix-flood",
        json!({"kind": "unix", "n": 1100, "max_connects": 6000, "await_late": true}),
        "api.socket",
        "127.0.0.1",
        500.0,
    )
    .await;
    common_asserts(&agent, &f, "the Unix socket flood");
    let r = &f.out;
    assert!(
        metric(
            &f.metrics,
            "warden_api_connections_refused_total",
            &[("listener", "api.socket"), ("reason", "per_caller")]
        ) > 0.0,
        "refused at the uid's cap: {}",
        f.metrics
    );
    // At most its cap held at once (root's calls and the scrape beside it).
    let open = metric(
        &f.metrics,
        "warden_api_connections_open",
        &[("listener", "api.socket")],
    );
    assert!(
        open <= 64.0 + 4.0,
        "{open} Unix connections open during the flood"
    );
    // Those past the cap were closed at once; the silent ones held at the
    // preface timeout, those that sent the preface at the idle timeout.
    assert!(r["closed_quickly"].as_u64().unwrap_or(0) >= 1000, "{r}");
    let silent = &r["silent_closed_late"];
    assert!(silent["count"].as_u64().unwrap_or(0) > 0, "{r}");
    assert!(
        silent["min_s"].as_f64().unwrap_or(0.0) >= 2.5,
        "preface timeout 3s: {r}"
    );
    let spoke = &r["spoke_closed_late"];
    assert!(spoke["count"].as_u64().unwrap_or(0) > 0, "{r}");
    assert!(
        spoke["min_s"].as_f64().unwrap_or(0.0) >= 3.5,
        "idle timeout 4s: {r}"
    );
    // The flood is gone: only root's connection remains.
    eventually(WAIT, "the flood's connections to close", || async {
        let (_, text) = crate::common::scrape(&agent).await;
        (metric(
            &text,
            "warden_api_connections_open",
            &[("listener", "api.socket")],
        ) <= 2.0)
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_short_of_descriptors_refuses_connections_before_it_runs_out() {
    let _one = ONE_FLOOD.lock().await;
    // 1024 descriptors, 64 rank slots: 1024 - 256 - 128 = 640 connections,
    // the last 32 for admins; the member's own cap is no help here.
    let nofile = 1024;
    let agent = agent_with(
        "[api]\nmax_connections_per_uid = 100000\n[ranks]\nmax_ranks = 64\nmax_per_process = 8\n",
        Some(nofile),
    );
    let u = users::users();
    let f = flood(
        &agent,
        &u.member,
        "fd-flood",
        json!({"kind": "unix", "n": 1100, "max_connects": 3000}),
        "api.socket",
        "127.0.0.1",
        300.0,
    )
    .await;
    common_asserts(&agent, &f, "the flood of an agent with nofile 1024");
    assert!(
        metric(
            &f.metrics,
            "warden_api_connections_refused_total",
            &[("listener", "api.socket"), ("reason", "total")]
        ) > 0.0,
        "refused at the budget: {}",
        f.metrics
    );
    assert!(
        f.most_fds < usize::try_from(nofile).expect("small") - 200,
        "the agent held {} of its {nofile} descriptors",
        f.most_fds
    );
    assert_eq!(
        metric(
            &f.metrics,
            "warden_api_accept_errors_total",
            &[("errno", "EMFILE")]
        ),
        0.0,
        "the agent never ran out of descriptors"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_flood_the_metrics_port() {
    let _one = ONE_FLOOD.lock().await;
    let agent = agent_with("", None);
    let u = users::users();
    let url = crate::common::endpoint(&agent.info().await, "metrics");
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_owned();
    let f = flood(
        &agent,
        &u.stranger,
        "metrics-flood",
        json!({"kind": "tcp", "addr": addr, "n": 1100, "max_connects": 6000,
               "await_late": true}),
        "metrics.listen",
        "127.0.0.2",
        500.0,
    )
    .await;
    common_asserts(&agent, &f, "the metrics port flood");
    let r = &f.out;
    // Scraped from another source during the flood: served.
    assert!(f.metrics.contains("warden_build_info"), "{}", f.metrics);
    let refused = metric(
        &f.metrics,
        "warden_api_connections_refused_total",
        &[("listener", "metrics.listen"), ("reason", "per_caller")],
    );
    assert!(refused >= 100.0, "{refused} refused: {}", f.metrics);
    // The stranger's 8, and the scrape itself.
    let open = metric(
        &f.metrics,
        "warden_api_connections_open",
        &[("listener", "metrics.listen")],
    );
    assert!(
        open <= 8.0 + 1.0,
        "{open} metrics connections open during the flood"
    );
    assert!(r["closed_quickly"].as_u64().unwrap_or(0) >= 100, "{r}");
    // The eight it held were closed after 5 s without a byte.
    let silent = &r["silent_closed_late"];
    assert!(silent["count"].as_u64().unwrap_or(0) > 0, "{r}");
    assert!(silent["min_s"].as_f64().unwrap_or(0.0) >= 4.0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tcp_connections_from_one_source_do_not_starve_valid_peers() {
    let _one = ONE_FLOOD.lock().await;
    use crate::common::pki::cluster;
    let me = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let files = cluster().node("h0");
    let agent = agent_with(
        &format!(
            "[agent]\nhost_name = \"h0\"\n[api]\ntcp = \"{me}\"\n{}",
            files.api_keys()
        ),
        None,
    );
    let u = users::users();
    let rel = release(&agent, "tcp");
    let attack = spawn_attack(
        &u.stranger,
        "floods.connections",
        json!({"kind": "tcp", "addr": me, "n": 400, "max_connects": 2000,
               "release": rel, "socket": agent.socket(),
               "await_late": true, "spoke_late": false}),
    );
    // Held: the stranger's 400 are open or refused (its 8 in handshakes).
    eventually(Duration::from_secs(60), "the handshake flood", || async {
        let (_, text) = crate::common::scrape(&agent).await;
        (metric(
            &text,
            "warden_api_connections_refused_total",
            &[("listener", "api.tcp handshakes")],
        ) >= 300.0)
            .then_some(())
    })
    .await;
    // A valid peer from another address handshakes at once, 20 times.
    let config = std::sync::Arc::new(cluster().client_config(Some(&cluster().node("h1"))));
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let t = Instant::now();
        let to: std::net::SocketAddr = me.parse().expect("addr");
        let tcp = tokio::task::spawn_blocking(move || {
            let s = TcpFromSocket::bind("127.0.0.2")?;
            s.connect(&to.into())?;
            let s: std::net::TcpStream = s.into();
            s.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(s)
        })
        .await
        .expect("connect")
        .expect("a valid peer connects");
        let tcp = tokio::net::TcpStream::from_std(tcp).expect("tokio stream");
        let name = tokio_rustls::rustls::pki_types::ServerName::try_from("h0").expect("a name");
        within(
            WAIT,
            "a valid peer's handshake",
            tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp),
        )
        .await
        .expect("the valid peer's handshake");
        slowest = slowest.max(t.elapsed());
    }
    let p99 = health_p99(&agent, "the TCP handshake flood").await;
    std::fs::write(&rel, b"").expect("release");
    let out = within(Duration::from_secs(90), "the attack", attack)
        .await
        .expect("the attack")
        .result;
    println!("TCP flood: {out}; slowest valid handshake {slowest:?}");
    // On main, 256 silent connections held every place for 10 s.
    assert!(
        slowest < Duration::from_secs(2),
        "a valid handshake took {slowest:?}"
    );
    assert!(out["closed_quickly"].as_u64().unwrap_or(0) >= 300, "{out}");
    // Those it held were dropped at the 10 s handshake limit.
    let silent = &out["silent_closed_late"];
    assert!(silent["min_s"].as_f64().unwrap_or(0.0) >= 9.5, "{out}");
    assert!(p99 < HEALTH_P99, "p99 {p99:?} during the TCP flood");
    assert!(
        log_lines(&agent, "connection refused") <= 12,
        "rate-limited"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_uid_cannot_take_every_rank_slot() {
    let _one = ONE_FLOOD.lock().await;
    // 16 slots, 2 per process: the member's 6 processes ask for 12, get 8
    // (half of the slots), and root still registers.
    let agent = agent_with("[ranks]\nmax_ranks = 16\nmax_per_process = 2\n", None);
    let u = users::users();
    let rel = release(&agent, "ranks");
    let attack = spawn_attack(
        &u.member,
        "floods.ranks",
        json!({"socket": agent.socket(), "processes": 6, "per_process": 2, "release": rel}),
    );
    let mut c = agent.client().await;
    eventually(Duration::from_secs(60), "the member's ranks", || {
        let mut c = c.clone();
        async move {
            let ranks = c
                .get_ranks(pb::GetRanksRequest {
                    job_id: "flood-ranks".into(),
                })
                .await
                .ok()?
                .into_inner()
                .ranks;
            (ranks.len() >= 8).then_some(())
        }
    })
    .await;
    let p99 = health_p99(&agent, "the rank-slot flood").await;
    // Root registers beside the flood.
    let mine = within(
        WAIT,
        "RegisterRank",
        c.register_rank(pb::RegisterRankRequest {
            job_id: "root-job".into(),
            global_rank: 0,
            local_rank: 0,
            world_size: 1,
            pid: std::process::id(),
            host: "root".into(),
            slot_layout_version: warden_client::slot::LAYOUT_VERSION,
            previous_slot: None,
            stack_dump_signal: 0,
            devices: Vec::new(),
        }),
    )
    .await;
    std::fs::write(&rel, b"").expect("release");
    let out = within(Duration::from_secs(90), "the attack", attack)
        .await
        .expect("the attack")
        .result;
    println!("rank flood: {out}");
    mine.expect("root registers while the member holds its share");
    let told: Vec<&Value> = out["told"]
        .as_array()
        .expect("told")
        .iter()
        .flat_map(|t| t["told"].as_array().expect("told").iter())
        .collect();
    let ok = told.iter().filter(|t| t["ok"] == json!(true)).count();
    assert_eq!(told.len(), 12, "{out}");
    assert_eq!(ok, 8, "half of 16 slots: {out}");
    for t in told.iter().filter(|t| t["ok"] != json!(true)) {
        assert_eq!(t["code"], json!("ResourceExhausted"), "{out}");
        let m = t["message"].as_str().unwrap_or_default();
        assert!(m.contains("ranks.max_ranks_per_uid = 8"), "{out}");
    }
    assert!(p99 < HEALTH_P99, "p99 {p99:?} during the rank-slot flood");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_uids_open_requests_are_capped_over_all_its_connections() {
    let _one = ONE_FLOOD.lock().await;
    let agent = agent_with("[api]\nmax_requests_per_uid = 8\n", None);
    let rel = release(&agent, "requests");
    let attack = spawn_attack(
        &users::users().member,
        "floods.requests",
        json!({"socket": agent.socket(), "n": 20, "release": rel}),
    );
    // Held: the member's streams past its cap have been refused.
    eventually(Duration::from_secs(60), "the request flood", || async {
        let (_, text) = crate::common::scrape(&agent).await;
        (metric(&text, "warden_api_refused_total", &[("call", "any")]) >= 12.0).then_some(())
    })
    .await;
    // Root is an admin: not held to it, beside the member's 8.
    let mut watches = Vec::new();
    for _ in 0..10 {
        let mut c = agent.client().await;
        let s = within(
            WAIT,
            "WatchHealth",
            c.watch_health(pb::WatchHealthRequest {}),
        )
        .await
        .expect("root's stream past the member's cap");
        watches.push(s.into_inner());
    }
    let p99 = health_p99(&agent, "the request flood").await;
    std::fs::write(&rel, b"").expect("release");
    let out = within(Duration::from_secs(90), "the attack", attack)
        .await
        .expect("the attack")
        .result;
    println!("request flood: {out}");
    assert_eq!(out["held"], json!(8), "{out}");
    let refused = out["refused"].as_array().expect("refused");
    assert_eq!(refused.len(), 12, "{out}");
    for r in refused {
        assert_eq!(r["code"], json!("ResourceExhausted"), "{out}");
        let m = r["message"].as_str().unwrap_or_default();
        assert!(m.contains("api.max_requests_per_uid = 8"), "{out}");
    }
    assert!(p99 < HEALTH_P99, "p99 {p99:?} during the request flood");
}
