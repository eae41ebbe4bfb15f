"""torch.distributed.checkpoint (DCP) saving into and restoring from the agent's tier.

    import torch.distributed.checkpoint as dcp
    from warden.integrations.dcp import WardenStorageReader, WardenStorageWriter

    dcp.save(state_dict, storage_writer=WardenStorageWriter(step=step))
    dcp.load(state_dict, storage_reader=WardenStorageReader())   # newest complete step

    # or asynchronously: the step is held only while the tensors are copied
    # into buffers the writer reuses; the shard is written in the background
    fut = dcp.async_save(state_dict, storage_writer=WardenStorageWriter(step=step))

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

``dcp.async_save``: the writer is DCP's stager (``AsyncStager``). ``stage``
copies every tensor (a DTensor's local shard) into a buffer of a
``StagingPool`` (registered once and reused across saves, pinned where CUDA
is there, filled by memcpy or one device-to-host copy per tensor), and hands
DCP views into it; DCP's background thread then plans, writes and commits
from those views. At most ``max_in_flight`` saves hold a buffer (default 1):
the next ``stage`` waits for one, and that wait counts as the save's stall.
A save that fails in the background is never committed (its shard is
aborted) and is raised by the next ``stage`` of the same pool, besides
DCP's own future.

Shard layout (rank R, step N): the items' bytes one after the other
(tensors as ``torch.save`` writes them, objects as DCP serialises them),
then a pickled footer ``{"format": 1, "rank": R, "metadata": Metadata or
None}``, then its length (8 bytes, little endian) and the magic
``WARDCP01``. ``Metadata.storage_data`` maps each item to ``(rank, offset,
length)``. The coordinator's footer holds the metadata; so does every
rank's when saved without collectives (``no_dist``, one process).

Replicated items: DCP saves an item several ranks hold (an FSDP2
optimizer's ``step`` of every parameter, a buffer, a replicated tensor)
once, on one rank, spreading them over the ranks, so at load every rank
needs items from other ranks' shards, and the tier fetches whole shards:
with FSDP2 and AdamW on 4 ranks, every rank read all 4 shards, 4x its own
bytes, and at N ranks it is up to N shards a rank. So each rank also keeps
its own copy of the small ones (up to 1 MiB each, ``local_copies`` bytes in
all, 64 MiB by default) after its items, listed in its footer as
``"local": {MetadataIndex: (rank, offset, length)}`` (not in the metadata),
and the reader takes an item from its own shard when the footer lists it.
With collectives the metadata is broadcast from the coordinator, so no
rank fetches the coordinator's whole shard for it. Older readers ignore the
footer's extra key; this reader reads older shards as before.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import struct
import threading
import time
import uuid
import weakref
from typing import Any, Optional, Union

from . import require
from .. import _agree
from .. import async_checkpoint as _async
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
from torch.distributed.checkpoint.staging import AsyncStager  # noqa: E402
from torch.distributed.checkpoint.storage import (  # noqa: E402
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.futures import Future  # noqa: E402

__all__ = ["StagingPool", "WardenStorageReader", "WardenStorageWriter", "checkpoint_id", "is_dcp_shard"]

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


def is_dcp_shard(path: str) -> bool:
    """Whether the file at ``path`` ends as a shard this module writes
    (its last 8 bytes the magic); reads only those."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < _TRAILER.size:
                return False
            f.seek(-len(MAGIC), os.SEEK_END)
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


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
#: Largest replicated item a rank keeps a copy of in its own shard when DCP
#: saves it on another rank (``WardenStorageWriter``'s ``local_copies``).
_LOCAL_ITEM_MAX = 1 << 20


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


