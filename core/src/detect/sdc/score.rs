//! The SDC detector's statistics, as pure functions: the median, a value's
//! robust departure from a set (median and MAD, as the straggler detector
//! scores section times), and whether two ranks disagree.

/// MAD x this estimates a normal distribution's standard deviation.
pub const MAD_TO_SIGMA: f64 = 1.4826;

/// Below this share of the median, a spread is not believed: ranks whose
/// gradient norms agree to the last bit (they do after an all-reduce) would
/// otherwise see a rounding difference as infinitely many deviations away.
pub const MIN_SPREAD: f64 = 0.01;

/// A value's departure from a set of values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ValueDeparture {
    /// The set's median.
    pub median: f64,
    /// Robust standard deviations from it: |x - median| / (1.4826 x MAD),
    /// the MAD floored at [`MIN_SPREAD`] of the median.
    pub z: f64,
    /// |x - median| / |median|.
    pub relative: f64,
    /// Both past their thresholds.
    pub departs: bool,
}

/// The median of finite `v` (reordered in place); None when empty.
pub fn median(v: &mut [f64]) -> Option<f64> {
    let n = v.len();
    if n == 0 {
        return None;
    }
    v.sort_unstable_by(f64::total_cmp);
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// How far `x` lies from the values `set` (reordered in place): departs
/// when at least `z_threshold` robust standard deviations and
/// `min_relative` of the median away. None for an empty set.
pub fn robust_departure(
    x: f64,
    set: &mut [f64],
    z_threshold: f64,
    min_relative: f64,
) -> Option<ValueDeparture> {
    let med = median(set)?;
    let mut dev: Vec<f64> = set.iter().map(|v| (v - med).abs()).collect();
    let mad = median(&mut dev)?;
    let spread = (MAD_TO_SIGMA * mad)
        .max(MIN_SPREAD * med.abs())
        .max(f64::MIN_POSITIVE);
    let d = (x - med).abs();
    let z = d / spread;
    let relative = d / med.abs().max(f64::MIN_POSITIVE);
    Some(ValueDeparture {
        median: med,
        z,
        relative,
        departs: z >= z_threshold && relative >= min_relative,
    })
}

/// Whether two ranks' values differ by at least `min_relative` of the
/// smaller magnitude.
pub fn disagree(a: f64, b: f64, min_relative: f64) -> bool {
    let small = a.abs().min(b.abs()).max(f64::MIN_POSITIVE);
    (a - b).abs() / small >= min_relative
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_departures() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), Some(2.5));
        // Identical peers: the spread is floored at 1% of the median.
        let d = robust_departure(10.0, &mut [1.0, 1.0, 1.0, 10.0], 12.0, 0.5).unwrap();
        assert_eq!(d.median, 1.0);
        assert!((d.z - 900.0).abs() < 1e-9 && d.departs);
        // Within the peers' own spread: not an outlier.
        let d = robust_departure(1.3, &mut [1.0, 1.2, 0.8, 1.3], 12.0, 0.5).unwrap();
        assert!(!d.departs);
        // Far in deviations but under the minimum effect.
        let d = robust_departure(1.2, &mut [1.0, 1.0, 1.0, 1.2], 12.0, 0.5).unwrap();
        assert!(d.z > 12.0 && !d.departs);
        assert!(disagree(1.0, 8.0, 0.5) && disagree(-1.0, 1.0, 0.5));
        assert!(!disagree(1.0, 1.2, 0.5));
    }
}
