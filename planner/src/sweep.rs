//! The sweep: goodput against checkpoint interval for warden and for the
//! scheduler-requeue baseline over many repetitions, the optimum of each,
//! and what spares are worth at warden's optimum.
//!
//! Repetitions run on all cores (`std::thread::scope`); each has its own
//! random stream derived from the seed and its index, and results are
//! gathered by index, so the same seed gives the same plan on any machine
//! and any number of threads.

use serde::Serialize;

use crate::rng::Rng;
use crate::scenario::{LedgerFigures, Scenario, ScenarioError};
use crate::sim::{self, Breakdown, Incident, Model, Strategy};
use crate::young_daly;

/// Goodput at one checkpoint interval, over the repetitions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// Seconds of training between saves.
    pub interval_s: f64,
    /// Mean goodput (productive share of the job's accelerator time).
    pub mean: f64,
    /// 5th percentile over the repetitions.
    pub p5: f64,
    /// 95th percentile.
    pub p95: f64,
}

/// The best interval of a series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Optimum {
    /// The vertex of a parabola fitted (in log interval) to the best grid
    /// point and its neighbours: steadier than the grid's argmax alone.
    pub interval_s: f64,
    /// The best grid point.
    pub grid_interval_s: f64,
    /// Goodput at the best grid point: mean, p5, p95.
    pub goodput: Point,
    /// Where the time went at the best grid point (means).
    pub breakdown: Breakdown,
}

/// One strategy's curve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Series {
    /// "warden" or "scheduler requeue".
    pub name: String,
    /// The save stall this strategy pays, seconds.
    pub save_stall_s: f64,
    /// Mean downtime per interruption (detection + restart + restore), seconds.
    pub mean_recovery_s: f64,
    /// The sweep.
    pub points: Vec<Point>,
    /// Its best interval.
    pub optimum: Optimum,
    /// Young's interval for this save stall and the interruptions that lose progress.
    pub young_interval_s: f64,
    /// Daly's higher-order interval.
    pub daly_interval_s: f64,
    /// The first-order closed form's goodput at Young's interval.
    pub closed_form_goodput: f64,
}

/// Goodput with a number of hot spares, at warden's optimum interval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpareRow {
    /// Spare nodes.
    pub spares: u32,
    /// Goodput of the job's accelerators: mean, p5, p95.
    pub goodput: Point,
    /// Productive accelerator-hours gained over no spares (mean).
    pub gained_gpu_hours: f64,
    /// Accelerator-hours the spares cost (held idle for the whole run).
    pub spare_gpu_hours: f64,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The inputs, after presets, flags and the ledger.
    pub scenario: Scenario,
    /// The ledger figures used, when `--from-ledger` was given.
    pub ledger: Option<LedgerFigures>,
    /// Nodes in the job.
    pub nodes: u64,
    /// The job's mean time between interruptions, seconds.
    pub job_mtbf_s: f64,
    /// Interruptions expected over the run.
    pub interruptions_expected: f64,
    /// Modelled restore of one node's shard from its local tier, seconds.
    pub restore_local_s: f64,
    /// Restore of one node's shard from a peer, seconds.
    pub restore_peer_s: f64,
    /// Restore of the whole checkpoint from durable storage, seconds.
    pub restore_durable_s: f64,
    /// The restart round across hosts used, seconds.
    pub round_s: f64,
    /// Where it came from: "given", or the fleet bench's figure at the
    /// job's node count (measured, interpolated or extrapolated).
    pub round_basis: String,
    /// warden with the scenario's spares.
    pub warden: Series,
    /// The scheduler-requeue baseline.
    pub baseline: Series,
    /// What spares are worth.
    pub spares: Vec<SpareRow>,
}

