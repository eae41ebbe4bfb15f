//! One function per fuzz target: it feeds one input to the parser and
//! asserts what must hold for any input.
//!
//! In: arbitrary bytes (text targets read them as lossy UTF-8, as the
//! agent does with what it did not write itself). Out: nothing; a broken
//! property panics, which fails the case. Never: does I/O beyond a temp
//! dir of its own. The same functions replay the kept corpus
//! ([`super::corpus`]), so a crash found once stays a test.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use prost::Message;

/// A target: one input in, a panic when a property breaks.
pub(crate) type FuzzTarget = fn(&[u8]);

/// Every target, by the name its corpus directory has.
pub(crate) const TARGETS: &[(&str, FuzzTarget)] = &[
    ("config", config),
    ("slot_header", slot_header),
    ("slot_record", slot_record),
    ("manifest", manifest),
    ("incident_journal", incident_journal),
    ("goodput_journal", goodput_journal),
    ("shard_framing", shard_framing),
    ("hook_output", hook_output),
    ("kmsg_lines", kmsg_lines),
    ("dcgmi_json", dcgmi_json),
    ("nvhcd", nvhcd),
    ("tpu_runtime", tpu_runtime),
    ("flight_recorder", flight_recorder),
    ("peer_positions", peer_positions),
    ("peer_holdings", peer_holdings),
];

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// An error a person can act on: it says something, on one subject.
fn assert_says_something(what: &str, e: &str) {
    assert!(!e.trim().is_empty(), "{what}: an error with no message");
}

/// The config loader: an error names the origin and the key; a config
/// that loads prints (`--print-config`) as TOML that loads to the same.
pub(crate) fn config(bytes: &[u8]) {
    match crate::config::Config::from_toml(&text(bytes), "fuzz.toml") {
        Err(e) => {
            let m = e.to_string();
            assert!(
                m.starts_with("fuzz.toml: key `"),
                "config error without origin and key: {m}"
            );
        }
        Ok(c) => {
            let again = crate::config::Config::from_toml(&c.to_toml(), "printed")
                .unwrap_or_else(|e| panic!("the printed config does not load: {e}"));
            assert_eq!(again, c, "the printed config loads to something else");
        }
    }
}

/// The slot file's header: any 128 bytes and any length are judged, a
/// refusal names the file.
pub(crate) fn slot_header(bytes: &[u8]) {
    use warden_slot::{HEADER_SIZE, validate_header};
    let mut header = [0u8; HEADER_SIZE];
    let n = bytes.len().min(HEADER_SIZE);
    header[..n].copy_from_slice(&bytes[..n]);
    let mut len = [0u8; 8];
    let rest = &bytes[n..];
    len[..rest.len().min(8)].copy_from_slice(&rest[..rest.len().min(8)]);
    let len = u64::from_le_bytes(len);
    let path = std::path::Path::new("/run/warden/slots");
    if let Err(e) = validate_header(path, &header, len) {
        assert_says_something("slot header", &e.to_string());
    }
    // The same header in a real slot memory (sealed: its length is fixed),
    // mapped as a rank maps what the slot socket hands it.
    use std::os::unix::fs::FileExt;
    use warden_slot::SlotMemory;
    let m = SlotMemory::create().expect("create a slot memory");
    let fd = m.fd().try_clone_to_owned().expect("dup");
    std::fs::File::from(fd.try_clone().expect("dup"))
        .write_all_at(&header, 0)
        .expect("write the header");
    match SlotMemory::open(fd) {
        Err(e) => assert_says_something("slot memory", &e.to_string()),
        Ok(mapped) => {
            let _ = mapped.writer();
            let _ = mapped.slot();
        }
    }
}

/// A slot's record (what a rank writes: seqlock, step ring, section stack,
/// names, control word) filled with arbitrary bytes: every read the
/// agent's scan makes answers or errs, bounded.
pub(crate) fn slot_record(bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    use warden_slot::{SLOT_SIZE, SlotTable, slot_offset};
    let slots = SlotTable::new(2).expect("a slot table");
    slots.claim(0, 7, 1234).expect("claim slot 0");
    slots.claim(1, 8, 1235).expect("claim slot 1");
    let f = std::fs::File::from(
        slots
            .memory(1)
            .expect("claimed, so made")
            .fd()
            .try_clone_to_owned()
            .expect("dup"),
    );
    // Slot 1 gets the input (repeated to fill it, so the ring and the
    // names see it too); slot 0 stays a clean neighbour.
    let fill: Vec<u8> = if bytes.is_empty() {
        vec![0xff; SLOT_SIZE]
    } else {
        bytes.iter().copied().cycle().take(SLOT_SIZE).collect()
    };
    f.write_all_at(&fill, slot_offset(0))
        .expect("write the slot");
    for (what, r) in [
        ("snapshot", slots.snapshot(1).map(|_| ())),
        ("snapshot_recent", slots.snapshot_recent(1, 8).map(|_| ())),
        (
            "snapshot_for_scan",
            slots.snapshot_for_scan(1, 64).map(|_| ()),
        ),
        ("change_counters", slots.change_counters(1).map(|_| ())),
        ("ack_word", slots.ack_word(1).map(|_| ())),
    ] {
        if let Err(e) = r {
            assert_says_something(what, &e.to_string());
        }
    }
    for id in [0, 7, 8, 31, 32, u32::MAX] {
        let _ = slots.section_name(1, id);
    }
    assert!(
        slots.snapshot(0).is_ok(),
        "a neighbour's garbage spoiled slot 0"
    );
    assert!(slots.snapshot(2).is_err(), "slot 2 of 2 must be refused");
}

