//! System tests in a real container engine (docker): the images
//! deploy/build-image.sh builds from the binaries under test, run the way
//! the deployment files run them.
//!
//! - The runtime image serves grpc.health.v1 through a socket in a shared
//!   volume, `warden health` answers from another container, the gRPC probe
//!   port answers inside the agent's network namespace, and the DaemonSet's
//!   init container installs a `warden health --plugin` that runs from a
//!   container holding nothing else (node-problem-detector's case).
//! - A "pod" as Kubernetes makes one: a pause container owning the network
//!   and PID namespaces, a wardend sidecar and a trainer container joining
//!   them (`--network container:`, `--pid container:`), the socket and the
//!   checkpoint tier in shared memory-backed volumes. The trainer runs
//!   `warden run -- python3 /app/train.py`: heartbeats, a hang detected and
//!   recovered; the sidecar killed mid-job and started again: training goes
//!   on and the ranks re-register.
//! - What the agent cannot see: a sidecar outside the trainer's PID
//!   namespace reports ranks/pid_visibility UNKNOWN; a node agent in the
//!   host's PID namespace (the DaemonSet) sees a pod's ranks and their
//!   launcher recognises them.
//!
//! No registry is used (the images are imported, nothing is pulled) and no
//! network: every container runs with `--network none` or in the pause
//! container's namespace. A missing engine fails the tests: run
//! `bash tests/system-deps.sh container` (tests/run-all.sh does).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::manifests::{container, object};
use common::{Finished, Streaming, WARDEND, python, repo_root, run};
use serde_json::Value;

/// One docker command (a `docker run` of a short job included).
const DOCKER: Duration = Duration::from_secs(120);
/// How long the agent or a rank may take to show up.
const WAIT: Duration = Duration::from_secs(30);
/// A whole training run in the trainer container.
const JOB: Duration = Duration::from_secs(120);

/// The agent's config in the sidecar tests: fast ticks, hang thresholds of
/// about a second once calibrated (as tests/launcher.rs), no host memory
/// verdicts (a busy test machine).
const SIDECAR_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [hang]\nfloor = \"1s\"\nwarmup_samples = 5\n\
    [checkpoint]\ndir = \"/ckpt/tier\"\nkeep_steps = 100\n";

/// The sidecar's securityContext in deploy/kubernetes/training-job.yaml,
/// as docker options: every capability dropped, a read-only root, its
/// state in a volume of its own (the emptyDir `state`).
const SIDECAR_SECURITY: &[&str] = &[
    "--cap-drop",
    "ALL",
    "--read-only",
    "--tmpfs",
    "/var/lib/warden:uid=65532,gid=65532,mode=0750",
];

/// The images under test, built once per test run from the binaries cargo
/// built for it: (runtime, trainer).
fn images() -> &'static (String, String) {
    static IMAGES: OnceLock<(String, String)> = OnceLock::new();
    IMAGES.get_or_init(|| {
        let info = run(Command::new("docker").arg("info"), DOCKER);
        assert!(
            info.status.success(),
            "no container engine answers `docker info`: run `bash tests/system-deps.sh container` \
             as root (it installs Debian's docker.io and starts dockerd; tests/run-all.sh does)\n{}",
            info.stderr
        );
        let (runtime, trainer) = ("warden-test:latest", "warden-test-trainer:latest");
        let bin_dir = Path::new(WARDEND).parent().unwrap();
        let out = run(
            Command::new("bash")
                .arg(repo_root().join("deploy/build-image.sh"))
                .arg("--bin-dir")
                .arg(bin_dir)
                .args(["--tag", runtime, "--trainer", trainer, "--python"])
                .arg(python()),
            Duration::from_secs(300),
        );
        assert!(out.status.success(), "build-image.sh: {}{}", out.stdout, out.stderr);
        (runtime.to_owned(), trainer.to_owned())
    })
}

fn docker(args: &[&str]) -> Finished {
    run(Command::new("docker").args(args), DOCKER)
}

/// `docker ARGS`, which must succeed; its stdout.
fn docker_ok(args: &[&str]) -> String {
    let out = docker(args);
    assert!(
        out.status.success(),
        "docker {args:?}: {:?}\n{}{}",
        out.status,
        out.stdout,
        out.stderr
    );
    out.stdout
}

