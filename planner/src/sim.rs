//! The discrete-event simulation of one run of the job.
//!
//! Two passes, so that a sweep over checkpoint intervals is cheap and every
//! interval sees the same failures (common random numbers: the differences
//! between intervals are not drowned in the noise between histories):
//!
//! 1. [`timeline`] draws one failure history: interruptions arrive as a
//!    Poisson process whose rate is the running node count over the node's
//!    MTBF (memoryless, so the next arrival is redrawn whenever the node
//!    count changes); each gets a class, crash or hang, and the recovery the
//!    strategy takes (in-process, in-job, hot-swap to a spare, with no spare
//!    free a node of the cluster's pool or a scale-down, or the scheduler's
//!    requeue), with its detection, restart and restore times. A spare
//!    taken is replaced: from the cluster's pool (the default) after the
//!    baseline's requeue and a cold start-up, the failed node being repaired
//!    outside the job; for an elastic job without a pool, or one
//!    allocation that cannot requeue a host (`spare_refill: repair`), by the
//!    failed node itself after the repair time, which also ends a
//!    scale-down (a planned restart).
//! 2. [`evaluate`] walks that history for one checkpoint interval, jumping
//!    from incident to incident: the time between two is split arithmetically
//!    into training and save stalls; a failure loses the training since the
//!    last completed save. Nothing is simulated step by step.
//!
//! Failures also strike during a recovery (the nodes are held): the
//! recovery starts over. The run is cut at the horizon; training not yet
//! saved at the end counts as done.

use std::collections::VecDeque;

use serde::Serialize;

use crate::rng::Rng;
use crate::scenario::{Recovery, Scenario, WithoutSpare};

/// Which recovery machinery the simulated job has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// warden with this many hot spare nodes.
    Warden {
        /// Spare nodes held beside the job.
        spares: u32,
    },
    /// The job exits and the scheduler requeues it, restoring from durable
    /// storage, for every interruption.
    Baseline,
}

/// One interruption (or planned restart) in a failure history.
#[derive(Debug, Clone, Copy)]
pub struct Incident {
    /// Seconds from the start of the run.
    pub t: f64,
    /// Seconds of detection, restart (with start-up and requeue) and restore.
    pub parts: [f64; 3],
    /// A checkpoint is saved before it (planned), so nothing is lost.
    pub planned: bool,
    /// Share of the job's nodes training after it (below 1 when scaled down).
    pub capacity_after: f64,
    /// Healed from a live replica: the training lost is at most this (the
    /// step in flight), not everything since the last save.
    pub redo_s: Option<f64>,
}

/// Where the job's accelerator time went, as fractions of the whole run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Training that was kept.
    pub productive: f64,
    /// Save stalls.
    pub save: f64,
    /// Training redone after a restore (lost progress).
    pub lost: f64,
    /// From the fault to the decision to recover.
    pub detection: f64,
    /// Restart, start-up and, for the baseline and a node of the cluster's
    /// pool, the scheduler's requeue.
    pub restart: f64,
    /// Reading the checkpoint back.
    pub restore: f64,
    /// Nodes of the job idle while it runs scaled down.
    pub scaled_down: f64,
}

impl Breakdown {
    /// Adds `other` times `w` (for means over repetitions).
    pub fn add_scaled(&mut self, other: &Self, w: f64) {
        self.productive += other.productive * w;
        self.save += other.save * w;
        self.lost += other.lost * w;
        self.detection += other.detection * w;
        self.restart += other.restart * w;
        self.restore += other.restore * w;
        self.scaled_down += other.scaled_down * w;
    }

    /// The sum of all parts (1 for a whole run).
    pub fn total(&self) -> f64 {
        self.productive
            + self.save
            + self.lost
            + self.detection
            + self.restart
            + self.restore
            + self.scaled_down
    }
}

