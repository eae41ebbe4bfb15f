"""Save and restore this rank's checkpoint shard through the local warden agent.

The agent keeps a local tier (tmpfs or NVMe) with copies on peer hosts and,
when configured, in object storage. ``save`` holds the training step for one
write of the bytes into the tier; checksums, replication and upload happen in
the agent afterwards. ``restore`` returns this rank's shard of the newest step
that is complete for every rank of the job, from the nearest valid copy
(local, then a peer, then durable storage), or ``None`` on a fresh start.

    import warden.checkpoint as ckpt

    r = ckpt.restore()
    start = r.step + 1 if r else 0
    for step in range(start, steps):
        ...
        if step % 100 == 0:
            ckpt.save(step, model_bytes)

With PyTorch (imported only when these are called):

    ckpt.save_state_dict(step, model.state_dict())
    r = ckpt.load_state_dict()          # (step, state_dict) or None

Once ``torch.distributed`` is initialized, ``load_state_dict()`` agrees on
the step over the process group first (``agreed_step``), so every rank
resumes from the same step: call it on every rank, as ``dcp.load``.

The job, rank and world size come from the environment (WARDEN_JOB_ID or
TORCHELASTIC_RUN_ID, RANK, WORLD_SIZE), the agent's socket from WARDEN_SOCKET.
Failures raise ``CheckpointError`` (``TierFullError`` when the tier has no room
even after pruning old steps); a half-written shard is never committed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import _agree, _native

CheckpointError = _native.CheckpointError
TierFullError = _native.TierFullError

__all__ = [
    "CheckpointError",
    "Restored",
    "ShardFile",
    "TierFullError",
    "agreed_step",
    "identity",
    "load_state_dict",
    "restore",
    "save",
    "save_file",
    "save_on_notice",
    "save_state_dict",
]


@dataclass(frozen=True)
class Restored:
    """A restored shard, already in the local tier and checked."""

    step: int
    path: str
    size_bytes: int
    tier: str
    source: str
    skipped: list = field(default_factory=list)

    def read(self) -> bytes:
        """The shard's bytes."""
        with open(self.path, "rb") as f:
            return f.read()


def identity() -> tuple:
    """(job_id, rank, world_size) the shards are saved under."""
    return _native._ckpt_identity()


def save_file(step: int, write: Callable[[str], Any], size_hint: int = 0, stall: Optional[float] = None) -> str:
    """Save a shard that ``write(path)`` writes at ``path`` (for writers that want
    a path, such as ``torch.save``). ``size_hint``: the most bytes it will write
    (required: the agent cuts a staging file written past its declared size and
    refuses its commit). ``stall``: the seconds the training step was held for
    it, when the write runs off the training thread (default: the write's own
    time). Returns the shard's path in the tier."""
    _check_hint(size_hint)
    started = time.perf_counter()
    path, token = _native._ckpt_begin(int(step), int(size_hint))
    try:
        write(path)
        size = os.stat(path).st_size
    except BaseException as e:
        try:
            os.unlink(path)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno in (28, 122):  # ENOSPC, EDQUOT
            raise TierFullError(f"checkpoint tier full writing {path}: {e}") from e
        raise
    held = time.perf_counter() - started if stall is None else float(stall)
    return _native._ckpt_commit(int(step), path, token, size, held)


def _check_hint(size_hint: int) -> None:
    """A shard's declared size is its limit: the agent cuts a staging file
    written past it and refuses its commit. None declared is refused here,
    named, rather than cut at a time that depends on the agent's tick."""
    if int(size_hint) <= 0:
        raise ValueError(
            "size_hint must be the most bytes the shard will hold (the agent cuts a "
            "staging file written past its declared size); got "
            f"{size_hint}"
        )


