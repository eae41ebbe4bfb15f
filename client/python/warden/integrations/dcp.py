"""torch.distributed.checkpoint (DCP) saving into and restoring from the agent's tier.

    import torch.distributed.checkpoint as dcp
    from warden.integrations.dcp import WardenStorageReader, WardenStorageWriter

    dcp.save(state_dict, storage_writer=WardenStorageWriter(step=step))
    dcp.load(state_dict, storage_reader=WardenStorageReader())   # newest complete step

In: DCP's save and load plans (FSDP's sharded state dicts, DTensors,
ShardedTensors, plain tensors and objects), on every rank of the job. Out:
each rank's items as one shard of the step in the agent's checkpoint tier
(local, then replicated to peers and uploaded to the durable store by the
agent), and on load each item read back into the tensors the planner gives,
from whichever rank's shard holds it (DCP saves a replicated item once, on
one rank; a job may load with another sharding). Never: commits a shard
half written (a failed write removes its staging file), or a step without
its metadata (the coordinator commits its shard, with the metadata, last;
a step is complete, and restorable, only once every rank's shard is in).

Shard layout (rank R, step N): the items' bytes one after the other
(tensors as ``torch.save`` writes them, objects as DCP serialises them),
then a pickled footer ``{"format": 1, "rank": R, "metadata": Metadata or
None}``, then its length (8 bytes, little endian) and the magic
``WARDCP01``. ``Metadata.storage_data`` maps each item to ``(rank, offset,
length)``. The coordinator's footer holds the metadata; so does every
rank's when saved without collectives (``no_dist``, one process).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import uuid
from typing import Any, Optional, Union

from . import require
from .. import checkpoint as _ckpt

_torch = require("torch", "warden.integrations.dcp", "torch")
_dcp = require(
    "torch.distributed.checkpoint", "warden.integrations.dcp", "torch (with torch.distributed)"
)

from torch.distributed._shard._utils import narrow_tensor_by_index  # noqa: E402
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta  # noqa: E402
from torch.distributed.checkpoint.planner import (  # noqa: E402
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import (  # noqa: E402
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.futures import Future  # noqa: E402

__all__ = ["WardenStorageReader", "WardenStorageWriter", "checkpoint_id"]

#: The last 8 bytes of every shard this module writes.
MAGIC = b"WARDCP01"
_TRAILER = struct.Struct("<Q8s")
#: The DCP format version the metadata says (what FileSystemWriter writes).
_DCP_VERSION = "1.0.0"
_PREFIX = "warden:"


def checkpoint_id(step: int) -> str:
    """The DCP ``checkpoint_id`` that names ``step`` in the tier (``warden:N``):
    ``dcp.save(sd, checkpoint_id=checkpoint_id(N), storage_writer=WardenStorageWriter(N))``
    is the same as passing the writer alone."""
    return f"{_PREFIX}{int(step)}"


def _step_of(cid: Union[str, "os.PathLike[str]"]) -> Optional[int]:
    """The step a ``warden:N`` checkpoint id names, or None for any other id."""
    s = os.fspath(cid)
    if not s.startswith(_PREFIX):
        return None
    try:
        return int(s[len(_PREFIX) :])
    except ValueError:
        return None


#: Room a shard is declared with beyond its items' bytes: the footer.
_SHARD_MARGIN = 1 << 20
#: ...and per item (pickled storage data in the metadata).
_ITEM_MARGIN = 4096
#: ...and, on the coordinator, for the job's metadata (every rank's items).
_METADATA_MARGIN = 64 << 20


def _item_bytes(item: Any, data: Any) -> int:
    """The bytes ``item`` takes in the shard."""
    if item.type == WriteItemType.BYTE_IO:
        return len(data.getbuffer())
    return int(data.numel()) * int(data.element_size())


def _tensor_bytes(t: Any) -> bytes:
    """``torch.save`` of the tensor's own elements: on the CPU, and compact
    (a view of a larger storage, or a strided one, is copied first, since
    ``torch.save`` would write the whole storage)."""
    t = t.detach().to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=_torch.contiguous_format)
    buf = io.BytesIO()
    _torch.save(t, buf)
    return buf.getvalue()


class WardenStorageWriter(StorageWriter):
    """A DCP storage writer that saves this rank's items as its shard of ``step``.

    Every rank of the job (``WORLD_SIZE`` ranks, as the agent counts them)
    must take part, as every rank of a DCP save does: the step becomes
    complete, and ``WardenStorageReader`` finds it, once all of them
    committed. ``step`` must be at least 1 (0 asks a restore for the newest
    step). A failed save raises ``warden.checkpoint.CheckpointError`` (the
    agent is needed, unlike for heartbeats).
    """

    def __init__(self, step: int) -> None:
        super().__init__()
        if int(step) < 1:
            raise ValueError(f"WardenStorageWriter: step must be at least 1, not {step}")
        self.step = int(step)
        self._coordinator = False
        self._pending: Optional[_ckpt.ShardFile] = None
        self._save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        """A new save begins; a ``warden:N`` checkpoint id sets the step."""
        self._abort_pending()
        if checkpoint_id:
            step = _step_of(checkpoint_id)
            if step is None or step < 1:
                raise ValueError(
                    f"WardenStorageWriter: checkpoint_id {os.fspath(checkpoint_id)!r} is not warden:N"
                )
            self.step = step
        self._save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Notes whether this rank writes the metadata (the coordinator)."""
        self._coordinator = bool(is_coordinator)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Unchanged: where an item goes is decided when it is written."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Unchanged: each rank writes one shard of its own."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Writes the plan's items into this rank's shard; commits it, except
        on the coordinator, whose shard waits for the metadata (``finish``)."""
        self._abort_pending()
        _job, rank, _world = _ckpt.identity()
        # The agent holds a staging file to the size declared when it is
        # begun (a file written past it is cut and its commit refused): the
        # items resolved first, so their bytes are known; the coordinator's
        # metadata, appended in ``finish``, gets a margin of its own.
        resolved = [(item, planner.resolve_data(item)) for item in plan.items]
        size_hint = sum(_item_bytes(item, data) for item, data in resolved)
        size_hint += _SHARD_MARGIN + _ITEM_MARGIN * len(resolved)
        if self._coordinator:
            size_hint += _METADATA_MARGIN
        shard = _ckpt.ShardFile(self.step, size_hint=size_hint)
        results: list[WriteResult] = []
        try:
            for item, data in resolved:
                if item.type == WriteItemType.BYTE_IO:
                    raw: Any = data.getbuffer()
                else:
                    raw = _tensor_bytes(data)
                offset = shard.file.tell()
                shard.file.write(raw)
                length = shard.file.tell() - offset
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=(rank, offset, length),
                    )
                )
            if self._coordinator:
                self._pending = shard
            else:
                _write_footer(shard.file, rank, None)
                shard.commit()
        except BaseException:
            shard.abort()
            raise
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: the metadata (where every rank put every item)
        appended to its shard, which is committed last."""
        shard, self._pending = self._pending, None
        if shard is None:
            raise _ckpt.CheckpointError(
                f"WardenStorageWriter.finish for step {self.step} without write_data on this rank"
            )
        try:
            metadata.version = _DCP_VERSION
            metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
            metadata.storage_meta = self.storage_meta()
            _write_footer(shard.file, _ckpt.identity()[1], metadata)
            shard.commit()
        except BaseException:
            shard.abort()
            raise

    def storage_meta(self) -> Optional[StorageMeta]:
        """The checkpoint id (``warden:N``) and this save's id."""
        return StorageMeta(checkpoint_id=checkpoint_id(self.step), save_id=self._save_id)

    @property
    def checkpoint_id(self) -> str:
        """``warden:N``: the step this writer saves."""
        return checkpoint_id(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        """True for ``warden:N`` ids (so DCP picks this writer for them)."""
        step = _step_of(checkpoint_id)
        return step is not None and step >= 1

    def _abort_pending(self) -> None:
        shard, self._pending = self._pending, None
        if shard is not None:
            shard.abort()

    def __del__(self) -> None:
        # A save that failed on another rank never reaches finish here.
        try:
            self._abort_pending()
        except Exception:
            pass


def _write_footer(f: Any, rank: int, metadata: Optional[Metadata]) -> None:
    footer = pickle.dumps({"format": 1, "rank": rank, "metadata": metadata})
    f.write(footer)
    f.write(_TRAILER.pack(len(footer), MAGIC))


def _read_footer(path: str) -> dict:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size < _TRAILER.size:
            raise _ckpt.CheckpointError(f"{path}: {size} bytes, not a warden DCP shard")
        f.seek(size - _TRAILER.size)
        length, magic = _TRAILER.unpack(f.read(_TRAILER.size))
        if magic != MAGIC or length > size - _TRAILER.size:
            raise _ckpt.CheckpointError(f"{path}: not a warden DCP shard (no {MAGIC!r} trailer)")
        f.seek(size - _TRAILER.size - length)
        footer = pickle.loads(f.read(length))
    if not isinstance(footer, dict) or footer.get("format") != 1:
        raise _ckpt.CheckpointError(f"{path}: unknown warden DCP shard format")
    return footer


class WardenStorageReader(StorageReader):
    """A DCP storage reader over the tier: ``step`` 0 (the default) is the
    newest step complete for every rank, else exactly that step.

    The metadata comes from this rank's shard when it holds it, else from
    ``coordinator_rank``'s (the rank that coordinated the save: 0 unless
    ``dcp.save`` was given another ``coordinator_rank``). Shards of other
    ranks are fetched as needed (the agent restores them from this host, a
    peer or the durable store). Raises ``warden.checkpoint.CheckpointError``
    when the tier has no complete step (check ``warden.checkpoint.restore()``
    first to tell a fresh start) or the agent cannot be reached.
    """

    def __init__(self, step: int = 0, coordinator_rank: int = 0) -> None:
        super().__init__()
        self.step = int(step)
        self.coordinator_rank = int(coordinator_rank)
        self._paths: dict[int, str] = {}
        self._resolved: Optional[int] = None
        self.storage_data: dict[Any, Any] = {}
        self._load_id = uuid.uuid4().hex

    @property
    def restored_step(self) -> Optional[int]:
        """The step read (the newest complete one when asked for 0), once known."""
        return self._resolved

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        """A new load begins; a ``warden:N`` checkpoint id sets the step."""
        self._paths = {}
        self._resolved = None
        self.storage_data = {}
        if checkpoint_id:
            step = _step_of(checkpoint_id)
            if step is None:
                raise ValueError(
                    f"WardenStorageReader: checkpoint_id {os.fspath(checkpoint_id)!r} is not warden:N"
                )
            self.step = step
        self._load_id = uuid.uuid4().hex

    def _shard(self, rank: int) -> str:
        """The local path of ``rank``'s shard of the step (restored once)."""
        path = self._paths.get(rank)
        if path is not None:
            return path
        if self._resolved is None and rank != _ckpt.identity()[1]:
            # This rank's own shard first: it fixes the step every other
            # shard is read at, when the newest was asked for.
            self._shard(_ckpt.identity()[1])
        step = self._resolved if self._resolved is not None else self.step
        r = _ckpt.restore(step, rank=rank)
        if r is None:
            raise _ckpt.CheckpointError(
                "WardenStorageReader: no complete checkpoint step in the tier (a fresh start?)"
            )
        self._resolved = r.step
        self._paths[rank] = r.path
        return r.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, from this rank's shard or the coordinator's."""
        own = _read_footer(self._shard(_ckpt.identity()[1]))
        metadata = own.get("metadata")
        if metadata is None:
            metadata = _read_footer(self._shard(self.coordinator_rank)).get("metadata")
        if metadata is None:
            raise _ckpt.CheckpointError(
                f"WardenStorageReader: step {self._resolved}: rank {self.coordinator_rank}'s shard"
                " holds no DCP metadata (saved with another coordinator_rank?)"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self._load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keeps where each item is (``Metadata.storage_data``)."""
        if metadata.storage_data is None:
            raise _ckpt.CheckpointError("WardenStorageReader: the metadata has no storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Reads each item of the plan from the shard that holds it."""
        by_rank: dict[int, list[Any]] = {}
        for req in plan.items:
            rank, _offset, _length = self.storage_data[req.storage_index]
            by_rank.setdefault(int(rank), []).append(req)
        for rank, reqs in sorted(by_rank.items()):
            reqs.sort(key=lambda r: self.storage_data[r.storage_index][1])
            with open(self._shard(rank), "rb") as f:
                for req in reqs:
                    _rank, offset, length = self.storage_data[req.storage_index]
                    f.seek(offset)
                    raw = f.read(length)
                    if len(raw) != length:
                        raise _ckpt.CheckpointError(
                            f"WardenStorageReader: rank {rank}'s shard of step {self._resolved}"
                            f" ends before {req.storage_index} ({offset}+{length})"
                        )
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(raw))
                        continue
                    tensor = _torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise _ckpt.CheckpointError(
                            f"WardenStorageReader: {req.storage_index}: saved {tuple(tensor.size())},"
                            f" loading into {tuple(target.size())}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str:
        """``warden:N`` (``warden:0``: the newest complete step)."""
        return checkpoint_id(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        """True for ``warden:N`` ids."""
        return _step_of(checkpoint_id) is not None
