"""warden.integrations.orbax against real Orbax (orbax-checkpoint on JAX's CPU) and a real agent.

One rank (jobs/orbax_job.py) saves steps through the integration's
CheckpointManager, async (Orbax's default) and sync: each finalized step
is committed into the tier (a sync one at once, an async one at the next
``save`` or ``wait_until_finished``), and a second manager in an empty
directory finds the tier's newest step and restores exactly the arrays
saved. The two-process job with a crash under ``warden run --jax`` is
tests/jax_restart.rs.
"""

from __future__ import annotations

import pytest
from conftest import require_framework, run_ranks
from wardend import Wardend


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_steps_go_through_the_tier_and_a_fresh_directory_restores_them(wardend: Wardend, mode: str) -> None:
    require_framework("jax")
    require_framework("orbax.checkpoint")
    (r,) = run_ranks(wardend, f"orbax-{mode}", "orbax_job.py", [str(wardend.home / f"orbax-{mode}"), mode])
    assert r["tier_steps"] == [0, 2, 4]
    if mode == "sync":
        # Finalized inside save: in the tier when save returns.
        assert r["after_save"] == {"0": [0], "2": [0, 2], "4": [0, 2, 4]}
    else:
        # Committed once Orbax says the step is final: at the latest by the
        # next save, which waits for the one before.
        assert r["after_save"]["2"][:1] == [0] and r["after_save"]["4"][:2] == [0, 2]
    assert r["restored_step"] == 4 and r["latest"] == 4
    assert r["restored_digest"] == r["saved"]["4"]
    assert r["third_restored"] == 4, "the step already there is kept, not unpacked again"
    assert "4" in r["second_steps"] and ".warden-restore" not in r["second_steps"]
