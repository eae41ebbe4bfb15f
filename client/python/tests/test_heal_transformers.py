"""A Transformers Trainer (DDP) heals from a live replica (issue 31) under the real ``warden run``.

examples/heal/transformers_ddp.py (a tiny GPT-2 from its config, with
dropout, AdamW, a linear LR schedule with warm-up and gradient accumulation,
a dataset of several epochs shuffled by the Trainer,
``WardenTrainingArguments``, ``WardenTrainer`` and ``WardenCallback``) runs
as WORLD gloo ranks on the CPU under the real ``warden`` binary (its
embedded agent). A fault-free
run gives the reference digests (sha256 of every parameter and optimizer
tensor). Then one rank is SIGKILLed mid-epoch between two checkpoints; the
run must:

- exit 0;
- end with every rank's digest equal to the fault-free run's (the healed
  rank got model, optimizer, LR schedule and the Trainer's progress (global
  step, epoch, so the batch position) from a live peer; a wrong batch, step
  or RNG changes the bits);
- keep the survivors' processes (one pid each in the log), but for a
  survivor that says it left blocked in a gloo collective (exit 75) to be
  healed in turn, as tests/torch_heal.rs allows;
- log no (rank, step) more than twice (at most the step in flight redone);
- heal (the replacement says it took its state from a live rank) and never
  restore a checkpoint or restart in job.

The same checks hold for a fault during the heal (a survivor killed as the
launcher heals the first rank) and for two faults in a row (a second rank
killed once every rank stepped again after the first heal).

And with no live replica (the whole job killed once the tier holds a
checkpoint, then started again as the same job), every rank restores the
tier's newest checkpoint and the job ends with the same digests.

The time from the kill to every rank logging a new step is printed, not
asserted. Needs Transformers and Accelerate (tests/frameworks-venv.sh) and the
``warden`` binary (the wheel's, or ``$WARDEN_TEST_WARDEN``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict

import pytest
from conftest import require_framework
from heal_run import HealJob, read, sigkill, story
from wardend import ROOT, find_binary

JOB = HealJob(
    example=ROOT / "examples" / "heal" / "transformers_ddp.py",
    framework="Transformers",
    module="transformers",
    # The standbys a replacement starts from import the Trainer too:
    # imported cold on the heal's path it takes seconds here.
    preload="transformers,transformers.trainer",
    prefix="transformers-heal",
    world=int(os.environ.get("WARDEN_TEST_HEAL_WORLD", "4")),
    steps=90,
    ckpt_every=30,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[int, str]:
    require_framework("transformers")
    require_framework("accelerate")
    return JOB.reference(tmp_path_factory.mktemp("transformers-heal-ref"))


def test_a_rank_killed_mid_epoch_heals_from_a_live_replica(
    reference: Dict[int, str], tmp_path: Path
) -> None:
    proc, log, out = JOB.launch(tmp_path, "kill")
    # Step 40: past the checkpoint at 30, before the one at 60, and inside
    # an epoch (12 optimizer steps of 2 micro-batches a rank: epoch 3, step 4).
    pid = JOB.wait_step(proc, out, log, 1, 40)
    JOB.check(proc, out, log, reference, [sigkill(pid)], 1)


def test_a_fault_during_the_heal_heals_again(reference: Dict[int, str], tmp_path: Path) -> None:
    """Rank 1 at step 40; the survivor rank 2 (its pid from the log) as soon
    as the launcher says it heals rank 1: while the survivors abort and
    rebuild their group, leave their Trainer's ``train`` and enter the next
    one, and the replacement comes up from its standby."""
    proc, log, out = JOB.launch(tmp_path, "during")
    victim = JOB.wait_step(proc, out, log, 1, 40)
    survivor = JOB.wait_step(proc, out, log, 2 if JOB.world > 2 else 0, 40)
    first = sigkill(victim)
    JOB.wait_said(proc, out, "healing it from a live replica")
    second = sigkill(survivor)
    # One heal at least: the launcher may heal both lost ranks in one attempt.
    JOB.check(proc, out, log, reference, [first, second], 1)


def test_two_faults_in_a_row_heal_twice(reference: Dict[int, str], tmp_path: Path) -> None:
    """Rank 1 at step 35; then, once every rank stepped again after that
    heal, another rank at step 50: both between the checkpoints at 30 and
    60, so a checkpoint restart would redo steps the test counts."""
    proc, log, out = JOB.launch(tmp_path, "twice")
    first = sigkill(JOB.wait_step(proc, out, log, 1, 35))
    for rank in range(JOB.world):
        JOB.wait_step(proc, out, log, rank, 45)
    second = sigkill(JOB.wait_step(proc, out, log, 2 if JOB.world > 2 else 0, 50))
    JOB.check(proc, out, log, reference, [first, second], 2)


def test_with_no_live_replica_the_job_resumes_from_the_tier(reference: Dict[int, str], tmp_path: Path) -> None:
    """Every replica lost (the whole job killed once the tier holds its
    checkpoint of step 30, then started again as the same job): no rank
    holds a live state, so every rank restores the tier's newest checkpoint
    (the Trainer's own directory, copied there by WardenCallback) and the
    job ends with the fault-free digests."""
    job = f"transformers-heal-tier-{os.getpid()}-{time.monotonic_ns()}"
    proc, log, out = JOB.launch(tmp_path, "first", job, standbys=0)
    warden = find_binary("warden")
    socket_of = re.compile(r"running the agent embedded in this launcher \(socket ([^,]+),")

    def tier_holds_a_step() -> bool:
        # Asked only once a checkpoint was saved (every rank past step 30).
        found = socket_of.search(out.read_text(errors="replace"))
        done = {r for _, s, r, _ in read(log)[0] if s >= JOB.ckpt_every - 1}
        if not found or len(done) < JOB.world:
            return False
        ls = subprocess.run(
            [warden, "--socket", found.group(1), "--json", "ckpt", "ls", "--job", job],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if ls.returncode != 0:
            return False
        listed = json.loads(ls.stdout)
        return any(s.get("complete") for s in listed.get("steps", []))

    JOB.wait(proc, out, "the tier held a complete checkpoint", tier_holds_a_step)
    # The launcher, its embedded agent, its workers and its standbys (one session).
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before, _ = read(log)
    assert max(s for _, s, _, _ in before) < JOB.steps - 1, "the first run ended before it was killed"
    proc, log, out = JOB.launch(tmp_path, "again", job, standbys=0)
    said = JOB.finish(proc, out)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{story(said)}"
    steps, digests = read(log)
    assert digests == reference, f"digests against the fault-free run\n{story(said)}"
    # The first step each rank ran again: the one after the tier's newest
    # checkpoint (30, or 60 when that one completed before the kill).
    first = {rank: min(s for _, s, r, _ in steps if r == rank) for rank in range(JOB.world)}
    assert len(set(first.values())) == 1, f"first steps differ: {first}\n{story(said)}"
    (resumed,) = set(first.values())
    assert resumed > 0 and resumed % JOB.ckpt_every == 0, f"first step {resumed}: not from the tier\n{story(said)}"
    assert "healed from rank" not in said, story(said)
