//! Judging signals over time: counters as deltas over a window, statuses
//! with hysteresis. A lifetime total says what a GPU went through in its
//! life, not what it is doing now; and a single flap is not a verdict.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::Status;

/// Samples of a monotonically increasing counter (ECC errors, PCIe replays,
/// link_downed), giving the increase over the last `window`.
#[derive(Debug, Clone)]
pub struct CounterWindow {
    window: Duration,
    samples: VecDeque<(Instant, u64)>,
}

impl CounterWindow {
    /// A window of `window`.
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            samples: VecDeque::new(),
        }
    }

    /// Records `value` at `now` and returns its increase over the window
    /// (from the oldest sample still inside it). A counter that went
    /// backwards was reset (driver reload, device reset): history restarts.
    pub fn observe(&mut self, now: Instant, value: u64) -> u64 {
        if self.samples.back().is_some_and(|(_, last)| value < *last) {
            self.samples.clear();
        }
        self.samples.push_back((now, value));
        // Keep one sample at or before the window's start as the baseline.
        while self.samples.len() > 2
            && self
                .samples
                .get(1)
                .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= self.window)
        {
            self.samples.pop_front();
        }
        let base = self.samples.front().map_or(value, |(_, v)| *v);
        value.saturating_sub(base)
    }

    /// The window, for evidence ("5 in 1m").
    pub fn window(&self) -> Duration {
        self.window
    }
}

/// Hysteresis on a status: a worse status is adopted after `raise_after`
/// consecutive observations of it, a better one after `clear_after`.
#[derive(Debug, Clone)]
pub struct Debounce {
    current: Status,
    candidate: Option<(Status, u32)>,
    raise_after: u32,
    clear_after: u32,
}

impl Debounce {
    /// Starts at OK.
    pub fn new(raise_after: u32, clear_after: u32) -> Self {
        Self {
            current: Status::Ok,
            candidate: None,
            raise_after: raise_after.max(1),
            clear_after: clear_after.max(1),
        }
    }

    /// Feeds one observation; returns the debounced status.
    pub fn observe(&mut self, seen: Status) -> Status {
        if seen == self.current {
            self.candidate = None;
            return self.current;
        }
        let count = match self.candidate {
            Some((s, n)) if s == seen => n + 1,
            _ => 1,
        };
        let needed = if seen > self.current {
            self.raise_after
        } else {
            self.clear_after
        };
        if count >= needed {
            self.current = seen;
            self.candidate = None;
        } else {
            self.candidate = Some((seen, count));
        }
        self.current
    }

    /// The debounced status.
    pub fn current(&self) -> Status {
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_over_the_window_not_the_lifetime() {
        let t0 = Instant::now();
        let mut w = CounterWindow::new(Duration::from_secs(60));
        assert_eq!(w.observe(t0, 1000), 0);
        assert_eq!(w.observe(t0 + Duration::from_secs(10), 1003), 3);
        assert_eq!(w.observe(t0 + Duration::from_secs(30), 1005), 5);
        // 90 s later the burst at 10-30 s has left the window.
        assert_eq!(w.observe(t0 + Duration::from_secs(120), 1005), 0);
    }

    #[test]
    fn counter_reset_restarts_history() {
        let t0 = Instant::now();
        let mut w = CounterWindow::new(Duration::from_secs(60));
        w.observe(t0, 50);
        assert_eq!(w.observe(t0 + Duration::from_secs(1), 2), 0);
        assert_eq!(w.observe(t0 + Duration::from_secs(2), 4), 2);
    }

    #[test]
    fn a_single_flap_is_not_a_verdict() {
        let mut d = Debounce::new(2, 3);
        assert_eq!(d.observe(Status::Failed), Status::Ok);
        assert_eq!(d.observe(Status::Ok), Status::Ok);
        assert_eq!(d.observe(Status::Failed), Status::Ok);
        assert_eq!(d.observe(Status::Failed), Status::Failed);
        assert_eq!(d.observe(Status::Ok), Status::Failed);
        assert_eq!(d.observe(Status::Ok), Status::Failed);
        assert_eq!(d.observe(Status::Ok), Status::Ok);
    }
}
