"""warden.tensor_bytes: a CPU tensor's bytes without numpy, read in place."""

from __future__ import annotations

import struct

import pytest

from conftest import require_framework


def test_the_view_is_the_tensors_bytes_in_place() -> None:
    require_framework("torch")
    import torch

    from warden import tensor_bytes

    t = torch.tensor([1.0, -2.5, 3.25], dtype=torch.float32)
    assert bytes(tensor_bytes.view(t)) == struct.pack("<3f", 1.0, -2.5, 3.25)
    assert bytes(tensor_bytes.view(t, 4)) == struct.pack("<f", 1.0)
    assert bytes(tensor_bytes.view(t, 0)) == b""
    assert bytes(tensor_bytes.view(torch.empty(0))) == b""
    # In place: a change to the tensor shows through the view.
    v = tensor_bytes.view(t)
    t[0] = 0.0
    assert bytes(v[:4]) == b"\0\0\0\0"


def test_the_view_keeps_a_temporary_tensor_alive() -> None:
    """A tensor made for the call alone (``view(t.clone())``) is held by its
    view: its memory is neither freed nor reused while the view is read."""
    require_framework("torch")
    import gc

    import torch

    from warden import tensor_bytes

    want = bytes(range(256)) * 4096  # 1 MiB: its own allocation, not a cached small block
    v = tensor_bytes.view(torch.frombuffer(bytearray(want), dtype=torch.uint8).clone())
    gc.collect()
    junk = [torch.full((1 << 20,), 7, dtype=torch.uint8) for _ in range(8)]  # would reuse freed memory
    assert bytes(v) == want
    del junk


def test_a_view_past_the_tensor_or_of_a_strided_one_is_refused() -> None:
    require_framework("torch")
    import torch

    from warden import tensor_bytes

    t = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="5 bytes of a tensor of 4"):
        tensor_bytes.view(t, 5)
    with pytest.raises(ValueError, match="-1 bytes"):
        tensor_bytes.view(t, -1)
    with pytest.raises(ValueError, match="contiguous: False"):
        tensor_bytes.view(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="conjugate or negative bit"):
        tensor_bytes.view(torch.zeros(2, dtype=torch.complex64).conj())
    with pytest.raises(TypeError):
        tensor_bytes.view(t)[0] = 1  # read-only
