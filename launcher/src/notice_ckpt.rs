//! Where the checkpoint saved on a notice went, for the console and the
//! summary: the job's newest step complete for every rank, and its copies.
//!
//! In: the agent's ListCheckpoints answer for the job, with the shards of
//! this host's ranks (every rank's from an older agent, which ignores the
//! request's ranks). Out: a [`Whereabouts`]
//! (pure), and whether the launcher should wait a little more for the
//! agent's replication ([`Whereabouts::wait_for_copies`]). Never: call the
//! agent (the executor does, bounded by the notice's window).

use serde::Serialize;
use warden_proto::v1 as pb;

/// The notice's checkpoint as the summary shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Whereabouts {
    /// The newest step complete for every rank (None: none is).
    pub step: Option<u64>,
    /// Each rank's copies: `rank 0: local (h1), peer (h2)`.
    pub copies: Vec<String>,
    /// Every listed shard of the step (this host's ranks') has a copy off
    /// this host (a peer, the durable store), by its holder's answer now
    /// or, `unconfirmed`, by the holder's answer to the push (a peer that
    /// went with the same notice may not keep it): it survives this host.
    pub off_host: bool,
    /// An older step of the job has every shard off this host, on holders
    /// that answered for it now: replication is configured and working, so
    /// a missing copy of the notice's step is still on its way. (Copies
    /// listed from the agent's record of its pushes, whose holder did not
    /// answer, count for `off_host` but not here: a peer gone cannot take
    /// the notice's step.)
    pub replicating: bool,
}

impl Whereabouts {
    /// Judges the listing of `job`.
    pub fn of(job: &str, steps: &[pb::CheckpointStep]) -> Self {
        let off_by = |s: &pb::CheckpointStep, counts: &dyn Fn(&pb::ShardCopy) -> bool| {
            !s.shards.is_empty()
                && s.shards.iter().all(|sh| {
                    sh.copies
                        .iter()
                        .any(|c| c.tier != "local" && c.corrupt.is_empty() && counts(c))
                })
        };
        let off = |s: &pb::CheckpointStep| off_by(s, &|_| true);
        let off_now = |s: &pb::CheckpointStep| off_by(s, &|c| !c.unconfirmed);
        let mut complete: Vec<&pb::CheckpointStep> = steps
            .iter()
            .filter(|s| s.job_id == job && s.complete)
            .collect();
        complete.sort_by_key(|s| std::cmp::Reverse(s.step));
        let Some(newest) = complete.first() else {
            return Self::default();
        };
        let copies = newest
            .shards
            .iter()
            .map(|sh| {
                let list: Vec<String> = sh
                    .copies
                    .iter()
                    .filter(|c| c.corrupt.is_empty())
                    .map(|c| format!("{} ({})", c.tier, c.holder))
                    .collect();
                format!("rank {}: {}", sh.rank, list.join(", "))
            })
            .collect();
        Self {
            step: Some(newest.step),
            copies,
            off_host: off(newest),
            replicating: complete.iter().skip(1).any(|s| off_now(s)),
        }
    }

    /// Whether the launcher should ask again before it exits: the step its
    /// ranks saved on the notice (`notice_step`, where the agent named one)
    /// is not yet the newest complete (another host's ranks still saving,
    /// their shards on the way), or the step is on this host alone while
    /// replication is evidently at work.
    pub fn wait_for_copies(&self, notice_step: Option<u64>) -> bool {
        let behind = notice_step.is_some_and(|n| self.step.is_none_or(|s| s < n));
        behind || (self.step.is_some() && !self.off_host && self.replicating)
    }

    /// One line for the console.
    pub fn line(&self) -> String {
        match self.step {
            None => "no step of the job is complete for every rank in the agent's view: the next run starts from an older save or from scratch".to_owned(),
            Some(step) => format!(
                "the notice's checkpoint: step {step}, complete for every rank{}; {}",
                if self.off_host {
                    ", with a copy off this host"
                } else {
                    ", on this host only (no peer or durable copy yet: it is lost with the host)"
                },
                self.copies.join("; ")
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(n: u64, copies: &[&[&str]]) -> pb::CheckpointStep {
        pb::CheckpointStep {
            job_id: "j".into(),
            step: n,
            world_size: u32::try_from(copies.len()).unwrap_or(0),
            complete: true,
            shards: copies
                .iter()
                .enumerate()
                .map(|(r, tiers)| pb::ShardLocations {
                    rank: u32::try_from(r).unwrap_or(0),
                    copies: tiers
                        .iter()
                        .map(|t| pb::ShardCopy {
                            tier: t.trim_end_matches('?').into(),
                            holder: "h".into(),
                            corrupt: String::new(),
                            unconfirmed: t.ends_with('?'),
                        })
                        .collect(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_step_on_this_host_alone_waits_only_where_replication_works() {
        let alone = [step(150, &[&["local"], &["local"]])];
        let w = Whereabouts::of("j", &alone);
        assert_eq!(w.step, Some(150));
        assert!(!w.off_host && !w.wait_for_copies(None), "{w:?}");
        assert!(w.line().contains("on this host only"), "{}", w.line());
        let replicating = [
            step(150, &[&["local", "peer"], &["local"]]),
            step(100, &[&["local", "peer"], &["local", "durable"]]),
        ];
        let w = Whereabouts::of("j", &replicating);
        assert!(w.wait_for_copies(None), "{w:?}");
        let done = [
            step(150, &[&["local", "peer"], &["local", "peer"]]),
            step(100, &[&["local", "peer"], &["local", "peer"]]),
        ];
        let w = Whereabouts::of("j", &done);
        assert!(w.off_host && !w.wait_for_copies(None), "{w:?}");
        assert!(
            w.line().contains("rank 1: local (h), peer (h)"),
            "{}",
            w.line()
        );
        assert_eq!(Whereabouts::of("other", &done).step, None);
    }

    /// A copy the agent lists from its record of the push (`peer?`: its
    /// holder did not answer) leaves the host, but says nothing of a peer
    /// that could still take the notice's step.
    #[test]
    fn a_copy_sent_to_a_peer_not_answering_is_off_host_but_not_replication_at_work() {
        let gone = [
            step(150, &[&["local", "peer?"], &["local", "peer?"]]),
            step(100, &[&["local", "peer?"], &["local", "peer?"]]),
        ];
        let w = Whereabouts::of("j", &gone);
        assert!(w.off_host && !w.replicating, "{w:?}");
        let half = [
            step(150, &[&["local", "peer?"], &["local"]]),
            step(100, &[&["local", "peer?"], &["local", "peer?"]]),
        ];
        let w = Whereabouts::of("j", &half);
        assert!(!w.off_host && !w.wait_for_copies(None), "{w:?}");
    }

    /// The step the ranks saved on the notice is waited for until it is
    /// the newest complete: another host's ranks may still be saving it.
    #[test]
    fn the_notices_step_is_waited_for_until_it_is_complete() {
        let older = [step(100, &[&["local", "peer"], &["local", "peer"]])];
        let w = Whereabouts::of("j", &older);
        assert!(w.off_host && !w.wait_for_copies(None), "{w:?}");
        assert!(w.wait_for_copies(Some(150)), "{w:?}");
        assert!(Whereabouts::of("j", &[]).wait_for_copies(Some(150)));
        let saved = [
            step(150, &[&["local", "peer"], &["local", "peer"]]),
            step(100, &[&["local", "peer"], &["local", "peer"]]),
        ];
        assert!(!Whereabouts::of("j", &saved).wait_for_copies(Some(150)));
    }
}
