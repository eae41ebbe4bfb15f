//! Running the user's policy hook (the protocol, its config and the
//! answer's parsing are [`warden_core::policy::hook`]): a process group of
//! its own, bounded reads of its output, a timeout that kills the group.
//! And what needs the filesystem before a run: the executable looked up in
//! `PATH`, checked to be a runnable file nobody else may change
//! ([`check_program`] at start, [`check_trusted`] before every run).
//!
//! Contract: [`ask`] always returns within the configured timeout (plus a
//! bounded grace to reap what it killed), never panics, and never leaves the
//! hook or the processes it started running after a failure.

use std::io;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::{AccessFlags, Pid, access};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};
use tokio::time::Instant;
use warden_core::policy::hook::{
    HookAnswer, HookConfig, HookError, MAX_STDOUT, RAW_KEEP, STDERR_KEEP, head_text, parse_answer,
};

/// How long to wait for a killed hook to be reaped. A process stuck in the
/// kernel (uninterruptible sleep in a GPU driver, say) cannot die until the
/// kernel lets it; the agent must not wait for that, and tokio reaps such a
/// child in the background once it does die (`kill_on_drop`).
const REAP_GRACE: Duration = Duration::from_millis(500);

/// Checks at start-up what [`HookConfig::validate`] cannot without the
/// filesystem: that `command[0]` names an executable regular file (an
/// absolute path, or a name found in `PATH` as `execvp` would find it), and
/// that nobody but root or the agent's user can change it
/// ([`check_trusted`]). So a typo in the hook's path is reported once,
/// naming the key, rather than as a failure at every incident.
pub fn check_program(cfg: &HookConfig) -> Result<(), String> {
    let Some(program) = cfg.command.first() else {
        return Ok(());
    };
    if program.is_empty() {
        // HookConfig::validate names this one.
        return Ok(());
    }
    let key = "policy.hook.command[0]";
    let path = if program.contains('/') {
        PathBuf::from(program)
    } else {
        search_path(program).ok_or_else(|| {
            format!(
                "{key} = {program:?}: not found in PATH; \
                 give the hook's absolute path"
            )
        })?
    };
    let meta = std::fs::metadata(&path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            format!("{key} = {program:?}: {} does not exist", path.display())
        } else {
            format!("{key} = {program:?}: cannot read {}: {e}", path.display())
        }
    })?;
    if !meta.is_file() {
        return Err(format!(
            "{key} = {program:?}: {} is not a regular file",
            path.display()
        ));
    }
    if access(&path, AccessFlags::X_OK).is_err() {
        return Err(format!(
            "{key} = {program:?}: {} is not executable; `chmod +x` it, or run \
             it through its interpreter: command = [\"python3\", {:?}]",
            path.display(),
            path.display().to_string()
        ));
    }
    check_trusted(cfg)
}

/// Checks that nobody but root or the agent's own user can change what
/// the hook runs: the agent runs it with its own rights (root, for
/// wardend), so a hook file, or a directory above it, that another user
/// may write is a way for that user to run code as root. Checked for
/// `command[0]` (as found in `PATH`) and for every argument that is an
/// absolute path to an existing file (`["python3", "/etc/warden/hook.py"]`),
/// each resolved through its symlinks: the file and its directory must be
/// owned by root or the agent's uid and not group- or other-writable;
/// the directories above them the same, or sticky (`/tmp`). Called at
/// start (through [`check_program`]) and again before every run, so a
/// hook made writable later is refused rather than run.
pub fn check_trusted(cfg: &HookConfig) -> Result<(), String> {
    let Some(program) = cfg.command.first() else {
        return Ok(());
    };
    let me = nix::unistd::geteuid().as_raw();
    let exe = if program.contains('/') {
        Some(PathBuf::from(program))
    } else {
        search_path(program)
    };
    if let Some(exe) = exe {
        trusted_file(&exe, me)
            .map_err(|why| format!("policy.hook.command[0] = {program:?}: {why}"))?;
    }
    for (i, arg) in cfg.command.iter().enumerate().skip(1) {
        let p = std::path::Path::new(arg);
        if p.is_absolute() && p.is_file() {
            trusted_file(p, me)
                .map_err(|why| format!("policy.hook.command[{i}] = {arg:?}: {why}"))?;
        }
    }
    Ok(())
}

