#!/usr/bin/env bash
# The first step after an in-job restart of a torch.compile'd model (CPU,
# Inductor), with the compilation cache warden keeps in the agent's tier
# and without any cache, beside the first step ever (issue 32 point 3).
#
#   bash tests/bench/compile_cache.sh [WARDEN] [PYTHON]
#
# Each run: `warden run` (embedded agent) of tests/fixtures/compile_job.py,
# whose first attempt exits 3 after its first step; the launcher restarts it
# in job (a new process). "warm": warden's defaults, a standby interpreter
# and the compile cache in the tier (a fresh job id, so the first attempt is
# cold). "cold": --no-standby, --compile-cache-max-gib 0 and
# TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 (torch's own /tmp cache off too): what
# new processes pay, as after a scheduler's requeue. The restart is timed
# from the crash (the first attempt's exit) to the end of the restarted
# worker's first step, across the processes by the wall clock.
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
  "$WARDEN" --socket "$work/none.sock" run --nproc-per-node 1 --rdzv-id "cc-bench-$name-$$" \
    --log-dir "$work/logs" --agent-config "$work/agent.toml" "$@" -- \
    "$PY" tests/fixtures/compile_job.py "$work/$name.jsonl" --exit-first-attempt >/dev/null 2>&1
}
(unset TORCHINDUCTOR_CACHE_DIR; one warm)
(export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1; one cold --no-standby --compile-cache-max-gib 0)
"$PY" - "$work" <<'PY'
import json, sys
w = sys.argv[1]
rows = {n: [json.loads(l) for l in open(f"{w}/{n}.jsonl")] for n in ("warm", "cold")}
print("| what | compiled graphs (cache hits / misses) | first step | crash to the end of the first step |")
print("|---|---|---|---|")
def row(label, r, back):
    print(f"| {label} | {r['hits']} / {r['misses']} | {r['first_step_s']:.2f} s | {back} |")
warm, cold = rows["warm"], rows["cold"]
row("the job's first start, ever (cold; interpreter start to end of first step)", warm[0], f"({warm[0]['start_to_first_step_s']:.2f} s)")
row("restart, warden: standby interpreter + compile cache in the tier", warm[1], f"{warm[1]['wall_first_step_end'] - warm[0]['wall_exit']:.2f} s")
row("restart, new process without standby or cache (as a requeue's)", cold[1], f"{cold[1]['wall_first_step_end'] - cold[0]['wall_exit']:.2f} s")
print(f"\nlater steps (compiled): {warm[1]['later_step_s'] * 1e3:.2f} ms")
print(json.dumps({"warm_restart_s": warm[1]["wall_first_step_end"] - warm[0]["wall_exit"],
                  "cold_restart_s": cold[1]["wall_first_step_end"] - cold[0]["wall_exit"],
                  "cold_start_s": warm[0]["start_to_first_step_s"]}))
PY
