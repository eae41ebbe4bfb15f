//! torch's flight recorder, read: where each process group of a rank stands,
//! and which ranks are behind their peers on a hang.
//!
//! In: the JSON `torch._C._distributed_c10d._dump_fr_trace_json(True, True)`
//! returns (torch 2.15, format "2.10"; gloo records when
//! `TORCH_FR_BUFFER_SIZE` > 0), as bytes the agent read from a file a rank
//! wrote; and, for [`compare`], the positions of several ranks of one job.
//! Out: per process group, the last collective enqueued, started and
//! completed and the oldest one not completed ([`PgPosition`]); the ranks
//! behind on a group, each with a sentence of evidence ([`Behind`]).
//! Never: I/O, or trust in the input: a rank wrote it, so the size, the
//! number of entries and of groups are capped, and a malformed field is an
//! error naming it, never a panic. The caps hold while the JSON is read,
//! not after: past [`MAX_ENTRIES`] entries or [`MAX_PGS`] groups the rest
//! are only counted, and every string is cut to 256 bytes as it is read, so
//! the memory a dump costs is bounded by the caps, whatever it holds (16
//! MiB of `{}` entries once cost 790 MB).

use std::collections::{BTreeMap, HashMap};

use crate::signal::join_ranks as join;
use serde::Deserialize;

/// The most bytes of a dump parsed. torch keeps `TORCH_FR_BUFFER_SIZE`
/// entries (2000 by default for NCCL), about 600 bytes each: 16 MiB holds
/// ten times that.
pub const MAX_DUMP_BYTES: usize = 16 * 1024 * 1024;
/// The most entries accepted in one dump.
pub const MAX_ENTRIES: usize = 20_000;
/// The most process groups accepted in one dump.
pub const MAX_PGS: usize = 4096;
/// The longest process-group label or profiling name kept (bytes); longer
/// ones are cut.
const MAX_NAME: usize = 256;

/// Where one process group of one rank stands, from its flight recorder.
///
/// Why these fields: torch numbers every collective on a group
/// (`collective_seq_id`) in the same order on every rank, so the sequence
/// numbers of ranks of one group compare directly; the rank that enqueued
/// fewer is the one the others wait on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgPosition {
    /// The group, "name:description" as torch names it in the entries
    /// ("0:default_pg"); the id alone when the dump has no entry of it.
    pub pg: String,
    /// The sequence number of the last collective the rank issued on the
    /// group (`None`: none, torch's "-1").
    pub last_enqueued: Option<u64>,
    /// The last one the backend started (gloo does not track starts:
    /// always `None` there).
    pub last_started: Option<u64>,
    /// The last one that completed.
    pub last_completed: Option<u64>,
    /// The oldest collective of the group not completed, as
    /// "profiling_name #seq" ("gloo:all_reduce #42"), when the dump holds it.
    pub pending: Option<String>,
}

/// A rank behind its peers on one process group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behind {
    /// The rank.
    pub rank: u32,
    /// The group ([`PgPosition::pg`]).
    pub pg: String,
    /// The last collective it enqueued there (`None`: none).
    pub last_enqueued: Option<u64>,
    /// The highest any rank of the group enqueued.
    pub peers_at: u64,
    /// One sentence for a person: "rank 3 enqueued collective #41 on pg
    /// 0:default_pg, ranks 0,1,2 are at #42 (gloo:all_reduce)".
    pub evidence: String,
}