/// Per-class recovery times, worked out once per scenario.
#[derive(Debug, Clone)]
pub struct Model {
    horizon: f64,
    node_mtbf_s: f64,
    nodes: u64,
    replica_nodes: u64,
    repair_s: f64,
    /// From a spare taken (after the fault's detection) to a new one
    /// standing by: the pool's requeue and a cold start-up, or the repair.
    refill_s: f64,
    /// What a node fault without a free spare does.
    without_spare: WithoutSpare,
    /// Cumulative class shares, normalised, for drawing a class.
    cumulative: Vec<f64>,
    classes: Vec<ClassModel>,
    /// A scale-up when a node returns (warden only).
    scale_up: [f64; 3],
    /// The save stall of each strategy.
    save_warden: f64,
    save_baseline: f64,
    /// One training step: what a healed fault redoes.
    step_s: f64,
    /// A lost node's shard from a peer's replica (a heal that cannot be had).
    node_restore_s: f64,
}

#[derive(Debug, Clone)]
struct ClassModel {
    hang_fraction: f64,
    recovery: Recovery,
    /// warden: [crash, hang] x [detection, restart, restore].
    warden: [[f64; 3]; 2],
    /// warden, the node replaced by a spare (healed when the heal across
    /// hosts is on).
    warden_node: [[f64; 3]; 2],
    /// warden, the job scaled down (no spare free): a round of another
    /// world size, which every host restarts in job (no heal).
    warden_scaled: [[f64; 3]; 2],
    /// warden, no spare free, a node from the cluster's pool joining the
    /// waiting round (no heal): the scheduler's part as the baseline's
    /// requeue, the new host's cold start-up, the round, its shard from a
    /// peer. The survivors' warm restart runs meanwhile.
    warden_pool: [[f64; 3]; 2],
    /// warden heals [crash, hang] from a live replica (no rollback).
    heals: [bool; 2],
    /// The baseline: [crash, hang] x parts.
    baseline: [[f64; 3]; 2],
}

/// The modelled restore times of one node's shard (local, peer) and of the
/// whole checkpoint from durable storage, seconds.
pub fn restore_times(s: &Scenario) -> (f64, f64, f64) {
    #[allow(clippy::cast_precision_loss)]
    let nodes = s.nodes() as f64;
    let c = &s.checkpoint;
    let shard = c.size_gib / nodes;
    let local = s.warden.restore_s.unwrap_or(shard / c.local_gibps);
    (local, shard / c.peer_gibps, c.size_gib / c.durable_gibps)
}

