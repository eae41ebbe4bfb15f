use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// A write handle on slot `index`'s memory (made if need be), for tests
/// that put bytes there behind the API's back, as a rogue rank could.
fn memfile(f: &SlotTable, index: u32) -> std::fs::File {
    f.slot(index).unwrap();
    std::fs::File::from(f.memory(index).unwrap().fd().try_clone_to_owned().unwrap())
}

#[test]
fn a_table_makes_memory_per_slot_on_first_use() {
    let f = SlotTable::new(4).unwrap();
    assert_eq!(f.slot_count(), 4);
    assert!(f.memory(0).is_none());
    assert!(matches!(
        f.snapshot(4),
        Err(SlotError::IndexOutOfRange { index: 4, count: 4 })
    ));
    let s = f.snapshot(0).unwrap();
    assert!(!s.claimed);
    assert_eq!(s.steps_completed, 0);
    assert!(s.recent_steps.is_empty());
    assert!(f.memory(0).is_some());
    assert!(f.memory(1).is_none());
}

#[test]
fn slot_memory_is_sealed_against_any_size_change() {
    let f = SlotTable::new(1).unwrap();
    f.claim(0, 5, 1).unwrap();
    let file = memfile(&f, 0);
    assert_eq!(file.metadata().unwrap().len(), memory_len());
    for len in [0, 10, memory_len() - 1, memory_len() + 4096] {
        let err = file.set_len(len).unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(libc::EPERM),
            "set_len({len}): {err}"
        );
    }
    // The seals themselves cannot be undone or added to.
    let err = nix::fcntl::fcntl(
        &file,
        nix::fcntl::FcntlArg::F_ADD_SEALS(nix::fcntl::SealFlag::F_SEAL_WRITE),
    )
    .unwrap_err();
    assert_eq!(err, nix::errno::Errno::EPERM);
    assert!(f.snapshot(0).unwrap().claimed);
}

#[test]
fn received_memory_is_checked_before_it_is_mapped() {
    let f = SlotTable::new(1).unwrap();
    f.claim(0, 5, 1).unwrap();
    let fd = f.memory(0).unwrap().fd().try_clone_to_owned().unwrap();
    let m = SlotMemory::open(fd).unwrap();
    assert_eq!(m.slot().generation(), 5);

    // Unsealed memory (anyone holding it could truncate it): refused.
    let raw = nix::sys::memfd::memfd_create(
        "unsealed",
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
    )
    .unwrap();
    std::fs::File::from(raw.try_clone().unwrap())
        .set_len(memory_len())
        .unwrap();
    let err = SlotMemory::open(raw).unwrap_err();
    assert!(matches!(err, SlotError::NotSealed { .. }), "{err}");
    assert!(err.to_string().contains("not sealed"), "{err}");

    // A plain file is not sealable at all.
    let dir = tmp();
    let p = dir.path().join("plain");
    std::fs::write(&p, vec![0u8; memory_len() as usize]).unwrap();
    let plain: std::os::fd::OwnedFd = std::fs::File::open(&p).unwrap().into();
    assert!(SlotMemory::open(plain).is_err());

    // Each header field in turn, written by a holder of the memory.
    let file = memfile(&f, 0);
    let cases: [(u64, &[u8], &str); 5] = [
        (0, b"NOTWARDN", "magic"),
        (8, &99u32.to_ne_bytes(), "layout version 99"),
        (12, &64u32.to_ne_bytes(), "header_size"),
        (16, &1u32.to_ne_bytes(), "slot_size"),
        (20, &2u32.to_ne_bytes(), "slot"),
    ];
    for (offset, bytes, needle) in cases {
        let mut orig = vec![0u8; bytes.len()];
        file.read_exact_at(&mut orig, offset).unwrap();
        file.write_all_at(bytes, offset).unwrap();
        let fd = f.memory(0).unwrap().fd().try_clone_to_owned().unwrap();
        let err = SlotMemory::open(fd).unwrap_err();
        assert!(err.to_string().contains(needle), "{needle}: {err}");
        file.write_all_at(&orig, offset).unwrap();
    }
    let fd = f.memory(0).unwrap().fd().try_clone_to_owned().unwrap();
    SlotMemory::open(fd).unwrap();

    // A holder wrecks the header; the next claim of the slot restores it,
    // so the next rank handed it can map it.
    file.write_all_at(b"NOTWARDN", 0).unwrap();
    let fd = f.memory(0).unwrap().fd().try_clone_to_owned().unwrap();
    assert!(SlotMemory::open(fd).is_err());
    f.claim(0, 6, 1).unwrap();
    let fd = f.memory(0).unwrap().fd().try_clone_to_owned().unwrap();
    assert_eq!(SlotMemory::open(fd).unwrap().slot().generation(), 6);
}

