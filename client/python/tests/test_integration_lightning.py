"""warden.integrations.lightning against real PyTorch Lightning and a real agent.

One rank (jobs/lightning_job.py) trains a small model on the CPU under
``warden.run`` with ``WardenCallback``: steps and sections reach the slot,
checkpoints go into the agent's tier, and an in-process restart resumes
from the tier's newest step with the weights it saved.
"""

from __future__ import annotations

import pytest
from conftest import require_framework, run_ranks
from wardend import Wardend


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
    # One warden step per optimizer step, each with its three sections.
    assert r["recent_steps"][-1] == 19
    for names in r["recent_sections"][-5:]:
        assert names == ["backward", "forward", "optimizer"], r["recent_sections"]
