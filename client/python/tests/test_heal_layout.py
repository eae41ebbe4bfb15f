"""warden.heal_layout: the heal's plan from a layout, and an HSDP heal with real torch.

The plan is a pure function (a table of cases). The heal runs four real
gloo ranks (jobs/heal_hsdp_job.py) of FSDP2 over a 2 x 2 mesh ("replicate",
"shard"), without a launcher: a lost rank is one that builds its state
afresh, the restart a process group and mesh made again. Its ranks cannot
import numpy (tests/no_numpy), as with torch installed alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import warden
from conftest import JOBS, NO_NUMPY, require_framework, run_processes
from warden.heal_layout import Layout, plan

#: 2 replica groups x 2 shards: rank r at (r // 2, r % 2).
HSDP = Layout(shape=(2, 2), names=("replicate", "shard"), replicate_dims=(0,), ranks=(0, 1, 2, 3))


@pytest.mark.parametrize(
    "steps, keys, best, sources, lost",
    [
        # Plain DDP: one key; the lowest rank at the newest step sends.
        ([5, -1, 5, 5], [()] * 4, 5, {1: 0}, ()),
        ([5, 5, 5, 5], [()] * 4, 5, {}, ()),
        ([4, 5, 5, -1], [()] * 4, 5, {0: 1, 3: 1}, ()),
        ([-1, -1], [()] * 2, -1, {}, ()),
        # HSDP: a rank takes its shard from its own shard position only.
        ([5, -1, 5, 5], [HSDP.key(r) for r in range(4)], 5, {1: 3}, ()),
        ([-1, 5, 5, -1], [HSDP.key(r) for r in range(4)], 5, {0: 2, 3: 1}, ()),
        # Shard position 1 is gone (ranks 1 and 3): nobody can send it.
        ([5, -1, 5, -1], [HSDP.key(r) for r in range(4)], 5, {}, ((1,),)),
        # Its only holder is a step behind: no live replica of the newest step.
        ([5, 4, 5, -1], [HSDP.key(r) for r in range(4)], 5, {}, ((1,),)),
    ],
)
def test_plan(steps, keys, best, sources, lost) -> None:
    p = plan(steps, keys)
    assert (p.best, p.sources, p.lost) == (best, sources, lost)


def test_plan_refuses_a_count_mismatch() -> None:
    with pytest.raises(ValueError, match="3 steps for 2 ranks"):
        plan([1, 2, 3], [(), ()])


def test_an_fsdp2_without_reset_iter_state_is_refused_at_declare() -> None:
    # torch 2.11's FSDPModule (seen on a GPU machine): no reset_iter_state,
    # so a heal could not clear the iteration a fault cut short.
    from warden.heal_layout import LayoutError, require_iter_reset

    class OldFSDPModule:
        pass

    class NewFSDPModule:
        def reset_iter_state(self) -> None:
            pass

    with pytest.raises(LayoutError, match="needs torch 2.15 or newer"):
        require_iter_reset(OldFSDPModule)
    require_iter_reset(NewFSDPModule)
    require_iter_reset(None)  # FSDP never imported: nothing to clear


def test_layout_keys_and_coordinates() -> None:
    assert [HSDP.key(r) for r in range(4)] == [(0,), (1,), (0,), (1,)]
    assert HSDP.coords(3) == (1, 1)
    # A mesh whose ranks are not in order: positions, not rank numbers.
    odd = Layout(shape=(2, 2), names=("replicate", "shard"), replicate_dims=(0,), ranks=(3, 2, 1, 0))
    assert odd.key(3) == (0,) and odd.key(1) == (0,) and odd.key(0) == (1,)
    assert "replicate=2 (replicate)" in HSDP.describe()
    with pytest.raises(RuntimeError, match="rank 7 is not in"):
        HSDP.key(7)


def test_an_hsdp_rank_heals_from_its_shard_position_or_the_job_restores(tmp_path) -> None:
    require_framework("torch")
    envs = []
    for rank in range(4):
        # The warden this test imported (the wheel, or the sources ahead of it),
        # and no numpy: the heal's transfer takes bytes from tensors without it
        # (torch does not install numpy).
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(warden.__file__)), str(NO_NUMPY),
             os.environ.get("PYTHONPATH", "")]))
        env.pop("WARDEN_HEAL_FILE", None)
        envs.append(env)
    codes = run_processes(
        [[sys.executable, str(JOBS / "heal_hsdp_job.py"), str(tmp_path), str(tmp_path / f"rank{rank}.json")]
         for rank in range(4)],
        envs,
        [tmp_path / f"rank{rank}.log" for rank in range(4)],
    )
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(4))
    assert codes == [0] * 4, logs
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(4)]
    reference = r[0]["none"]["digest"]
    assert [x["numpy"] for x in r] == [False] * 4
    for i in range(4):
        # Every mode ends with the same weights on every rank.
        assert {r[i][m]["digest"] for m in ("none", "one", "lost")} == {reference}, (i, r[i], logs)
        assert r[i]["none"]["start"] == 4 and r[i]["one"]["start"] == 4, r[i]
        assert r[i]["lost"]["start"] == 2, r[i]
        assert r[i]["lost"]["last"] == "restored from the checkpoint at step 2", r[i]
        assert r[i]["none"]["released"] == 3, r[i]  # two layers and the root
    assert r[1]["one"]["last"].startswith("healed from rank 3 at step 4"), r[1]
    assert r[3]["one"]["last"] == "rank 3 sent step 4 to rank 1", r[3]
    assert "no live replica holds shard position (1,)" in logs


def test_shared_rng_state_is_carried_and_applied() -> None:
    # rng="shared": the loop state a heal sends holds the source's torch and
    # Python generators (and the CUDA device's where CUDA is initialized:
    # tests/hw/heal_cuda_rng.py on a GPU); applied, the receiver draws what
    # the source drew after taking it. In a process of its own: declare
    # installs process-wide hooks.
    code = """
import random, sys, torch, warden.heal
state = warden.heal.declare(torch.nn.Linear(2, 2), None, rng="shared")
torch.manual_seed(3); random.seed(3)
snap = state._snapshot_loop()
assert "cuda" not in snap or torch.cuda.is_initialized(), sorted(snap)
first = (torch.rand(4).tolist(), random.random())
other = (torch.rand(4).tolist(), random.random())
state._apply_loop(snap)
again = (torch.rand(4).tolist(), random.random())
assert again == first and other != first, (first, other, again)
print("ok")
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-3000:]
