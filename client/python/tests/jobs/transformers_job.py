"""A Hugging Face Trainer run under warden.run with WardenCallback, against a real agent.

    python transformers_job.py OUTPUT_DIR MAX_STEPS SAVE_STEPS RESTART_AT OUT

A tiny BERT built from its config (nothing downloaded) learns a toy
classification on the CPU. Attempt 0 asks for an in-process restart
(``warden.inject_restart``) once step RESTART_AT is done; warden.run runs
``train`` again, which resumes from the tier's newest checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import warden
from warden.integrations.transformers import WardenCallback, restore_dir

# Accelerate makes a process group whenever LOCAL_RANK is set, as torchrun
# and warden run set it: a rendezvous address of its own, on a free port.
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_s.getsockname()[1]))

OUTPUT_DIR = sys.argv[1]
MAX_STEPS, SAVE_STEPS, RESTART_AT = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
OUT = sys.argv[-1]
ASYNC = "sync" not in sys.argv[5:-1]
events: dict = {"attempts": [], "saved_weights": {}}


def weights(model: torch.nn.Module) -> str:
    """A digest of every parameter's bytes (exact, short)."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Probe(TrainerCallback):
    def __init__(self) -> None:
        self.first = True

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.first:
            self.first = False
            events["attempts"][-1]["start_step"] = state.global_step
            events["attempts"][-1]["start_weights"] = weights(model)

    def on_save(self, args, state, control, model=None, **kwargs):
        events["saved_weights"][str(state.global_step)] = weights(model)

    def on_step_end(self, args, state, control, **kwargs):
        if warden.restart_count() == 0 and state.global_step == RESTART_AT:
            warden.inject_restart(4343, restart_count=1, reason="transformers test")
            time.sleep(30)  # interrupted by the restart's signal
            raise AssertionError("no restart within 30 s")


class Toy(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 50, (64, 12), generator=g)
        self.labels = (self.ids.sum(dim=1) % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def train() -> None:
    events["attempts"].append({"restart_count": warden.restart_count()})
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    args = TrainingArguments(
        output_dir=OUTPUT_DIR,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=BertForSequenceClassification(config),
        args=args,
        train_dataset=Toy(),
        callbacks=[WardenCallback(async_copy=ASYNC), Probe()],
    )
    path = restore_dir(OUTPUT_DIR)
    events["attempts"][-1]["resume_from"] = path
    trainer.train(resume_from_checkpoint=path)
    events["attempts"][-1]["end_step"] = trainer.state.global_step


warden.run(train)
snap = warden.default_client().snapshot()
events["recent_sections"] = [sorted(s["sections"]) for s in snap["recent_steps"]]
events["recent_steps"] = [s["step"] for s in snap["recent_steps"]]
with open(OUT, "w") as f:
    json.dump(events, f)
