#!/usr/bin/env python3
"""examples/heal/ddp.py as a torchft 0.2.0 job: the torchft rows of tests/bench/heal.py.

The same model (an MLP with dropout), optimizer (Adam, lr 1e-3), data
(seeded by step and rank), RNG seeding per (step, rank) (what
``warden.heal.seed_step(7, rank, step)`` draws), checkpoint cadence and step
time as the example. One process is one torchft replica group of one rank
(REPLICA_GROUP_ID = the example's RANK); the groups meet at a lighthouse the
bench starts. torchft's own parts throughout: ``Manager`` on a
``ProcessGroupGloo``, its ``DistributedDataParallel`` (gradients all-reduced
through its comm hook, averaged over the quorum's participants) and its
``Optimizer`` wrapper (``zero_grad`` starts the quorum, ``step`` steps only if
the manager commits). A replacement joins the lighthouse's next quorum and
heals from a live group over torchft's HTTP checkpoint transport.

The bench runs the lighthouse with ``--min_replicas 4`` and the manager has
``min_replica_size=4``: a step commits only with all four groups, so every
committed step averages the same four gradients as the fault-free run, and a
correct recovery ends with its weights (with fewer, torchft would go on with 3
and the weights would differ by construction).

Each group saves a checkpoint (model, optimizer and the manager's step, as
torchft's docs ask) every EXAMPLE_CKPT_EVERY steps and loads its newest one at
start: what a job restarted after a crash resumes from. A replacement that
finds the others ahead heals from them instead.

Environment: EXAMPLE_LOG, EXAMPLE_STEPS (200), EXAMPLE_CKPT_EVERY (50),
EXAMPLE_STEP_MS (20) as the example; REPLICA_GROUP_ID, NUM_REPLICA_GROUPS (4),
TORCHFT_LIGHTHOUSE (http://host:port), BENCH_CKPT_DIR (the checkpoints);
BENCH_STANDBY=1: import and build everything, then wait for a line on stdin
before joining (the pre-started replacement).

Lines appended to $EXAMPLE_LOG, as the example's:
  <unix time> step <N> rank <R> pid <P>          after each committed step
  <unix time> done rank <R> digest <sha256>      at the end
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

RANK = int(os.environ["REPLICA_GROUP_ID"])
GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", "4"))
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
LOG = os.environ["EXAMPLE_LOG"]
CKPT = os.path.join(os.environ["BENCH_CKPT_DIR"], f"group{RANK}.pt")
PID = os.getpid()


def log(line: str) -> None:
    """One append, one write: lines of the groups never interleave."""
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{time.time():.6f} {line}\n".encode())
    finally:
        os.close(fd)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The example's data of (step, rank)."""
    g = torch.Generator().manual_seed(1_000_003 * step + RANK)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def seed_step(step: int) -> None:
    """warden.heal.seed_step(7, RANK, step), without importing warden."""
    value = ((7 * 1_000_003 + RANK) * 1_000_033 + step) % (1 << 63)
    torch.manual_seed(value)
    random.seed(value)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """The example's digest: every parameter and optimizer tensor, in a fixed order."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    for k, v in sorted(model.state_dict().items()):
        add(k, v)
    sd = opt.state_dict()
    for pid in sorted(sd["state"]):
        for k, v in sorted(sd["state"][pid].items()):
            if torch.is_tensor(v):
                add(f"opt.{pid}.{k}", v)
    return h.hexdigest()


torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
)
inner = torch.optim.Adam(model.parameters(), lr=1e-3)
loss_fn = torch.nn.MSELoss()
# This group's own store, as torchrun would give each group: the manager
# publishes its address there and the quorum's process group meets on the
# first participant's.
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

if os.environ.get("BENCH_STANDBY") == "1":
    print("standby ready", flush=True)
    sys.stdin.readline()


def state_dict() -> dict:
    return {"model": model.state_dict(), "optim": inner.state_dict()}


def load_state_dict(sd: dict) -> None:
    model.load_state_dict(sd["model"])
    inner.load_state_dict(sd["optim"])


manager = Manager(
    pg=ProcessGroupGloo(),
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    min_replica_size=GROUPS,
    rank=0,
    world_size=1,
    store_addr="127.0.0.1",
    store_port=store.port,
    lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
    replica_id=f"bench_{RANK}",
    hostname="127.0.0.1",
    timeout=timedelta(seconds=60),
)
if os.path.exists(CKPT):
    got = torch.load(CKPT, weights_only=True)
    load_state_dict(got)
    manager.load_state_dict(got["manager"])
ddp = DistributedDataParallel(manager, model)
opt = Optimizer(manager, inner)


def save() -> None:
    sd = dict(state_dict(), manager=manager.state_dict())
    tmp = f"{CKPT}.{PID}.tmp"
    torch.save(sd, tmp)
    os.replace(tmp, CKPT)


while (n := manager.current_step()) < STEPS:
    seed_step(n)
    if n and n % CKPT_EVERY == 0:
        save()
    x, y = batch(n)
    time.sleep(STEP_S)
    opt.zero_grad(set_to_none=True)
    loss_fn(ddp(x), y).backward()
    opt.step()
    if manager.current_step() == n + 1:
        log(f"step {n} rank {RANK} pid {PID}")

log(f"done rank {RANK} digest {digest(model, inner)}")
manager.shutdown(wait=False)
# The manager's threads (quorum, heartbeats, HTTP server) are not ours to
# join; the log line above is on disk.
os._exit(0)
