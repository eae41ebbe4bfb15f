"""A rank of 2 (gloo) whose agent sees the newest step differently from
the other rank's for a moment, as at a restart while a save commits.

    python agree_job.py race STORE OUT
    python agree_job.py unreachable STORE OUT   # rank 1's agent cannot be reached

Each phase: rank 0 saves step N alone, then restores the newest step (N is
not complete yet: rank 1 has not saved it), and says so through a file
store; only then does rank 1 save N and restore the newest (now N). The
first phase loads with ``agree=False``, as every rank did before the step
was agreed: the two ranks resume from different steps, which shows the
race is real. The second loads with the default: both resume from the
newer step. The third damages rank 0's shard of the newer step in the
tier: both resume from the older. Writes to OUT (JSON) the steps and whether each loaded state
is the one this rank saved at that step. ``unreachable``: rank 1 points at
no agent, and both ranks write what their load raised.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

if sys.argv[1] == "unreachable" and os.environ.get("RANK") == "1":
    # Before warden is imported: this rank's agent is nowhere.
    os.environ["WARDEN_SOCKET"] = sys.argv[2] + ".nobody.sock"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import warden.checkpoint as ckpt  # noqa: E402


def state(rank: int, step: int) -> dict:
    return {"w": torch.full((8,), float(rank * 1000 + step)), "step": torch.tensor(step)}


def is_state(loaded: dict, rank: int, step: int) -> bool:
    want = state(rank, step)
    return all(torch.equal(loaded[k], want[k]) for k in want)


def init(store_path: str) -> tuple:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world, timeout=timedelta(seconds=240)
    )
    return rank, world


def unreachable(store_path: str, out: str) -> None:
    rank, _world = init(store_path)
    if rank == 0:
        ckpt.save_state_dict(5, state(rank, 5))
    try:
        ckpt.load_state_dict()
        raised = ""
    except ckpt.CheckpointError as e:
        raised = str(e)
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"raised": raised}, f)


def race(store_path: str, out: str) -> None:
    rank, world = init(store_path)
    # A second store for this test's own signals, beside the group's.
    signals = dist.FileStore(store_path + ".signals", world)
    signals.set_timeout(timedelta(seconds=240))

    # A fresh start: no rank sees a step, every rank is told None.
    fresh = ckpt.load_state_dict()

    # Each rank keeps what its first restore of a phase answered (its own
    # agent's newest); rank 0's says so through the store too.
    real_restore = ckpt.restore
    phase = {"name": None, "saw": None}

    def restore(step: int = 0, rank_: object = None) -> object:
        r = real_restore(step, rank_)
        if phase["name"] is not None:
            phase["saw"] = r.step if r else 0
            if rank == 0:
                signals.set(phase["name"], str(phase["saw"]))
            phase["name"] = None
        return r

    ckpt.restore = restore

    results = {"fresh": fresh is None}
    # A step 0 saved is a step: both ranks see it, and resume from it.
    ckpt.save_state_dict(0, state(rank, 0))
    dist.barrier()
    zero = ckpt.load_state_dict()
    results["zero"] = zero is not None and zero[0] == 0 and is_state(zero[1], rank, 0)
    for name, step, agree in (("apart", 10, False), ("agreed", 20, None), ("damaged", 30, None)):
        base = step - 5
        ckpt.save_state_dict(base, state(rank, base))
        dist.barrier()
        if name == "damaged":
            results["agreed_step"] = ckpt.agreed_step()
        if rank == 0:
            path = ckpt.save_state_dict(step, state(rank, step))
            if name == "damaged":
                # Every copy of rank 0's shard of the newer step is bad.
                os.chmod(path, 0o600)
                with open(path, "r+b") as f:
                    f.seek(64)
                    f.write(b"\xff" * 64)
            phase["name"] = name
            loaded = ckpt.load_state_dict(agree=agree)
        else:
            # After rank 0's agent has answered without step `step`.
            signals.wait([name])
            ckpt.save_state_dict(step, state(rank, step))
            phase["name"] = name
            loaded = ckpt.load_state_dict(agree=agree)
        got, sd = loaded
        results[name] = {
            "step": got,
            "rank0_saw": int(signals.get(name)),
            "saw": phase["saw"],
            "exact": is_state(sd, rank, got),
        }
        dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    {"race": race, "unreachable": unreachable}[sys.argv[1]](sys.argv[2], sys.argv[3])
