//! What one launcher needs to take part in a multi-host job.
//!
//! Built by `warden run` from its torchrun-style flags (`--rdzv-endpoint`,
//! `--rdzv-id`, `--nnodes MIN:MAX`, ...), not read from a file, so there is
//! no serde here; [`CoordConfig::validate`] names the field that is wrong.

use std::time::Duration;

use super::CoordError;

/// Where the job's keys live unless the launcher says otherwise.
pub const DEFAULT_PREFIX: &str = "/warden/jobs";
/// torchrun's default `MASTER_PORT`: the rendezvous port of epoch 0.
pub const DEFAULT_BASE_PORT: u16 = 29500;
/// How many ports the rendezvous port cycles through (`base_port + epoch %
/// port_span`).
pub const DEFAULT_PORT_SPAN: u16 = 1000;

/// How late etcd may delete the keys of a lease that ran out: its lessor
/// looks for expired leases every 500 ms (etcd 3.4 and 3.5,
/// `lease/lessor.go`, `runLoop`). The rejoin grace is counted from the
/// lease's end, so the other hosts start it this much before they see the
/// key go: a lost host is then out within its TTL, the grace and the
/// round's write, wherever the sweep fell (issue 30's bound), and a
/// launcher that lapsed keeps between `rejoin_grace` less this and
/// `rejoin_grace` to re-register.
pub const ETCD_EXPIRY_SWEEP: Duration = Duration::from_millis(500);

/// One launcher's view of the job it takes part in.
///
/// Every host of a job must agree on `job`, `prefix`, `min_nodes`,
/// `max_nodes`, `base_port` and `port_span`; the round is computed by
/// whichever host advances the epoch, with its own values (a mismatch is
/// logged at join).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordConfig {
    /// etcd client endpoints: `host:port`, `http://host:port`, or with
    /// `access.tls` `https://host:port` (a bare `host:port` is then TLS too).
    pub endpoints: Vec<String>,
    /// TLS to etcd and the etcd user: without them anyone who reaches etcd
    /// can read and forge the job's rounds (docs/security.md).
    pub access: super::access::EtcdAccess,
    /// The key prefix under which jobs live; the job's keys are
    /// `<prefix>/<job>/...`. Lets several clusters share one etcd.
    pub prefix: String,
    /// The job's id (`--rdzv-id`): the same on every host of the job, unique
    /// among the jobs that share the etcd prefix.
    pub job: String,
    /// This host's id in the job (default: the host name). Two live
    /// launchers may not share one: the second waits, then fails.
    pub host: String,
    /// The address the other hosts reach this host's workers at; the
    /// round's `MASTER_ADDR` when this host is node rank 0.
    pub addr: String,
    /// Worker processes this host runs (`--nproc-per-node`); the world size
    /// is the sum over the round's members.
    pub nproc_per_node: u32,
    /// The fewest hosts the job may run on (`--nnodes MIN:MAX`): below it the
    /// job waits, workers stopped, until hosts come back.
    pub min_nodes: u32,
    /// The most hosts the job runs on; live hosts beyond it wait as standby
    /// spares and replace a member that leaves (hot-swap).
    pub max_nodes: u32,
    /// A spare is taken into a round only after every regular host, so a
    /// dedicated spare host waits until a regular one is missing.
    pub spare: bool,
    /// TTL of this host's membership lease: a launcher that dies (or loses
    /// etcd) for this long is out of the job. Whole seconds, at least 1;
    /// etcd also enforces its own minimum (about 1.5 x its election timeout).
    pub lease_ttl: Duration,
    /// How long a round that could grow waits for more hosts before it
    /// forms (torchrun's "last call"): at the first formation once
    /// `min_nodes` are there, and on scale-up once a host comes back. A
    /// round that reaches `max_nodes` forms at once.
    pub last_call: Duration,
    /// The rendezvous port of the round at epoch `e` is `base_port + e %
    /// port_span`: a new round never reuses the previous round's port, so a
    /// worker left from an old round cannot join the new one's store.
    pub base_port: u16,
    /// See `base_port`.
    pub port_span: u16,
    /// Deadline of every single etcd request.
    pub request_timeout: Duration,
    /// How long `join` waits for a host id still held by a previous
    /// launcher's lease (a launcher restarted on the same host) to free up.
    pub join_timeout: Duration,
    /// This host's agent as a checkpoint peer, published in its member
    /// record so the job's other agents replicate to it; `None`: it takes
    /// no replicas.
    pub ckpt_peer: Option<super::records::CkptPeer>,
    /// This host's agent takes a replica ring by node-rank order
    /// (`warden_agent::RING_BY_PLACE` in its GetAgentInfo), published in the
    /// member record.
    pub ckpt_ring_by_place: bool,
    /// This host's agent's `checkpoint.replicas`, published in the member
    /// record where it takes replicas and judges placement by the job's
    /// most (None: not said).
    pub ckpt_replicas: Option<u32>,
    /// How long the other hosts wait for a member whose lease expired
    /// without a word (etcd out, the host stalled) to re-register before
    /// they re-form the round without it. A member that left, or a new
    /// launcher on its host id, is replaced at once. The launcher uses its
    /// lease TTL. Counted from the lease's end, which etcd reports up to
    /// [`ETCD_EXPIRY_SWEEP`] late: the others wait this less the sweep
    /// (nothing below zero) once they see the key go.
    pub rejoin_grace: Duration,
    /// How long this launcher keeps trying to keep or regain its membership
    /// after its lease lapsed (no keep-alive answered for a TTL, or etcd
    /// says it expired) before it gives up with [`CoordError::LeaseLost`].
    /// Its workers keep running meanwhile.
    pub rejoin_timeout: Duration,
}

