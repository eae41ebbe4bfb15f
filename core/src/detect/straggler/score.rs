//! The statistics, as pure functions: window medians, the job's median and
//! spread per section, a rank's relative, robust-z and individual scores,
//! and the hysteresis that turns windows into a flag.
//!
//! Why these: a synchronous job moves at the pace of its slowest rank, so
//! only sections that are a rank's own work are compared (waiting on a
//! collective makes every rank look as slow as the slowest). Medians over a
//! window ignore one slow step (a GC pause); the median absolute deviation
//! (MAD) across ranks measures the job's spread without letting the
//! straggler inflate it. A rank counts as "over" in a window when it is
//! both slower by a minimum effect (`relative_threshold`) and an outlier
//! (`z_threshold`); it is flagged after `flag_after` consecutive windows
//! over and cleared after `clear_after` under, so one noisy window neither
//! raises nor drops a flag.
//!
//! Allocation: a [`Scorer`] keeps its scratch buffers between windows, and
//! window medians are taken in a stack buffer, so scoring allocates nothing
//! once warm. Deterministic: no clock, no randomness, no I/O.

use super::config::{MAX_WINDOW, StragglerConfig};
use super::samples::{RankSamples, TRACKED_SECTIONS};

/// Sections one job's comparison holds (the union of its ranks' sections).
pub const MAX_SECTIONS: usize = TRACKED_SECTIONS;

/// The section of a rank that marks no section at all: its step time.
pub const STEP: &str = "step";
/// The section of a rank that marks only wait (or unlisted) sections: its
/// step time minus the wait sections.
pub const STEP_MINUS_WAIT: &str = "step-minus-wait";

/// Below this share of the job's median, a spread is not believed: timers
/// and schedulers do not resolve better than about 1%, and a job whose
/// ranks agree to the nanosecond (a simulation, sleeping ranks) would
/// otherwise see any difference as infinitely many deviations away.
pub const MIN_SPREAD: f64 = 0.01;

/// MAD x this estimates a normal distribution's standard deviation.
const MAD_TO_SIGMA: f64 = 1.4826;

/// What a section name stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SectionKind {
    /// The rank's own work: compared across ranks.
    Compute,
    /// Waiting on others or on I/O: never compared.
    Wait,
    /// Neither listed: not compared on its own; counted in a step-time
    /// fallback.
    Other,
}

/// Tells compute sections from wait sections by name (`[straggler]`
/// `compute_sections`, `wait_sections`).
#[derive(Debug, Clone)]
pub struct Classifier {
    compute: Vec<String>,
    wait: Vec<String>,
}

impl Classifier {
    /// From the config's lists.
    pub fn new(cfg: &StragglerConfig) -> Self {
        Self {
            compute: cfg.compute_sections.clone(),
            wait: cfg
                .wait_sections
                .iter()
                .map(|w| w.to_ascii_lowercase())
                .collect(),
        }
    }

    /// The kind of `name`: a wait pattern anywhere in it wins, then an exact
    /// compute name or a compute prefix (`name*`).
    pub fn kind(&self, name: &str) -> SectionKind {
        let lower = name.to_ascii_lowercase();
        if self.wait.iter().any(|w| lower.contains(w.as_str())) {
            return SectionKind::Wait;
        }
        let compute = self.compute.iter().any(|c| match c.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => c == name,
        });
        if compute {
            SectionKind::Compute
        } else {
            SectionKind::Other
        }
    }
}

/// A rank's section kinds by tracked index, classified once per name (a
/// rank's names are append-only, so only new ones are classified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionKinds {
    known: usize,
    kinds: [SectionKind; TRACKED_SECTIONS],
}

impl Default for SectionKinds {
    fn default() -> Self {
        Self {
            known: 0,
            kinds: [SectionKind::Other; TRACKED_SECTIONS],
        }
    }
}

