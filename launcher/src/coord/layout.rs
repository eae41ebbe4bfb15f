//! Who is in a round, stored apart from the round (issue 30, point 5).
//!
//! A round record used to carry every member's assignment. Every host
//! watches the job's keys, so each restart round sent the whole member list
//! to every host: 229 KB to each of 2,048 hosts, 469 MB through etcd per
//! round, and past about 7,600 hosts a record over etcd's 1.5 MiB request
//! limit. Most rounds do not change who is in them (a restart after a
//! worker's failure keeps every host), and those that do change one or two.
//!
//! So the member list lives in a **layout**: a base list, written in chunks
//! under `layouts/<base>/<chunk>` only when a round needs a new one, and a
//! short **delta** in each round record that says how this round's members
//! are made from the base (runs of base members kept in order, and members
//! not in the base). A restart round repeats the delta (a few bytes); a
//! lost host or a spare's swap adds a run or a member; only when the delta
//! would pass [`MAX_SEGMENTS`] (or there is no base yet) does the writer
//! write a new base. Every host keeps the current base in memory (it needs
//! the members anyway: node ranks, checkpoint peers, the lost-member
//! checks), so a round costs each host its header, and a new base costs
//! each host the list once.
//!
//! In: the base's members and a round's members. Out: the delta, or the
//! round's members from a base and a delta, or a base in chunks.
//! Never: trust a stored delta (every run is checked against the base's
//! length, and a member count against the record's); make a chunk over
//! [`CHUNK_BYTES`] unless one member alone is larger.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::records::RoundMember;

/// Most segments a round's delta may hold before the writer writes a new
/// base: each change of membership adds one to three, so a base serves
/// tens of changes, and a header stays a few KB.
pub const MAX_SEGMENTS: usize = 64;

/// Target size of one stored chunk of a base: well under etcd's default
/// 1.5 MiB request limit, and a page of 256 of them (a paged read) well
/// under the clients' receive limit.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// Most chunks one base may have: 16,384 hosts of the largest member
/// record warden writes take under 40.
pub const MAX_CHUNKS: u32 = 4096;

/// Where a round's members come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutRef {
    /// The base's name: `<epoch:020>-<writer host>`, its key segment under
    /// `layouts/`.
    pub base: String,
    /// How many chunks the base was written in (`0..chunks`).
    pub chunks: u32,
    /// How many members the base holds.
    pub len: u32,
    /// This round's members, made from the base.
    pub segments: Vec<Segment>,
}

/// A piece of a round's member list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Segment {
    /// `len` members of the base from index `from`, in order.
    Base {
        /// First index in the base.
        from: u32,
        /// How many.
        len: u32,
    },
    /// A member not in the base (a spare swapped in, a host that joined, a
    /// member under a new lease).
    New(RoundMember),
}

/// Why a stored layout cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A run of base members past the base's end.
    #[error("segment {index} takes base members {from}..{end}, but the base holds {len}")]
    OutOfBase {
        /// The segment's place.
        index: usize,
        /// Its first index.
        from: u32,
        /// One past its last.
        end: u64,
        /// The base's length.
        len: usize,
    },
    /// The base read back has another length than the record says.
    #[error("the base holds {got} members, the round record says {want}")]
    BaseLength {
        /// What was read.
        got: usize,
        /// What the record says.
        want: u32,
    },
    /// The members made are not the count the record says.
    #[error("the layout makes {got} members, the round record says nnodes {want}")]
    Count {
        /// What the segments made.
        got: usize,
        /// The record's `nnodes`.
        want: u32,
    },
    /// More chunks than any base has.
    #[error("{0} chunks; at most {MAX_CHUNKS}")]
    TooManyChunks(u32),
    /// The members made are not those the writer digested: a base or a
    /// delta that is not the one the record was written against (or, for
    /// the hosts' digest, a record whose two digests disagree).
    #[error("the members made digest to {got}, the round record says {want}")]
    Digest {
        /// The digest of the members made.
        got: String,
        /// The record's `members_digest`.
        want: String,
    },
    /// The record says every member runs `want` workers, and one does not.
    #[error(
        "member {index} ({host}) runs {got} workers, the round record says every member runs {want}"
    )]
    Nproc {
        /// The member's node rank.
        index: usize,
        /// Its host id.
        host: String,
        /// Its workers.
        got: u32,
        /// The record's `nproc`.
        want: u32,
    },
    /// A round record whose world size is not its hosts times the
    /// workers it says each runs.
    #[error(
        "the round record's world size is {world_size}, not its {nnodes} hosts x {nproc} workers"
    )]
    WorldSize {
        /// The record's `world_size`.
        world_size: u32,
        /// Its `nnodes`.
        nnodes: u32,
        /// Its `nproc`.
        nproc: u32,
    },
}

