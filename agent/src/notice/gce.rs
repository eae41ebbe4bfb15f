//! The GCE metadata server: preemption and host maintenance.
//!
//! In: `instance/preempted` (TRUE / FALSE), `instance/maintenance-event`
//! (NONE, MIGRATE_ON_HOST_MAINTENANCE, TERMINATE_ON_HOST_MAINTENANCE) and,
//! where served, `instance/upcoming-maintenance` (JSON with
//! `windowStartTime`), each read with the header `Metadata-Flavor: Google`:
//! once for its value and ETag, then long-polled with
//! `wait_for_change=true&last_etag=<etag>&timeout_sec=<wait>` so the server
//! answers as soon as it changes. Out: host notices on the [`NoticeBoard`].
//! Never: trust a body (bounded to 64 KiB, clipped), or poll a key the
//! server does not serve more than once a minute.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use warden_core::events::EventBus;

use super::config::GceConfig;
use super::{Notice, NoticeBoard, NoticeSource, say_trouble};

/// The most of a body read.
pub const MAX_BODY: usize = 64 * 1024;
/// Wait after a failed read before the next.
const RETRY: Duration = Duration::from_secs(2);
/// How often a key the server does not serve (404) is asked again.
const NOT_SERVED_RETRY: Duration = Duration::from_secs(60);

/// One of the keys read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// `instance/preempted`.
    Preempted,
    /// `instance/maintenance-event`.
    Maintenance,
    /// `instance/upcoming-maintenance`.
    Upcoming,
}

impl Key {
    /// Its path under `computeMetadata/v1`.
    pub fn path(self) -> &'static str {
        match self {
            Key::Preempted => "instance/preempted",
            Key::Maintenance => "instance/maintenance-event",
            Key::Upcoming => "instance/upcoming-maintenance",
        }
    }
}

/// What a key's value means: a notice (what, window from now or the stop's
/// own time), or none (pure: a table of cases tests it).
pub fn judge(
    key: Key,
    value: &str,
    cfg: &GceConfig,
    now: SystemTime,
) -> Option<(String, SystemTime)> {
    let v = value.trim();
    match key {
        Key::Preempted => {
            (v == "TRUE").then(|| (format!("{} = TRUE", key.path()), now + cfg.preempt_window))
        }
        Key::Maintenance => match v {
            "MIGRATE_ON_HOST_MAINTENANCE" | "TERMINATE_ON_HOST_MAINTENANCE" => Some((
                format!("{} = {v}", key.path()),
                now + cfg.maintenance_window,
            )),
            _ => None,
        },
        Key::Upcoming => {
            let j: serde_json::Value = serde_json::from_str(v).ok()?;
            let start = j.get("windowStartTime")?.as_str()?;
            let at = humantime::parse_rfc3339_weak(start.trim_end_matches('Z'))
                .or_else(|_| humantime::parse_rfc3339(start))
                .ok()?;
            let lead_from = at.checked_sub(cfg.upcoming_lead)?;
            (now >= lead_from).then(|| {
                let kind = j
                    .get("type")
                    .and_then(|t| t.as_str())
                    .unwrap_or("maintenance");
                (format!("{} = {kind} at {start}", key.path()), at)
            })
        }
    }
}

/// Reads the three keys until `shutdown`.
pub async fn run(
    cfg: GceConfig,
    board: NoticeBoard,
    events: Arc<EventBus>,
    shutdown: CancellationToken,
) {
    let client = match reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(2))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the GCE metadata client");
            return;
        }
    };
    let mut set = tokio::task::JoinSet::new();
    for key in [Key::Preempted, Key::Maintenance, Key::Upcoming] {
        set.spawn(watch(
            key,
            cfg.clone(),
            client.clone(),
            board.clone(),
            events.clone(),
            shutdown.clone(),
        ));
    }
    while set.join_next().await.is_some() {}
}

/// What one read gave.
#[derive(Debug)]
pub enum Read {
    /// The value and its ETag.
    Value(String, String),
    /// 404: the key is not served here.
    NotServed,
}

/// One GET of `key`: plain (`etag` None) or a long-poll from `etag`.
pub async fn read(
    client: &reqwest::Client,
    cfg: &GceConfig,
    key: Key,
    etag: Option<&str>,
) -> Result<Read, String> {
    let mut url = format!("{}/{}", cfg.url.trim_end_matches('/'), key.path());
    let mut timeout = Duration::from_secs(5);
    if let Some(e) = etag {
        url.push_str(&format!(
            "?wait_for_change=true&last_etag={}&timeout_sec={}",
            url_escape(e),
            cfg.wait.as_secs()
        ));
        timeout += cfg.wait;
    }
    let resp = client
        .get(&url)
        .header("Metadata-Flavor", "Google")
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = resp.status();
    if status == reqwest::StatusCode::NOT_FOUND {
        return Ok(Read::NotServed);
    }
    if !status.is_success() {
        return Err(format!("GET {url}: HTTP {status}"));
    }
    // The real server answers with this header; anything else is not it.
    if resp
        .headers()
        .get("metadata-flavor")
        .and_then(|v| v.to_str().ok())
        != Some("Google")
    {
        return Err(format!(
            "GET {url}: the answer has no `Metadata-Flavor: Google` header: not a GCE metadata server"
        ));
    }
    let new_etag = resp
        .headers()
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = bounded_body(resp, MAX_BODY)
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    Ok(Read::Value(body, new_etag))
}

/// The body, at most `max` bytes, as text.
pub async fn bounded_body(mut resp: reqwest::Response, max: usize) -> Result<String, String> {
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if out.len() + chunk.len() > max {
            return Err(format!("the answer is longer than {max} bytes"));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn url_escape(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~'))
        .collect()
}

async fn watch(
    key: Key,
    cfg: GceConfig,
    client: reqwest::Client,
    board: NoticeBoard,
    events: Arc<EventBus>,
    shutdown: CancellationToken,
) {
    let id = format!("gce/{}", key.path());
    let mut etag: Option<String> = None;
    let mut trouble: Option<String> = None;
    let mut raised = false;
    loop {
        let r = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = read(&client, &cfg, key, etag.as_deref()) => r,
        };
        let pause = match r {
            Ok(Read::Value(value, tag)) => {
                say_trouble(&board, &events, NoticeSource::Gce, &mut trouble, None);
                let now = SystemTime::now();
                match judge(key, &value, &cfg, now) {
                    Some((what, deadline)) => {
                        raised = true;
                        board.raise_host(
                            &id,
                            Notice {
                                source: NoticeSource::Gce,
                                what,
                                deadline: Some(deadline),
                                raised: now,
                            },
                        );
                    }
                    None if raised => {
                        raised = false;
                        board.clear_host(&id);
                    }
                    None => {}
                }
                // No ETag (not the real server): poll plainly, not in a loop.
                let pause = if tag.is_empty() {
                    RETRY
                } else {
                    Duration::ZERO
                };
                etag = (!tag.is_empty()).then_some(tag);
                pause
            }
            Ok(Read::NotServed) => {
                etag = None;
                NOT_SERVED_RETRY
            }
            Err(e) => {
                say_trouble(&board, &events, NoticeSource::Gce, &mut trouble, Some(e));
                etag = None;
                RETRY
            }
        };
        if !pause.is_zero() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
}
