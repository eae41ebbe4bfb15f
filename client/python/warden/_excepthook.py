"""Exception reports: the exception that ends a rank, told to the agent.

When a rank dies of a Python exception, the agent would otherwise see only
exit code 1. Reported first, the exception (its type, message and
traceback) arrives as a ``rank.exception`` event, and the crash that follows
is diagnosed with it: a CUDA out-of-memory error is the user's, an ECC error
surfacing as a RuntimeError is the hardware's.

When the package creates a client (``warden.connect()``, or the default
client's first use), it installs, once, a chained ``sys.excepthook`` and
``threading.excepthook``. An uncaught exception of the main thread is
reported with ``uncaught=True`` (the process is about to exit: the client
then leaves its registration for the agent to see the exit instead of
deregistering from the atexit handler); one that ends another thread with
``uncaught=False`` (the process goes on). Then the previous hook runs, so
the traceback is printed as before. ``WARDEN_EXCEPTHOOK=0`` turns this off.

The hooks never raise and never hang: reports go through the clients that
exist (never creating one), each bounded to about a second by the native
client, and with no agent they return at once without formatting anything.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
import weakref
from types import TracebackType
from typing import Any, Callable, Optional

# Most bytes of a traceback sent: its end, where the innermost frames say
# what failed (the agent keeps as much).
MAX_TRACEBACK = 16 * 1024

_lock = threading.Lock()
_installed = False
_previous_sys: Optional[Callable[..., Any]] = None
_previous_threading: Optional[Callable[..., Any]] = None
# Explicit clients (warden.connect), followed without being kept alive.
_clients: "weakref.WeakSet[Any]" = weakref.WeakSet()


def enabled() -> bool:
    """False when ``WARDEN_EXCEPTHOOK`` turns the hooks off (0, false, no, off)."""
    raw = os.environ.get("WARDEN_EXCEPTHOOK", "1").strip().lower()
    return raw not in ("0", "false", "no", "off")


def type_name(exc: BaseException) -> str:
    """``module.QualName``, or just ``QualName`` for builtins (``RuntimeError``)."""
    cls = type(exc)
    qualname = getattr(cls, "__qualname__", None) or cls.__name__
    module = getattr(cls, "__module__", None)
    if not module or module == "builtins":
        return str(qualname)
    return f"{module}.{qualname}"


def tail(text: str, limit: int = MAX_TRACEBACK) -> str:
    """The last ``limit`` bytes of ``text`` (UTF-8), cut on a character boundary."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[-limit:].decode("utf-8", "ignore")


def describe(exc: BaseException) -> tuple[str, str, str]:
    """(type, message, traceback) of ``exc``; never raises for a bad ``__str__``."""
    name = type_name(exc)
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not lose the report
        message = f"<unprintable {name} object>"
    try:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        formatted = "".join(lines)
    except Exception:
        formatted = ""
    return name, message, tail(formatted)


def track(client: Any) -> None:
    """Reports go through ``client`` too (the default client is always included)."""
    try:
        _clients.add(client)
    except TypeError:  # not weak-referenceable: nothing to follow
        pass


def clients() -> list[Any]:
    """The clients that exist: the default one (if created), then explicit ones."""
    from . import _native

    found: list[Any] = []
    default = _native._default_client_if_any()
    if default is not None:
        found.append(default)
    for c in list(_clients):
        if all(c is not f for f in found):
            found.append(c)
    return found


def report(exc: BaseException, *, uncaught: bool) -> bool:
    """Reports ``exc`` through every existing client; True if an agent took it."""
    results = [c.report_exception(exc, uncaught=uncaught) for c in clients()]
    return any(results)


def _report_quietly(
    exc: Optional[BaseException], tb: Optional[TracebackType], *, uncaught: bool
) -> None:
    try:
        if not isinstance(exc, BaseException):
            return
        if exc.__traceback__ is None and tb is not None:
            exc = exc.with_traceback(tb)
        for c in clients():
            try:
                c.report_exception(exc, uncaught=uncaught)
            except BaseException:  # noqa: BLE001 - a hook must never raise
                pass
    except BaseException:  # noqa: BLE001 - a hook must never raise
        pass


def _sys_hook(
    exc_type: type[BaseException],
    exc: BaseException,
    tb: Optional[TracebackType],
) -> None:
    # The main thread's uncaught exception ends the process; sys.excepthook
    # called by hand from another thread does not.
    try:
        main = threading.current_thread() is threading.main_thread()
    except BaseException:  # noqa: BLE001
        main = True
    _report_quietly(exc, tb, uncaught=main)
    previous = _previous_sys or sys.__excepthook__
    previous(exc_type, exc, tb)


def _threading_hook(args: Any) -> None:
    exc_type = getattr(args, "exc_type", None)
    # A thread that calls sys.exit() ends quietly; nothing to report.
    if not (isinstance(exc_type, type) and issubclass(exc_type, SystemExit)):
        _report_quietly(
            getattr(args, "exc_value", None),
            getattr(args, "exc_traceback", None),
            uncaught=False,
        )
    previous = _previous_threading
    if previous is not None:
        previous(args)


def install() -> bool:
    """Installs the chained hooks once; False when turned off by the environment."""
    global _installed, _previous_sys, _previous_threading
    with _lock:
        if _installed:
            return True
        if not enabled():
            return False
        _previous_sys = sys.excepthook
        sys.excepthook = _sys_hook
        _previous_threading = threading.excepthook
        threading.excepthook = _threading_hook
        _installed = True
        return True


def installed() -> bool:
    """Whether the hooks were installed in this process."""
    return _installed
