"""One rank of an HSDP heal without a launcher: four of these make a 2 x 2
mesh ("replicate", "shard") on gloo, train, lose some ranks' state (those
ranks build a fresh model, optimizer and declaration, as a replacement
process does), make the process group and mesh again (as a restart does),
and resume. Modes, each from the same start:

  none  nobody lost: every rank is live at the newest step
  one   rank 1 lost: it heals from rank 3 (its shard position's peer)
  lost  ranks 1 and 3 lost (shard position 1 gone): every rank restores
        the checkpoint saved at step 2

Writes, per mode, the resume's account, the step it resumed at and the
sha256 of every parameter and optimizer tensor (whole) after 6 steps.

    python heal_hsdp_job.py STORE_DIR OUT_JSON   (RANK, WORLD_SIZE=4 set)
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import warden.heal
import warden.heal_layout as hl
from warden import tensor_bytes

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
FOLDER, OUT = sys.argv[1], sys.argv[2]
LOST = {"none": (), "one": (1,), "lost": (1, 3)}


def group(name: str) -> None:
    store = dist.FileStore(os.path.join(FOLDER, name), WORLD)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))


def mesh():
    return init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("replicate", "shard"))


def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    dp = mesh()
    for layer in (m[0], m[3]):
        fully_shard(layer, mesh=dp)
    fully_shard(m, mesh=dp)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    return m, opt, warden.heal.declare(m, opt, seed=3)


def train(m, opt, state, total: int, ckpt: str) -> None:
    for n in state.steps(total):
        if n == 2:
            torch.save(dict(hl.local_state_dict(m, opt), step=n), ckpt)
        g = torch.Generator().manual_seed(1000 * n + RANK)
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(m(x), x.sum(1, keepdim=True)).backward()
        opt.step()


def digest(m, opt) -> str:
    h = hashlib.sha256()
    tensors = [v for _, v in sorted(m.state_dict().items())]
    for pid, entries in sorted(opt.state_dict()["state"].items()):
        tensors += [v for _, v in sorted(entries.items()) if torch.is_tensor(v)]
    for t in tensors:
        t = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(tensor_bytes.view(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)))
    return h.hexdigest()


results = {}
for mode, lost in LOST.items():
    ckpt = os.path.join(FOLDER, f"{mode}-rank{RANK}.pt")
    group(f"{mode}-first")
    m, opt, state = build()
    train(m, opt, state, 4, ckpt)
    dist.destroy_process_group()  # what warden.run does after a restart
    released = hl.release(m)
    group(f"{mode}-second")
    if RANK in lost:
        m, opt, state = build()
    else:
        mesh()  # the same groups, under the same names, as the first attempt's

    def restore(m=m, opt=opt, ckpt=ckpt):
        sd = torch.load(ckpt, weights_only=True)
        hl.load_local_state_dict(m, opt, sd)
        return int(sd["step"])

    start = state.resume(restore)
    train(m, opt, state, 6, ckpt + ".unused")
    results[mode] = {"last": state.last, "start": start, "digest": digest(m, opt), "released": released}
    dist.destroy_process_group()

with open(OUT, "w") as f:
    # Whether this interpreter could use numpy (tests/no_numpy blocks it).
    json.dump({"rank": RANK, "numpy": importlib.util.find_spec("numpy") is not None, **results}, f)
