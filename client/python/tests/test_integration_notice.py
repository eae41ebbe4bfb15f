"""The Lightning and Transformers integrations on a notice of a coming stop,
against a real agent whose notice source is a Kubernetes taint file.

Each job (jobs/notice_job.py) trains on the CPU with ``WardenCallback``,
periodic saves every 100 steps; at step 20 it writes the taint (standing in
for the node controller). The agent raises a host notice, sets the save step
in the rank's slot, the callback saves that step into the tier and the rank
exits 85. The taint removed, the job runs again and resumes at that step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import JOBS, RANK_TIMEOUT_S, find_wardend, require_framework
from wardend import Wardend, find_binary


def run_job(agent: Wardend, job: str, framework: str, taint_at: int, taint: Path, steps: int, out: Path) -> int:
    env = agent.env(job)
    env["PYTHONPATH"] = os.pathsep.join([str(JOBS), env.get("PYTHONPATH", "")])
    log = out.with_suffix(".log")
    args = [framework, str(taint_at), str(taint), str(steps), str(out)]
    with open(log, "wb") as f:
        p = subprocess.run(
            [sys.executable, str(JOBS / "notice_job.py"), *args],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=RANK_TIMEOUT_S,
        )
    if p.returncode not in (0, 85):
        pytest.fail(
            f"{framework} exited {p.returncode}:\n{log.read_text()[-6000:]}\n--- wardend ---\n{agent.stderr()[-3000:]}"
        )
    return p.returncode


def notice_status(agent: Wardend) -> str:
    """The agent's `notice` component status, through `warden health --json`."""
    warden = find_binary("warden")
    assert warden is not None, "no warden binary"
    out = subprocess.run(
        [warden, "--socket", agent.socket, "health", "--json"], capture_output=True, text=True, timeout=30
    )
    health = json.loads(out.stdout)
    return next(c["status"] for c in health["components"] if c["id"] == "notice")


@pytest.mark.parametrize("framework,module", [("lightning", "pytorch_lightning"), ("transformers", "transformers")])
def test_a_notice_saves_the_named_step_exits_85_and_the_next_run_resumes_there(
    tmp_path: Path, framework: str, module: str
) -> None:
    require_framework(module)
    binary = find_wardend()
    assert binary is not None, "no wardend binary"
    os.chmod(tmp_path, 0o755)
    taint = tmp_path / "taints"
    (tmp_path / "agent").mkdir()
    agent = Wardend(
        tmp_path / "agent",
        binary,
        extra_toml=f'[notice.kubernetes]\ntaints_file = "{taint}"\npoll_interval = "100ms"',
    )
    try:
        job = f"notice-{framework}"
        first = tmp_path / "first.json"
        code = run_job(agent, job, framework, 20, taint, 100_000, first)
        r = json.loads(first.read_text())
        assert code == 85, r
        saved = r["preempted"]
        assert saved is not None and saved > 20, r
        # Between the periodic saves (at 100); that it was saved into the
        # tier shows in the rerun's resume below (Transformers saves after
        # the step's callbacks, which the job's record precedes).
        assert saved < 100, r
        assert notice_status(agent) == "DEGRADED"
        # The host's notice goes (a new node, in real life); the rerun resumes
        # at the notice's step and trains on.
        taint.unlink()
        deadline = time.monotonic() + 30
        while notice_status(agent) != "OK":
            assert time.monotonic() < deadline, "the notice did not clear"
            time.sleep(0.1)
        second = tmp_path / "second.json"
        code = run_job(agent, job, framework, 0, taint, saved + 5, second)
        r2 = json.loads(second.read_text())
        assert code == 0, r2
        assert r2["resumed_from"], r2
        assert r2["start_step"] == saved, r2
        assert r2["steps"][-1] == saved + 5, r2
    finally:
        agent.stop()
