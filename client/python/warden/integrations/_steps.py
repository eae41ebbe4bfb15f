"""A framework's hooks turned into warden steps and sections.

In: calls from a framework callback at its hooks (a step begins, the
forward, backward or optimizer part starts, a micro-batch or the step ends).
Out: the client's step and section calls, in an order the client accepts:
the three sections never nest (entering one closes the one open), and
every section is closed before its step ends. Never: raises for the agent's
sake (the client's calls do not), or leaves a section open after an
exception (``abandon`` closes what is open).
"""

from __future__ import annotations

from typing import Optional

from .. import _native

#: The well-known sections a training step is made of (docs/client.md).
SECTIONS = ("forward", "backward", "optimizer", "checkpoint")


class StepTracker:
    """Which step and section are open, so that hooks that come in any order
    (gradient accumulation, a skipped optimizer step) leave the slot tidy.

    One tracker drives the slot at a time: the first step of a new one (the
    next attempt under ``warden.run`` builds a new trainer and callback)
    closes what the previous one left open when a restart interrupted it."""

    #: The tracker that last began a step.
    _current: Optional["StepTracker"] = None

    def __init__(self, client: Optional[_native.Client] = None) -> None:
        self._client = client if client is not None else _native.default_client()
        self._ids = {name: self._client.section_id(name) for name in SECTIONS}
        self._open: Optional[int] = None
        #: The step open now, or None between steps.
        self.step: Optional[int] = None

    def begin(self, step: int) -> None:
        """Begins ``step`` (ending the one open, if any, first)."""
        previous = StepTracker._current
        if previous is not None and previous is not self:
            previous.abandon()
        StepTracker._current = self
        if self.step is not None:
            self.end()
        self._client.step_begin(int(step))
        self.step = int(step)

    def enter(self, name: str) -> None:
        """Opens section ``name``, closing the section open before."""
        self.leave()
        sid = self._ids[name]
        self._client.section_open(sid)
        self._open = sid

    def leave(self) -> None:
        """Closes the open section, if any."""
        if self._open is not None:
            self._client.section_close(self._open)
            self._open = None

    def end(self) -> None:
        """Closes the open section and ends the open step, if any."""
        self.leave()
        if self.step is not None:
            self._client.step_end(self.step)
            self.step = None

    def abandon(self) -> None:
        """After an exception: the same as ``end``, so the next attempt
        (``warden.run``) starts from a clean slot."""
        self.end()
