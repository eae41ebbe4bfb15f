//! Shard chunks on the wire without copying their bytes.
//!
//! PushShard and FetchShard move whole shards (gigabytes). Through tonic's
//! generic codec each chunk was copied twice more than a plain socket copy
//! does: encoded into tonic's send buffer, and gathered from the HTTP/2
//! frames into its receive buffer, each copy into a freshly allocated
//! multi-megabyte buffer (page faults included). The receiving agent paid
//! most of it, and it was the bottleneck.
//!
//! Here the same calls carry the same bytes (gRPC length-prefixed
//! messages, protobuf `ShardChunk`s: any gRPC peer reads and writes them),
//! framed by hand: a sender gives HTTP/2 a small head (the gRPC prefix, the
//! `info` field, the `data` tag and length) and then the chunk's own buffer;
//! a receiver keeps the buffers HTTP/2 received and hands them on as they
//! are. The other calls of `warden.v1.Peer` stay with tonic's code, and
//! their checkpoint messages are built and read here too ([`info`],
//! [`manifest_of`], [`list_request`], [`fetch_request`]): the transport's
//! one place where a `pb` type meets a [`Manifest`] or a [`ShardKey`].

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::{Body, Frame};
use prost::Message;
use tonic::Status;
use tonic::transport::Channel;
use tower::Service;
use warden_proto::v1 as pb;

use crate::ckpt::layout::ShardKey;
use crate::ckpt::manifest::{self, Manifest};

/// The PushShard method's path.
pub const PUSH_PATH: &str = "/warden.v1.Peer/PushShard";
/// The FetchShard method's path.
pub const FETCH_PATH: &str = "/warden.v1.Peer/FetchShard";

/// gRPC's message prefix: a compression flag and a 4-byte length.
const PREFIX: usize = 5;
/// `ShardChunk.info`: field 1, length-delimited.
const INFO_TAG: u8 = (1 << 3) | 2;
/// `ShardChunk.data`: field 2, length-delimited.
const DATA_TAG: u8 = (2 << 3) | 2;

fn prefix(buf: &mut BytesMut, len: usize) -> Result<(), Status> {
    let len = u32::try_from(len)
        .map_err(|_| Status::resource_exhausted(format!("a {len}-byte message is too long")))?;
    buf.put_u8(0);
    buf.put_u32(len);
    Ok(())
}

/// A small message, length-prefixed (a request or an answer).
pub fn message(m: &impl Message) -> Result<Bytes, Status> {
    let mut buf = BytesMut::with_capacity(PREFIX + m.encoded_len());
    prefix(&mut buf, m.encoded_len())?;
    m.encode(&mut buf)
        .map_err(|e| Status::internal(format!("encoding: {e}")))?;
    Ok(buf.freeze())
}

/// A chunk as two buffers for HTTP/2: its head (prefix, `info`, the
/// `data` field's tag and length) and its data, untouched.
pub fn chunk_frames(c: pb::ShardChunk) -> Result<(Bytes, Bytes), Status> {
    let info_len = c.info.as_ref().map(Message::encoded_len);
    let data_len = c.data.len();
    let mut head_len = 0;
    if let Some(n) = info_len {
        head_len += 1 + prost::encoding::encoded_len_varint(n as u64) + n;
    }
    if data_len > 0 {
        head_len += 1 + prost::encoding::encoded_len_varint(data_len as u64);
    }
    let mut head = BytesMut::with_capacity(PREFIX + head_len);
    prefix(&mut head, head_len + data_len)?;
    if let Some(info) = &c.info {
        head.put_u8(INFO_TAG);
        info.encode_length_delimited(&mut head)
            .map_err(|e| Status::internal(format!("encoding: {e}")))?;
    }
    if data_len > 0 {
        head.put_u8(DATA_TAG);
        prost::encoding::encode_varint(data_len as u64, &mut head);
    }
    Ok((head.freeze(), c.data))
}

/// How a [`ChunkBody`] ends: a server's answer ends with gRPC trailers
/// (the status), a client's request with the end of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A response: trailers with `grpc-status`, an error's status there too.
    Trailers,
    /// A request: end of stream; an error resets the stream.
    Request,
}

type Chunks = tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, Status>>;

/// An HTTP body of framed chunks, from a stream such as
/// [`crate::peer_link::channel::chunk_stream`].
#[derive(Debug)]
pub struct ChunkBody {
    chunks: Option<Chunks>,
    /// A chunk's data, sent after its head.
    data: Option<Bytes>,
    ending: Ending,
}

