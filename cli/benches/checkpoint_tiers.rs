//! Checkpoint tiers against their baselines, in one run, on tmpfs:
//!
//! 1. Save stall: `Checkpointer::save` of a shard (BeginShard, the write
//!    into the tier, CommitShard) against a plain memcpy of the same bytes
//!    into freshly allocated memory (what a rank pays to snapshot its state
//!    to host memory), and against a memcpy into memory already touched.
//!    Target: save at most 1.2x the fresh memcpy.
//! 2. Replication: a committed shard pushed from agent A (127.0.0.2) to
//!    agent B (127.0.0.3) over warden.v1.Peer (chunked gRPC, checksum on
//!    arrival, written to B's tier), timed by A from the start of the push
//!    to B's answer; against a raw TCP copy of the same file between the
//!    same addresses (read, send, write to tmpfs, no checksum). Target: at
//!    least 80% of raw TCP.
//! 3. Restore from a peer: A's tier wiped, `Checkpointer::restore` (peers
//!    listed, the shard fetched from B, checked, committed) against the
//!    same raw TCP copy.
//!
//! Run: `cargo bench -p warden-cli --bench checkpoint_tiers` (release).
//! `WARDEN_BENCH_SIZES_MIB=64,256,1024` picks the shard sizes and
//! `WARDEN_BENCH_REPS` the repetitions per size (default 5; medians).
//! Prints a markdown table for docs/benchmarks.md.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;
/// The tests' cluster CA: the agents replicate over mutual TLS, as deployed.
#[allow(dead_code)]
#[path = "../../tests/common/pki.rs"]
mod pki;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Agent;
use tokio_stream::StreamExt;
use warden_client::{Checkpointer, ConnectOptions};
use warden_proto::v1 as pb;

/// Repetitions per size unless `WARDEN_BENCH_REPS` says otherwise.
const REPS: usize = 5;

/// The tier of an agent the bench started.
fn tier(agent: &Agent) -> PathBuf {
    agent.dir.path().join("ckpt")
}

fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An agent `name` on `tcp`, replicating to `peer` (its name and address)
/// over mutual TLS with certificates of the tests' cluster CA.
fn start_agent(name: &str, tcp: &str, peer: Option<(&str, &str)>) -> Agent {
    let dir = tempfile::Builder::new()
        .prefix("warden-bench-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let peers = peer
        .map(|(n, a)| format!("[[checkpoint.peers]]\naddr = \"{a}\"\nname = \"{n}\"\n"))
        .unwrap_or_default();
    let ckpt = dir.path().join("ckpt");
    let tls = pki::cluster().node(name).api_keys();
    Agent::start(dir, |socket, state| {
        format!(
            "[api]\nsocket = \"{}\"\ntcp = \"{tcp}\"\n{tls}[metrics]\nlisten = \"\"\n\
             [agent]\nhost_name = \"{name}\"\nstate_dir = \"{}\"\n[log]\nlevel = \"off\"\n\
             [nvml]\nenabled = false\n[kmsg]\nenabled = false\n[dcgm]\nenabled = false\n\
             [checkpoint]\ndir = \"{}\"\nkeep_steps = 1\nretry_interval = \"1h\"\n{peers}",
            socket.display(),
            state.display(),
            ckpt.display(),
        )
    })
}

fn checkpointer(agent: &Agent, job: &str) -> Checkpointer {
    let mut o = ConnectOptions::from_env_lossy();
    o.socket_path = agent.socket();
    o.job_id = job.into();
    o.global_rank = 0;
    o.local_rank = 0;
    o.world_size = 1;
    Checkpointer::new(o).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Raw TCP copy of `src` from `from` to a listener on `to`, written to
/// `dest`: seconds.
fn raw_tcp_copy(src: &Path, dest: &Path, to_ip: &str, from_ip: &str) -> f64 {
    let listener = std::net::TcpListener::bind((to_ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let dest = dest.to_owned();
    let receiver = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut f = std::fs::File::create(&dest).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            f.write_all(&buf[..n]).unwrap();
        }
    });
    let started = Instant::now();
    let _ = from_ip; // loopback: the kernel picks the source address
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut f = std::fs::File::open(src).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n]).unwrap();
    }
    drop(s);
    receiver.join().unwrap();
    started.elapsed().as_secs_f64()
}

