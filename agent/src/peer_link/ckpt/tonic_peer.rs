//! The checkpoint flow's [`PeerLink`] over `warden.v1.Peer`: tonic's client
//! for listings and the collector's asks, the hand-framed chunks of
//! [`super::wire`] for the shards' bytes.

use std::any::Any;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;

use super::collect_wire as w;
use super::wire::{self, ChunkSource};
use crate::ckpt::collect::{Ask, AskScope, Collected};
use crate::ckpt::layout::ShardKey;
use crate::ckpt::link::{Incoming, LinkError, PeerDial, PeerHoldings, PeerLink};
use crate::ckpt::manifest::Manifest;
use crate::ckpt::receive::ShardStream;
use crate::peer_link::channel::{self, MAX_MESSAGE};
use crate::tls::PeerTls;

/// One peer agent over tonic: a lazily connected channel, and the client
/// on it.
#[derive(Debug, Clone)]
pub struct TonicPeer {
    /// The client for the calls other than the shard transfers; the
    /// straggler exchange calls through it too (`exchange::routes`).
    pub client: PeerClient<Channel>,
    /// The channel, for the shard transfers ([`super::wire`]).
    pub channel: Channel,
}

impl TonicPeer {
    /// The peer behind `channel`.
    pub fn on(channel: Channel) -> Self {
        Self {
            client: channel::client(channel.clone()),
            channel,
        }
    }

    async fn list_raw(
        &self,
        job: &str,
        limit: Duration,
    ) -> Result<pb::ListShardsResponse, LinkError> {
        let mut c = self.client.clone();
        match tokio::time::timeout(limit, c.list_shards(wire::list_request(job))).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(LinkError::Refused(s.message().to_owned())),
            Err(_) => Err(LinkError::Silent(limit)),
        }
    }
}

/// The client of a job's peer `link`, when it is one of ours: the
/// straggler exchange shares the connection the checkpoint flow made.
pub fn client_of(link: &dyn PeerLink) -> Option<PeerClient<Channel>> {
    link.as_any()
        .downcast_ref::<TonicPeer>()
        .map(|p| p.client.clone())
}

#[async_trait::async_trait]
impl PeerLink for TonicPeer {
    async fn list(&self, job: &str, limit: Duration) -> Result<PeerHoldings, LinkError> {
        let r = self.list_raw(job, limit).await?;
        Ok(PeerHoldings {
            shards: r.shards.iter().map(wire::manifest_of).collect(),
            host: r.host,
        })
    }

    async fn held(
        &self,
        job: &str,
        limit: Duration,
    ) -> Result<HashSet<(ShardKey, u64)>, LinkError> {
        Ok(wire::held_shards(&self.list_raw(job, limit).await?))
    }

    async fn collect(&self, ask: &Ask, limit: Duration) -> Result<Collected, LinkError> {
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

    async fn push(
        &self,
        m: &Manifest,
        file: std::fs::File,
        path: PathBuf,
        chunk_bytes: usize,
        bytes_per_sec: u64,
    ) -> Result<String, LinkError> {
        let stream = channel::chunk_stream(m.clone(), file, path, chunk_bytes, bytes_per_sec);
        wire::push(self.channel.clone(), stream, MAX_MESSAGE)
            .await
            .map(|r| r.host)
            .map_err(|s| LinkError::Refused(s.message().to_owned()))
    }

    async fn fetch(&self, key: &ShardKey) -> Result<Incoming, String> {
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
        Ok(Incoming::new(
            wire::manifest_of(&info)?,
            first.data,
            Box::new(reader),
        ))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The chunks after the first, from any framing the transport reads
/// (a fetched body, a pushed stream): their bytes, in order.
#[async_trait::async_trait]
impl<S: ChunkSource + Send> ShardStream for S {
    async fn next_data(&mut self) -> Result<Option<Vec<Bytes>>, String> {
        self.next_chunk()
            .await
            .map(|c| c.map(|c| c.data))
            .map_err(|s| s.message().to_owned())
    }
}

/// Dials peer agents over tonic through `tls` (mutual TLS unless
/// `api.insecure`).
#[derive(Debug, Clone)]
pub struct TonicDial {
    /// The agent's peer TLS.
    pub tls: PeerTls,
}

impl TonicDial {
    /// A dialer through `tls`, as the checkpoint flow takes it.
    pub fn shared(tls: PeerTls) -> Arc<dyn PeerDial> {
        Arc::new(Self { tls })
    }
}

impl PeerDial for TonicDial {
    fn dial(&self, addr: &str, name: &str, timeout: Duration) -> Result<Arc<dyn PeerLink>, String> {
        let connector = crate::tls::connect::PeerConnector::new(self.tls.clone(), name);
        Ok(Arc::new(TonicPeer::on(channel::channel(
            addr, timeout, connector,
        )?)))
    }
}
