"""The package with no agent running: the default path on a laptop or in CI."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest

import warden


def fresh(**kw: object) -> warden.Client:
    return warden.connect(job_id="pytest", socket_path=os.environ["WARDEN_SOCKET"], **kw)


def test_connect_without_agent_is_quick_and_disconnected() -> None:
    t0 = time.monotonic()
    c = fresh(connect_timeout=5.0)
    assert time.monotonic() - t0 < 2.0
    assert c.is_connected() is False
    status = c.status()
    assert status["connected"] is False
    assert "no-agent.sock" in (status["last_error"] or "")
    c.close()
    c.close()  # idempotent


def test_module_level_default_client_never_raises() -> None:
    warden.heartbeat()
    warden.step_begin(1)
    with warden.section("forward"):
        warden.heartbeat()
    warden.step_end(1)
    assert warden.is_connected() is False
    assert warden.default_client() is warden.default_client()


def test_steps_and_sections_are_recorded_in_the_private_slot() -> None:
    c = fresh()
    fwd = c.section("forward")
    assert (fwd.name, fwd.id) == ("forward", 2)
    attn = c.section("attention")
    assert attn.id >= 8
    assert c.section("attention").id == attn.id
    for n in range(3):
        with c.step(n):
            with fwd:
                with attn:
                    time.sleep(0.001)
            with c.section("backward"):
                pass
    snap = c.snapshot()
    assert snap["steps_completed"] == 3
    assert snap["step_open"] is False
    assert snap["depth"] == 0
    assert snap["misuse"] == 0
    last = snap["recent_steps"][-1]
    assert last["step"] == 2
    assert set(last["sections"]) == {"forward", "attention", "backward"}
    assert last["sections"]["forward"] >= last["sections"]["attention"] >= 1_000_000
    assert last["duration_ns"] >= last["sections"]["forward"]


def test_open_sections_are_visible_while_open() -> None:
    c = fresh()
    c.step_begin(7)
    with c.section("data"):
        snap = c.snapshot()
        assert [name for name, _ in snap["open_sections"]] == ["step", "data"]
        assert snap["step"] == 7 and snap["step_open"] is True
    c.step_end(7)


def test_section_closes_on_exception_and_does_not_swallow_it() -> None:
    c = fresh()
    c.step_begin(1)
    with pytest.raises(ZeroDivisionError):
        with c.section("forward"):
            1 / 0
    assert c.snapshot()["depth"] == 1  # only "step" left
    c.step_end(1)


def test_decorator_sync_and_async() -> None:
    c = fresh()
    sec = c.section("optimizer")

    @sec
    def work(x: int, *, y: int = 1) -> int:
        """Docstring kept."""
        assert [n for n, _ in c.snapshot()["open_sections"]][-1] == "optimizer"
        return x + y

    assert work(1, y=2) == 3
    assert work.__name__ == "work" and work.__doc__ == "Docstring kept."

    @warden.section("checkpoint")
    async def save() -> str:
        return "saved"

    assert asyncio.run(save()) == "saved"
    assert c.snapshot()["depth"] == 0


def test_explicit_ids_and_misuse_never_raise() -> None:
    c = fresh()
    i = c.section_id("my-phase")
    c.section_open(i)
    c.section_close(i)
    c.section_close(12345)  # nothing open: counted, ignored
    c.step_end(99)  # no step open: counted, ignored
    assert c.snapshot()["misuse"] == 2


def test_invalid_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError):
        warden.connect(job_id="x", global_rank=4, world_size=4)
    with pytest.raises(ValueError):
        warden.connect(job_id="")
    with pytest.raises(ValueError):
        warden.connect(connect_timeout=-1.0)


def test_client_as_context_manager() -> None:
    with fresh() as c:
        c.heartbeat()
    c.heartbeat()  # still usable after close


def test_types_are_exported() -> None:
    assert warden.SLOT_LAYOUT_VERSION == 3
    assert isinstance(warden.section("forward"), warden.Section)
    assert isinstance(warden.step(1), warden.Step)
    assert "connected=False" in repr(fresh())


def test_sections_are_cached_per_client() -> None:
    c = fresh()
    assert c.section("forward") is c.section("forward")
    assert warden.section("data") is warden.section("data")
    assert c.section("forward") is not warden.section("forward")


def test_report_values_land_in_the_step_record() -> None:
    c = fresh()
    with c.step(1):
        c.report_values(loss=2.5, grad_norm=float("nan"))
    # Between steps: into the step just ended (a loss read after the step).
    c.report_values(loss=3.0)
    with c.step(2):
        pass
    steps = {r["step"]: r for r in c.snapshot()["recent_steps"]}
    assert steps[1]["loss"] == 3.0
    assert math.isnan(steps[1]["grad_norm"])
    assert steps[2]["loss"] is None and steps[2]["grad_norm"] is None
    warden.report_values(grad_norm=1.0)  # the default client, no agent: a no-op that returns
