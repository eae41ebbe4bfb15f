//! Multi-host coordination through an etcd with TLS and authentication on,
//! as a production etcd runs: `--client-cert-auth` (a client must show a
//! certificate of the cluster's CA) and `auth enable` with a `warden` user
//! whose role may read and write the jobs' prefix and nothing else. The
//! test makes the certificates (rcgen) and the users (etcd's auth API)
//! itself; everything listens on 127.0.0.x.
//!
//! What is shown, through the coordination library (two hosts' launchers
//! in one process, advertising 127.0.0.2 and 127.0.0.3) and through the
//! real `warden run` and `warden goodput` binaries:
//! - with the CA, a client certificate and the right password, two hosts
//!   form a round and their goodput reports are read back;
//! - a wrong password, no client certificate, a client certificate of
//!   another CA, a server the client's CA did not sign, a user without the
//!   role, and a plain `http://` endpoint to the TLS port are each refused
//!   with a message that names the cause (and never the password);
//! - `warden run` with a wrong password exits non-zero before it starts a
//!   worker, and `warden goodput --etcd` with one is refused by name;
//!   a missing password file is named with its flag (exit 2).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::etcd::{
    EtcdServer, JOBS_PREFIX, OUTSIDER, OUTSIDER_PASSWORD, PASSWORD, Pki, SecureEtcd, USER,
};
use common::within;
use warden_launcher::coord::reports::Reports;
use warden_launcher::coord::{
    ClientIdentity, CoordConfig, CoordError, Coordinator, Credentials, EtcdAccess, EtcdTlsFiles,
    Leave, Password,
};
use warden_proto::v1 as pb;

/// Every wait: a TLS handshake and a login on a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(60);
/// The deadline of each etcd request.
const REQUEST: Duration = Duration::from_secs(10);

/// TLS with the cluster CA and `cert`/`key`, logged in as `user`.
fn access(ca: &Path, id: Option<(&Path, &Path)>, user: Option<(&str, &str)>) -> EtcdAccess {
    EtcdAccess {
        tls: Some(EtcdTlsFiles {
            ca: ca.to_owned(),
            identity: id.map(|(cert, key)| ClientIdentity {
                cert: cert.to_owned(),
                key: key.to_owned(),
            }),
        }),
        auth: user.map(|(user, password)| Credentials {
            user: user.to_owned(),
            password: Password::new(password),
        }),
    }
}

/// What a launcher of the job uses: the CA, its certificate, `warden`.
fn good(pki: &Pki) -> EtcdAccess {
    access(
        &pki.ca,
        Some((&pki.client_cert, &pki.client_key)),
        Some((USER, PASSWORD)),
    )
}

fn cfg(etcd: &SecureEtcd, access: EtcdAccess, job: &str, host: &str, addr: &str) -> CoordConfig {
    let mut c = CoordConfig::new(etcd.server.endpoints(), job, host, addr);
    c.access = access;
    c.min_nodes = 2;
    c.max_nodes = 2;
    c.lease_ttl = Duration::from_secs(2);
    c.last_call = Duration::from_millis(300);
    c.request_timeout = REQUEST;
    c.join_timeout = Duration::from_secs(5);
    c
}

