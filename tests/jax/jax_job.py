"""A JAX multi-process training job for tests/jax_restart.rs, run by `warden run --jax`.

Every process calls `jax.distributed.initialize()` with no arguments (the
launcher's environment carries everything), holds its shard of a global
weight array sharded across the job's processes (one CPU device each),
trains it with updates that are a pure function of the step, and saves
every SAVE_EVERY steps through warden's Orbax CheckpointManager (the tier).
A restarted attempt resumes from the tier. With --crash-step S, on the
first attempt only, rank 1 kills itself with SIGKILL right after step S's
save is in the tier. Each attempt's Orbax directory is new (as on a
replacement host), so a resume comes from the tier. Each process writes `rank<R>.json` into --out: the
process count and id JAX saw, the coordinator, the step it resumed from
and the digest of the arrays it restored, the digests of what it saved at
each step, and the digest of its final shard.

Usage: jax_job.py --ckpt-dir DIR --out DIR --steps N [--crash-step S]
"""

import argparse
import hashlib
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from warden.integrations.orbax import CheckpointManager

SAVE_EVERY = 4

p = argparse.ArgumentParser()
p.add_argument("--ckpt-dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--crash-step", type=int, default=-1)
a = p.parse_args()

jax.distributed.initialize()
rank, world = jax.process_index(), jax.process_count()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {rank} of {world}: attempt {attempt}, coordinator {os.environ['JAX_COORDINATOR_ADDRESS']}", flush=True)

mesh = Mesh(np.array(jax.devices()), ("p",))
sharding = NamedSharding(mesh, PartitionSpec("p"))
ROWS = 2 * world


def shard_digest(x) -> str:
    """This process's shard of the global array ``x``, as bytes, hashed."""
    h = hashlib.sha256()
    for s in sorted(x.addressable_shards, key=lambda s: str(s.index)):
        h.update(np.asarray(s.data).tobytes())
    return h.hexdigest()


def initial():
    return jax.make_array_from_callback(
        (ROWS, 64), sharding, lambda idx: np.ones((ROWS, 64), np.float32)[idx]
    )


@jax.jit
def train_step(w, step):
    # A pure function of the step and the weights: a run that resumes from
    # a checkpoint ends with exactly the weights of one that never failed.
    target = jnp.sin(jnp.arange(w.size, dtype=jnp.float32).reshape(w.shape) + step)
    return w - 0.1 * (w - target)


# A directory of the attempt's own, as a restart on another host would
# have: what it resumes from comes from the tier.
mngr = CheckpointManager(os.path.join(a.ckpt_dir, f"attempt{attempt}"), options=ocp.CheckpointManagerOptions(max_to_keep=2))
result = {
    "rank": rank,
    "world": world,
    "attempt": attempt,
    "coordinator": os.environ["JAX_COORDINATOR_ADDRESS"],
    "tier_restored": mngr.restored_step,
    "saved": {},
}
start = 0
w = initial()
latest = mngr.latest_step()
if latest is not None:
    abstract = jax.ShapeDtypeStruct((ROWS, 64), jnp.float32, sharding=sharding)
    w = mngr.restore(latest, args=ocp.args.StandardRestore({"w": abstract}))["w"]
    start = latest + 1
    result["resumed_from"] = latest
    result["restored_digest"] = shard_digest(w)
    print(f"rank {rank}: resumed from step {latest}", flush=True)

for step in range(start, a.steps):
    w = train_step(w, step)
    if step % SAVE_EVERY == 0:
        mngr.save(step, args=ocp.args.StandardSave({"w": w}))
        mngr.wait_until_finished()  # in the directory and committed into the tier
        result["saved"][str(step)] = shard_digest(w)
        print(f"rank {rank}: saved step {step}", flush=True)
        if step == a.crash_step and attempt == 0:
            multihost_utils.sync_global_devices(f"saved {step}")
            if rank == 1:
                print(f"rank {rank}: killing itself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
mngr.close()
result["final_digest"] = shard_digest(w)
result["tier_steps"] = mngr.tier_steps
with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
multihost_utils.sync_global_devices("done")
jax.distributed.shutdown()
