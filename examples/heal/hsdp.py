#!/usr/bin/env python3
"""FSDP2 with replica groups (HSDP) over gloo (CPU, or CUDA tensors) that heals from a live replica.

    warden run --nproc-per-node 4 -- python examples/heal/hsdp.py

The ranks form a 2-D device mesh ("replicate", "shard"): 2 replica groups
of 2 shards with 4 ranks (ranks 0,1 and 2,3; rank r holds shard r % 2).
``fully_shard`` shards each layer's parameters and Adam's state over
"shard" and replicates them over "replicate". Data is seeded by step and
rank, dropout by (step, rank). The state is declared once
(``warden.heal.declare(model, opt)``); its layout comes from the DTensors'
placements. When a rank is killed, ``warden run`` starts it again from a
standby interpreter while the others restart in process: they keep their
shards, make the mesh again on the new process group (the old mesh and its
DTensors resolve their groups by name, and take the new ones), and the rank
of the same shard position in the other replica group sends the
replacement its local shards of model and optimizer, and the step. Nothing
is read from a checkpoint; at most the step in flight is redone. A
checkpoint (each rank its local shards) is still saved every
``EXAMPLE_CKPT_EVERY`` steps into warden's tier: the fallback where no
replica of a shard position lives (``EXAMPLE_HEAL=0`` takes it always).

Environment:
  EXAMPLE_LOG          file the lines below are appended to (required)
  EXAMPLE_STEPS        steps to run (200)
  EXAMPLE_CKPT_EVERY   checkpoint every this many steps (50)
  EXAMPLE_STEP_MS      extra time per step, milliseconds (20)
  EXAMPLE_HEAL         0: no heal, restore from the checkpoint after a fault (1)
  EXAMPLE_DEVICE       cpu, or cuda: every rank on GPU LOCAL_RANK modulo the GPUs,
                       the mesh's collectives still over gloo (one GPU cannot
                       hold several NCCL ranks)

Lines appended to $EXAMPLE_LOG:
  <unix time> step <N> rank <R> pid <P>          after each completed step
  <unix time> done rank <R> digest <sha256>      at the end: every parameter
                                                 and optimizer tensor, whole
                                                 (gathered over "shard"), so
                                                 every rank's digest is the same
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import warden
import warden.tensor_bytes  # a tensor's bytes for the digest, without numpy (torch does not install it)
import warden.checkpoint as ckpt
import warden.heal
import warden.heal_layout

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
HEAL = os.environ.get("EXAMPLE_HEAL", "1") != "0"
LOG = os.environ["EXAMPLE_LOG"]
PID = os.getpid()
DEVICE = os.environ.get("EXAMPLE_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    sys.exit(f"EXAMPLE_DEVICE={DEVICE!r}: expected cpu or cuda")
if DEVICE == "cuda":
    if not torch.cuda.is_available():
        sys.exit("EXAMPLE_DEVICE=cuda: torch sees no GPU")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", RANK)) % torch.cuda.device_count())
    _t = time.perf_counter()
    torch.zeros(1, device="cuda")  # the CUDA context, timed apart (tests/bench/heal.py reads it)
    print(f"example: rank {RANK}: CUDA ready on cuda:{torch.cuda.current_device()} in {time.perf_counter() - _t:.3f} s", file=sys.stderr, flush=True)
SHARDS = 2
if WORLD % SHARDS:
    sys.exit(f"hsdp.py: WORLD_SIZE {WORLD} is not a multiple of {SHARDS} shards")


def log(line: str) -> None:
    """One append, one write: lines of the ranks never interleave."""
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{time.time():.6f} {line}\n".encode())
    finally:
        os.close(fd)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of (step, rank): the same in every run."""
    g = torch.Generator().manual_seed(1_000_003 * step + RANK)
    x = torch.randn(64, 32, generator=g)
    return x.to(DEVICE), x.sum(dim=1, keepdim=True).sin().to(DEVICE)


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor, on every rank. On CUDA its shards are
    gathered as CPU tensors (gloo takes those everywhere; the example's
    collectives over gloo on one GPU are a stand-in for NCCL)."""
    if not isinstance(t, DTensor):
        return t
    if DEVICE == "cpu":
        return t.full_tensor()
    local = t.to_local().detach().cpu()
    for dim, placement in enumerate(t.placements):
        if placement.is_shard():
            group = t.device_mesh.get_group(dim)
            parts: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, local, group=group)
            local = torch.cat(parts, dim=placement.dim)
    return local


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every parameter and optimizer tensor, whole, in a fixed order
    (a collective over "shard": every rank calls it at the same point)."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        h.update(name.encode())
        h.update(warden.tensor_bytes.view(whole(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8)))

    for k, v in sorted(model.state_dict().items()):
        add(k, v)
    sd = opt.state_dict()
    for pid in sorted(sd["state"]):
        for k, v in sorted(sd["state"][pid].items()):
            if torch.is_tensor(v):
                add(f"opt.{pid}.{k}", v)
    return h.hexdigest()


def mesh() -> object:
    """This attempt's mesh: made the same way in every attempt, after the
    attempt's process group, so its groups get the names the first
    attempt's had (the model's DTensors find them by name)."""
    return init_device_mesh(DEVICE, (WORLD // SHARDS, SHARDS), mesh_dim_names=("replicate", "shard"))


model: torch.nn.Module | None = None
opt: torch.optim.Optimizer | None = None
state: warden.heal.State | None = None


def build() -> None:
    """The sharded model and its optimizer, once per process (in its first
    attempt: fully_shard needs the mesh, the mesh a process group)."""
    global model, opt, state
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    ).to(DEVICE)
    dp = mesh()
    for layer in (m[0], m[3]):
        fully_shard(layer, mesh=dp)
    fully_shard(m, mesh=dp)
    model = m
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    # Declared once: what a heal sends (this rank's shards of the model and
    # optimizer, the step); who sends to whom follows from the DTensors' mesh.
    state = warden.heal.declare(model, opt, seed=7) if HEAL else None


def save(step: int) -> None:
    sd = dict(warden.heal_layout.local_state_dict(model, opt), step=step)
    ckpt.save_state_dict(step, sd)


def restore() -> int | None:
    """Today's path: this rank's shards of the newest checkpoint every rank has."""
    got = ckpt.load_state_dict()
    if got is None:
        return None
    _, sd = got
    warden.heal_layout.load_local_state_dict(model, opt, sd)
    return int(sd["step"])


def train() -> str:
    warden.heal.init_process_group("gloo")
    if model is None:
        build()
    else:
        mesh()
    if state is not None:
        start = state.resume(restore)
    else:
        if model is not None:
            # A restart cut the step short: FSDP's iteration state, and the
            # groups it keeps, made current (what resume does too).
            warden.heal_layout.rebind(model, warden.heal_layout.infer(model), RANK)
        start = restore() or 0
    loss_fn = torch.nn.MSELoss()

    def one(n: int) -> None:
        if state is None:
            warden.heal.seed_step(7, RANK, n)
        if n and n % CKPT_EVERY == 0:
            save(n)
        x, y = batch(n)
        time.sleep(STEP_S)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        log(f"step {n} rank {RANK} pid {PID}")

    # warden.step tells the agent the step (its hang detection, and its
    # rule that the same failure at the same step is the code's).
    if state is not None:
        for n in state.steps(STEPS):
            with warden.step(n):
                one(n)
    else:
        for n in range(start, STEPS):
            with warden.step(n):
                one(n)
    d = digest(model, opt)
    if DEVICE != "cpu":
        print(f"example: rank {RANK}: digest {d[:12]}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return d


def main() -> int:
    warden.default_client()
    d = warden.run(train)
    log(f"done rank {RANK} digest {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
