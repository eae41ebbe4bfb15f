//! Flight-recorder dump requests on the ranks' `Control` streams: that a
//! rank write its torch flight recorder to a file (`hang::flight` makes
//! the request, awaits the file and reads it).
//!
//! In: a rank's subscription (its key and generation); a request (the
//! generation it is for, the path) and its end. Out: a `watch` receiver
//! per rank holding the dump in flight at once, then each new one; a
//! sequence number per request.
//!
//! Never: replace a restart request not yet acknowledged (dumps have
//! channels of their own), serve a registration not in force, or go on
//! delivering a request nobody awaits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::watch;

use super::control::{ControlError, check_rank};
use super::{Handles, Restarts};
use crate::ranks::RankKey;

/// A request that a rank write its torch flight recorder to `path`
/// (`hang::flight` makes and reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpRequest {
    /// The generation the rank held when asked: a stream of another
    /// registration never delivers it.
    pub generation: u64,
    /// Increases with every dump request this agent makes.
    pub seq: u64,
    /// Where the rank writes it, in a directory the agent made for this
    /// request.
    pub path: PathBuf,
}

/// The dump requests in flight, per rank.
#[derive(Debug, Default)]
pub(super) struct Dumps {
    /// The last sequence number issued.
    last: u64,
    /// Per rank, the dump its `Control` stream delivers (`None` once the
    /// asker stopped waiting).
    streams: HashMap<RankKey, watch::Sender<Option<Arc<DumpRequest>>>>,
}

/// The flight-recorder dump requests for a rank's `Control` stream: the
/// receiver holds the one in flight at once, then each new one. Only for
/// the registration in force.
pub fn subscribe_dumps(
    state: &Handles,
    key: &RankKey,
    generation: u64,
) -> Result<watch::Receiver<Option<Arc<DumpRequest>>>, ControlError> {
    check_rank(state, key, generation)?;
    let mut g = state.restarts.lock();
    g.dumps
        .streams
        .retain(|k, tx| k == key || tx.receiver_count() > 0 || tx.borrow().is_some());
    let tx = g
        .dumps
        .streams
        .entry(key.clone())
        .or_insert_with(|| watch::channel(None).0);
    Ok(tx.subscribe())
}

/// Puts a flight-recorder dump request on `key`'s `Control` stream (the
/// generation it must be delivered to, the file to write); returns its
/// sequence number. [`end_dump`] takes it off again.
pub fn ask_dump(restarts: &Restarts, key: &RankKey, generation: u64, path: PathBuf) -> u64 {
    let mut g = restarts.lock();
    let d = &mut g.dumps;
    d.last = d.last.wrapping_add(1).max(1);
    let seq = d.last;
    d.streams
        .entry(key.clone())
        .or_insert_with(|| watch::channel(None).0)
        .send_replace(Some(Arc::new(DumpRequest {
            generation,
            seq,
            path,
        })));
    seq
}

/// Takes dump request `seq` off `key`'s stream, if it is still the one
/// there: a stream opened later must not deliver a request nobody awaits.
pub fn end_dump(restarts: &Restarts, key: &RankKey, seq: u64) {
    let g = restarts.lock();
    if let Some(tx) = g.dumps.streams.get(key) {
        tx.send_if_modified(|v| {
            if v.as_ref().is_some_and(|d| d.seq == seq) {
                *v = None;
                true
            } else {
                false
            }
        });
    }
}