/// `join` must fail; its message.
async fn refused(c: CoordConfig) -> String {
    let what = format!("a join as {:?}", c.access.auth.as_ref().map(|a| &a.user));
    match within(WAIT, &what, Coordinator::join(c)).await {
        Ok(_) => panic!("{what} was let in"),
        Err(e) => {
            let text = e.to_string();
            eprintln!("refused: {text}");
            assert!(
                !text.contains(PASSWORD) && !text.contains(OUTSIDER_PASSWORD),
                "a password in an error: {text}"
            );
            assert!(
                matches!(e, CoordError::Connect { .. }),
                "not a connect error: {e:?}"
            );
            text
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_form_a_round_over_tls_and_auth() {
    let etcd = EtcdServer::start_secure();
    assert!(etcd.server.endpoint.starts_with("https://"));
    let a = within(
        WAIT,
        "host-a joins",
        Coordinator::join(cfg(
            &etcd,
            good(&etcd.pki),
            "job-tls",
            "host-a",
            "127.0.0.2",
        )),
    )
    .await
    .expect("host-a joins over TLS as warden");
    let b = within(
        WAIT,
        "host-b joins",
        Coordinator::join(cfg(
            &etcd,
            good(&etcd.pki),
            "job-tls",
            "host-b",
            "127.0.0.3",
        )),
    )
    .await
    .expect("host-b joins over TLS as warden");
    let ra = a.wait_for_round(0, WAIT).await.expect("host-a's round");
    let rb = b.wait_for_round(0, WAIT).await.expect("host-b's round");
    assert_eq!(ra.epoch, rb.epoch);
    assert_eq!(*ra.members, ["host-a", "host-b"]);
    assert_eq!((ra.node_rank, rb.node_rank), (Some(0), Some(1)));
    assert_eq!(ra.master_addr, "127.0.0.2");
    // The goodput reports go the same way.
    let reports = Reports::connect(
        &etcd.server.endpoints(),
        &good(&etcd.pki),
        "/warden/jobs",
        "job-tls",
        REQUEST,
    )
    .await
    .expect("reports over TLS");
    let mine = pb::JobGoodput {
        job_id: "job-tls".into(),
        ..pb::JobGoodput::default()
    };
    reports.publish("host-a", &mine).await.expect("publish");
    let found = reports.read().await.expect("read");
    assert_eq!(found.reports.len(), 1);
    a.leave(Leave::Finished).await.expect("host-a leaves");
    b.leave(Leave::Finished).await.expect("host-b leaves");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_wrong_credential_is_refused_by_name() {
    let etcd = EtcdServer::start_secure();
    let pki = &etcd.pki;
    let id = Some((pki.client_cert.as_path(), pki.client_key.as_path()));
    let job = "job-refused";
    let c = |access| cfg(&etcd, access, job, "host-a", "127.0.0.2");

    let wrong = refused(c(access(&pki.ca, id, Some((USER, "not-the-password"))))).await;
    assert!(wrong.contains("wrong user name or password"), "{wrong}");
    assert!(wrong.contains(USER), "{wrong}");

    let outsider = refused(c(access(&pki.ca, id, Some((OUTSIDER, OUTSIDER_PASSWORD))))).await;
    assert!(outsider.contains("may not read or write"), "{outsider}");
    assert!(
        outsider.contains(&format!("{JOBS_PREFIX}{job}/")),
        "{outsider}"
    );

    let nobody = refused(c(access(&pki.ca, id, None))).await;
    assert!(nobody.contains("--etcd-user"), "{nobody}");

    let no_cert = refused(c(access(&pki.ca, None, Some((USER, PASSWORD))))).await;
    assert!(no_cert.contains("wants a client certificate"), "{no_cert}");

    let stranger = refused(c(access(
        &pki.ca,
        Some((&pki.stranger_cert, &pki.stranger_key)),
        Some((USER, PASSWORD)),
    )))
    .await;
    assert!(
        stranger.contains("refused this client's certificate"),
        "{stranger}"
    );

    let other_ca = refused(c(access(&pki.stranger_ca, id, Some((USER, PASSWORD))))).await;
    assert!(
        other_ca.contains("TLS handshake with etcd failed"),
        "{other_ca}"
    );
    assert!(other_ca.contains("UnknownIssuer"), "{other_ca}");

    let mut plain = c(EtcdAccess {
        tls: None,
        auth: Some(Credentials {
            user: USER.into(),
            password: Password::new(PASSWORD),
        }),
    });
    plain.endpoints = vec![etcd.server.endpoint.replacen("https://", "http://", 1)];
    let plain = refused(plain).await;
    assert!(plain.contains("--etcd-cacert"), "{plain}");
}

/// The embedded agents of the launcher tests: fast ticks, no hardware.
const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n[dcgm]\nenabled = false\n\
    [checkpoint]\nenabled = false\n";

/// `warden run --rdzv-backend etcd` as `host` (advertising `addr`) with
/// the TLS and auth flags of `pki` and `password_file`, output to files in
/// `dir`; one worker, a shell that prints the round's world size (no
/// Python needed: what is tested is the launchers' way through etcd).
fn launch(
    etcd: &SecureEtcd,
    dir: &Path,
    host: &str,
    addr: &str,
    password_file: &Path,
    shared: &Path,
) -> std::process::Child {
    use std::process::{Command, Stdio};
    let pki = &etcd.pki;
    let toml = AGENT_TOML.replacen(
        "[agent]\n",
        &format!("[agent]\nhost_name = \"{host}\"\n"),
        1,
    );
    std::fs::write(dir.join("agent.toml"), toml).expect("write the agent config");
    let mut cmd = Command::new(common::WARDEN);
    cmd.arg("--socket")
        .arg(dir.join("no-agent-here.sock"))
        .arg("run")
        .args(["--nproc-per-node", "1", "--nnodes", "2"])
        .args(["--rdzv-backend", "etcd"])
        .args(["--rdzv-endpoint", &etcd.server.endpoint])
        .args(["--rdzv-id", "job-run-tls"])
        .args(["--rdzv-conf", "join_timeout=60,last_call_timeout=1"])
        .args(["--host-id", host, "--advertise-addr", addr])
        .args(["--rdzv-lease-ttl", "2s"])
        .arg("--etcd-cacert")
        .arg(&pki.ca)
        .arg("--etcd-cert")
        .arg(&pki.client_cert)
        .arg("--etcd-key")
        .arg(&pki.client_key)
        .args(["--etcd-user", USER])
        .arg("--etcd-password-file")
        .arg(password_file)
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--agent-config")
        .arg(dir.join("agent.toml"))
        .args(["--no-python", "--", "sh", "-c"])
        // Both hosts' workers run until each has seen the other's start
        // (a file in a shared directory, polled for at most 120 s): a job
        // that ends on one host before the other joins would prove nothing.
        .arg(format!(
            "echo \"worker started world_size=$WORLD_SIZE group_rank=$GROUP_RANK\"; \
             touch {shared}/r$GROUP_RANK; i=0; \
             while [ ! -e {shared}/r0 ] || [ ! -e {shared}/r1 ]; do \
               i=$((i+1)); [ $i -gt 2400 ] && exit 9; sleep 0.05; done",
            shared = shared.display()
        ))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("stdout")).expect("stdout file"))
        .stderr(std::fs::File::create(dir.join("stderr")).expect("stderr file"));
    for var in [
        "WARDEN_SOCKET",
        "WARDEN_JOB_ID",
        "RUNTIME_DIRECTORY",
        "STATE_DIRECTORY",
        "NOTIFY_SOCKET",
        "WARDEN_ETCD_PASSWORD",
    ] {
        cmd.env_remove(var);
    }
    cmd.spawn().expect("spawn warden run")
}

/// Waits (polling, with a deadline) for `child` to exit; its code and
/// output.
fn finish(mut child: std::process::Child, dir: &Path) -> (i32, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(s) = child.try_wait().expect("poll warden run") {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "warden run did not exit within 180 s:\n{}{}",
                std::fs::read_to_string(dir.join("stdout")).unwrap_or_default(),
                std::fs::read_to_string(dir.join("stderr")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = format!(
        "{}{}",
        std::fs::read_to_string(dir.join("stdout")).unwrap_or_default(),
        std::fs::read_to_string(dir.join("stderr")).unwrap_or_default()
    );
    (status.code().unwrap_or(-1), out)
}

/// Two real launchers, on 127.0.0.2 and 127.0.0.3, run a job through the
/// TLS+auth etcd; `warden goodput --etcd` with the same flags reads their
/// reports back. Then a launcher with the wrong password is refused
/// before any worker starts, and exits non-zero.
#[test]
fn warden_run_over_tls_and_auth_and_refused_with_a_wrong_password() {
    let etcd = EtcdServer::start_secure();
    let (da, db) = (
        tempfile::tempdir().expect("scratch a"),
        tempfile::tempdir().expect("scratch b"),
    );
    let shared = tempfile::tempdir().expect("scratch shared");
    let a = launch(
        &etcd,
        da.path(),
        "host-a",
        "127.0.0.2",
        &etcd.pki.password_file,
        shared.path(),
    );
    let b = launch(
        &etcd,
        db.path(),
        "host-b",
        "127.0.0.3",
        &etcd.pki.password_file,
        shared.path(),
    );
    let (code_a, out_a) = finish(a, da.path());
    let (code_b, out_b) = finish(b, db.path());
    assert_eq!(code_a, 0, "host-a:\n{out_a}");
    assert_eq!(code_b, 0, "host-b:\n{out_b}");
    for out in [&out_a, &out_b] {
        assert!(out.contains("worker started world_size=2"), "{out}");
        assert!(out.contains("TLS (CA "), "{out}");
        assert!(
            !out.contains(PASSWORD),
            "the password in the output:\n{out}"
        );
    }

    // A report in etcd (the workers here are no ranks the agent accounts).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let reports = Reports::connect(
            &etcd.server.endpoints(),
            &good(&etcd.pki),
            "/warden/jobs",
            "job-run-tls",
            REQUEST,
        )
        .await
        .expect("reports over TLS");
        let r = pb::JobGoodput {
            job_id: "job-run-tls".into(),
            hosts: vec!["host-a".into()],
            ..pb::JobGoodput::default()
        };
        reports.publish("host-a", &r).await.expect("publish");
    });
    let goodput = std::process::Command::new(common::WARDEN)
        .args(["goodput", "--json", "--job", "job-run-tls"])
        .args(["--etcd", &etcd.server.endpoint])
        .arg("--etcd-cacert")
        .arg(&etcd.pki.ca)
        .arg("--etcd-cert")
        .arg(&etcd.pki.client_cert)
        .arg("--etcd-key")
        .arg(&etcd.pki.client_key)
        .args(["--etcd-user", USER])
        .env("WARDEN_ETCD_PASSWORD", PASSWORD)
        .output()
        .expect("run warden goodput");
    let text = String::from_utf8_lossy(&goodput.stdout);
    assert!(
        goodput.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&goodput.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(&text).expect("goodput JSON");
    let hosts = json["hosts"].as_object().expect("hosts");
    assert!(hosts.contains_key("host-a"), "{json}");

    // The same with a wrong password: refused, named, non-zero.
    let refused = std::process::Command::new(common::WARDEN)
        .args(["goodput", "--job", "job-run-tls"])
        .args(["--etcd", &etcd.server.endpoint])
        .arg("--etcd-cacert")
        .arg(&etcd.pki.ca)
        .arg("--etcd-cert")
        .arg(&etcd.pki.client_cert)
        .arg("--etcd-key")
        .arg(&etcd.pki.client_key)
        .args(["--etcd-user", USER])
        .arg("--etcd-password-file")
        .arg(&etcd.pki.wrong_password_file)
        .env_remove("WARDEN_ETCD_PASSWORD")
        .output()
        .expect("run warden goodput");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(said.contains("wrong user name or password"), "{said}");

    let dw = tempfile::tempdir().expect("scratch w");
    let w = launch(
        &etcd,
        dw.path(),
        "host-w",
        "127.0.0.4",
        &etcd.pki.wrong_password_file,
        shared.path(),
    );
    let (code_w, out_w) = finish(w, dw.path());
    assert_ne!(code_w, 0, "{out_w}");
    assert!(out_w.contains("wrong user name or password"), "{out_w}");
    assert!(out_w.contains(USER), "{out_w}");
    assert!(
        !out_w.contains("worker started world_size=2"),
        "a worker started:\n{out_w}"
    );
    assert!(!out_w.contains("not-the-password"), "{out_w}");

    // A bad flag is named before anything starts: exit 2.
    let dm = tempfile::tempdir().expect("scratch m");
    let missing = dm.path().join("missing-password");
    let m = launch(
        &etcd,
        dm.path(),
        "host-m",
        "127.0.0.5",
        &missing,
        shared.path(),
    );
    let (code_m, out_m) = finish(m, dm.path());
    assert_eq!(code_m, 2, "{out_m}");
    assert!(out_m.contains("--etcd-password-file"), "{out_m}");
    assert!(out_m.contains("missing-password"), "{out_m}");
}
