"""warden.async_checkpoint: saves that hold the step only for the copy.

Against a real agent (the session's wardend) and real torch: a rank saves
every 4 steps while it goes on training and changes its parameters right
after each save; the newest step comes back byte for byte as it was when
``save`` returned. Without an agent, the background failure is raised by
the next call and nothing is committed.
"""

from __future__ import annotations

import os

import pytest

from conftest import JOBS, NO_NUMPY, require_framework, run_ranks
from wardend import Wardend


def test_a_snapshot_is_what_comes_back_though_training_went_on(wardend: Wardend) -> None:
    require_framework("torch")
    (r,) = run_ranks(wardend, "async-save", "async_save_job.py", [])
    check_saved(r)


def test_an_async_save_needs_no_numpy(wardend: Wardend) -> None:
    """torch does not install numpy; the background write took the buffer's
    bytes through ``Tensor.numpy()`` and failed every save without it."""
    require_framework("torch")
    env = {"PYTHONPATH": os.pathsep.join([str(JOBS), str(NO_NUMPY)])}
    (r,) = run_ranks(wardend, "async-save-no-numpy", "async_save_job.py", [], env=env)
    assert r["numpy"] is False
    check_saved(r)


def check_saved(r: dict) -> None:
    """What async_save_job.py must have seen: every save committed, the
    newest one back byte for byte."""
    assert r["restored_step"] == 12
    assert r["committed"] == 3
    # Prepared after the first step: no save made its buffer on the training thread.
    assert r["grown_in_save"] == 0
    assert all(r["exact"].values()), r["exact"]
    assert r["meta"] == {"step": 12, "note": "hello", "sizes": [1, 2, 3]}
    assert r["optim_keys"] == ["0", "1", "2", "3"]
    assert r["optim_step"] == 12.0
    assert len(r["stalls"]) == 3 and all(s > 0 for s in r["stalls"])
    # The last save's background was timed; a GPU's copy only where the state is on one.
    write_s, commit_s, device_s = r["background"]
    assert write_s > 0 and commit_s > 0
    assert (device_s > 0) == (r["device"] == "cuda")


def test_a_failed_background_save_is_raised_by_the_next_call() -> None:
    require_framework("torch")
    import torch

    import warden.checkpoint as ckpt
    from warden.async_checkpoint import AsyncCheckpointer

    errors = []
    saver = AsyncCheckpointer(on_error=errors.append)
    # No agent here (conftest): the snapshot is taken, the write fails.
    saver.save(1, {"w": torch.ones(4)})
    with pytest.raises(ckpt.CheckpointError, match="an earlier async save failed"):
        saver.wait()
    assert len(errors) == 1
    assert saver.committed == 0
    # Reported once; the saver goes on.
    saver.wait()
    saver.close()
    with pytest.raises(ckpt.CheckpointError, match="closed"):
        saver.save(2, {"w": torch.ones(4)})


def test_a_save_waits_for_a_free_buffer_and_the_wait_is_its_stall() -> None:
    """Back pressure (issue 32): with ``max_in_flight`` buffers all in
    flight, the next ``save`` waits on the training thread until the
    background lets one go, and that wait is counted in its stall."""
    require_framework("torch")
    import queue
    import threading
    import time

    import torch

    from warden.async_checkpoint import AsyncCheckpointer

    saver = AsyncCheckpointer(max_in_flight=1)
    writing, release = threading.Event(), threading.Event()

    def held_write(slot) -> str:  # the background's write, held until released
        writing.set()
        assert release.wait(60), "never released"
        return f"step-{slot.step}"

    saver._write = held_write  # type: ignore[method-assign]
    state = {"w": torch.ones(1024)}
    saver.save(1, state)
    assert writing.wait(60), "the first save never reached its write"

    # The one buffer is in flight: mark when the next save starts waiting.
    entered: list[float] = []

    class Marked(queue.Queue):
        def get(self, *args, **kwargs):
            entered.append(time.perf_counter())
            return super().get(*args, **kwargs)

    saver._free = Marked()
    returned: list[float] = []
    second = threading.Thread(
        target=lambda: (saver.save(2, state), returned.append(time.perf_counter())), daemon=True
    )
    second.start()
    try:
        deadline = time.monotonic() + 60
        while not entered and time.monotonic() < deadline:
            second.join(0.01)
        assert entered, "the second save never asked for a buffer"
        assert not returned, "the second save returned with no buffer free"
        released_at = time.perf_counter()
    finally:
        release.set()  # a failed check leaves no thread blocked behind it
    second.join(60)
    assert returned and returned[0] >= released_at, "the second save returned before a buffer was free"
    assert saver.last_stall_s >= released_at - entered[0], (saver.last_stall_s, released_at - entered[0])
    saver.wait()
    assert saver.committed == 2
    saver.close()


