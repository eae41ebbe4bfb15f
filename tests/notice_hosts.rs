//! A notice of a coming stop on one host of a multi-host job (issue 32):
//! a real etcd, two real `warden run` launchers as host-a (127.0.0.2) and
//! host-b (127.0.0.3), each with its own embedded agent and checkpoint
//! tier, and real torch ranks (tests/fixtures/notice_train.py --lockstep) kept in
//! lockstep by a gloo all_reduce at every step, as a data-parallel job's
//! are. Only host-a's launcher gets the scheduler's SIGTERM
//! (`--term-grace`): its agent names a step far enough ahead, host-a
//! publishes it in etcd, host-b's launcher reads it from its watch and
//! tells its agent; every rank of both hosts saves that same step, both
//! launchers exit 85, and the next run of both hosts resumes at the step
//! after it.
//!
//! The same over torch's c10d rendezvous (no etcd): the notice goes
//! through torch's store at the endpoint; the agents are each other's
//! checkpoint peers by their config, as c10d rounds name none.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use common::{Streaming, WARDEN, python, repo_root};
use nix::sys::signal::Signal;

/// Any one wait on a loaded 2-core machine (4 torch ranks, 2 agents, etcd).
const WAIT: Duration = Duration::from_secs(180);
/// `--term-grace`: the scheduler's SIGTERM to SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(40);

const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [straggler]\nenabled = false\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n[dcgm]\nenabled = false\n";

/// How the hosts meet.
#[derive(Clone, Copy)]
enum Rdzv<'a> {
    /// Through etcd: rounds, and the checkpoint peers they name.
    Etcd(&'a EtcdServer),
    /// Through torch's c10d store at host-a's address and this port.
    C10d(u16),
}

/// One host: its scratch directory (logs, agent config, tier, summary).
struct Host {
    dir: tempfile::TempDir,
    id: &'static str,
    addr: &'static str,
}

impl Host {
    fn new(id: &'static str, addr: &'static str) -> Self {
        Self::with_api(id, addr, &format!("{addr}:0"), "")
    }

    /// A host whose agent listens at `api` (`ip:port`), with `peers` (TOML
    /// `[[checkpoint.peers]]` tables) added to its config.
    fn with_api(id: &'static str, addr: &'static str, api: &str, peers: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-noticeh-")
            .tempdir()
            .unwrap();
        let toml = format!(
            "{}[api]\ntcp = \"{api}\"\n{}[checkpoint]\ndir = {:?}\ndomain = \"{id}\"\n{peers}",
            AGENT_TOML.replacen("[agent]\n", &format!("[agent]\nhost_name = \"{id}\"\n"), 1),
            common::pki::api_keys(id),
            dir.path().join("tier").display().to_string()
        );
        std::fs::write(dir.path().join("agent.toml"), toml).unwrap();
        Self { dir, id, addr }
    }

