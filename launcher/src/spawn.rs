//! Worker processes: each spawned in a session (and so a process group) of
//! its own, watched through a pidfd, its exit observed without reaping it,
//! stopped through its process group, and the orphans it leaves behind
//! found and killed.
//!
//! Why not reap at once: the agent reads a rank's exit status from its
//! zombie (`/proc/PID/stat`, see `ranks::exit_watch`); a parent that reaps
//! first leaves it "status unknown". `waitid(WNOWAIT)` tells the launcher the
//! status and leaves the zombie; it is reaped once the agent reported the
//! exit (or after a bound). The launcher is a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`), so a worker's children that outlive it are
//! reparented to the launcher, where the sweep can kill and reap them.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::process::{ChildStderr, ChildStdout};

use super::env::MARKER;

/// Why a worker could not be started or watched.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// exec or fork failed.
    #[error("cannot start {program:?}: {source}")]
    Start {
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The command is empty.
    #[error("no command to run")]
    Empty,
    /// A pipe or pidfd could not be set up.
    #[error("cannot watch worker pid {pid}: {source}")]
    Watch {
        /// The worker.
        pid: i32,
        /// The OS error.
        source: std::io::Error,
    },
}

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Exit {
    /// True for exit code 0.
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    /// The status a shell would show: the code, or 128 + the signal.
    pub fn shell_code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(
                f,
                "signal {s} ({})",
                Signal::try_from(s).map_or("unknown", |s| s.as_str())
            ),
        }
    }
}

/// A started worker: its pid (also its session and process group id), the
/// pidfd that turns readable when it exits, and its output pipes.
#[derive(Debug)]
pub struct Spawned {
    /// The pid.
    pub pid: i32,
    /// Readable once the process exited.
    pub pidfd: AsyncFd<OwnedFd>,
    /// Its stdout.
    pub stdout: Option<ChildStdout>,
    /// Its stderr.
    pub stderr: Option<ChildStderr>,
}

/// Makes this process a child subreaper: orphans of its descendants are
/// reparented to it instead of init, so the launcher can kill and reap them.
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes integer arguments only
    // and touches no memory of ours.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Starts `argv` with `env` added to the launcher's environment, in a new
/// session, with SIGKILL as its parent-death signal (a launcher killed with
/// SIGKILL leaves no worker behind). Must run on a thread that outlives the
/// worker: the parent-death signal follows the spawning thread.
pub fn spawn(argv: &[String], env: &[(String, String)], cwd: &Path) -> Result<Spawned, SpawnError> {
    let (program, rest) = argv.split_first().ok_or(SpawnError::Empty)?;
    let mut cmd = Command::new(program);
    cmd.args(rest)
        // The launcher's etcd password is not the workers' business.
        .env_remove(crate::coord::etcd_flags::PASSWORD_ENV)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd)
        .stdin(Stdio::null());
    start_in_session(cmd, program)
}

/// Starts `cmd` (its arguments, environment and stdin set) as [`spawn`]
/// does: stdout and stderr piped, a new session, SIGKILL as its
/// parent-death signal, watched through a pidfd. The standby interpreters
/// ([`super::standby`]) start through here too, so a promoted one is a
/// worker like any other.
pub(crate) fn start_in_session(mut cmd: Command, program: &str) -> Result<Spawned, SpawnError> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let parent = nix::unistd::getpid().as_raw();
    // SAFETY: the closure runs in the forked child before exec and calls
    // only async-signal-safe functions (setsid, prctl, getppid), allocating
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died between fork and prctl: do not run orphaned.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let spawned = cmd.spawn();
    // The command holds the parent's copies of what it handed the child (a
    // standby's order socket): closed now, so only the child has them.
    drop(cmd);
    let mut child = spawned.map_err(|source| SpawnError::Start {
        program: program.to_owned(),
        source,
    })?;
    let pid = i32::try_from(child.id()).map_err(|_| SpawnError::Watch {
        pid: -1,
        source: std::io::Error::from_raw_os_error(libc::ERANGE),
    })?;
    let watch = |source| SpawnError::Watch { pid, source };
    // The child is ours and not reaped: its pid cannot have been reused.
    let fd = warden_pidfd::open(child.id()).map_err(watch)?;
    // SAFETY: `fd` is an OwnedFd moved into the AsyncFd: it stays open and
    // refers to the same pidfd until the AsyncFd is dropped.
    let pidfd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
        .map_err(|e| watch(std::io::Error::from(e)))?;
    let stdout = child
        .stdout
        .take()
        .map(ChildStdout::from_std)
        .transpose()
        .map_err(watch)?;
    let stderr = child
        .stderr
        .take()
        .map(ChildStderr::from_std)
        .transpose()
        .map_err(watch)?;
    // `child` is dropped without waiting: the launcher reaps by pid.
    Ok(Spawned {
        pid,
        pidfd,
        stdout,
        stderr,
    })
}

