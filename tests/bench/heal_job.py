"""What examples/heal/ddp.py's job is, for the bench's jobs without warden.

tests/bench/torchft_ddp.py and tests/bench/torchrun_ddp.py run the example's
job under torchft and torchrun; both take from here its model, optimizer, data
of (step, rank), per-step RNG seeding, log lines and digest, so the rows of
tests/bench/heal.py compare the same job. No warden import: the torchft and
torchrun rows run without it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import time

import torch


def log(path: str, line: str) -> None:
    """One append, one write: lines of the ranks never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{time.time():.6f} {line}\n".encode())
    finally:
        os.close(fd)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The example's data of (step, rank)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def seed_step(rank: int, step: int) -> None:
    """warden.heal.seed_step(7, rank, step), without importing warden."""
    value = ((7 * 1_000_003 + rank) * 1_000_033 + step) % (1 << 63)
    torch.manual_seed(value)
    random.seed(value)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The example's MLP with dropout, seeded alike on every rank, and Adam."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """The example's digest: every parameter and optimizer tensor, in a fixed order."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        h.update(name.encode())
        u = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        h.update(ctypes.string_at(u.data_ptr(), u.numel()) if u.numel() else b"")  # no numpy needed

    for k, v in sorted(model.state_dict().items()):
        add(k, v)
    sd = opt.state_dict()
    for pid in sorted(sd["state"]):
        for k, v in sorted(sd["state"][pid].items()):
            if torch.is_tensor(v):
                add(f"opt.{pid}.{k}", v)
    return h.hexdigest()
