//! The round's store across hosts, hosted by node rank 0's launcher.
//!
//! Across hosts (`--rdzv-backend etcd`) each attempt's process group is made
//! on a TCPStore every host reaches (`warden.heal.init_process_group`). Hosted
//! by global rank 0 (a worker), it dies with that rank, so a fault of rank 0
//! could only be answered by a restart in job. Here node rank 0's launcher
//! hosts it instead, in a small Python process of its own (torch's TCPStore
//! server, so the workers speak torch's protocol to it), for as long as the
//! round lasts: the workers connect as clients, and any of them may die
//! while the store and its keys live on (torchrun's agent store, by
//! another door: `TORCHELASTIC_USE_AGENT_STORE` stays False, so plain torch
//! code's rank 0 still hosts its own store at `MASTER_PORT`).
//!
//! - **In**: the job's Python interpreter (the command's, as for standby
//!   interpreters), the round's port and address.
//! - **Out**: a process (its own session, SIGKILL as its parent-death signal,
//!   fd 0 a Unix socket to the launcher) serving TCPStore on the round's
//!   store port ([`port_for`]) until the round closes.
//! - **Never**: blocks a training step or the launcher beyond
//!   [`ORDER_TIMEOUT`]; hosts more than the store process's `MAX_OPEN`
//!   stores; outlives the launcher.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::spawn::{self, SpawnError, Spawned};

/// The store process's program, run with `python -c`.
const SOURCE: &str = include_str!("round_store.py");

/// The variable naming the round store's port to the workers (set on every
/// host; `warden.heal` connects there as a client instead of rank 0 hosting).
pub const PORT_ENV: &str = "WARDEN_ROUND_STORE_PORT";

/// How long an order may take: the first one waits for the process to import
/// torch (seconds on a loaded host), the others for a bind.
pub const ORDER_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest answer line read from the store process.
const MAX_ANSWER: usize = 1024;

/// The round store's port for a round at `master_port`: one port span
/// (`coord::config::DEFAULT_PORT_SPAN`) above it, so the rounds' store ports
/// move with their master ports and never meet another round's `MASTER_PORT`
/// (JAX's coordinator, at `MASTER_PORT + 1`, may meet the store of the
/// round 999 epochs later). None past the last port.
pub fn port_for(master_port: u16) -> Option<u16> {
    master_port.checked_add(crate::coord::config::DEFAULT_PORT_SPAN)
}

/// What went wrong with the store process.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// It could not be started.
    #[error("starting the round store: {0}")]
    Start(#[from] SpawnError),
    /// Its order socket failed.
    #[error("the round store's order socket: {0}")]
    Socket(std::io::Error),
    /// It did not answer in time.
    #[error("the round store did not answer `{order}` within {}s", ORDER_TIMEOUT.as_secs())]
    Timeout {
        /// The order.
        order: String,
    },
    /// It ended (torch missing, killed).
    #[error("the round store process ended (is torch importable by the job's python?)")]
    Ended,
    /// It refused the order.
    #[error("the round store refused `{order}`: {why}")]
    Refused {
        /// The order.
        order: String,
        /// Its answer.
        why: String,
    },
}

/// The store process and the port it serves.
#[derive(Debug)]
pub struct RoundStore {
    /// The process (taken by drop, to await its exit in the background).
    process: Option<Spawned>,
    pid: i32,
    orders: BufReader<UnixStream>,
    /// The port of the round it serves now, if any.
    open: Option<u16>,
    /// An order timed out or the process ended: its answers can no longer
    /// be matched to orders; a new process is needed.
    broken: bool,
}

