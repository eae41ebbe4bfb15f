"""Saves that hold the training step only for a copy of the tensors.

``checkpoint.save_state_dict`` holds the step for the whole ``torch.save``:
the device-to-host copy, pickling and the write into the tier. Here the step
is held only while the state's tensors are copied into a buffer this saver
owns (allocated once and reused, pinned when CUDA is there, so the copy from
the GPU goes straight into it); writing the shard into the tier, the agent's
commit (checksums, replication) all run on a background thread. A state on
the GPU is copied on the training stream itself: ``save`` queues the copies
and returns, the step's next kernels run after them, and the background
thread waits for them before it reads the buffer, so the training thread
never blocks on the GPU for a save.

    from warden.async_checkpoint import AsyncCheckpointer

    saver = AsyncCheckpointer()            # at most 1 save in flight
    for step in range(start, steps):
        ...
        if step == start:                  # the state complete: its buffer made ahead
            saver.prepare({"model": model.state_dict(), "optim": opt.state_dict()})
        if step % 100 == 0:
            saver.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    saver.close()                          # waits for the last one

    r = load()                             # (step, state) or None

Back pressure is bounded: at most ``max_in_flight`` saves are in flight;
the next ``save`` waits for a free buffer, and that wait counts as stall.
A save that fails in the background is never committed; the failure is
raised by the next ``save``, ``wait`` or ``close`` (and ``on_error`` is
called with it, when given).

The shard is warden's own format (a header written with ``torch.save`` of
the state's structure, then the tensors' bytes), read back by ``load`` and
by ``checkpoint.load_state_dict``, with ``weights_only`` safety: nothing
in the shard can run code when it is loaded.
"""

from __future__ import annotations

import ctypes
import io
import os
import queue
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from . import _native, checkpoint, tensor_bytes
from .async_shard import MAGIC, VERSION, body_offset, is_async_shard, read_shard, skeleton

__all__ = ["AsyncCheckpointer", "MAGIC", "is_async_shard", "load", "read_shard"]

def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise checkpoint.CheckpointError("async saves need torch") from e
    return torch


@dataclass
class _Meta:
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


class _Slot:
    """One reusable snapshot buffer and what it holds."""

    def __init__(self) -> None:
        self.buffer = None  # torch.uint8 tensor
        self.pinned = False
        self.step = -1
        self.skeleton: Any = None
        self.metas: List[_Meta] = []
        self.used = 0
        self.snapshot_s = 0.0
        self.wait_s = 0.0
        #: (start, done) CUDA events of copies queued and not yet waited for.
        self.ready: list = []
        #: A buffer made ahead by ``prefault`` (set by its thread), taken by
        #: the next copy that needs a larger buffer than ``buffer``.
        self.spare = None
        self.prefault: Optional[threading.Thread] = None
        #: Buffers the copy had to allocate itself, on the training thread.
        self.grown = 0
        #: DCP's staging: (key, tensors) of the last save's views into the
        #: buffer, DTensors rewrapped, reused while the key holds.
        self.staged: Any = None


