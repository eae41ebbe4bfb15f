use super::*;

const MS: u64 = 1_000_000;

fn step(pid: u32, n: u64, start_ms: u64, dur_ms: u64) -> StepObs {
    StepObs {
        pid,
        step: n,
        start_ns: start_ms * MS,
        duration_ns: dur_ms * MS,
        data_ns: 0,
    }
}

/// Parts add up to each rank's span: the invariant.
fn assert_sums(l: &Ledger, job: &str) {
    for (rank, r) in &l.jobs[job].ranks {
        assert_eq!(
            r.parts.total(),
            ns_between(r.start_ns, r.cursor_ns),
            "rank {rank}: parts {:?} do not add up to its span",
            r.parts
        );
        assert!(
            r.parts.0.iter().all(|p| *p >= 0),
            "rank {rank}: a negative part {:?}",
            r.parts
        );
    }
}

fn ms(l: &Ledger, job: &str, c: Cause) -> i64 {
    l.report(job, 0).map_or(0, |r| r.parts.get(c)) / 1_000_000
}

#[test]
fn startup_steps_gaps_and_end_add_up() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 300 * MS);
    l.init_section("j", 0, Some(400 * MS), 450 * MS);
    l.init_section("j", 0, None, 600 * MS);
    for n in 0..10 {
        l.step("j", 0, step(10, n, 1000 + n * 110, 100));
    }
    l.exited("j", 0, 10, ExitKind::Clean, 3000 * MS);
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::StartupImport), 300);
    assert_eq!(ms(&l, "j", Cause::StartupInit), 200);
    assert_eq!(ms(&l, "j", Cause::Startup), 500);
    assert_eq!(ms(&l, "j", Cause::Productive), 1000);
    // 9 gaps of 10 ms, then 1000 + 1090 -> 3000.
    assert_eq!(ms(&l, "j", Cause::Idle), 90 + 910);
    let rep = l.report("j", 0).unwrap();
    assert_eq!(rep.wall_ns, 3000 * MS as i64);
    assert!(!rep.open);
    assert_eq!(rep.occ.startups, (1, 1000 * MS as i64));
}

#[test]
fn a_step_read_twice_is_counted_once() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    l.step("j", 0, step(10, 0, 100, 100));
    l.step("j", 0, step(10, 0, 100, 100));
    l.step("j", 0, step(10, 1, 150, 100)); // overlaps: only its tail counts
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::Productive), 150);
}

#[test]
fn crash_restart_and_redone_steps_are_lost_progress() {
    let mut l = Ledger::default();
    for rank in 0..2 {
        l.registered("j", rank, 10 + rank, 0, 100 * MS);
    }
    // Steps 0..=9 of 100 ms each, from t = 1000 ms.
    for n in 0..10 {
        for rank in 0..2 {
            l.step("j", rank, step(10 + rank, n, 1000 + n * 100, 100));
        }
    }
    // Rank 1 crashes at 2050 ms, halfway through step 10.
    l.exited("j", 1, 11, ExitKind::Failed, 2050 * MS);
    // Rank 0 is stopped for the restart afterwards: already disrupted.
    l.exited("j", 0, 10, ExitKind::StoppedForRestart, 2100 * MS);
    // New processes; restored from step 5 at 3000 ms: steps 5..=9 redone.
    for rank in 0..2 {
        l.registered("j", rank, 20 + rank, 2500 * MS, 2600 * MS);
        l.restored("j", rank, 200 * MS as i64);
        for n in 5..15 {
            l.step("j", rank, step(20 + rank, n, 3000 + (n - 5) * 100, 100));
        }
    }
    l.close("j", 4000 * MS);
    assert_sums(&l, "j");
    // Two ranks: each 50 ms into step 10 when the crash came (less than
    // its 100 ms baseline: all of it the step in flight, lost, none
    // detection wait), and 5 redone steps of 100 ms.
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 0);
    assert_eq!(ms(&l, "j", Cause::LostProgress), 2 * (500 + 50));
    assert_eq!(ms(&l, "j", Cause::CheckpointRestore), 2 * 200);
    // 2050 -> 3000 less the restore.
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 2 * (950 - 200));
    assert_eq!(ms(&l, "j", Cause::Productive), 2 * (1000 + 500));
    let rep = l.report("j", 0).unwrap();
    assert_eq!(rep.restarts, 1);
    assert_eq!(rep.occ.restarts, (2, 2 * 750 * MS as i64));
    assert_eq!(rep.occ.detections, (2, 0));
    assert_eq!(rep.parts.total(), 2 * 4000 * MS as i64);
}