impl ChunkBody {
    /// The body of `chunks`, ended as `ending` says.
    pub fn new(chunks: Chunks, ending: Ending) -> Self {
        Self {
            chunks: Some(chunks),
            data: None,
            ending,
        }
    }

    fn end(&mut self, status: Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.chunks = None;
        match self.ending {
            Ending::Request if status.code() == tonic::Code::Ok => Poll::Ready(None),
            Ending::Request => Poll::Ready(Some(Err(status))),
            Ending::Trailers => {
                let mut trailers = http::HeaderMap::new();
                match status.add_header(&mut trailers) {
                    Ok(()) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                    Err(s) => Poll::Ready(Some(Err(s))),
                }
            }
        }
    }
}

impl Body for ChunkBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        let Some(chunks) = self.chunks.as_mut() else {
            return Poll::Ready(None);
        };
        match futures_core_poll(chunks, cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(c))) => match chunk_frames(c) {
                Ok((head, data)) => {
                    if !data.is_empty() {
                        self.data = Some(data);
                    }
                    Poll::Ready(Some(Ok(Frame::data(head))))
                }
                Err(s) => self.end(s),
            },
            Poll::Ready(Some(Err(s))) => self.end(s),
            Poll::Ready(None) => self.end(Status::ok("")),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_none() && self.data.is_none()
    }
}

fn futures_core_poll(
    chunks: &mut Chunks,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<pb::ShardChunk, Status>>> {
    tokio_stream::Stream::poll_next(Pin::new(chunks), cx)
}

/// A chunk as received: `info` when it carried one, its data as the
/// buffers it arrived in.
#[derive(Debug, Default)]
pub struct Chunk {
    /// The shard's description (the first chunk's).
    pub info: Option<pb::ShardInfo>,
    /// The data, in order.
    pub data: Vec<Bytes>,
}

impl Chunk {
    /// How many data bytes it carries.
    pub fn len(&self) -> usize {
        self.data.iter().map(Bytes::len).sum()
    }

    /// True when it carries no data.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Anything that yields a shard's chunks in order: a body read by
/// [`Reader`], or tonic's decoder (the generated PushShard handler).
pub trait ChunkSource {
    /// The next chunk; None at the end.
    fn next_chunk(
        &mut self,
    ) -> impl std::future::Future<Output = Result<Option<Chunk>, Status>> + Send;
}

impl ChunkSource for tonic::Streaming<pb::ShardChunk> {
    async fn next_chunk(&mut self) -> Result<Option<Chunk>, Status> {
        Ok(self.message().await?.map(|c| Chunk {
            info: c.info,
            data: vec![c.data],
        }))
    }
}

/// Reads length-prefixed gRPC messages from an HTTP body, keeping the
/// received buffers (a message's bytes are the frames' bytes, sliced).
#[derive(Debug)]
pub struct Reader<B> {
    body: B,
    /// Received, not yet consumed, in order.
    queued: VecDeque<Bytes>,
    /// Their total length.
    len: usize,
    /// The body ended (trailers, if any, are in `trailers`).
    ended: bool,
    trailers: Option<http::HeaderMap>,
    /// The longest message accepted.
    max: usize,
}

impl<B> Reader<B>
where
    B: Body<Data = Bytes> + Unpin + Send,
    B::Error: std::fmt::Display,
{
    /// A reader of `body`, refusing messages over `max` bytes.
    pub fn new(body: B, max: usize) -> Self {
        Self {
            body,
            queued: VecDeque::new(),
            len: 0,
            ended: false,
            trailers: None,
            max,
        }
    }

    /// Receives until `n` bytes are queued; false if the body ended first.
    async fn fill(&mut self, n: usize) -> Result<bool, Status> {
        while self.len < n {
            if self.ended {
                return Ok(false);
            }
            let frame = std::future::poll_fn(|cx| Pin::new(&mut self.body).poll_frame(cx)).await;
            match frame {
                None => self.ended = true,
                Some(Err(e)) => return Err(Status::aborted(format!("stream broke: {e}"))),
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => {
                        if !d.is_empty() {
                            self.len += d.len();
                            self.queued.push_back(d);
                        }
                    }
                    Err(f) => {
                        if let Ok(t) = f.into_trailers() {
                            self.trailers = Some(t);
                        }
                        self.ended = true;
                    }
                },
            }
        }
        Ok(true)
    }

    /// The next `n` queued bytes, as the buffers they are in.
    fn take(&mut self, n: usize) -> Vec<Bytes> {
        split_front(&mut self.queued, &mut self.len, n)
    }

    /// The next message's bytes; None when the body ended between
    /// messages. A status in the trailers that is not OK is the error.
    pub async fn message(&mut self) -> Result<Option<Segments>, Status> {
        if !self.fill(PREFIX).await? {
            if self.len > 0 {
                return Err(Status::aborted("stream ended inside a message"));
            }
            return match self.trailers.as_ref().and_then(Status::from_header_map) {
                Some(s) if s.code() != tonic::Code::Ok => Err(s),
                _ => Ok(None),
            };
        }
        let mut head = Segments::new(self.take(PREFIX));
        let compressed = head.get_u8();
        let len = head.get_u32() as usize;
        if compressed != 0 {
            return Err(Status::unimplemented(
                "compressed messages are not accepted for shard chunks",
            ));
        }
        if len > self.max {
            return Err(Status::resource_exhausted(format!(
                "a {len}-byte message; at most {} accepted",
                self.max
            )));
        }
        if !self.fill(len).await? {
            return Err(Status::aborted("stream ended inside a message"));
        }
        Ok(Some(Segments::new(self.take(len))))
    }

    /// The next message decoded as `M` (a small one: it is copied).
    pub async fn decode<M: Message + Default>(&mut self) -> Result<Option<M>, Status> {
        let Some(mut m) = self.message().await? else {
            return Ok(None);
        };
        let n = m.remaining();
        M::decode(m.copy_to_bytes(n))
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("decoding: {e}")))
    }

    /// Reads to the end; the trailers' status decides (a server's answer).
    pub async fn finish(&mut self) -> Result<(), Status> {
        while self.message().await?.is_some() {}
        match self.trailers.as_ref().and_then(Status::from_header_map) {
            Some(s) if s.code() == tonic::Code::Ok => Ok(()),
            Some(s) => Err(s),
            None => Err(Status::unknown("the answer ended without a gRPC status")),
        }
    }
}

