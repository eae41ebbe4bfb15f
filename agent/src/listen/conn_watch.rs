//! Closing connections that hold a place and do nothing with it.
//!
//! In: an accepted gRPC connection (Unix socket or `api.tcp`), with its
//! [`super::admission::Ticket`]. Out: the same connection, closed by the
//! agent when its client sends no HTTP/2 preface within
//! `api.preface_timeout`, or holds no request or stream (and sends
//! nothing) for `api.idle_timeout`; or, for `metrics.listen` (HTTP/1), when it sends
//! nothing for [`METRICS_IDLE`] or lives past [`METRICS_LIFETIME`]. Never:
//! close a connection that has a request or stream open (a rank's Control
//! stream is quiet for hours and must stay).
//!
//! How: [`Watched`] wraps the connection's I/O and ends its reads (an end
//! of stream, which hyper answers by closing) when a rule is broken; it
//! arms a timer in `poll_read`, which hyper polls while the connection is
//! idle. Open requests are counted by [`TrackLayer`]: the connection's
//! connect info carries its [`Activity`], and each request holds a
//! [`Busy`] guard until its response body is dropped (the stream ended, or
//! the client reset it). The same layer holds a uid's open requests over
//! all its connections to `api.max_requests_per_uid` ([`RequestLimiter`]).

use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The HTTP/2 client connection preface's length.
const PREFACE_LEN: u64 = 24;
/// A metrics connection that sends nothing for this long is closed.
pub const METRICS_IDLE: Duration = Duration::from_secs(5);
/// A metrics connection is closed after this long whatever it does (a
/// scrape takes milliseconds; Prometheus dials again).
pub const METRICS_LIFETIME: Duration = Duration::from_secs(30);

/// A connection's open requests and streams, and since when it has had
/// none.
#[derive(Debug)]
pub struct Activity {
    open: AtomicUsize,
    idle_since: Mutex<Instant>,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
        })
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.open.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// When the connection became idle, or None while a request is open.
    fn idle_since(&self) -> Option<Instant> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(
            *self
                .idle_since
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// One open request or stream of a connection.
#[derive(Debug)]
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        *self
            .0
            .idle_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection's connect info with its [`Activity`]: what tonic copies
/// into each request's extensions, where [`TrackLayer`] finds it.
#[derive(Debug, Clone)]
pub struct Tracked<T> {
    /// The connection's own connect info (a `LocalPeer`, a `PeerInfo`).
    pub info: T,
    activity: Arc<Activity>,
    quota: Option<Arc<RequestQuota>>,
}

/// Requests (unary calls in flight and open streams of every kind) by uid,
/// against `api.max_requests_per_uid`: the bound on what one uid holds
/// open over all its connections, whatever the call (a request whose
/// message never comes holds its stream as long as the client likes).
#[derive(Debug)]
pub struct RequestLimiter {
    max: usize,
    open: Mutex<std::collections::HashMap<u32, usize>>,
}

impl RequestLimiter {
    /// At most `max` requests open per uid.
    pub fn new(max: u32) -> Arc<Self> {
        Arc::new(Self {
            max: usize::try_from(max).unwrap_or(usize::MAX),
            open: Mutex::new(std::collections::HashMap::new()),
        })
    }

    fn begin(self: &Arc<Self>, uid: u32, exempt: bool) -> Result<RequestPlace, usize> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let n = open.entry(uid).or_default();
        if !exempt && *n >= self.max {
            return Err(*n);
        }
        *n += 1;
        Ok(RequestPlace {
            limiter: self.clone(),
            uid,
        })
    }
}

/// One open request's place under its uid's [`RequestLimiter`].
#[derive(Debug)]
pub struct RequestPlace {
    limiter: Arc<RequestLimiter>,
    uid: u32,
}

impl Drop for RequestPlace {
    fn drop(&mut self) {
        let mut open = self
            .limiter
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.uid);
            }
        }
    }
}

/// Whose requests a connection's are, for the [`RequestLimiter`].
#[derive(Debug)]
pub struct RequestQuota {
    /// The limiter shared by the listener's connections.
    pub limiter: Arc<RequestLimiter>,
    /// The connection's uid.
    pub uid: u32,
    /// An admin, not held to the cap.
    pub exempt: bool,
}

/// The rules a [`Watched`] connection is held to.
#[derive(Debug, Clone, Copy)]
pub enum Rules {
    /// gRPC over HTTP/2: the preface within the first duration; closed
    /// after the second with no request or stream open.
    Grpc {
        /// `api.preface_timeout`.
        preface: Duration,
        /// `api.idle_timeout`.
        idle: Duration,
    },
    /// Plain HTTP/1 (metrics): closed after [`METRICS_IDLE`] without a byte
    /// from the client, or [`METRICS_LIFETIME`] after it was accepted.
    Http1,
}

