"""warden.integrations: no framework at ``import warden``, and a clear error without one."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_warden_imports_no_framework() -> None:
    out = run(
        "import sys, warden, warden.checkpoint, warden.integrations\n"
        "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning', 'transformers', 'jax', 'orbax')"
        " if m in sys.modules))"
    )
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize(
    ("module", "blocked", "install"),
    [
        ("lightning", ("lightning", "pytorch_lightning"), "pip install pytorch-lightning"),
        ("transformers", ("transformers",), "pip install transformers accelerate"),
        ("dcp", ("torch",), "pip install torch"),
        ("orbax", ("orbax", "orbax.checkpoint"), "pip install orbax-checkpoint"),
    ],
)
def test_a_missing_framework_names_the_package_to_install(
    module: str, blocked: tuple, install: str
) -> None:
    # A None entry in sys.modules makes the import fail as if not installed.
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    out = run(
        f"import sys\n{block}"
        "try:\n"
        f"    import warden.integrations.{module}\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    assert f"warden.integrations.{module} needs" in out.stdout, out.stdout + out.stderr
    assert install in out.stdout, out.stdout