class ShardFile:
    """A shard written in more than one go, then committed: for a writer that
    learns the last of its bytes later than the first (torch.distributed.checkpoint's
    coordinator appends the checkpoint's metadata after every rank wrote).

    ``file`` is the staging file, open for writing. ``commit()`` closes and
    commits it and returns the shard's path in the tier; ``abort()`` (also on
    an exception inside ``with``) removes it, so nothing half-written is
    ever committed.
    """

    def __init__(self, step: int, size_hint: int = 0) -> None:
        _check_hint(size_hint)
        self.step = int(step)
        self._started = time.perf_counter()
        self.path, self._token = _native._ckpt_begin(self.step, int(size_hint))
        try:
            self.file = open(self.path, "wb")
        except BaseException:
            self._remove()
            raise
        self._done = False

    def commit(self, stall: Optional[float] = None) -> str:
        """Closes the file and commits it as this rank's shard of the step.
        ``stall``: the seconds the training step was held for it, when not the
        time since the file was begun (a save written in the background)."""
        if self._done:
            raise CheckpointError(f"shard of step {self.step} already committed or aborted")
        self._done = True
        try:
            self.file.close()
            size = os.stat(self.path).st_size
        except BaseException as e:
            self._remove()
            if isinstance(e, OSError) and e.errno in (28, 122):  # ENOSPC, EDQUOT
                raise TierFullError(f"checkpoint tier full writing {self.path}: {e}") from e
            raise
        if stall is None:
            stall = time.perf_counter() - self._started
        return _native._ckpt_commit(self.step, self.path, self._token, size, float(stall))

    def abort(self) -> None:
        """Drops the staging file (no-op once committed or aborted)."""
        if self._done:
            return
        self._done = True
        try:
            self.file.close()
        except OSError:
            pass
        self._remove()

    def _remove(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


def save(step: int, data: Any) -> str:
    """Save ``data`` (bytes, bytearray, memoryview or any buffer, such as a numpy
    array) as this rank's shard of ``step``. Returns the shard's path in the tier."""
    view = memoryview(data)
    if not view.contiguous:
        raise ValueError("checkpoint.save: data must be a contiguous buffer")
    view = view.cast("B")

    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(view)

    return save_file(step, write, size_hint=max(view.nbytes, 1))


def restore(step: int = 0, rank: Optional[int] = None) -> Optional[Restored]:
    """This rank's shard of the newest step complete for every rank (or of
    ``step``), or None when no step is complete anywhere.

    ``rank``: another rank's shard of the same job instead (a sharded
    checkpoint whose reader needs what another rank wrote; a replicated
    state that rank 0 alone saved)."""
    r = _native._ckpt_restore(int(step), None if rank is None else int(rank))
    if r is None:
        return None
    return Restored(**r)


def agreed_step(group: Any = None) -> Optional[int]:
    """The step every rank of ``group`` (the default process group when
    None) resumes from, the same on every rank; None on every rank on a
    fresh start. A collective: every rank of the group calls it. Without an
    initialized ``torch.distributed`` (or with one rank) it is this rank's
    ``restore().step``.

    Each rank's agent names the newest step complete for every rank as it
    sees the job, and two agents can see it differently during a restart
    (a save committing as the ranks restore). The ranks take the newest of
    those where every rank can restore it (a rank that had not seen it
    asks for it by name), else the oldest of them; this rank's shard of it
    is fetched into the tier. Pass the step to ``restore``,
    ``WardenStorageReader`` or an integration's ``restore_*``. Raises
    ``CheckpointError`` on every rank when any rank cannot read its tier or
    restore either: better no rank resumes than one from another step."""
    r = _agree.agree(restore, CheckpointError, group)
    return None if r is None else r.step


def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise CheckpointError("save_state_dict / load_state_dict need torch") from e
    return torch


def _tensor_bytes(obj: Any, torch: Any) -> tuple:
    """(bytes, count) of the tensors anywhere in ``obj`` (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), 1
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    total, count = 0, 0
    for v in items:
        b, c = _tensor_bytes(v, torch)
        total, count = total + b, count + c
    return total, count


def save_state_dict(step: int, state_dict: Any, size_hint: int = 0) -> str:
    """``torch.save(state_dict)`` into the tier as this rank's shard of ``step``.

    ``size_hint``: the most bytes the file may take. The agent cuts a staging
    file written past the size declared for it and refuses its commit, so the
    default is generous: every tensor's bytes (nested dicts and lists too),
    4 KiB per tensor for torch.save's zip entries and alignment, and 4 MiB
    for the rest of the pickle."""
    torch = _torch()
    if not size_hint:
        nbytes, count = _tensor_bytes(state_dict, torch)
        size_hint = nbytes + 4096 * count + (4 << 20)
    return save_file(step, lambda p: torch.save(state_dict, p), size_hint=size_hint)


def load_state_dict(
    step: int = 0, map_location: Any = "cpu", agree: Optional[bool] = None, group: Any = None
) -> Optional[tuple]:
    """(step, state_dict) restored with ``torch.load`` (or, for a shard an
    ``AsyncCheckpointer`` saved, its own reader), or None on a fresh start.

    ``step`` 0 (the newest) with ``torch.distributed`` initialized agrees on
    the step over ``group`` first (``agreed_step``), so every rank of it
    must call this; ``agree=False`` loads this rank's newest alone (a load on
    some ranks only). ``agree=True`` without a process group is the same as
    no agreement."""
    torch = _torch()
    if step == 0 and agree is not False:
        r = _agree.agree(restore, CheckpointError, group)
    else:
        r = restore(step)
    if r is None:
        return None
    from . import async_shard  # noqa: PLC0415

    if async_shard.is_async_shard(r.path):
        return r.step, async_shard.read_shard(r.path, map_location=map_location)
    return r.step, torch.load(r.path, map_location=map_location, weights_only=True)


def save_on_notice(step: int, state: Any, leave: bool = True) -> bool:
    """At the boundary after ``step``: when a notice of a coming stop stands
    (``warden.notice()``) and names this step or an earlier one (every rank
    of the job is given the same), save ``state`` as this rank's shard of
    ``step`` and leave with ``warden.Preempted`` (exit 85, which ``warden run`` reads
    as "saved on the notice, requeue me"); ``leave=False`` returns True
    instead. With no notice it returns False at the cost of one load from
    shared memory, so it may run at every step.

    ``state``: bytes or any buffer (``save``), a callable taking the step
    (your own save), or anything else ``torch.save`` takes
    (``save_state_dict``). The shard goes to the tier and the agent
    replicates it to its peers as any other save."""
    from ._notice import Preempted, notice  # noqa: PLC0415

    n = notice()
    if n is None or not n.due(step):
        return False
    if callable(state):
        state(step)
    elif isinstance(state, (bytes, bytearray, memoryview)):
        save(step, state)
    else:
        save_state_dict(step, state)
    if leave:
        raise Preempted(step)
    return True
