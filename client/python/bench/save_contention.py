"""Where does the step-time cost of async saves on a machine come from?
(issue 32's 2% target; docs/benchmarks.md.)

Run under warden (the save arm saves into the agent's tier):

    warden run --nproc-per-node 1 --rdzv-id contention --no-standby -- \\
        python3 client/python/bench/save_contention.py [--steps 200] [--rounds 9] \\
        [--arms none,dicts,copy,save] [--mover file]

The step-time part's model of ``async_save.py`` (a CPU MLP, one thread,
about 96 MiB of parameters and Adam state), in rounds of one segment per
arm, the order rotated each round (ABCD, BCDA, ...). Arms, each acting
every 10 steps:
  - none: no saves;
  - dicts: ``model.state_dict()`` and ``opt.state_dict()`` called and
    dropped (what the loop does for a save before warden sees it);
  - copy: the same, and the tensors copied into a buffer of this process
    on the training thread as a save's snapshot copies them
    (``async_checkpoint.copy_into``): the save's stall and what it does to
    the caches, without the background;
  - move: a thread of this process moves the bytes a save's background
    moves, without warden: ``--mover memmove``, two memmoves of the shard's
    size; ``--mover file``, the shard's bytes written to a new /dev/shm
    file, read back, and the file two saves older removed (as the tier
    keeps two);
  - save: ``AsyncCheckpointer.save``, drained at the end of the segment.
Printed: each arm's median step and, against none, the per-round median
ratio with a 95% interval (``async_save.median_interval``); and the CPU
each arm spent per action beyond none's, in this process (every thread)
and in its parent (``warden run``, with the agent embedded when no wardend
runs), from /proc.
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

from warden import async_checkpoint, tensor_bytes  # noqa: E402
from warden.async_checkpoint import AsyncCheckpointer  # noqa: E402


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` so far, from
    /proc/<pid>/stat; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # Fields 14 and 15 (utime, stime), counted from after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", "--triples", type=int, default=9)
    p.add_argument("--arms", default="none,dicts,copy,save")
    p.add_argument("--mover", choices=("memmove", "file"), default="memmove")
    a = p.parse_args()
    arms = [k.strip() for k in a.arms.split(",") if k.strip()]
    known = ("none", "dicts", "copy", "move", "save")
    if "none" not in arms or any(k not in known for k in arms):
        p.error(f"--arms: a comma-separated list of {', '.join(known)}, with none")
    own = async_checkpoint._Slot()
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
                    f.write(tensor_bytes.view(buf))
                with open(path, "rb") as f:
                    while f.read(8 << 20):
                        pass
                old = f"/dev/shm/warden-contention-{os.getpid()}-{made[0] - 2}"
                if os.path.exists(old):
                    os.remove(old)
            work.task_done()

    threading.Thread(target=mover, daemon=True).start()

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def copy_own() -> None:
        """What a save's snapshot does, into this process's own buffer."""
        held: list = []
        async_checkpoint.skeleton(state(), held, torch)
        async_checkpoint.copy_into(own, held, False, torch)

    def segment(kind: str, saver: AsyncCheckpointer, step0: int, nbytes: int) -> tuple:
        cpu0 = (time.process_time(), cpu_s(os.getppid()))
        t0 = time.perf_counter()
        for s in range(a.steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if s % 10 == 9:
                if kind == "save":
                    saver.save(step0 + s, state())
                elif kind == "dicts":
                    state()
                elif kind == "copy":
                    copy_own()
                elif kind == "move":
                    work.join()
                    work.put(nbytes)
        if kind == "save":
            saver.wait()
        elif kind == "move":
            work.join()
        wall = (time.perf_counter() - t0) / a.steps
        actions = a.steps // 10
        return wall, (time.process_time() - cpu0[0]) / actions, (cpu_s(os.getppid()) - cpu0[1]) / actions

    times: dict = {k: [] for k in arms}
    cpu: dict = {k: [] for k in arms}
    parent: dict = {k: [] for k in arms}
    try:
        with AsyncCheckpointer() as saver:
            ab.segment(model, opt, x, 10, saver, 0)  # Adam's state and the saver's buffer made
            tensors = list(model.state_dict().values())
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if "copy" in arms:  # the copy arm's buffer made before it is timed
                copy_own()
            step = 10_000
            for i in range(a.rounds):
                r = i % len(arms)
                for kind in arms[r:] + arms[:r]:
                    wall, own_cpu, parent_cpu = segment(kind, saver, step, nbytes)
                    times[kind].append(wall)
                    cpu[kind].append(own_cpu)
                    parent[kind].append(parent_cpu)
                    step += a.steps
    finally:
        work.put(None)
        for k in range(max(0, made[0] - 2), made[0] + 1):
            path = f"/dev/shm/warden-contention-{os.getpid()}-{k}"
            if os.path.exists(path):
                os.remove(path)
    base = statistics.median(times["none"])
    mover = f", mover {a.mover}" if "move" in arms else ""
    print(f"| arm ({a.rounds} rounds of {a.steps}-step segments{mover}, shard {nbytes / 2**20:.0f} MiB) "
          "| median step | against none, per round: median (95% interval) "
          "| wall per action beyond none | CPU per action beyond none: this process | its parent |")
    print("|---|---|---|---|---|---|")
    cpu0, parent0 = statistics.median(cpu["none"]), statistics.median(parent["none"])
    print(f"| none | {base * 1e3:.1f} ms | | | ({cpu0 * 1e3:.1f} ms) | ({parent0 * 1e3:.1f} ms) |")
    for kind in arms:
        if kind == "none":
            continue
        r = sorted(b / n for n, b in zip(times["none"], times[kind]))
        lo, hi = ab.median_interval(r)
        extra = (statistics.median(times[kind]) - base) * 10
        print(f"| {kind} | {statistics.median(times[kind]) * 1e3:.1f} ms "
              f"| {100 * (statistics.median(r) - 1):+.1f}% ({100 * (lo - 1):+.1f}% to {100 * (hi - 1):+.1f}%) "
              f"| {extra * 1e3:+.1f} ms "
              f"| {(statistics.median(cpu[kind]) - cpu0) * 1e3:+.1f} ms "
              f"| {(statistics.median(parent[kind]) - parent0) * 1e3:+.1f} ms |")


if __name__ == "__main__":
    main()
