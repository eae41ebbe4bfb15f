//! System tests of straggler detection: the real `wardend`, and real toy
//! training ranks (`warden toy-rank`, linked with the real client) whose
//! `forward` section is made slower on one rank.
//!
//! 1. One host, four ranks, rank 2 30% slower in `forward`, its GPU (a
//!    simulated node: gpu2 held down by thermal slowdown) explaining it:
//!    `rank.straggler` names the rank, the section, the GPU and the cause
//!    class; `warden stragglers --json` shows it flagged and the others not;
//!    the metrics count it.
//! 2. Two agents on 127.0.0.2 and 127.0.0.3 (api.tcp, mutual TLS with a
//!    test-made cluster CA) as two hosts of one
//!    job, each other's peers, two ranks each: the slow rank on host B is
//!    flagged by B (and only by B), and both agents' GetStragglers show the
//!    whole job with both hosts. Bad peer requests get clear errors.
//!
//! Steps are 30 ms (10 ms per section), windows 10 steps every 5: a rank is
//! flagged about half a second after it has 10 steps. Every wait has a
//! deadline; the waits are for events and answers, never sleeps.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TestAgent, WARDEN, eventually, evidence, free_port, run, sample, scrape, within};
use serde_json::Value;
use tokio_stream::StreamExt;
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;

/// Generous: the test machine may be compiling in parallel.
const DETECT: Duration = Duration::from_secs(30);

/// A toy rank (`warden toy-rank`), killed and reaped when dropped.
struct ToyRank(Child);

impl ToyRank {
    fn spawn(socket: &Path, job: &str, rank: u32, local: u32, world: u32, slow: f64) -> Self {
        let child = Command::new(WARDEN)
            .args(["toy-rank", "--steps", "1000000", "--step-ms", "30"])
            .args([
                "--slow-section",
                "forward",
                "--slow-factor",
                &slow.to_string(),
            ])
            .env("WARDEN_SOCKET", socket)
            .env("WARDEN_JOB_ID", job)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env_remove("TORCHELASTIC_RUN_ID")
            .env_remove("NOTIFY_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn warden toy-rank");
        Self(child)
    }
}

impl Drop for ToyRank {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Thresholds for a loaded test machine: the slow rank is 30% slower, so a
/// 15% minimum effect leaves room for scheduling noise on the others.
const STRAGGLER_TOML: &str = "[straggler]\nrelative_threshold = 1.15\n";

/// The agent's common settings: fast ticks, host memory never low.
fn base(host: &str) -> String {
    format!(
        "[agent]\ntick = \"50ms\"\nhost_name = \"{host}\"\n\
         [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n"
    )
}

/// Waits on `agent`'s event stream for an event of `kind` about `subject`.
async fn await_event(agent: &TestAgent, kind: &str, subject: &str) -> pb::Event {
    let mut stream = agent
        .client()
        .await
        .watch_events(pb::WatchEventsRequest { after_id: Some(0) })
        .await
        .expect("WatchEvents")
        .into_inner();
    within(DETECT, &format!("{kind} for {subject}"), async {
        while let Some(e) = stream.next().await {
            let e = e.expect("an event");
            if e.kind == kind && e.subject == subject {
                return e;
            }
        }
        panic!(
            "the event stream ended before {kind} for {subject}\n--- wardend stderr ---\n{}",
            agent.stderr()
        );
    })
    .await
}

/// `warden --socket <agent> stragglers --json ARGS...`, parsed.
fn stragglers_cli(agent: &TestAgent, args: &[&str]) -> Value {
    let out = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["--json", "stragglers"])
            .args(args),
        common::WAIT,
    );
    assert_eq!(out.code(), 0, "{out:?}");
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

