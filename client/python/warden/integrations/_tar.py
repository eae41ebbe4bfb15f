"""A checkpoint directory packed into one tier shard, and unpacked back.

In: a directory a framework wrote (a Transformers ``checkpoint-N``, an
Orbax step directory), or a restored shard. Out: an uncompressed tar
written at a path the tier hands out (``warden.checkpoint.save_file``),
with a size bound computed beforehand (the agent cuts a staging file
written past its declared size); a directory unpacked from such a shard.
Never: follows a link or writes outside the target when unpacking
(tarfile's ``data`` filter), or packs a path that is not a directory.
"""

from __future__ import annotations

import os
import tarfile
from typing import Optional

from .. import checkpoint as _ckpt


def tar_size(src: Optional[str]) -> int:
    """The most bytes ``pack(src)`` writes: each entry's 512-byte header
    (and long names' extra headers) and its data rounded up to 512, the two
    end blocks, and tarfile's padding of the archive to 10 KiB records."""
    if src is None or not os.path.isdir(src):
        return 4096
    total = 1024 + 10240
    for root, dirs, files in os.walk(src):
        total += 1536 * (1 + len(dirs))
        for name in files:
            try:
                size = os.path.getsize(os.path.join(root, name))
            except OSError:
                size = 0
            total += 1536 + (size + 511) // 512 * 512
    return total


def pack(src: Optional[str], path: str, what: str = "the checkpoint") -> None:
    """The directory ``src`` as a tar at ``path`` (its top entry named as
    the directory is); ``src`` None: an empty shard."""
    if src is None:
        open(path, "wb").close()
        return
    if not os.path.isdir(src):
        raise _ckpt.CheckpointError(f"{what} {src} is not a directory")
    with tarfile.open(path, "w:") as tar:
        tar.add(src, arcname=os.path.basename(src))


def unpack(shard: str, root: str) -> None:
    """The tar at ``shard`` unpacked under ``root``, refusing links out of
    it and absolute or ``..`` names (the ``data`` filter)."""
    with tarfile.open(shard, "r:") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, filter="data")
        else:  # pragma: no cover - Pythons before the extraction filters
            tar.extractall(root)