/// The scheme [`digest`] writes: its name leads the digest, so a reader
/// that does not know a later scheme leaves it unchecked rather than
/// refusing every round a newer launcher writes. A change of the hash or
/// of the fields hashed is a new scheme name: readers of this version
/// would otherwise refuse every round it writes.
const DIGEST_SCHEME: &str = "xxh3-128:";

/// A digest of `members` in node-rank order, of what makes each one's place
/// and environment: host id, address, workers, lease and incarnation (not
/// the checkpoint peer, which does not move a rank). Fields are separated
/// by NUL and members ended by a newline, neither of which a host id or an
/// address holds. A round record carries it so that a host can tell the
/// members it made from a base and a delta are the writer's, and, once
/// hosts stop reading whole bases (issue 30's partial views), that two
/// rounds hold the same members without either list.
///
/// Not a defence against a writer of the job's keys (it could write the
/// digest too): against a base or delta that is not the one the record was
/// written against, which would give hosts ranks that disagree.
pub fn digest(members: &[RoundMember]) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    for m in members {
        h.update(m.host.as_bytes());
        h.update(b"\0");
        h.update(m.addr.as_bytes());
        h.update(b"\0");
        h.update(&m.nproc_per_node.to_le_bytes());
        h.update(&m.lease.to_le_bytes());
        h.update(&m.incarnation.to_le_bytes());
        h.update(b"\n");
    }
    format!("{DIGEST_SCHEME}{:032x}", h.digest128())
}

/// The scheme [`hosts_digest`] writes; see [`DIGEST_SCHEME`]. 64 bits: it
/// tells two rounds' hosts apart, where a collision would only make a
/// changed set of hosts restart where it could have healed (1 in 2^64 for
/// two different lists), and it is in every record every host reads.
const HOSTS_DIGEST_SCHEME: &str = "xxh3-64:";

/// Whether `d` is a [`hosts_digest`] of the scheme this launcher writes
/// (and checks against the members it makes).
pub fn is_hosts_digest(d: &str) -> bool {
    d.starts_with(HOSTS_DIGEST_SCHEME)
}

/// A digest of the members' host ids alone, in node-rank order: two rounds
/// with the same hosts in the same places have the same one, whatever their
/// leases, incarnations or addresses. It is what a host compares to know
/// whether another host took a place (`keeps_place` in the launcher's etcd
/// flow) without either round's member list, which a host will not hold
/// once it reads only its part of a base (issue 30's partial views).
/// [`digest`] cannot serve: a launcher relaunched under the same host id
/// has a new lease, and is a restart of the same hosts, not a swap.
pub fn hosts_digest(members: &[RoundMember]) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    for m in members {
        h.update(m.host.as_bytes());
        h.update(b"\n");
    }
    format!("{HOSTS_DIGEST_SCHEME}{:016x}", h.digest())
}

