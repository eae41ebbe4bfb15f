//! Saving and restoring a rank's checkpoint shard through the local agent's
//! checkpoint tier.
//!
//! In: the shard's bytes (or a function that writes the file in place, such
//! as `torch.save`). Out: the shard committed in the agent's local tier, and
//! later the newest complete step's shard, from the nearest valid copy.
//!
//! Contract: a save holds the caller for one write into the tier (tmpfs or
//! NVMe, on this host) and two local calls; the commit answers once the
//! agent has checksummed the shard and written its manifest durably, so a
//! save that returns Ok survives the agent's death. Replication to peers
//! and upload to the durable store happen in the agent afterwards. Unlike
//! heartbeats, saving needs the agent: without one, a save fails at once
//! with an error saying so, and the caller decides whether to go on. After
//! the agent restarted, the next save dials it again before it answers.
//!
//! Calls block the calling thread. From inside a tokio runtime they run on
//! a scoped helper thread, so they never panic there.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::client::ConnectOptions;

/// Why a checkpoint call failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The agent's socket could not be reached.
    #[error("checkpoint: no agent at {path}: {error}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What went wrong.
        error: String,
    },
    /// The agent refused (a full tier is `ResourceExhausted`, no such step
    /// `NotFound`, no valid copy `DataLoss`, holders of the checkpoint that
    /// could not be asked `Aborted`: the agent asked them twice already, so
    /// the call is not repeated; a restart of the job asks again).
    #[error("checkpoint: {call} refused ({code:?}): {message}")]
    Rejected {
        /// The call.
        call: &'static str,
        /// gRPC code.
        code: tonic::Code,
        /// The agent's words.
        message: String,
    },
    /// Writing or reading the shard file failed (a full tmpfs is
    /// `StorageFull`); a half-written staging file is removed.
    #[error("checkpoint: {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The client's runtime could not start.
    #[error("checkpoint: tokio runtime: {0}")]
    Runtime(std::io::Error),
}

impl CheckpointError {
    /// True when the tier had no room, even after pruning old steps.
    pub fn is_full(&self) -> bool {
        match self {
            CheckpointError::Rejected { code, .. } => *code == tonic::Code::ResourceExhausted,
            CheckpointError::Io { source, .. } => {
                source.kind() == std::io::ErrorKind::StorageFull
                    || source.raw_os_error() == Some(libc::ENOSPC)
                    || source.raw_os_error() == Some(libc::EDQUOT)
            }
            _ => false,
        }
    }
}

/// A committed save.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    /// The step.
    pub step: u64,
    /// The shard in the local tier.
    pub path: PathBuf,
    /// Bytes.
    pub size_bytes: u64,
    /// How long the caller was held.
    pub stall: Duration,
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The most one checkpoint call may take. CommitShard hashes and syncs
/// the shard before it answers (a GiB on NVMe: about a second), and a
/// Restore may fetch a shard from a peer or the durable store; the 2 s
/// bound of the heartbeat client's calls would fail saves that did commit.
/// An agent that is down is still found at once (connecting is bounded
/// apart).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// A staging file named by the agent, to be written and committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    /// Where to write the shard.
    pub path: PathBuf,
    /// Hands it back in [`Checkpointer::commit`].
    pub token: String,
}

/// A restored shard: already in the local tier and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The step restored.
    pub step: u64,
    /// The shard's file in the local tier.
    pub path: PathBuf,
    /// Bytes.
    pub size_bytes: u64,
    /// "local", "peer" or "durable".
    pub tier: String,
    /// The agent or store it came from.
    pub source: String,
    /// Copies passed over, with why.
    pub skipped: Vec<String>,
}

impl Restored {
    /// The shard's bytes.
    pub fn read(&self) -> Result<Vec<u8>, CheckpointError> {
        std::fs::read(&self.path).map_err(|source| CheckpointError::Io {
            what: "reading",
            path: self.path.clone(),
            source,
        })
    }
}

