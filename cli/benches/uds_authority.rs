//! Cost of the `:authority` filter on the Unix sockets
//! (`api::uds_authority`, docs/benchmarks.md), beside its baseline in the
//! same run: the bytes of a connection copied as they are (what any
//! wrapper that buffers costs, the floor).
//!
//! 1. One unary gRPC request as grpcio sends it: a HEADERS block with the
//!    percent-encoded socket path as `:authority` (client dynamic table in
//!    use after the first request) and a small DATA frame.
//! 2. Pass-through of DATA: 64 MiB in 16 KiB frames (a large request).
//!
//! `cargo bench -p warden-cli --bench uds_authority` (release).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use warden_agent::api::uds_authority::Rewriter;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// `n` unary requests as grpcio encodes them (its header set, with
/// loona-hpack's encoder indexing what it can, as C-core does).
fn requests(n: u32) -> Vec<u8> {
    let mut enc = loona_hpack::Encoder::new();
    let mut out = PREFACE.to_vec();
    frame(&mut out, 0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
    for i in 0..n {
        let block = enc.encode([
            (&b":scheme"[..], &b"http"[..]),
            (b":method", b"POST"),
            (b":authority", b"%2Frun%2Fwarden%2Fwarden.sock"),
            (b":path", b"/warden.v1.Agent/GetNodeHealth"),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (
                b"user-agent",
                b"grpc-python/1.85.1 grpc-c/51.0.0 (linux; chttp2)",
            ),
            (b"grpc-accept-encoding", b"identity, deflate, gzip"),
        ]);
        let stream = 1 + 2 * i;
        frame(&mut out, 0x1, 0x4, stream, &block);
        frame(&mut out, 0x0, 0x1, stream, &[0, 0, 0, 0, 0]);
    }
    out
}

fn data(total: usize) -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    let chunk = vec![0x5a; 16_384];
    for _ in 0..total / chunk.len() {
        frame(&mut out, 0x0, 0, 1, &chunk);
    }
    out
}

/// Median of `runs` timings of feeding `input` in 8 KiB reads (the
/// filter's read size) through a fresh [`Rewriter`] (`filter`) or through
/// a plain copy (the baseline).
fn time(runs: usize, input: &[u8], filter: bool) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let mut rw = Rewriter::new();
            let mut pending = BytesMut::new();
            let mut out = BytesMut::with_capacity(input.len() + 1024);
            let t = Instant::now();
            for chunk in input.chunks(8192) {
                pending.extend_from_slice(chunk);
                if filter {
                    rw.process(&mut pending, &mut out).unwrap();
                } else {
                    out.extend_from_slice(&pending.split());
                }
                if out.len() > 1 << 20 {
                    black_box(out.split());
                }
            }
            black_box(&out);
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn main() {
    const N: u32 = 10_000;
    let reqs = requests(N);
    let with = time(51, &reqs, true);
    let floor = time(51, &reqs, false);
    println!(
        "unary request ({} B of frames), {N} per run, median of 51:",
        reqs.len() / N as usize
    );
    let per = |d: Duration| d.as_nanos() as f64 / f64::from(N);
    println!("  filter:   {:>7.0} ns per request", per(with));
    println!(
        "  baseline: {:>7.0} ns per request (bytes copied, no parsing)",
        per(floor)
    );

    let big = data(64 << 20);
    let with = time(11, &big, true);
    let floor = time(11, &big, false);
    let gib = |d: Duration| big.len() as f64 / d.as_secs_f64() / f64::from(1u32 << 30);
    println!("DATA pass-through, 64 MiB in 16 KiB frames, median of 11:");
    println!("  filter:   {:>6.2} GiB/s", gib(with));
    println!("  baseline: {:>6.2} GiB/s (bytes copied)", gib(floor));
}
