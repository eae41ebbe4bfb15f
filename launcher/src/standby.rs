//! Standby interpreters: warm in-job restarts for Python entrypoints.
//!
//! A cold in-job restart of a torch rank spends most of its time importing
//! torch again (seconds on a small host). For `PYTHON script.py ARGS` and
//! `PYTHON -m MODULE ARGS`, the launcher keeps one spare interpreter per
//! local worker slot, started in advance, that has already imported the
//! heavy modules (torch, torch.distributed, torch.nn.parallel and
//! torch._dynamo when importable, plus `--preload`). On a restart, a standby is promoted: it gets the rank's
//! argv, environment and working directory, and runs the script as
//! `__main__` in the same process.
//!
//! Why this is safe:
//! - Nothing is CUDA-initialized before the rank's environment is applied:
//!   the standby refuses (exits 3) if a preloaded module initialized CUDA,
//!   so `CUDA_VISIBLE_DEVICES` and the rest of the rank's variables are in
//!   place before any device is touched.
//! - A promoted standby is a worker like a cold one: started through
//!   [`spawn::start_in_session`] (a session of its own, SIGKILL as its
//!   parent-death signal, a pidfd), its stdout and stderr are the rank's
//!   pipes from the start, its stdin /dev/null once it has its orders.
//! - A standby never outlives the launcher (parent-death signal) or the job
//!   ([`Standby::discard`] at the end), and does not carry the launcher's
//!   job marker until promoted, so a restart's stop sweep leaves the spares
//!   alone.
//!
//! The protocol (launcher/src/standby.py, run with `python -c`, so the job's
//! Python needs nothing installed): on fd 0, a Unix socket, the standby
//! writes `R` when ready; the launcher writes one JSON object (`argv` after
//! the interpreter, `env`: the whole environment, `cwd`) and shuts its side.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::task::JoinHandle;

use super::spawn::{self, SpawnError, Spawned};

/// The standby's program, run with `python -c`.
const SOURCE: &str = include_str!("standby.py");

/// The variable carrying the preload list to the standby: module names,
/// comma-separated; a trailing `?` marks one imported only when it can be.
pub const PRELOAD_ENV: &str = "WARDEN_STANDBY_PRELOAD";

/// Modules every standby imports when they are importable: what a torch
/// rank spends its start on. `torch._dynamo` (with sympy) is imported by
/// DistributedDataParallel's constructor and by torch.compile: about 1 s
/// of a warm rank's start on a 2-core host when left out.
pub const DEFAULT_PRELOAD: &[&str] = &[
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
];

/// How long a discarded standby may take to die before it is left to the
/// parent-death signal.
const DISCARD_WAIT: Duration = Duration::from_secs(2);

/// A Python entrypoint a standby can become: the interpreter and what
/// follows it (`script.py ARGS` or `-m MODULE ARGS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The interpreter (argv[0] of a cold worker).
    pub python: String,
    /// The rest of a cold worker's argv.
    pub args: Vec<String>,
}

impl Entry {
    /// The entrypoint of `argv` when it is `PYTHON script.py ARGS` or
    /// `PYTHON -m MODULE ARGS` with PYTHON's file name starting `python`;
    /// None for anything else (interpreter flags such as `-u` included:
    /// those run cold).
    pub fn of(argv: &[String]) -> Option<Self> {
        let (python, args) = argv.split_first()?;
        let name = Path::new(python).file_name()?.to_str()?;
        if !name.starts_with("python") {
            return None;
        }
        let ok = match args.first().map(String::as_str) {
            Some("-m") => args
                .get(1)
                .is_some_and(|m| !m.is_empty() && !m.starts_with('-')),
            Some(script) => !script.starts_with('-'),
            None => false,
        };
        ok.then(|| Self {
            python: python.clone(),
            args: args.to_vec(),
        })
    }
}