/// The checks of [`check_trusted`] on one file: `Err` says
/// which path is wrong and how.
fn trusted_file(path: &std::path::Path, me: u32) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let real = match std::fs::canonicalize(path) {
        Ok(r) => r,
        // Nothing there: nothing runs (the start fails, named, as a spawn
        // error).
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("cannot resolve {}: {e}", path.display())),
    };
    let owners = if me == 0 {
        "root".to_owned()
    } else {
        format!("root or uid {me} (the agent's)")
    };
    let check = |p: &std::path::Path, what: &str, sticky_ok: bool| -> Result<(), String> {
        let m = std::fs::metadata(p).map_err(|e| format!("cannot inspect {}: {e}", p.display()))?;
        if m.uid() != 0 && m.uid() != me {
            return Err(format!(
                "{what} {} is owned by uid {}; it must be owned by {owners}, since the agent runs the hook with its own rights (refused)",
                p.display(),
                m.uid()
            ));
        }
        let sticky = m.mode() & 0o1000 != 0;
        if m.mode() & 0o022 != 0 && !(sticky_ok && sticky) {
            return Err(format!(
                "{what} {} has mode {:04o}: group or others may write it, and so change what the agent runs with its own rights; `chmod go-w` it (refused)",
                p.display(),
                m.mode() & 0o7777
            ));
        }
        Ok(())
    };
    check(&real, "the hook", false)?;
    let mut dirs = real.ancestors().skip(1);
    if let Some(dir) = dirs.next() {
        check(dir, "the hook's directory", false)?;
    }
    for dir in dirs {
        check(dir, "the directory", true)?;
    }
    Ok(())
}

/// `program` looked up in `PATH` the way `execvp` does: the first
/// executable regular file of that name.
fn search_path(program: &str) -> Option<PathBuf> {
    let dirs = std::env::var_os("PATH")?;
    std::env::split_paths(&dirs)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file() && access(p.as_path(), AccessFlags::X_OK).is_ok())
}

/// Asks the hook configured in `cfg` about `input` (the diagnosis and the
/// proposed decision) and returns its answer, or why there is none.
///
/// Runs the hook to completion within `cfg.timeout`; see the module
/// documentation for the protocol and the guarantees. Dropping the returned
/// future kills the hook's process group.
pub async fn ask(cfg: &HookConfig, input: &Value) -> Result<HookAnswer, HookError> {
    let Some((program, args)) = cfg.command.split_first() else {
        return Err(HookError::NotConfigured);
    };
    // Again at every run: a hook made writable by another user since the
    // agent started is refused, not run with the agent's rights.
    check_trusted(cfg).map_err(HookError::Untrusted)?;
    let mut payload = serde_json::to_vec(input).map_err(io::Error::other)?;
    payload.push(b'\n');

    let started = Instant::now();
    let mut child = Command::new(program)
        .args(args)
        .env("WARDEN_HOOK", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so that killing the group reaches the processes a
        // script starts (a `sleep`, a `curl`), not only the script.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| HookError::Spawn {
            command: program.clone(),
            source,
        })?;
    // Declared after `child`, so dropped before it: if this future is
    // cancelled the group dies, then tokio reaps the child.
    let mut group = ProcessGroup::of(&child);
    let (Some(stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(io::Error::other("the hook's stdin, stdout or stderr was not piped").into());
    };

    let mut out = Vec::new();
    let mut err = Tail::default();
    let mut exited = false;
    // Feeding stdin, draining stdout and stderr, and waiting for the exit all
    // at once: a hook that answers before (or without) reading its input, or
    // that fills its stderr pipe, must not deadlock against us.
    let talk = async {
        tokio::try_join!(
            feed(stdin, &payload),
            read_capped(stdout, &mut out, MAX_STDOUT),
            read_tail(stderr, &mut err, STDERR_KEEP),
            async {
                let status = child.wait().await?;
                exited = true;
                Ok::<_, HookError>(status)
            },
        )
    };
    let outcome = tokio::time::timeout(cfg.timeout, talk).await;
    let took = started.elapsed();
    let status = match outcome {
        Ok(Ok(((), (), (), status))) => status,
        Ok(Err(e)) => {
            group.kill();
            reap(&mut child).await;
            return Err(e);
        }
        Err(_elapsed) => {
            group.kill();
            reap(&mut child).await;
            return Err(HookError::Timeout {
                after: cfg.timeout,
                exited,
                stderr: tail_text(&err, STDERR_KEEP),
            });
        }
    };
    // The hook exited and closed its output: whatever is left in its group
    // was detached on purpose and is not ours to kill.
    group.release();

    let stderr = tail_text(&err, STDERR_KEEP);
    if !status.success() {
        return Err(HookError::Exit { status, stderr });
    }
    let (action, reason) = parse_answer(&out)?;
    Ok(HookAnswer {
        action,
        reason,
        raw: head_text(&out, RAW_KEEP),
        stderr,
        took,
    })
}

