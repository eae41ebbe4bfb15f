//! System tests of the Slurm integration against a real Slurm: Debian's
//! slurmctld and slurmd (and munged, with its own key) started by the test
//! on this machine, this host its one node, everything in a scratch
//! directory (tests/run-all.sh installs them: tests/system-deps.sh slurm).
//!
//! - A real wardend with `[slurm] enabled` that cordons the node (a
//!   simulated XID 79) drains it in slurmctld with a reason naming the
//!   incident; a job cannot start there; `warden uncordon` makes it IDLE.
//! - deploy/slurm/prolog.sh and epilog.sh, run directly and as slurmd's
//!   Prolog and Epilog: a healthy agent lets a batch job run, a cordoned one
//!   refuses it (slurmd drains the node, the job does not run) with a message.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    Finished, MEMORY_NEVER_LOW, TestAgent, WAIT, WARDEN, XID79_AT_START, eventually, free_port,
    repo_root, run,
};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// How long the daemons may take to come up and register the node, and
/// Slurm to act on a request, on a loaded 2-core machine.
const SLURM_WAIT: Duration = Duration::from_secs(60);

/// The Slurm daemons the tests need, with what to install when missing.
fn require_binaries() {
    for bin in ["munged", "slurmctld", "slurmd", "scontrol", "sbatch"] {
        let found = std::env::var_os("PATH").is_some_and(|p| {
            std::env::split_paths(&p)
                .chain([PathBuf::from("/usr/sbin")])
                .any(|d| d.join(bin).is_file())
        });
        assert!(
            found,
            "no `{bin}`: install Debian's slurmctld slurmd slurm-client munge \
             (bash tests/system-deps.sh slurm; tests/run-all.sh does)"
        );
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "the Slurm tests run slurmd (SlurmdUser root) and must run as root"
    );
}

/// This host's name as Slurm's NodeName: up to its first dot.
fn short_host() -> String {
    let host = nix::unistd::gethostname().unwrap().into_string().unwrap();
    host.split('.').next().unwrap().to_owned()
}

/// A one-node Slurm cluster on this host, in a scratch directory: munged
/// with its own key and socket, slurmctld and slurmd on free ports. Every
/// daemon runs in its own process group, killed on drop.
struct Cluster {
    dir: tempfile::TempDir,
    conf: PathBuf,
    node: String,
    daemons: Vec<Child>,
}

