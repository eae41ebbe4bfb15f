"""One real torch (gloo, CPU) data-parallel training function for the fault bench, under three systems.

tests/bench-faults.sh runs it (docs/benchmarks.md, "Faults side by side").
``train`` is a plain function; what differs per system is only who calls it
and where its attempt number comes from:

  --system warden   ``warden.run(train)`` under ``warden run`` (the attempt:
                    TORCHELASTIC_RESTART_COUNT and ``warden.restart_count()``)
  --system torchrun called once per process under ``torchrun`` (the attempt:
                    TORCHELASTIC_RESTART_COUNT)
  --system nvrx     called by NVRx's ``inprocess.Wrapper`` (the attempt: its
                    ``CallWrapper.iteration``); intervals from --nvrx-* flags

Every attempt makes its process group on a new FileStore (one file per
attempt in --store-dir) and resumes from its own checkpoint of the weights:
every --checkpoint-every steps a rank saves them; after a restart the ranks
agree (all_reduce MIN) on the newest step every rank saved and load it, so
their weights stay identical.

Faults, in the first attempt only, on --fault-rank at --fault-step, inside
the step before its all_reduce (the other ranks wait in theirs). Each is
stamped with time.time() just before it happens:
  crash      os._exit(3)
  transient  raises an NCCL-timeout RuntimeError
  hang       time.sleep(3600) (hung in Python)
  stop       SIGSTOP to itself (frozen: only SIGCONT or SIGKILL moves it)

Lines on stdout, flushed (T: time.time() on the host's clock):
  attempt key=K rank=R world=W pid=P
  fault KIND step=N pid=P t=T
  stepping key=K rank=R step=N pid=P t=T     (first step completed in an attempt after the first)
  done key=K rank=R world=W pid=P weights=H
"""

import argparse
import datetime
import glob
import hashlib
import os
import re
import signal
import sys
import time
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist


def say(line: str) -> None:
    print(line, flush=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["warden", "torchrun", "nvrx"], required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--store-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--fault", choices=["none", "crash", "transient", "hang", "stop"], default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=20)
    p.add_argument("--nvrx-interval", type=float, default=0.1, help="NVRx's four intervals, s")
    p.add_argument("--nvrx-soft-timeout", type=float, default=1.0)
    p.add_argument("--nvrx-hard-timeout", type=float, default=2.0)
    return p.parse_args()


def train(
    a: argparse.Namespace,
    key: str,
    first: bool,
    ping: Optional[Callable[[], None]] = None,
    step: Callable[[int], ContextManager] = lambda n: nullcontext(),
) -> str:
    """One attempt: a new group on a new store, resume from the agreed checkpoint, train to the end.

    ``key`` names the attempt (the store's file); ``first`` is whether it is
    the job's first attempt (the only one with the fault). Progress goes to
    the system as it asks for it: ``ping()`` after each step (NVRx), each
    step inside ``step(n)`` (warden). Returns a hash of the weights.
    """
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    pid = os.getpid()
    store = dist.FileStore(os.path.join(a.store_dir, f"attempt-{key}"), world)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world,
        # Long: only the system under test may end a wait, never this time-out.
        timeout=datetime.timedelta(seconds=600),
    )

    def ckpt(step: int) -> str:
        return os.path.join(a.checkpoint_dir, f"rank{rank}-step{step}.pt")

    def save(step: int, w: torch.Tensor) -> None:
        tmp = ckpt(step) + ".tmp"
        torch.save({"step": step, "w": w}, tmp)
        os.replace(tmp, ckpt(step))

    def latest() -> int:
        steps = [
            int(m.group(1))
            for f in glob.glob(os.path.join(a.checkpoint_dir, f"rank{rank}-step*.pt"))
            if (m := re.search(r"-step(\d+)\.pt$", f))
        ]
        return max(steps, default=0)

    w = torch.zeros(8, dtype=torch.float64)
    start = 0
    if first:
        save(0, w)
    else:
        agreed = torch.tensor([latest()], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        start = int(agreed.item())
        w = torch.load(ckpt(start))["w"]
    say(f"attempt key={key} rank={rank} world={world} start={start} pid={pid}")
    stamp_next = not first
    for n in range(start, a.steps):
        with step(n):
            g = torch.arange(8, dtype=torch.float64) * (n + 1) + rank
            time.sleep(a.step_ms / 2000.0)
            if first and rank == a.fault_rank and n == a.fault_step:
                fault(a.fault, n, pid)
            dist.all_reduce(g)
            w -= 0.01 * g / world
            time.sleep(a.step_ms / 2000.0)
        if ping is not None:
            ping()
        if stamp_next:
            say(f"stepping key={key} rank={rank} step={n} pid={pid} t={time.time():.6f}")
            stamp_next = False
        if (n + 1) % a.checkpoint_every == 0:
            save(n + 1, w)
    dist.destroy_process_group()
    return hashlib.sha256(repr(w.tolist()).encode()).hexdigest()[:16]


def fault(kind: str, n: int, pid: int) -> None:
    if kind == "none":
        return
    say(f"fault {kind} step={n} pid={pid} t={time.time():.6f}")
    if kind == "crash":
        os._exit(3)
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "stop":
        os.kill(pid, signal.SIGSTOP)
    elif kind == "transient":
        raise RuntimeError(
            "[Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=8) ran for "
            "600000 milliseconds before timing out."
        )


def under_warden(a: argparse.Namespace) -> str:
    import warden

    elastic = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def attempt() -> str:
        count = warden.restart_count()
        return train(a, f"{elastic}-{count}", elastic == 0 and count == 0, step=warden.step)

    return warden.run(attempt)


def under_torchrun(a: argparse.Namespace) -> str:
    elastic = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return train(a, f"{elastic}", elastic == 0)


def under_nvrx(a: argparse.Namespace) -> str:
    import logging

    from nvidia_resiliency_ext import inprocess

    # Its log lines, stamped on the host's clock: the bench reads the first
    # "RankShouldRestart" (a rank taking the restart) as NVRx's detection.
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="nvrx-log t=%(created).6f %(name)s %(levelname)s %(message)s"
    )
    iv = datetime.timedelta(seconds=a.nvrx_interval)

    @inprocess.Wrapper(
        monitor_thread_interval=iv,
        monitor_process_interval=iv,
        heartbeat_interval=iv,
        progress_watchdog_interval=iv,
        soft_timeout=datetime.timedelta(seconds=a.nvrx_soft_timeout),
        hard_timeout=datetime.timedelta(seconds=a.nvrx_hard_timeout),
        heartbeat_timeout=datetime.timedelta(seconds=a.nvrx_hard_timeout),
        termination_grace_time=datetime.timedelta(seconds=0.5),
        # Its default waits 1 s for other ranks' failures before every restart.
        last_call_wait=iv,
        health_check=None,
    )
    def attempt(call_wrapper: Optional[inprocess.CallWrapper] = None) -> str:
        assert call_wrapper is not None
        it = call_wrapper.iteration
        return train(a, f"{it}", it == 0, call_wrapper.ping)

    return attempt()


def main() -> int:
    a = parse()
    run = {"warden": under_warden, "torchrun": under_torchrun, "nvrx": under_nvrx}[a.system]
    digest = run(a)
    if digest is None:  # NVRx: a rank left out of the new world
        say(f"inactive pid={os.getpid()}")
        return 0
    elastic = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    say(
        f"done elastic={elastic} rank={os.environ.get('RANK')} world={os.environ.get('WORLD_SIZE')} "
        f"pid={os.getpid()} weights={digest}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
