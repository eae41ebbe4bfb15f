//! Hang detection: no progress past the timeout of the section a rank is in.
//!
//! The timeout of a section is, in order: the one set in `hang.timeouts`;
//! else, once the job has `hang.warmup_samples` durations of that section,
//! `hang.multiplier` times their `hang.percentile`th percentile, never below
//! `hang.floor`; else the section's default (init and checkpoint get longer
//! ones). Every threshold carries a sentence saying how it was derived, for
//! the event's evidence.

use std::time::Duration;

use super::calibration::{Calibration, HEAL, HEAL_WAIT, IDLE, INIT, RESTART};
use crate::config::HangConfig;

/// A hang threshold and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Threshold {
    /// The timeout.
    pub value: Duration,
    /// How it was derived, for people.
    pub source: String,
}

/// The section a rank is considered to be in: its innermost open section,
/// or `init` before its first step, or `idle` between steps.
pub fn current_section(innermost: Option<&str>, steps_started: bool) -> &str {
    match innermost {
        Some(name) if !name.is_empty() => name,
        Some(_) => "other",
        None if steps_started => IDLE,
        None => INIT,
    }
}

/// The timeout for `section` of a job with history `cal`.
pub fn threshold(cfg: &HangConfig, section: &str, cal: &mut Calibration) -> Threshold {
    if let Some(t) = cfg.timeouts.get(section) {
        return Threshold {
            value: *t,
            source: format!("configured (hang.timeouts.{section})"),
        };
    }
    let n = cal.count(section);
    if cfg.calibrate
        && n >= cfg.warmup_samples
        && let Some(p) = cal.percentile(section, cfg.percentile)
    {
        {
            let scaled = Duration::from_nanos(p).mul_f64(cfg.multiplier);
            let value = scaled.max(cfg.floor);
            let pct = cfg.percentile;
            let mult = cfg.multiplier;
            let p_str = fmt(Duration::from_nanos(p));
            return Threshold {
                value,
                source: if scaled >= cfg.floor {
                    format!("{mult} x p{pct} ({p_str}) of {n} '{section}' samples")
                } else {
                    format!(
                        "floor {} ({mult} x p{pct} of {n} '{section}' samples = {})",
                        fmt(cfg.floor),
                        fmt(scaled)
                    )
                },
            };
        }
    }
    let value = match section {
        INIT => cfg.init_timeout,
        "checkpoint" => cfg.checkpoint_timeout,
        HEAL | RESTART | HEAL_WAIT => cfg.heal_timeout,
        _ => cfg.default_timeout,
    };
    Threshold {
        value,
        source: if cfg.calibrate {
            format!(
                "default: not calibrated yet ({n} of {} '{section}' samples)",
                cfg.warmup_samples
            )
        } else {
            "default (calibration off)".into()
        },
    }
}

/// Formats a duration for evidence: "1.234s", "250ms".
pub fn fmt(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.3}s", d.as_secs_f64())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Where a job's local ranks stand, for the hang pattern.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerPosition {
    /// Global rank.
    pub rank: u32,
    /// Current step.
    pub step: u64,
    /// Current section.
    pub section: String,
    /// Whether it has made no progress past its own threshold.
    pub stalled: bool,
}

