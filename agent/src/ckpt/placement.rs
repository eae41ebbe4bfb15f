//! Which peers hold a host's replicas: a ring over failure domains.
//!
//! As in Gemini's ring placement (Wang et al., SOSP 2023): members sorted
//! by address form a ring and each host sends its shards to the next ones
//! along it, so every host holds about as many replicas as it sends. Peers
//! in the host's own failure domain are skipped (a rack that loses power
//! loses both copies otherwise), and domains not used yet are preferred, so
//! R replicas land in R other domains whenever there are that many.
//!
//! Two orders of the ring ([`Ring::new`], [`Ring::by_place`]). By address,
//! a host's neighbours may stand anywhere in the job's order, so every host
//! must know every address to agree on any origin's targets. By place (a
//! job's node-rank order, issue 30), a host's replicas go to the hosts
//! after it in that order, and whether an origin's shards belong here is a
//! walk over the places between it and this host: a host that knows only
//! a window of the order around itself agrees with every other host, as
//! long as the window holds the walk (R other domains). And a spare that
//! takes a lost host's place has the lost host's neighbours, who hold its
//! replicas.

/// One ring member: its address and failure domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingMember {
    /// `host:port`; sorts the ring.
    pub addr: String,
    /// Failure domain label.
    pub domain: String,
}

impl RingMember {
    /// The member at `addr` in `domain`, or in a domain of its own (its
    /// address) where none is given: a host whose operator set no
    /// `checkpoint.domain` is its own failure domain.
    pub fn at(addr: &str, domain: &str) -> Self {
        Self {
            addr: addr.to_owned(),
            domain: if domain.is_empty() { addr } else { domain }.to_owned(),
        }
    }
}

/// The most places [`window`] looks along a job's order from one origin.
pub const MAX_WINDOW: usize = 1024;

/// How far along a job's node-rank order every member's replica targets
/// lie on the ring by place (issue 30): over every origin, the most places
/// after it that its walk takes to find `replicas` targets in other
/// domains. A host that knows the places within that many of it on each
/// side knows every origin whose targets may include it and every place
/// its own walk reaches, so it agrees with every other host
/// ([`Ring::by_known_places`] decides each such walk). `Some(0)` for no
/// replicas. None when some origin's walk needs more than `most` places,
/// or when the order has fewer than `replicas` domains besides an
/// origin's: the walk then fills from domains already used, which needs
/// every place. A walk steps over a run of places in one domain at once,
/// so where racks are contiguous in the order it costs about `replicas`
/// steps an origin, not a rack's size (the round's writer computes it
/// every round, over up to 16,384 places); at most `most` steps an origin.
pub fn window(members: &[RingMember], replicas: usize, most: usize) -> Option<usize> {
    if replicas == 0 {
        return Some(0);
    }
    let n = members.len();
    let mut ids: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let domain: Vec<usize> = members
        .iter()
        .map(|m| {
            let next = ids.len();
            *ids.entry(m.domain.as_str()).or_insert(next)
        })
        .collect();
    // Over the order twice (a walk wraps): each place's next place in
    // another domain, or the end.
    let mut next_other = vec![2 * n; 2 * n];
    for p in (0..(2 * n).saturating_sub(1)).rev() {
        next_other[p] = if domain[(p + 1) % n] != domain[p % n] {
            p + 1
        } else {
            next_other[p + 1]
        };
    }
    let last = n.min(most.saturating_add(1));
    let mut widest = 0;
    let mut chosen: Vec<usize> = Vec::with_capacity(replicas);
    for o in 0..n {
        chosen.clear();
        let mut p = o + 1;
        loop {
            if p - o >= last {
                return None;
            }
            let d = domain[p % n];
            if d == domain[o] || chosen.contains(&d) {
                p = next_other[p];
                continue;
            }
            if members[p % n].addr == members[o].addr {
                // Not a target, though its domain is: the next place may be.
                p += 1;
                continue;
            }
            chosen.push(d);
            if chosen.len() == replicas {
                widest = widest.max(p - o);
                break;
            }
            p = next_other[p];
        }
    }
    Some(widest)
}

/// A job's ring kept ready (issue 30): its members sorted by address once,
/// when the job's peers are handed over, so that the targets of any member
/// are a walk from its place rather than a copy and a sort of up to 16,384
/// members per shard pushed.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    members: Vec<RingMember>,
    /// Indices into `members`, in ring order (by address, or the caller's
    /// order for a ring by place).
    sorted: Vec<usize>,
    domains: std::collections::HashSet<String>,
    /// The ring is in the caller's order ([`Ring::by_place`]).
    by_place: bool,
    /// For a ring by place that holds only some places of the order
    /// ([`Ring::by_known_places`]): each member's place, and the order's
    /// length. Empty: every place is a member.
    places: Vec<usize>,
    len: usize,
}

