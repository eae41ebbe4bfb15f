//! `warden ckpt ls`: checkpoint steps and where every shard's copies live.

use serde_json::{Value, json};
use warden_proto::v1 as pb;

/// JSON form of ListCheckpointsResponse.
pub fn list_json(r: &pb::ListCheckpointsResponse) -> Value {
    json!({
        "steps": r.steps.iter().map(|s| json!({
            "job_id": s.job_id,
            "step": s.step,
            "world_size": s.world_size,
            "complete": s.complete,
            "shards": s.shards.iter().map(|sh| json!({
                "rank": sh.rank,
                "size_bytes": sh.size_bytes,
                "xxh3": format!("{:016x}", sh.xxh3),
                "copies": sh.copies.iter().map(|c| json!({
                    "tier": c.tier, "holder": c.holder, "corrupt": c.corrupt,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "unreachable": r.unreachable,
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

/// Prints ListCheckpointsResponse: one row per step, then per shard.
pub fn print_list(r: &pb::ListCheckpointsResponse, as_json: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", list_json(r))?;
        return Ok(());
    }
    if r.steps.is_empty() {
        outln!("no checkpoints")?;
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