def test_max_in_flight_must_be_positive() -> None:
    require_framework("torch")
    from warden.async_checkpoint import AsyncCheckpointer

    with pytest.raises(ValueError, match="max_in_flight"):
        AsyncCheckpointer(max_in_flight=0)


def test_prepare_makes_the_buffer_ahead_and_never_replaces_one_in_use() -> None:
    require_framework("torch")
    import torch

    import warden.checkpoint as ckpt
    from warden.async_checkpoint import AsyncCheckpointer

    small = {"w": torch.ones(1 << 18)}  # 1 MiB
    large = {"w": torch.ones(1 << 18), "v": torch.ones(1 << 20)}  # 5 MiB

    # Without prepare, the first save makes its buffer on the training thread.
    with AsyncCheckpointer(on_error=lambda e: None) as plain:
        plain.save(1, small)
        assert plain.grown_in_save == 1
        with pytest.raises(ckpt.CheckpointError):
            plain.wait()  # no agent here: the write fails (the snapshot was taken)

    saver = AsyncCheckpointer(on_error=lambda e: None)
    saver.prepare(small)
    assert saver.prepared(timeout=60)
    saver.save(1, small)
    assert saver.grown_in_save == 0
    slot = saver._slots[0]
    in_use = slot.buffer
    # Asked for a larger state while a save may still read the buffer: the
    # buffer in use stays; the larger one waits as the spare.
    saver.prepare(large)
    assert saver.prepared(timeout=60)
    assert slot.buffer is in_use
    assert slot.spare is not None and slot.spare[0].numel() >= 5 << 20
    with pytest.raises(ckpt.CheckpointError):
        saver.wait()
    saver.save(2, large)
    assert saver.grown_in_save == 0
    assert slot.buffer is not in_use and slot.spare is None
    with pytest.raises(ckpt.CheckpointError):
        saver.wait()
    # A state past what was prepared: its save makes its own buffer.
    saver.save(3, {"w": torch.ones(4 << 20)})
    assert saver.grown_in_save == 1
    with pytest.raises(ckpt.CheckpointError):
        saver.wait()
    saver.close()
    with pytest.raises(ckpt.CheckpointError, match="closed"):
        saver.prepare(small)


def test_a_closed_saver_lets_go_of_a_buffer_made_for_a_save_that_never_came() -> None:
    require_framework("torch")
    import torch

    from warden.async_checkpoint import AsyncCheckpointer

    saver = AsyncCheckpointer(max_in_flight=2)
    saver.prepare({"w": torch.ones(1 << 18)})
    assert all(slot.spare is not None or slot.prefault is not None for slot in saver._slots)
    # Asked again for the same state: nothing new is made.
    made = [slot.prefault for slot in saver._slots]
    saver.prepare({"w": torch.ones(1 << 18)})
    assert [slot.prefault for slot in saver._slots] == made
    saver.close()
    assert all(slot.spare is None and slot.prefault is None for slot in saver._slots)


def test_headroom_stays_within_the_pinned_allocators_power_of_two() -> None:
    from warden.async_checkpoint import headroom

    mib = 1 << 20
    assert headroom(64 * mib) == 65 * mib  # 1/64 more
    assert headroom(10) == 10 + mib  # at least 1 MiB more
    # Pinned: torch rounds the block up to a power of two; the headroom
    # stays under it rather than double the page-locked memory.
    assert headroom(64 * mib, pin=True) == 64 * mib
    assert headroom(63 * mib, pin=True) == 64 * mib
    assert headroom(40 * mib, pin=True) == 41 * mib