impl SectionKinds {
    /// The kinds of `names`, classifying those not seen yet.
    pub fn update(&mut self, names: &[String], classifier: &Classifier) -> &[SectionKind] {
        let n = names.len().min(TRACKED_SECTIONS);
        if n < self.known {
            // Another rank's names (a fresh registration): start over.
            self.known = 0;
        }
        for (k, name) in self.kinds.iter_mut().zip(names).take(n).skip(self.known) {
            *k = classifier.kind(name);
        }
        self.known = n;
        &self.kinds[..n]
    }
}

/// The thresholds, copied out of the config once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Steps per window.
    pub window: usize,
    /// Steps a section needs before it is judged.
    pub min_steps: usize,
    /// Minimum effect: rank median / job median.
    pub relative_threshold: f64,
    /// Minimum robust z.
    pub z_threshold: f64,
    /// Minimum individual score, for jobs too small for a spread.
    pub individual_threshold: f64,
    /// Windows the "best recent window" is taken from.
    pub individual_windows: usize,
    /// Ranks needed for the robust-z comparison.
    pub min_ranks: usize,
    /// Largest share of ranks that may be over in a section.
    pub max_share: f64,
    /// Consecutive windows over before a flag.
    pub flag_after: u32,
    /// Consecutive windows under before a flag clears.
    pub clear_after: u32,
}

impl From<&StragglerConfig> for Params {
    fn from(c: &StragglerConfig) -> Self {
        Self {
            window: c.window_steps,
            min_steps: c.min_steps,
            relative_threshold: c.relative_threshold,
            z_threshold: c.z_threshold,
            individual_threshold: c.individual_threshold,
            individual_windows: c.individual_windows,
            min_ranks: c.min_ranks,
            max_share: c.max_share,
            flag_after: c.flag_after,
            clear_after: c.clear_after,
        }
    }
}

/// The median of `v` (the mean of the two middle values for an even
/// count); reorders `v`. None when empty.
pub fn median_u64(v: &mut [u64]) -> Option<f64> {
    let n = v.len();
    if n == 0 {
        return None;
    }
    let (lower, upper, _) = v.select_nth_unstable(n / 2);
    let hi = *upper as f64;
    if n % 2 == 1 {
        return Some(hi);
    }
    let lo = lower.iter().copied().max().unwrap_or(*upper) as f64;
    Some((lo + hi) / 2.0)
}

/// [`median_u64`] for a window's few values (reorders `v` above 16): up to
/// 16 values, counting each one's rank beats sorting, whose branches a
/// noisy window mispredicts.
pub fn median_small(v: &mut [u64]) -> Option<f64> {
    let n = v.len();
    if n == 0 {
        return None;
    }
    if n > 16 {
        v.sort_unstable();
        let hi = v[n / 2] as f64;
        return Some(if n % 2 == 1 {
            hi
        } else {
            (v[n / 2 - 1] as f64 + hi) / 2.0
        });
    }
    // Each value's rank by counting, without a branch a random window
    // would mispredict (ties broken by position, so ranks are distinct).
    let (mut lo, mut hi) = (0u64, 0u64);
    #[allow(clippy::needless_range_loop)] // plain indices: cheap in debug builds too
    for i in 0..n {
        let x = v[i];
        let mut rank = 0;
        for j in 0..n {
            let y = v[j];
            rank += usize::from(y < x) + usize::from(y == x && j < i);
        }
        if rank == n / 2 {
            hi = x;
        }
        if n.is_multiple_of(2) && rank + 1 == n / 2 {
            lo = x;
        }
    }
    Some(if n % 2 == 1 {
        hi as f64
    } else {
        (lo as f64 + hi as f64) / 2.0
    })
}

/// [`median_u64`] for floats (total order; NaN never reaches here).
pub fn median_f64(v: &mut [f64]) -> Option<f64> {
    let n = v.len();
    if n == 0 {
        return None;
    }
    let (lower, upper, _) = v.select_nth_unstable_by(n / 2, f64::total_cmp);
    let hi = *upper;
    if n % 2 == 1 {
        return Some(hi);
    }
    let lo = lower.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some((lo + hi) / 2.0)
}

