"""warden.integrations.transformers against a real Hugging Face Trainer and a real agent.

One rank (jobs/transformers_job.py) trains a tiny BERT on the CPU under
``warden.run`` with ``WardenCallback``, with gradient accumulation: steps
and sections reach the slot, each checkpoint the Trainer saves is copied
into the agent's tier, and an in-process restart resumes from the tier.
"""

from __future__ import annotations

from pathlib import Path

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


def _load_dir(path):
    """Every tensor a Trainer checkpoint directory holds, by file and key."""
    import torch
    from safetensors.torch import load_file

    out = {f"model/{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
    for name in ("optimizer.pt", "scheduler.pt"):
        state = torch.load(path / name, weights_only=True)
        if name == "optimizer.pt":
            for pid, s in state["state"].items():
                for k, v in s.items():
                    out[f"optim/{pid}/{k}"] = v
        else:
            out["sched"] = torch.tensor(state["last_epoch"])
    return out


def test_warden_trainer_writes_its_checkpoints_in_the_background_as_the_trainer_would(wardend: Wardend) -> None:
    """Issue 32: WardenTrainer's async save holds the step for a copy, and
    the background writes what the Trainer's own save writes: the same files,
    the same tensors, the tied decoder kept tied, the old checkpoints
    rotated, the newest one in the tier."""
    require_framework("transformers")
    require_framework("accelerate")
    import json as _json

    import torch

    runs = {}
    for mode in ("async", "sync"):
        out_dir = wardend.home / f"hf-trainer-{mode}"
        (r,) = run_ranks(wardend, f"trainer-{mode}", "transformers_async_job.py", [str(out_dir), mode])
        assert r["error"] is None, r
        assert r["tied"], "the model's decoder is no longer tied to its embeddings"
        # save_total_limit=2: the newest two kept, rotated after each write.
        assert r["dirs"] == ["checkpoint-12", "checkpoint-8"], r["dirs"]
        assert r["tier"].endswith("warden-restore/rank-0/checkpoint-12"), r["tier"]
        runs[mode] = (out_dir, r)
    (a_dir, a), (s_dir, s) = runs["async"], runs["sync"]
    assert a["live_weights"] == s["live_weights"]
    assert all(x > 0 for x in a["stalls"]), a["stalls"]
    # The buffer was made ahead after the first step: no save allocated it
    # on the training thread (the sync run never made one).
    assert a["grown_in_save"] == 0 and s["grown_in_save"] == 0
    for step in ("8", "12"):
        a_ck, s_ck = a_dir / f"checkpoint-{step}", s_dir / f"checkpoint-{step}"
        assert sorted(p.name for p in a_ck.iterdir()) == sorted(p.name for p in s_ck.iterdir())
        a_t, s_t = _load_dir(a_ck), _load_dir(s_ck)
        assert sorted(a_t) == sorted(s_t)
        for k in a_t:
            assert torch.equal(a_t[k], s_t[k]), k
        a_state = _json.loads((a_ck / "trainer_state.json").read_text())
        s_state = _json.loads((s_ck / "trainer_state.json").read_text())
        assert a_state["global_step"] == s_state["global_step"] == int(step)
    # The tier's copy is the same directory.
    assert _load_dir(Path(a["tier"]))["model/bert.embeddings.word_embeddings.weight"].equal(
        _load_dir(a_dir / "checkpoint-12")["model/bert.embeddings.word_embeddings.weight"]
    )


def test_a_background_write_that_fails_is_raised_and_never_committed(wardend: Wardend) -> None:
    """Issue 32: the optimizer's file of step 4 fails to write in the
    background: its checkpoint-4 is removed, nothing reaches the tier, and
    the next save raises the failure, naming it."""
    require_framework("transformers")
    require_framework("accelerate")
    out_dir = wardend.home / "hf-trainer-fail"
    (r,) = run_ranks(wardend, "trainer-fail", "transformers_async_job.py", [str(out_dir), "fail"])
    assert r["error"] is not None and "step 4" in r["error"] and "No space left" in r["error"], r
    assert r["failed_at"] == 8, r
    assert r["dirs"] == [], r["dirs"]
    assert r["tier"] is None, r["tier"]


def test_the_trainer_state_is_copied_for_the_writer_without_deep_copying_its_log() -> None:
    """The background writer's TrainerState: what the Trainer's was at the
    save, its log's list its own (entries appended later are not in it),
    the rest deep-copied (a callback's state changed later is not in it)."""
    require_framework("transformers")
    from transformers import TrainerState

    from warden.integrations._transformers_save import copy_trainer_state

    st = TrainerState(global_step=7)
    st.log_history = [{"loss": 0.5, "step": 5}]
    st.stateful_callbacks = {"Cb": {"args": {"n": 1}}}
    copied = copy_trainer_state(st)
    st.log_history.append({"loss": 0.4, "step": 10})
    st.stateful_callbacks["Cb"]["args"]["n"] = 2
    st.global_step = 8
    assert copied.log_history == [{"loss": 0.5, "step": 5}]
    assert copied.stateful_callbacks == {"Cb": {"args": {"n": 1}}}
    assert copied.global_step == 7
    # The Trainer's own state kept its log.
    assert len(st.log_history) == 2
    # Its entries shared, not deep-copied (140 ms a save at 10,000 of them).
    assert copied.log_history[0] is st.log_history[0]
