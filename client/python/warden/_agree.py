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
name, which gathers again (though through the collector a collection
kept for ``peer_timeout`` may still not show it). Where some rank cannot
(its shard's copies all bad, a view kept from before), every rank takes the oldest of
the newest instead, complete by the same reasoning and still in every tier
for a while (``keep_steps``, 2 by default). A rank that cannot restore
that either fails the load on every rank, loudly, instead of resuming alone
from another step.

In: this rank's view from its agent, and the group. Out: the step and this
rank's shard of it, the same step on every rank. Never: leave a rank out
of a collective the others are in (every rank reaches every all-reduce,
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
    """Where a tensor for one of ``group``'s collectives must live: as
    torch's own object collectives choose (the CPU where the group has a
    CPU backend, else the accelerator's current device, or the one the
    group is bound to); from the backend's name on a torch without that."""
    import torch  # noqa: PLC0415

    find = getattr(dist.distributed_c10d, "_get_object_coll_device", None)
    if find is not None:
        kind = str(find(group))
    else:
        backend = str(dist.get_backend(group)).lower()
        kind = "cuda" if "nccl" in backend and "cpu" not in backend else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    pg = group if group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)
    return bound if bound is not None else torch.device(kind)


def _min(dist: Any, group: Any, values: list) -> list:
    """The element-wise minimum of ``values`` over ``group``."""
    import torch  # noqa: PLC0415

    t = torch.tensor(values, dtype=torch.int64, device=_device(dist, group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.cpu().tolist()]


def agree(restore: Callable[[int], Any], error: type, group: Any = None, first: int = 0) -> Any:
    """This rank's shard of the step every rank of ``group`` restores (what
    ``restore(step)`` returns), or None on every rank when no rank sees a
    complete step. Every rank of ``group`` must call it. ``first``: the step
    this rank proposes (0: its agent's newest), each rank its own.

    Raises ``error`` on every rank when any rank could not reach its tier,
    or some rank could restore neither the newest nor the oldest of the
    newest steps the ranks see."""
    dist = distributed(group)
    if dist is None:
        return restore(first)
    failure: Optional[BaseException] = None
    mine = None
    try:
        mine = restore(first)
    except Exception as e:  # noqa: BLE001 - reported after the collective
        failure = e
    # Steps go in as step + 1, so that 0 is "sees none" and a step 0 saved
    # stays a step (the agent keeps steps below 2^53).
    seen = mine.step + 1 if mine is not None else 0
    if seen >= NO_STEP:
        failure, mine, seen = error(f"step {seen - 1} is past 2^63 - 2"), None, 0
    # One all-reduce: the oldest newest step, the newest one, whether any
    # rank sees none, and whether any failed (as minimums: -newest, ...).
    oldest, neg_newest, neg_blind, neg_failed = _min(
        dist, group, [seen or NO_STEP, -seen, -int(seen == 0), -int(failure is not None)]
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
    oldest, newest = oldest - 1, newest - 1
    # The same candidates in the same order on every rank, and one
    # all-reduce each: every rank leaves the loop at the same candidate.
    for candidate in dict.fromkeys((newest, oldest)):
        failure = None
        got = mine
        if seen != candidate + 1:
            try:
                if candidate == 0:
                    # 0 asks for the newest: step 0 cannot be asked by name.
                    raise error("step 0 cannot be restored by name")
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
