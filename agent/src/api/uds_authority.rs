//! Makes stock gRPC clients' Unix-socket requests acceptable to h2.
//!
//! gRPC C-core (grpcio for Python, and the clients built on it) and
//! grpc-java send the socket path, percent-encoded or not, as the
//! `:authority` of a `unix:` channel (`%2Frun%2Fwarden%2Fwarden.sock`).
//! That is no valid URI authority, and h2 (0.4.20, `server.rs`,
//! `Peer::convert_poll_message`) parses `:authority` with
//! `http::uri::Authority` and answers a failure with RST_STREAM
//! PROTOCOL_ERROR ("malformed headers: malformed authority") before tonic
//! sees the request. h2 has no setting for it (hyperium/h2#487, "Do not
//! require authority for UNIX domain sockets", is still open).
//!
//! On a Unix socket the authority names nothing the agent uses, so this
//! filter sits between the socket and h2 on the client-to-server side of
//! each Unix connection: it passes every frame through unchanged except
//! header blocks (HEADERS plus its CONTINUATION frames), which it decodes
//! with HPACK, replaces an `:authority` that h2 would refuse by
//! `localhost`, and encodes again. An authority h2 accepts (grpcurl's and
//! grpc-go's `localhost`) is kept as sent.
//!
//! HPACK state stays consistent in both directions: the decoder here keeps
//! the client's dynamic table (the client encodes against it), and the
//! re-encoded blocks use only literals without indexing, so h2's decoder
//! table is never written and never disagrees with anything. The
//! server-to-client side (h2's encoder, the client's decoder) is not
//! touched at all. Padding is dropped (it carries nothing), PRIORITY
//! fields and END_STREAM are kept, and a block larger than one 16 KiB
//! frame (the least SETTINGS_MAX_FRAME_SIZE a peer may set) is split into
//! CONTINUATION frames.
//!
//! Bad input (a header block over [`MAX_BLOCK`], one that decodes to more
//! than [`MAX_DECODED`], HPACK that does not decode, frames out of order)
//! ends that connection with an error naming what was wrong, as h2 itself
//! would (a connection error); nothing else is affected.

use std::borrow::Cow;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, ReadBuf};

/// The HTTP/2 connection preface a client sends before any frame.
const PREFACE_LEN: usize = 24;
/// Frame header: length (24 bits), type, flags, stream id (32 bits).
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// The largest frame payload written here: the least
/// SETTINGS_MAX_FRAME_SIZE a peer may announce, so always accepted.
const OUT_FRAME_MAX: usize = 16_384;
/// The HPACK dynamic table size h2 announces for its decoder (its default,
/// SETTINGS_HEADER_TABLE_SIZE 4096, which tonic does not change): a client
/// may not make its table larger, and neither may the mirror of it here.
const CLIENT_TABLE_MAX: usize = 4_096;
/// The largest header block (all of its fragments) taken from a client. A
/// gRPC request's headers are a few hundred bytes; clients limit metadata
/// to 8 KiB by default.
pub const MAX_BLOCK: usize = 256 * 1024;
/// The most bytes of names and values one header block may decode to:
/// indexed fields make HPACK expand, so the encoded bound alone is not
/// enough.
pub const MAX_DECODED: usize = 1024 * 1024;
/// What replaces an `:authority` that h2 would refuse.
const LOCAL_AUTHORITY: &[u8] = b"localhost";

/// Why a connection was ended by the filter.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// A HEADERS or CONTINUATION frame larger than [`MAX_BLOCK`].
    #[error("header block of {0} bytes from the client is over the {MAX_BLOCK}-byte limit")]
    BlockTooLarge(usize),
    /// The block decodes to more than [`MAX_DECODED`] bytes.
    #[error("header block decodes to more than {MAX_DECODED} bytes of names and values")]
    DecodedTooLarge,
    /// HPACK that does not decode (a compression error in HTTP/2 terms).
    #[error("header block does not decode as HPACK: {0}")]
    Hpack(String),
    /// Frames in an order HTTP/2 forbids, or a frame too short for its flags.
    #[error("HTTP/2 framing error from the client: {0}")]
    Framing(&'static str),
}

