//! `warden stragglers`: per-rank straggler scores, job-wide, as a table or
//! JSON.

use serde_json::{Value, json};
use warden_proto::v1 as pb;

use super::views::time;

/// JSON form of GetStragglersResponse.
pub fn stragglers_json(r: &pb::GetStragglersResponse) -> Value {
    json!({
        "hosts": r.hosts,
        "ranks": r.ranks.iter().map(|s| json!({
            "job_id": s.job_id,
            "global_rank": s.global_rank,
            "host": s.host,
            "section": s.section,
            "relative": s.relative,
            "individual": s.individual,
            "robust_z": s.robust_z,
            "flagged": s.flagged,
            "consecutive": s.consecutive,
            "flagged_since": s.flagged_since.as_ref().map(|t| time(Some(t))),
            "explanation": s.explanation,
            "cause_class": s.cause_class,
            "samples": s.samples,
            "devices": s.devices,
            "rank_median_ns": s.rank_median_ns,
            "job_median_ns": s.job_median_ns,
            "ranks_compared": s.ranks_compared,
            "scored_at": s.scored_at.as_ref().map(|t| time(Some(t))),
        })).collect::<Vec<_>>(),
    })
}

fn ratio(v: f64) -> String {
    if v > 0.0 && v.is_finite() {
        format!("{v:.2}")
    } else {
        "-".into()
    }
}

/// Prints GetStragglersResponse.
pub fn print_stragglers(r: &pb::GetStragglersResponse, as_json: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", stragglers_json(r))?;
        return Ok(());
    }
    outln!("hosts: {}", r.hosts.join(", "))?;
    if r.ranks.is_empty() {
        outln!("no ranks scored")?;
        return Ok(());
    }
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(vec![
        "JOB",
        "RANK",
        "HOST",
        "SECTION",
        "RELATIVE",
        "INDIVIDUAL",
        "Z",
        "SAMPLES",
        "FLAGGED",
        "WHY",
    ]);
    for s in &r.ranks {
        let flagged = if s.flagged {
            format!("yes since {}", time(s.flagged_since.as_ref()))
        } else {
            "no".into()
        };
        let why = if s.flagged {
            format!("{} [{}]", s.explanation, s.cause_class)
        } else {
            String::new()
        };
        t.add_row(vec![
            s.job_id.clone(),
            s.global_rank.to_string(),
            s.host.clone(),
            s.section.clone(),
            ratio(s.relative),
            ratio(s.individual),
            if s.relative > 0.0 {
                format!("{:.1}", s.robust_z)
            } else {
                "-".into()
            },
            s.samples.to_string(),
            flagged,
            why,
        ]);
    }
    outln!("{t}")?;
    Ok(())
}