/// Checks `members` against a record's `members_digest` and
/// `hosts_digest`: each passes when empty (a launcher before it) or of a
/// scheme this one does not know.
pub fn check_digest(
    members: &[RoundMember],
    want: &str,
    want_hosts: &str,
) -> Result<(), LayoutError> {
    type Make = fn(&[RoundMember]) -> String;
    let checks: [(&'static str, &str, Make); 2] = [
        (DIGEST_SCHEME, want, digest),
        (HOSTS_DIGEST_SCHEME, want_hosts, hosts_digest),
    ];
    for (scheme, want, make) in checks {
        if !want.starts_with(scheme) {
            continue;
        }
        let got = make(members);
        if got != want {
            // A stored value of any length; the error quotes its start.
            return Err(LayoutError::Digest {
                got,
                want: want.chars().take(64).collect(),
            });
        }
    }
    Ok(())
}

/// The delta that makes `members` from `base`: runs of base members kept in
/// order, and the members the base does not hold (or holds otherwise: a
/// new lease, a new address). O(N) in the two lists.
pub fn delta(base: &[RoundMember], members: &[RoundMember]) -> Vec<Segment> {
    let index: HashMap<&str, usize> = base
        .iter()
        .enumerate()
        .map(|(i, m)| (m.host.as_str(), i))
        .collect();
    let mut out: Vec<Segment> = Vec::new();
    for m in members {
        let at = index
            .get(m.host.as_str())
            .copied()
            .filter(|&i| base.get(i) == Some(m))
            .and_then(|i| u32::try_from(i).ok());
        match at {
            Some(i) => {
                if let Some(Segment::Base { from, len }) = out.last_mut()
                    && from.checked_add(*len) == Some(i)
                {
                    *len += 1;
                    continue;
                }
                out.push(Segment::Base { from: i, len: 1 });
            }
            None => out.push(Segment::New(m.clone())),
        }
    }
    out
}

/// The members `segments` make from `base`, checked against the base's
/// recorded length and the round's `nnodes`.
pub fn apply(
    base: &[RoundMember],
    layout: &LayoutRef,
    nnodes: u32,
) -> Result<Vec<RoundMember>, LayoutError> {
    if base.len() != layout.len as usize {
        return Err(LayoutError::BaseLength {
            got: base.len(),
            want: layout.len,
        });
    }
    let mut out = Vec::with_capacity(nnodes as usize);
    for (index, s) in layout.segments.iter().enumerate() {
        match s {
            Segment::Base { from, len } => {
                let end = u64::from(*from) + u64::from(*len);
                let run = usize::try_from(end)
                    .ok()
                    .and_then(|end| base.get(*from as usize..end))
                    .ok_or(LayoutError::OutOfBase {
                        index,
                        from: *from,
                        end,
                        len: base.len(),
                    })?;
                out.extend_from_slice(run);
            }
            Segment::New(m) => out.push(m.clone()),
        }
        if out.len() > nnodes as usize {
            break;
        }
    }
    if out.len() != nnodes as usize {
        return Err(LayoutError::Count {
            got: out.len(),
            want: nnodes,
        });
    }
    Ok(out)
}

/// Most bytes a stored chunk may inflate to: a chunk is at most about
/// [`CHUNK_BYTES`] of JSON, or one member larger than that (a member
/// record is itself under etcd's 1.5 MiB request limit). A value that
/// inflates past this is refused, not read to its end.
pub const MAX_INFLATED: usize = 4 * 1024 * 1024;

/// Why a chunk cannot be made or read.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    /// The members as JSON.
    #[error("the members as JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// zlib, either way.
    #[error("zlib: {0}")]
    Zlib(std::io::Error),
    /// A stored chunk that inflates past [`MAX_INFLATED`].
    #[error("the chunk inflates past {MAX_INFLATED} bytes")]
    TooLarge,
}

/// `members` as chunks: JSON arrays of at most about [`CHUNK_BYTES`] each
/// (a member larger than that alone is a chunk of its own), in order, each
/// compressed with zlib.
///
/// Why compressed: every host receives every base through its watch, so
/// a base's bytes are sent N times (issue 30: 0.47 GB through etcd for
/// the first round of 2,048 hosts). Member records repeat their field
/// names, and host names and addresses share their prefixes: zlib takes a
/// base to about a fifth. A constant factor, not a change of order: the
/// first round still sends each host the whole list.
pub fn chunks(members: &[RoundMember]) -> Result<Vec<Vec<u8>>, ChunkError> {
    json_chunks(members)?
        .iter()
        .map(|c| deflate(c.as_bytes()))
        .collect()
}

fn deflate(json: &[u8]) -> Result<Vec<u8>, ChunkError> {
    use std::io::Write as _;
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(json).map_err(ChunkError::Zlib)?;
    z.finish().map_err(ChunkError::Zlib)
}