/// An accepted connection held to [`Rules`], with the place it holds
/// under the quotas (`T`, dropped with it).
pub struct Watched<IO, T> {
    io: IO,
    rules: Rules,
    activity: Arc<Activity>,
    read: u64,
    accepted: Instant,
    last_read: Instant,
    timer: Pin<Box<Sleep>>,
    closed: Option<&'static str>,
    quota: Option<Arc<RequestQuota>>,
    _ticket: T,
}

impl<IO, T> std::fmt::Debug for Watched<IO, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("rules", &self.rules)
            .field("read", &self.read)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl<IO, T> Watched<IO, T> {
    /// Wraps a freshly accepted connection.
    pub fn new(io: IO, rules: Rules, ticket: T) -> Self {
        let now = Instant::now();
        Self {
            io,
            rules,
            activity: Activity::new(),
            read: 0,
            accepted: now,
            last_read: now,
            timer: Box::pin(tokio::time::sleep_until(now)),
            closed: None,
            quota: None,
            _ticket: ticket,
        }
    }

    /// Holds the connection's requests to `quota`'s per-uid cap.
    #[must_use]
    pub fn with_quota(mut self, quota: RequestQuota) -> Self {
        self.quota = Some(Arc::new(quota));
        self
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// Which rule the connection broke now, or when to look again.
    fn verdict(&self, now: Instant) -> Result<Instant, &'static str> {
        match self.rules {
            Rules::Grpc { preface, idle } => {
                if self.read < PREFACE_LEN {
                    let by = self.accepted + preface;
                    return if now >= by {
                        Err("no HTTP/2 preface")
                    } else {
                        Ok(by)
                    };
                }
                match self.activity.idle_since() {
                    None => Ok(now + idle),
                    Some(since) => {
                        let by = since.max(self.last_read) + idle;
                        if now >= by {
                            Err("idle, no request or stream open")
                        } else {
                            Ok(by)
                        }
                    }
                }
            }
            Rules::Http1 => {
                let by = (self.last_read + METRICS_IDLE).min(self.accepted + METRICS_LIFETIME);
                if now >= by {
                    Err("idle or past its lifetime")
                } else {
                    Ok(by)
                }
            }
        }
    }
}

impl<IO: tonic::transport::server::Connected, T> tonic::transport::server::Connected
    for Watched<IO, T>
{
    type ConnectInfo = Tracked<IO::ConnectInfo>;

    fn connect_info(&self) -> Self::ConnectInfo {
        Tracked {
            info: self.io.connect_info(),
            activity: self.activity.clone(),
            quota: self.quota.clone(),
        }
    }
}

impl<IO: AsyncRead + Unpin, T: Unpin> AsyncRead for Watched<IO, T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.closed.is_some() {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                let n = buf.filled().len().saturating_sub(before);
                if n > 0 {
                    this.read = this.read.saturating_add(n as u64);
                    this.last_read = Instant::now();
                }
                return Poll::Ready(r);
            }
            Poll::Pending => {}
        }
        // Nothing to read: is a rule broken, and if not, when to look again.
        loop {
            match this.verdict(Instant::now()) {
                Err(why) => {
                    this.closed = Some(why);
                    metrics::counter!("warden_api_connections_closed_total", "reason" => why)
                        .increment(1);
                    tracing::debug!(why, "connection closed by the agent");
                    // An end of stream: hyper closes the connection.
                    return Poll::Ready(Ok(()));
                }
                Ok(at) => {
                    if this.timer.deadline() != at {
                        this.timer.as_mut().reset(at);
                    }
                    if this.timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                }
            }
        }
    }
}

delegate_async_write!(impl[IO: tokio::io::AsyncWrite + Unpin, T: Unpin] for Watched<IO, T>, io);

/// A tower layer for a gRPC server whose connections are [`Watched`]:
/// puts each connection's own connect info (`T`) in the request's
/// extensions, where the handlers look for it, and counts the request as
/// open until its response body is dropped.
#[derive(Debug)]
pub struct TrackLayer<T>(PhantomData<fn() -> T>);

impl<T> TrackLayer<T> {
    /// The layer.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T> Default for TrackLayer<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for TrackLayer<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<S, T> tower::Layer<S> for TrackLayer<T> {
    type Service = Track<S, T>;

    fn layer(&self, inner: S) -> Self::Service {
        Track {
            inner,
            _info: PhantomData,
        }
    }
}

