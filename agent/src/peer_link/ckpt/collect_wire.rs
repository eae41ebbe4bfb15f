//! CollectHoldings on the wire (`warden.v1.HoldingsAsk`, `Holdings`), both
//! ways: the collector's questions and answers in [`crate::ckpt::collect`]'s
//! terms, and a peer's checked and bounded before anything is kept, the
//! error naming the field.

use std::time::Duration;

use warden_core::rank::MAX_WORLD_SIZE;
use warden_proto::v1 as pb;

use crate::ckpt::collect::{Ask, AskScope};
use crate::ckpt::holdings::{
    HolderRef, Holdings, JobStep, JobView, MAX_HOSTS, MAX_STEPS, MAX_VIEW_RANKS, Tally,
};

/// The shortest and longest an ask may give its answer.
pub const LIMIT_RANGE: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(300));

/// An ask as sent.
pub fn ask_to_pb(a: &Ask) -> pb::HoldingsAsk {
    let (group, rank, ranks) = match &a.scope {
        AskScope::Job { ranks } => (
            0,
            ranks.first().copied().unwrap_or(0),
            ranks.iter().skip(1).copied().collect(),
        ),
        AskScope::Group { start } => (
            u32::try_from(*start).unwrap_or(u32::MAX).saturating_add(1),
            0,
            Vec::new(),
        ),
    };
    pb::HoldingsAsk {
        job_id: a.job.clone(),
        group,
        rank,
        relayed: a.relayed,
        limit_ms: u32::try_from(a.limit.as_millis()).unwrap_or(u32::MAX),
        ranks,
    }
}

/// A peer's ask, checked (the job's name is checked by the edge); the
/// error names the field.
pub fn ask_from_pb(r: pb::HoldingsAsk) -> Result<Ask, String> {
    let limit = Duration::from_millis(u64::from(r.limit_ms));
    if !(LIMIT_RANGE.0..=LIMIT_RANGE.1).contains(&limit) {
        return Err(format!(
            "limit_ms: {}; must be between 10 and 300000",
            r.limit_ms
        ));
    }
    let scope = if r.group == 0 {
        if r.rank >= MAX_WORLD_SIZE {
            return Err(format!("rank: {}; must be below {MAX_WORLD_SIZE}", r.rank));
        }
        if r.ranks.len() >= MAX_VIEW_RANKS {
            return Err(format!(
                "ranks: {}; at most {} beside rank",
                r.ranks.len(),
                MAX_VIEW_RANKS - 1
            ));
        }
        if let Some(x) = r.ranks.iter().find(|&&x| x >= MAX_WORLD_SIZE) {
            return Err(format!("ranks: {x}; must be below {MAX_WORLD_SIZE}"));
        }
        // The first stays first (an older agent on the way answers it
        // alone); the rest once each.
        let mut ranks = vec![r.rank];
        for x in r.ranks {
            if !ranks.contains(&x) {
                ranks.push(x);
            }
        }
        AskScope::Job { ranks }
    } else {
        if r.rank != 0 || r.relayed || !r.ranks.is_empty() {
            return Err("rank, ranks, relayed: set on a group's ask (group > 0)".to_owned());
        }
        AskScope::Group {
            start: (r.group - 1) as usize,
        }
    };
    Ok(Ask {
        job: r.job_id,
        scope,
        relayed: r.relayed,
        limit,
    })
}

/// A group's holdings as sent.
pub fn holdings_to_pb(h: &Holdings) -> pb::Holdings {
    pb::Holdings {
        hosts: h.hosts.iter().map(host_to_pb).collect(),
        steps: h
            .steps
            .iter()
            .map(|(&step, s)| pb::StepHoldings {
                step,
                world_size: s.world,
                ranks: s
                    .ranks
                    .iter()
                    .map(|(&rank, hs)| pb::RankHolders {
                        rank,
                        hosts: hs.clone(),
                        size_bytes: s.sizes.get(&rank).copied().unwrap_or(0),
                    })
                    .collect(),
                present: 0,
                missing: Vec::new(),
                tally: None,
            })
            .collect(),
        unreachable: h.unreachable.clone(),
        answered: Vec::new(),
    }
}

/// A peer's answer for a group, checked ([`Holdings::check`]).
pub fn holdings_from_pb(r: pb::Holdings) -> Result<Holdings, String> {
    bounded(&r)?;
    let mut h = Holdings::default();
    let index: Vec<u32> = r.hosts.iter().map(|x| h.host(&x.addr, &x.host)).collect();
    for s in r.steps {
        for rh in s.ranks {
            for i in rh.hosts {
                let Some(&mine) = index.get(i as usize) else {
                    return Err(format!(
                        "step {} rank {}: holder {i} of {} hosts",
                        s.step,
                        rh.rank,
                        index.len()
                    ));
                };
                h.add_sized(mine, s.step, rh.rank, s.world_size, rh.size_bytes);
            }
        }
    }
    h.unreachable = r.unreachable;
    h.check()?;
    Ok(h)
}

