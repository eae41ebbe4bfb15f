//! Another user's code and files through the launcher (issue 29, point 9):
//! a member of the socket group plants, in a shared log directory, links
//! where `warden run` (as root here) would write its logs, and, in a shared
//! working directory, a `torch.py` (and `json.py`) for its standby
//! interpreters to import. The launcher refuses the planted log tree with a
//! message naming it (the linked file is unchanged), and its standby
//! imports nothing from the working directory (the warm restart happens;
//! the planted modules never ran).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::common::users;
use crate::common::{WARDEN, run, within};

/// A whole `warden run` may take this long on a loaded machine (Python
/// start-up, a restart, the embedded agent's settle time).
const RUN: Duration = Duration::from_secs(120);

/// A directory anyone may create in (sticky, as `/tmp`).
fn shared_dir(path: &Path) {
    std::fs::create_dir(path).expect("create the shared directory");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o1777))
        .expect("open the shared directory");
}

/// As the member, in the shared log directory `args.logs`: the victim's
/// job directory `args.job` made first, with `attempt_0/rank_0.stdout.log`
/// a link to `args.target`; and for job `args.linked_job`, the job
/// directory itself a link to the member's tree.
pub fn attack_plant_logs(args: &Value) -> Value {
    let logs = PathBuf::from(args["logs"].as_str().expect("the shared log dir"));
    let target = args["target"].as_str().expect("the victim's file");
    let plant = |dir: &Path| -> std::io::Result<()> {
        std::fs::create_dir_all(dir.join("attempt_0"))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))?;
        std::fs::set_permissions(
            dir.join("attempt_0"),
            std::fs::Permissions::from_mode(0o777),
        )?;
        for stream in ["stdout", "stderr"] {
            std::os::unix::fs::symlink(
                target,
                dir.join("attempt_0").join(format!("rank_0.{stream}.log")),
            )?;
        }
        Ok(())
    };
    let job = logs.join(args["job"].as_str().expect("the job"));
    let mine = logs.join("member-tree");
    let linked = logs.join(args["linked_job"].as_str().expect("the linked job"));
    let r = plant(&job)
        .and_then(|()| plant(&mine))
        .and_then(|()| std::os::unix::fs::symlink(&mine, &linked));
    match r {
        Ok(()) => json!({"ok": true}),
        Err(e) => json!({"ok": false, "error": e.to_string()}),
    }
}

/// As the member, modules in the shared working directory `args.cwd` that
/// leave a file naming who ran them.
pub fn attack_plant_modules(args: &Value) -> Value {
    let cwd = PathBuf::from(args["cwd"].as_str().expect("the shared cwd"));
    let mut out = serde_json::Map::new();
    for m in ["torch", "json"] {
        let marker = cwd.join(format!("{m}.ran"));
        let body = format!(
            "import os\nwith open({:?}, 'w') as f:\n    f.write(str(os.getuid()))\n",
            marker.display().to_string()
        );
        let r = std::fs::write(cwd.join(format!("{m}.py")), body);
        out.insert(m.to_owned(), json!(r.is_ok()));
    }
    Value::Object(out)
}

/// `warden run --agent embedded` of `job` (one worker, `argv`), logs under
/// `logs`, in `cwd`; the launcher's lines with the workers'.
fn launcher(scratch: &Path, logs: &Path, cwd: &Path, job: &str, opts: &[&str]) -> Command {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", WARDEN])
        .arg("--socket")
        .arg(scratch.join("no-agent-here.sock"))
        .arg("run")
        .args(["--agent", "embedded", "--nproc-per-node", "1"])
        .args(["--rdzv-id", job])
        .arg("--log-dir")
        .arg(logs)
        .args(opts)
        .current_dir(cwd)
        .env_remove("WARDEN_JOB_ID")
        .env_remove("PYTHONPATH")
        .env_remove("PYTHONSAFEPATH");
    cmd
}