class StagingPool:
    """The buffers ``dcp.async_save`` stages into, registered once and reused.

    ``max_in_flight``: saves staged and not yet written (default 1); the
    next ``stage`` waits for a buffer, and the wait counts as stall.
    ``pin``: page-locked buffers (default: when CUDA is available), so a
    device-to-host copy goes straight into them. ``wait_s``: the longest a
    ``stage`` waits for a buffer before it raises (a save stuck in the
    background must not hold the training loop for ever unseen).
    Writers made without a pool share one per process (``default``).
    """

    _default: Optional["StagingPool"] = None
    _default_lock = threading.Lock()

    def __init__(self, max_in_flight: int = 1, pin: Optional[bool] = None, wait_s: float = 3600.0) -> None:
        if int(max_in_flight) < 1:
            raise ValueError(f"StagingPool: max_in_flight must be at least 1, not {max_in_flight}")
        self.pin = _torch.cuda.is_available() if pin is None else bool(pin)
        self.wait_s = float(wait_s)
        self._free: "queue.Queue[_async._Slot]" = queue.Queue()
        self._slots = [_async._Slot() for _ in range(int(max_in_flight))]
        for slot in self._slots:
            self._free.put(slot)
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        #: The last stage's time on the training thread (seconds: the wait
        #: for a buffer plus the copy, or, for CUDA tensors, its queueing).
        self.last_stall_s = 0.0
        #: The GPU's time copying the last written save's CUDA tensors
        #: (seconds; 0 for CPU tensors): the training stream's hold.
        self.last_device_copy_s = 0.0

    @classmethod
    def default(cls) -> "StagingPool":
        """The process's shared pool (one buffer), made on first use."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls()
            return cls._default

    def prepare(self, state_dict: Any) -> None:
        """Makes the pool's buffers for a state dict like ``state_dict`` (a
        DTensor counted by its local shard) ahead, on a thread of their own,
        and returns at once, for ``AsyncCheckpointer.prepare``'s reasons: the
        first ``stage`` after a start otherwise touches every page of its
        buffer on the training thread. Call it once the optimizer has its
        state. A buffer a save may still be reading is never replaced."""
        tensors: list = []
        _stage_walk(state_dict, tensors, [])
        _, need = _async.layout(tensors)
        for slot in self._slots:
            _async.prefault(slot, need, self.pin, _torch)

    @property
    def grown_in_save(self) -> int:
        """Buffers a ``stage`` had to allocate on the training thread."""
        return sum(slot.grown for slot in self._slots)

    def _acquire(self) -> "_async._Slot":
        try:
            return self._free.get(timeout=self.wait_s)
        except queue.Empty:
            raise _ckpt.CheckpointError(
                f"dcp.async_save: no staging buffer came free in {self.wait_s:.0f} s "
                "(the previous save is still being written)"
            ) from None

    def _release(self, slot: "_async._Slot") -> None:
        if getattr(slot, "held", False):
            slot.held = False
            _async.drain_ready(slot)  # a save that failed before it waited for the GPU's copies
            self._free.put(slot)

    def _dropped(self, slot: "_async._Slot", step: int) -> None:
        """DCP let a staged state go: if its shard was never written (the save
        failed before ``write_data``, e.g. in its planning collectives), the
        buffer comes back and the next ``stage`` raises."""
        if getattr(slot, "held", False):
            self._failed(
                _ckpt.CheckpointError(f"the async save of step {step} ended before this rank's shard was written")
            )
            self._release(slot)

    def _failed(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e

    def take_failure(self) -> Optional[BaseException]:
        """The failure an earlier save left, taken: the next ``stage`` does
        not raise it. For a caller that reported it already (its future's
        own error), where raising it again on this rank alone would part
        the ranks."""
        with self._lock:
            e, self._error = self._error, None
        return e

    def _raise_failure(self) -> None:
        e = self.take_failure()
        if e is not None:
            raise _ckpt.CheckpointError(f"an earlier dcp.async_save failed: {e}") from e


class _Staged(dict):
    """A staged state dict: its buffer goes back to the pool when the save
    is written, or when DCP drops it (a save that failed before writing)."""


def _stage_walk(obj: Any, tensors: list, rebuild: list) -> Any:
    """``obj`` with each tensor (a DTensor's local shard) replaced by a
    place holder, collected in ``tensors``; containers copied, other leaves
    deep-copied (the training loop may change them once ``stage`` returns)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if isinstance(obj, DTensor):
        tensors.append(obj.to_local())
        rebuild.append(obj)
        return _Place(len(tensors) - 1)
    if isinstance(obj, _torch.Tensor):
        tensors.append(obj)
        rebuild.append(None)
        return _Place(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _stage_walk(v, tensors, rebuild) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage_walk(v, tensors, rebuild) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_stage_walk(v, tensors, rebuild) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    import copy  # noqa: PLC0415

    return copy.deepcopy(obj)


def _staged_key(slot: "_async._Slot", rebuild: list) -> tuple:
    """What the staged tensors of ``slot`` depend on: its buffer, where each
    tensor lies in it, and each DTensor's mesh (by identity: the cached
    DTensors hold it, so its id is not reused; a mesh rebuilt after a heal
    is another), placements, global shape and stride."""
    buf = slot.buffer
    specs = tuple(
        None if dt is None else (id(dt.device_mesh), tuple(dt.placements), tuple(dt.shape), dt.stride())
        for dt in rebuild
    )
    return (0 if buf is None else buf.data_ptr(), 0 if buf is None else buf.numel(), list(slot.metas), specs)


def _staged_tensors(slot: "_async._Slot", rebuild: list) -> list:
    """The staged state's tensors: views into ``slot``'s buffer, each
    DTensor's local shard rewrapped on its mesh (DCP's planner wants the
    global shape). The same save after save (same layout, same buffer, same
    meshes) reuses the last save's: the copy has just rewritten their bytes
    in place, and making them again cost 30-40 us a DTensor (about 20 ms a
    save for 470 DTensors). The last save's are done with by then: a slot
    is staged into again only once its previous save is written."""
    key = _staged_key(slot, rebuild)
    if slot.staged is not None and slot.staged[0] == key:
        return slot.staged[1]
    tensors = []
    for meta, dt in zip(slot.metas, rebuild):
        local = _async.view_of(slot, meta, _torch)
        if dt is not None:
            from torch.distributed.tensor import DTensor  # noqa: PLC0415

            local = DTensor.from_local(
                local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
            )
        tensors.append(local)
    slot.staged = (key, tensors)
    return tensors


class _Place:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _stage_fill(obj: Any, staged: list) -> Any:
    if isinstance(obj, _Place):
        return staged[obj.index]
    if isinstance(obj, dict):
        return {k: _stage_fill(v, staged) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage_fill(v, staged) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_stage_fill(v, staged) for v in obj)
    return obj


class WardenStorageWriter(StorageWriter, AsyncStager):
    """A DCP storage writer that saves this rank's items as its shard of ``step``.

    Every rank of the job (``WORLD_SIZE`` ranks, as the agent counts them)
    must take part, as every rank of a DCP save does: the step becomes
    complete, and ``WardenStorageReader`` finds it, once all of them
    committed. ``step`` must be at least 1 (0 asks a restore for the newest
    step). A failed save raises ``warden.checkpoint.CheckpointError`` (the
    agent is needed, unlike for heartbeats).

    ``staging``: the buffers ``dcp.async_save`` stages into (default: the
    process's shared ``StagingPool``); ``dcp.save`` uses none.
    """

    def __init__(
        self, step: int, staging: Optional[StagingPool] = None, local_copies: int = 64 << 20
    ) -> None:
        super().__init__()
        if int(step) < 1:
            raise ValueError(f"WardenStorageWriter: step must be at least 1, not {step}")
        if int(local_copies) < 0:
            raise ValueError(f"WardenStorageWriter: local_copies must be >= 0, not {local_copies}")
        self.step = int(step)
        #: Most bytes of replicated items DCP saves on another rank that this
        #: rank keeps a copy of in its own shard (each up to 1 MiB).
        self.local_copies = int(local_copies)
        #: This rank's items before DCP took the duplicates out.
        self._local_items: list = []
        self._coordinator = False
        self._pending: Optional[_ckpt.ShardFile] = None
        self._save_id = uuid.uuid4().hex
        self._staging = staging
        #: The buffer of the save being written (async), and the stall it cost.
        self._slot: Optional[_async._Slot] = None
        self._stall: Optional[float] = None
        self._copy_s = 0.0
        self._commit_stall: Optional[float] = None
        self._pool: Optional[StagingPool] = None
        #: The copies written into the pending shard (its footer's "local").
        self._local: dict = {}

    # -- dcp.async_save's staging, on the training thread -------------------

    def stage(self, state_dict: Any) -> Any:
        """Copies the state's tensors into a staging buffer and returns the
        state with views into it: the training loop may change its tensors
        once this returns. Raises the failure of an earlier async save."""
        pool = self._staging or StagingPool.default()
        pool._raise_failure()
        if self._slot is not None:
            raise ValueError(
                "WardenStorageWriter: this writer's previous async save is not written yet; "
                "make one writer per save"
            )
        started = time.perf_counter()
        slot = pool._acquire()
        slot.held = True
        try:
            tensors: list = []
            rebuild: list = []
            skeleton = _stage_walk(state_dict, tensors, rebuild)
            copy_started = time.perf_counter()
            # CUDA tensors: queued on the training stream, waited for by
            # ``write_data`` on DCP's background thread, never here.
            _async.copy_into(slot, tensors, pool.pin, _torch, wait=False)
            self._copy_s = time.perf_counter() - copy_started
            staged = _Staged(_stage_fill(skeleton, _staged_tensors(slot, rebuild)))
        except BaseException:
            pool._release(slot)
            raise
        # Back to the pool when written (``write_data``) or, for a save that
        # failed before writing, when DCP lets the staged state go.
        weakref.finalize(staged, pool._dropped, slot, self.step)
        self._slot, self._stall = slot, time.perf_counter() - started
        self._pool = pool
        pool.last_stall_s = self._stall
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for here: CPU tensors are copied when ``stage``
        returns, and the GPU's copies, queued on the training stream, are
        waited for by ``write_data`` before it reads the buffer."""

    def close(self) -> None:
        """The pool outlives the writer: nothing to close."""

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
        """Unchanged; its items kept, before DCP takes the duplicates out
        (the copies ``write_data`` keeps)."""
        self._local_items = list(plan.items)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Unchanged: each rank writes one shard of its own."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Writes the plan's items into this rank's shard; commits it, except
        on the coordinator, whose shard waits for the metadata (``finish``)."""
        self._abort_pending()
        slot, self._slot = self._slot, None
        # The stall of an async save is its staging's; of a plain save, the
        # whole write (ShardFile's default).
        self._commit_stall = self._stall if slot is not None else None
        self._stall = None
        try:
            if slot is not None:
                device_s = _async.wait_ready(slot)
                if self._pool is not None:
                    self._pool.last_device_copy_s = device_s
                self._commit_stall = _async.held_s(self._commit_stall or 0.0, self._copy_s, device_s)
            results = self._write_shard(plan, planner)
        except BaseException as e:
            if slot is not None and self._pool is not None:
                self._pool._failed(e)
            raise
        finally:
            if slot is not None and self._pool is not None:
                # Every byte is in the shard (or the save failed): the buffer
                # may take the next save.
                self._pool._release(slot)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_shard(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        _job, rank, _world = _ckpt.identity()
        # The agent holds a staging file to the size declared when it is
        # begun (a file written past it is cut and its commit refused): the
        # items resolved first, so their bytes are known; the coordinator's
        # metadata, appended in ``finish``, gets a margin of its own.
        resolved = [(item, planner.resolve_data(item)) for item in plan.items]
        copies = self._copies(plan, planner)
        size_hint = sum(_item_bytes(item, data) for item, data in resolved + copies)
        size_hint += _SHARD_MARGIN + _ITEM_MARGIN * (len(resolved) + len(copies))
        if self._coordinator:
            size_hint += _METADATA_MARGIN
        shard = _ckpt.ShardFile(self.step, size_hint=size_hint)
        results: list[WriteResult] = []
        local: dict = {}
        try:
            for n, (item, data) in enumerate(resolved + copies):
                if item.type == WriteItemType.BYTE_IO:
                    raw: Any = data.getbuffer()
                else:
                    raw = _tensor_bytes(data)
                offset = shard.file.tell()
                shard.file.write(raw)
                length = shard.file.tell() - offset
                if n >= len(resolved):
                    local[item.index] = (rank, offset, length)
                    continue
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=(rank, offset, length),
                    )
                )
            self._local = local
            if self._coordinator:
                self._pending = shard
            else:
                _write_footer(shard.file, rank, None, local)
                shard.commit(stall=self._commit_stall)
        except BaseException:
            shard.abort()
            raise
        return results

    def _copies(self, plan: SavePlan, planner: SavePlanner) -> list:
        """The items DCP took out of this rank's plan as saved elsewhere,
        each up to 1 MiB, up to ``local_copies`` bytes in all, resolved:
        the copies this rank keeps (see the module)."""
        written = {item.index for item in plan.items}
        local = self._local_items
        if not local:
            # A planner that caches plans sent an empty one: this rank's
            # plan is the one it cached (the same as last time).
            cached = getattr(SavePlanner, "_cached_save_plan", None)
            key = getattr(planner, "_cached_plans_key", None)
            if isinstance(cached, dict) and key in cached:
                local = list(cached[key].items)
        copies: list = []
        room = self.local_copies
        for item in local:
            if room <= 0:
                break
            if item.index in written:
                continue
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                # Known before resolving: skip a large chunk without a copy.
                numel = 1
                for n in item.tensor_data.chunk.sizes:
                    numel *= int(n)
                if numel * item.tensor_data.properties.dtype.itemsize > min(_LOCAL_ITEM_MAX, room):
                    continue
            try:
                data = planner.resolve_data(item)
            except Exception:  # noqa: BLE001 - a copy is an optimisation: the save goes on
                continue
            size = _item_bytes(item, data)
            if size > min(_LOCAL_ITEM_MAX, room):
                continue
            copies.append((item, data))
            room -= size
        return copies

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
            _write_footer(shard.file, _ckpt.identity()[1], metadata, self._local)
            shard.commit(stall=self._commit_stall)
        except BaseException as e:
            shard.abort()
            if self._commit_stall is not None and self._pool is not None:
                self._pool._failed(e)
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


def _write_footer(f: Any, rank: int, metadata: Optional[Metadata], local: Optional[dict] = None) -> None:
    footer = pickle.dumps({"format": 1, "rank": rank, "metadata": metadata, "local": local or {}})
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
    when the tier has no complete step (``warden.checkpoint.agreed_step()``
    first tells a fresh start, the same on every rank) or the agent cannot
    be reached.

    With ``step`` 0 (or ``agree=True``) and ``torch.distributed``
    initialized, the load is a collective of ``group`` (the default process
    group when None): the ranks agree on the step as they read the metadata
    (``warden.checkpoint.agreed_step``; an explicit step is taken as
    agreed), and the coordinator broadcasts the metadata from its own
    shard, so no rank fetches the coordinator's whole shard for it. Every
    rank of the group must load then, as ``dcp.load`` has them. Pass the
    ``process_group`` given to ``dcp.load`` as ``group``; ``agree=False``
    for a load on some ranks only (``no_dist=True``). ``coordinator_rank``
    is a global rank, and warden's rank (``RANK``) must be torch's.
    """

    def __init__(
        self, step: int = 0, coordinator_rank: int = 0, agree: Optional[bool] = None, group: Any = None
    ) -> None:
        super().__init__()
        self.step = int(step)
        self.coordinator_rank = int(coordinator_rank)
        self.agree = agree
        self.group = group
        self._paths: dict[int, str] = {}
        self._resolved: Optional[int] = None
        self.storage_data: dict[Any, Any] = {}
        #: This rank's own copies of items saved on other ranks (its footer's
        #: "local"): MetadataIndex -> (rank, offset, length).
        self._local: dict[Any, Any] = {}
        #: Why the collective read of the metadata failed: what DCP's
        #: rank-local retry (``read_metadata(rank=...)``) raises again.
        self._failure: Optional[BaseException] = None
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
        self._local = {}
        self._failure = None
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

    def _agree(self) -> None:
        """Fixes the step with every rank of the group, once (see the class)."""
        if self._resolved is not None or self.step != 0 or self.agree is False:
            return
        own = _ckpt.identity()[1]
        r = _agree.agree(lambda step: _ckpt.restore(step, rank=own), _ckpt.CheckpointError, self.group)
        if r is None:
            raise _ckpt.CheckpointError(
                "WardenStorageReader: no complete checkpoint step in the tier (a fresh start?)"
            )
        self._resolved = r.step
        self._paths[own] = r.path

    def _dist(self) -> Optional[Any]:
        """``torch.distributed`` when this load is a collective of the group
        (see the class: step 0 by default, or ``agree=True``), else None."""
        if not (self.agree is True or (self.agree is None and self.step == 0)):
            return None
        return _agree.distributed(self.group)

    def _broadcast_metadata(self, dist: Any) -> Optional[Metadata]:
        """The coordinator's metadata, read from its own shard and broadcast
        to the group: no rank fetches the coordinator's whole shard for it.
        Every rank reaches the broadcast, whatever its own read did; a rank
        at another step than the coordinator's raises."""
        mine: Any = None
        failure: Optional[BaseException] = None
        try:
            own = _read_footer(self._shard(_ckpt.identity()[1]))
            self._local = dict(own.get("local") or {})
            if dist.get_rank() == self.coordinator_rank:
                mine = (self._resolved, own.get("metadata"))
        except Exception as e:  # noqa: BLE001 - raised after the broadcast
            failure = e
            if dist.get_rank() == self.coordinator_rank:
                mine = (None, f"{type(e).__name__}: {e}")
        holder = [mine]
        dist.broadcast_object_list(holder, src=self.coordinator_rank, group=self.group)
        if failure is not None:
            raise failure
        sent = holder[0]
        if not isinstance(sent, tuple) or len(sent) != 2 or sent[0] is None:
            raise _ckpt.CheckpointError(
                f"WardenStorageReader: rank {self.coordinator_rank} could not read its shard's"
                f" metadata: {sent[1] if isinstance(sent, tuple) and len(sent) == 2 else sent!r}"
            )
        step, metadata = sent
        if step != self._resolved:
            raise _ckpt.CheckpointError(
                f"WardenStorageReader: this rank reads step {self._resolved}, rank"
                f" {self.coordinator_rank} step {step} (agree on the step: agreed_step)"
            )
        return metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, from this rank's shard or the coordinator's
        (broadcast by it, when the load is a collective)."""
        if kwargs.get("rank") is not None and self._failure is not None:
            # DCP's rank-local retry after the collective read failed: every
            # rank failed it alike, and a retry alone could resume this rank
            # at its own step.
            raise self._failure
        dist = self._dist() if kwargs.get("rank") is None else None
        try:
            if dist is not None:
                self._agree()
                metadata = self._broadcast_metadata(dist)
            else:
                own = _read_footer(self._shard(_ckpt.identity()[1]))
                self._local = dict(own.get("local") or {})
                metadata = own.get("metadata")
                if metadata is None:
                    metadata = _read_footer(self._shard(self.coordinator_rank)).get("metadata")
            if metadata is None:
                raise _ckpt.CheckpointError(
                    f"WardenStorageReader: step {self._resolved}: rank {self.coordinator_rank}'s shard"
                    " holds no DCP metadata (saved with another coordinator_rank?)"
                )
        except BaseException as e:
            if dist is not None:
                self._failure = e
            raise
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
        where: dict[Any, Any] = {}
        for req in plan.items:
            # This rank's own copy first: no other rank's shard fetched for it.
            at = self._local.get(req.storage_index) or self.storage_data[req.storage_index]
            where[req.storage_index] = at
            by_rank.setdefault(int(at[0]), []).append(req)
        for rank, reqs in sorted(by_rank.items()):
            reqs.sort(key=lambda r: where[r.storage_index][1])
            with open(self._shard(rank), "rb") as f:
                for req in reqs:
                    _rank, offset, length = where[req.storage_index]
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