impl<B> ChunkSource for Reader<B>
where
    B: Body<Data = Bytes> + Unpin + Send,
    B::Error: std::fmt::Display,
{
    async fn next_chunk(&mut self) -> Result<Option<Chunk>, Status> {
        match self.message().await? {
            None => Ok(None),
            Some(m) => parse_chunk(m).map(Some),
        }
    }
}

/// A message's bytes as the buffers they arrived in.
#[derive(Debug)]
pub struct Segments {
    parts: VecDeque<Bytes>,
    len: usize,
}

impl Segments {
    fn new(parts: Vec<Bytes>) -> Self {
        let len = parts.iter().map(Bytes::len).sum();
        Self {
            parts: parts.into(),
            len,
        }
    }

    /// The next `n` bytes without copying them.
    fn split(&mut self, n: usize) -> Vec<Bytes> {
        split_front(&mut self.parts, &mut self.len, n)
    }
}

impl Buf for Segments {
    fn remaining(&self) -> usize {
        self.len
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |b| b.as_ref())
    }

    fn advance(&mut self, mut cnt: usize) {
        while cnt > 0 {
            let Some(front) = self.parts.front_mut() else {
                return;
            };
            let k = cnt.min(front.len());
            front.advance(k);
            cnt -= k;
            self.len -= k;
            if front.is_empty() {
                self.parts.pop_front();
            }
        }
    }
}

fn bad(what: &str) -> Status {
    Status::invalid_argument(format!("ShardChunk: {what}"))
}

/// Parses a `ShardChunk` from its bytes, the data field left where it
/// arrived. Unknown fields are skipped, as protobuf wants.
pub fn parse_chunk(mut m: Segments) -> Result<Chunk, Status> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    let mut c = Chunk::default();
    while m.has_remaining() {
        let (tag, wire) = decode_key(&mut m).map_err(|e| bad(&e.to_string()))?;
        match (tag, wire) {
            (1 | 2, WireType::LengthDelimited) => {
                let n = decode_varint(&mut m).map_err(|e| bad(&e.to_string()))?;
                let n = usize::try_from(n)
                    .ok()
                    .filter(|n| *n <= m.remaining())
                    .ok_or_else(|| bad("a field runs past the message"))?;
                if tag == 1 {
                    let info = pb::ShardInfo::decode(m.copy_to_bytes(n))
                        .map_err(|e| bad(&format!("info: {e}")))?;
                    c.info = Some(info);
                } else {
                    // proto3: the last occurrence of a scalar field wins.
                    c.data = m.split(n);
                }
            }
            (1 | 2, _) => return Err(bad(&format!("field {tag} has wire type {wire:?}"))),
            _ => prost::encoding::skip_field(
                wire,
                tag,
                &mut m,
                prost::encoding::DecodeContext::default(),
            )
            .map_err(|e| bad(&e.to_string()))?,
        }
    }
    Ok(c)
}

