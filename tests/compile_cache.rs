//! The compilation cache in the agent's tier survives an in-job restart:
//! a torch.compile'd model (tests/fixtures/compile_job.py, Inductor on the
//! CPU with the machine's C++ compiler) under `warden run`, its first
//! attempt crashing after its first step. The restarted worker (a new
//! process) finds its FX graphs in the cache the launcher pointed it to, in
//! the tier's `.cache/<uid>/<job>/`, and compiles nothing again. The first
//! step's time of both attempts is printed (docs/benchmarks.md has the
//! bench), not asserted.
//!
//! Across hosts: host-a's wardend (127.0.0.2) and host-b's (127.0.0.3),
//! each the other's checkpoint peer by config. The job runs on host-a,
//! whose launcher packs the warmed cache and saves it through the agent
//! (`<job>.compile-cache`); host-a's agent replicates it to host-b's and
//! is then stopped, as a lost host is; the same job on host-b, its cache
//! folder empty, restores the blob before its worker starts, says where
//! it came from, and its first compiled step takes every graph from the
//! cache.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON`; skips, saying so, only when torch
//! is missing and `WARDEN_REQUIRE_TORCH` is unset.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{TestAgent, WARDEN, eventually, free_port, python, repo_root, run, torch_available};
use warden_proto::v1 as pb;

/// A cold compile on a loaded 2-core machine took 34 s here; twice that
/// and the restart, with room.
const RUN: Duration = Duration::from_secs(400);

const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n";