/// Point 9, the logs: links planted in a shared `--log-dir` are refused,
/// never written through; the linked file is unchanged and no worker ran.
#[tokio::test(flavor = "multi_thread")]
async fn planted_log_links_in_a_shared_log_dir_are_refused() {
    let u = users::users();
    let scratch = tempfile::tempdir().expect("a scratch directory");
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o711))
        .expect("open the scratch directory to the test users");
    let logs = scratch.path().join("shared-logs");
    shared_dir(&logs);
    // Root's file the links point at.
    let victim = scratch.path().join("victim-file");
    std::fs::write(&victim, "precious\n").expect("the victim's file");
    let args = json!({
        "logs": logs, "job": "logs-a", "linked_job": "logs-b",
        "target": victim,
    });
    let member = u.member.clone();
    let planted = within(Duration::from_secs(60), "the plant", async move {
        tokio::task::spawn_blocking(move || {
            users::run_as(&member, "launcher_files.plant_logs", &args)
        })
        .await
        .expect("run the attack")
    })
    .await;
    assert_eq!(planted.result["ok"], json!(true), "{:?}", planted.result);

    let marker = scratch.path().join("worker-ran");
    let script = format!("echo written-through; touch {}", marker.display());
    for (job, says) in [
        ("logs-a", format!("is owned by uid {}", u.member.uid)),
        ("logs-b", "is a symlink".to_owned()),
    ] {
        let done = run(
            &mut launcher(
                scratch.path(),
                &logs,
                scratch.path(),
                job,
                &["--", "sh", "-c", &script],
            ),
            RUN,
        );
        let all = format!("{}{}", done.stdout, done.stderr);
        assert_eq!(done.code(), 1, "{all}");
        assert!(
            all.contains("cannot create the log directory")
                && all.contains(&logs.join(job).display().to_string())
                && all.contains(&says),
            "{job}: {all}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(&victim).expect("read the victim's file"),
        "precious\n"
    );
    assert!(!marker.exists(), "a worker ran");
}

/// Point 9, the standby: modules planted in a shared working directory are
/// not imported by the launcher's standby interpreter. The job's worker
/// fails once and comes back warm from the standby (so the standby ran its
/// preload); neither planted module ever ran.
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_imports_nothing_from_a_shared_working_directory() {
    let u = users::users();
    let scratch = tempfile::tempdir().expect("a scratch directory");
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o711))
        .expect("open the scratch directory to the test users");
    let cwd = scratch.path().join("shared-cwd");
    shared_dir(&cwd);
    let args = json!({"cwd": cwd});
    let member = u.member.clone();
    let planted = within(Duration::from_secs(60), "the plant", async move {
        tokio::task::spawn_blocking(move || {
            users::run_as(&member, "launcher_files.plant_modules", &args)
        })
        .await
        .expect("run the attack")
    })
    .await;
    assert_eq!(
        planted.result,
        json!({"torch": true, "json": true}),
        "{}",
        planted.stderr
    );
    // The victim's script, in a directory of its own: fails its first
    // attempt, succeeds on the next.
    let own = scratch.path().join("victim");
    std::fs::create_dir(&own).expect("the victim's directory");
    let script = own.join("train.py");
    std::fs::write(
        &script,
        "import os, sys\n\
         n = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))\n\
         print(f'attempt {n} in', os.getcwd(), flush=True)\n\
         os._exit(3 if n == 0 else 0)\n",
    )
    .expect("the victim's script");
    let python = python3();
    let done = run(
        &mut launcher(
            scratch.path(),
            &scratch.path().join("logs"),
            &cwd,
            "standby-plant",
            &[
                "--standby",
                "--max-restarts",
                "1",
                "--",
                &python,
                &script.display().to_string(),
            ],
        ),
        RUN,
    );
    let all = format!("{}{}", done.stdout, done.stderr);
    assert_eq!(done.code(), 0, "{all}");
    assert!(
        all.contains("rank 0: warm start from standby pid"),
        "no warm restart, so the standby's preload proves nothing\n{all}"
    );
    assert!(all.contains("attempt 1 in"), "{all}");
    for m in ["torch", "json"] {
        let marker = cwd.join(format!("{m}.ran"));
        assert!(
            !marker.exists(),
            "the planted {m}.py ran as uid {}\n{all}",
            std::fs::read_to_string(&marker).unwrap_or_default()
        );
    }
}

/// The real interpreter behind `python3` (a pyenv shim is a shell script),
/// named `python3...` as a standby wants.
fn python3() -> String {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 runs");
    String::from_utf8(out.stdout)
        .expect("a path")
        .trim()
        .to_owned()
}