impl Model {
    /// Works out every class's recovery for both strategies.
    pub fn new(s: &Scenario) -> Self {
        let (local, peer, durable) = restore_times(s);
        let w = &s.warden;
        let hang_detect = (w.hang_multiplier * s.job.step_s).max(w.hang_floor_s) + w.tick_s;
        let detect = |hang: bool| match w.detection_s {
            Some(d) => d,
            None if hang => hang_detect,
            None => w.crash_detection_s,
        };
        let in_job = w
            .restart_downtime_s
            .unwrap_or(w.in_job_restart_s + w.warm_start_s);
        // `Scenario::validate` refuses a scenario whose round cannot be
        // had, so the fallback is never taken on a validated one.
        let round_s = s.round().map_or(0.0, |r| r.seconds);
        let b = &s.baseline;
        let requeue = b.requeue_s + s.job.startup_s;
        // A lost node's state lives in another data-parallel replica only
        // when the job has two or more.
        let replicas = s.nodes() / s.replica_nodes.max(1) >= 2;
        let heal_node = w
            .heal_s
            .filter(|_| w.heal_across_hosts && replicas)
            .map(|_| w.heal_node_s);
        // A rank's own crash: its state lives in the other ranks of its
        // data-parallel group; on one host the heal is `heal_s`, across
        // hosts it heals inside the round (`heal_across_hosts`).
        let heal_rank = match w.heal_s {
            Some(h) if s.nodes() <= 1 => Some(h),
            Some(_) if w.heal_across_hosts && replicas => Some(w.heal_rank_hosts_s),
            _ => None,
        };
        let total: f64 = s.classes.iter().map(|c| c.share).sum();
        let mut acc = 0.0;
        let cumulative = s
            .classes
            .iter()
            .map(|c| {
                acc += c.share / total;
                acc
            })
            .collect();
        let classes = s
            .classes
            .iter()
            .map(|c| {
                let per = |f: &dyn Fn(bool) -> [f64; 3]| [f(false), f(true)];
                let planned = c.recovery == Recovery::Planned;
                // What heals: a hang restarted in process keeps every
                // rank's live state (nothing to restore); a crashed rank of
                // an in-process class takes its state from a live replica
                // (`heal_rank`); a lost node's ranks take theirs from
                // another replica, when that is asked for
                // (`heal_across_hosts`). A network hang (every process
                // restarted in job) and a planned stop roll back as before.
                let heals = [
                    match c.recovery {
                        Recovery::InProcess => heal_rank.is_some(),
                        Recovery::ReplaceNode => heal_node.is_some(),
                        Recovery::InJob | Recovery::Planned => false,
                    },
                    match c.recovery {
                        Recovery::InProcess => w.heal_s.is_some(),
                        Recovery::ReplaceNode => heal_node.is_some(),
                        Recovery::InJob | Recovery::Planned => false,
                    },
                ];
                let node = |hang: bool| match heal_node {
                    Some(h) => [detect(hang), h + round_s, 0.0],
                    None => [detect(hang), in_job + round_s, peer],
                };
                ClassModel {
                    hang_fraction: c.hang_fraction,
                    recovery: c.recovery,
                    warden: per(&|hang| {
                        let d = if planned { 0.0 } else { detect(hang) };
                        match c.recovery {
                            // A hang (or a transient exception) comes back in
                            // the same processes; a crash has no process left
                            // to restart in: its launcher restarts it in job.
                            Recovery::InProcess if hang && w.heal_s.is_some() => {
                                [d, w.in_process_s, 0.0]
                            }
                            Recovery::InProcess if hang => [d, w.in_process_s, local],
                            Recovery::InProcess => match heal_rank {
                                Some(h) => [d, h, 0.0],
                                None => [d, in_job, local],
                            },
                            Recovery::InJob | Recovery::Planned => [d, in_job, local],
                            Recovery::ReplaceNode => node(hang),
                        }
                    }),
                    warden_node: per(&node),
                    warden_scaled: per(&|hang| [detect(hang), in_job + round_s, peer]),
                    warden_pool: per(&|hang| [detect(hang), requeue.max(in_job) + round_s, peer]),
                    heals,
                    baseline: per(&|hang| {
                        let d = match (planned, hang) {
                            (true, _) => 0.0,
                            (false, true) => b.hang_detection_s,
                            (false, false) => b.crash_detection_s,
                        };
                        [d, requeue, durable]
                    }),
                }
            })
            .collect();
        Self {
            horizon: s.horizon_s(),
            node_mtbf_s: s.node_mtbf_hours * 3600.0,
            nodes: s.nodes(),
            replica_nodes: s.replica_nodes,
            repair_s: s.repair_hours * 3600.0,
            // The failed host's launcher, requeued on a free node (exit 86:
            // requeue elsewhere), joins the full round as a standby: the
            // same scheduler's part and cold start-up as a pool node's.
            refill_s: if s.uses_repair() {
                s.repair_hours * 3600.0
            } else {
                requeue
            },
            without_spare: s.without_spare,
            cumulative,
            classes,
            scale_up: [0.0, in_job + round_s, peer],
            save_warden: s.save_stall_s(),
            save_baseline: s.baseline_save_stall_s(),
            step_s: s.job.step_s,
            node_restore_s: peer,
        }
    }

    /// Seconds simulated.
    pub fn horizon(&self) -> f64 {
        self.horizon
    }

    /// The save stall `strategy` pays.
    pub fn save_stall(&self, strategy: Strategy) -> f64 {
        match strategy {
            Strategy::Warden { .. } => self.save_warden,
            Strategy::Baseline => self.save_baseline,
        }
    }

