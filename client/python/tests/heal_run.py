"""One heal example run under the real ``warden run``, and the checks every
faulted run must pass: shared by the framework heal tests
(test_heal_lightning.py, test_heal_transformers.py).

An example (examples/heal/*.py) appends ``<unix time> step <N> rank <R> pid
<P>`` to ``$EXAMPLE_LOG`` after each step and ``<unix time> done rank <R>
digest <sha256>`` at the end. The launcher's output (its lines and the
workers') goes to a file. Both are polled with a deadline, never slept on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
from wardend import find_binary

#: (time, step, rank, pid) of each step line.
Steps = List[Tuple[float, int, int, int]]


@dataclass(frozen=True)
class HealJob:
    """One framework's heal example and how it is run."""

    #: The example file.
    example: Path
    #: Its framework's name, for the printed timings.
    framework: str
    #: The framework's module, whose version the timings name.
    module: str
    #: Modules the standbys import ahead (``--preload``): a replacement
    #: starts from one, and the framework imported cold on the heal's path
    #: took seconds here.
    preload: str
    #: The job id's prefix.
    prefix: str
    world: int
    steps: int
    ckpt_every: int
    #: Bound on one run: 2 x world interpreters importing torch and the
    #: framework on a loaded 2-core machine.
    run_s: float = 400.0
    #: More of the example's environment (name, value).
    env: Tuple[Tuple[str, str], ...] = ()

    def launch(
        self, tmp: Path, name: str, job: str = "", standbys: int = 2
    ) -> Tuple[subprocess.Popen, Path, Path]:
        """Starts the example under ``warden run`` (its own session, so a
        test can kill the whole job) with ``standbys`` standby interpreters
        (``--standbys``: two, for the tests that lose two ranks at once; a
        standby for every rank would import torch and the framework twice
        more a run, on two cores, for nothing; 0: none); returns it, its log
        and its output."""
        warden = find_binary("warden")
        if warden is None:
            pytest.fail("no warden binary: cargo build -p warden-cli, or set WARDEN_TEST_WARDEN")
        log = tmp / f"{name}.log"
        out = tmp / f"{name}.out"
        env = dict(os.environ)
        for var in ("WARDEN_SOCKET", "RANK", "LOCAL_RANK", "WORLD_SIZE", "WARDEN_JOB_ID", "TORCHELASTIC_RUN_ID"):
            env.pop(var, None)
        env.update(
            EXAMPLE_LOG=str(log),
            EXAMPLE_STEPS=str(self.steps),
            EXAMPLE_CKPT_EVERY=str(self.ckpt_every),
            EXAMPLE_STEP_MS="30",
            WARDEN_HEAL_STORE_DIR=str(tmp / f"stores-{name}"),
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.update(self.env)
        # The embedded agent's tier under the test's own directory, which
        # pytest removes: its default, /dev/shm/warden-ckpt/<job>, outlives
        # the test by design (a tier survives its job's processes), and
        # every run of these tests left its jobs' tiers there (half a GB a
        # day in RAM on a machine that runs the suite again and again).
        agent_toml = tmp / "agent.toml"
        if not agent_toml.exists():
            agent_toml.write_text(f"[checkpoint]\ndir = {json.dumps(str(tmp / 'tier'))}\n")
        # The ranks import the installed package (the wheel, with its
        # native module), as every other test here does: the source tree
        # has no built `_native`.
        cmd = [
            warden,
            "--socket",
            str(tmp / "no-agent-here.sock"),
            "run",
            "--agent-config",
            str(agent_toml),
            "--nproc-per-node",
            str(self.world),
            "--rdzv-id",
            job or f"{self.prefix}-{name}-{os.getpid()}-{time.monotonic_ns()}",
            "--log-dir",
            str(tmp / "logs"),
            "--preload",
            self.preload,
            "--standbys",
            str(standbys),
            "--",
            sys.executable,
            str(self.example),
        ]
        proc = subprocess.Popen(
            cmd, env=env, cwd=tmp, stdout=open(out, "wb"), stderr=subprocess.STDOUT, start_new_session=True
        )
        return proc, log, out

    def wait(self, proc: subprocess.Popen, out: Path, what: str, cond: Callable[[], bool]) -> None:
        """Polls ``cond`` until it holds; fails the test if the job ends
        first or ``run_s`` passes."""
        deadline = time.monotonic() + self.run_s
        while not cond():
            if proc.poll() is not None:
                pytest.fail(f"the job ended ({proc.returncode}) before {what}\n{story(out.read_text(errors='replace'))}")
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"not {what} within {self.run_s} s\n{story(out.read_text(errors='replace'))}")
            time.sleep(0.01)

    def wait_step(self, proc: subprocess.Popen, out: Path, log: Path, rank: int, step: int) -> int:
        """Polls the log until ``rank`` logged a step >= ``step``; that line's pid."""
        found: List[int] = []

        def logged() -> bool:
            found[:] = [p for _, s, r, p in read(log)[0] if r == rank and s >= step]
            return bool(found)

        self.wait(proc, out, f"rank {rank} logged step {step}", logged)
        return found[0]

    def wait_said(self, proc: subprocess.Popen, out: Path, text: str) -> None:
        """Polls the launcher's output until it says ``text``."""
        self.wait(proc, out, f"the launcher said {text!r}", lambda: text in out.read_text(errors="replace"))

    def finish(self, proc: subprocess.Popen, out: Path) -> str:
        """Waits for the job's end (killing it past ``run_s``); all it said."""
        try:
            proc.wait(self.run_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return out.read_text()

    def reference(self, tmp: Path) -> Dict[int, str]:
        """The fault-free run's digests, one per rank and all equal."""
        # No standbys: nothing fails in this run.
        proc, log, out = self.launch(tmp, "ref", standbys=0)
        said = self.finish(proc, out)
        assert proc.returncode == 0, f"fault-free run: exit {proc.returncode}\n{story(said)}"
        _, digests = read(log)
        assert sorted(digests) == list(range(self.world)), story(said)
        assert len(set(digests.values())) == 1, f"fault-free digests differ: {digests}"
        return digests

    def check(
        self,
        proc: subprocess.Popen,
        out: Path,
        log: Path,
        reference: Dict[int, str],
        killed: List[Tuple[int, float]],
        heals: int,
    ) -> None:
        """What every faulted run must show once it ended; ``killed``: (pid,
        unix time) of each SIGKILL, in order; ``heals``: how many
        replacements at least must say they healed from a live rank.
        Prints, per kill, the time from it to every rank logging a new
        step (not asserted: tests do not assert speed)."""
        said = self.finish(proc, out)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{story(said)}"
        steps, digests = read(log)
        assert digests == reference, f"digests against the fault-free run\n{story(said)}"

        pids: Dict[int, set] = defaultdict(set)
        for _, _, rank, p in steps:
            pids[rank].add(p)
        # Killed from outside, or a survivor that stayed blocked in a gloo
        # collective after its group's connections were shut down and left
        # by itself to be healed in turn (it says so; tests/torch_heal.rs
        # case 4). Seen under load in CI: 1 run of several.
        dead = {pid for pid, _ in killed} | left_blocked(said)
        for pid, _ in killed:
            assert any(pid in p for p in pids.values()), f"killed pid {pid} never logged a step: {dict(pids)}"
        for rank in range(self.world):
            gone = pids[rank] & dead
            assert len(pids[rank]) == 1 + len(gone), (
                f"rank {rank}: the survivors keep their processes, one new process per kill or exit 75: "
                f"{pids[rank]} (left or killed: {sorted(dead)})\n{story(said)}"
            )
        ((worst, times),) = Counter((r, s) for _, s, r, _ in steps).most_common(1)
        assert times <= 2, f"rank {worst[0]} logged step {worst[1]} {times} times\n{story(said)}"
        healed = said.count("healed from rank")
        assert healed >= heals, f"{healed} replacements healed from a live rank, want {heals}\n{story(said)}"
        for never in ("restarting in job", "restored from the checkpoint"):
            assert never not in said, f"{never!r}\n{story(said)}"
        for pid, at in killed:
            rank = next(r for r, p in pids.items() if pid in p)
            back = max(min(t for t, _, r, _ in steps if r == each and t > at) for each in range(self.world))
            print(
                f"SIGKILL of rank {rank} (pid {pid}) -> every rank stepping again: {back - at:.3f} s "
                f"({self.world} ranks, gloo, {self.framework} {version(self.module)})"
            )


def story(said: str, limit: int = 16000) -> str:
    """What a failed run's output says about its recovery, for an assertion's
    message: the launcher's lines, warden's own (``warden:``, ``warden.heal:``),
    every traceback whole and every line naming an error; the frameworks'
    warnings left out. A raw tail of the output is mostly warnings, and the
    line that said why a rank failed (seen in CI: a survivor's exit 1 that
    made the job restart in job) fell outside it. Past ``limit`` characters,
    the first quarter and the rest's end."""
    kept: List[str] = []
    in_trace: Dict[str, bool] = {}
    for line in said.splitlines():
        m = re.match(r"(\[rank \d+\] )?(.*)", line)
        prefix, body = (m.group(1) or ""), m.group(2) if m else line
        if "Traceback (most recent call last)" in body:
            in_trace[prefix] = True
            kept.append(line)
            continue
        if in_trace.get(prefix):
            kept.append(line)
            # A traceback ends at its exception's line, the first not indented.
            if body and not body[0].isspace():
                in_trace[prefix] = False
            continue
        if (
            line.startswith("[warden]")
            or "warden:" in body
            or "warden.heal:" in body
            or re.search(r"\b\w*(Error|Exception)\b", body)
            and "Warning" not in body
        ):
            kept.append(line)
    text = "\n".join(kept)
    if len(text) > limit:
        head = limit // 4
        text = text[:head] + "\n[...]\n" + text[-(limit - head):]
    return text


def read(log: Path) -> Tuple[Steps, Dict[int, str]]:
    """(time, step, rank, pid) of each step line, and each rank's digest."""
    steps: Steps = []
    digests: Dict[int, str] = {}
    if not log.exists():
        return steps, digests
    for line in log.read_text().splitlines():
        f = line.split()
        if len(f) == 7 and f[1] == "step":
            steps.append((float(f[0]), int(f[2]), int(f[4]), int(f[6])))
        elif len(f) == 6 and f[1] == "done":
            digests[int(f[3])] = f[5]
    return steps, digests


def sigkill(pid: int) -> Tuple[int, float]:
    """SIGKILLs ``pid``: (pid, unix time of the kill)."""
    os.kill(pid, signal.SIGKILL)
    return pid, time.time()


def left_blocked(said: str) -> set:
    """The pids of the ranks that said they left blocked in a collective
    ("warden.heal: rank R (pid P): ... leaving with exit 75 ...")."""
    return {int(m) for m in re.findall(r"\(pid (\d+)\): the restart request[^\n]*leaving with exit 75", said)}


def version(module: str) -> Optional[str]:
    """``module.__version__``, or None where it is not installed."""
    try:
        return getattr(__import__(module), "__version__", None)
    except ImportError:
        return None