impl CoordConfig {
    /// A config with the defaults (min = max = 1 node, 1 worker, 5 s lease,
    /// 2 s last call, ports from 29500, 2 s requests) for the given job.
    pub fn new(
        endpoints: Vec<String>,
        job: impl Into<String>,
        host: impl Into<String>,
        addr: impl Into<String>,
    ) -> Self {
        Self {
            endpoints,
            access: super::access::EtcdAccess::default(),
            prefix: DEFAULT_PREFIX.to_owned(),
            job: job.into(),
            host: host.into(),
            addr: addr.into(),
            nproc_per_node: 1,
            min_nodes: 1,
            max_nodes: 1,
            spare: false,
            lease_ttl: Duration::from_secs(5),
            last_call: Duration::from_secs(2),
            base_port: DEFAULT_BASE_PORT,
            port_span: DEFAULT_PORT_SPAN,
            request_timeout: Duration::from_secs(2),
            join_timeout: Duration::from_secs(15),
            ckpt_peer: None,
            ckpt_ring_by_place: false,
            ckpt_replicas: None,
            rejoin_grace: Duration::from_secs(5),
            rejoin_timeout: Duration::from_secs(60),
        }
    }

    /// Checks every field; the error names the first one that is wrong and
    /// its value.
    pub fn validate(&self) -> Result<(), CoordError> {
        let bad = |field: &'static str, value: String, problem: &str| {
            Err(CoordError::Config {
                field,
                value,
                problem: problem.to_owned(),
            })
        };
        if self.endpoints.is_empty() {
            return bad("endpoints", "[]".into(), "at least one etcd endpoint");
        }
        for e in &self.endpoints {
            if e.trim().is_empty() {
                return bad("endpoints", e.clone(), "an endpoint is empty");
            }
        }
        super::connect::check_endpoints(&self.endpoints, &self.access)?;
        if let Some(c) = &self.access.auth {
            if c.user.is_empty() {
                return bad("access.auth.user", String::new(), "must not be empty");
            }
            if c.password.expose().is_empty() {
                return bad(
                    "access.auth.password",
                    "<redacted>".into(),
                    "must not be empty",
                );
            }
        }
        if !self.prefix.starts_with('/') || self.prefix.ends_with('/') {
            return bad(
                "prefix",
                self.prefix.clone(),
                "must start with '/' and not end with one",
            );
        }
        for (field, value) in [("job", &self.job), ("host", &self.host)] {
            if !is_key_segment(value) {
                return bad(
                    field,
                    value.clone(),
                    "must be non-empty, at most 128 characters, of letters, digits, '.', '_', '-', ':'",
                );
            }
        }
        if self.addr.trim().is_empty() {
            return bad("addr", self.addr.clone(), "must not be empty");
        }
        if let Some(p) = &self.ckpt_peer
            && !warden_core::config::valid_peer_addr(&p.addr)
        {
            return bad("ckpt_peer.addr", p.addr.clone(), "must be host:port");
        }
        if self.nproc_per_node == 0 {
            return bad("nproc_per_node", "0".into(), "must be at least 1");
        }
        // `--nproc-per-node` holds the CLI to this; the library's callers too.
        if self.nproc_per_node > crate::nproc::MAX {
            return bad(
                "nproc_per_node",
                self.nproc_per_node.to_string(),
                &format!("must be at most {}", crate::nproc::MAX),
            );
        }
        if self.min_nodes == 0 {
            return bad("min_nodes", "0".into(), "must be at least 1");
        }
        if self.max_nodes < self.min_nodes {
            return bad(
                "max_nodes",
                self.max_nodes.to_string(),
                &format!("must be at least min_nodes ({})", self.min_nodes),
            );
        }
        if self.lease_ttl < Duration::from_secs(1) || self.lease_ttl.subsec_nanos() != 0 {
            return bad(
                "lease_ttl",
                format!("{:?}", self.lease_ttl),
                "must be whole seconds, at least 1s (etcd leases are in seconds)",
            );
        }
        if self.rejoin_timeout < self.lease_ttl {
            return bad(
                "rejoin_timeout",
                format!("{:?}", self.rejoin_timeout),
                &format!("must be at least lease_ttl ({:?})", self.lease_ttl),
            );
        }
        if self.port_span == 0 {
            return bad("port_span", "0".into(), "must be at least 1");
        }
        if u32::from(self.base_port) + u32::from(self.port_span) - 1 > u32::from(u16::MAX) {
            return bad(
                "port_span",
                self.port_span.to_string(),
                &format!(
                    "base_port ({}) + port_span - 1 must be a valid port",
                    self.base_port
                ),
            );
        }
        if self.request_timeout.is_zero() {
            return bad("request_timeout", "0s".into(), "must be more than 0");
        }
        Ok(())
    }

    /// The lease TTL as etcd wants it: whole seconds.
    pub(crate) fn ttl_secs(&self) -> i64 {
        i64::try_from(self.lease_ttl.as_secs()).unwrap_or(i64::MAX)
    }
}

