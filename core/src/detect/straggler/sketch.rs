//! A mergeable quantile sketch of positive durations, with a relative error
//! bound: what each host sends the job's aggregator per section instead of
//! one summary per rank, and what the aggregator adds up.
//!
//! In: positive finite values (a rank's window median, ns). Out: the
//! median, the median absolute deviation (MAD) and the count at or above a
//! threshold, each within [`ALPHA`] relative error of the exact figure over
//! the same values. Never: allocation beyond [`MAX_BINS`] bins per sketch
//! received from a peer; I/O.
//!
//! The scheme is DDSketch's (Masson, Rim, Lee, VLDB 2019): value `v` falls
//! in bin `ceil(log_gamma(v))` with `gamma = (1 + ALPHA) / (1 - ALPHA)`,
//! and the bin's representative `2 gamma^k / (gamma + 1)` is within ALPHA
//! of every value in it. Counts are additive, so merging is adding bins and
//! a host's old contribution can be subtracted exactly when its new one
//! arrives (the aggregator keeps a running sum, O(bins) per report). Hand
//! written over the `sketches-ddsketch` crate because the statistics need
//! a rank query (the MAD and the over-threshold count walk the bins) and
//! the wire needs the bins themselves; that crate exposes neither (see
//! docs/dependencies.md).

use std::collections::BTreeMap;

/// Relative accuracy of every value the sketch returns: 0.1%, a tenth of
/// the straggler score's spread floor (`score::MIN_SPREAD`, 1%), so a
/// rank's z moves by at most about 0.2 of a spread.
pub const ALPHA: f64 = 0.001;
/// Smallest value kept apart (1 ns): anything below counts in its bin.
const MIN_VALUE: f64 = 1.0;
/// Largest value kept apart (about 2.8 hours in ns): anything above counts
/// in its bin. With the floor, this bounds a section's bins to about
/// 15,000 whatever the values.
const MAX_VALUE: f64 = 1e13;
/// Most bins one sketch from a peer may carry (a host's ranks fill one bin
/// each at most; 4,096 covers 512 ranks per host with room). A sketch over
/// it is refused with an error naming the count.
pub const MAX_BINS: usize = 4096;

fn gamma_ln() -> f64 {
    ((1.0 + ALPHA) / (1.0 - ALPHA)).ln()
}

/// The bin of `v` (clamped to the kept range).
pub fn key_of(v: f64) -> i32 {
    let v = v.clamp(MIN_VALUE, MAX_VALUE);
    // In range: |ln(1e13) / ln(gamma)| < 15,000.
    #[allow(clippy::cast_possible_truncation)]
    let k = (v.ln() / gamma_ln()).ceil() as i32;
    k
}

/// The representative value of bin `k`.
pub fn value_of(k: i32) -> f64 {
    let g = gamma_ln().exp();
    2.0 * (f64::from(k) * gamma_ln()).exp() / (g + 1.0)
}

/// A sketch: bin -> count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sketch {
    bins: BTreeMap<i32, u64>,
    count: u64,
}

/// Why a sketch from a peer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SketchError {
    /// More bins than [`MAX_BINS`].
    #[error("{0} bins; at most {MAX_BINS}")]
    TooManyBins(usize),
    /// A bin outside the kept range.
    #[error("bin {0} is outside {1}..={2}")]
    BadKey(i32, i32, i32),
    /// A bin given twice.
    #[error("bin {0} appears twice")]
    Repeated(i32),
    /// A zero count.
    #[error("bin {0} has a zero count")]
    ZeroCount(i32),
}

impl Sketch {
    /// Adds one value (non-positive or non-finite values are not durations
    /// and are ignored).
    pub fn add(&mut self, v: f64) {
        if v.is_finite() && v > 0.0 {
            *self.bins.entry(key_of(v)).or_default() += 1;
            self.count += 1;
        }
    }

    /// Values added.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bins in use.
    pub fn len(&self) -> usize {
        self.bins.len()
    }