/// A gRPC request to `path` on `channel` with `body`: the answer's body
/// once its headers say the call goes on.
async fn call(
    channel: Channel,
    path: &'static str,
    body: tonic::body::Body,
) -> Result<tonic::body::Body, Status> {
    let req = http::Request::builder()
        .method(http::Method::POST)
        .uri(path)
        .version(http::Version::HTTP_2)
        .header(http::header::TE, "trailers")
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .body(body)
        .map_err(|e| Status::internal(format!("request: {e}")))?;
    let mut channel = channel;
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .map_err(|e| Status::unavailable(format!("peer: {e}")))?;
    let resp = channel
        .call(req)
        .await
        .map_err(|e| Status::unavailable(format!("peer: {e}")))?;
    // A trailers-only answer: the status is in the headers.
    if let Some(s) = Status::from_header_map(resp.headers())
        && s.code() != tonic::Code::Ok
    {
        return Err(s);
    }
    if resp.status() != http::StatusCode::OK {
        return Err(Status::unknown(format!(
            "the peer answered HTTP {}",
            resp.status()
        )));
    }
    Ok(resp.into_body())
}

/// PushShard: `chunks` sent to the peer behind `channel`; its answer.
pub async fn push(
    channel: Channel,
    chunks: Chunks,
    max: usize,
) -> Result<pb::PushShardResponse, Status> {
    let body = tonic::body::Body::new(ChunkBody::new(chunks, Ending::Request));
    let mut r = Reader::new(call(channel, PUSH_PATH, body).await?, max);
    let answer = r.decode::<pb::PushShardResponse>().await?;
    r.finish().await?;
    answer.ok_or_else(|| Status::unknown("PushShard: the peer answered nothing"))
}

/// FetchShard: the shard's chunks as the peer behind `channel` sends them.
pub async fn fetch(
    channel: Channel,
    req: &pb::FetchShardRequest,
    max: usize,
) -> Result<Reader<tonic::body::Body>, Status> {
    let body = tonic::body::Body::new(http_body_full(message(req)?));
    Ok(Reader::new(call(channel, FETCH_PATH, body).await?, max))
}

/// A body of one buffer.
fn http_body_full(b: Bytes) -> OneFrame {
    OneFrame(Some(b))
}

#[derive(Debug)]
struct OneFrame(Option<Bytes>);

impl Body for OneFrame {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Poll::Ready(self.0.take().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }
}