/// The service of [`TrackLayer`].
#[derive(Debug)]
pub struct Track<S, T> {
    inner: S,
    _info: PhantomData<fn() -> T>,
}

impl<S: Clone, T> Clone for Track<S, T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            _info: PhantomData,
        }
    }
}

type BoxFuture<O> = Pin<Box<dyn Future<Output = O> + Send>>;

impl<S, T, B> tower::Service<http::Request<B>> for Track<S, T>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    T: Clone + Send + Sync + 'static,
{
    type Response = http::Response<BusyBody<tonic::body::Body>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let tracked = req.extensions().get::<Tracked<T>>().cloned();
        let mut place = None;
        if let Some(q) = tracked.as_ref().and_then(|t| t.quota.as_ref()) {
            match q.limiter.begin(q.uid, q.exempt) {
                Ok(p) => place = Some(p),
                Err(open) => {
                    let why = format!(
                        "{} refused: uid {} already has {open} requests and streams open, the most one uid may (api.max_requests_per_uid = {})",
                        req.uri().path(),
                        q.uid,
                        q.limiter.max
                    );
                    metrics::counter!("warden_api_refused_total", "call" => "any").increment(1);
                    tracing::debug!("{why}");
                    let resp = tonic::Status::resource_exhausted(why).into_http();
                    return Box::pin(async move {
                        Ok(resp.map(|inner| BusyBody {
                            inner,
                            _busy: None,
                            _place: None,
                        }))
                    });
                }
            }
        }
        let busy = tracked.map(|t| {
            req.extensions_mut().insert(t.info);
            t.activity.begin()
        });
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|inner| BusyBody {
                inner,
                _busy: busy,
                _place: place,
            }))
        })
    }
}

/// A response body that keeps its request counted as open until dropped.
#[derive(Debug)]
pub struct BusyBody<B> {
    inner: B,
    _busy: Option<Busy>,
    _place: Option<RequestPlace>,
}

impl<B: http_body::Body + Unpin> http_body::Body for BusyBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn grpc() -> Rules {
        Rules::Grpc {
            preface: Duration::from_secs(5),
            idle: Duration::from_secs(60),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn no_preface_closes_after_the_preface_timeout() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut w = Watched::new(a, grpc(), ());
        b.write_all(b"PRI * HTTP/2.0").await.unwrap();
        let start = Instant::now();
        let mut buf = [0u8; 64];
        assert_eq!(w.read(&mut buf).await.unwrap(), 14);
        // 14 of 24 bytes: the rest never comes, and the read ends at 5 s.
        assert_eq!(w.read(&mut buf).await.unwrap(), 0);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(w.closed, Some("no HTTP/2 preface"));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_closes_only_with_nothing_open() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut w = Watched::new(a, grpc(), ());
        b.write_all(&[0u8; 24]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(w.read(&mut buf).await.unwrap(), 24);
        // A stream open: the connection outlives the idle timeout.
        let busy = w.activity.begin();
        let read = tokio::time::timeout(Duration::from_secs(600), w.read(&mut buf)).await;
        assert!(read.is_err(), "still open while a stream is");
        // The stream ends: closed idle_timeout later.
        drop(busy);
        let start = Instant::now();
        assert_eq!(w.read(&mut buf).await.unwrap(), 0);
        assert_eq!(start.elapsed(), Duration::from_secs(60));
        assert_eq!(w.closed, Some("idle, no request or stream open"));
    }

    #[test]
    fn requests_per_uid_are_capped_and_admins_exempt() {
        let l = RequestLimiter::new(2);
        let a = l.begin(1000, false).unwrap();
        let _b = l.begin(1000, false).unwrap();
        assert_eq!(l.begin(1000, false).unwrap_err(), 2);
        let _other = l.begin(1001, false).unwrap();
        let _admin: Vec<_> = (0..5).map(|_| l.begin(0, true).unwrap()).collect();
        drop(a);
        let _c = l.begin(1000, false).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn metrics_connections_close_when_silent_or_old() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut w = Watched::new(a, Rules::Http1, ());
        let start = Instant::now();
        let mut buf = [0u8; 64];
        // A byte every 4 s keeps it from the idle rule, not the lifetime.
        loop {
            tokio::select! {
                n = w.read(&mut buf) => {
                    if n.unwrap() == 0 {
                        break;
                    }
                }
                () = tokio::time::sleep(Duration::from_secs(4)) => {
                    b.write_all(b"x").await.unwrap();
                }
            }
        }
        assert!(start.elapsed() <= METRICS_LIFETIME + Duration::from_secs(1));
        assert!(start.elapsed() >= METRICS_LIFETIME - Duration::from_secs(4));
    }
}