/// Reads the pattern across a job's local ranks: all stuck at the same step
/// and section points to a collective; one stuck alone points to that rank.
pub fn pattern(me: &PeerPosition, peers: &[PeerPosition]) -> String {
    if peers.is_empty() {
        return "only rank of its job on this node".into();
    }
    let same = peers
        .iter()
        .filter(|p| p.stalled && p.step == me.step && p.section == me.section)
        .count();
    if same == peers.len() {
        return format!(
            "all {} local ranks stuck at step {} in '{}': a collective (NCCL/gloo) hang or a fault shared by all ranks is likely",
            peers.len() + 1,
            me.step,
            me.section
        );
    }
    let moving: Vec<u64> = peers
        .iter()
        .filter(|p| !p.stalled)
        .map(|p| p.step)
        .collect();
    if moving.len() == peers.len() {
        let lo = moving.iter().min().copied().unwrap_or(0);
        let hi = moving.iter().max().copied().unwrap_or(0);
        let steps = if lo == hi {
            format!("step {lo}")
        } else {
            format!("steps {lo}..{hi}")
        };
        return format!(
            "rank {} is stuck alone at step {}; its {} local peers still progress ({steps}): look at this rank",
            me.rank,
            me.step,
            peers.len(),
        );
    }
    format!(
        "{} of {} local ranks stalled ({} at the same step and section)",
        peers.iter().filter(|p| p.stalled).count() + 1,
        peers.len() + 1,
        same + 1
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> HangConfig {
        HangConfig::default()
    }

    #[test]
    fn section_naming() {
        assert_eq!(current_section(Some("forward"), true), "forward");
        assert_eq!(current_section(None, false), INIT);
        assert_eq!(current_section(None, true), IDLE);
    }

    #[test]
    fn uncalibrated_uses_section_defaults() {
        let mut cal = Calibration::default();
        let c = cfg();
        assert_eq!(threshold(&c, INIT, &mut cal).value, c.init_timeout);
        assert_eq!(
            threshold(&c, "checkpoint", &mut cal).value,
            c.checkpoint_timeout
        );
        assert_eq!(threshold(&c, HEAL, &mut cal).value, c.heal_timeout);
        assert_eq!(threshold(&c, HEAL_WAIT, &mut cal).value, c.heal_timeout);
        let t = threshold(&c, "forward", &mut cal);
        assert_eq!(t.value, c.default_timeout);
        assert!(t.source.contains("not calibrated"), "{}", t.source);
    }

    #[test]
    fn calibrated_one_second_steps_give_seconds() {
        let mut cal = Calibration::default();
        let c = cfg();
        for i in 0..50u64 {
            cal.add("step", 1_000_000_000 + i * 2_000_000, 256);
        }
        let t = threshold(&c, "step", &mut cal);
        // 3 x p99 (~1.1 s) = ~3.3 s: found within seconds, not minutes.
        assert!(
            t.value > Duration::from_secs(3) && t.value < Duration::from_secs(4),
            "{t:?}"
        );
        assert!(t.source.contains("p99"), "{}", t.source);
    }

    #[test]
    fn floor_applies_to_fast_sections() {
        let mut cal = Calibration::default();
        let c = cfg();
        for _ in 0..50 {
            cal.add("optimizer", 5_000_000, 256);
        }
        let t = threshold(&c, "optimizer", &mut cal);
        assert_eq!(t.value, c.floor);
        assert!(t.source.starts_with("floor"), "{}", t.source);
    }

    #[test]
    fn configured_timeout_wins() {
        let mut cal = Calibration::default();
        let mut c = cfg();
        c.timeouts
            .insert("checkpoint".into(), Duration::from_secs(7));
        for _ in 0..50 {
            cal.add("checkpoint", 1_000, 256);
        }
        let t = threshold(&c, "checkpoint", &mut cal);
        assert_eq!(t.value, Duration::from_secs(7));
        assert!(t.source.contains("configured"));
    }

    fn pos(rank: u32, step: u64, section: &str, stalled: bool) -> PeerPosition {
        PeerPosition {
            rank,
            step,
            section: section.into(),
            stalled,
        }
    }

    #[test]
    fn pattern_collective_vs_alone() {
        let me = pos(0, 10, "backward", true);
        let all = [pos(1, 10, "backward", true), pos(2, 10, "backward", true)];
        assert!(pattern(&me, &all).contains("collective"));
        let alone = [pos(1, 11, "forward", false), pos(2, 11, "step", false)];
        assert!(pattern(&me, &alone).contains("stuck alone"));
        assert!(pattern(&me, &[]).contains("only rank"));
    }
}
