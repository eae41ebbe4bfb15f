"""The torchft 0.2.0 and torchrun rows of tests/bench/heal.py (docs/benchmarks.md,
"Heal from a live replica"): the same job, fault and measurement as the warden rows.

torchft: tests/bench/torchft_ddp.py, 4 replica groups of one process each, a
lighthouse from torchft's wheel (``torchft_lighthouse --min_replicas 4``)
started per run. This module supervises the groups as a per-group torchrun
(or torchx) with restarts would: a group process that exits non-zero is
started again at once, cold, up to 3 times a group. The fault: group 1's
process SIGKILLed once it logged step 60. Its replacement is
  defaults  started cold right after the kill, stock torchft, stock lighthouse
            (join timeout 60 s, heartbeat timeout 5 s);
  tuned     pre-started (imports, model, optimizer, store made; it waits on its
            stdin) and released right after the kill, torchft with its DDP comm
            hook patched (tests/bench/torchft_venv.sh says the line), the
            lighthouse's --join_timeout_ms 100.
torchrun: tests/bench/torchrun_ddp.py under ``torchrun --standalone
--nproc-per-node 4 --max-restarts 3`` from .venv: any rank's death restarts
every rank, which resume from the newest checkpoint.
"""

from __future__ import annotations

import collections
import os
import re
import select
import signal
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GROUPS, MAX_RESTARTS = 4, 3


def _read(log: str) -> list[list[str]]:
    try:
        with open(log) as f:
            return [l.split() for l in f]
    except FileNotFoundError:
        return []


def _victim_pid(log: str, kill_at: int, victim: int) -> int | None:
    for f in _read(log):
        if len(f) == 7 and f[1] == "step" and int(f[2]) >= kill_at and int(f[4]) == victim:
            return int(f[6])
    return None


def _measure(log: str, killed: float | None) -> dict:
    """The warden rows' measures, from the same log lines."""
    lines = _read(log)
    steps = [f for f in lines if len(f) == 7 and f[1] == "step"]
    done = {int(f[3]): f[5] for f in lines if len(f) == 6 and f[1] == "done"}
    back = None
    if killed:
        first: dict[int, float] = {}
        for f in steps:
            if float(f[0]) > killed:
                first.setdefault(int(f[4]), float(f[0]))
        if len(first) == GROUPS:
            back = max(first.values()) - killed
    seen = collections.Counter((int(f[4]), int(f[2])) for f in steps)
    redone = collections.Counter(r for (r, _), c in seen.items() if c > 1)
    return {"back_s": back, "redone": max(redone.values(), default=0), "digests": done}