/// Why a dump could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FlightRecorderError {
    /// Larger than [`MAX_DUMP_BYTES`].
    #[error("flight-recorder dump of {len} bytes is over the {max}-byte cap (refused)")]
    TooLarge {
        /// Its size.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// Not JSON of the expected shape; `field` is the path to the value
    /// that is wrong ("pg_status.0.last_enqueued_collective").
    #[error("flight-recorder dump: bad value at {field}: {message}")]
    Malformed {
        /// Where.
        field: String,
        /// What serde said.
        message: String,
    },
    /// More entries or groups than the caps allow.
    #[error("flight-recorder dump has {count} {what}, over the cap of {max} (refused)")]
    TooMany {
        /// "entries" or "process groups".
        what: &'static str,
        /// How many it has.
        count: usize,
        /// The cap.
        max: usize,
    },
    /// A sequence number that is neither a non-negative integer nor -1.
    #[error("flight-recorder dump: {field} is {value:?}, not a sequence number or -1")]
    BadSeq {
        /// Where.
        field: String,
        /// The value.
        value: String,
    },
}

/// A sequence number as torch writes it: a string ("42", "-1") in
/// `pg_status`, an integer in entries.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Seq {
    Int(i64),
    Str(Name),
}

#[derive(Debug, Deserialize)]
struct PgStatus {
    #[serde(default)]
    last_enqueued_collective: Option<Seq>,
    #[serde(default)]
    last_started_collective: Option<Seq>,
    #[serde(default)]
    last_completed_collective: Option<Seq>,
}

#[derive(Debug, Deserialize)]
struct Entry {
    #[serde(default)]
    pg_id: Option<u64>,
    #[serde(default)]
    process_group: Option<(Name, Name)>,
    #[serde(default)]
    collective_seq_id: Option<u64>,
    #[serde(default)]
    is_p2p: bool,
    #[serde(default)]
    profiling_name: Name,
    #[serde(default)]
    state: Name,
}

#[derive(Debug, Deserialize)]
struct Dump {
    #[serde(default)]
    pg_status: Capped<BTreeMap<Name, PgStatus>>,
    #[serde(default)]
    entries: Capped<Vec<Entry>>,
}

/// A string of the dump kept to its first [`MAX_NAME`] bytes as it is
/// read: a rank's 16 MiB label costs the agent 256 bytes, not 16 MiB.
#[derive(Debug, Default, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Name(String);

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Name;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Name, E> {
                Ok(Name(clip(s)))
            }
        }
        d.deserialize_str(V)
    }
}

/// A list or map of the dump whose items are kept only up to a cap while
/// it is read: past the cap the rest are skipped (`IgnoredAny`, nothing
/// allocated) and only counted, so a dump of millions of `{}` entries
/// costs the agent its cap's worth of memory and a count, and the caller
/// refuses it with the real number ([`FlightRecorderError::TooMany`]).
#[derive(Debug, Default)]
struct Capped<T> {
    items: T,
    /// How many the input held in all.
    count: usize,
}

impl<'de> Deserialize<'de> for Capped<Vec<Entry>> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Capped<Vec<Entry>>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of entries")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Capped {
                    items: Vec::new(),
                    count: 0,
                };
                while out.count < MAX_ENTRIES {
                    match seq.next_element::<Entry>()? {
                        Some(e) => out.items.push(e),
                        None => return Ok(out),
                    }
                    out.count += 1;
                }
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    out.count += 1;
                }
                Ok(out)
            }
        }
        d.deserialize_seq(V)
    }
}