/// One member's targets as a ring knows them ([`Ring::walk_at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    /// Indices of its targets found, nearest first.
    pub targets: Vec<usize>,
    /// Whether they are all of them. False only on a ring by place that
    /// lacks some places: the walk reached a place not known here before
    /// it found `replicas` targets in other domains, so `targets` is a
    /// prefix of the member's true targets, and the rest are not known
    /// here.
    pub decided: bool,
}

impl Ring {
    /// The ring of `members` (the caller's order is kept: indices name
    /// them).
    pub fn new(members: Vec<RingMember>) -> Self {
        let mut sorted: Vec<usize> = (0..members.len()).collect();
        sorted.sort_by(|&a, &b| members[a].addr.cmp(&members[b].addr));
        let domains = members.iter().map(|m| m.domain.clone()).collect();
        Self {
            members,
            sorted,
            domains,
            by_place: false,
            places: Vec::new(),
            len: 0,
        }
    }

    /// The ring of `members` in the order given (a job's node-rank order:
    /// each member's replicas go to the ones after it, wrapping).
    pub fn by_place(members: Vec<RingMember>) -> Self {
        let domains = members.iter().map(|m| m.domain.clone()).collect();
        Self {
            sorted: (0..members.len()).collect(),
            len: members.len(),
            members,
            domains,
            by_place: true,
            places: Vec::new(),
        }
    }

    /// The ring by place of an order of `len` places of which only
    /// `members` are known, at `places` (ascending, one each). A walk that
    /// reaches a place not known here stops there undecided
    /// ([`Walk::decided`]): walking on past it would take the next known
    /// place for the one missing, and hosts with different views would
    /// disagree. With every place known, [`Ring::by_place`].
    pub fn by_known_places(members: Vec<RingMember>, places: Vec<usize>, len: usize) -> Self {
        if places.len() == len || places.len() != members.len() {
            return Self::by_place(members);
        }
        Self {
            places,
            len,
            ..Self::by_place(members)
        }
    }

    /// The members, in the caller's order.
    pub fn members(&self) -> &[RingMember] {
        &self.members
    }

    /// Indices of the `replicas` members that hold `from`'s shards, nearest
    /// along the ring first; fewer when too few members are in other
    /// domains (never one in `from`'s own, nor `from` itself, by address).
    /// The walk starts after `from`'s address and
    /// stops once it has as many domains as there are to find; the
    /// second pass, for more replicas than domains, stops at `replicas`.
    pub fn targets_of(&self, from: &RingMember, replicas: usize) -> Vec<usize> {
        let start = self
            .sorted
            .partition_point(|&i| self.members[i].addr <= from.addr);
        self.walk_from(start, from, replicas)
    }

    /// [`Ring::targets_of`] the member at index `at`: on a ring by place,
    /// the walk starts after its place (on one by address, after its
    /// address). None past the members.
    pub fn targets_at(&self, at: usize, replicas: usize) -> Option<Vec<usize>> {
        self.walk_at(at, replicas).map(|w| w.targets)
    }

    /// [`Ring::targets_at`], saying whether they are all of them: on a
    /// ring by place that lacks some places, the walk stops undecided at
    /// the first place not known here. Undecided too where it went all
    /// around the known places without `replicas` other domains: the
    /// places not known here may hold them.
    pub fn walk_at(&self, at: usize, replicas: usize) -> Option<Walk> {
        let from = self.members.get(at)?;
        if !self.by_place {
            return Some(Walk {
                targets: self.targets_of(from, replicas),
                decided: true,
            });
        }
        if self.places.is_empty() {
            return Some(Walk {
                targets: self.walk_from(at + 1, from, replicas),
                decided: true,
            });
        }
        let n = self.members.len();
        let mut targets: Vec<usize> = Vec::new();
        let mut prev = at;
        for k in 1..n {
            if targets.len() == replicas {
                break;
            }
            let i = (at + k) % n;
            if self.places[i] != (self.places[prev] + 1) % self.len.max(1) {
                return Some(Walk {
                    targets,
                    decided: false,
                });
            }
            let m = &self.members[i];
            if m.domain != from.domain
                && m.addr != from.addr
                && !targets.iter().any(|&t| self.members[t].domain == m.domain)
            {
                targets.push(i);
            }
            prev = i;
        }
        let decided = targets.len() == replicas;
        Some(Walk { targets, decided })
    }