/// Waits until `step` is gone from both agents' tiers (retention done).
fn settled(agents: &[&Agent], step: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for a in agents {
        let dir = tier(a).join(format!("bench/step-{step:020}"));
        while dir.exists() {
            assert!(Instant::now() < deadline, "{} not pruned", dir.display());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::var("WARDEN_BENCH_SIZES_MIB")
        .unwrap_or_else(|_| "64,256,1024".into())
        .split(',')
        .map(|s| s.trim().parse::<usize>().unwrap() << 20)
        .collect();
    let reps: usize = std::env::var("WARDEN_BENCH_REPS")
        .map(|r| r.parse().expect("WARDEN_BENCH_REPS: a number"))
        .unwrap_or(REPS);
    let (a_addr, b_addr) = (
        format!("127.0.0.2:{}", free_port("127.0.0.2")),
        format!("127.0.0.3:{}", free_port("127.0.0.3")),
    );
    let a = start_agent("bench-a", &a_addr, Some(("bench-b", &b_addr)));
    let b = start_agent("bench-b", &b_addr, Some(("bench-a", &a_addr)));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut events = rt.block_on(async {
        // The event stream is the local API: the Unix socket.
        common::connect(&a.socket())
            .await
            .watch_events(pb::WatchEventsRequest { after_id: None })
            .await
            .unwrap()
            .into_inner()
    });
    let scratch = tempfile::tempdir_in("/dev/shm").unwrap();

    println!(
        "| shard | memcpy (fresh) | memcpy (warm) | save | save / fresh memcpy | replicate | raw TCP | replicate / TCP | restore from peer | restore / TCP | restore, local copy |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut step = 0u64;
    for &size in &sizes {
        let data: Vec<u8> = (0..size)
            .map(|i| (i as u64).wrapping_mul(2_654_435_761) as u8)
            .collect();
        let mut warm = vec![0u8; size];
        let (mut fresh_t, mut warm_t, mut save_t, mut repl_t, mut tcp_t, mut restore_t) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut local_t = vec![];
        let ck = checkpointer(&a, "bench");
        for _ in 0..reps {
            let t = Instant::now();
            let mut v: Vec<u8> = Vec::with_capacity(size);
            v.extend_from_slice(&data);
            fresh_t.push(t.elapsed().as_secs_f64());
            std::hint::black_box(&v);
            drop(v);
            let t = Instant::now();
            warm.copy_from_slice(&data);
            warm_t.push(t.elapsed().as_secs_f64());
            std::hint::black_box(&warm);

            step += 1;
            let t = Instant::now();
            ck.save(step, &data).unwrap();
            save_t.push(t.elapsed().as_secs_f64());
            // The push A made of it, timed by A.
            let ms: f64 = rt.block_on(async {
                loop {
                    let e = tokio::time::timeout(Duration::from_secs(120), events.next())
                        .await
                        .expect("no ckpt.replicated within 120 s")
                        .unwrap()
                        .unwrap();
                    let ev = |k: &str| {
                        e.evidence
                            .iter()
                            .find(|x| x.key == k)
                            .map(|x| x.value.clone())
                    };
                    if e.kind == "ckpt.replicated" && ev("step") == Some(step.to_string()) {
                        return ev("ms").unwrap().parse().unwrap();
                    }
                }
            });
            repl_t.push(ms / 1e3);
            // Retention (keep_steps = 1) deletes the step before on both
            // agents after the push: a GiB of tmpfs freed on the same two
            // cores. Let it finish so the raw copy is not slowed by it.
            if step > 1 {
                settled(&[&a, &b], step - 1);
            }
            let shard = tier(&a).join(format!("bench/step-{step:020}/rank-000000.bin"));
            tcp_t.push(raw_tcp_copy(
                &shard,
                &scratch.path().join("copy"),
                "127.0.0.3",
                "127.0.0.2",
            ));
            std::fs::remove_file(scratch.path().join("copy")).unwrap();
            // Restore from the peer: A's tier wiped first.
            std::fs::remove_dir_all(tier(&a).join("bench")).unwrap();
            let t = Instant::now();
            let r = ck.restore(0).unwrap().unwrap();
            restore_t.push(t.elapsed().as_secs_f64());
            assert_eq!((r.step, r.tier.as_str()), (step, "peer"));
            // Restore again, the copy now local: what a restart on the
            // same host pays (listings, the local copy's xxh3 checked).
            let t = Instant::now();
            let r = ck.restore(0).unwrap().unwrap();
            local_t.push(t.elapsed().as_secs_f64());
            assert_eq!((r.step, r.tier.as_str()), (step, "local"));
        }
        let _ = &b;
        let mib = size as f64 / (1 << 20) as f64;
        let gbs = |s: f64| size as f64 / s / 1e9;
        let (f, w, s, r, t, re) = (
            median(fresh_t),
            median(warm_t),
            median(save_t),
            median(repl_t),
            median(tcp_t),
            median(restore_t),
        );
        let lo = median(local_t);
        println!(
            "| {mib:.0} MiB | {:.1} ms ({:.1} GB/s) | {:.1} ms | {:.1} ms ({:.1} GB/s) | {:.2}x | {:.0} ms ({:.2} GB/s) | {:.0} ms ({:.2} GB/s) | {:.0}% | {:.0} ms ({:.2} GB/s) | {:.0}% | {:.0} ms ({:.2} GB/s) |",
            f * 1e3,
            gbs(f),
            w * 1e3,
            s * 1e3,
            gbs(s),
            s / f,
            r * 1e3,
            gbs(r),
            t * 1e3,
            gbs(t),
            100.0 * t / r,
            re * 1e3,
            gbs(re),
            100.0 * t / re,
            lo * 1e3,
            gbs(lo),
        );
    }
}
