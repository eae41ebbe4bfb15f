"""A rank that saves with warden.async_checkpoint.AsyncCheckpointer into the
agent's tier while it keeps training, then loads the newest step back.

    python async_save_job.py OUT

Writes to OUT (JSON): the step restored, whether every tensor came back
byte for byte as it was when ``save`` returned (the training thread changed
them right after), the non-tensor state, and the stalls. On a machine with a
GPU the model and tensors live on it (the copies queued on the training
stream, waited for in the background): the same checks, on the CUDA path.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch

import warden.checkpoint as ckpt
from warden.async_checkpoint import AsyncCheckpointer


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def main(out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    extra = {
        "half": torch.randn(17).to(torch.bfloat16),
        "view": torch.arange(100, dtype=torch.float64).reshape(10, 10)[:, 2],
        "mask": torch.rand(5, 3) > 0.5,
        "empty": torch.empty(0, 4),
    }
    extra = {k: v.to(DEVICE) for k, v in extra.items()}
    saved = {}
    stalls = []
    with AsyncCheckpointer(max_in_flight=1) as saver:
        for step in range(1, 13):
            x = torch.randn(32, 64, device=DEVICE)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:
                # Adam's moments exist now: the buffer is made ahead, so
                # no save allocates one on this thread.
                saver.prepare({"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra})
            if step % 4 == 0:
                state = {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "extra": extra,
                    "meta": {"step": step, "note": "hello", "sizes": [1, 2, 3]},
                }
                saver.save(step, state)
                stalls.append(saver.last_stall_s)
                # What the shard must hold: the state as it was when save
                # returned; then the training thread changes it in place.
                saved = {
                    k: v.clone()
                    for k, v in model.state_dict().items()
                }
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
    # Closed: every save committed.
    committed = saver.committed
    grown = saver.grown_in_save
    background = [saver.last_write_s, saver.last_commit_s, saver.last_device_copy_s]
    step, state = ckpt.load_state_dict()
    exact = {k: same_bytes(saved[k], state["model"][k]) for k in saved}
    exact.update({k: same_bytes(v, state["extra"][k]) for k, v in extra.items()})
    optim_state = state["optim"]["state"]
    result = {
        "restored_step": step,
        "exact": exact,
        "meta": state["meta"],
        "optim_keys": sorted(str(k) for k in optim_state),
        "optim_step": float(optim_state[0]["step"]),
        "stalls": stalls,
        "committed": committed,
        "grown_in_save": grown,
        "device": DEVICE,
        "background": background,
        # Whether this interpreter could use numpy (tests/no_numpy blocks it).
        "numpy": importlib.util.find_spec("numpy") is not None,
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[-1])
