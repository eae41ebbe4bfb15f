//! A job's goodput as people read it: the table with percentages and the
//! top causes of badput, and the JSON the planner reads. Printed by
//! `warden goodput` and by `warden run` when a job ends (which also writes
//! the JSON next to the job's logs).

use serde_json::{Map, Value, json};
use warden_proto::v1 as pb;

/// Badput causes by share, largest first (productive left out, zero
/// shares left out).
pub fn top_causes(j: &pb::JobGoodput) -> Vec<&pb::GoodputPart> {
    let mut bad: Vec<&pb::GoodputPart> = j
        .parts
        .iter()
        .filter(|p| p.cause != "productive" && p.accelerator_seconds > 0.0)
        .collect();
    bad.sort_by(|a, b| b.fraction.total_cmp(&a.fraction));
    bad
}

/// One job as JSON: parts in accelerator-seconds and fractions, the top
/// causes, and the `recovery` means the planner reads (`--from-ledger`).
pub fn job_json(j: &pb::JobGoodput) -> Value {
    let mut parts = Map::new();
    for p in &j.parts {
        parts.insert(
            p.cause.clone(),
            json!({ "accelerator_s": p.accelerator_seconds, "fraction": p.fraction }),
        );
    }
    let rec = j.recovery.unwrap_or_default();
    json!({
        "job_id": j.job_id,
        "wall_s": j.wall_seconds,
        "ranks": j.ranks,
        "accelerator_s": j.accelerator_seconds,
        "goodput": j.goodput,
        "open": j.open,
        "hosts": j.hosts,
        "parts": parts,
        "top_causes": top_causes(j).iter().take(3).map(|p| p.cause.clone()).collect::<Vec<_>>(),
        "recovery": {
            "step_s": rec.step_s,
            "startup_s": rec.startup_s,
            "detection_s": rec.detection_s,
            "restart_downtime_s": rec.restart_downtime_s,
            "restore_s": rec.restore_s,
            "save_stall_s": rec.save_stall_s,
            "restarts": rec.restarts,
            "saves": rec.saves,
        },
    })
}

/// One job as a table with percentages and its top causes.
pub fn render(j: &pb::JobGoodput) -> String {
    let mut out = format!(
        "job {}: goodput {:.1}% of {:.1} accelerator-s ({} rank{}{} x {:.1} s wall){}\n",
        j.job_id,
        j.goodput * 100.0,
        j.accelerator_seconds,
        j.ranks,
        if j.ranks == 1 { "" } else { "s" },
        match j.hosts.len() {
            0 => String::new(),
            1 => " on 1 host".to_owned(),
            n => format!(" on {n} hosts"),
        },
        j.wall_seconds,
        if j.open { ", running" } else { "" }
    );
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(vec!["CAUSE", "ACCEL-S", "SHARE"]);
    for p in &j.parts {
        if p.accelerator_seconds == 0.0 && p.cause != "productive" {
            continue;
        }
        t.add_row(vec![
            p.cause.clone(),
            format!("{:.2}", p.accelerator_seconds),
            format!("{:.1}%", p.fraction * 100.0),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    let top = top_causes(j);
    if top.is_empty() {
        out.push_str("no badput\n");
    } else {
        out.push_str(&format!(
            "top causes: {}\n",
            top.iter()
                .take(3)
                .map(|p| format!("{} {:.1}%", p.cause, p.fraction * 100.0))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if let Some(r) = &j.recovery
        && (r.restarts > 0 || r.saves > 0)
    {
        let f = |v: Option<f64>| v.map_or("-".to_owned(), |s| format!("{s:.2} s"));
        out.push_str(&format!(
            "recovery: {} restart{} (mean detection {}, downtime {}, restore {}), {} save{} (mean stall {})\n",
            r.restarts,
            if r.restarts == 1 { "" } else { "s" },
            f(r.detection_s),
            f(r.restart_downtime_s),
            f(r.restore_s),
            r.saves,
            if r.saves == 1 { "" } else { "s" },
            f(r.save_stall_s),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recovery_line_says_its_figures_are_means() {
        let j = pb::JobGoodput {
            recovery: Some(pb::GoodputRecovery {
                detection_s: Some(0.15),
                restart_downtime_s: Some(9.94),
                restore_s: Some(0.05),
                save_stall_s: Some(0.19),
                restarts: 1,
                saves: 4,
                ..Default::default()
            }),
            ..Default::default()
        };
        let out = render(&j);
        assert!(
            out.contains(
                "recovery: 1 restart (mean detection 0.15 s, downtime 9.94 s, restore 0.05 s), \
                 4 saves (mean stall 0.19 s)"
            ),
            "{out}"
        );
    }
}