/// A stored chunk's members: zlib-compressed JSON ([`chunks`]), or plain
/// JSON from a launcher before compression (it starts with `[`, which no
/// zlib stream does: zlib's first byte is 0x78 for every window size).
pub fn read_chunk(stored: &[u8]) -> Result<Vec<RoundMember>, ChunkError> {
    use std::io::Read as _;
    if stored.first() == Some(&b'[') {
        return Ok(serde_json::from_slice(stored)?);
    }
    let mut json = Vec::new();
    flate2::read::ZlibDecoder::new(stored)
        .take(MAX_INFLATED as u64 + 1)
        .read_to_end(&mut json)
        .map_err(ChunkError::Zlib)?;
    if json.len() > MAX_INFLATED {
        return Err(ChunkError::TooLarge);
    }
    Ok(serde_json::from_slice(&json)?)
}

/// `members` as JSON arrays of at most about [`CHUNK_BYTES`] each, in order.
fn json_chunks(members: &[RoundMember]) -> Result<Vec<String>, serde_json::Error> {
    let mut out = Vec::new();
    let mut chunk = String::from("[");
    for m in members {
        let json = serde_json::to_string(m)?;
        if chunk.len() > 1 && chunk.len() + json.len() + 2 > CHUNK_BYTES {
            chunk.push(']');
            out.push(std::mem::replace(&mut chunk, String::from("[")));
        }
        if chunk.len() > 1 {
            chunk.push(',');
        }
        chunk.push_str(&json);
    }
    if chunk.len() > 1 || out.is_empty() {
        chunk.push(']');
        out.push(chunk);
    }
    Ok(out)
}

