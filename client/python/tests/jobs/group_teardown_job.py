"""Rank of tests/test_group_teardown.py: a two-rank gloo group whose rank 1
stays alive and silent while rank 0 has an all-reduce in flight, as a heal's
survivor finds its old group when a peer has not yet shut its side.

argv: rank, port, how long rank 1 stays silent (s). Rank 0 prints one JSON
line: how long ``warden._torch.destroy_after_abort`` held it, and whether it
could make a new group at once (a store of its own: the next attempt's).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from warden import _torch

rank, port, silent_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
)
t = torch.ones(1024)
dist.all_reduce(t)
if rank == 1:
    # Alive, its sockets open, never joining the next all-reduce.
    time.sleep(silent_s)
    sys.exit(0)
work = dist.all_reduce(t, async_op=True)
time.sleep(0.3)
del work
start = time.monotonic()
_torch.destroy_after_abort()
held = time.monotonic() - start
# The next attempt's group, alone on a store of its own, while the old
# one's destructor still waits on its thread.
store = dist.TCPStore("127.0.0.1", 0, 1, True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
next_group_s = time.monotonic() - start
print(json.dumps({"held_s": held, "next_group_s": next_group_s}), flush=True)
# The interpreter's exit waits for the reaper (bounded), which says how
# long the old group took.
