"""Lightning's sharded FSDP2 checkpoint (``ModelParallelStrategy``'s default)
saved into the agent's tier through DCP, and loaded back.

In: the Trainer at a step boundary, on every rank alike. Out: one DCP save
of step N through ``WardenStorageWriter`` (each rank's shards one shard of
the tier's step; the coordinator's with the metadata), holding what
Lightning's own sharded save writes: the module's state dictionary as
``state_dict``, each optimizer's as ``optimizer_<i>``, and the rest of
Lightning's checkpoint (loops, callbacks, hyper-parameters) as one bytes
item ``lightning``, written with ``torch.save``, where Lightning writes a
``meta.pt`` file. ``load`` reads them back as Lightning's own sharded load
does, through ``WardenStorageReader``.

Async (the default): ``dcp.async_save`` with the writer as its stager: the
step is held while the tensors (each DTensor's local shard) are copied into
the writer's reused buffer; DCP's background thread plans, writes and
commits. Its collectives run on a gloo group of their own, made once per
default group (an in-process restart makes a new one), so they never
interleave with the training thread's collectives on the default group.
A save waits for the one before it (at most one in flight). A save made in
an earlier attempt (before an in-process restart) is waited for at most
``STALE_WAIT_S``: its collectives ran on a group the restart aborted, which
may never wake a gloo wait; past that it is left (the resume then takes the
step before it) and said.

Never: commits a step without its metadata (the writer's rule), or leaves
one rank's save started and another's not (every rank calls the same DCP
save, whose planning is collective).
"""

from __future__ import annotations

import io
import threading
import warnings
from typing import Any, Optional

#: This process's DCP save in flight (its future, step and attempt), if any.
_pending: Optional[tuple] = None
#: The longest a save of an earlier attempt is waited for, seconds.
STALE_WAIT_S = 30.0
#: (the default group it was made under, the group DCP's background
#: collectives use).
_group: tuple = (None, None)
#: The staging buffers of these saves (their own: a failure left in it is
#: theirs to clear).
_pool: Any = None
_lock = threading.Lock()


def _staging() -> Any:
    global _pool
    from .dcp import StagingPool  # noqa: PLC0415

    with _lock:
        if _pool is None:
            _pool = StagingPool(max_in_flight=1)
        return _pool


def _checkpoint_group() -> Any:
    """A gloo group over every rank, for DCP's background collectives: made
    (collectively: every rank saves at the same step) once per default
    group."""
    global _group
    import torch.distributed as dist  # noqa: PLC0415

    world = dist.group.WORLD
    if _group[0] is not world:
        _group = (world, dist.new_group(backend="gloo"))
    return _group[1]


def wait() -> None:
    """The save in flight, if any, committed; its failure warned (it was
    never committed)."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return
    fut, step, attempt = pending
    from concurrent.futures import TimeoutError as FutureTimeout  # noqa: PLC0415

    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415

    from .._restart import restart_count  # noqa: PLC0415

    stale = attempt != restart_count()
    try:
        fut.result(timeout=STALE_WAIT_S if stale else None)
    except FutureTimeout:
        warnings.warn(
            f"warden: the save of step {step}, made before the restart, did not finish in "
            f"{STALE_WAIT_S:.0f} s (its group was aborted): not waited for; it is committed "
            "only if it finishes by itself",
            stacklevel=3,
        )
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported, not raised
        # (DCP's CheckpointException is a BaseException; a restart's is
        # not caught here.)
        warnings.warn(f"warden: checkpoint of step {step} not saved: {e}", stacklevel=3)


def prepare(trainer: Any) -> None:
    """This rank's staging buffer made ahead (``StagingPool.prepare``),
    sized from the module's and the optimizers' state dictionaries (this
    rank's shards of them), which are the save's tensors. No collective,
    and none of the user's checkpoint hooks, runs for it."""
    state = {
        "state_dict": trainer.lightning_module.state_dict(),
        "optimizers": [o.state_dict() for o in trainer.optimizers],
    }
    _staging().prepare(state)


def save(trainer: Any, step: int, async_save: bool) -> bool:
    """Saves the Trainer's checkpoint as step ``step`` (every rank). Returns
    whether the save was made (async: staged; its commit follows)."""
    global _pending
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415

    from .. import checkpoint as _ckpt  # noqa: PLC0415
    from .dcp import WardenStorageWriter  # noqa: PLC0415

    wait()
    # A failure of the save before is warned by ``wait`` on the rank it
    # happened on; left in the staging pool, it would also fail this
    # rank's next staging alone, and the other ranks' background saves
    # would wait in their collectives for a rank that never came.
    pool = _staging()
    pool.take_failure()
    # The strategy's state dictionaries as references, copied once, by the
    # staging (``WardenModelParallelStrategy.warden_references``).
    strategy = trainer.strategy
    strategy.warden_references = True
    try:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    finally:
        strategy.warden_references = False
    state: dict = {"state_dict": checkpoint.pop("state_dict")}
    for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optim_state
    rest = io.BytesIO()
    torch.save(checkpoint, rest)
    rest.seek(0)
    state["lightning"] = rest
    writer = WardenStorageWriter(step=step, staging=pool)
    try:
        if async_save:
            fut = dcp.async_save(state, storage_writer=writer, process_group=_checkpoint_group())
            from .._restart import restart_count  # noqa: PLC0415

            with _lock:
                _pending = (fut, step, restart_count())
        else:
            dcp.save(state, storage_writer=writer)
    except (_ckpt.CheckpointError, CheckpointException, OSError, RuntimeError, ValueError) as e:
        warnings.warn(f"warden: checkpoint of step {step} not saved: {e}", stacklevel=3)
        return False
    return True


def load(strategy: Any, step: int, safe_globals: list) -> dict:
    """Step ``step`` of the tier into ``strategy``'s module and optimizers,
    as Lightning's sharded load does; returns the rest of the checkpoint
    (what Lightning reads from ``meta.pt``), read with ``weights_only`` and
    ``safe_globals`` allowed besides containers and numbers."""
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from .dcp import WardenStorageReader  # noqa: PLC0415

    wait()
    module = strategy.model
    strict = getattr(strategy.lightning_module, "strict_loading", True)
    module_state = {"state_dict": get_model_state_dict(module)}
    # Every rank loads (the strategy's load_checkpoint, after the ranks
    # agreed on the step): collectives, the metadata broadcast.
    dcp.load(module_state, storage_reader=WardenStorageReader(step=step, agree=True))
    module.load_state_dict(module_state["state_dict"], strict=strict)
    options = StateDictOptions(cpu_offload=True)
    for i, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(optim_state, storage_reader=WardenStorageReader(step=step, agree=True))
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key], options=options)
    rest: dict = {"lightning": io.BytesIO()}
    dcp.load(rest, storage_reader=WardenStorageReader(step=step, agree=True))
    blob = rest["lightning"]
    blob.seek(0)
    with torch.serialization.safe_globals(safe_globals):
        meta = torch.load(blob, weights_only=True)
    if not isinstance(meta, dict):
        raise ValueError(f"warden: step {step}'s Lightning checkpoint holds {type(meta).__name__}, not a dict")
    return meta