/// A warm restart: the new processes step within ~0.1 s, before the agent
/// has reported every stopped process of the old attempt. A late exit of an
/// older process (stopped or failed) is no new incident: the new attempt's
/// redone steps stay lost progress, not downtime.
#[test]
fn a_late_exit_of_an_older_process_does_not_disrupt_its_replacement() {
    let mut l = Ledger::default();
    for rank in 0..2 {
        l.registered("j", rank, 10 + rank, 0, 100 * MS);
        for n in 0..10 {
            l.step("j", rank, step(10 + rank, n, 1000 + n * 100, 100));
        }
    }
    l.exited("j", 1, 11, ExitKind::Failed, 2050 * MS);
    for rank in 0..2 {
        l.registered("j", rank, 20 + rank, 2200 * MS, 2250 * MS);
    }
    l.step("j", 0, step(20, 5, 2300, 100));
    l.step("j", 1, step(21, 5, 2300, 100));
    // Rank 0's old process read as stopped only now; a straggling failed
    // report of rank 1's old one too.
    l.exited("j", 0, 10, ExitKind::StoppedForRestart, 2420 * MS);
    l.exited("j", 1, 11, ExitKind::Failed, 2430 * MS);
    for rank in 0..2 {
        for n in 6..15 {
            l.step("j", rank, step(20 + rank, n, 2400 + (n - 5) * 100, 100));
        }
    }
    l.close("j", 3400 * MS);
    assert_sums(&l, "j");
    // Steps 5..=9 redone on both ranks, and the 50 ms of step 10 in flight.
    assert_eq!(ms(&l, "j", Cause::LostProgress), 2 * (500 + 50));
    assert_eq!(l.report("j", 0).unwrap().restarts, 1);
}

#[test]
fn old_attempt_steps_after_the_incident_are_downtime() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    l.registered("j", 1, 11, 0, 0);
    l.step("j", 0, step(10, 0, 0, 100));
    l.step("j", 1, step(11, 0, 0, 100));
    // Rank 1 hangs; declared at 1000 ms. Rank 0 keeps stepping a while.
    l.step("j", 0, step(10, 1, 100, 100));
    l.incident("j", 1000 * MS);
    l.step("j", 0, step(10, 2, 1000, 100));
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 800 + 900);
    // Not a restart: the same process, no resume.
    assert!(matches!(
        l.jobs["j"].ranks[&0].phase,
        Phase::Disrupted { .. }
    ));
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 100);
}

#[test]
fn in_process_restart_resumes_the_same_process() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    for n in 0..5 {
        l.step("j", 0, step(10, n, n * 100, 100));
    }
    l.incident("j", 900 * MS);
    l.resumed("j", 1000 * MS);
    l.step("j", 0, step(10, 3, 1200, 100));
    l.step("j", 0, step(10, 5, 1300, 100));
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 300);
    // 500 -> 900: one step's baseline (100 ms) of step 5 in flight, lost;
    // the rest detection wait. Then step 3 redone.
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 300);
    assert_eq!(ms(&l, "j", Cause::LostProgress), 100 + 100);
    assert_eq!(ms(&l, "j", Cause::Productive), 600);
}

#[test]
fn save_stall_comes_out_of_idle_then_productive_and_never_below_zero() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    l.step("j", 0, step(10, 0, 0, 100));
    l.step("j", 0, step(10, 1, 150, 100)); // 50 ms idle
    l.saved("j", 0, 80 * MS as i64);
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::CheckpointSave), 80);
    assert_eq!(ms(&l, "j", Cause::Idle), 0);
    assert_eq!(ms(&l, "j", Cause::Productive), 170);
    // A stall larger than everything: the rest waits for later time.
    l.saved("j", 0, 1000 * MS as i64);
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::Productive), 0);
    l.step("j", 0, step(10, 2, 250, 100));
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::CheckpointSave), 350);
    assert_eq!(l.jobs["j"].ranks[&0].save_debt_ns, 730 * MS as i64);
    let rep = l.report("j", 0).unwrap();
    assert_eq!(rep.saves, 2);
}