/// One section of one rank over its latest window.
#[derive(Debug, Clone, PartialEq)]
pub struct SectionMedian {
    /// Section name (or [`STEP`], [`STEP_MINUS_WAIT`]).
    pub section: String,
    /// Median duration over the window, nanoseconds.
    pub median_ns: f64,
    /// Steps of the section kept (at most [`MAX_WINDOW`]).
    pub samples: u32,
}

/// A rank's compute sections over its last `window` steps, into `out`
/// (cleared first). A rank that marks no compute section is measured on
/// its step time minus its wait sections, named [`STEP`] or
/// [`STEP_MINUS_WAIT`] so the score says so.
/// `kinds` is the rank's [`SectionKinds`] (its classification cache).
pub fn window_medians(
    samples: &RankSamples,
    classifier: &Classifier,
    kinds: &mut SectionKinds,
    window: usize,
    out: &mut Vec<SectionMedian>,
) {
    let names = samples.names();
    let rows = samples.rows();
    let window = window.min(MAX_WINDOW);
    let kinds = kinds.update(names, classifier);
    // Entries are rewritten in place, so a warm `out` keeps its strings.
    let mut used = 0;
    let mut buf = [0u64; MAX_WINDOW];
    for (i, name) in names.iter().enumerate().take(TRACKED_SECTIONS) {
        if kinds.get(i) != Some(&SectionKind::Compute) {
            continue;
        }
        // Newest first, only as far back as the window reaches.
        let mut n = 0;
        for row in rows.iter().rev() {
            let v = row.ns[i];
            if v > 0 {
                buf[n] = v;
                n += 1;
                if n == window {
                    break;
                }
            }
        }
        if let Some(m) = median_small(&mut buf[..n]) {
            put_median(out, &mut used, name, m, samples.steps_with(i));
        }
    }
    if used > 0 {
        out.truncate(used);
        return;
    }
    let mut n = 0;
    for row in rows.iter().rev().take(window) {
        let wait: u64 = row
            .ns
            .iter()
            .zip(kinds)
            .filter(|(_, k)| **k == SectionKind::Wait)
            .map(|(v, _)| *v)
            .sum();
        let v = row.step_ns.saturating_sub(wait);
        if v > 0 {
            buf[n] = v;
            n += 1;
        }
    }
    if let Some(m) = median_small(&mut buf[..n]) {
        let have = rows
            .iter()
            .filter(|r| r.step_ns > 0)
            .count()
            .min(MAX_WINDOW);
        let name = if names.is_empty() {
            STEP
        } else {
            STEP_MINUS_WAIT
        };
        put_median(
            out,
            &mut used,
            name,
            m,
            u32::try_from(have).unwrap_or(u32::MAX),
        );
    }
    out.truncate(used);
}

/// Writes entry `*used` of `out` (reusing its string), then advances.
fn put_median(
    out: &mut Vec<SectionMedian>,
    used: &mut usize,
    name: &str,
    median_ns: f64,
    samples: u32,
) {
    match out.get_mut(*used) {
        Some(e) => {
            if e.section != name {
                e.section.clear();
                e.section.push_str(name);
            }
            e.median_ns = median_ns;
            e.samples = samples;
        }
        None => out.push(SectionMedian {
            section: name.to_owned(),
            median_ns,
            samples,
        }),
    }
    *used += 1;
}

/// One rank's medians laid out on its job's section table (index i is the
/// job's section i): what the comparison reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobRank {
    /// Global rank.
    pub rank: u32,
    /// Median per job section, nanoseconds (NaN: the rank has none).
    pub median_ns: [f64; MAX_SECTIONS],
    /// Samples per job section.
    pub samples: [u32; MAX_SECTIONS],
}

impl JobRank {
    /// A rank with no section yet.
    pub fn new(rank: u32) -> Self {
        Self {
            rank,
            median_ns: [f64::NAN; MAX_SECTIONS],
            samples: [0; MAX_SECTIONS],
        }
    }

