//! Test servers that speak the cloud metadata protocols warden's notice
//! sources read, on a loopback address of the test's choosing (127.0.0.x).
//!
//! - [`Gce`]: `computeMetadata/v1/instance/{preempted, maintenance-event,
//!   upcoming-maintenance}`. Refuses a request without `Metadata-Flavor:
//!   Google` (403, as the real server does); answers with the value, its
//!   `ETag` and `Metadata-Flavor: Google`; with `wait_for_change=true` it
//!   holds the request until the value's ETag differs from `last_etag` (at
//!   once when it already does) or `timeout_sec` passes. A key set to None
//!   is not served (404).
//! - [`Aws`]: IMDSv2. `PUT /latest/api/token` needs
//!   `X-aws-ec2-metadata-token-ttl-seconds` (400 without) and returns a
//!   new token; `GET /latest/meta-data/spot/instance-action` needs a live
//!   token in `X-aws-ec2-metadata-token` (401 otherwise) and answers 404
//!   until an action is set. [`Aws::expire_tokens`] makes every token so
//!   far refused.
//!
//! Every request is recorded (method, path, query, whether it carried the
//! header or token) so a test can assert the protocol was followed.

#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use tokio::sync::watch;

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// "GET /computeMetadata/v1/instance/preempted".
    pub what: String,
    /// Its query parameters.
    pub query: BTreeMap<String, String>,
    /// It carried the protocol's header (GCE: the flavor; AWS: a live token).
    pub proper: bool,
}

#[derive(Debug, Default)]
struct GceState {
    /// key -> (value or not served, etag number).
    values: HashMap<String, (Option<String>, u64)>,
    seen: Vec<Seen>,
    /// Long-polls waiting now.
    waiting: usize,
}