def layout(tensors: list) -> Tuple[List[_Meta], int]:
    """Where each of ``tensors`` goes in a buffer (one after the other, each
    on a 64-byte boundary), and the bytes they take."""
    metas: List[_Meta] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        offset = (offset + 63) & ~63
        metas.append(_Meta(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += nbytes
    return metas, offset


def headroom(need: int, pin: bool = False) -> int:
    """A buffer made ahead of a save of ``need`` bytes: 1/64 more, at least
    1 MiB more, so that the small things a checkpoint gains after the
    state it was sized from (a scheduler's counters, a callback's score)
    do not make the first save allocate a buffer of its own after all.
    Pinned, never past the power of two ``need`` fits in: torch's pinned
    allocator rounds each block up to one, and headroom across it would
    double the page-locked memory."""
    want = need + max(need >> 6, 1 << 20)
    if pin:
        want = min(want, 1 << (need - 1).bit_length())
    return want


def prefault(slot: _Slot, need: int, pin: bool, torch) -> Optional[threading.Thread]:
    """Starts making ``slot`` a buffer of ``headroom(need)`` bytes on a
    thread of its own, every page of it touched (or, pinned, page-locked by
    the allocation itself), and returns the thread; None where ``slot``'s
    buffer holds ``need`` bytes already, or its spare is large enough or
    still being made, or ``need`` is 0 (a state without a byte to copy
    needs no buffer).

    Why: a buffer's first touch is a page fault per 4 KiB page, and the
    first save after every start paid them on the training thread (2.6 to
    12 s for 4 GiB on the 2-core VM, docs/benchmarks.md), as does
    ``cudaHostAlloc`` for a pinned one. Made ahead, the first save is a
    copy like the others. The buffer in use is never replaced here (a
    save in flight may be reading it): the copy that next needs a larger
    one takes the spare (``take_spare``), on the thread that owns the slot.
    A failure (no memory) leaves no spare; the copy then allocates its own,
    as without this. Call it from the thread that copies into ``slot``
    (the hand-over of the spare takes no lock)."""
    need = int(need)
    if need <= 0:
        return None
    want = headroom(need, pin)
    have = slot.buffer
    spare = slot.spare
    if slot.prefault is not None and slot.prefault.is_alive():
        return None
    if (have is not None and have.numel() >= need) or (spare is not None and spare[0].numel() >= need):
        return None

    def run() -> None:
        try:
            buf = torch.empty(want, dtype=torch.uint8, pin_memory=pin)
            if not pin:
                ctypes.memset(buf.data_ptr(), 0, want)  # the GIL released meanwhile
            slot.spare = (buf, pin)
        except Exception as e:  # noqa: BLE001 - the copy allocates its own
            warnings.warn(f"warden: a save buffer of {want} bytes could not be made ahead: {e}", stacklevel=1)

    t = threading.Thread(target=run, name="warden-save-prefault", daemon=True)
    t.start()
    slot.prefault = t
    return t


def _pop_spare(slot: _Slot) -> Any:
    """``slot``'s spare (buffer, pinned) taken from it, or None, once the
    ``prefault`` thread making it is done."""
    t, slot.prefault = slot.prefault, None
    if t is not None:
        t.join()
    made, slot.spare = slot.spare, None
    return made


def drop_spare(slot: _Slot) -> None:
    """The spare ``prefault`` made for ``slot`` let go (waited for, if still
    being made): a saver that closes holds no buffer made for a save that
    never came."""
    _pop_spare(slot)


def take_spare(slot: _Slot, need: int, pin: bool) -> Any:
    """The buffer ``prefault`` made for ``slot`` (waited for, if still being
    made: the wait is the save's stall, as the faults would have been),
    when it holds ``need`` bytes and is pinned as asked; else None."""
    made = _pop_spare(slot)
    if made is None:
        return None
    buf, pinned = made
    return buf if buf.numel() >= need and pinned == pin else None


#: The integrations make the save buffer ahead once the optimizers' state
#: is made, and at this optimizer step at the latest.
PREPARE_BY = 10


def optimizer_state_made(optimizers: list) -> bool:
    """Whether every parameter the ``optimizers`` train has its state (Adam's
    moments, made at its first step with a gradient): before that, a state
    dict is smaller than a save's will be, and a buffer made ahead from it
    would be thrown away by the first save. A step skipped (a loss scaler's
    overflow) or a parameter without a gradient yet leaves it False."""
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []):
            for p in group.get("params", []):
                if getattr(p, "requires_grad", False) and not opt.state.get(p):
                    return False
    return True


def prepare_once_ready(steps: int, optimizers: list, make: Callable[[], None]) -> bool:
    """For the integrations, at the end of each optimizer step until it
    returns True: ``make`` (a ``prepare``) called once the ``optimizers``'
    state is made, or at the ``PREPARE_BY``-th step in any case. A failure
    of ``make`` is warned, never raised: the buffer made ahead is a head
    start, never the step's failure. True once done (made or warned)."""
    if steps < PREPARE_BY and not optimizer_state_made(optimizers):
        return False
    try:
        make()
    except Exception as e:  # noqa: BLE001 - see above
        warnings.warn(f"warden: the save buffer was not made ahead: {e}", stacklevel=3)
    return True


#: Environment: how many threads copy a save's CPU tensors into its buffer.
COPY_THREADS_ENV = "WARDEN_SAVE_COPY_THREADS"

#: Contiguous copies of non-contiguous CPU tensors held for one native copy
#: call at most; past this they are copied and let go.
_KEEP_BYTES = 64 << 20


def copy_threads() -> int:
    """Threads for the snapshot's copy of CPU tensors: ``WARDEN_SAVE_COPY_THREADS``
    when set, else this process's share of the cores it may run on, at most
    4: its affinity where that is a part of the machine's cores (a rank
    bound to its own), else the machine's divided among the node's ranks
    (``LOCAL_WORLD_SIZE``).
    The training thread is held for the copy, so the cores it would compute
    on are free to copy; ranks that copy at once on a node share them."""
    raw = os.environ.get(COPY_THREADS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
            if n >= 1:
                return n
        except ValueError:
            pass
        warnings.warn(
            f"warden: {COPY_THREADS_ENV}={raw!r} is not a whole number of at least 1; "
            "copying with the default",
            stacklevel=2,
        )
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    if cores < (os.cpu_count() or cores):
        # Bound to cores of its own (Slurm's --cpu-bind, a NUMA binding):
        # they are its share already.
        return max(1, min(4, cores))
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(4, cores // ranks))


def copy_into(slot: _Slot, tensors: list, pin: bool, torch, wait: bool = True) -> None:
    """Copies ``tensors`` one after the other into ``slot``'s buffer (grown,
    never per save, when they no longer fit; pinned when ``pin``), each on a
    64-byte boundary, and notes where each went (``slot.metas``, ``slot.used``).
    CPU tensors are copied before it returns, all in one native call with
    the GIL released, split over ``copy_threads()`` threads (torch's
    ``copy_`` of many tensors of a few MiB ran at a third of memcpy's speed
    here, and one ``memmove`` per tensor from Python paid a call's cost per
    tensor, 1,300 of them in a BERT). CUDA tensors are queued on their device's
    current stream straight into the (pinned) buffer. With ``wait`` it
    returns once they are there too; without, it returns at once and
    ``slot.ready`` holds a (start, done) event pair per device, which
    whoever reads the buffer waits for (``wait_ready``): the copy is ordered
    on the stream the training step runs on, so the step's next kernels,
    the optimizer's in-place update among them, run after it, and the
    training thread never waits on the GPU for a save."""
    metas, offset = layout(tensors)
    # A state without a byte to copy (a rank that saves an empty state)
    # needs no buffer, and gets none.
    if offset > 0 and (slot.buffer is None or slot.buffer.numel() < offset):
        # Views of the old buffer (DCP's staged tensors) would keep it alive.
        slot.staged = None
        buf = take_spare(slot, offset, pin)
        if buf is None:
            buf = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
            slot.grown += 1
        slot.buffer = buf
        slot.pinned = pin
    buf = slot.buffer
    # Per CUDA device: the event recorded on its current stream before the
    # first copy from it (the copies' start, for their time on the GPU).
    started: dict = {}
    # CPU tensors' (address, offset, bytes), copied in one call below; the
    # contiguous copies made for them are kept alive until then (copied
    # early once they hold _KEEP_BYTES, so that a state of many
    # non-contiguous views never holds a second copy of itself).
    regions: list = []
    keep: list = []
    kept = 0
    threads = copy_threads()
    try:
        for t, m in zip(tensors, metas):
            if m.nbytes == 0:
                continue
            src = t.detach()
            if src.is_cuda and src.device not in started:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(src.device))
                started[src.device] = ev
            made = not src.is_contiguous()
            if made:
                src = src.contiguous()
            if src.is_cuda:
                flat = src.reshape(-1).view(torch.uint8)
                buf[m.offset : m.offset + m.nbytes].copy_(flat, non_blocking=True)
            else:
                regions.append((src.data_ptr(), m.offset, m.nbytes))
                keep.append(src)
                kept += m.nbytes if made else 0
                if kept >= _KEEP_BYTES:
                    _native._copy_regions(buf.data_ptr(), buf.numel(), regions, threads)
                    regions, keep, kept = [], [], 0
    finally:
        # The GPU copies' end recorded whatever the loop or a copy raised:
        # the queued copies are known, and a failed save's drain_ready
        # waits for them before the buffer is written again.
        ready = []
        for device, start in started.items():
            done = torch.cuda.Event(enable_timing=True)
            done.record(torch.cuda.current_stream(device))
            ready.append((start, done))
        slot.ready = ready
    if regions:
        _native._copy_regions(buf.data_ptr(), buf.numel(), regions, threads)
    del keep
    if wait:
        wait_ready(slot)
    slot.metas = metas
    slot.used = offset


def held_s(total_s: float, copy_s: float, device_s: float) -> float:
    """The step's hold by a save that spent ``total_s`` on the training
    thread, ``copy_s`` of it queueing or making the copy, and whose copies
    took ``device_s`` on a GPU (after the queueing returned): the GPU's
    copy where it outlasted the queueing, which it overlaps."""
    return total_s + max(0.0, device_s - copy_s)


def wait_ready(slot: _Slot) -> float:
    """Waits for ``slot``'s queued GPU copies (none: returns at once) and
    returns the longest one's time on its GPU, in seconds (0 without)."""
    ready, slot.ready = slot.ready, []
    longest = 0.0
    for start, done in ready:
        done.synchronize()
        longest = max(longest, start.elapsed_time(done) / 1e3)
    return longest


def drain_ready(slot: _Slot) -> None:
    """Waits for the GPU copies a failed save left queued into ``slot``, so
    that the buffer is not written again under them; their own error is
    dropped (the save's failure is reported already)."""
    if slot.ready:
        try:
            wait_ready(slot)
        except BaseException:  # noqa: BLE001 - see above; wait_ready cleared slot.ready
            pass


def view_of(slot: _Slot, meta: _Meta, torch) -> Any:
    """The tensor ``meta`` describes, as a view into ``slot``'s buffer (no copy)."""
    dt = getattr(torch, meta.dtype)
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=dt)
    return slot.buffer[meta.offset : meta.offset + meta.nbytes].view(dt).reshape(meta.shape)


class AsyncCheckpointer:
    """Snapshots a state into buffers it owns and saves it in the background.

    ``max_in_flight``: saves copied and not yet committed (default 1); the
    next ``save`` waits for one to finish. ``pin``: pin the buffers in page-
    locked memory (default: when CUDA is available). ``on_error``: called
    on the background thread with a save's exception (it is raised by the
    next call anyway).
    """

    def __init__(
        self,
        max_in_flight: int = 1,
        pin: Optional[bool] = None,
        on_error: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        torch = _torch()
        self._torch = torch
        self._pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._free: "queue.Queue[_Slot]" = queue.Queue()
        self._slots = [_Slot() for _ in range(max_in_flight)]
        for slot in self._slots:
            self._free.put(slot)
        self._work: "queue.Queue[Optional[_Slot]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._on_error = on_error
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False
        #: The last save's time in ``save``, seconds: the wait for a buffer
        #: plus the copy (for CUDA tensors, the copies' queueing: the GPU
        #: copies them on the training stream, ``last_device_copy_s``).
        self.last_stall_s = 0.0
        #: Every save's time in ``save``, added up.
        self.total_stall_s = 0.0
        #: The GPU's time copying the last committed save's CUDA tensors,
        #: seconds (0 for a state on the CPU): the training stream's hold.
        self.last_device_copy_s = 0.0
        #: The stall the agent booked for the last committed save (``held_s``:
        #: the wait for a buffer and the copy, the GPU's where it was longer).
        self.last_held_s = 0.0
        #: The last committed save's background: writing the shard into the
        #: tier's staging file, and the agent's commit (its checksum and
        #: placement), seconds.
        self.last_write_s = 0.0
        self.last_commit_s = 0.0
        #: Saves committed, and the last one's step and path.
        self.committed = 0
        self.last_committed: Optional[Tuple[int, str]] = None
        self._thread = threading.Thread(target=self._run, name="warden-async-save", daemon=True)
        self._thread.start()

    # -- the training thread ------------------------------------------------

    def save(self, step: int, state: Any) -> None:
        """Copies ``state``'s tensors (any nesting of dicts, lists and tuples)
        into a buffer and returns; the shard of ``step`` is written and
        committed in the background. Raises the failure of an earlier save."""
        self._raise_failure()
        if self._closed:
            raise checkpoint.CheckpointError("this AsyncCheckpointer is closed")
        torch = self._torch
        started = time.perf_counter()
        slot = self._free.get()  # back pressure: counted as stall
        got = time.perf_counter()
        try:
            self._snapshot(slot, int(step), state, torch)
        except BaseException:
            # GPU copies queued before the failure finish before the buffer
            # is written again.
            drain_ready(slot)
            self._free.put(slot)
            raise
        done = time.perf_counter()
        stall = done - started
        # The copy's share; the background adds the GPU's where it is longer.
        slot.wait_s, slot.snapshot_s = got - started, done - got
        self.last_stall_s = stall
        self.total_stall_s += stall
        with self._lock:
            self._in_flight += 1
        self._work.put(slot)

    def prepare(self, state: Any) -> None:
        """Makes the buffers a save of ``state`` needs ahead of it, on a
        background thread, and returns at once: their memory allocated and
        every page touched (pinned memory: page-locked), so that the first
        save is a copy like the others instead of a page fault per 4 KiB of
        state on the training thread (seconds for 4 GiB on a small VM, after
        every restart). Call it once the state holds all its tensors:
        after the first optimizer step, where Adam makes its moments
        (``optimizer_state_made`` says when), and from the thread that
        saves. A save that comes before the buffers are made waits for them
        (stall, as the faults would have been); a state that grew past them
        is given a buffer of its own by its save, as without ``prepare``;
        ``close`` lets go of buffers made for saves that never came."""
        if self._closed:
            raise checkpoint.CheckpointError("this AsyncCheckpointer is closed")
        torch = self._torch
        tensors: list = []
        skeleton(state, tensors, torch)
        _, need = layout(tensors)
        for slot in self._slots:
            prefault(slot, need, self._pin, torch)

    def prepared(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (None: for as long as it takes)
        for the buffers ``prepare`` is making; True once none is being made."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for slot in self._slots:
            t = slot.prefault
            if t is None:
                continue
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                return False
        return True

    @property
    def grown_in_save(self) -> int:
        """Buffers that saves had to allocate on the training thread (the
        first save of a state without ``prepare``, or a state that grew)."""
        return sum(slot.grown for slot in self._slots)

    def _snapshot(self, slot: _Slot, step: int, state: Any, torch) -> None:
        tensors: list = []
        structure = skeleton(state, tensors, torch)
        copy_into(slot, tensors, self._pin, torch, wait=False)
        slot.step = step
        slot.skeleton = structure

    def wait(self) -> None:
        """Waits until every save in flight is committed (or failed); raises
        the first failure."""
        with self._lock:
            while self._in_flight:
                self._idle.wait()
        self._raise_failure()

    def close(self) -> None:
        """Waits for the saves in flight and stops the background thread."""
        if self._closed:
            self._raise_failure()
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._work.put(None)
            self._thread.join()
            for slot in self._slots:
                drop_spare(slot)

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    def _raise_failure(self) -> None:
        with self._lock:
            e, self._error = self._error, None
        if e is not None:
            raise checkpoint.CheckpointError(f"an earlier async save failed: {e}") from e

    # -- the background thread ---------------------------------------------

    def _run(self) -> None:
        while True:
            slot = self._work.get()
            if slot is None:
                return
            try:
                path = self._write(slot)
                self.committed += 1
                self.last_committed = (slot.step, path)
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                with self._lock:
                    if self._error is None:
                        self._error = e
                if self._on_error is not None:
                    try:
                        self._on_error(e)
                    except Exception:  # noqa: BLE001
                        pass
            finally:
                slot.skeleton = None
                drain_ready(slot)  # a write that failed before it waited
                self._free.put(slot)
                with self._lock:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _write(self, slot: _Slot) -> str:
        torch = self._torch
        device_s = wait_ready(slot)
        self.last_device_copy_s = device_s
        header = io.BytesIO()
        torch.save(
            {
                "version": VERSION,
                "state": slot.skeleton,
                "tensors": [(m.dtype, list(m.shape), m.offset, m.nbytes) for m in slot.metas],
                "size": slot.used,
            },
            header,
        )
        head = header.getvalue()
        body = body_offset(len(head))
        size = body + slot.used
        started = time.perf_counter()
        with checkpoint.ShardFile(slot.step, size_hint=size) as f:
            f.file.write(MAGIC)
            f.file.write(struct.pack("<Q", len(head)))
            f.file.write(head)
            f.file.write(b"\0" * (body - len(MAGIC) - 8 - len(head)))
            if slot.used:
                f.file.write(tensor_bytes.view(slot.buffer, slot.used))
            f.file.flush()
            written = time.perf_counter()
            # The stall the agent records for this shard is the training
            # step's, not the background write's: the wait for a buffer and
            # the copy, the GPU's where that took longer than the queueing.
            held = held_s(slot.wait_s + slot.snapshot_s, slot.snapshot_s, device_s)
            path = f.commit(stall=held)
            self.last_write_s, self.last_commit_s = written - started, time.perf_counter() - written
            self.last_held_s = held
            return path


def load(
    step: int = 0, map_location: Any = "cpu", agree: Optional[bool] = None, group: Any = None
) -> Optional[tuple]:
    """(step, state) of the newest complete step (or ``step``), whichever way
    it was saved, or None on a fresh start: ``checkpoint.load_state_dict``,
    which agrees on the step over ``group`` when ``torch.distributed`` is
    up (every rank of it calls this then; ``agree=False`` for one rank)."""
    return checkpoint.load_state_dict(step, map_location=map_location, agree=agree, group=group)
