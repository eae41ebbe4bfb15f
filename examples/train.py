#!/usr/bin/env python3
"""A toy training job for `warden run`: no torch, no GPU, any machine.

Each rank fits one number by gradient descent, one step every --step-ms,
inside warden's step and sections ("forward", "backward", "checkpoint") when
the `warden` package is installed (pip install ./client/python; without it
the job runs unwatched). It saves a checkpoint per rank every --ckpt-every
steps (a JSON file, written atomically; with --ckpt warden, a shard in the
agent's checkpoint tier) and resumes from it when restarted.

Faults to inject (all off by default):
  --crash-at-step N [--crash-rank R] [--crash-code C]
      rank R dies with os._exit(C) at step N: a crash. First attempt only
      (TORCHELASTIC_RESTART_COUNT 0), so an in-job restart recovers; with
      --crash-every-attempt on every attempt (a crash that is the code's).
      With --crash-step-shift D, attempt K dies at step N + K*D instead: a
      failure at a different step each time (with --ckpt-every 0, which
      never saves, a restart loop that makes no progress).
  --raise-at-step N [--raise-rank R]
      rank R raises ValueError in its model code at step N, on every attempt:
      a bug in the user's code, which no restart fixes.
  --hang-at-step N [--hang-rank R] [--hang-restart K]
      rank R stops making progress inside "backward" at step N, on the
      attempt with TORCHELASTIC_RESTART_COUNT K (default 0) before any
      in-process restart: a hang, for the agent's hang detection and
      in-process restarts (the training function runs under `warden.run`
      when the package has it, so an in-process restart resumes from the
      checkpoint). K > 0 puts a hang after a crash in one job.
  --orphan
      rank 0 starts, on the first attempt, two grandchildren that ignore
      SIGTERM (one of them in a session of its own): what the launcher's stop
      must still clean up.

Lines on stdout (the launcher prefixes them with the rank):
  world rank=R world_size=W group_rank=G nnodes=N epoch=E master=A:P
                                               (once, at start: the world this
                                               attempt was given; epoch: the
                                               job-wide round across hosts, - on one)
  ready pid=P restart=C start_step=S t=T       (T: time.time())
  env {...}                                    (with --print-env)
  step N loss L                                (every --report-every steps)
  resumed from checkpoint at step S
  crash: os._exit(C) at step N t=T
  orphan pid=P session=own|worker
  done steps=N w=W
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

try:
    import warden
except ImportError:  # the job still runs, unwatched
    warden = None

RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

ENV_SHOWN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "WARDEN_SOCKET",
    "WARDEN_JOB_ID",
    "WARDEN_RESTART_COUNT",
    "WARDEN_ROUND_EPOCH",
    "GROUP_WORLD_SIZE",
    "WARDEN_HEAL_PEER_WAIT_S",
)


def say(line: str) -> None:
    print(line, flush=True)


def section(name: str):
    return warden.section(name) if warden is not None else contextlib.nullcontext()


def step_ctx(n: int):
    return warden.step(n) if warden is not None else contextlib.nullcontext()


def in_process_restarts() -> int:
    if warden is not None and hasattr(warden, "restart_count"):
        return warden.restart_count()
    return 0


def first_attempt() -> bool:
    return RESTART == 0 and in_process_restarts() == 0


def model(w: float, step: int, a: argparse.Namespace) -> float:
    """The forward pass: the loss of w on this step's batch."""
    if a.raise_at_step == step and RANK == a.raise_rank:
        raise ValueError(f"shapes (32, 64) and (128, 10) not aligned at step {step}")
    target = 3.0 + 0.01 * ((step * 7 + RANK) % 5)
    return (w - target) ** 2


