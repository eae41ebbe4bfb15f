#!/usr/bin/env bash
# Builds warden's wheel: the `warden` Python package (client/python, its
# native module) plus the `warden` and `wardend` binaries, which pip puts on
# the environment's PATH (the wheel's warden-<v>.data/scripts/). Installing
# it needs neither a Rust toolchain nor protoc:
#
#   bash deploy/build-wheel.sh [--out DIR] [--target TRIPLE] [--glibc X.Y]
#   pip install dist/warden-*.whl
#
# writes DIR/warden-<version>-cp39-abi3-manylinux_2_28_<arch>.whl
# (DIR: dist; one wheel for CPython 3.9 and later, abi3). Both the binaries
# and the extension are linked by zig (PyPI's ziglang) against glibc X.Y's
# symbols (default 2.28, manylinux_2_28: the client's memfd_create is 2.27's,
# Rust's standard library calls getrandom, 2.25's) whatever the host's glibc,
# so the wheel installs on any Linux with glibc X.Y or newer; auditwheel then checks
# every ELF file in the wheel against that manylinux policy and the script
# fails if the check does not pass. TRIPLE (default x86_64-unknown-linux-gnu)
# may be another *-unknown-linux-gnu target whose Rust standard library is
# installed (rustup target add TRIPLE); docs/operations.md says which.
#
# Needs cargo, python3 (3.9+, with venv) and protoc (installed here through
# tests/system-deps.sh build when missing). The build tools are pinned in
# deploy/wheel-requirements.txt and installed into a venv of their own,
# $CARGO_TARGET_DIR/wheel-tools (default target/wheel-tools); the extension
# builds in $CARGO_TARGET_DIR/wheel-extension (see below), the binaries in
# $CARGO_TARGET_DIR/<triple>/release.
set -euo pipefail

# Paths given are the caller's; the script then works from the repository root.
out= target=x86_64-unknown-linux-gnu glibc=2.28
while (($#)); do
  case $1 in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --target) target=$2; shift 2 ;;
    --glibc) glibc=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "build-wheel.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
root=$PWD
[[ -n $out ]] || out=$root/dist
if [[ ! $glibc =~ ^2\.([0-9]+)$ ]]; then
  echo "build-wheel.sh: --glibc wants 2.N (e.g. 2.28), not $glibc" >&2
  exit 2
fi
policy=manylinux_2_${BASH_REMATCH[1]}
arch=${target%%-*}
target_dir=$(realpath -m "${CARGO_TARGET_DIR:-target}")

bash tests/system-deps.sh build

# The build tools, pinned, in their own venv (reinstalled when the pins change).
tools=$target_dir/wheel-tools
if ! cmp -s deploy/wheel-requirements.txt "$tools/requirements.txt" 2>/dev/null; then
  rm -rf "$tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install --quiet --disable-pip-version-check -r deploy/wheel-requirements.txt
  cp deploy/wheel-requirements.txt "$tools/requirements.txt"
fi
# zig is found as `python3 -m ziglang` from the tools' venv.
export PATH=$tools/bin:$PATH
# The wheel's binaries carry symbols (a backtrace names functions) but no
# line tables (80 MB -> 14 MB each); the extension is stripped by maturin.
export CARGO_PROFILE_RELEASE_DEBUG=false

started=$SECONDS
echo "build-wheel.sh: wardend and warden for $target, glibc $glibc symbols (cargo zigbuild --release)" >&2
cargo-zigbuild zigbuild --release --locked --target "$target.$glibc" -p warden-cli --bins
bin_dir=$target_dir/$target/release

# The binaries go in as the wheel's scripts: maturin packs
# <module-name>.data/ next to pyproject.toml as the wheel's .data directory.
# It exists only while maturin runs, so that a source build
# (pip install ./client/python) stays the package alone.
data=$root/client/python/warden._native.data
rm -rf "$data"
trap 'rm -rf "$data"' EXIT
mkdir -p "$data/scripts"
install -m 0755 "$bin_dir/wardend" "$bin_dir/warden" "$data/scripts/"

mkdir -p "$out"
rm -f "$out"/warden-*.whl
echo "build-wheel.sh: the wheel (maturin build --release --zig --compatibility $policy)" >&2
# A target directory of its own: maturin's zig linker wrapper is not
# cargo-zigbuild's, and the linker is part of cargo's fingerprint, so in one
# directory each build would throw away the other's common crates and a
# second run would rebuild everything (measured: docs/operations.md).
CARGO_TARGET_DIR=$target_dir/wheel-extension \
  maturin build --release --locked --zig --compatibility "$policy" --target "$target" \
  -m client/python/Cargo.toml --out "$out"
rm -rf "$data"
echo "build-wheel.sh: built in $((SECONDS - started))s" >&2

wheel=$(ls "$out"/warden-*.whl)
# auditwheel looks at every ELF file in the wheel (the extension and both
# binaries): their libraries and symbol versions must all be in the policy.
report=$(auditwheel show "$wheel")
echo "$report"
# (It wraps its lines: compare with the whitespace folded.)
if ! grep -q "consistent with the following platform tag: \"${policy}_$arch\"" <<<"$(tr -s ' \n' '  ' <<<"$report")"; then
  echo "build-wheel.sh: auditwheel does not place $wheel in ${policy}_$arch" >&2
  exit 1
fi
python3 -c 'import sys, zipfile
for i in zipfile.ZipFile(sys.argv[1]).infolist():
    if i.file_size > 100000: print("%8.1f MB  %s" % (i.file_size / 1e6, i.filename))' "$wheel"
echo "$wheel"
