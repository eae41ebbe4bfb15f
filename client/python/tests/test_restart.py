"""In-process restarts without an agent: requests injected as the agent's would be.

``warden.inject_restart`` goes through the same path as a request from the
agent (the Rust client's callback, the resender thread, the signal and the
asynchronous exception, the native catch in ``warden.run``), only the source
differs. Every test leaves nothing pending.
"""

from __future__ import annotations

import gc
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

import warden
from warden import _native, _restart

_seqs = itertools.count(1000)


def next_seq() -> int:
    return next(_seqs)


def inject_later(delay: float, seq: int, count: int = 1, reason: str = "test") -> list[float]:
    """Injects a request after ``delay`` seconds; returns [when it was injected]."""
    at: list[float] = []

    def fire() -> None:
        at.append(time.monotonic())
        warden.inject_restart(seq, restart_count=count, reason=reason, incident_id="inc-test")

    threading.Timer(delay, fire).start()
    return at


@pytest.fixture(autouse=True)
def nothing_pending() -> Any:
    yield
    assert _native._restart_pending() is None, "a test left a restart request pending"


def test_without_a_request_run_is_a_plain_call() -> None:
    def train(a: int, b: int = 0) -> tuple[int, int, int]:
        return a, b, warden.restart_count()

    base = warden.restart_count()
    assert warden.run(train, 1, b=2) == (1, 2, base)


def test_a_blocking_sleep_in_the_main_thread_is_interrupted_at_once() -> None:
    assert threading.current_thread() is threading.main_thread()
    seq = next_seq()
    seen: list[Any] = []
    injected: list[list[float]] = []
    interrupted: list[float] = []

    def train() -> int:
        if not seen:
            seen.append(("start", warden.restart_count()))
            injected.append(inject_later(0.1, seq, count=1, reason="rank 1 hung"))
            try:
                time.sleep(30)
            except BaseException:
                interrupted.append(time.monotonic())
                raise
            raise AssertionError("the sleep was not interrupted")
        return warden.restart_count()

    def hook(exc: warden.RestartRequested) -> None:
        seen.append((exc.seq, exc.restart_count, exc.reason, exc.incident_id, time.monotonic()))

    t0 = time.monotonic()
    count = warden.run(train, on_restart=hook)
    assert time.monotonic() - t0 < 5
    assert seen[1][:4] == (seq, 1, "rank 1 hung", "inc-test")
    # The interruption itself, from the request to the raise in the sleep.
    # Not to the hook: before it, ``run`` tears the attempt down
    # (``gc.collect()``, whose time grows with the process's heap: 0.3 s a
    # call with Lightning and Transformers imported, which the integration
    # tests before this one do; CI measured 1.05 s to the hook).
    latency = interrupted[0] - injected[0][0]
    assert latency < 0.5, f"{latency * 1000:.1f} ms from the request to the raise"
    assert seen[1][4] >= interrupted[0]
    assert count == max(1, seen[0][1] + 1)
    signals, _ = _native._restart_deliveries()
    assert signals >= 1, "the blocking call was interrupted by the signal"


def test_a_busy_loop_in_another_thread_gets_the_asynchronous_exception() -> None:
    seq = next_seq()
    out: list[Any] = []

    def train() -> str:
        if not out:
            out.append("first")
            inject_later(0.05, seq)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                sum(range(100))
            return "never interrupted"
        return "second"

    th = threading.Thread(target=lambda: out.append(warden.run(train)))
    th.start()
    th.join(10)
    assert not th.is_alive()
    assert out == ["first", "second"]


def test_except_exception_does_not_swallow_it_and_a_swallowed_one_comes_back() -> None:
    seq = next_seq()
    caught: list[str] = []

    def train() -> int:
        if caught:
            return len(caught)
        inject_later(0.05, seq)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                try:
                    time.sleep(0.01)
                except Exception:  # noqa: BLE001 - user code that catches too much
                    caught.append("Exception")
            except BaseException as e:  # noqa: BLE001 - and code that swallows everything
                assert isinstance(e, warden.RestartRequested)
                caught.append("BaseException")
                if caught.count("BaseException") == 3:
                    raise
        return -1

    t0 = time.monotonic()
    assert warden.run(train) == 3
    assert caught == ["BaseException"] * 3
    # Resent about every 100 ms until warden.run caught it.
    assert 0.15 < time.monotonic() - t0 < 5


