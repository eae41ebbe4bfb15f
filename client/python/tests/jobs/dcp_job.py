"""A rank that saves a state dict with torch.distributed.checkpoint into the
agent's tier (WardenStorageWriter) and loads it back (WardenStorageReader).

    python dcp_job.py single STEP OUT      # one process, no process group
    python dcp_job.py sharded STEP STORE OUT   # a rank of 2 (gloo), DTensors
    python dcp_job.py async STEP STORE OUT     # the same through dcp.async_save
    python dcp_job.py async-fail STEP OUT      # one process: a background failure
    python dcp_job.py fsdp STEP STORE OUT      # a rank of 4 (gloo): FSDP2 and AdamW

Writes to OUT (JSON) what the test checks: the step restored and whether
every tensor came back byte for byte.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import warden.checkpoint as ckpt
from warden.integrations.dcp import StagingPool, WardenStorageReader, WardenStorageWriter


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaNs included, which torch.equal is not)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "half": torch.randn(17, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (9,), generator=g, dtype=torch.int64),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
        # A strided view: only its own elements are saved.
        "view": torch.arange(100, dtype=torch.float64).reshape(10, 10)[:, 2],
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def single(step: int, out: str) -> None:
    src = tensors(1)
    sd = {"model": dict(src), "extra": {"epoch": 3, "note": "hello", "sizes": [1, 2, 3]}}
    dcp.save(sd, storage_writer=WardenStorageWriter(step=step))
    dst = {
        "model": {k: torch.zeros_like(v) for k, v in src.items()},
        "extra": {"epoch": 0, "note": "", "sizes": []},
    }
    reader = WardenStorageReader()
    dcp.load(dst, storage_reader=reader)
    result = {
        "restored_step": reader.restored_step,
        "exact": {k: same_bytes(src[k], dst["model"][k]) for k in src},
        "extra": dst["extra"],
        "listed": ckpt.restore().step,
    }
    with open(out, "w") as f:
        json.dump(result, f)


def sharded(step: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = tensors(7)
    # FSDP-style: each big tensor sharded along dim 0 across the ranks.
    sd = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "ids": distribute_tensor(full["ids"], mesh, [Shard(0)]),
        "replicated": full["half"].clone(),  # the same on every rank: saved once
        f"rank{rank}_only": torch.full((4,), float(rank + 1)),
        "step": step,
    }
    writer = WardenStorageWriter(step=step)
    dcp.save(sd, storage_writer=writer)

    # Back into fresh tensors with the same sharding.
    same = {
        "w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(0)]),
        "ids": distribute_tensor(torch.zeros_like(full["ids"]), mesh, [Shard(0)]),
        "replicated": torch.zeros_like(full["half"]),
        f"rank{rank}_only": torch.zeros(4),
        "step": 0,
    }
    r1 = WardenStorageReader(step=step)
    dcp.load(same, storage_reader=r1)
    exact = {
        "w": same_bytes(same["w"].to_local(), sd["w"].to_local()),
        "ids": same_bytes(same["ids"].to_local(), sd["ids"].to_local()),
        "replicated": same_bytes(same["replicated"], full["half"]),
        "rank_only": same_bytes(same[f"rank{rank}_only"], torch.full((4,), float(rank + 1))),
        "step": same["step"] == step,
    }
    # Resharded: every rank loads the whole tensors (replicated), which reads
    # the other rank's shard too.
    whole = {
        "w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Replicate()]),
        "ids": distribute_tensor(torch.zeros_like(full["ids"]), mesh, [Replicate()]),
    }
    r2 = WardenStorageReader()
    dcp.load(whole, storage_reader=r2)
    exact["w_whole"] = same_bytes(whole["w"].to_local(), full["w"])
    exact["ids_whole"] = same_bytes(whole["ids"].to_local(), full["ids"])
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "restored_step": r2.restored_step, "exact": exact}, f)


def async_sharded(step: int, store: str, out: str) -> None:
    """Three saves through dcp.async_save sharing one staging buffer: the
    training loop changes the tensors as soon as each returns, and what is
    restored is what they held when it was called. The second reuses the
    first's staged tensors (the same layout and mesh); the third, on a mesh
    made again (as after a heal), makes its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    pool = StagingPool()
    exact = {}
    stalls = []
    buffers = set()
    staged = []
    for i, s in enumerate((step, step + 1, step + 2)):
        if i == 2:
            mesh = init_device_mesh("cpu", (world,))
        full = tensors(11 + i)
        sd = {
            "w": distribute_tensor(full["w"].clone(), mesh, [Shard(0)]),
            "plain": full["half"].clone(),
            f"rank{rank}_only": torch.full((4,), float(rank + 1 + i)),
            "meta": {"step": s, "note": f"save {i}"},
        }
        expect_local = sd["w"].to_local().clone()
        fut = dcp.async_save(sd, storage_writer=WardenStorageWriter(step=s, staging=pool))
        stalls.append(pool.last_stall_s)
        # The training loop goes on at once: the save must not see this.
        sd["w"].to_local().fill_(-1.0)
        sd["plain"].fill_(-1.0)
        sd["meta"]["note"] = "changed"
        fut.result(timeout=120)
        slot = pool._free.queue[0] if pool._free.queue else None
        if slot is not None and slot.buffer is not None:
            buffers.add(slot.buffer.data_ptr())
        staged.append(id(slot.staged[1]) if slot is not None and slot.staged is not None else None)
        back = {
            "w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(0)]),
            "plain": torch.zeros_like(full["half"]),
            f"rank{rank}_only": torch.zeros(4),
            "meta": {"step": 0, "note": ""},
        }
        reader = WardenStorageReader(step=s)
        dcp.load(back, storage_reader=reader)
        exact[f"w{i}"] = same_bytes(back["w"].to_local(), expect_local)
        exact[f"plain{i}"] = same_bytes(back["plain"], full["half"])
        exact[f"rank_only{i}"] = same_bytes(back[f"rank{rank}_only"], torch.full((4,), float(rank + 1 + i)))
        exact[f"meta{i}"] = back["meta"] == {"step": s, "note": f"save {i}"}
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(
            {
                "rank": rank,
                "exact": exact,
                "stalls": stalls,
                "buffers_reused": len(buffers) == 1,
                "staged_reused": [staged[1] is not None and staged[1] == staged[0], staged[2] != staged[1]],
                "newest": ckpt.restore().step,
            },
            f,
        )


