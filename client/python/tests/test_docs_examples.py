"""The framework examples docs/client.md shows, run as written against a real agent.

docs/client.md's "PyTorch Lightning", "Hugging Face Transformers" and
"torch.distributed.checkpoint" sections show examples/integrations/*.py
verbatim (checked here, so the page and the files cannot drift apart). Each
example then runs unchanged in fresh interpreters against the session's
wardend, the single-process ones with the environment a launcher gives, the
DCP one as its comment says: 2 gloo ranks under ``warden run`` (whose
teardown rule also covers torch's occasional abort at the exit of a rank
that finished, "terminate called without an active exception"), twice: a fresh start with ``EXAMPLE_STEPS=50`` that saves step 50
into the tier (each example saves every 50 steps), then
``EXAMPLE_STEPS=100``, which must resume from step 50 and leave step 100 as
the tier's newest complete step, holding the framework's own state at that
step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from conftest import RANK_TIMEOUT_S, free_port, require_framework
from wardend import ROOT, Wardend, find_binary

EXAMPLES = ROOT / "examples" / "integrations"
DOCS = ROOT / "docs" / "client.md"

#: docs/client.md's heading for each example file.
SECTIONS = {
    "lightning_example.py": "### PyTorch Lightning",
    "transformers_example.py": "### Hugging Face Transformers",
    "dcp_example.py": "### torch.distributed.checkpoint (FSDP, DTensor)",
}


def doc_example(heading: str) -> str:
    """The first ```python block under ``heading`` in docs/client.md."""
    text = DOCS.read_text()
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    assert start is not None, f"docs/client.md has no heading {heading!r}"
    block: list[str] = []
    inside = False
    for line in lines[start + 1 :]:
        if not inside:
            if line.startswith("#"):
                break
            inside = line.rstrip() == "```python"
            continue
        if line.rstrip() == "```":
            return "".join(block)
        block.append(line)
    pytest.fail(f"docs/client.md: no complete ```python block under {heading!r}")


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_docs_show_the_example_file_verbatim(name: str) -> None:
    assert doc_example(SECTIONS[name]) == (EXAMPLES / name).read_text(), (
        f"docs/client.md {SECTIONS[name]!r} must show examples/integrations/{name} verbatim"
    )


