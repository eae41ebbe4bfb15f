#!/usr/bin/env bash
# Runs every test of the project on a fresh machine: installs what the tests
# need (inside the clone where it can), then formatting and lint checks, the
# Rust unit, integration and system tests, and the Python package's tests.
# .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { printf '\n==> %s (%ss)\n' "$*" "$((SECONDS - started))"; }

step "toolchain"
cargo --version
rustup component list --installed 2>/dev/null | grep -qE '^(rustfmt|clippy)' || rustup component add rustfmt clippy

step "system packages: etcd (multi-host tests), protoc (etcd-client's build)"
# Debian's etcd-server is the real etcd that tests/coord.rs starts, one per
# test on free ports (tests/common/etcd.rs); no system etcd service is left
# running. etcd-client's build script needs protoc and the well-known types
# (google/protobuf/*.proto): protobuf-compiler and libprotobuf-dev, unless
# PROTOC points at a protoc that has them. Skipped when all is present.
need=()
command -v etcd >/dev/null || [[ -n ${WARDEN_TEST_ETCD:-} ]] || need+=(etcd-server)
if [[ -z ${PROTOC:-} ]]; then
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
    echo "run-all.sh: missing ${need[*]} (Debian package names) and cannot apt-get install them here;" >&2
    echo "install them, or set WARDEN_TEST_ETCD (an etcd 3.4+ binary) and PROTOC (a protoc with its include dir)" >&2
    exit 1
  fi
  # Keep the package from starting its etcd service (policy-rc.d 101: action
  # forbidden); put back whatever policy was there.
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null && "${sudo[@]}" chmod 0755 "$policy" && own_policy=1
  fi
  rc=0
  "${sudo[@]}" apt-get update -qq || rc=$?
  ((rc)) || "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" || rc=$?
  ((own_policy)) && "${sudo[@]}" rm -f "$policy"
  ((rc == 0)) || { echo "run-all.sh: apt-get install ${need[*]} failed ($rc)" >&2; exit "$rc"; }
  if [[ -d /run/systemd/system ]]; then
    "${sudo[@]}" systemctl disable --now etcd.service >/dev/null 2>&1 || true
  fi
fi
etcd --version 2>/dev/null | head -1 || true
protoc --version 2>/dev/null || true

step "python venv (.venv, inside the clone) with the warden package and pytest"
# The system tests drive real Python ranks through this interpreter
# (WARDEN_TEST_PYTHON); pip builds the package with maturin from PyPI.
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet pytest
.venv/bin/pip install --quiet ./client/python
export WARDEN_TEST_PYTHON="$PWD/.venv/bin/python"

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test (unit, integration, system tests with the real binaries)"
cargo test --workspace --locked

step "python tests (client/python/tests)"
.venv/bin/python -m pytest -q client/python/tests

step "done in $((SECONDS - started))s"
