#!/bin/sh
# warden's Slurm epilog, the prolog's partner: after each job it records the
# incidents warden diagnosed for the job, then checks the node's health
# again. A node that went FAILED or was cordoned during the job makes the
# epilog exit 1, and slurmd drains it ("Epilog error") before the next job
# lands (the agent's own drain, [slurm] enabled, names the incident).
#
#   slurm.conf:  Epilog=/etc/slurm/warden-epilog.sh   (or run it from your own epilog)
#
# The job's incidents are found when the job ran under `warden run` with the
# Slurm job id as its id (`warden run --rdzv-id "$SLURM_JOB_ID" ...`, or
# WARDEN_JOB_ID=$SLURM_JOB_ID); they go to stderr and syslog (tag
# warden-epilog). Settings as in prolog.sh: WARDEN, WARDEN_SOCKET,
# WARDEN_UNREACHABLE (accept | refuse), WARDEN_SLURM_DEFAULTS.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
defaults=${WARDEN_SLURM_DEFAULTS:-/etc/default/warden-slurm}
# shellcheck disable=SC1090
[ -r "$defaults" ] && . "$defaults"
if [ -z "${WARDEN:-}" ]; then
  WARDEN=/usr/local/bin/warden
  [ -x "$WARDEN" ] || WARDEN=warden
fi
[ -n "${WARDEN_SOCKET:-}" ] && export WARDEN_SOCKET
node=${SLURMD_NODENAME:-$(hostname -s)}
job=${SLURM_JOB_ID:-}

say() {
  echo "warden-epilog: $*" >&2
  command -v logger >/dev/null 2>&1 && logger -t warden-epilog -- "$*" 2>/dev/null
  return 0
}

if [ -n "$job" ]; then
  incidents=$("$WARDEN" incidents --job "$job" 2>/dev/null)
  if [ $? -eq 0 ] && ! printf '%s\n' "$incidents" | grep -qi '^no incidents'; then
    printf '%s\n' "$incidents" | while IFS= read -r l; do say "job $job on $node: $l"; done
  fi
fi

line=$("$WARDEN" health --plugin 2>&1)
rc=$?
case $rc in
  0) exit 0 ;;
  1)
    say "node $node unhealthy after job ${job:-?}: $line"
    exit 1
    ;;
  *)
    if [ "${WARDEN_UNREACHABLE:-accept}" = refuse ]; then
      say "node $node: wardend did not answer after job ${job:-?} (exit $rc): $line"
      exit 1
    fi
    exit 0
    ;;
esac
