//! The ranks' control channel: each rank's `Control` stream of restart
//! requests, and its acknowledgements by `AckControl`.
//!
//! In: a rank's subscription (its key and the generation it speaks for),
//! the requests [`super::request`] arms, a rank's acknowledgement. Out: a
//! `tokio::sync::watch` receiver per rank that holds the pending request
//! at once (a client whose stream broke gets it again) and then each new
//! one; the acknowledgement handed to the request's waiter, which is woken.
//!
//! Never: serve a registration that is not the one in force or a rank
//! that is not alive; deliver a request once the rank answered or the
//! request ended; wake a stream to say it was cleared.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;

use super::waiter::{JobRestart, Via, WaiterInput, WaiterStep};
use super::{Handles, now};
use crate::ranks::RankKey;
use crate::ranks::registry::RankState;

/// What one rank's `Control` stream carries: the request and the
/// registration (generation) it is addressed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankRequest {
    /// The generation the rank held when asked.
    pub generation: u64,
    /// The request.
    pub request: JobRestart,
}

/// Why a rank's `Control` stream or acknowledgement was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The rank never registered here (or left).
    #[error("{key} is not registered with this agent")]
    UnknownRank {
        /// The rank.
        key: RankKey,
    },
    /// The caller speaks for an older registration of the rank.
    #[error(
        "{key} is registered with generation {current}, not {given} (a stale registration: register again)"
    )]
    StaleGeneration {
        /// The rank.
        key: RankKey,
        /// The generation in force.
        current: u64,
        /// The one the caller gave.
        given: u64,
    },
    /// The rank's process is gone or its slot was lost.
    #[error("{key} is {state}, not running")]
    NotLive {
        /// The rank.
        key: RankKey,
        /// Its state.
        state: &'static str,
    },
}

/// Per rank, the restart request its `Control` stream delivers (the
/// latest; `None` once the rank acknowledged or the request ended).
#[derive(Debug, Default)]
pub(super) struct RequestChannels(HashMap<RankKey, watch::Sender<Option<Arc<RankRequest>>>>);

impl RequestChannels {
    /// Puts `msg` on `key`'s stream (made if the rank has none yet).
    pub(super) fn send(&mut self, key: RankKey, msg: RankRequest) {
        self.0
            .entry(key)
            .or_insert_with(|| watch::channel(None).0)
            .send_replace(Some(Arc::new(msg)));
    }

    /// A receiver of `key`'s stream. Channels of ranks that left, with
    /// nobody listening and nothing pending, go.
    fn subscribe(&mut self, key: &RankKey) -> watch::Receiver<Option<Arc<RankRequest>>> {
        self.0
            .retain(|k, tx| k == key || tx.receiver_count() > 0 || tx.borrow().is_some());
        self.0
            .entry(key.clone())
            .or_insert_with(|| watch::channel(None).0)
            .subscribe()
    }

    /// Stops delivering request `seq` on `key`'s stream (it answered, or
    /// the request ended), without waking the stream.
    pub(super) fn clear(&self, key: &RankKey, seq: u64) {
        if let Some(tx) = self.0.get(key) {
            tx.send_if_modified(|v| {
                if v.as_ref().is_some_and(|r| r.request.seq == seq) {
                    *v = None;
                }
                false
            });
        }
    }
}

/// Checks that `key` is registered with `generation` and alive.
pub(super) fn check_rank(
    state: &Handles,
    key: &RankKey,
    generation: u64,
) -> Result<(), ControlError> {
    let reg = state.registry();
    let Some(e) = reg.ranks.get(key) else {
        return Err(ControlError::UnknownRank { key: key.clone() });
    };
    if e.generation != generation {
        return Err(ControlError::StaleGeneration {
            key: key.clone(),
            current: e.generation,
            given: generation,
        });
    }
    if !matches!(e.state, RankState::Running | RankState::Hung) {
        return Err(ControlError::NotLive {
            key: key.clone(),
            state: e.state.as_str(),
        });
    }
    Ok(())
}

/// The requests for a rank's `Control` stream: the receiver holds the
/// pending one at once (a client whose stream broke gets it again), then
/// each new one. Only for the registration in force.
pub fn subscribe(
    state: &Handles,
    key: &RankKey,
    generation: u64,
) -> Result<watch::Receiver<Option<Arc<RankRequest>>>, ControlError> {
    check_rank(state, key, generation)?;
    Ok(state.restarts.lock().streams.subscribe(key))
}

/// Records a rank's acknowledgement of request `seq` (the `AckControl`
/// call). True when it answered a request in flight; an acknowledgement of
/// an older or unknown request is accepted and ignored.
pub fn ack(
    state: &Handles,
    key: &RankKey,
    generation: u64,
    seq: u64,
) -> Result<bool, ControlError> {
    check_rank(state, key, generation)?;
    let mut g = state.restarts.lock();
    let Some(p) = g.jobs.get_mut(&key.job).and_then(|j| j.pending.as_mut()) else {
        return Ok(false);
    };
    let input = WaiterInput::Acked {
        rank: key.rank,
        generation,
        seq,
        via: Via::Rpc,
    };
    if super::step(&mut p.waiter, input, now()) == WaiterStep::Ignored {
        return Ok(false);
    }
    p.wake.notify_one();
    g.streams.clear(key, seq);
    Ok(true)
}
