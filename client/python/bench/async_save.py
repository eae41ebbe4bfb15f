"""The save stall of warden.async_checkpoint against a plain copy of the same
bytes, and a training step's time with saves every 10 steps (issue 32).

Run under warden (the agent's tier takes the shards):

    warden run --nproc-per-node 1 --rdzv-id async-bench -- \\
        python3 client/python/bench/async_save.py [--sizes-mib 64,256,1024] [--repeat 5]

For each state size (tensors of 16 MiB each, float32), side by side in one run:
  - memcpy: libc's ``memcpy`` (``ctypes.memmove``) of the same bytes, in one
    piece, into a preallocated buffer; and the same bytes split over the
    threads a save copies with (``copy_threads()``, in brackets) by the
    save's own native copy;
  - async: ``AsyncCheckpointer.save`` (the step's stall: the copy into the
    saver's reused buffer; on a GPU the copy's time on the GPU, measured by
    CUDA events, as ``save`` only queues it on the training stream and
    returns), the median of ``--repeat`` saves after the first,
    each save committed before the next (no back pressure), alternated with
    the memcpy so both run under the same conditions;
  - async, first: the first save (its buffer is allocated then);
  - async, first, prepared: the first save of a new saver whose buffer
    ``prepare`` made ahead (and the time that took, on its own thread);
  - sync: ``checkpoint.save_state_dict`` (torch.save into the tier).
Then a CPU training loop (an MLP of about 64 MiB of parameters and Adam
state), one model and one saver throughout, in ``--pairs`` pairs of
segments of ``--steps`` steps: one segment without saves, one with an async
save every 10 steps and the saver drained at its end (so every save's
background work, the write, the hash and the commit, is inside the segment
that made it), the pairs' order alternated (AB, BA, ...) so that drift on a
shared machine falls on both sides. Printed: each side's median step time,
the median and range of the per-pair ratios, a 95% interval of that median
(the pairs resampled with replacement, 10,000 times, seeded), what it says of
issue 32's target (within 2% of no saves: met where the interval's top is
under +2%, excluded where its bottom is over, else undecided), and the stall
per save.

With ``--writer-nice N``, the step-time part runs three arms instead of
two, in ``--pairs`` triples, the order rotated: no saves; saves with the
saver's background thread at the process's priority; saves with a second
saver's thread at nice ``N`` (does a lower-priority writer give the training
thread back what the background costs it?).

With ``--dcp``, the same sizes through ``torch.distributed.checkpoint``
instead (one process), side by side in one run:
  - memcpy, as above;
  - warden: the time ``dcp.async_save`` with ``WardenStorageWriter`` takes to
    return (the step's stall: staging into the writer's reused buffer, then
    the background thread started; the staging alone in brackets), the median
    of ``--repeat`` after the first;
  - torch: the same call with torch's ``FileSystemWriter`` on /dev/shm and
    torch's ``DefaultStager`` (one stager for all saves; its pinned and shared
    memory off, as there is no GPU here, and staging synchronous, so the
    call's return means the copy is taken, as with warden's);
each save finished before the next (no back pressure).

With ``--device cuda`` the state and the training loop live on the GPU,
and the baseline is a plain ``cudaMemcpy`` (libcudart's, called through
ctypes, device to host) of the same bytes, in one piece, into page-locked
memory allocated once: the copy the async save's stall is held against on a
GPU (issue 32's 1.2x target). The saver's buffers are pinned there
(``AsyncCheckpointer``'s default when CUDA is available), so the save's copy
is the same DMA, cut into the state's tensors. For ``--dcp``, torch's stager
then uses pinned memory and non-blocking copies too.

Prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import time

import torch

import warden.checkpoint as ckpt
from warden import _native
from warden.async_checkpoint import AsyncCheckpointer, copy_threads, held_s

MIB = 1 << 20


DEVICE = "cpu"


def state_of(total: int) -> dict:
    per = 16 * MIB
    n = max(1, total // per)
    return {f"t{i}": torch.randn(per // 4, device=DEVICE) for i in range(n)}


class Baseline:
    """The plain copy of ``nbytes`` the stall is held against: libc's memcpy
    between two host buffers, or, with the state on a GPU, libcudart's
    cudaMemcpy from one device buffer into one page-locked host buffer."""

    def __init__(self, state: dict) -> None:
        self.src = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
        self.nbytes = self.src.numel()
        self.cuda = self.src.is_cuda
        self.dst = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.dst.copy_(self.src)  # its pages touched once, as the saver's buffer after its first save
        self._memcpy = cudart().cudaMemcpy if self.cuda else None

    def copy(self) -> float:
        t0 = time.perf_counter()
        if self.cuda:
            err = self._memcpy(ctypes.c_void_p(self.dst.data_ptr()), ctypes.c_void_p(self.src.data_ptr()),
                               ctypes.c_size_t(self.nbytes), 2)  # cudaMemcpyDeviceToHost
            if err != 0:
                raise RuntimeError(f"cudaMemcpy failed: error {err}")
        else:
            ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.nbytes)
        return time.perf_counter() - t0

    def split(self) -> float:
        """On the CPU, the same bytes in one piece split over the threads a
        save copies with (``copy_threads()``), by the save's own native copy:
        the most a save's copy could do on these cores. NaN on a GPU."""
        if self.cuda:
            return float("nan")
        t0 = time.perf_counter()
        _native._copy_regions(self.dst.data_ptr(), self.nbytes, [(self.src.data_ptr(), 0, self.nbytes)], copy_threads())
        return time.perf_counter() - t0


