"""``restore_path`` on the ranks of a job, against a real agent.

    python restore_path_job.py save OUT      # this rank saves step 5: a whole checkpoint's bytes
    python restore_path_job.py restore OUT   # this rank's restore_path(), and what it names

OUT (JSON) gets what the test checks: the path's bytes (or None).
"""

from __future__ import annotations

import json
import sys

from warden import checkpoint as ckpt
from warden.integrations.lightning import restore_path

MODE, OUT = sys.argv[1], sys.argv[-1]
if MODE == "save":

    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"rank 0's whole checkpoint")

    ckpt.save_file(5, write, size_hint=64)
    result: dict = {"saved": 5}
else:
    path = restore_path()
    if path is None:
        result = {"bytes": None}
    else:
        with open(path, "rb") as f:
            result = {"bytes": f.read().decode()}
with open(OUT, "w") as f:
    json.dump(result, f)
