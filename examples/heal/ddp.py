#!/usr/bin/env python3
"""Plain DDP on CPU (gloo) that heals from a live replica instead of rolling back.

    warden run --nproc-per-node 4 -- python examples/heal/ddp.py

Each rank trains the same small MLP (with dropout, so the RNG matters) with
Adam on data seeded by step and rank, under ``warden.run``. The state is
declared once (``warden.heal.declare``). When a rank is killed, ``warden
run`` starts it again from a standby interpreter while the others restart in
process: they keep their model and optimizer, rebuild the process group,
and the lowest live rank sends the replacement its model, optimizer, step and
RNG seeds follow from (step, rank). Nothing is read from a checkpoint; at most the step in flight is redone.
A checkpoint is still saved every ``EXAMPLE_CKPT_EVERY`` steps into warden's
tier: the fallback where no replica lives (``EXAMPLE_HEAL=0`` takes it
always, as today's checkpoint restart does).

Environment:
  EXAMPLE_LOG          file the lines below are appended to (required)
  EXAMPLE_STEPS        steps to run (200)
  EXAMPLE_CKPT_EVERY   checkpoint every this many steps (50)
  EXAMPLE_STEP_MS      extra time per step, milliseconds (20)
  EXAMPLE_SLOW_RANK    a rank that takes EXAMPLE_SLOW_MS more per step (none): a
                       straggler the others wait for in their all-reduce
  EXAMPLE_SLOW_MS      that rank's extra time per step, milliseconds (0)
  EXAMPLE_HEAL         0: no heal, restore from the checkpoint after a fault (1)
  EXAMPLE_DEVICE       cpu, or cuda: every rank on GPU LOCAL_RANK modulo the GPUs
                       there are (ranks may share one), still over gloo (cpu)

Lines appended to $EXAMPLE_LOG:
  <unix time> step <N> rank <R> pid <P>          after each completed step
  <unix time> done rank <R> digest <sha256>      at the end: every parameter
                                                 and optimizer tensor
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import warden
import warden.tensor_bytes  # a tensor's bytes for the digest, without numpy (torch does not install it)
import warden.checkpoint as ckpt
import warden.heal

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
SLOW_RANK = int(os.environ.get("EXAMPLE_SLOW_RANK", "-1"))
SLOW_S = float(os.environ.get("EXAMPLE_SLOW_MS", "0")) / 1000.0
HEAL = os.environ.get("EXAMPLE_HEAL", "1") != "0"
DEVICE = os.environ.get("EXAMPLE_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    sys.exit(f"EXAMPLE_DEVICE={DEVICE!r}: expected cpu or cuda")
if DEVICE == "cuda":
    if not torch.cuda.is_available():
        sys.exit("EXAMPLE_DEVICE=cuda: torch sees no GPU")
    DEVICE = f"cuda:{int(os.environ.get('LOCAL_RANK', RANK)) % torch.cuda.device_count()}"
    _t = time.perf_counter()
    torch.zeros(1, device=DEVICE)  # the CUDA context, timed apart (tests/bench/heal.py reads it)
    print(f"example: rank {RANK}: CUDA ready on {DEVICE} in {time.perf_counter() - _t:.3f} s", file=sys.stderr, flush=True)
LOG = os.environ["EXAMPLE_LOG"]
PID = os.getpid()


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


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every parameter and optimizer tensor, in a fixed order."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        h.update(name.encode())
        h.update(warden.tensor_bytes.view(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)))

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
).to(DEVICE)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
# Declared once: what a heal sends (model, optimizer, step); the RNGs are
# seeded per step and rank (warden.heal.seed_step), the same with or without it.
state = warden.heal.declare(model, opt, seed=7) if HEAL else None


def tensor_bytes(obj: object) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def save(step: int) -> None:
    sd = {"step": step, "model": model.state_dict(), "opt": opt.state_dict()}
    # The room the tier makes: the tensors and torch.save's framing.
    ckpt.save_state_dict(step, sd, size_hint=2 * tensor_bytes(sd) + (1 << 20))


def restore() -> int | None:
    """Today's path: the newest checkpoint every rank has, or None (fresh)."""
    got = ckpt.load_state_dict()
    if got is None:
        return None
    step, sd = got
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])
    return int(sd["step"])


def train() -> str:
    warden.heal.init_process_group("gloo")
    if state is not None:
        start = state.resume(restore)
    else:
        start = restore() or 0
    # DDP rebuilds its gradient buckets after its first iteration, so a DDP
    # made again after a restart all-reduces in another layout and its sums
    # differ in the last bits. find_unused_parameters=True keeps the first
    # layout for ever: the same sums in every attempt, bit for bit (its cost,
    # one walk of the autograd graph a step, is nothing for this model).
    ddp = DDP(model, find_unused_parameters=True)
    loss_fn = torch.nn.MSELoss()

    def one(n: int) -> None:
        if state is None:
            warden.heal.seed_step(7, RANK, n)
        if n and n % CKPT_EVERY == 0:
            save(n)
        x, y = batch(n)
        time.sleep(STEP_S + (SLOW_S if RANK == SLOW_RANK else 0.0))
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
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
    del ddp
    dist.destroy_process_group()
    return digest(model, opt)


def main() -> int:
    warden.default_client()
    d = warden.run(train)
    log(f"done rank {RANK} digest {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