/// What the launcher's standbys are: the entrypoint they become, their
/// preload list ([`preload_spec`]) and how many are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandbyPlan {
    /// The workers' entrypoint.
    pub entry: Entry,
    /// The preload list.
    pub preload: String,
    /// How many to keep (`--standbys`); None: one per local worker.
    pub count: Option<u32>,
}

/// Which slot of the pool a restarted worker whose own slot is `own`
/// takes, given each slot's standby (None: empty; Some(ready)): its own
/// when ready, else any ready one (standbys differ in nothing but their
/// age), else its own still importing, else any still importing (a
/// promotion waits for its imports, which have a head start over a cold
/// start's); None when the pool is empty.
pub fn pick_slot(slots: &[Option<bool>], own: usize) -> Option<usize> {
    if slots.get(own) == Some(&Some(true)) {
        return Some(own);
    }
    slots
        .iter()
        .position(|s| *s == Some(true))
        .or_else(|| slots.get(own).copied().flatten().map(|_| own))
        .or_else(|| slots.iter().position(Option::is_some))
}

impl StandbyPlan {
    /// How many standbys a host of `nproc` local workers keeps: `count`,
    /// never more than one per worker (a restart replaces at most every
    /// local worker at once).
    pub fn pool_size(&self, nproc: u32) -> usize {
        self.count.map_or(nproc, |c| c.min(nproc)) as usize
    }
}

/// The preload list handed to the standby: the defaults (each when
/// importable), then `extra` (each required: a failure is printed on the
/// rank's stderr).
pub fn preload_spec(extra: &[String]) -> String {
    DEFAULT_PRELOAD
        .iter()
        .map(|m| format!("{m}?"))
        .chain(extra.iter().cloned())
        .collect::<Vec<_>>()
        .join(",")
}

/// Why a standby could not be promoted (it is discarded; the rank starts
/// cold).
#[derive(Debug, thiserror::Error)]
pub enum NotPromoted {
    /// The standby exited before it was ready (a preload that initialized
    /// CUDA, a crash in an import, killed).
    #[error("exited before it was ready")]
    Died,
    /// It was still importing after the wait.
    #[error("not ready after {0:?}")]
    NotReady(Duration),
    /// The launcher got a signal while it waited for it.
    #[error("was still importing when the launcher got a signal")]
    Interrupted,
    /// Its orders could not be handed over.
    #[error("cannot hand it its orders: {0}")]
    Order(std::io::Error),
}

/// A spare interpreter waiting for its orders.
#[derive(Debug)]
pub struct Standby {
    process: Spawned,
    /// Its fd 0's other end.
    orders: UnixStream,
    /// It said it is ready.
    ready: bool,
    started: Instant,
}

impl Standby {
    /// Starts a standby of `entry`'s interpreter in `cwd`, with the
    /// launcher's environment plus `env` (what every rank gets alike:
    /// the thread defaults modules read at import) and the preload list.
    pub fn start(
        entry: &Entry,
        preload: &str,
        env: &[(String, String)],
        cwd: &Path,
    ) -> Result<Self, SpawnError> {
        let (orders, theirs) = StdUnixStream::pair().map_err(|source| SpawnError::Start {
            program: entry.python.clone(),
            source,
        })?;
        let mut cmd = Command::new(&entry.python);
        cmd.args(["-c", SOURCE])
            .env_remove(crate::coord::etcd_flags::PASSWORD_ENV)
            // Not the job's until promoted: the stop sweep spares it.
            .env_remove(super::env::MARKER)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env(PRELOAD_ENV, preload)
            // `python -c` puts the working directory first on sys.path: a
            // module planted there would be imported at the preload, as
            // the job's user. 3.11+ leaves it out with this; standby.py
            // takes it out itself on older ones. The rank's own
            // environment replaces this one at promotion.
            .env("PYTHONSAFEPATH", "1")
            .current_dir(cwd)
            .stdin(Stdio::from(OwnedFd::from(theirs)));
        let process = spawn::start_in_session(cmd, &entry.python)?;
        let orders = orders
            .set_nonblocking(true)
            .and_then(|()| UnixStream::from_std(orders));
        let orders = match orders {
            Ok(o) => o,
            Err(source) => {
                drop(discard(process));
                return Err(SpawnError::Start {
                    program: entry.python.clone(),
                    source,
                });
            }
        };
        Ok(Self {
            process,
            orders,
            ready: false,
            started: Instant::now(),
        })
    }

