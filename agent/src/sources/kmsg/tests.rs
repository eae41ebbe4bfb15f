//! The parser on recorded lines, and the source on a file it follows.

use std::io::Write;

use super::*;
use crate::sources::Source;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/kmsg");

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{name}"))
        .unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

fn events_of(name: &str) -> Vec<KernelEvent> {
    fixture(name)
        .lines()
        .filter_map(|l| match parse_line(l) {
            Parsed::Event(e) => Some(e),
            _ => None,
        })
        .collect()
}

#[test]
fn xid_79_from_dev_kmsg_records() {
    let evs = events_of("xid_79_fallen_off_bus.kmsg.log");
    assert_eq!(
        evs,
        vec![KernelEvent::Xid {
            pci: "0000:3b:00".into(),
            xid: 79,
            pid: Some(1234),
            name: Some("python".into()),
            text: "GPU has fallen off the bus.".into(),
        }]
    );
}

#[test]
fn dmesg_xids_with_unknown_pids_and_long_domains() {
    let evs = events_of("dmesg_xids_mixed.log");
    let xids: Vec<(String, u32, Option<u32>)> = evs
        .iter()
        .map(|e| match e {
            KernelEvent::Xid { pci, xid, pid, .. } => (pci.clone(), *xid, *pid),
            other => panic!("not an XID: {other:?}"),
        })
        .collect();
    assert_eq!(
        xids,
        vec![
            ("0000:3b:00".into(), 13, Some(20414)),
            ("0000:3b:00".into(), 13, Some(20414)),
            ("0000:86:00".into(), 31, Some(31337)),
            ("0000:86:00".into(), 48, None),
            ("0000:b7:00".into(), 94, Some(8812)),
            ("0000:b7:00".into(), 74, None),
            ("0000:db:00".into(), 119, Some(1412)),
        ]
    );
    let KernelEvent::Xid { name, text, .. } = &evs[3] else {
        unreachable!()
    };
    assert_eq!(*name, None);
    assert!(
        text.starts_with("An uncorrectable double bit error"),
        "{text}"
    );
}

#[test]
fn oom_kills_from_both_line_forms() {
    let evs = events_of("oom_kill.log");
    assert_eq!(
        evs,
        vec![
            KernelEvent::OomKill {
                pid: 4242,
                name: "python".into()
            },
            KernelEvent::OomKill {
                pid: 4242,
                name: "python".into()
            },
            KernelEvent::OomKill {
                pid: 5151,
                name: "torchrun".into()
            },
        ]
    );
}

#[test]
fn nic_link_changes() {
    let evs = events_of("link_flap.log");
    let link = |nic: &str, up| KernelEvent::Link {
        nic: nic.into(),
        up,
    };
    assert_eq!(
        evs,
        vec![
            link("ens1np0", false),
            link("ens1np0", true),
            link("ib0", false),
            link("eno1", false),
            link("eno1", true),
        ]
    );
}

#[test]
fn garbage_is_other_or_malformed_never_a_panic() {
    let text = String::from_utf8_lossy(&std::fs::read(format!("{FIXTURES}/garbage.log")).unwrap())
        .into_owned();
    let parsed: Vec<Parsed> = text.lines().map(parse_line).collect();
    assert!(
        parsed.iter().all(|p| !matches!(p, Parsed::Event(_))),
        "{parsed:?}"
    );
    assert!(
        parsed.iter().filter(|p| **p == Parsed::Malformed).count() >= 4,
        "{parsed:?}"
    );
}

#[test]
fn xid_table() {
    for x in [48, 62, 64, 74, 79, 95, 119, 120, 140] {
        assert_eq!(xid_verdict(x).0, Status::Failed, "XID {x}");
    }
    for x in [8, 63, 92, 94, 109, 9999] {
        assert_eq!(xid_verdict(x).0, Status::Degraded, "XID {x}");
    }
    // Application errors say nothing bad about the GPU on their own.
    for x in [13, 31, 43, 45, 68] {
        assert_eq!(
            xid_verdict(x),
            (Status::Ok, if x == 45 { "follow_up" } else { "user_error" }),
            "XID {x}"
        );
    }
}

#[test]
fn pci_addresses_normalise() {
    for s in [
        "0000:3b:00",
        "0000:3B:00.0",
        "00000000:3B:00.0",
        "3b:00",
        "PCI:0000:3b:00",
    ] {
        assert_eq!(normalize_pci(s).as_deref(), Some("0000:3b:00"), "{s}");
    }
    assert_eq!(normalize_pci("zz:00"), None);
    assert_eq!(normalize_pci(""), None);
}

fn cfg(path: &Path) -> KmsgConfig {
    KmsgConfig {
        path: path.display().to_string(),
        gpu_pci: vec!["0000:1a:00".into(), "0000:3b:00".into()],
        xid_hold: Duration::from_secs(60),
        ..KmsgConfig::default()
    }
}

