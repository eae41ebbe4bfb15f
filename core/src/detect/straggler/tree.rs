//! The shape of the job-wide exchange (issue 30): a two-level tree over a
//! job's hosts in their agreed order, so that no host holds a connection
//! from every other one.
//!
//! The order (node rank order, the same on every host) is cut into groups
//! of `k` hosts, `k` about the square root of the host count. Group 0's
//! first live host is the job's aggregator. Every other group's first live
//! host is that group's *leader*: its members report to it, and it relays
//! each report to the aggregator and hands back the answer. So the
//! aggregator holds about `2k` connections (its group and the other
//! leaders), a leader about `k`, and every other host one; calls per
//! interval stay O(N) (a report relayed is two calls).
//!
//! Failover follows from the order alone, with no election: a host tries
//! its own group's earlier hosts, then group 0's hosts (the aggregator and
//! its successors), then aggregates in place. A leader that receives a
//! report relays it to group 0's hosts, and aggregates it in place when
//! none answers. So the aggregator is the first live host of group 0. A
//! relayed report is never relayed again, so two hosts that disagree for
//! an interval on who is live cannot loop a report.
//!
//! Why group 0 and not every host before a group (as until stop 86): a
//! host then needs to know only its own group and group 0, about `2k`
//! hosts, not the job's order up to itself, which is what lets a host of a
//! 12,500-host job read its part of the round and not all of it (issue
//! 30, partial views). The cost: with the whole of group 0 lost at once
//! (`k` hosts, about 112 at 12,500), each group's leader aggregates its
//! own group until the next round; scores then cover a group, not the
//! job, as with any split. Walking the hosts between group 0 and a group
//! bought nothing a lost group 0 does not already cost a round: those
//! hosts are leaders and members of other groups, not aggregators.

use super::config::AUTO_MIN_FAN_OUT;

/// The group size for a job of `hosts` hosts: `configured`, or with 0 the
/// square root of `hosts` rounded up, at least [`AUTO_MIN_FAN_OUT`].
pub fn fan_out(hosts: usize, configured: u32) -> usize {
    if configured >= 2 {
        return configured as usize;
    }
    ceil_sqrt(hosts).max(AUTO_MIN_FAN_OUT)
}

fn ceil_sqrt(n: usize) -> usize {
    let r = n.isqrt();
    if r * r < n { r + 1 } else { r }
}

/// Whom the host at index `me` of an order of `len` hosts reports to, as
/// indices in the order to try them: its group's earlier hosts (its leader,
/// then the next in line), then group 0's hosts (the aggregator and its
/// successors), then `me` itself (aggregate in place). A host not in the
/// order (`None`) tries group 0.
pub fn route(len: usize, me: Option<usize>, k: usize) -> impl Iterator<Item = usize> + Clone {
    let first = k.max(1).min(len);
    let (own, group0, last) = match me {
        Some(pos) if pos < len => {
            let start = group_start(pos, k);
            (start..pos, 0..start.min(first), Some(pos))
        }
        _ => (0..0, 0..first, None),
    };
    own.chain(group0).chain(last)
}

/// Where a report that the host at index `me` receives from a host of its
/// group goes: `None` when `me` is in group 0 (it aggregates) or not in the
/// order, else group 0's hosts, then `me` itself (aggregate in place when
/// none answers).
pub fn relay(
    len: usize,
    me: Option<usize>,
    k: usize,
) -> Option<impl Iterator<Item = usize> + Clone> {
    let pos = me.filter(|p| *p < len)?;
    let start = group_start(pos, k);
    (start > 0).then(|| (0..start.min(k.max(1))).chain(std::iter::once(pos)))
}

/// The indices a host at `me` of an order of `len` hosts needs to know:
/// outside group 0, its own group and group 0 (the route's and the
/// relay's every host); in group 0, every host, since it may aggregate or
/// collect for the whole job and authorizes each reporter by name. A host
/// not in the order, group 0. What a partial view of the job must hold.
pub fn needed(len: usize, me: Option<usize>, k: usize) -> impl Iterator<Item = usize> {
    let k = k.max(1);
    let pos = me.filter(|p| *p < len);
    if pos.is_some_and(|p| group_start(p, k) == 0) {
        return (0..len).chain(0..0);
    }
    let first = 0..k.min(len);
    let own = match pos {
        Some(p) => {
            let start = group_start(p, k);
            start..(start + k).min(len)
        }
        None => 0..0,
    };
    first.chain(own)
}