def run_example(agent: Wardend, job: str, name: str, steps: int) -> str:
    """Runs examples/integrations/``name`` unchanged as the one rank of ``job``
    (the environment a launcher gives: RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT, OMP_NUM_THREADS, WARDEN_SOCKET, WARDEN_JOB_ID) in a
    working directory of the job's own. Returns its output; fails with it if
    it fails. (The 2-rank DCP example runs under ``warden run``.)"""
    cwd = agent.home / f"{job}-cwd"
    cwd.mkdir(exist_ok=True)
    runs = len(list(cwd.glob("run*-rank0.log")))
    env = agent.env(job, 0, 1)
    env.update(EXAMPLE_STEPS=str(steps), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # What `warden run` (and torchrun) give more than one worker; for one
    # it keeps torch's OpenMP threads from spinning against the rest of a
    # loaded 2-core machine (a 50-step run: 0.4 s of training, not 6-12 s).
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = cwd / f"run{runs}-rank0.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen(
            [sys.executable, str(EXAMPLES / name)],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            p.wait(RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    text = log_path.read_text(errors="replace")
    if p.returncode != 0:
        pytest.fail(f"{name} exited {p.returncode}:\n{text[-6000:]}\n--- wardend ---\n{agent.stderr()[-3000:]}")
    return text


def run_example_under_warden_run(agent: Wardend, job: str, name: str, steps: int, world: int) -> list[str]:
    """Runs examples/integrations/``name`` unchanged as ``world`` ranks of
    ``job`` under ``warden run`` on the session's agent, as its comment tells
    a user to. Returns each rank's output (the launcher's ``[rank R] `` lines,
    prefix removed); fails with the launcher's output if the job fails."""
    warden = find_binary("warden")
    if warden is None:
        pytest.fail("no warden binary (deploy/build-wheel.sh, or cargo build -p warden-cli)")
    cwd = agent.home / f"{job}-cwd"
    cwd.mkdir(exist_ok=True)
    runs = len(list(cwd.glob("run*.log")))
    env = agent.env(job, 0, 1)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env["EXAMPLE_STEPS"] = str(steps)
    argv = [
        warden, "--socket", agent.socket, "run", "--agent", "local",
        "--nproc-per-node", str(world), "--rdzv-id", job, "--log-dir", str(cwd / "logs"),
        # Nothing here restarts: no standby interpreters to import torch
        # beside the ranks on a 2-core machine.
        "--no-standby", "--", sys.executable, str(EXAMPLES / name),
    ]  # fmt: skip
    log_path = cwd / f"run{runs}.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            p.wait(RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    text = log_path.read_text(errors="replace")
    if p.returncode != 0:
        pytest.fail(f"warden run {name} exited {p.returncode}:\n{text[-6000:]}\n--- wardend ---\n{agent.stderr()[-3000:]}")
    return [
        "".join(line[len(f"[rank {r}] ") :] for line in text.splitlines(keepends=True) if line.startswith(f"[rank {r}] "))
        for r in range(world)
    ]


def newest_in_tier(agent: Wardend, job: str, rank: int = 0, world: int = 1) -> dict:
    """``warden.checkpoint.restore(0, rank=rank)`` as a rank of ``job`` would
    call it (a fresh interpreter: this one's client points at no agent)."""
    code = (
        "import json, warden.checkpoint as c\n"
        f"r = c.restore(0, rank={rank})\n"
        "print(json.dumps(r and {'step': r.step, 'path': r.path}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=agent.env(job, 0, world),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found is not None, f"no complete step of {job} in the tier"
    return found


def test_lightning_example_checkpoints_into_the_tier_and_resumes(wardend: Wardend) -> None:
    require_framework("pytorch_lightning")
    import torch

    first = run_example(wardend, "example-lightning", "lightning_example.py", 50)
    assert "resuming from None" in first, first[-3000:]
    assert newest_in_tier(wardend, "example-lightning")["step"] == 50

    second = run_example(wardend, "example-lightning", "lightning_example.py", 100)
    resumed = next(l for l in second.splitlines() if l.startswith("resuming from "))
    # The callback saves asynchronously: the tier holds an async shard, which
    # restore_path turns back into a file Lightning reads.
    assert "warden-lightning-" in resumed and resumed.endswith("step-50.ckpt"), second[-3000:]
    assert "Restored all states from the checkpoint" in second, second[-3000:]
    newest = newest_in_tier(wardend, "example-lightning")
    assert newest["step"] == 100
    from warden.async_checkpoint import read_shard
    from warden.integrations.lightning import _lightning_safe_globals

    state = read_shard(newest["path"], safe_globals=_lightning_safe_globals())
    assert state["global_step"] == 100
    assert isinstance(state["state_dict"]["net.weight"], torch.Tensor)


def test_transformers_example_checkpoints_into_the_tier_and_resumes(wardend: Wardend) -> None:
    require_framework("transformers")
    require_framework("accelerate")

    first = run_example(wardend, "example-transformers", "transformers_example.py", 50)
    assert "resuming from None" in first, first[-3000:]
    assert newest_in_tier(wardend, "example-transformers")["step"] == 50

    second = run_example(wardend, "example-transformers", "transformers_example.py", 100)
    resumed = next(l for l in second.splitlines() if l.startswith("resuming from "))
    assert resumed.endswith("out/warden-restore/rank-0/checkpoint-50"), second[-3000:]
    newest = newest_in_tier(wardend, "example-transformers")
    assert newest["step"] == 100
    with tarfile.open(newest["path"], "r:") as tar:
        member = tar.extractfile("checkpoint-100/trainer_state.json")
        assert member is not None
        assert json.load(member)["global_step"] == 100


def test_dcp_example_saves_fsdp_shards_of_two_ranks_and_resumes(wardend: Wardend) -> None:
    require_framework("torch")

    first = run_example_under_warden_run(wardend, "example-dcp", "dcp_example.py", 50, world=2)
    assert not any("resumed" in out for out in first), first
    # Complete only with both ranks' shards (rank 0's holds DCP's metadata).
    assert newest_in_tier(wardend, "example-dcp", rank=1, world=2)["step"] == 50

    second = run_example_under_warden_run(wardend, "example-dcp", "dcp_example.py", 100, world=2)
    for rank, out in enumerate(second):
        assert f"rank {rank}: resumed from step 50" in out, out[-3000:]
    for rank in range(2):
        assert newest_in_tier(wardend, "example-dcp", rank=rank, world=2)["step"] == 100