/// The job's view for its ranks as sent.
pub fn view_to_pb(v: &JobView) -> pb::Holdings {
    let mut hosts: Vec<HolderRef> = Vec::new();
    let mut index = |h: &HolderRef| -> u32 {
        match hosts.iter().position(|x| x == h) {
            Some(i) => i as u32,
            None => {
                hosts.push(h.clone());
                (hosts.len() - 1) as u32
            }
        }
    };
    let steps = v
        .steps
        .iter()
        .map(|(&step, s)| pb::StepHoldings {
            step,
            world_size: s.world,
            ranks: s
                .holders
                .iter()
                .map(|(&rank, hs)| pb::RankHolders {
                    rank,
                    hosts: hs.iter().map(&mut index).collect(),
                    size_bytes: 0,
                })
                .collect(),
            present: s.present,
            missing: s.missing.clone(),
            tally: s.tally.map(|t| pb::StepTally {
                copies: t.copies,
                size_bytes: t.size_bytes,
                sized_ranks: t.sized_ranks,
            }),
        })
        .collect();
    pb::Holdings {
        hosts: hosts.iter().map(host_to_pb).collect(),
        steps,
        unreachable: v.unreachable.clone(),
        answered: v.ranks.iter().copied().collect(),
    }
}

/// A peer's view of the job for the `asked` ranks (the first first, as the
/// ask sent them), checked ([`JobView::check`]). The ranks it answers are
/// those it names that were asked; naming none, it answers the first alone
/// (an older agent, which reads only the ask's `rank`). Every agent answers
/// the first: an answer naming ranks but not that one makes no sense (kept,
/// its empty set would read as an older agent's one hop on).
pub fn view_from_pb(r: pb::Holdings, asked: &[u32]) -> Result<JobView, String> {
    bounded(&r)?;
    if r.answered.len() > MAX_VIEW_RANKS {
        return Err(format!(
            "answered: {}; at most {MAX_VIEW_RANKS}",
            r.answered.len()
        ));
    }
    let ranks = if r.answered.is_empty() {
        asked.iter().take(1).copied().collect()
    } else if asked.first().is_some_and(|f| !r.answered.contains(f)) {
        return Err(format!(
            "answered: {:?}, without the first rank asked ({:?})",
            r.answered.iter().take(8).collect::<Vec<_>>(),
            asked.first()
        ));
    } else {
        r.answered
            .iter()
            .copied()
            .filter(|x| asked.contains(x))
            .collect()
    };
    let mut v = JobView {
        unreachable: r.unreachable,
        ranks,
        ..JobView::default()
    };
    for s in r.steps {
        let mut holders: std::collections::BTreeMap<u32, Vec<HolderRef>> = Default::default();
        for x in s.ranks.iter().filter(|x| v.ranks.contains(&x.rank)) {
            for i in &x.hosts {
                let h = r.hosts.get(*i as usize).ok_or_else(|| {
                    format!("step {}: holder {i} of {} hosts", s.step, r.hosts.len())
                })?;
                holders.entry(x.rank).or_default().push(HolderRef {
                    addr: h.addr.clone(),
                    host: h.host.clone(),
                });
            }
        }
        v.steps.insert(
            s.step,
            JobStep {
                world: s.world_size,
                present: s.present,
                missing: s.missing,
                holders,
                tally: s.tally.map(|t| Tally {
                    copies: t.copies,
                    size_bytes: t.size_bytes,
                    sized_ranks: t.sized_ranks,
                }),
            },
        );
    }
    v.check()?;
    Ok(v)
}

fn host_to_pb(h: &HolderRef) -> pb::HoldingsHost {
    pb::HoldingsHost {
        addr: h.addr.clone(),
        host: h.host.clone(),
    }
}

