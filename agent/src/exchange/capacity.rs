//! Whether this agent can take its job's straggler aggregator's
//! connections: said when a launcher hands the job's peers over
//! (SetCheckpointPeers), the first time the job's size is known here, not
//! at the first refused report.
//!
//! In: the job's host count, this agent's `api` and `straggler` settings
//! and the cap its listeners enforce. Out: nothing, or the warning the
//! launcher prints. Never: refuses anything itself (the listener's quota
//! does, at the connection).

use warden_core::detect::straggler::StragglerConfig;
use warden_core::detect::straggler::tree;

use crate::config::ApiConfig;

/// Whether a job with `peers` other hosts needs more connections at its
/// busiest host than this agent takes over `api.tcp`: the job's straggler
/// aggregator holds one from each host of its own group and from every
/// other group's leader (`warden_core::detect::straggler::tree`), so past
/// the cap the later hosts' reports are refused there. `cap` is the one
/// the listeners enforce (the daemon's one budget; None: no TCP listener
/// counted yet), not one computed again here.
pub fn connections_short(
    api: &ApiConfig,
    straggler: &StragglerConfig,
    cap: Option<usize>,
    peers: usize,
) -> Option<String> {
    let cap = api.peer_cap(cap)?;
    let hosts = peers + 1;
    let k = tree::fan_out(hosts, straggler.aggregator_fan_out);
    let needed = tree::max_in_degree(hosts, k);
    (needed > cap).then(|| {
        format!(
            "this job has {hosts} hosts, so its straggler aggregator takes {needed} connections \
             from other hosts (groups of {k}: straggler.aggregator_fan_out {}), but this agent \
             takes at most {cap} (api.max_connections {}, within its RLIMIT_NOFILE, less those \
             kept for admins): were it the job's aggregator, {} hosts could not report to it; set \
             straggler.aggregator_fan_out to 0 (the square root of the hosts), or raise \
             api.max_connections and LimitNOFILE on every host",
            straggler.aggregator_fan_out,
            api.max_connections,
            needed - cap,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(tcp: &str) -> ApiConfig {
        ApiConfig {
            tcp: tcp.to_owned(),
            ..ApiConfig::default()
        }
    }

    #[test]
    fn a_job_past_the_cap_is_said_with_the_shortfall_and_the_keys_to_change() {
        let s = StragglerConfig::default();
        let hosts = 2048;
        let k = tree::fan_out(hosts, s.aggregator_fan_out);
        let needed = tree::max_in_degree(hosts, k);
        // Room for every connection: nothing said.
        assert_eq!(
            connections_short(&api("127.0.0.2:7000"), &s, Some(needed), hosts - 1),
            None
        );
        // Ten short: said, with the count and both ways out.
        let said = connections_short(&api("127.0.0.2:7000"), &s, Some(needed - 10), hosts - 1)
            .expect("a shortfall is said");
        assert!(
            said.contains(&format!("takes {needed} connections")),
            "{said}"
        );
        assert!(said.contains("10 hosts could not report"), "{said}");
        assert!(
            said.contains("straggler.aggregator_fan_out") && said.contains("api.max_connections"),
            "{said}"
        );
        // No TCP listener, or no cap counted yet: nothing to say.
        assert_eq!(connections_short(&api(""), &s, Some(1), hosts - 1), None);
        assert_eq!(
            connections_short(&api("127.0.0.2:7000"), &s, None, hosts - 1),
            None
        );
    }
}
