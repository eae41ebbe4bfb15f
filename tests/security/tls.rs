//! `api.tcp` under mutual TLS, against real agents on 127.0.0.2 and
//! 127.0.0.3 with certificates this test makes (rcgen):
//! - a client with no certificate, or one of another CA, gets nothing;
//! - a cluster peer that is not a member of the job is refused
//!   (PERMISSION_DENIED naming the rule) on push, fetch and listing;
//! - a member pushing a shard that names another origin, or this host,
//!   is refused and the victim's tier is byte-for-byte unchanged;
//! - warden.v1.Agent (Uncordon, StopRanks, RequestRestart) is not on TCP;
//! - a rotated node certificate is served without a restart, and a bad
//!   one keeps the last good set;
//! - `api.insecure = true` shows in `warden health`.
//!
//! Replication and restore between peers over mutual TLS are shown by
//! tests/checkpoint.rs, whose agents run with this CA's certificates.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use tokio_rustls::rustls;
use warden_client::{Checkpointer, ConnectOptions};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::common::pki::{ClusterCa, NodeFiles, cluster, peer_client, tls_channel};
use crate::common::{Events, TestAgent, free_port};

const JOB: &str = "victim-job";

/// Two agents, h0 on 127.0.0.2 and h1 on 127.0.0.3, each the other's
/// configured checkpoint peer, one replica each.
struct Pair {
    h0: TestAgent,
    h1: TestAgent,
    h0_addr: String,
    h1_files: NodeFiles,
}

fn pair() -> Pair {
    let a0 = format!("127.0.0.2:{}", free_port("127.0.0.2"));
    let a1 = format!("127.0.0.3:{}", free_port("127.0.0.3"));
    let (f0, f1) = (cluster().node("h0"), cluster().node("h1"));
    let toml = |name: &str, me: &str, files: &NodeFiles, peer: &str, peer_name: &str| {
        format!(
            "[agent]\nhost_name = \"{name}\"\n[api]\ntcp = \"{me}\"\n{}\
             [checkpoint]\nretry_interval = \"200ms\"\n\
             [[checkpoint.peers]]\naddr = \"{peer}\"\nname = \"{peer_name}\"\n",
            files.api_keys()
        )
    };
    let h0 = TestAgent::start(&toml("h0", &a0, &f0, &a1, "h1"));
    let h1 = TestAgent::start(&toml("h1", &a1, &f1, &a0, "h0"));
    Pair {
        h0,
        h1,
        h0_addr: a0,
        h1_files: f1,
    }
}

/// Rank 0 of a one-rank job saves `step` on `agent`.
fn save(agent: &TestAgent, step: u64, bytes: &[u8]) {
    let mut o = ConnectOptions::from_env_lossy();
    o.socket_path = agent.socket().to_path_buf();
    o.job_id = JOB.to_owned();
    o.world_size = 1;
    Checkpointer::new(o)
        .expect("checkpointer")
        .save(step, bytes)
        .expect("save");
}

/// Every file under `dir` with its bytes (the staging area included).
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(
                    p.display().to_string(),
                    std::fs::read(&p).unwrap_or_default(),
                );
            }
        }
    }
    out
}

