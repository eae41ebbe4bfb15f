"""One rank saving an Orbax CheckpointManager's steps through the tier.

Usage: orbax_job.py DIR MODE OUT, MODE ``async`` (Orbax's default) or
``sync``. Saves steps 0..5 (every other one) through
``warden.integrations.orbax.CheckpointManager`` in DIR/first, then makes a
second manager in the empty DIR/second (as a restarted process on another
host would): it must find the tier's newest step, and restore exactly the
arrays saved. Writes what it saw as JSON to OUT.
"""

import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from warden.integrations.orbax import CheckpointManager

root, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
options = ocp.CheckpointManagerOptions(enable_async_checkpointing=(mode == "async"), max_to_keep=2)


def digest(tree) -> str:
    return hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in jax.tree_util.tree_leaves(tree))).hexdigest()


saved = {}
first = CheckpointManager(os.path.join(root, "first"), options=options)
assert first.restored_step is None, first.restored_step
state = {"w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8), "b": jnp.zeros(8)}
after_save = {}
for step in range(6):
    state = jax.tree_util.tree_map(lambda x: x * 1.5 + step, state)
    if step % 2 == 0:
        first.save(step, args=ocp.args.StandardSave(state))
        after_save[step] = list(first.tier_steps)
        saved[step] = digest(state)
first.close()

second = CheckpointManager(os.path.join(root, "second"), options=options)
latest = second.latest_step()
abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
restored = second.restore(latest, args=ocp.args.StandardRestore(abstract))
second.close()
# A directory that already holds the step keeps it as it is.
third = CheckpointManager(os.path.join(root, "second"), options=options)

with open(out, "w") as f:
    json.dump(
        {
            "tier_steps": first.tier_steps,
            "after_save": {str(k): v for k, v in after_save.items()},
            "restored_step": second.restored_step,
            "latest": latest,
            "restored_digest": digest(restored),
            "saved": {str(k): v for k, v in saved.items()},
            "third_restored": third.restored_step,
            "second_steps": sorted(os.listdir(os.path.join(root, "second"))),
        },
        f,
    )
