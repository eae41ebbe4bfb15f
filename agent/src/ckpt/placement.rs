//! Which peers hold a host's replicas: a ring over failure domains.
//!
//! As in Gemini's ring placement (Wang et al., SOSP 2023): members sorted
//! by address form a ring and each host sends its shards to the next ones
//! along it, so every host holds about as many replicas as it sends. Peers
//! in the host's own failure domain are skipped (a rack that loses power
//! loses both copies otherwise), and domains not used yet are preferred, so
//! R replicas land in R other domains whenever there are that many.

/// One ring member: its address and failure domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingMember {
    /// `host:port`; sorts the ring.
    pub addr: String,
    /// Failure domain label.
    pub domain: String,
}

/// Indexes into `peers` of the `replicas` peers that hold `me`'s shards,
/// nearest along the ring first. Fewer when too few peers are in other
/// domains (never one in `me`'s own).
pub fn targets(me: &RingMember, peers: &[RingMember], replicas: usize) -> Vec<usize> {
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

    fn m(addr: &str, domain: &str) -> RingMember {
        RingMember {
            addr: addr.into(),
            domain: domain.into(),
        }
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
}
