"""A real ``wardend`` for the tests that need one (checkpoints through the tier).

In: a scratch directory. Out: an agent serving a socket there, with its own
state directory and checkpoint tier, started with ``NOTIFY_SOCKET`` and
waited for until it says ``READY=1`` (as tests/common/mod.rs does for the
Rust tests), then stopped with SIGTERM (SIGKILL past a bound). Never: uses
the machine's default paths (/run, /var/lib/warden, /dev/shm), or a fixed port.

The binary: ``$WARDEN_TEST_WARDEND``, else ``wardend`` on PATH (an installed
wheel), else the workspace's target/debug or target/release build.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from pathlib import Path
from typing import Optional

#: The repository root (client/python/tests/ -> ../../..).
ROOT = Path(__file__).resolve().parents[3]
#: Bound on READY=1: generous for a loaded 2-core machine.
READY_TIMEOUT_S = 60.0


def find_binary(name: str) -> Optional[str]:
    """warden's binary ``name`` (``wardend``, ``warden``) to run, or None when
    there is none: ``$WARDEN_TEST_WARDEND`` / ``$WARDEN_TEST_WARDEN`` first."""
    env = os.environ.get(f"WARDEN_TEST_{name.upper()}")
    if env:
        return env
    # The environment's own scripts first: the wheel installs the binaries
    # beside the interpreter, and CI runs these tests against the wheel's
    # (tests/run-all.sh), whether or not that folder is on PATH.
    beside = Path(sysconfig.get_path("scripts")) / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    if os.environ.get("WARDEN_REQUIRE_WHEEL") == "1":
        raise RuntimeError(f"WARDEN_REQUIRE_WHEEL=1, but the environment has no {beside} (a source install?)")
    on_path = shutil.which(name)
    if on_path:
        return on_path
    for profile in ("debug", "release"):
        p = ROOT / "target" / profile / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def find_wardend() -> Optional[str]:
    """The wardend binary to run, or None when there is none."""
    return find_binary("wardend")


class Wardend:
    """A running agent; ``socket`` is what ranks put in ``WARDEN_SOCKET``."""

    def __init__(
        self,
        home: Path,
        binary: str,
        extra_toml: str = "",
        tables: Optional[dict] = None,
        metrics: str = "127.0.0.1:0",
    ) -> None:
        """``extra_toml``: tables of its own, after the others; ``tables``:
        more lines inside [api], [agent] and [checkpoint] (by name), which
        TOML does not let a later table open again; ``metrics``: the
        address the metrics endpoint listens on (read by :meth:`served`)."""
        self.home = home
        self.socket = str(home / "wardend.sock")
        self.config = home / "wardend.toml"
        self.stderr_path = home / "wardend.stderr"
        self.metrics = metrics
        more = tables or {}
        unknown = set(more) - {"api", "agent", "checkpoint"}
        assert not unknown, f"Wardend(tables=...): no table {sorted(unknown)} to add to"
        self.config.write_text(
            "\n".join(
                [
                    "[api]",
                    f'socket = "{self.socket}"',
                    more.get("api", ""),
                    "[agent]",
                    f'state_dir = "{home / "state"}"',
                    more.get("agent", ""),
                    "[checkpoint]",
                    f'dir = "{home / "ckpt"}"',
                    "keep_steps = 4",
                    more.get("checkpoint", ""),
                    "[metrics]",
                    f'listen = "{metrics}"',
                    # No GPU, no readable kernel log, no DCGM here.
                    "[nvml]",
                    "enabled = false",
                    "[kmsg]",
                    "enabled = false",
                    "[dcgm]",
                    "enabled = false",
                    extra_toml,
                    "",
                ]
            )
        )
        notify_path = str(home / "notify.sock")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(notify_path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARDEN_")}
        env["NOTIFY_SOCKET"] = notify_path
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [binary, "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        seen: list[str] = []
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            self._notify.settimeout(max(0.01, min(0.5, deadline - time.monotonic())))
            try:
                msg = self._notify.recv(4096).decode(errors="replace")
            except socket.timeout:
                continue
            seen.append(msg)
            if "READY=1" in msg.splitlines():
                return
        self.stop()
        raise RuntimeError(
            f"wardend did not report READY=1 within {READY_TIMEOUT_S} s (exit {self.proc.poll()},"
            f" notifications {seen}):\n{self.stderr()}"
        )

    def stderr(self) -> str:
        """What the agent logged so far."""
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def served(self, method: str) -> float:
        """How many calls of the gRPC ``method`` the agent has answered, from
        its metrics (``warden_api_requests_total``, every status); needs a
        ``metrics`` address with its port."""
        import re  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("warden_api_requests_total{") and re.search(rf'method="{method}"', line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def env(self, job: str, rank: int = 0, world: int = 1) -> dict[str, str]:
        """The environment a rank of ``job`` runs with against this agent."""
        env = dict(os.environ)
        env.update(
            {
                "WARDEN_SOCKET": self.socket,
                "WARDEN_JOB_ID": job,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
            }
        )
        return env

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)
        self._notify.close()
