"""warden.checkpoint with no agent: saving needs one, and says so."""

from __future__ import annotations

import pytest

import warden.checkpoint as ckpt


def test_save_without_an_agent_raises_naming_the_socket() -> None:
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save(1, b"state")
    assert "no-agent.sock" in str(e.value)
    assert not isinstance(e.value, ckpt.TierFullError)


def test_restore_without_an_agent_raises() -> None:
    with pytest.raises(ckpt.CheckpointError):
        ckpt.restore()


def test_save_refuses_a_non_contiguous_buffer_before_any_call() -> None:
    data = memoryview(bytes(range(16)))[::2]
    with pytest.raises(ValueError, match="contiguous"):
        ckpt.save(1, data)


def test_identity_comes_from_the_environment() -> None:
    job, rank, world = ckpt.identity()
    assert (job, rank, world) == ("default", 0, 1)
