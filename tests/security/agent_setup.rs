//! The agent's own setup (issue 29, point 12): the nvhcd socket is the
//! socket group's like the API socket (NVRx runs as the job's user), a
//! socket mode that lets every user of the host in is refused at start
//! naming `api.socket_mode`, and a policy hook that a user other than root
//! could change (its file or its directory theirs or writable by them) is
//! refused at start naming `policy.hook.command[0]`, before anything runs
//! it with root's rights.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use serde_json::{Value, json};
use warden_proto::nvhcd::HealthCheckRequest;
use warden_proto::nvhcd::health_check_service_client::HealthCheckServiceClient;

use crate::common::users::{self, block_on, socket_arg};
use crate::common::{Home, TestAgent, WAIT, within};

/// As a test user: NVRx's health check on the nvhcd socket `args.socket`.
pub fn attack_nvhcd(args: &Value) -> Value {
    block_on(async {
        let channel = match warden_cli::Target::Unix(socket_arg(args)).channel().await {
            Ok(c) => c,
            Err(e) => return json!({"connected": false, "error": format!("{e:#}")}),
        };
        let r = HealthCheckServiceClient::new(channel)
            .run_health_check(HealthCheckRequest { args: Vec::new() })
            .await;
        match r {
            Ok(r) => {
                json!({"connected": true, "answered": true, "success": r.into_inner().success})
            }
            Err(s) => json!({"connected": true, "answered": false, "error": s.message()}),
        }
    })
}

/// The nvhcd socket gets `api.socket_group` and `api.socket_mode`: the
/// socket group's member (NVRx as the job's user) is answered, the
/// stranger cannot connect.
#[tokio::test(flavor = "multi_thread")]
async fn the_nvhcd_socket_is_the_socket_groups() {
    let u = users::users();
    let dir = tempfile::tempdir().expect("a directory for the nvhcd socket");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711))
        .expect("open it to the test users");
    let nvhcd = dir.path().join("nvhcd.sock");
    let _agent = TestAgent::start_shared(&format!(
        "[nvhcd]\nsocket = {:?}\n",
        nvhcd.display().to_string()
    ));
    let meta = std::fs::metadata(&nvhcd).expect("the nvhcd socket");
    assert_eq!(meta.gid(), u.sock_gid, "the nvhcd socket's group");
    assert_eq!(meta.mode() & 0o777, 0o660);
    for (who, answered) in [(&u.member, true), (&u.stranger, false)] {
        let who = who.clone();
        let args = json!({"socket": nvhcd});
        let out = within(WAIT * 6, "the health check", async move {
            tokio::task::spawn_blocking(move || users::run_as(&who, "setup.nvhcd", &args))
                .await
                .expect("run as the user")
        })
        .await
        .result;
        assert_eq!(out["connected"], json!(answered), "{out}");
        if answered {
            assert_eq!(out["answered"], json!(true), "{out}");
        }
    }
}

/// `api.socket_mode` with any bit for others is refused at start, naming
/// the key; no socket is made.
#[test]
fn a_socket_mode_open_to_everyone_is_refused_at_start() {
    for mode in ["0666", "0777", "0662"] {
        let home = Arc::new(Home::new(&format!("[api]\nsocket_mode = \"{mode}\"\n")));
        let mut agent = TestAgent::spawn(home.clone(), &[]);
        let status = agent.wait_exit(WAIT * 3);
        assert!(!status.success(), "{mode}: {status}");
        let err = agent.stderr();
        assert!(
            err.contains("api.socket_mode") && err.contains(mode) && err.contains("others"),
            "{mode}: {err}"
        );
        assert!(!home.socket.exists(), "{mode}: the socket was made");
    }
}

/// A hook script of the member's, or root's in a directory the member
/// may write, is refused at start naming the key and the reason; the
/// script never ran.
#[test]
fn a_policy_hook_another_user_could_change_is_refused_at_start() {
    let u = users::users();
    let dir = tempfile::tempdir().expect("a directory for the hooks");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let ran = dir.path().join("hook-ran");
    let hook = |d: &Path| {
        let p = d.join("hook.sh");
        std::fs::write(
            &p,
            format!("#!/bin/sh\ntouch {}\necho '{{}}'\n", ran.display()),
        )
        .expect("write the hook");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    };
    // The member's own script.
    let theirs = hook(dir.path());
    nix::unistd::chown(
        &theirs,
        Some(nix::unistd::Uid::from_raw(u.member.uid)),
        None,
    )
    .expect("give the script to the member");
    // Root's script in the member's directory (it could swap the file).
    let their_dir = dir.path().join("member-dir");
    std::fs::create_dir(&their_dir).expect("mkdir");
    let in_their_dir = hook(&their_dir);
    nix::unistd::chown(
        &their_dir,
        Some(nix::unistd::Uid::from_raw(u.member.uid)),
        None,
    )
    .expect("give the directory to the member");
    for (path, says) in [
        (&theirs, format!("is owned by uid {}", u.member.uid)),
        (
            &in_their_dir,
            format!(
                "hook's directory {} is owned by uid {}",
                their_dir.display(),
                u.member.uid
            ),
        ),
    ] {
        let home = Arc::new(Home::new(&format!(
            "[policy.hook]\ncommand = [{:?}]\n",
            path.display().to_string()
        )));
        let mut agent = TestAgent::spawn(home.clone(), &[]);
        let status = agent.wait_exit(WAIT * 3);
        assert!(!status.success(), "{status}");
        let err = agent.stderr();
        assert!(
            err.contains("policy.hook.command[0]") && err.contains(&says),
            "{}: {err}",
            path.display()
        );
        assert!(!home.socket.exists());
    }
    assert!(!ran.exists(), "a refused hook ran");
}
