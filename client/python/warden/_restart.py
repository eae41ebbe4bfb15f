"""In-process restarts: ``warden.run``, ``@warden.restartable`` and ``RestartRequested``.

When the agent decides that a job is to restart in process (a rank hung
alone, ``warden restart``), every rank of the job gets the request. Under
``warden.run(train_fn)`` the training thread then raises
``RestartRequested`` wherever it is, even inside a long ``time.sleep``, a
socket or a lock wait (a signal interrupts them); ``warden.run`` catches
it, acknowledges it to the agent, and calls ``train_fn`` again, which
restores from its local checkpoint. The process keeps its interpreter, its
imports and its CUDA context.

Before the first delivery of a request, the rank's torch process groups
are aborted from the resender's thread (``warden._torch``), so a training
thread blocked in a collective returns and takes the exception; ``run``
destroys them before the next attempt, which makes new ones.

An exception from the training function is reported to the agent, and
the rank waits (bounded) for its decision instead of dying: a transient
class (a collective timeout) restarts every rank of the job in process,
this one included; anything else (a ValueError) propagates and ends the
rank with its exit code.

A rank whose process is frozen (SIGSTOP) never answers: the agent has its
launcher replace it at once while the others restart in process, and the
new process starts with ``WARDEN_IN_PROCESS_RESTART_COUNT`` set to the
count the others' next attempt runs with, so ``restart_count()`` is the same
in every rank and it restores from the same checkpoint.

Across hosts, with ``warden.heal`` declared, a rank whose collective lost a
peer that another host's launcher heals is asked nothing: it closes its
groups, waits for the peers' next attempt to begin on the round's store, and
restarts in process by itself to join it (a ``RestartRequested`` it makes,
``seq`` 0).

Outside ``warden.run`` nothing is raised: the request stays pending, and the
agent restarts the job's processes after its ``restart.in_process_timeout``.
So does a rank stuck in native code that never returns to the interpreter
(a NCCL collective waiting on a dead peer): no signal interrupts it.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional, TypeVar

from . import _native, _torch

_F = TypeVar("_F", bound=Callable[..., Any])
_R = TypeVar("_R")

#: The restart count of the attempt running now (0: the first); None until
#: first read (from ``WARDEN_IN_PROCESS_RESTART_COUNT``, read late: a standby
#: interpreter may import warden before its environment is the rank's).
_count: Optional[int] = None

#: Set by ``warden run`` for a rank it started in the middle of an in-process
#: restart (replacing a frozen process): the count its peers run with.
_COUNT_ENV = "WARDEN_IN_PROCESS_RESTART_COUNT"
#: The signal whose handler raises, once installed (None: not tried yet).
_signal: Optional[int] = None
_signal_lock = threading.Lock()


class RestartRequested(BaseException):
    """The agent asked this rank to restart its training function in process.

    A ``BaseException``, like ``KeyboardInterrupt``: ``except Exception`` in
    training code does not swallow it. Code that catches ``BaseException``
    and carries on gets it again about every 100 ms, until ``warden.run``
    catches it.

    Attributes: ``restart_count`` (the count the next attempt runs with, 1 for
    the job's first restart), ``seq`` (the request's sequence number, what the
    acknowledgement carries), ``reason`` and ``incident_id`` (empty when the
    restart was asked by hand).
    """

    seq: int
    restart_count: int
    reason: str
    incident_id: str

    def __init__(
        self,
        *args: Any,
        seq: Optional[int] = None,
        restart_count: Optional[int] = None,
        reason: Optional[str] = None,
        incident_id: Optional[str] = None,
    ) -> None:
        info: dict[str, Any] = {}
        if seq is None and restart_count is None and not args:
            # Raised for the pending request (by the signal handler, the
            # asynchronous-exception mechanism or warden.run): describe it,
            # and tell the resender that the raise happened.
            info = _native._restart_pending() or {}
            _native._restart_raised()
        self.seq = int(seq if seq is not None else info.get("seq", 0))
        self.restart_count = int(
            restart_count if restart_count is not None else info.get("restart_count", 0)
        )
        self.reason = str(reason if reason is not None else info.get("reason", ""))
        self.incident_id = str(
            incident_id if incident_id is not None else info.get("incident_id", "")
        )
        if not args:
            why = f": {self.reason}" if self.reason else ""
            args = (
                f"the warden agent asked for an in-process restart "
                f"(restart {self.restart_count}, seq {self.seq}){why}",
            )
        super().__init__(*args)


def restart_count() -> int:
    """The restart count of the attempt running under ``warden.run`` (0: the first).

    A training function restores from its local checkpoint when it is not 0.
    It only grows within a process: the agent's count for the job, or one
    more than the last, whichever is higher. A process its launcher started
    to replace a frozen rank in the middle of an in-process restart begins
    at the count of that restart (``WARDEN_IN_PROCESS_RESTART_COUNT``).
    """
    return _current_count()


def _current_count() -> int:
    """The count now, taken from the environment on first use."""
    global _count
    if _count is None:
        _count = _initial_count(os.environ.get(_COUNT_ENV))
    return _count


def _initial_count(raw: Optional[str]) -> int:
    """The count a process starts with: ``raw`` (the environment's) when it is
    a count (0 to 2**31-1), else 0, said on stderr."""
    if raw is None or raw.strip() == "":
        return 0
    try:
        n = int(raw.strip())
    except ValueError:
        n = -1
    if not 0 <= n < 2**31:
        print(
            f"warden: {_COUNT_ENV}={raw!r} is not a restart count; starting at 0",
            file=sys.stderr,
        )
        return 0
    return n


def _wanted_signal() -> int:
    raw = os.environ.get("WARDEN_RESTART_SIGNAL")
    if raw is None or raw.strip() == "":
        return int(signal.SIGUSR1)
    raw = raw.strip()
    if raw.lower() in ("0", "off", "none", "no", "false"):
        return 0
    try:
        sig = int(raw)
    except ValueError:
        name = raw.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        found = getattr(signal.Signals, name, None)
        if found is None:
            print(
                f"warden: WARDEN_RESTART_SIGNAL={raw!r} is not a signal; "
                "restarts interrupt no blocking call",
                file=sys.stderr,
            )
            return 0
        sig = int(found)
    return sig if 0 < sig < signal.NSIG else 0


#: Asked by the restart signal's handler before it raises: True defers the
#: raise (``warden.heal`` while an optimizer update runs; it raises the
#: restart itself once the step is committed). None: never deferred.
_defer: Optional[Callable[[], bool]] = None


def _set_defer(fn: Optional[Callable[[], bool]]) -> None:
    """Installs the predicate that defers the signal's raise (``warden.heal``)."""
    global _defer
    _defer = fn


def _on_signal(signum: int, frame: Any) -> None:
    """The restart signal's handler: raises in the training thread, once due
    (unless an update that must not be cut in half runs: see ``_defer``)."""
    defer = _defer
    if defer is not None and defer():
        return
    if _native._restart_should_raise():
        raise RestartRequested()


def _install_signal() -> None:
    """Installs the restart signal's handler (once, from the main thread).

    Kept for the life of the process: a signal the resender already sent
    must never meet the default action (which ends the process). A signal
    the program already handles, or the stack-dump signal, is not taken:
    restarts then come through the asynchronous exception alone, which
    does not interrupt a blocking call.
    """
    global _signal
    if _signal is not None or threading.current_thread() is not threading.main_thread():
        return
    with _signal_lock:
        if _signal is not None:
            return
        sig = _wanted_signal()
        stack = os.environ.get("WARDEN_STACK_DUMP_SIGNAL")
        stack_sig = int(signal.SIGUSR2)
        if stack is not None:
            try:
                stack_sig = int(stack)
            except ValueError:
                stack_sig = -1
        if sig == stack_sig:
            print(
                f"warden: the restart signal {sig} is the stack-dump signal; "
                "restarts interrupt no blocking call",
                file=sys.stderr,
            )
            sig = 0
        if sig:
            try:
                if signal.getsignal(sig) not in (signal.SIG_DFL, None):
                    sig = 0
                else:
                    signal.signal(sig, _on_signal)
            except (OSError, ValueError, RuntimeError) as e:
                print(f"warden: no restart signal {sig}: {e}", file=sys.stderr)
                sig = 0
        main = threading.main_thread().ident or 0
        _native._restart_set_signal(sig, main if sig else 0)
        _signal = sig


def run(
    train_fn: Callable[..., _R],
    *args: Any,
    max_restarts: Optional[int] = None,
    on_restart: Optional[Callable[[RestartRequested], Any]] = None,
    **kwargs: Any,
) -> _R:
    """Runs ``train_fn(*args, **kwargs)``, again after each in-process restart.

    When the agent asks for a restart, ``train_fn`` raises
    ``RestartRequested`` wherever it is; ``run`` acknowledges it, calls
    ``on_restart(exc)`` if given (tear down the process group, free memory),
    and calls ``train_fn`` again, which reads ``warden.restart_count()`` and
    restores from its local checkpoint. Returns what ``train_fn`` returns.

    ``max_restarts``: past that many restarts in this call, the exception
    propagates (the process ends; its launcher restarts it). ``max_restarts``
    and ``on_restart`` are ``run``'s own keywords; every other argument goes
    to ``train_fn``. Run it from the training thread (the main thread, for a
    blocking call to be interruptible).
    """
    global _count
    _install_signal()
    from . import _excepthook, _imports

    _imports.report()

    if not _excepthook.clients():
        # Requests come through a client: make sure one is registered.
        _native.default_client()
    done_restarts = 0
    call_args = args
    call_kwargs = kwargs
    while True:
        failure: Optional[Exception] = None
        try:
            done, value = _native._restart_call(train_fn, call_args, call_kwargs)
        except Exception as e:
            failure = e
        try:
            if failure is not None:
                how = _restarts_for(failure)
                if how == _NO:
                    raise failure
                if how == _JOINED:
                    # No request: the peers' next attempt began (a heal on
                    # another host); this rank restarts to join it.
                    n = _current_count() + 1
                    value = RestartRequested(
                        f"a lost peer is healed by its own host's launcher: joining the peers' next attempt (restart {n})",
                        seq=0,
                        restart_count=n,
                        reason="a lost peer is healed by its own host's launcher",
                    )
                    print(f"warden: {value}", file=sys.stderr, flush=True)
                else:
                    # Taken outside the handler, so the restart does not chain
                    # the error (whose frames hold the old process group) as
                    # context.
                    took, value = _native._restart_call(_nothing, (), None)
                    if took:
                        raise failure
                _release_frames(failure)
                failure = None
                done = False
            if done:
                return value  # type: ignore[no-any-return]
            exc: RestartRequested = value
            # The attempt's group is of no further use: its connections are
            # shut down first (a group warden.heal made records them), so that
            # a worker thread of its still blocked in a collective returns and
            # the group's destructor (below) does not wait on it (measured: 3 to
            # 8 s in about 1 heal of 6, until the agent's hang detection asked
            # again and the rank left with exit 75), and a peer blocked on
            # this rank's sockets fails at once instead of waiting for its own
            # watchdog.
            _shut_heal_sockets()
            # The frames the restart interrupted hold the attempt's objects (its
            # process group among them): a gloo group lives, its sockets open and
            # its peers waiting on them, until the last reference goes.
            _release_frames(exc)
            # A DDP wrapper of the attempt holds the group too, and sits in
            # reference cycles (module hooks): only the cycle collector frees
            # it, and a peer blocked on this rank's sockets waits until it does
            # (measured: gloo's whole 600 s timeout).
            gc.collect()
            while True:
                if max_restarts is not None and done_restarts >= max_restarts:
                    raise exc
                info = _native._restart_ack()
                done_restarts += 1
                if info and info["seq"] == exc.seq:
                    # What the stream said since the raise (the slot is terse).
                    exc.reason = exc.reason or info["reason"]
                    exc.incident_id = exc.incident_id or info["incident_id"]
                agent_count = int(info["restart_count"]) if info else 0
                _count = max(agent_count, _current_count() + 1)
                # The groups the request aborted: gone, so the next attempt
                # makes new ones (init_process_group on a new store).
                _torch.destroy_after_abort()
                if on_restart is None:
                    break
                # A newer request during the hook restarts again, acknowledged.
                done, value = _native._restart_call(on_restart, (exc,), None)
                if done:
                    break
                exc = value
        finally:
            # A lost peer's heal awaited (``_restarts_for``) ends here, on
            # every way out: the next attempt's own sections
            # (``warden.heal``'s ``heal`` around its regrouping) take over.
            _restart_section.leave()


#: How long an exception waits for a restart request that may be on its
#: way (a peer's abort reached this rank's collective first).
_PEER_GRACE_S = 1.0

#: How long a rank waits for the request the agent said it made (armed
#: before the answer: it arrives in milliseconds, unless the stream broke).
_DECIDED_WAIT_S = 5.0


#: ``_restarts_for``'s answers: no restart (the error stands), the pending
#: request's restart, or a restart with no request that joins the peers'
#: next attempt (``warden.heal`` across hosts).
_NO = "no"
_REQUESTED = "requested"
_JOINED = "joined"


def _restarts_for(exc: Exception) -> str:
    """Whether ``exc``, raised by the training function, ends in an in-process restart.

    Yes when a request is pending already: a collective that a peer's
    restart ended raises its own error (gloo: "Connection reset by peer")
    before the restart's signal handler can run, so that error is the
    restart's, not the program's. Else the rank reports it and waits for
    the agent's decision (bounded): a transient class (a collective timeout)
    restarts every rank of the job in process, this one included; anything
    else (a ValueError, no agent) ends the rank with the exception, after
    a short grace for a request already on its way.

    Across hosts, with ``warden.heal`` declared and the round's store hosted
    by a launcher, a lost peer's heal may be another host's: its launcher
    restarts its own ranks and the lost one, and nothing asks this rank.
    Then this rank's groups are closed at once (a peer blocked on its
    sockets returns), and it waits for either a request or the peers' next
    attempt begun on the round's store (``_JOINED``: it restarts to join it).
    """
    if _native._restart_pending() is not None:
        return _REQUESTED
    if _heal_declared and _lost_peer(exc):
        # The wait for the lost peer's heal, and then this restart's
        # teardown, in ``heal_wait`` (see ``_RestartSection``).
        _restart_section.enter()
        begun = _next_attempt_begun
        if begun is not None and begun() is not None:
            _close_groups(exc)
            how = _wait_request_or(_heal_wait(), begun)
            if how != _NO:
                return how
        elif _wait_pending(_heal_wait()):
            # A heal is on its way: the launcher saw the peer's process end
            # and asked for the restart, which comes in milliseconds;
            # reporting first would hold this rank for the agent's answer
            # (its settle window) before it could take it.
            return _REQUESTED
    decision: Optional[dict[str, Any]] = None
    try:
        decision = _native.default_client()._report_for_decision(exc)
    except Exception as e:  # never let the report hide the program's error
        print(f"warden: reporting {type(e).__name__}: {e}", file=sys.stderr)
    if decision and decision.get("restart_in_process"):
        if _wait_pending(_DECIDED_WAIT_S):
            return _REQUESTED
        print(
            f"warden: the agent restarts the job in process (seq {decision.get('seq')}), "
            f"but no request came within {_DECIDED_WAIT_S} s",
            file=sys.stderr,
        )
        return _NO
    return _REQUESTED if _wait_pending(_PEER_GRACE_S) else _NO


class _RestartSection:
    """The ``heal_wait`` section from a lost peer's error until the next
    attempt begins: the wait for that peer's heal, then the old attempt's
    teardown. The agent judges it by ``hang.heal_timeout`` (2 min; set
    apart as ``hang.timeouts.heal_wait``), never calibrates it, and takes
    the gap it leaves between two steps for no ``idle`` sample.

    The agent puts a rank in ``restart`` itself from a restart it asks, but
    not while the rank waits for one, nor after a restart the rank began
    itself (``_JOINED``). Across hosts that wait lasts the lost host's lease
    TTL and the others' rejoin grace (``WARDEN_HEAL_PEER_WAIT_S``), seconds;
    out of any section it was judged against the job's ``idle`` threshold
    (the calibrated gap between steps, 3 s at least), and the survivor was
    called hung while it waited as designed: a false hang incident on a
    healthy host (suspected infrastructure) and a needless round of the
    same hosts before the lost host's (seen in CI, issue 31). Bounded
    still: the wait ends by itself, and a teardown stuck past the timeout
    is found. ``run`` leaves it on every way out of the restart's handling
    (a ``finally``)."""

    def __init__(self) -> None:
        self._open: Any = None

    def enter(self) -> None:
        if self._open is not None:
            return
        try:
            s = _native.section(_HEAL_WAIT_SECTION)
            s.__enter__()
        except Exception as e:  # no client: nothing judges this rank
            print(f"warden: no '{_HEAL_WAIT_SECTION}' section: {e}", file=sys.stderr)
            return
        self._open = s

    def leave(self) -> None:
        s, self._open = self._open, None
        if s is not None:
            s.__exit__(None, None, None)


#: The client's section for a lost peer's heal awaited
#: (``warden_core::detect::calibration::HEAL_WAIT``).
_HEAL_WAIT_SECTION = "heal_wait"

_restart_section = _RestartSection()

#: Set by ``warden.heal.declare``: a peer's loss is healed, so an error
#: that says a peer's connection ended waits for the restart first.
_heal_declared = False

#: Set by ``warden.heal``: whether the peers' next attempt began on the
#: round's store (True/False), or None where that cannot be told (one host,
#: a store hosted by a rank, no attempt joined yet).
_next_attempt_begun: Optional[Callable[[], Optional[bool]]] = None

#: How often the round's store is asked while a lost peer's heal is awaited.
_BEGUN_POLL_S = 0.01

#: How long such an error waits for the heal's restart request.
_HEAL_WAIT_S = 2.0

#: The launcher's variable for that wait across hosts: a peer on another
#: host is healed only once the job's next round is made (the lost host's
#: lease TTL and the others' rejoin grace), seconds after the error.
_HEAL_WAIT_ENV = "WARDEN_HEAL_PEER_WAIT_S"


def _heal_wait() -> float:
    """``$WARDEN_HEAL_PEER_WAIT_S`` (0.1 to 3600 s), else ``_HEAL_WAIT_S``."""
    raw = os.environ.get(_HEAL_WAIT_ENV, "")
    if not raw:
        return _HEAL_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 3600.0:
        print(f"warden: {_HEAL_WAIT_ENV}={raw!r} is not a number of seconds from 0.1 to 3600: using {_HEAL_WAIT_S}", file=sys.stderr)
        return _HEAL_WAIT_S
    return value

#: What a collective says when a peer's process ended (gloo, NCCL).
_LOST_PEER = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "remote process exited",
)