    /// The median of section `s` when it has enough samples to be judged.
    fn judged(&self, s: usize, p: &Params) -> Option<f64> {
        let m = self.median_ns[s];
        (m.is_finite() && m > 0.0 && self.samples[s] as usize >= p.min_steps).then_some(m)
    }
}

/// The job's centre and spread of one section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Median over the ranks' window medians, nanoseconds.
    pub median: f64,
    /// 1.4826 x MAD, never below [`MIN_SPREAD`] x median.
    pub sigma: f64,
    /// Ranks compared.
    pub n: usize,
}

/// The job's median and robust spread of `values` (reordered, then
/// overwritten with the absolute deviations). None when empty.
pub fn spread(values: &mut [f64]) -> Option<Spread> {
    let median = median_f64(values)?;
    for v in values.iter_mut() {
        *v = (*v - median).abs();
    }
    let mad = median_f64(values).unwrap_or(0.0);
    Some(Spread {
        median,
        sigma: (MAD_TO_SIGMA * mad).max(MIN_SPREAD * median),
        n: values.len(),
    })
}

/// A rank's scores in one section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankScores {
    /// Rank median / job median.
    pub relative: f64,
    /// (rank median - job median) / spread.
    pub z: f64,
    /// Rank median / its best recent window median.
    pub individual: f64,
    /// Over the thresholds in this window.
    pub over: bool,
}

/// Scores `m` (a rank's window median) against the job's `spread` and the
/// rank's own `best` recent window.
pub fn judge(m: f64, best: f64, spread: &Spread, p: &Params) -> RankScores {
    let relative = if spread.median > 0.0 {
        m / spread.median
    } else {
        1.0
    };
    let z = if spread.sigma > 0.0 {
        (m - spread.median) / spread.sigma
    } else {
        0.0
    };
    let individual = if best > 0.0 { m / best } else { 1.0 };
    let slower = relative >= p.relative_threshold;
    let over = if spread.n >= p.min_ranks {
        slower && z >= p.z_threshold
    } else {
        // Too few ranks for a spread: the rank must also have slowed down
        // against itself (a rank that was always this slow in a two-rank
        // job cannot be told from a rank doing different work).
        spread.n >= 2 && slower && individual >= p.individual_threshold
    };
    RankScores {
        relative,
        z,
        individual,
        over,
    }
}

/// Flag state of one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hysteresis {
    /// Flagged now.
    pub flagged: bool,
    /// Consecutive windows over (while not flagged) or under (while flagged).
    pub run: u32,
}

/// What a window did to a rank's flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Nothing changed.
    None,
    /// The rank became a straggler.
    Flagged,
    /// The rank is no longer one.
    Cleared,
}

impl Hysteresis {
    /// Takes one window's verdict.
    pub fn update(&mut self, over: bool, flag_after: u32, clear_after: u32) -> Transition {
        if self.flagged == over {
            // Over while flagged, or under while not: the run restarts.
            self.run = 0;
            return Transition::None;
        }
        self.run += 1;
        if !self.flagged && self.run >= flag_after {
            *self = Self {
                flagged: true,
                run: 0,
            };
            return Transition::Flagged;
        }
        if self.flagged && self.run >= clear_after {
            *self = Self::default();
            return Transition::Cleared;
        }
        Transition::None
    }
}

/// A small ring of a rank's recent window medians of one section.
#[derive(Debug, Clone, Default)]
struct History {
    section: String,
    values: Vec<f64>,
    next: usize,
}

/// What the detector remembers of a rank between windows: its recent window
/// medians (for the individual score) and its flag.
#[derive(Debug, Clone, Default)]
pub struct RankTrack {
    history: Vec<History>,
    /// The flag and its run.
    pub hysteresis: Hysteresis,
    /// Windows scored.
    pub windows: u64,
}

