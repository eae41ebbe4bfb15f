//! `warden ckpt ls`: checkpoint steps and where every shard's copies live;
//! for a large job, each step's counts (the agent leaves the shards out past
//! 1,024 unless every one is asked for).

use serde_json::{Value, json};
use warden_proto::v1 as pb;

/// The largest listing the CLI takes: every shard of a job of 100,000
/// ranks with three copies each is about 10 MB a step, past tonic's 4 MiB
/// default; a few steps of it fit.
pub const MAX_LISTING_BYTES: usize = 256 << 20;

/// `r` with only `ranks`' shards, when any were named: an older agent
/// ignores the request's ranks and lists every shard.
pub fn only_ranks(
    mut r: pb::ListCheckpointsResponse,
    ranks: &[u32],
) -> pb::ListCheckpointsResponse {
    if !ranks.is_empty() {
        for s in &mut r.steps {
            s.shards.retain(|sh| ranks.contains(&sh.rank));
        }
    }
    r
}

/// JSON form of ListCheckpointsResponse.
pub fn list_json(r: &pb::ListCheckpointsResponse) -> Value {
    json!({
        "steps": r.steps.iter().map(|s| json!({
            "job_id": s.job_id,
            "step": s.step,
            "world_size": s.world_size,
            "complete": s.complete,
            "ranks_with_copy": s.ranks_with_copy,
            "size_bytes": s.size_bytes,
            "sized_ranks": s.sized_ranks,
            "good_copies": s.good_copies,
            "corrupt_copies": s.corrupt_copies,
            "missing_ranks": s.missing_ranks,
            "shards": s.shards.iter().map(|sh| json!({
                "rank": sh.rank,
                "size_bytes": sh.size_bytes,
                "xxh3": format!("{:016x}", sh.xxh3),
                "copies": sh.copies.iter().map(|c| json!({
                    "tier": c.tier, "holder": c.holder, "corrupt": c.corrupt,
                    "unconfirmed": c.unconfirmed,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "unreachable": r.unreachable,
        "summarized": r.summarized,
        "collected": r.collected,
    })
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A step's SIZE: its bytes; in a collected listing where the collector
/// knew no size for some ranks, a lower bound (`>=`, with how many ranks
/// it adds up), or `unknown` where it knew none.
fn step_size(s: &pb::CheckpointStep, collected: bool) -> String {
    if !collected || s.sized_ranks >= s.ranks_with_copy {
        return bytes(s.size_bytes);
    }
    if s.sized_ranks == 0 {
        return "unknown".to_owned();
    }
    format!(
        ">= {} ({}/{} ranks sized)",
        bytes(s.size_bytes),
        s.sized_ranks,
        s.ranks_with_copy
    )
}

/// Prints a summarized listing: one row per step, its counts.
fn print_counts(r: &pb::ListCheckpointsResponse) -> std::io::Result<()> {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(vec![
        "JOB", "STEP", "RANKS", "COMPLETE", "SIZE", "COPIES", "MISSING",
    ]);
    for s in &r.steps {
        let missing = s.world_size.saturating_sub(s.ranks_with_copy);
        let mut named: Vec<String> = s.missing_ranks.iter().map(u32::to_string).collect();
        if missing as usize > named.len() {
            named.push(format!("... ({missing} in all)"));
        }
        t.add_row(vec![
            s.job_id.clone(),
            s.step.to_string(),
            format!("{}/{}", s.ranks_with_copy, s.world_size),
            if s.complete { "yes" } else { "no" }.to_owned(),
            step_size(s, r.collected),
            if s.corrupt_copies == 0 {
                s.good_copies.to_string()
            } else {
                format!("{} ({} CORRUPT)", s.good_copies, s.corrupt_copies)
            },
            named.join(","),
        ]);
    }
    outln!("{t}")?;
    if r.collected {
        outln!(
            "counted by the job's checkpoint collector: CORRUPT copies are this host's own; SIZE is a lower bound or unknown where the collector knows no size for some ranks (held in the durable store alone, or answered by an older agent, whose COPIES are 0)"
        )?;
    }
    outln!(
        "shards left out (more than 1,024, or --summary): --rank R for a rank's copies, --shards for every one"
    )
}

/// Prints ListCheckpointsResponse: one row per step, then per shard.
pub fn print_list(r: &pb::ListCheckpointsResponse, as_json: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", list_json(r))?;
        return Ok(());
    }
    if r.steps.is_empty() {
        outln!("no checkpoints")?;
    } else if r.summarized {
        print_counts(r)?;
    } else {
        let mut t = comfy_table::Table::new();
        t.load_preset(comfy_table::presets::NOTHING);
        t.set_header(vec![
            "JOB", "STEP", "RANKS", "COMPLETE", "RANK", "SIZE", "COPIES",
        ]);
        for s in &r.steps {
            let have = s.shards.len();
            for (i, sh) in s.shards.iter().enumerate() {
                let copies: Vec<String> = sh
                    .copies
                    .iter()
                    .map(|c| {
                        if c.corrupt.is_empty() {
                            format!("{}:{}", c.tier, c.holder)
                        } else {
                            format!("{}:{}(CORRUPT)", c.tier, c.holder)
                        }
                    })
                    .collect();
                let first = i == 0;
                t.add_row(vec![
                    if first {
                        s.job_id.clone()
                    } else {
                        String::new()
                    },
                    if first {
                        s.step.to_string()
                    } else {
                        String::new()
                    },
                    if first {
                        format!("{have}/{}", s.world_size)
                    } else {
                        String::new()
                    },
                    if first {
                        if s.complete { "yes" } else { "no" }.to_owned()
                    } else {
                        String::new()
                    },
                    sh.rank.to_string(),
                    bytes(sh.size_bytes),
                    copies.join(" "),
                ]);
            }
        }
        outln!("{t}")?;
    }
    for u in &r.unreachable {
        outln!("not asked: {u}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collected_steps_size_says_where_it_is_a_lower_bound_or_unknown() {
        let step = |size_bytes, sized_ranks| pb::CheckpointStep {
            ranks_with_copy: 8,
            size_bytes,
            sized_ranks,
            ..Default::default()
        };
        assert_eq!(step_size(&step(2048, 8), true), "2.0 KiB");
        assert_eq!(
            step_size(&step(1536, 6), true),
            ">= 1.5 KiB (6/8 ranks sized)"
        );
        assert_eq!(step_size(&step(0, 0), true), "unknown");
        // A listing not collected counts every copy it lists.
        assert_eq!(step_size(&step(1536, 0), false), "1.5 KiB");
    }
}