def test_outside_run_nothing_is_raised_and_run_starts_with_the_restart() -> None:
    seq = next_seq()
    before = warden.restart_count()
    assert warden.inject_restart(seq, restart_count=before + 5, reason="while importing")
    time.sleep(0.3)  # nothing raises here: no warden.run
    assert _native._restart_pending() == {
        "seq": seq,
        "restart_count": before + 5,
        "reason": "while importing",
        "incident_id": "",
    }
    assert warden.default_client().restart_pending()["seq"] == seq  # type: ignore[index]
    calls: list[int] = []
    assert warden.run(lambda: calls.append(warden.restart_count()) or "ok") == "ok"
    # The function was not started twice: the pending request is acknowledged
    # at once and the first attempt runs with its count.
    assert calls == [before + 5]
    assert warden.default_client().restart_pending() is None
    assert not warden.inject_restart(seq), "a request is new only once"


def test_max_restarts_lets_the_exception_out() -> None:
    seq = next_seq()

    def train() -> None:
        inject_later(0.02, seq)
        time.sleep(30)

    with pytest.raises(warden.RestartRequested) as info:
        warden.run(train, max_restarts=0)
    assert info.value.seq == seq
    # Not acknowledged, but never raised again either.
    assert _native._restart_pending() is not None
    assert _native._restart_ack() is not None


def test_a_caught_request_counts_as_caught_until_it_is_acknowledged() -> None:
    """``_restart_pending_caught``: False for a request not raised yet, True
    from ``warden.run``'s catch to its acknowledgement (its teardown, where
    it collects the interrupted frames), False once acknowledged. What
    ``warden.heal``'s ``_Stuck`` asks, so that a thread tearing its attempt
    down is never taken for one blocked in a collective."""
    seq = next_seq()
    armed: list[bool] = []
    seen: list[tuple[bool, bool]] = []

    def during_gc(phase: str, info: dict) -> None:
        if phase == "start" and armed:
            seen.append((_native._restart_pending() is not None, _native._restart_pending_caught()))

    calls: list[int] = []

    def train() -> str:
        calls.append(warden.restart_count())
        if len(calls) == 1:
            warden.inject_restart(seq, restart_count=warden.restart_count() + 1, reason="test")
            assert _native._restart_pending() is not None
            assert not _native._restart_pending_caught()
            armed.append(True)
            time.sleep(30)
        return "ok"

    gc.callbacks.append(during_gc)
    try:
        assert warden.run(train) == "ok"
    finally:
        gc.callbacks.remove(during_gc)
    assert len(calls) == 2
    assert (True, True) in seen, seen
    assert _native._restart_pending() is None
    assert not _native._restart_pending_caught()


#: A worker with ``warden.heal``'s watchdog (``_Stuck``, 0.2 s) whose restart
#: teardown, after ``warden.run`` caught the request, spends 1.5 s off the
#: CPU (a sleep in a collection, as a teardown waiting its turn on a loaded
#: host): it must run its next attempt, not leave with exit 75.
_CAUGHT_OFF_CPU = """
import gc, sys, time
import warden
from warden import _native, heal

class Holder:
    _updating = False
    rank = 0

holder = Holder()
heal._Stuck(holder, 0.2).start()
slept = []

def during_gc(phase, info):
    if phase == "start" and not slept and _native._restart_pending_caught():
        slept.append(True)
        time.sleep(1.5)

gc.callbacks.append(during_gc)
calls = []

def train():
    calls.append(warden.restart_count())
    if len(calls) == 1:
        warden.inject_restart(7, restart_count=1, reason="test")
        time.sleep(30)
    return "ok"

print(warden.run(train), len(calls), bool(slept), flush=True)
"""