impl RankTrack {
    /// Records `m` for `section` and returns the best (lowest) of the last
    /// `keep` windows, this one included.
    pub fn best(&mut self, section: &str, m: f64, keep: usize) -> f64 {
        let keep = keep.max(1);
        let h = match self.history.iter().position(|h| h.section == section) {
            Some(i) => &mut self.history[i],
            None => {
                self.history.push(History {
                    section: section.to_owned(),
                    values: Vec::with_capacity(keep),
                    next: 0,
                });
                let last = self.history.len() - 1;
                &mut self.history[last]
            }
        };
        if h.values.len() < keep {
            h.values.push(m);
        } else {
            h.values[h.next % keep] = m;
        }
        h.next = (h.next + 1) % keep;
        h.values.iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// A rank's result for one window: its headline section (the slowest over
/// the thresholds, else the slowest) and whether it is over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankScore {
    /// Index of the headline section in the job's table (None: nothing judged).
    pub section: Option<usize>,
    /// Its verdict.
    pub verdict: RankScores,
    /// The rank's median of it, ns.
    pub rank_median_ns: f64,
    /// The job's, ns.
    pub job_median_ns: f64,
    /// Samples of it.
    pub samples: u32,
    /// Ranks compared in it.
    pub ranks: usize,
    /// Relative score per job section (NaN: not judged).
    pub relative: [f64; MAX_SECTIONS],
}

/// Scores windows of one job; keeps its scratch buffers between calls.
#[derive(Debug, Default)]
pub struct Scorer {
    scratch: Vec<f64>,
    spreads: [Option<Spread>; MAX_SECTIONS],
    over: [usize; MAX_SECTIONS],
}

impl Scorer {
    /// Phase one of a window: each section's job median and spread over
    /// every rank of the job (all hosts), and how many ranks are over in it,
    /// for the `max_share` guard.
    pub fn prepare(&mut self, p: &Params, sections: usize, ranks: &[JobRank]) {
        let sections = sections.min(MAX_SECTIONS);
        self.spreads = [None; MAX_SECTIONS];
        self.over = [0; MAX_SECTIONS];
        for s in 0..sections {
            self.scratch.clear();
            self.scratch
                .extend(ranks.iter().filter_map(|r| r.judged(s, p)));
            let Some(sp) = spread(&mut self.scratch) else {
                continue;
            };
            self.spreads[s] = Some(sp);
            if sp.n >= p.min_ranks {
                self.over[s] = ranks
                    .iter()
                    .filter_map(|r| r.judged(s, p))
                    .filter(|m| {
                        m / sp.median >= p.relative_threshold
                            && (m - sp.median) / sp.sigma >= p.z_threshold
                    })
                    .count();
            }
        }
    }

    /// Phase one from the job's aggregator instead of from every rank:
    /// section `i` of the job's table has `stats[i]` (its job-wide spread
    /// and the count of ranks over the thresholds; None: not compared).
    pub fn prepare_job_wide(&mut self, stats: &[Option<(Spread, usize)>]) {
        self.spreads = [None; MAX_SECTIONS];
        self.over = [0; MAX_SECTIONS];
        for (s, st) in stats.iter().enumerate().take(MAX_SECTIONS) {
            if let Some((sp, over)) = st {
                self.spreads[s] = Some(*sp);
                self.over[s] = *over;
            }
        }
    }

    /// The spread of section `s` found by [`Scorer::prepare`].
    pub fn spread_of(&self, s: usize) -> Option<Spread> {
        self.spreads.get(s).copied().flatten()
    }

