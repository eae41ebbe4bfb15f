#!/bin/sh
# warden's Slurm prolog: refuses this node to a job while wardend says the
# node is cordoned or FAILED, as NVIDIA's health-check prologs do. A prolog
# that exits non-zero makes slurmd drain the node ("Prolog error") and the
# job is requeued elsewhere.
#
#   slurm.conf:  Prolog=/etc/slurm/warden-prolog.sh   (or run it from your own prolog)
#
# It asks the local agent through `warden health --plugin` (exit 0 healthy
# or degraded, 1 cordoned or FAILED, 2 the agent cannot be reached).
# Settings, from the environment or from $WARDEN_SLURM_DEFAULTS
# (/etc/default/warden-slurm) when that file exists:
#   WARDEN              the warden CLI [/usr/local/bin/warden, else warden in PATH]
#   WARDEN_SOCKET       wardend's API socket [the CLI's default]
#   WARDEN_UNREACHABLE  accept | refuse: what to do when wardend does not
#                       answer [accept: a stopped agent must not drain the
#                       cluster; alert on it instead (deploy/prometheus)]
# Exit: 0 accepted, 1 refused. The reason goes to stderr (slurmd's log) and
# to syslog (tag warden-prolog).
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
job=${SLURM_JOB_ID:-?}

say() {
  echo "warden-prolog: $*" >&2
  command -v logger >/dev/null 2>&1 && logger -t warden-prolog -- "$*" 2>/dev/null
  return 0
}

line=$("$WARDEN" health --plugin 2>&1)
rc=$?
case $rc in
  0) exit 0 ;;
  1)
    say "refusing job $job on $node: $line (lift a cordon with \`warden uncordon\` after repair)"
    exit 1
    ;;
  *)
    if [ "${WARDEN_UNREACHABLE:-accept}" = refuse ]; then
      say "refusing job $job on $node: wardend did not answer (exit $rc): $line"
      exit 1
    fi
    say "accepting job $job on $node without a health check: wardend did not answer (exit $rc): $line"
    exit 0
    ;;
esac