/// Waits until `agent` lists `step` of the job complete, with `copies`.
async fn wait_step(agent: &TestAgent, step: u64, copies: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let l = agent
            .client()
            .await
            .list_checkpoints(pb::ListCheckpointsRequest {
                job_id: JOB.into(),
                ..Default::default()
            })
            .await
            .expect("ListCheckpoints")
            .into_inner();
        if l.steps.iter().any(|s| {
            s.step == step
                && s.complete
                && s.shards
                    .iter()
                    .all(|sh| sh.copies.iter().filter(|c| !c.unconfirmed).count() >= copies)
        }) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "step {step} never had {copies} copies: {l:#?}\n{}",
            agent.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn chunk(origin: &str, step: u64, data: &[u8]) -> pb::ShardChunk {
    pb::ShardChunk {
        info: Some(pb::ShardInfo {
            job_id: JOB.into(),
            step,
            rank: 0,
            world_size: 1,
            size_bytes: data.len() as u64,
            xxh3: xxhash_rust::xxh3::xxh3_64(data),
            origin: origin.into(),
        }),
        data: bytes::Bytes::copy_from_slice(data),
    }
}

fn assert_denied<T: std::fmt::Debug>(r: Result<T, tonic::Status>, rule: &str, what: &str) {
    match r {
        Err(s) => {
            assert_eq!(s.code(), tonic::Code::PermissionDenied, "{what}: {s:?}");
            assert!(s.message().contains(rule), "{what}: {s:?}");
        }
        Ok(v) => panic!("{what}: answered {v:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_members_of_the_job_reach_its_shards_and_nobody_forges_them() {
    let p = pair();
    let data = vec![7u8; 64 << 10];
    save(&p.h0, 5, &data);
    // Replicated to h1 over mutual TLS.
    wait_step(&p.h0, 5, 2).await;
    let tier = p.h0.home.path().join("ckpt");
    let before = snapshot(&tier);
    let fetch = pb::FetchShardRequest {
        job_id: JOB.into(),
        step: 5,
        rank: 0,
    };
    let list = pb::ListShardsRequest { job_id: JOB.into() };

    // No certificate, or one of another CA: the handshake fails.
    let other = ClusterCa::new("other");
    let stranger = other.node("h1");
    for (what, cfg) in [
        ("no certificate", cluster().client_config(None)),
        // Trusts the cluster's CA for the server, presents the other's.
        ("another CA", cluster().client_config(Some(&stranger))),
    ] {
        let mut c = peer_client(&p.h0_addr, "h0", cfg);
        assert!(c.list_shards(list.clone()).await.is_err(), "{what}: listed");
        assert!(
            c.fetch_shard(fetch.clone()).await.is_err(),
            "{what}: fetched"
        );
        assert!(
            c.push_shard(tokio_stream::iter(vec![chunk("h1", 99, &data)]))
                .await
                .is_err(),
            "{what}: pushed"
        );
    }

    // A cluster peer that is no member of the job.
    let outsider = cluster().node("h9");
    let mut c = peer_client(&p.h0_addr, "h0", cluster().client_config(Some(&outsider)));
    assert_denied(c.fetch_shard(fetch.clone()).await, "job-member", "fetch");
    assert_denied(c.list_shards(list.clone()).await, "job-member", "list");
    assert_denied(
        c.push_shard(tokio_stream::iter(vec![chunk("h9", 99, &data)]))
            .await,
        "job-member",
        "push",
    );
    let all = c
        .list_shards(pb::ListShardsRequest::default())
        .await
        .expect("a listing of everything")
        .into_inner();
    assert!(all.shards.is_empty(), "{all:?}");
    // A job id that cannot be is named as such, and clipped, before any
    // rule: a stranger's 1 MB id never comes back whole in a refusal.
    let huge = "x".repeat(1 << 20);
    for (what, r) in [
        (
            "fetch",
            c.fetch_shard(pb::FetchShardRequest {
                job_id: huge.clone(),
                ..fetch.clone()
            })
            .await
            .map(|_| ()),
        ),
        (
            "list",
            c.list_shards(pb::ListShardsRequest {
                job_id: huge.clone(),
            })
            .await
            .map(|_| ()),
        ),
        (
            "collect",
            c.collect_holdings(pb::HoldingsAsk {
                job_id: huge.clone(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        ),
    ] {
        let s = r.expect_err(what);
        assert_eq!(
            s.code(),
            tonic::Code::InvalidArgument,
            "{what}: {:.200}",
            s.message()
        );
        assert!(
            s.message().len() < 1024,
            "{what}: {} bytes",
            s.message().len()
        );
    }

    // A member (h1's own certificate) may fetch, but may push only its
    // own shards, never one naming h0 or a third host as origin.
    let mut m = peer_client(&p.h0_addr, "h0", cluster().client_config(Some(&p.h1_files)));
    let mut s = m
        .fetch_shard(fetch.clone())
        .await
        .expect("a member fetches")
        .into_inner();
    let mut got = 0;
    while let Some(c) = s.message().await.expect("chunk") {
        got += c.data.len();
    }
    assert_eq!(got, data.len());
    let forged = vec![0u8; 64 << 10];
    assert_denied(
        m.push_shard(tokio_stream::iter(vec![chunk("h0", 1_000, &forged)]))
            .await,
        "origin-not-this-host",
        "push naming h0",
    );
    assert_denied(
        m.push_shard(tokio_stream::iter(vec![chunk("h2", 1_000, &forged)]))
            .await,
        "origin-is-pusher",
        "push naming h2",
    );
    assert_eq!(snapshot(&tier), before, "h0's tier changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_api_is_not_served_on_tcp() {
    let p = pair();
    let mut a = AgentClient::new(tls_channel(
        &p.h0_addr,
        "h0",
        cluster().client_config(Some(&p.h1_files)),
    ));
    let codes = [
        a.uncordon(pb::UncordonRequest::default())
            .await
            .map(|_| ())
            .map_err(|s| s.code()),
        a.stop_ranks(pb::StopRanksRequest::default())
            .await
            .map(|_| ())
            .map_err(|s| s.code()),
        a.request_restart(pb::RequestRestartRequest::default())
            .await
            .map(|_| ())
            .map_err(|s| s.code()),
        a.get_node_health(pb::GetNodeHealthRequest {})
            .await
            .map(|_| ())
            .map_err(|s| s.code()),
    ];
    for c in codes {
        assert_eq!(c, Err(tonic::Code::Unimplemented));
    }
    drop(p.h1);
}

/// The certificate h0 presents in a fresh handshake.
async fn served_cert(addr: &str, client: &NodeFiles) -> Vec<u8> {
    let cfg = std::sync::Arc::new(cluster().client_config(Some(client)));
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let s = tokio_rustls::TlsConnector::from(cfg)
        .connect(
            rustls::pki_types::ServerName::try_from("h0").expect("name"),
            tcp,
        )
        .await
        .expect("handshake");
    s.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .expect("a server certificate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let a0 = format!("127.0.0.2:{}", free_port("127.0.0.2"));
    let f0 = cluster().node("h0");
    let agent = TestAgent::start(&format!(
        "[agent]\nhost_name = \"h0\"\n[api]\ntcp = \"{a0}\"\n{}",
        f0.api_keys()
    ));
    let client = cluster().node("h1");
    let first = served_cert(&a0, &client).await;
    let pid = agent.pid();

    // A bad file: refused, the last good set stays in force.
    std::fs::write(&f0.cert, "not a certificate").expect("write");
    let mut events = Events::all(&agent).await;
    events
        .expect(&agent, Duration::from_secs(30), "tls.reload_failed", |e| {
            e.kind == "tls.reload_failed"
        })
        .await;
    assert_eq!(served_cert(&a0, &client).await, first);

    // A new certificate and key: served from the next connection on.
    cluster().issue_to("h0", &f0.cert, &f0.key);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if served_cert(&a0, &client).await != first {
            break;
        }
        assert!(Instant::now() < deadline, "{}", agent.stderr());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(agent.pid(), pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_tcp_is_a_warning_in_health() {
    let agent = TestAgent::start(
        "[agent]\nhost_name = \"open\"\n[api]\ntcp = \"127.0.0.1:0\"\ninsecure = true\n",
    );
    let c = agent
        .component("agent/api.tcp")
        .await
        .expect("the agent/api.tcp component");
    assert_eq!(c.status, pb::Status::Degraded as i32, "{c:?}");
    assert!(
        c.reasons
            .iter()
            .any(|r| r.message.contains("no authentication")),
        "{c:?}"
    );
    let out = std::process::Command::new(crate::common::WARDEN)
        .arg("--socket")
        .arg(agent.socket())
        .arg("health")
        .output()
        .expect("warden health");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("agent/api.tcp"), "{text}");
    assert!(text.contains("DEGRADED"), "{text}");
}
