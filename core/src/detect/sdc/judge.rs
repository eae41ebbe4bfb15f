//! One of this host's ranks' values at one step, judged against the job's
//! statistics at that step (a pure function, table-tested in tests.rs).
//!
//! The rules are the detector's (mod.rs): a non-finite value is a suspect
//! when some other value at the step is finite, or it is the step's only
//! value; among three or more finite values, one at least `z_threshold`
//! robust deviations (1.4826 x MAD, floored at 1% of the median) and
//! `min_relative` from the median is a suspect; of two finite values that
//! disagree by `min_relative`, the one whose owner says it departed from
//! its own history is the suspect, and when both or neither did nothing is
//! said and neither value becomes history.

use super::aggregate::MetricStat;
use super::score::{self, MAD_TO_SIGMA, MIN_SPREAD, ValueDeparture};
use super::{Basis, SdcConfig};

/// What the step says of one rank's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueVerdict {
    /// A suspect: on what basis, its robust z and the own-history median
    /// when that was compared.
    Suspect {
        /// What the suspicion rests on.
        basis: Basis,
        /// Robust deviations (None for a non-finite value).
        z: Option<f64>,
        /// The rank's own recent median (own-history case).
        own_median: Option<f64>,
    },
    /// Compared and clean: the value becomes the rank's history.
    Clean,
    /// Compared with nothing, or two ranks disagreeing with no way to tell
    /// which: neither a suspect nor history.
    Neither,
}

/// The departure of `x` from a set whose median and MAD are given, as
/// `score::robust_departure` computes it from the set itself.
pub fn departure(x: f64, median: f64, mad: f64, cfg: &SdcConfig) -> ValueDeparture {
    let spread = (MAD_TO_SIGMA * mad)
        .max(MIN_SPREAD * median.abs())
        .max(f64::MIN_POSITIVE);
    let d = (x - median).abs();
    let z = d / spread;
    let relative = d / median.abs().max(f64::MIN_POSITIVE);
    ValueDeparture {
        median,
        z,
        relative,
        departs: z >= cfg.z_threshold && relative >= cfg.min_relative,
    }
}

/// Judges `rank`'s value `x` (with its own-history departure `own`, as of
/// now) against the job's statistics `stat` at the step. `local` gives the
/// own-history verdict of another rank this host owns too (fresher than the
/// one its report carried); for a rank of another host, its owner's word
/// in the statistics is taken.
pub fn judge(
    cfg: &SdcConfig,
    stat: &MetricStat,
    rank: u32,
    x: f64,
    own: Option<ValueDeparture>,
    local: &dyn Fn(u32, f64) -> Option<bool>,
) -> ValueVerdict {
    let total = stat.count;
    let n = stat.finite();
    if !x.is_finite() {
        if n > 0 || total <= 1 {
            let basis = if total <= 1 {
                Basis::NonFiniteAlone
            } else {
                Basis::NonFinite
            };
            return ValueVerdict::Suspect {
                basis,
                z: None,
                own_median: None,
            };
        }
        return ValueVerdict::Neither;
    }
    if n >= 3 {
        let (Some(median), Some(mad)) = (stat.median, stat.mad) else {
            return ValueVerdict::Neither;
        };
        let d = departure(x, median, mad, cfg);
        return if d.departs {
            ValueVerdict::Suspect {
                basis: Basis::Peers,
                z: Some(d.z),
                own_median: None,
            }
        } else {
            ValueVerdict::Clean
        };
    }
    if n < 2 {
        return ValueVerdict::Neither;
    }
    // Two finite values: both are among the lowest; the other is the one
    // that is not this rank (global ranks are unique in a job).
    let Some(other) = stat.lowest.iter().find(|v| v.rank != rank) else {
        return ValueVerdict::Neither;
    };
    if !score::disagree(x, other.value, cfg.min_relative) {
        return ValueVerdict::Clean;
    }
    let mine = own.is_some_and(|d| d.departs);
    let theirs = local(other.rank, other.value).unwrap_or(other.departs_own);
    match (mine, theirs) {
        (true, false) => ValueVerdict::Suspect {
            basis: Basis::OwnHistory,
            z: own.map(|d| d.z),
            own_median: own.map(|d| d.median),
        },
        (false, true) => ValueVerdict::Clean,
        _ => ValueVerdict::Neither,
    }
}
