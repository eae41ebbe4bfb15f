#!/usr/bin/env python3
"""PyTorch Lightning with FSDP2 in replica groups (HSDP) on CPU (gloo) that heals from a live replica.

    warden run --nproc-per-node 4 -- python examples/heal/lightning_hsdp.py

A LightningModule (a small MLP with dropout, Adam and a step LR schedule)
trains on a shuffled dataset of several epochs under ``warden.run``, with
``WardenModelParallelStrategy(heal=True)`` and ``WardenCallback``. Its
``configure_model`` shards each layer and the root with ``fully_shard`` over
the strategy's whole 2-D device mesh: FSDP2 with replica groups (HSDP),
replicated over the mesh's "data_parallel" dimension and sharded over its
"tensor_parallel" one (Lightning's names): with 4 ranks, 2 replica groups
(ranks 0,1 and 2,3) of 2 shards (rank r holds shard r % 2). Each rank reads
its own part of the data (a ``DistributedSampler`` over every rank, as FSDP
wants). When a rank is killed, ``warden run`` starts it again from a standby
interpreter while the others restart in process: they keep their shards and
optimizer state in memory, each attempt's Trainer is new, and the rank of
the same shard position in the other replica group sends the replacement
its shards of module and optimizer, the LR schedule and the fit loop's
progress (global step, epoch, batch position); every rank's RNG is seeded
by (step, rank). Nothing is read from a checkpoint; at most the step in
flight is redone. A sharded checkpoint is still saved every
``EXAMPLE_CKPT_EVERY`` steps into warden's tier: the fallback where no live
rank holds a shard position.

Environment:
  EXAMPLE_LOG          file the lines below are appended to (required)
  EXAMPLE_STEPS        optimizer steps to run (200)
  EXAMPLE_CKPT_EVERY   checkpoint every this many steps (50)
  EXAMPLE_STEP_MS      extra time per step, milliseconds (20)

Lines appended to $EXAMPLE_LOG:
  <unix time> step <N> rank <R> pid <P>          after each completed batch
  <unix time> done rank <R> digest <sha256>      at the end: every parameter
                                                 and optimizer tensor, whole
                                                 (gathered over the shards),
                                                 so every rank's digest is
                                                 the same (or
                                                 callback-state-lost:... when
                                                 the steps the LogSteps
                                                 callback counted are not the
                                                 Trainer's)
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import pytorch_lightning as pl
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import warden
import warden.tensor_bytes  # a tensor's bytes for the digest, without numpy (torch does not install it)
from warden.integrations.lightning import WardenCallback, WardenModelParallelStrategy

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL_WORLD = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))
NODES = max(1, WORLD // LOCAL_WORLD)
SHARDS = 2
if WORLD % SHARDS:
    sys.exit(f"lightning_hsdp.py: WORLD_SIZE {WORLD} is not a multiple of {SHARDS} shards")
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
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
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
        )

    def configure_model(self) -> None:
        # Lightning calls it in every fit: a survivor's module is sharded
        # already, and keeps its shards.
        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh  # ("data_parallel", "tensor_parallel"): replicas x shards
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_S)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LogSteps(pl.Callback):
    """Logs each completed batch's step (before WardenCallback commits it)
    and counts the batches: a callback with a state of its own, which a heal
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


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def digest(model: torch.nn.Module, opts: list) -> str:
    """sha256 of every parameter and optimizer tensor, whole, in a fixed
    order (collectives over the shards: every rank calls it at one point)."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        h.update(name.encode())
        h.update(warden.tensor_bytes.view(whole(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8)))

    for k, v in sorted(model.state_dict().items()):
        add(k, v)
    for i, opt in enumerate(opts):
        sd = opt.state_dict()
        for pid in sorted(sd["state"]):
            for k, v in sorted(sd["state"][pid].items()):
                if torch.is_tensor(v):
                    add(f"opt{i}.{pid}.{k}", v)
    return h.hexdigest()


# The data: the same in every run; each rank reads its part (every rank its
# own batches, as FSDP's ranks do), shuffled, seeded per epoch.
g = torch.Generator().manual_seed(3)
X = torch.randn(16 * 24 * WORLD, 32, generator=g)
DATA = torch.utils.data.TensorDataset(X, X.sum(dim=1, keepdim=True).sin())

torch.manual_seed(0)
MODEL = Model()  # once per process: a survivor keeps it, and its shards, across attempts


def train() -> str:
    sampler = torch.utils.data.DistributedSampler(DATA, num_replicas=WORLD, rank=RANK, shuffle=True, seed=5)
    loader = torch.utils.data.DataLoader(DATA, batch_size=16, sampler=sampler)
    steps = LogSteps()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=LOCAL_WORLD,
        num_nodes=NODES,
        strategy=WardenModelParallelStrategy(
            data_parallel_size=WORLD // SHARDS, tensor_parallel_size=SHARDS, heal=True, seed=7
        ),
        max_steps=STEPS,
        use_distributed_sampler=False,
        callbacks=[steps, WardenCallback(every_n_steps=CKPT_EVERY)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MODEL, loader)
    if steps.completed != trainer.global_step:
        # Not a digest: the callbacks' state was lost on the way, and the
        # comparison with the fault-free run says so.
        d = f"callback-state-lost:{steps.completed}-batches-of-{trainer.global_step}-steps"
    else:
        d = digest(MODEL, trainer.optimizers)
    torch.distributed.destroy_process_group()
    return d


def main() -> int:
    warden.default_client()
    d = warden.run(train)
    log(f"done rank {RANK} digest {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
