#!/usr/bin/env python3
"""PyTorch Lightning DDP on CPU (gloo) that heals from a live replica.

    warden run --nproc-per-node 4 -- python examples/heal/lightning_ddp.py

A LightningModule (a small MLP with dropout, Adam and a step LR schedule)
trains on a shuffled dataset of several epochs under ``warden.run``, with
``WardenDDPStrategy`` and ``WardenCallback``: nothing else of the user's
code changes. When a rank is killed, ``warden run`` starts it again from a
standby interpreter while the others restart in process: they keep their
module and optimizer state in memory, each attempt's Trainer is new, and
the lowest live rank sends the replacement its module, optimizer, LR
schedule and the fit loop's progress (global step, epoch, batch position);
every rank's RNG is seeded by (step, rank). Nothing is read from a
checkpoint; at most the step in flight is redone. A checkpoint is still
saved every ``EXAMPLE_CKPT_EVERY`` steps into warden's tier: the fallback
where no replica lives.

Environment:
  EXAMPLE_LOG          file the lines below are appended to (required)
  EXAMPLE_STEPS        optimizer steps to run (200)
  EXAMPLE_CKPT_EVERY   checkpoint every this many steps (50)
  EXAMPLE_STEP_MS      extra time per step, milliseconds (20)
  EXAMPLE_OPTIMIZATION automatic (the default: Lightning steps one Adam)
                       or manual (``automatic_optimization = False``: the
                       module steps two optimizers and their LR schedules
                       itself, so each batch is two optimizer steps)
  EXAMPLE_SYNC_AFTER_UPDATE  1: (manual) an all_reduce of the loss after the
                       update, before the batch ends, as ``self.log(...,
                       sync_dist=True)`` there does (it changes no parameter)
  EXAMPLE_DIE_AT       (with the above) rank 1 SIGKILLs itself once, right
                       after the update that reaches this global step,
                       before the all_reduce: a fault no heal can take from
                       a live replica (0: never)

Lines appended to $EXAMPLE_LOG:
  <unix time> step <N> rank <R> pid <P>          after each completed batch
                                                 (N: global_step - 1; odd
                                                 steps only when manual)
  <unix time> done rank <R> digest <sha256>      at the end: every parameter
                                                 and optimizer tensor (or
                                                 callback-state-lost:... when
                                                 the steps the LogSteps
                                                 callback counted are not the
                                                 Trainer's)
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import pytorch_lightning as pl
import torch

import warden
import warden.tensor_bytes  # a tensor's bytes for the digest, without numpy (torch does not install it)
from warden.integrations.lightning import WardenCallback, WardenDDPStrategy

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL_WORLD = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))
# Hosts in the job (`warden run --nnodes`: one node rank per host of the
# round); Lightning checks devices x num_nodes against WORLD_SIZE.
NODES = max(1, WORLD // LOCAL_WORLD)
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
OPTIMIZATION = os.environ.get("EXAMPLE_OPTIMIZATION", "automatic")
if OPTIMIZATION not in ("automatic", "manual"):
    sys.exit(f"EXAMPLE_OPTIMIZATION: automatic or manual, not {OPTIMIZATION!r}")
MANUAL = OPTIMIZATION == "manual"
SYNC_AFTER_UPDATE = os.environ.get("EXAMPLE_SYNC_AFTER_UPDATE") == "1"
DIE_AT = int(os.environ.get("EXAMPLE_DIE_AT", "0"))
# Lightning's global_step counts optimizer steps: two a batch when manual.
STEPS_PER_BATCH = 2 if MANUAL else 1
LOG = os.environ["EXAMPLE_LOG"]
PID = os.getpid()


def log(line: str) -> None:
    """One append, one write: lines of the ranks never interleave."""
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{time.time():.6f} {line}\n".encode())
    finally:
        os.close(fd)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = not MANUAL
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_S)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if not MANUAL:
            return loss
        # Manual optimization: one backward (DDP's all-reduce), then the
        # two optimizers and their schedules, each stepped by the module.
        opts, scheds = self.optimizers(), self.lr_schedulers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        for sched in scheds:
            sched.step()
        if SYNC_AFTER_UPDATE:
            # A collective between the update and the batch's end (what
            # `self.log(..., sync_dist=True)` does there).
            if DIE_AT and RANK == 1 and self.trainer.global_step >= DIE_AT and not os.path.exists(LOG + ".died"):
                open(LOG + ".died", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            torch.distributed.all_reduce(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        if MANUAL:
            first = torch.optim.Adam(self.net[0].parameters(), lr=1e-3)
            last = torch.optim.SGD(self.net[3].parameters(), lr=1e-2, momentum=0.9)
            return [first, last], [
                torch.optim.lr_scheduler.StepLR(first, step_size=30, gamma=0.9),
                torch.optim.lr_scheduler.StepLR(last, step_size=20, gamma=0.8),
            ]
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LogSteps(pl.Callback):
    """Logs each completed batch's last optimizer step (before WardenCallback
    commits it) and counts the batches: a callback with a state of its own, which a heal
    carries to every rank's new callback with the rest of the state."""

    def __init__(self) -> None:
        self.completed = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.completed += 1
        log(f"step {trainer.global_step - 1} rank {RANK} pid {PID}")

    def state_dict(self) -> dict:
        return {"completed": self.completed}

    def load_state_dict(self, state: dict) -> None:
        self.completed = state["completed"]


def digest(model: torch.nn.Module, opts: list) -> str:
    """sha256 of every parameter and optimizer tensor, in a fixed order."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        h.update(name.encode())
        h.update(warden.tensor_bytes.view(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)))

    for k, v in sorted(model.state_dict().items()):
        add(k, v)
    for i, opt in enumerate(opts):
        sd = opt.state_dict()
        for pid in sorted(sd["state"]):
            for k, v in sorted(sd["state"][pid].items()):
                if torch.is_tensor(v):
                    add(f"opt{i}.{pid}.{k}", v)
    return h.hexdigest()


# The data: the same on every rank and in every run; Lightning gives each
# rank its part through a DistributedSampler (shuffled, seeded per epoch).
g = torch.Generator().manual_seed(3)
X = torch.randn(16 * 24 * WORLD, 32, generator=g)
DATA = torch.utils.data.TensorDataset(X, X.sum(dim=1, keepdim=True).sin())

torch.manual_seed(0)
MODEL = Model()  # once per process: a survivor keeps it across attempts


def train() -> str:
    loader = torch.utils.data.DataLoader(DATA, batch_size=16, shuffle=True)
    steps = LogSteps()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=LOCAL_WORLD,
        num_nodes=NODES,
        strategy=WardenDDPStrategy(seed=7),
        max_steps=STEPS,
        callbacks=[steps, WardenCallback(every_n_steps=CKPT_EVERY)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MODEL, loader)
    torch.distributed.destroy_process_group()
    if steps.completed * STEPS_PER_BATCH != trainer.global_step:
        # Not a digest: the callbacks' state was lost on the way, and the
        # comparison with the fault-free run says so.
        return f"callback-state-lost:{steps.completed}-batches-of-{trainer.global_step}-steps"
    return digest(MODEL, trainer.optimizers)


def main() -> int:
    warden.default_client()
    d = warden.run(train)
    log(f"done rank {RANK} digest {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
