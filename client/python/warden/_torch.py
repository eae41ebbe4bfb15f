"""Out of a stuck collective: the rank's torch process groups, aborted before a restart.

In: a restart request (the resender calls ``abort_process_groups(seq)`` on a
thread of its own, before the request's first delivery), or an exception
that ``warden.run`` is about to retry. Out: every process group of the rank
aborted (``ProcessGroup.abort()``: NCCL's ``ncclCommAbort``, so a thread
blocked in a collective returns with an error and takes ``RestartRequested``
at once), then, in the training thread, destroyed (``destroy_after_abort``),
so the next attempt can call ``init_process_group`` again on a new store.
Never: imports torch (a program that did not import ``torch.distributed``
has no group to abort), or raises (a failed abort is printed; the restart
goes on).

Also the flight-recorder hook (``dump_flight_recorder``): on the agent's
request for a hung rank, torch's flight recorder is written to the file the
agent named, for the agent to match ranks by process group and sequence
number.

Which groups: the default one and every group made through
``torch.distributed`` (its ``_world.pg_map``), and those registered with
``warden.register_process_group`` (a group made outside torch.distributed's
bookkeeping). On gloo, torch 2.15's abort does not wake a collective waiting
on a peer that is alive but silent (a rank frozen with SIGSTOP); such a peer
returns once the silent rank's sockets close (it restarts, or the launcher
replaces it). A peer hung in Python is no such case: its own request aborts
and destroys its groups, which closes its sockets, as long as nothing else
holds the group (``warden.run`` clears the interrupted frames for that).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import traceback
import weakref
from typing import Any, List

_lock = threading.Lock()
#: Signalled when an abort on the resender's thread ends (under ``_lock``).
_abort_done = threading.Condition(_lock)
#: Groups registered by hand (weakly: a group the program dropped is gone).
_registered: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: Groups aborted since the last ``destroy_after_abort`` (strong refs: they
#: must live until destroyed in the training thread).
_aborted: List[Any] = []
#: Aborts in progress on the resender's thread (under ``_lock``).
_aborting = 0
#: How long ``destroy_after_abort`` waits for an abort in progress on the
#: resender's thread (an NCCL abort can itself hang: then the teardown goes
#: on without it, and says so).
ABORT_WAIT_S = 10.0


def register_process_group(group: Any) -> None:
    """Registers a torch process group for aborting on an in-process restart.

    Groups made with ``torch.distributed.init_process_group`` and
    ``new_group`` are found without this; register one made another way (a
    backend constructed by hand, a torchft group).
    """
    with _lock:
        _registered.add(group)


def _distributed() -> Any:
    """``torch.distributed`` if the program imported it, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available():
            return None
    except Exception:
        return None
    return dist


def process_groups() -> List[Any]:
    """The rank's process groups: torch.distributed's (default first), then registered ones."""
    found: List[Any] = []
    dist = _distributed()
    if dist is not None:
        try:
            c10d = dist.distributed_c10d
            default = c10d.GroupMember.WORLD
            if default is not None:
                found.append(default)
            for pg in list(c10d._world.pg_map.keys()):
                if all(pg is not f for f in found):
                    found.append(pg)
        except Exception:
            traceback.print_exc()
    with _lock:
        for pg in list(_registered):
            if all(pg is not f for f in found):
                found.append(pg)
    return found


def _still_pending(seq: int) -> bool:
    """Whether request ``seq`` is still the one waiting for the training
    thread (not yet taken: acknowledged, or joined early by ``warden.heal``)."""
    try:
        from . import _native

        p = _native._restart_pending()
    except Exception:
        return True  # cannot tell: abort, as before
    return p is not None and int(p["seq"]) == seq


def abort_process_groups(seq: int = 0) -> int:
    """Aborts every process group of the rank; returns how many were aborted.

    Safe from any thread: it only calls ``abort()`` on each group (no change
    to torch.distributed's bookkeeping, which belongs to the training thread).

    Called by the resender for request ``seq`` (0: by the training thread
    itself) before the request's first delivery, on the resender's thread,
    so it can run beside the training thread's teardown of the same
    attempt. Two orders are kept out: a request the training thread took
    already (its attempt torn down, or, with ``warden.heal``, a new attempt
    joined whose groups are not this request's to abort) aborts nothing;
    and ``destroy_after_abort`` waits for an abort in progress, so no group
    is added to ``_aborted`` after the teardown took the list (a group held
    there stays alive, its sockets open, and a peer blocked on them waits).
    """
    global _aborting
    with _lock:
        _aborting += 1
    try:
        if seq and not _still_pending(seq):
            return 0
        groups = process_groups()
        done = 0
        for pg in groups:
            try:
                pg.abort()
                done += 1
            except Exception as e:  # a backend without abort, one already gone
                print(f"warden: aborting process group {pg!r} failed: {e}", file=sys.stderr)
            with _lock:
                if all(pg is not a for a in _aborted):
                    _aborted.append(pg)
        return done
    finally:
        with _lock:
            _aborting -= 1
            _abort_done.notify_all()


def wait_for_aborts(timeout: float = ABORT_WAIT_S) -> bool:
    """Waits until no abort runs on the resender's thread, at most
    ``timeout`` seconds; whether none runs.

    For a new attempt's group (``warden.heal``'s ``init_process_group``):
    an abort that passed its request's check before the training thread
    acknowledged that request without a raise (an attempt joined early)
    takes the groups it finds when it gets to them, and one that got there
    after the new group was made would abort it, and the peers would see
    its connections close with no request to restart."""
    with _lock:
        return _abort_done.wait_for(lambda: _aborting == 0, timeout=timeout)


#: A group's destructor that takes this long is said on stderr.
REAP_SAID_AFTER_S = 1.0


