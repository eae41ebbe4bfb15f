"""warden.integrations.dcp against real torch.distributed.checkpoint and a real agent.

Ranks run as fresh processes (jobs/dcp_job.py) against the session's
wardend; two of them make a gloo process group on the CPU, with DTensors
sharded across them as FSDP shards its parameters.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import require_framework, run_ranks
from wardend import Wardend


def test_one_process_saves_and_restores_byte_for_byte(wardend: Wardend) -> None:
    require_framework("torch")
    (r,) = run_ranks(wardend, "dcp-single", "dcp_job.py", ["single", "5"])
    assert r["restored_step"] == 5 and r["listed"] == 5
    assert all(r["exact"].values()), r["exact"]
    assert r["extra"] == {"epoch": 3, "note": "hello", "sizes": [1, 2, 3]}


def test_two_ranks_save_a_sharded_state_dict_and_restore_it_resharded(
    wardend: Wardend,
) -> None:
    require_framework("torch")
    store = wardend.home / "dcp-sharded.store"
    results = run_ranks(
        wardend, "dcp-sharded", "dcp_job.py", ["sharded", "12", str(store)], world=2
    )
    for r in results:
        assert r["restored_step"] == 12
        assert all(r["exact"].values()), (r["rank"], r["exact"])
    # Every rank committed a shard of the step: the agent lists it complete.
    listing = subprocess.run(
        [sys.executable, "-c", "import warden.checkpoint as c; print(c.restore(0, rank=1).step)"],
        env=wardend.env("dcp-sharded", 0, 2),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.stdout.strip() == "12", listing.stderr



def test_with_fsdp2_and_adamw_each_rank_reads_its_own_shard_alone(wardend: Wardend) -> None:
    """DCP saves each replicated item once, spread over the ranks (here the
    optimizer's ``step`` of every parameter); before each rank kept its own
    copies, every rank read all 4 shards, 4x its own bytes, and at N ranks
    up to N whole shards a rank. The metadata comes by broadcast, not in
    the coordinator's whole shard."""
    require_framework("torch")
    store = wardend.home / "dcp-fsdp.store"
    results = run_ranks(wardend, "dcp-fsdp", "dcp_job.py", ["fsdp", "7", str(store)], world=4)
    for r in results:
        assert r["restored_step"] == 7, r
        assert r["shards_read"] == [r["rank"]], r
        assert r["exact"] and r["optim_steps"], r


def test_async_save_stages_into_a_reused_buffer_and_the_loop_goes_on_at_once(
    wardend: Wardend,
) -> None:
    require_framework("torch")
    store = wardend.home / "dcp-async.store"
    results = run_ranks(wardend, "dcp-async", "dcp_job.py", ["async", "20", str(store)], world=2)
    for r in results:
        # What was restored is what the tensors held when async_save was
        # called, not what the loop wrote into them right after.
        assert all(r["exact"].values()), (r["rank"], r["exact"])
        assert r["buffers_reused"], r
        # The second save's staged tensors are the first's; the third's, on
        # a mesh made again, its own.
        assert r["staged_reused"] == [True, True], r
        assert all(s > 0 for s in r["stalls"]), r["stalls"]
        assert r["newest"] == 22


def test_an_async_save_that_fails_in_the_background_is_never_committed_and_is_raised_next(
    wardend: Wardend,
) -> None:
    require_framework("torch")
    (r,) = run_ranks(wardend, "dcp-async-fail", "dcp_job.py", ["async-fail", "30"])
    assert r["future_error"], r  # DCP's own future failed
    assert "an earlier dcp.async_save failed" in r["next_error"], r
    # Step 31 (the failed save) and 32 (refused, the failure raised) are not
    # there; 30 and 33 are.
    assert r["steps"] == [30, 33], r