/// Waits until the worker exited and returns its status, leaving the zombie
/// for the agent to read (WNOWAIT).
pub async fn exited(pid: i32, pidfd: &AsyncFd<OwnedFd>) -> Option<Exit> {
    // A pidfd is readable once the process exited; a read error means the
    // fd is unusable, and waitid then tells (it blocks only until the exit).
    let _ = pidfd.readable().await;
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
    match waitid(Id::Pid(Pid::from_raw(pid)), flags) {
        Ok(WaitStatus::Exited(_, code)) => Some(Exit::Code(code)),
        Ok(WaitStatus::Signaled(_, sig, _)) => Some(Exit::Signal(sig as i32)),
        _ => None,
    }
}

/// Reaps `pid` if it is an exited child of ours; never blocks.
pub fn reap(pid: i32) {
    let _ = waitid(
        Id::Pid(Pid::from_raw(pid)),
        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG,
    );
}

/// Sends `sig` to the process group `pgid` (a worker's); a group already
/// gone is no error.
pub fn signal_group(pgid: i32, sig: Signal) {
    let _ = killpg(Pid::from_raw(pgid), sig);
}

/// Sends `sig` to one process.
pub fn signal_pid(pid: i32, sig: Signal) {
    let _ = nix::sys::signal::kill(Pid::from_raw(pid), sig);
}

/// A process as `/proc/PID/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    /// Its pid.
    pub pid: i32,
    /// Its parent.
    pub ppid: i32,
    /// Its process group.
    pub pgrp: i32,
    /// Its session.
    pub session: i32,
    /// Its state letter (`Z`: a zombie, dead but not reaped).
    pub state: char,
}

impl Proc {
    /// Not yet dead (a zombie has exited and released its memory and GPUs).
    pub fn alive(&self) -> bool {
        !matches!(self.state, 'Z' | 'X')
    }
}

/// Parses `/proc/PID/stat` (the command name may hold spaces and
/// parentheses: fields are read after the last `)`).
pub fn parse_stat(text: &str) -> Option<Proc> {
    let pid = text.split_whitespace().next()?.parse().ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let pgrp = f.next()?.parse().ok()?;
    let session = f.next()?.parse().ok()?;
    Some(Proc {
        pid,
        ppid,
        pgrp,
        session,
        state,
    })
}

/// Every process on the host (those readable to us).
pub fn scan() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let name = e.file_name();
        let name = name.to_str()?;
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        parse_stat(&std::fs::read_to_string(e.path().join("stat")).ok()?)
    })
    .collect()
}

/// True when `pid`'s environment carries the launcher's marker with `me`.
pub fn has_marker(pid: i32, me: i32) -> bool {
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let want = format!("{MARKER}={me}");
    env.split(|b| *b == 0).any(|kv| kv == want.as_bytes())
}

/// The job's processes among `procs`: the workers (`sessions`: their pids,
/// which are their session and group ids), everything in their sessions or
/// groups, and any child of the launcher carrying its marker (an orphan that
/// left the worker's session). Never the launcher itself.
pub fn job_processes(procs: &[Proc], sessions: &HashSet<i32>, me: i32) -> Vec<Proc> {
    procs
        .iter()
        .filter(|p| p.pid != me)
        .filter(|p| {
            sessions.contains(&p.pid)
                || sessions.contains(&p.session)
                || sessions.contains(&p.pgrp)
                || (p.ppid == me && has_marker(p.pid, me))
        })
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_command_names_parses() {
        let p = parse_stat("4242 (my (weird) name) S 1 4242 4242 0 -1 4194560 0 0").unwrap();
        assert_eq!(
            p,
            Proc {
                pid: 4242,
                ppid: 1,
                pgrp: 4242,
                session: 4242,
                state: 'S'
            }
        );
        assert!(p.alive());
        let z = parse_stat("7 (x) Z 1 7 7 0").unwrap();
        assert!(!z.alive());
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn job_processes_follow_sessions_and_groups() {
        let me = 100;
        let procs = [
            Proc {
                pid: 200,
                ppid: me,
                pgrp: 200,
                session: 200,
                state: 'S',
            },
            // A grandchild in the worker's group.
            Proc {
                pid: 201,
                ppid: 200,
                pgrp: 200,
                session: 200,
                state: 'S',
            },
            // One that made a group of its own but kept the session.
            Proc {
                pid: 202,
                ppid: me,
                pgrp: 202,
                session: 200,
                state: 'S',
            },
            // Someone else's.
            Proc {
                pid: 300,
                ppid: 1,
                pgrp: 300,
                session: 300,
                state: 'S',
            },
        ];
        let sessions = HashSet::from([200]);
        let got: Vec<i32> = job_processes(&procs, &sessions, me)
            .iter()
            .map(|p| p.pid)
            .collect();
        assert_eq!(got, [200, 201, 202]);
    }

    #[tokio::test]
    async fn exit_status_is_read_without_reaping() {
        let s = spawn(
            &["sh".into(), "-c".into(), "exit 7".into()],
            &[],
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(exited(s.pid, &s.pidfd).await, Some(Exit::Code(7)));
        // Still a zombie: the agent could read it; a second look agrees.
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", s.pid)).unwrap();
        assert_eq!(parse_stat(&stat).unwrap().state, 'Z');
        assert_eq!(exited(s.pid, &s.pidfd).await, Some(Exit::Code(7)));
        reap(s.pid);
        assert!(!Path::new(&format!("/proc/{}", s.pid)).exists());
    }
}
