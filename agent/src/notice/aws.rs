//! EC2's instance metadata service (IMDSv2): a Spot interruption.
//!
//! In: a session token (`PUT /latest/api/token` with
//! `X-aws-ec2-metadata-token-ttl-seconds`), then
//! `GET /latest/meta-data/spot/instance-action` with
//! `X-aws-ec2-metadata-token`, every `poll_interval`: 404 while no
//! interruption is planned, else `{"action": "terminate|stop|hibernate",
//! "time": "<RFC 3339>"}` (two minutes ahead). A 401 means the token
//! expired: a new one is asked for. Out: a host notice on the [`NoticeBoard`],
//! its deadline the action's `time`. Never: trust the body (bounded,
//! clipped; an unreadable time is no deadline, not an error).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use warden_core::events::EventBus;

use super::config::AwsConfig;
use super::gce::{MAX_BODY, bounded_body};
use super::{Notice, NoticeBoard, NoticeSource, say_trouble};

const ID: &str = "aws/spot/instance-action";

/// What a `spot/instance-action` body means: (what, deadline), or None
/// when it is no action (pure).
pub fn judge(body: &str) -> Option<(String, Option<SystemTime>)> {
    let j: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    let action = j.get("action")?.as_str()?;
    if !matches!(action, "terminate" | "stop" | "hibernate") {
        return None;
    }
    let time = j.get("time").and_then(|t| t.as_str()).unwrap_or("");
    let deadline = humantime::parse_rfc3339(time).ok();
    Some((
        format!("spot/instance-action = {action} at {time}"),
        deadline,
    ))
}

/// Why a read failed, so a 401 can renew the token.
#[derive(Debug)]
pub enum ReadError {
    /// The token was refused: ask for a new one.
    TokenRefused,
    /// Anything else, in words.
    Other(String),
}

/// Asks for a session token.
pub async fn token(client: &reqwest::Client, cfg: &AwsConfig) -> Result<String, String> {
    let url = format!("{}/latest/api/token", cfg.url.trim_end_matches('/'));
    let resp = client
        .put(&url)
        .header(
            "X-aws-ec2-metadata-token-ttl-seconds",
            cfg.token_ttl.as_secs().to_string(),
        )
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| format!("PUT {url}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("PUT {url}: HTTP {}", resp.status()));
    }
    let t = bounded_body(resp, 4096)
        .await
        .map_err(|e| format!("PUT {url}: {e}"))?;
    let t = t.trim().to_owned();
    if t.is_empty() || t.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(format!("PUT {url}: not a token"));
    }
    Ok(t)
}

/// One read of `spot/instance-action`: the body, or None for 404.
pub async fn read(
    client: &reqwest::Client,
    cfg: &AwsConfig,
    token: &str,
) -> Result<Option<String>, ReadError> {
    let url = format!(
        "{}/latest/meta-data/spot/instance-action",
        cfg.url.trim_end_matches('/')
    );
    let resp = client
        .get(&url)
        .header("X-aws-ec2-metadata-token", token)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| ReadError::Other(format!("GET {url}: {e}")))?;
    match resp.status() {
        reqwest::StatusCode::NOT_FOUND => Ok(None),
        reqwest::StatusCode::UNAUTHORIZED => Err(ReadError::TokenRefused),
        s if s.is_success() => bounded_body(resp, MAX_BODY)
            .await
            .map(Some)
            .map_err(|e| ReadError::Other(format!("GET {url}: {e}"))),
        s => Err(ReadError::Other(format!("GET {url}: HTTP {s}"))),
    }
}

/// Polls until `shutdown`.
pub async fn run(
    cfg: AwsConfig,
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
            tracing::error!(error = %e, "cannot build the EC2 metadata client");
            return;
        }
    };
    let mut tok: Option<(String, tokio::time::Instant)> = None;
    let mut trouble: Option<String> = None;
    let mut raised = false;
    loop {
        let outcome = async {
            // Renewed before it expires (a tenth of its life early).
            let fresh = tok
                .as_ref()
                .filter(|(_, at)| at.elapsed() < cfg.token_ttl.mul_f64(0.9));
            let t = match fresh {
                Some((t, _)) => t.clone(),
                None => {
                    let t = token(&client, &cfg).await?;
                    tok = Some((t.clone(), tokio::time::Instant::now()));
                    t
                }
            };
            match read(&client, &cfg, &t).await {
                Ok(b) => Ok(b),
                Err(ReadError::TokenRefused) => {
                    tok = None;
                    Err("the token was refused (401); asking for a new one".to_owned())
                }
                Err(ReadError::Other(e)) => Err(e),
            }
        };
        let r = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = outcome => r,
        };
        match r {
            Ok(body) => {
                say_trouble(&board, &events, NoticeSource::Aws, &mut trouble, None);
                match body.as_deref().and_then(judge) {
                    Some((what, deadline)) => {
                        raised = true;
                        board.raise_host(
                            ID,
                            Notice {
                                source: NoticeSource::Aws,
                                what,
                                deadline,
                                raised: SystemTime::now(),
                            },
                        );
                    }
                    None if raised => {
                        raised = false;
                        board.clear_host(ID);
                    }
                    None => {}
                }
            }
            Err(e) => say_trouble(&board, &events, NoticeSource::Aws, &mut trouble, Some(e)),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(cfg.poll_interval) => {}
        }
    }
}
