"""The Hugging Face Trainer's checkpoint stall: WardenTrainer's async save
against the Trainer's own save and a plain copy of the same bytes (issue 32).

Run under warden (the agent's tier takes the copies):

    warden run --nproc-per-node 1 --rdzv-id trainer-bench --no-standby -- \\
        python3 client/python/bench/trainer_save.py [--sizes-mib 64,256] [--saves 5]

For each state size (a BERT for sequence classification sized so that its
parameters and Adam's two moments come to about that many MiB), one process,
side by side in one run:
  - memcpy: libc's ``memcpy`` (``ctypes.memmove``) of the same bytes (every
    parameter and optimizer tensor), in one piece, into a buffer touched before;
    and the same bytes split over the threads the save copies with
    (``copy_threads()``, in brackets), by the save's own native copy;
  - async: the step held by a save under ``WardenTrainer`` (the default,
    ``async_save=True``): the time ``_maybe_log_save_evaluate`` takes at a step
    that saves, with the wait for the save before it (none here: each save
    finishes before the next, ``--gap`` steps apart);
  - sync: the same with ``WardenTrainer(async_save=False)``: the Trainer's own
    ``_save_checkpoint`` (safetensors, ``torch.save``) on the training thread.
Both with ``WardenCallback(save_to_tier=False)``: the tier is the job's, and
the second run would resume from the first one's newest step; the copy into
the tier runs in the background either way.
The median of ``--saves`` saves after the first (the first allocates the
buffer). Prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from warden.integrations import transformers as wt
from warden import _native
from warden.async_checkpoint import copy_threads

MIB = 1 << 20

with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_s.getsockname()[1]))


def config_of(total_mib: int) -> BertConfig:
    """A BERT whose parameters x3 (Adam's two moments) come to about ``total_mib``."""
    params = total_mib * MIB // 4 // 3
    hidden = 512
    layers = max(1, round((params - 2048 * hidden) / (12 * hidden * hidden)))
    return BertConfig(
        vocab_size=2048,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        intermediate_size=4 * hidden,
        max_position_embeddings=32,
        num_labels=2,
    )


class Toy(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 2048, (16,), generator=g)
        return {"input_ids": ids, "labels": ids.sum() % 2}


def memcpy_ms(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    tensors = [p.detach() for p in model.parameters()]
    for s in optimizer.state.values():
        tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    src = torch.empty(total, dtype=torch.uint8)
    dst = torch.empty(total, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(0)
    threads = copy_threads()
    one, split = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), total)
        t1 = time.perf_counter()
        _native._copy_regions(dst.data_ptr(), total, [(src.data_ptr(), 0, total)], threads)
        one.append(t1 - t0)
        split.append(time.perf_counter() - t1)
    return statistics.median(one) * 1e3, statistics.median(split) * 1e3, threads, total


def run(size_mib: int, async_save: bool, saves: int, gap: int) -> tuple:
    out = tempfile.mkdtemp(prefix=f"trainer-bench-{size_mib}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    torch.manual_seed(0)
    args = wt.WardenTrainingArguments(
        output_dir=out,
        max_steps=gap * (saves + 1),
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=gap,
        save_total_limit=1,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = wt.WardenTrainer(
        model=BertForSequenceClassification(config_of(size_mib)),
        args=args,
        train_dataset=Toy(),
        # Not into the tier: the tier is the job's, and the second run would
        # resume from the first one's newest step. What is measured is the
        # Trainer's checkpoint-N on the training thread.
        callbacks=[wt.WardenCallback(save_to_tier=False)],
        async_save=async_save,
    )
    held: list = []
    inner = trainer._maybe_log_save_evaluate

    def timed(*a, **kw):
        saving = trainer.control.should_save
        if saving:
            # Each save finished before the next: the stall measured is the
            # save's own, not back pressure.
            wt._copier.wait()
        t0 = time.perf_counter()
        r = inner(*a, **kw)
        if saving:
            held.append(time.perf_counter() - t0)
        return r

    trainer._maybe_log_save_evaluate = timed
    trainer.train()
    copy_ms, split_ms, threads, total = memcpy_ms(trainer.model, trainer.optimizer)
    return statistics.median(held[1:]) * 1e3, held[0] * 1e3, copy_ms, split_ms, threads, total


def in_child(size: int, async_save: bool, a: argparse.Namespace) -> tuple:
    """``run`` in a process of its own: a second Trainer in one process
    would be taken for the next attempt of the first (``WardenTrainer`` heals
    the progress a live process holds) and start where it ended."""
    cmd = [sys.executable, __file__, "--one", f"{size},{int(async_save)}", "--saves", str(a.saves), "--gap", str(a.gap)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mib", default="64,256")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--gap", type=int, default=3)
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.one:
        size, asy = (int(x) for x in a.one.split(","))
        print(json.dumps(run(size, bool(asy), a.saves, a.gap)), flush=True)
        return
    print(
        "| state (parameters + Adam) | memcpy (same bytes) | memcpy split over the save's threads | "
        "WardenTrainer async save, median | async / memcpy | async / split memcpy | first async save "
        "| Trainer's own save (async_save=False), median | own / async |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in [int(s) for s in a.sizes_mib.split(",")]:
        asy, first, copy_ms, split_ms, threads, total = in_child(size, True, a)
        own = in_child(size, False, a)[0]
        print(
            f"| {total / MIB:.0f} MiB | {copy_ms:.1f} ms | {split_ms:.1f} ms ({threads}) | {asy:.1f} ms "
            f"| {asy / copy_ms:.2f}x | {asy / split_ms:.2f}x | {first:.1f} ms | {own:.1f} ms | {own / asy:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
