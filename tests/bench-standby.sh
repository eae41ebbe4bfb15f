#!/usr/bin/env bash
# Warm against cold in-job restarts of a real torch job, side by side
# (docs/benchmarks.md, "Warm in-job restarts"): the plain DDP script
# tests/fixtures/torch_plain.py, 2 ranks (gloo, CPU), rank 1 exits with code
# 3 at step 60 of 70 (100 ms steps); each run times the crash (the rank's
# own time.time() before os._exit) to every rank's first step of the new
# attempt, on the host's wall clock. Alternates --no-standby and --standby.
#
#   bash tests/bench-standby.sh [RUNS]      (default 5; needs torch in $PYTHON)
#
# PYTHON defaults to .venv/bin/python (tests/torch-venv.sh makes it); WARDEN
# to target/release/warden, else target/debug/warden.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:-5}
python=${PYTHON:-$root/.venv/bin/python}
warden=${WARDEN:-$root/target/release/warden}
[ -x "$warden" ] || warden=$root/target/debug/warden
work=$(mktemp -d /tmp/warden-bench-standby.XXXXXX)
trap 'rm -rf "$work"' EXIT
printf '[agent]\ntick = "50ms"\n[host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n[kmsg]\nenabled = false\n[nvml]\nenabled = false\n' >"$work/agent.toml"

# One run: prints the seconds from the crash to every rank stepping again,
# and "warm" when the restarted ranks came from standbys.
one() {
  local mode=$1 job=$2
  env -u WARDEN_SOCKET "$warden" --socket "$work/none.sock" run "$mode" \
    --nproc-per-node 2 --rdzv-id "$job" --log-dir "$work/logs" \
    --agent-config "$work/agent.toml" -- "$python" "$root/tests/fixtures/torch_plain.py" \
    --steps 70 --step-ms 100 --exit-rank 1 --exit-step 60 --stamp >"$work/$job.out" 2>"$work/$job.err"
  awk -v warm="$(grep -c 'warm start from standby' "$work/$job.err" || true)" '
    /^\[rank 1\] exiting with code 3/ { for (i = 1; i <= NF; i++) if ($i ~ /^t=/) crash = substr($i, 3) }
    /^\[rank [01]\] step 1 restart=1 / { for (i = 1; i <= NF; i++) if ($i ~ /^t=/) { t = substr($i, 3); if (t > back) back = t } }
    END { printf "%.3f %s\n", back - crash, (warm == 2 ? "warm" : "cold") }' "$work/$job.out"
}

printf '%-4s %-22s %-22s\n' run 'cold (--no-standby)' 'warm (--standby)'
cold_all=() warm_all=()
for i in $(seq 1 "$runs"); do
  c=$(one --no-standby "cold-$i")
  w=$(one --standby "warm-$i")
  printf '%-4s %-22s %-22s\n' "$i" "$c" "$w"
  cold_all+=("${c%% *}") warm_all+=("${w%% *}")
done
median() { printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }
printf '%-4s %-22s %-22s\n' median "$(median "${cold_all[@]}") s" "$(median "${warm_all[@]}") s"
