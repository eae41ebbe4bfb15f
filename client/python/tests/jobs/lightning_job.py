"""A Lightning training run under warden.run with WardenCallback, against a real agent.

    python lightning_job.py MAX_STEPS EVERY RESTART_AT [sync] OUT

Attempt 0 asks for an in-process restart (``warden.inject_restart``, the
path an agent's request takes) once step RESTART_AT is done; warden.run
runs ``train`` again, which resumes from the newest checkpoint in the tier.
OUT (JSON) gets what the test checks.
"""

from __future__ import annotations

import json
import sys
import time

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import warden
from warden.integrations import lightning as warden_lightning
from warden.integrations.lightning import WardenCallback, restore_path

MAX_STEPS, EVERY, RESTART_AT, OUT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[-1]
ASYNC = "sync" not in sys.argv[4:-1]
events: dict = {"attempts": [], "saved_weights": {}}


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def weights(module: torch.nn.Module) -> list:
    return [p.detach().clone().view(-1).tolist() for p in module.parameters()]


class Probe(pl.Callback):
    """Records what the test checks; asks for the restart in attempt 0."""

    def __init__(self, cb: WardenCallback) -> None:
        self.cb = cb

    def on_train_start(self, trainer, pl_module) -> None:
        events["attempts"][-1]["start_step"] = trainer.global_step
        events["attempts"][-1]["start_weights"] = weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # After WardenCallback's own hook (it comes first in the list).
        step = trainer.global_step
        if self.cb.last_saved == step:
            events["saved_weights"][str(step)] = weights(pl_module)
        if warden.restart_count() == 0 and step == RESTART_AT:
            warden.inject_restart(4242, restart_count=1, reason="lightning test")
            time.sleep(30)  # interrupted by the restart's signal
            raise AssertionError("no restart within 30 s")


def train() -> None:
    torch.manual_seed(0)
    events["attempts"].append({"restart_count": warden.restart_count()})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    cb = WardenCallback(every_n_steps=EVERY, async_save=ASYNC)
    trainer = pl.Trainer(
        max_steps=MAX_STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=[cb, Probe(cb)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    path = restore_path()
    events["attempts"][-1]["ckpt_path"] = path
    trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=path)
    events["attempts"][-1]["end_step"] = trainer.global_step


warden.run(train)
snap = warden.default_client().snapshot()
events["recent_sections"] = [sorted(s["sections"]) for s in snap["recent_steps"]]
events["recent_steps"] = [s["step"] for s in snap["recent_steps"]]
saver = warden_lightning._saver
events["grown_in_save"] = None if saver is None else saver.grown_in_save
with open(OUT, "w") as f:
    json.dump(events, f)