impl RoundStore {
    /// Starts the store process with `python` in `cwd` (it imports torch
    /// before its first answer). Its stdout and stderr go to the launcher's
    /// stderr, each line marked.
    pub fn start(python: &str, cwd: &Path) -> Result<Self, StoreError> {
        let (ours, theirs) = StdUnixStream::pair().map_err(StoreError::Socket)?;
        let mut cmd = Command::new(python);
        cmd.args(["-c", SOURCE])
            .env_remove(crate::coord::etcd_flags::PASSWORD_ENV)
            // Not a worker: the stop sweep between attempts spares it.
            .env_remove(crate::env::MARKER)
            .env("PYTHONSAFEPATH", "1")
            .current_dir(cwd)
            .stdin(Stdio::from(OwnedFd::from(theirs)));
        let mut process = spawn::start_in_session(cmd, python)?;
        for out in [
            process
                .stdout
                .take()
                .map(|o| Box::new(o) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            process
                .stderr
                .take()
                .map(|e| Box::new(e) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
        ]
        .into_iter()
        .flatten()
        {
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::warn!(target: "warden::round_store", "{line}");
                }
            });
        }
        let orders = ours
            .set_nonblocking(true)
            .and_then(|()| UnixStream::from_std(ours))
            .map_err(StoreError::Socket);
        match orders {
            Ok(o) => Ok(Self {
                pid: process.pid,
                process: Some(process),
                orders: BufReader::new(o),
                open: None,
                broken: false,
            }),
            Err(e) => {
                spawn::signal_group(process.pid, Signal::SIGKILL);
                Err(e)
            }
        }
    }

    /// Its pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The port it serves now.
    pub fn serving(&self) -> Option<u16> {
        self.open
    }

    /// Whether it can take no more orders (one timed out, or it ended).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Serves the round at `port` (binding every address; `addr` is the
    /// one its own client connection uses), then closes the round it served
    /// before: the workers of the old round are gone or have moved on.
    pub async fn serve(&mut self, port: u16, addr: &str) -> Result<(), StoreError> {
        if self.open == Some(port) {
            return Ok(());
        }
        self.order(&format!("open {port} {addr}"), port).await?;
        if let Some(old) = self.open.replace(port) {
            self.order(&format!("close {old}"), old).await?;
        }
        Ok(())
    }

    /// Stops serving its round, if any.
    pub async fn close(&mut self) -> Result<(), StoreError> {
        match self.open.take() {
            Some(old) => self.order(&format!("close {old}"), old).await,
            None => Ok(()),
        }
    }

    async fn order(&mut self, order: &str, port: u16) -> Result<(), StoreError> {
        if self.broken {
            return Err(StoreError::Ended);
        }
        let answer = self.exchange(order).await;
        if matches!(
            answer,
            Err(StoreError::Ended | StoreError::Timeout { .. } | StoreError::Socket(_))
        ) {
            self.broken = true;
        }
        let answer = answer?;
        if answer == format!("ok {port}") {
            return Ok(());
        }
        Err(StoreError::Refused {
            order: order.to_owned(),
            why: answer,
        })
    }

    /// Sends `order`, returns its answer line.
    async fn exchange(&mut self, order: &str) -> Result<String, StoreError> {
        let exchange = async {
            self.orders
                .get_mut()
                .write_all(format!("{order}\n").as_bytes())
                .await
                .map_err(|_| StoreError::Ended)?;
            let mut line = Vec::new();
            let mut limited = (&mut self.orders).take(MAX_ANSWER as u64);
            tokio::io::AsyncBufReadExt::read_until(&mut limited, b'\n', &mut line)
                .await
                .map_err(|_| StoreError::Ended)?;
            if line.is_empty() {
                return Err(StoreError::Ended);
            }
            Ok(String::from_utf8_lossy(&line).trim().to_owned())
        };
        tokio::time::timeout(ORDER_TIMEOUT, exchange)
            .await
            .map_err(|_| StoreError::Timeout {
                order: order.to_owned(),
            })?
    }
}

impl Drop for RoundStore {
    /// SIGKILL to its session, then its exit awaited (bounded) and reaped
    /// in the background, so no zombie waits for the launcher's end.
    fn drop(&mut self) {
        let pid = self.pid;
        spawn::signal_group(pid, Signal::SIGKILL);
        let (Some(process), Ok(rt)) = (self.process.take(), tokio::runtime::Handle::try_current())
        else {
            spawn::reap(pid);
            return;
        };
        rt.spawn(async move {
            let _ = tokio::time::timeout(REAP_WAIT, process.pidfd.readable()).await;
            spawn::reap(pid);
        });
    }
}

