#!/usr/bin/env python3
"""A small PyTorch job for `warden run` on a GPU: real CUDA work, real state.

Each rank trains an MLP (--layers x --width, fp32, Adam) on random batches on
cuda:LOCAL_RANK (CPU when no GPU is visible), inside warden's step and
sections. Every --ckpt-every steps it saves the model and optimizer
state_dict into the agent's checkpoint tier (warden.checkpoint
.save_state_dict) and prints the bytes and how long training was stopped for
it. When restarted it loads the newest complete step back onto the GPU and
checks, tensor by tensor, that what it got is what it saved (the digest of
every saved step is kept next to the job, outside the tier).

Where examples/train.py is the toy for any machine, this is the job the
hardware validation runs (docs/hardware-validation.md): NVML sees the CUDA
context, the launcher's GPU release wait sees it go, and the tier carries a
real optimizer state.

  --crash-at-step N [--crash-rank R]   rank R dies with os._exit(3) at step
                                       N on the first attempt only

Lines on stdout (the launcher prefixes them with the rank):
  device D name=NAME pid=P restart=C
  resumed from checkpoint at step S (tier T, from SRC) in MS ms, digest ok
  saved step S: MiB MiB in MS ms
  step N loss L
  crash: os._exit(3) at step N
  done steps=N
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

import warden
import warden.tensor_bytes  # a tensor's bytes for the digest, without numpy (torch does not install it)
import warden.checkpoint as tier

RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def say(line: str) -> None:
    print(line, flush=True)


def digest(state: dict) -> str:
    """A digest of every tensor's bytes, in key order, computed on the CPU."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(state):
        value = state[key]
        h.update(key.encode())
        if torch.is_tensor(value):
            h.update(warden.tensor_bytes.view(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8)))
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def flat_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """One flat dict of tensors (save_state_dict sizes the shard from it)."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in optim.state_dict()["state"].items():
        for k, v in s.items():
            state[f"optim.{i}.{k}"] = v
    return state


def load_flat(model: torch.nn.Module, optim: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
    opt = optim.state_dict()
    per: dict = {}
    for k, v in state.items():
        if k.startswith("optim."):
            _, i, name = k.split(".", 2)
            per.setdefault(int(i), {})[name] = v
    opt["state"] = per
    optim.load_state_dict(opt)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--report-every", type=int, default=10)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--digests", default=None, help="default: $TMPDIR/warden-torch-<job>.json")
    a = p.parse_args()

    warden.default_client()
    job = os.environ.get("WARDEN_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    digests = a.digests or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"warden-torch-{job}-rank{RANK}.json"
    )
    device = torch.device(f"cuda:{LOCAL_RANK}" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"device {device} name={name.replace(' ', '_')} pid={os.getpid()} restart={RESTART}")

    torch.manual_seed(1234 + RANK)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)

    start = 0
    t0 = time.perf_counter()
    r = tier.restore()
    if r is not None:
        # Loaded on the CPU: load_state_dict puts every tensor where its
        # parameter lives (Adam's step counters stay on the CPU).
        start = r.step
        load_flat(model, optim, torch.load(r.path, map_location="cpu", weights_only=True))
        want = {}
        if os.path.exists(digests):
            with open(digests) as f:
                want = json.load(f)
        ok = want.get(str(start)) == digest(flat_state(model, optim))
        say(
            f"resumed from checkpoint at step {start} (tier {r.tier}, from {r.source})"
            f" in {(time.perf_counter() - t0) * 1e3:.0f} ms, digest {'ok' if ok else 'MISMATCH'}"
        )
        if not ok:
            return 5

    for n in range(start, a.steps):
        with warden.step(n):
            x = torch.randn(a.batch, a.width, device=device)
            with warden.section("forward"):
                loss = model(x).square().mean()
            with warden.section("backward"):
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        if a.report_every and n % a.report_every == 0:
            say(f"step {n} loss {loss.item():.6f}")
        if n == a.crash_at_step and RANK == a.crash_rank and RESTART == 0:
            say(f"crash: os._exit(3) at step {n}")
            os._exit(3)
        if (n + 1) % a.ckpt_every == 0:
            state = flat_state(model, optim)
            with warden.section("checkpoint"):
                t = time.perf_counter()
                path = tier.save_state_dict(n + 1, state)
                ms = (time.perf_counter() - t) * 1e3
            known = {}
            if os.path.exists(digests):
                with open(digests) as f:
                    known = json.load(f)
            known[str(n + 1)] = digest(state)
            with open(digests + ".tmp", "w") as f:
                json.dump(known, f)
            os.replace(digests + ".tmp", digests)
            mib = os.stat(path).st_size / 2**20
            say(f"saved step {n + 1}: {mib:.0f} MiB in {ms:.0f} ms")
    say(f"done steps={a.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