#[test]
fn a_restarted_worker_finds_its_compiled_graphs_in_the_tier() {
    if !torch_available() {
        eprintln!("skipped: no torch in {}", python().display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let toml = format!("{AGENT_TOML}{}", common::tier_in(dir.path()));
    std::fs::write(dir.path().join("agent.toml"), toml).unwrap();
    // A job id of its own: a cache left by an earlier run of this test
    // would make the first attempt warm.
    let job = format!(
        "compile-cache-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    );
    let out = dir.path().join("out.jsonl");
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(dir.path().join("no-agent-here.sock"))
        .arg("run")
        .args(["--nproc-per-node", "1", "--rdzv-id", &job, "--no-standby"])
        .arg("--log-dir")
        .arg(dir.path().join("logs"))
        .arg("--agent-config")
        .arg(dir.path().join("agent.toml"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/compile_job.py"))
        .arg(&out)
        .arg("--exit-first-attempt")
        .env_remove("WARDEN_SOCKET")
        .env_remove("TORCHINDUCTOR_CACHE_DIR")
        .env_remove("TORCHINDUCTOR_FORCE_DISABLE_CACHES")
        .current_dir(dir.path());
    let done = run(&mut cmd, RUN);
    let all = format!("{}\n{}", done.stdout, done.stderr);
    assert_eq!(done.code(), 0, "{all}");
    assert!(
        done.stderr
            .contains("compilation caches (torch.compile, Triton, XLA) in "),
        "{all}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}\n{all}");
    let (first, second) = (&lines[0], &lines[1]);
    assert_eq!(first["attempt"], 0);
    assert_eq!(second["attempt"], 1);
    let uid = nix::unistd::Uid::effective().as_raw();
    let want = format!("/.cache/{uid}/{job}/inductor");
    for l in &lines {
        let d = l["cache_dir"].as_str().unwrap_or_default();
        assert!(d.ends_with(&want), "cache dir {d:?}, want *{want}");
    }
    // Cold: compiled; warm: every graph from the cache, none compiled.
    assert!(first["misses"].as_u64().unwrap() > 0, "{first}");
    assert_eq!(first["hits"].as_u64().unwrap(), 0, "{first}");
    assert!(second["hits"].as_u64().unwrap() > 0, "{second}");
    assert_eq!(second["misses"].as_u64().unwrap(), 0, "{second}");
    eprintln!(
        "first step: cold {:.2} s, after the restart {:.2} s (from the cache)",
        first["first_step_s"].as_f64().unwrap(),
        second["first_step_s"].as_f64().unwrap()
    );
}

/// A job id of its own: a cache left by an earlier run would make the
/// first attempt warm.
fn fresh_job(what: &str) -> String {
    format!(
        "{what}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    )
}

/// `warden run` of compile_job.py (one worker, no crash) against the
/// wardend at `agent`; its record goes to `out`.
fn run_on(agent: &TestAgent, job: &str, out: &std::path::Path) -> (i32, String) {
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(agent.socket())
        .arg("run")
        .args(["--nproc-per-node", "1", "--rdzv-id", job, "--no-standby"])
        .arg("--log-dir")
        .arg(agent.home.path().join("logs"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/compile_job.py"))
        .arg(out)
        .env_remove("WARDEN_SOCKET")
        .env_remove("TORCHINDUCTOR_CACHE_DIR")
        .env_remove("TORCHINDUCTOR_FORCE_DISABLE_CACHES")
        .current_dir(agent.home.path());
    let done = run(&mut cmd, RUN);
    (done.code(), format!("{}\n{}", done.stdout, done.stderr))
}

fn record(out: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "{text}");
    serde_json::from_str(lines[0]).unwrap()
}

#[test]
fn a_replacement_host_finds_the_cache_its_peer_compiled() {
    if !torch_available() {
        eprintln!("skipped: no torch in {}", python().display());
        return;
    }
    const IPS: [&str; 2] = ["127.0.0.2", "127.0.0.3"];
    let addrs: Vec<String> = IPS
        .iter()
        .map(|ip| format!("{ip}:{}", free_port(ip)))
        .collect();
    let names = ["host-a", "host-b"];
    let toml = |i: usize| {
        let j = 1 - i;
        format!(
            "{}[agent]\nhost_name = \"{}\"\n[api]\ntcp = \"{}\"\n{}\
             [checkpoint]\ndomain = \"rack{i}\"\nretry_interval = \"200ms\"\n\
             [[checkpoint.peers]]\naddr = \"{}\"\ndomain = \"rack{j}\"\nname = \"{}\"\n",
            AGENT_TOML.replacen("[agent]\ntick = \"50ms\"\n", "", 1),
            names[i],
            addrs[i],
            common::pki::api_keys(names[i]),
            addrs[j],
            names[j]
        )
        .replacen("[agent]\n", "[agent]\ntick = \"50ms\"\n", 1)
    };
    let a = TestAgent::start(&toml(0));
    let b = TestAgent::start(&toml(1));
    let job = fresh_job("compile-peer");
    let blob_job = format!("{job}.compile-cache");

    // Host-a: a cold compile, then the pack saved through its agent.
    let out_a = a.home.path().join("out.jsonl");
    let (code, all) = run_on(&a, &job, &out_a);
    assert_eq!(code, 0, "{all}");
    assert!(
        all.contains("compilation cache saved for the job's other hosts: "),
        "{all}"
    );
    let first = record(&out_a);
    assert!(first["misses"].as_u64().unwrap() > 0, "{first}");
    assert_eq!(first["hits"].as_u64().unwrap(), 0, "{first}");

    // The agent replicates it to host-b's tier.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let step = rt.block_on(eventually(
        Duration::from_secs(60),
        "host-b's tier holds the cache blob",
        async || {
            let l: pb::ListCheckpointsResponse = b
                .client()
                .await
                .list_checkpoints(pb::ListCheckpointsRequest {
                    job_id: blob_job.clone(),
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner();
            l.steps
                .iter()
                .find(|s| {
                    s.complete
                        && s.shards.iter().all(|sh| {
                            sh.copies
                                .iter()
                                .any(|c| c.tier == "local" && c.corrupt.is_empty())
                        })
                })
                .map(|s| s.step)
        },
    ));
    // Host-a is lost.
    drop(a);

    // Host-b, its cache folder empty: the blob unpacked before the worker.
    let out_b = b.home.path().join("out.jsonl");
    let (code, all) = run_on(&b, &job, &out_b);
    assert_eq!(code, 0, "{all}");
    let said = format!(
        "compilation cache restored from the local copy at host-b ({blob_job} step {step}): "
    );
    assert!(all.contains(&said), "want {said:?} in\n{all}");
    let warm = record(&out_b);
    let uid = nix::unistd::Uid::effective().as_raw();
    let d = warm["cache_dir"].as_str().unwrap_or_default();
    assert!(
        d.starts_with(&b.home.path().display().to_string())
            && d.ends_with(&format!("/.cache/{uid}/{job}/inductor")),
        "cache dir {d:?}"
    );
    assert!(warm["hits"].as_u64().unwrap() > 0, "{warm}");
    assert_eq!(warm["misses"].as_u64().unwrap(), 0, "{warm}");
    eprintln!(
        "first step: cold on host-a {:.2} s, on host-b from host-a's cache {:.2} s",
        first["first_step_s"].as_f64().unwrap(),
        warm["first_step_s"].as_f64().unwrap()
    );
}
