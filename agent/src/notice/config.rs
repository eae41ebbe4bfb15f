//! `[notice]`: where notices of a coming stop are read from.
//!
//! In: the TOML keys. Out: a checked [`NoticeConfig`], or an error naming
//! the dotted key. Never: network or file I/O (detection is `detect.rs`).

use std::net::IpAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use warden_core::config::ConfigError;

/// Whether a cloud's source runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    /// Only where the host says it runs on that cloud (its DMI strings in
    /// sysfs: no network call off the cloud).
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
}

/// `[notice]`: the sources of notices (preemption, host maintenance, a
/// node taint). The launcher's own SIGTERM needs nothing here (`warden run
/// --term-grace`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NoticeConfig {
    /// `[notice.gce]`: the Google Compute Engine metadata server.
    pub gce: GceConfig,
    /// `[notice.aws]`: the EC2 instance metadata service (IMDSv2).
    pub aws: AwsConfig,
    /// `[notice.kubernetes]`: a node taint, read from a file.
    pub kubernetes: KubernetesConfig,
    /// Accept a source URL on a loopback address and an unprivileged port
    /// (1024 and up), where any local user could answer in its place and
    /// stop every job of the host. Off: such URLs are refused (tests and
    /// a metadata proxy of the operator's own turn it on).
    pub allow_user_endpoints: bool,
}

/// `[notice.gce]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GceConfig {
    /// `auto` (on where the DMI product name is "Google Compute Engine"),
    /// `on` or `off`.
    pub enabled: Switch,
    /// The metadata server's `computeMetadata/v1` root.
    pub url: String,
    /// How long one long-poll (`wait_for_change=true`) may wait before the
    /// server answers with the same value (its `timeout_sec`).
    #[serde(with = "warden_core::config::duration")]
    pub wait: Duration,
    /// The stop's window after `instance/preempted` turns TRUE (GCE gives
    /// a preemptible or Spot VM 30 s).
    #[serde(with = "warden_core::config::duration")]
    pub preempt_window: Duration,
    /// The stop's window after `instance/maintenance-event` names a
    /// maintenance (GCE gives 60 s before it).
    #[serde(with = "warden_core::config::duration")]
    pub maintenance_window: Duration,
    /// `instance/upcoming-maintenance` (where served) raises a notice this
    /// long before its window starts.
    #[serde(with = "warden_core::config::duration")]
    pub upcoming_lead: Duration,
}

impl Default for GceConfig {
    fn default() -> Self {
        Self {
            enabled: Switch::Auto,
            url: "http://metadata.google.internal/computeMetadata/v1".into(),
            wait: Duration::from_secs(60),
            preempt_window: Duration::from_secs(30),
            maintenance_window: Duration::from_secs(60),
            upcoming_lead: Duration::from_secs(60),
        }
    }
}

/// `[notice.aws]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AwsConfig {
    /// `auto` (on where the DMI vendor is "Amazon EC2"), `on` or `off`.
    pub enabled: Switch,
    /// The instance metadata service's root (IMDSv2: a token PUT to
    /// `/latest/api/token` first).
    pub url: String,
    /// How often `spot/instance-action` is read (AWS advises 5 s).
    #[serde(with = "warden_core::config::duration")]
    pub poll_interval: Duration,
    /// The token's lifetime asked for in the PUT.
    #[serde(with = "warden_core::config::duration")]
    pub token_ttl: Duration,
}

impl Default for AwsConfig {
    fn default() -> Self {
        Self {
            enabled: Switch::Auto,
            url: "http://169.254.169.254".into(),
            poll_interval: Duration::from_secs(5),
            token_ttl: Duration::from_secs(21_600),
        }
    }
}

/// `[notice.kubernetes]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// The node's taints, as a file (empty: off): the node's
    /// `.spec.taints` JSON, or one `key[=value]:Effect` per line (what
    /// `kubectl taint` takes). A sidecar or a projected volume keeps it.
    pub taints_file: String,
    /// The taint keys that mean "this node is going away" (with effect
    /// NoSchedule or NoExecute).
    pub taints: Vec<String>,
    /// How often the file is read.
    #[serde(with = "warden_core::config::duration")]
    pub poll_interval: Duration,
    /// The stop's window after the taint appears (the pod's
    /// `terminationGracePeriodSeconds`).
    #[serde(with = "warden_core::config::duration")]
    pub window: Duration,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            taints_file: String::new(),
            taints: vec![
                "cloud.google.com/impending-node-termination".into(),
                "aws-node-termination-handler/spot-itn".into(),
                "node.kubernetes.io/unschedulable".into(),
            ],
            poll_interval: Duration::from_secs(2),
            window: Duration::from_secs(30),
        }
    }
}

