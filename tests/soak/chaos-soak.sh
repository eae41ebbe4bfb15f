#!/usr/bin/env bash
# The chaos soak: tests/chaos.rs with many more agent kills (default 100),
# in a loop of runs if asked, printing each run's summary and a total.
#
#   bash tests/soak/chaos-soak.sh [KILLS] [RUNS]
#
# KILLS (default 100, at least 20) SIGKILLs of wardend per run under a real
# 4-rank Python job that saves every 4 steps; RUNS (default 1) runs, each
# with a fresh seed. WARDEN_CHAOS_SEED replays one run's schedule. The
# assertions are the test's own: every rank keeps stepping, no step held
# past two agent ticks, the job exits 0, every committed save restores
# byte-exact, nothing listed complete is corrupt. Exits non-zero on the
# first failing run, with its seed in the output.
#
# Needs what the system tests need: a Python with the warden package
# (WARDEN_TEST_PYTHON, else .venv/bin/python; tests/run-all.sh makes one).
set -euo pipefail

kills="${1:-100}"
runs="${2:-1}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [[ -z "${WARDEN_TEST_PYTHON:-}" && -x .venv/bin/python ]]; then
    export WARDEN_TEST_PYTHON="$root/.venv/bin/python"
fi

echo "chaos soak: $runs run(s) of $kills agent kills each"
cargo test --locked -p warden-cli --test chaos --no-run >/dev/null 2>&1 \
    || cargo test --locked -p warden-cli --test chaos --no-run

log="$(mktemp -t warden-chaos-soak.XXXXXX)"
trap 'rm -f "$log"' EXIT
total_kills=0 total_saves=0 total_committed=0 total_restored=0 worst_held=0
start=$(date +%s)
for run in $(seq 1 "$runs"); do
    if ! WARDEN_CHAOS_KILLS="$kills" cargo test --locked -q -p warden-cli --test chaos \
        -- --nocapture --test-threads 1 >"$log" 2>&1; then
        cat "$log"
        echo "chaos soak: run $run FAILED (its seed is in the output above)" >&2
        exit 1
    fi
    summary="$(grep '^chaos summary:' "$log")"
    echo "run $run: ${summary#chaos summary: }"
    field() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$summary"; }
    total_kills=$((total_kills + $(field kills)))
    total_saves=$((total_saves + $(field saves)))
    total_committed=$((total_committed + $(field committed)))
    total_restored=$((total_restored + $(field restored_exact) + $(field committed_incomplete_whole)))
    held=$(field max_held_ms)
    ((held > worst_held)) && worst_held=$held
done
# committed_lost is 0 by construction: a committed save that does not come
# back byte-exact fails its run (above), and the soak stops there.
echo "chaos soak total: runs=$runs kills=$total_kills saves=$total_saves committed=$total_committed" \
     "failed_saves=$((total_saves - total_committed)) committed_lost=0 verified_shards=$total_restored" \
     "max_held_ms=$worst_held wall_s=$(($(date +%s) - start))"