#[test]
fn rejects_bad_slot_counts() {
    assert!(matches!(SlotTable::new(0), Err(SlotError::BadSlotCount(0))));
    assert!(matches!(
        SlotTable::new(MAX_SLOTS + 1),
        Err(SlotError::BadSlotCount(_))
    ));
}

#[test]
fn claim_release_and_generation_echo() {
    let f = SlotTable::new(2).unwrap();
    f.claim(1, 42, 1234).unwrap();
    let s = f.snapshot(1).unwrap();
    assert!(s.claimed);
    assert_eq!((s.generation, s.owner_pid), (42, 1234));
    assert!(!s.writer_is_owner(), "nobody attached yet");
    f.slot(1).unwrap().attach_writer(42, 1234);
    assert!(f.snapshot(1).unwrap().writer_is_owner());
    f.set_control(1, 7).unwrap();
    let w = f.writer(1).unwrap();
    assert_eq!(w.control(), 7);
    w.ack(7);
    assert_eq!(f.snapshot(1).unwrap().ack, 7);
    f.release(1).unwrap();
    assert!(!f.snapshot(1).unwrap().claimed);
    assert!(f.claim(2, 1, 1).is_err());
}

#[test]
fn steps_and_sections_accumulate_per_step() {
    let f = SlotTable::new(1).unwrap();
    f.claim(0, 1, 1).unwrap();
    f.slot(0).unwrap().write_name(8, "attention");
    let w = f.writer(0).unwrap();
    w.heartbeat();
    w.step_begin(7, 100);
    w.section_open(SECTION_FORWARD, 110);
    w.section_open(8, 120);
    let s = f.snapshot(0).unwrap();
    assert!(s.step_open);
    assert_eq!(s.step, 7);
    let ids: Vec<u32> = s.open_sections.iter().map(|o| o.id).collect();
    assert_eq!(ids, [SECTION_STEP, SECTION_FORWARD, 8]);
    assert_eq!(s.section_name(s.innermost().unwrap().id), "attention");
    assert_eq!(s.current_step.as_ref().unwrap().start_ns, 100);
    w.section_close(8, 130);
    w.section_close(SECTION_FORWARD, 150);
    w.section_open(SECTION_FORWARD, 160);
    w.section_close(SECTION_FORWARD, 170);
    w.section_open(SECTION_BACKWARD, 170);
    w.step_end(7, 250); // closes backward implicitly
    let s = f.snapshot(0).unwrap();
    assert!(!s.step_open && s.current_step.is_none());
    assert_eq!(s.depth, 0);
    assert_eq!(s.steps_completed, 1);
    assert_eq!(s.heartbeats, 3);
    let rec = &s.recent_steps[0];
    assert_eq!((rec.step, rec.start_ns, rec.duration_ns), (7, 100, 150));
    let totals: Vec<(u32, u64)> = rec.sections.iter().map(|t| (t.id, t.total_ns)).collect();
    assert_eq!(
        totals,
        [(SECTION_FORWARD, 50), (SECTION_BACKWARD, 80), (8, 10)]
    );
    assert_eq!(s.misuse, 0);
}