/// A job or host id must be one key segment: no '/', nothing that could
/// make one job's keys a prefix of another's.
fn is_key_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> CoordConfig {
        let mut c = CoordConfig::new(vec!["127.0.0.1:2379".into()], "job-1", "host-a", "10.0.0.1");
        c.min_nodes = 2;
        c.max_nodes = 3;
        c
    }

    #[test]
    fn defaults_are_valid() {
        assert!(ok().validate().is_ok());
    }

    #[test]
    fn https_is_valid_with_a_ca() {
        let mut c = ok();
        c.endpoints = vec!["https://etcd:2379".into(), "etcd-2:2379".into()];
        c.access.tls = Some(crate::coord::EtcdTlsFiles {
            ca: "/etc/etcd/ca.pem".into(),
            identity: None,
        });
        assert!(c.validate().is_ok(), "{:?}", c.validate());
    }

    type Change = Box<dyn Fn(&mut CoordConfig)>;

    #[test]
    fn each_bad_field_is_named() {
        let cases: Vec<(&str, Change)> = vec![
            ("endpoints", Box::new(|c| c.endpoints.clear())),
            (
                "endpoints",
                Box::new(|c| c.endpoints = vec!["https://etcd:2379".into()]),
            ),
            (
                "endpoints",
                Box::new(|c| {
                    c.endpoints = vec!["http://etcd:2379".into()];
                    c.access.tls = Some(crate::coord::EtcdTlsFiles {
                        ca: "/etc/etcd/ca.pem".into(),
                        identity: None,
                    });
                }),
            ),
            (
                "access.auth.user",
                Box::new(|c| {
                    c.access.auth = Some(crate::coord::Credentials {
                        user: String::new(),
                        password: crate::coord::Password::new("x"),
                    });
                }),
            ),
            ("prefix", Box::new(|c| c.prefix = "warden".into())),
            ("prefix", Box::new(|c| c.prefix = "/warden/".into())),
            ("job", Box::new(|c| c.job = "a/b".into())),
            ("host", Box::new(|c| c.host = String::new())),
            ("addr", Box::new(|c| c.addr = " ".into())),
            ("nproc_per_node", Box::new(|c| c.nproc_per_node = 0)),
            (
                "nproc_per_node",
                Box::new(|c| c.nproc_per_node = crate::nproc::MAX + 1),
            ),
            ("min_nodes", Box::new(|c| c.min_nodes = 0)),
            ("max_nodes", Box::new(|c| c.max_nodes = 1)),
            (
                "lease_ttl",
                Box::new(|c| c.lease_ttl = Duration::from_millis(1500)),
            ),
            ("port_span", Box::new(|c| c.port_span = 0)),
            (
                "port_span",
                Box::new(|c| {
                    c.base_port = 65000;
                    c.port_span = 1000;
                }),
            ),
            (
                "request_timeout",
                Box::new(|c| c.request_timeout = Duration::ZERO),
            ),
        ];
        for (field, change) in cases {
            let mut c = ok();
            change(&mut c);
            match c.validate() {
                Err(CoordError::Config { field: f, .. }) => assert_eq!(f, field, "{c:?}"),
                other => panic!("{field}: expected a config error, got {other:?}"),
            }
        }
    }
}