impl From<FilterError> for io::Error {
    fn from(e: FilterError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// A header block being assembled from HEADERS and CONTINUATION frames.
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// Where the client-to-server byte stream is.
enum Stage {
    /// This many bytes of the connection preface are still to pass.
    Preface(usize),
    /// At a frame header.
    Frame,
    /// This many payload bytes of a frame that is not a header block are
    /// still to pass unchanged.
    Payload(usize),
}

/// The client-to-server rewriting, apart from any I/O so it can be tested
/// on bytes.
pub struct Rewriter {
    stage: Stage,
    decoder: loona_hpack::Decoder<'static>,
    block: Option<Block>,
    rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    /// A rewriter at the start of a connection (the preface comes first).
    pub fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(CLIENT_TABLE_MAX);
        Self {
            stage: Stage::Preface(PREFACE_LEN),
            decoder,
            block: None,
            rewritten: 0,
        }
    }

    /// How many requests' `:authority` were replaced so far.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Moves what can be handled of `input` to `out`: whole non-header
    /// frames' bytes as they come, header blocks once complete. Bytes of an
    /// incomplete frame header or header frame stay in `input`.
    pub fn process(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Result<(), FilterError> {
        loop {
            match self.stage {
                Stage::Preface(left) | Stage::Payload(left) => {
                    let n = left.min(input.len());
                    out.extend_from_slice(&input.split_to(n));
                    if n < left {
                        self.stage = match self.stage {
                            Stage::Preface(_) => Stage::Preface(left - n),
                            _ => Stage::Payload(left - n),
                        };
                        return Ok(());
                    }
                    self.stage = Stage::Frame;
                }
                Stage::Frame => {
                    if input.len() < FRAME_HEADER_LEN {
                        return Ok(());
                    }
                    let len = usize::from(input[0]) << 16
                        | usize::from(input[1]) << 8
                        | usize::from(input[2]);
                    let kind = input[3];
                    let flags = input[4];
                    let stream =
                        u32::from_be_bytes([input[5], input[6], input[7], input[8]]) & 0x7fff_ffff;
                    let header_frame = kind == TYPE_HEADERS || kind == TYPE_CONTINUATION;
                    if !header_frame {
                        if self.block.is_some() {
                            return Err(FilterError::Framing(
                                "a header block was interrupted by another frame",
                            ));
                        }
                        out.extend_from_slice(&input.split_to(FRAME_HEADER_LEN));
                        self.stage = Stage::Payload(len);
                        continue;
                    }
                    let so_far = self.block.as_ref().map_or(0, |b| b.fragment.len());
                    if len.saturating_add(so_far) > MAX_BLOCK {
                        return Err(FilterError::BlockTooLarge(len.saturating_add(so_far)));
                    }
                    if input.len() < FRAME_HEADER_LEN + len {
                        input.reserve(FRAME_HEADER_LEN + len - input.len());
                        return Ok(());
                    }
                    input.advance(FRAME_HEADER_LEN);
                    let payload = input.split_to(len);
                    if kind == TYPE_HEADERS {
                        self.headers(stream, flags, &payload)?;
                    } else {
                        self.continuation(stream, &payload)?;
                    }
                    if flags & FLAG_END_HEADERS != 0 {
                        self.finish(out)?;
                    }
                }
            }
        }
    }

    fn headers(&mut self, stream: u32, flags: u8, payload: &[u8]) -> Result<(), FilterError> {
        if self.block.is_some() {
            return Err(FilterError::Framing(
                "HEADERS while a header block was still open",
            ));
        }
        let mut body = payload;
        let mut pad = 0usize;
        if flags & FLAG_PADDED != 0 {
            let (&p, rest) = body
                .split_first()
                .ok_or(FilterError::Framing("PADDED HEADERS without a pad length"))?;
            pad = usize::from(p);
            body = rest;
        }
        let mut priority = None;
        if flags & FLAG_PRIORITY != 0 {
            let (p, rest) = body.split_first_chunk::<5>().ok_or(FilterError::Framing(
                "PRIORITY HEADERS too short for its fields",
            ))?;
            priority = Some(*p);
            body = rest;
        }
        let body = body
            .get(
                ..body.len().checked_sub(pad).ok_or(FilterError::Framing(
                    "HEADERS padding longer than the frame",
                ))?,
            )
            .unwrap_or_default();
        self.block = Some(Block {
            stream,
            end_stream: flags & FLAG_END_STREAM != 0,
            priority,
            fragment: body.to_vec(),
        });
        Ok(())
    }

    fn continuation(&mut self, stream: u32, payload: &[u8]) -> Result<(), FilterError> {
        match &mut self.block {
            Some(b) if b.stream == stream => {
                b.fragment.extend_from_slice(payload);
                Ok(())
            }
            Some(_) => Err(FilterError::Framing(
                "CONTINUATION on another stream than its HEADERS",
            )),
            None => Err(FilterError::Framing("CONTINUATION without HEADERS")),
        }
    }

    /// Decodes the complete block, fixes `:authority`, writes it out again.
    fn finish(&mut self, out: &mut BytesMut) -> Result<(), FilterError> {
        let Some(block) = self.block.take() else {
            return Err(FilterError::Framing("END_HEADERS without a header block"));
        };
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut decoded = 0usize;
        let mut over = false;
        self.decoder
            .decode_with_cb(&block.fragment, |name: Cow<[u8]>, value: Cow<[u8]>| {
                decoded = decoded.saturating_add(name.len() + value.len());
                if decoded > MAX_DECODED {
                    over = true;
                } else {
                    fields.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| FilterError::Hpack(e.to_string()))?;
        if over {
            return Err(FilterError::DecodedTooLarge);
        }
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority"
                && http::uri::Authority::try_from(value.as_slice()).is_err()
            {
                tracing::debug!(
                    authority = %String::from_utf8_lossy(value),
                    "unix socket request: :authority replaced by localhost (h2 refuses it)"
                );
                *value = LOCAL_AUTHORITY.to_vec();
                self.rewritten += 1;
            }
        }
        let encoded = encode_literals(&fields);
        write_block(out, &block, &encoded);
        Ok(())
    }
}

/// HPACK with every field a literal without indexing (RFC 7541 6.2.2,
/// new name): it needs no table on either side.
fn encode_literals(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(fields.iter().map(|(n, v)| n.len() + v.len() + 8).sum());
    for (name, value) in fields {
        buf.push(0x00);
        for s in [name, value] {
            // Writing to a Vec cannot fail.
            let _ = loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, &mut buf);
            buf.extend_from_slice(s);
        }
    }
    buf
}

/// Frames `encoded` as one HEADERS and as many CONTINUATION frames as its
/// size needs.
fn write_block(out: &mut BytesMut, block: &Block, encoded: &[u8]) {
    let prio_len = if block.priority.is_some() { 5 } else { 0 };
    let first = encoded.len().min(OUT_FRAME_MAX - prio_len);
    let (head, mut rest) = encoded.split_at(first);
    let mut flags = 0u8;
    if block.end_stream {
        flags |= FLAG_END_STREAM;
    }
    if block.priority.is_some() {
        flags |= FLAG_PRIORITY;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    frame_header(
        out,
        prio_len + head.len(),
        TYPE_HEADERS,
        flags,
        block.stream,
    );
    if let Some(p) = &block.priority {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(head);
    while !rest.is_empty() {
        let n = rest.len().min(OUT_FRAME_MAX);
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let flags = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        frame_header(out, n, TYPE_CONTINUATION, flags, block.stream);
        out.extend_from_slice(chunk);
    }
}

fn frame_header(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = u32::try_from(len).unwrap_or(0).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// An accepted Unix-socket stream whose client-to-server header blocks go
/// through a [`Rewriter`]; writes pass straight to the socket.
#[derive(Debug)]
pub struct AuthorityFilter<S> {
    inner: S,
    rewriter: Rewriter,
    input: BytesMut,
    output: BytesMut,
    eof: bool,
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("rewritten", &self.rewritten)
            .field("block_open", &self.block.is_some())
            .finish_non_exhaustive()
    }
}

impl<S> AuthorityFilter<S> {
    /// Wraps a freshly accepted connection (nothing read from it yet).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            input: BytesMut::new(),
            output: BytesMut::new(),
            eof: false,
        }
    }

    /// The wrapped stream (for its peer credentials and the like).
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// The wrapped stream's connect info (for a bare `UnixStream`, tonic's
/// `UdsConnectInfo`): the filter changes nothing of who is connected.
impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFilter<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFilter<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // What is left in `input` is a frame cut short by the
                // client's close: h2 sees the end of the stream.
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            if rb.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.input.extend_from_slice(rb.filled());
            if let Err(e) = this.rewriter.process(&mut this.input, &mut this.output) {
                tracing::debug!(error = %e, "unix socket connection ended");
                return Poll::Ready(Err(e.into()));
            }
        }
    }
}

