//! Whether this agent can take the connections of its job's restore: said
//! when a launcher hands the job's peers over (SetCheckpointPeers), the
//! first time the job's size is known here, not at a restore that fails.
//!
//! A restore asks every peer of the job what it holds
//! ([`super::restore::gather`]): O(N) calls per host, and when the whole
//! job restores at once (a restart after a fault), every agent is dialled
//! by every other, which then keep the connection. Past this agent's
//! connection cap the later ones are refused at accept; those hosts'
//! restores find a holder unreachable, ask again, and answer ABORTED
//! (`exception.ckpt_holders_unreachable`) until the kept connections go
//! idle (`api.idle_timeout`). With the defaults (`api.max_connections`
//! 4096, less 32 kept for admins) that is a job of more than 4,065 hosts:
//! a limit below issue 30's 16,384, named here and in docs/operations.md
//! until the restore's listing goes through a collector instead of every
//! peer.
//!
//! In: the job's count of other hosts, this agent's `api` settings and the
//! cap its listeners enforce. Out: nothing, or the warning the launcher
//! prints. Never: refuses anything itself (the listener's quota does, at
//! the connection).

use crate::config::ApiConfig;

/// Whether a job with `peers` other hosts would dial this agent more
/// times at a job-wide restore than it takes over `api.tcp`. `cap` is the
/// one the listeners enforce (the daemon's one budget; None: no TCP
/// listener counted yet).
pub fn restore_connections_short(
    api: &ApiConfig,
    cap: Option<usize>,
    peers: usize,
) -> Option<String> {
    if api.tcp.is_empty() {
        return None;
    }
    let cap = cap?;
    (peers > cap).then(|| {
        format!(
            "this job has {} hosts, and a restore on each asks every other host's agent what it \
             holds: when the job restores at once, {peers} agents connect here, but this agent \
             takes at most {cap} (api.max_connections {}, within its RLIMIT_NOFILE, less those \
             kept for admins): {} hosts' restores would find this one unreachable and fail \
             (ABORTED) until the kept connections go idle (api.idle_timeout); raise \
             api.max_connections and LimitNOFILE on every host (about 33 KB of memory a \
             connection)",
            peers + 1,
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
        // 4,065 hosts: 4,064 others, the default cap less the admins'.
        assert_eq!(restore_connections_short(&a, Some(4064), 4064), None);
        let said = restore_connections_short(&a, Some(4064), 4095).expect("said");
        assert!(said.contains("this job has 4096 hosts"), "{said}");
        assert!(said.contains("4095 agents connect here"), "{said}");
        assert!(said.contains("31 hosts' restores"), "{said}");
        assert!(
            said.contains("api.max_connections 4096") && said.contains("LimitNOFILE"),
            "{said}"
        );
        // No TCP listener, or no cap counted yet: nothing to say.
        assert_eq!(restore_connections_short(&api(""), Some(1), 10), None);
        assert_eq!(restore_connections_short(&a, None, 10), None);
    }
}
