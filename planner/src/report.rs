//! The plan for people (a table) and for scripts (JSON).

use std::fmt::Write;

use serde_json::Value;

use crate::sweep::{Plan, Series};

/// Formats a count with thousands separators.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Seconds in the unit that reads best.
/// GiB as MiB below one.
fn bytes_gib(g: f64) -> String {
    if g >= 1.0 {
        format!("{g:.1} GiB")
    } else {
        format!("{:.0} MiB", g * 1024.0)
    }
}

fn duration(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 7200.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.2} h", s / 3600.0)
    }
}

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

/// Whether input `a` is still its default `d` (to the float's precision):
/// a default is labelled with its source, a changed input as given.
fn same(a: f64, d: f64) -> bool {
    (a - d).abs() <= f64::EPSILON * d.abs().max(1.0)
}

/// Which of the model's times are warden's measured figures and which are
/// assumptions (docs/goodput.md names the source of each default): a plan
/// is only as good as its inputs, and the reader should know which to
/// replace with their own.
fn inputs_line(s: &crate::scenario::Scenario) -> String {
    use crate::scenario::{Checkpoint, JobTimes, WardenTimes};
    let (w, dw) = (&s.warden, WardenTimes::default());
    let (j, dj) = (&s.job, JobTimes::default());
    let (c, dc) = (&s.checkpoint, Checkpoint::default());
    let item = |name: &str, v: f64, default: f64, by_default: &str| {
        let whose = if same(v, default) {
            by_default
        } else {
            "given"
        };
        format!("{name} {} ({whose})", duration(v))
    };
    let measured = [
        item(
            "crash detection",
            w.crash_detection_s,
            dw.crash_detection_s,
            "measured",
        ),
        item(
            "in-job restart",
            w.in_job_restart_s,
            dw.in_job_restart_s,
            "measured",
        ),
        item(
            "in-process restart",
            w.in_process_s,
            dw.in_process_s,
            "measured",
        ),
        item(
            "warm start-up",
            w.warm_start_s,
            dw.warm_start_s,
            "measured: standby + compile cache, small compiled model, CPU",
        ),
        item(
            "cold start-up",
            j.startup_s,
            dj.startup_s,
            "measured: new process, no cache, small compiled model, CPU; the requeue's",
        ),
        round_item(s),
    ];
    #[allow(clippy::cast_precision_loss)]
    let gpus = s.gpus.max(1) as f64;
    let stall = match c.save_stall_s {
        Some(v) => format!("save stall {} (given)", duration(v)),
        None => format!(
            "save stall {} ({} per GPU at {} GiB/s, {})",
            duration(s.save_stall_s()),
            bytes_gib(c.size_gib / gpus),
            c.stall_gibps,
            if same(c.stall_gibps, dc.stall_gibps) {
                "measured: the async save's copy on an H100"
            } else {
                "given"
            },
        ),
    };
    let assumed = [item("step", j.step_s, dj.step_s, "assumed"), stall];
    format!(
        "inputs: {}; {} (docs/goodput.md: replace the assumed with yours, or --from-ledger)",
        measured.join(", "),
        assumed.join(", ")
    )
}