delegate_async_write!(impl[S: tokio::io::AsyncWrite + Unpin] for AuthorityFilter<S>, inner);

#[cfg(test)]
mod tests {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        frame_header(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out.to_vec()
    }

    /// A frame read back: HEADERS' flags (or the frame type), stream,
    /// decoded fields (or the payload).
    type ReadFrame = (u8, u32, Vec<(Vec<u8>, Vec<u8>)>);

    /// Parses `bytes` (after the preface) into frames and decodes each
    /// header block with a fresh decoder, as h2 would.
    fn read_back(bytes: &[u8]) -> Vec<ReadFrame> {
        let mut dec = loona_hpack::Decoder::new();
        let mut rest = &bytes[PREFACE_LEN..];
        let mut out = Vec::new();
        let mut block = Vec::new();
        let mut first_flags = 0;
        while !rest.is_empty() {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let (kind, flags) = (rest[3], rest[4]);
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            assert!(len <= OUT_FRAME_MAX);
            let payload = &rest[9..9 + len];
            rest = &rest[9 + len..];
            match kind {
                TYPE_HEADERS => {
                    first_flags = flags;
                    let skip = if flags & FLAG_PRIORITY != 0 { 5 } else { 0 };
                    assert_eq!(flags & FLAG_PADDED, 0);
                    block.extend_from_slice(&payload[skip..]);
                }
                TYPE_CONTINUATION => block.extend_from_slice(payload),
                _ => {
                    out.push((kind, stream, vec![(b"payload".to_vec(), payload.to_vec())]));
                    continue;
                }
            }
            if flags & FLAG_END_HEADERS != 0 {
                let fields = dec.decode(&block).unwrap();
                block.clear();
                out.push((first_flags, stream, fields));
            }
        }
        out
    }

