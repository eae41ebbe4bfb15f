#!/usr/bin/env python3
"""examples/heal/ddp.py without warden: the torchrun row of tests/bench/heal.py.

The example's model, optimizer, data, RNG seeding per (step, rank), DDP
(find_unused_parameters=True, as the example), checkpoint cadence, step time
and log lines, with what a torchrun user has instead of warden's tier and
heal: rank 0 torch.save()s the model and optimizer every EXAMPLE_CKPT_EVERY
steps into BENCH_CKPT_DIR, and every attempt (torchrun --max-restarts starts
all ranks again after any rank dies) makes its process group under its own
prefix of torchrun's store and resumes from the newest one rank 0
finds, broadcast so that every rank loads the same.

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 tests/bench/torchrun_ddp.py
"""

from __future__ import annotations

import glob
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import heal_job

RANK = int(os.environ["RANK"])
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
LOG = os.environ["EXAMPLE_LOG"]
CKPT_DIR = os.environ["BENCH_CKPT_DIR"]
PID = os.getpid()


def main() -> int:
    model, opt = heal_job.model_and_optimizer()
    # A process group of this attempt's own: on torchrun's store as it is, a
    # restarted rank read the killed rank's address of the first attempt and
    # failed to connect (tests/bench/bench_train.py makes a store per attempt
    # for the same reason).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"bench-attempt-{attempt}", store),
                            rank=RANK, world_size=int(os.environ["WORLD_SIZE"]))
    # The newest checkpoint rank 0 sees, the same for every rank.
    newest = torch.tensor([0])
    if RANK == 0:
        steps = [int(os.path.basename(p)[5:-3]) for p in glob.glob(os.path.join(CKPT_DIR, "step-*.pt"))]
        newest[0] = max(steps, default=0)
    dist.broadcast(newest, 0)
    start = int(newest[0])
    if start:
        sd = torch.load(os.path.join(CKPT_DIR, f"step-{start}.pt"), weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
    ddp = DDP(model, find_unused_parameters=True)
    loss_fn = torch.nn.MSELoss()
    for n in range(start, STEPS):
        heal_job.seed_step(RANK, n)
        if n and n % CKPT_EVERY == 0 and RANK == 0:
            tmp = os.path.join(CKPT_DIR, f".step-{n}.{PID}.tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp)
            os.replace(tmp, os.path.join(CKPT_DIR, f"step-{n}.pt"))
        x, y = heal_job.batch(n, RANK)
        time.sleep(STEP_S)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        heal_job.log(LOG, f"step {n} rank {RANK} pid {PID}")
    del ddp
    dist.destroy_process_group()
    heal_job.log(LOG, f"done rank {RANK} digest {heal_job.digest(model, opt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
