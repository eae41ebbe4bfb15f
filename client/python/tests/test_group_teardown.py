"""The old process group's teardown after a restart never holds the
training thread (``warden._torch.destroy_after_abort``), with real torch and
gloo: rank 0 has an all-reduce in flight that rank 1, alive and silent,
never joins. The group's destructor waits for that all-reduce; it must wait
on a thread of its own, and say so, while rank 0 makes its next group."""

from __future__ import annotations

import json
import os
import sys

import warden
from conftest import JOBS, free_port, require_framework, run_processes

#: How long rank 1 stays silent: the old code held rank 0 this long.
SILENT_S = 8.0


def test_a_group_whose_collective_waits_on_a_silent_peer_is_torn_down_off_the_training_thread(
    tmp_path,
) -> None:
    require_framework("torch")
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(warden.__file__)), os.environ.get("PYTHONPATH", "")]
        ),
    )
    codes = run_processes(
        [[sys.executable, str(JOBS / "group_teardown_job.py"), str(rank), str(port), str(SILENT_S)]
         for rank in range(2)],
        [env, env],
        [tmp_path / f"rank{rank}.log" for rank in range(2)],
    )
    out = (tmp_path / "rank0.log").read_text(errors="replace")
    assert codes == [0, 0], out
    line = next(l for l in out.splitlines() if l.startswith("{"))
    r = json.loads(line)
    # The old code returned only when rank 1 exited (SILENT_S on).
    assert r["held_s"] < SILENT_S / 4, (r, out)
    assert r["next_group_s"] < SILENT_S / 2, (r, out)
    # The destructor did wait (the case is the one meant), on the reaper.
    assert "the previous attempt's process group took" in out, out
