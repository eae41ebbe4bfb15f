"""A Lightning fit of an FSDP2 module (``ModelParallelStrategy``, whole state
dictionaries on rank 0) with WardenCallback, as one of WORLD_SIZE ranks.

    python lightning_fsdp_job.py MAX_STEPS EVERY [sharded | warden-sharded [sync] [fail-8]] OUT

Resumes from the tier's newest step (``restore_path``) when there is one.
MASTER_ADDR and MASTER_PORT come from the environment (one port per run).
OUT (JSON) gets what the test checks, from global rank 0: the step the fit
started at, the whole weights then and at each step saved, the checkpoint
path it resumed from. ``sharded``: the strategy's default, a DCP folder of
shards, which WardenCallback refuses before the first step (the refusal
recorded as "refused"); ``warden-sharded``: the same default under
``WardenModelParallelStrategy``, each rank's shards saved into the tier
through DCP (``sync``: ``async_save=False``; ``fail-8``: rank 1's write
of step 8's shard fails as a full disk would, an injected fault).
"""

from __future__ import annotations

import json
import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import warden
from warden.integrations import _lightning_sharded as warden_sharded
from warden.integrations import lightning as warden_lightning
from warden.integrations.lightning import WardenCallback, WardenModelParallelStrategy, restore_path

MAX_STEPS, EVERY, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[-1]
WORLD = int(os.environ["WORLD_SIZE"])
MODE = sys.argv[3:-1]
SHARDED = "sharded" in MODE or "warden-sharded" in MODE
WARDEN_SHARDED = "warden-sharded" in MODE
events: dict = {"saved_weights": {}}


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def whole(module: torch.nn.Module) -> dict:
    """The module's whole weights on rank 0 (a collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(module, options=options)
    return {k: v.view(-1).tolist() for k, v in state.items()}


class Probe(pl.Callback):
    def __init__(self, cb: WardenCallback) -> None:
        self.cb = cb

    def on_train_start(self, trainer, pl_module) -> None:
        events["start_step"] = trainer.global_step
        events["start_weights"] = whole(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # After WardenCallback's own hook (it comes first in the list).
        if self.cb.last_saved == trainer.global_step:
            events["saved_weights"][str(trainer.global_step)] = whole(pl_module)



def inject_a_full_disk_at_step_8() -> None:
    """Rank 1's shard of step 8 fails to write (ENOSPC), as a full local
    disk would: a fault on one rank, in DCP's writing (the background
    thread under dcp.async_save)."""
    import errno

    from warden.integrations.dcp import WardenStorageWriter

    write = WardenStorageWriter._write_shard

    def failing(self, plan, planner):
        if self.step == 8:
            raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")
        return write(self, plan, planner)

    WardenStorageWriter._write_shard = failing


def train() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    cb = WardenCallback(every_n_steps=EVERY, async_save="sync" not in MODE)
    kind = WardenModelParallelStrategy if WARDEN_SHARDED else ModelParallelStrategy
    trainer = pl.Trainer(
        max_steps=MAX_STEPS,
        accelerator="cpu",
        devices=WORLD,
        strategy=kind(
            data_parallel_size=WORLD, tensor_parallel_size=1, save_distributed_checkpoint=SHARDED
        ),
        callbacks=[cb, Probe(cb)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    path = restore_path()
    events["ckpt_path"] = path
    try:
        trainer.fit(Sharded(), DataLoader(data, batch_size=4), ckpt_path=path)
    except ValueError as e:
        if not SHARDED or WARDEN_SHARDED:
            raise
        events["refused"] = str(e)
    events["end_step"] = trainer.global_step


if "fail-8" in MODE and int(os.environ["RANK"]) == 1:
    inject_a_full_disk_at_step_8()
warden.run(train)
# The buffers saves had to make on the training thread (none: made ahead).
pool = warden_sharded._pool
events["staging_grown"] = None if pool is None else pool.grown_in_save
saver = warden_lightning._saver
events["saver_grown"] = None if saver is None else saver.grown_in_save
with open(OUT, "w") as f:
    json.dump(events, f)