#[test]
fn step_values_land_in_their_step_record() {
    let f = SlotTable::new(1).unwrap();
    f.claim(0, 1, 1).unwrap();
    let w = f.writer(0).unwrap();
    w.report_values(Some(1.0), None); // before any step: misuse, dropped
    assert_eq!(f.snapshot(0).unwrap().misuse, 1);
    w.step_begin(1, 100);
    w.report_values(Some(2.5), None);
    w.report_values(None, Some(f64::NAN));
    let s = f.snapshot(0).unwrap();
    let cur = s.current_step.as_ref().unwrap();
    assert_eq!(cur.loss, Some(2.5));
    assert!(
        cur.grad_norm.unwrap().is_nan(),
        "a NaN is reported, not dropped"
    );
    w.step_end(1, 200);
    // Between steps: into the step just ended.
    w.report_values(Some(3.0), Some(f64::INFINITY));
    w.step_begin(2, 300);
    w.step_end(2, 400);
    let s = f.snapshot(0).unwrap();
    let r: Vec<(u64, Option<f64>, Option<f64>)> = s
        .recent_steps
        .iter()
        .map(|r| (r.step, r.loss, r.grad_norm))
        .collect();
    assert_eq!(
        r,
        [(1, Some(3.0), Some(f64::INFINITY)), (2, None, None)],
        "a new step starts with no values"
    );
    // Carried across a slot swap like the rest of the client's line.
    let other = Slot::new_boxed();
    other.copy_client_state_from(f.slot(0).unwrap());
    let copied = other.snapshot(0).unwrap();
    assert_eq!(copied.recent_steps[0].loss, Some(3.0));
}

#[test]
fn sections_outside_steps_and_implicit_step_end() {
    let f = SlotTable::new(1).unwrap();
    let w = f.writer(0).unwrap();
    w.section_open(SECTION_INIT, 1);
    w.step_begin(1, 10);
    w.section_open(SECTION_DATA, 11);
    w.step_begin(2, 20); // ends step 1, closing "data"
    let s = f.snapshot(0).unwrap();
    assert_eq!(s.steps_completed, 1);
    assert_eq!(s.recent_steps[0].duration_ns, 10);
    assert_eq!(s.recent_steps[0].sections[0].id, SECTION_DATA);
    let ids: Vec<u32> = s.open_sections.iter().map(|o| o.id).collect();
    assert_eq!(ids, [SECTION_INIT, SECTION_STEP]);
    w.step_end(2, 30);
    w.section_close(SECTION_INIT, 40);
    assert_eq!(f.snapshot(0).unwrap().depth, 0);
}

#[test]
fn misuse_is_counted_and_never_corrupts_the_stack() {
    let f = SlotTable::new(1).unwrap();
    let w = f.writer(0).unwrap();
    w.step_end(1, 5); // no step open
    w.section_close(SECTION_FORWARD, 5); // nothing open
    w.step_begin(1, 10);
    w.section_open(SECTION_FORWARD, 11);
    w.section_close(SECTION_BACKWARD, 12); // not open
    w.section_close(999, 12); // out of range -> "other", not open
    w.section_open(SECTION_STEP, 12); // reserved -> "other", counted
    let s = f.snapshot(0).unwrap();
    assert_eq!(s.misuse, 5);
    let ids: Vec<u32> = s.open_sections.iter().map(|o| o.id).collect();
    assert_eq!(ids, [SECTION_STEP, SECTION_FORWARD, SECTION_OTHER]);
    // Closing the outer section closes the inner one too.
    w.section_close(SECTION_FORWARD, 20);
    assert_eq!(f.snapshot(0).unwrap().depth, 1);
    w.step_end(1, 30);
    assert_eq!(f.snapshot(0).unwrap().depth, 0);
}

#[test]
fn deep_nesting_is_counted_past_max_depth() {
    let f = SlotTable::new(1).unwrap();
    let w = f.writer(0).unwrap();
    w.step_begin(1, 0);
    for i in 0..12 {
        w.section_open(SECTION_FORWARD, i);
    }
    let s = f.snapshot(0).unwrap();
    assert_eq!(s.depth, 13);
    assert_eq!(s.open_sections.len(), MAX_DEPTH);
    for i in 0..12 {
        w.section_close(SECTION_FORWARD, 100 + i);
    }
    assert_eq!(f.snapshot(0).unwrap().depth, 1);
    w.step_end(1, 200);
    let s = f.snapshot(0).unwrap();
    assert_eq!(s.depth, 0);
    assert_eq!(s.misuse, 0);
}