/// A throughput as the plan prints it: whole GiB/s from 100 up (the
/// default store's 2 TB/s is 1862.6...), as given below that (0.4 stays 0.4).
fn gibps(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The model's other inputs, each with what it rests on: the paper's counts,
/// a measurement here, a configuration default, or an assumption no bench
/// has measured. Why: a plan that labels its recovery times but not the
/// failure mix, the durable store's speed or the baseline's requeue reads
/// as if every figure were measured; these are the ones to replace first.
fn other_inputs_line(s: &crate::scenario::Scenario) -> String {
    use crate::scenario::{Baseline, Checkpoint, Scenario, WardenTimes, llama3_classes};
    let (c, dc) = (&s.checkpoint, Checkpoint::default());
    let (b, db) = (&s.baseline, Baseline::default());
    let (w, dw) = (&s.warden, WardenTimes::default());
    let ds = Scenario::default();
    let label = |a: f64, d: f64, by_default: &'static str| {
        if same(a, d) { by_default } else { "given" }
    };
    let classes_default = s.classes == llama3_classes();
    let rate = if classes_default && same(s.node_mtbf_hours, ds.node_mtbf_hours) {
        "Llama 3's 466 interruptions in 54 days and their causes"
    } else if classes_default {
        "rate given; Llama 3's causes"
    } else {
        "given"
    };
    let hangs: Vec<String> = s
        .classes
        .iter()
        .map(|k| format!("{} {:.1}%", k.name, k.hang_fraction * 100.0))
        .collect();
    let hang_source = if classes_default {
        "published: ByteRobust's 5,506 hangs among 45,783 failures, its Table 1; one share for every unplanned cause, since no record splits hangs by cause"
    } else {
        "given"
    };
    let items = [
        format!("failure rate and mix ({rate})"),
        format!("hang fractions {} ({hang_source})", hangs.join(", ")),
        format!(
            "hang threshold {}x the p99 step, at least {} ({})",
            w.hang_multiplier,
            duration(w.hang_floor_s),
            if same(w.hang_multiplier, dw.hang_multiplier) && same(w.hang_floor_s, dw.hang_floor_s)
            {
                "the agent's defaults"
            } else {
                "given"
            }
        ),
        format!(
            "without a free spare {} ({})",
            without_spare_words(s.without_spare),
            if s.without_spare == ds.without_spare {
                "a fixed-size job; the baseline's requeue takes its node from the same pool"
            } else {
                "given: an elastic job"
            }
        ),
        if s.uses_repair() {
            format!(
                "repair {} ({}: {})",
                duration(s.repair_hours * 3600.0),
                label(s.repair_hours, ds.repair_hours, "assumed"),
                if s.without_spare == crate::scenario::WithoutSpare::ScaleDown {
                    "it ends a scale-down and refills a spare"
                } else {
                    "it refills a spare, --spare-refill repair"
                }
            )
        } else {
            // The repair never reaches the job: the failed host's launcher
            // is requeued on a free node (exit 86) and stands by.
            format!(
                "a spare taken is refilled {} after the fault's detection (the failed host's launcher requeued on a node of the pool: the requeue and a cold start-up, as a pool node; needs one scheduler job per host with the job's --rdzv-id, else --spare-refill repair; the repair is outside the job)",
                duration(s.baseline.requeue_s + s.job.startup_s),
            )
        },
        format!(
            "restore read local {} GiB/s and peer {} GiB/s ({}), durable {} GiB/s for the job ({})",
            c.local_gibps,
            c.peer_gibps,
            if same(c.local_gibps, dc.local_gibps) && same(c.peer_gibps, dc.peer_gibps) {
                "measured: tmpfs tier and loopback, two cores"
            } else {
                "given"
            },
            gibps(c.durable_gibps),
            label(
                c.durable_gibps,
                dc.durable_gibps,
                "published: Llama 3's store, 2 TB/s sustained, its section 3.3.1; a store's throughput, not a measured restore"
            ),
        ),
        format!(
            "baseline crash to teardown {} ({}), hang {} ({}), requeue {} ({})",
            duration(b.crash_detection_s),
            label(
                b.crash_detection_s,
                db.crash_detection_s,
                "measured: torchrun --max-restarts 0 on 2 nodes under srun --kill-on-bad-exit, one-node Slurm; a floor for more nodes"
            ),
            duration(b.hang_detection_s),
            label(
                b.hang_detection_s,
                db.hang_detection_s,
                "NCCL's default timeout: a setting, not a measurement"
            ),
            duration(b.requeue_s),
            label(
                b.requeue_s,
                db.requeue_s,
                "measured: a failed job's afternotok successor starting, one-node Slurm; a floor, and Slurm's own requeue took 2.9 min there, held until its credentials expire"
            ),
        ),
    ];
    format!("other inputs: {}", items.join("; "))
}

/// The restart round across hosts: given, or the fleet bench's figure at
/// the job's node count with what it rests on (measured there,
/// interpolated or extrapolated on the fitted curve).
fn round_item(s: &crate::scenario::Scenario) -> String {
    match s.round() {
        Ok(r) => match r.fleet {
            Some(f) => format!("round {} ({})", duration(r.seconds), f.label()),
            None => format!("round {} (given)", duration(r.seconds)),
        },
        Err(e) => format!("round unknown ({e})"),
    }
}

