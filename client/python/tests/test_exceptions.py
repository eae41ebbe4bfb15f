"""Exception reports and the chained excepthooks, with no agent running.

The reports against a real agent are system tests (tests/exceptions.rs);
here: what is sent (type, message, traceback), that nothing blocks or raises
without an agent, and that the hooks chain to the ones installed before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

import warden
from warden import _excepthook


class OuterError(Exception):
    class Inner(ValueError):
        pass


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - the point of the helper
        return e


def run_script(body: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs ``body`` in a fresh interpreter (no agent: conftest's socket)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_report_without_an_agent_returns_false_at_once() -> None:
    c = warden.connect(job_id="pytest", socket_path=os.environ["WARDEN_SOCKET"])
    exc = raised(RuntimeError("CUDA out of memory"))
    t0 = time.monotonic()
    assert c.report_exception(exc) is False
    assert c.report_exception(exc, uncaught=True, step=3) is False
    assert warden.report_exception(exc) is False
    assert time.monotonic() - t0 < 0.5


def test_report_takes_only_exceptions() -> None:
    c = warden.connect(job_id="pytest", socket_path=os.environ["WARDEN_SOCKET"])
    with pytest.raises(TypeError):
        c.report_exception("not an exception")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        warden.report_exception(42)  # type: ignore[arg-type]


def test_type_names_are_qualified_except_builtins() -> None:
    assert _excepthook.type_name(RuntimeError("x")) == "RuntimeError"
    assert _excepthook.type_name(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert _excepthook.type_name(OuterError.Inner()) == f"{__name__}.OuterError.Inner"
    assert _excepthook.type_name(subprocess.TimeoutExpired("x", 1)) == (
        "subprocess.TimeoutExpired"
    )


def test_describe_gives_message_and_traceback() -> None:
    def failing_function() -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        failing_function()
    except RuntimeError as e:
        kind, message, tb = _excepthook.describe(e)
    assert kind == "RuntimeError"
    assert message == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert tb.startswith("Traceback (most recent call last):")
    assert "in failing_function" in tb
    assert tb.rstrip().endswith("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_describe_survives_a_broken_str() -> None:
    class Broken(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    kind, message, _tb = _excepthook.describe(raised(Broken()))
    assert kind.endswith("Broken")
    assert message.startswith("<unprintable ")


def test_long_tracebacks_keep_their_last_16_kib() -> None:
    # Python folds repeated frames, so the length comes from a chain of
    # exceptions, each with its own frame: the last one is the innermost.
    def step(n: int) -> None:
        try:
            if n == 0:
                raise KeyError("first")
            step(n - 1)
        except Exception as e:
            raise RuntimeError(f"while handling level {n}") from e

    try:
        step(300)
    except RuntimeError as e:
        _kind, _message, tb = _excepthook.describe(e)
    assert len(tb.encode()) <= _excepthook.MAX_TRACEBACK
    assert len(tb.encode()) > _excepthook.MAX_TRACEBACK - 200
    assert tb.rstrip().endswith("RuntimeError: while handling level 300")
    assert "KeyError: 'first'" not in tb  # the outermost part was cut
    # Cut on a character boundary, never inside one.
    assert _excepthook.tail("aé" * 10, 3) in ("é", "aé")
    assert _excepthook.tail("é" * 4, 3) == "é"


def test_hooks_are_installed_once_a_client_exists() -> None:
    warden.connect(job_id="pytest", socket_path=os.environ["WARDEN_SOCKET"])
    assert _excepthook.installed()
    assert sys.excepthook is _excepthook._sys_hook
    assert threading.excepthook is _excepthook._threading_hook
    assert _excepthook.install() is True  # idempotent: no second layer
    assert _excepthook._previous_sys is not _excepthook._sys_hook


def test_a_hook_that_cannot_report_still_calls_the_previous_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []

    class Exploding:
        def report_exception(self, exc: BaseException, *, uncaught: bool) -> bool:
            calls.append(("report", type(exc).__name__, uncaught))
            raise RuntimeError("a broken client")

    monkeypatch.setattr(_excepthook, "clients", lambda: [Exploding()])
    monkeypatch.setattr(_excepthook, "_previous_sys", lambda *a: calls.append(("sys", a[0])))
    monkeypatch.setattr(_excepthook, "_previous_threading", lambda a: calls.append(("thread", a)))
    exc = raised(ValueError("v"))
    _excepthook._sys_hook(ValueError, exc, exc.__traceback__)
    assert calls == [("report", "ValueError", True), ("sys", ValueError)]

    calls.clear()
    t = threading.Thread(target=lambda: (_ for _ in ()).throw(KeyError("k")))
    # Exercised through the real threading machinery: the hook runs in the thread.
    monkeypatch.setattr(threading, "excepthook", _excepthook._threading_hook)
    t.start()
    t.join(10)
    assert calls[0] == ("report", "KeyError", False), calls
    assert calls[1][0] == "thread"

    calls.clear()
    args = threading.ExceptHookArgs([SystemExit, SystemExit(0), None, None])
    _excepthook._threading_hook(args)
    assert calls == [("thread", args)]  # a thread's sys.exit() is not reported


def test_uncaught_exception_chains_to_the_previous_hook_quickly() -> None:
    out = run_script(
        """
        import sys, time
        def mine(t, e, tb):
            print(f"previous hook: {t.__name__}: {e}", file=sys.stderr, flush=True)
        sys.excepthook = mine
        import warden
        warden.connect(job_id="pytest")
        print(f"started {time.monotonic()}", flush=True)
        raise RuntimeError("CUDA out of memory")
        """
    )
    assert out.returncode == 1, out
    assert "previous hook: RuntimeError: CUDA out of memory" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr  # the previous hook replaced the default
    started = float(out.stdout.split()[1])
    assert time.monotonic() - started < 5.0


def test_default_client_installs_the_hooks_and_a_thread_error_chains() -> None:
    out = run_script(
        """
        import sys, threading
        def mine(args):
            print(f"previous thread hook: {args.exc_type.__name__}", file=sys.stderr, flush=True)
        threading.excepthook = mine
        import warden
        assert threading.excepthook is mine
        warden.heartbeat()  # creates the default client
        assert threading.excepthook is not mine
        t = threading.Thread(target=lambda: 1 / 0)
        t.start(); t.join()
        print("main goes on", flush=True)
        """
    )
    assert out.returncode == 0, out
    assert "previous thread hook: ZeroDivisionError" in out.stderr, out.stderr
    assert "main goes on" in out.stdout


def test_warden_excepthook_0_turns_the_hooks_off() -> None:
    out = run_script(
        """
        import sys, threading
        before = (sys.excepthook, threading.excepthook)
        import warden
        warden.connect(job_id="pytest")
        warden.heartbeat()
        assert (sys.excepthook, threading.excepthook) == before
        print("untouched", flush=True)
        """,
        WARDEN_EXCEPTHOOK="0",
    )
    assert out.returncode == 0, out
    assert "untouched" in out.stdout
