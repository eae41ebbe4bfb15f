#!/usr/bin/env bash
# The GPU parts of issues 31 and 32 on a machine with one NVIDIA GPU
# (docs/hardware-validation.md), after tests/hw/validate-gpu.sh:
#   1. issue 32: the async save's stall against a plain cudaMemcpy (device
#      to host, into page-locked memory) of the same bytes, 64 MiB to 4 GiB,
#      and a GPU training step's time with an async save every 10 steps
#      (client/python/bench/async_save.py --device cuda);
#   2. issue 32: dcp.async_save with WardenStorageWriter against torch's
#      FileSystemWriter + DefaultStager (pinned, non-blocking) and cudaMemcpy;
#   3. issue 32: the async save tests on the GPU (PARTS=tests; not in the
#      default set): test_async_checkpoint.py, whose job puts its model and
#      tensors on the GPU where there is one and checks the shard byte for
#      byte after training changed them, and the DCP integration's tests;
#   4. issue 31: a heal of CUDA tensors over gloo: examples/heal/ddp.py with
#      EXAMPLE_DEVICE=cuda, 4 ranks sharing the one GPU, rank 1 SIGKILLed at
#      step 60 (tests/bench/heal.py): heal against checkpoint restart, and
#      the final digests against the fault-free run's, and where the heal's
#      time went (the launcher's start of the replacement, its CUDA context,
#      its resume);
#   5. issue 31: the same with examples/heal/hsdp.py (FSDP2 over a 2 x 2
#      mesh, CUDA tensors, gloo) (PARTS=hsdp);
#   6. issue 31: rng="shared" carries the CUDA generator (PARTS=rng,
#      tests/hw/heal_cuda_rng.py).
# One GPU cannot run a multi-rank NCCL job: the ranks share the GPU and talk
# over gloo, which copies CUDA tensors through the host.
#
#   BIN=<dir with warden> PY=python3 bash tests/hw/gpu-saves-heal.sh
#
# Each part has a time limit (PART_S, default 150 s) so one that hangs
# leaves the others their time; PARTS (default saves,steps,dcp,heal) picks
# them. Output: $OUT/bench.log, $OUT/heal.log and $OUT/tests.log.
set -u
OUT=${OUT:-/tmp/warden-hw}
BIN=$(cd "${BIN:-target/release}" && pwd)
PY=${PY:-python3}
PART_S=${PART_S:-150}
PARTS=${PARTS:-saves,steps,dcp,heal}
mkdir -p "$OUT"
work=$(mktemp -d /dev/shm/warden-gpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
step() { printf '\n### %s\n' "$*"; }

# A bench under `warden run` (the embedded agent's tier takes the shards);
# the worker's stdout is where the tables are.
bench() {
    local id=$1
    shift
    timeout "$PART_S" "$BIN/warden" --socket "$work/none.sock" run --nproc-per-node 1 --rdzv-id "$id" \
        --log-dir "$work/logs" -- "$PY" client/python/bench/async_save.py --device cuda "$@" \
        >"$work/$id.launcher" 2>&1
    echo "exit $?"
    cat "$work/logs/$id/attempt_0/rank_0.stdout.log"
    grep -q Traceback "$work/logs/$id/attempt_0/rank_0.stderr.log" &&
        sed -n '/Traceback/,$p' "$work/logs/$id/attempt_0/rank_0.stderr.log" | tail -30
    tail -3 "$work/$id.launcher"
}

has() { [[ ",$PARTS," == *",$1,"* ]]; }
{
    nvidia-smi --query-gpu=name,pci.bus_id,pcie.link.gen.current,pcie.link.width.current --format=csv
    if has saves; then
        step "async save stall against cudaMemcpy, and the step time with saves"
        bench gpu-async --sizes-mib 64,256,1024,4096 --repeat 4 --steps 50 --pairs 6 --batch 16384
    fi
    if has steps; then
        # Segments of 100 steps (10 saves): the drain at a segment's end,
        # one save's background, weighs a third of what it did in 30.
        step "the step time with saves, a longer step (batch 65536)"
        bench gpu-steps --sizes-mib 64 --repeat 2 --steps 100 --pairs 4 --batch 65536
        step "the same, the loss read each step (loss.item(), as a loop that logs it)"
        bench gpu-item --sizes-mib 64 --repeat 2 --steps 100 --pairs 4 --batch 65536 --item
        bench gpu-item16 --sizes-mib 64 --repeat 2 --steps 100 --pairs 4 --batch 16384 --item
    fi
    if has dcp; then
        step "dcp.async_save on the GPU"
        bench gpu-dcp --dcp --sizes-mib 64,256,1024 --repeat 4
    fi
} 2>&1 | tee "$OUT/bench.log"

if has tests; then
    step "the async save tests on the GPU" | tee "$OUT/tests.log"
    WARDEN_TEST_WARDEND="$BIN/wardend" PATH="$BIN:$PATH" timeout "$PART_S" "$PY" -m pytest -q -p no:cacheprovider \
        client/python/tests/test_async_checkpoint.py client/python/tests/test_integration_dcp.py 2>&1 |
        tee -a "$OUT/tests.log"
fi

if has heal; then
    step "heal of CUDA tensors over gloo (4 ranks on one GPU)" | tee "$OUT/heal.log"
    EXAMPLE_DEVICE=cuda PYTHONUNBUFFERED=1 timeout "$PART_S" "$PY" tests/bench/heal.py --runs 2 \
        --rows heal,checkpoint --warden "$BIN/warden" --python "$PY" 2>&1 | tee -a "$OUT/heal.log"
    echo "heal bench exit ${PIPESTATUS[0]}" | tee -a "$OUT/heal.log"
fi

if has hsdp; then
    step "heal of CUDA tensors over gloo, FSDP2 over a 2 x 2 mesh (4 ranks on one GPU)" | tee -a "$OUT/heal.log"
    EXAMPLE_DEVICE=cuda PYTHONUNBUFFERED=1 timeout "$PART_S" "$PY" tests/bench/heal.py --runs 1 --example hsdp \
        --rows heal,checkpoint --warden "$BIN/warden" --python "$PY" 2>&1 | tee -a "$OUT/heal.log"
    echo "hsdp heal bench exit ${PIPESTATUS[0]}" | tee -a "$OUT/heal.log"
fi

if has rng; then
    step "rng=shared carries the CUDA generator" | tee -a "$OUT/heal.log"
    timeout 60 "$PY" tests/hw/heal_cuda_rng.py 2>&1 | tee -a "$OUT/heal.log"
    echo "rng check exit ${PIPESTATUS[0]}" | tee -a "$OUT/heal.log"
fi
