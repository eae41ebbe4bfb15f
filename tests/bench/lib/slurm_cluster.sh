# A one-node Slurm cluster in a scratch directory, for the baseline benches
# (baseline_teardown.sh, baseline_requeue.sh): Debian's munged, slurmctld
# and slurmd (bash tests/system-deps.sh slurm), the machine its one node,
# every file under the scratch directory, nothing of the system's services.
# Sourced, as root:
#
#   source tests/bench/lib/slurm_cluster.sh
#   slurm_cluster_start WORK PYTHON JOB_NAME    # SLURM_CONF exported; idle node
#   free_port                                   # a free port on 127.0.0.1
#
# An EXIT trap cancels JOB_NAME's jobs, kills what still runs from WORK and
# the daemons, and removes WORK. Extra slurm.conf lines may be given in
# SLURM_CLUSTER_EXTRA before the call.

slurm_cluster_pids=()
slurm_cluster_work=
slurm_cluster_job=
slurm_cluster_py=

# A free TCP port on loopback, for the daemons and the benches' rendezvous.
free_port() { "$slurm_cluster_py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

slurm_cluster_cleanup() {
  # A run stopped half way (an error under set -e) may leave a job's
  # processes: cancelled while the controller answers, then anything still
  # running from the scratch directory killed.
  scancel --quiet --name "$slurm_cluster_job" 2>/dev/null || true
  pkill -KILL -f "$slurm_cluster_work/" 2>/dev/null || true
  for p in "${slurm_cluster_pids[@]}"; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
  for p in "${slurm_cluster_pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  done
  rm -rf "$slurm_cluster_work"
}

slurm_cluster_start() {
  local work=$1 py=$2 node cpus
  slurm_cluster_work=$work slurm_cluster_py=$py slurm_cluster_job=$3
  # First, so that a refusal below still removes the scratch directory.
  trap slurm_cluster_cleanup EXIT
  [[ $(id -u) -eq 0 ]] || { echo "slurm_cluster.sh: slurmd runs as root here; run as root" >&2; return 2; }
  export PATH=$PATH:/usr/sbin
  local bin
  for bin in munged slurmctld slurmd srun sbatch scontrol sinfo squeue; do
    command -v "$bin" >/dev/null || {
      echo "slurm_cluster.sh: no $bin (bash tests/system-deps.sh slurm)" >&2; return 2; }
  done
  mkdir -p "$work"/{munge,state,spool,log}
  chmod 700 "$work/munge"
  head -c 1024 /dev/urandom >"$work/munge/key"
  chmod 600 "$work/munge/key"
  node=$(hostname -s)
  cpus=$(nproc)
  cat >"$work/slurm.conf" <<CONF
ClusterName=wardenbench
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge/sock
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=2
${SLURM_CLUSTER_EXTRA:-}
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=bench Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  export SLURM_CONF=$work/slurm.conf
  setsid munged --foreground --force --socket="$work/munge/sock" --key-file="$work/munge/key" \
    --log-file="$work/log/munged.log" --pid-file="$work/munge/pid" --seed-file="$work/munge/seed" \
    >"$work/log/munged.out" 2>&1 &
  slurm_cluster_pids+=($!)
  # Disowned: the cleanup's kills are expected, not worth bash's report.
  disown
  for _ in $(seq 100); do [[ -S $work/munge/sock ]] && break; sleep 0.1; done
  setsid slurmctld -D -i -f "$SLURM_CONF" >"$work/log/slurmctld.out" 2>&1 &
  slurm_cluster_pids+=($!)
  disown
  setsid slurmd -D -f "$SLURM_CONF" >"$work/log/slurmd.out" 2>&1 &
  slurm_cluster_pids+=($!)
  disown
  for _ in $(seq 600); do
    [[ $(sinfo -h -N -o %t 2>/dev/null) == idle ]] && break
    sleep 0.1
  done
  [[ $(sinfo -h -N -o %t 2>/dev/null) == idle ]] || {
    echo "slurm_cluster.sh: the node never came up idle:" >&2
    tail -n 20 "$work/log/slurmctld.log" "$work/log/slurmd.log" >&2; return 1; }
}
