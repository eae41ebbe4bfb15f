"""A Lightning or Transformers run with WardenCallback that gets a notice of a
coming stop from the agent (a Kubernetes taint it writes itself at step
TAINT_AT, standing in for the node controller), saves the step the agent names
and leaves with 85; run again, it resumes at that step.

    python notice_job.py lightning|transformers TAINT_AT TAINT_FILE MAX_STEPS OUT

OUT (JSON, rewritten at every step) gets the first step trained, the steps
done, the step saved on the notice and the checkpoint path resumed from.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import warden

FRAMEWORK, TAINT_AT, TAINT_FILE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
MAX_STEPS, OUT = int(sys.argv[4]), sys.argv[5]
TAINT = "cloud.google.com/impending-node-termination=true:NoSchedule\n"
events: dict = {"steps": []}


def record(step: int, cb) -> None:
    events["steps"].append(step)
    events["preempted"] = cb.preempted
    events["last_saved"] = cb.last_saved
    with open(OUT, "w") as f:
        json.dump(events, f)
    if TAINT_AT and step == TAINT_AT and not os.path.exists(TAINT_FILE):
        with open(TAINT_FILE + ".tmp", "w") as f:
            f.write(TAINT)
        os.rename(TAINT_FILE + ".tmp", TAINT_FILE)
    if TAINT_AT and step >= TAINT_AT:
        # Steps of a real job's length from the taint on (these take about a
        # millisecond): the notice has the 80 steps to the periodic save at
        # 100, 4 s, to reach the rank even on a loaded machine (CI once saw
        # it arrive at step 102 with millisecond steps).
        time.sleep(0.05)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def lightning() -> None:
    import pytorch_lightning as pl

    from warden.integrations.lightning import WardenCallback, restore_path

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            events["start_step"] = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            record(trainer.global_step, cb)

    cb = WardenCallback(every_n_steps=100)
    trainer = pl.Trainer(
        max_steps=MAX_STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=[cb, Probe()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    path = restore_path()
    events["resumed_from"] = path
    x, y = data()
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, y), batch_size=4), ckpt_path=path)


def transformers() -> None:
    import socket

    import transformers as tf

    # Accelerate makes a process group whenever LOCAL_RANK is set, as torchrun
    # and warden run set it: a rendezvous address of its own, on a free port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))

    from warden.integrations.transformers import WardenCallback, restore_dir

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Rows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x, self.y = data()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    class Probe(tf.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw) -> None:
            events["start_step"] = int(state.global_step)

        def on_step_end(self, args, state, control, **kw) -> None:
            record(int(state.global_step), cb)

    out_dir = os.path.join(os.path.dirname(OUT), "hf-out")
    cb = WardenCallback()
    args = tf.TrainingArguments(
        output_dir=out_dir,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=100,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    trainer = tf.Trainer(model=Tiny(), args=args, train_dataset=Rows(), callbacks=[cb, Probe()])
    resume = restore_dir(out_dir)
    events["resumed_from"] = resume
    trainer.train(resume_from_checkpoint=resume)


warden.run(lightning if FRAMEWORK == "lightning" else transformers)
