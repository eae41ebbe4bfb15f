#!/usr/bin/env bash
# Repeats the single-kill heal of tests/torch_heal.rs N times and prints one
# line a run: its exit status, whether a survivor left blocked in a gloo
# collective (warden.heal's exit 75), the time from the killed rank's last
# logged step to every rank logging a step again, and the digests.
#
#   bash tests/bench/heal_repeat.sh [RUNS] [OUT_DIR]
#
# Needs target/debug/warden (cargo build -p warden-cli) and .venv with torch
# and the warden wheel (the README's test command installs both).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUNS=${1:-10}
OUT=${2:-$(mktemp -d -t warden-heal-repeat-XXXXXX)}
PY=${WARDEN_TEST_PYTHON:-$ROOT/.venv/bin/python}
for i in $(seq 1 "$RUNS"); do
  D=$OUT/$i; rm -rf "$D"; mkdir -p "$D"
  LOG=$D/example.log
  EXAMPLE_LOG=$LOG EXAMPLE_STEPS=120 EXAMPLE_CKPT_EVERY=40 EXAMPLE_STEP_MS=30 \
    WARDEN_HEAL_STORE_DIR=$D/stores PYTHONDONTWRITEBYTECODE=1 \
    setsid "$ROOT/target/debug/warden" --socket "$D/none.sock" run --nproc-per-node 4 \
    --rdzv-id "heal-repeat-$$-$i" --log-dir "$D/logs" -- "$PY" "$ROOT/examples/heal/ddp.py" \
    >"$D/launcher.txt" 2>&1 &
  L=$!
  pid=""
  for _ in $(seq 1 6000); do
    pid=$(awk '$2=="step" && $4=="rank" && $5=="1" && $3>=55 {print $7; exit}' "$LOG" 2>/dev/null || true)
    [ -n "$pid" ] && break
    kill -0 "$L" 2>/dev/null || break
    sleep 0.05
  done
  [ -n "$pid" ] && kill -9 "$pid"
  status=timeout
  for _ in $(seq 1 300); do
    if ! kill -0 "$L" 2>/dev/null; then wait "$L" && status=0 || status=$?; break; fi
    sleep 1
  done
  [ "$status" = timeout ] && kill -KILL -- "-$L" 2>/dev/null || true
  "$PY" - "$D" "$status" <<'PYEOF'
import sys
d, status = sys.argv[1], sys.argv[2]
rows = [l.split() for l in open(f"{d}/example.log")]
steps = [(float(f[0]), int(f[4]), int(f[6])) for f in rows if len(f) == 7 and f[1] == "step"]
digests = sorted({f[5] for f in rows if len(f) == 6 and f[1] == "done"})
old = next(p for _, r, p in steps if r == 1)
t = max(at for at, r, p in steps if r == 1 and p == old)
first = {}
for at, r, p in steps:
    if at > t and r not in first and (r != 1 or p != old):
        first[r] = at
back = f"{max(first.values()) - t:.3f}" if len(first) == 4 else "-"
blocked = "leaving with exit 75" in open(f"{d}/launcher.txt").read()
print(f"run {d.rsplit('/', 1)[-1]}: exit {status}, {'a survivor left blocked' if blocked else 'healed directly'}, "
      f"back in {back} s, digests {','.join(x[:12] for x in digests)}", flush=True)
PYEOF
done