fn flagged_ranks(v: &Value) -> Vec<u64> {
    v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["flagged"] == Value::Bool(true))
        .map(|r| r["global_rank"].as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_rank_on_one_host_is_flagged_and_explained() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("gpu2-thermal.toml");
    std::fs::write(
        &scenario,
        "description = \"gpu2 held down by thermal slowdown\"\n\
         [[gpu]]\ncount = 4\n\
         [[fault]]\nat = \"0s\"\nkind = \"thermal\"\ngpu = 2\n",
    )
    .unwrap();
    let agent = TestAgent::start_with(
        &format!("{}{STRAGGLER_TOML}", base("host-a")),
        &[("WARDEN_SIMULATE", scenario.to_str().unwrap())],
    );
    eventually(
        DETECT,
        "gpu2 DEGRADED by the simulated thermal slowdown",
        async || {
            agent
                .component("gpu2")
                .await
                .filter(|c| c.status == pb::Status::Degraded as i32)
        },
    )
    .await;

    let _ranks: Vec<ToyRank> = (0..4)
        .map(|r| {
            ToyRank::spawn(
                agent.socket(),
                "j1",
                r,
                r,
                4,
                if r == 2 { 1.3 } else { 1.0 },
            )
        })
        .collect();
    let ev = await_event(&agent, "rank.straggler", "job/j1/rank/2").await;
    assert_eq!(evidence(&ev, "section"), Some("forward"), "{ev:?}");
    assert_eq!(evidence(&ev, "devices"), Some("gpu2"), "{ev:?}");
    assert_eq!(
        evidence(&ev, "cause_class"),
        Some("correctable_hardware"),
        "{ev:?}"
    );
    assert_eq!(evidence(&ev, "host"), Some("host-a"), "{ev:?}");
    let relative: f64 = evidence(&ev, "relative").unwrap().parse().unwrap();
    assert!((1.15..1.6).contains(&relative), "{ev:?}");
    let explanation = evidence(&ev, "explanation").unwrap();
    assert!(
        explanation.starts_with("rank 2 is ")
            && explanation.contains("slower in forward; gpu2 reports HW thermal slowdown"),
        "{explanation}"
    );
    for key in ["individual", "samples", "job_median", "rank_median"] {
        assert!(
            evidence(&ev, key).is_some_and(|v| !v.is_empty()),
            "{key}: {ev:?}"
        );
    }

    // The CLI: every rank scored, rank 2 alone flagged, with the reason.
    let v = eventually(DETECT, "all four ranks scored", async || {
        let v = stragglers_cli(&agent, &[]);
        (v["ranks"].as_array().unwrap().len() == 4).then_some(v)
    })
    .await;
    assert_eq!(v["hosts"], serde_json::json!(["host-a"]));
    assert_eq!(flagged_ranks(&v), [2], "{v:#}");
    let two = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["global_rank"] == 2)
        .unwrap();
    assert_eq!(two["section"], "forward");
    assert_eq!(two["cause_class"], "correctable_hardware");
    assert_eq!(two["host"], "host-a");
    let only = stragglers_cli(&agent, &["--flagged", "--job", "j1"]);
    assert_eq!(only["ranks"].as_array().unwrap().len(), 1, "{only:#}");

    // Metrics: one flagged rank in the job, one flag raised.
    let (scrape, text) = scrape(&agent).await;
    assert_eq!(
        sample(&scrape, "warden_stragglers_flagged", &[("job", "j1")]),
        1.0,
        "{text}"
    );
    assert!(
        sample(&scrape, "warden_straggler_flags_total", &[]) >= 1.0,
        "{text}"
    );
    let rel = sample(
        &scrape,
        "warden_straggler_relative",
        &[("job", "j1"), ("rank", "2"), ("section", "forward")],
    );
    assert!(rel > 1.15, "{text}");

    // No other rank was ever flagged.
    let others: Vec<String> = agent
        .events()
        .await
        .into_iter()
        .filter(|e| e.kind == "rank.straggler" && e.subject != "job/j1/rank/2")
        .map(|e| format!("{e:?}"))
        .collect();
    assert!(others.is_empty(), "{others:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_compare_their_ranks_job_wide() {
    let (a_addr, b_addr) = (
        format!("127.0.0.2:{}", free_port("127.0.0.2")),
        format!("127.0.0.3:{}", free_port("127.0.0.3")),
    );
    let config = |host: &str, tcp: &str, peer: &str| {
        format!(
            "{}[api]\ntcp = \"{tcp}\"\n{}{STRAGGLER_TOML}peers = [\"{peer}\"]\n\
             exchange_interval = \"200ms\"\nsummary_ttl = \"5s\"\n",
            base(host),
            common::pki::api_keys(host)
        )
    };
    let a = TestAgent::start(&config("host-a", &a_addr, &b_addr));
    let b = TestAgent::start(&config("host-b", &b_addr, &a_addr));
    let _ranks = [
        ToyRank::spawn(a.socket(), "j2", 0, 0, 4, 1.0),
        ToyRank::spawn(a.socket(), "j2", 1, 1, 4, 1.0),
        ToyRank::spawn(b.socket(), "j2", 2, 0, 4, 1.0),
        ToyRank::spawn(b.socket(), "j2", 3, 1, 4, 1.3),
    ];

    // B owns rank 3; alone it has two ranks, too few to compare: the flag
    // needs A's summaries.
    let ev = await_event(&b, "rank.straggler", "job/j2/rank/3").await;
    assert_eq!(evidence(&ev, "section"), Some("forward"), "{ev:?}");
    assert_eq!(evidence(&ev, "host"), Some("host-b"), "{ev:?}");
    // More than host-b's own two: A's summaries were in the comparison
    // (all of A's ranks, or the first of them to reach the aggregator: a
    // loaded machine flagged rank 3 with 3 ranks compared).
    let compared: u32 = evidence(&ev, "ranks_compared")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((3..=4).contains(&compared), "{ev:?}");
    assert_eq!(evidence(&ev, "devices"), Some("gpu1"), "{ev:?}");
    assert_eq!(evidence(&ev, "cause_class"), Some("unknown"), "{ev:?}");

    // Both agents show the whole job: four ranks, both hosts, rank 3
    // flagged by host-b.
    for (agent, me, other) in [(&b, "host-b", "host-a"), (&a, "host-a", "host-b")] {
        let resp = eventually(
            DETECT,
            &format!("the job-wide picture on {me}"),
            async || {
                let r = agent
                    .client()
                    .await
                    .get_stragglers(pb::GetStragglersRequest {
                        job_id: "j2".into(),
                        flagged_only: false,
                    })
                    .await
                    .expect("GetStragglers")
                    .into_inner();
                let three_flagged = r.ranks.iter().any(|s| s.global_rank == 3 && s.flagged);
                (r.ranks.len() == 4 && three_flagged).then_some(r)
            },
        )
        .await;
        assert_eq!(resp.hosts, [me, other], "{resp:?}");
        let hosts: Vec<(u32, &str, bool)> = resp
            .ranks
            .iter()
            .map(|s| (s.global_rank, s.host.as_str(), s.flagged))
            .collect();
        assert_eq!(
            hosts,
            [
                (0, "host-a", false),
                (1, "host-a", false),
                (2, "host-b", false),
                (3, "host-b", true)
            ],
            "on {me}: {resp:?}"
        );
    }
    // Only the owner flags: A published no rank.straggler.
    assert!(
        !a.events().await.iter().any(|e| e.kind == "rank.straggler"),
        "host-a flagged a rank it does not own"
    );

    // Bad peer requests are refused with the field or the reason named.
    let mut peer = PeerClient::new(a.channel().await);
    let err = peer
        .exchange_straggler_summaries(pb::StragglerSummaries {
            host: "host-c".into(),
            ranks: Vec::new(),
            positions: vec![pb::JobPositions {
                job_id: "j2".into(),
                world_size: 4,
                ranks: vec![pb::RankPosition {
                    global_rank: 4,
                    ..Default::default()
                }],
                ..Default::default()
            }],
            values: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("positions[0].ranks[0].global_rank"),
        "{err:?}"
    );
    let err = peer
        .exchange_straggler_summaries(pb::StragglerSummaries {
            host: "host-c".into(),
            values: vec![pb::RankValues {
                job_id: "j2".into(),
                steps: vec![pb::StepValue::default(); 65],
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("values[0].steps"), "{err:?}");
    let err = peer
        .exchange_straggler_summaries(pb::StragglerSummaries {
            host: String::new(),
            ranks: Vec::new(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("host"), "{err:?}");
    let err = peer
        .exchange_straggler_summaries(pb::StragglerSummaries {
            host: "host-a".into(),
            ranks: Vec::new(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let err = peer
        .exchange_straggler_summaries(pb::StragglerSummaries {
            host: "host-c".into(),
            ranks: vec![pb::RankSummary {
                job_id: "j2".into(),
                global_rank: 9,
                sections: vec![pb::SectionMedian {
                    section: "forward".into(),
                    median_ns: -1.0,
                    samples: 10,
                }],
                window_seq: 1,
                score: None,
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("ranks[0].sections[0].median_ns"),
        "{err:?}"
    );
}

/// A static fleet on `ips`, one free port each: the addresses, in the
/// order the agents sort them into.
fn static_fleet(ips: &[&str]) -> Vec<String> {
    let addrs: Vec<String> = ips
        .iter()
        .map(|ip| format!("{ip}:{}", free_port(ip)))
        .collect();
    let mut sorted = addrs.clone();
    sorted.sort();
    assert_eq!(sorted, addrs, "the hosts' order is their addresses' order");
    addrs
}

/// The config of host `host`, the `me`th of the static fleet `addrs`: the
/// others as its straggler peers, a fast exchange, and `extra` keys of
/// `[straggler]`.
fn fleet_config(addrs: &[String], host: &str, me: usize, extra: &str) -> String {
    let peers: Vec<String> = addrs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != me)
        .map(|(_, a)| format!("\"{a}\""))
        .collect();
    format!(
        "{}[api]\ntcp = \"{}\"\n{}{STRAGGLER_TOML}peers = [{}]\n\
         exchange_interval = \"200ms\"\nsummary_ttl = \"3s\"\npeer_timeout = \"1s\"\n{extra}",
        base(host),
        addrs[me],
        common::pki::api_keys(host),
        peers.join(", ")
    )
}

/// Waits until `agent` flags `job`'s rank `rank` compared with `want`
/// ranks: the statistics it got from the job's aggregator cover them.
async fn flagged_against(agent: &TestAgent, job: &str, rank: u32, want: u32) -> pb::StragglerScore {
    eventually(
        DETECT,
        &format!("rank {rank} compared with {want} ranks"),
        async || {
            let r = agent
                .client()
                .await
                .get_stragglers(pb::GetStragglersRequest {
                    job_id: job.into(),
                    flagged_only: false,
                })
                .await
                .expect("GetStragglers")
                .into_inner();
            r.ranks
                .iter()
                .find(|s| s.global_rank == rank && s.flagged && s.ranks_compared == want)
                .cloned()
        },
    )
    .await
}

/// Issue 30: the job-wide exchange goes through one aggregator (the first
/// live agent of the sorted static peers: host-a here), and its loss is
/// handled like any lost host: the next in line (host-b) takes over, and
/// host-c's slow rank is still judged against the job's other live ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aggregators_loss_hands_the_job_wide_statistics_to_the_next_host() {
    let addrs = static_fleet(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]);
    let config = |host: &str, me: usize| fleet_config(&addrs, host, me, "");
    let a = TestAgent::start(&config("host-a", 0));
    let b = TestAgent::start(&config("host-b", 1));
    let c = TestAgent::start(&config("host-c", 2));
    let ranks_a = [
        ToyRank::spawn(a.socket(), "j3", 0, 0, 6, 1.0),
        ToyRank::spawn(a.socket(), "j3", 1, 1, 6, 1.0),
    ];
    let _others = [
        ToyRank::spawn(b.socket(), "j3", 2, 0, 6, 1.0),
        ToyRank::spawn(b.socket(), "j3", 3, 1, 6, 1.0),
        ToyRank::spawn(c.socket(), "j3", 4, 0, 6, 1.0),
        ToyRank::spawn(c.socket(), "j3", 5, 1, 6, 1.3),
    ];
    // host-c's rank 5 is judged against all six ranks: the statistics
    // come from the aggregator, which has every host's sketch.
    flagged_against(&c, "j3", 5, 6).await;
    // The aggregator goes, with its ranks.
    drop(ranks_a);
    drop(a);
    // host-b, next in line, aggregates host-b's and host-c's sketches: the
    // slow rank is still flagged, now against the four live ranks.
    let s = flagged_against(&c, "j3", 5, 4).await;
    assert_eq!(s.host, "host-c", "{s:?}");
}

/// Issue 30: the job-wide exchange as a two-level tree. Four hosts in
/// groups of two (`straggler.aggregator_fan_out = 2`): host-a and host-b
/// (group 0) report to host-a, the aggregator; host-d reports to host-c,
/// its group's leader, which relays to host-a. host-d's slow rank is
/// judged against all eight ranks through the relay; when the leader goes
/// host-d reports past it, and when the aggregator goes host-b takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_leader_relays_its_members_reports_and_their_loss_moves_the_route() {
    let addrs = static_fleet(&["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]);
    let config = |host: &str, me: usize| fleet_config(&addrs, host, me, "aggregator_fan_out = 2\n");
    let a = TestAgent::start(&config("host-a", 0));
    let b = TestAgent::start(&config("host-b", 1));
    let c = TestAgent::start(&config("host-c", 2));
    let d = TestAgent::start(&config("host-d", 3));
    let ranks_a = [
        ToyRank::spawn(a.socket(), "j4", 0, 0, 8, 1.0),
        ToyRank::spawn(a.socket(), "j4", 1, 1, 8, 1.0),
    ];
    let ranks_c = [
        ToyRank::spawn(c.socket(), "j4", 4, 0, 8, 1.0),
        ToyRank::spawn(c.socket(), "j4", 5, 1, 8, 1.0),
    ];
    let _others = [
        ToyRank::spawn(b.socket(), "j4", 2, 0, 8, 1.0),
        ToyRank::spawn(b.socket(), "j4", 3, 1, 8, 1.0),
        ToyRank::spawn(d.socket(), "j4", 6, 0, 8, 1.0),
        ToyRank::spawn(d.socket(), "j4", 7, 1, 8, 1.3),
    ];
    let relays = async |agent: &TestAgent, result: &str| {
        let (s, _) = scrape(agent).await;
        s.samples
            .iter()
            .filter(|x| {
                x.metric == "warden_straggler_relays_total"
                    && x.labels.get("result") == Some(result)
            })
            .map(|x| common::number(&x.value))
            .sum::<f64>()
    };
    // Through the relay: every host's sketch reached the aggregator.
    let s = flagged_against(&d, "j4", 7, 8).await;
    assert_eq!(s.host, "host-d", "{s:?}");
    assert!(
        relays(&c, "ok").await >= 1.0,
        "host-c, group 1's leader, relayed host-d's reports to host-a"
    );
    // In batches (straggler.relay_batch_window, 100 ms by default): one
    // ReportBatchToAggregator per window.
    let (s, text) = scrape(&c).await;
    let batches: f64 = s
        .samples
        .iter()
        .filter(|x| x.metric == "warden_straggler_relay_batch_reports_count")
        .map(|x| common::number(&x.value))
        .sum();
    assert!(batches >= 1.0, "host-c sent no batch: {text}");
    for (name, agent) in [("host-a", &a), ("host-b", &b), ("host-d", &d)] {
        assert_eq!(
            relays(agent, "ok").await + relays(agent, "here").await,
            0.0,
            "{name} leads no group other than the aggregator's, so relays nothing"
        );
    }
    // The leader goes, with its ranks: host-d reports past it, to host-a.
    drop(ranks_c);
    drop(c);
    flagged_against(&d, "j4", 7, 6).await;
    // The aggregator goes too: host-b, next in order, takes over.
    drop(ranks_a);
    drop(a);
    let s = flagged_against(&d, "j4", 7, 4).await;
    assert_eq!(s.host, "host-d", "{s:?}");
}

/// Issue 30, partial views: a host need know only its own group and
/// group 0 of the job's order. Six hosts in groups of two, handed over by
/// place (`job_hosts`, each peer's `place`; the restore's collectors in
/// groups of two as well): host-0 and host-1 (group 0)
/// the whole order, the others only their group and group 0. host-5's
/// slow rank is judged against all six through its leader host-4, which
/// relays to host-0; when host-4 goes, host-5 reports straight to group 0,
/// past hosts it was never told of. A list without a place the host needs
/// is taken with a warning naming it; places past the order are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_handed_only_its_group_and_group_zero_is_judged_job_wide() {
    let ips = [
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.4",
        "127.0.0.5",
        "127.0.0.6",
        "127.0.0.7",
    ];
    let addrs: Vec<String> = ips
        .iter()
        .map(|ip| format!("{ip}:{}", free_port(ip)))
        .collect();
    let config = |i: usize| {
        let host = format!("host-{i}");
        format!(
            "{}[api]\ntcp = \"{}\"\n{}{STRAGGLER_TOML}aggregator_fan_out = 2\n\
             exchange_interval = \"200ms\"\nsummary_ttl = \"3s\"\npeer_timeout = \"1s\"\n\
             [checkpoint]\ncollect_fan_out = 2\n",
            base(&host),
            addrs[i],
            common::pki::api_keys(&host)
        )
    };
    let mut agents: Vec<Option<TestAgent>> =
        (0..6).map(|i| Some(TestAgent::start(&config(i)))).collect();
    let agent =
        |agents: &[Option<TestAgent>], i: usize| agents[i].as_ref().map(|a| a.socket().to_owned());
    // Host i handed the places `places` of the order of six.
    let hand = |i: usize, places: &[usize]| pb::SetCheckpointPeersRequest {
        job_id: "j6".into(),
        peers: places
            .iter()
            .filter(|&&p| p != i)
            .map(|&p| pb::CheckpointPeer {
                addr: addrs[p].clone(),
                host: format!("host-{p}"),
                identity: format!("host-{p}"),
                place: p as u32,
                ..Default::default()
            })
            .collect(),
        self_place: i as u32 + 1,
        self_addr: addrs[i].clone(),
        job_hosts: 6,
        ..Default::default()
    };
    let needs = |i: usize| -> Vec<usize> {
        match i {
            0 | 1 => (0..6).collect(),
            _ => vec![0, 1, i / 2 * 2, i / 2 * 2 + 1],
        }
    };
    // Refused by name, nothing changed: a peer past the order, this host
    // past it, an order past the limit.
    let five = agents[5].as_ref().expect("host-5");
    let mut past = hand(5, &needs(5));
    past.peers[0].place = 6;
    let mut self_past = hand(5, &needs(5));
    self_past.self_place = 7;
    let mut huge = hand(5, &needs(5));
    huge.job_hosts = 70_000;
    for (req, words) in [
        (past, "place 6"),
        (
            self_past,
            "self_place 7 is past job \"j6\"'s order of 6 hosts",
        ),
        (huge, "job_hosts 70000"),
    ] {
        let e = five
            .client()
            .await
            .set_checkpoint_peers(req)
            .await
            .expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(words), "{words:?} in {e:?}");
    }
    // Without its leader's place: taken, and said.
    let short = five
        .client()
        .await
        .set_checkpoint_peers(hand(5, &[0, 1]))
        .await
        .expect("a short list is taken")
        .into_inner();
    assert!(
        short.warning.contains("without 1 of those this host needs")
            && short.warning.contains("the first at place 4"),
        "{short:?}"
    );
    for (i, a) in agents.iter().enumerate() {
        let a = a.as_ref().expect("up");
        let taken = a
            .client()
            .await
            .set_checkpoint_peers(hand(i, &needs(i)))
            .await
            .expect("SetCheckpointPeers")
            .into_inner();
        assert_eq!(taken.warning, "", "host-{i}: {taken:?}");
    }
    let ranks: Vec<Option<ToyRank>> = (0..6u32)
        .map(|r| {
            let socket = agent(&agents, r as usize).expect("up");
            let slow = if r == 5 { 1.3 } else { 1.0 };
            Some(ToyRank::spawn(&socket, "j6", r, 0, 6, slow))
        })
        .collect();
    let relays = async |agent: &TestAgent| {
        let (s, _) = scrape(agent).await;
        s.samples
            .iter()
            .filter(|x| {
                x.metric == "warden_straggler_relays_total" && x.labels.get("result") == Some("ok")
            })
            .map(|x| common::number(&x.value))
            .sum::<f64>()
    };
    let five = agents[5].as_ref().expect("host-5");
    let s = flagged_against(five, "j6", 5, 6).await;
    assert_eq!(s.host, "host-5", "{s:?}");
    assert!(
        relays(agents[4].as_ref().expect("host-4")).await >= 1.0,
        "host-4, group 2's leader, relayed host-5's reports to group 0"
    );
    // The leader goes, with its rank: host-5 reports to group 0 itself.
    let mut ranks = ranks;
    ranks[4].take();
    agents[4].take();
    let five = agents[5].as_ref().expect("host-5");
    let s = flagged_against(five, "j6", 5, 5).await;
    assert_eq!(s.host, "host-5", "{s:?}");
}

/// A report as a member's agent sends it: one job's sketch of one section.
fn member_report(host: &str, job: &str) -> pb::AggregateReport {
    pb::AggregateReport {
        host: host.into(),
        relative_threshold: 1.06,
        z_threshold: 4.0,
        jobs: vec![pb::JobSketches {
            job_id: job.into(),
            sections: vec![pb::SectionSketch {
                section: "forward".into(),
                keys: vec![4000],
                counts: vec![2],
            }],
            scores: Vec::new(),
        }],
        ..Default::default()
    }
}

/// Issue 30: a group leader passes its members' reports on in one
/// `ReportBatchToAggregator`. The aggregator takes each report as a
/// relayed one and answers it in its own item: a report refused alone
/// (malformed, the aggregator's own name, a host not of the job) gets its
/// status and the others are taken all the same. A caller that is no peer
/// of the job may not relay at all, and a batch past 4,096 reports is
/// refused whole, naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_relayed_reports_is_answered_report_by_report() {
    let addr = format!("127.0.0.2:{}", free_port("127.0.0.2"));
    let agg = TestAgent::start(&format!(
        "{}[api]\ntcp = \"{addr}\"\n{}{STRAGGLER_TOML}",
        base("host-a"),
        common::pki::api_keys("host-a")
    ));
    // The job's hosts as its launchers hand them over: host-a the
    // aggregator, host-b a group leader, host-c its member.
    let peers = ["host-a", "host-b", "host-c"]
        .iter()
        .enumerate()
        .map(|(i, h)| pb::CheckpointPeer {
            addr: if i == 0 {
                addr.clone()
            } else {
                format!("127.0.0.{}:7070", i + 2)
            },
            domain: String::new(),
            host: (*h).into(),
            identity: (*h).into(),
            ..Default::default()
        })
        .collect();
    agg.client()
        .await
        .set_checkpoint_peers(pb::SetCheckpointPeersRequest {
            job_id: "jb".into(),
            peers,
            ..Default::default()
        })
        .await
        .expect("SetCheckpointPeers");
    let ca = common::pki::cluster();
    let as_host = |name: &str| {
        common::pki::peer_client(&addr, "host-a", ca.client_config(Some(&ca.node(name))))
    };

    let mut leader = as_host("host-b");
    let mut empty = member_report("", "jb");
    empty.jobs.clear();
    let batch = vec![
        member_report("host-c", "jb"),
        member_report("host-z", "jb"),
        empty,
        member_report("host-a", "jb"),
        member_report("host-b", "jb"),
    ];
    let answer = leader
        .report_batch_to_aggregator(pb::AggregateBatch {
            reports: batch,
            shared_steps: true,
        })
        .await
        .expect("ReportBatchToAggregator")
        .into_inner();
    // The job's statistics are carried once, after every report of the
    // batch was taken: both taken reports point at the same, of both hosts.
    assert_eq!(answer.jobs.len(), 1, "{answer:?}");
    let outcome: Vec<Result<u32, (tonic::Code, String)>> = answer
        .items
        .into_iter()
        .map(|i| match i.outcome.expect("an outcome per report") {
            pb::aggregate_batch_item::Outcome::Answer(a) => {
                assert!(a.jobs.is_empty(), "{a:?}");
                assert_eq!(i.jobs, [0]);
                Ok(answer.jobs[0].hosts)
            }
            pb::aggregate_batch_item::Outcome::Error(e) => {
                Err((tonic::Code::from_i32(e.code), e.message))
            }
        })
        .collect();
    assert_eq!(outcome.len(), 5, "{outcome:?}");
    assert_eq!(outcome[0], Ok(2), "host-c's report taken: {outcome:?}");
    let refused = |i: usize, code: tonic::Code, says: &str| {
        let Err((c, m)) = &outcome[i] else {
            panic!("report {i} was taken: {outcome:?}")
        };
        assert_eq!(*c, code, "report {i}: {m}");
        assert!(m.contains(says), "report {i}: {m}");
    };
    refused(1, tonic::Code::PermissionDenied, "relay-for-member");
    refused(2, tonic::Code::InvalidArgument, "host");
    refused(3, tonic::Code::FailedPrecondition, "own name");
    assert_eq!(outcome[4], Ok(2), "host-b's report taken: {outcome:?}");

    // A CA-signed agent that is no peer of the job may not relay.
    let err = as_host("host-q")
        .report_batch_to_aggregator(pb::AggregateBatch {
            reports: vec![member_report("host-c", "jb")],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("relay-from-peer"), "{err:?}");
    // Past the limit, refused whole and named.
    let err = leader
        .report_batch_to_aggregator(pb::AggregateBatch {
            reports: vec![pb::AggregateReport::default(); 4097],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("4096"), "{err:?}");
    // The agent is up and still takes a report.
    let items = leader
        .report_batch_to_aggregator(pb::AggregateBatch {
            reports: vec![member_report("host-c", "jb")],
            ..Default::default()
        })
        .await
        .expect("ReportBatchToAggregator after the refusals")
        .into_inner()
        .items;
    assert!(
        matches!(
            items[0].outcome,
            Some(pb::aggregate_batch_item::Outcome::Answer(_))
        ),
        "{items:?}"
    );

    // SDC values: both hosts' one rank each at step 1 of a job of two
    // ranks. The step settles once the batch is folded, so both members
    // are answered with it, carried once and named by index.
    let answer = leader
        .report_batch_to_aggregator(pb::AggregateBatch {
            reports: vec![
                with_values(member_report("host-c", "jb"), 0, 1),
                with_values(member_report("host-b", "jb"), 1, 1),
            ],
            shared_steps: true,
        })
        .await
        .expect("ReportBatchToAggregator with values")
        .into_inner();
    let shared: Vec<(&str, u64)> = answer
        .steps
        .iter()
        .map(|s| (s.job_id.as_str(), s.step.as_ref().map_or(0, |s| s.step)))
        .collect();
    assert_eq!(shared, [("jb", 1)], "{answer:?}");
    let loss = answer.steps[0].step.as_ref().and_then(|s| s.loss.as_ref());
    assert_eq!(loss.map(|l| l.count), Some(2), "{answer:?}");
    for item in &answer.items {
        let Some(pb::aggregate_batch_item::Outcome::Answer(a)) = &item.outcome else {
            panic!("{item:?}")
        };
        assert_eq!(a.values.len(), 1, "{a:?}");
        assert!(
            a.values[0].steps.is_empty(),
            "shared, not in the item: {a:?}"
        );
        let refs: Vec<&[u32]> = item.values.iter().map(|r| r.steps.as_slice()).collect();
        assert_eq!(refs, [&[0u32][..]], "{item:?}");
    }
    // A leader older than shared steps gets each item's steps in full.
    let answer = leader
        .report_batch_to_aggregator(pb::AggregateBatch {
            reports: vec![
                with_values(member_report("host-c", "jb"), 0, 2),
                with_values(member_report("host-b", "jb"), 1, 2),
            ],
            shared_steps: false,
        })
        .await
        .expect("ReportBatchToAggregator with values, unshared")
        .into_inner();
    assert!(answer.steps.is_empty(), "{answer:?}");
    for item in &answer.items {
        let Some(pb::aggregate_batch_item::Outcome::Answer(a)) = &item.outcome else {
            panic!("{item:?}")
        };
        assert!(item.values.is_empty(), "{item:?}");
        let steps: Vec<u64> = a.values[0].steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, [2], "{a:?}");
    }
}

/// `report` with one rank's loss at `step`, of a job of two ranks.
fn with_values(mut report: pb::AggregateReport, rank: u32, step: u64) -> pb::AggregateReport {
    let job = report.jobs[0].job_id.clone();
    report.values = vec![pb::JobValues {
        job_id: job.clone(),
        active: 1,
        world_size: 2,
        ranks: vec![pb::RankValues {
            job_id: job,
            global_rank: rank,
            generation: 1,
            steps: vec![pb::StepValue {
                step,
                loss: Some(2.5),
                ..Default::default()
            }],
        }],
    }];
    report
}