    /// Its pid (the promoted worker's).
    pub fn pid(&self) -> i32 {
        self.process.pid
    }

    /// Waits up to `wait` for it to finish its imports (it has a head
    /// start over a cold worker). Cancel-safe: dropped before it is ready,
    /// the standby is as it was.
    pub async fn wait_ready(&mut self, wait: Duration) -> Result<(), NotPromoted> {
        if self.ready {
            return Ok(());
        }
        let mut byte = [0u8; 1];
        match tokio::time::timeout(wait, self.orders.read(&mut byte)).await {
            Ok(Ok(1)) if byte[0] == b'R' => {
                self.ready = true;
                Ok(())
            }
            Ok(_) => Err(NotPromoted::Died),
            Err(_) => Err(NotPromoted::NotReady(wait)),
        }
    }

    /// Whether it said it is ready, without waiting: reads its ready byte
    /// if it is there. False while it imports, and for one that died (its
    /// promotion then fails and the rank starts cold).
    pub fn is_ready(&mut self) -> bool {
        if !self.ready {
            let mut byte = [0u8; 1];
            if let Ok(1) = self.orders.try_read(&mut byte) {
                self.ready = byte[0] == b'R';
            }
        }
        self.ready
    }

    /// Makes it the worker `entry` with the rank's `env` (added to the
    /// launcher's environment, as a cold spawn's) in `cwd`, once ready
    /// ([`Self::wait_ready`] with `wait`). On failure it is discarded.
    pub async fn promote(
        mut self,
        entry: &Entry,
        env: &[(String, String)],
        cwd: &Path,
        wait: Duration,
    ) -> Result<Spawned, NotPromoted> {
        if let Err(e) = self.wait_ready(wait).await {
            drop(self.discard());
            return Err(e);
        }
        let order = order(entry, env, cwd);
        let Self {
            process,
            mut orders,
            ..
        } = self;
        let sent = async {
            orders.write_all(&order).await?;
            orders.shutdown().await
        };
        if let Err(e) = sent.await {
            drop(discard(process));
            return Err(NotPromoted::Order(e));
        }
        Ok(process)
    }

    /// Has it import `spec` too (`a?,b?`, as [`preload_spec`] writes):
    /// what the workers imported, as their clients reported it. The
    /// standby imports it before it reads its orders, so a promotion after
    /// this waits for the import; a standby that died makes this an error,
    /// and its promotion then starts the rank cold.
    pub async fn preload_more(&mut self, spec: &str) -> std::io::Result<()> {
        let mut line = serde_json::json!({ "preload": spec })
            .to_string()
            .into_bytes();
        line.push(b'\n');
        self.orders.write_all(&line).await
    }

    /// Kills it (its process group) and reaps it in the background.
    pub fn discard(self) -> JoinHandle<()> {
        discard(self.process)
    }

    /// How long ago it was started.
    pub fn age(&self) -> Duration {
        self.started.elapsed()
    }
}

fn discard(process: Spawned) -> JoinHandle<()> {
    spawn::signal_group(process.pid, Signal::SIGKILL);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(DISCARD_WAIT, process.pidfd.readable()).await;
        spawn::reap(process.pid);
    })
}