def _committed(step: int) -> bool:
    try:
        return ckpt.restore(step) is not None
    except ckpt.CheckpointError:
        return False


def async_fail(step: int, out: str) -> None:
    """A save that fails on the background thread (an object that copies but
    cannot be pickled: its class is local) is never committed, and the next
    staging says so."""

    class Local:
        pass

    pool = StagingPool()
    good = {"w": tensors(3)["w"]}
    dcp.async_save(good, storage_writer=WardenStorageWriter(step=step, staging=pool)).result(timeout=120)
    bad = {"w": tensors(4)["w"], "obj": Local()}
    fut = dcp.async_save(bad, storage_writer=WardenStorageWriter(step=step + 1, staging=pool))
    try:
        fut.result(timeout=120)
        future_error = ""
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        future_error = type(e).__name__
    try:
        dcp.async_save(good, storage_writer=WardenStorageWriter(step=step + 2, staging=pool)).result(timeout=120)
        next_error = ""
    except ckpt.CheckpointError as e:
        next_error = str(e)
    # The pool's buffer came back: a save after the raised one goes through.
    dcp.async_save(good, storage_writer=WardenStorageWriter(step=step + 3, staging=pool)).result(timeout=120)
    steps = [s for s in range(step, step + 4) if _committed(s)]
    with open(out, "w") as f:
        json.dump({"future_error": future_error, "next_error": next_error, "steps": steps}, f)


def fsdp(step: int, store: str, out: str) -> None:
    """FSDP2 with AdamW: the optimizer's ``step`` of every parameter is
    replicated, and DCP saves each once, spread over the ranks. Loading,
    each rank must read its own shard alone (its copies of those), and get
    back exactly what it saved."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    # The CPU mesh named: FSDP2's default follows the build's accelerator.
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    # Replicated plain tensors, each its own values (the same on every
    # rank): a copy read under another item's index would not match.
    extra = {f"t{i}": torch.arange(i + 3, dtype=torch.float32) * (i + 1) for i in range(8)}
    dcp.save({"model": msd, "optim": osd, "extra": extra}, storage_writer=WardenStorageWriter(step=step))
    saved = {k: v.full_tensor().clone() for k, v in msd.items()}
    saved_steps = [float(s["step"]) for s in osd["state"].values()]
    # Change the weights and the optimizer's state: the load must bring them back.
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    loaded_extra = {k: torch.zeros_like(v) for k, v in extra.items()}
    reader = WardenStorageReader()
    dcp.load({"model": msd, "optim": osd, "extra": loaded_extra}, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, opt)
    result = {
        "rank": rank,
        "restored_step": reader.restored_step,
        "shards_read": sorted(reader._paths),
        "exact": all(same_bytes(saved[k], v.full_tensor()) for k, v in msd.items())
        and all(same_bytes(extra[k], loaded_extra[k]) for k in extra),
        "optim_steps": [float(s["step"]) for s in osd["state"].values()] == saved_steps,
    }
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "single":
        single(int(sys.argv[2]), sys.argv[3])
    elif mode == "sharded":
        sharded(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif mode == "async":
        async_sharded(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif mode == "async-fail":
        async_fail(int(sys.argv[2]), sys.argv[3])
    elif mode == "fsdp":
        fsdp(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")