    /// Mean recovery downtime per interruption (detection + restart +
    /// restore, weighted by class share and hang fraction) and the share of
    /// interruptions that lose progress, for the closed form.
    pub fn mean_recovery(&self, strategy: Strategy) -> (f64, f64) {
        let mut downtime = 0.0;
        let mut unplanned = 0.0;
        let mut prev = 0.0;
        for (c, &cum) in self.classes.iter().zip(&self.cumulative) {
            let share = cum - prev;
            prev = cum;
            // With no spare held, every node fault of the pool's kind
            // waits for a node of the cluster's pool, which heals nothing
            // (as in `timeline`); with spares, the closed form takes the
            // spare as free.
            let (parts, heals) = match strategy {
                Strategy::Warden { spares: 0 }
                    if c.recovery == Recovery::ReplaceNode
                        && self.without_spare == WithoutSpare::Pool =>
                {
                    (&c.warden_pool, [false, false])
                }
                Strategy::Warden { .. } => (&c.warden, c.heals),
                Strategy::Baseline => (&c.baseline, [false, false]),
            };
            let sum = |p: &[f64; 3]| p.iter().sum::<f64>();
            downtime += share
                * ((1.0 - c.hang_fraction) * sum(&parts[0]) + c.hang_fraction * sum(&parts[1]));
            if c.recovery != Recovery::Planned {
                // A healed interruption loses one step, not the interval.
                let healed = (1.0 - c.hang_fraction) * f64::from(u8::from(heals[0]))
                    + c.hang_fraction * f64::from(u8::from(heals[1]));
                unplanned += share * (1.0 - healed);
            }
        }
        (downtime, unplanned)
    }

    /// The job's mean time between interruptions at full size, seconds.
    pub fn job_mtbf(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let nodes = self.nodes as f64;
        self.node_mtbf_s / nodes
    }
}

/// Draws one failure history for `strategy` into `out` (cleared first).
pub fn timeline(model: &Model, strategy: Strategy, rng: &mut Rng, out: &mut Vec<Incident>) {
    out.clear();
    let spares_held = match strategy {
        Strategy::Warden { spares } => spares,
        Strategy::Baseline => 0,
    };
    let nodes = model.nodes;
    #[allow(clippy::cast_precision_loss)]
    let capacity = |active: u64| active as f64 / nodes as f64;
    let mut t = 0.0;
    let mut active = nodes;
    let mut spares_free = spares_held;
    // Nodes coming back (a spare refilled, a node repaired), by return time
    // (a refill counts from the fault's detection, which differs by class).
    let mut returns: VecDeque<f64> = VecDeque::new();
    let back_at = |returns: &mut VecDeque<f64>, at: f64| {
        let i = returns.partition_point(|&r| r <= at);
        returns.insert(i, at);
    };
    loop {
        #[allow(clippy::cast_precision_loss)]
        let next_fail = t + rng.exponential(model.node_mtbf_s / active as f64);
        if let Some(&back) = returns.front()
            && back <= next_fail
        {
            if back >= model.horizon {
                break;
            }
            t = back;
            returns.pop_front();
            if active < nodes {
                active += model.replica_nodes;
                out.push(Incident {
                    t,
                    parts: model.scale_up,
                    planned: true,
                    capacity_after: capacity(active),
                    redo_s: None,
                });
            } else {
                spares_free += 1;
            }
            // The arrival drawn above is dropped: the process is memoryless
            // and its rate may have changed.
            continue;
        }
        if next_fail >= model.horizon {
            break;
        }
        t = next_fail;
        let u = rng.uniform();
        let k = model
            .cumulative
            .iter()
            .position(|&c| u < c)
            .unwrap_or(model.classes.len() - 1);
        let class = &model.classes[k];
        let hang = usize::from(rng.uniform() < class.hang_fraction);
        let planned = class.recovery == Recovery::Planned;
        let mut healed = matches!(strategy, Strategy::Warden { .. }) && class.heals[hang];
        let parts = match strategy {
            Strategy::Baseline => class.baseline[hang],
            Strategy::Warden { .. } if class.recovery == Recovery::ReplaceNode => {
                if spares_free > 0 {
                    spares_free -= 1;
                    let p = class.warden_node[hang];
                    back_at(&mut returns, t + p[0] + model.refill_s);
                    p
                } else if model.without_spare == WithoutSpare::Pool {
                    // A node of the cluster's pool takes its place; the
                    // failed one is repaired outside the job and does not
                    // come back to it.
                    healed = false;
                    class.warden_pool[hang]
                } else if active > model.replica_nodes {
                    // The survivors heal into a round of the same world
                    // size only: scaled down, every host restarts in job
                    // until the node is back.
                    back_at(&mut returns, t + model.repair_s);
                    active -= model.replica_nodes;
                    healed = false;
                    class.warden_scaled[hang]
                } else {
                    // One replica left: nothing to scale down to; the job
                    // waits for the node to come back, and no other replica
                    // holds the state: it comes from the tier.
                    let mut p = class.warden_node[hang];
                    p[1] += model.repair_s;
                    if healed {
                        healed = false;
                        p[2] = model.node_restore_s;
                    }
                    p
                }
            }
            Strategy::Warden { .. } => class.warden[hang],
        };
        out.push(Incident {
            t,
            parts,
            planned,
            capacity_after: capacity(active),
            redo_s: healed.then_some(model.step_s),
        });
    }
}

