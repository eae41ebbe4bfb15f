#!/usr/bin/env bash
# The first step after an in-job restart of a torch.compile'd model (CPU,
# Inductor), with the compilation cache warden keeps in the agent's tier
# and without any cache, beside the first step ever (issue 32 point 3).
#
#   bash tests/bench/compile_cache.sh [WARDEN] [PYTHON]
#
# Each run: `warden run` (embedded agent) of tests/fixtures/compile_job.py,
# whose first attempt exits 3 after its first step; the launcher restarts it
# in job (a new process). "with the cache": warden's default (a fresh job id,
# so the first attempt is cold). "without": --compile-cache-max-gib 0 and
# TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 (torch's own /tmp cache off too).
# Prints a markdown table for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
WARDEN=${1:-target/release/warden}
PY=${2:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '[agent]\ntick = "50ms"\n[host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n[kmsg]\nenabled = false\n[nvml]\nenabled = false\n' >"$work/agent.toml"
one() { # NAME EXTRA_ARGS...
  local name=$1; shift
  "$WARDEN" --socket "$work/none.sock" run --nproc-per-node 1 --rdzv-id "cc-bench-$name-$$" --no-standby \
    --log-dir "$work/logs" --agent-config "$work/agent.toml" "$@" -- \
    "$PY" tests/fixtures/compile_job.py "$work/$name.jsonl" --exit-first-attempt >/dev/null 2>&1
}
(unset TORCHINDUCTOR_CACHE_DIR; one with)
(export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1; one without --compile-cache-max-gib 0)
"$PY" - "$work" <<'PY'
import json, sys
w = sys.argv[1]
rows = {n: [json.loads(l) for l in open(f"{w}/{n}.jsonl")] for n in ("with", "without")}
print("| first step of | compiled graphs (cache hits / misses) | first step | interpreter start to end of first step |")
print("|---|---|---|---|")
def row(label, r):
    print(f"| {label} | {r['hits']} / {r['misses']} | {r['first_step_s']:.2f} s | {r['start_to_first_step_s']:.2f} s |")
row("the job, ever (cold)", rows["with"][0])
row("attempt 1 after a crash, warden's cache in the tier", rows["with"][1])
row("attempt 1 after a crash, no cache", rows["without"][1])
print(f"\nlater steps (compiled): {rows['with'][1]['later_step_s'] * 1e3:.2f} ms")
PY
