#!/usr/bin/env bash
# The fault bench of issue 21 (docs/benchmarks.md, "Faults side by side"):
# real torch jobs (2 ranks, gloo on CPU), each fault under each system that
# handles it, RUNS times, one table on stdout (median, min-max, first-try
# recoveries, identical weights) and the raw per-run lines in a file it names.
#
#   bash tests/bench-faults.sh [RUNS] [ROW ...]    (default 10 runs, every row)
#
# One command: it makes (once) a venv of its own inside the clone,
# target/bench-venv, with torch (tests/torch-venv.sh), NVRx 0.4.1 and what
# its in-process Wrapper imports (tests/bench/requirements.txt, --no-deps)
# and the warden client (client/python, reinstalled when client/ changed);
# builds the release `warden` (a no-op when it is up to date with the tree);
# then runs tests/bench/faults.py.
# Rows (names for ROW): warden-inproc-hang, warden-inproc-transient,
# warden-inproc-frozen, warden-warm-crash, warden-cold-crash, torchrun-crash,
# torchrun-hang, nvrx-transient, nvrx-hang, nvrx-frozen, warden-teardown-abort.
# BENCH_BOUND_S (default 45; BENCH_OTHER_BOUND_S, 30, for torchrun and NVRx):
# how long after its fault a run may take to come
# back before it is stopped and counted as not recovered. BENCH_KEEP=1 keeps
# each run's output under /tmp/warden-bench-faults.*.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
runs=${1:-10}
shift || true
venv=$root/target/bench-venv
py=$venv/bin/python

[ -x "$py" ] || python3 -m venv "$venv"
bash tests/torch-venv.sh "$py"
if ! "$py" -c 'import nvidia_resiliency_ext.inprocess' 2>/dev/null; then
  "$py" -m pip install --quiet --no-deps -r tests/bench/requirements.txt
fi
# The client as the tree has it: reinstalled when client/ changed since the
# venv's copy was built (a stale client would bench old code).
stamp=$venv/.warden-client-tree
tree=$( { git rev-parse HEAD:client 2>/dev/null; git status --porcelain -- client 2>/dev/null; } | sha256sum | cut -d' ' -f1)
if ! "$py" -c 'import warden' 2>/dev/null || [ "$(cat "$stamp" 2>/dev/null)" != "$tree" ]; then
  # The native module built in the clone's target directory (its
  # dependencies are shared with the release build).
  CARGO_TARGET_DIR=$root/target "$py" -m pip install --quiet --force-reinstall --no-deps ./client/python
  echo "$tree" >"$stamp"
fi
# Always: a no-op when the release binaries are up to date with the tree.
cargo build --release --locked -p warden-cli --bins
warden=$root/target/release/warden

raw=$root/target/bench-faults-$(date -u +%Y%m%dT%H%M%SZ).jsonl
{
  echo "# $(date -u +%FT%TZ) RUNS=$runs; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# torch $("$py" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null)," \
    "nvidia-resiliency-ext $("$py" -m pip show nvidia-resiliency-ext 2>/dev/null | awk '/^Version/ { print $2 }')," \
    "warden $(git rev-parse --short HEAD)"
} | tee "$raw" >&2
BENCH_PYTHON=$py BENCH_WARDEN=$warden BENCH_TORCHRUN=$venv/bin/torchrun \
  python3 tests/bench/faults.py "$runs" "$raw" "$@"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