def destroy_after_abort() -> None:
    """In the training thread, after a restart was caught: forgets the aborted groups.

    The default group (and with it every group torch.distributed made) is
    destroyed, so ``init_process_group`` can run again; a registered group
    is only dropped (its owner rebuilds it).

    The groups' last references are dropped on a thread of their own
    (:func:`_reap`), not here: a gloo group's C++ destructor joins its
    worker threads, and one still in a collective on a peer that is alive
    but has not yet shut its side holds the destructor, and so the training
    thread, until that peer's sockets close (measured on torch 2.15: a
    two-rank gloo group with an all-reduce the peer never joins,
    ``destroy_process_group`` returned only when the peer exited, 10 s on;
    with the references held and dropped on another thread it returned at
    once, the other thread waiting alone, the GIL free). Such a stall,
    between steps, is what the agent's hang detection took for a hang after
    a heal, asking again until the rank left with exit 75.

    An abort still running on the resender's thread is waited for first
    (at most :data:`ABORT_WAIT_S`), so the groups it aborts are among those
    destroyed here and none is left held in ``_aborted``.
    """
    with _lock:
        if not _abort_done.wait_for(lambda: _aborting == 0, timeout=ABORT_WAIT_S):
            print(
                f"warden: an abort of the process groups still runs after {ABORT_WAIT_S:.0f} s; "
                "tearing the attempt down without waiting for it",
                file=sys.stderr,
                flush=True,
            )
        held = list(_aborted)
        _aborted.clear()
    dist = _distributed()
    if dist is None:
        _reap(held)
        return
    held.extend(g for g in process_groups() if all(g is not h for h in held))
    try:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                # An aborted group may refuse an orderly shutdown: drop
                # torch.distributed's state without one.
                dist.distributed_c10d._abort_process_group()
    except Exception as e:
        print(f"warden: destroying the aborted process groups failed: {e}", file=sys.stderr)
    _reap(held)


def _reap(held: List[Any]) -> None:
    """Drops ``held`` (the last references to the attempt's groups, as far as
    warden knows) on a daemon thread, so their destructors run there.

    A destructor that waits costs that thread only, and is said once it
    took :data:`REAP_SAID_AFTER_S` or more. A group someone else still
    holds lives on, as before.
    """
    if not held:
        return

    def drop() -> None:
        start = time.monotonic()
        held.clear()
        took = time.monotonic() - start
        if took >= REAP_SAID_AFTER_S:
            print(
                f"warden: the previous attempt's process group took {took:.1f} s to go "
                "(a worker thread of its was still in a collective); training did not wait",
                file=sys.stderr,
                flush=True,
            )

    reaper = threading.Thread(target=drop, name="warden-group-reaper", daemon=True)
    with _lock:
        _reapers[:] = [r for r in _reapers if r.is_alive()]
        _reapers.append(reaper)
    reaper.start()


#: Reapers started; the interpreter's exit waits for them, bounded.
_reapers: List[threading.Thread] = []
#: How long the interpreter's exit waits for reapers still at work.
REAP_EXIT_WAIT_S = 10.0


@atexit.register
def _join_reapers() -> None:
    """At exit, waits (bounded) for destructors still at work on a reaper:
    one cut off by the interpreter's teardown could run into torch's own."""
    deadline = time.monotonic() + REAP_EXIT_WAIT_S
    with _lock:
        reapers = list(_reapers)
    for r in reapers:
        r.join(max(0.0, deadline - time.monotonic()))


def _fr_dump() -> tuple[bytes | None, str]:
    """torch's flight-recorder JSON, or None and why there is none."""
    dist = _distributed()
    if dist is None:
        return None, "torch.distributed is not imported"
    try:
        if not dist.is_initialized():
            return None, "torch.distributed is not initialised"
        c10d = sys.modules.get("torch._C._distributed_c10d")
        if c10d is None:
            import torch._C._distributed_c10d as c10d  # already loaded with torch.distributed
        backend = str(dist.get_backend()).lower()
        if "nccl" in backend and hasattr(c10d, "_dump_nccl_trace_json"):
            return c10d._dump_nccl_trace_json(True, True), ""
        if hasattr(c10d, "_dump_fr_trace_json"):
            return c10d._dump_fr_trace_json(True, True), ""
        return None, "this torch has no flight recorder for backend " + backend
    except Exception as e:  # a torch without it, a backend that refuses
        return None, f"torch's flight-recorder dump failed: {e}"


def dump_flight_recorder(seq: int, path: str) -> None:
    """Writes the rank's flight recorder to ``path`` (the agent's request ``seq``).

    Called by the native client on a thread of its own. ``path`` is a file
    the agent made (mode 0600, handed to this rank's uid) in a directory
    only the agent writes: it is opened without creating and never through
    a link, written in place, and its write bits are then taken off (mode
    0400), which tells the agent the dump is complete. Without
    torch.distributed initialised, or without a recorder, writes
    ``{"warden_unavailable": why}`` instead. With the recorder off
    (``TORCH_FR_BUFFER_SIZE`` unset or 0) torch's dump has no groups.
    """
    import json
    import os
    import stat

    data, why = _fr_dump()
    if data is None:
        data = json.dumps({"warden_unavailable": why}).encode()
    elif isinstance(data, str):
        data = data.encode()
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a regular file")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fchmod(fd, 0o400)
        finally:
            os.close(fd)
    except OSError as e:
        print(f"warden: cannot write the flight-recorder dump to {path}: {e}", file=sys.stderr)


def _register_flight_recorder_hook() -> None:
    from . import _native

    setter = getattr(_native, "_flight_recorder_set_hook", None)
    if setter is not None:
        setter(dump_flight_recorder)


_register_flight_recorder_hook()