/// A rank's handle on the checkpoint tier.
#[derive(Debug)]
pub struct Checkpointer {
    opts: ConnectOptions,
    /// Always Some until drop, which shuts it down without blocking (a
    /// checkpointer may be dropped inside someone else's runtime).
    rt: Option<tokio::runtime::Runtime>,
    client: std::sync::Mutex<Option<AgentClient<Channel>>>,
}

impl Checkpointer {
    /// A checkpointer for the rank `opts` describe (job, rank, world size,
    /// socket). Connects on first use.
    pub fn new(opts: ConnectOptions) -> Result<Self, CheckpointError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(CheckpointError::Runtime)?;
        Ok(Self {
            opts,
            rt: Some(rt),
            client: std::sync::Mutex::new(None),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &ConnectOptions {
        &self.opts
    }

    fn run<T: Send>(&self, f: impl std::future::Future<Output = T> + Send) -> T {
        let Some(rt) = self.rt.as_ref() else {
            unreachable!("the runtime is only taken by drop")
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            std::thread::scope(|s| {
                s.spawn(|| rt.block_on(f))
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p))
            })
        } else {
            rt.block_on(f)
        }
    }

    fn agent(&self) -> Result<AgentClient<Channel>, CheckpointError> {
        let mut guard = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let path = self.opts.socket_path.clone();
        let timeout = self.opts.connect_timeout.max(Duration::from_secs(1));
        let channel = self
            .run(async {
                tokio::time::timeout(
                    timeout,
                    crate::channel::connect_channel_with(path.clone(), CALL_TIMEOUT),
                )
                .await
            })
            .map_err(|_| CheckpointError::Connect {
                path: path.clone(),
                error: format!("no answer within {timeout:?}"),
            })?
            .map_err(|e| CheckpointError::Connect {
                path: path.clone(),
                error: e.to_string(),
            })?;
        let c = AgentClient::new(channel);
        *guard = Some(c.clone());
        Ok(c)
    }

    /// Forgets the connection, so the next call dials the socket again.
    fn forget(&self) {
        *self.client.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Runs `call` on the agent; when it fails as a dead connection does
    /// (the agent restarted since the last call: UNAVAILABLE, or UNKNOWN
    /// from a transport cut mid-call), dials the socket again, once, and
    /// retries. Bounded: one reconnect within `connect_timeout`; while the
    /// agent is down the reconnect itself fails at once (no socket, or
    /// nobody listening) with [`CheckpointError::Connect`]. Only for calls
    /// that are safe to repeat (BeginShard: a duplicate reservation expires
    /// unused; Restore).
    fn call_reconnecting<T, F, Fut>(
        &self,
        name: &'static str,
        call: F,
    ) -> Result<T, CheckpointError>
    where
        F: Fn(AgentClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>> + Send,
        T: Send,
    {
        let first = self.run(call(self.agent()?));
        let answer = match first {
            Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown) => {
                self.forget();
                self.run(call(self.agent()?))
            }
            r => r,
        };
        answer
            .map(tonic::Response::into_inner)
            .map_err(|s| self.rejected(name, s))
    }

    fn rejected(&self, call: &'static str, s: tonic::Status) -> CheckpointError {
        if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown) {
            // The connection may be gone (agent restarted): the next call
            // dials again.
            self.forget();
        }
        CheckpointError::Rejected {
            call,
            code: s.code(),
            message: s.message().to_owned(),
        }
    }

    /// Saves `data` as this rank's shard of `step`.
    pub fn save(&self, step: u64, data: &[u8]) -> Result<Saved, CheckpointError> {
        self.save_with(step, data.len() as u64, |f| f.write_all(data))
    }

    /// Saves a shard that `write` writes into the given file (opened for
    /// writing, in the tier's staging directory); `size_hint` is the room to
    /// make (the real size is what gets written).
    pub fn save_with(
        &self,
        step: u64,
        size_hint: u64,
        write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
    ) -> Result<Saved, CheckpointError> {
        self.save_in_place(step, size_hint, |path| {
            let mut f = std::fs::File::create(path)?;
            write(&mut f)
        })
    }

