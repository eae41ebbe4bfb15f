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

mod common;
#[path = "common/fleet.rs"]
mod fleet;

use std::time::Duration;

use common::etcd::EtcdServer;
use fleet::{EtcdMetrics, Fleet, FleetConfig};

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
    let (lost, replaced) = fleet.lose_one().await;
    assert!(
        lost >= Duration::from_secs(2),
        "a host that said nothing is out only once its lease expired ({lost:?})"
    );
    assert!(replaced < Duration::from_secs(60));
}