/// The hook's process group, killed on drop unless released.
#[derive(Debug)]
struct ProcessGroup {
    /// The group id (the hook's pid, as it leads its group); `None` once
    /// killed or released. The id cannot be reused while the hook is
    /// unreaped or anything is left in its group.
    pgid: Option<Pid>,
}

impl ProcessGroup {
    fn of(child: &Child) -> Self {
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw);
        Self { pgid }
    }

    /// SIGKILL to every process in the group. ESRCH (all gone already) is
    /// fine, and nothing else can be done about another error.
    fn kill(&mut self) {
        if let Some(pgid) = self.pgid.take() {
            let _ = killpg(pgid, Signal::SIGKILL);
        }
    }

    /// Leaves the group alone from now on.
    fn release(&mut self) {
        self.pgid = None;
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits a little for a killed hook, so that it does not linger as a zombie;
/// see [`REAP_GRACE`] for why only a little.
async fn reap(child: &mut Child) {
    let _ = tokio::time::timeout(REAP_GRACE, child.wait()).await;
}

/// Writes the input and closes stdin. A hook that exits or closes its stdin
/// without reading it all is allowed to (EPIPE is not an error).
async fn feed(mut stdin: ChildStdin, payload: &[u8]) -> Result<(), HookError> {
    match stdin.write_all(payload).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(e.into()),
    }
    // `stdin` is dropped here: the hook sees EOF.
}

/// Reads `r` to EOF into `buf`, failing with [`HookError::TooLarge`] as soon
/// as more than `cap` bytes came (and reading no further).
async fn read_capped<R: AsyncRead + Unpin>(
    mut r: R,
    buf: &mut Vec<u8>,
    cap: usize,
) -> Result<(), HookError> {
    let mut chunk = [0u8; 8192];
    loop {
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > cap {
            return Err(HookError::TooLarge { limit: cap });
        }
    }
}

/// The end of a stream: what is left once older bytes were dropped.
#[derive(Debug, Default)]
struct Tail {
    /// The last bytes read (between `keep` and `2 * keep` once cut).
    bytes: Vec<u8>,
    /// Whether older bytes were dropped, so the text is marked as cut even
    /// when what is left happens to fit.
    cut: bool,
}

/// Reads `r` to EOF, keeping only about the last `keep` bytes in `tail`: the
/// pipe must be drained (or a chatty hook blocks), but memory stays bounded.
async fn read_tail<R: AsyncRead + Unpin>(
    mut r: R,
    tail: &mut Tail,
    keep: usize,
) -> Result<(), HookError> {
    let mut chunk = [0u8; 8192];
    loop {
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        tail.bytes.extend_from_slice(&chunk[..n]);
        if tail.bytes.len() > 2 * keep {
            tail.bytes.drain(..tail.bytes.len() - keep);
            tail.cut = true;
        }
    }
}

