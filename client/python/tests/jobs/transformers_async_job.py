"""WardenTrainer's checkpoints, written in the background or by the Trainer, against a real agent.

    python transformers_async_job.py OUTPUT_DIR MODE OUT

One process trains a tiny BERT masked LM (its decoder tied to the word
embeddings) for 12 steps on the CPU, saving every 4 with
``save_total_limit=2``. MODE: ``async`` (WardenTrainer's default),
``sync`` (``async_save=False``: the Trainer's own save), or ``fail``
(async, with the optimizer's file of step 4 failing to write in the
background). OUT gets what the test compares.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys

import torch
from transformers import BertConfig, BertForMaskedLM, TrainerCallback

from warden.integrations import transformers as wt

with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_s.getsockname()[1]))

OUTPUT_DIR, MODE, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
events: dict = {"live_weights": {}, "stalls": []}


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Probe(TrainerCallback):
    def on_save(self, args, state, control, model=None, **kwargs):
        events["live_weights"][str(state.global_step)] = digest(model.state_dict().values())
        events["stalls"].append(wt._saver.last_stall_s)


class Toy(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 50, (64, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if MODE == "fail":
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        if isinstance(f, str) and f.endswith(os.path.join("checkpoint-4", "optimizer.pt")):
            raise OSError(28, "No space left on device (test)")
        return real_save(obj, f, *a, **kw)

    torch.save = failing_save

torch.manual_seed(0)
config = BertConfig(
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
)
args = wt.WardenTrainingArguments(
    output_dir=OUTPUT_DIR,
    max_steps=12,
    per_device_train_batch_size=4,
    save_strategy="steps",
    save_steps=4,
    save_total_limit=2,
    logging_strategy="no",
    report_to=[],
    use_cpu=True,
    seed=0,
    disable_tqdm=True,
    dataloader_num_workers=0,
)
trainer = wt.WardenTrainer(
    model=BertForMaskedLM(config),
    args=args,
    train_dataset=Toy(),
    callbacks=[wt.WardenCallback(), Probe()],
    async_save=MODE != "sync",
)
try:
    trainer.train()
    events["error"] = None
except wt.TrainerSaveError as e:
    events["error"] = str(e)
    events["failed_at"] = trainer.state.global_step
events["tied"] = trainer.model.cls.predictions.decoder.weight.data_ptr() == trainer.model.bert.embeddings.word_embeddings.weight.data_ptr()
events["dirs"] = sorted(d for d in os.listdir(OUTPUT_DIR) if d.startswith("checkpoint-"))
events["tier"] = wt.restore_dir(OUTPUT_DIR)
events["grown_in_save"] = wt._saver.grown_in_save
with open(OUT, "w") as f:
    json.dump(events, f)