/// Polls `f` until it returns Some, every 200 ms; fails the test at the
/// deadline with `what` and the last thing `f` saw.
fn eventually<T>(what: &str, mut f: impl FnMut(&mut String) -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        if let Some(v) = f(&mut last) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {WAIT:?} waiting for {what}; last seen:\n{last}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Containers and volumes of one test, named after it, removed when dropped.
struct Pod {
    prefix: String,
    containers: Vec<String>,
    volumes: Vec<String>,
    scratch: tempfile::TempDir,
}

impl Pod {
    fn new(test: &str) -> Self {
        let prefix = format!("wt{}-{test}", std::process::id());
        let scratch = tempfile::Builder::new()
            .prefix("warden-container-")
            .tempdir()
            .unwrap();
        Self {
            prefix,
            containers: Vec::new(),
            volumes: Vec::new(),
            scratch,
        }
    }

    fn name(&self, what: &str) -> String {
        format!("{}-{what}", self.prefix)
    }

    /// A memory-backed volume owned by the images' user, as an emptyDir
    /// with `medium: Memory` and `fsGroup: 65532`.
    fn volume(&mut self, what: &str) -> String {
        self.volume_owned(what, "uid=65532,gid=65532,mode=0770")
    }

    /// A memory-backed volume with the owner and mode `o` (tmpfs options).
    fn volume_owned(&mut self, what: &str, o: &str) -> String {
        let name = self.name(what);
        let options = format!("o=size=64m,{o}");
        docker_ok(&[
            "volume",
            "create",
            "--driver",
            "local",
            "--opt",
            "type=tmpfs",
            "--opt",
            "device=tmpfs",
            "--opt",
            &options,
            &name,
        ]);
        self.volumes.push(name.clone());
        name
    }

    /// `docker run -d --name <prefix>-<what> ARGS`: its name.
    fn start(&mut self, what: &str, args: &[&str]) -> String {
        let name = self.name(what);
        let mut all = vec!["run", "-d", "--name", &name];
        all.extend_from_slice(args);
        docker_ok(&all);
        self.containers.push(name.clone());
        name
    }

    /// The pause container: owns the network (none) and PID namespaces the
    /// others join, as a pod's infrastructure container does.
    fn pause(&mut self) -> String {
        let image = images().0.clone();
        self.start(
            "pause",
            &[
                "--network",
                "none",
                "--entrypoint",
                "/bin/busybox",
                &image,
                "sleep",
                "100000",
            ],
        )
    }

    /// The `docker run` arguments that put a container in the pod's network
    /// and PID namespaces (the pause container, started here).
    fn shared_namespaces(&mut self) -> [String; 2] {
        let pause = self.pause();
        [
            format!("--network=container:{pause}"),
            format!("--pid=container:{pause}"),
        ]
    }

    /// The agent's config in a directory mounted read-only at /etc/warden.
    fn config(&self, toml: &str) -> String {
        let dir = self.scratch.path().join("etc");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("wardend.toml"), toml).unwrap();
        format!("{}:/etc/warden:ro", dir.display())
    }

    /// A wardend container named `what` with `config`, the socket volume at
    /// /run/warden, the namespace options `ns`; waits until it answers.
    fn agent(&mut self, what: &str, ns: &[&str], socket: &str, config: &str) -> String {
        let image = images().0.clone();
        let socket_mount = format!("{socket}:/run/warden");
        let mut args: Vec<&str> = ns.to_vec();
        args.extend_from_slice(&[
            "-v",
            &socket_mount,
            "-v",
            config,
            &image,
            "--config",
            "/etc/warden/wardend.toml",
        ]);
        let name = self.start(what, &args);
        wait_serving(&name);
        name
    }

    /// Everything a finished trainer container printed on stdout (what a
    /// [`Streaming`] read is only what the test waited for).
    fn stdout(&self, t: &Streaming) -> String {
        let name = t.label.rsplit(' ').next().unwrap();
        let out = docker(&["logs", name]);
        assert!(out.status.success(), "docker logs {name}: {}", out.stderr);
        out.stdout
    }

    /// A volume on disk that outlives its containers, as a hostPath.
    fn disk_volume(&mut self, what: &str) -> String {
        let name = self.name(what);
        docker_ok(&["volume", "create", &name]);
        self.volumes.push(name.clone());
        name
    }

    fn logs(&self, container: &str) -> String {
        let out = docker(&["logs", container]);
        format!("{}{}", out.stdout, out.stderr)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if !self.containers.is_empty() {
            let mut args = vec!["rm", "-f", "-v"];
            args.extend(self.containers.iter().map(String::as_str));
            let _ = run(Command::new("docker").args(&args), DOCKER);
        }
        for v in &self.volumes {
            let _ = run(
                Command::new("docker").args(["volume", "rm", "-f", v]),
                DOCKER,
            );
        }
    }
}

