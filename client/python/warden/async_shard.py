"""The async shard's format, read and written: warden's own, a header
written with ``torch.save`` of the state's structure (each tensor replaced by
a mark), then the tensors' bytes, each 64-byte aligned. Its own module so
that ``checkpoint.load_state_dict`` reads it and ``async_checkpoint`` writes
it without either importing the other.

Nothing in a shard can run code when it is loaded: the header is read with
``weights_only``, and the tensors are raw bytes viewed in place.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Optional

from . import _native

__all__ = ["MAGIC", "is_async_shard", "read_shard"]

#: The first bytes of a shard written here.
MAGIC = b"WARDENAS"
VERSION = 1
#: A tensor's place in the header's structure: ("__warden_tensor__", index).
MARK = "__warden_tensor__"



def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise _native.CheckpointError("async shards need torch") from e
    return torch


def skeleton(obj: Any, tensors: list, torch, shared: Optional[dict] = None) -> Any:
    """``obj`` with each tensor replaced by its mark (the tensors appended to
    ``tensors``), containers copied, other leaves deep-copied: the training
    loop may change them after ``save`` returns. ``shared``: when given (a
    dict, empty at first), a tensor that views the same memory as one met
    before (tied weights) gets that one's mark, not a copy of its own."""
    if isinstance(obj, torch.Tensor):
        if shared is not None:
            key = (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), tuple(obj.stride()))
            if obj.numel() and key in shared:
                return (MARK, shared[key])
            shared[key] = len(tensors)
        tensors.append(obj)
        return (MARK, len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: skeleton(v, tensors, torch, shared) for k, v in obj.items()}
    if isinstance(obj, list):
        return [skeleton(v, tensors, torch, shared) for v in obj]
    if isinstance(obj, tuple):
        return tuple(skeleton(v, tensors, torch, shared) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    import copy  # noqa: PLC0415

    return copy.deepcopy(obj)


def fill(obj: Any, tensors: list) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == MARK and isinstance(obj[1], int):
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(fill(v, tensors) for v in obj)
    return obj


def body_offset(head_len: int) -> int:
    """Where the tensors' bytes start: after the magic, the header's length
    and the header, on a 64-byte boundary (so every tensor, 64-byte aligned
    within the body, can be viewed in place when read)."""
    return (len(MAGIC) + 8 + head_len + 63) & ~63


def read_shard(path: str, map_location: Any = "cpu", safe_globals: Optional[list] = None) -> Any:
    """The state saved at ``path`` by an ``AsyncCheckpointer`` (tensors on
    ``map_location``). ``safe_globals``: classes the structure may hold
    besides containers and numbers (``torch.serialization.safe_globals``;
    still no code runs on load)."""
    torch = _torch()
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise _native.CheckpointError(f"{path} is not an async-saved shard")
    (head_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if start + head_len > len(data):
        raise _native.CheckpointError(f"{path}: the header runs past the shard's end")
    raw_head = io.BytesIO(bytes(data[start : start + head_len]))
    if safe_globals:
        with torch.serialization.safe_globals(list(safe_globals)):
            header = torch.load(raw_head, weights_only=True)
    else:
        header = torch.load(raw_head, weights_only=True)
    body = body_offset(head_len)
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) > body else None
    tensors = []
    for dtype, shape, offset, nbytes in header["tensors"]:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise _native.CheckpointError(f"{path}: unknown dtype {dtype!r}")
        if nbytes == 0 or raw is None:
            t = torch.empty(shape, dtype=dt)
        else:
            if body + offset + nbytes > len(data):
                raise _native.CheckpointError(f"{path}: a tensor runs past the shard's end")
            t = raw[body + offset : body + offset + nbytes].view(dt).reshape(shape)
        if map_location not in (None, "cpu"):
            t = t.to(map_location)
        tensors.append(t)
    return fill(header["state"], tensors)


def is_async_shard(path: str) -> bool:
    """Whether ``path`` starts with this format's magic."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC
