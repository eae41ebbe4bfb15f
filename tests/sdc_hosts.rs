//! System test of SDC across hosts through the job's aggregator (issue 30:
//! no all-to-all): three real `wardend`s on 127.0.0.2, 127.0.0.3 and
//! 127.0.0.4 (mutual TLS, a static fleet: each lists the other two in
//! `straggler.peers`), two Python ranks each (tests/fixtures/
//! sdc_values_rank.py, no torch) reporting loss and gradient norm with
//! `warden.report_values`. Rank 5, on the third host, has its gradient norm
//! multiplied by 100 from step 30.
//!
//! The third host flags it against all six ranks (basis `peers`, 6 ranks
//! compared: alone it would have only its own two), at the first bad step;
//! the other two flag nothing; the values went to the aggregator (the
//! first of the sorted addresses, 127.0.0.2) with one call per interval
//! from each host, and no agent called another's
//! ExchangeStragglerSummaries (the old all-to-all).

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    Events, Streaming, TestAgent, describe, evidence, python_rank, scrape, spawn_python_rank,
};

/// The sum of `metric`'s samples whose labels include `labels` (0: none).
fn total(m: &prometheus_parse::Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    m.samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

/// Generous: three agents and six Python ranks on a loaded 2-core machine.
const SLOW: Duration = Duration::from_secs(120);
const CORRUPT_STEP: u64 = 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_rank_on_one_host_is_judged_against_the_whole_job_via_the_aggregator() {
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
    let addrs: Vec<String> = ips
        .iter()
        .map(|ip| format!("{ip}:{}", common::free_port(ip)))
        .collect();
    let states: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let agents: Vec<TestAgent> = (0..3)
        .map(|i| {
            let host = format!("host-{}", ["a", "b", "c"][i]);
            let peers: Vec<String> = (0..3)
                .filter(|k| *k != i)
                .map(|k| format!("{:?}", addrs[k]))
                .collect();
            TestAgent::start(&format!(
                "[agent]\ntick = \"50ms\"\nhost_name = \"{host}\"\nstate_dir = \"{}\"\n\
                 [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
                 [hang]\nfloor = \"30s\"\n\
                 [sdc]\njudge_lag = 40\n\
                 [api]\ntcp = \"{}\"\n{}\
                 [straggler]\npeers = [{}]\nexchange_interval = \"100ms\"\n",
                states[i].path().display(),
                addrs[i],
                common::pki::api_keys(&host),
                peers.join(", "),
            ))
        })
        .collect();
    let mut events = Vec::new();
    for a in &agents {
        events.push(Events::all(a).await);
    }
    let job = "sdc-hosts";
    let mut ranks: Vec<Streaming> = (0..6u32)
        .map(|rank| {
            let agent = &agents[(rank / 2) as usize];
            let args = [
                "--steps",
                "80",
                "--step-ms",
                "20",
                "--corrupt-rank",
                "5",
                "--corrupt-step",
                "30",
            ];
            let mut cmd = python_rank(
                agent,
                "tests/fixtures/sdc_values_rank.py",
                job,
                (rank, 6),
                &args,
            );
            cmd.env("LOCAL_RANK", (rank % 2).to_string());
            spawn_python_rank(agent, job, rank, &mut cmd)
        })
        .collect();
    for r in &mut ranks {
        r.wait_line(SLOW, "registered", |l| l.starts_with("registered "));
    }
    let suspect = events[2]
        .expect(&agents[2], SLOW, "rank.sdc_suspect", |e| {
            e.kind == "rank.sdc_suspect"
        })
        .await;
    let d = describe(&suspect);
    assert_eq!(suspect.subject, format!("job/{job}/rank/5"), "{d}");
    assert_eq!(evidence(&suspect, "metric"), Some("grad_norm"), "{d}");
    assert_eq!(evidence(&suspect, "basis"), Some("peers"), "{d}");
    assert_eq!(evidence(&suspect, "ranks_compared"), Some("6"), "{d}");
    let flagged: u64 = evidence(&suspect, "step").unwrap().parse().unwrap();
    assert_eq!(flagged, CORRUPT_STEP, "{d}");
    for (rank, r) in ranks.iter_mut().enumerate() {
        r.wait_line(SLOW, "the end", |l| l.starts_with("done "));
        let status = r.wait_exit(SLOW);
        assert!(status.success(), "rank {rank}: {status:?}\n{}", r.stderr());
    }
    // The other hosts judged their own ranks clean; only the owner speaks.
    for (i, a) in agents.iter().enumerate().take(2) {
        for rank in [2 * i, 2 * i + 1] {
            let subject = format!("job/{job}/rank/{rank}");
            if events[i].count("rank.deregistered", &subject) == 0 {
                let _ = events[i]
                    .expect(a, SLOW, "the rank leaving", |e| {
                        e.kind == "rank.deregistered" && e.subject == subject
                    })
                    .await;
            }
        }
        assert_eq!(
            events[i].count("rank.sdc_suspect", ""),
            0,
            "{}",
            events[i].summary()
        );
    }
    // One aggregator (127.0.0.2 sorts first) took every host's reports;
    // nobody called the old all-to-all.
    for a in &agents {
        let (m, text) = scrape(a).await;
        let old = total(
            &m,
            "warden_api_requests_total",
            &[("method", "ExchangeStragglerSummaries")],
        );
        assert_eq!(old, 0.0, "{text}");
    }
    let (m, text) = scrape(&agents[0]).await;
    let taken = total(
        &m,
        "warden_api_requests_total",
        &[("method", "ReportToAggregator"), ("code", "OK")],
    );
    assert!(taken >= 2.0, "host-a took {taken} reports\n{text}");
    for a in &agents[1..] {
        let (m, text) = scrape(a).await;
        let served = total(
            &m,
            "warden_api_requests_total",
            &[("method", "ReportToAggregator")],
        );
        assert_eq!(served, 0.0, "only the first in order aggregates\n{text}");
    }
}
