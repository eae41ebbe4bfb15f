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

from . import _native

CheckpointError = _native.CheckpointError
TierFullError = _native.TierFullError

__all__ = [
    "CheckpointError",
    "Restored",
    "TierFullError",
    "identity",
    "load_state_dict",
    "restore",
    "save",
    "save_file",
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


def save_file(step: int, write: Callable[[str], Any], size_hint: int = 0) -> str:
    """Save a shard that ``write(path)`` writes at ``path`` (for writers that want
    a path, such as ``torch.save``). ``size_hint``: the room to make. Returns the
    shard's path in the tier."""
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
    return _native._ckpt_commit(int(step), path, token, size, time.perf_counter() - started)


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

    return save_file(step, write, size_hint=view.nbytes)


def restore(step: int = 0) -> Optional[Restored]:
    """This rank's shard of the newest step complete for every rank (or of
    ``step``), or None when no step is complete anywhere."""
    r = _native._ckpt_restore(int(step))
    if r is None:
        return None
    return Restored(**r)


def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise CheckpointError("save_state_dict / load_state_dict need torch") from e
    return torch


def save_state_dict(step: int, state_dict: Any, size_hint: int = 0) -> str:
    """``torch.save(state_dict)`` into the tier as this rank's shard of ``step``."""
    torch = _torch()
    if not size_hint:
        size_hint = sum(
            t.numel() * t.element_size() for t in state_dict.values() if hasattr(t, "numel")
        )
    return save_file(step, lambda p: torch.save(state_dict, p), size_hint=size_hint)


def load_state_dict(step: int = 0, map_location: Any = "cpu") -> Optional[tuple]:
    """(step, state_dict) restored with ``torch.load``, or None on a fresh start."""
    torch = _torch()
    r = restore(step)
    if r is None:
        return None
    return r.step, torch.load(r.path, map_location=map_location, weights_only=True)