    fn run(input: &[u8], split: usize) -> Result<Vec<u8>, FilterError> {
        let mut r = Rewriter::new();
        let mut out = BytesMut::new();
        let mut buf = BytesMut::new();
        for chunk in input.chunks(split.max(1)) {
            buf.extend_from_slice(chunk);
            r.process(&mut buf, &mut out)?;
        }
        assert!(buf.is_empty(), "bytes left over");
        Ok(out.to_vec())
    }

    /// A gRPC request's header block. With `first`, `:authority` is a
    /// literal with incremental indexing (it enters the client's dynamic
    /// table, as C-core sends it); otherwise a reference to that entry,
    /// which is then index 63 (`te: trailers`, added by `enc` after it,
    /// is 62).
    fn request(enc: &mut loona_hpack::Encoder<'_>, authority: &[u8], first: bool) -> Vec<u8> {
        let mut b = if first {
            let mut b = vec![0x41]; // literal, indexed name 1 (:authority), add to table
            loona_hpack::encoder::encode_integer_into(authority.len(), 7, 0, &mut b).unwrap();
            b.extend_from_slice(authority);
            b
        } else {
            vec![0x80 | 63]
        };
        b.extend(enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/warden.v1.Agent/GetNodeHealth"),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
        ]));
        b
    }

    fn field<'a>(fields: &'a [(Vec<u8>, Vec<u8>)], name: &str) -> &'a [u8] {
        &fields.iter().find(|(n, _)| n == name.as_bytes()).unwrap().1
    }

    #[test]
    fn percent_encoded_path_becomes_localhost_across_the_dynamic_table() {
        // The client's encoder indexes its fields, so the second request is
        // mostly references into its dynamic table: the rewriter must keep
        // that table to decode it.
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])); // SETTINGS
        let b1 = request(&mut enc, b"%2Frun%2Fwarden%2Fwarden.sock", true);
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &b1));
        input.extend(frame(0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\0"));
        let b2 = request(&mut enc, b"%2Frun%2Fwarden%2Fwarden.sock", false);
        assert!(
            b2.contains(&(0x80 | 63)) && b2.contains(&(0x80 | 62)),
            "second block uses the table"
        );
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &b2));
        for split in [1, 7, 4096] {
            let out = run(&input, split).unwrap();
            let frames = read_back(&out);
            assert_eq!(frames.len(), 4);
            for i in [1, 3] {
                let (_, _, fields) = &frames[i];
                assert_eq!(field(fields, ":authority"), b"localhost");
                assert_eq!(field(fields, ":path"), b"/warden.v1.Agent/GetNodeHealth");
                assert_eq!(field(fields, "te"), b"trailers");
                assert_eq!(fields.len(), 6);
            }
            assert_eq!(frames[2].2[0].1, b"\0\0\0\0\0");
        }
    }

    #[test]
    fn a_valid_authority_is_kept() {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        let b = request(&mut enc, b"localhost:50051", true);
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            1,
            &b,
        ));
        let mut r = Rewriter::new();
        let mut out = BytesMut::new();
        r.process(&mut BytesMut::from(&input[..]), &mut out)
            .unwrap();
        assert_eq!(r.rewritten(), 0);
        let frames = read_back(&out);
        assert_eq!(field(&frames[0].2, ":authority"), b"localhost:50051");
        assert_eq!(frames[0].0 & FLAG_END_STREAM, FLAG_END_STREAM);
    }

    #[test]
    fn padding_priority_and_continuation_are_handled() {
        let mut enc = loona_hpack::Encoder::new();
        let big = vec![b'x'; 40_000];
        let block = enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":path", b"/a"),
            (b":authority", b"/tmp/raw path.sock"),
            (b"x-big", &big[..]),
        ]);
        let (a, b) = block.split_at(100);
        let mut headers = vec![3u8]; // pad length
        headers.extend([0x80, 0, 0, 0, 15]); // exclusive, depends on 0, weight 15
        headers.extend_from_slice(a);
        headers.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY,
            5,
            &headers,
        ));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, b));
        let out = run(&input, 1000).unwrap();
        let frames = read_back(&out);
        assert_eq!(frames.len(), 1);
        let (flags, stream, fields) = &frames[0];
        assert_eq!(*stream, 5);
        assert_eq!(flags & FLAG_PRIORITY, FLAG_PRIORITY);
        assert_eq!(field(fields, ":authority"), b"localhost");
        assert_eq!(field(fields, "x-big"), &big[..]);
        // The priority fields came through as sent.
        let at = PREFACE_LEN + 9;
        assert_eq!(&out[at..at + 5], &[0x80, 0, 0, 0, 15]);
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &[0xff, 0xff, 0xff],
        ));
        assert!(matches!(run(&input, 64), Err(FilterError::Hpack(_))));

        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82]));
        assert!(matches!(run(&input, 64), Err(FilterError::Framing(_))));

        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, 0, 1, &[0x82]));
        input.extend(frame(0x0, 0, 1, b"data"));
        assert!(matches!(run(&input, 64), Err(FilterError::Framing(_))));

        let mut input = PREFACE.to_vec();
        input.extend([0x10, 0, 0, TYPE_HEADERS, 0, 0, 0, 0, 1]); // 1 MiB
        assert!(matches!(
            run(&input, 64),
            Err(FilterError::BlockTooLarge(_))
        ));

        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_END_HEADERS,
            1,
            &[9, 0x82],
        ));
        assert!(matches!(run(&input, 64), Err(FilterError::Framing(_))));

        // A table entry of ~4 KiB referenced 300 times: 1.2 MB decoded
        // from a block of a few KiB.
        let mut enc = loona_hpack::Encoder::new();
        let v = vec![b'v'; 4000];
        let mut block = enc.encode([(&b"x-a"[..], &v[..])]);
        block.extend(std::iter::repeat_n(0x80 | 62, 300));
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        assert!(matches!(
            run(&input, 4096),
            Err(FilterError::DecodedTooLarge)
        ));
    }

    #[test]
    fn garbage_never_panics() {
        // Deterministic pseudo-random bytes after a valid preface: every
        // outcome is Ok or a FilterError, never a panic.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            let mut input = PREFACE.to_vec();
            let n = (x % 300) as usize;
            for _ in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                input.push(x as u8);
            }
            // Often a header frame of a plausible length.
            if x.is_multiple_of(2) && input.len() > PREFACE_LEN + 9 {
                let len = input.len() - PREFACE_LEN - 9;
                input[PREFACE_LEN] = 0;
                input[PREFACE_LEN + 1] = (len >> 8) as u8;
                input[PREFACE_LEN + 2] = len as u8;
                input[PREFACE_LEN + 3] = TYPE_HEADERS;
            }
            let mut r = Rewriter::new();
            let _ = r.process(&mut BytesMut::from(&input[..]), &mut BytesMut::new());
        }
    }
}