/// A GCE metadata server.
#[derive(Debug, Clone)]
pub struct Gce {
    state: Arc<Mutex<GceState>>,
    changed: watch::Sender<u64>,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Gce {
    /// Starts on `ip` (a free port), with preempted FALSE, maintenance-event
    /// NONE and upcoming-maintenance not served.
    pub async fn start(ip: &str) -> Self {
        let mut values = HashMap::new();
        values.insert(
            "instance/preempted".to_owned(),
            (Some("FALSE".to_owned()), 1),
        );
        values.insert(
            "instance/maintenance-event".to_owned(),
            (Some("NONE".to_owned()), 1),
        );
        values.insert("instance/upcoming-maintenance".to_owned(), (None, 1));
        let state = Arc::new(Mutex::new(GceState {
            values,
            ..Default::default()
        }));
        let (changed, _) = watch::channel(0);
        let listener = tokio::net::TcpListener::bind(format!("{ip}:0"))
            .await
            .expect("bind the GCE test server");
        let addr = listener.local_addr().unwrap();
        let me = Self {
            state,
            changed,
            addr,
        };
        let app = axum::Router::new()
            .route("/computeMetadata/v1/instance/{*key}", get(gce_get))
            .with_state(me.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        me
    }

    /// The `computeMetadata/v1` root, for `notice.gce.url`.
    pub fn url(&self) -> String {
        format!("http://{}/computeMetadata/v1", self.addr)
    }

    /// Sets `key` (`instance/preempted`...) to `value` (None: not served).
    pub fn set(&self, key: &str, value: Option<&str>) {
        let mut g = self.state.lock().unwrap();
        let e = g.values.entry(key.to_owned()).or_insert((None, 0));
        e.0 = value.map(str::to_owned);
        e.1 += 1;
        drop(g);
        self.changed.send_modify(|n| *n += 1);
    }

    /// The requests so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    /// Long-polls holding now.
    pub fn waiting(&self) -> usize {
        self.state.lock().unwrap().waiting
    }
}

async fn gce_get(
    State(s): State<Gce>,
    UrlPath(key): UrlPath<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    // The sources send plain tokens (no percent-escapes) in the query.
    let q: BTreeMap<String, String> = raw
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect();
    let key = format!("instance/{key}");
    let flavored = headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) == Some("Google");
    s.state.lock().unwrap().seen.push(Seen {
        what: format!("GET /computeMetadata/v1/{key}"),
        query: q.clone(),
        proper: flavored,
    });
    if !flavored {
        return (
            StatusCode::FORBIDDEN,
            "Missing Metadata-Flavor:Google header.",
        )
            .into_response();
    }
    let current = |s: &Gce| s.state.lock().unwrap().values.get(&key).cloned();
    let wait = q.get("wait_for_change").is_some_and(|v| v == "true");
    let timeout = Duration::from_secs(
        q.get("timeout_sec")
            .and_then(|t| t.parse().ok())
            .unwrap_or(300),
    );
    let mut rx = s.changed.subscribe();
    if wait {
        let last = q.get("last_etag").cloned().unwrap_or_default();
        s.state.lock().unwrap().waiting += 1;
        let held = tokio::time::timeout(timeout, async {
            loop {
                let now = current(&s);
                if now.as_ref().is_none_or(|(_, e)| format!("e{e}") != last) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        let _ = held;
        s.state.lock().unwrap().waiting -= 1;
    }
    match current(&s) {
        Some((Some(v), etag)) => (
            [
                ("metadata-flavor", "Google".to_owned()),
                ("etag", format!("e{etag}")),
            ],
            v,
        )
            .into_response(),
        _ => (
            StatusCode::NOT_FOUND,
            [("metadata-flavor", "Google")],
            "not found",
        )
            .into_response(),
    }
}

#[derive(Debug, Default)]
struct AwsState {
    action: Option<String>,
    tokens: Vec<String>,
    live_from: usize,
    seen: Vec<Seen>,
}

/// An EC2 instance metadata service (IMDSv2).
#[derive(Debug, Clone)]
pub struct Aws {
    state: Arc<Mutex<AwsState>>,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Aws {
    /// Starts on `ip` (a free port), no action planned.
    pub async fn start(ip: &str) -> Self {
        let state = Arc::new(Mutex::new(AwsState::default()));
        let listener = tokio::net::TcpListener::bind(format!("{ip}:0"))
            .await
            .expect("bind the IMDS test server");
        let addr = listener.local_addr().unwrap();
        let me = Self { state, addr };
        let app = axum::Router::new()
            .route("/latest/api/token", put(aws_token))
            .route("/latest/meta-data/spot/instance-action", get(aws_action))
            .with_state(me.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        me
    }

    /// The root, for `notice.aws.url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Plans an interruption (`{"action": ..., "time": ...}`), or none.
    pub fn set_action(&self, body: Option<&str>) {
        self.state.lock().unwrap().action = body.map(str::to_owned);
    }

    /// Every token issued so far is refused from now on.
    pub fn expire_tokens(&self) {
        let mut g = self.state.lock().unwrap();
        g.live_from = g.tokens.len();
    }

    /// Tokens issued so far.
    pub fn tokens_issued(&self) -> usize {
        self.state.lock().unwrap().tokens.len()
    }

    /// The requests so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }
}

async fn aws_token(State(s): State<Aws>, headers: HeaderMap) -> Response {
    let ttl = headers
        .get("x-aws-ec2-metadata-token-ttl-seconds")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|t| (1..=21_600).contains(t));
    let mut g = s.state.lock().unwrap();
    g.seen.push(Seen {
        what: "PUT /latest/api/token".into(),
        query: BTreeMap::new(),
        proper: ttl.is_some(),
    });
    if ttl.is_none() {
        return (
            StatusCode::BAD_REQUEST,
            "missing or bad X-aws-ec2-metadata-token-ttl-seconds",
        )
            .into_response();
    }
    let t = format!("tok-{}-{}", g.tokens.len(), std::process::id());
    g.tokens.push(t.clone());
    t.into_response()
}

async fn aws_action(State(s): State<Aws>, headers: HeaderMap) -> Response {
    let token = headers
        .get("x-aws-ec2-metadata-token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut g = s.state.lock().unwrap();
    let live = g.tokens[g.live_from..].iter().any(|t| t == token);
    g.seen.push(Seen {
        what: "GET /latest/meta-data/spot/instance-action".into(),
        query: BTreeMap::new(),
        proper: live,
    });
    if !live {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    match &g.action {
        Some(b) => b.clone().into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