impl Cluster {
    /// Starts the cluster, with `prolog` and `epilog` as slurmd's scripts,
    /// and waits until the node is IDLE.
    fn start(prolog_epilog: Option<(&Path, &Path)>) -> Self {
        require_binaries();
        let dir = tempfile::Builder::new()
            .prefix("warden-slurm-")
            .tempdir()
            .unwrap();
        let d = dir.path().to_owned();
        for sub in ["munge", "state", "spool", "log"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        // munged refuses a key or a directory others could read.
        std::fs::set_permissions(d.join("munge"), std::fs::Permissions::from_mode(0o700)).unwrap();
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key)
            .unwrap();
        std::fs::write(d.join("munge/key"), key).unwrap();
        std::fs::set_permissions(d.join("munge/key"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        let node = short_host();
        let scripts = prolog_epilog
            .map(|(p, e)| format!("Prolog={}\nEpilog={}\n", p.display(), e.display()))
            .unwrap_or_default();
        let conf = d.join("slurm.conf");
        let p = |s: &str| d.join(s).display().to_string();
        std::fs::write(
            &conf,
            format!(
                "ClusterName=wardentest\n\
                 SlurmctldHost={node}(127.0.0.1)\n\
                 SlurmctldPort={ctld}\n\
                 SlurmdPort={slurmd}\n\
                 SlurmUser=root\n\
                 SlurmdUser=root\n\
                 AuthType=auth/munge\n\
                 AuthInfo=socket={sock}\n\
                 CredType=cred/munge\n\
                 StateSaveLocation={state}\n\
                 SlurmdSpoolDir={spool}\n\
                 SlurmctldPidFile={ctld_pid}\n\
                 SlurmdPidFile={slurmd_pid}\n\
                 SlurmctldLogFile={ctld_log}\n\
                 SlurmdLogFile={slurmd_log}\n\
                 ProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\n\
                 JobAcctGatherType=jobacct_gather/none\n\
                 AccountingStorageType=accounting_storage/none\n\
                 SchedulerType=sched/builtin\n\
                 SelectType=select/cons_tres\n\
                 MpiDefault=none\n\
                 ReturnToService=2\n\
                 {scripts}\
                 NodeName={node} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN\n\
                 PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP\n",
                ctld = free_port("127.0.0.1"),
                slurmd = free_port("127.0.0.1"),
                sock = p("munge/sock"),
                state = p("state"),
                spool = p("spool"),
                ctld_pid = p("slurmctld.pid"),
                slurmd_pid = p("slurmd.pid"),
                ctld_log = p("log/slurmctld.log"),
                slurmd_log = p("log/slurmd.log"),
            ),
        )
        .unwrap();
        let mut cluster = Self {
            conf,
            node,
            daemons: Vec::new(),
            dir,
        };
        cluster.daemon(
            "munged",
            &[
                "--foreground",
                "--force",
                &format!("--socket={}", p("munge/sock")),
                &format!("--key-file={}", p("munge/key")),
                &format!("--log-file={}", p("log/munged.log")),
                &format!("--pid-file={}", p("munge/pid")),
                &format!("--seed-file={}", p("munge/seed")),
            ],
        );
        let sock = cluster.dir.path().join("munge/sock");
        cluster.wait("munged's socket", || sock.exists().then_some(()));
        let conf = cluster.conf.display().to_string();
        cluster.daemon("slurmctld", &["-D", "-i", "-f", &conf]);
        cluster.daemon("slurmd", &["-D", "-f", &conf]);
        cluster.wait_state("the node IDLE", |s| s == "IDLE");
        cluster
    }

    fn daemon(&mut self, program: &str, args: &[&str]) {
        use std::os::unix::process::CommandExt;
        let out = self.dir.path().join(format!("log/{program}.out"));
        let child = Command::new(program)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&out).unwrap())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        self.daemons.push(child);
    }

