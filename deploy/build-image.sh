#!/usr/bin/env bash
# Builds warden's container images where no registry is reachable: no base
# image is pulled. The runtime image is the release binaries, the shared
# libraries they link against (as ldd resolves them on this machine) and a
# statically linked busybox (only for `busybox cp` in the DaemonSet's init
# container; there is no /bin/sh), packed into a tarball and imported into
# the engine with `docker import`. It is the same image as the Containerfile's
# runtime stage builds for users with a registry: non-root (uid 65532),
# entrypoint wardend, socket under /run/warden, state under /var/lib/warden.
#
#   deploy/build-image.sh [--bin-dir DIR] [--tag TAG]
#       the runtime image (default tag warden:dev) from DIR/wardend and
#       DIR/warden (default target/release, built first if missing).
#   deploy/build-image.sh --trainer TAG --python PY [--tag BASE]
#       also a trainer image: the runtime image's files plus PY's
#       interpreter, its standard library and the `warden` package installed
#       in PY's environment (e.g. .venv/bin/python after
#       `pip install ./client/python`), and examples/train.py as
#       /app/train.py; entrypoint `warden run`.
#   --save FILE: also write the runtime image's tarball to FILE (to load
#       it elsewhere with `docker import`).
#
# Prints the image sizes. Needs docker (an engine running), ldd, tar, strip, and
# busybox-static (/bin/busybox; tests/system-deps.sh container installs it).
set -euo pipefail

