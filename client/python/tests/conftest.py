"""No agent by default: every test points the client at a socket nobody serves."""

from __future__ import annotations

import os
import tempfile

# Before `warden` creates its default client: an empty directory, so no agent.
_SCRATCH = tempfile.mkdtemp(prefix="warden-pytest-")
os.environ["WARDEN_SOCKET"] = os.path.join(_SCRATCH, "no-agent.sock")
for _var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "WARDEN_JOB_ID", "TORCHELASTIC_RUN_ID"):
    os.environ.pop(_var, None)