def test_optimizer_state_is_made_at_adams_first_step() -> None:
    require_framework("torch")
    import torch

    from warden.async_checkpoint import optimizer_state_made

    model = torch.nn.Linear(4, 2)
    frozen = torch.nn.Linear(4, 2).requires_grad_(False)
    opt = torch.optim.Adam(list(model.parameters()) + list(frozen.parameters()))
    assert not optimizer_state_made([opt])
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    # The frozen layer never gets state, and is not waited for.
    assert optimizer_state_made([opt])


def test_the_snapshot_copy_is_exact_whatever_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native copy splits the bytes evenly over its threads, cutting
    tensors where a thread's share ends: odd sizes, a tensor larger than a
    share, empty and non-contiguous ones all land where ``layout`` says."""
    require_framework("torch")
    import torch

    from warden import async_checkpoint as ac

    gen = torch.Generator().manual_seed(7)
    tensors = [
        torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)
        for n in (1, 3, 9 << 20, 0, 4097, (5 << 20) + 11, 63, 65)
    ]
    tensors.append(torch.randn(700, 900, generator=gen).t())  # not contiguous
    tensors.append(torch.arange(1000, dtype=torch.float64))
    # Enough bytes (about 66 MiB) for 16 threads of at least 4 MiB each.
    tensors += [torch.randint(0, 255, ((3 << 20) + 5,), dtype=torch.uint8, generator=gen) for _ in range(17)]
    for threads in ("1", "2", "3", "4", "16"):
        monkeypatch.setenv(ac.COPY_THREADS_ENV, threads)
        slot = ac._Slot()
        ac.copy_into(slot, tensors, False, torch)
        for t, m in zip(tensors, slot.metas):
            assert torch.equal(ac.view_of(slot, m, torch), t), (threads, m)
    # Contiguous copies past the cap are copied early and let go: the same bytes.
    monkeypatch.setattr(ac, "_KEEP_BYTES", 1)
    tensors += [torch.randn(300, 500, generator=gen).t() for _ in range(3)]
    slot = ac._Slot()
    ac.copy_into(slot, tensors, False, torch)
    for t, m in zip(tensors, slot.metas):
        assert torch.equal(ac.view_of(slot, m, torch), t), m


def test_a_copy_region_outside_the_buffer_is_refused() -> None:
    require_framework("torch")
    import torch

    from warden import _native

    src = torch.ones(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit the 16-byte buffer"):
        _native._copy_regions(dst.data_ptr(), 16, [(src.data_ptr(), 8, 9)], 2)
    with pytest.raises(ValueError, match="does not fit"):
        _native._copy_regions(dst.data_ptr(), 16, [(src.data_ptr(), 2**64 - 1, 2)], 1)
    assert int(dst.sum()) == 0


def test_copy_threads_come_from_the_environment_or_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from warden import async_checkpoint as ac

    monkeypatch.setenv(ac.COPY_THREADS_ENV, "3")
    assert ac.copy_threads() == 3
    monkeypatch.setenv(ac.COPY_THREADS_ENV, "zero")
    with pytest.warns(UserWarning, match="WARDEN_SAVE_COPY_THREADS='zero'"):
        n = ac.copy_threads()
    assert 1 <= n <= 4
    monkeypatch.delenv(ac.COPY_THREADS_ENV)
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert ac.copy_threads() == max(1, min(4, cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))
    # The machine's cores shared among the node's ranks; a process bound to
    # a part of them (a CI runner's cpuset) has that part as its share.
    assert ac.copy_threads() == (1 if cores == os.cpu_count() else min(4, cores))


def test_a_state_without_a_byte_to_copy_gets_no_buffer() -> None:
    """A rank that saves an empty state (Lightning's whole route on ranks
    other than 0) made a 1-byte buffer at its first save, and ``prepare``
    a 1 MiB one: neither is needed."""
    require_framework("torch")
    import torch

    from warden import async_checkpoint as ac

    slot = ac._Slot()
    assert ac.prefault(slot, 0, False, torch) is None
    ac.copy_into(slot, [], False, torch)
    ac.copy_into(slot, [torch.empty(0), torch.ones(0, 3)], False, torch)
    assert slot.buffer is None and slot.grown == 0 and slot.used == 0
    assert [tuple(ac.view_of(slot, m, torch).shape) for m in slot.metas] == [(0,), (0, 3)]