/// Walks a history for one checkpoint interval (seconds of training between
/// saves) and a save stall: where the run's time went.
pub fn evaluate(incidents: &[Incident], horizon: f64, interval: f64, save: f64) -> Breakdown {
    let period = interval + save;
    let mut acc = Breakdown::default();
    // `loses`: None, nothing (a planned stop, the run's end); Some(None),
    // everything since the last save; Some(Some(x)), at most x (healed).
    let run = |acc: &mut Breakdown, d: f64, capacity: f64, loses: Option<Option<f64>>| {
        let full = (d / period).floor();
        let rem = d - full * period;
        let work = full * interval + rem.min(interval);
        let saving = full * save + (rem - interval).max(0.0);
        let lost = match loses {
            None => 0.0,
            Some(None) => rem.min(interval),
            Some(Some(redo)) => rem.min(interval).min(redo),
        };
        acc.productive += (work - lost) * capacity;
        acc.lost += lost * capacity;
        acc.save += saving * capacity;
        acc.scaled_down += d * (1.0 - capacity);
    };
    // Charges a recovery's parts in order, cut after `elapsed` seconds.
    let charge = |acc: &mut Breakdown, parts: &[f64; 4], elapsed: f64| {
        let mut left = elapsed;
        let slots = [
            &mut acc.save,
            &mut acc.detection,
            &mut acc.restart,
            &mut acc.restore,
        ];
        for (slot, &p) in slots.into_iter().zip(parts) {
            let take = p.min(left);
            *slot += take;
            left -= take;
        }
    };
    let mut up_at = 0.0;
    let mut capacity = 1.0;
    // The recovery under way: its start and [pre-save, detection, restart, restore].
    let mut pending: Option<(f64, [f64; 4])> = None;
    for inc in incidents {
        if inc.t >= up_at {
            if let Some((_, parts)) = pending.take() {
                charge(&mut acc, &parts, f64::INFINITY);
            }
            let loses = (!inc.planned).then_some(inc.redo_s);
            run(&mut acc, inc.t - up_at, capacity, loses);
        } else if let Some((start, parts)) = pending.take() {
            // A failure during the recovery: it starts over.
            charge(&mut acc, &parts, inc.t - start);
        }
        let pre_save = if inc.planned && inc.t >= up_at {
            save
        } else {
            0.0
        };
        let parts = [pre_save, inc.parts[0], inc.parts[1], inc.parts[2]];
        up_at = inc.t + parts.iter().sum::<f64>();
        pending = Some((inc.t, parts));
        capacity = inc.capacity_after;
    }
    if horizon >= up_at {
        if let Some((_, parts)) = pending.take() {
            charge(&mut acc, &parts, f64::INFINITY);
        }
        run(&mut acc, horizon - up_at, capacity, None);
    } else if let Some((start, parts)) = pending.take() {
        charge(&mut acc, &parts, horizon - start);
    }
    let scale = 1.0 / horizon;
    let mut out = Breakdown::default();
    out.add_scaled(&acc, scale);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::SpareRefill;

    fn incident(t: f64, parts: [f64; 3], planned: bool) -> Incident {
        Incident {
            redo_s: None,
            t,
            parts,
            planned,
            capacity_after: 1.0,
        }
    }

    #[test]
    fn no_failures_pays_only_saves() {
        let b = evaluate(&[], 1100.0, 100.0, 10.0);
        // 10 periods of 110 s: 1000 s of training, 100 s of saves.
        assert!((b.productive - 1000.0 / 1100.0).abs() < 1e-12, "{b:?}");
        assert!((b.save - 100.0 / 1100.0).abs() < 1e-12, "{b:?}");
        assert!((b.total() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_healed_failure_loses_the_step_in_flight_only() {
        // The same failure as below, healed: 2 s steps, one redone.
        let mut healed = incident(160.0, [1.0, 0.3, 0.0], false);
        healed.redo_s = Some(2.0);
        let b = evaluate(&[healed], 1000.0, 100.0, 10.0);
        assert!((b.lost * 1000.0 - 2.0).abs() < 1e-9, "{b:?}");
        assert_eq!(b.restore, 0.0);
        assert!((b.total() - 1.0).abs() < 1e-12, "{b:?}");
    }

    #[test]
    fn heal_scopes_what_rolls_back_at_the_llama3_preset() {
        use crate::scenario::Scenario;
        // With spares: the closed form takes one as free for a node fault
        // (with none, a node of the cluster's pool joins and heals nothing).
        let lossy = |s: &Scenario| {
            Model::new(s)
                .mean_recovery(Strategy::Warden { spares: 8 })
                .1
        };
        let today = Scenario::default();
        let mut heal = today.clone();
        heal.warden.heal_s = Some(0.27);
        let mut across = heal.clone();
        across.warden.heal_across_hosts = true;
        let (a, b, c) = (lossy(&today), lossy(&heal), lossy(&across));
        // One host's heal in a job of many hosts: only the software hangs
        // (12% of 63, 7.6 of 466) stop rolling back; across hosts the
        // software crashes (55) and the GPU and host losses (321) do too.
        assert!(b < a && a - b < 0.02, "{a} {b}");
        assert!(c < 0.3 && c < b, "{c}");
        // A job of one replica has no replica to heal a lost node from.
        let mut one = across.clone();
        one.replica_nodes = one.nodes();
        assert!((lossy(&one) - b).abs() < 1e-12, "{} {b}", lossy(&one));
        // No spare held: a node of the pool joins, and the lost nodes roll
        // back, as `timeline` has them.
        let pool = Model::new(&across)
            .mean_recovery(Strategy::Warden { spares: 0 })
            .1;
        assert!(pool > c + 0.6, "{pool} {c}");
    }

    #[test]
    fn a_failure_loses_training_since_the_last_save() {
        // Fails 50 s into the second period: 50 s lost; down 1+2+3 s.
        let b = evaluate(
            &[incident(160.0, [1.0, 2.0, 3.0], false)],
            1000.0,
            100.0,
            10.0,
        );
        assert!((b.lost * 1000.0 - 50.0).abs() < 1e-9, "{b:?}");
        assert!((b.detection * 1000.0 - 1.0).abs() < 1e-9);
        assert!((b.restart * 1000.0 - 2.0).abs() < 1e-9);
        assert!((b.restore * 1000.0 - 3.0).abs() < 1e-9);
        assert!((b.total() - 1.0).abs() < 1e-12, "{b:?}");
        // A planned restart at the same moment saves first: nothing lost.
        let p = evaluate(
            &[incident(160.0, [0.0, 2.0, 3.0], true)],
            1000.0,
            100.0,
            10.0,
        );
        assert_eq!(p.lost, 0.0);
        assert!((p.total() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_failure_during_recovery_restarts_it_and_parts_still_sum() {
        let incs = [
            incident(50.0, [10.0, 10.0, 10.0], false),
            incident(65.0, [10.0, 10.0, 10.0], false),
        ];
        let b = evaluate(&incs, 200.0, 100.0, 10.0);
        // First recovery cut after 15 s (10 detection + 5 restart), second whole.
        assert!((b.detection * 200.0 - 20.0).abs() < 1e-9, "{b:?}");
        assert!((b.restart * 200.0 - 15.0).abs() < 1e-9, "{b:?}");
        assert!((b.lost * 200.0 - 50.0).abs() < 1e-9, "{b:?}");
        assert!((b.total() - 1.0).abs() < 1e-12, "{b:?}");
    }

    /// 8 nodes failing every 100 node-hours for 10 days, repaired in two,
    /// node faults only.
    fn node_faults(without_spare: WithoutSpare) -> Scenario {
        let mut s = Scenario {
            gpus: 64,
            gpus_per_node: 8,
            node_mtbf_hours: 100.0,
            days: 10.0,
            repair_hours: 48.0,
            without_spare,
            ..Scenario::default()
        };
        s.classes.retain(|c| c.recovery == Recovery::ReplaceNode);
        s
    }

    /// warden's history of one repetition (the same seed each time).
    fn history(m: &Model, spares: u32) -> Vec<Incident> {
        let mut out = Vec::new();
        timeline(
            m,
            Strategy::Warden { spares },
            &mut Rng::for_rep(3, 0),
            &mut out,
        );
        out
    }

    #[test]
    fn spares_turn_scale_down_into_hot_swap() {
        let m = Model::new(&node_faults(WithoutSpare::ScaleDown));
        let out = history(&m, 0);
        assert!(out.iter().any(|i| i.capacity_after < 1.0), "no scale-down");
        let out = history(&m, 64);
        assert!(
            out.iter().all(|i| i.capacity_after == 1.0),
            "spares ran out"
        );
    }

    /// Without a free spare, the default takes a node from the cluster's
    /// pool, as the baseline's requeue does: the job never runs short, and
    /// each such fault pays the scheduler's requeue and a cold start-up on
    /// top of the round; a spare, when free, is faster.
    #[test]
    fn without_a_spare_a_pool_node_joins_at_the_requeues_cost() {
        let mut s = node_faults(WithoutSpare::Pool);
        s.baseline.requeue_s = 40.0;
        s.job.startup_s = 20.0;
        let m = Model::new(&s);
        let out = history(&m, 0);
        assert!(out.len() > 3, "{out:?}");
        assert!(out.iter().all(|i| i.capacity_after == 1.0), "{out:?}");
        assert!(out.iter().all(|i| i.parts[1] >= 60.0), "{out:?}");
        let out = history(&m, 64);
        assert!(out.iter().all(|i| i.parts[1] < 60.0), "{out:?}");
    }

    /// With the pool, a spare taken is refilled at the pool's cost (the
    /// failed host's launcher requeued on a free node), so one spare covers
    /// faults a repair time apart, and the repair time moves nothing; for
    /// an elastic job without a pool it still sets when a spare is back.
    #[test]
    fn with_the_pool_a_spare_is_refilled_at_the_requeues_cost_not_the_repair() {
        let mut s = node_faults(WithoutSpare::Pool);
        s.baseline.requeue_s = 40.0;
        s.job.startup_s = 20.0;
        let swaps = |out: &[Incident]| out.iter().filter(|i| i.parts[1] < 60.0).count();
        // Spare swaps alone: at full size after it, and no scale-up.
        let swapped = |out: &[Incident]| {
            out.iter()
                .filter(|i| !i.planned && i.capacity_after == 1.0)
                .count()
        };
        let one_spare = history(&Model::new(&s), 1);
        // About 19 faults in 10 days, 12.5 h apart on average: a refill in
        // 60 s leaves the spare free for every one but a near coincidence.
        assert!(one_spare.len() > 3, "{one_spare:?}");
        assert!(swaps(&one_spare) + 1 >= one_spare.len(), "{one_spare:?}");
        for hours in [1.0, 1000.0] {
            s.repair_hours = hours;
            let again = history(&Model::new(&s), 1);
            assert_eq!(again.len(), one_spare.len(), "repair {hours} h");
            assert!(
                again
                    .iter()
                    .zip(&one_spare)
                    .all(|(a, b)| a.t == b.t && a.parts == b.parts),
                "repair {hours} h moved the pool's history"
            );
        }
        // Without the pool, or with the pool but spares back from repair
        // (one multi-node allocation), the one spare is back only after the
        // 48 h repair: most faults find none.
        let mut e = node_faults(WithoutSpare::ScaleDown);
        e.baseline.requeue_s = 40.0;
        e.job.startup_s = 20.0;
        let elastic = history(&Model::new(&e), 1);
        assert!(
            swapped(&elastic) * 2 < swapped(&one_spare),
            "{} swaps against {}: {elastic:?}",
            swapped(&elastic),
            swapped(&one_spare)
        );
        s.spare_refill = SpareRefill::Repair;
        s.repair_hours = 48.0;
        let repaired = history(&Model::new(&s), 1);
        assert!(
            swaps(&repaired) * 2 < swaps(&one_spare),
            "{} swaps against {}: {repaired:?}",
            swaps(&repaired),
            swaps(&one_spare)
        );
    }
}
