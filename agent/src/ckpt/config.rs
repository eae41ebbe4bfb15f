//! `[checkpoint]`: the local tier, its peers and the durable store.
//!
//! The defaults give a working local tier on tmpfs with no peers and no
//! durable store: a single host restores from its own memory, and nothing
//! leaves the machine until the operator names where copies go.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use warden_core::config::{ConfigError, duration};

/// The most `checkpoint.replicas` an agent takes, and the most a launcher
/// may say a job's agents judge placement by (`SetCheckpointPeers.replicas`).
pub const MAX_REPLICAS: usize = 16;

/// `[checkpoint]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Off: the checkpoint calls answer UNAVAILABLE and nothing is written.
    pub enabled: bool,
    /// The local tier: tmpfs (the default, restores at memory speed) or an
    /// NVMe mount. Laid out as `<dir>/<job>/step-<n>/rank-<r>.bin` with a
    /// manifest beside each shard; `<dir>/.staging` holds writes in flight.
    /// Default: `/dev/shm/warden-ckpt`, or `/dev/shm/warden-ckpt-<uid>` for
    /// an agent running as a user ([`default_dir`]).
    pub dir: String,
    /// Complete steps kept per job and saving host; older ones are pruned
    /// once a newer step is complete (never the newest complete one).
    pub keep_steps: usize,
    /// Bytes the tier may hold in all (0: bounded by free space only).
    pub max_bytes: u64,
    /// Hand each user a compilation cache folder in the tier
    /// (`<dir>/.cache/<uid>`, ClaimJob). Its users write it as they like
    /// (their launcher bounds it): turn it off where the tier is a file
    /// system of its own that users must not fill (docs/security.md).
    pub compile_cache: bool,
    /// This host's failure domain (a rack, a power feed, a switch): a
    /// replica never goes to a peer of the same domain. Empty: the host name
    /// (every host its own domain).
    pub domain: String,
    /// Copies of each shard kept on peers of other domains.
    pub replicas: usize,
    /// Peer agents holding replicas and answering restores.
    pub peers: Vec<PeerConfig>,
    /// Replication and fetch chunk size, bytes.
    pub chunk_bytes: usize,
    /// Cap on replication to peers, bytes per second over all peers (0:
    /// none), so copies do not starve the job's own traffic.
    pub replication_bytes_per_sec: u64,
    /// Bound on connecting to a peer and on listing its shards.
    #[serde(with = "duration")]
    pub peer_timeout: Duration,
    /// A job of more hosts than this restores through a collector along
    /// the exchange's two-level tree (`ckpt::collect`): each host asks its
    /// group leader, not every other host, which copies exist (issue 30:
    /// asking every host is O(N) calls a host, and past an agent's
    /// connection cap the later hosts are refused). 0: always.
    pub collect_above: usize,
    /// The collector's group size: 0 (the default) about the square root
    /// of the job's hosts, at least 32; else this many hosts a group.
    pub collect_fan_out: u32,
    /// How often shards not yet on their peers (a peer was down, the agent
    /// restarted mid-copy) are sent again.
    #[serde(with = "duration")]
    pub retry_interval: Duration,
    /// Background scrub: committed shards in the local tier are read back
    /// and checked against their manifests at most this many bytes per
    /// second (0: no scrub). A copy whose bytes changed is marked corrupt
    /// (`warden ckpt ls` shows it, restores go to the next copy) and a
    /// `ckpt.corrupt` event is published. The default, 64 MiB/s, re-reads
    /// a 100 GiB tier in under half an hour for a few percent of one core.
    pub scrub_bytes_per_sec: u64,
    /// Pause between two scrub passes over the whole tier.
    #[serde(with = "duration")]
    pub scrub_interval: Duration,
    /// The durable tier.
    pub durable: DurableConfig,
}

/// One peer agent: `[[checkpoint.peers]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// `host:port` of its `api.tcp` listener.
    pub addr: String,
    /// Its failure domain; empty: a domain of its own.
    #[serde(default)]
    pub domain: String,
    /// Its identity: the agent's `agent.host_name`, which its certificate
    /// carries. Required with `api.tls_*`: the peer's certificate must
    /// name it, and only then may it push and fetch this host's shards.
    #[serde(default)]
    pub name: String,
}

/// `[checkpoint.durable]`: object storage through the object_store crate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DurableConfig {
    /// `file:///path`, `s3://bucket/prefix`, `gs://bucket/prefix`. Empty:
    /// no durable tier. Credentials come from the usual environment
    /// variables (AWS_ACCESS_KEY_ID, GOOGLE_SERVICE_ACCOUNT...).
    pub url: String,
    /// Upload a complete step when its number is a multiple of this (0:
    /// by time only).
    pub every_steps: u64,
    /// Upload a complete step when this long has passed since the last
    /// upload of the job (0: by step count only).
    #[serde(with = "duration")]
    pub every: Duration,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: default_dir(nix::unistd::geteuid().as_raw()),
            keep_steps: 2,
            max_bytes: 0,
            compile_cache: true,
            domain: String::new(),
            replicas: 1,
            peers: Vec::new(),
            chunk_bytes: 4 << 20,
            replication_bytes_per_sec: 0,
            peer_timeout: Duration::from_secs(2),
            collect_above: 128,
            collect_fan_out: 0,
            retry_interval: Duration::from_secs(2),
            scrub_bytes_per_sec: 64 << 20,
            scrub_interval: Duration::from_secs(600),
            durable: DurableConfig::default(),
        }
    }
}

