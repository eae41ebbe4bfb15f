//! A quantile sketch of signed values (losses, gradient norms) with a
//! relative error bound: what the job's aggregator keeps per step and
//! metric instead of every rank's value.
//!
//! In: finite values of either sign. Out: the median and the median
//! absolute deviation (MAD), each within [`ALPHA`] relative error of the
//! exact figure over the same values (a value's magnitude is clamped to
//! [`MIN_MAGNITUDE`]..=[`MAX_MAGNITUDE`] first). Never: more bins than
//! [`MAX_BINS`] whatever is added (the magnitudes' bins are bounded by the
//! clamp), I/O.
//!
//! The scheme is the straggler sketch's (DDSketch, `straggler::sketch`),
//! mirrored for negative values with zero kept apart: a loss can be
//! negative (a log-likelihood) and a gradient norm can be zero. It never
//! goes on the wire (hosts send their ranks' raw values and are answered
//! with statistics), so it is add-only.

use std::collections::BTreeMap;

/// Relative accuracy: 0.1%, a tenth of the spread floor
/// ([`super::MIN_SPREAD`], 1% of the median), so a rank's robust z moves by
/// at most about 0.2 of a spread.
pub const ALPHA: f64 = 0.001;
/// Magnitudes below are counted as this (a bin of their own).
pub const MIN_MAGNITUDE: f64 = 1e-12;
/// Magnitudes above are counted as this.
pub const MAX_MAGNITUDE: f64 = 1e12;
/// Bins a sketch can ever hold: both signs' keys over the clamped range,
/// and zero.
pub const MAX_BINS: usize = 2 * 13_817 * 2 + 1;

fn gamma_ln() -> f64 {
    ((1.0 + ALPHA) / (1.0 - ALPHA)).ln()
}

/// The magnitude key of `m > 0`, at least 1 (so the sign can ride on it).
fn key_of(m: f64) -> i32 {
    let m = m.clamp(MIN_MAGNITUDE, MAX_MAGNITUDE);
    let lo = (MIN_MAGNITUDE.ln() / gamma_ln()).ceil();
    // In range: (ln 1e12 - ln 1e-12) / ln gamma < 27,700.
    #[allow(clippy::cast_possible_truncation)]
    let k = ((m.ln() / gamma_ln()).ceil() - lo) as i32 + 1;
    k
}

fn magnitude_of(k: i32) -> f64 {
    let lo = (MIN_MAGNITUDE.ln() / gamma_ln()).ceil();
    let g = gamma_ln().exp();
    2.0 * ((f64::from(k - 1) + lo) * gamma_ln()).exp() / (g + 1.0)
}

/// The signed bin of `v`: 0 for zero, the magnitude's key with `v`'s sign
/// otherwise (so bins sort as their values do).
fn bin_of(v: f64) -> i32 {
    if v == 0.0 {
        0
    } else if v > 0.0 {
        key_of(v)
    } else {
        -key_of(-v)
    }
}

fn value_of(b: i32) -> f64 {
    match b.cmp(&0) {
        std::cmp::Ordering::Equal => 0.0,
        std::cmp::Ordering::Greater => magnitude_of(b),
        std::cmp::Ordering::Less => -magnitude_of(-b),
    }
}

/// Signed bin -> count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ValueSketch {
    bins: BTreeMap<i32, u64>,
    count: u64,
}

impl ValueSketch {
    /// Adds one finite value (a non-finite one is not a quantile of
    /// anything and is ignored: the aggregator counts those apart).
    pub fn add(&mut self, v: f64) {
        if v.is_finite() {
            *self.bins.entry(bin_of(v)).or_default() += 1;
            self.count += 1;
        }
    }

    /// Values added.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Bins in use.
    pub fn len(&self) -> usize {
        self.bins.len()
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn rank_of(sorted: &[(f64, u64)], r: u64) -> Option<f64> {
        let mut seen = 0u64;
        sorted
            .iter()
            .find(|(_, c)| {
                seen += c;
                seen > r
            })
            .map(|(v, _)| *v)
    }

    fn middle(sorted: &[(f64, u64)], n: u64) -> Option<f64> {
        let hi = Self::rank_of(sorted, n / 2)?;
        if n % 2 == 1 {
            return Some(hi);
        }
        Some((Self::rank_of(sorted, n / 2 - 1)? + hi) / 2.0)
    }

    /// The median (the mean of the two middle values for an even count).
    pub fn median(&self) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let sorted: Vec<(f64, u64)> = self.bins.iter().map(|(b, c)| (value_of(*b), *c)).collect();
        Self::middle(&sorted, self.count)
    }

    /// The median absolute deviation from `center`.
    pub fn mad(&self, center: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let mut dev: Vec<(f64, u64)> = self
            .bins
            .iter()
            .map(|(b, c)| ((value_of(*b) - center).abs(), *c))
            .collect();
        dev.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        Self::middle(&dev, self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::sdc::score::median;

    #[test]
    fn signed_statistics_stay_within_the_bound() {
        let vals: Vec<f64> = (0..999)
            .map(|i| -3.0 + 0.01 * f64::from(i) + if i == 500 { 1e6 } else { 0.0 })
            .collect();
        let mut sk = ValueSketch::default();
        for v in &vals {
            sk.add(*v);
        }
        sk.add(f64::NAN);
        assert_eq!(sk.count(), 999);
        let mut exact = vals.clone();
        let m = median(&mut exact).unwrap();
        let got = sk.median().unwrap();
        assert!((got - m).abs() <= ALPHA * m.abs() + 1e-12, "{got} vs {m}");
        let mut dev: Vec<f64> = vals.iter().map(|v| (v - m).abs()).collect();
        let mad = median(&mut dev).unwrap();
        let got = sk.mad(m).unwrap();
        assert!(
            (got - mad).abs() <= 2.0 * ALPHA * (mad + m.abs()),
            "{got} vs {mad}"
        );
        // Zero and both signs order as values do.
        let mut sk = ValueSketch::default();
        for v in [-2.0, 0.0, 5.0] {
            sk.add(v);
        }
        assert_eq!(sk.median(), Some(0.0));
        assert!(bin_of(-1e30) < bin_of(-1.0) && bin_of(-1e-30) < 0 && bin_of(1e-30) > 0);
    }

    #[test]
    fn bins_are_bounded_whatever_is_added() {
        let mut sk = ValueSketch::default();
        let mut v = 1e-300;
        while v < 1e300 {
            sk.add(v);
            sk.add(-v);
            v *= 1.0005;
        }
        sk.add(0.0);
        assert!(sk.len() <= MAX_BINS, "{} bins", sk.len());
        assert!(bin_of(f64::MAX).unsigned_abs() as usize <= MAX_BINS / 2);
    }
}
