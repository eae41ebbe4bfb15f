//! A simulated synchronous job, to check the detector's thresholds against
//! the benchmark's criteria (docs/benchmarks.md): the unit tests run it
//! small, `cargo bench --bench stragglers` runs it at full size.
//!
//! Every rank runs `forward`, `backward` and `optimizer` (compute) and then
//! waits in `allreduce` for the slowest rank of the step, as a synchronous
//! job does; so the step time is the same for every rank and only the
//! compute sections tell the slow one. Each compute section's duration is
//! its base times a factor drawn per rank, step and section (`PerSection`)
//! or per rank and step (`PerStep`: the sections of a step move together),
//! normal with mean 1 and sd `jitter`. Seeded: a run is reproducible.
//!
//! The scoring path is the agent's: [`RankSamples`] fed per step, window
//! medians, [`Scorer`], [`RankTrack`] hysteresis.

use super::config::StragglerConfig;
use super::samples::RankSamples;
use super::score::{
    Classifier, JobRank, MAX_SECTIONS, Params, RankTrack, Scorer, SectionKinds, SectionMedian,
    Transition, window_medians,
};

/// Compute sections and their base durations (ns): 100 ms of compute.
pub const SECTIONS: [(&str, f64); 3] = [("forward", 40e6), ("backward", 50e6), ("optimizer", 10e6)];

/// How jitter is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// One factor per rank, step and section.
    PerSection,
    /// One factor per rank and step, for all its sections.
    PerStep,
}

/// A small, fast, seeded PRNG (xorshift64*), with normal draws
/// (Box-Muller). Test and benchmark use only: no dependency for it.
#[derive(Debug, Clone)]
pub struct SimRng {
    state: u64,
    spare: Option<f64>,
}

impl SimRng {
    /// A generator from `seed` (0 is replaced: xorshift needs a set bit).
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            spare: None,
        }
    }

    /// Uniform in [0, 2^64).
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u, v) = (self.uniform(), self.uniform());
        let r = (-2.0 * u.ln()).sqrt();
        let t = std::f64::consts::TAU * v;
        self.spare = Some(r * t.sin());
        r * t.cos()
    }
}

/// One simulated job, scored the way the agent scores a host's ranks.
#[derive(Debug)]
pub struct SimJob {
    params: Params,
    classifier: Classifier,
    stride: u64,
    jitter: f64,
    model: Jitter,
    rng: SimRng,
    samples: Vec<RankSamples>,
    kinds: Vec<SectionKinds>,
    tracks: Vec<RankTrack>,
    /// Per-rank slowdown factor (1.0: normal).
    pub slow: Vec<f64>,
    scorer: Scorer,
    names: Vec<String>,
    medians: Vec<SectionMedian>,
    job: Vec<JobRank>,
    compute: Vec<f64>,
    /// Steps run.
    pub step: u64,
    /// Windows in which a rank was over the thresholds (rank-windows).
    pub over_windows: u64,
}

/// A flag change seen by [`SimJob::score`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlagChange {
    /// The rank.
    pub rank: u32,
    /// Flagged (true) or cleared.
    pub flagged: bool,
    /// The step at which it happened.
    pub step: u64,
}

impl SimJob {
    /// `ranks` ranks under `cfg`, with `jitter` (0.03: 3%) drawn by `model`.
    pub fn new(cfg: &StragglerConfig, ranks: usize, jitter: f64, model: Jitter, seed: u64) -> Self {
        Self {
            params: Params::from(cfg),
            classifier: Classifier::new(cfg),
            stride: cfg.stride_steps as u64,
            jitter,
            model,
            rng: SimRng::new(seed),
            samples: vec![RankSamples::default(); ranks],
            kinds: vec![SectionKinds::default(); ranks],
            tracks: vec![RankTrack::default(); ranks],
            slow: vec![1.0; ranks],
            scorer: Scorer::default(),
            names: SECTIONS.iter().map(|(n, _)| (*n).to_owned()).collect(),
            medians: Vec::new(),
            job: Vec::with_capacity(ranks),
            compute: vec![0.0; ranks],
            step: 0,
            over_windows: 0,
        }
    }