#[test]
fn ring_keeps_the_last_completed_steps() {
    let f = SlotTable::new(1).unwrap();
    let w = f.writer(0).unwrap();
    for n in 0..100u64 {
        w.step_begin(n, n * 10);
        w.step_end(n, n * 10 + 5);
    }
    w.step_begin(100, 1000);
    let s = f.snapshot(0).unwrap();
    assert_eq!(s.steps_completed, 100);
    assert_eq!(s.recent_steps.len(), RING_LEN - 1);
    assert_eq!(
        s.recent_steps.first().unwrap().step,
        100 - (RING_LEN as u64 - 1)
    );
    assert_eq!(s.recent_steps.last().unwrap().step, 99);
    assert!(s.recent_steps.iter().all(|r| r.duration_ns == 5));
    assert_eq!(s.current_step.unwrap().step, 100);
    let s = f.snapshot_recent(0, 3).unwrap();
    let steps: Vec<u64> = s.recent_steps.iter().map(|r| r.step).collect();
    assert_eq!(steps, [97, 98, 99]);
    assert_eq!(s.current_step.unwrap().step, 100);
    assert!(f.snapshot_recent(0, 0).unwrap().recent_steps.is_empty());
}

#[test]
fn names_are_truncated_on_char_boundaries_and_sanitised() {
    let f = SlotTable::new(1).unwrap();
    let long = "é".repeat(20); // 40 bytes
    f.slot(0).unwrap().write_name(9, &long);
    f.slot(0).unwrap().write_name(3, "not-user"); // well-known ids are fixed
    let s = f.snapshot(0).unwrap();
    assert_eq!(s.section_name(9), "é".repeat(16));
    assert_eq!(s.section_name(3), "backward");
    assert_eq!(s.section_name(10), "");
    assert_eq!(s.section_name(1000), "");

    // Invalid UTF-8 and an impossible length, written behind the API's back.
    let file = memfile(&f, 0);
    let names = slot_offset(0) + std::mem::offset_of!(Slot, names) as u64;
    let entry = |id: u64| names + id * (8 + NAME_LEN as u64);
    file.write_all_at(&[0xff, 0xfe, b'a'], entry(10) + 8)
        .unwrap();
    file.write_all_at(&3u32.to_ne_bytes(), entry(10)).unwrap();
    file.write_all_at(&1000u32.to_ne_bytes(), entry(11))
        .unwrap();
    let s = f.snapshot(0).unwrap();
    assert_eq!(s.section_name(10), "\u{fffd}\u{fffd}a");
    assert_eq!(s.section_name(11), "");
}

/// Any bytes at all in a slot: the reader never panics and bounds everything.
#[test]
fn random_garbage_never_panics_the_reader() {
    let f = SlotTable::new(2).unwrap();
    let file = memfile(&f, 1);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut buf = vec![0u8; SLOT_SIZE];
    for round in 0..200 {
        for b in buf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        // Keep the seqlock even on most rounds so the full decode runs.
        if round % 4 != 0 {
            buf[128..136].copy_from_slice(&0u64.to_ne_bytes());
        }
        file.write_all_at(&buf, slot_offset(0)).unwrap();
        match f.snapshot(1) {
            Ok(s) => {
                assert!(s.open_sections.len() <= MAX_DEPTH);
                assert!(
                    s.open_sections
                        .iter()
                        .all(|o| (o.id as usize) < MAX_SECTIONS)
                );
                assert!(s.recent_steps.len() < RING_LEN);
                assert_eq!(s.section_names.len(), MAX_SECTIONS);
                for r in &s.recent_steps {
                    assert!(r.sections.iter().all(|t| (t.id as usize) < MAX_SECTIONS));
                }
            }
            Err(e) => assert!(matches!(e, SlotError::Inconsistent { index: 1, .. })),
        }
        // A writer on garbage must not panic either.
        let w = f.writer(1).unwrap();
        w.step_begin(1, 1);
        w.section_open(u32::MAX, 2);
        w.section_close(u32::MAX, 3);
        w.section_close(SECTION_FORWARD, 3);
        w.step_end(1, 4);
    }
}