/// A shard's manifest: refused with a reason, or it round-trips.
pub(crate) fn manifest(bytes: &[u8]) {
    use crate::ckpt::manifest::Manifest;
    match Manifest::parse(bytes) {
        Err(e) => assert_says_something("manifest", &e),
        Ok(m) => {
            let back = serde_json::to_vec(&m).expect("serialise");
            assert_eq!(Manifest::parse(&back).as_ref(), Ok(&m), "round trip");
        }
    }
}

/// The incident journal at start-up: whatever the file holds, the store
/// loads (damaged lines skipped) and keeps at most one record per line.
pub(crate) fn incident_journal(bytes: &[u8]) {
    let t = tempfile::tempdir().expect("temp dir");
    std::fs::write(t.path().join("incidents.jsonl"), bytes).expect("write");
    let store = warden_core::attribute::store::IncidentStore::load(
        t.path(),
        t.path().join("node-condition.json"),
        1000,
    );
    let lines = text(bytes).lines().filter(|l| !l.trim().is_empty()).count();
    assert!(store.all().len() <= lines, "more records than lines");
}

/// A goodput journal at start-up: it opens, and every line that did not
/// parse comes back as a warning naming the file and the line.
pub(crate) fn goodput_journal(bytes: &[u8]) {
    let t = tempfile::tempdir().expect("temp dir");
    let dir = t.path().join("goodput");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .expect("chmod");
    std::fs::write(dir.join("job.jsonl"), bytes).expect("write");
    let (_, _, warnings) = warden_core::goodput::journal::Journal::open(t.path())
        .unwrap_or_else(|e| panic!("a journal's content stopped the open: {e}"));
    for w in &warnings {
        assert!(
            w.contains("job.jsonl line "),
            "a warning that names no line: {w}"
        );
    }
}

/// A body handing out the input in pieces: the first byte sets the piece
/// size, so frames split across HTTP/2 DATA frames anywhere.
struct Pieces(VecDeque<Bytes>);

impl Body for Pieces {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

/// Shard framing (PushShard / FetchShard bodies): messages are read and
/// parsed as ShardChunks until the end or an error with a message; a
/// length over the cap is refused before anything is buffered.
pub(crate) fn shard_framing(bytes: &[u8]) {
    use crate::peer_link::ckpt::wire::{Reader, parse_chunk};
    let step = usize::from(bytes.first().copied().unwrap_or(1)).max(1);
    let body = Pieces(bytes.chunks(step).map(Bytes::copy_from_slice).collect());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut r = Reader::new(body, 1 << 16);
        // Each message takes at least its 5-byte prefix: the loop ends.
        for _ in 0..=bytes.len() {
            match r.message().await {
                Ok(None) => return,
                Ok(Some(m)) => {
                    if let Err(s) = parse_chunk(m) {
                        assert_says_something("shard chunk", s.message());
                        return;
                    }
                }
                Err(s) => {
                    assert_says_something("shard frame", s.message());
                    return;
                }
            }
        }
        panic!("more messages than bytes");
    });
}

/// A policy hook's stdout: an answer or an error naming what was wrong.
pub(crate) fn hook_output(bytes: &[u8]) {
    if let Err(e) = warden_core::policy::hook::parse_answer(bytes) {
        assert_says_something("hook answer", &e.to_string());
    }
}

/// A rank's flight-recorder dump (a file the rank writes): positions or
/// an error naming what was wrong; positions that parse compare without
/// a panic, against themselves and an empty rank.
pub(crate) fn flight_recorder(bytes: &[u8]) {
    use warden_core::detect::flight_recorder::{compare, parse};
    match parse(bytes) {
        Err(e) => assert_says_something("flight recorder", &e.to_string()),
        Ok(groups) => {
            let _ = compare(&[(0, groups.clone()), (1, groups), (2, Vec::new())]);
        }
    }
}

