#!/usr/bin/env bash
# The README's first command: a supervised toy training job on any machine
# (no GPU, no torch). Creates .venv with the warden Python package, builds
# the release binaries, then runs 4 workers of examples/train.py under
# `warden run`; rank 2 crashes at step 20 and the output shows the crash
# seen, the agent's diagnosis and decision, the in-job restart resuming from
# the checkpoint, and the run's summary. Extra arguments go to train.py
# (e.g. `bash examples/demo.sh --raise-at-step 10` for a user error that
# stops the job instead).
set -euo pipefail
cd "$(dirname "$0")/.."

# The Python package, (re)installed when missing or older than its sources.
stamp=.venv/.warden-client-installed
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import warden" 2>/dev/null \
    || [ ! -f "$stamp" ] || [ -n "$(find client -newer "$stamp" -type f \( -name '*.rs' -o -name '*.py' -o -name '*.toml' \) -print -quit)" ]; then
    echo "==> python venv (.venv) with the warden package (pip builds it with maturin)" >&2
    python3 -m venv .venv
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet ./client/python
    touch "$stamp"
fi

# etcd-client's build needs protoc and the protobuf well-known types.
bash tests/system-deps.sh build

echo "==> cargo build --release" >&2
cargo build --release --quiet

echo "==> warden run --nproc-per-node 4 -- .venv/bin/python examples/train.py --ckpt warden --crash-at-step 20 --crash-rank 2" >&2
exec ./target/release/warden run --nproc-per-node 4 -- \
    .venv/bin/python examples/train.py --steps 40 --step-ms 50 --ckpt warden --crash-at-step 20 --crash-rank 2 "$@"
