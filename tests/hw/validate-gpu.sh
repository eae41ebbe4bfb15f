#!/usr/bin/env bash
# Hardware validation on a machine with NVIDIA GPUs (docs/hardware-validation.md).
#
# Starts the real wardend on its defaults (NVML on, the real driver) plus a
# socket and metrics in a scratch directory under /dev/shm, and records:
#   1. the machine: nvidia-smi, the driver, whether DCGM is installed;
#   2. what the agent reads: `warden health` (table and JSON), `warden info`,
#      the NVML metrics, `warden diag` (the pre-restart health gate);
#   3. a PyTorch job on the GPU (examples/train_torch.py) under `warden run`
#      using that wardend: rank 0 crashes at step 25, the agent decides, the
#      launcher waits for NVML to show the GPU released, respawns, and the
#      worker restores model and Adam state from the tier and checks them
#      tensor by tensor; then `warden ranks`, `warden incidents`,
#      `warden ckpt ls` and `warden goodput`.
# Everything goes to $OUT (default /tmp/warden-hw); exit status 0 only if
# the job finished and its restore checked out.
#
#   BIN=target/release PY=python3 bash tests/hw/validate-gpu.sh
#
# Needs: the release binaries in $BIN, a python with torch and the warden
# package importable (PYTHONPATH=client/python after building it).
set -u
OUT=${OUT:-/tmp/warden-hw}
BIN=$(cd "${BIN:-target/release}" && pwd)
PY=${PY:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/validate.log") 2>&1
step() { printf '\n### %s\n' "$*"; }

step machine
nvidia-smi
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,ecc.mode.current,power.limit \
    --format=csv
uname -r
nproc
step "DCGM installed?"
ls -l /usr/lib/x86_64-linux-gnu/libdcgm* /usr/lib64/libdcgm* /usr/local/dcgm 2>&1 | head
command -v nv-hostengine dcgmi || echo "no nv-hostengine / dcgmi on PATH"

gpus=$(nvidia-smi -L | grep -c '^GPU')
dir=$(mktemp -d /dev/shm/warden-hw.XXXXXX)
cat >"$dir/wardend.toml" <<EOF
[agent]
state_dir = "$dir/state"
[api]
socket = "$dir/w.sock"
[metrics]
listen = "127.0.0.1:19464"
[nvml]
expected_gpus = $gpus
[checkpoint]
dir = "$dir/ckpt"
EOF
step "wardend (real NVML, $gpus GPU(s) expected)"
RUST_LOG=info "$BIN/wardend" --config "$dir/wardend.toml" >"$OUT/wardend.log" 2>&1 &
agent=$!
trap 'kill $agent 2>/dev/null; wait $agent 2>/dev/null; rm -rf "$dir"' EXIT
export WARDEN_SOCKET="$dir/w.sock"
for _ in $(seq 100); do
    "$BIN/warden" info >/dev/null 2>&1 && break
    sleep 0.1
done
"$BIN/warden" info
# NVML is polled every few seconds: wait for the first poll's GPU rows.
for _ in $(seq 100); do
    "$BIN/warden" health --json 2>/dev/null | grep -q '"gpu0' && break
    sleep 0.2
done
"$BIN/warden" health
"$BIN/warden" health --json >"$OUT/health.json"
step "metrics (NVML)"
"$PY" -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:19464/metrics').read().decode())" \
    >"$OUT/metrics.txt"
grep -E '^warden_(gpu|nvml|component)' "$OUT/metrics.txt" | head -40
step "warden diag (pre-restart health gate)"
"$BIN/warden" diag
echo "diag exit $?"

step "PyTorch on the GPU under warden run: crash at step 25, in-job restart, restore"
PYTHONUNBUFFERED=1 "$BIN/warden" --socket "$WARDEN_SOCKET" run --nproc-per-node "$gpus" --max-restarts 2 \
    --rdzv-id hw-torch --log-dir "${LOGS:-/tmp/warden-hw-logs}" --summary-json "$OUT/summary.json" \
    -- "$PY" examples/train_torch.py --steps 40 --crash-at-step 25
run=$?
echo "warden run exit $run"
"$BIN/warden" incidents
"$BIN/warden" ckpt ls
"$BIN/warden" goodput
"$BIN/warden" health
ok=0
grep -q "digest ok" "$OUT/validate.log" || { echo "FAIL: no checked restore"; ok=1; }
[ "$run" = 0 ] || { echo "FAIL: warden run exited $run"; ok=1; }
exit $ok