/// The plan as a readable report.
pub fn table(plan: &Plan) -> String {
    let s = &plan.scenario;
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        "goodput plan: {} GPUs ({} nodes x {}), {} days, {} repetitions, seed {}",
        thousands(s.gpus),
        thousands(plan.nodes),
        s.gpus_per_node,
        s.days,
        s.sweep.reps,
        s.sweep.seed
    );
    let total: f64 = s.classes.iter().map(|c| c.share).sum();
    let classes: Vec<String> = s
        .classes
        .iter()
        .map(|c| format!("{} {:.0}%", c.name, c.share / total * 100.0))
        .collect();
    let _ = writeln!(
        out,
        "failures: node MTBF {:.0} h -> one interruption every {} ({:.0} expected); {}",
        s.node_mtbf_hours,
        duration(plan.job_mtbf_s),
        plan.interruptions_expected,
        classes.join(", ")
    );
    let _ = writeln!(
        out,
        "checkpoint: {:.0} GiB; restore per node from local {}, from a peer {}; whole from durable {}",
        s.checkpoint.size_gib,
        duration(plan.restore_local_s),
        duration(plan.restore_peer_s),
        duration(plan.restore_durable_s)
    );
    let _ = writeln!(out, "{}", inputs_line(s));
    let _ = writeln!(out, "{}", other_inputs_line(s));
    if let Some(l) = &plan.ledger {
        let applied: Vec<String> = l.applied.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(
            out,
            "from the ledger: {} (over {} restarts, {} saves)",
            if applied.is_empty() {
                "nothing".to_owned()
            } else {
                applied.join(", ")
            },
            l.restarts.map_or("?".into(), |n| n.to_string()),
            l.saves.map_or("?".into(), |n| n.to_string())
        );
    }
    let _ = writeln!(out);
    let (w, b) = (&plan.warden, &plan.baseline);
    let row = |out: &mut String, label: &str, f: &dyn Fn(&Series) -> String| {
        let _ = writeln!(out, "{label:<34}{:>20}{:>22}", f(w), f(b));
    };
    let _ = writeln!(
        out,
        "{:<34}{:>20}{:>22}",
        "",
        if s.spares > 0 {
            format!("warden ({} spares)", s.spares)
        } else {
            "warden".to_owned()
        },
        "scheduler requeue"
    );
    row(&mut out, "best checkpoint interval", &|x| {
        duration(x.optimum.interval_s)
    });
    row(&mut out, "  Young / Daly interval", &|x| {
        format!(
            "{} / {}",
            duration(x.young_interval_s),
            duration(x.daly_interval_s)
        )
    });
    row(&mut out, "goodput at best (mean)", &|x| {
        pct(x.optimum.goodput.mean)
    });
    row(&mut out, "  p5 - p95", &|x| {
        format!(
            "{} - {}",
            pct(x.optimum.goodput.p5),
            pct(x.optimum.goodput.p95)
        )
    });
    row(&mut out, "  closed form at Young's interval", &|x| {
        pct(x.closed_form_goodput)
    });
    row(&mut out, "save stall", &|x| duration(x.save_stall_s));
    row(&mut out, "mean downtime per interruption", &|x| {
        duration(x.mean_recovery_s)
    });
    let _ = writeln!(out, "where the time went (at best):");
    row(&mut out, "  productive", &|x| {
        pct(x.optimum.breakdown.productive)
    });
    row(&mut out, "  checkpoint save stall", &|x| {
        pct(x.optimum.breakdown.save)
    });
    row(&mut out, "  lost progress (redone)", &|x| {
        pct(x.optimum.breakdown.lost)
    });
    row(&mut out, "  detection", &|x| {
        pct(x.optimum.breakdown.detection)
    });
    row(&mut out, "  restart, start-up, requeue", &|x| {
        pct(x.optimum.breakdown.restart)
    });
    row(&mut out, "  restore", &|x| pct(x.optimum.breakdown.restore));
    row(&mut out, "  scaled down", &|x| {
        pct(x.optimum.breakdown.scaled_down)
    });
    let gain = w.optimum.goodput.mean - b.optimum.goodput.mean;
    #[allow(clippy::cast_precision_loss)]
    let gpu_hours = s.gpus as f64 * s.days * 24.0;
    let _ = writeln!(
        out,
        "\nwarden over the baseline: {:+.2} points of goodput = {:.0} GPU-hours over the run",
        gain * 100.0,
        gain * gpu_hours
    );
    if let Some(first) = plan.spares.first() {
        let _ = writeln!(
            out,
            "\nspares (warden at {}; without a free spare {}):",
            duration(first.goodput.interval_s),
            without_spare_words(s.without_spare)
        );
        let _ = writeln!(
            out,
            "{:>8}{:>12}{:>22}{:>16}{:>16}",
            "spares", "goodput", "p5 - p95", "gained GPU-h", "spare GPU-h"
        );
        for r in &plan.spares {
            let _ = writeln!(
                out,
                "{:>8}{:>12}{:>22}{:>16.0}{:>16.0}",
                r.spares,
                pct(r.goodput.mean),
                format!("{} - {}", pct(r.goodput.p5), pct(r.goodput.p95)),
                r.gained_gpu_hours,
                r.spare_gpu_hours
            );
        }
    }
    out
}