def start_orphans() -> None:
    """Grandchildren that ignore SIGTERM and sleep: one in the worker's
    session, one in a session of its own. They outlive the worker."""
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)\n"
    for own in (False, True):
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            start_new_session=own,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        say(f"orphan pid={p.pid} session={'own' if own else 'worker'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--ckpt-dir", default=None, help="default: $TMPDIR/warden-train-<job id>")
    p.add_argument("--ckpt-every", type=int, default=5, help="0: never save")
    p.add_argument(
        "--ckpt",
        choices=["file", "warden"],
        default="file",
        help="file: a JSON file per rank in --ckpt-dir; warden: the agent's checkpoint tier"
        " (warden.checkpoint: replicated to peers, restored from the nearest copy)",
    )
    p.add_argument("--report-every", type=int, default=5)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-code", type=int, default=3)
    p.add_argument("--crash-every-attempt", action="store_true")
    p.add_argument("--crash-step-shift", type=int, default=0)
    p.add_argument("--raise-at-step", type=int, default=-1)
    p.add_argument("--raise-rank", type=int, default=0)
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--hang-s", type=float, default=3600.0)
    p.add_argument("--hang-restart", type=int, default=0)
    p.add_argument("--orphan", action="store_true")
    p.add_argument("--print-env", action="store_true")
    a = p.parse_args()

    if warden is not None:
        warden.default_client()  # register now, not at the first step
    job = os.environ.get("WARDEN_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    ckpt_dir = a.ckpt_dir or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"warden-train-{job}"
    )
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt = os.path.join(ckpt_dir, f"rank_{RANK}.json")
    say(
        f"world rank={RANK} world_size={WORLD_SIZE}"
        f" group_rank={os.environ.get('GROUP_RANK', '0')}"
        f" nnodes={os.environ.get('GROUP_WORLD_SIZE', '1')}"
        f" epoch={os.environ.get('WARDEN_ROUND_EPOCH', '-')}"
        f" master={os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}"
    )
    if a.print_env:
        say("env " + json.dumps({k: os.environ.get(k) for k in ENV_SHOWN}, sort_keys=True))
    if a.orphan and RANK == 0 and RESTART == 0:
        start_orphans()

    def save(next_step: int, w: float) -> None:
        if a.ckpt == "warden":
            import warden.checkpoint as tier

            with section("checkpoint"):
                try:
                    tier.save(next_step, json.dumps({"step": next_step, "w": w}).encode())
                except tier.CheckpointError as e:
                    # No agent (restarting), or no room: this step is not
                    # saved, and nothing says it is; training goes on.
                    say(f"checkpoint at step {next_step} not saved: {e}")
            return
        with section("checkpoint"):
            tmp = ckpt + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"step": next_step, "w": w}, f)
            os.replace(tmp, ckpt)

    def train() -> float:
        start, w = 0, 0.0
        if a.ckpt == "warden":
            import warden.checkpoint as tier

            r = tier.restore()
            if r is not None:
                saved = json.loads(r.read())
                start, w = int(saved["step"]), float(saved["w"])
                say(f"resumed from checkpoint at step {start} (tier {r.tier}, from {r.source})")
        elif os.path.exists(ckpt):
            with open(ckpt) as f:
                saved = json.load(f)
            start, w = int(saved["step"]), float(saved["w"])
            say(f"resumed from checkpoint at step {start}")
        say(f"ready pid={os.getpid()} restart={RESTART} start_step={start} t={time.time():.6f}")
        half = a.step_ms / 2000.0
        for n in range(start, a.steps):
            with step_ctx(n):
                with section("forward"):
                    time.sleep(half)
                    loss = model(w, n, a)
                with section("backward"):
                    time.sleep(half)
                    if (
                        n == a.hang_at_step
                        and RANK == a.hang_rank
                        and RESTART == a.hang_restart
                        and in_process_restarts() == 0
                    ):
                        say(f"hang: no progress from step {n} on")
                        time.sleep(a.hang_s)
                    target = 3.0 + 0.01 * ((n * 7 + RANK) % 5)
                    w -= a.lr * 2.0 * (w - target)
            # Reported as soon as the step is complete (before the crash and
            # the save), so the lines name every step the agent saw done.
            if a.report_every and n % a.report_every == 0:
                say(f"step {n} loss {loss:.4f}")
            if (
                n == a.crash_at_step + RESTART * a.crash_step_shift
                and RANK == a.crash_rank
                and (a.crash_every_attempt or first_attempt())
            ):
                say(f"crash: os._exit({a.crash_code}) at step {n} t={time.time():.6f}")
                os._exit(a.crash_code)
            if a.ckpt_every > 0 and (n + 1) % a.ckpt_every == 0:
                save(n + 1, w)
        return w

    if warden is not None and hasattr(warden, "run"):
        w = warden.run(train)
    else:
        w = train()
    say(f"done steps={a.steps} w={w:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
