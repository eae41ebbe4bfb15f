//! Which etcd member the lease keeper's keep-alives go to, and when to move
//! to another (issue 30: a member paused by SIGSTOP cost hosts their lease).
//!
//! A keep-alive stream lives on one HTTP/2 connection to one member. A
//! member that stops answering without closing its socket (paused, a long
//! GC stall, a full disk) leaves the stream open and unanswered: the keeper
//! used to wait for an answer until the lease's end by its own clock, so
//! the lease ran out while two other members could have renewed it. So the
//! keeper waits for an answer only [`keep_alive_wait`]: until a third of
//! the TTL is left on the lease (time to move and renew elsewhere), at
//! least [`answer_deadline`] (a sixth of the TTL), at most the request
//! deadline; then it opens its next stream on the next endpoint, each on a
//! client of its own to that one endpoint, in turn. With the keep-alive
//! sent every third of the TTL, a member that stops answering is left a
//! third of the TTL before the lease's end, and the next member's
//! connection and first answer get a sixth each: the lease holds through
//! any one member that stops answering.
//!
//! Why not a sixth of the TTL every time, as before (issue 30, fleet bench,
//! 4,096 hosts on 3 members, 10 s TTL): when the leader was killed every
//! member answered slowly for a while (a new leader, the whole fleet's
//! keep-alives forwarded to it), each host left member after member, 7 new
//! connections a host, never waiting for an answer past 1.67 s, and every
//! lease was lost, in both runs that got that far. Waiting 5 s or 3.33 s,
//! none was lost and only the dead member's hosts moved. A member slow under
//! load is not a member gone: the watch learned that first (`drive`). Not
//! settled: of two runs with this rule, one lost no lease and one lost
//! every one, in a storm of new streams whose first keep-alive went
//! unanswered (docs/benchmarks.md, "A 3-member cluster at 4,096 hosts").
//!
//! In: the endpoints, the host id (where the keeper starts: hosts spread
//! over the members), what a stream to an endpoint came to. Out: the
//! endpoint to keep the lease through now, and a client to it.
//! Never: stay on an endpoint after a keep-alive it left unanswered; wait
//! on a connection without a deadline; change anything with a single
//! endpoint (there is nowhere to move: the shared client is used, and the
//! wait is [`answer_deadline`], as before).

use std::hash::{Hash, Hasher};
use std::time::Duration;

use etcd_client::Client;

use super::CoordError;
use super::access::EtcdAccess;

/// How long the keeper waits for the answer to one keep-alive (or for a
/// new stream's first) before it moves on: a sixth of the TTL, at most the
/// request deadline, at least 100 ms.
pub(crate) fn answer_deadline(ttl: Duration, request_timeout: Duration) -> Duration {
    (ttl / 6)
        .min(request_timeout)
        .max(Duration::from_millis(100))
}

/// How long the keeper waits for the answer to a keep-alive sent at
/// `sent`, the lease running to `expires`: until a third of the TTL is left
/// (a move and a fresh stream's first answer fit in it), at least
/// [`answer_deadline`], at most the request deadline.
pub(crate) fn keep_alive_wait(
    sent: tokio::time::Instant,
    expires: tokio::time::Instant,
    ttl: Duration,
    request_timeout: Duration,
) -> Duration {
    let slack = expires
        .saturating_duration_since(sent)
        .saturating_sub(ttl / 3);
    slack
        .min(request_timeout)
        .max(answer_deadline(ttl, request_timeout))
}

/// The order in which `host` goes through `endpoints` (indices into
/// them): highest random weight first, a hash of the host id and the
/// endpoint, so hosts start spread over the members and, when one member
/// goes, its hosts move spread over the others. Moving every host to the
/// *next* member in one shared order (as until 2026-11-28) put all of a
/// killed leader's hosts on one member, two thirds of a 4,096-host fleet
/// on a 3-member cluster; pausing that member then moved two thirds of
/// the fleet at once, onto one member (docs/benchmarks.md, "A 3-member
/// cluster at 4,096 hosts").
pub fn member_order(endpoints: &[String], host: &str) -> Vec<usize> {
    let weight = |e: &String| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        host.hash(&mut h);
        e.hash(&mut h);
        h.finish()
    };
    let mut order: Vec<usize> = (0..endpoints.len()).collect();
    order.sort_by_cached_key(|&i| std::cmp::Reverse(weight(&endpoints[i])));
    order
}