fn status(poll: &crate::sources::Poll, id: &str) -> Option<Status> {
    poll.reports.iter().find(|r| r.id == id).map(|r| {
        r.status_override.unwrap_or_else(|| {
            r.reasons
                .iter()
                .map(|r| r.status)
                .max()
                .unwrap_or(Status::Ok)
        })
    })
}

#[test]
fn follows_a_file_from_its_end_and_holds_an_xid_for_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kern.log");
    std::fs::write(&path, fixture("xid_79_fallen_off_bus.kmsg.log")).unwrap();
    let mut src = Kmsg::new(cfg(&path));
    let t0 = SystemTime::now();
    let first = src.poll(t0);
    assert!(
        first.events.is_empty(),
        "old lines replayed: {:?}",
        first.events
    );
    assert_eq!(status(&first, COMPONENT), Some(Status::Ok));

    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"NVRM: Xid (PCI:0000:3b:00): 79, pid=77, name=python, GPU has fallen off the bus.\nhalf a li").unwrap();
    let p = src.poll(t0 + Duration::from_secs(1));
    assert_eq!(p.events.len(), 1);
    let e = &p.events[0];
    let e = &e.render();
    assert_eq!((e.kind, e.subject.as_str()), ("kmsg.xid", "gpu1"));
    // Its health reason is an XID to attribution, as the source says.
    let gpu1 = p
        .reports
        .iter()
        .find(|r| r.id == "gpu1")
        .expect("gpu1's report");
    assert_eq!(
        gpu1.reasons.iter().map(|r| r.kind).collect::<Vec<_>>(),
        [warden_core::health::ReasonKind::Xid]
    );
    let ev = |k: &str| {
        e.evidence
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(ev("pci"), Some("0000:3b:00"));
    assert_eq!(ev("xid"), Some("79"));
    assert_eq!(ev("pid"), Some("77"));
    assert_eq!(status(&p, "gpu1"), Some(Status::Failed));

    // Still held within the window, cleared after it.
    let p = src.poll(t0 + Duration::from_secs(30));
    assert_eq!(status(&p, "gpu1"), Some(Status::Failed));
    let p = src.poll(t0 + Duration::from_secs(62));
    assert_eq!(status(&p, "gpu1"), Some(Status::Ok));

    // The partial line completes later.
    f.write_all(b"ne\nOut of memory: Killed process 9 (python)\n")
        .unwrap();
    let p = src.poll(t0 + Duration::from_secs(63));
    assert_eq!(p.events.len(), 1, "{:?}", p.events);
    assert_eq!(p.events[0].kind(), "kmsg.oom_kill");
    assert_eq!(status(&p, OOM_COMPONENT), Some(Status::Degraded));
}

#[test]
fn reads_from_the_start_when_asked_and_maps_unknown_pci() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kern.log");
    std::fs::write(&path, fixture("dmesg_xids_mixed.log")).unwrap();
    let mut src = Kmsg::new(KmsgConfig {
        from_start: true,
        ..cfg(&path)
    });
    let p = src.poll(SystemTime::now());
    assert_eq!(p.events.len(), 7);
    // XID 13 alone is the application's: the GPU stays OK, with the reason noted.
    assert_eq!(status(&p, "gpu1"), Some(Status::Ok), "XID 13 only");
    assert_eq!(status(&p, "gpu-0000:86:00"), Some(Status::Failed), "XID 48");
}

#[test]
fn links_go_down_and_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kern.log");
    std::fs::write(&path, fixture("link_flap.log")).unwrap();
    let mut src = Kmsg::new(KmsgConfig {
        from_start: true,
        ..cfg(&path)
    });
    let p = src.poll(SystemTime::now());
    let kinds: Vec<&str> = p.events.iter().map(|e| e.kind()).collect();
    assert_eq!(
        kinds,
        [
            "kmsg.link_down",
            "kmsg.link_up",
            "kmsg.link_down",
            "kmsg.link_down",
            "kmsg.link_up"
        ]
    );
    assert_eq!(status(&p, "nic/ib0"), Some(Status::Failed));
    assert_eq!(status(&p, "nic/eno1"), Some(Status::Ok));
}

#[test]
fn an_unreadable_log_is_unknown_not_fatal() {
    let mut src = Kmsg::new(cfg(Path::new("/nonexistent/kmsg")));
    let p = src.poll(SystemTime::now());
    assert_eq!(status(&p, COMPONENT), Some(Status::Unknown));
    let r = &p.reports[0].reasons[0];
    assert!(r.message.contains("/nonexistent/kmsg"), "{}", r.message);
}

#[test]
fn config_validation_names_the_key() {
    let bad = KmsgConfig {
        gpu_pci: vec!["nonsense".into()],
        ..KmsgConfig::default()
    };
    let e = bad.validate("t").unwrap_err().to_string();
    assert!(e.contains("kmsg.gpu_pci"), "{e}");
}