    /// Phase two: one rank's score for this window. Records the window in
    /// its track (for the individual score); does not touch its flag.
    pub fn judge_rank(
        &self,
        p: &Params,
        names: &[String],
        rank: &JobRank,
        track: &mut RankTrack,
    ) -> RankScore {
        let mut out = RankScore {
            section: None,
            verdict: RankScores {
                relative: 1.0,
                z: 0.0,
                individual: 1.0,
                over: false,
            },
            rank_median_ns: 0.0,
            job_median_ns: 0.0,
            samples: 0,
            ranks: 0,
            relative: [f64::NAN; MAX_SECTIONS],
        };
        track.windows += 1;
        let mut best_key = (false, f64::NEG_INFINITY);
        for (s, name) in names.iter().enumerate().take(MAX_SECTIONS) {
            let Some(m) = rank.judged(s, p) else {
                continue;
            };
            let Some(sp) = self.spreads[s] else {
                continue;
            };
            let best = track.best(name, m, p.individual_windows);
            let mut v = judge(m, best, &sp, p);
            let allowed = ((p.max_share * sp.n as f64).floor() as usize).max(1);
            if self.over[s] > allowed {
                v.over = false;
            }
            out.relative[s] = v.relative;
            let better =
                (v.over && !best_key.0) || (v.over == best_key.0 && v.relative > best_key.1);
            if better {
                best_key = (v.over, v.relative);
                out.section = Some(s);
                out.verdict = v;
                out.rank_median_ns = m;
                out.job_median_ns = sp.median;
                out.samples = rank.samples[s];
                out.ranks = sp.n;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        Params::from(&StragglerConfig::default())
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median_u64(&mut []), None);
        assert_eq!(median_u64(&mut [5]), Some(5.0));
        assert_eq!(median_u64(&mut [9, 1, 5]), Some(5.0));
        assert_eq!(median_u64(&mut [9, 1, 5, 7]), Some(6.0));
        assert_eq!(median_small(&mut []), None);
        assert_eq!(median_small(&mut [9, 1, 5]), Some(5.0));
        assert_eq!(median_small(&mut [9, 1, 5, 7]), Some(6.0));
        assert_eq!(median_f64(&mut [3.0, 1.0, 2.0, 10.0]), Some(2.5));
    }

    #[test]
    fn spread_ignores_one_outlier_and_has_a_floor() {
        let mut v = vec![100.0, 101.0, 99.0, 100.0, 1000.0];
        let s = spread(&mut v).unwrap();
        assert_eq!(s.median, 100.0);
        assert!((s.sigma - 1.4826).abs() < 1e-9, "{s:?}");
        let mut same = vec![50.0; 8];
        let s = spread(&mut same).unwrap();
        assert_eq!(s.sigma, 0.5, "1% of the median when ranks agree exactly");
    }

    #[test]
    fn classifier_prefers_wait_patterns() {
        let c = Classifier::new(&StragglerConfig {
            compute_sections: vec!["forward".into(), "layer*".into()],
            ..StragglerConfig::default()
        });
        assert_eq!(c.kind("forward"), SectionKind::Compute);
        assert_eq!(c.kind("layer3"), SectionKind::Compute);
        assert_eq!(c.kind("forward_allreduce"), SectionKind::Wait);
        assert_eq!(c.kind("NCCL wait"), SectionKind::Wait);
        assert_eq!(c.kind("data"), SectionKind::Wait);
        assert_eq!(c.kind("loss"), SectionKind::Other);
    }

    #[test]
    fn window_medians_use_compute_sections_or_fall_back() {
        let c = Classifier::new(&StragglerConfig::default());
        let mut s = RankSamples::default();
        for i in 0..30u64 {
            s.push_step(
                1000,
                [("data", 100), ("forward", 300 + i), ("allreduce", 400)],
            );
        }
        let mut out = Vec::new();
        window_medians(&s, &c, &mut SectionKinds::default(), 10, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].section, "forward");
        assert_eq!(out[0].median_ns, 324.5, "the last 10: 320..=329");
        assert_eq!(out[0].samples, 30);

        let mut bare = RankSamples::default();
        for _ in 0..5 {
            bare.push_step(1000, []);
        }
        window_medians(&bare, &c, &mut SectionKinds::default(), 10, &mut out);
        assert_eq!((out[0].section.as_str(), out[0].median_ns), (STEP, 1000.0));

        let mut waits = RankSamples::default();
        for _ in 0..5 {
            waits.push_step(1000, [("allreduce", 300), ("loss", 100)]);
        }
        window_medians(&waits, &c, &mut SectionKinds::default(), 10, &mut out);
        assert_eq!(
            (out[0].section.as_str(), out[0].median_ns),
            (STEP_MINUS_WAIT, 700.0)
        );
    }