/// The lease keeper's place among the endpoints.
pub(crate) struct LeaseRoute {
    endpoints: Vec<String>,
    /// This host's order of the endpoints ([`member_order`]).
    order: Vec<usize>,
    /// The endpoint in use, a place in `order`.
    at: usize,
    /// A client to `endpoints[at]` alone, made when first needed.
    client: Option<Client>,
}

impl std::fmt::Debug for LeaseRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseRoute")
            .field("endpoint", &self.endpoint())
            .field("connected", &self.client.is_some())
            .finish()
    }
}

impl LeaseRoute {
    /// A route over `endpoints` in `host`'s own order ([`member_order`]),
    /// so a job's keep-alives spread over the members, and so do the moves
    /// away from one.
    pub(crate) fn new(endpoints: &[String], host: &str) -> Self {
        Self {
            endpoints: endpoints.to_vec(),
            order: member_order(endpoints, host),
            at: 0,
            client: None,
        }
    }

    /// How long to wait for the answer to a keep-alive sent at `sent`, the
    /// lease running to `expires`: [`keep_alive_wait`] with several
    /// endpoints; with one, where there is nowhere to move, a sixth of the
    /// TTL as before the wait grew (a CI run of tests/notice_hosts.rs, a
    /// 3 s TTL on a starved machine, saw leases lapse with the longer wait
    /// on one endpoint, cause not established; the leader change it is for
    /// needs several members).
    pub(crate) fn answer_wait(
        &self,
        sent: tokio::time::Instant,
        expires: tokio::time::Instant,
        ttl: Duration,
        request_timeout: Duration,
    ) -> Duration {
        if self.can_move() {
            keep_alive_wait(sent, expires, ttl, request_timeout)
        } else {
            answer_deadline(ttl, request_timeout)
        }
    }

    /// Whether there is another endpoint to move to.
    pub(crate) fn can_move(&self) -> bool {
        self.endpoints.len() > 1
    }

    /// The endpoint in use.
    pub(crate) fn endpoint(&self) -> &str {
        self.order
            .get(self.at)
            .and_then(|&i| self.endpoints.get(i))
            .map_or("", String::as_str)
    }

    /// Moves to the next endpoint in this host's order (its client is made
    /// on the next [`LeaseRoute::client`]).
    pub(crate) fn move_on(&mut self) {
        if self.can_move() {
            self.at = (self.at + 1) % self.order.len();
            self.client = None;
        }
    }

