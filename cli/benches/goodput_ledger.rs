//! The goodput ledger's cost per heartbeat scan, next to the scan itself
//! (docs/benchmarks.md, "Goodput ledger").
//!
//! Every iteration: each of N ranks completed one step (forward, backward,
//! data sections) since the last tick. Measured apart, on the same slots in
//! the same run: `scan` is the agent's per-tick scan of every slot
//! (`ranks::scan::scan`, the baseline; it builds the ledger's feed as it
//! reads the records), `ledger` is what the work loop adds on the tick for
//! goodput accounting: handing that feed over (`Goodput::observe_scan`,
//! which appends it to the pending buffer). `fold` is the accounting itself,
//! off the tick: the goodput task (or a reader) taking the ledger and
//! folding one tick's feed into it (`Goodput::ledger`); still CPU, reported
//! apart. The client's writes are done in the untimed set-up, and so is the
//! fold of the previous iteration's feed in `ledger` (the task's job).
//! `*_no_step`: the ranks only heartbeat (steps longer than the tick, the
//! common case), so the scan reads every slot and the ledger gets nothing.
//!
//! `cargo bench -p warden-cli --bench goodput_ledger`

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::cell::Cell;
use std::hint::black_box;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use warden_agent::ranks::registry::{RegisterRequest, Registry};
use warden_agent::ranks::scan;
use warden_client::slot::{self, SlotMemory};
use warden_core::config::HangConfig;
use warden_core::goodput::{Goodput, ScanFeed};

struct Setup {
    _dir: tempfile::TempDir,
    reg: Registry,
    /// Each rank's slot memory, as the rank maps it.
    file: Vec<SlotMemory>,
    goodput: Goodput,
    cfg: HangConfig,
    step: Cell<u64>,
    now: Cell<u64>,
}

fn setup(ranks: u32) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let mut reg = Registry::new(&dir.path().join("run"), &dir.path().join("state"), ranks).unwrap();
    let goodput = Goodput::open(&dir.path().join("state"));
    let me = std::process::id();
    let mut slots = Vec::new();
    for rank in 0..ranks {
        let r = reg
            .register(
                &RegisterRequest {
                    job_id: "bench".into(),
                    global_rank: rank,
                    local_rank: rank % 8,
                    world_size: ranks,
                    pid: me,
                    host: "bench".into(),
                    layout_version: slot::LAYOUT_VERSION,
                    stack_dump_signal: 0,
                    devices: Vec::new(),
                    declared_pid: me,
                    process: None,
                    caller_pid: None,
                    owner: None,
                },
                1,
            )
            .unwrap();
        goodput.ledger().registered("bench", rank, me, 0, 1);
        slots.push((r.slot_index, r.generation));
    }
    let file: Vec<SlotMemory> = slots
        .iter()
        .map(|(i, g)| {
            let fd = reg.slots().memory(*i).unwrap().fd().try_clone_to_owned();
            let m = SlotMemory::open(fd.unwrap()).unwrap();
            m.slot().attach_writer(*g, me);
            m
        })
        .collect();
    Setup {
        _dir: dir,
        reg,
        file,
        goodput,
        cfg: HangConfig::default(),
        step: Cell::new(0),
        now: Cell::new(warden_client::clock::syscall_now()),
    }
}

impl Setup {
    /// Every rank completes one 10 ms step (what a client writes); returns
    /// the scan's time window.
    fn write_steps(&self) -> (u64, u64) {
        let n = self.step.get();
        let t0 = self.now.get();
        for m in &self.file {
            let w = m.writer();
            w.step_begin(n, t0);
            w.section_open(slot::SECTION_DATA, t0);
            w.section_close(slot::SECTION_DATA, t0 + 1_000_000);
            w.section_open(slot::SECTION_FORWARD, t0 + 1_000_000);
            w.section_close(slot::SECTION_FORWARD, t0 + 5_000_000);
            w.section_open(slot::SECTION_BACKWARD, t0 + 5_000_000);
            w.section_close(slot::SECTION_BACKWARD, t0 + 10_000_000);
            w.step_end(n, t0 + 10_000_000);
        }
        self.step.set(n + 1);
        self.now.set(t0 + 10_000_000);
        (t0 + 10_000_000, t0)
    }

    /// Every rank only heartbeats (a step longer than the tick is under
    /// way): the common scan when steps take seconds.
    fn write_heartbeats(&self) -> (u64, u64) {
        let t0 = self.now.get();
        for m in &self.file {
            m.writer().heartbeat();
        }
        self.now.set(t0 + 10_000_000);
        (t0 + 10_000_000, t0)
    }

    fn scan(&mut self, now: u64, prev: u64) -> ScanFeed {
        scan::scan(&mut self.reg, &self.cfg, now, prev).goodput
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("goodput_per_scan");
    for ranks in [8u32, 64, 1024] {
        let mut s = setup(ranks);
        // Warm the baselines and caches.
        for _ in 0..40 {
            let (now, prev) = s.write_steps();
            let feed = s.scan(now, prev);
            s.goodput.observe_scan(feed, now);
            drop(s.goodput.ledger());
        }
        let s = std::cell::RefCell::new(s);
        g.bench_function(BenchmarkId::new("scan", ranks), |b| {
            b.iter_batched(
                || s.borrow().write_steps(),
                |(now, prev)| black_box(s.borrow_mut().scan(now, prev)),
                BatchSize::PerIteration,
            );
        });
        g.bench_function(BenchmarkId::new("ledger", ranks), |b| {
            b.iter_batched(
                || {
                    drop(s.borrow().goodput.ledger());
                    let (now, prev) = s.borrow().write_steps();
                    (s.borrow_mut().scan(now, prev), now)
                },
                |(feed, now)| s.borrow().goodput.observe_scan(black_box(feed), now),
                BatchSize::PerIteration,
            );
        });
        g.bench_function(BenchmarkId::new("fold", ranks), |b| {
            b.iter_batched(
                || {
                    let (now, prev) = s.borrow().write_steps();
                    let feed = s.borrow_mut().scan(now, prev);
                    s.borrow().goodput.observe_scan(feed, now);
                },
                |()| drop(black_box(s.borrow().goodput.ledger())),
                BatchSize::PerIteration,
            );
        });
        assert_eq!(s.borrow().goodput.pending(), 0);
        g.bench_function(BenchmarkId::new("scan_no_step", ranks), |b| {
            b.iter_batched(
                || s.borrow().write_heartbeats(),
                |(now, prev)| black_box(s.borrow_mut().scan(now, prev)),
                BatchSize::PerIteration,
            );
        });
        g.bench_function(BenchmarkId::new("ledger_no_step", ranks), |b| {
            b.iter_batched(
                || {
                    let (now, prev) = s.borrow().write_heartbeats();
                    (s.borrow_mut().scan(now, prev), now)
                },
                |(feed, now)| s.borrow().goodput.observe_scan(black_box(feed), now),
                BatchSize::PerIteration,
            );
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