/// A base's chunks read back (`0..chunks`, each the members of one),
/// joined in order; `None` while one is missing.
pub fn joined(
    stored: Option<&std::collections::BTreeMap<u32, Vec<RoundMember>>>,
    layout: &LayoutRef,
) -> Result<Option<Vec<RoundMember>>, LayoutError> {
    if layout.chunks > MAX_CHUNKS {
        return Err(LayoutError::TooManyChunks(layout.chunks));
    }
    let Some(stored) = stored else {
        return Ok(None);
    };
    let mut base = Vec::with_capacity(layout.len as usize);
    for i in 0..layout.chunks {
        match stored.get(&i) {
            Some(c) => base.extend_from_slice(c),
            None => return Ok(None),
        }
    }
    Ok(Some(base))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(host: &str, lease: i64) -> RoundMember {
        RoundMember {
            host: host.into(),
            addr: format!("127.0.0.{}", lease % 250 + 2),
            nproc_per_node: 8,
            lease,
            ckpt_peer: None,
            incarnation: 7,
        }
    }

    fn layout(base: &[RoundMember], members: &[RoundMember]) -> LayoutRef {
        LayoutRef {
            base: "00000000000000000001-h0".into(),
            chunks: 1,
            len: u32::try_from(base.len()).unwrap(),
            segments: delta(base, members),
        }
    }

    fn nn(v: &[RoundMember]) -> u32 {
        u32::try_from(v.len()).unwrap()
    }

    #[test]
    fn the_same_members_are_one_run_and_make_the_same_list() {
        let base: Vec<_> = (0..1000).map(|i| m(&format!("h{i}"), i)).collect();
        let l = layout(&base, &base);
        assert_eq!(l.segments, vec![Segment::Base { from: 0, len: 1000 }]);
        assert_eq!(apply(&base, &l, 1000).unwrap(), base);
        // The header's share: a few dozen bytes however many hosts.
        assert!(serde_json::to_string(&l).unwrap().len() < 128);
    }

    #[test]
    fn a_lost_host_and_a_spare_swap_are_a_few_segments() {
        let base: Vec<_> = (0..100).map(|i| m(&format!("h{i}"), i)).collect();
        // h40 lost, the survivors close ranks.
        let mut down = base.clone();
        down.remove(40);
        let l = layout(&base, &down);
        assert_eq!(l.segments.len(), 2);
        assert_eq!(apply(&base, &l, 99).unwrap(), down);
        // h40's place goes to a spare.
        let mut swapped = base.clone();
        swapped[40] = m("spare", 500);
        let l = layout(&base, &swapped);
        assert_eq!(l.segments.len(), 3);
        assert!(matches!(&l.segments[1], Segment::New(s) if s.host == "spare"));
        assert_eq!(apply(&base, &l, 100).unwrap(), swapped);
        // The same host under a new lease is a new member, not the base's.
        let mut relet = base.clone();
        relet[0].lease = 999;
        let l = layout(&base, &relet);
        assert!(matches!(&l.segments[0], Segment::New(s) if s.lease == 999));
        assert_eq!(apply(&base, &l, 100).unwrap(), relet);
    }

    #[test]
    fn a_stored_delta_that_does_not_fit_its_base_is_refused_by_name() {
        let base: Vec<_> = (0..10).map(|i| m(&format!("h{i}"), i)).collect();
        let mut l = layout(&base, &base);
        l.segments = vec![Segment::Base { from: 5, len: 10 }];
        let e = apply(&base, &l, 10).unwrap_err();
        assert!(e.to_string().contains("base members 5..15"), "{e}");
        l.segments = vec![Segment::Base {
            from: u32::MAX,
            len: u32::MAX,
        }];
        assert!(apply(&base, &l, 10).is_err());
        let l = layout(&base, &base);
        let e = apply(&base, &l, 9).unwrap_err();
        assert!(e.to_string().contains("nnodes 9"), "{e}");
        let e = apply(&base[..9], &l, 10).unwrap_err();
        assert!(e.to_string().contains("the base holds 9"), "{e}");
    }

    #[test]
    fn the_digest_names_the_members_and_their_order_and_a_base_of_others_is_refused() {
        let base: Vec<_> = (0..100).map(|i| m(&format!("h{i}"), i)).collect();
        let want = digest(&base);
        assert!(want.starts_with(DIGEST_SCHEME), "{want}");
        assert_eq!(check_digest(&base, &want, ""), Ok(()));
        // Anything that moves a rank or an environment changes it.
        let mut swapped = base.clone();
        swapped.swap(3, 4);
        let mut relet = base.clone();
        relet[50].lease = 999;
        let mut moved = base.clone();
        moved[99].addr = "127.0.0.99".into();
        let mut wider = base.clone();
        wider[0].nproc_per_node = 4;
        let mut reborn = base.clone();
        reborn[7].incarnation = 8;
        for other in [
            &swapped,
            &relet,
            &moved,
            &wider,
            &reborn,
            &base[..99].to_vec(),
        ] {
            let e = check_digest(other, &want, "").unwrap_err();
            assert!(e.to_string().contains(&want), "{e}");
        }
        // Field bounds are kept: "h1" + "0..." is not "h10" + "...".
        let a = RoundMember {
            host: "h1".into(),
            addr: "0x".into(),
            ..m("x", 1)
        };
        let b = RoundMember {
            host: "h10".into(),
            addr: "x".into(),
            ..m("x", 1)
        };
        assert_ne!(digest(&[a]), digest(&[b]));
        // The checkpoint peer moves no rank: not in it.
        let mut peered = base.clone();
        peered[0].ckpt_peer = Some(super::super::records::CkptPeer {
            addr: "127.0.0.2:7000".into(),
            domain: String::new(),
            identity: String::new(),
        });
        assert_eq!(check_digest(&peered, &want, ""), Ok(()));
        // A launcher before it wrote none; a later scheme is not checked here.
        assert_eq!(check_digest(&swapped, "", ""), Ok(()));
        assert_eq!(check_digest(&swapped, "sha3-256:00", "sha3-256:00"), Ok(()));
    }

    #[test]
    fn the_hosts_digest_names_only_the_hosts_and_their_places() {
        let base: Vec<_> = (0..100).map(|i| m(&format!("h{i}"), i)).collect();
        let want = hosts_digest(&base);
        assert!(want.starts_with(HOSTS_DIGEST_SCHEME), "{want}");
        assert_eq!(want.len(), HOSTS_DIGEST_SCHEME.len() + 16, "{want}");
        assert_eq!(check_digest(&base, "", &want), Ok(()));
        // A launcher relaunched under its host id (new lease, incarnation,
        // even address) holds the same place: the same hosts digest, where
        // the members digest changes.
        let mut relaunched = base.clone();
        relaunched[50].lease = 999;
        relaunched[50].incarnation = 7;
        relaunched[50].addr = "127.0.0.99".into();
        assert_eq!(hosts_digest(&relaunched), want);
        assert_ne!(digest(&relaunched), digest(&base));
        // Another host in a place, two places swapped, one fewer: changed.
        let mut swapped_in = base.clone();
        swapped_in[3].host = "spare".into();
        let mut swapped = base.clone();
        swapped.swap(3, 4);
        for other in [&swapped_in, &swapped, &base[..99].to_vec()] {
            assert_ne!(hosts_digest(other), want);
            let e = check_digest(other, "", &want).unwrap_err();
            assert!(e.to_string().contains(&want), "{e}");
        }
        // Host bounds are kept: ["h1", "0"] is not ["h10"].
        assert_ne!(
            hosts_digest(&[m("h1", 1), m("0", 2)]),
            hosts_digest(&[m("h10", 1)])
        );
    }

    #[test]
    fn chunks_stay_under_their_size_and_join_back_in_order() {
        let base: Vec<_> = (0..16_384)
            .map(|i| {
                m(
                    &format!("a-long-host-name-{i:06}.rack-{:03}.example", i / 32),
                    i,
                )
            })
            .collect();
        let cs = chunks(&base).unwrap();
        assert!(cs.len() > 1);
        assert!(
            cs.iter().all(|c| c.len() <= CHUNK_BYTES),
            "a chunk is too big"
        );
        let stored: std::collections::BTreeMap<u32, Vec<RoundMember>> = cs
            .iter()
            .enumerate()
            .map(|(i, c)| (u32::try_from(i).unwrap(), read_chunk(c).unwrap()))
            .collect();
        let l = LayoutRef {
            base: "b".into(),
            chunks: u32::try_from(cs.len()).unwrap(),
            len: nn(&base),
            segments: vec![Segment::Base {
                from: 0,
                len: nn(&base),
            }],
        };
        let joined = joined(Some(&stored), &l).unwrap().unwrap();
        assert_eq!(joined, base);
        // One chunk missing: not yet readable, not an error.
        let mut partial = stored.clone();
        partial.remove(&1);
        assert_eq!(super::joined(Some(&partial), &l).unwrap(), None);
        let empty = chunks(&[]).unwrap();
        assert_eq!(empty.len(), 1);
        assert_eq!(read_chunk(&empty[0]).unwrap(), Vec::new());
    }

    #[test]
    fn a_chunk_is_a_fraction_of_its_json_and_an_older_plain_one_still_reads() {
        // 2,048 members as the fleet bench writes them (no checkpoint peer).
        let base: Vec<_> = (0..2048u32)
            .map(|i| RoundMember {
                host: format!("host-{i:05}"),
                addr: format!("127.0.{}.{}", (i / 250) % 250, 2 + i % 250),
                nproc_per_node: 8,
                lease: 7_587_869_234_234_234_123 - i64::from(i) * 7_919,
                ckpt_peer: None,
                incarnation: 1_000_000 + u64::from(i),
            })
            .collect();
        let json: usize = json_chunks(&base).unwrap().iter().map(String::len).sum();
        let stored: usize = chunks(&base).unwrap().iter().map(Vec::len).sum();
        assert!(
            stored * 3 < json,
            "{stored} bytes compressed against {json} of JSON"
        );
        // A chunk a launcher before compression wrote: plain JSON.
        let plain = json_chunks(&base[..3]).unwrap().remove(0);
        assert_eq!(read_chunk(plain.as_bytes()).unwrap(), base[..3].to_vec());
    }

    #[test]
    fn a_stored_chunk_that_inflates_past_the_bound_or_is_not_zlib_is_refused_by_name() {
        // 64 MiB of one byte compresses to about 64 KB: a value anyone with
        // the job's etcd role could write.
        let bomb = deflate(&vec![b' '; 64 * 1024 * 1024]).unwrap();
        let e = read_chunk(&bomb).unwrap_err();
        assert!(matches!(e, ChunkError::TooLarge), "{e}");
        let e = read_chunk(b"\x00not zlib").unwrap_err();
        assert!(e.to_string().contains("zlib"), "{e}");
        let e = read_chunk(b"[{\"host\": 1}]").unwrap_err();
        assert!(e.to_string().contains("JSON"), "{e}");
    }
}