    /// The client to keep the lease through: `shared` with one endpoint,
    /// else a client of the route's own to the endpoint in use, connected
    /// lazily (the first request makes the connection, under its
    /// deadline).
    pub(crate) async fn client(
        &mut self,
        shared: &Client,
        access: &EtcdAccess,
        deadline: Duration,
        ttl: Duration,
    ) -> Result<Client, CoordError> {
        if !self.can_move() {
            return Ok(shared.clone());
        }
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let endpoint = self.endpoint().to_owned();
        let options = super::connect::options(access, deadline, Some(ttl / 3))?;
        let connect = Client::connect([endpoint.as_str()], Some(options));
        let client =
            super::bounded::call(&endpoint, deadline, "connect (lease)", "", connect).await?;
        self.client = Some(client.clone());
        Ok(client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_deadline_is_well_under_the_ttl() {
        let s = Duration::from_secs;
        assert_eq!(answer_deadline(s(12), s(5)), s(2));
        // Never longer than a request may take.
        assert_eq!(answer_deadline(s(60), s(2)), s(2));
        // An unanswered keep-alive and two more tries fit in the TTL.
        for ttl in [s(1), s(3), s(5), s(10), s(30)] {
            let d = answer_deadline(ttl, s(5));
            assert!(ttl / 3 + d * 3 < ttl, "{ttl:?}: {d:?}");
        }
    }

    #[test]
    fn a_keep_alive_is_waited_for_until_a_third_of_the_ttl_is_left() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let t0 = tokio::time::Instant::now();
        let ttl = s(12);
        // Sent a third of the TTL after the last renewal: 8 s left on the
        // lease, waited for until 4 s are left.
        assert_eq!(keep_alive_wait(t0 + s(4), t0 + ttl, ttl, s(5)), s(4));
        // Never past the request deadline.
        assert_eq!(keep_alive_wait(t0 + s(4), t0 + ttl, ttl, s(3)), s(3));
        // Little left (a stream opened late in a doubt): a sixth of the TTL.
        assert_eq!(keep_alive_wait(t0 + s(9), t0 + ttl, ttl, s(5)), s(2));
        assert_eq!(keep_alive_wait(t0 + s(20), t0 + ttl, ttl, s(5)), s(2));
        // A member that stops answering is left with a third of the TTL
        // on the lease: the next member's connection and first answer, a
        // sixth each at most, fit before its end.
        for ttl in [s(3), s(5), s(10), s(30)] {
            let last = t0;
            let sent = last + ttl / 3;
            let left_at = sent + keep_alive_wait(sent, last + ttl, ttl, s(5));
            let next = answer_deadline(ttl, s(5));
            assert!(left_at + next * 2 <= last + ttl + ms(1), "{ttl:?}");
        }
    }

    #[test]
    fn the_route_goes_round_every_endpoint_and_stays_with_one() {
        let three: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let mut r = LeaseRoute::new(&three, "host-1");
        let start = r.endpoint().to_owned();
        let mut seen = vec![start.clone()];
        for _ in 0..2 {
            r.move_on();
            seen.push(r.endpoint().to_owned());
        }
        seen.sort();
        assert_eq!(seen, three, "each endpoint once in three moves");
        r.move_on();
        assert_eq!(r.endpoint(), start, "and round again");
        // Hosts start on different endpoints.
        let starts: std::collections::BTreeSet<String> = (0..30)
            .map(|i| {
                LeaseRoute::new(&three, &format!("host-{i}"))
                    .endpoint()
                    .to_owned()
            })
            .collect();
        assert_eq!(starts.len(), 3);
        let mut one = LeaseRoute::new(&three[..1], "host-1");
        assert!(!one.can_move());
        one.move_on();
        assert_eq!(one.endpoint(), "a");
    }

    /// When a member goes, its hosts move spread over the others, not all
    /// to one (issue 30: a killed leader's hosts all went to the next
    /// member, which then held two thirds of a 4,096-host fleet).
    #[test]
    fn the_hosts_of_a_member_that_goes_spread_over_the_others() {
        let three: Vec<String> = [
            "http://127.0.0.2:2379",
            "http://127.0.0.3:2379",
            "http://127.0.0.4:2379",
        ]
        .map(String::from)
        .to_vec();
        let mut starts = std::collections::BTreeMap::<String, usize>::new();
        let mut moved = std::collections::BTreeMap::<String, usize>::new();
        for i in 0..3000 {
            let mut r = LeaseRoute::new(&three, &format!("host-{i:05}"));
            *starts.entry(r.endpoint().to_owned()).or_default() += 1;
            if r.endpoint() == three[0] {
                r.move_on();
                *moved.entry(r.endpoint().to_owned()).or_default() += 1;
            }
        }
        assert_eq!(starts.len(), 3, "{starts:?}");
        assert!(starts.values().all(|&n| n > 800), "{starts:?}");
        assert_eq!(moved.len(), 2, "{moved:?}");
        let total: usize = moved.values().sum();
        assert!(
            moved.values().all(|&n| n * 10 > total * 4),
            "the first member's hosts went mostly to one other: {moved:?}"
        );
    }
}
