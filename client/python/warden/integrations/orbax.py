"""Orbax checkpoints through the agent's tier: ``warden.integrations.orbax.CheckpointManager``.

    import orbax.checkpoint as ocp
    from warden.integrations.orbax import CheckpointManager

    mngr = CheckpointManager("/tmp/ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    step = mngr.latest_step()        # the tier's newest complete step, restored into the directory
    if step is not None:
        state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
    for step in range(start, steps):
        ...
        mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()

In: Orbax's own ``CheckpointManager`` API, unchanged: this is a subclass,
and every argument and option of Orbax's is taken as it is. Out: each step
Orbax finalizes in the directory is also committed into the tier, as one
shard per process (process 0 packs the step's directory; the others commit
an empty shard, so the step is complete only once process 0's is in); the
agent replicates it to its peers and the durable store as any tier save. At
construction the tier's newest complete step is unpacked into the directory
when the directory does not hold it, so ``latest_step()`` and ``restore()``
see it. Never: commits a step Orbax did not finalize (a save that failed
stays out of the tier), or unpacks over a step directory already there.

Why a subclass and not an Orbax handler or a storage path: Orbax writes a
step as many files from all the processes (array shards, per-process
OCDBT files, metadata) into a temporary directory, and process 0 renames
it into place once every process is done; the directory is the unit Orbax
treats as committed. So the tier takes the finalized directory, at the two
public points where Orbax says a step is final: after ``save`` when it
already is (synchronous saves), else at ``wait_until_finished``, which
Orbax's own ``save`` calls for the previous step and ``close`` calls for
the last one. The directory must be one all the job's processes write
(Orbax's own requirement for multi-process saves): a host's local disk on
one host, a shared file system across hosts.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from typing import Any, Optional

from . import require
from ._tar import pack, tar_size, unpack
from .. import checkpoint as _ckpt

_ocp = require("orbax.checkpoint", "warden.integrations.orbax", "orbax-checkpoint")

__all__ = ["CheckpointManager", "restore_into"]

#: Where a restore unpacks before it renames the step into place.
_STAGING = ".warden-restore"


def _step_dir(directory: str, step: int, mngr: Any = None) -> str:
    """Where Orbax keeps ``step`` in ``directory``: its own answer when the
    manager has one (a custom ``step_name_format``), else ``<directory>/<step>``."""
    if mngr is not None:
        find = getattr(mngr, "_get_read_step_directory", None)
        if find is not None:
            try:
                return os.fspath(find(step, mngr.directory))
            except Exception:  # noqa: BLE001 - no step found: the default name
                pass
    return os.path.join(directory, str(step))


def restore_into(directory: str, step: int = 0) -> Optional[int]:
    """Unpacks the tier's newest complete step (or ``step``) into
    ``directory`` as Orbax's step directory; returns the step, or None on
    a fresh start. A step directory already there is kept as it is. Safe
    for every process of the job at once: each unpacks into a staging
    folder of its own and renames it into place, and the first rename
    wins. Raises ``CheckpointError`` when the agent cannot be reached."""
    r = _ckpt.restore(step, rank=0)
    if r is None:
        return None
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, str(r.step))
    if os.path.isdir(target):
        return r.step
    if r.size_bytes == 0:
        raise _ckpt.CheckpointError(f"the tier's step {r.step}: rank 0's shard is empty, no Orbax step in it")
    staging = os.path.join(directory, _STAGING, f"{os.getpid()}-{time.monotonic_ns()}")
    os.makedirs(staging)
    try:
        unpack(r.path, staging)
        names = os.listdir(staging)
        if len(names) != 1 or not os.path.isdir(os.path.join(staging, names[0])):
            raise _ckpt.CheckpointError(
                f"the tier's step {r.step}: rank 0's shard holds {names}, not one Orbax step directory"
            )
        try:
            os.rename(os.path.join(staging, names[0]), os.path.join(directory, names[0]))
        except OSError:
            if not os.path.isdir(os.path.join(directory, names[0])):
                raise
            # Another process of the job renamed its copy first.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            os.rmdir(os.path.join(directory, _STAGING))
        except OSError:
            pass
    return r.step


class CheckpointManager(_ocp.CheckpointManager):
    """Orbax's ``CheckpointManager``, whose finalized steps are also
    committed into the agent's tier, and which starts from the tier's newest
    complete step. ``restore_from_tier=False`` leaves the directory as it
    is at construction; ``strict=True`` makes a failed commit into the tier
    raise ``CheckpointError`` instead of a warning (training goes on by
    default: Orbax's own copy is still in the directory)."""

    def __init__(
        self, directory: Any, *args: Any, restore_from_tier: bool = True, strict: bool = False, **kwargs: Any
    ) -> None:
        self._warden_pending: list[int] = []
        self._warden_strict = strict
        #: Steps committed into the tier by this manager, in order.
        self.tier_steps: list[int] = []
        _job, rank, _world = _ckpt.identity()
        self._warden_rank = rank
        #: The tier's step unpacked into the directory at construction (None: none).
        self.restored_step = restore_into(os.fspath(directory)) if restore_from_tier else None
        super().__init__(directory, *args, **kwargs)

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        saved = super().save(step, *args, **kwargs)
        if saved:
            self._warden_pending.append(int(step))
            self._warden_commit(final=False)
        return saved

    def wait_until_finished(self) -> None:
        super().wait_until_finished()
        self._warden_commit(final=True)

    def _warden_commit(self, final: bool) -> None:
        """Commits the pending steps that Orbax finalized; ``final``: every
        pending one must be (Orbax's wait returned), so one that is not
        failed in Orbax and is dropped, said so."""
        still = []
        for step in self._warden_pending:
            src = None
            if self._warden_rank == 0:
                src = _step_dir(os.fspath(self.directory), step, self)
                if not os.path.isdir(src):
                    if not final:
                        still.append(step)
                        continue
                    self._warden_failed(step, f"Orbax did not finalize step {step} ({src} is not there)")
                    continue
            try:
                _ckpt.save_file(step, lambda p, s=src: pack(s, p, "Orbax's step"), size_hint=tar_size(src))
                self.tier_steps.append(step)
            except Exception as e:  # noqa: BLE001 - a failed copy must not end training
                self._warden_failed(step, str(e))
        self._warden_pending = still

    def _warden_failed(self, step: int, why: str) -> None:
        if self._warden_strict:
            raise _ckpt.CheckpointError(f"step {step} not committed into the tier: {why}")
        warnings.warn(f"warden: step {step} not committed into the tier: {why}", stacklevel=4)
