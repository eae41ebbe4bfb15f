//! A local user's compilation-cache folder in the tier (`ClaimJob`): made
//! for the claiming uid, kept across the job's restarts, so that a
//! restarted rank finds its compiled kernels (issue 32, caches that survive
//! a restart).

use std::path::PathBuf;
use std::sync::Arc;

use super::Checkpoints;
use super::tier::{Owner, TierError};

/// Why a caller has no cache folder.
#[derive(Debug, thiserror::Error)]
pub enum UserCacheError {
    /// `checkpoint.compile_cache = false`.
    #[error("checkpoint.compile_cache is off")]
    Off,
    /// The tier refused (a path another user owns, a full disk...).
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The blocking task did not finish.
    #[error("checkpoint task: {0}")]
    Task(String),
}

/// `owner`'s cache folder, made when missing (off the async threads: it
/// touches the file system).
pub async fn dir(ck: &Arc<Checkpoints>, owner: Owner) -> Result<PathBuf, UserCacheError> {
    if !ck.cfg.compile_cache {
        return Err(UserCacheError::Off);
    }
    let ck = ck.clone();
    tokio::task::spawn_blocking(move || ck.tier.user_cache(Some(owner)))
        .await
        .map_err(|e| UserCacheError::Task(e.to_string()))?
        .map_err(UserCacheError::Tier)
}
