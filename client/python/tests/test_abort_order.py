"""The resender's abort of a restart request and the training thread's
teardown of the same attempt, run side by side (``warden._torch``).

The resender aborts the process groups on a thread of its own, before the
request's first delivery, while the training thread may already be tearing
the attempt down (its collective failed when the first group was aborted).
Two orders must not happen: a group added to the aborted list after the
teardown took it (held there, the group stays alive with its sockets open,
and a peer blocked on them waits), and a request the training thread
already took aborting the groups of the attempt after it.

The groups here are process-group objects registered by hand, as a torchft
group is (``warden.register_process_group``), whose ``abort`` blocks until
the test lets it go: the slow abort the race needs, which gloo's and NCCL's
aborts give only by chance.
"""

from __future__ import annotations

import threading

from warden import _torch


class SlowAbortGroup:
    """A process group whose ``abort`` waits until ``release`` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1
        self.entered.set()
        self.release.wait(10)


def _clean() -> None:
    with _torch._lock:
        _torch._aborted.clear()


def test_the_teardown_waits_for_an_abort_in_progress_and_leaves_nothing_held() -> None:
    _clean()
    group = SlowAbortGroup()
    _torch.register_process_group(group)
    # The resender's abort (seq 0: no request to check), stuck in abort().
    resender = threading.Thread(target=_torch.abort_process_groups, args=(0,), daemon=True)
    resender.start()
    assert group.entered.wait(5), "the abort never reached the group"
    # The training thread's teardown of the same attempt.
    teardown = threading.Thread(target=_torch.destroy_after_abort, daemon=True)
    teardown.start()
    teardown.join(0.5)
    assert teardown.is_alive(), "the teardown went on while the abort was still running"
    group.release.set()
    resender.join(5)
    teardown.join(5)
    assert not teardown.is_alive()
    # The old order left the group in the list the teardown had already
    # taken: alive until the next restart.
    with _torch._lock:
        held = list(_torch._aborted)
    assert all(g is not group for g in held), "the aborted group is still held after the teardown"
    del group


def test_a_request_already_taken_aborts_nothing() -> None:
    _clean()
    group = SlowAbortGroup()
    group.release.set()
    _torch.register_process_group(group)
    # No request is pending in this process: request 41 was taken (or never
    # came), so its late abort must leave the groups alone.
    assert _torch.abort_process_groups(41) == 0
    assert group.aborts == 0, "a late abort reached the next attempt's group"
    # The training thread's own abort (seq 0) still aborts everything.
    assert _torch.abort_process_groups(0) >= 1
    assert group.aborts == 1
    _torch.destroy_after_abort()
    del group


def test_a_new_attempts_group_waits_for_an_abort_in_progress() -> None:
    """``wait_for_aborts``, which ``warden.heal`` calls before it makes an
    attempt's group: an abort that passed its request's check (a request
    then acknowledged without a raise, the attempt joined early) would take
    a group made meanwhile among those it aborts. It is waited for, within
    the timeout, and said when it outlives it."""
    _clean()
    group = SlowAbortGroup()
    _torch.register_process_group(group)
    assert _torch.wait_for_aborts(0.1), "no abort runs: nothing to wait for"
    resender = threading.Thread(target=_torch.abort_process_groups, args=(0,), daemon=True)
    resender.start()
    assert group.entered.wait(5), "the abort never reached the group"
    assert not _torch.wait_for_aborts(0.2), "an abort still runs: the wait must not end before it"
    waiter_done = threading.Event()

    def waiter() -> None:
        if _torch.wait_for_aborts(10):
            waiter_done.set()

    threading.Thread(target=waiter, daemon=True).start()
    assert not waiter_done.wait(0.3), "the wait ended while the abort still ran"
    group.release.set()
    resender.join(5)
    assert waiter_done.wait(5), "the wait did not end with the abort"
    _torch.destroy_after_abort()
    del group
