"""warden.integrations.lightning against real PyTorch Lightning and a real agent.

One rank (jobs/lightning_job.py) trains a small model on the CPU under
``warden.run`` with ``WardenCallback``: steps and sections reach the slot,
checkpoints go into the agent's tier, and an in-process restart resumes
from the tier's newest step with the weights it saved. Two ranks
(jobs/lightning_fsdp_job.py) fit an FSDP2 module under
``ModelParallelStrategy`` with whole state dictionaries: saved in the
background, and a second fit resumes from them; and under
``WardenModelParallelStrategy`` with sharded saves through DCP, resumed
exactly.
"""

from __future__ import annotations

import threading
import traceback
from concurrent.futures import Future
from typing import Union

import pytest
from conftest import free_port, require_framework, run_ranks
from wardend import Wardend, find_wardend


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_steps_sections_checkpoints_and_an_in_process_restart(wardend: Wardend, mode: str) -> None:
    require_framework("pytorch_lightning")
    (r,) = run_ranks(wardend, f"lightning-{mode}", "lightning_job.py", ["20", "5", "12", mode])
    first, second = r["attempts"]
    assert first["restart_count"] == 0 and first["ckpt_path"] is None
    assert first["start_step"] == 0 and "end_step" not in first
    # The restart resumed from step 10, the newest saved before step 12,
    # through the tier, with exactly the weights saved then.
    assert second["restart_count"] == 1
    # Sync: the shard in the tier as is; async: the async shard turned back
    # into the file Lightning reads.
    if mode == "sync":
        assert second["ckpt_path"] and "/ckpt/" in second["ckpt_path"]
    else:
        assert second["ckpt_path"] and "warden-lightning-" in second["ckpt_path"]
    assert second["start_step"] == 10
    assert second["start_weights"] == r["saved_weights"]["10"]
    assert second["end_step"] == 20
    assert sorted(r["saved_weights"]) == ["10", "15", "20", "5"]
    # Async: the saver's buffer was made ahead after the first step of each
    # attempt, so no save allocated it on the training thread.
    assert r["grown_in_save"] == (0 if mode == "async" else None)
    # One warden step per optimizer step, each with its three sections.
    assert r["recent_steps"][-1] == 19
    for names in r["recent_sections"][-5:]:
        assert names == ["backward", "forward", "optimizer"], r["recent_sections"]


