"""A rank for the in-process restart benchmark (cli/benches/in_process_restart.rs).

Runs forever under ``warden.run``; each attempt blocks in ``time.sleep``
(``--mode sleep``), spins in a pure-Python loop (``--mode busy``), or, with
``--mode baseline``, runs without warden at all: a plain handler for
SIGUSR1 raises, the baseline for the signal round trip alone.

The moment ``RestartRequested`` (or the baseline's exception) reaches the
training code is taken where it is raised, by catching it in place and
raising it on, and printed as ``raised seq=S t_ns=T`` (CLOCK_MONOTONIC, the
clock the benchmark reads). ``ready`` is printed once per attempt.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def say(line: str) -> None:
    print(line, flush=True)


class Baseline(BaseException):
    pass


def work(mode: str) -> None:
    if mode == "busy":
        while True:
            sum(range(64))
    while True:
        time.sleep(3600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["sleep", "busy", "baseline"], default="sleep")
    a = p.parse_args()

    if a.mode == "baseline":

        def handler(signum: int, frame: object) -> None:
            raise Baseline()

        signal.signal(signal.SIGUSR1, handler)
        say(f"registered pid={os.getpid()}")
        n = 0
        while True:
            say("ready")
            try:
                work("sleep")
            except Baseline:
                n += 1
                say(f"raised seq={n} t_ns={time.monotonic_ns()}")

    import warden

    client = warden.default_client()
    deadline = time.monotonic() + 10
    while not client.is_connected():
        if time.monotonic() >= deadline:
            say(f"not registered: {client.status()}")
            return 3
        time.sleep(0.01)
    say(f"registered pid={os.getpid()}")

    def train() -> None:
        say("ready")
        try:
            work(a.mode)
        except warden.RestartRequested as e:
            say(f"raised seq={e.seq} t_ns={time.monotonic_ns()}")
            raise

    warden.run(train)
    return 0


if __name__ == "__main__":
    sys.exit(main())
