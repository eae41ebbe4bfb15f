//! Calls to peer agents: list their shards, push a replica, fetch a copy.
//!
//! Shards travel as a gRPC stream of chunks over `warden.v1.Peer`, with
//! HTTP/2 windows large enough to keep a loopback or datacentre link busy
//! and a token bucket when `checkpoint.replication_bytes_per_sec` caps it.
//! The receiving side checks size and xxh3 before anything is committed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint};
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;
use xxhash_rust::xxh3::Xxh3;

use super::layout::ShardKey;
use super::manifest::{self, Manifest};

/// gRPC message ceiling for shard chunks (chunk_bytes is at most 16 MiB).
pub const MAX_MESSAGE: usize = 32 << 20;
/// HTTP/2 windows: a few chunks in flight per stream.
pub const STREAM_WINDOW: u32 = 8 << 20;
/// HTTP/2 connection window.
pub const CONN_WINDOW: u32 = 32 << 20;

/// `host:port` (or `ip:port`).
pub fn valid_addr(p: &str) -> bool {
    if p.parse::<std::net::SocketAddr>().is_ok() {
        return true;
    }
    match p.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        }
        None => false,
    }
}

/// A lazily connected client for one peer.
pub fn client(addr: &str, timeout: Duration) -> Result<PeerClient<Channel>, String> {
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("peer address {addr:?}: {e}"))?
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW);
    Ok(PeerClient::new(ep.connect_lazy())
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

/// A shard as the wire describes it.
pub fn info(m: &Manifest) -> pb::ShardInfo {
    pb::ShardInfo {
        job_id: m.job_id.clone(),
        step: m.step,
        rank: m.rank,
        world_size: m.world_size,
        size_bytes: m.size_bytes,
        xxh3: m.hash().unwrap_or(0),
        origin: m.origin.clone(),
    }
}

/// A manifest from what a peer said; refused when it makes no sense.
pub fn manifest_of(i: &pb::ShardInfo) -> Result<Manifest, String> {
    super::layout::check_job_id(&i.job_id).map_err(|e| e.to_string())?;
    if i.world_size == 0 || i.rank >= i.world_size {
        return Err(format!(
            "shard info: rank {} is not below world_size {}",
            i.rank, i.world_size
        ));
    }
    Ok(Manifest {
        job_id: i.job_id.clone(),
        step: i.step,
        rank: i.rank,
        world_size: i.world_size,
        size_bytes: i.size_bytes,
        xxh3: manifest::hex(i.xxh3),
        origin: i.origin.clone(),
        committed_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    })
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

/// Streams the chunks of a local shard file: `info` on the first.
pub fn chunk_stream(
    m: Manifest,
    path: PathBuf,
    chunk: usize,
    rate: u64,
) -> tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, tonic::Status>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let mut f = match tokio::fs::File::open(&path).await {
            Ok(f) => f,
            Err(e) => {
                let _ = tx
                    .send(Err(tonic::Status::not_found(format!(
                        "{}: {e}",
                        path.display()
                    ))))
                    .await;
                return;
            }
        };
        let mut pacer = Pacer::new(rate);
        let mut first = Some(info(&m));
        let mut left = m.size_bytes;
        loop {
            let n = usize::try_from(left.min(chunk as u64)).unwrap_or(chunk);
            let mut buf = bytes::BytesMut::zeroed(n);
            if n > 0
                && let Err(e) = f.read_exact(&mut buf).await
            {
                let _ = tx
                    .send(Err(tonic::Status::data_loss(format!(
                        "{}: {e}",
                        path.display()
                    ))))
                    .await;
                return;
            }
            left -= n as u64;
            pacer.take(n as u64).await;
            let msg = pb::ShardChunk {
                info: first.take(),
                data: buf.freeze(),
            };
            if tx.send(Ok(msg)).await.is_err() || left == 0 {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Receives a shard's chunks into `dest`, checking them against `want`
/// (size and xxh3). On any mismatch the file is removed and the error
/// names what differed.
pub async fn receive(
    stream: &mut tonic::Streaming<pb::ShardChunk>,
    first_data: bytes::Bytes,
    want: &Manifest,
    dest: &Path,
) -> Result<(), String> {
    let result = receive_inner(stream, first_data, want, dest).await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(dest).await;
    }
    result
}

async fn receive_inner(
    stream: &mut tonic::Streaming<pb::ShardChunk>,
    first_data: bytes::Bytes,
    want: &Manifest,
    dest: &Path,
) -> Result<(), String> {
    let mut f = tokio::fs::File::create(dest)
        .await
        .map_err(|e| format!("{}: {e}", dest.display()))?;
    let mut h = Xxh3::new();
    let mut size = 0u64;
    let mut data = first_data;
    loop {
        size += data.len() as u64;
        if size > want.size_bytes {
            return Err(format!(
                "corrupt: {}: more than the {} bytes announced",
                want.key(),
                want.size_bytes
            ));
        }
        h.update(&data);
        f.write_all(&data)
            .await
            .map_err(|e| format!("{}: {e}", dest.display()))?;
        match stream.message().await {
            Ok(Some(c)) => data = c.data,
            Ok(None) => break,
            Err(s) => return Err(format!("{}: stream broke: {}", want.key(), s.message())),
        }
    }
    f.flush()
        .await
        .map_err(|e| format!("{}: {e}", dest.display()))?;
    if size != want.size_bytes {
        return Err(format!(
            "corrupt: {}: {size} bytes arrived, {} were announced",
            want.key(),
            want.size_bytes
        ));
    }
    let got = h.digest();
    if manifest::hex(got) != want.xxh3 {
        return Err(format!(
            "corrupt: {}: arrived with xxh3 {}, expected {}",
            want.key(),
            manifest::hex(got),
            want.xxh3
        ));
    }
    Ok(())
}

/// The key a fetch asks for.
pub fn fetch_request(k: &ShardKey) -> pb::FetchShardRequest {
    pb::FetchShardRequest {
        job_id: k.job_id.clone(),
        step: k.step,
        rank: k.rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert!(valid_addr("127.0.0.2:7411"));
        assert!(valid_addr("node-3.rack:7411"));
        assert!(!valid_addr("node"));
        assert!(!valid_addr("node:0"));
        assert!(!valid_addr("http://x:1"));
    }

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