def test_the_stuck_watchdog_leaves_a_caught_request_to_its_teardown(tmp_path: Any) -> None:
    env = dict(os.environ)
    env.update(WARDEN_HEAL_FILE=str(tmp_path / "heal"), WARDEN_HEAL_STUCK_S="0.2")
    for var in ("WARDEN_SOCKET", "WARDEN_JOB_ID", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    done = subprocess.run(
        [sys.executable, "-c", _CAUGHT_OFF_CPU], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.split() == ["ok", "2", "True"], done.stdout + done.stderr
    assert "leaving with exit 75" not in done.stderr, done.stderr


def open_sections() -> list[str]:
    return [name for name, _ in warden.default_client().snapshot()["open_sections"]]


def test_a_lost_peers_heal_is_awaited_in_the_heal_wait_section_until_the_next_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``warden.heal`` declared, a lost peer's error waits for its heal
    in ``heal_wait``, not between steps (``idle``, where the agent called the
    waiting survivor hung: issue 31), through the peers' next attempt joined
    without a request (``_JOINED``), and no longer once it runs."""
    seen_waiting: list[list[str]] = []

    def begun() -> bool:
        seen_waiting.append(open_sections())
        return len(seen_waiting) >= 3

    monkeypatch.setattr(_restart, "_heal_declared", True)
    monkeypatch.setattr(_restart, "_next_attempt_begun", begun)
    attempts: list[list[str]] = []

    def train() -> int:
        attempts.append(open_sections())
        if len(attempts) == 1:
            with warden.step(1):
                with warden.section("forward"):
                    raise RuntimeError("[gloo] Connection closed by peer [127.0.0.3]:1234")
        return warden.restart_count()

    before = warden.restart_count()
    assert warden.run(train) == before + 1
    assert attempts == [[], []], "the next attempt starts with no section open"
    # The first call is the check that the store can be asked at all.
    assert seen_waiting[1:] and all(s == ["heal_wait"] for s in seen_waiting[1:]), seen_waiting
    snap = warden.default_client().snapshot()
    assert (snap["depth"], snap["misuse"]) == (0, 0)


def test_a_lost_peers_error_no_heal_answers_leaves_the_heal_wait_section(monkeypatch: pytest.MonkeyPatch) -> None:
    """No request and no next attempt within the wait: the error stands,
    and the ``heal_wait`` section is closed behind it."""
    monkeypatch.setattr(_restart, "_heal_declared", True)
    monkeypatch.setattr(_restart, "_next_attempt_begun", lambda: False)
    monkeypatch.setattr(_restart, "_PEER_GRACE_S", 0.05)
    monkeypatch.setenv(_restart._HEAL_WAIT_ENV, "0.2")
    seen: list[list[str]] = []

    def train() -> None:
        raise RuntimeError("Connection reset by peer")

    real_wait = _restart._wait_request_or

    def waiting(timeout: float, begun: Callable[[], Any]) -> str:
        seen.append(open_sections())
        return real_wait(timeout, begun)

    monkeypatch.setattr(_restart, "_wait_request_or", waiting)
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        warden.run(train)
    assert seen == [["heal_wait"]]
    assert open_sections() == []


def test_a_failing_restart_hook_after_a_lost_peer_leaves_no_section_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_restart`` raising after a lost peer's heal was joined: its error
    is the program's, and ``heal_wait`` does not outlive it (every later gap
    between steps would be judged as a heal awaited)."""
    monkeypatch.setattr(_restart, "_heal_declared", True)
    monkeypatch.setattr(_restart, "_next_attempt_begun", lambda: True)
    hooked: list[list[str]] = []

    def hook(e: warden.RestartRequested) -> None:
        hooked.append(open_sections())
        raise ValueError("teardown failed")

    def train() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(ValueError, match="teardown failed"):
        warden.run(train, on_restart=hook)
    assert hooked == [["heal_wait"]]
    assert open_sections() == []


def test_other_exceptions_and_results_pass_through() -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        warden.run(boom)
    assert warden.run(lambda *a, **k: (a, k), 1, 2, z=3) == ((1, 2), {"z": 3})


def test_the_decorator_keeps_the_signature_and_restarts() -> None:
    seq = next_seq()
    hooks: list[int] = []

    @warden.restartable(max_restarts=2, on_restart=lambda e: hooks.append(e.seq))
    def train(x: int, *, y: int) -> int:
        """Doc."""
        if not hooks:
            inject_later(0.02, seq)
            time.sleep(30)
        return x + y

    assert train.__name__ == "train" and train.__doc__ == "Doc."
    assert train(1, y=2) == 3
    assert hooks == [seq]

    @warden.restartable
    def plain() -> str:
        return "plain"

    assert plain() == "plain"


def test_a_request_after_run_returned_is_not_raised_in_the_code_that_follows() -> None:
    seq = next_seq()
    assert warden.run(lambda: "done") == "done"
    inject_later(0.02, seq)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # the main thread, busy, outside warden.run
        sum(range(100))
    time.sleep(0.1)  # blocking, with the restart signal's handler installed
    # Not caught by any warden.run: nothing to acknowledge yet.
    assert _native._restart_ack() is None
    # The next warden.run takes it at once (acknowledged, not raised).
    calls: list[int] = []
    assert warden.run(lambda: calls.append(1) or "again") == "again"
    assert calls == [1]


def test_the_exception_describes_itself() -> None:
    e = warden.RestartRequested(seq=4, restart_count=2, reason="why", incident_id="inc-1")
    assert (e.seq, e.restart_count, e.reason, e.incident_id) == (4, 2, "why", "inc-1")
    assert "restart 2" in str(e) and "why" in str(e)
    assert isinstance(e, BaseException) and not isinstance(e, Exception)
    plain = warden.RestartRequested("custom")
    assert str(plain) == "custom" and plain.seq == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, int(signal.SIGUSR1)),
        ("", int(signal.SIGUSR1)),
        ("off", 0),
        ("0", 0),
        ("SIGUSR2", int(signal.SIGUSR2)),
        ("usr1", int(signal.SIGUSR1)),
        ("12", 12),
        ("nonsense", 0),
        ("999", 0),
    ],
)
def test_the_restart_signal_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: int
) -> None:
    if value is None:
        monkeypatch.delenv("WARDEN_RESTART_SIGNAL", raising=False)
    else:
        monkeypatch.setenv("WARDEN_RESTART_SIGNAL", value)
    assert _restart._wanted_signal() == expected


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, 0),
        ("", 0),
        ("3", 3),
        (" 7 ", 7),
        ("-1", 0),
        ("nonsense", 0),
        (str(2**31), 0),
    ],
)
def test_the_replacement_count_from_the_environment(value: str | None, expected: int) -> None:
    # What `warden run` sets in a rank it started to replace a frozen one.
    assert _restart._initial_count(value) == expected


def test_a_replacement_starts_at_its_peers_count_and_grows_from_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saved = _restart._count
    try:
        monkeypatch.setenv("WARDEN_IN_PROCESS_RESTART_COUNT", "4")
        _restart._count = None
        assert warden.restart_count() == 4
        seen: list[int] = []
        seq = next_seq()

        def train() -> None:
            seen.append(warden.restart_count())
            if len(seen) == 1:
                warden.inject_restart(seq, restart_count=2, reason="test", incident_id="")
                time.sleep(10)

        warden.run(train)
        # One more than its own, above the (lower) count the request carried.
        assert seen == [4, 5]
    finally:
        _restart._count = saved


def test_the_handler_stays_installed_and_raises_only_when_due() -> None:
    warden.run(lambda: None)
    handler: Callable[..., Any] = signal.getsignal(signal.SIGUSR1)  # type: ignore[assignment]
    assert handler is _restart._on_signal
    # A stray signal with nothing due is harmless.
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