    /// The daemons' logs, for a failure message.
    fn logs(&self) -> String {
        let mut all = String::new();
        for name in [
            "munged.out",
            "slurmctld.out",
            "slurmd.out",
            "slurmctld.log",
            "slurmd.log",
        ] {
            let text =
                std::fs::read_to_string(self.dir.path().join("log").join(name)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            all.push_str(&format!("--- {name} ---\n"));
            for l in tail.into_iter().rev() {
                all.push_str(l);
                all.push('\n');
            }
        }
        all
    }

    /// A Slurm client command against this cluster.
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `scontrol show node` on one line.
    fn show_node(&self) -> String {
        run(
            self.cmd("scontrol")
                .args(["show", "node", &self.node, "--oneliner"]),
            WAIT,
        )
        .stdout
    }

    /// The node's State= and Reason= (without its `[user@time]`).
    fn state_and_reason(&self) -> (String, String) {
        let shown = self.show_node();
        let state = shown
            .split_whitespace()
            .find_map(|w| w.strip_prefix("State="))
            .unwrap_or_default()
            .to_owned();
        let reason = shown
            .find(" Reason=")
            .map(|i| shown[i + " Reason=".len()..].trim_end())
            .map(|r| r.rsplit_once(" [").map_or(r, |(r, _)| r).to_owned())
            .unwrap_or_default();
        (state, reason)
    }

    /// Polls `check` until it answers, failing with the daemons' logs.
    fn wait<T>(&self, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + SLURM_WAIT;
        loop {
            if let Some(v) = check() {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {SLURM_WAIT:?} waiting for {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the node's State= satisfies `ok`; returns (state, reason).
    fn wait_state(&self, what: &str, ok: impl Fn(&str) -> bool) -> (String, String) {
        self.wait(what, || {
            let (s, r) = self.state_and_reason();
            ok(&s).then_some((s, r))
        })
    }

    /// `sbatch --wrap COMMAND`: the job id.
    fn sbatch(&self, command: &str) -> String {
        let out = run(
            self.cmd("sbatch")
                .args(["--parsable", "-N1", "-o", "/dev/null", "--wrap", command]),
            WAIT,
        );
        assert_eq!(out.code(), 0, "sbatch: {out:?}\n{}", self.logs());
        out.stdout.trim().to_owned()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // slurmd first: the job steps it started are in its group.
        for child in self.daemons.iter_mut().rev() {
            if let Ok(pgid) = i32::try_from(child.id()) {
                let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// Runs one of deploy/slurm's scripts as slurmd would (a job id and the
/// node's name in the environment), against `socket`.
fn script(name: &str, socket: &Path, node: &str) -> Finished {
    run(
        Command::new(repo_root().join("deploy/slurm").join(name))
            .env_clear()
            .env("SLURM_JOB_ID", "4242")
            .env("SLURMD_NODENAME", node)
            .env("WARDEN", WARDEN)
            .env("WARDEN_SOCKET", socket)
            .env("WARDEN_SLURM_DEFAULTS", "/nonexistent"),
        WAIT,
    )
}

/// A wrapper that runs deploy/slurm's `name` with the agent's socket, as a
/// site's /etc/default/warden-slurm would set it (slurmd gives its scripts
/// a bare environment).
fn wrapper(dir: &Path, name: &str, socket: &Path) -> PathBuf {
    let path = dir.join(format!("wrap-{name}"));
    let defaults = dir.join(format!("defaults-{name}"));
    std::fs::write(
        &defaults,
        format!("WARDEN={}\nWARDEN_SOCKET={}\n", WARDEN, socket.display()),
    )
    .unwrap();
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nWARDEN_SLURM_DEFAULTS={} exec {}\n",
            defaults.display(),
            repo_root().join("deploy/slurm").join(name).display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn xid79(dir: &Path) -> String {
    let scenario = dir.join("xid79.toml");
    std::fs::write(&scenario, XID79_AT_START).unwrap();
    scenario.display().to_string()
}

#[tokio::test]
async fn a_cordon_drains_the_node_and_uncordon_resumes_it() {
    let cluster = Cluster::start(None);
    let conf = cluster.conf.display().to_string();
    let scenario = xid79(cluster.dir.path());
    let agent = TestAgent::start_with(
        &format!(
            "{MEMORY_NEVER_LOW}[slurm]\nenabled = true\nnode_name = \"{}\"\n",
            cluster.node
        ),
        &[
            ("WARDEN_SIMULATE", scenario.as_str()),
            ("SLURM_CONF", conf.as_str()),
        ],
    );

    let (state, reason) =
        cluster.wait_state("the node drained by the agent", |s| s.contains("DRAIN"));
    let inc = eventually(WAIT, "the cordon's incident", async || {
        agent
            .events()
            .await
            .into_iter()
            .find(|e| e.kind == "node.cordoned")
            .and_then(|e| common::evidence(&e, "incident").map(str::to_owned))
    })
    .await;
    assert!(
        reason.starts_with(&format!("warden: {inc} ")),
        "State={state} Reason={reason:?} should name {inc}\n{}",
        agent.stderr()
    );
    let drained = eventually(WAIT, "a slurm.drained event", async || {
        agent
            .events()
            .await
            .into_iter()
            .find(|e| e.kind == "slurm.drained")
    })
    .await;
    assert_eq!(common::evidence(&drained, "incident"), Some(inc.as_str()));

    // No job starts on a drained node.
    let marker = cluster.dir.path().join("ran-while-drained");
    let out = run(
        cluster
            .cmd("srun")
            .args(["-N1", "--immediate=2", "touch", marker.to_str().unwrap()]),
        WAIT,
    );
    assert_ne!(out.code(), 0, "srun ran on a drained node: {out:?}");
    assert!(!marker.exists(), "the job ran on a drained node");

    // Lifted by a person: Slurm gets the node back.
    let out = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["uncordon", "--reason", "GPU 0 reseated"]),
        WAIT,
    );
    assert_eq!(out.code(), 0, "{out:?}");
    cluster.wait_state("the node IDLE after uncordon", |s| s == "IDLE");
    let resumed = eventually(WAIT, "a slurm.resumed event", async || {
        agent
            .events()
            .await
            .into_iter()
            .find(|e| e.kind == "slurm.resumed")
    })
    .await;
    let why = common::evidence(&resumed, "why").unwrap_or_default();
    assert!(why.contains("GPU 0 reseated"), "{resumed:?}");
    assert!(
        !agent
            .events()
            .await
            .iter()
            .any(|e| e.kind == "slurm.failed"),
        "{}",
        agent.stderr()
    );
}

#[tokio::test]
async fn the_prolog_refuses_a_cordoned_node_and_accepts_a_healthy_one() {
    let healthy = TestAgent::start(MEMORY_NEVER_LOW);
    let scratch = tempfile::tempdir().unwrap();
    let scenario = xid79(scratch.path());
    // The cordoned agent does not drain the node itself ([slurm] off): the
    // prolog alone keeps the job off.
    let cordoned =
        TestAgent::start_with(MEMORY_NEVER_LOW, &[("WARDEN_SIMULATE", scenario.as_str())]);
    let node = short_host();

    // Run directly, as slurmd runs it.
    for name in ["prolog.sh", "epilog.sh"] {
        let out = script(name, healthy.socket(), &node);
        assert_eq!(out.code(), 0, "{name} on a healthy node: {out:?}");
    }
    // A FAILED GPU is refused at once; the cordon follows its decision.
    let out = eventually(WAIT, "the prolog to refuse the cordoned node", async || {
        let out = script("prolog.sh", cordoned.socket(), &node);
        out.stderr.contains("CORDONED").then_some(out)
    })
    .await;
    assert_eq!(out.code(), 1, "{out:?}");
    assert!(
        out.stderr.contains("refusing job 4242") && out.stderr.contains(&node),
        "{out:?}"
    );
    let out = script("epilog.sh", cordoned.socket(), &node);
    assert_eq!(out.code(), 1, "{out:?}");
    assert!(out.stderr.contains("unhealthy after job 4242"), "{out:?}");
    // No agent: accepted by default, refused when the site says so.
    let gone = scratch.path().join("no-agent.sock");
    let out = script("prolog.sh", &gone, &node);
    assert_eq!(out.code(), 0, "{out:?}");
    assert!(out.stderr.contains("did not answer"), "{out:?}");

    // As slurmd's Prolog and Epilog: a healthy agent lets the job run.
    let prolog = wrapper(scratch.path(), "prolog.sh", healthy.socket());
    let epilog = wrapper(scratch.path(), "epilog.sh", healthy.socket());
    let cluster = Cluster::start(Some((&prolog, &epilog)));
    let ran = scratch.path().join("ran-on-healthy");
    cluster.sbatch(&format!("touch {}", ran.display()));
    cluster.wait("the job on the healthy node", || ran.exists().then_some(()));
    // The epilog passed too: the node is back to IDLE, not drained.
    let (state, reason) = cluster.wait_state("the node IDLE after the job", |s| {
        s == "IDLE" || s.contains("DRAIN")
    });
    assert_eq!(state, "IDLE", "Reason={reason:?}");

    // The same node behind a cordoned agent: the prolog refuses the job,
    // slurmd drains the node, and the job does not run.
    wrapper(scratch.path(), "prolog.sh", cordoned.socket());
    let refused = scratch.path().join("ran-on-cordoned");
    let job = cluster.sbatch(&format!("touch {}", refused.display()));
    let (state, reason) = cluster.wait_state("the prolog's drain", |s| s.contains("DRAIN"));
    assert!(
        reason.contains("Prolog"),
        "State={state} Reason={reason:?}\n{}",
        cluster.logs()
    );
    assert!(!refused.exists(), "job {job} ran on a cordoned node");
    let _ = run(cluster.cmd("scancel").arg(&job), WAIT);
}