/// A peer's StragglerSummaries decoded from any bytes: its positions are
/// taken or refused naming the field, and the job-wide verdict over what
/// was taken never panics.
pub(crate) fn peer_positions(bytes: &[u8]) {
    let Ok(batch) = warden_proto::v1::StragglerSummaries::decode(bytes) else {
        return;
    };
    if let Err(e) = crate::peer_link::exchange::positions::values_from_pb(batch.values) {
        assert_says_something("peer values", &e);
    }
    match crate::peer_link::exchange::positions::from_pb(&batch.host, batch.positions) {
        Err(e) => assert_says_something("peer positions", &e),
        Ok(jobs) => {
            for j in jobs {
                let _ = warden_core::detect::culprit::judge(&j.ranks, j.world_size);
            }
        }
    }
}

/// A peer's CollectHoldings answer decoded from any bytes, read both ways
/// (a group's holdings, the job's view for a rank): taken or refused
/// naming what was wrong; what is taken stays within bounds, merges, and
/// goes back on the wire to the same.
pub(crate) fn peer_holdings(bytes: &[u8]) {
    use crate::peer_link::ckpt::collect_wire as w;
    let Ok(answer) = warden_proto::v1::Holdings::decode(bytes) else {
        return;
    };
    // Asked for three ranks, as a host's restores ask.
    let asked = [0, 1, 2];
    match w::view_from_pb(answer.clone(), &asked) {
        Err(e) => assert_says_something("peer view", &e),
        Ok(v) => {
            let again = w::view_from_pb(w::view_to_pb(&v), &asked).expect("a view taken goes back");
            assert_eq!(again, v, "a view round-trips");
        }
    }
    match w::holdings_from_pb(answer) {
        Err(e) => assert_says_something("peer holdings", &e),
        Ok(h) => {
            h.check().expect("holdings taken are within bounds");
            let again = w::holdings_from_pb(w::holdings_to_pb(&h)).expect("holdings go back");
            assert_eq!(again.steps, h.steps, "holdings round-trip");
            let mut all = crate::ckpt::holdings::Holdings::default();
            all.merge(h);
            all.check().expect("merged holdings are within bounds");
            let _ = all.for_ranks(&asked);
        }
    }
}

/// Kernel-log lines (`/dev/kmsg` records, dmesg and syslog forms).
pub(crate) fn kmsg_lines(bytes: &[u8]) {
    use crate::sources::kmsg::{Parsed, normalize_pci, parse_line};
    for line in text(bytes).lines() {
        if let Parsed::Event(e) = parse_line(line) {
            // An event carries what it was read from.
            let _ = format!("{e:?}");
        }
        let _ = normalize_pci(line);
    }
}

/// `dcgmi diag -j` output with any exit code.
pub(crate) fn dcgmi_json(bytes: &[u8]) {
    let code = bytes.last().map(|b| i32::from(*b));
    if let Err(e) = crate::sources::dcgm::diag::parse(&text(bytes), code) {
        assert_says_something("dcgmi", &e.to_string());
    }
}

/// The nvhcd socket: a request decoded from any bytes is answered, and the
/// answer's output is JSON (NVRx reads it).
pub(crate) fn nvhcd(bytes: &[u8]) {
    use warden_proto::nvhcd::HealthCheckRequest;
    let Ok(req) = HealthCheckRequest::decode(bytes) else {
        return;
    };
    let snapshot = warden_core::health::NodeSnapshot {
        status: warden_core::health::Status::Ok,
        components: Vec::new(),
        observed_at: std::time::SystemTime::now(),
        version: 0,
    };
    let _ = crate::api::nvhcd::answer(&snapshot, &req.args);
}

/// libtpu's answers: MetricResponse and GetTpuRuntimeStatusResponse decoded
/// from any bytes, read the way the source reads them, and judged.
pub(crate) fn tpu_runtime(bytes: &[u8]) {
    use crate::sources::tpu::runtime::{RuntimeReading, device_of, value_of};
    use warden_proto::tpu::monitoring::runtime as pb;
    let mut reading = RuntimeReading {
        port: 8431,
        ..RuntimeReading::default()
    };
    if let Ok(m) = pb::MetricResponse::decode(bytes) {
        for x in m.metric.iter().flat_map(|m| m.metrics.iter()) {
            if let (Some(d), Some(v)) = (device_of(x), value_of(x)) {
                reading.hbm_used.insert(d, v);
                reading.hbm_total.insert(d, v.abs() * 2.0);
                reading.duty_cycle.insert(d, v);
            }
        }
    }
    if let Ok(s) = pb::GetTpuRuntimeStatusResponse::decode(bytes) {
        reading.status_served = true;
        for (core, st) in s.core_states {
            if let Some(message) = st.error_message {
                reading
                    .core_errors
                    .push(crate::sources::tpu::runtime::CoreError {
                        core,
                        chip: None,
                        message,
                    });
            }
        }
    }
    let chips = vec![
        crate::sources::tpu::chips::Chip {
            pci: vec!["0000:00:04.0".into()],
            device_id: "0x0062".into(),
            generation: Some("v5p"),
            hbm_gib: Some(95),
            dev: None,
        };
        4
    ];
    let _ = crate::sources::tpu::judge(&chips, &[reading], &[], std::time::SystemTime::now());
}
