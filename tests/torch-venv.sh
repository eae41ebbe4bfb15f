#!/usr/bin/env bash
# Installs real torch (CPU use; see tests/torch/requirements.txt) into a
# Python environment when it cannot import it yet. tests/run-all.sh runs it
# for the clone's .venv; by hand: bash tests/torch-venv.sh [.venv/bin/python]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv/bin/python}"
if "$py" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
    "$py" -c 'import torch; print("torch", torch.__version__, "already installed")'
    exit 0
fi
# --no-deps: the pinned list is the whole set (it leaves triton out).
"$py" -m pip install --quiet --no-deps --no-cache-dir -r tests/torch/requirements.txt
"$py" -c 'import torch, torch.distributed as d; print("torch", torch.__version__, "gloo", d.is_gloo_available())'