/// The default tier of an agent running as `uid`: `/dev/shm/warden-ckpt`
/// for root, `/dev/shm/warden-ckpt-<uid>` for a user (the embedded agent of
/// `warden run`). Either is a directory the agent creates and owns (0711),
/// writable by nobody else; a user's gets its own name so that it never
/// meets root's tier, or another user's, in one directory the first comer
/// made (the tier refuses a directory it does not own).
pub fn default_dir(uid: u32) -> String {
    if uid == 0 {
        "/dev/shm/warden-ckpt".to_owned()
    } else {
        format!("/dev/shm/warden-ckpt-{uid}")
    }
}

impl Default for DurableConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            every_steps: 0,
            every: Duration::from_secs(600),
        }
    }
}

impl CheckpointConfig {
    /// Checks values that parse but make no sense; the error names the key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        if !self.enabled {
            return Ok(());
        }
        if self.dir.is_empty() || !std::path::Path::new(&self.dir).is_absolute() {
            return Err(invalid(
                "checkpoint.dir",
                format!("{:?}", self.dir),
                "must be an absolute path",
            ));
        }
        if self.keep_steps == 0 || self.keep_steps > 1000 {
            return Err(invalid(
                "checkpoint.keep_steps",
                self.keep_steps.to_string(),
                "must be between 1 and 1000",
            ));
        }
        if self.replicas > MAX_REPLICAS {
            return Err(invalid(
                "checkpoint.replicas",
                self.replicas.to_string(),
                "must be at most 16",
            ));
        }
        if !(4096..=(16 << 20)).contains(&self.chunk_bytes) {
            return Err(invalid(
                "checkpoint.chunk_bytes",
                self.chunk_bytes.to_string(),
                "must be between 4096 and 16777216",
            ));
        }
        if self.peer_timeout < Duration::from_millis(10)
            || self.peer_timeout > Duration::from_secs(300)
        {
            return Err(invalid(
                "checkpoint.peer_timeout",
                humantime::format_duration(self.peer_timeout).to_string(),
                "must be between 10ms and 5m",
            ));
        }
        if self.collect_fan_out == 1 || self.collect_fan_out > 65_536 {
            return Err(invalid(
                "checkpoint.collect_fan_out",
                self.collect_fan_out.to_string(),
                "must be 0 (about the square root of the job's hosts) or between 2 and 65536",
            ));
        }
        if self.scrub_bytes_per_sec > 0 && self.scrub_bytes_per_sec < 4096 {
            return Err(invalid(
                "checkpoint.scrub_bytes_per_sec",
                self.scrub_bytes_per_sec.to_string(),
                "must be 0 (off) or at least 4096",
            ));
        }
        if self.scrub_interval < Duration::from_millis(50) {
            return Err(invalid(
                "checkpoint.scrub_interval",
                humantime::format_duration(self.scrub_interval).to_string(),
                "must be at least 50ms",
            ));
        }
        if self.retry_interval < Duration::from_millis(50) {
            return Err(invalid(
                "checkpoint.retry_interval",
                humantime::format_duration(self.retry_interval).to_string(),
                "must be at least 50ms",
            ));
        }
        for p in &self.peers {
            if !warden_core::config::valid_peer_addr(&p.addr) {
                return Err(invalid(
                    "checkpoint.peers.addr",
                    format!("{:?}", p.addr),
                    "must be host:port (the peer's api.tcp)",
                ));
            }
        }
        if !self.durable.url.is_empty()
            && let Err(e) = super::durable::parse(&self.durable.url)
        {
            return Err(invalid(
                "checkpoint.durable.url",
                format!("{:?}", self.durable.url),
                &e,
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        assert!(CheckpointConfig::default().validate("t").is_ok());
        let bad = [
            CheckpointConfig {
                dir: "relative/dir".into(),
                ..Default::default()
            },
            CheckpointConfig {
                keep_steps: 0,
                ..Default::default()
            },
            CheckpointConfig {
                chunk_bytes: 10,
                ..Default::default()
            },
            CheckpointConfig {
                peers: vec![PeerConfig {
                    addr: "no-port".into(),
                    domain: String::new(),
                    name: String::new(),
                }],
                ..Default::default()
            },
            CheckpointConfig {
                durable: DurableConfig {
                    url: "ftp://x/y".into(),
                    ..Default::default()
                },
                ..Default::default()
            },
        ];
        let keys = [
            "checkpoint.dir",
            "checkpoint.keep_steps",
            "checkpoint.chunk_bytes",
            "checkpoint.peers.addr",
            "checkpoint.durable.url",
        ];
        for (cfg, key) in bad.iter().zip(keys) {
            let err = cfg.validate("t").expect_err(key).to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}
