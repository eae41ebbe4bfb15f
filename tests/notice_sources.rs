//! The agent's notice sources against test servers that speak the real
//! protocols (tests/common/metadata.rs), each on a loopback address of its
//! own: the GCE metadata server's long-poll (`wait_for_change`,
//! `last_etag`, the `Metadata-Flavor` header both ways), EC2's IMDSv2 (the
//! token PUT, the token on every read, a refused token renewed), a
//! Kubernetes taint file (and one a user could write, refused), the
//! cloud detection from DMI strings, and the config's refusal of a source
//! URL any local user could answer. In-process: the real source tasks of
//! warden-agent, the real HTTP client, real sockets; no agent needed.

#![allow(clippy::expect_used, clippy::unwrap_used)]

#[path = "common/metadata.rs"]
mod metadata;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;
use warden_agent::notice::config::{AwsConfig, GceConfig, KubernetesConfig, NoticeConfig, Switch};
use warden_agent::notice::{Notice, NoticeBoard, NoticeSource, aws, detect, gce, kubernetes};
use warden_core::events::EventBus;

/// Generous: a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(20);

/// Polls `f` until it returns Some, or fails the test naming `what`.
async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn bus() -> Arc<EventBus> {
    Arc::new(EventBus::new(1000))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gce_preemption_is_seen_through_the_long_poll_with_etag_and_header() {
    let server = metadata::Gce::start("127.0.0.2").await;
    let board = NoticeBoard::default();
    let stop = CancellationToken::new();
    let cfg = GceConfig {
        url: server.url(),
        wait: Duration::from_secs(30),
        ..GceConfig::default()
    };
    let task = tokio::spawn(gce::run(cfg, board.clone(), bus(), stop.clone()));
    // Both keys that are served are held in a long-poll.
    until("two long-polls holding", || {
        (server.waiting() >= 2).then_some(())
    })
    .await;
    assert!(board.host_notice().is_none());
    let set_at = Instant::now();
    server.set("instance/preempted", Some("TRUE"));
    let n: Notice = until("the preemption notice", || board.host_notice()).await;
    let seen_after = set_at.elapsed();
    assert_eq!(n.source, NoticeSource::Gce);
    assert!(n.what.contains("instance/preempted = TRUE"), "{n:?}");
    let window = n
        .deadline
        .unwrap()
        .duration_since(SystemTime::now())
        .unwrap();
    assert!(
        window <= Duration::from_secs(30) && window > Duration::from_secs(20),
        "{window:?}"
    );
    // The long-poll brought it, not a timer: far below the 30 s wait.
    assert!(seen_after < Duration::from_secs(10), "{seen_after:?}");
    println!(
        "gce: preemption seen {} ms after the server's change",
        seen_after.as_millis()
    );
    let seen = server.seen();
    assert!(
        seen.iter().all(|s| s.proper),
        "a request without Metadata-Flavor: Google: {seen:?}"
    );
    let polls: Vec<_> = seen
        .iter()
        .filter(|s| {
            s.what.ends_with("instance/preempted") && s.query.contains_key("wait_for_change")
        })
        .collect();
    assert!(!polls.is_empty(), "{seen:?}");
    for p in &polls {
        assert_eq!(
            p.query.get("wait_for_change").map(String::as_str),
            Some("true"),
            "{p:?}"
        );
        assert_eq!(
            p.query.get("timeout_sec").map(String::as_str),
            Some("30"),
            "{p:?}"
        );
    }
    // The first long-poll carries the ETag of the value read plainly; the
    // one after the change carries the new value's.
    let etag = |p: &metadata::Seen| p.query.get("last_etag").cloned().unwrap_or_default();
    assert_eq!(etag(polls[0]), "e1", "{polls:?}");
    until("a long-poll from the new ETag", || {
        server
            .seen()
            .iter()
            .any(|s| s.what.ends_with("instance/preempted") && etag(s) == "e2")
            .then_some(())
    })
    .await;
    // The server refuses a request without the header, as the real one does.
    let r = reqwest::Client::new()
        .get(format!("{}/instance/preempted", server.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::FORBIDDEN);
    stop.cancel();
    tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gce_maintenance_raises_and_clears_and_upcoming_maintenance_within_its_lead() {
    let server = metadata::Gce::start("127.0.0.3").await;
    let board = NoticeBoard::default();
    let stop = CancellationToken::new();
    let cfg = GceConfig {
        url: server.url(),
        wait: Duration::from_secs(30),
        ..GceConfig::default()
    };
    tokio::spawn(gce::run(cfg.clone(), board.clone(), bus(), stop.clone()));
    until("long-polls holding", || {
        (server.waiting() >= 2).then_some(())
    })
    .await;
    server.set(
        "instance/maintenance-event",
        Some("TERMINATE_ON_HOST_MAINTENANCE"),
    );
    let n = until("the maintenance notice", || board.host_notice()).await;
    assert!(n.what.contains("TERMINATE_ON_HOST_MAINTENANCE"), "{n:?}");
    server.set("instance/maintenance-event", Some("NONE"));
    until("the notice cleared", || {
        board.host_notice().is_none().then_some(())
    })
    .await;
    server.set(
        "instance/maintenance-event",
        Some("MIGRATE_ON_HOST_MAINTENANCE"),
    );
    let n = until("the migration notice", || board.host_notice()).await;
    assert!(n.what.contains("MIGRATE_ON_HOST_MAINTENANCE"), "{n:?}");
    stop.cancel();

    // upcoming-maintenance: far away is no notice; within the lead it is,
    // with the window's start as the deadline (the judgement is pure).
    let now = SystemTime::now();
    let at = |d: u64| humantime::format_rfc3339_seconds(now + Duration::from_secs(d)).to_string();
    let far = format!(r#"{{"type":"SCHEDULED","windowStartTime":"{}"}}"#, at(3600));
    assert!(gce::judge(gce::Key::Upcoming, &far, &cfg, now).is_none());
    let near = format!(r#"{{"type":"SCHEDULED","windowStartTime":"{}"}}"#, at(30));
    let (what, deadline) = gce::judge(gce::Key::Upcoming, &near, &cfg, now).unwrap();
    assert!(what.contains("SCHEDULED"), "{what}");
    assert!(deadline > now + Duration::from_secs(20));
    assert!(gce::judge(gce::Key::Preempted, "FALSE", &cfg, now).is_none());
    assert!(gce::judge(gce::Key::Maintenance, "NONE", &cfg, now).is_none());
    assert!(gce::judge(gce::Key::Upcoming, "{not json", &cfg, now).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gce_answer_without_the_flavor_header_is_not_believed() {
    // A server that answers TRUE without `Metadata-Flavor: Google` (not the
    // metadata server: a proxy, a captive portal) raises nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.4:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/computeMetadata/v1/instance/{*key}",
        axum::routing::get(|| async { "TRUE" }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let cfg = GceConfig {
        url: format!("http://{addr}/computeMetadata/v1"),
        ..GceConfig::default()
    };
    let client = reqwest::Client::new();
    let r = gce::read(&client, &cfg, gce::Key::Preempted, None).await;
    let e = r.expect_err("an answer without the header is refused");
    assert!(e.contains("Metadata-Flavor"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_spot_interruption_is_read_with_an_imdsv2_token_and_a_refused_token_renewed() {
    let server = metadata::Aws::start("127.0.0.5").await;
    let board = NoticeBoard::default();
    let stop = CancellationToken::new();
    let cfg = AwsConfig {
        url: server.url(),
        poll_interval: Duration::from_millis(100),
        ..AwsConfig::default()
    };
    tokio::spawn(aws::run(cfg, board.clone(), bus(), stop.clone()));
    until("a few reads with no action", || {
        (server
            .seen()
            .iter()
            .filter(|s| s.what.starts_with("GET"))
            .count()
            >= 3)
            .then_some(())
    })
    .await;
    assert!(board.host_notice().is_none());
    assert_eq!(server.tokens_issued(), 1, "one token for many reads");
    // The token is refused: a new one is asked for, and reads go on.
    server.expire_tokens();
    until("a second token", || {
        (server.tokens_issued() >= 2).then_some(())
    })
    .await;
    let when =
        humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(120)).to_string();
    server.set_action(Some(&format!(
        r#"{{"action": "terminate", "time": "{when}"}}"#
    )));
    let n = until("the spot notice", || board.host_notice()).await;
    assert_eq!(n.source, NoticeSource::Aws);
    assert!(n.what.contains("terminate"), "{n:?}");
    let left = n
        .deadline
        .unwrap()
        .duration_since(SystemTime::now())
        .unwrap();
    assert!(
        left > Duration::from_secs(100) && left <= Duration::from_secs(120),
        "{left:?}"
    );
    let seen = server.seen();
    assert!(
        seen.iter()
            .filter(|s| s.what.starts_with("PUT"))
            .all(|s| s.proper),
        "{seen:?}"
    );
    // Every read but the one the expiry refused carried a live token.
    let refused = seen
        .iter()
        .filter(|s| s.what.starts_with("GET") && !s.proper)
        .count();
    assert_eq!(refused, 1, "{seen:?}");
    server.set_action(None);
    until("the notice cleared", || {
        board.host_notice().is_none().then_some(())
    })
    .await;
    stop.cancel();
    // The judgement of odd bodies (pure).
    assert!(aws::judge("{}").is_none());
    assert!(aws::judge(r#"{"action":"nothing"}"#).is_none());
    assert!(aws::judge(r#"{"action":"stop","time":"garbage"}"#).is_some_and(|(_, d)| d.is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_taint_in_a_file_raises_a_notice_and_a_file_others_can_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = dir.path().join("taints");
    std::fs::write(&file, r#"[{"key":"other","effect":"NoSchedule"}]"#).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let board = NoticeBoard::default();
    let stop = CancellationToken::new();
    let cfg = KubernetesConfig {
        taints_file: file.display().to_string(),
        poll_interval: Duration::from_millis(100),
        ..KubernetesConfig::default()
    };
    let events = bus();
    tokio::spawn(kubernetes::run(
        cfg.clone(),
        board.clone(),
        events.clone(),
        stop.clone(),
    ));
    // A taint not named, and a named one with a mild effect, mean no stop
    // (the judgement is pure; the running source is checked below).
    let named = &cfg.taints;
    assert!(
        kubernetes::judge(
            &kubernetes::parse(r#"[{"key":"other","effect":"NoSchedule"}]"#),
            named
        )
        .is_none()
    );
    assert!(
        kubernetes::judge(
            &kubernetes::parse("cloud.google.com/impending-node-termination:PreferNoSchedule\n"),
            named
        )
        .is_none()
    );
    assert!(board.host_notice().is_none());
    // kubectl's line form, named, NoExecute.
    std::fs::write(
        &file,
        "# node taints\ncloud.google.com/impending-node-termination=true:NoExecute\n",
    )
    .unwrap();
    let n = until("the taint notice", || board.host_notice()).await;
    assert_eq!(n.source, NoticeSource::Kubernetes);
    assert!(
        n.what.contains("impending-node-termination=true:NoExecute"),
        "{n:?}"
    );
    // A file group or others can write: refused, and the notice it held
    // stays (a refused read is no all-clear), shown as the source's trouble.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
    let refused = until("the refusal event", || {
        let (evs, _) = events.list(0, 100);
        evs.into_iter()
            .find(|e| e.kind == "notice.source_error")
            .map(|e| e.message.clone())
    })
    .await;
    assert!(refused.contains("writable by group or others"), "{refused}");
    assert!(kubernetes::read(&file, nix::unistd::geteuid().as_raw()).is_err());
    stop.cancel();
    // Parsing: the node's JSON, and lines.
    let t =
        kubernetes::parse(r#"{"spec":{"taints":[{"key":"a","value":"b","effect":"NoExecute"}]}}"#);
    assert_eq!(t.len(), 1);
    assert_eq!(
        (t[0].key.as_str(), t[0].value.as_str(), t[0].effect.as_str()),
        ("a", "b", "NoExecute")
    );
    assert!(kubernetes::parse("garbage without colon").is_empty());
}

#[test]
fn clouds_are_detected_from_dmi_strings_only() {
    let root = tempfile::tempdir().unwrap();
    assert_eq!(
        detect::cloud(root.path()),
        None,
        "nothing in sysfs: no cloud"
    );
    let dmi = root.path().join("class/dmi/id");
    std::fs::create_dir_all(&dmi).unwrap();
    std::fs::write(dmi.join("product_name"), "Google Compute Engine\n").unwrap();
    assert_eq!(detect::cloud(root.path()), Some(detect::Cloud::Gce));
    std::fs::write(dmi.join("product_name"), "m5.large\n").unwrap();
    std::fs::write(dmi.join("sys_vendor"), "Amazon EC2\n").unwrap();
    assert_eq!(detect::cloud(root.path()), Some(detect::Cloud::Aws));
    assert_eq!(detect::judge("", "QEMU", "SeaBIOS", ""), None);
    assert_eq!(
        detect::judge("", "", "", "ec2e1916-9099-7caf"),
        Some(detect::Cloud::Aws)
    );
}

#[test]
fn a_source_url_any_local_user_could_answer_is_refused_unless_allowed() {
    let mut c = NoticeConfig::default();
    c.gce.enabled = Switch::On;
    c.gce.url = "http://127.0.0.1:8080/computeMetadata/v1".into();
    let e = c.validate("test").unwrap_err().to_string();
    assert!(e.contains("notice.gce.url"), "{e}");
    assert!(e.contains("any local user"), "{e}");
    c.allow_user_endpoints = true;
    c.validate("test").unwrap();
    c.aws.url = "https://169.254.169.254".into();
    let e = c.validate("test").unwrap_err().to_string();
    assert!(e.contains("notice.aws.url"), "{e}");
    c.aws.url = "http://169.254.169.254".into();
    c.kubernetes.taints_file = "relative/path".into();
    assert!(
        c.validate("test")
            .unwrap_err()
            .to_string()
            .contains("notice.kubernetes.taints_file")
    );
    // The default config validates and runs nothing off the clouds.
    NoticeConfig::default().validate("test").unwrap();
}