def _lighthouse(venv: str, work: str, job: str, join_ms: int | None) -> tuple[subprocess.Popen, str]:
    out = os.path.join(work, f"{job}.lighthouse")
    cmd = [os.path.join(venv, "bin/torchft_lighthouse"), "--bind", "127.0.0.1:0", "--min_replicas", str(GROUPS)]
    if join_ms is not None:
        cmd += ["--join_timeout_ms", str(join_ms)]
    p = subprocess.Popen(cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and p.poll() is None:
        m = re.search(r"listening on: http://[^:\s]+:(\d+)", open(out).read())
        if m:
            return p, f"http://127.0.0.1:{m.group(1)}"
        time.sleep(0.01)
    p.kill()
    raise RuntimeError(f"torchft_lighthouse did not listen within 30 s: {out}")


def torchft_one(a, work: str, job: str, tuned: bool, kill: bool, steps: int, ckpt: int,
                kill_at: int, victim: int, midstep: bool = False) -> dict:
    """One run. ``midstep``: the kill waits, after the step-60 line, for the
    victim's next quorum request to reach the lighthouse, so that it lands in
    the step after the quorum (the survivors then meet the loss in their
    all-reduce, not in the quorum): --torchft-midstep's side rows."""
    venv = a.torchft_patched if tuned else a.torchft_stock
    log = os.path.join(work, f"{job}.log")
    ckdir = os.path.join(work, f"{job}-ckpt")
    os.makedirs(ckdir)
    lh, addr = _lighthouse(venv, work, job, 100 if tuned else None)
    lh_log = os.path.join(work, f"{job}.lighthouse")
    asks = None
    py = os.path.join(venv, "bin/python")
    script = os.path.join(HERE, "torchft_ddp.py")
    base = dict(os.environ, EXAMPLE_LOG=log, EXAMPLE_STEPS=str(steps), EXAMPLE_CKPT_EVERY=str(ckpt),
                EXAMPLE_STEP_MS="30", NUM_REPLICA_GROUPS=str(GROUPS), TORCHFT_LIGHTHOUSE=addr,
                BENCH_CKPT_DIR=ckdir)
    errs = []

    def start(r: int, standby: bool = False) -> subprocess.Popen:
        err = open(os.path.join(work, f"{job}.group{r}.{len(errs)}.err"), "w")
        errs.append(err.name)
        env = dict(base, REPLICA_GROUP_ID=str(r), BENCH_STANDBY="1" if standby else "0")
        return subprocess.Popen([py, script], env=env, stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
                                stdout=subprocess.PIPE if standby else subprocess.DEVNULL, stderr=err)

    procs = {r: start(r) for r in range(GROUPS)}
    standby = None
    if kill and tuned:
        standby = start(victim, standby=True)
        # Ready before the fault: what "pre-started" means.
        ready, _, _ = select.select([standby.stdout], [], [], 120)
        if not ready or b"standby ready" not in standby.stdout.readline():
            raise RuntimeError(f"the standby did not come up: {errs[-1]}")
    restarts = collections.Counter()
    exited: dict[int, int] = {}
    killed = None
    gave_up = False
    deadline = time.monotonic() + 600
    try:
        while len(exited) < GROUPS and time.monotonic() < deadline and not gave_up:
            if kill and killed is None:
                pid = _victim_pid(log, kill_at, victim)
                if pid is not None and midstep:
                    n = open(lh_log).read().count(f"quorum request for replica bench_{victim}:")
                    if asks is None:
                        asks = n
                    if n == asks:
                        pid = None
                if pid is not None:
                    assert pid == procs[victim].pid, (pid, procs[victim].pid)
                    os.kill(pid, signal.SIGKILL)
                    killed = time.time()
                    if standby is not None:
                        standby.stdin.write(b"go\n")
                        standby.stdin.flush()
                        replacement = standby
                    else:
                        replacement = start(victim)
                    procs[victim].wait()
                    procs[victim] = replacement
            for r, p in procs.items():
                if r in exited or p.poll() is None:
                    continue
                if p.returncode == 0:
                    exited[r] = 0
                elif restarts[r] < MAX_RESTARTS:
                    # What a per-group torchrun --max-restarts does: start it again.
                    restarts[r] += 1
                    procs[r] = start(r)
                else:
                    gave_up = True
            time.sleep(0.005)
    finally:
        for p in list(procs.values()) + ([standby] if standby else []):
            if p.poll() is None:
                p.kill()
            p.wait()
        lh.terminate()
        lh.wait()
    m = _measure(log, killed)
    rc = 0 if len(exited) == GROUPS and not gave_up else 1
    crashes = sum(restarts.values())
    tracebacks = collections.Counter()
    for e in errs:
        for line in open(e):
            if re.match(r"^\w*(Error|Exception)\b", line):
                tracebacks[line.strip()[:160]] += 1
    mode = ("torchft-tuned" if tuned else "torchft-defaults") + ("-midstep" if midstep else "")
    return {"job": job, "mode": mode, "rc": rc, **m,
            "restarts": crashes, "errors": dict(tracebacks),
            # First try: exit 0, and the only process started again is the killed one's.
            "first_try": rc == 0 and crashes == 0}


def torchrun_one(a, work: str, job: str, kill: bool, steps: int, ckpt: int, kill_at: int,
                 victim: int) -> dict:
    log = os.path.join(work, f"{job}.log")
    ckdir = os.path.join(work, f"{job}-ckpt")
    os.makedirs(ckdir)
    env = dict(os.environ, EXAMPLE_LOG=log, EXAMPLE_STEPS=str(steps), EXAMPLE_CKPT_EVERY=str(ckpt),
               EXAMPLE_STEP_MS="30", BENCH_CKPT_DIR=ckdir)
    err = os.path.join(work, f"{job}.err")
    torchrun = os.path.join(os.path.dirname(a.python), "torchrun")
    p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", str(GROUPS), "--max-restarts", "3",
                          os.path.join(HERE, "torchrun_ddp.py")],
                         stdout=subprocess.DEVNULL, stderr=open(err, "w"), env=env, start_new_session=True)
    killed = None
    deadline = time.monotonic() + 600
    while p.poll() is None and time.monotonic() < deadline:
        if kill and killed is None:
            pid = _victim_pid(log, kill_at, victim)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = time.time()
        time.sleep(0.005)
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    rc = p.wait()
    m = _measure(log, killed)
    # Attempts: the distinct pids rank 0 logged steps from.
    attempts = len({f[6] for f in _read(log) if len(f) == 7 and f[1] == "step" and f[4] == "0"})
    return {"job": job, "mode": "torchrun", "rc": rc, **m, "attempts": attempts,
            "first_try": rc == 0 and attempts == (2 if kill else 1)}