def _lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` says that a peer's connection ended."""
    text = str(exc).lower()
    return any(p in text for p in _LOST_PEER)


def _wait_pending(timeout: float) -> bool:
    """Whether a restart request is pending, waiting up to ``timeout`` seconds for one."""
    deadline = time.monotonic() + timeout
    while _native._restart_pending() is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _wait_request_or(timeout: float, begun: Callable[[], Optional[bool]]) -> str:
    """Waits up to ``timeout`` seconds for a restart request (``_REQUESTED``)
    or the peers' next attempt begun (``_JOINED``); ``_NO`` past it.

    The store is asked from a thread of its own: a store whose host is gone
    holds a question up to its client's timeout, and the training thread,
    blocked there in C++, would take a request (a lost host's round heal)
    that late, or be taken for stuck (``warden.heal``'s exit 75)."""
    seen = threading.Event()
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            if begun():
                seen.set()
                return
            stop.wait(_BEGUN_POLL_S)

    threading.Thread(target=ask, name="warden-heal-begun", daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            if _native._restart_pending() is not None:
                return _REQUESTED
            if seen.is_set():
                return _JOINED
            if time.monotonic() >= deadline:
                return _NO
            time.sleep(0.002)
    finally:
        stop.set()


def _shut_heal_sockets() -> None:
    """Shuts down the connections of the attempt's group when
    ``warden.heal`` made it (nothing otherwise: a plain group's sockets are
    not known here). Imported lazily: ``warden.heal`` imports this module."""
    heal = sys.modules.get("warden.heal")
    if heal is not None:
        heal._shut_attempt_sockets()


def _close_groups(exc: BaseException) -> None:
    """Aborts and destroys this rank's process groups now, in the training thread.

    Why: a peer blocked in a collective with this rank returns only when
    this rank's sockets close (gloo's ``abort()`` wakes no waiting op). A
    rank that waits for another host's heal holds its failed group meanwhile;
    a survivor on the lost rank's host blocked on it could not take its own
    restart, and would leave (``warden.heal``'s exit 75) to be healed in turn.
    The group is of no further use: the attempt it served failed, and the
    next one (a restart, or none) makes its own.
    """
    _torch.abort_process_groups(0)
    _release_frames(exc)
    gc.collect()
    _torch.destroy_after_abort()


def _release_frames(exc: BaseException) -> None:
    """Drops the locals of the finished frames in ``exc``'s traceback and its chain.

    Why: a gloo process group closes its sockets only when destroyed, and a
    peer blocked in a collective with this rank (one the abort cannot wake)
    returns only then. The exception keeps its traceback (still printable),
    without the objects of the attempt it ended.
    """
    seen: set = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        try:
            traceback.clear_frames(cur.__traceback__)
        except Exception:
            pass
        cur = cur.__cause__ or cur.__context__


def _nothing() -> None:
    """A guarded call that only takes the pending request (it is due at once)."""


def restartable(
    fn: Optional[_F] = None,
    *,
    max_restarts: Optional[int] = None,
    on_restart: Optional[Callable[[RestartRequested], Any]] = None,
) -> Any:
    """Decorator form of ``run``: ``@warden.restartable`` or
    ``@warden.restartable(max_restarts=3, on_restart=hook)``.

    Each call of the decorated function runs under ``warden.run``, with the
    same arguments and return value.
    """

    def wrap(f: _F) -> _F:
        @functools.wraps(f)
        def wrapper(*a: Any, **k: Any) -> Any:
            return run(f, *a, max_restarts=max_restarts, on_restart=on_restart, **k)

        return wrapper  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


_native._restart_set_exception(RestartRequested)
_native._restart_set_abort(_torch.abort_process_groups)
