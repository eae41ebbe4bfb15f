"""Heartbeats, training steps and sections, reported to the local warden agent.

Every call is a few atomic stores into shared memory; nothing here blocks on,
or raises because of, the agent. With no agent running (or after losing it)
the calls write into a private slot while a background thread keeps trying
to register, so it is always safe to leave the instrumentation in.

    import warden

    fwd = warden.section("forward")          # resolve once, reuse
    for n, batch in enumerate(loader):
        with warden.step(n):
            with fwd:
                loss = model(batch)
            with warden.section("backward"):
                loss.backward()

    @warden.section("checkpoint")
    def save(): ...

The module-level functions use a default client configured from the
environment (WARDEN_SOCKET, WARDEN_JOB_ID or TORCHELASTIC_RUN_ID, RANK,
LOCAL_RANK, WORLD_SIZE); ``warden.connect(...)`` makes an explicit one.
Step and section calls belong to one thread (the training loop);
``heartbeat`` may be called from any thread.

Exceptions: once a client exists, an uncaught exception is reported to the
agent before the traceback is printed (a chained ``sys.excepthook`` and
``threading.excepthook``; ``WARDEN_EXCEPTHOOK=0`` turns them off), and
``warden.report_exception(exc)`` reports one by hand. Either takes at most
about a second, and returns at once with no agent.

In-process restarts: run the training function under ``warden.run`` (or
decorate it with ``@warden.restartable``). When the agent asks the job to
restart in process, ``warden.RestartRequested`` is raised in it, even in a
blocking call; ``warden.run`` acknowledges and calls it again, and it
restores from its local checkpoint when ``warden.restart_count()`` is not 0:

    @warden.restartable
    def train():
        start = restore_local_checkpoint() if warden.restart_count() else 0
        for n in range(start, steps):
            with warden.step(n):
                ...

    train()

Notices of a coming stop (a preemption, host maintenance, the scheduler's
SIGTERM to ``warden run --term-grace``): ``warden.notice()`` returns a
``Notice`` once the agent raised one for this rank's job or host; save at that
step boundary and raise ``warden.Preempted`` (exit 85, "requeue me"), or let
``warden.checkpoint.save_on_notice`` do both.
"""

from __future__ import annotations

import atexit
import functools
import inspect
from typing import Any, Callable, TypeVar

from ._stackdump import StackDumps as _StackDumps

from . import _excepthook, _native, _restart
from ._restart import RestartRequested, restart_count, restartable, run
from ._notice import EXIT_PREEMPTED, Notice, Preempted, notice
from ._torch import register_process_group
from ._native import (
    SLOT_LAYOUT_VERSION,
    _close_default,
    Client,
    Section,
    Step,
    heartbeat,
    is_connected,
    report_values,
    section,
    step,
    step_begin,
    step_end,
)

__all__ = [
    "EXIT_PREEMPTED",
    "SLOT_LAYOUT_VERSION",
    "Client",
    "Notice",
    "Preempted",
    "RestartRequested",
    "Section",
    "Step",
    "connect",
    "default_client",
    "heartbeat",
    "inject_restart",
    "is_connected",
    "notice",
    "report_exception",
    "report_values",
    "restart_count",
    "register_process_group",
    "restartable",
    "run",
    "section",
    "step",
    "step_begin",
    "step_end",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# A clean exit deregisters the default client (a crash is seen by its pid).
atexit.register(_close_default)

# Before any client registers: the agent may send this signal to a hung
# rank, so the handler must exist first (see warden/_stackdump.py).
_stack_dumps = _StackDumps.install()
_native._set_stack_dump_signal(_stack_dumps.signal)


def connect(
    job_id: str | None = None,
    global_rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    socket_path: str | None = None,
    connect_timeout: float | None = None,
    devices: list[str] | None = None,
    exception_report_timeout: float | None = None,
) -> Client:
    """Connects with explicit settings (``None``: from the environment).

    ``devices`` names the accelerators the rank drives (default:
    ``WARDEN_DEVICES``, else this rank's entry of ``CUDA_VISIBLE_DEVICES``;
    see docs/client.md). Installs the exception hooks (once).

    Never raises because the agent is absent: the client retries in the
    background. Raises ``ValueError`` only for invalid arguments.
    """
    client = _native.connect(
        job_id=job_id,
        global_rank=global_rank,
        local_rank=local_rank,
        world_size=world_size,
        socket_path=socket_path,
        connect_timeout=connect_timeout,
        devices=devices,
        exception_report_timeout=exception_report_timeout,
    )
    _stack_dumps.track(client)
    _excepthook.track(client)
    _excepthook.install()
    return client


def report_exception(exc: BaseException, *, uncaught: bool = False) -> bool:
    """Reports ``exc`` to the agent (a ``rank.exception`` event); True if it took it.

    Goes through the clients that exist (the default one is created if none
    does). The type is ``module.QualName`` (``RuntimeError`` for builtins),
    the message ``str(exc)``, the traceback its last 16 KiB. Never raises
    for agent trouble; at most about a second, at once with no agent.
    ``uncaught=True``: the process is about to exit of it (the client then
    leaves the exit for the agent to see instead of deregistering).
    """
    if not isinstance(exc, BaseException):
        raise TypeError(f"report_exception() takes an exception, not {type(exc).__name__}")
    if not _excepthook.clients():
        _native.default_client()
    return _excepthook.report(exc, uncaught=uncaught)


def default_client() -> Client:
    """The module-level client, created from the environment on first use."""
    return _native.default_client()


def inject_restart(
    seq: int, restart_count: int = 1, reason: str = "", incident_id: str = ""
) -> bool:
    """Makes a restart request pending on the default client, as if the agent
    had sent it: a restart drill, or a test of the restart path without an
    agent. ``warden.run`` raises ``RestartRequested`` in its training
    function and runs it again. False when ``seq`` was seen already.
    """
    return _native.default_client().inject_restart(
        seq, restart_count=restart_count, reason=reason, incident_id=incident_id
    )


def _decorate(sec: Section, func: _F) -> _F:
    """Wraps ``func`` so each call runs inside ``sec`` (used by ``Section.__call__``)."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            with sec:
                return await func(*args, **kwargs)

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with sec:
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