/// Waits until `warden info` answers inside the agent's container.
fn wait_serving(agent: &str) {
    eventually(&format!("wardend in {agent} to answer"), |last| {
        let out = docker(&["exec", agent, "warden", "info"]);
        *last = format!("{}{}", out.stdout, out.stderr);
        out.status.success().then_some(())
    });
}

/// `warden --json ARGS` run in the agent's container, parsed.
fn warden_json(agent: &str, args: &[&str]) -> Value {
    let mut all = vec!["exec", agent, "warden", "--json"];
    all.extend_from_slice(args);
    serde_json::from_str(&docker_ok(&all)).expect("warden --json prints JSON")
}

/// The agent's events, oldest first (`warden events --json`: one per line).
fn events(agent: &str) -> Vec<Value> {
    docker_ok(&[
        "exec", agent, "warden", "--json", "events", "--limit", "1000",
    ])
    .lines()
    .map(|l| serde_json::from_str(l).expect("an event as JSON"))
    .collect()
}

fn component<'a>(health: &'a Value, id: &str) -> Option<&'a Value> {
    health["components"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
}

/// Registered ranks of `job` as (rank, pid, steps completed).
fn ranks(agent: &str, job: &str) -> Vec<(u64, u64, u64)> {
    warden_json(agent, &["ranks", "--job", job])["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["state"] == "running" || r["state"] == "hung")
        .map(|r| {
            (
                r["global_rank"].as_u64().unwrap(),
                r["pid"].as_u64().unwrap(),
                r["steps_completed"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// `docker run` of the trainer image in the pod, attached, read line by
/// line: `warden run --agent local --nproc-per-node 2 --rdzv-id JOB --
/// python3 /app/train.py --ckpt-dir /ckpt/JOB TRAIN...`.
fn trainer(
    pod: &mut Pod,
    ns: &[&str],
    socket: &str,
    ckpt: &str,
    job: &str,
    train: &[&str],
) -> Streaming {
    let name = pod.name(&format!("trainer-{job}"));
    pod.containers.push(name.clone());
    let socket_mount = format!("{socket}:/run/warden");
    let ckpt_mount = format!("{ckpt}:/ckpt");
    let ckpt_dir = format!("/ckpt/{job}");
    let mut cmd = Command::new("docker");
    // The trainer's securityContext in training-job.yaml: no capabilities.
    cmd.args(["run", "--name", &name, "--cap-drop", "ALL"])
        .args(ns)
        .args(["-v", &socket_mount, "-v", &ckpt_mount, &images().1])
        .args([
            "--agent",
            "local",
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            job,
        ])
        .args(["--", "python3", "/app/train.py", "--ckpt-dir", &ckpt_dir])
        .args(train);
    let mut s = Streaming::spawn(&mut cmd, pod.scratch.path().join(format!("{job}.stderr")));
    s.label = format!("trainer container {name}");
    s
}

/// Steps N of `[rank R] step N loss L` lines.
fn step_of(line: &str, rank: u32) -> Option<u64> {
    line.strip_prefix(&format!("[rank {rank}] step "))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn the_image_serves_health_through_a_socket_volume_to_other_containers() {
    let (image, _) = images().clone();
    let mut pod = Pod::new("health");
    // The image as built: non-root, wardend as entrypoint.
    let user = docker_ok(&[
        "image",
        "inspect",
        "--format",
        "{{.Config.User}} {{json .Config.Entrypoint}}",
        &image,
    ]);
    assert_eq!(user.trim(), r#"65532:65532 ["/usr/local/bin/wardend"]"#);

    let socket = pod.volume("sock");
    let config = pod.config("");
    let agent = pod.agent("agent", &["--network", "none"], &socket, &config);

    // warden health from another container that shares only the volume.
    let mount = format!("{socket}:/run/warden");
    let other = |args: &[&str]| {
        let mut all = vec![
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            &mount,
            "--entrypoint",
            "warden",
            &image,
        ];
        all.extend_from_slice(args);
        docker(&all)
    };
    let out = other(&["--json", "health"]);
    assert!(out.status.success(), "{}{}", out.stdout, out.stderr);
    let health: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(
        component(&health, "agent").unwrap()["status"],
        "OK",
        "{health}"
    );
    // What a container without /dev/kmsg or NVML cannot see, said as such:
    // the kernel log should be there (UNKNOWN: faults go unseen); NVML on a
    // host with no NVIDIA device node is absent by design (issue 22), which
    // leaves the node OK.
    for (id, why, status) in [
        ("kmsg", "/dev/kmsg", "UNKNOWN"),
        ("nvml", "libnvidia-ml", "ABSENT"),
    ] {
        let c = component(&health, id).unwrap_or_else(|| panic!("no {id} in {health}"));
        assert_eq!(c["status"], status, "{c}");
        assert!(
            c["reasons"][0]["message"].as_str().unwrap().contains(why),
            "{c}"
        );
    }
    let plugin = other(&["health", "--plugin"]);
    assert_eq!(plugin.code(), 0, "{}{}", plugin.stdout, plugin.stderr);
    assert!(plugin.stdout.starts_with("OK: "), "{}", plugin.stdout);

    // The agent runs as the image's user: the socket is its.
    let owner = docker_ok(&[
        "exec",
        &agent,
        "/bin/busybox",
        "stat",
        "-c",
        "%u %a",
        "/run/warden/wardend.sock",
    ]);
    assert_eq!(owner.trim(), "65532 660");

    // grpc.health.v1 on the socket, from this (host) process through the
    // volume, as grpc_health_probe or any gRPC client would ask.
    let host_path = docker_ok(&["volume", "inspect", "--format", "{{.Mountpoint}}", &socket]);
    let sock = Path::new(host_path.trim()).join("wardend.sock");
    let status = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let channel = warden_cli::Target::Unix(sock.clone())
                .channel()
                .await
                .unwrap_or_else(|e| panic!("connect to {}: {e:#}", sock.display()));
            tonic_health::pb::health_client::HealthClient::new(channel)
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .expect("grpc.health.v1.Health/Check")
                .into_inner()
                .status
        });
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    // The DaemonSet's probes, as the kubelet runs them: warden inside the
    // agent's container, over the Unix socket (api.tcp serves only peer
    // agents, behind mutual TLS).
    let out = docker(&[
        "exec",
        &agent,
        "/usr/local/bin/warden",
        "--socket",
        "/run/warden/wardend.sock",
        "info",
    ]);
    assert!(out.status.success(), "{}{}", out.stdout, out.stderr);

    // The DaemonSet's init container, as written in the manifest, installs
    // a self-contained warden; node-problem-detector's rule, as written in
    // its config, runs it in a container that holds nothing else.
    let ds = object("daemonset.yaml", "DaemonSet", "wardend");
    let init = container(&ds["spec"]["template"]["spec"], "install-plugin");
    let plugin_dir = pod.disk_volume("plugin");
    let plugin_mount = format!("{plugin_dir}:/host-plugin");
    let mut args = vec![
        "run",
        "--rm",
        "--network",
        "none",
        "--user",
        "0",
        "-v",
        &plugin_mount,
        "--entrypoint",
    ];
    let command: Vec<String> = init["command"]
        .as_array()
        .unwrap()
        .iter()
        .chain(init["args"].as_array().unwrap())
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    args.push(&command[0]);
    args.push(&image);
    args.extend(command[1..].iter().map(String::as_str));
    docker_ok(&args);

    let bare = pod.name("bare");
    let empty = pod.scratch.path().join("empty.tar");
    let tar = run(
        Command::new("tar")
            .arg("-cf")
            .arg(&empty)
            .arg("-C")
            .arg(pod.scratch.path())
            .arg("--files-from=/dev/null"),
        DOCKER,
    );
    assert!(tar.status.success(), "{}", tar.stderr);
    docker_ok(&["import", &empty.to_string_lossy(), &format!("{bare}:empty")]);
    let monitor: Value = serde_json::from_str(
        object("npd-warden-plugin.yaml", "ConfigMap", "npd-warden-plugin")["data"]["warden-plugin.json"].as_str().unwrap(),
    )
    .unwrap();
    let rule = &monitor["rules"][0];
    let npd_plugin = format!("{plugin_dir}:/var/lib/warden/plugin:ro");
    let bare_image = format!("{bare}:empty");
    let mut args = vec![
        "run",
        "--rm",
        "--network",
        "none",
        "--user",
        "65532:65532",
        "-v",
        &npd_plugin,
        "-v",
        &mount,
        "--entrypoint",
        rule["path"].as_str().unwrap(),
        &bare_image,
    ];
    args.extend(
        rule["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap()),
    );
    let out = docker(&args);
    let _ = docker(&["rmi", &bare_image]);
    assert_eq!(out.code(), 0, "{}{}", out.stdout, out.stderr);
    assert!(out.stdout.starts_with("OK: "), "{}", out.stdout);
    assert!(out.stdout.len() <= 81, "{}", out.stdout);
}

/// The sidecar of training-job.yaml, its checkpoint tier in the volume
/// the trainer shares (`checkpoint.dir = "/ckpt/tier"`).
fn sidecar_with_tier(pod: &mut Pod, ns: &[&str], socket: &str, ckpt: &str) -> String {
    let config = pod.config(SIDECAR_TOML);
    let ckpt_mount = format!("{ckpt}:/ckpt");
    let sidecar: Vec<&str> = ns
        .iter()
        .chain(SIDECAR_SECURITY)
        .copied()
        .chain(["-v", ckpt_mount.as_str()])
        .collect();
    pod.agent("wardend", &sidecar, socket, &config)
}

/// `warden ckpt ls --job` in the sidecar: (step, complete, shards) newest
/// first, and the JSON for messages.
fn ckpt_steps(agent: &str, job: &str) -> (Vec<(u64, bool, usize)>, Value) {
    let ls = warden_json(agent, &["ckpt", "ls", "--job", job]);
    let steps = ls["steps"]
        .as_array()
        .unwrap_or_else(|| panic!("{ls}"))
        .iter()
        .map(|s| {
            (
                s["step"].as_u64().unwrap_or(0),
                s["complete"].as_bool().unwrap_or(false),
                s["shards"].as_array().map_or(0, Vec::len),
            )
        })
        .collect();
    (steps, ls)
}

#[test]
fn a_sidecar_sees_the_trainers_heartbeats_and_recovers_a_hang() {
    let mut pod = Pod::new("hang");
    let ns = pod.shared_namespaces();
    let ns: Vec<&str> = ns.iter().map(String::as_str).collect();
    let socket = pod.volume("sock");
    let ckpt = pod.volume("ckpt");
    let agent = sidecar_with_tier(&mut pod, &ns, &socket, &ckpt);

    let mut t = trainer(
        &mut pod,
        &ns,
        &socket,
        &ckpt,
        "j-hang",
        &[
            "--ckpt",
            "warden",
            "--steps",
            "80",
            "--step-ms",
            "40",
            "--hang-at-step",
            "30",
            "--hang-rank",
            "1",
        ],
    );
    // Heartbeats: both ranks registered with the sidecar, their steps
    // counted from the shared slots, their pids the trainer's own (one PID
    // namespace).
    t.wait_line(JOB, "rank 0 at step 10", |l| {
        step_of(l, 0).is_some_and(|s| s >= 10)
    });
    // Rank 1's ready line may still be unread: its process starts apart
    // from rank 0's, which can be ten steps on by then.
    while t.seen.iter().filter(|l| l.contains("] ready pid=")).count() < 2 {
        t.wait_line(JOB, "both ranks' ready lines", |l| {
            l.contains("] ready pid=")
        });
    }
    let seen = eventually("both ranks stepping in the sidecar's view", |last| {
        let r = ranks(&agent, "j-hang");
        *last = format!("{r:?}");
        (r.len() == 2 && r.iter().all(|(_, _, steps)| *steps >= 5)).then_some(r)
    });
    let ready: Vec<u64> = t
        .seen
        .iter()
        .filter_map(|l| {
            l.split_once("] ready pid=")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    let mut agent_pids: Vec<u64> = seen.iter().map(|(_, pid, _)| *pid).collect();
    let mut trainer_pids = ready.clone();
    agent_pids.sort_unstable();
    trainer_pids.sort_unstable();
    assert_eq!(
        agent_pids, trainer_pids,
        "the sidecar sees the trainer's pids"
    );

    let status = t.wait_exit(JOB);
    let out = pod.stdout(&t);
    let all = format!(
        "{out}\n--- stderr ---\n{}\n--- sidecar ---\n{}",
        t.stderr(),
        pod.logs(&agent)
    );
    assert!(status.success(), "{status:?}\n{all}");
    assert!(out.contains("[rank 1] hang:"), "{all}");
    assert!(t.stderr().contains("decision: restart_in_process"), "{all}");
    assert!(
        out.contains("[rank 1] resumed from checkpoint at step 30"),
        "{all}"
    );
    for rank in 0..2 {
        assert!(
            out.contains(&format!("[rank {rank}] done steps=80")),
            "{all}"
        );
    }
    // The hang as the sidecar saw it: the process visible (state, wchan).
    let hang = events(&agent)
        .into_iter()
        .find(|e| e["kind"] == "rank.hang" && e["subject"] == "job/j-hang/rank/1")
        .unwrap_or_else(|| panic!("no rank.hang\n{all}"));
    assert!(hang["evidence"]["process_state"].is_string(), "{hang}");
    assert!(hang["evidence"]["wchan"].is_string(), "{hang}");
    let health = warden_json(&agent, &["health"]);
    assert!(
        component(&health, "ranks/pid_visibility").is_none(),
        "{health}"
    );

    // The checkpoints went through the sidecar's tier in the shared volume:
    // the recovered rank restored step 30 from it, and the sidecar lists
    // every step the job saved (one per 5 steps) complete for both ranks.
    assert!(
        out.contains("[rank 1] resumed from checkpoint at step 30 (tier local"),
        "{all}"
    );
    let (steps, ls) = ckpt_steps(&agent, "j-hang");
    assert_eq!(steps.first(), Some(&(80, true, 2)), "{ls}");
    assert!(steps.iter().all(|&(_, c, n)| c && n == 2), "{ls}");
    assert_eq!(steps.len(), 16, "steps 5..=80: {ls}");
}

#[test]
fn the_sidecar_killed_mid_job_training_goes_on_and_ranks_register_again() {
    let mut pod = Pod::new("kill");
    let ns = pod.shared_namespaces();
    let ns: Vec<&str> = ns.iter().map(String::as_str).collect();
    let socket = pod.volume("sock");
    let ckpt = pod.volume("ckpt");
    let agent = sidecar_with_tier(&mut pod, &ns, &socket, &ckpt);

    let mut t = trainer(
        &mut pod,
        &ns,
        &socket,
        &ckpt,
        "j-kill",
        &[
            "--ckpt",
            "warden",
            "--ckpt-every",
            "20",
            "--steps",
            "400",
            "--step-ms",
            "40",
        ],
    );
    t.wait_line(JOB, "rank 0 at step 10", |l| {
        step_of(l, 0).is_some_and(|s| s >= 10)
    });
    let before = eventually("both ranks registered", |last| {
        let r = ranks(&agent, "j-kill");
        *last = format!("{r:?}");
        (r.len() == 2).then_some(r)
    });

    docker_ok(&["kill", &agent]);
    let killed_at = t.seen.iter().rev().find_map(|l| step_of(l, 0)).unwrap_or(0);
    // Training goes on without the agent.
    t.wait_line(JOB, "rank 0 stepping on without the sidecar", |l| {
        step_of(l, 0).is_some_and(|s| s >= killed_at + 25)
    });
    let state = docker_ok(&["inspect", "--format", "{{.State.Running}}", &agent]);
    assert_eq!(
        state.trim(),
        "false",
        "the sidecar is down while the job steps on"
    );

    // Back (as the kubelet restarts a native sidecar): the ranks register
    // again with the new agent, and their steps go on from where they were.
    docker_ok(&["start", &agent]);
    wait_serving(&agent);
    let after = eventually("both ranks registered with the restarted sidecar", |last| {
        let r = ranks(&agent, "j-kill");
        let logs = docker(&["logs", "--tail", "400", &agent]);
        let logs: Vec<&str> = logs
            .stdout
            .lines()
            .chain(logs.stderr.lines())
            .filter(|l| !l.contains("ckpt.saved"))
            .collect();
        *last = format!(
            "{r:?}\nthe sidecar's log (saves left out):\n{}\nthe trainer's last lines:\n{}",
            logs[logs.len().saturating_sub(40)..].join("\n"),
            t.seen[t.seen.len().saturating_sub(15)..].join("\n")
        );
        (r.len() == 2 && r.iter().all(|(_, _, steps)| *steps >= 1)).then_some(r)
    });
    for ((rank, pid, _), (rank2, pid2, _)) in before.iter().zip(&after) {
        assert_eq!(
            (rank, pid),
            (rank2, pid2),
            "the same processes: {before:?} {after:?}"
        );
    }
    let registered = events(&agent)
        .into_iter()
        .filter(|e| e["kind"] == "rank.registered")
        .count();
    assert_eq!(registered, 2, "the new agent's own registrations");

    let status = t.wait_exit(JOB);
    let out = pod.stdout(&t);
    let all = format!(
        "{out}\n--- stderr ---\n{}\n--- sidecar ---\n{}",
        t.stderr(),
        pod.logs(&agent)
    );
    assert!(status.success(), "{status:?}\n{all}");
    for rank in 0..2 {
        assert!(
            out.contains(&format!("[rank {rank}] done steps=400")),
            "{all}"
        );
    }
    // One attempt: the agent going away restarted nothing.
    assert!(!t.stderr().contains("attempt 1"), "{all}");

    // Checkpoints: every save before the kill is still in the shared volume
    // and listed by the restarted sidecar; a save while it was down failed
    // at the rank (and says so) and is listed nowhere; every step listed is
    // complete for both ranks.
    let unsaved: Vec<u64> = out
        .lines()
        .filter_map(|l| {
            l.split_once("] checkpoint at step ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    let (listed, ls) = ckpt_steps(&agent, "j-kill");
    assert_eq!(listed.first(), Some(&(400, true, 2)), "{ls}");
    // Complete exactly when both ranks' shards are there.
    assert!(listed.iter().all(|&(_, c, n)| c == (n == 2)), "{ls}");
    // Not lost: every save well before the kill (a step's margin for the
    // ranks' skew) is listed complete by the restarted sidecar.
    for step in (20..killed_at.saturating_sub(20)).step_by(20) {
        assert!(
            listed.contains(&(step, true, 2)),
            "step {step}, saved before the kill, is missing: {ls}"
        );
    }
    for step in &unsaved {
        assert!(
            !listed.contains(&(*step, true, 2)),
            "step {step} failed to save but is listed complete: {ls}"
        );
    }
}

#[test]
fn a_sidecar_outside_the_trainers_pid_namespace_reports_what_it_cannot_see() {
    let mut pod = Pod::new("nopid");
    let pause = pod.pause();
    let net = format!("--network=container:{pause}");
    let socket = pod.volume("sock");
    let ckpt = pod.volume("ckpt");
    let config = pod.config(SIDECAR_TOML);
    // The sidecar shares the network and the volumes, not the PIDs.
    let sidecar: Vec<&str> = [net.as_str()]
        .iter()
        .chain(SIDECAR_SECURITY)
        .copied()
        .collect();
    let agent = pod.agent("wardend", &sidecar, &socket, &config);
    let pid = format!("--pid=container:{pause}");
    let mut t = trainer(
        &mut pod,
        &[&net, &pid],
        &socket,
        &ckpt,
        "j-nopid",
        &["--steps", "300", "--step-ms", "40"],
    );
    t.wait_line(JOB, "rank 0 at step 5", |l| {
        step_of(l, 0).is_some_and(|s| s >= 5)
    });
    // Registered (heartbeats still counted), with no pid the agent could use.
    let r = eventually("both ranks registered and stepping", |last| {
        let r = ranks(&agent, "j-nopid");
        *last = format!("{r:?}");
        (r.len() == 2 && r.iter().all(|(_, _, steps)| *steps >= 1)).then_some(r)
    });
    assert!(r.iter().all(|(_, pid, _)| *pid == 0), "{r:?}");
    let c = eventually("ranks/pid_visibility UNKNOWN", |last| {
        let h = warden_json(&agent, &["health"]);
        *last = h.to_string();
        component(&h, "ranks/pid_visibility")
            .filter(|c| c["status"] == "UNKNOWN")
            .cloned()
    });
    let reason = &c["reasons"][0];
    assert_eq!(reason["value"], "2 of 2 ranks", "{c}");
    assert!(
        reason["message"]
            .as_str()
            .unwrap()
            .contains("shareProcessNamespace"),
        "{c}"
    );
    // UNKNOWN is not a node problem: the NPD plugin still says healthy.
    let plugin = docker(&["exec", &agent, "warden", "health", "--plugin"]);
    assert_eq!(plugin.code(), 0, "{}", plugin.stdout);
    let status = t.wait_exit(JOB);
    assert!(
        status.success(),
        "{status:?}\n{}\n{}",
        pod.stdout(&t),
        t.stderr()
    );
    // Once the ranks are gone, nothing is unseen.
    eventually("ranks/pid_visibility OK after the job", |last| {
        let h = warden_json(&agent, &["health"]);
        *last = h.to_string();
        (component(&h, "ranks/pid_visibility")?["status"] == "OK").then_some(())
    });
}

#[test]
fn a_node_agent_in_the_hosts_pid_namespace_sees_a_pods_ranks() {
    let mut pod = Pod::new("node");
    // The host's socket directory as the kubelet creates a hostPath
    // (root's, 0755); the trainer connects through the socket's group.
    let socket = pod.volume_owned("sock", "uid=0,gid=0,mode=0755");
    let ckpt = pod.volume("ckpt");
    let config = pod.config(SIDECAR_TOML);
    // As the DaemonSet runs it: the host's PID namespace, its user and
    // group, its capabilities (read from the manifest: every other one
    // dropped), a read-only root, its state on a root-owned directory, and
    // the host's /dev/kmsg mounted into an unprivileged container. The
    // trainer in a pod of its own (its own PID namespace), sharing the
    // socket directory.
    let ds = object("daemonset.yaml", "DaemonSet", "wardend");
    let sc = &container(&ds["spec"]["template"]["spec"], "wardend")["securityContext"];
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    let user = format!("{}:{}", sc["runAsUser"], sc["runAsGroup"]);
    let mut ns: Vec<String> = [
        "--network",
        "none",
        "--pid",
        "host",
        "--user",
        &user,
        "--cap-drop",
        "ALL",
        "--read-only",
        "--tmpfs",
        "/var/lib/warden:mode=0750",
        "--tmpfs",
        "/tmp",
        "-v",
        "/dev/kmsg:/dev/kmsg:ro",
    ]
    .map(str::to_owned)
    .to_vec();
    for cap in sc["capabilities"]["add"].as_array().unwrap() {
        ns.extend(["--cap-add".to_owned(), cap.as_str().unwrap().to_owned()]);
    }
    let ns: Vec<&str> = ns.iter().map(String::as_str).collect();
    let agent = pod.agent("wardend", &ns, &socket, &config);
    // The device cgroup keeps an unprivileged container from the kernel
    // log, as the DaemonSet's comments say: reported, not fatal.
    let health = warden_json(&agent, &["health"]);
    let kmsg = component(&health, "kmsg").unwrap();
    assert_eq!(kmsg["status"], "UNKNOWN", "{kmsg}");
    assert!(
        kmsg["reasons"][0]["message"]
            .as_str()
            .unwrap()
            .contains("Operation not permitted"),
        "{kmsg}"
    );
    let mut t = trainer(
        &mut pod,
        &["--network", "none"],
        &socket,
        &ckpt,
        "j-node",
        &[
            "--steps",
            "60",
            "--step-ms",
            "40",
            "--crash-at-step",
            "20",
            "--crash-rank",
            "1",
            "--crash-code",
            "3",
        ],
    );
    let status = t.wait_exit(JOB);
    let out = pod.stdout(&t);
    let err = t.stderr();
    let all = format!(
        "{out}\n--- stderr ---\n{err}\n--- agent ---\n{}",
        pod.logs(&agent)
    );
    assert!(status.success(), "{status:?}\n{all}");
    // The agent saw the crash (its exit status, by the host pid) and
    // decided; the launcher matched its workers to the agent's
    // registrations although their pids differ between the namespaces.
    assert!(err.contains("decision: restart_in_job by policy"), "{all}");
    assert!(!err.contains("had not registered with the agent"), "{all}");
    assert!(
        err.contains("all 2 workers registered with the agent"),
        "{all}"
    );
    let exited = events(&agent)
        .into_iter()
        .find(|e| e["kind"] == "rank.exited" && e["subject"] == "job/j-node/rank/1")
        .unwrap_or_else(|| panic!("no rank.exited\n{all}"));
    assert_eq!(exited["evidence"]["exit_code"], "3", "{exited}");
    assert_ne!(
        exited["evidence"]["pid"], exited["evidence"]["declared_pid"],
        "{exited}"
    );
    for rank in 0..2 {
        assert!(
            out.contains(&format!("[rank {rank}] done steps=60")),
            "{all}"
        );
    }
}