#[test]
fn data_wait_and_straggler_drag_are_above_baselines() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    let mut t = 0;
    for n in 0..10 {
        l.step(
            "j",
            0,
            StepObs {
                pid: 10,
                step: n,
                start_ns: t * MS,
                duration_ns: 100 * MS,
                data_ns: 20 * MS,
            },
        );
        t += 100;
    }
    // A slow data step: 60 ms of data, 40 above baseline.
    l.step(
        "j",
        0,
        StepObs {
            pid: 10,
            step: 10,
            start_ns: t * MS,
            duration_ns: 140 * MS,
            data_ns: 60 * MS,
        },
    );
    t += 140;
    assert_eq!(ms(&l, "j", Cause::DataWait), 40);
    // A straggler in the job: a 150 ms step is 50 ms of drag.
    l.straggler("j", 3, true);
    l.step(
        "j",
        0,
        StepObs {
            pid: 10,
            step: 11,
            start_ns: t * MS,
            duration_ns: 150 * MS,
            data_ns: 20 * MS,
        },
    );
    l.straggler("j", 3, false);
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::StragglerDrag), 50);
    assert_eq!(ms(&l, "j", Cause::Productive), 1000 + 100 + 100);
}

#[test]
fn a_reconnect_of_the_same_process_changes_nothing() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    l.step("j", 0, step(10, 0, 0, 100));
    let before = l.clone();
    l.registered("j", 0, 10, 0, 500 * MS);
    assert_eq!(l, before);
    l.step("j", 0, step(10, 1, 600, 100));
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::Idle), 500);
}

#[test]
fn report_counts_open_downtime_until_now() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    l.step("j", 0, step(10, 0, 0, 100));
    l.incident("j", 200 * MS);
    let rep = l.report("j", 1000 * MS).unwrap();
    assert_eq!(rep.parts.get(Cause::RestartDowntime), 800 * MS as i64);
    assert_eq!(rep.parts.total(), rep.wall_ns);
    assert!(rep.open);
}

#[test]
fn closing_a_job_holds_early_finishers_until_the_end() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    l.registered("j", 1, 11, 0, 0);
    l.step("j", 0, step(10, 0, 0, 100));
    l.step("j", 1, step(11, 0, 0, 300));
    l.exited("j", 0, 10, ExitKind::Clean, 100 * MS);
    l.exited("j", 1, 11, ExitKind::Clean, 300 * MS);
    assert_eq!(l.report("j", 0).unwrap().parts.total(), 400 * MS as i64);
    l.close("j", 300 * MS);
    assert_sums(&l, "j");
    let rep = l.report("j", 0).unwrap();
    assert_eq!(rep.parts.total(), 2 * rep.wall_ns);
    assert_eq!(ms(&l, "j", Cause::Idle), 200);
}

/// A warm restart under load: the scan reads the new processes' first
/// steps before the bus has brought their registrations to the ledger,
/// with the crash's exit seen before them or not yet. The steps' own pids
/// say they are the new attempt's: the redone ones are lost progress, not
/// the old attempt's downtime, and the registrations that follow change
/// nothing.
#[test]
fn a_new_process_stepping_before_its_registration_is_the_new_attempt() {
    for exit_first in [true, false] {
        let mut l = Ledger::default();
        for rank in 0..2 {
            l.registered("j", rank, 10 + rank, 0, 100 * MS);
            for n in 0..10 {
                l.step("j", rank, step(10 + rank, n, 1000 + n * 100, 100));
            }
        }
        let exits = |l: &mut Ledger| {
            l.exited("j", 1, 11, ExitKind::Failed, 2050 * MS);
            l.exited("j", 0, 10, ExitKind::StoppedForRestart, 2100 * MS);
        };
        if exit_first {
            exits(&mut l);
        }
        // Restored from step 5: steps 5..=9 redone, read before the
        // registrations.
        for rank in 0..2 {
            for n in 5..8 {
                l.step("j", rank, step(20 + rank, n, 2300 + (n - 5) * 100, 100));
            }
        }
        if !exit_first {
            exits(&mut l);
        }
        for rank in 0..2 {
            l.registered("j", rank, 20 + rank, 2200 * MS, 2250 * MS);
            for n in 8..15 {
                l.step("j", rank, step(20 + rank, n, 2300 + (n - 5) * 100, 100));
            }
        }
        l.close("j", 3300 * MS);
        assert_sums(&l, "j");
        let what = format!("exit seen first: {exit_first}");
        // The last step's end (2000) -> 2300: when the exit came first,
        // the step in flight to it (50 ms, under the 100 ms baseline: lost
        // progress), then downtime; else all downtime (no incident was
        // seen, only a new process). Once per rank.
        let (in_flight, wait, down) = if exit_first {
            (50, 0, 250)
        } else {
            (0, 0, 300)
        };
        assert_eq!(
            ms(&l, "j", Cause::LostProgress),
            2 * (500 + in_flight),
            "{what}"
        );
        assert_eq!(ms(&l, "j", Cause::Productive), 2 * (1000 + 500), "{what}");
        assert_eq!(ms(&l, "j", Cause::DetectionWait), 2 * wait, "{what}");
        assert_eq!(ms(&l, "j", Cause::RestartDowntime), 2 * down, "{what}");
        let rep = l.report("j", 0).unwrap();
        assert_eq!(rep.restarts, 1, "{what}");
        assert_eq!(rep.occ.restarts.0, 2, "{what}");
    }
}

