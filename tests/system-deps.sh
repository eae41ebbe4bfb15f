#!/usr/bin/env bash
# System packages warden needs on a fresh Debian machine, installed with
# apt-get when missing (as root, or through sudo); nothing is done when all
# is present. Used by examples/demo.sh (build) and tests/run-all.sh (build,
# test and container).
#   build: protoc and the protobuf well-known types, which etcd-client's
#          build script needs (protobuf-compiler, libprotobuf-dev), unless
#          PROTOC points at a protoc that has them.
#   test:  Debian's etcd-server, the real etcd that tests/coord.rs and
#          tests/multihost.rs start on free ports (tests/common/etcd.rs); its
#          system service is kept from starting. WARDEN_TEST_ETCD may name an
#          etcd binary instead. systemd-analyze (tests/deploy.rs verifies
#          the unit file).
#   slurm: Debian's slurmctld, slurmd, slurm-client and munge, for
#          tests/slurm.rs (a one-node cluster the test starts in a scratch
#          directory, with its own munge key); their system services are
#          kept from starting.
#   prometheus: promtool (Debian's prometheus; its service kept from
#          starting), which checks and unit-tests deploy/prometheus's alert
#          rules (tests/prometheus_rules.rs).
#   container: a container engine for tests/container.rs and
#          deploy/build-image.sh: Debian's docker.io when no docker engine
#          answers, started here (dockerd in the background, its log in
#          /var/log/warden-dockerd.log) when none runs; busybox-static (the
#          images' only tool, for the DaemonSet's init container).
set -euo pipefail
want_build=0 want_test=0 want_container=0 want_slurm=0 want_prometheus=0
for a in "$@"; do
  case $a in
    build) want_build=1 ;;
    test) want_test=1 ;;
    container) want_container=1 ;;
    slurm) want_slurm=1 ;;
    prometheus) want_prometheus=1 ;;
    *) echo "system-deps.sh: unknown group $a (expected build, test, container, slurm, prometheus)" >&2; exit 2 ;;
  esac
done
need=()
if ((want_container)); then
  [[ -x /bin/busybox ]] && ! ldd /bin/busybox >/dev/null 2>&1 || need+=(busybox-static)
  if ! docker info >/dev/null 2>&1 && ! command -v dockerd >/dev/null; then
    need+=(docker.io)
  fi
fi
if ((want_test)); then
  command -v etcd >/dev/null || [[ -n ${WARDEN_TEST_ETCD:-} ]] || need+=(etcd-server)
  command -v systemd-analyze >/dev/null || need+=(systemd)
fi
if ((want_slurm)); then
  [[ -x /usr/sbin/slurmctld ]] || need+=(slurmctld)
  [[ -x /usr/sbin/slurmd ]] || need+=(slurmd)
  command -v sbatch >/dev/null && command -v scontrol >/dev/null || need+=(slurm-client)
  [[ -x /usr/sbin/munged ]] || need+=(munge)
fi
if ((want_prometheus)); then
  command -v promtool >/dev/null || need+=(prometheus)
fi
if ((want_build)) && [[ -z ${PROTOC:-} ]]; then
  if ! command -v protoc >/dev/null; then
    need+=(protobuf-compiler libprotobuf-dev)
  else
    probe=$(mktemp -d)
    echo 'syntax = "proto3"; import "google/protobuf/descriptor.proto";' >"$probe/probe.proto"
    protoc -I"$probe" -o /dev/null "$probe/probe.proto" 2>/dev/null || need+=(libprotobuf-dev)
    rm -rf "$probe"
  fi
fi
if ((${#need[@]})); then
  sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  if ! command -v apt-get >/dev/null || { ((${#sudo[@]})) && ! command -v sudo >/dev/null; }; then
    echo "system-deps.sh: missing ${need[*]} (Debian package names) and cannot apt-get install them here;" >&2
    echo "install them, or set WARDEN_TEST_ETCD (an etcd 3.4+ binary) and PROTOC (a protoc with its include dir)" >&2
    exit 1
  fi
  # Keep the packages from starting their services (etcd, slurmctld, slurmd,
  # munge, prometheus; policy-rc.d 101: action forbidden); put back whatever
  # policy was there.
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null && "${sudo[@]}" chmod 0755 "$policy" && own_policy=1
  fi
  rc=0
  "${sudo[@]}" apt-get update -qq || rc=$?
  ((rc)) || "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" || rc=$?
  ((own_policy)) && "${sudo[@]}" rm -f "$policy"
  ((rc == 0)) || { echo "system-deps.sh: apt-get install ${need[*]} failed ($rc)" >&2; exit "$rc"; }
  if [[ -d /run/systemd/system ]]; then
    for unit in etcd slurmctld slurmd munge prometheus prometheus-node-exporter; do
      "${sudo[@]}" systemctl disable --now "$unit.service" >/dev/null 2>&1 || true
    done
  fi
fi
if ((want_container)) && ! docker info >/dev/null 2>&1; then
  sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  if [[ -d /run/systemd/system ]] && "${sudo[@]}" systemctl start docker 2>/dev/null; then
    echo "system-deps.sh: started docker.service" >&2
  else
    echo "system-deps.sh: starting dockerd (log: /var/log/warden-dockerd.log)" >&2
    "${sudo[@]}" sh -c 'setsid dockerd >/var/log/warden-dockerd.log 2>&1 </dev/null &'
  fi
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    echo "system-deps.sh: dockerd did not answer within 60s; its log:" >&2
    tail -20 /var/log/warden-dockerd.log >&2 || true
    exit 1
  fi
fi
