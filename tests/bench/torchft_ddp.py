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

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

import heal_job

RANK = int(os.environ["REPLICA_GROUP_ID"])
GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", "4"))
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
LOG = os.environ["EXAMPLE_LOG"]
CKPT = os.path.join(os.environ["BENCH_CKPT_DIR"], f"group{RANK}.pt")
PID = os.getpid()


model, inner = heal_job.model_and_optimizer()
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
    heal_job.seed_step(RANK, n)
    if n and n % CKPT_EVERY == 0:
        save()
    x, y = heal_job.batch(n, RANK)
    time.sleep(STEP_S)
    opt.zero_grad(set_to_none=True)
    loss_fn(ddp(x), y).backward()
    opt.step()
    if manager.current_step() == n + 1:
        heal_job.log(LOG, f"step {n} rank {RANK} pid {PID}")

heal_job.log(LOG, f"done rank {RANK} digest {heal_job.digest(model, inner)}")
manager.shutdown(wait=False)
# The manager's threads (quorum, heartbeats, HTTP server) are not ours to
# join; the log line above is on disk.
os._exit(0)
