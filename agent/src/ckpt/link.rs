//! The checkpoint flow's calls to a peer agent, in the flow's own terms:
//! what shards a peer holds, a replica pushed to it, a copy fetched from it.
//!
//! In: a [`Peer`], a job, a [`Manifest`] or a [`ShardKey`]. Out: manifests,
//! the peer's host name, and errors worded for a person ([`LinkError`]).
//! Replication (`replicate.rs`) and restores (`restore.rs`) call these and
//! name no tonic or protobuf type: the transport (tonic's client for
//! listings, the hand-framed chunks of [`super::wire`] for the shards'
//! bytes) stays behind this module.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;

use super::Peer;
use super::layout::ShardKey;
use super::manifest::Manifest;
use super::peers::{self, MAX_MESSAGE};
use super::wire::{self, ChunkSource, Reader};

pub use super::link_error::LinkError;

/// What a peer said it holds of a job.
#[derive(Debug)]
pub struct PeerHoldings {
    /// The peer's host name, as it gave it.
    pub host: String,
    /// Each shard it listed, or why its description makes no sense.
    pub shards: Vec<Result<Manifest, String>>,
}

impl Peer {
    /// The shards this peer holds of `job` (every job: `""`), within
    /// `limit`.
    pub async fn list(&self, job: &str, limit: Duration) -> Result<PeerHoldings, LinkError> {
        let r = self.list_raw(job, limit).await?;
        Ok(PeerHoldings {
            shards: r.shards.iter().map(wire::manifest_of).collect(),
            host: r.host,
        })
    }

    /// The shards (key and xxh3) this peer holds of `job`, within `limit`,
    /// as it listed them: what replication need not send again.
    pub async fn held(
        &self,
        job: &str,
        limit: Duration,
    ) -> Result<HashSet<(ShardKey, u64)>, LinkError> {
        Ok(wire::held_shards(&self.list_raw(job, limit).await?))
    }

    /// Asks this peer `ask` (CollectHoldings), within `limit`: its answer,
    /// checked ([`super::collect_wire`]); one out of bounds is refused as
    /// if the peer had refused the ask, naming what was wrong.
    pub async fn collect(
        &self,
        ask: &super::collect::Ask,
        limit: Duration,
    ) -> Result<super::collect::Collected, LinkError> {
        use super::collect::{AskScope, Collected};
        use super::collect_wire as w;
        let mut c = self.client.clone();
        let r = match tokio::time::timeout(limit, c.collect_holdings(w::ask_to_pb(ask))).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                return Err(LinkError::Unsupported(s.message().to_owned()));
            }
            Ok(Err(s)) => return Err(LinkError::Refused(s.message().to_owned())),
            Err(_) => return Err(LinkError::Silent(limit)),
        };
        match &ask.scope {
            AskScope::Job { ranks } => w::view_from_pb(r, ranks).map(Collected::Job),
            AskScope::Group { .. } => w::holdings_from_pb(r).map(Collected::Group),
        }
        .map_err(|e| LinkError::Refused(format!("its answer makes no sense: {e}")))
    }

    async fn list_raw(
        &self,
        job: &str,
        limit: Duration,
    ) -> Result<warden_proto::v1::ListShardsResponse, LinkError> {
        let mut c = self.client.clone();
        match tokio::time::timeout(limit, c.list_shards(wire::list_request(job))).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(LinkError::Refused(s.message().to_owned())),
            Err(_) => Err(LinkError::Silent(limit)),
        }
    }

    /// Pushes the shard `m` (read from `file`, at `path`) to this peer in
    /// chunks of `chunk_bytes`, paced to `bytes_per_sec` (0: unpaced); the
    /// host name it answered with. A read error resets the stream: the
    /// receiver refuses the replica.
    pub async fn push(
        &self,
        m: &Manifest,
        file: std::fs::File,
        path: PathBuf,
        chunk_bytes: usize,
        bytes_per_sec: u64,
    ) -> Result<String, LinkError> {
        let stream = peers::chunk_stream(m.clone(), file, path, chunk_bytes, bytes_per_sec);
        wire::push(self.channel.clone(), stream, MAX_MESSAGE)
            .await
            .map(|r| r.host)
            .map_err(|s| LinkError::Refused(s.message().to_owned()))
    }

    /// Asks this peer for the shard `key`: its first chunk read, and what
    /// the peer says the shard is.
    pub async fn fetch(&self, key: &ShardKey) -> Result<Incoming, String> {
        let mut reader = wire::fetch(self.channel.clone(), &wire::fetch_request(key), MAX_MESSAGE)
            .await
            .map_err(|s| s.message().to_owned())?;
        let first = reader
            .next_chunk()
            .await
            .map_err(|s| s.message().to_owned())?
            .ok_or("the peer sent nothing")?;
        let info = first
            .info
            .ok_or("the peer's first chunk has no shard info")?;
        Ok(Incoming {
            told: wire::manifest_of(&info)?,
            first: first.data,
            reader,
        })
    }
}

/// A shard a peer began sending ([`Peer::fetch`]).
pub struct Incoming {
    /// What the peer says the shard is.
    pub told: Manifest,
    first: Vec<Bytes>,
    reader: Reader<tonic::body::Body>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("told", &self.told)
            .finish_non_exhaustive()
    }
}

impl Incoming {
    /// Receives the rest into `dest` (a staging file at `path`), checked
    /// against `want` (size and xxh3): [`peers::receive`].
    pub async fn receive(
        mut self,
        want: &Manifest,
        dest: std::fs::File,
        path: PathBuf,
    ) -> Result<(), String> {
        peers::receive(&mut self.reader, self.first, want, dest, path).await
    }
}