/// Whether the host at `index` relays the reports it receives (a group
/// leader, not in group 0).
pub fn relays(index: usize, k: usize) -> bool {
    group_start(index, k) > 0
}

/// The most connections any one host of a job of `hosts` holds from the
/// others' reports, with group size `k`: the aggregator's, from its own
/// group and every other group's leader.
pub fn max_in_degree(hosts: usize, k: usize) -> usize {
    if hosts == 0 {
        return 0;
    }
    let k = k.max(1);
    let groups = hosts.div_ceil(k);
    (k.min(hosts) - 1) + (groups - 1)
}

fn group_start(pos: usize, k: usize) -> usize {
    let k = k.max(1);
    pos / k * k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_size_is_the_square_root_at_least_the_floor() {
        assert_eq!(fan_out(4, 0), AUTO_MIN_FAN_OUT);
        assert_eq!(fan_out(1024, 0), AUTO_MIN_FAN_OUT);
        assert_eq!(fan_out(1025, 0), 33);
        assert_eq!(fan_out(2048, 0), 46);
        assert_eq!(fan_out(12_500, 0), 112);
        assert_eq!(fan_out(16_384, 0), 128);
        assert_eq!(fan_out(16_385, 0), 129);
        assert_eq!(fan_out(4, 2), 2);
    }

    #[test]
    fn a_member_tries_its_leader_then_group_zero_then_itself() {
        let r = |me, k| route(8, me, k).collect::<Vec<_>>();
        // k = 3: groups 0-2, 3-5, 6-7.
        assert_eq!(r(Some(5), 3), [3, 4, 0, 1, 2, 5]);
        assert_eq!(r(Some(3), 3), [0, 1, 2, 3]);
        // Group 2 fails over into group 0 alone, not group 1 (its hosts
        // are no aggregators): a host need not know group 1 at all.
        assert_eq!(r(Some(7), 3), [6, 0, 1, 2, 7]);
        assert_eq!(r(Some(2), 3), [0, 1, 2]);
        assert_eq!(r(Some(0), 3), [0]);
        assert_eq!(r(None, 3), [0, 1, 2]);
        assert_eq!(route(2, None, 3).collect::<Vec<_>>(), [0, 1]);
        // One group: the single aggregator of before.
        assert_eq!(r(Some(5), 32), [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn only_hosts_outside_group_zero_relay() {
        let r = |me| relay(8, me, 3).map(|i| i.collect::<Vec<_>>());
        assert_eq!(r(Some(1)), None);
        assert_eq!(r(Some(4)).unwrap(), [0, 1, 2, 4]);
        assert_eq!(r(Some(7)).unwrap(), [0, 1, 2, 7]);
        assert_eq!(r(None), None);
        assert_eq!(r(Some(9)), None);
        assert!(relays(6, 3) && relays(3, 3) && !relays(2, 3) && !relays(5, 32));
    }

    #[test]
    fn a_host_outside_group_zero_needs_only_its_group_and_group_zero() {
        let n = |me| needed(8, me, 3).collect::<Vec<_>>();
        assert_eq!(n(Some(7)), [0, 1, 2, 6, 7]);
        assert_eq!(n(Some(4)), [0, 1, 2, 3, 4, 5]);
        // Group 0 aggregates and collects for the whole job.
        assert_eq!(n(Some(1)), [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(n(None), [0, 1, 2]);
        // Everything the route and the relay name is in it, at every size.
        for len in [1usize, 7, 8, 100, 2_048] {
            let k = fan_out(len, 0).min(len.max(2) / 2 + 1);
            for me in (0..len).step_by(7).map(Some).chain([None]) {
                let have: std::collections::HashSet<usize> = needed(len, me, k).collect();
                let named = route(len, me, k).chain(relay(len, me, k).into_iter().flatten());
                for i in named {
                    assert!(have.contains(&i), "{len} hosts, k {k}, me {me:?}: {i}");
                }
            }
        }
    }

    #[test]
    fn no_host_holds_more_than_about_twice_the_square_root() {
        assert_eq!(max_in_degree(1, 32), 0);
        assert_eq!(max_in_degree(16, 32), 15);
        assert_eq!(max_in_degree(8, 3), 2 + 2);
        for n in [2_048usize, 12_500, 16_384, 65_536] {
            let k = fan_out(n, 0);
            let d = max_in_degree(n, k);
            assert!(
                d <= 2 * k,
                "{n} hosts: {d} connections at the aggregator, k = {k}"
            );
        }
        assert_eq!(max_in_degree(16_384, 128), 254);
    }
}