/// A stop on a notice (preemption, maintenance) is planned: the ranks'
/// exits open no incident, so nothing is detection wait, restart downtime
/// or lost progress; the time after the last step is idle, as at a job's
/// end. A crash at the same moment is an incident (the control).
#[test]
fn a_stop_on_a_notice_is_booked_as_planned_not_as_a_failure() {
    let run = |kind: ExitKind| {
        let mut l = Ledger::default();
        for rank in 0..2 {
            l.registered("j", rank, 10 + rank, 0, 100 * MS);
            for n in 0..10 {
                l.step("j", rank, step(10 + rank, n, 1000 + n * 100, 100));
            }
        }
        for rank in 0..2 {
            l.exited("j", rank, 10 + rank, kind, 2050 * MS);
        }
        l.close("j", 3000 * MS);
        assert_sums(&l, "j");
        l
    };
    let l = run(ExitKind::Preempted);
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 0);
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 0);
    assert_eq!(ms(&l, "j", Cause::LostProgress), 0);
    assert_eq!(l.report("j", 0).unwrap().restarts, 0);
    let crashed = run(ExitKind::Failed);
    assert_eq!(
        ms(&crashed, "j", Cause::LostProgress),
        2 * 50,
        "the step in flight"
    );
}

/// A heal (issue 31 point 5): rank 1 is killed 30 ms into step 10, the
/// survivors go on in process at step 10 and the replacement heals there.
/// What the fault cost in redone work is the step in flight, at most one
/// step's baseline a rank, as lost progress; a hang noticed long after
/// the step would have ended is one step lost and the rest detection wait.
#[test]
fn a_heals_redone_work_is_the_step_in_flight_at_most_one_step() {
    let mut l = Ledger::default();
    for rank in 0..2 {
        l.registered("j", rank, 10 + rank, 0, 100 * MS);
        for n in 0..10 {
            l.step("j", rank, step(10 + rank, n, 1000 + n * 100, 100));
        }
    }
    l.exited("j", 1, 11, ExitKind::Failed, 2030 * MS);
    l.resumed("j", 2100 * MS);
    l.registered("j", 1, 21, 2040 * MS, 2080 * MS);
    for rank in 0..2 {
        for n in 10..20 {
            l.step(
                "j",
                rank,
                step([10, 21][rank as usize], n, 2150 + (n - 10) * 100, 100),
            );
        }
    }
    l.close("j", 3150 * MS);
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::LostProgress), 2 * 30);
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 0);
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 2 * 120);
    assert_eq!(ms(&l, "j", Cause::Productive), 2 * 2000);

    // A hang declared 1.5 s after the last step: one step lost a rank.
    let mut h = Ledger::default();
    for rank in 0..2 {
        h.registered("j", rank, 10 + rank, 0, 100 * MS);
        for n in 0..10 {
            h.step("j", rank, step(10 + rank, n, 1000 + n * 100, 100));
        }
    }
    h.incident("j", 3500 * MS);
    assert_sums(&h, "j");
    assert_eq!(ms(&h, "j", Cause::LostProgress), 2 * 100);
    assert_eq!(ms(&h, "j", Cause::DetectionWait), 2 * 1400);
}

