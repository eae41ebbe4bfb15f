"""Every rank resumes from the same step, even while its agent sees another.

Two ranks of one job (jobs/agree_job.py) in a real gloo process group,
against the session's real wardend. Rank 0 restores while a step is
complete for it alone and rank 1 right after that step completes: as at a
restart while a save commits, or with two agents whose views of the job
differ for a moment.
"""

from __future__ import annotations

from conftest import require_framework, run_ranks
from wardend import Wardend


def test_ranks_that_see_different_newest_steps_resume_from_the_same_one(wardend: Wardend) -> None:
    require_framework("torch")
    store = wardend.home / "agree.store"
    r0, r1 = run_ranks(wardend, "agree", "agree_job.py", ["race", str(store)], world=2)
    for r in (r0, r1):
        assert r["fresh"] and r["zero"], r
        # Each rank loaded its own state of the step it names.
        assert r["apart"]["exact"] and r["agreed"]["exact"], r
    # Without agreeing, the race is real: rank 0's agent answered before
    # step 10 was complete, rank 1's after.
    assert r0["apart"]["rank0_saw"] == r0["apart"]["saw"] == 5
    assert r1["apart"]["saw"] == 10
    assert (r0["apart"]["step"], r1["apart"]["step"]) == (5, 10)
    # Agreed: the newer of the newest steps the ranks saw, on both; rank 0
    # asked for it by name.
    assert r0["agreed"]["saw"] == 15 and r1["agreed"]["saw"] == 20
    assert (r0["agreed"]["step"], r1["agreed"]["step"]) == (20, 20)
    # Once both see the same newest step, that is the one.
    assert r0["agreed_step"] == r1["agreed_step"] == 25
    # Rank 0's copy of the newer step is bad: both take the older one.
    assert r0["damaged"]["saw"] == 25 and r1["damaged"]["saw"] == 30
    assert (r0["damaged"]["step"], r1["damaged"]["step"]) == (25, 25)
    assert r0["damaged"]["exact"] and r1["damaged"]["exact"]


def test_a_rank_that_cannot_reach_its_agent_fails_the_load_on_every_rank(wardend: Wardend) -> None:
    require_framework("torch")
    store = wardend.home / "agree-unreachable.store"
    r0, r1 = run_ranks(wardend, "agree-unreachable", "agree_job.py", ["unreachable", str(store)], world=2)
    # Rank 0's agent answered (nothing complete); rank 1 could not ask. No
    # rank starts fresh while another might resume: both raise, neither hangs.
    assert "a rank could not read its checkpoint tier" in r0["raised"], r0
    assert "a rank could not read its checkpoint tier" in r1["raised"], r1
    assert "nobody.sock" in r1["raised"], r1