    /// Runs one step of every rank (compute, then the all-reduce wait).
    pub fn run_step(&mut self) {
        let n = self.samples.len();
        let mut slowest = 0.0f64;
        let mut per_rank: Vec<[u64; 3]> = Vec::with_capacity(n);
        for r in 0..n {
            let common = self.rng.normal();
            let mut total = 0.0;
            let mut sec = [0u64; 3];
            for (i, (_, base)) in SECTIONS.iter().enumerate() {
                let z = match self.model {
                    Jitter::PerSection => self.rng.normal(),
                    Jitter::PerStep => common,
                };
                let d = (base * self.slow[r] * (1.0 + self.jitter * z)).max(1.0);
                sec[i] = d as u64;
                total += d;
            }
            self.compute[r] = total;
            slowest = slowest.max(total);
            per_rank.push(sec);
        }
        let comm = 5e6;
        for (r, s) in per_rank.iter().enumerate() {
            let wait = (slowest - self.compute[r] + comm) as u64;
            let step = self.compute[r] as u64 + wait;
            self.samples[r].push_step(
                step,
                [
                    (SECTIONS[0].0, s[0]),
                    (SECTIONS[1].0, s[1]),
                    (SECTIONS[2].0, s[2]),
                    ("allreduce", wait),
                ],
            );
        }
        self.step += 1;
    }

    /// Whether a window is due (every `stride_steps` steps).
    pub fn due(&self) -> bool {
        self.step > 0 && self.step.is_multiple_of(self.stride)
    }

    /// Scores one window of every rank; returns the flag changes.
    pub fn score(&mut self, changes: &mut Vec<FlagChange>) {
        self.job.clear();
        for (r, s) in self.samples.iter().enumerate() {
            window_medians(
                s,
                &self.classifier,
                &mut self.kinds[r],
                self.params.window,
                &mut self.medians,
            );
            let mut jr = JobRank::new(r as u32);
            for m in &self.medians {
                if let Some(i) = self.names.iter().position(|n| *n == m.section)
                    && i < MAX_SECTIONS
                {
                    jr.median_ns[i] = m.median_ns;
                    jr.samples[i] = m.samples;
                }
            }
            self.job.push(jr);
        }
        self.scorer
            .prepare(&self.params, self.names.len(), &self.job);
        for (r, jr) in self.job.iter().enumerate() {
            let t = &mut self.tracks[r];
            let s = self.scorer.judge_rank(&self.params, &self.names, jr, t);
            if s.section.is_none() {
                continue;
            }
            if s.verdict.over {
                self.over_windows += 1;
            }
            match t.hysteresis.update(
                s.verdict.over,
                self.params.flag_after,
                self.params.clear_after,
            ) {
                Transition::Flagged => changes.push(FlagChange {
                    rank: jr.rank,
                    flagged: true,
                    step: self.step,
                }),
                Transition::Cleared => changes.push(FlagChange {
                    rank: jr.rank,
                    flagged: false,
                    step: self.step,
                }),
                Transition::None => {}
            }
        }
    }

    /// Runs `steps` steps, scoring when due; returns the flag changes.
    pub fn run(&mut self, steps: u64) -> Vec<FlagChange> {
        let mut changes = Vec::new();
        for _ in 0..steps {
            self.run_step();
            if self.due() {
                self.score(&mut changes);
            }
        }
        changes
    }

    /// Runs until `rank` is flagged or `limit` steps pass; returns the step
    /// count from now at which it was flagged.
    pub fn steps_to_flag(&mut self, rank: u32, limit: u64) -> Option<u64> {
        let start = self.step;
        let mut changes = Vec::new();
        while self.step - start < limit {
            self.run_step();
            if self.due() {
                changes.clear();
                self.score(&mut changes);
                if changes.iter().any(|c| c.rank == rank && c.flagged) {
                    return Some(self.step - start);
                }
            }
        }
        None
    }

    /// The rank samples (the bench copies them for its baseline).
    pub fn samples(&self) -> &[RankSamples] {
        &self.samples
    }
}
