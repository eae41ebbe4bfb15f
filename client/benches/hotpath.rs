//! Hot-path cost of the client next to the obvious alternative.
//!
//! One run, one group, so the numbers sit side by side: heartbeat, section
//! open+close and step begin+end through [`Client`] (no agent: the private
//! slot costs exactly what the shared one does, same stores), the raw
//! [`SlotWriter`] with timestamps passed in (what the stores alone cost),
//! the clock, and the baseline: one length-prefixed message over a Unix
//! stream socket per heartbeat, drained by a reader thread.
//!
//! Issue 22 moved the agent's slot from a shared tmpfs file to a sealed
//! memfd per rank; `slot/heartbeat+step (sealed memfd)` writes into the
//! memory as the agent now hands it out, `slot/heartbeat+step (tmpfs file)`
//! into a MAP_SHARED file on /dev/shm as before, in the same run.
//!
//! `cargo bench -p warden-client --bench hotpath`

// Benchmark setup may unwrap: a failure there is a broken machine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use warden_client::slot::{SECTION_FORWARD, Slot, SlotTable, SlotWriter};
use warden_client::{Client, ConnectOptions, clock};

fn offline_client() -> Client {
    let mut opts = ConnectOptions::from_env_lossy();
    opts.socket_path = "/nonexistent/warden-bench.sock".into();
    Client::connect_with(opts).unwrap()
}

fn hotpath(c: &mut Criterion) {
    let client = offline_client();
    assert!(!client.is_connected());
    eprintln!("clock source: {}", clock::source());
    let mut g = c.benchmark_group("hotpath");
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_secs(1));

    g.bench_function("warden/heartbeat", |b| b.iter(|| client.heartbeat()));
    let fwd = client.section_id("forward");
    g.bench_function("warden/section_open+close(id)", |b| {
        b.iter(|| {
            client.section_open(black_box(fwd));
            client.section_close(black_box(fwd));
        })
    });
    g.bench_function("warden/section_guard(name)", |b| {
        b.iter(|| drop(client.section(black_box("forward"))))
    });
    let user = client.section_id("attention");
    g.bench_function("warden/section_guard(user id)", |b| {
        b.iter(|| drop(client.enter(black_box(user))))
    });
    g.bench_function("warden/report_values(loss, grad_norm)", |b| {
        b.iter(|| client.report_values(black_box(Some(2.5)), black_box(Some(0.75))))
    });
    let mut n = 0u64;
    g.bench_function("warden/step_begin+end", |b| {
        b.iter(|| {
            n += 1;
            client.step_begin(black_box(n));
            client.step_end(black_box(n));
        })
    });

    let slot = Slot::new_boxed();
    let w = SlotWriter::new(&slot);
    let mut t = 0u64;
    g.bench_function("slot/section_open+close(no clock)", |b| {
        b.iter(|| {
            t += 10;
            w.section_open(SECTION_FORWARD, black_box(t));
            w.section_close(SECTION_FORWARD, black_box(t + 5));
        })
    });
    // The agent's slot memory before and after issue 22, same stores.
    let table = SlotTable::new(1).unwrap();
    table.claim(0, 1, std::process::id()).unwrap();
    let sealed = table.writer(0).unwrap();
    let shm = tempfile::tempfile_in("/dev/shm")
        .or_else(|_| tempfile::tempfile())
        .unwrap();
    shm.set_len(warden_client::slot::file_len(1)).unwrap();
    // SAFETY: a private temporary file nobody else can open or resize,
    // sized above, mapped for the bench's lifetime.
    let map = unsafe { memmap2::MmapMut::map_mut(&shm) }.unwrap();
    // SAFETY: the offset of slot 0 is inside the map and 128-aligned from a
    // page-aligned base; Slot is all atomics, valid for any bytes.
    let file_slot = unsafe {
        &*(map
            .as_ptr()
            .add(warden_client::slot::slot_offset(0) as usize)
            .cast::<Slot>())
    };
    let in_file = SlotWriter::new(file_slot);
    for (name, w) in [
        ("slot/heartbeat+step (sealed memfd)", &sealed),
        ("slot/heartbeat+step (tmpfs file)", &in_file),
    ] {
        let mut t = 0u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                t += 10;
                w.heartbeat();
                w.step_begin(black_box(t), black_box(t));
                w.step_end(black_box(t), black_box(t + 5));
            })
        });
    }
    g.bench_function("clock/now_ns", |b| b.iter(clock::now_ns));
    g.bench_function("clock/clock_gettime", |b| b.iter(clock::syscall_now));

    // Baseline: a length-prefixed message per heartbeat over a Unix stream.
    let (mut tx, mut rx) = UnixStream::pair().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = rx.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
    });
    let payload = b"hb job=bench rank=0 step=123456";
    let mut msg = Vec::with_capacity(4 + payload.len());
    msg.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    msg.extend_from_slice(payload);
    g.bench_function("baseline/unix_socket_message", |b| {
        b.iter(|| tx.write_all(black_box(&msg)).unwrap())
    });
    g.finish();
    drop(tx);
    reader.join().unwrap();
}

criterion_group!(benches, hotpath);
criterion_main!(benches);