/// What a node fault does when no spare is free, as the report says it.
fn without_spare_words(w: crate::scenario::WithoutSpare) -> &'static str {
    match w {
        crate::scenario::WithoutSpare::Pool => {
            "a node of the cluster's pool joins at the baseline's requeue and a cold start-up"
        }
        crate::scenario::WithoutSpare::ScaleDown => "a node fault scales the job down until repair",
    }
}

/// The plan as one JSON document (every input, both curves, the optima,
/// the breakdowns and the spares table).
pub fn json(plan: &Plan) -> Value {
    // The plan is plain numbers and strings: serialising cannot fail, but a
    // non-finite number would become null rather than an error.
    serde_json::to_value(plan).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(thousands(16_384), "16,384");
        assert_eq!(thousands(100), "100");
        assert_eq!(thousands(1_000_000), "1,000,000");
        assert_eq!(duration(0.203), "203 ms");
        assert_eq!(duration(600.0), "10.0 min");
    }

    /// Every input the model takes is labelled: the defaults with what they
    /// rest on, a changed one as given.
    #[test]
    fn other_inputs_are_labelled() {
        let mut s = crate::scenario::Scenario::default();
        let line = other_inputs_line(&s);
        for words in [
            "Llama 3's 466 interruptions",
            "gpu 12.0%, host 12.0%, network 12.0%, software 12.0%, planned 0.0% (published: ByteRobust's 5,506 hangs",
            "a spare taken is refilled 16.9 s after the fault's detection (the failed host's launcher requeued",
            "durable 1863 GiB/s for the job (published: Llama 3's store",
            "requeue 3.0 s (measured: a failed job's afternotok successor",
            "NCCL's default timeout",
            "the agent's defaults",
        ] {
            assert!(line.contains(words), "{words:?} in {line}");
        }
        s.checkpoint.durable_gibps = 0.4;
        assert!(
            other_inputs_line(&s).contains("durable 0.4 GiB/s for the job (given)"),
            "{}",
            other_inputs_line(&s)
        );
        // Issue 32 point 4: the default plan's other inputs assume nothing.
        assert!(!line.contains("assumed"), "{line}");
        s.checkpoint.durable_gibps = 50.0;
        s.without_spare = crate::scenario::WithoutSpare::ScaleDown;
        let line = other_inputs_line(&s);
        assert!(
            line.contains("durable 50 GiB/s for the job (given)"),
            "{line}"
        );
        assert!(line.contains("repair 24.00 h (assumed: it ends"), "{line}");
        s.repair_hours = 4.0;
        let line = other_inputs_line(&s);
        assert!(line.contains("repair 4.00 h (given: it ends"), "{line}");
        s.without_spare = crate::scenario::WithoutSpare::Pool;
        s.spare_refill = crate::scenario::SpareRefill::Repair;
        let line = other_inputs_line(&s);
        assert!(
            line.contains("repair 4.00 h (given: it refills a spare, --spare-refill repair)"),
            "{line}"
        );
        s.classes[0].hang_fraction = 0.5;
        let line = other_inputs_line(&s);
        assert!(
            line.contains("hang fractions gpu 50.0%, host 12.0%")
                && line.contains("planned 0.0% (given)"),
            "{line}"
        );
    }
}
