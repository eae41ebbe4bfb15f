"""A rank that saves a state dict with torch.distributed.checkpoint into the
agent's tier (WardenStorageWriter) and loads it back (WardenStorageReader).

    python dcp_job.py single STEP OUT      # one process, no process group
    python dcp_job.py sharded STEP STORE OUT   # a rank of 2 (gloo), DTensors

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
from warden.integrations.dcp import WardenStorageReader, WardenStorageWriter


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


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "single":
        single(int(sys.argv[2]), sys.argv[3])
    elif mode == "sharded":
        sharded(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")