/// How long a dropped store process's exit is awaited before it is reaped
/// anyway (SIGKILL ends it in milliseconds).
const REAP_WAIT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// `$WARDEN_TEST_PYTHON` (else `python3`) when it imports torch; None
    /// (said) when it cannot and `WARDEN_REQUIRE_TORCH` is unset.
    fn torch_python() -> Option<String> {
        let python = std::env::var("WARDEN_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let ok = std::process::Command::new(&python)
            .args(["-c", "import torch.distributed"])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(python);
        }
        assert!(
            std::env::var_os("WARDEN_REQUIRE_TORCH").is_none(),
            "WARDEN_REQUIRE_TORCH is set but {python} cannot import torch"
        );
        eprintln!("skipped: {python} cannot import torch");
        None
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A torch client of the store at `port`: runs `body` (with `s` the
    /// store), its output and status.
    fn client(python: &str, port: u16, body: &str) -> std::process::Output {
        let src = format!(
            "import datetime, os, signal\nimport torch.distributed as dist\n\
             s = dist.TCPStore('127.0.0.1', {port}, world_size=None, is_master=False, \
             timeout=datetime.timedelta(seconds=20), wait_for_workers=False)\n{body}\n"
        );
        std::process::Command::new(python)
            .args(["-c", &src])
            .output()
            .unwrap()
    }

    /// The store keeps a key after the rank that set it was SIGKILLed (what
    /// rank 0 hosting it could not), a later rank reads it, and a round's
    /// store closes when the next round's opens.
    #[tokio::test]
    async fn the_store_outlives_a_killed_client_and_closes_with_its_round() {
        let Some(python) = torch_python() else {
            return;
        };
        let mut store = RoundStore::start(&python, Path::new("/")).unwrap();
        let first = free_port();
        store.serve(first, "127.0.0.1").await.unwrap();
        assert_eq!(store.serving(), Some(first));

        let killed = client(
            &python,
            first,
            "s.set('entered-0', 'rank 0')\nos.kill(os.getpid(), signal.SIGKILL)",
        );
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&killed.status),
            Some(9),
            "{killed:?}"
        );
        let read = client(&python, first, "print(s.get('entered-0').decode())");
        assert!(read.status.success(), "{read:?}");
        assert_eq!(String::from_utf8_lossy(&read.stdout).trim(), "rank 0");

        let next = free_port();
        store.serve(next, "127.0.0.1").await.unwrap();
        assert_eq!(store.serving(), Some(next));
        let old = std::net::TcpStream::connect(("127.0.0.1", first));
        assert!(old.is_err(), "the old round's store still listens");
        let fresh = client(&python, next, "print(s.check(['entered-0']))");
        assert!(fresh.status.success(), "{fresh:?}");
        assert_eq!(String::from_utf8_lossy(&fresh.stdout).trim(), "False");
        store.close().await.unwrap();
        assert_eq!(store.serving(), None);
    }

    /// A port already taken is refused with the store's reason, and the
    /// store serves on.
    #[tokio::test]
    async fn a_taken_port_is_refused_with_the_reason() {
        let Some(python) = torch_python() else {
            return;
        };
        let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let mut store = RoundStore::start(&python, Path::new("/")).unwrap();
        let err = store.serve(port, "127.0.0.1").await.unwrap_err();
        assert!(
            matches!(&err, StoreError::Refused { why, .. } if why.starts_with(&format!("err {port}"))),
            "{err}"
        );
        let other = free_port();
        store.serve(other, "127.0.0.1").await.unwrap();
        assert_eq!(store.serving(), Some(other));
    }

    #[test]
    fn store_ports_sit_one_span_above_the_rounds_and_stop_at_the_last_port() {
        assert_eq!(port_for(29500), Some(30500));
        assert_eq!(port_for(u16::MAX - 10), None);
    }
}
