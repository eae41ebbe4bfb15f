//! Issue 30's fleet, small: 24 hosts of one job on a real etcd, 4 of them
//! running the real coordinator and 20 light ones doing a launcher's share
//! of etcd work (tests/common/fleet.rs; the bench `coord_fleet` runs the
//! same fleet at 1,024 and 2,048 hosts).
//!
//! What is shown: every host joins and holds one first round of all 24;
//! restart rounds reach every host; a host lost without a word is out
//! after its lease TTL and a new host takes its place; and what a restart
//! round costs etcd in bytes per host stays under a bound that a round
//! sending every host's assignment to every host would break.
//!
//! And on a 3-member etcd cluster (127.0.0.2-4, tests/common/etcd.rs), 12
//! hosts: the leader SIGKILLed during restart rounds; every host still holds
//! every next round, no host loses its lease, and etcd keeps every
//! member key.

mod common;
#[path = "common/fleet.rs"]
mod fleet;

use std::time::Duration;

use std::time::Instant;

use common::etcd::{EtcdCluster, EtcdServer};
use fleet::{EtcdMetrics, Fleet, FleetConfig};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const HOSTS: usize = 24;
const ROUNDS: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_joins_restarts_and_loses_a_host() {
    let etcd = EtcdServer::start();
    let mut cfg = FleetConfig::new(etcd.endpoints(), "fleet-ci", HOSTS, 4);
    cfg.ttl = Duration::from_secs(3);
    let (mut fleet, _) = Fleet::join(cfg).await;
    assert_eq!(fleet.hosts(), HOSTS);
    let before = EtcdMetrics::read(&etcd.endpoint);
    for _ in 0..ROUNDS {
        fleet.restart().await;
    }
    let after = EtcdMetrics::read(&etcd.endpoint);
    let per_host = (after.sent - before.sent) / ROUNDS as f64 / HOSTS as f64;
    // What one host is sent for one restart round: the watch events of the
    // epoch and of what it reads of the round. 8 KiB per host holds a
    // round whose record per host stays small; it fails once every host
    // is sent about 300 bytes for each of the other hosts.
    assert!(
        per_host < 8192.0,
        "etcd sent {per_host:.0} bytes per host per restart round"
    );
    let loss = fleet.lose_one().await;
    assert!(
        loss.out >= Duration::from_secs(2),
        "a host that said nothing is out only once its lease expired ({loss:?})"
    );
    // The others wait the rejoin grace (1 s) less etcd's 500 ms expiry
    // sweep once its key goes, which is no sooner than its lease's end.
    // The lease's end is taken from when the last answered keep-alive was
    // sent, never later than the real one: no margin for load needed.
    assert!(
        loss.beyond_lease_s >= 0.49,
        "a lost host is out only after the rejoin grace less the sweep past its lease ({loss:?})"
    );
    assert!(loss.replaced < Duration::from_secs(60));
    println!("a lost host: {loss:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_fleet_keeps_every_lease_through_a_leader_kill() {
    let mut cluster = EtcdCluster::start(3);
    let mut cfg = FleetConfig::new(cluster.endpoints(), "fleet-cluster", 12, 4);
    cfg.ttl = Duration::from_secs(4);
    cfg.request_timeout = Duration::from_secs(2);
    let ttl = cfg.ttl;
    let (mut fleet, _) = Fleet::join(cfg).await;
    fleet.restart().await;
    let leader = cluster.leader(Duration::from_secs(30));
    let pid = cluster.members[leader].pid();
    let epoch = fleet.epoch;
    // The kill lands while rounds run; rounds go on for a TTL and 2 s
    // after it: a lease left unrenewed by the kill would have expired.
    let killed = fleet
        .rounds_through(
            async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                kill(Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL the etcd leader");
                (Instant::now(), Duration::ZERO)
            },
            3,
            ttl + Duration::from_secs(2),
        )
        .await;
    cluster.members[leader].kill();
    assert!(killed.rounds >= 1, "{killed:?}");
    assert!(
        fleet.epoch > epoch,
        "every host holds the rounds after the kill"
    );
    // One more round after: every host holds it (wait_round covers all 12).
    let seen = fleet.epoch;
    fleet.restart_through_faults().await;
    assert_eq!(fleet.epoch, seen + 1);
    let leases = fleet.leases().await;
    assert!(killed.leases_kept, "{killed:?} {leases:?}");
    assert!(leases.all_kept(), "{leases:?}");
    assert_eq!(leases.member_keys, 12, "{leases:?}");
    let new_leader = cluster.leader(Duration::from_secs(30));
    assert_ne!(new_leader, leader, "a new leader was elected");
}