    /// The bins, lowest first, for the wire.
    pub fn bins(&self) -> impl Iterator<Item = (i32, u64)> + '_ {
        self.bins.iter().map(|(k, c)| (*k, *c))
    }

    /// A sketch from a peer's bins, checked.
    pub fn from_bins(bins: impl ExactSizeIterator<Item = (i32, u64)>) -> Result<Self, SketchError> {
        if bins.len() > MAX_BINS {
            return Err(SketchError::TooManyBins(bins.len()));
        }
        let (lo, hi) = (key_of(MIN_VALUE), key_of(MAX_VALUE));
        let mut s = Sketch::default();
        for (k, c) in bins {
            if !(lo..=hi).contains(&k) {
                return Err(SketchError::BadKey(k, lo, hi));
            }
            if c == 0 {
                return Err(SketchError::ZeroCount(k));
            }
            if s.bins.insert(k, c).is_some() {
                return Err(SketchError::Repeated(k));
            }
            s.count = s.count.saturating_add(c);
        }
        Ok(s)
    }

    /// Adds `other`'s counts.
    pub fn merge(&mut self, other: &Sketch) {
        for (k, c) in &other.bins {
            let e = self.bins.entry(*k).or_default();
            *e = e.saturating_add(*c);
        }
        self.count = self.count.saturating_add(other.count);
    }

    /// Takes `other`'s counts away again (it must have been merged in).
    pub fn subtract(&mut self, other: &Sketch) {
        for (k, c) in &other.bins {
            if let Some(e) = self.bins.get_mut(k) {
                *e = e.saturating_sub(*c);
                if *e == 0 {
                    self.bins.remove(k);
                }
            }
        }
        self.count = self.count.saturating_sub(other.count);
    }

    /// The value at rank `r` (0-based, in sorted order).
    fn at_rank(&self, r: u64) -> Option<f64> {
        let mut seen = 0u64;
        for (k, c) in &self.bins {
            seen += c;
            if seen > r {
                return Some(value_of(*k));
            }
        }
        None
    }

    /// The median (the mean of the two middle values for an even count),
    /// within ALPHA of the exact one.
    pub fn median(&self) -> Option<f64> {
        let n = self.count;
        if n == 0 {
            return None;
        }
        let hi = self.at_rank(n / 2)?;
        if n % 2 == 1 {
            return Some(hi);
        }
        Some((self.at_rank(n / 2 - 1)? + hi) / 2.0)
    }

    /// The median absolute deviation from `center`: each bin's
    /// representative deviates by its distance, so the result is within
    /// ALPHA x (center + the deviation) of the exact one.
    pub fn mad(&self, center: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let mut dev: Vec<(f64, u64)> = self
            .bins
            .iter()
            .map(|(k, c)| ((value_of(*k) - center).abs(), *c))
            .collect();
        dev.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        let n = self.count;
        let rank = |r: u64| {
            let mut seen = 0u64;
            dev.iter()
                .find(|(_, c)| {
                    seen += c;
                    seen > r
                })
                .map(|(d, _)| *d)
        };
        let hi = rank(n / 2)?;
        if n % 2 == 1 {
            return Some(hi);
        }
        Some((rank(n / 2 - 1)? + hi) / 2.0)
    }

    /// Values at or above `threshold` (bins whose representative is).
    pub fn count_at_least(&self, threshold: f64) -> u64 {
        self.bins
            .iter()
            .filter(|(k, _)| value_of(**k) >= threshold)
            .map(|(_, c)| *c)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::straggler::score::{median_f64, spread};

    #[test]
    fn statistics_stay_within_the_error_bound() {
        // A job's window medians: 10 ms with a 1% jitter and two stragglers.
        let mut vals: Vec<f64> = (0..2000)
            .map(|i| 1e7 * (1.0 + 0.01 * ((i * 7919 % 101) as f64 / 100.0 - 0.5)))
            .collect();
        vals.push(1.3e7);
        vals.push(2e7);
        let mut s = Sketch::default();
        for v in &vals {
            s.add(*v);
        }
        assert_eq!(s.count(), 2002);
        let exact = spread(&mut vals.clone()).unwrap();
        let m = s.median().unwrap();
        assert!(
            (m - exact.median).abs() <= ALPHA * exact.median,
            "{m} {exact:?}"
        );
        let mut dev: Vec<f64> = vals.iter().map(|v| (v - exact.median).abs()).collect();
        let exact_mad = median_f64(&mut dev).unwrap();
        let mad = s.mad(m).unwrap();
        assert!(
            (mad - exact_mad).abs() <= 2.0 * ALPHA * (exact.median + exact_mad),
            "{mad} vs {exact_mad}"
        );
        assert_eq!(s.count_at_least(1.2e7), 2);
    }

    #[test]
    fn merge_and_subtract_are_exact_on_counts() {
        let (mut a, mut b) = (Sketch::default(), Sketch::default());
        for v in [1e6, 2e6, 3e6] {
            a.add(v);
        }
        for v in [2e6, 5e6] {
            b.add(v);
        }
        let mut all = a.clone();
        all.merge(&b);
        assert_eq!(all.count(), 5);
        let m = all.median().unwrap();
        assert!((m - 2e6).abs() <= ALPHA * 2e6);
        all.subtract(&b);
        assert_eq!(all, a);
    }

    #[test]
    fn bins_from_a_peer_are_checked() {
        let ok = Sketch::from_bins([(100, 2), (200, 1)].into_iter()).unwrap();
        assert_eq!(ok.count(), 3);
        assert_eq!(
            Sketch::from_bins([(100, 2), (100, 1)].into_iter()),
            Err(SketchError::Repeated(100))
        );
        assert_eq!(
            Sketch::from_bins([(1, 0)].into_iter()),
            Err(SketchError::ZeroCount(1))
        );
        assert!(matches!(
            Sketch::from_bins([(i32::MAX, 1)].into_iter()),
            Err(SketchError::BadKey(..))
        ));
        let many: Vec<(i32, u64)> = (0..=MAX_BINS as i32).map(|k| (k, 1)).collect();
        assert_eq!(
            Sketch::from_bins(many.into_iter()),
            Err(SketchError::TooManyBins(MAX_BINS + 1))
        );
    }
}
