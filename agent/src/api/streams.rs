//! Caps on the server streams a caller holds open (WatchEvents,
//! WatchHealth, WatchIncidents, and Control in the total), and giving
//! their memory back.
//!
//! In: a stream about to open, with its caller's uid (SO_PEERCRED, see
//! [`super::caller`]). Out: a [`StreamPermit`] that the stream's forwarding
//! task holds until the stream ends (the client cancelled or went away, or
//! the agent stops), or RESOURCE_EXHAUSTED naming the cap that refused it:
//! `api.max_streams_per_uid` or `api.max_streams`. Never: block, or let one
//! caller's streams crowd out another uid's below its own cap.
//!
//! Why: each open stream holds a task, a bounded channel of converted
//! events, and HTTP/2 state in the connection; 600 streams grew the agent
//! from 15 to 112 MB (issue 22). When the last of a burst of streams
//! closes, the freed heap is handed back to the kernel with glibc's
//! `malloc_trim`: glibc keeps freed memory in its per-thread arenas, where
//! tokio's worker threads allocated it, so RSS would otherwise stay at its
//! peak for the agent's life (docs/benchmarks.md measures both).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tonic::Status;

/// Streams that must have been open at once since the last trim before the
/// last one closing trims the heap (a few streams coming and going are
/// not worth a trim).
pub const TRIM_AFTER_PEAK: usize = 32;

/// What the gate counts.
#[derive(Debug, Default)]
struct Counts {
    /// Open streams by uid.
    by_uid: HashMap<u32, usize>,
    /// Open streams in all.
    total: usize,
    /// Most open at once since the heap was last trimmed.
    peak: usize,
}

/// The caps and the streams open now.
#[derive(Debug)]
pub struct StreamGate {
    per_uid: usize,
    total: usize,
    counts: Mutex<Counts>,
}

/// One open stream; dropping it (with the stream's task) frees its place.
#[derive(Debug)]
pub struct StreamPermit {
    gate: Arc<StreamGate>,
    /// The uid whose per-uid count holds it; None for a Control stream,
    /// counted in the total only (a uid's Control streams are bounded by
    /// its ranks, one each: see `api::control::ControlStreams`).
    uid: Option<u32>,
}

impl StreamGate {
    /// A gate with `per_uid` streams per uid and `total` in all.
    pub fn new(per_uid: u32, total: u32) -> Arc<Self> {
        Arc::new(Self {
            per_uid: usize::try_from(per_uid).unwrap_or(usize::MAX),
            total: usize::try_from(total).unwrap_or(usize::MAX),
            counts: Mutex::new(Counts::default()),
        })
    }

    /// A place for one more `call` stream of `uid`, or RESOURCE_EXHAUSTED
    /// naming the cap reached (counted in `warden_api_refused_total`).
    pub fn open(self: &Arc<Self>, call: &str, uid: u32) -> Result<StreamPermit, Status> {
        self.open_as(call, uid, true)
    }

    /// A place for one more Control stream of `uid`: counted in the total
    /// (`api.max_streams`) but not in the uid's watch streams, which a uid
    /// with many ranks would otherwise exhaust with one Control stream per
    /// rank.
    pub fn open_control(self: &Arc<Self>, uid: u32) -> Result<StreamPermit, Status> {
        self.open_as("Control", uid, false)
    }

    fn open_as(
        self: &Arc<Self>,
        call: &str,
        uid: u32,
        per_uid: bool,
    ) -> Result<StreamPermit, Status> {
        let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let mine = c.by_uid.get(&uid).copied().unwrap_or(0);
        let refusal = if per_uid && mine >= self.per_uid {
            Some(format!(
                "{call} refused: uid {uid} already holds {mine} open streams, the most one uid may (api.max_streams_per_uid = {}); close one first",
                self.per_uid
            ))
        } else if c.total >= self.total {
            Some(format!(
                "{call} refused: the agent already serves {} open streams, the most it takes (api.max_streams = {})",
                c.total, self.total
            ))
        } else {
            None
        };
        if let Some(why) = refusal {
            drop(c);
            metrics::counter!("warden_api_refused_total", "call" => call.to_owned()).increment(1);
            tracing::warn!(call, uid, "{why}");
            return Err(Status::resource_exhausted(why));
        }
        if per_uid {
            *c.by_uid.entry(uid).or_default() += 1;
        }
        c.total += 1;
        c.peak = c.peak.max(c.total);
        metrics::gauge!("warden_api_streams_open").set(c.total as f64);
        Ok(StreamPermit {
            gate: self.clone(),
            uid: per_uid.then_some(uid),
        })
    }

    /// Streams open now.
    pub fn open_now(&self) -> usize {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }

    fn close(&self, uid: Option<u32>) {
        let trim = {
            let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(uid) = uid
                && let Some(n) = c.by_uid.get_mut(&uid)
            {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.by_uid.remove(&uid);
                }
            }
            c.total = c.total.saturating_sub(1);
            metrics::gauge!("warden_api_streams_open").set(c.total as f64);
            let trim = c.total == 0 && c.peak >= TRIM_AFTER_PEAK;
            if trim {
                c.peak = 0;
            }
            trim
        };
        if trim {
            give_back_heap();
        }
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        self.gate.close(self.uid);
    }
}

/// Hands freed heap back to the kernel, off the async workers (a trim walks
/// every arena and may take milliseconds).
fn give_back_heap() {
    #[cfg(target_env = "gnu")]
    {
        let trim = || {
            // SAFETY: malloc_trim only releases free memory at the top of
            // glibc's heaps and arenas; it has no preconditions.
            unsafe { libc::malloc_trim(0) };
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(trim);
            }
            Err(_) => trim(),
        }
    }
}

/// A boxed server stream, as tonic wants it.
pub type BoxStream<T> =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, tonic::Status>> + Send + 'static>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_per_uid_and_in_all_name_their_key_and_free_on_drop() {
        let gate = StreamGate::new(2, 3);
        let a1 = gate.open("WatchEvents", 1000).unwrap();
        let _a2 = gate.open("WatchEvents", 1000).unwrap();
        let s = gate.open("WatchEvents", 1000).unwrap_err();
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert!(s.message().contains("api.max_streams_per_uid = 2"), "{s:?}");
        let _b1 = gate.open("WatchHealth", 1001).unwrap();
        let s = gate.open("WatchHealth", 1002).unwrap_err();
        assert!(s.message().contains("api.max_streams = 3"), "{s:?}");
        drop(a1);
        assert_eq!(gate.open_now(), 2);
        let _b2 = gate.open("WatchHealth", 1002).unwrap();
        // Control streams count in the total, not in the uid's watches.
        let s = gate.open_control(1000).unwrap_err();
        assert!(s.message().contains("api.max_streams = 3"), "{s:?}");
        drop(_b2);
        let c = gate.open_control(1000).unwrap();
        assert_eq!(gate.open_now(), 3);
        drop(c);
        let _a3 = gate.open("WatchEvents", 1000).unwrap();
    }
}
