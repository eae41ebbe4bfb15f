"""One restore step for every rank of a process group.

``restore()`` with no step gives this rank the newest step complete for
every rank *as its own agent sees the job*. Two agents can see it
differently for a moment: a step whose last shard commits during the
restart (an async save finishing, a survivor's save landing after a
crash), a job-wide view the collector keeps for a while, a peer that
answers one host's gather and not another's. Ranks that each took their
own newest would then resume from different steps, and the job's state
would be silently inconsistent. So a load meant for the whole job agrees
on the step over the job's own process group first. The newest of the
newest steps the ranks see comes first: it is complete (the rank that sees
it says so), and a rank whose agent had not seen it yet restores it by
name, which asks the holders again. Where some rank cannot (its shard's
copies all bad, a view kept from before), every rank takes the oldest of
the newest instead, complete by the same reasoning and still in every tier
for a while (``keep_steps``, 2 by default). A rank that cannot restore
that either fails the load on every rank, loudly, instead of resuming alone
from another step.

In: this rank's view from its agent, and the group. Out: the step and this
rank's shard of it, the same step on every rank. Never: leave a rank out
of a collective the others are in (every rank reaches both all-reduces,
whatever its own restore did), or let a rank that sees nothing pull the
job back to a fresh start while others see a step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

#: Above every step: what a rank that sees no complete step puts in the
#: minimum, so that it does not pull the agreed step down to "none".
NO_STEP = (1 << 63) - 1


def distributed(group: Any = None) -> Optional[Any]:
    """``torch.distributed`` when it is imported, initialized and ``group``
    holds more than one rank; None otherwise (nothing to agree with)."""
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size(group) <= 1:
        return None
    return dist


def _device(dist: Any, group: Any) -> Any:
    """Where a tensor for one of ``group``'s collectives must live: the
    current GPU for a group that only NCCL backs, else the CPU."""
    import torch  # noqa: PLC0415

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _min(dist: Any, group: Any, values: list) -> list:
    """The element-wise minimum of ``values`` over ``group``."""
    import torch  # noqa: PLC0415

    t = torch.tensor(values, dtype=torch.int64, device=_device(dist, group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.cpu().tolist()]


def agree(restore: Callable[[int], Any], error: type, group: Any = None) -> Any:
    """This rank's shard of the step every rank of ``group`` restores (what
    ``restore(step)`` returns), or None on every rank when no rank sees a
    complete step. Every rank of ``group`` must call it.

    Raises ``error`` on every rank when any rank could not reach its tier,
    or some rank could restore neither the newest nor the oldest of the
    newest steps the ranks see."""
    dist = distributed(group)
    if dist is None:
        return restore(0)
    failure: Optional[BaseException] = None
    mine = None
    try:
        mine = restore(0)
    except Exception as e:  # noqa: BLE001 - reported after the collective
        failure = e
    step = mine.step if mine is not None else 0
    if step >= NO_STEP:  # past an int64: the step cannot be agreed on
        failure, mine, step = error(f"step {step} is past 2^63 - 1"), None, 0
    # One all-reduce: the oldest newest step, the newest one, whether any
    # rank sees none, and whether any failed (as minimums: -newest, ...).
    oldest, neg_newest, neg_blind, neg_failed = _min(
        dist, group, [step or NO_STEP, -step, -int(step == 0), -int(failure is not None)]
    )
    if neg_failed:
        raise error(
            "agreed_step: a rank could not read its checkpoint tier, so no rank resumes"
            + (f" (this rank: {failure})" if failure is not None else "")
        ) from failure
    newest = -neg_newest
    if newest == 0:
        return None  # no rank sees a complete step: a fresh start everywhere
    if oldest == newest and not neg_blind:
        return mine  # every rank sees the same newest step: nothing to fetch
    # The same candidates in the same order on every rank, and one
    # all-reduce each: every rank leaves the loop at the same candidate.
    for candidate in dict.fromkeys((newest, oldest)):
        failure = None
        got = mine
        if step != candidate:
            try:
                got = restore(candidate)
                if got is None or got.step != candidate:
                    failure = error(f"step {candidate} not restored")
            except Exception as e:  # noqa: BLE001 - reported after the collective
                failure = e
        (neg_failed,) = _min(dist, group, [-int(failure is not None)])
        if not neg_failed:
            return got
    raise error(
        f"agreed_step: the ranks see newest steps from {oldest} to {newest}, and a rank cannot"
        f" restore {'either' if newest != oldest else 'it'}, so no rank resumes"
        + (f" (this rank: {failure})" if failure is not None else "")
    ) from failure
