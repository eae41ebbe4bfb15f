"""warden.integrations.transformers against a real Hugging Face Trainer and a real agent.

One rank (jobs/transformers_job.py) trains a tiny BERT on the CPU under
``warden.run`` with ``WardenCallback``, with gradient accumulation: steps
and sections reach the slot, each checkpoint the Trainer saves is copied
into the agent's tier, and an in-process restart resumes from the tier.
"""

from __future__ import annotations

import pytest
from conftest import require_framework, run_ranks
from wardend import Wardend


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_steps_sections_checkpoints_and_an_in_process_restart(wardend: Wardend, mode: str) -> None:
    require_framework("transformers")
    require_framework("accelerate")
    out_dir = wardend.home / f"hf-output-{mode}"
    (r,) = run_ranks(
        wardend, f"transformers-{mode}", "transformers_job.py", [str(out_dir), "12", "4", "6", mode]
    )
    first, second = r["attempts"]
    assert first["restart_count"] == 0 and first["resume_from"] is None
    assert first["start_step"] == 0 and "end_step" not in first
    # Resumed from step 4 (the newest saved before step 6), unpacked from
    # the tier, with exactly the weights the Trainer saved then.
    assert second["restart_count"] == 1
    assert second["resume_from"].endswith("warden-restore/rank-0/checkpoint-4")
    assert second["start_step"] == 4
    assert second["start_weights"] == r["saved_weights"]["4"]
    assert second["end_step"] == 12
    assert sorted(r["saved_weights"], key=int) == ["4", "8", "12"]
    if mode == "async":
        # Every background copy's snapshot (hard links) is gone once it is in.
        snaps = out_dir / ".warden-snapshots"
        assert snaps.is_dir() and not any(snaps.iterdir()), list(snaps.iterdir())
    # One warden step per optimizer step (two micro-batches each), with the
    # model's forward, the backward and the optimizer timed apart.
    assert r["recent_steps"][-1] == 11
    for names in r["recent_sections"][-4:]:
        assert names == ["backward", "forward", "optimizer"], r["recent_sections"]
