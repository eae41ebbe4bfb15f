#!/usr/bin/env bash
# Installs the training frameworks the Python integrations are tested
# against (tests/frameworks/requirements.txt: PyTorch Lightning, Hugging Face
# Transformers and Accelerate, pinned, with the packages they load; and
# tests/jax/requirements.txt: JAX on the CPU and Orbax) into a
# Python environment that has torch already (tests/torch-venv.sh), when it
# cannot import them yet. --no-deps: pip never touches torch or adds
# triton and the CUDA meta packages. The frameworks' list goes first: it
# brings numpy, which JAX imports and its own list leaves out.
# tests/run-all.sh runs it for the clone's .venv; by hand:
# bash tests/frameworks-venv.sh [.venv/bin/python]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv/bin/python}"
check='import pytorch_lightning, transformers, accelerate; from transformers import Trainer'
if "$py" -c "$check" 2>/dev/null; then
    "$py" -c 'import pytorch_lightning as l, transformers as t; print("lightning", l.__version__, "transformers", t.__version__, "already installed")'
else
    "$py" -m pip install --quiet --no-deps --no-cache-dir -r tests/frameworks/requirements.txt
    "$py" -c "$check"
    "$py" -c 'import torch, pytorch_lightning as l, transformers as t; print("lightning", l.__version__, "transformers", t.__version__, "torch", torch.__version__)'
fi
# JAX and Orbax: their own pinned list, also --no-deps.
jax_check='import jax, orbax.checkpoint'
if "$py" -c "$jax_check" 2>/dev/null; then
    "$py" -c 'import jax; print("jax", jax.__version__, "already installed")'
else
    "$py" -m pip install --quiet --no-deps --no-cache-dir -r tests/jax/requirements.txt
    "$py" -c "$jax_check"
    "$py" -c 'import jax, orbax.checkpoint as o; print("jax", jax.__version__, "orbax-checkpoint", o.__version__)'
fi
