//! The connection to a peer agent, and a local shard read out to it.
//!
//! Shards travel as a gRPC stream of chunks over `warden.v1.Peer`, with
//! HTTP/2 windows large enough to keep a loopback or datacentre link busy
//! and a token bucket when `checkpoint.replication_bytes_per_sec` caps it.
//! The receiving side checks size and xxh3 before anything is committed
//! (`ckpt::receive`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use std::io::Read;
use tonic::transport::{Channel, Endpoint};
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;

use crate::ckpt::manifest::Manifest;

/// gRPC message ceiling for shard chunks (chunk_bytes is at most 16 MiB).
pub const MAX_MESSAGE: usize = 32 << 20;
/// HTTP/2 windows: a few chunks in flight per stream.
pub const STREAM_WINDOW: u32 = 32 << 20;
/// HTTP/2 connection window.
pub const CONN_WINDOW: u32 = 64 << 20;

/// A lazily connected channel to one peer, dialed through `connector`
/// (mutual TLS unless `api.insecure`).
pub fn channel(
    addr: &str,
    timeout: Duration,
    connector: crate::tls::connect::PeerConnector,
) -> Result<Channel, String> {
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("peer address {addr:?}: {e}"))?
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_frame_size(FRAME);
    Ok(ep.connect_with_connector_lazy(connector))
}

/// A client for the peer behind `channel` (the calls other than the
/// shard transfers, which go through [`super::ckpt::wire`]).
pub fn client(channel: Channel) -> PeerClient<Channel> {
    PeerClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE)
}

/// Paces a sender to a byte rate (0: unpaced).
#[derive(Debug)]
pub struct Pacer {
    rate: u64,
    start: Instant,
    sent: u64,
}

impl Pacer {
    /// A pacer at `rate` bytes per second.
    pub fn new(rate: u64) -> Self {
        Self {
            rate,
            start: Instant::now(),
            sent: 0,
        }
    }

    /// Accounts `n` bytes and waits until sending them keeps to the rate.
    pub async fn take(&mut self, n: u64) {
        self.sent += n;
        if self.rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(self.sent as f64 / self.rate as f64);
        if let Some(wait) = due.checked_sub(self.start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// HTTP/2 frame size both ways: 1 MiB frames instead of the default 16
/// KiB cut the per-frame work of a multi-megabyte chunk.
pub const FRAME: u32 = 1 << 20;

/// Streams the chunks of a local shard file, opened by the tier (never
/// through a symlink): `info` on the first. The file
/// is read on a blocking thread (no zero-fill, no per-chunk task hop), a
/// few chunks ahead of the network.
pub fn chunk_stream(
    m: Manifest,
    file: std::fs::File,
    path: PathBuf,
    chunk: usize,
    rate: u64,
) -> tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, tonic::Status>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let pace = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let fail = |s: tonic::Status| {
            let _ = tx.blocking_send(Err(s));
        };
        let mut f = file;
        let mut pacer = Pacer::new(rate);
        let mut first = Some(super::ckpt::wire::info(&m));
        let mut left = m.size_bytes;
        let pool = std::sync::Arc::new(Pool::default());
        loop {
            let n = left.min(chunk as u64);
            let mut buf = pool.take(chunk);
            match std::io::Read::take(&mut f, n).read_to_end(&mut buf) {
                Ok(got) if got as u64 == n => {}
                Ok(got) => {
                    return fail(tonic::Status::data_loss(format!(
                        "{}: ended {} bytes early",
                        path.display(),
                        left - got as u64
                    )));
                }
                Err(e) => {
                    return fail(tonic::Status::data_loss(format!("{}: {e}", path.display())));
                }
            }
            left -= n;
            if rate > 0 {
                pace.block_on(pacer.take(n));
            }
            let msg = pb::ShardChunk {
                info: first.take(),
                data: bytes::Bytes::from_owner(Pooled {
                    buf,
                    pool: pool.clone(),
                }),
            };
            if tx.blocking_send(Ok(msg)).is_err() || left == 0 {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Read buffers of one transfer, handed back once HTTP/2 has sent them:
/// a fresh multi-megabyte buffer per chunk cost a page fault per 4 KiB
/// (and the allocator returned each to the kernel when it was freed).
#[derive(Debug, Default)]
struct Pool(std::sync::Mutex<Vec<Vec<u8>>>);

/// At most this many idle buffers are kept (a few chunks are in the
/// channel, the rest in the HTTP/2 window).
const POOL_MAX: usize = 16;

impl Pool {
    /// An empty buffer of at least `cap` bytes.
    fn take(&self, cap: usize) -> Vec<u8> {
        let mut idle = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match idle.pop() {
            Some(mut b) => {
                b.clear();
                b.reserve(cap);
                b
            }
            None => Vec::with_capacity(cap),
        }
    }
}

/// A chunk's buffer, back to its pool when the last `Bytes` of it goes.
#[derive(Debug)]
struct Pooled {
    buf: Vec<u8>,
    pool: std::sync::Arc<Pool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut idle = self.pool.0.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < POOL_MAX {
            idle.push(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_pacer_keeps_to_its_rate() {
        let mut p = Pacer::new(10_000_000);
        let t = Instant::now();
        p.take(1_000_000).await;
        assert!(
            t.elapsed() >= Duration::from_millis(95),
            "{:?}",
            t.elapsed()
        );
    }
}