/// A body of one buffer, then trailers (a server's answer).
#[derive(Debug)]
pub struct WireAnswer {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl WireAnswer {
    /// `m` answered with an OK status.
    pub fn ok(m: &impl Message) -> Result<Self, Status> {
        let mut trailers = http::HeaderMap::new();
        Status::ok("").add_header(&mut trailers)?;
        Ok(Self {
            data: Some(message(m)?),
            trailers: Some(trailers),
        })
    }
}

impl Body for WireAnswer {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

/// The headers of a gRPC answer whose body follows.
pub fn response(body: tonic::body::Body) -> http::Response<tonic::body::Body> {
    let mut r = http::Response::new(body);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    r
}

/// The first `n` bytes of `parts` (whose total is `len`), as the buffers
/// they are in: whole buffers moved, the last one split, nothing copied.
fn split_front(parts: &mut VecDeque<Bytes>, len: &mut usize, mut n: usize) -> Vec<Bytes> {
    let mut out = Vec::new();
    while n > 0 {
        let Some(front) = parts.front_mut() else {
            break;
        };
        if front.len() <= n {
            n -= front.len();
            *len -= front.len();
            if let Some(b) = parts.pop_front() {
                out.push(b);
            }
        } else {
            out.push(front.split_to(n));
            *len -= n;
            n = 0;
        }
    }
    out
}

// The Peer service's checkpoint messages other than the chunks' bytes:
// every `pb` type the checkpoint transport builds or reads is built or read
// here.

/// The shards a `ListShards` answer says the peer holds, with their hashes.
pub fn held_shards(r: &pb::ListShardsResponse) -> std::collections::HashSet<(ShardKey, u64)> {
    r.shards
        .iter()
        .map(|i| {
            (
                ShardKey {
                    job_id: i.job_id.clone(),
                    step: i.step,
                    rank: i.rank,
                },
                i.xxh3,
            )
        })
        .collect()
}

/// `ListShards`' request for `job`.
pub fn list_request(job: &str) -> pb::ListShardsRequest {
    pb::ListShardsRequest {
        job_id: job.to_owned(),
    }
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
    crate::ckpt::layout::check_job_id(&i.job_id).map_err(|e| e.to_string())?;
    if i.world_size == 0 || i.rank >= i.world_size {
        return Err(format!(
            "shard info: rank {} is not below world_size {}",
            i.rank, i.world_size
        ));
    }
    if i.world_size > warden_core::rank::MAX_WORLD_SIZE {
        return Err(format!(
            "shard info: world_size {} is above the most any agent takes ({})",
            i.world_size,
            warden_core::rank::MAX_WORLD_SIZE
        ));
    }
    crate::ckpt::layout::check_step(i.step).map_err(|e| format!("shard info: {e}"))?;
    if i.origin.len() > 255 || i.origin.chars().any(char::is_control) {
        return Err(format!(
            "shard info: origin {:?} is longer than 255 bytes or holds control characters",
            warden_slot::truncate_utf8(&i.origin, 64)
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

    /// A body that hands out `bytes` in pieces of `step`.
    struct Pieces(VecDeque<Bytes>);

    impl Body for Pieces {
        type Data = Bytes;
        type Error = Status;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }

    fn pieces(all: &[u8], step: usize) -> Pieces {
        Pieces(all.chunks(step).map(Bytes::copy_from_slice).collect())
    }

    fn info() -> pb::ShardInfo {
        pb::ShardInfo {
            job_id: "j".into(),
            step: 7,
            rank: 1,
            world_size: 2,
            size_bytes: 300,
            xxh3: 99,
            origin: "h".into(),
        }
    }

    #[tokio::test]
    async fn chunks_framed_by_hand_read_back_with_prost_and_with_the_reader() {
        let chunks = vec![
            pb::ShardChunk {
                info: Some(info()),
                data: Bytes::from(vec![1u8; 100]),
            },
            pb::ShardChunk {
                info: None,
                data: Bytes::from((0..200).map(|i| i as u8).collect::<Vec<_>>()),
            },
            pb::ShardChunk {
                info: Some(info()),
                data: Bytes::new(),
            },
        ];
        let mut wire = Vec::new();
        for c in &chunks {
            let (head, data) = chunk_frames(c.clone()).unwrap();
            wire.extend_from_slice(&head);
            wire.extend_from_slice(&data);
        }
        // What prost makes of each framed message is the chunk.
        let mut at = 0;
        for c in &chunks {
            let len = u32::from_be_bytes(wire[at + 1..at + 5].try_into().unwrap()) as usize;
            let got = pb::ShardChunk::decode(&wire[at + 5..at + 5 + len]).unwrap();
            assert_eq!(&got, c);
            at += 5 + len;
        }
        // And the reader gets them back whatever the frame boundaries.
        for step in [1, 3, 7, 64, 4096] {
            let mut r = Reader::new(pieces(&wire, step), 1 << 20);
            for c in &chunks {
                let got = r.next_chunk().await.unwrap().unwrap();
                assert_eq!(got.info, c.info);
                assert_eq!(got.data.concat(), c.data.to_vec(), "step {step}");
            }
            assert!(r.next_chunk().await.unwrap().is_none());
        }
    }

    #[tokio::test]
    async fn prost_encoded_chunks_parse_and_bad_input_is_refused() {
        let c = pb::ShardChunk {
            info: Some(info()),
            data: Bytes::from_static(b"hello"),
        };
        let mut framed = BytesMut::new();
        prefix(&mut framed, c.encoded_len()).unwrap();
        c.encode(&mut framed).unwrap();
        let mut r = Reader::new(pieces(&framed, 2), 1 << 20);
        let got = r.next_chunk().await.unwrap().unwrap();
        assert_eq!(got.info, c.info);
        assert_eq!(got.data.concat(), b"hello");

        // Over the limit.
        let mut r = Reader::new(pieces(&framed, 2), 4);
        assert_eq!(
            r.next_chunk().await.unwrap_err().code(),
            tonic::Code::ResourceExhausted
        );
        // Cut short.
        let mut r = Reader::new(pieces(&framed[..framed.len() - 1], 2), 1 << 20);
        assert_eq!(
            r.next_chunk().await.unwrap_err().code(),
            tonic::Code::Aborted
        );
        // A field running past the message.
        let mut bad_msg = BytesMut::new();
        prefix(&mut bad_msg, 2).unwrap();
        bad_msg.put_slice(&[DATA_TAG, 50]);
        let mut r = Reader::new(pieces(&bad_msg, 16), 1 << 20);
        assert_eq!(
            r.next_chunk().await.unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }
}
