"""No agent by default: every test points the client at a socket nobody serves."""

from __future__ import annotations

import os
import tempfile

# Before `warden` creates its default client: an empty directory, so no agent.
_SCRATCH = tempfile.mkdtemp(prefix="warden-pytest-")
os.environ["WARDEN_SOCKET"] = os.path.join(_SCRATCH, "no-agent.sock")
for _var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "WARDEN_JOB_ID", "TORCHELASTIC_RUN_ID"):
    os.environ.pop(_var, None)


# --- A real agent and real frameworks, for the integration tests ------------

import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator, Optional, Union  # noqa: E402

import pytest  # noqa: E402

from wardend import Wardend, find_wardend  # noqa: E402

#: The scripts the integration tests run as ranks (fresh interpreters: the
#: client's default connection and checkpointer are per process, and this
#: one points at no agent).
JOBS = Path(__file__).resolve().parent / "jobs"
#: A folder whose sitecustomize makes numpy unimportable: on a job's
#: PYTHONPATH, the job runs as on a machine with torch alone.
NO_NUMPY = Path(__file__).resolve().parent / "no_numpy"
#: Bound on one rank's run: real frameworks on a loaded 2-core machine.
RANK_TIMEOUT_S = 300.0


def require_framework(module: str) -> None:
    """Skips the test when ``module`` cannot be imported, or fails it when
    ``WARDEN_REQUIRE_FRAMEWORKS=1`` (tests/run-all.sh installs them)."""
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get("WARDEN_REQUIRE_FRAMEWORKS") == "1":
        pytest.fail(f"{module} is not installed (bash tests/frameworks-venv.sh installs it)")
    pytest.skip(f"{module} is not installed (bash tests/frameworks-venv.sh)")


@pytest.fixture(scope="session")
def wardend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wardend]:
    """One real agent for the session; each test uses a job id of its own."""
    binary = find_wardend()
    if binary is None:
        pytest.fail("no wardend binary: cargo build -p warden-agent, or set WARDEN_TEST_WARDEND")
    agent = Wardend(tmp_path_factory.mktemp("wardend"), binary)
    yield agent
    agent.stop()


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port on ``ip`` free now (for MASTER_PORT, an agent's address)."""
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def run_processes(commands: list[list[str]], envs: list[dict], logs: list[Path]) -> list[int]:
    """Starts each command with its environment, its output to its log, and
    waits for all, each bounded by :data:`RANK_TIMEOUT_S` (killed past it).
    Returns their exit codes, in order."""
    procs = []
    for command, env, path in zip(commands, envs, logs):
        with open(path, "wb") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    for p in procs:
        try:
            p.wait(RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def aborted_at_exit(code: int, out: Path, log: str) -> bool:
    """Whether a rank that exited ``code`` with output ``log`` ended its
    work and then aborted in teardown: killed by SIGABRT, its result file
    written and whole, and no Python traceback in its output."""
    if code != -signal.SIGABRT or "Traceback (most recent call last)" in log:
        return False
    try:
        json.loads(out.read_text())
    except (OSError, ValueError):
        return False
    return True


def run_ranks(
    agent: Union[Wardend, list],
    job: str,
    script: str,
    args: list[str],
    world: int = 1,
    env: Optional[dict] = None,
) -> list[dict]:
    """Runs ``jobs/<script>`` as ``world`` ranks of ``job`` against ``agent``
    (a list: rank r against the agent r modulo its length, one agent a
    host) (``env`` added to each one's environment); each writes its result
    as JSON to the path given last. Returns them by rank.

    A rank that wrote its result and then died by SIGABRT at exit with no
    Python traceback (torch 2.15's gloo teardown now and then: "terminate
    called without an active exception", after ``destroy_process_group``)
    ended its work: its result is taken, as ``warden run``'s teardown rule
    takes such a worker's (docs/client.md, "A crash in teardown"). Seen in
    a fresh-clone rehearsal, with every rank's result written."""
    agents = agent if isinstance(agent, list) else [agent]
    out_dir = agents[0].home / f"{job}-out"
    out_dir.mkdir(exist_ok=True)
    outs = [out_dir / f"rank{rank}.json" for rank in range(world)]
    envs = []
    for rank in range(world):
        rank_env = agents[rank % len(agents)].env(job, rank, world)
        rank_env["PYTHONPATH"] = str(JOBS)
        rank_env.update(env or {})
        envs.append(rank_env)
    codes = run_processes(
        [[sys.executable, str(JOBS / script), *args, str(out)] for out in outs],
        envs,
        [out_dir / f"rank{rank}.log" for rank in range(world)],
    )
    results = []
    failed = []
    for rank, (code, out) in enumerate(zip(codes, outs)):
        text = (out_dir / f"rank{rank}.log").read_text(errors="replace")
        if code != 0 and not aborted_at_exit(code, out, text):
            failed.append(f"rank {rank} exited {code}:\n{text[-6000:]}")
            continue
        results.append(json.loads(out.read_text()))
    if failed:
        logs = "".join(f"\n--- wardend {i} ---\n" + a.stderr()[-3000:] for i, a in enumerate(agents))
        pytest.fail("\n".join(failed) + logs)
    return results