/// A survivor of a lost host waits for that host's heal in its client's
/// `heal_wait` section, in the same process, with no incident on its own
/// host: the gap is the fault's, not idle.
#[test]
fn a_survivors_wait_for_a_lost_peers_heal_is_booked_as_a_restart_not_idle() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    // Steps 0..9 of 100 ms every 110 ms: the last ends at 1000 + 990 + 100.
    for n in 0..10 {
        l.step("j", 0, step(10, n, 1000 + n * 110, 100));
    }
    let idle_before = ms(&l, "j", Cause::Idle);
    // Step 10 began at 2100 and failed on the lost peer: heal_wait at 2400.
    l.heal_wait("j", 0, 2400 * MS);
    // The heal and the new round: step 10 again from 4400.
    l.step("j", 0, step(10, 10, 4400, 100));
    assert_sums(&l, "j");
    assert_eq!(
        ms(&l, "j", Cause::Idle),
        idle_before,
        "the wait was booked idle"
    );
    // The step in flight (up to one baseline step; it never completed, so
    // its run after the heal is no redone number), then the wait to the
    // failure, then the heal.
    assert_eq!(ms(&l, "j", Cause::LostProgress), 100);
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 2400 - 2090 - 100);
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 4400 - 2400);
    let rep = l.report("j", 0).unwrap();
    assert_eq!(rep.occ.restarts, (1, 2000 * MS as i64));
    assert_eq!(rep.occ.detections.0, 1);
    // The next gap is idle again: the wait is taken once.
    let idle = ms(&l, "j", Cause::Idle);
    l.step("j", 0, step(10, 11, 4600, 100));
    assert_eq!(ms(&l, "j", Cause::Idle), idle + 100);
}

/// A wait seen before the scan's older step (the one it interrupted came
/// in the same scan after it) waits for the step after it; one behind the
/// cursor is dropped.
#[test]
fn a_heal_wait_applies_to_the_first_step_after_it() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    for n in 0..5 {
        l.step("j", 0, step(10, n, 1000 + n * 110, 100));
    }
    // The wait at 1700, then a step that began at 1550 (before it).
    l.heal_wait("j", 0, 1700 * MS);
    l.step("j", 0, step(10, 5, 1550, 100));
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 0);
    l.step("j", 0, step(10, 6, 3000, 100));
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 3000 - 1700);
    assert_sums(&l, "j");
    // A wait behind the cursor is no wait.
    l.heal_wait("j", 0, 3050 * MS);
    let idle = ms(&l, "j", Cause::Idle);
    l.step("j", 0, step(10, 7, 3200, 100));
    assert_eq!(ms(&l, "j", Cause::Idle), idle + 100);
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 1300);
}

/// A client that marks only each step's start: the interrupted step's
/// record runs on through the wait until the next step begins. That
/// record is the attempt the heal redoes: nothing of it is productive, and
/// the step after it is not counted as redone.
#[test]
fn a_heal_wait_inside_a_steps_record_books_that_record_as_the_fault() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    for n in 0..10 {
        l.step("j", 0, step(10, n, 1000 + n * 110, 100));
    }
    let productive = ms(&l, "j", Cause::Productive);
    l.heal_wait("j", 0, 2400 * MS);
    // Step 10's record: from 2100 to 4400, ended by the next begin.
    l.step("j", 0, step(10, 10, 2100, 2300));
    l.step("j", 0, step(10, 10, 4400, 100));
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::Productive), productive + 100);
    assert_eq!(ms(&l, "j", Cause::LostProgress), 100);
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 2400 - 2100 - 100);
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 4400 - 2400);
    let rep = l.report("j", 0).unwrap();
    assert_eq!(rep.occ.restarts, (1, 2000 * MS as i64));
}

/// The scan cuts a step record that held the wait where the wait began, so
/// the wait starts exactly at the cursor: still the heal's, not stale.
#[test]
fn a_heal_wait_at_the_cursor_is_the_heals() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    for n in 0..10 {
        l.step("j", 0, step(10, n, 1000 + n * 110, 100));
    }
    // Step 10 from 2100, cut at 2150 where the wait began (a later scan
    // reports the wait).
    l.step("j", 0, step(10, 10, 2100, 50));
    l.heal_wait("j", 0, 2150 * MS);
    l.step("j", 0, step(10, 10, 4000, 100));
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 4000 - 2150);
}

/// The step in flight has its own record, ended at the failure (Python's
/// step context): its redo after the heal is the lost step, and the gap
/// between the record and the wait (the error's handling) is detection,
/// not a second step lost.
#[test]
fn a_heal_after_a_recorded_failure_loses_one_step_not_two() {
    let mut l = Ledger::default();
    l.registered("j", 0, 10, 0, 0);
    for n in 0..10 {
        l.step("j", 0, step(10, n, 1000 + n * 110, 100));
    }
    l.step("j", 0, step(10, 10, 2100, 50));
    l.heal_wait("j", 0, 2200 * MS);
    l.step("j", 0, step(10, 10, 4000, 100));
    assert_sums(&l, "j");
    assert_eq!(ms(&l, "j", Cause::LostProgress), 100, "the redo only");
    assert_eq!(ms(&l, "j", Cause::DetectionWait), 50);
    assert_eq!(ms(&l, "j", Cause::RestartDowntime), 4000 - 2200);
}
