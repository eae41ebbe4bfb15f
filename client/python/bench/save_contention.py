"""Is the step-time cost of async saves on a machine the bytes their
background moves? (issue 32's 2% target; docs/benchmarks.md.)

Run under warden (the third arm saves into the agent's tier):

    warden run --nproc-per-node 1 --rdzv-id contention --no-standby -- \\
        python3 client/python/bench/save_contention.py [--steps 200] [--triples 9] [--mover file]

The step-time part's model of ``async_save.py`` (a CPU MLP, one thread,
about 96 MiB of parameters and Adam state), in triples of segments, the
order rotated (ABC, BCA, CAB):
  - none: no saves;
  - move: every 10 steps, a thread of this process moves the bytes a save's
    background moves, without warden: ``--mover memmove``, two memmoves of
    the shard's size (the write into the tier, the agent's read to hash it);
    ``--mover file``, the shard's bytes written to a new /dev/shm file, read
    back, and the file two saves older removed (as the tier keeps two);
  - save: ``AsyncCheckpointer.save`` every 10 steps, drained at the end.
Printed: each arm's median step and, for move and save, the per-triple
median ratio against none with a 95% interval (``async_save.median_interval``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import async_save as ab  # noqa: E402

from warden.async_checkpoint import AsyncCheckpointer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--triples", type=int, default=9)
    p.add_argument("--mover", choices=("memmove", "file"), default="memmove")
    a = p.parse_args()
    model, opt, x = ab.step_model(64)
    work: queue.Queue = queue.Queue()
    made = [0]

    def mover() -> None:
        buf = None
        while True:
            n = work.get()
            if n is None:
                return
            if buf is None:
                buf = torch.ones(n, dtype=torch.uint8)
                spare = torch.empty(n, dtype=torch.uint8)
            if a.mover == "memmove":
                ctypes.memmove(spare.data_ptr(), buf.data_ptr(), n)
                ctypes.memmove(buf.data_ptr(), spare.data_ptr(), n)
            else:
                made[0] += 1
                path = f"/dev/shm/warden-contention-{os.getpid()}-{made[0]}"
                with open(path, "wb") as f:
                    f.write(memoryview(buf.numpy()))
                with open(path, "rb") as f:
                    while f.read(8 << 20):
                        pass
                old = f"/dev/shm/warden-contention-{os.getpid()}-{made[0] - 2}"
                if os.path.exists(old):
                    os.remove(old)
            work.task_done()

    threading.Thread(target=mover, daemon=True).start()

    def segment(kind: str, saver: AsyncCheckpointer, step0: int, nbytes: int) -> float:
        t0 = time.perf_counter()
        for s in range(a.steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if s % 10 == 9:
                if kind == "save":
                    saver.save(step0 + s, {"model": model.state_dict(), "optim": opt.state_dict()})
                elif kind == "move":
                    work.join()
                    work.put(nbytes)
        if kind == "save":
            saver.wait()
        elif kind == "move":
            work.join()
        return (time.perf_counter() - t0) / a.steps

    arms = ["none", "move", "save"]
    times: dict = {k: [] for k in arms}
    try:
        with AsyncCheckpointer() as saver:
            ab.segment(model, opt, x, 10, saver, 0)  # Adam's state and the saver's buffer made
            tensors = list(model.state_dict().values())
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            step = 10_000
            for i in range(a.triples):
                for kind in arms[i % 3 :] + arms[: i % 3]:
                    times[kind].append(segment(kind, saver, step, nbytes))
                    step += a.steps
    finally:
        work.put(None)
        for k in range(max(0, made[0] - 2), made[0] + 1):
            path = f"/dev/shm/warden-contention-{os.getpid()}-{k}"
            if os.path.exists(path):
                os.remove(path)
    base = statistics.median(times["none"])
    print(f"| arm ({a.triples} triples of {a.steps}-step segments, mover {a.mover}, shard {nbytes / 2**20:.0f} MiB) "
          "| median step | against none, per triple: median (95% interval) |")
    print("|---|---|---|")
    print(f"| none | {base * 1e3:.1f} ms | |")
    for kind in ("move", "save"):
        r = sorted(b / n for n, b in zip(times["none"], times[kind]))
        lo, hi = ab.median_interval(r)
        print(f"| {kind} | {statistics.median(times[kind]) * 1e3:.1f} ms "
              f"| {100 * (statistics.median(r) - 1):+.1f}% ({100 * (lo - 1):+.1f}% to {100 * (hi - 1):+.1f}%) |")


if __name__ == "__main__":
    main()
