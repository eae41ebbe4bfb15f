"""A CPU tensor's bytes as a Python buffer, without numpy.

torch does not install numpy, and ``Tensor.numpy()`` raises "Numpy is not
available" where it is missing: an async save's background write and a
healing rank's received skeleton both failed that way on a machine with
torch alone. A ctypes array laid over the tensor's memory is a buffer that
``file.write``, ``bytes`` and ``io.BytesIO`` take as it is, with no copy.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

__all__ = ["view"]


def view(t: Any, nbytes: Optional[int] = None) -> memoryview:
    """The first ``nbytes`` bytes (all of them by default) of ``t``, a
    contiguous tensor in host memory (pinned or not), read in place and
    read-only. The view keeps the tensor alive (a temporary, such as
    ``whole(t).cpu()`` passed straight in, would otherwise be freed under
    it)."""
    total = t.numel() * t.element_size()
    n = total if nbytes is None else int(nbytes)
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"tensor_bytes.view: a contiguous CPU tensor, not one on {t.device} "
                         f"(contiguous: {t.is_contiguous()})")
    if t.is_conj() or t.is_neg():
        raise ValueError("tensor_bytes.view: a tensor with its conjugate or negative bit set "
                         "(resolve_conj() / resolve_neg() first): its bytes are not its values")
    if not 0 <= n <= total:
        raise ValueError(f"tensor_bytes.view: {n} bytes of a tensor of {total}")
    if n == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    array.owner = t  # the memoryview holds the array, the array the tensor
    return memoryview(array).cast("B").toreadonly()
