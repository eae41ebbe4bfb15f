//! A Kubernetes node taint that means the node is going away.
//!
//! In: `[notice.kubernetes] taints_file`: the node's `.spec.taints` as JSON
//! (`[{"key": ..., "value": ..., "effect": "NoSchedule"}]`, what
//! `kubectl get node -o jsonpath='{.spec.taints}'` prints) or one
//! `key[=value]:Effect` per line, kept by a sidecar or a projected volume;
//! read every `poll_interval`. Out: a host notice on the [`NoticeBoard`] when a
//! taint named in `taints` has effect NoSchedule or NoExecute, its deadline
//! `window` after the agent first saw it. Never: read a file that a user
//! other than root or the agent could have written (the file, after
//! symlinks, and every directory above it must be owned by one of them
//! and not writable by group or others): such a file could stop every job
//! of the host, so it is refused and the refusal shown in `warden health`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use tokio_util::sync::CancellationToken;
use warden_core::events::EventBus;

use super::config::KubernetesConfig;
use super::{Notice, NoticeBoard, NoticeSource, say_trouble};

const ID: &str = "kubernetes/taint";
/// The most of the file read.
const MAX_FILE: u64 = 256 * 1024;

/// One taint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taint {
    /// Its key.
    pub key: String,
    /// Its value (may be empty).
    pub value: String,
    /// NoSchedule, PreferNoSchedule or NoExecute.
    pub effect: String,
}

/// Parses the file: JSON (an array of taints, or a node object with
/// `spec.taints`) or lines of `key[=value]:Effect` (blank lines and `#`
/// comments skipped). Unparsable lines are skipped, not fatal: a taint
/// that cannot be read is not one that was named.
pub fn parse(text: &str) -> Vec<Taint> {
    let t = text.trim();
    if t.starts_with('[') || t.starts_with('{') {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(t) else {
            return Vec::new();
        };
        let arr = v
            .as_array()
            .cloned()
            .or_else(|| {
                v.pointer("/spec/taints")
                    .and_then(|a| a.as_array())
                    .cloned()
            })
            .unwrap_or_default();
        return arr
            .iter()
            .filter_map(|x| {
                Some(Taint {
                    key: x.get("key")?.as_str()?.to_owned(),
                    value: x
                        .get("value")
                        .and_then(|v| v.as_str())
                        .unwrap_or("")
                        .to_owned(),
                    effect: x.get("effect")?.as_str()?.to_owned(),
                })
            })
            .collect();
    }
    t.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let (kv, effect) = l.rsplit_once(':')?;
            let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
            Some(Taint {
                key: key.trim().to_owned(),
                value: value.trim().to_owned(),
                effect: effect.trim().to_owned(),
            })
        })
        .collect()
}

/// The first taint that means a stop (pure).
pub fn judge<'a>(taints: &'a [Taint], named: &[String]) -> Option<&'a Taint> {
    taints
        .iter()
        .find(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute") && named.contains(&t.key))
}

/// Why `path` (after symlinks) could have been written by a user other
/// than root or `me`; None when it could not.
pub fn untrusted(path: &Path, me: u32) -> Result<Option<String>, String> {
    let real = std::fs::canonicalize(path)
        .map_err(|e| format!("cannot resolve {}: {e}", path.display()))?;
    let mut p: Option<PathBuf> = Some(real.clone());
    while let Some(at) = p {
        let m = std::fs::metadata(&at).map_err(|e| format!("cannot stat {}: {e}", at.display()))?;
        let mode = m.mode() & 0o7777;
        if m.uid() != 0 && m.uid() != me {
            return Ok(Some(format!(
                "{} is owned by uid {}, not root or the agent (uid {me})",
                at.display(),
                m.uid()
            )));
        }
        if mode & 0o022 != 0 && !(m.is_dir() && mode & 0o1000 != 0 && at != real) {
            return Ok(Some(format!(
                "{} (mode {mode:04o}) is writable by group or others",
                at.display()
            )));
        }
        p = at.parent().map(Path::to_path_buf);
    }
    Ok(None)
}

/// Checks and reads the file (blocking). A file that does not exist is no
/// taint (not written yet, or the taint was removed with it): empty.
pub fn read(path: &Path, me: u32) -> Result<String, String> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(String::new()),
        _ => {}
    }
    if let Some(why) = untrusted(path, me)? {
        return Err(format!(
            "refused: {why}; a user who can write it could stop every job on the host"
        ));
    }
    use std::io::Read;
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut s = String::new();
    f.take(MAX_FILE)
        .read_to_string(&mut s)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(s)
}

/// Reads the file every `poll_interval` until `shutdown`.
pub async fn run(
    cfg: KubernetesConfig,
    board: NoticeBoard,
    events: Arc<EventBus>,
    shutdown: CancellationToken,
) {
    let path = PathBuf::from(&cfg.taints_file);
    let me = nix::unistd::geteuid().as_raw();
    let mut trouble: Option<String> = None;
    let mut since: Option<(String, SystemTime)> = None;
    loop {
        let p = path.clone();
        let r = tokio::task::spawn_blocking(move || read(&p, me))
            .await
            .unwrap_or_else(|e| Err(format!("the read failed: {e}")));
        match r {
            Ok(text) => {
                say_trouble(
                    &board,
                    &events,
                    NoticeSource::Kubernetes,
                    &mut trouble,
                    None,
                );
                let taints = parse(&text);
                match judge(&taints, &cfg.taints) {
                    Some(t) => {
                        let what = format!(
                            "taint {}{}:{}",
                            t.key,
                            if t.value.is_empty() {
                                String::new()
                            } else {
                                format!("={}", t.value)
                            },
                            t.effect
                        );
                        let first = match &since {
                            Some((w, at)) if *w == what => *at,
                            _ => SystemTime::now(),
                        };
                        since = Some((what.clone(), first));
                        board.raise_host(
                            ID,
                            Notice {
                                source: NoticeSource::Kubernetes,
                                what,
                                deadline: Some(first + cfg.window),
                                raised: first,
                            },
                        );
                    }
                    None => {
                        if since.take().is_some() {
                            board.clear_host(ID);
                        }
                    }
                }
            }
            // A refused or unreadable file is trouble, shown; it neither
            // raises nor clears a notice.
            Err(e) => say_trouble(
                &board,
                &events,
                NoticeSource::Kubernetes,
                &mut trouble,
                Some(e),
            ),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(cfg.poll_interval) => {}
        }
    }
}
