//! The closed forms the simulation is checked against: Young's first-order
//! optimum checkpoint interval (1974), Daly's higher-order one (2006), and the
//! first-order expected goodput at a given interval.
//!
//! They assume exponential failures, a fixed save cost and one mean recovery;
//! the simulation does not need those assumptions (classes, hangs, spares,
//! scale-down, failures during recovery), which is why it exists. Where the
//! assumptions hold, the two must agree (tests/young_daly.rs).

/// Young: the interval (training between saves) that minimises waste,
/// `sqrt(2 * C * M)` for save cost `C` and mean time between failures `M`.
pub fn young_interval(save_s: f64, mtbf_s: f64) -> f64 {
    (2.0 * save_s * mtbf_s).sqrt()
}

/// Daly's higher-order optimum, for `C < 2M`:
/// `sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`; `M` when `C >= 2M`.
pub fn daly_interval(save_s: f64, mtbf_s: f64) -> f64 {
    if save_s >= 2.0 * mtbf_s {
        return mtbf_s;
    }
    let r = save_s / (2.0 * mtbf_s);
    young_interval(save_s, mtbf_s) * (1.0 + r.sqrt() / 3.0 + r / 9.0) - save_s
}

/// First-order expected goodput at `interval`: each period of `interval +
/// C` pays `C`; each failure that loses progress (`unplanned` of all, at rate
/// `1/M`) costs half a period on average plus the recovery `R`; a planned
/// restart costs a save and `R`:
/// `interval/(interval+C) - (u*((interval+C)/2 + R) + (1-u)*(C + R)) / M`,
/// floored at 0.
pub fn expected_goodput(
    interval: f64,
    save_s: f64,
    mtbf_s: f64,
    recovery_s: f64,
    unplanned: f64,
) -> f64 {
    let period = interval + save_s;
    let per_failure =
        unplanned * (period / 2.0 + recovery_s) + (1.0 - unplanned) * (save_s + recovery_s);
    (interval / period - per_failure / mtbf_s).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn young_is_the_maximum_of_the_first_order_goodput() {
        let (c, m, r) = (10.0, 10_000.0, 100.0);
        let t = young_interval(c, m);
        assert!((t - 447.213_595_5).abs() < 1e-6);
        // The first-order goodput peaks where period = sqrt(2CM), i.e. at
        // interval = Young - C, and Young is within C of it.
        let peak = expected_goodput(t - c, c, m, r, 1.0);
        for f in [0.8, 0.9, 1.1, 1.2] {
            assert!(expected_goodput((t - c) * f, c, m, r, 1.0) < peak);
        }
        let d = daly_interval(c, m);
        assert!(d < t && d > t - c, "daly {d} young {t}");
        assert_eq!(daly_interval(30.0, 10.0), 10.0);
    }
}
