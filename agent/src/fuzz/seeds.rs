//! Valid inputs of every target, the starting points of the structure-aware
//! mutations: recorded files where the repository has them (the shipped
//! config, the kernel-log fixtures), otherwise made by the agent's own
//! writers (a manifest, journals, a slot, shard frames), so a seed is what
//! the agent really reads.

use std::time::SystemTime;

use prost::Message;
use serde_json::Value;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

/// The shipped, documented config and two small ones.
pub(crate) fn config() -> Vec<Vec<u8>> {
    vec![
        include_bytes!("../../../systemd/wardend.toml").to_vec(),
        b"[agent]\ntick = \"100ms\"\n[ranks]\nmax_ranks = 8\n".to_vec(),
        b"[policy]\nmax_restarts = 3\n[kmsg]\nenabled = false\n".to_vec(),
    ]
}

/// [`config`] as TOML tables (those that parse).
pub(crate) fn config_tables() -> Vec<toml::Table> {
    config()
        .iter()
        .filter_map(|b| std::str::from_utf8(b).ok()?.parse().ok())
        .collect()
}

/// The bytes of a slot memory (its header and its one slot), read
/// through a duplicate of its descriptor.
fn memory_bytes(m: &warden_slot::SlotMemory) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    use warden_slot::memory_len;
    let f = std::fs::File::from(m.fd().try_clone_to_owned().expect("dup"));
    let mut bytes = vec![0u8; usize::try_from(memory_len()).expect("length")];
    f.read_exact_at(&mut bytes, 0)
        .expect("read the slot memory");
    bytes
}

/// A slot memory's header as the agent stamps it, and its length.
pub(crate) fn slot_header() -> Vec<Vec<u8>> {
    use warden_slot::{HEADER_SIZE, SlotMemory, memory_len};
    let m = SlotMemory::create().expect("create a slot memory");
    let mut seed = memory_bytes(&m)[..HEADER_SIZE].to_vec();
    seed.extend_from_slice(&memory_len().to_le_bytes());
    vec![seed]
}

/// A claimed slot a rank has written steps and sections into.
pub(crate) fn slot_record() -> Vec<Vec<u8>> {
    use warden_slot::{SLOT_SIZE, SlotTable, slot_offset};
    let slots = SlotTable::new(1).expect("a slot table");
    slots.claim(0, 7, 1234).expect("claim");
    let w = slots.writer(0).expect("writer");
    for step in 0..70u64 {
        w.step_begin(step, step * 1000);
        w.section_open(2, step * 1000 + 10);
        w.section_open(9, step * 1000 + 20);
        w.section_close(9, step * 1000 + 30);
        w.section_close(2, step * 1000 + 40);
        w.step_end(step, step * 1000 + 900);
        w.heartbeat();
    }
    let bytes = memory_bytes(slots.memory(0).expect("claimed, so made"));
    let at = usize::try_from(slot_offset(0)).expect("offset");
    vec![bytes[at..at + SLOT_SIZE].to_vec()]
}

/// A manifest as the tier writes it.
pub(crate) fn manifest() -> Vec<Vec<u8>> {
    let m = crate::ckpt::manifest::Manifest {
        job_id: "team/llama".into(),
        step: 1200,
        rank: 3,
        world_size: 8,
        size_bytes: 1 << 30,
        xxh3: crate::ckpt::manifest::hex(0x0123_4567_89ab_cdef),
        origin: "host-a".into(),
        committed_unix: 1_763_900_000,
    };
    vec![serde_json::to_vec_pretty(&m).expect("serialise")]
}

/// An incident journal with two records, as the store writes it.
pub(crate) fn incident_journal() -> Vec<Vec<u8>> {
    use warden_core::attribute::{Diagnosis, FaultClass, IncidentKind, IncidentRecord};
    let t = tempfile::tempdir().expect("temp dir");
    let mut store = warden_core::attribute::store::IncidentStore::load(
        t.path(),
        t.path().join("node-condition.json"),
        10,
    );
    for (id, job) in [("inc-1", "a"), ("inc-2", "b")] {
        store.upsert(
            IncidentRecord {
                id: id.into(),
                opened_at: SystemTime::UNIX_EPOCH,
                updated_at: SystemTime::UNIX_EPOCH,
                kind: IncidentKind::Crash,
                host: "h".into(),
                job: job.into(),
                ranks: vec![1],
                devices: vec!["gpu1".into()],
                diagnosis: Diagnosis {
                    class: FaultClass::UserError,
                    confidence: 0.8,
                    summary: "s".into(),
                    rule: "r".into(),
                    evidence: Vec::new(),
                },
                decision: None,
                superseded: Vec::new(),
                signature: "sig".into(),
                step: Some(3),
                exit_code: Some(1),
                waited_on: Vec::new(),
            },
            true,
        );
    }
    vec![std::fs::read(t.path().join("incidents.jsonl")).expect("the journal")]
}