impl<'de> Deserialize<'de> for Capped<BTreeMap<Name, PgStatus>> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Capped<BTreeMap<Name, PgStatus>>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of process groups")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Capped {
                    items: BTreeMap::new(),
                    count: 0,
                };
                while out.count < MAX_PGS {
                    match map.next_entry::<Name, PgStatus>()? {
                        Some((k, v)) => {
                            out.items.insert(k, v);
                        }
                        None => return Ok(out),
                    }
                    out.count += 1;
                }
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {
                    out.count += 1;
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// Reads a dump: one [`PgPosition`] per group in `pg_status`, ordered by
/// group id. A dump of a recorder that is off (no groups) gives none.
pub fn parse(json: &[u8]) -> Result<Vec<PgPosition>, FlightRecorderError> {
    if json.len() > MAX_DUMP_BYTES {
        return Err(FlightRecorderError::TooLarge {
            len: json.len(),
            max: MAX_DUMP_BYTES,
        });
    }
    let de = &mut serde_json::Deserializer::from_slice(json);
    let dump: Dump =
        serde_path_to_error::deserialize(de).map_err(|e| FlightRecorderError::Malformed {
            field: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
    if dump.entries.count > MAX_ENTRIES {
        return Err(FlightRecorderError::TooMany {
            what: "entries",
            count: dump.entries.count,
            max: MAX_ENTRIES,
        });
    }
    if dump.pg_status.count > MAX_PGS {
        return Err(FlightRecorderError::TooMany {
            what: "process groups",
            count: dump.pg_status.count,
            max: MAX_PGS,
        });
    }
    let (entries, pg_status) = (dump.entries.items, dump.pg_status.items);
    // Per group id: its label and the entries of its collectives.
    let mut labels: HashMap<u64, String> = HashMap::new();
    let mut by_pg: HashMap<u64, Vec<&Entry>> = HashMap::new();
    for e in &entries {
        let Some(id) = e.pg_id else { continue };
        if let Some((name, desc)) = &e.process_group {
            labels
                .entry(id)
                .or_insert_with(|| clip(&format!("{}:{}", name.0, desc.0)));
        }
        if !e.is_p2p && e.collective_seq_id.is_some_and(|s| s > 0) {
            by_pg.entry(id).or_default().push(e);
        }
    }
    let mut out: Vec<(Option<u64>, PgPosition)> = Vec::with_capacity(pg_status.len());
    for (Name(key), st) in &pg_status {
        let field = |name: &str| format!("pg_status.{key}.{name}");
        let last_enqueued = seq(
            st.last_enqueued_collective.as_ref(),
            &field("last_enqueued_collective"),
        )?;
        let last_started = seq(
            st.last_started_collective.as_ref(),
            &field("last_started_collective"),
        )?;
        let last_completed = seq(
            st.last_completed_collective.as_ref(),
            &field("last_completed_collective"),
        )?;
        let id = key.parse::<u64>().ok();
        let pg = id
            .and_then(|id| labels.get(&id).cloned())
            .unwrap_or_else(|| clip(key));
        let pending = id
            .and_then(|id| by_pg.get(&id))
            .and_then(|entries| {
                entries
                    .iter()
                    .filter(|e| e.state.0 != "completed")
                    .filter_map(|e| e.collective_seq_id.map(|s| (s, e)))
                    .filter(|(s, _)| last_completed.is_none_or(|c| *s > c))
                    .min_by_key(|(s, _)| *s)
            })
            .map(|(s, e)| format!("{} #{s}", e.profiling_name.0));
        out.push((
            id,
            PgPosition {
                pg,
                last_enqueued,
                last_started,
                last_completed,
                pending,
            },
        ));
    }
    // Numeric ids in numeric order ("10" after "9"), others after them.
    out.sort_by(|a, b| (a.0.is_none(), a.0, &a.1.pg).cmp(&(b.0.is_none(), b.0, &b.1.pg)));
    Ok(out.into_iter().map(|(_, p)| p).collect())
}

/// A sequence number; `None` for -1 or a missing field.
fn seq(v: Option<&Seq>, field: &str) -> Result<Option<u64>, FlightRecorderError> {
    let bad = |value: String| FlightRecorderError::BadSeq {
        field: field.to_owned(),
        value,
    };
    match v {
        None => Ok(None),
        Some(Seq::Int(-1)) => Ok(None),
        Some(Seq::Int(n)) => u64::try_from(*n).map(Some).map_err(|_| bad(n.to_string())),
        Some(Seq::Str(Name(s))) => match s.trim().parse::<i64>() {
            Ok(-1) => Ok(None),
            Ok(n) => u64::try_from(n).map(Some).map_err(|_| bad(clip(s))),
            Err(_) => Err(bad(clip(s))),
        },
    }
}

fn clip(s: &str) -> String {
    if s.len() <= MAX_NAME {
        return s.to_owned();
    }
    let mut end = MAX_NAME;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The part of a group's label all ranks agree on: torch's group name
/// (before the ':'), so a rank whose dump lost the group's entries (its
/// label is the id alone) still matches its peers.
fn match_key(pg: &str) -> &str {
    pg.split_once(':').map_or(pg, |(name, _)| name)
}

/// One group across ranks: its richest label and each rank's position.
type Group<'a> = (&'a str, Vec<(u32, &'a PgPosition)>);

/// Matches ranks by process group and sequence number and names those
/// behind: on each group, a rank whose last enqueued collective is lower
/// than the highest any rank of that group enqueued. Only ranks whose dump
/// has the group count; a group where all agree names nobody. Ordered by
/// group, then rank.
pub fn compare(ranks: &[(u32, Vec<PgPosition>)]) -> Vec<Behind> {
    // Per group: its richest label and each rank's position.
    let mut groups: BTreeMap<&str, Group<'_>> = BTreeMap::new();
    for (rank, positions) in ranks {
        for p in positions {
            let g = groups
                .entry(match_key(&p.pg))
                .or_insert((p.pg.as_str(), Vec::new()));
            if p.pg.len() > g.0.len() {
                g.0 = p.pg.as_str();
            }
            g.1.push((*rank, p));
        }
    }
    let mut out = Vec::new();
    for (label, members) in groups.values() {
        let Some(top) = members.iter().filter_map(|(_, p)| p.last_enqueued).max() else {
            continue;
        };
        let mut leaders: Vec<u32> = members
            .iter()
            .filter(|(_, p)| p.last_enqueued == Some(top))
            .map(|(r, _)| *r)
            .collect();
        leaders.sort_unstable();
        leaders.dedup();
        // What the leaders wait in: their oldest collective not completed.
        let waiting_in = members
            .iter()
            .filter(|(_, p)| p.last_enqueued == Some(top))
            .find_map(|(_, p)| p.pending.as_deref())
            .map(|p| p.split(" #").next().unwrap_or(p).to_owned());
        let mut behind: Vec<(u32, Option<u64>)> = members
            .iter()
            .filter(|(_, p)| p.last_enqueued.is_none_or(|s| s < top))
            .map(|(r, p)| (*r, p.last_enqueued))
            .collect();
        behind.sort_unstable();
        behind.dedup_by_key(|(r, _)| *r);
        let who = join(&leaders);
        let verb = if leaders.len() == 1 { "is" } else { "are" };
        let noun = if leaders.len() == 1 { "rank" } else { "ranks" };
        let what = waiting_in.map_or_else(String::new, |w| format!(" ({w})"));
        for (rank, last) in behind {
            let did = match last {
                Some(s) => format!("enqueued collective #{s}"),
                None => "enqueued no collective".to_owned(),
            };
            out.push(Behind {
                rank,
                pg: (*label).to_owned(),
                last_enqueued: last,
                peers_at: top,
                evidence: format!(
                    "rank {rank} {did} on pg {label}, {noun} {who} {verb} at #{top}{what}"
                ),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two gloo ranks (tests/fixtures/flight_recorder/capture.py): rank 0
    /// waits in its 5th collective on the default group (an all_reduce),
    /// rank 1 is still computing before it.
    const RANK0: &[u8] = include_bytes!(
        "../../../tests/fixtures/flight_recorder/gloo_rank0_waiting_in_all_reduce.json"
    );
    const RANK1: &[u8] =
        include_bytes!("../../../tests/fixtures/flight_recorder/gloo_rank1_behind_in_compute.json");
    const OFF: &[u8] =
        include_bytes!("../../../tests/fixtures/flight_recorder/gloo_recorder_off.json");

    #[test]
    fn a_rank_waiting_in_an_all_reduce() {
        let p = parse(RANK0).expect("parse");
        assert_eq!(
            p,
            vec![
                PgPosition {
                    pg: "0:default_pg".into(),
                    last_enqueued: Some(5),
                    last_started: None,
                    last_completed: Some(4),
                    pending: Some("gloo:all_reduce #5".into()),
                },
                PgPosition {
                    pg: "1:undefined".into(),
                    last_enqueued: Some(1),
                    last_started: None,
                    last_completed: Some(1),
                    pending: None,
                },
            ]
        );
    }

    #[test]
    fn a_rank_behind_in_compute_has_nothing_pending() {
        let p = parse(RANK1).expect("parse");
        assert_eq!(p[0].pg, "0:default_pg");
        assert_eq!(p[0].last_enqueued, Some(4));
        assert_eq!(p[0].last_completed, Some(4));
        assert_eq!(p[0].pending, None);
    }

    #[test]
    fn a_recorder_that_is_off_gives_no_groups() {
        assert_eq!(parse(OFF).expect("parse"), vec![]);
    }

    #[test]
    fn the_rank_behind_is_named_with_evidence() {
        let ranks = vec![
            (0, parse(RANK0).expect("rank 0")),
            (1, parse(RANK1).expect("rank 1")),
        ];
        let b = compare(&ranks);
        assert_eq!(
            b,
            vec![Behind {
                rank: 1,
                pg: "0:default_pg".into(),
                last_enqueued: Some(4),
                peers_at: 5,
                evidence: "rank 1 enqueued collective #4 on pg 0:default_pg, rank 0 is at #5 (gloo:all_reduce)".into(),
            }]
        );
    }

    fn pos(pg: &str, enq: Option<u64>, pending: Option<&str>) -> PgPosition {
        PgPosition {
            pg: pg.into(),
            last_enqueued: enq,
            last_started: None,
            last_completed: enq.map(|s| s.saturating_sub(1)),
            pending: pending.map(str::to_owned),
        }
    }

    #[test]
    fn compare_matches_by_group_name_and_sorts_ranks() {
        let ranks = vec![
            (
                2,
                vec![pos("0:default_pg", Some(42), Some("gloo:all_reduce #42"))],
            ),
            (3, vec![pos("0", Some(41), None)]),
            (
                0,
                vec![pos("0:default_pg", Some(42), Some("gloo:all_reduce #42"))],
            ),
            (1, vec![pos("0:default_pg", Some(42), None)]),
            (4, vec![pos("0:default_pg", None, None)]),
        ];
        let b = compare(&ranks);
        let ev: Vec<&str> = b.iter().map(|b| b.evidence.as_str()).collect();
        assert_eq!(
            ev,
            vec![
                "rank 3 enqueued collective #41 on pg 0:default_pg, ranks 0,1,2 are at #42 (gloo:all_reduce)",
                "rank 4 enqueued no collective on pg 0:default_pg, ranks 0,1,2 are at #42 (gloo:all_reduce)",
            ]
        );
    }

    #[test]
    fn ranks_in_step_name_nobody() {
        let ranks = vec![
            (
                0,
                vec![
                    pos("0:default_pg", Some(7), None),
                    pos("1:tp", Some(3), None),
                ],
            ),
            (
                1,
                vec![
                    pos("0:default_pg", Some(7), None),
                    pos("1:tp", Some(3), None),
                ],
            ),
        ];
        assert_eq!(compare(&ranks), vec![]);
        assert_eq!(compare(&[]), vec![]);
        // A group no rank enqueued on names nobody either.
        assert_eq!(compare(&[(0, vec![pos("2:x", None, None)])]), vec![]);
    }

    #[test]
    fn bad_inputs_are_refused_naming_the_field() {
        let e = parse(b"not json").expect_err("garbage").to_string();
        assert!(e.contains("bad value"), "{e}");
        let e = parse(br#"{"pg_status":{"0":{"last_enqueued_collective":"abc"}}}"#)
            .expect_err("bad seq")
            .to_string();
        assert!(e.contains("pg_status.0.last_enqueued_collective"), "{e}");
        let e = parse(br#"{"pg_status":{"0":{"last_completed_collective":"-7"}}}"#)
            .expect_err("negative")
            .to_string();
        assert!(e.contains("last_completed_collective"), "{e}");
        let e = parse(br#"{"entries":[{"pg_id":"zero"}]}"#)
            .expect_err("bad pg_id")
            .to_string();
        assert!(e.contains("entries[0].pg_id"), "{e}");
        let e = parse(br#"{"pg_status":[]}"#)
            .expect_err("a list")
            .to_string();
        assert!(e.contains("pg_status"), "{e}");
        let e = parse(br#"{"entries":[{"collective_seq_id":-3}]}"#)
            .expect_err("negative id")
            .to_string();
        assert!(e.contains("entries[0].collective_seq_id"), "{e}");
    }

    #[test]
    fn caps_are_enforced() {
        let big = vec![b' '; MAX_DUMP_BYTES + 1];
        assert!(matches!(
            parse(&big),
            Err(FlightRecorderError::TooLarge { .. })
        ));
        let many = format!(
            "{{\"entries\":[{}]}}",
            vec!["{}"; MAX_ENTRIES + 1].join(",")
        );
        assert!(matches!(
            parse(many.as_bytes()),
            Err(FlightRecorderError::TooMany {
                what: "entries",
                count,
                ..
            }) if count == MAX_ENTRIES + 1
        ));
        // The dump of issue 29: the whole cap of empty entries, refused
        // with their real number (only the first MAX_ENTRIES were kept).
        let n = (MAX_DUMP_BYTES - 16) / 3;
        let mut huge = String::with_capacity(MAX_DUMP_BYTES);
        huge.push_str("{\"entries\":[{}");
        for _ in 1..n {
            huge.push_str(",{}");
        }
        huge.push_str("]}");
        assert!(huge.len() <= MAX_DUMP_BYTES, "{}", huge.len());
        assert!(matches!(
            parse(huge.as_bytes()),
            Err(FlightRecorderError::TooMany {
                what: "entries",
                count,
                ..
            }) if count == n
        ));
        let pgs: Vec<String> = (0..=MAX_PGS).map(|i| format!("\"{i}\":{{}}")).collect();
        let many = format!("{{\"pg_status\":{{{}}}}}", pgs.join(","));
        assert!(matches!(
            parse(many.as_bytes()),
            Err(FlightRecorderError::TooMany {
                what: "process groups",
                ..
            })
        ));
    }

    #[test]
    fn long_names_are_cut_as_they_are_read() {
        let long = "x".repeat(1 << 20);
        let dump = format!(
            r#"{{"pg_status":{{"0":{{"last_enqueued_collective":"2"}}}},"entries":[{{"pg_id":0,"process_group":["{long}","d"],"collective_seq_id":2,"profiling_name":"{long}","state":"scheduled"}}]}}"#
        );
        let p = parse(dump.as_bytes()).expect("parse");
        assert_eq!(p[0].pg.len(), MAX_NAME, "{}", p[0].pg.len());
        let pending = p[0].pending.as_deref().expect("pending");
        assert_eq!(pending, format!("{} #2", "x".repeat(MAX_NAME)));
    }

    #[test]
    fn integers_and_missing_fields_are_accepted() {
        let p = parse(
            br#"{"pg_status":{"3":{"last_enqueued_collective":9,"last_completed_collective":-1}},"extra":1}"#,
        )
        .expect("parse");
        assert_eq!(
            p,
            vec![PgPosition {
                pg: "3".into(),
                last_enqueued: Some(9),
                last_started: None,
                last_completed: None,
                pending: None,
            }]
        );
    }
}
