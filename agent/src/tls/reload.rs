//! The node's TLS set kept current: the three files polled for a change
//! (modification time, size, inode) and loaded again when one changed.
//!
//! In: the configured [`TlsFiles`] and the agent's host name. Out: the
//! last good [`Material`] for every new handshake (connections already up
//! keep the set they were made with), and a report of each reload or
//! failed reload. Never: replace a good set by one that fails to load
//! (a certificate written before its key, a truncated file): the old set
//! stays until the files are consistent again.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Material, TlsError, TlsFiles};

/// How often the files are looked at: a rotation is in force within this
/// long (a stat of three files; nothing is read unless one changed).
pub const POLL: Duration = Duration::from_secs(1);

/// What identifies one version of a file without reading it.
type Stamp = Option<(std::time::SystemTime, u64, u64)>;

fn stamp(p: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// The TLS set in force and the files it came from.
#[derive(Debug)]
pub struct Reloader {
    files: TlsFiles,
    host: String,
    current: RwLock<Arc<Material>>,
    /// The stamps of the files last tried (loaded or refused), so a bad
    /// file is reported once, not on every poll.
    seen: Mutex<[Stamp; 3]>,
}

/// What one look at the files found.
#[derive(Debug)]
pub enum Reload {
    /// Nothing changed since the last look.
    Unchanged,
    /// A new set is in force; its identity.
    Loaded(String),
    /// The files changed but do not load: the previous set stays.
    Refused(TlsError),
}

impl Reloader {
    /// Loads the files once; an error here stops the agent from starting.
    pub fn open(files: TlsFiles, host: &str) -> Result<Self, TlsError> {
        let seen = Self::stamps(&files);
        let material = Material::load(&files, host)?;
        Ok(Self {
            files,
            host: host.to_owned(),
            current: RwLock::new(Arc::new(material)),
            seen: Mutex::new(seen),
        })
    }

    fn stamps(f: &TlsFiles) -> [Stamp; 3] {
        [stamp(&f.ca), stamp(&f.cert), stamp(&f.key)]
    }

    /// The set in force.
    pub fn current(&self) -> Arc<Material> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Loads the files again if any changed since the last look.
    pub fn check(&self) -> Reload {
        let now = Self::stamps(&self.files);
        {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *seen == now {
                return Reload::Unchanged;
            }
            *seen = now;
        }
        match Material::load(&self.files, &self.host) {
            Ok(m) => {
                let identity = m.identity.clone();
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(m);
                Reload::Loaded(identity)
            }
            Err(e) => Reload::Refused(e),
        }
    }

    /// The configured files.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

/// Polls `reloader` every [`POLL`] until `stop`, handing each reload or
/// refusal to `report` (which logs and publishes it).
pub async fn watch(
    reloader: Arc<Reloader>,
    stop: CancellationToken,
    report: impl Fn(Reload) + Send + 'static,
) {
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let r = reloader.clone();
        match tokio::task::spawn_blocking(move || r.check()).await {
            Ok(Reload::Unchanged) => {}
            Ok(other) => report(other),
            Err(e) => tracing::error!(error = %e, "tls reload task failed"),
        }
    }
}
