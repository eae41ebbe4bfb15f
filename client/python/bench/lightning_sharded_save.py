"""Lightning FSDP2's sharded checkpoint: the step held by warden's async save
into the tier, against a plain copy of each rank's bytes and Lightning's own
sharded save (issue 32).

Run as 2 ranks under warden (the agent's tier takes the saves):

    warden run --nproc-per-node 2 --rdzv-id lightning-sharded-bench --no-standby -- \\
        python3 client/python/bench/lightning_sharded_save.py [--size-mib 256] [--saves 5]

One fit of an MLP sized so that its parameters and Adam's two moments come to
about ``--size-mib`` over both ranks, sharded by FSDP2 under
``WardenModelParallelStrategy`` (its default sharded checkpoint), on the CPU
with gloo, one thread a rank. Once Adam's state exists (after step 2), at the
same state, ``--saves`` times each, every rank alike:
  - memcpy: libc's ``memcpy`` of this rank's bytes (its shards of every
    parameter and optimizer tensor) in one piece, into a buffer touched before,
    every rank at once (a barrier before each copy), as the ranks' saves copy:
    they share the memory's bandwidth, as the saves do;
  - async: the step held by warden's sharded save with ``async_save=True``
    (what ``WardenCallback`` runs: Lightning's checkpoint dictionary built,
    its shards staged into the reused buffer, ``dcp.async_save`` started),
    each save's background write and commit finished before the next;
  - sync: the same with ``async_save=False`` (DCP writes and commits the
    shards into the tier on the training thread);
  - own: Lightning's own ``trainer.save_checkpoint`` of the same sharded
    state, a DCP folder on the local disk (what a user without warden has).
The median of the saves after the first (the first allocates the buffers).
Rank 0 prints a markdown row for docs/benchmarks.md; the saves are steps
1,000,000 and on of this job's tier.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import time

import pytorch_lightning as pl
import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import warden
from warden.integrations import _lightning_sharded as sharded
from warden.integrations.lightning import WardenModelParallelStrategy

MIB = 1 << 20
WIDTH = 1024


class Mlp(pl.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def local_bytes(trainer: pl.Trainer) -> int:
    """This rank's bytes: its shards of the parameters and Adam's state."""
    total = 0
    for p in trainer.lightning_module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    for state in trainer.optimizers[0].state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


def memcpy_ms(nbytes: int, repeat: int) -> float:
    import torch.distributed as dist

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(0)
    times = []
    for _ in range(repeat):
        # Every rank copies at once, as every rank's save does.
        dist.barrier()
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class Measure(pl.Callback):
    def __init__(self, saves: int) -> None:
        self.saves = saves
        self.row = ""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 2:
            return
        import torch.distributed as dist

        step = 1_000_000
        held: dict = {"async": [], "sync": [], "own": []}
        folder = tempfile.mkdtemp(prefix="lightning-own-", dir=os.environ.get("BENCH_OWN_DIR"))
        for _ in range(self.saves):
            for how in ("async", "sync", "own"):
                dist.barrier()
                t0 = time.perf_counter()
                if how == "own":
                    trainer.save_checkpoint(os.path.join(folder, f"step-{step}"))
                else:
                    assert sharded.save(trainer, step, how == "async"), f"the {how} save of {step} failed"
                held[how].append(time.perf_counter() - t0)
                # Each save finished (written, committed) before the next.
                sharded.wait()
                step += 1
        dist.barrier()
        shutil.rmtree(folder, ignore_errors=True)
        nbytes = local_bytes(trainer)
        copy = memcpy_ms(nbytes, self.saves)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in held.items()}
        world = dist.get_world_size()
        self.row = (
            f"| {nbytes * world / MIB:.0f} MiB ({nbytes / MIB:.0f} MiB a rank) | {copy:.1f} ms "
            f"| {med['async']:.1f} ms | {med['async'] / copy:.2f}x | {held['async'][0] * 1e3:.1f} ms "
            f"| {med['sync']:.1f} ms | {med['own']:.1f} ms | {med['own'] / med['async']:.1f}x |"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    # Parameters and Adam's two moments: 3 x 4 bytes a weight.
    layers = max(1, round(a.size_mib * MIB / (12 * WIDTH * (WIDTH + 1))))
    measure = Measure(a.saves)

    def train() -> None:
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(64, WIDTH))
        trainer = pl.Trainer(
            max_steps=3,
            accelerator="cpu",
            devices=world,
            strategy=WardenModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            callbacks=[measure],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Mlp(layers), DataLoader(data, batch_size=4))

    warden.run(train)
    if int(os.environ["RANK"]) == 0:
        print(
            "| state (parameters + Adam), both ranks | memcpy (a rank's bytes) | warden async, median "
            "| async / memcpy | first async | warden sync, median | Lightning's own (DCP folder on disk), median "
            "| own / async |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print(measure.row, flush=True)


if __name__ == "__main__":
    main()
