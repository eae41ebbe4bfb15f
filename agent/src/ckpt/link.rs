//! The checkpoint flow's calls to a peer agent, in the flow's own terms:
//! what shards a peer holds, a replica pushed to it, a copy fetched from it.
//!
//! In: a [`Peer`], a job, a [`Manifest`] or a [`ShardKey`]. Out: manifests,
//! the peer's host name, and errors worded for a person ([`LinkError`]).
//! Replication (`replicate.rs`) and restores (`restore.rs`) call these and
//! name no tonic or protobuf type. The calls are a port: [`PeerLink`] and
//! [`PeerDial`] are implemented by the transport (`crate::peer_link`, tonic
//! and the hand-framed chunks), which imports this stage and never the
//! other way round.

use std::any::Any;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::Peer;
use super::collect::{Ask, Collected};
use super::layout::ShardKey;
use super::manifest::Manifest;
use super::receive::ShardStream;

pub use super::link_error::LinkError;

/// What a peer said it holds of a job.
#[derive(Debug)]
pub struct PeerHoldings {
    /// The peer's host name, as it gave it.
    pub host: String,
    /// Each shard it listed, or why its description makes no sense.
    pub shards: Vec<Result<Manifest, String>>,
}

/// One peer agent's calls, as the transport carries them.
#[async_trait::async_trait]
pub trait PeerLink: Send + Sync + std::fmt::Debug {
    /// The shards the peer holds of `job` (every job: `""`), within
    /// `limit`.
    async fn list(&self, job: &str, limit: Duration) -> Result<PeerHoldings, LinkError>;

    /// The shards (key and xxh3) the peer holds of `job`, within `limit`,
    /// as it listed them: what replication need not send again.
    async fn held(&self, job: &str, limit: Duration)
    -> Result<HashSet<(ShardKey, u64)>, LinkError>;

    /// Asks the peer `ask` (CollectHoldings), within `limit`: its answer,
    /// checked; one out of bounds is refused as if the peer had refused
    /// the ask, naming what was wrong.
    async fn collect(&self, ask: &Ask, limit: Duration) -> Result<Collected, LinkError>;

    /// Pushes the shard `m` (read from `file`, at `path`) to the peer in
    /// chunks of `chunk_bytes`, paced to `bytes_per_sec` (0: unpaced); the
    /// host name it answered with. A read error resets the stream: the
    /// receiver refuses the replica.
    async fn push(
        &self,
        m: &Manifest,
        file: std::fs::File,
        path: PathBuf,
        chunk_bytes: usize,
        bytes_per_sec: u64,
    ) -> Result<String, LinkError>;

    /// Asks the peer for the shard `key`: its first chunk read, and what
    /// the peer says the shard is.
    async fn fetch(&self, key: &ShardKey) -> Result<Incoming, String>;

    /// The transport's own handle, for a transport's other calls to share
    /// the connection (the straggler exchange dials a job's peer through
    /// it).
    fn as_any(&self) -> &dyn Any;
}

/// Makes the link to a peer agent: its address, the name its certificate
/// must carry (empty: unknown, dialed but never authorized for a job), and
/// how long a connection may take. Connections are made lazily.
pub trait PeerDial: Send + Sync + std::fmt::Debug {
    /// The link to the peer at `addr`, or why its address is unusable.
    fn dial(&self, addr: &str, name: &str, timeout: Duration) -> Result<Arc<dyn PeerLink>, String>;
}

impl Peer {
    /// [`PeerLink::list`].
    pub async fn list(&self, job: &str, limit: Duration) -> Result<PeerHoldings, LinkError> {
        self.link.list(job, limit).await
    }

    /// [`PeerLink::held`].
    pub async fn held(
        &self,
        job: &str,
        limit: Duration,
    ) -> Result<HashSet<(ShardKey, u64)>, LinkError> {
        self.link.held(job, limit).await
    }

    /// [`PeerLink::collect`].
    pub async fn collect(&self, ask: &Ask, limit: Duration) -> Result<Collected, LinkError> {
        self.link.collect(ask, limit).await
    }

    /// [`PeerLink::push`].
    pub async fn push(
        &self,
        m: &Manifest,
        file: std::fs::File,
        path: PathBuf,
        chunk_bytes: usize,
        bytes_per_sec: u64,
    ) -> Result<String, LinkError> {
        self.link
            .push(m, file, path, chunk_bytes, bytes_per_sec)
            .await
    }

    /// [`PeerLink::fetch`].
    pub async fn fetch(&self, key: &ShardKey) -> Result<Incoming, String> {
        self.link.fetch(key).await
    }
}

/// A shard a peer began sending ([`PeerLink::fetch`]).
pub struct Incoming {
    /// What the peer says the shard is.
    pub told: Manifest,
    first: Vec<Bytes>,
    rest: Box<dyn ShardStream>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("told", &self.told)
            .finish_non_exhaustive()
    }
}

impl Incoming {
    /// A shard the peer says is `told`, whose first chunk carried `first`
    /// and whose other chunks come from `rest`.
    pub fn new(told: Manifest, first: Vec<Bytes>, rest: Box<dyn ShardStream>) -> Self {
        Self { told, first, rest }
    }

    /// Receives the rest into `dest` (a staging file at `path`), checked
    /// against `want` (size and xxh3): [`super::receive::receive`].
    pub async fn receive(
        mut self,
        want: &Manifest,
        dest: std::fs::File,
        path: PathBuf,
    ) -> Result<(), String> {
        super::receive::receive(&mut *self.rest, self.first, want, dest, path).await
    }
}