/// A goodput journal as the agent flushes it: a job with a rank that
/// registered, stepped and was flagged a straggler.
pub(crate) fn goodput_journal() -> Vec<Vec<u8>> {
    use warden_core::goodput::{Ledger, StepObs};
    let t = tempfile::tempdir().expect("temp dir");
    let (mut j, _, _) = warden_core::goodput::journal::Journal::open(t.path()).expect("open");
    let mut l = Ledger::default();
    l.registered("job", 0, 10, 0, 1_000);
    l.step(
        "job",
        0,
        StepObs {
            pid: 10,
            step: 0,
            start_ns: 2_000,
            duration_ns: 5_000,
            data_ns: 100,
        },
    );
    l.straggler("job", 0, true);
    j.flush(&mut l).expect("flush");
    vec![std::fs::read(j.path_of("job")).expect("the journal")]
}

/// Two chunks of a shard, framed as PushShard sends them.
pub(crate) fn shard_framing() -> Vec<Vec<u8>> {
    use warden_proto::v1 as pb;
    let info = pb::ShardInfo {
        job_id: "j".into(),
        step: 7,
        rank: 1,
        world_size: 2,
        size_bytes: 300,
        xxh3: 99,
        origin: "h".into(),
    };
    let mut seed = Vec::new();
    for (info, data) in [(Some(info), vec![1u8; 100]), (None, vec![2u8; 200])] {
        let (head, data) = crate::peer_link::ckpt::wire::chunk_frames(pb::ShardChunk {
            info,
            data: data.into(),
        })
        .expect("frame");
        seed.extend_from_slice(&head);
        seed.extend_from_slice(&data);
    }
    // The first byte sets the piece size in the target; 7 splits frames.
    let mut split = vec![7u8];
    split.extend_from_slice(&seed[1..]);
    vec![seed, split]
}

/// Answers a hook gives.
pub(crate) fn hook_output() -> Vec<Vec<u8>> {
    vec![
        br#"{"action": "cordon", "reason": "xid 79 on gpu 3: spare available"}"#.to_vec(),
        br#"{"action": "default"}"#.to_vec(),
        br#"{"reason": "nothing to add", "extra": [1, 2]}"#.to_vec(),
    ]
}

/// Flight-recorder dumps captured from real gloo ranks (torch 2.15).
pub(crate) fn flight_recorder() -> Vec<Vec<u8>> {
    [
        "gloo_rank0_waiting_in_all_reduce.json",
        "gloo_rank1_behind_in_compute.json",
        "gloo_recorder_off.json",
    ]
    .iter()
    .map(|n| {
        let p = format!("{FIXTURES}/flight_recorder/{n}");
        std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
    })
    .collect()
}

/// A peer's batch with positions: a hang snapshot of two ranks, one
/// frozen, with flight-recorder groups.
pub(crate) fn peer_positions() -> Vec<Vec<u8>> {
    use prost::Message;
    use warden_proto::v1 as pb;
    let rank = |r: u32, section: &str, state: &str, seq: u64| pb::RankPosition {
        global_rank: r,
        step: 12,
        section: section.into(),
        stalled: true,
        stalled_ms: 4000,
        process_state: state.into(),
        groups: vec![pb::GroupSeq {
            group: "0:default_pg".into(),
            enqueued: seq,
            pending: format!("gloo:all_reduce #{seq}"),
        }],
    };
    let batch = pb::StragglerSummaries {
        host: "host-b".into(),
        ranks: Vec::new(),
        positions: vec![pb::JobPositions {
            job_id: "j".into(),
            world_size: 4,
            hang: true,
            taken_at_unix_ms: 1_700_000_000_000,
            ranks: vec![
                rank(2, "allreduce", "S (sleeping)", 13),
                rank(3, "compute", "T (stopped)", 12),
            ],
            flight_recorder_pending: false,
        }],
        values: vec![pb::RankValues {
            job_id: "j".into(),
            global_rank: 3,
            generation: 1,
            steps: vec![pb::StepValue {
                step: 12,
                loss: Some(2.5),
                grad_norm: Some(f64::NAN),
                loss_departs_own: false,
                grad_norm_departs_own: false,
            }],
        }],
    };
    vec![batch.encode_to_vec()]
}