def fsdp_fit(agent: Union[Wardend, list], job: str, max_steps: int, every: int, *how: str) -> dict:
    """One fit of jobs/lightning_fsdp_job.py as 2 ranks (against one agent,
    or a list of one a host); rank 0's record."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = [str(max_steps), str(every), *how]
    return run_ranks(agent, job, "lightning_fsdp_job.py", args, world=2, env=env)[0]


def test_fsdp2_under_model_parallel_saves_in_the_background_and_resumes(wardend: Wardend) -> None:
    require_framework("pytorch_lightning")
    job = "lightning-fsdp2"

    def fit(max_steps: int, *how: str) -> dict:
        return fsdp_fit(wardend, job, max_steps, 5, *how)

    first = fit(12)
    assert first["ckpt_path"] is None and first["start_step"] == 0
    assert first["end_step"] == 12
    assert sorted(first["saved_weights"]) == ["10", "5"]
    # Rank 0's buffer, sized after the first step from its shards' global
    # shapes, held the whole state gathered: no save made its own.
    assert first["saver_grown"] == 0 and first["staging_grown"] is None
    # The second fit resumes from step 10, the newest saved, through an
    # async shard (turned back into the file Lightning reads), with the
    # whole weights the first gathered at that step.
    second = fit(20)
    assert second["ckpt_path"] and "warden-lightning-" in second["ckpt_path"], second["ckpt_path"]
    assert second["start_step"] == 10
    assert second["start_weights"] == first["saved_weights"]["10"]
    assert second["end_step"] == 20
    assert sorted(second["saved_weights"]) == ["15", "20"]
    # The strategy's default writes a folder of shards, which the tier does
    # not take: refused before the first step, on every rank alike, the
    # setting that fixes it named; the tier still holds step 20.
    third = fit(25, "sharded")
    assert third["end_step"] == 0 and not third["saved_weights"], third
    assert third["ckpt_path"] and "step-20" in third["ckpt_path"], third["ckpt_path"]
    assert "save_distributed_checkpoint=False" in third["refused"], third["refused"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_fsdp2_sharded_checkpoints_go_into_the_tier_and_resume_exactly(wardend: Wardend, mode: str) -> None:
    """WardenModelParallelStrategy: the default sharded save, each rank's
    shards one shard of the tier's step through DCP; a second fit resumes
    at the newest step and goes on as a fit that was never stopped."""
    require_framework("pytorch_lightning")
    job = f"lightning-fsdp2-sharded-{mode}"
    how = ["warden-sharded"] + (["sync"] if mode == "sync" else [])
    # 8 steps an epoch (64 samples, 2 ranks, batches of 4): each save ends one.
    first = fsdp_fit(wardend, job, 12, 8, *how)
    assert first["ckpt_path"] is None and first["end_step"] == 12
    assert sorted(first["saved_weights"]) == ["8"]
    # Async: each rank's staging buffer made ahead after the first step.
    if mode == "async":
        assert first["staging_grown"] == 0
    second = fsdp_fit(wardend, job, 24, 8, *how)
    assert second["ckpt_path"] == "warden:8", second["ckpt_path"]
    assert second["start_step"] == 8
    assert second["start_weights"] == first["saved_weights"]["8"]
    assert second["end_step"] == 24
    # Against a fit never stopped: the same weights at each later save, so
    # the optimizers' state and the loops came back too.
    whole = fsdp_fit(wardend, f"{job}-whole", 24, 8, *how)
    assert sorted(whole["saved_weights"]) == ["16", "24", "8"]
    assert second["saved_weights"]["16"] == whole["saved_weights"]["16"]
    assert second["saved_weights"]["24"] == whole["saved_weights"]["24"]


def test_a_sharded_restore_across_hosts_reads_no_other_ranks_shard(tmp_path) -> None:
    """Two hosts, each rank on its own agent (127.0.0.2 and 127.0.0.3, no
    replicas): the second fit's ``restore_path`` tells the step is sharded
    from each rank's own shard, and rank 1's host fetches nothing from rank
    0's (its FetchShard count stays). Before, every rank fetched rank 0's
    whole shard to tell the format: at N hosts, N copies of it out of the
    hosts that hold it."""
    require_framework("pytorch_lightning")
    binary = find_wardend()
    assert binary is not None, "no wardend binary"
    ips = ("127.0.0.2", "127.0.0.3")
    addrs = [f"{ip}:{free_port(ip)}" for ip in ips]
    agents: list = []
    try:
        for i, ip in enumerate(ips):
            j = 1 - i
            (tmp_path / f"h{i}").mkdir()
            agents.append(
                Wardend(
                    tmp_path / f"h{i}",
                    binary,
                    extra_toml=f'[[checkpoint.peers]]\naddr = "{addrs[j]}"\nname = "h{j}"\ndomain = "rack{j}"\n',
                    tables={
                        "api": f'tcp = "{addrs[i]}"\ninsecure = true',
                        "agent": f'host_name = "h{i}"',
                        "checkpoint": f'replicas = 0\ndomain = "rack{i}"',
                    },
                    metrics=f"{ip}:{free_port(ip)}",
                )
            )
        job = "lightning-sharded-two-hosts"
        first = fsdp_fit(agents, job, 12, 8, "warden-sharded")
        assert first["ckpt_path"] is None and sorted(first["saved_weights"]) == ["8"], first
        fetched = agents[0].served("FetchShard")
        second = fsdp_fit(agents, job, 16, 8, "warden-sharded")
        assert second["ckpt_path"] == "warden:8", second["ckpt_path"]
        assert second["start_weights"] == first["saved_weights"]["8"]
        assert second["end_step"] == 16
        assert agents[0].served("FetchShard") == fetched, "rank 1's host fetched from rank 0's"
        # The count is read right: each agent served its rank's restores.
        assert agents[0].served("Restore") > 0 and agents[1].served("Restore") > 0
    finally:
        for a in agents:
            a.stop()


def test_a_rank_the_saved_step_did_not_have_restores_rank_0s_whole_checkpoint(wardend: Wardend) -> None:
    """A job that grew since its save (one rank saved step 5; two restore):
    rank 1 has no shard of the step, and its ``restore_path`` reads rank
    0's, as every rank did before it first read its own (a review found it
    raised there)."""
    require_framework("pytorch_lightning")
    job = "lightning-grown"
    run_ranks(wardend, job, "restore_path_job.py", ["save"])
    got = run_ranks(wardend, job, "restore_path_job.py", ["restore"], world=2)
    assert [g["bytes"] for g in got] == ["rank 0's whole checkpoint"] * 2, got


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_sharded_save_that_fails_is_warned_and_the_next_goes_through(wardend: Wardend, mode: str) -> None:
    """Rank 1's shard of step 8 cannot be written (a full disk, injected):
    the save is warned on every rank, never committed, and the fit goes on;
    the save of step 12 is committed on every rank (the failure left in
    rank 1's staging fails no later save of that rank alone), and the next
    fit resumes from it."""
    require_framework("pytorch_lightning")
    job = f"lightning-fsdp2-fail-{mode}"
    how = ["warden-sharded", "fail-8"] + (["sync"] if mode == "sync" else [])
    first = fsdp_fit(wardend, job, 14, 4, *how)
    assert first["end_step"] == 14
    logs = [(wardend.home / f"{job}-out" / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)]
    for log in logs:
        assert "checkpoint of step 8 not saved" in log, log[-3000:]
        assert "checkpoint of step 12 not saved" not in log, log[-3000:]
    second = fsdp_fit(wardend, job, 16, 4, "warden-sharded")
    assert second["ckpt_path"] == "warden:12", second["ckpt_path"]
    assert second["start_weights"] == first["saved_weights"]["12"]


def test_a_save_made_before_a_restart_is_waited_for_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded save of an earlier attempt whose background collectives
    never end (a gloo wait the restart's abort did not wake) holds the
    resume at most STALE_WAIT_S, and says so; a failed save of this attempt
    (DCP's CheckpointException, a BaseException) is warned, not raised."""
    require_framework("torch")
    import warden
    from torch.distributed.checkpoint.api import CheckpointException
    from warden.integrations import _lightning_sharded as sharded

    monkeypatch.setattr(sharded, "STALE_WAIT_S", 0.5)
    never: Future = Future()
    monkeypatch.setattr(sharded, "_pending", (never, 8, warden.restart_count() - 1))
    # On a thread of its own, so that a wait with no bound fails the test
    # instead of hanging it.
    waiter = threading.Thread(target=sharded.wait, daemon=True)
    with pytest.warns(UserWarning, match="save of step 8, made before the restart, did not finish"):
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "the wait for an earlier attempt's save has no bound"
    assert sharded._pending is None
    failed: Future = Future()
    failed.set_exception(CheckpointException("write failed", {1: (OSError("disk full"), traceback.StackSummary())}))
    monkeypatch.setattr(sharded, "_pending", (failed, 9, warden.restart_count()))
    with pytest.warns(UserWarning, match="checkpoint of step 9 not saved"):
        sharded.wait()
