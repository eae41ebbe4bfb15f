"""The package as the wheel installs it (deploy/build-wheel.sh): the agent's binaries on the
environment's PATH and the package importable from anywhere, not from the clone.

A source install (`pip install ./client/python`) has no binaries: these tests skip then, unless
WARDEN_REQUIRE_WHEEL=1 (tests/run-all.sh sets it: CI installs the wheel, so a skip there would
hide a wheel that lost its binaries).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

# The wheel's scripts go where the interpreter's console scripts go: the venv's bin/.
BIN_DIR = Path(sys.executable).parent
BINARIES = ("warden", "wardend")
# A rank's import must not be slow on a loaded 2-core CI machine; the margin is wide.
TIMEOUT_S = 60


def _wheel_scripts() -> set[str]:
    """The binaries the installed distribution's RECORD lists as installed into bin/."""
    files = metadata.distribution("warden").files or []
    return {f.name for f in files if f.name in BINARIES and f.parent.name == "bin"}


@pytest.fixture(scope="module")
def installed_from_wheel() -> None:
    if _wheel_scripts():
        return
    if os.environ.get("WARDEN_REQUIRE_WHEEL") == "1":
        pytest.fail("WARDEN_REQUIRE_WHEEL=1, but the installed warden lists no binaries (a source install?)")
    pytest.skip("warden installed from source (no binaries); deploy/build-wheel.sh builds the wheel")


def test_the_wheel_lists_both_binaries(installed_from_wheel: None) -> None:
    assert _wheel_scripts() == set(BINARIES)


@pytest.mark.parametrize("name", BINARIES)
def test_binary_is_on_the_venvs_path_and_runs(
    installed_from_wheel: None, name: str, tmp_path: Path
) -> None:
    exe = BIN_DIR / name
    assert exe.is_file() and os.access(exe, os.X_OK), f"{exe} missing or not executable"
    out = subprocess.run(
        [str(exe), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [name, metadata.version("warden")], out.stdout


def test_import_from_outside_the_clone(installed_from_wheel: None, tmp_path: Path) -> None:
    # A fresh interpreter in an empty directory with no PYTHONPATH: `warden` must come from the
    # environment's site-packages (the clone's .venv may be inside the clone), with its native
    # module, and not from the source tree client/python.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import warden, warden._native; print(warden.__file__); print(warden._native.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    assert out.returncode == 0, out.stderr
    source = Path(__file__).resolve().parents[1]
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    imported = [Path(line).resolve() for line in out.stdout.split()]
    assert len(imported) == 2, out.stdout
    for path in imported:
        assert not path.is_relative_to(source), f"{path} imported from the source tree {source}"
        assert any(path.is_relative_to(s) for s in site), f"{path} not under {site}"