# Paths given are the caller's; the script then works from the repository root.
bin_dir= tag=warden:dev trainer= python= save=
while (($#)); do
  case $1 in
    --bin-dir) bin_dir=$(realpath -m "$2"); shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --trainer) trainer=$2; shift 2 ;;
    --python) if [[ $2 == */* ]]; then python=$(realpath -s -m "$2"); else python=$(command -v "$2"); fi; shift 2 ;;
    --save) save=$(realpath -m "$2"); shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "build-image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
[[ -n $bin_dir ]] || bin_dir=target/release
if [[ -n $trainer && -z $python ]]; then
  echo "build-image.sh: --trainer needs --python (an interpreter with the warden package installed)" >&2
  exit 2
fi
if [[ ! -x $bin_dir/wardend || ! -x $bin_dir/warden ]]; then
  if [[ $bin_dir == target/release ]]; then
    cargo build --release --locked -p warden-cli
  else
    echo "build-image.sh: no wardend and warden in $bin_dir" >&2
    exit 1
  fi
fi
busybox=$(command -v busybox || true)
[[ -n $busybox ]] || busybox=/bin/busybox
if [[ ! -x $busybox ]] || ldd "$busybox" >/dev/null 2>&1; then
  echo "build-image.sh: needs a statically linked busybox (Debian: busybox-static; bash tests/system-deps.sh container)" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# copy_libs ROOT FILE...: the shared libraries FILE needs, at the paths the
# loader found them on this machine (the loader itself included).
copy_libs() {
  local root=$1
  shift
  local f lib
  for f in "$@"; do
    { ldd "$f" 2>/dev/null || true; } | { grep -oE '/[^ ]+' || true; } | while read -r lib; do
      [[ -e $root$lib ]] && continue
      mkdir -p "$root$(dirname "$lib")"
      cp -L "$lib" "$root$lib"
    done
  done
}

# The runtime tree: binaries, their libraries, users, writable directories.
runtime_tree() {
  local root=$1
  mkdir -p "$root"/{usr/local/bin,bin,etc,tmp,run/warden,var/lib/warden,dev,proc,sys}
  # Debug line tables off (80 MB -> 14 MB each); symbols stay, so a
  # backtrace still names functions.
  strip --strip-debug -o "$root/usr/local/bin/wardend" "$bin_dir/wardend"
  strip --strip-debug -o "$root/usr/local/bin/warden" "$bin_dir/warden"
  install -m 0755 "$busybox" "$root/bin/busybox"
  copy_libs "$root" "$root/usr/local/bin/wardend" "$root/usr/local/bin/warden"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nwarden:x:65532:65532:warden:/var/lib/warden:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nwarden:x:65532:\n' >"$root/etc/group"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  chmod 1777 "$root/tmp"
}

# pack ROOT TAG CHANGES...: ROOT as an image.
pack() {
  local root=$1 name=$2
  shift 2
  local args=()
  for c in "$@"; do args+=(--change "$c"); done
  tar --numeric-owner --owner=0 --group=0 --exclude=./run/warden --exclude=./var/lib/warden \
    -C "$root" -cf "$work/$(basename "$root").tar" .
  # The warden user owns its directories (a tar can set that without root).
  tar --numeric-owner --owner=65532 --group=65532 -C "$root" -rf "$work/$(basename "$root").tar" ./run/warden ./var/lib/warden
  local old
  old=$(docker image inspect --format '{{.Id}}' "$name" 2>/dev/null || true)
  docker import "${args[@]}" "$work/$(basename "$root").tar" "$name" >/dev/null
  # The image this tag named before, now untagged: gone, unless a container
  # still uses it.
  if [[ -n $old && $old != "$(docker image inspect --format '{{.Id}}' "$name")" ]]; then
    docker rmi "$old" >/dev/null 2>&1 || true
  fi
}

common_changes=(
  "USER 65532:65532"
  "ENV PATH=/usr/local/bin:/usr/bin:/bin"
  "ENV RUNTIME_DIRECTORY=/run/warden"
  "ENV STATE_DIRECTORY=/var/lib/warden"
  "ENV WARDEN_SOCKET=/run/warden/wardend.sock"
  "WORKDIR /var/lib/warden"
  "LABEL org.opencontainers.image.source=https://github.com/warden/warden"
)

runtime_tree "$work/runtime"
pack "$work/runtime" "$tag" "${common_changes[@]}" \
  'ENTRYPOINT ["/usr/local/bin/wardend"]' \
  'CMD []'
[[ -z $save ]] || cp "$work/runtime.tar" "$save"

if [[ -n $trainer ]]; then
  root=$work/trainer
  runtime_tree "$root"
  # The interpreter (not the venv's link to it), its standard library (no
  # tests, no tkinter, no idle, no site-packages of its own) and the
  # extension modules' libraries; then the venv's warden package.
  read -r exe base ver site < <("$python" -c 'import sys, sysconfig; print(sys._base_executable, sys.base_prefix, "%d.%d" % sys.version_info[:2], sysconfig.get_paths()["purelib"])')
  exe=$(readlink -f "$exe")
  stdlib=$base/lib/python$ver
  [[ -d $stdlib ]] || { echo "build-image.sh: no standard library at $stdlib" >&2; exit 1; }
  mkdir -p "$root/usr/local/bin" "$root/usr/local/lib/python$ver/site-packages" "$root/app"
  install -m 0755 "$exe" "$root/usr/local/bin/python$ver"
  ln -s "python$ver" "$root/usr/local/bin/python3"
  ln -s "python$ver" "$root/usr/local/bin/python"
  tar -C "$stdlib" --exclude=./site-packages --exclude=./test --exclude=./idlelib \
    --exclude=./tkinter --exclude=./turtledemo --exclude=./ensurepip --exclude='./config-*' \
    -cf - . | tar -C "$root/usr/local/lib/python$ver" -xf -
  copy_libs "$root" "$root/usr/local/bin/python$ver" "$root/usr/local/lib/python$ver"/lib-dynload/*.so
  found=0
  for d in "$site"/warden "$site"/warden-*.dist-info; do
    [[ -e $d ]] || continue
    cp -a "$d" "$root/usr/local/lib/python$ver/site-packages/"
    found=1
  done
  ((found)) || { echo "build-image.sh: the warden package is not installed for $python (pip install ./client/python)" >&2; exit 1; }
  # The package's native extension links what the wheel was built against
  # (libpthread.so.0 for a manylinux_2_28 wheel): its libraries too.
  copy_libs "$root" "$root/usr/local/lib/python$ver/site-packages/warden"/*.so
  install -m 0644 examples/train.py "$root/app/train.py"
  pack "$root" "$trainer" "${common_changes[@]}" \
    "ENV PYTHONUNBUFFERED=1" \
    'ENTRYPOINT ["/usr/local/bin/warden", "run"]' \
    'CMD ["--", "python3", "/app/train.py"]'
fi

size() { docker image inspect --format '{{.Size}}' "$1" | awk -v t="$1" '{printf "%s: %.1f MB\n", t, $1 / 1e6}'; }
size "$tag"
[[ -z $trainer ]] || size "$trainer"