    /// The targets of `from` along the ring from its position `start`.
    fn walk_from(&self, start: usize, from: &RingMember, replicas: usize) -> Vec<usize> {
        let n = self.sorted.len();
        if n == 0 {
            return Vec::new();
        }
        let walk = (0..n).map(|k| self.sorted[(start + k) % n]);
        let eligible = |i: &usize| {
            let m = &self.members[*i];
            m.domain != from.domain && m.addr != from.addr
        };
        let domains = self.domains.len() - usize::from(self.domains.contains(&from.domain));
        let mut chosen: Vec<usize> = Vec::new();
        for i in walk.clone().filter(eligible) {
            if chosen.len() == replicas.min(domains) {
                break;
            }
            let d = &self.members[i].domain;
            if !chosen.iter().any(|&c| self.members[c].domain == *d) {
                chosen.push(i);
            }
        }
        if chosen.len() < replicas {
            for i in walk.filter(eligible) {
                if chosen.len() == replicas {
                    break;
                }
                if !chosen.contains(&i) {
                    chosen.push(i);
                }
            }
        }
        chosen
    }
}

/// The rule as first written, kept as the tests' oracle for
/// [`Ring::targets_of`]: indexes into `peers` of the `replicas` peers that
/// hold `me`'s shards, nearest along the ring first, by a copy and a sort.
/// Fewer when too few peers are in other domains (never one in `me`'s
/// own).
#[cfg(test)]
pub(crate) fn by_sort(me: &RingMember, peers: &[RingMember], replicas: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..peers.len()).collect();
    // Ring order starting after `me`: addresses greater than mine first,
    // then wrap around.
    order.sort_by(|&a, &b| {
        let (pa, pb) = (&peers[a].addr, &peers[b].addr);
        (pa <= &me.addr, pa).cmp(&(pb <= &me.addr, pb))
    });
    let eligible: Vec<usize> = order
        .into_iter()
        .filter(|&i| peers[i].domain != me.domain && peers[i].addr != me.addr)
        .collect();
    let mut chosen: Vec<usize> = Vec::new();
    // First pass: one per domain; second: fill from what is left.
    for &i in &eligible {
        if chosen.len() == replicas {
            break;
        }
        if !chosen.iter().any(|&c| peers[c].domain == peers[i].domain) {
            chosen.push(i);
        }
    }
    for &i in &eligible {
        if chosen.len() == replicas {
            break;
        }
        if !chosen.contains(&i) {
            chosen.push(i);
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept ring's targets over `peers`.
    fn targets(me: &RingMember, peers: &[RingMember], replicas: usize) -> Vec<usize> {
        Ring::new(peers.to_vec()).targets_of(me, replicas)
    }

    fn m(addr: &str, domain: &str) -> RingMember {
        RingMember {
            addr: addr.into(),
            domain: domain.into(),
        }
    }

    /// Issue 30, the window a partial view needs: over layouts of racks of
    /// random sizes (contiguous in node-rank order, as schedulers place
    /// them) and of random domains per host, every origin's targets lie
    /// within [`window`] places after it, one origin's last target at
    /// exactly that distance; and a host handed only the places within the
    /// window on each side decides the walk of every origin within the
    /// window before it as the whole order does, and its own.
    #[test]
    fn every_walk_lies_within_the_window_and_a_window_of_it_decides_them() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |bound: usize| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            usize::try_from(seed >> 33).unwrap() % bound
        };
        let mut windowed = 0;
        for case in 0..60 {
            let n = 8 + next(56);
            let contiguous = case % 2 == 0;
            let mut rack = 0;
            let members: Vec<RingMember> = (0..n)
                .map(|i| {
                    if contiguous && next(4) == 0 {
                        rack += 1;
                    }
                    let d = if contiguous { rack } else { next(5) };
                    m(&format!("10.0.0.{i}:7000"), &format!("rack{d}"))
                })
                .collect();
            let ring = Ring::by_place(members.clone());
            // The walk for fewer replicas is the start of the walk for
            // more, on both rings, past the domains there are too: a host
            // judging with the job's most accepts every copy an origin
            // with fewer sends (`PeerSet::placed_here`).
            let by_addr = Ring::new(members.clone());
            for o in 0..n {
                for r in 0..6 {
                    for (name, walk) in [("place", &ring), ("address", &by_addr)] {
                        let (fewer, more) = (
                            walk.targets_at(o, r).unwrap(),
                            walk.targets_at(o, r + 1).unwrap(),
                        );
                        assert_eq!(
                            fewer,
                            more[..fewer.len()],
                            "case {case}, by {name}: {o} {r}"
                        );
                    }
                }
            }
            for replicas in 1..=3 {
                let Some(w) = window(&members, replicas, MAX_WINDOW) else {
                    let domains: std::collections::HashSet<&str> =
                        members.iter().map(|m| m.domain.as_str()).collect();
                    assert!(
                        domains.len() <= replicas,
                        "case {case}: no window with {} domains for {replicas}",
                        domains.len()
                    );
                    continue;
                };
                let dist = |o: usize, t: usize| (t + n - o) % n;
                let reach: Vec<usize> = (0..n)
                    .map(|o| {
                        let t = ring.targets_at(o, replicas).unwrap();
                        assert_eq!(t.len(), replicas, "case {case}: origin {o}");
                        t.iter().map(|&t| dist(o, t)).max().unwrap()
                    })
                    .collect();
                assert_eq!(reach.iter().max(), Some(&w), "case {case}, {replicas}");
                if 2 * w + 1 >= n {
                    continue;
                }
                windowed += 1;
                for h in 0..n {
                    let places: Vec<usize> = {
                        let mut p: Vec<usize> = (0..=2 * w).map(|k| (h + n - w + k) % n).collect();
                        p.sort_unstable();
                        p
                    };
                    let known: Vec<RingMember> =
                        places.iter().map(|&p| members[p].clone()).collect();
                    let partial = Ring::by_known_places(known, places.clone(), n);
                    let index = |p: usize| places.binary_search(&p).unwrap();
                    for d in 0..=w {
                        let o = (h + n - d) % n;
                        let walk = partial.walk_at(index(o), replicas).unwrap();
                        assert!(walk.decided, "case {case}: host {h}, origin {o}");
                        let mut got: Vec<usize> = walk.targets.iter().map(|&i| places[i]).collect();
                        let mut want = ring.targets_at(o, replicas).unwrap();
                        got.sort_unstable();
                        want.sort_unstable();
                        assert_eq!(got, want, "case {case}: host {h}, origin {o}");
                    }
                }
            }
        }
        assert!(windowed > 20, "layouts checked windowed: {windowed}");
        // A cap below the widest walk, or too few domains: no window.
        let two_racks: Vec<RingMember> = (0..8)
            .map(|i| m(&format!("10.0.0.{i}:7000"), &format!("rack{}", i / 4)))
            .collect();
        assert_eq!(window(&two_racks, 1, MAX_WINDOW), Some(4));
        assert_eq!(window(&two_racks, 1, 3), None);
        assert_eq!(window(&two_racks, 2, MAX_WINDOW), None);
        assert_eq!(window(&two_racks, 0, 3), Some(0));
        assert_eq!(RingMember::at("10.0.0.1:7000", "").domain, "10.0.0.1:7000");
        // 16,384 places in racks of 32 in order, 16 replicas: a rack's
        // first place reaches the 16th rack after its own, 512 on; 64 to a
        // rack, 1,024 on, the cap; 65 passes it.
        let racks = |size: usize| -> Vec<RingMember> {
            (0..16_384)
                .map(|i| {
                    m(
                        &format!("10.{}.{}.1:7000", i / 256, i % 256),
                        &format!("r{}", i / size),
                    )
                })
                .collect()
        };
        assert_eq!(window(&racks(32), 16, MAX_WINDOW), Some(512));
        assert_eq!(window(&racks(64), 16, MAX_WINDOW), Some(1024));
        assert_eq!(window(&racks(65), 16, MAX_WINDOW), None);
    }

    #[test]
    fn the_ring_sends_to_the_next_host_and_wraps() {
        let all = [m("a:1", "a"), m("b:1", "b"), m("c:1", "c")];
        let peers_of = |i: usize| -> Vec<RingMember> {
            all.iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, p)| p.clone())
                .collect()
        };
        let next = |i: usize| {
            let p = peers_of(i);
            targets(&all[i], &p, 1)
                .into_iter()
                .map(|t| p[t].addr.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(next(0), vec!["b:1"]);
        assert_eq!(next(1), vec!["c:1"]);
        assert_eq!(next(2), vec!["a:1"]);
    }

    #[test]
    fn never_the_same_domain_and_spread_over_domains() {
        let me = m("a:1", "rack1");
        let peers = [
            m("b:1", "rack1"),
            m("c:1", "rack2"),
            m("d:1", "rack2"),
            m("e:1", "rack3"),
        ];
        let t: Vec<&str> = targets(&me, &peers, 2)
            .into_iter()
            .map(|i| peers[i].addr.as_str())
            .collect();
        assert_eq!(t, vec!["c:1", "e:1"]);
        // Only rack1 peers: no replica rather than one in the same rack.
        assert!(targets(&me, &peers[..1], 1).is_empty());
        // More replicas than domains: the rest from domains already used.
        assert_eq!(targets(&me, &peers, 3).len(), 3);
    }

    /// By place, a host sends to the ones after it in the order given, not
    /// by address; a member's targets are those of its index, wrapping, in
    /// other domains first.
    #[test]
    fn a_ring_by_place_sends_to_the_next_places() {
        // Node-rank order, not address order.
        let order = [
            m("z:1", "r0"),
            m("a:1", "r1"),
            m("m:1", "r1"),
            m("b:1", "r2"),
        ];
        let r = Ring::by_place(order.to_vec());
        assert_eq!(r.targets_at(0, 1), Some(vec![1]));
        assert_eq!(r.targets_at(1, 2), Some(vec![3, 0]), "m:1 shares r1");
        assert_eq!(r.targets_at(3, 2), Some(vec![0, 1]), "wraps");
        assert_eq!(r.targets_at(4, 1), None);
        // The same members by address: z:1 sends to a:1's successor.
        let a = Ring::new(order.to_vec());
        assert_eq!(a.targets_at(0, 1), Some(vec![1]), "wraps to a:1");
        assert_eq!(a.targets_at(1, 1), Some(vec![3]), "a:1 to b:1");
        assert!(Ring::by_place(Vec::new()).targets_at(0, 1).is_none());
    }

    /// A ring by place that lacks some places walks only over the places
    /// it knows in a row: it finds what the whole ring finds up to the
    /// first place not known here, and says it stopped there.
    #[test]
    fn a_partial_ring_by_place_stops_undecided_at_a_missing_place() {
        // Places 0..8, racks of two; known: 0..4 and 6, 7 (5 missing).
        let all: Vec<RingMember> = (0..8)
            .map(|p| m(&format!("h{p}:1"), &format!("r{}", p / 2)))
            .collect();
        let places = vec![0usize, 1, 2, 3, 4, 6, 7];
        let known: Vec<RingMember> = places.iter().map(|&p| all[p].clone()).collect();
        let part = Ring::by_known_places(known, places.clone(), 8);
        let whole = Ring::by_place(all);
        let decided = |t: Vec<usize>| Walk {
            targets: t,
            decided: true,
        };
        // Place 0 (r0): 2 and 4 in a row, as the whole ring.
        assert_eq!(part.walk_at(0, 2), Some(decided(vec![2, 4])));
        assert_eq!(whole.walk_at(0, 2), Some(decided(vec![2, 4])));
        // Place 3 (r1): 4, then place 5 is not known: undecided, the
        // prefix found. The whole ring says 4 then 6.
        assert_eq!(
            part.walk_at(3, 2),
            Some(Walk {
                targets: vec![4],
                decided: false
            })
        );
        assert_eq!(whole.walk_at(3, 2), Some(decided(vec![4, 6])));
        // Place 6 (index 5, r3): wraps over 7 to 0 and 1... 0 is r0: 0,
        // then 2 (index 2).
        assert_eq!(part.walk_at(5, 2), Some(decided(vec![0, 2])));
        // No replicas: decided at once.
        assert_eq!(part.walk_at(3, 0), Some(decided(vec![])));
        // Every place known: the whole ring.
        let again = Ring::by_known_places(
            (0..3)
                .map(|p| m(&format!("h{p}:1"), &format!("r{p}")))
                .collect(),
            vec![0, 1, 2],
            3,
        );
        assert_eq!(again.walk_at(0, 1), Some(decided(vec![1])));
    }

    /// The kept ring's walk gives what the sort gives, from every member's
    /// place, over rings of random addresses, domains (some empty, some
    /// shared) and replica counts, duplicates of an address included.
    #[test]
    fn the_kept_ring_places_as_the_sort_does() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..400 {
            let size = 1 + next(24) as usize;
            let domains = 1 + next(6);
            let members: Vec<RingMember> = (0..size)
                .map(|_| {
                    let d = next(domains + 1);
                    m(
                        &format!("10.0.0.{}:7070", next(40)),
                        &if d == domains {
                            String::new()
                        } else {
                            format!("r{d}")
                        },
                    )
                })
                .collect();
            let ring = Ring::new(members.clone());
            for replicas in 0..4 {
                for from in &members {
                    assert_eq!(
                        ring.targets_of(from, replicas),
                        by_sort(from, &members, replicas),
                        "{from:?} {replicas} {members:?}"
                    );
                }
                // A member not in the ring as well.
                let outside = m("10.0.0.99:1", "r0");
                assert_eq!(
                    ring.targets_of(&outside, replicas),
                    by_sort(&outside, &members, replicas)
                );
            }
        }
    }
}