/// The end of `tail` as text, at most `max` bytes, trailing blank space
/// removed, cut on a character boundary and marked with `…` when anything
/// was left out.
fn tail_text(tail: &Tail, max: usize) -> String {
    let mut bytes = tail.bytes.as_slice();
    if tail.cut {
        // Dropping bytes may have split a character: skip its remains.
        while let Some((first, rest)) = bytes.split_first()
            && first & 0b1100_0000 == 0b1000_0000
        {
            bytes = rest;
        }
    }
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim_end();
    if text.len() <= max && !tail.cut {
        return text.to_owned();
    }
    let mut start = text
        .len()
        .saturating_sub(max.saturating_sub('…'.len_utf8()));
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use serde_json::json;
    use warden_core::policy::Action;

    use super::*;

    /// A fixture hook under tests/fixtures/hooks/, named after what it shows.
    fn fixture(name: &str) -> String {
        format!(
            "{}/../tests/fixtures/hooks/{name}",
            env!("CARGO_MANIFEST_DIR")
        )
    }

    fn hook(argv: &[&str], timeout: Duration) -> HookConfig {
        HookConfig {
            command: argv.iter().map(|s| s.to_string()).collect(),
            timeout,
        }
    }

    /// A hook run through `sh -c`, for one-line behaviours.
    fn sh(script: &str) -> HookConfig {
        hook(&["/bin/sh", "-c", script], Duration::from_secs(10))
    }

    fn input() -> Value {
        json!({"class": "gpu_xid", "proposed": "restart_in_job", "node": "n1"})
    }

    /// True once `pid` is gone or dead (a zombie waiting for its reaper).
    fn dead(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            // "pid (comm) S ...": the state follows the last ')'.
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        }
    }

    /// Polls until `pid` is dead, with a deadline.
    async fn assert_dies(pid: i32) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !dead(pid) {
            assert!(Instant::now() < deadline, "process {pid} is still alive");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn read_pid(path: &Path) -> i32 {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("the hook did not write {}: {e}", path.display()));
        text.trim().parse().unwrap()
    }

    #[tokio::test]
    async fn answer_with_action_and_reason() {
        let cfg = hook(&[&fixture("answers_cordon.sh")], Duration::from_secs(10));
        cfg.validate().unwrap();
        check_program(&cfg).unwrap();
        let a = ask(&cfg, &input()).await.unwrap();
        assert_eq!(a.action, Some(Action::Cordon));
        assert_eq!(a.reason, "xid 79 on gpu 3: spare available");
        assert!(a.raw.contains("\"cordon\""), "{}", a.raw);
        assert_eq!(a.stderr, "checking the spare pool");
        assert!(a.took < Duration::from_secs(10));
    }

    #[tokio::test]
    async fn default_keeps_the_proposed_decision() {
        let a = ask(&sh(r#"echo '{"action": "default"}'"#), &input())
            .await
            .unwrap();
        assert_eq!(a.action, None);
        assert_eq!(a.reason, "");
        let a = ask(&sh("echo '{}'"), &input()).await.unwrap();
        assert_eq!(a.action, None);
        let a = ask(
            &sh(r#"echo '{"action": null, "reason": "no opinion"}'"#),
            &input(),
        )
        .await
        .unwrap();
        assert_eq!((a.action, a.reason.as_str()), (None, "no opinion"));
    }

    #[tokio::test]
    async fn hook_reads_its_input_and_environment() {
        let cfg = hook(&[&fixture("echoes_input.py")], Duration::from_secs(10));
        let a = ask(&cfg, &input()).await.unwrap();
        // The action comes from the input's `proposed`: stdin was delivered.
        assert_eq!(a.action, Some(Action::RestartInJob));
        assert_eq!(a.reason, "saw class gpu_xid on n1; WARDEN_HOOK=1");
    }

    #[tokio::test]
    async fn arguments_are_passed() {
        let cfg = hook(
            &[
                "/bin/sh",
                "-c",
                r#"printf '{"action": "%s", "reason": "%s"}' "$1" "$2""#,
                "sh",
                "stop",
                "two words",
            ],
            Duration::from_secs(10),
        );
        let a = ask(&cfg, &input()).await.unwrap();
        assert_eq!(
            (a.action, a.reason.as_str()),
            (Some(Action::Stop), "two words")
        );
    }

    #[tokio::test]
    async fn a_hook_others_may_change_is_refused_and_not_run() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let ran = dir.path().join("ran");
        let script = dir.path().join("hook.sh");
        std::fs::write(
            &script,
            format!("#!/bin/sh\ntouch {}\necho '{{}}'\n", ran.display()),
        )
        .unwrap();
        let set = |p: &std::path::Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
        };
        set(&script, 0o755);
        set(dir.path(), 0o700);
        let cfg = hook(&[script.to_str().unwrap()], Duration::from_secs(10));
        // Trusted: it runs.
        ask(&cfg, &input()).await.unwrap();
        assert!(ran.exists());
        std::fs::remove_file(&ran).unwrap();
        // Made writable by the group after start: refused at the run.
        set(&script, 0o775);
        let e = ask(&cfg, &input()).await.unwrap_err();
        assert!(matches!(e, HookError::Untrusted(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("policy.hook.command[0]") && msg.contains("0775"),
            "{msg}"
        );
        assert!(check_program(&cfg).is_err());
        // Its directory open to everyone: the same.
        set(&script, 0o755);
        set(dir.path(), 0o777);
        let e = ask(&cfg, &input()).await.unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        // A script given to an interpreter is checked as well.
        let via = hook(
            &["/bin/sh", script.to_str().unwrap()],
            Duration::from_secs(10),
        );
        let e = ask(&via, &input()).await.unwrap_err();
        assert!(e.to_string().contains("policy.hook.command[1]"), "{e}");
        assert!(!ran.exists(), "the refused hook ran");
        set(dir.path(), 0o700);
    }

    #[tokio::test]
    async fn sleeping_hook_times_out_and_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let cfg = hook(
            &[&fixture("sleeps.sh"), pid_file.to_str().unwrap()],
            Duration::from_millis(200),
        );
        let started = Instant::now();
        let e = ask(&cfg, &input()).await.unwrap_err();
        let took = started.elapsed();
        assert!(
            matches!(e, HookError::Timeout { exited: false, .. }),
            "{e:?}"
        );
        assert!(took < Duration::from_secs(1), "took {took:?}");
        assert!(e.to_string().contains("within 200ms"), "{e}");
        assert_dies(read_pid(&pid_file)).await;
    }

    #[tokio::test]
    async fn timeout_kills_grandchildren() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let cfg = hook(
            &[&fixture("spawns_grandchild.sh"), pid_file.to_str().unwrap()],
            Duration::from_millis(200),
        );
        let started = Instant::now();
        let e = ask(&cfg, &input()).await.unwrap_err();
        let took = started.elapsed();
        assert!(matches!(e, HookError::Timeout { .. }), "{e:?}");
        assert!(took < Duration::from_secs(1), "took {took:?}");
        // The background `sleep 30`, not our child, died with the group.
        assert_dies(read_pid(&pid_file)).await;
    }

    #[tokio::test]
    async fn background_process_holding_stdout_is_named_on_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let mut cfg = sh(r#"sleep 30 & echo $! > "$0"; echo '{}'; echo bye >&2"#);
        cfg.command.push(pid_file.to_str().unwrap().to_owned());
        cfg.timeout = Duration::from_millis(300);
        let e = ask(&cfg, &input()).await.unwrap_err();
        assert!(
            matches!(e, HookError::Timeout { exited: true, .. }),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(text.contains("kept its stdout or stderr open"), "{text}");
        assert!(text.contains("bye"), "{text}");
        assert_dies(read_pid(&pid_file)).await;
    }

    #[tokio::test]
    async fn detached_helper_does_not_hold_the_answer() {
        // Output redirected: the answer counts as soon as the hook exits.
        let cfg = sh(r#"true >/dev/null 2>&1 & echo '{"action": "continue"}'"#);
        let a = ask(&cfg, &input()).await.unwrap();
        assert_eq!(a.action, Some(Action::Continue));
    }

    #[tokio::test]
    async fn bad_json_is_reported_with_the_output() {
        let cfg = hook(&[&fixture("answers_prose.sh")], Duration::from_secs(10));
        let e = ask(&cfg, &input()).await.unwrap_err();
        assert!(matches!(e, HookError::BadJson { .. }), "{e:?}");
        assert!(e.to_string().contains("please cordon"), "{e}");

        for (script, says) in [
            ("true", "wrote nothing"),
            (r#"echo '["stop"]'"#, "expected a JSON object"),
            (
                r#"echo '{"action": "stop"} {"action": "stop"}'"#,
                "trailing",
            ),
            (
                r#"echo '{"action": "stop", "reason": 7}'"#,
                "\"reason\" must be a string",
            ),
        ] {
            let e = ask(&sh(script), &input()).await.unwrap_err();
            assert!(matches!(e, HookError::BadJson { .. }), "{script}: {e:?}");
            assert!(e.to_string().contains(says), "{script}: {e}");
        }
    }

    #[tokio::test]
    async fn unknown_action_lists_the_valid_names() {
        let cfg = hook(
            &[&fixture("answers_unknown_action.sh")],
            Duration::from_secs(10),
        );
        let e = ask(&cfg, &input()).await.unwrap_err();
        assert!(matches!(e, HookError::BadAction { .. }), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("\"reboot\""), "{text}");
        for a in Action::ALL {
            assert!(text.contains(a.as_str()), "{text}");
        }
        assert!(text.contains("default"), "{text}");

        let e = ask(&sh(r#"echo '{"action": 3}'"#), &input())
            .await
            .unwrap_err();
        assert!(matches!(e, HookError::BadAction { .. }), "{e:?}");
    }

    #[tokio::test]
    async fn extra_fields_are_ignored() {
        let cfg = sh(r#"echo '{"action": "scale_down", "confidence": 0.9, "ticket": {"id": 1}}'"#);
        let a = ask(&cfg, &input()).await.unwrap();
        assert_eq!(a.action, Some(Action::ScaleDown));
    }

    #[tokio::test]
    async fn non_zero_exit_carries_stderr() {
        let cfg = hook(&[&fixture("fails_with_stderr.sh")], Duration::from_secs(10));
        let e = ask(&cfg, &input()).await.unwrap_err();
        let HookError::Exit { status, stderr } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(status.code(), Some(3));
        assert!(
            stderr.ends_with("cannot reach the scheduler at 10.0.0.1"),
            "{stderr}"
        );
        // The answer it printed before failing does not count, and the
        // message shows the stderr tail.
        let text = e.to_string();
        assert!(text.contains("exit status: 3"), "{text}");
        assert!(text.contains("cannot reach the scheduler"), "{text}");
    }

    #[tokio::test]
    async fn stderr_is_clipped_to_its_tail() {
        let cfg = sh("yes 'warning: something' | head -c 100000 >&2; \
             echo 'the last line' >&2; exit 1");
        let e = ask(&cfg, &input()).await.unwrap_err();
        let HookError::Exit { stderr, .. } = &e else {
            panic!("{e:?}");
        };
        assert!(stderr.len() <= STDERR_KEEP, "{}", stderr.len());
        assert!(stderr.starts_with('…'), "{stderr}");
        assert!(stderr.ends_with("the last line"), "{stderr}");
    }

    #[tokio::test]
    async fn killed_by_signal_is_an_exit_error() {
        let e = ask(&sh("kill -9 $$"), &input()).await.unwrap_err();
        let HookError::Exit { status, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(status.code(), None);
        assert!(e.to_string().contains("SIGKILL"), "{e}");
    }

    #[tokio::test]
    async fn missing_command_is_a_spawn_error() {
        let cfg = hook(&["/nonexistent/warden-hook"], Duration::from_secs(1));
        let v = check_program(&cfg).unwrap_err();
        assert!(v.contains("policy.hook.command[0]"), "{v}");
        assert!(v.contains("does not exist"), "{v}");
        let e = ask(&cfg, &input()).await.unwrap_err();
        let HookError::Spawn { source, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(source.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("/nonexistent/warden-hook"), "{e}");

        let cfg = hook(&["warden-no-such-hook"], Duration::from_secs(1));
        let v = check_program(&cfg).unwrap_err();
        assert!(v.contains("not found in PATH"), "{v}");
    }

    #[tokio::test]
    async fn not_executable_is_a_spawn_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hook.sh");
        std::fs::write(&path, "#!/bin/sh\necho '{}'\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let cfg = hook(&[path.to_str().unwrap()], Duration::from_secs(1));
        let v = check_program(&cfg).unwrap_err();
        assert!(v.contains("policy.hook.command[0]"), "{v}");
        assert!(v.contains("is not executable"), "{v}");
        let e = ask(&cfg, &input()).await.unwrap_err();
        let HookError::Spawn { source, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(source.kind(), io::ErrorKind::PermissionDenied);

        let cfg = hook(&[dir.path().to_str().unwrap()], Duration::from_secs(1));
        let v = check_program(&cfg).unwrap_err();
        assert!(v.contains("is not a regular file"), "{v}");
    }

    #[tokio::test]
    async fn hook_that_never_reads_stdin_still_answers() {
        // Far more than a pipe holds: writing it all before reading stdout
        // would deadlock against a hook that does not read.
        let big = json!({"class": "gpu_xid", "log": "x".repeat(1 << 20)});
        let cfg = hook(&[&fixture("ignores_stdin.sh")], Duration::from_secs(10));
        let a = ask(&cfg, &big).await.unwrap();
        assert_eq!(a.action, Some(Action::Continue));
        assert_eq!(a.reason, "answered without reading");
    }

    #[tokio::test]
    async fn chatty_stderr_before_reading_does_not_deadlock() {
        // The hook fills its stderr pipe before it reads stdin, while warden
        // has more input than a pipe holds: only draining stderr while
        // writing stdin lets both go on.
        let big = json!({"log": "x".repeat(1 << 20)});
        let cfg = sh(
            "head -c 300000 /dev/zero | tr '\\0' w >&2; cat >/dev/null; \
             echo '{\"action\": \"stop\"}'",
        );
        let a = ask(&cfg, &big).await.unwrap();
        assert_eq!(a.action, Some(Action::Stop));
        assert!(
            a.stderr.starts_with('…') && a.stderr.ends_with('w'),
            "{}",
            a.stderr
        );
    }

    #[tokio::test]
    async fn huge_stdout_is_too_large_and_killed() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let cfg = hook(
            &[&fixture("floods_stdout.sh"), pid_file.to_str().unwrap()],
            Duration::from_secs(30),
        );
        let started = Instant::now();
        let e = ask(&cfg, &input()).await.unwrap_err();
        assert!(
            matches!(e, HookError::TooLarge { limit: MAX_STDOUT }),
            "{e:?}"
        );
        // Stopped at the limit, not at the timeout.
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_dies(read_pid(&pid_file)).await;
    }

    #[tokio::test]
    async fn empty_command_is_not_configured() {
        let cfg = HookConfig::default();
        assert!(!cfg.is_enabled());
        cfg.validate().unwrap();
        check_program(&cfg).unwrap();
        let e = ask(&cfg, &input()).await.unwrap_err();
        assert!(matches!(e, HookError::NotConfigured), "{e:?}");
    }

    #[test]
    fn clipping_keeps_characters_whole() {
        let s = "é".repeat(10);
        let head = head_text(s.as_bytes(), 8);
        assert!(head.len() <= 8 && head.ends_with('…'), "{head}");
        let whole = Tail {
            bytes: s.clone().into_bytes(),
            cut: false,
        };
        let tail = tail_text(&whole, 8);
        assert!(tail.len() <= 8 && tail.starts_with('…'), "{tail}");
        assert_eq!(tail_text(&whole, 100), s);
        // Cut in the middle of a character: marked, and no U+FFFD.
        let cut = Tail {
            bytes: s.as_bytes()[1..].to_vec(),
            cut: true,
        };
        assert_eq!(tail_text(&cut, 100), format!("…{}", "é".repeat(9)));
        assert_eq!(head_text(b"short", 8), "short");
    }
}
