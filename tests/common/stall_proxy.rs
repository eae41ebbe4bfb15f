//! A TCP proxy in front of a real etcd that holds etcd's answers on one
//! request, as a saturated etcd does in a mass start: the request goes
//! through and is carried out, its answer comes late.
//!
//! It reads the HTTP/2 frames etcd sends on the proxy's first connection
//! (the launcher's main client; gRPC runs one stream per request, and a
//! client numbers its streams 1, 3, 5, ... in the order it asks) and, at
//! the first frame of a stream numbered `from_stream` or higher, holds
//! everything etcd sends on that connection for `hold`; every request
//! the client sends meanwhile still reaches etcd. Later connections pass
//! untouched.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The proxy; dropped, it stops accepting (open connections end with
/// their peers).
pub struct StallProxy {
    addr: SocketAddr,
    held: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl StallProxy {
    /// Listens on `listen` (a loopback address of its own, port 0) and
    /// forwards to `upstream` (`host:port`).
    pub async fn start(listen: &str, upstream: &str, from_stream: u32, hold: Duration) -> Self {
        let listener = TcpListener::bind((listen, 0))
            .await
            .unwrap_or_else(|e| panic!("bind the stall proxy on {listen}: {e}"));
        let addr = listener.local_addr().expect("the proxy's address");
        let held = Arc::new(AtomicBool::new(false));
        let upstream = upstream.to_owned();
        let flag = Arc::clone(&held);
        let task = tokio::spawn(async move {
            let mut first = true;
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let stall = first.then(|| (from_stream, hold, Arc::clone(&flag)));
                first = false;
                tokio::spawn(pipe(client, server, stall));
            }
        });
        Self { addr, held, task }
    }

    /// The endpoint to give the client.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Whether the hold took place: etcd answered a stream at or past
    /// `from_stream` on the first connection.
    pub fn held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    stall: Option<(u32, Duration, Arc<AtomicBool>)>,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut cr, &mut sw).await;
        let _ = sw.shutdown().await;
    });
    let down = async move {
        let mut frames = Frames::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut chunk = &buf[..n];
            if let Some((from, hold, flag)) = &stall
                && !flag.load(Ordering::Acquire)
                && let Some(at) = frames.first_of_stream_at_least(chunk, *from)
            {
                // What came before the held stream's first frame goes now.
                if cw.write_all(&chunk[..at]).await.is_err() {
                    break;
                }
                flag.store(true, Ordering::Release);
                tokio::time::sleep(*hold).await;
                chunk = &chunk[at..];
            }
            if cw.write_all(chunk).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
    };
    down.await;
    up.abort();
}

/// Where the frame boundaries of a server's HTTP/2 byte stream fall (a
/// server sends no preface string; each frame is a 9-byte header, its
/// 24-bit length first and its 31-bit stream id last, then the payload).
#[derive(Default)]
struct Frames {
    /// Bytes of the current frame's payload still to come.
    skip: usize,
    /// A frame header split across reads.
    header: Vec<u8>,
}

impl Frames {
    /// Walks `chunk`; returns the offset of the first frame header whose
    /// stream id is `from` or more (when it starts in this chunk).
    fn first_of_stream_at_least(&mut self, chunk: &[u8], from: u32) -> Option<usize> {
        let mut at = 0;
        while at < chunk.len() {
            if self.skip > 0 {
                let take = self.skip.min(chunk.len() - at);
                self.skip -= take;
                at += take;
                continue;
            }
            let start = at;
            let need = 9 - self.header.len();
            let take = need.min(chunk.len() - at);
            self.header.extend_from_slice(&chunk[at..at + take]);
            at += take;
            if self.header.len() < 9 {
                return None;
            }
            let h = std::mem::take(&mut self.header);
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            self.skip = len;
            // A header split across reads began in a chunk already sent:
            // the hold waits for the next frame of such a stream.
            if stream >= from && take == 9 {
                return Some(start);
            }
        }
        None
    }
}