    #[test]
    fn judge_needs_effect_and_outlier() {
        let p = params();
        let sp = Spread {
            median: 100.0,
            sigma: 1.0,
            n: 100,
        };
        // 10% slower and 10 sigma out: over.
        assert!(judge(110.0, 100.0, &sp, &p).over);
        // 5 sigma out but only 5% slower: a tight job's harmless spread.
        assert!(!judge(105.0, 100.0, &sp, &p).over);
        // 20% slower in a job this noisy is only 2 sigma: not an outlier.
        let noisy = Spread { sigma: 10.0, ..sp };
        assert!(!judge(120.0, 100.0, &noisy, &p).over);
        // Two ranks: the slower one must also have slowed against itself.
        let two = Spread {
            median: 100.0,
            sigma: 10.0,
            n: 2,
        };
        assert!(!judge(110.0, 110.0, &two, &p).over);
        assert!(judge(110.0, 95.0, &two, &p).over);
        let v = judge(110.0, 95.0, &two, &p);
        assert!((v.individual - 110.0 / 95.0).abs() < 1e-12);
    }

    #[test]
    fn hysteresis_flags_after_n_and_clears_after_m() {
        let mut h = Hysteresis::default();
        let seq = [
            true, false, true, true, true, false, true, false, false, false,
        ];
        let got: Vec<Transition> = seq.iter().map(|o| h.update(*o, 2, 3)).collect();
        use Transition::{Cleared as C, Flagged as F, None as N};
        assert_eq!(got, [N, N, N, F, N, N, N, N, N, C]);
        assert!(!h.flagged);
    }

    #[test]
    fn best_window_is_the_minimum_of_the_last_k() {
        let mut t = RankTrack::default();
        assert_eq!(t.best("f", 10.0, 3), 10.0);
        assert_eq!(t.best("f", 8.0, 3), 8.0);
        assert_eq!(t.best("f", 12.0, 3), 8.0);
        assert_eq!(t.best("g", 50.0, 3), 50.0);
        assert_eq!(t.best("f", 12.0, 3), 8.0);
        assert_eq!(t.best("f", 12.0, 3), 12.0, "8 has left the last three");
    }

    fn job(values: &[f64]) -> Vec<JobRank> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let mut r = JobRank::new(i as u32);
                r.median_ns[0] = *v;
                r.samples[0] = 10;
                r
            })
            .collect()
    }

    #[test]
    fn scorer_picks_the_outlier_and_respects_max_share() {
        let p = params();
        let names = vec!["forward".to_owned()];
        let mut vals = vec![100.0; 20];
        vals[7] = 130.0;
        let ranks = job(&vals);
        let mut sc = Scorer::default();
        sc.prepare(&p, 1, &ranks);
        let mut t = RankTrack::default();
        let s = sc.judge_rank(&p, &names, &ranks[7], &mut t);
        assert!(s.verdict.over);
        assert_eq!(s.section, Some(0));
        assert!((s.verdict.relative - 1.3).abs() < 1e-12);
        assert!(!sc.judge_rank(&p, &names, &ranks[0], &mut t).verdict.over);

        // A quarter of the job slower: the job's shape, not stragglers.
        let mut vals = vec![100.0; 20];
        for v in vals.iter_mut().take(5) {
            *v = 130.0;
        }
        let ranks = job(&vals);
        sc.prepare(&p, 1, &ranks);
        let s = sc.judge_rank(&p, &names, &ranks[0], &mut RankTrack::default());
        assert!(!s.verdict.over);
        assert!((s.verdict.relative - 1.3).abs() < 1e-12, "still reported");
    }

    #[test]
    fn too_few_samples_are_not_judged() {
        let p = params();
        let mut ranks = job(&[100.0, 100.0, 100.0, 150.0]);
        ranks[3].samples[0] = 5;
        let mut sc = Scorer::default();
        sc.prepare(&p, 1, &ranks);
        let s = sc.judge_rank(&p, &["f".to_owned()], &ranks[3], &mut RankTrack::default());
        assert_eq!(s.section, None);
        assert_eq!(sc.spread_of(0).unwrap().n, 3);
    }
}