/// The recorded kernel logs.
pub(crate) fn kmsg_lines() -> Vec<Vec<u8>> {
    let dir = format!("{FIXTURES}/kmsg");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .filter_map(|e| Some(e.ok()?.path()))
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

/// `dcgmi diag -j` output of DCGM 4 (a pass, a failure) and 3.
pub(crate) fn dcgmi_json() -> Vec<Vec<u8>> {
    vec![
        br#"{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [
        {"category": "Deployment", "tests": [{"name": "software", "results": [
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"}],
            "test_summary": {"status": "Pass"}}]}]}}"#
            .to_vec(),
        br#"{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [
        {"category": "Hardware", "tests": [{"name": "memory", "results": [
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Fail",
             "warnings": [{"warning": "Memory test found 3 uncorrectable errors on GPU 1", "error_id": 4,
                           "error_category": 2, "error_severity": "isolate"}]}],
            "test_summary": {"status": "Fail"}}]}]}}"#
            .to_vec(),
        br#"{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Integration", "tests": [
            {"name": "PCIe", "results": [{"gpu_id": "2", "status": "Fail", "info": "link down"}]}]}]}}"#
            .to_vec(),
    ]
}

/// The request NVRx's NodeHealthCheck sends.
pub(crate) fn nvhcd() -> Vec<Vec<u8>> {
    let req = warden_proto::nvhcd::HealthCheckRequest {
        args: vec!["--no-slurm".into()],
    };
    vec![req.encode_to_vec()]
}

/// A MetricResponse for HBM usage of two devices, as libtpu answers.
pub(crate) fn tpu_runtime() -> Vec<Vec<u8>> {
    use warden_proto::tpu::monitoring::runtime as pb;
    let metric = |device: i64, attr: pb::attr_value::Attr, value: f64| pb::Metric {
        attribute: Some(pb::Attribute {
            key: "device-id".into(),
            value: Some(pb::AttrValue {
                attr: Some(if device == 0 {
                    attr
                } else {
                    pb::attr_value::Attr::IntAttr(device)
                }),
            }),
        }),
        measure: Some(pb::metric::Measure::Gauge(pb::Gauge {
            value: Some(pb::gauge::Value::AsDouble(value)),
        })),
        ..pb::Metric::default()
    };
    let resp = pb::MetricResponse {
        metric: Some(pb::TpuMetric {
            name: crate::sources::tpu::runtime::HBM_USAGE.into(),
            description: "HBM in use".into(),
            metrics: vec![
                metric(0, pb::attr_value::Attr::StringAttr("0".into()), 1e9),
                metric(1, pb::attr_value::Attr::IntAttr(1), 2e9),
            ],
        }),
    };
    vec![resp.encode_to_vec()]
}

/// Each seed parsed as one JSON document.
pub(crate) fn json(seeds: &[Vec<u8>]) -> Vec<Value> {
    seeds
        .iter()
        .map(|s| serde_json::from_slice(s).expect("a JSON seed"))
        .collect()
}

/// Each line of each seed as a JSON document.
pub(crate) fn json_lines(seeds: &[Vec<u8>]) -> Vec<Value> {
    seeds
        .iter()
        .flat_map(|s| {
            String::from_utf8_lossy(s)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| serde_json::from_str(l).expect("a JSON line"))
                .collect::<Vec<Value>>()
        })
        .collect()
}

/// A group's CollectHoldings answer (two hosts, two steps, one unreachable)
/// and the job's view for one rank.
pub(crate) fn peer_holdings() -> Vec<Vec<u8>> {
    use crate::ckpt::holdings::Holdings;
    use crate::peer_link::ckpt::collect_wire as w;
    use prost::Message;
    let mut h = Holdings::default();
    let a = h.host("10.0.0.1:7411", "node-1");
    let b = h.host("10.0.0.2:7411", "node-2");
    h.add(a, 100, 0, 4);
    h.add(a, 100, 1, 4);
    h.add(b, 100, 0, 4);
    h.add(b, 200, 2, 4);
    h.unreachable
        .push("peer 10.0.0.3:7411: no answer within 2s".into());
    vec![
        w::holdings_to_pb(&h).encode_to_vec(),
        w::view_to_pb(&h.for_ranks(&[0, 2])).encode_to_vec(),
    ]
}