def split_cell(split: list) -> str:
    """The split memcpy's median and its thread count, or a dash on a GPU."""
    if DEVICE != "cpu":
        return "-"
    return f"{statistics.median(split) * 1e3:.1f} ms ({copy_threads()})"


def held_note(queued: float) -> str:
    """On a GPU, the training thread's own time in save() beside the hold."""
    return f" (save() returned in {queued * 1e3:.2f} ms)" if DEVICE != "cpu" else ""


def copy_name() -> str:
    return "cudaMemcpy D2H into pinned" if DEVICE != "cpu" else "memcpy"


def cudart() -> ctypes.CDLL:
    """The libcudart this process's torch loaded (the same CUDA context)."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    for path in sorted(paths):
        if os.path.exists(path):
            return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")


def bench_sizes(sizes_mib: list, repeat: int) -> None:
    c = copy_name()
    print(
        f"| state | {c} (same bytes) | memcpy split over the save's threads | async save stall, median "
        f"| async / {c} | first async save "
        "| first async save, prepared (made ahead in) | sync save_state_dict "
        "| background: write, commit (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    step = 1
    for mib in sizes_mib:
        state = state_of(mib * MIB)
        base = Baseline(state)
        nbytes = base.nbytes
        saver = AsyncCheckpointer(max_in_flight=1)
        copies, splits, stalls, queued, background = [], [], [], [], []
        first = 0.0
        # Alternated, each pair under the same conditions (the agent hashes
        # and places each committed shard meanwhile, on the same cores).
        for i in range(repeat + 1):
            if i > 0:
                copies.append(base.copy())
                splits.append(base.split())
            saver.save(step, state)
            step += 1
            saver.wait()
            # The step's hold, as booked: on a GPU the copy runs on the
            # training stream after save() returns, for the GPU's copy time.
            held = saver.last_held_s
            if i == 0:
                first = held
            else:
                stalls.append(held)
                queued.append(saver.last_stall_s)
                background.append((saver.last_write_s, saver.last_commit_s))
        saver.close()
        del saver, base
        # The first save of a saver whose buffer ``prepare`` made ahead (on
        # its own thread, as a job would while its steps go on).
        saver = AsyncCheckpointer(max_in_flight=1)
        t0 = time.perf_counter()
        saver.prepare(state)
        saver.prepared()
        ahead = time.perf_counter() - t0
        saver.save(step, state)
        step += 1
        saver.wait()
        first_prepared = saver.last_held_s
        saver.close()
        del saver
        t0 = time.perf_counter()
        ckpt.save_state_dict(step, state)
        sync = time.perf_counter() - t0
        step += 1
        copy = statistics.median(copies)
        stall = statistics.median(stalls)
        print(
            f"| {nbytes / MIB:.0f} MiB | {copy * 1e3:.1f} ms ({nbytes / copy / 1e9:.1f} GB/s) | {split_cell(splits)} "
            f"| {stall * 1e3:.1f} ms{held_note(statistics.median(queued))} | {stall / copy:.2f}x "
            f"| {first * 1e3:.1f} ms | {first_prepared * 1e3:.1f} ms ({ahead:.2f} s) | {sync * 1e3:.1f} ms "
            f"| {statistics.median(w for w, _ in background) * 1e3:.0f} ms, "
            f"{statistics.median(c for _, c in background) * 1e3:.0f} ms |",
            flush=True,
        )
        del state


def bench_dcp(sizes_mib: list, repeat: int) -> None:
    import tempfile  # noqa: PLC0415

    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint import FileSystemWriter  # noqa: PLC0415
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: PLC0415

    from warden.integrations.dcp import StagingPool, WardenStorageWriter  # noqa: PLC0415

    c = copy_name()
    print(
        f"| state | {c} (same bytes) | memcpy split over the save's threads | dcp.async_save, WardenStorageWriter | / {c} "
        f"| dcp.async_save, FileSystemWriter + DefaultStager (torch) | / {c} |"
    )
    print("|---|---|---|---|---|---|---|")
    step = 100_000
    for mib in sizes_mib:
        state = state_of(mib * MIB)
        base = Baseline(state)
        pool = StagingPool()
        copies, splits, ours, staging, theirs = [], [], [], [], []
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            fs = FileSystemWriter(d, overwrite=True)
            # (pinned, shared memory, async staging, non-blocking copies)
            stager = DefaultStager(StagingOptions(base.cuda, False, False, base.cuda))
            for i in range(repeat + 1):
                copy = base.copy()
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=WardenStorageWriter(step=step, staging=pool))
                mine = time.perf_counter() - t0
                fut.result()
                # On a GPU the staging queues the copy on the training
                # stream; the stream is held for the GPU's copy time where
                # that outlasts the queueing.
                mine = held_s(mine, pool.last_stall_s, pool.last_device_copy_s)
                step += 1
                t0 = time.perf_counter()
                try:
                    fut = dcp.async_save(state, storage_writer=fs, checkpoint_id=d, async_stager=stager)
                except KeyError as e:
                    # torch 2.11's pinned stager (the GPU machine's torch)
                    # raised KeyError(<class 'type'>) on this plain state:
                    # its pageable stager instead, and the row says so.
                    print(f"(torch's pinned DefaultStager failed: KeyError {e}; its pageable one below)", flush=True)
                    stager.close()
                    stager = DefaultStager(StagingOptions(False, False, False, False))
                    t0 = time.perf_counter()
                    fut = dcp.async_save(state, storage_writer=fs, checkpoint_id=d, async_stager=stager)
                torch_s = time.perf_counter() - t0
                fut.result()
                if i > 0:
                    copies.append(copy)
                    splits.append(base.split())
                    ours.append(mine)
                    staging.append(pool.last_stall_s)
                    theirs.append(torch_s)
            stager.close()
        copy, mine, staged, torch_s = (statistics.median(x) for x in (copies, ours, staging, theirs))
        print(
            f"| {base.nbytes / MIB:.0f} MiB | {copy * 1e3:.1f} ms | {split_cell(splits)} | {mine * 1e3:.1f} ms (staging {staged * 1e3:.1f} ms) "
            f"| {mine / copy:.2f}x "
            f"| {torch_s * 1e3:.1f} ms | {torch_s / copy:.2f}x |",
            flush=True,
        )
        del state, base


def segment(model, opt, x, steps: int, saver, step0: int, item: bool = False) -> tuple:
    """Seconds for ``steps`` training steps, with an async save every 10
    when ``saver`` is given, and the saves in flight drained at the end;
    and the seconds of that drain (its share of the segment)."""
    t0 = time.perf_counter()
    for s in range(steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if item:
            loss.item()  # a loop that logs its loss: the CPU waits for each step
        if saver is not None and s % 10 == 9:
            saver.save(step0 + s, {"model": model.state_dict(), "optim": opt.state_dict()})
    if x.is_cuda:
        torch.cuda.synchronize()  # the segment's kernels done, not only queued
    drained = time.perf_counter()
    if saver is not None:
        saver.wait()
    end = time.perf_counter()
    return end - t0, end - drained


def median_interval(ratios: list, resamples: int = 10_000, seed: int = 1) -> tuple:
    """A 95% percentile bootstrap interval of the median of ``ratios``."""
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def target_verdict(lo: float, hi: float, target: float = 1.02) -> str:
    """What the interval of the median ratio says of ``target``."""
    if hi < target:
        return "met"
    if lo > target:
        return "excluded"
    return "undecided"


def bench_writer_nice(steps: int, triples: int, batch: int, nice: int) -> None:
    """Three arms, the order rotated (ABC, BCA, CAB): no saves; a save every
    10 steps with the saver's background thread at the process's priority;
    the same with a second saver's thread at ``nice``. Prints each saving
    arm against no saves, and the two against each other, pair by pair."""
    model, opt, x = step_model(batch)
    with AsyncCheckpointer() as plain, AsyncCheckpointer() as lowered:
        os.setpriority(os.PRIO_PROCESS, lowered._thread.native_id, nice)
        segment(model, opt, x, 10, plain, 0)
        segment(model, opt, x, 10, lowered, 10)
        arms = {"no saves": None, "saves, writer at nice 0": plain, f"saves, writer at nice {nice}": lowered}
        names = list(arms)
        times: dict = {n: [] for n in names}
        step = 1000
        for t in range(triples):
            for n in names[t % 3 :] + names[: t % 3]:
                el, _ = segment(model, opt, x, steps, arms[n], step)
                step += steps
                times[n].append(el / steps)

    def against(a: str, b: str) -> str:
        r = sorted(y / x for x, y in zip(times[a], times[b]))
        lo, hi = median_interval(r)
        return f"{(statistics.median(r) - 1) * 100:+.1f}% ({(lo - 1) * 100:+.1f}% to {(hi - 1) * 100:+.1f}%)"

    print()
    print(f"| {triples} triples of {steps}-step segments | median step | against no saves, per triple: median (95% interval) |")
    print("|---|---|---|")
    for n in names:
        vs = "" if arms[n] is None else against(names[0], n)
        print(f"| {n} | {statistics.median(times[n]) * 1e3:.1f} ms | {vs} |")
    print(f"| nice {nice} against nice 0, per triple | | {against(names[1], names[2])} |")


def step_model(batch: int, device: str = "cpu") -> tuple:
    """The step-time parts' training loop (also ``save_contention.py``'s): an
    MLP of about 32 MiB of parameters (96 MiB with Adam's state), seeded,
    its optimizer and a batch of ``batch`` rows, on ``device``; on the CPU
    torch runs one thread."""
    if device == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt, torch.randn(batch, 1024, device=device)


def bench_steps(steps: int, pairs: int, batch: int, item: bool) -> None:
    model, opt, x = step_model(batch, DEVICE)
    plain: list = []
    saving: list = []
    drains: list = []
    steady: list = []
    with AsyncCheckpointer(max_in_flight=1) as saver:
        # Warm-up: Adam's state allocated, the saver's buffer allocated.
        segment(model, opt, x, 10, saver, 0, item)
        stall0, saves0 = saver.total_stall_s, saver.committed
        step = 1000
        for p in range(pairs):
            for with_saves in ((False, True) if p % 2 == 0 else (True, False)):
                t, drain = segment(model, opt, x, steps, saver if with_saves else None, step, item)
                step += steps
                (saving if with_saves else plain).append(t / steps)
                if with_saves:
                    drains.append(drain)
                    steady.append((t - drain) / steps)
        stall = saver.total_stall_s - stall0
        saves = saver.committed - saves0
    ratios = sorted(b / a for a, b in zip(plain, saving))
    lo, hi = median_interval(ratios)
    a, b = statistics.median(plain), statistics.median(saving)
    print()
    print(
        f"| training step ({'CPU, 1 thread' if DEVICE == 'cpu' else DEVICE}, batch {batch}, ~52 MiB of "
        f"parameters and Adam state x3{', loss.item() each step' if item else ''}; {pairs} pairs of "
        f"{steps}-step segments, alternated) | median step | with saves / without, per pair |"
    )
    print("|---|---|---|")
    print(f"| no saves | {a * 1e3:.1f} ms | |")
    print(
        f"| an async save every 10 steps, drained at the segment's end | {b * 1e3:.1f} ms | median "
        f"{(statistics.median(ratios) - 1) * 100:+.1f}% (from {(ratios[0] - 1) * 100:+.1f}% to "
        f"{(ratios[-1] - 1) * 100:+.1f}%), 95% interval of the median {(lo - 1) * 100:+.1f}% to "
        f"{(hi - 1) * 100:+.1f}%: the 2% target {target_verdict(lo, hi)}; "
        f"{'stall' if DEVICE == 'cpu' else 'time in save() (the GPU copies after it)'} "
        f"{stall / max(saves, 1) * 1e3:.1f} ms a save, "
        f"{stall / (sum(saving) * steps) * 100:.1f}% of the saving segments' time; the drain at a segment's end "
        f"(its last save's background, on the clock by design) {statistics.median(drains) * 1e3:.1f} ms, "
        f"{statistics.median(drains) / (steps * b) * 100:.1f}% of a segment |"
    )
    # A job's steady state: saves every 10 steps without end, so no save's
    # background is waited for; the segment's last save still runs beside
    # its last steps, so at most its cost is left out.
    held = sorted(c / a for a, c in zip(plain, steady))
    lo2, hi2 = median_interval(held)
    print(
        f"| the same, the drain at the segment's end left out (a job that goes on saving) | "
        f"{statistics.median(steady) * 1e3:.1f} ms | median {(statistics.median(held) - 1) * 100:+.1f}% (from "
        f"{(held[0] - 1) * 100:+.1f}% to {(held[-1] - 1) * 100:+.1f}%), 95% interval of the median "
        f"{(lo2 - 1) * 100:+.1f}% to {(hi2 - 1) * 100:+.1f}%: the 2% target {target_verdict(lo2, hi2)} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="64,256,1024")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100, help="steps of each segment of the step-time part (0: skip it)")
    ap.add_argument("--pairs", type=int, default=6, help="pairs of segments (with and without saves)")
    ap.add_argument("--batch", type=int, default=64, help="rows of the step-time part's batch (its step's length)")
    ap.add_argument("--item", action="store_true", help="the step-time part reads loss.item() each step")
    ap.add_argument("--dcp", action="store_true", help="dcp.async_save instead (see above)")
    ap.add_argument(
        "--writer-nice", type=int, default=None,
        help="the step-time part in three arms instead: no saves, the writer at nice 0, at this nice (--pairs triples)",
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives (see above)")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    if a.dcp:
        bench_dcp([int(x) for x in a.sizes_mib.split(",")], a.repeat)
        return
    bench_sizes([int(x) for x in a.sizes_mib.split(",")], a.repeat)
    if a.steps > 0 and a.writer_nice is not None:
        bench_writer_nice(a.steps, a.pairs, a.batch, a.writer_nice)
    elif a.steps > 0:
        bench_steps(a.steps, a.pairs, a.batch, a.item)


if __name__ == "__main__":
    main()
