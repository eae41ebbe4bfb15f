#!/usr/bin/env bash
# The baseline's crash to teardown (the planner's `baseline.crash_detection_s`,
# issue 32 point 4): how long a job launched the usual way, without warden,
# takes from one worker's crash to the whole job gone, so that the scheduler
# can requeue it.
#
#   bash tests/bench/baseline_teardown.sh [RUNS] [PYTHON]      (as root)
#
# The job: `srun --nodes 1 --ntasks 2 --kill-on-bad-exit=1`, each task one
# node of `torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 0` (static
# rendezvous at 127.0.0.2), on a one-node Slurm cluster this script starts in
# a scratch directory (Debian's munged, slurmctld, slurmd: bash
# tests/system-deps.sh slurm), the machine its one node. The workers step
# every 50 ms without a collective, as ranks blocked in NCCL's collectives
# do when a peer dies: nothing but torchrun and Slurm ends them. At step 40,
# node 1's local rank 1 writes its time.time() and kills itself (SIGKILL,
# as a segfault or the OOM killer would). Timed, by the wall clock: that
# crash to `srun` returning (every task gone; Slurm's step over), and, on
# the way, to the crashed node's torchrun exit (its monitor saw the dead
# worker and stopped the others) from its own log. Beside it, in the same
# run: `torchrun --standalone --nproc-per-node 2 --max-restarts 0`, one
# node, crash to torchrun's exit.
#
# What it is not: a job of many nodes (slurmctld's kill fans out over a
# tree; nodes' stepds act at once), a busy controller, or a host lost
# outright (no torchrun is left to exit: Slurm notices after its
# SlurmdTimeout, minutes by default). Prints a markdown table for
# docs/benchmarks.md.
set -euo pipefail
# $EPOCHREALTIME's decimal point is the locale's: Python reads a dot.
export LC_ALL=C
cd "$(dirname "$0")/../.."
RUNS=${1:-5}
PY=${2:-.venv/bin/python}
TORCHRUN=$(dirname "$PY")/torchrun
[[ -x $TORCHRUN ]] || { echo "baseline_teardown.sh: no torchrun beside $PY" >&2; exit 2; }
work=$(mktemp -d /tmp/warden-teardown-XXXXXX)
source tests/bench/lib/slurm_cluster.sh

# The worker: steps of 50 ms, no collective; the crash where told.
cat >"$work/worker.py" <<'EOF'
import os, signal, sys, time
node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
crash_node, crash_at, mark = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
print(f"started node {node} local {local}", flush=True)
for step in range(1, 100000):
    time.sleep(0.05)
    if node == crash_node and local == 1 and step == crash_at:
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
EOF

slurm_cluster_start "$work" "$PY" teardown

now() { echo "$EPOCHREALTIME"; }
slurm_rows=() alone_rows=() node_rows=()
for run in $(seq "$RUNS"); do
  # Two nodes under srun.
  port=$(free_port)
  mark=$work/crash-$run
  cat >"$work/task.sh" <<EOF
#!/usr/bin/env bash
"$TORCHRUN" --nnodes 2 --node-rank "\$SLURM_PROCID" --nproc-per-node 2 --max-restarts 0 \
  --master-addr 127.0.0.2 --master-port $port --local-addr 127.0.0.\$((2 + SLURM_PROCID)) \
  "$work/worker.py" 1 40 "$mark" >"$work/torchrun-$run-\$SLURM_PROCID.log" 2>&1
rc=\$?
echo "\$EPOCHREALTIME" >"$work/exit-$run-\$SLURM_PROCID"
exit \$rc
EOF
  chmod +x "$work/task.sh"
  srun --nodes 1 --ntasks 2 --oversubscribe --kill-on-bad-exit=1 --job-name teardown \
    "$work/task.sh" >"$work/srun-$run.log" 2>&1 || true
  ended=$(now)
  [[ -s $mark ]] || { echo "run $run: no crash:" >&2; cat "$work/srun-$run.log" "$work"/torchrun-"$run"-*.log >&2; exit 1; }
  crash=$(cat "$mark")
  slurm_rows+=("$("$PY" -c "print(f'{$ended - $crash:.3f}')")")
  # The crashed node's torchrun, as its task saw it exit.
  node_end=$(cat "$work/exit-$run-1")
  node_rows+=("$("$PY" -c "print(f'{$node_end - $crash:.3f}')")")
  # One node, torchrun alone.
  mark1=$work/crash1-$run
  GROUP_RANK=0 "$TORCHRUN" --standalone --nproc-per-node 2 --max-restarts 0 \
    "$work/worker.py" 0 40 "$mark1" >"$work/alone-$run.log" 2>&1 || true
  ended=$(now)
  [[ -s $mark1 ]] || { echo "run $run (alone): no crash:" >&2; cat "$work/alone-$run.log" >&2; exit 1; }
  alone_rows+=("$("$PY" -c "print(f'{$ended - $(cat "$mark1"):.3f}')")")
  echo "run $run: srun ${slurm_rows[-1]} s (the crashed node's torchrun ${node_rows[-1]} s), torchrun alone ${alone_rows[-1]} s" >&2
done
source tests/bench/lib/stats.sh
echo "| launch | crash to | runs | median | range |"
echo "|---|---|---|---|---|"
echo "| srun --kill-on-bad-exit=1, 2 tasks of torchrun --nnodes 2 --max-restarts 0 | srun returned (job step over) | $RUNS | $(median "${slurm_rows[@]}") s | $(range "${slurm_rows[@]}") s |"
echo "| the same | the crashed node's torchrun exited | $RUNS | $(median "${node_rows[@]}") s | $(range "${node_rows[@]}") s |"
echo "| torchrun --standalone --nproc-per-node 2 --max-restarts 0 | torchrun exited | $RUNS | $(median "${alone_rows[@]}") s | $(range "${alone_rows[@]}") s |"
echo "srun's last lines (run $RUNS):" >&2
tail -n 5 "$work/srun-$RUNS.log" >&2 || true
