//! Whether this agent can take the connections of its job's restore: said
//! when a launcher hands the job's peers over (SetCheckpointPeers), the
//! first time the job's size is known here, not at a restore that fails.
//!
//! A job of up to `checkpoint.collect_above` hosts restores by asking every
//! peer what it holds ([`super::restore`]): when the whole job restores at
//! once (a restart after a fault), every agent is dialled by every other,
//! which then keep the connection. Past this agent's connection cap the
//! later ones are refused at accept; those hosts' restores find a holder
//! unreachable, ask again, and answer ABORTED
//! (`exception.ckpt_holders_unreachable`) until the kept connections go
//! idle (`api.idle_timeout`). A larger job restores through the collector
//! ([`super::collect`]): the busiest host (the job's first) takes its
//! group's asks and every other group's leader's, about 2√N, plus the
//! restores of the ranks whose copies it holds; that is what is checked
//! for it.
//!
//! In: the job's count of other hosts, this agent's `api` and `checkpoint`
//! settings and the cap its listeners enforce. Out: nothing, or the warning
//! the launcher prints. Never: refuses anything itself (the listener's
//! quota does, at the connection).

use warden_core::detect::straggler::tree;

use super::CheckpointConfig;
use crate::config::ApiConfig;

/// Whether a job with `peers` other hosts would dial this agent more
/// times at a job-wide restore than it takes over `api.tcp`. `cap` is the
/// one the listeners enforce (the daemon's one budget; None: no TCP
/// listener counted yet). `holders`: how many of an origin's targets this
/// host takes copies for (the job's most `checkpoint.replicas`, at least
/// its own), each origin's restore asking it.
pub fn restore_connections_short(
    api: &ApiConfig,
    ckpt: &CheckpointConfig,
    cap: Option<usize>,
    peers: usize,
    holders: usize,
) -> Option<String> {
    let cap = api.peer_cap(cap)?;
    let hosts = peers + 1;
    if hosts > 1 && hosts > ckpt.collect_above {
        let k = tree::fan_out(hosts, ckpt.collect_fan_out);
        let busiest = tree::max_in_degree(hosts, k) + holders + 1;
        return (busiest > cap).then(|| {
            format!(
                "this job has {hosts} hosts, and its restores go through the checkpoint \
                 collector in groups of {k} (checkpoint.collect_fan_out {}): when the job \
                 restores at once, up to {busiest} agents connect to its first host (its \
                 group's, the other groups' leaders' and the holders' restores), but this \
                 agent takes at most {cap} (api.max_connections {}, within its RLIMIT_NOFILE, \
                 less those kept for admins); raise api.max_connections and LimitNOFILE on \
                 every host, or set checkpoint.collect_fan_out nearer the square root of the \
                 hosts",
                ckpt.collect_fan_out, api.max_connections,
            )
        });
    }
    (peers > cap).then(|| {
        format!(
            "this job has {hosts} hosts, and a restore on each asks every other host's agent \
             what it holds (checkpoint.collect_above {}): when the job restores at once, \
             {peers} agents connect here, but this agent takes at most {cap} \
             (api.max_connections {}, within its RLIMIT_NOFILE, less those kept for admins): \
             {} hosts' restores would find this one unreachable and fail (ABORTED) until the \
             kept connections go idle (api.idle_timeout); lower checkpoint.collect_above, or \
             raise api.max_connections and LimitNOFILE on every host (about 33 KB of memory a \
             connection)",
            ckpt.collect_above,
            api.max_connections,
            peers - cap,
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
    fn a_job_whose_restore_passes_the_cap_is_said_with_the_shortfall() {
        let a = api("127.0.0.2:7000");
        // Every host asked directly (collect_above raised): 4,065 hosts,
        // 4,064 others, the default cap less the admins'.
        let direct = CheckpointConfig {
            collect_above: 100_000,
            ..CheckpointConfig::default()
        };
        assert_eq!(
            restore_connections_short(&a, &direct, Some(4064), 4064, direct.replicas),
            None
        );
        let said = restore_connections_short(&a, &direct, Some(4064), 4095, direct.replicas)
            .expect("said");
        assert!(said.contains("this job has 4096 hosts"), "{said}");
        assert!(said.contains("4095 agents connect here"), "{said}");
        assert!(said.contains("31 hosts' restores"), "{said}");
        assert!(
            said.contains("api.max_connections 4096") && said.contains("LimitNOFILE"),
            "{said}"
        );
        // No TCP listener, or no cap counted yet: nothing to say.
        assert_eq!(
            restore_connections_short(&api(""), &direct, Some(1), 10, direct.replicas),
            None
        );
        assert_eq!(
            restore_connections_short(&a, &direct, None, 10, direct.replicas),
            None
        );
    }

    #[test]
    fn through_the_collector_the_busiest_host_takes_about_twice_the_root() {
        let a = api("127.0.0.2:7000");
        let ck = CheckpointConfig::default();
        // 16,384 hosts in groups of 128: 127 + 127, and the holders' two.
        assert_eq!(
            restore_connections_short(&a, &ck, Some(4064), 16_383, ck.replicas),
            None
        );
        let said =
            restore_connections_short(&a, &ck, Some(200), 16_383, ck.replicas).expect("said");
        assert!(said.contains("up to 256 agents connect"), "{said}");
        assert!(said.contains("groups of 128"), "{said}");
        // Holding the copies of 16 origins (the job's most replicas): 16
        // more restores ask it.
        assert_eq!(
            restore_connections_short(&a, &ck, Some(260), 16_383, ck.replicas),
            None
        );
        let said = restore_connections_short(&a, &ck, Some(260), 16_383, 16).expect("said");
        assert!(said.contains("up to 271 agents connect"), "{said}");
        // One group of 65,536: every host asks the first.
        let one_group = CheckpointConfig {
            collect_fan_out: 65_536,
            ..CheckpointConfig::default()
        };
        let said =
            restore_connections_short(&a, &one_group, Some(4064), 16_383, one_group.replicas)
                .expect("said");
        assert!(said.contains("up to 16385 agents"), "{said}");
    }
}
