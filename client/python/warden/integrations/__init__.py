"""Training frameworks wired to the local warden agent in a few lines each.

Each submodule imports its framework when it is imported itself (never at
``import warden``), and says which package to install when it is missing:

- ``warden.integrations.lightning``: ``WardenCallback`` for a PyTorch
  Lightning ``Trainer`` (steps, sections, checkpoints through the agent's
  tier), ``restore_path()`` for ``trainer.fit(ckpt_path=...)``, and
  ``WardenDDPStrategy``, Lightning's DDP strategy healed from a live replica.
- ``warden.integrations.transformers``: ``WardenCallback`` for a Hugging
  Face ``Trainer`` and ``restore_dir()`` for
  ``trainer.train(resume_from_checkpoint=...)``.
- ``warden.integrations.dcp``: ``WardenStorageWriter`` and
  ``WardenStorageReader`` for ``torch.distributed.checkpoint``, so sharded
  (FSDP, DTensor) state dicts save into and restore from the tier.
- ``warden.integrations.orbax``: ``CheckpointManager``, Orbax's own
  manager whose finalized steps are also committed into the tier, and
  which starts from the tier's newest complete step.

In-process restarts come from ``warden.run`` around the function that
builds the trainer and calls fit/train; docs/client.md has complete examples.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__: list[str] = []


def require(module: str, integration: str, install: str) -> ModuleType:
    """Imports ``module`` for ``integration``, or raises an ImportError that
    names the package to install (``install``), so a missing framework reads
    as what it is rather than as a traceback inside warden."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{integration} needs {module!r}, which is not installed: pip install {install}"
        ) from e
