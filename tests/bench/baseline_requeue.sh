#!/usr/bin/env bash
# The baseline's requeue (the planner's `baseline.requeue_s`, issue 32
# point 4): once a job launched the usual way, without warden, has failed and
# been torn down (`baseline_teardown.sh` times that part), how long until the
# scheduler runs it again. The next parts, the new processes' start-up and
# the restore from durable storage, are the planner's own inputs and are not
# in this figure.
#
#   bash tests/bench/baseline_requeue.sh [RUNS] [PYTHON]      (as root)
#
# On a one-node Slurm cluster this script starts in a scratch directory
# (tests/bench/lib/slurm_cluster.sh), two ways a failed job is run again
# that training scripts use and the one warden's exit 85 asks for, each
# timed by the wall clock from its failed step's `srun` returning (the job
# torn down) to the job's batch script running again, its first line:
#   - requeue: a `sbatch --requeue` job whose script, when its step fails,
#     requeues itself (`scontrol requeue $SLURM_JOB_ID`, as submitit and
#     many launch scripts do); the requeued job runs the same script again
#     (SLURM_RESTART_COUNT 1);
#   - exit code: the script exits with a code slurm.conf's RequeueExit
#     names (85 here: `warden run`'s "preempted: requeue me",
#     docs/operations.md), and Slurm requeues the job itself;
#   - dependency: a second job submitted beforehand with
#     `--dependency=afternotok:FIRST`, which the scheduler starts when the
#     first fails.
# The failed step is `srun --kill-on-bad-exit=1` of a task that exits 1: what
# failed does not change the scheduler's part.
#
# What it is not: a busy controller, a queue with other jobs, or a job of
# many nodes waiting for its allocation (a requeued 2,048-node job must find
# 2,048 free nodes, or wait for them): an idle controller with its one node
# free is the floor of what a requeue costs, so the baseline is not made to
# look worse than it is. Nor Slurm's own requeue after a node failure
# (JobRequeue), which on one node would wait for the failed node itself.
# Prints a markdown table for docs/benchmarks.md.
set -euo pipefail
shopt -s inherit_errexit
# $EPOCHREALTIME's decimal point is the locale's: Python reads a dot.
export LC_ALL=C
cd "$(dirname "$0")/../.."
RUNS=${1:-5}
PY=${2:-python3}
work=$(mktemp -d /tmp/warden-requeue-XXXXXX)
source tests/bench/lib/slurm_cluster.sh
SLURM_CLUSTER_EXTRA=RequeueExit=85
slurm_cluster_start "$work" "$PY" requeue

# The job's script. First run: a step that fails, its end written down, then
# the way back asked for ($mode). Second run: its start written down.
cat >"$work/job.sh" <<'EOF'
#!/usr/bin/env bash
mode=$1 marks=$2
if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 || $mode == second ]]; then
  echo "$EPOCHREALTIME" >"$marks.started"
  exit 0
fi
srun --kill-on-bad-exit=1 --ntasks 1 bash -c 'exit 1' || true
echo "$EPOCHREALTIME" >"$marks.failed"
case $mode in
  requeue)
    scontrol requeue "$SLURM_JOB_ID"
    # The requeue ends this script; it must not exit first.
    sleep 600 ;;
  exit85) exit 85 ;;
esac
exit 1
EOF
chmod +x "$work/job.sh"

# Waits (at most 10 minutes) for FILE to be written; its content.
wait_for() {
  local f=$1
  for _ in $(seq 6000); do
    [[ -s $f ]] && { cat "$f"; return 0; }
    sleep 0.1
  done
  echo "baseline_requeue.sh: $f never came" >&2
  squeue -a -o '%i %j %T %r %S' >&2 || true
  tail -n 20 "$work/log/slurmctld.log" >&2
  return 1
}
# The seconds from the failed step (MARKS.failed) to the script running
# again (MARKS.started), once both are written.
since_failure() {
  local failed started
  failed=$(wait_for "$1.failed")
  started=$(wait_for "$1.started")
  "$PY" -c "print(f'{$started - $failed:.3f}')"
}

# One requeued job: MODE as the way back; since_failure of its marks.
requeued() {
  local mode=$1 marks=$work/$1-$2 id
  id=$(sbatch --parsable --requeue --job-name requeue --output "$marks.out" \
    "$work/job.sh" "$mode" "$marks")
  since_failure "$marks"
  scancel --quiet "$id" 2>/dev/null || true
}

requeue_rows=() exit_rows=() dep_rows=()
for run in $(seq "$RUNS"); do
  requeue_rows+=("$(requeued requeue "$run")")
  exit_rows+=("$(requeued exit85 "$run")")

  marks=$work/dep-$run
  first=$(sbatch --parsable --job-name requeue --output "$work/dep-$run.out" \
    "$work/job.sh" first "$marks")
  sbatch --parsable --job-name requeue --dependency=afternotok:"$first" \
    --output "$work/dep2-$run.out" "$work/job.sh" second "$marks" >/dev/null
  dep_rows+=("$(since_failure "$marks")")
  # Both jobs gone before the next run, so that each starts on an idle node.
  for _ in $(seq 600); do [[ -z $(squeue -h --name requeue) ]] && break; sleep 0.1; done
  echo "run $run: requeue ${requeue_rows[-1]} s, exit 85 ${exit_rows[-1]} s, dependency ${dep_rows[-1]} s" >&2
done
source tests/bench/lib/stats.sh
echo "| way back | failed step's srun returned to the batch script running again | runs | median | range |"
echo "|---|---|---|---|---|"
echo "| sbatch --requeue, the script's own scontrol requeue | requeued job (SLURM_RESTART_COUNT 1) | $RUNS | $(median "${requeue_rows[@]}") s | $(range "${requeue_rows[@]}") s |"
echo "| sbatch --requeue, the script's exit 85 with RequeueExit=85 | requeued job | $RUNS | $(median "${exit_rows[@]}") s | $(range "${exit_rows[@]}") s |"
echo "| a second job, --dependency=afternotok | second job | $RUNS | $(median "${dep_rows[@]}") s | $(range "${dep_rows[@]}") s |"
echo "slurm $(sinfo -V)" >&2
