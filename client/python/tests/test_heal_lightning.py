"""A Lightning DDP fit heals from a live replica (issue 31) under the real ``warden run``.

examples/heal/lightning_ddp.py (a LightningModule with dropout, Adam and a
step LR schedule, a shuffled DataLoader over several epochs,
``WardenDDPStrategy`` and ``WardenCallback``) runs as WORLD gloo ranks on
the CPU under the real ``warden`` binary (its embedded agent). A fault-free
run gives the reference digests (sha256 of every parameter and optimizer
tensor). Then, each in its own run, ranks are SIGKILLed from outside
mid-epoch, between two checkpoints (the faults of tests/torch_heal.rs):

1. one rank;
2. a fault during the heal: a survivor killed as soon as the launcher says
   it heals the first;
3. two faults in a row: rank 1 at step 35, another rank at step 50 once
   every rank stepped again;
4. one rank, under manual optimization (``automatic_optimization = False``:
   the module steps two optimizers and their LR schedules itself, so
   Lightning's global step moves by two a batch), against a fault-free run
   of its own;
5. under manual optimization, a rank lost between the update and the
   batch's end while the others wait in a collective there (an all_reduce
   of the loss, as ``self.log(..., sync_dist=True)`` after ``opt.step()``):
   every survivor's update is begun and not committed, so no live rank
   holds a committed step; the job falls back to the tier, says so, and
   still ends with the fault-free digests;
6. FSDP2 in replica groups (HSDP, examples/heal/lightning_hsdp.py:
   ``WardenModelParallelStrategy(heal=True)``, 2 replica groups of 2
   shards), against a fault-free run of its own: one rank, healed from the
   rank of its shard position in the other replica group;
7. HSDP, a fault during the heal: rank 1, then the survivor rank 2 as soon
   as the launcher says it heals rank 1 (each healed from the other replica
   group's holder of its shard: ranks 3 and 0);
8. HSDP with both holders of one shard position killed at once: no live
   rank holds those shards, so every rank restores the tier's sharded
   checkpoint, says so, and still ends with the fault-free digests.

Each run must:

- exit 0;
- end with every rank's digest equal to the fault-free run's (the healed
  rank got module, optimizer, LR schedule, global step, epoch and batch
  position from a live peer; a wrong batch, step or RNG changes the bits);
- keep the survivors' processes (one pid each in the log), but for a
  survivor that says it left blocked in a gloo collective (exit 75) to be
  healed in turn, as tests/torch_heal.rs allows;
- log no (rank, step) more than twice (at most the step in flight redone);
- heal (a replacement says it took its state from a live rank) and never
  restore a checkpoint or restart in job.

The time from each kill to every rank logging a new step is printed, not
asserted. The launcher's output (a file) and the log are polled with a
deadline, never slept on. Needs PyTorch Lightning (tests/frameworks-venv.sh)
and the ``warden`` binary (the wheel's, or ``$WARDEN_TEST_WARDEN``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Dict

import pytest
from conftest import require_framework
from heal_run import HealJob, read, sigkill, story
from wardend import ROOT

JOB = HealJob(
    example=ROOT / "examples" / "heal" / "lightning_ddp.py",
    framework="Lightning",
    module="pytorch_lightning",
    preload="pytorch_lightning",
    prefix="lightning-heal",
    # Ranks: 4 as the heal's other tests; WARDEN_TEST_HEAL_WORLD=2 on a
    # machine too small for 8 interpreters.
    world=int(os.environ.get("WARDEN_TEST_HEAL_WORLD", "4")),
    steps=90,
    ckpt_every=30,
)


#: The same job under manual optimization.
MANUAL = dataclasses.replace(JOB, prefix="lightning-heal-manual", env=(("EXAMPLE_OPTIMIZATION", "manual"),))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[int, str]:
    require_framework("pytorch_lightning")
    return JOB.reference(tmp_path_factory.mktemp("lightning-heal-ref"))


def test_a_rank_killed_mid_epoch_heals_from_a_live_replica(
    reference: Dict[int, str], tmp_path: Path
) -> None:
    proc, log, out = JOB.launch(tmp_path, "kill")
    # Step 40: past the checkpoint at 30, before the one at 60, and inside
    # an epoch (24 batches a rank: epoch 1, batch 17).
    pid = JOB.wait_step(proc, out, log, 1, 40)
    JOB.check(proc, out, log, reference, [sigkill(pid)], 1)


def test_a_fault_during_the_heal_heals_again(reference: Dict[int, str], tmp_path: Path) -> None:
    proc, log, out = JOB.launch(tmp_path, "during")
    # Rank 1 at step 40; the survivor rank 2 (its pid from the log) as soon
    # as the launcher says it heals rank 1: while the survivors abort and
    # rebuild their group and the replacement comes up from its standby.
    victim = JOB.wait_step(proc, out, log, 1, 40)
    survivor = JOB.wait_step(proc, out, log, 2, 40)
    first = sigkill(victim)
    JOB.wait_said(proc, out, "healing it from a live replica")
    second = sigkill(survivor)
    # One heal at least: the launcher may heal both lost ranks in one attempt.
    JOB.check(proc, out, log, reference, [first, second], 1)


def test_two_faults_in_a_row_heal_twice(reference: Dict[int, str], tmp_path: Path) -> None:
    proc, log, out = JOB.launch(tmp_path, "twice")
    # Rank 1 at step 35; then, once every rank stepped again after that
    # heal, another rank at step 50: both between the checkpoints at 30 and
    # 60, so a checkpoint restart would redo steps the test counts.
    first = sigkill(JOB.wait_step(proc, out, log, 1, 35))
    for rank in range(JOB.world):
        JOB.wait_step(proc, out, log, rank, 45)
    second = sigkill(JOB.wait_step(proc, out, log, 2 if JOB.world > 2 else 0, 50))
    JOB.check(proc, out, log, reference, [first, second], 2)


@pytest.fixture(scope="module")
def manual_reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[int, str]:
    require_framework("pytorch_lightning")
    return MANUAL.reference(tmp_path_factory.mktemp("lightning-heal-manual-ref"))


def test_manual_optimization_heals_from_a_live_replica(manual_reference: Dict[int, str], tmp_path: Path) -> None:
    reference = manual_reference
    proc, log, out = MANUAL.launch(tmp_path, "manual")
    # Step 41 (the 21st batch: two optimizer steps a batch): past the
    # checkpoint at 30, before the one at 60, inside the first epoch.
    pid = MANUAL.wait_step(proc, out, log, 1, 40)
    MANUAL.check(proc, out, log, reference, [sigkill(pid)], 1)


def test_a_fault_after_a_manual_update_falls_back_to_the_tier(manual_reference: Dict[int, str], tmp_path: Path) -> None:
    # The same job with an all_reduce of the loss after each update (it
    # changes no parameter: the fault-free digests are the manual job's),
    # and rank 1 gone once right after the update that reaches step 40.
    job = dataclasses.replace(
        MANUAL, env=MANUAL.env + (("EXAMPLE_SYNC_AFTER_UPDATE", "1"), ("EXAMPLE_DIE_AT", "40"))
    )
    proc, log, out = job.launch(tmp_path, "torn")
    said = job.finish(proc, out)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{story(said)}"
    steps, digests = read(log)
    assert digests == manual_reference, f"digests against the fault-free run\n{story(said)}"
    # Said, not silent: the update was interrupted, and the state came
    # from the checkpoint at 30 (the newest before the fault), not a peer.
    assert "was interrupted: it receives the state" in said, story(said)
    assert "no live replica holds the state: restored from the checkpoint at step 30" in said, story(said)
    assert "healed from rank" not in said, story(said)
    assert "restarting in job" not in said, story(said)
    # The survivors kept their processes; rank 1 is one new process.
    for rank in range(job.world):
        pids = {p for _, _, r, p in steps if r == rank}
        assert len(pids) == (2 if rank == 1 else 1), f"rank {rank}: {pids}\n{story(said)}"


#: FSDP2 in replica groups: 2 groups of 2 shards, so 4 ranks whatever
#: WARDEN_TEST_HEAL_WORLD says (with 2, no shard would have a replica).
HSDP = dataclasses.replace(
    JOB, example=ROOT / "examples" / "heal" / "lightning_hsdp.py", prefix="lightning-heal-hsdp", world=4
)


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[int, str]:
    require_framework("pytorch_lightning")
    return HSDP.reference(tmp_path_factory.mktemp("lightning-heal-hsdp-ref"))


def test_hsdp_a_rank_killed_heals_from_its_shard_position(hsdp_reference: Dict[int, str], tmp_path: Path) -> None:
    proc, log, out = HSDP.launch(tmp_path, "hsdp")
    pid = HSDP.wait_step(proc, out, log, 1, 40)
    HSDP.check(proc, out, log, hsdp_reference, [sigkill(pid)], 1)
    said = out.read_text()
    # Rank 1 holds shard 1 of replica group 0: only rank 3 (shard 1 of group
    # 1) holds the same shards, so the plan has it send, and no one else.
    assert "rank 1: healed from rank 3 at step" in said, story(said)
    assert "rank 3 sent step" in said, story(said)


def test_hsdp_a_fault_during_the_heal_heals_again(hsdp_reference: Dict[int, str], tmp_path: Path) -> None:
    proc, log, out = HSDP.launch(tmp_path, "hsdp-during")
    victim = HSDP.wait_step(proc, out, log, 1, 40)
    survivor = HSDP.wait_step(proc, out, log, 2, 40)
    first = sigkill(victim)
    HSDP.wait_said(proc, out, "healing it from a live replica")
    second = sigkill(survivor)
    # One heal at least: the launcher may heal both lost ranks in one attempt.
    HSDP.check(proc, out, log, hsdp_reference, [first, second], 1)
    said = out.read_text()
    # Whoever was behind took its shards from its own shard position only.
    for wrong in ("rank 1: healed from rank 0", "rank 1: healed from rank 2", "rank 2: healed from rank 1",
                  "rank 2: healed from rank 3"):
        assert wrong not in said, f"{wrong!r}\n{story(said)}"


def test_hsdp_a_shard_position_with_no_live_replica_falls_back_to_the_tier(
    hsdp_reference: Dict[int, str], tmp_path: Path
) -> None:
    proc, log, out = HSDP.launch(tmp_path, "hsdp-lost")
    # Both holders of shard 1 (rank 1 in group 0, rank 3 in group 1) at once,
    # past the checkpoint at 30 and before the one at 60.
    a = HSDP.wait_step(proc, out, log, 1, 40)
    b = HSDP.wait_step(proc, out, log, 3, 40)
    sigkill(a)
    sigkill(b)
    said = HSDP.finish(proc, out)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{story(said)}"
    steps, digests = read(log)
    assert digests == hsdp_reference, f"digests against the fault-free run\n{story(said)}"
    for text in ("no live replica holds shard position (1,)", "restored from the checkpoint at step 30"):
        assert text in said, f"{text!r}\n{story(said)}"
    assert "restarting in job" not in said, story(said)
    # The survivors (ranks 0 and 2) kept their processes.
    for rank in (0, 2):
        pids = {p for _, _, r, p in steps if r == rank}
        assert len(pids) == 1, f"rank {rank}: {pids}\n{story(said)}"
