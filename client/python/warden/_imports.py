"""What this rank imported, for the standby interpreters of ``warden run``.

``warden run --standby`` keeps a spare interpreter per local worker with
torch imported, and makes a restarted rank out of it. It also asks each
worker (``WARDEN_IMPORTS_FILE``) which installed packages it imported: the
launcher has its standbys import them too, so a warm rank finds them loaded.
``warden.run`` writes the list when it starts and once more a little later
(packages imported lazily inside the training function); nothing here runs
on a training step, and nothing raises.

Only top-level packages installed in the environment (site-packages) are
named: the user's own modules may read the rank's environment at import,
which a standby does not have yet.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import threading
from typing import List, Optional

#: The launcher's file for this rank; unset without standbys.
ENV = "WARDEN_IMPORTS_FILE"

#: Seconds after ``warden.run`` starts for the second report.
LATER_S = 20.0

#: At most this many names (the launcher reads no more either).
MAX_NAMES = 256

_started = False


def _roots() -> List[str]:
    roots = set()
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            roots.add(os.path.realpath(p))
    try:
        roots.update(os.path.realpath(p) for p in site.getsitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if isinstance(user, str):
        roots.add(os.path.realpath(user))
    return sorted(r + os.sep for r in roots)


def installed_imports() -> List[str]:
    """Top-level installed packages in ``sys.modules`` (not warden's own)."""
    roots = _roots()
    names = set()
    for name, mod in list(sys.modules.items()):
        if "." in name or name.startswith("_") or name == "warden" or not name.isidentifier():
            continue
        f = getattr(mod, "__file__", None)
        if not isinstance(f, str):
            continue
        real = os.path.realpath(f)
        if any(real.startswith(r) for r in roots):
            names.add(name)
    return sorted(names)[:MAX_NAMES]


def write(path: Optional[str] = None) -> bool:
    """Writes the list (one name a line) to ``path`` or ``$WARDEN_IMPORTS_FILE``
    atomically; False when there is nowhere to write or it failed."""
    path = path or os.environ.get(ENV)
    if not path:
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(n + "\n" for n in installed_imports()))
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def report() -> None:
    """Reports now and once more after ``LATER_S`` (once per process)."""
    global _started
    if _started or not os.environ.get(ENV):
        return
    _started = True
    write()
    t = threading.Timer(LATER_S, write)
    t.daemon = True
    t.name = "warden-imports"
    t.start()