/// The counts any answer must stay within, before it is read.
fn bounded(r: &pb::Holdings) -> Result<(), String> {
    if r.hosts.len() > MAX_HOSTS {
        return Err(format!("hosts: {}; at most {MAX_HOSTS}", r.hosts.len()));
    }
    if r.steps.len() > MAX_STEPS {
        return Err(format!("steps: {}; at most {MAX_STEPS}", r.steps.len()));
    }
    if r.unreachable.len() > MAX_HOSTS {
        return Err(format!(
            "unreachable: {}; at most {MAX_HOSTS}",
            r.unreachable.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_and_answers_go_both_ways() {
        let a = Ask {
            job: "j".into(),
            scope: AskScope::Group { start: 64 },
            relayed: false,
            limit: Duration::from_secs(4),
        };
        let back = ask_from_pb(ask_to_pb(&a)).expect("ask");
        assert_eq!(back.scope, AskScope::Group { start: 64 });
        assert_eq!(back.limit, a.limit);
        let mut h = Holdings::default();
        let x = h.host("a:1", "ha");
        let y = h.host("b:1", "hb");
        h.add_sized(x, 5, 0, 2, 64);
        h.add(y, 5, 0, 2);
        h.add_sized(y, 5, 1, 2, 32);
        h.unreachable.push("c:1: silent".into());
        let g = holdings_from_pb(holdings_to_pb(&h)).expect("group");
        assert_eq!(g.steps, h.steps);
        assert_eq!(g.hosts, h.hosts);
        assert_eq!(g.steps[&5].sizes, [(0, 64), (1, 32)].into());
        let v = h.for_ranks(&[0]);
        assert_eq!(
            v.steps[&5].tally.map(|t| (t.copies, t.size_bytes)),
            Some((3, 96))
        );
        assert_eq!(view_from_pb(view_to_pb(&v), &[0]).expect("view"), v);
        // An older agent's view has no tally: none is made up.
        let mut old = view_to_pb(&v);
        old.steps[0].tally = None;
        assert_eq!(view_from_pb(old, &[0]).expect("view").steps[&5].tally, None);

        // A host's ranks in one ask: the first stays first, each once.
        let a = Ask {
            job: "j".into(),
            scope: AskScope::Job {
                ranks: vec![1, 0, 7],
            },
            relayed: true,
            limit: Duration::from_secs(1),
        };
        let mut sent = ask_to_pb(&a);
        assert_eq!((sent.rank, sent.ranks.clone()), (1, vec![0, 7]));
        sent.ranks.push(0);
        assert_eq!(ask_from_pb(sent).expect("ask").scope, a.scope);
        let both = h.for_ranks(&[1, 0, 7]);
        assert_eq!(
            view_from_pb(view_to_pb(&both), &[1, 0, 7]).expect("view"),
            both
        );
        // An older agent answers the first rank alone, and says none: the
        // others are not taken for ranks without copies.
        let mut old = view_to_pb(&both);
        old.answered.clear();
        let got = view_from_pb(old, &[1, 0, 7]).expect("view");
        assert_eq!(got.ranks, [1].into());
        assert_eq!(got.steps[&5].holders.keys().collect::<Vec<_>>(), [&1]);
        // Ranks named that were not asked are not taken.
        let got = view_from_pb(view_to_pb(&both), &[0]).expect("view");
        assert_eq!(got.ranks, [0].into());
        assert_eq!(got.steps[&5].holders.keys().collect::<Vec<_>>(), [&0]);
        // An answer that names ranks, but not the first asked, is refused.
        let err = view_from_pb(view_to_pb(&both), &[3, 0]).expect_err("not the first");
        assert!(err.starts_with("answered"), "{err}");
    }

    #[test]
    fn a_peers_ask_or_answer_out_of_range_is_refused_naming_the_field() {
        let mut a = ask_to_pb(&Ask {
            job: "j".into(),
            scope: AskScope::Job { ranks: vec![3] },
            relayed: true,
            limit: Duration::from_secs(1),
        });
        a.limit_ms = 0;
        assert!(ask_from_pb(a.clone()).unwrap_err().starts_with("limit_ms"));
        a.limit_ms = 1000;
        a.ranks = vec![MAX_WORLD_SIZE];
        assert!(
            ask_from_pb(a.clone())
                .unwrap_err()
                .starts_with("ranks: 16777216")
        );
        a.ranks = (0..MAX_VIEW_RANKS as u32).collect();
        assert!(ask_from_pb(a.clone()).unwrap_err().starts_with("ranks: 64"));
        a.ranks.clear();
        a.rank = MAX_WORLD_SIZE;
        assert!(ask_from_pb(a.clone()).unwrap_err().starts_with("rank"));
        a.group = 2;
        assert!(ask_from_pb(a).unwrap_err().contains("group > 0"));
        let bad = pb::Holdings {
            hosts: vec![],
            steps: vec![pb::StepHoldings {
                step: 1,
                world_size: 1,
                ranks: vec![pb::RankHolders {
                    rank: 0,
                    hosts: vec![3],
                    size_bytes: 0,
                }],
                present: 1,
                missing: vec![],
                tally: None,
            }],
            unreachable: vec![],
            answered: vec![],
        };
        assert!(
            holdings_from_pb(bad.clone())
                .unwrap_err()
                .contains("holder 3 of 0")
        );
        assert!(
            view_from_pb(bad.clone(), &[0])
                .unwrap_err()
                .contains("holder 3 of 0")
        );
        let mut many = bad;
        many.steps.clear();
        many.answered = (0..=MAX_VIEW_RANKS as u32).collect();
        assert!(
            view_from_pb(many, &[0])
                .unwrap_err()
                .starts_with("answered")
        );
    }
}
