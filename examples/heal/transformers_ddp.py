#!/usr/bin/env python3
"""A Hugging Face Transformers Trainer on CPU (gloo, DDP) that heals from a live replica.

    warden run --nproc-per-node 4 --preload transformers.trainer -- python examples/heal/transformers_ddp.py

A tiny GPT-2 built from its config (nothing downloaded; dropout on, AdamW,
a linear LR schedule with warm-up, gradient accumulation of 2) trains on a
dataset of several epochs, shuffled by the Trainer, under ``warden.run``,
with ``WardenTrainingArguments``, ``WardenTrainer`` and ``WardenCallback``:
nothing else of the user's code changes. When a rank is killed, ``warden
run`` starts it again from a standby interpreter while the others restart
in process: they keep their model and optimizer state in memory, each
attempt's Trainer is new, and the lowest live rank sends the replacement
its model, optimizer, LR schedule and the Trainer's progress (global step,
epoch; the epoch's batches consumed are skipped by index); every rank's RNG
is seeded by (step, rank). Nothing is read from a checkpoint; at most the
step in flight is redone. A checkpoint is still saved every
``EXAMPLE_CKPT_EVERY`` steps and copied into warden's tier: the fallback
where no replica lives.

Environment:
  EXAMPLE_LOG          file the lines below are appended to (required)
  EXAMPLE_STEPS        optimizer steps to run (200)
  EXAMPLE_CKPT_EVERY   checkpoint every this many steps (50)
  EXAMPLE_STEP_MS      extra time per step, milliseconds (20)

The Trainer's output directory is ``$EXAMPLE_LOG.trainer``.

Lines appended to $EXAMPLE_LOG:
  <unix time> step <N> rank <R> pid <P>          after each completed step
                                                 (N from 0: global_step - 1)
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
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback
from transformers.trainer_callback import ExportableState

import warden
import warden.tensor_bytes  # a tensor's bytes for the digest, without numpy (torch does not install it)
from warden.integrations.transformers import WardenCallback, WardenTrainer, WardenTrainingArguments

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
STEPS = int(os.environ.get("EXAMPLE_STEPS", "200"))
CKPT_EVERY = int(os.environ.get("EXAMPLE_CKPT_EVERY", "50"))
STEP_S = float(os.environ.get("EXAMPLE_STEP_MS", "20")) / 1000.0
LOG = os.environ["EXAMPLE_LOG"]
OUT = LOG + ".trainer"
PID = os.getpid()
#: Per rank and optimizer step: 2 micro-batches of 8 sequences.
BATCH = 8
ACCUMULATE = 2
#: Micro-batches a rank sees per epoch (12 optimizer steps).
BATCHES_PER_EPOCH = 24


def log(line: str) -> None:
    """One append, one write: lines of the ranks never interleave."""
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{time.time():.6f} {line}\n".encode())
    finally:
        os.close(fd)


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences, the same on every rank and in every run;
    the Trainer gives each rank its part and shuffles them per epoch."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 128, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LogSteps(TrainerCallback, ExportableState):
    """Paces each step and logs it when done (before WardenCallback commits
    it), and counts them: a callback with a state of its own (exported, as
    EarlyStoppingCallback's), which a heal carries to every rank's new
    callback and a checkpoint restores."""

    def __init__(self) -> None:
        self.completed = 0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        time.sleep(STEP_S)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.completed += 1
        log(f"step {state.global_step - 1} rank {RANK} pid {PID}")

    def state(self) -> dict:
        return {"args": {}, "attributes": {"completed": self.completed}}


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


DATA = Tokens(BATCH * BATCHES_PER_EPOCH * WORLD)
torch.manual_seed(0)
# Once per process: a survivor keeps it across attempts.
MODEL = GPT2LMHeadModel(
    GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
)


def train() -> str:
    args = WardenTrainingArguments(
        output_dir=OUT,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=10,
        save_strategy="steps",
        save_steps=CKPT_EVERY,
        save_total_limit=2,
        logging_steps=10,
        seed=7,
        report_to=[],
        disable_tqdm=True,
        # A fall-back to the tier restores LogSteps' count too.
        restore_callback_states_from_checkpoint=True,
    )
    trainer = WardenTrainer(
        model=MODEL, args=args, train_dataset=DATA, callbacks=[LogSteps(), WardenCallback()]
    )
    trainer.train()
    d = digest(MODEL, trainer.optimizer)
    torch.distributed.destroy_process_group()
    # The Trainer's restore from a checkpoint replaces the callback: ask it.
    steps = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LogSteps))
    if steps.completed != trainer.state.global_step:
        # Not a digest: the callbacks' state was lost on the way, and the
        # comparison with the fault-free run says so.
        return f"callback-state-lost:{steps.completed}-of-{trainer.state.global_step}-steps"
    return d


def main() -> int:
    warden.default_client()
    d = warden.run(train)
    log(f"done rank {RANK} digest {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