/// Runs `f` for every repetition on all cores; results in repetition order.
fn par_reps<R: Send>(reps: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(reps)
        .max(1);
    let chunk = reps.div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                scope.spawn(move || {
                    (k * chunk..((k + 1) * chunk).min(reps))
                        .map(f)
                        .collect::<Vec<R>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h.join() {
                Ok(v) => v,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}

/// The `q` quantile of sorted values (linear interpolation).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    #[allow(clippy::cast_precision_loss)]
    let pos = q * (sorted.len() - 1) as f64;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    #[allow(clippy::cast_precision_loss)]
    let frac = pos - lo as f64;
    sorted[lo] + (sorted[hi] - sorted[lo]) * frac
}

fn point(interval_s: f64, values: &mut [f64]) -> Point {
    values.sort_by(f64::total_cmp);
    #[allow(clippy::cast_precision_loss)]
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    Point {
        interval_s,
        mean,
        p5: quantile(values, 0.05),
        p95: quantile(values, 0.95),
    }
}

/// Fits `y = a x^2 + b x + c` by least squares; the vertex `-b / 2a` when
/// the parabola opens downwards.
fn parabola_vertex(xs: &[f64], ys: &[f64]) -> Option<f64> {
    #[allow(clippy::cast_precision_loss)]
    let n = xs.len() as f64;
    let mx = xs.iter().sum::<f64>() / n;
    // Centre x for a well-conditioned system.
    let (mut s2, mut s3, mut s4, mut sy, mut sxy, mut sx2y) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (&x, &y) in xs.iter().zip(ys) {
        let x = x - mx;
        s2 += x * x;
        s3 += x * x * x;
        s4 += x * x * x * x;
        sy += y;
        sxy += x * y;
        sx2y += x * x * y;
    }
    // Normal equations with s0 = n, s1 = 0 (centred).
    let m = [[s4, s3, s2], [s3, s2, 0.0], [s2, 0.0, n]];
    let v = [sx2y, sxy, sy];
    let det = |m: &[[f64; 3]; 3]| {
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    };
    let d = det(&m);
    if d.abs() < f64::MIN_POSITIVE {
        return None;
    }
    let with = |col: usize| {
        let mut c = m;
        for (row, &val) in c.iter_mut().zip(&v) {
            row[col] = val;
        }
        det(&c) / d
    };
    let (a, b) = (with(0), with(1));
    (a < 0.0).then(|| mx - b / (2.0 * a))
}

/// Half-width, in grid points, of the parabola fitted around the best point.
const FIT_HALF_WIDTH: usize = 4;

fn optimum(points: &[Point], breakdowns: &[Breakdown]) -> Optimum {
    let best = points
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.mean.total_cmp(&b.1.mean))
        .map_or(0, |(i, _)| i);
    let lo = best.saturating_sub(FIT_HALF_WIDTH);
    let hi = (best + FIT_HALF_WIDTH).min(points.len() - 1);
    let window = &points[lo..=hi];
    let xs: Vec<f64> = window.iter().map(|p| p.interval_s.ln()).collect();
    let ys: Vec<f64> = window.iter().map(|p| p.mean).collect();
    let refined = parabola_vertex(&xs, &ys)
        .filter(|v| *v >= xs[0] && *v <= xs[xs.len() - 1])
        .map_or(points[best].interval_s, f64::exp);
    Optimum {
        interval_s: refined,
        grid_interval_s: points[best].interval_s,
        goodput: points[best].clone(),
        breakdown: breakdowns[best],
    }
}

/// `n` intervals log-spaced from `lo` to `hi`.
pub fn log_grid(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    #[allow(clippy::cast_precision_loss)]
    let steps = (n - 1) as f64;
    (0..n)
        .map(|i| {
            #[allow(clippy::cast_precision_loss)]
            let f = i as f64 / steps;
            (lo.ln() + f * (hi.ln() - lo.ln())).exp()
        })
        .collect()
}

/// The spare counts compared: 0, 1, 2, 4, ... up to the larger of the
/// scenario's count and 8, and the scenario's count itself.
fn spare_counts(spares: u32) -> Vec<u32> {
    let top = spares.max(8);
    let mut counts = vec![0];
    let mut n = 1;
    while n <= top {
        counts.push(n);
        n *= 2;
    }
    counts.push(spares);
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// Simulates the scenario and answers: goodput against interval for warden
/// and the baseline, each one's optimum, and the spares table.
pub fn plan(scenario: &Scenario, ledger: Option<LedgerFigures>) -> Result<Plan, ScenarioError> {
    scenario.validate()?;
    let model = Model::new(scenario);
    let horizon = model.horizon();
    let warden = Strategy::Warden {
        spares: scenario.spares,
    };
    let baseline = Strategy::Baseline;
    let (rec_w, lossy_w) = model.mean_recovery(warden);
    let (rec_b, lossy_b) = model.mean_recovery(baseline);
    // Young's M: the mean time between interruptions that lose progress
    // (each strategy's own: a healed fault loses none).
    let lossy_mtbf = |share: f64| model.job_mtbf() / share.max(f64::MIN_POSITIVE);
    let save_w = model.save_stall(warden);
    let save_b = model.save_stall(baseline);
    let young_w = young_daly::young_interval(save_w, lossy_mtbf(lossy_w));
    let young_b = young_daly::young_interval(save_b, lossy_mtbf(lossy_b));
    let sw = &scenario.sweep;
    // A save happens at a step boundary: no interval below one step (a
    // cheap save makes Young's interval shorter than a step).
    let step = scenario.job.step_s;
    let lo = sw
        .interval_min_s
        .unwrap_or((young_w.min(young_b).max(1.0) / 5.0).max(step));
    let hi = sw
        .interval_max_s
        .unwrap_or((young_w.max(young_b).max(1.0) * 5.0).max(lo * 25.0));
    if hi <= lo {
        return Err(ScenarioError::Invalid {
            key: "sweep.interval_max_s".into(),
            value: hi.to_string(),
            why: format!("must be above the sweep's lower end ({lo})"),
        });
    }
    let grid = log_grid(lo, hi, sw.points);
    let seed = sw.seed;

    // Pass 1: both curves, every repetition with its own history.
    // Per repetition: [warden, baseline] x interval.
    let per_rep: Vec<[Vec<Breakdown>; 2]> = par_reps(sw.reps, |rep| {
        let mut incidents: Vec<Incident> = Vec::new();
        let mut curve = |strategy: Strategy, save: f64| {
            let mut rng = Rng::for_rep(seed, rep as u64);
            sim::timeline(&model, strategy, &mut rng, &mut incidents);
            grid.iter()
                .map(|&tau| sim::evaluate(&incidents, horizon, tau, save))
                .collect::<Vec<_>>()
        };
        [curve(warden, save_w), curve(baseline, save_b)]
    });
    let series = |name: &str, which: usize, save: f64, rec: f64, young: f64, lossy: f64| {
        let mut values = vec![0.0; per_rep.len()];
        let mut points = Vec::with_capacity(grid.len());
        let mut means = Vec::with_capacity(grid.len());
        #[allow(clippy::cast_precision_loss)]
        let w = 1.0 / per_rep.len() as f64;
        for (i, &tau) in grid.iter().enumerate() {
            let mut mean = Breakdown::default();
            for (v, r) in values.iter_mut().zip(&per_rep) {
                let b = &r[which][i];
                *v = b.productive;
                mean.add_scaled(b, w);
            }
            points.push(point(tau, &mut values));
            means.push(mean);
        }
        let optimum = optimum(&points, &means);
        Series {
            name: name.to_owned(),
            save_stall_s: save,
            mean_recovery_s: rec,
            points,
            optimum,
            young_interval_s: young,
            daly_interval_s: young_daly::daly_interval(save, lossy_mtbf(lossy)),
            closed_form_goodput: young_daly::expected_goodput(
                young,
                save,
                model.job_mtbf(),
                rec,
                lossy,
            ),
        }
    };
    let warden_series = series("warden", 0, save_w, rec_w, young_w, lossy_w);
    let baseline_series = series("scheduler requeue", 1, save_b, rec_b, young_b, lossy_b);

    // Pass 2: spares at warden's optimum.
    let tau = warden_series.optimum.interval_s;
    let counts = spare_counts(scenario.spares);
    let spare_runs: Vec<Vec<f64>> = par_reps(sw.reps, |rep| {
        let mut incidents = Vec::new();
        counts
            .iter()
            .map(|&spares| {
                let mut rng = Rng::for_rep(seed, rep as u64);
                sim::timeline(
                    &model,
                    Strategy::Warden { spares },
                    &mut rng,
                    &mut incidents,
                );
                sim::evaluate(&incidents, horizon, tau, save_w).productive
            })
            .collect()
    });
    #[allow(clippy::cast_precision_loss)]
    let gpu_hours = scenario.gpus as f64 * horizon / 3600.0;
    #[allow(clippy::cast_precision_loss)]
    let node_hours = scenario.gpus_per_node as f64 * horizon / 3600.0;
    let mut rows: Vec<SpareRow> = counts
        .iter()
        .enumerate()
        .map(|(k, &spares)| {
            let mut values: Vec<f64> = spare_runs.iter().map(|r| r[k]).collect();
            SpareRow {
                spares,
                goodput: point(tau, &mut values),
                gained_gpu_hours: 0.0,
                spare_gpu_hours: f64::from(spares) * node_hours,
            }
        })
        .collect();
    let none = rows.first().map_or(0.0, |r| r.goodput.mean);
    for r in &mut rows {
        r.gained_gpu_hours = (r.goodput.mean - none) * gpu_hours;
    }
    let (local, peer, durable) = sim::restore_times(scenario);
    let round = scenario.round()?;
    Ok(Plan {
        round_s: round.seconds,
        round_basis: round
            .fleet
            .map_or_else(|| "given".to_owned(), |f| f.label()),
        scenario: scenario.clone(),
        ledger,
        nodes: scenario.nodes(),
        job_mtbf_s: model.job_mtbf(),
        interruptions_expected: horizon / model.job_mtbf(),
        restore_local_s: local,
        restore_peer_s: peer,
        restore_durable_s: durable,
        warden: warden_series,
        baseline: baseline_series,
        spares: rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parabola_vertex_finds_the_peak() {
        let xs: Vec<f64> = (0..9).map(|i| f64::from(i) * 0.1).collect();
        let ys: Vec<f64> = xs.iter().map(|x| -(x - 0.37) * (x - 0.37) + 2.0).collect();
        let v = parabola_vertex(&xs, &ys).unwrap();
        assert!((v - 0.37).abs() < 1e-9, "{v}");
        let up: Vec<f64> = xs.iter().map(|x| x * x).collect();
        assert_eq!(parabola_vertex(&xs, &up), None);
    }

    #[test]
    fn quantiles_and_spare_counts() {
        let v: Vec<f64> = (0..=100).map(f64::from).collect();
        assert!((quantile(&v, 0.05) - 5.0).abs() < 1e-12);
        assert!((quantile(&v, 0.95) - 95.0).abs() < 1e-12);
        assert_eq!(spare_counts(0), vec![0, 1, 2, 4, 8]);
        assert_eq!(spare_counts(3), vec![0, 1, 2, 3, 4, 8]);
        assert_eq!(spare_counts(16), vec![0, 1, 2, 4, 8, 16]);
    }
}