    /// Saves a shard written by `write` at the path it is given (a file in
    /// the tier's staging directory): for writers that want a path, such as
    /// `torch.save`.
    pub fn save_in_place(
        &self,
        step: u64,
        size_hint: u64,
        write: impl FnOnce(&Path) -> std::io::Result<()>,
    ) -> Result<Saved, CheckpointError> {
        let started = Instant::now();
        let staged = self.begin(step, size_hint)?;
        let written =
            write(&staged.path).and_then(|()| std::fs::metadata(&staged.path).map(|m| m.len()));
        let size = match written {
            Ok(n) => n,
            Err(source) => {
                let _ = std::fs::remove_file(&staged.path);
                return Err(CheckpointError::Io {
                    what: "writing the shard to",
                    path: staged.path,
                    source,
                });
            }
        };
        let path = self.commit(step, &staged, size, started.elapsed())?;
        Ok(Saved {
            step,
            path,
            size_bytes: size,
            stall: started.elapsed(),
        })
    }

    /// First half of a save, for callers that write the file themselves
    /// (the Python package writes from its own buffer): room is made for
    /// `size_hint` bytes and a staging file is named.
    pub fn begin(&self, step: u64, size_hint: u64) -> Result<Staged, CheckpointError> {
        let req = pb::BeginShardRequest {
            job_id: self.opts.job_id.clone(),
            rank: self.opts.global_rank,
            step,
            size_bytes: size_hint,
        };
        let begin = self.call_reconnecting("BeginShard", |mut agent| {
            let req = req.clone();
            async move { agent.begin_shard(req).await }
        })?;
        Ok(Staged {
            path: PathBuf::from(begin.staging_path),
            token: begin.token,
        })
    }

    /// Second half: the written staging file (`size` bytes) committed; `stall`
    /// is how long the save held the training step. On refusal the staging
    /// file is removed.
    pub fn commit(
        &self,
        step: u64,
        staged: &Staged,
        size: u64,
        stall: Duration,
    ) -> Result<PathBuf, CheckpointError> {
        let mut agent = self.agent()?;
        let done = self
            .run(agent.commit_shard(pb::CommitShardRequest {
                job_id: self.opts.job_id.clone(),
                rank: self.opts.global_rank,
                step,
                token: staged.token.clone(),
                size_bytes: size,
                world_size: self.opts.world_size,
                stall_ns: u64::try_from(stall.as_nanos()).unwrap_or(u64::MAX),
            }))
            .map_err(|s| {
                let _ = std::fs::remove_file(&staged.path);
                self.rejected("CommitShard", s)
            })?
            .into_inner();
        Ok(PathBuf::from(done.path))
    }

    /// This rank's shard of the newest step complete for every rank of the
    /// job (`step` 0), or of `step`; `None` when no step is complete
    /// anywhere (a fresh start).
    pub fn restore(&self, step: u64) -> Result<Option<Restored>, CheckpointError> {
        self.restore_rank(self.opts.global_rank, step)
    }

    /// Another rank's shard of the same job, as [`Checkpointer::restore`]
    /// finds this rank's: for a sharded checkpoint (torch.distributed.checkpoint)
    /// whose reader needs items another rank wrote (a replicated tensor is
    /// saved by one rank only; a job that restores with a new sharding).
    pub fn restore_rank(&self, rank: u32, step: u64) -> Result<Option<Restored>, CheckpointError> {
        let req = pb::RestoreRequest {
            job_id: self.opts.job_id.clone(),
            rank,
            step,
        };
        let r = self.call_reconnecting("Restore", |mut agent| {
            let req = req.clone();
            async move { agent.restore(req).await }
        })?;
        if !r.found {
            return Ok(None);
        }
        Ok(Some(Restored {
            step: r.step,
            path: PathBuf::from(r.path),
            size_bytes: r.size_bytes,
            tier: r.tier,
            source: r.source,
            skipped: r.skipped,
        }))
    }
}
