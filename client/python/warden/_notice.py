"""Notices of a coming stop: a preemption, host maintenance, the scheduler's SIGTERM.

In: the notice word the agent sets in this rank's heartbeat slot (one atomic
load, so asking at every step boundary costs nanoseconds). Out: a
``Notice`` or ``None``; ``Preempted``, the ``SystemExit`` a rank raises once
it saved, whose status (85) tells ``warden run`` the rank left on a notice.
Never: block, call the agent, or raise because the agent is absent.

    for step in range(start, steps):
        with warden.step(step):
            train_one_step()
        n = warden.notice()
        if n and n.due(step):
            ckpt.save_state_dict(step, model.state_dict())
            raise warden.Preempted(step)

Every rank of the job is given the same step to save at (``save_at_step``:
the one after the furthest rank's step when the agent told them), so the
shards of one step are complete and the next start resumes there; ranks in
lockstep (data parallel) save at their next or second next step boundary.

``warden.checkpoint.save_on_notice`` does the last three lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from . import _native

EXIT_PREEMPTED = 85
"""The status of a rank (and of ``warden run``) stopped on a notice: "preempted,
requeue me". See docs/operations.md, "Notices of a coming stop"."""


@dataclass(frozen=True)
class Notice:
    """A stop is coming: save at this step boundary and leave."""

    source: str
    """Who gave notice: launcher (its SIGTERM), gce, aws, kubernetes."""
    deadline_unix_s: int
    """When the stop comes (Unix seconds); 0 when the source did not say."""
    save_at_step: int
    """The step at whose boundary every rank of the job saves."""

    def due(self, step: int) -> bool:
        """Whether the rank, at the boundary after ``step``, saves now."""
        return int(step) >= self.save_at_step

    def seconds_left(self) -> Optional[float]:
        """Seconds until the deadline (negative once past); None without one."""
        if not self.deadline_unix_s:
            return None
        return self.deadline_unix_s - time.time()


def notice() -> Optional[Notice]:
    """The notice standing for this rank, or None. Cheap: call it every step."""
    raw = _native.notice()
    if raw is None:
        return None
    return Notice(source=raw[0], deadline_unix_s=raw[1], save_at_step=raw[2])


class Preempted(SystemExit):
    """Raised by a rank that saved on a notice: it exits with status 85, which
    ``warden run`` reads as "left on a notice", not as a failure."""

    def __init__(self, step: Optional[int] = None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step = step

    def __str__(self) -> str:
        at = "" if self.step is None else f" after saving step {self.step}"
        return f"stopped on a notice{at} (exit {EXIT_PREEMPTED}: requeue)"