/// A reader racing a busy writer only ever sees complete updates.
#[test]
fn concurrent_reader_never_sees_a_torn_snapshot() {
    let f = Arc::new(SlotTable::new(1).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (f, stop) = (f.clone(), stop.clone());
        std::thread::spawn(move || {
            let w = f.writer(0).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = n * 1000;
                w.step_begin(n, t);
                w.section_open(SECTION_FORWARD, t + 100);
                w.section_close(SECTION_FORWARD, t + 300);
                w.section_open(SECTION_BACKWARD, t + 300);
                w.section_open(8, t + 350);
                for _ in 0..50 {
                    std::hint::spin_loop();
                }
                w.section_close(8, t + 400);
                w.section_close(SECTION_BACKWARD, t + 700);
                w.step_end(n, t + 900);
                n += 1;
                if n.is_multiple_of(64) {
                    std::thread::yield_now();
                }
            }
            n
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    let (mut ok, mut busy) = (0u32, 0u32);
    while std::time::Instant::now() < deadline {
        let s = match f.snapshot(0) {
            Ok(s) => s,
            Err(SlotError::Inconsistent { .. }) => {
                busy += 1;
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        ok += 1;
        for r in &s.recent_steps {
            assert_eq!(r.start_ns, r.step * 1000, "{r:?}");
            assert_eq!(r.duration_ns, 900, "{r:?}");
            let totals: Vec<(u32, u64)> = r.sections.iter().map(|t| (t.id, t.total_ns)).collect();
            assert_eq!(
                totals,
                [(SECTION_FORWARD, 200), (SECTION_BACKWARD, 400), (8, 50)],
                "{r:?}"
            );
        }
        for pair in s.recent_steps.windows(2) {
            assert_eq!(pair[1].step, pair[0].step + 1);
        }
        if s.step_open {
            let cur = s.current_step.as_ref().unwrap();
            assert_eq!(cur.step, s.step);
            assert_eq!(s.open_sections[0].id, SECTION_STEP);
            assert_eq!(s.open_sections[0].entered_ns, s.step * 1000);
            for o in &s.open_sections[1..] {
                assert!(o.entered_ns >= s.step * 1000 + 100, "{s:?}");
            }
        }
        if let Some(last) = s.recent_steps.last() {
            assert_eq!(last.step + 1, s.steps_completed);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let steps = writer.join().unwrap();
    assert!(steps > 100, "writer made {steps} steps");
    eprintln!("{ok} consistent snapshots, {busy} busy, writer made {steps} steps");
    assert!(ok >= 10, "only {ok} consistent snapshots ({busy} busy)");
}

#[test]
fn control_word_round_trips_and_rejects_garbage() {
    let w = ControlWord::restart(0xdead_beef, 3);
    let word = w.encode();
    assert_eq!(word, (0xdead_beef_u64 << 32) | (3 << 8) | 1);
    assert_eq!(ControlWord::decode(word), Some(w));
    // Nothing asked, an unknown kind, a zero sequence number: no request.
    assert_eq!(ControlWord::decode(0), None);
    assert_eq!(ControlWord::decode((5 << 32) | 2), None);
    assert_eq!(ControlWord::decode(1), None);
    // The count saturates at 24 bits instead of bleeding into the seq.
    let big = ControlWord::restart(7, u32::MAX).encode();
    let back = ControlWord::decode(big).unwrap();
    assert_eq!(
        (back.seq, back.restart_count),
        (7, CONTROL_MAX_RESTART_COUNT)
    );
}

#[test]
fn the_ack_word_is_read_alone_and_survives_a_swap() {
    let f = SlotTable::new(2).unwrap();
    f.claim(0, 9, 1).unwrap();
    f.slot(0).unwrap().attach_writer(9, 1);
    f.set_control(0, ControlWord::restart(41, 1).encode())
        .unwrap();
    let w = f.writer(0).unwrap();
    assert_eq!(
        ControlWord::decode(w.control()),
        Some(ControlWord::restart(41, 1))
    );
    w.ack(41);
    assert_eq!(f.ack_word(0).unwrap(), (41, 9));
    // A client moving to another slot carries its ack along.
    f.claim(1, 10, 1).unwrap();
    f.slot(1)
        .unwrap()
        .copy_client_state_from(f.slot(0).unwrap());
    assert_eq!(f.ack_word(1).unwrap().0, 41);
    // A fresh claim clears the control word.
    f.claim(0, 11, 1).unwrap();
    assert_eq!(f.snapshot(0).unwrap().control, 0);
    assert!(f.ack_word(5).is_err());
}
