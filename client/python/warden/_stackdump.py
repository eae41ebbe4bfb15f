"""Stack dumps on the agent's request.

When a rank hangs, the agent sends it a signal (``WARDEN_STACK_DUMP_SIGNAL``,
SIGUSR2 by default; ``0`` turns the feature off) and attaches what the rank
writes to the file the agent named at registration. ``faulthandler`` does
the writing from its C signal handler, so the dump works even while the main
thread is stuck in a long C call that holds the GIL.

The handler is installed at import, before any client registers, writing to
``/dev/null``: a signal that arrives early is harmless instead of killing the
process (SIGUSR2's default action). A daemon thread then points it at the
agent's file, and follows it when the client re-registers with another
agent. A signal the program already handles is never taken over.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from typing import IO, Any

_POLL_SECONDS = 1.0


def _wanted_signal() -> int:
    raw = os.environ.get("WARDEN_STACK_DUMP_SIGNAL")
    if raw is None:
        return int(signal.SIGUSR2)
    try:
        sig = int(raw)
    except ValueError:
        print(
            f"warden: WARDEN_STACK_DUMP_SIGNAL={raw!r} is not a signal number; stack dumps off",
            file=sys.stderr,
        )
        return 0
    return sig if 0 < sig < signal.NSIG else 0


class StackDumps:
    """The process's stack-dump handler and the clients whose file it follows."""

    def __init__(self, sig: int, sink: IO[str] | None) -> None:
        self.signal = sig
        self._file = sink
        self._path: str | None = None
        self._clients: list[Any] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def install(cls) -> "StackDumps":
        """Installs the handler if the signal is free; signal 0 when not."""
        sig = _wanted_signal()
        if sig == 0:
            return cls(0, None)
        try:
            if signal.getsignal(sig) not in (signal.SIG_DFL, None):
                return cls(0, None)
            sink = open(os.devnull, "w")  # noqa: SIM115 - kept open for the handler
            faulthandler.register(sig, file=sink, all_threads=True, chain=False)
        except (OSError, ValueError, RuntimeError) as e:
            print(f"warden: no stack dumps on signal {sig}: {e}", file=sys.stderr)
            return cls(0, None)
        dumps = cls(sig, sink)
        # The default client appears on first use of a module-level call;
        # the thread polls for it, so it starts now.
        dumps._start()
        return dumps

    def track(self, client: Any) -> None:
        """Follows `client`'s dump path (the default client is followed anyway)."""
        if self.signal == 0:
            return
        with self._lock:
            if client not in self._clients:
                self._clients.append(client)
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="warden-stackdump", daemon=True)
            self._thread.start()

    def _candidates(self) -> list[Any]:
        from . import _native

        with self._lock:
            clients = list(self._clients)
        default = _native._default_client_if_any()
        if default is not None:
            clients.insert(0, default)
        return clients

    def _run(self) -> None:
        stop = threading.Event()
        while not stop.wait(_POLL_SECONDS):
            for client in self._candidates():
                try:
                    path = client.status().get("stack_dump_path")
                except Exception:  # a closed client: skip it
                    continue
                if path and path != self._path:
                    self._point_at(path)
                    break

    def _point_at(self, path: str) -> None:
        try:
            new = open(path, "a")  # noqa: SIM115 - kept open for the handler
            faulthandler.register(self.signal, file=new, all_threads=True, chain=False)
        except (OSError, ValueError, RuntimeError) as e:
            print(f"warden: cannot write stack dumps to {path}: {e}", file=sys.stderr)
            self._path = path
            return
        old, self._file, self._path = self._file, new, path
        if old is not None:
            old.close()