    /// Two hosts whose agents are each other's checkpoint peers by config.
    fn peered() -> (Self, Self) {
        let apis = [
            format!("127.0.0.2:{}", common::free_port("127.0.0.2")),
            format!("127.0.0.3:{}", common::free_port("127.0.0.3")),
        ];
        let peer = |id: &str, api: &str| {
            format!("[[checkpoint.peers]]\naddr = \"{api}\"\ndomain = \"{id}\"\nname = \"{id}\"\n")
        };
        (
            Self::with_api("host-a", "127.0.0.2", &apis[0], &peer("host-b", &apis[1])),
            Self::with_api("host-b", "127.0.0.3", &apis[1], &peer("host-a", &apis[0])),
        )
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `warden run` of 2 lockstep ranks on this host, in the background.
    fn launch(&self, rdzv: Rdzv<'_>, job: &str, run: u32, train: &[&str]) -> Streaming {
        let grace = format!("{}s", TERM_GRACE.as_secs());
        let mut cmd = Command::new(WARDEN);
        cmd.arg("--socket")
            .arg(self.path().join("no-agent-here.sock"))
            .arg("run")
            .args(["--nproc-per-node", "2", "--nnodes", "2"]);
        match rdzv {
            Rdzv::Etcd(etcd) => cmd
                .args(["--rdzv-backend", "etcd", "--rdzv-endpoint", &etcd.endpoint])
                .args(["--rdzv-id", job, "--host-id", self.id])
                .args(["--advertise-addr", self.addr, "--rdzv-lease-ttl", "3s"])
                .args(["--rdzv-conf", "join_timeout=90,last_call_timeout=3"]),
            Rdzv::C10d(port) => cmd
                .args(["--rdzv-backend", "c10d"])
                .args(["--rdzv-endpoint", &format!("127.0.0.2:{port}")])
                .args(["--rdzv-id", job, "--local-addr", self.addr])
                .args([
                    "--rdzv-conf",
                    "join_timeout=180,last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3",
                ]),
        };
        cmd.args(["--term-grace", &grace])
            .arg("--log-dir")
            .arg(self.path().join(format!("logs-{run}")))
            .arg("--agent-config")
            .arg(self.path().join("agent.toml"))
            .arg("--summary-json")
            .arg(self.path().join(format!("summary-{run}.json")))
            .arg("--")
            .arg(python())
            .arg(repo_root().join("tests/fixtures/notice_train.py"))
            .arg("--lockstep")
            // 50 ms steps: the lead (2 s) is 40 steps, well before step 200.
            .args(["--every", "100", "--step-ms", "50"])
            .args(train)
            .current_dir(self.path());
        for var in ["WARDEN_SOCKET", "WARDEN_JOB_ID"] {
            cmd.env_remove(var);
        }
        let mut s = Streaming::spawn(&mut cmd, self.path().join(format!("launcher-{run}.stderr")));
        s.label = format!("{} run {run}", self.id);
        s
    }
}

/// The value of `key=` in a line.
fn value(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    line[at..].split_whitespace().next()?.parse().ok()
}

/// Waits until both of the host's ranks printed a line with `what`
/// (lines read before count); returns them.
fn both(l: &mut Streaming, what: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut ranks: Vec<String> = Vec::new();
    let rank_of = |x: &str| x.split(']').next().unwrap_or("").to_owned();
    for x in l.seen.clone() {
        if x.contains(what) && !ranks.contains(&rank_of(&x)) {
            ranks.push(rank_of(&x));
            found.push(x);
        }
    }
    while found.len() < 2 {
        let line = l.wait_line(WAIT, what, |x| x.contains(what));
        if !ranks.contains(&rank_of(&line)) {
            ranks.push(rank_of(&line));
            found.push(line);
        }
    }
    found
}

#[test]
fn a_notice_on_one_host_makes_every_rank_of_every_host_save_one_step_and_exit_85() {
    let etcd = EtcdServer::start();
    let a = Host::new("host-a", "127.0.0.2");
    let b = Host::new("host-b", "127.0.0.3");
    notice_on_host_a(&a, &b, Rdzv::Etcd(&etcd), "t-notice-hosts");
}

/// The same job met through torch's c10d rendezvous, with no etcd: the
/// notice's step goes through torch's store at the endpoint.
#[test]
fn a_notice_spreads_through_torchs_c10d_store_too() {
    let (a, b) = Host::peered();
    let port = common::free_port_below_ephemeral("127.0.0.2");
    notice_on_host_a(&a, &b, Rdzv::C10d(port), "t-notice-c10d");
}

/// Both hosts run `job`; host-a alone gets the scheduler's SIGTERM; every
/// rank saves one step, both exit 85, and the next run resumes after it.
fn notice_on_host_a(a: &Host, b: &Host, rdzv: Rdzv<'_>, job: &str) {
    let mut la = a.launch(rdzv, job, 1, &[]);
    let mut lb = b.launch(rdzv, job, 1, &[]);
    for l in [&mut la, &mut lb] {
        for s in both(l, "start step=") {
            assert_eq!(value(&s, "step"), Some(0), "{s}");
            assert!(s.contains("world=4"), "{s}");
        }
    }
    both(&mut la, "saved step=100 ");
    la.wait_line(WAIT, "step 110", |x| x.contains("] step 110"));

    // The scheduler's SIGTERM reaches host-a alone.
    let noticed_at = Instant::now();
    la.signal(Signal::SIGTERM);
    let mut steps = Vec::new();
    for l in [&mut la, &mut lb] {
        for s in both(l, "saved on notice step=") {
            steps.push(value(&s, "step").unwrap());
        }
    }
    assert!(
        steps.iter().all(|s| *s == steps[0]),
        "every rank of both hosts saves the same step: {steps:?}"
    );
    let step = steps[0];
    assert!(
        step > 110 && step < 200,
        "the notice's step {step} is between the checkpoints"
    );
    for l in [&mut la, &mut lb] {
        let status = l.wait_exit(WAIT);
        assert_eq!(status.code(), Some(85), "{}: {}", l.label, l.stderr());
    }
    let took = noticed_at.elapsed();
    assert!(
        took < TERM_GRACE,
        "the job stopped {took:?} after the notice: past the window"
    );
    println!(
        "notice on host-a to both launchers' exit in {} ms (saved step {step})",
        took.as_millis()
    );
    assert!(
        la.stderr().contains(&format!(
            "told the job's other hosts of the notice: every rank saves at step {step}"
        )),
        "{}",
        la.stderr()
    );
    // etcd names a host by its id, torch's rendezvous by its address.
    assert!(
        [a.id, a.addr]
            .iter()
            .any(|h| lb.stderr().contains(&format!("host {h} got a notice"))),
        "{}",
        lb.stderr()
    );
    for h in [a, b] {
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(h.path().join("summary-1.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(summary["exit_code"], 85, "{}: {summary:#}", h.id);
        assert!(
            summary["outcome"]
                .as_str()
                .unwrap()
                .starts_with("preempted: every worker saved"),
            "{}: {summary:#}",
            h.id
        );
    }

    // The requeued job: both hosts resume at the step after the notice's.
    let end = (step + 20).to_string();
    let mut la = a.launch(rdzv, job, 2, &["--steps", &end]);
    let mut lb = b.launch(rdzv, job, 2, &["--steps", &end]);
    for l in [&mut la, &mut lb] {
        for s in both(l, "start step=") {
            assert_eq!(
                value(&s, "step"),
                Some(step + 1),
                "resumed after the notice's step {step}: {s}"
            );
        }
    }
    for l in [&mut la, &mut lb] {
        both(l, "done");
        assert_eq!(
            l.wait_exit(WAIT).code(),
            Some(0),
            "{}: {}",
            l.label,
            l.stderr()
        );
    }
}