/// The JSON orders: argv after the interpreter, the whole environment (the
/// launcher's, without its etcd password, with `env` over it: what a cold
/// worker's exec gets; variables that are not UTF-8 are left out), cwd.
fn order(entry: &Entry, env: &[(String, String)], cwd: &Path) -> Vec<u8> {
    let mut all: BTreeMap<String, String> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    all.remove(crate::coord::etcd_flags::PASSWORD_ENV);
    for (k, v) in env {
        all.insert(k.clone(), v.clone());
    }
    let doc = serde_json::json!({
        "argv": entry.args,
        "env": all,
        "cwd": cwd.to_string_lossy(),
    });
    let mut line = doc.to_string().into_bytes();
    line.push(b'\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_worker_takes_its_own_ready_standby_else_another_ready_one() {
        let (ready, importing) = (Some(true), Some(false));
        // Its own, when ready.
        assert_eq!(pick_slot(&[ready, ready], 1), Some(1));
        // A pool smaller than the workers: another ready one.
        assert_eq!(pick_slot(&[ready, ready], 3), Some(0));
        assert_eq!(pick_slot(&[None, ready], 3), Some(1));
        // Its own still importing, another ready: the ready one.
        assert_eq!(pick_slot(&[ready, importing], 1), Some(0));
        // Its own empty (not refilled yet), another ready.
        assert_eq!(pick_slot(&[None, ready, None, None], 2), Some(1));
        // None ready: its own importing, else any importing.
        assert_eq!(pick_slot(&[importing, importing], 1), Some(1));
        assert_eq!(pick_slot(&[None, importing], 0), Some(1));
        assert_eq!(pick_slot(&[importing], 5), Some(0));
        // An empty pool, or none at all.
        assert_eq!(pick_slot(&[None, None], 0), None);
        assert_eq!(pick_slot(&[], 0), None);
    }

    #[test]
    fn the_pool_is_never_larger_than_the_workers() {
        let plan = |count| StandbyPlan {
            entry: Entry::of(&v(&["python3", "t.py"])).unwrap(),
            preload: String::new(),
            count,
        };
        assert_eq!(plan(None).pool_size(4), 4);
        assert_eq!(plan(Some(2)).pool_size(4), 2);
        assert_eq!(plan(Some(9)).pool_size(4), 4);
    }

    #[test]
    fn python_entrypoints_are_recognised() {
        let e = Entry::of(&v(&["/venv/bin/python3.11", "train.py", "--lr", "1"])).unwrap();
        assert_eq!(e.python, "/venv/bin/python3.11");
        assert_eq!(e.args, v(&["train.py", "--lr", "1"]));
        assert!(Entry::of(&v(&["python3", "-m", "pkg.train", "-x"])).is_some());
        assert!(Entry::of(&v(&["python3", "-u", "train.py"])).is_none());
        assert!(Entry::of(&v(&["python3", "-m"])).is_none());
        assert!(Entry::of(&v(&["python3"])).is_none());
        assert!(Entry::of(&v(&["bash", "job.sh"])).is_none());
        assert!(Entry::of(&v(&["./train.py"])).is_none());
    }

    #[test]
    fn the_defaults_are_optional_and_extras_required() {
        assert_eq!(
            preload_spec(&v(&["numpy", "mypkg.model"])),
            "torch?,torch.distributed?,torch.nn.parallel?,torch._dynamo?,numpy,mypkg.model"
        );
    }

    /// A real interpreter: the standby runs a script with the rank's argv,
    /// environment and cwd, and exits with its status; one never given
    /// orders exits 0 when the launcher lets go.
    #[tokio::test]
    async fn a_standby_becomes_the_script_with_its_exit_status() {
        let Ok(python) = which("python3") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("s.py");
        std::fs::write(
            &script,
            "import os, sys\nprint(sys.argv[1:], os.environ['RANK'], os.getcwd(), __name__)\nsys.exit(7)\n",
        )
        .unwrap();
        let entry = Entry {
            python: python.clone(),
            args: vec![script.display().to_string(), "a".into()],
        };
        // No torch wanted here: a test-only preload of a stdlib module.
        let s = Standby::start(&entry, "json", &[], Path::new("/")).unwrap();
        let pid = s.pid();
        let env = vec![("RANK".to_owned(), "5".to_owned())];
        let mut w = s
            .promote(&entry, &env, dir.path(), Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(w.pid, pid);
        let mut out = String::new();
        w.stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        let cwd = dir.path().canonicalize().unwrap();
        assert_eq!(
            out.trim(),
            format!("['a'] 5 {} __main__", cwd.display()),
            "{out}"
        );
        assert_eq!(
            spawn::exited(w.pid, &w.pidfd).await,
            Some(spawn::Exit::Code(7))
        );
        spawn::reap(w.pid);

        let idle = Standby::start(&entry, "", &[], Path::new("/")).unwrap();
        let pid = idle.pid();
        idle.discard().await.unwrap();
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
    }

    /// The standby's program takes the working directory off `sys.path`
    /// itself (a Python older than 3.11 ignores PYTHONSAFEPATH): modules
    /// planted there (`json`, imported by the program; `torch`, preloaded)
    /// are not imported, while `python -c` alone would import them.
    #[test]
    fn modules_planted_in_the_working_directory_are_not_imported() {
        let Ok(python) = which("python3") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        for m in ["json", "torch"] {
            let marker = dir.path().join(format!("{m}.ran"));
            std::fs::write(
                dir.path().join(format!("{m}.py")),
                format!("open({:?}, 'w').close()\n", marker.display().to_string()),
            )
            .unwrap();
        }
        let run = |program: &str| {
            std::process::Command::new(&python)
                .args(["-c", program])
                .env_remove("PYTHONSAFEPATH")
                .env_remove("PYTHONPATH")
                .env(PRELOAD_ENV, "torch?")
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap()
        };
        // The standby: no orders can come on /dev/null, so it ends after
        // its imports and preload.
        run(SOURCE);
        assert!(!dir.path().join("json.ran").exists(), "json.py ran");
        assert!(!dir.path().join("torch.ran").exists(), "torch.py ran");
        // The plant works on a plain `python -c` (what the standby was).
        run("import json");
        assert!(dir.path().join("json.ran").exists());
    }

    /// A module run with `-m` gets its package's path and `sys.argv`; an
    /// uncaught exception ends the process with 1 and Python's traceback on
    /// the rank's stderr; a standby whose preload kills it is not promoted.
    #[tokio::test]
    async fn modules_exceptions_and_a_dead_standby() {
        let Ok(python) = which("python3") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("pkg")).unwrap();
        std::fs::write(dir.path().join("pkg/__init__.py"), "").unwrap();
        std::fs::write(
            dir.path().join("pkg/train.py"),
            "import sys\nprint(__name__, sys.argv[1:])\nraise ValueError('bad batch')\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("dies.py"), "import os\nos._exit(4)\n").unwrap();
        let entry = Entry {
            python: python.clone(),
            args: v(&["-m", "pkg.train", "--lr", "1"]),
        };
        let s = Standby::start(&entry, "", &[], Path::new("/")).unwrap();
        let mut w = s
            .promote(&entry, &[], dir.path(), Duration::from_secs(30))
            .await
            .unwrap();
        let (mut out, mut err) = (String::new(), String::new());
        w.stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        w.stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .await
            .unwrap();
        assert_eq!(out.trim(), "__main__ ['--lr', '1']", "{out}\n{err}");
        assert!(
            err.contains("Traceback") && err.trim_end().ends_with("ValueError: bad batch"),
            "{err}"
        );
        assert_eq!(
            spawn::exited(w.pid, &w.pidfd).await,
            Some(spawn::Exit::Code(1))
        );
        spawn::reap(w.pid);

        let pythonpath = vec![("PYTHONPATH".to_owned(), dir.path().display().to_string())];
        let doomed = Standby::start(&entry, "dies", &pythonpath, Path::new("/")).unwrap();
        let got = doomed
            .promote(&entry, &[], dir.path(), Duration::from_secs(30))
            .await;
        assert!(matches!(got, Err(NotPromoted::Died)), "{got:?}");
    }

    fn which(name: &str) -> Result<String, ()> {
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .map_err(|_| ())?;
        let p = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if p.is_empty() { Err(()) } else { Ok(p) }
    }
}