impl NoticeConfig {
    /// Checks every `[notice]` key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        self.check_url(origin, "notice.gce.url", &self.gce.url)?;
        self.check_url(origin, "notice.aws.url", &self.aws.url)?;
        let between = |key: &'static str, d: Duration, lo: Duration, hi: Duration| {
            if d < lo || d > hi {
                return Err(ConfigError::invalid(
                    origin,
                    key,
                    humantime::format_duration(d).to_string(),
                    &format!(
                        "must be between {} and {}",
                        humantime::format_duration(lo),
                        humantime::format_duration(hi)
                    ),
                ));
            }
            Ok(())
        };
        let s = Duration::from_secs;
        between("notice.gce.wait", self.gce.wait, s(1), s(3600))?;
        between(
            "notice.gce.preempt_window",
            self.gce.preempt_window,
            s(1),
            s(3600),
        )?;
        between(
            "notice.gce.maintenance_window",
            self.gce.maintenance_window,
            s(1),
            s(3600),
        )?;
        between(
            "notice.gce.upcoming_lead",
            self.gce.upcoming_lead,
            s(1),
            s(86_400),
        )?;
        between(
            "notice.aws.poll_interval",
            self.aws.poll_interval,
            Duration::from_millis(100),
            s(600),
        )?;
        between("notice.aws.token_ttl", self.aws.token_ttl, s(1), s(21_600))?;
        between(
            "notice.kubernetes.poll_interval",
            self.kubernetes.poll_interval,
            Duration::from_millis(100),
            s(600),
        )?;
        between(
            "notice.kubernetes.window",
            self.kubernetes.window,
            s(1),
            s(3600),
        )?;
        if !self.kubernetes.taints_file.is_empty() {
            if !self.kubernetes.taints_file.starts_with('/') {
                return Err(ConfigError::invalid(
                    origin,
                    "notice.kubernetes.taints_file",
                    self.kubernetes.taints_file.clone(),
                    "must be an absolute path",
                ));
            }
            if self.kubernetes.taints.is_empty() {
                return Err(ConfigError::invalid(
                    origin,
                    "notice.kubernetes.taints",
                    "[]".to_owned(),
                    "names no taint: with a taints_file, name the taint keys that mean a stop",
                ));
            }
        }
        for t in &self.kubernetes.taints {
            if t.is_empty() || t.len() > 316 || t.chars().any(|c| c.is_whitespace() || c == ':') {
                return Err(ConfigError::invalid(
                    origin,
                    "notice.kubernetes.taints",
                    t.clone(),
                    "a taint key is 1-316 characters, no spaces or ':'",
                ));
            }
        }
        Ok(())
    }

    /// An `http://` URL; a loopback one on an unprivileged port only with
    /// `allow_user_endpoints` (any local user could listen there).
    fn check_url(&self, origin: &str, key: &'static str, raw: &str) -> Result<(), ConfigError> {
        let u = url::Url::parse(raw).map_err(|e| {
            ConfigError::invalid(origin, key, raw.to_owned(), &format!("not a URL: {e}"))
        })?;
        if u.scheme() != "http" {
            return Err(ConfigError::invalid(
                origin,
                key,
                raw.to_owned(),
                "must be http:// (metadata servers speak plain HTTP on a link-local address)",
            ));
        }
        let port = u.port_or_known_default().unwrap_or(80);
        let loopback = match u.host() {
            Some(url::Host::Ipv4(a)) => IpAddr::V4(a).is_loopback(),
            Some(url::Host::Ipv6(a)) => IpAddr::V6(a).is_loopback(),
            Some(url::Host::Domain(d)) => d == "localhost",
            None => {
                return Err(ConfigError::invalid(
                    origin,
                    key,
                    raw.to_owned(),
                    "has no host",
                ));
            }
        };
        if loopback && port >= 1024 && !self.allow_user_endpoints {
            return Err(ConfigError::invalid(
                origin,
                key,
                raw.to_owned(),
                "a loopback address on an unprivileged port: any local user could answer there and stop every job on the host; set notice.allow_user_endpoints = true if the operator runs that server",
            ));
        }
        Ok(())
    }
}
