"""On a GPU: warden.heal's rng="shared" carries the CUDA generator's state.

A healed rank that draws dropout masks on a GPU must draw what its source
would have; the CPU generator alone does not give that. Snapshots the loop
state, draws on the GPU, applies the snapshot, draws again: the two draws
must be equal (and a draw without the apply must differ, so the check can
fail). Run by tests/hw/gpu-saves-heal.sh (PARTS=rng); exit 0 when it holds.
"""

import sys

import torch

import warden.heal

if not torch.cuda.is_available():
    sys.exit("heal_cuda_rng.py: torch sees no GPU")
model = torch.nn.Linear(4, 4).cuda()
state = warden.heal.declare(model, None, rng="shared")
torch.cuda.manual_seed(5)
torch.rand(3, device="cuda")
snap = state._snapshot_loop()
if "cuda" not in snap:
    sys.exit("FAIL: the shared loop state carries no CUDA generator state")
first = torch.rand(8, device="cuda")
other = torch.rand(8, device="cuda")
state._apply_loop(snap)
again = torch.rand(8, device="cuda")
ok = torch.equal(first, again) and not torch.equal(first, other)
print(f"cuda rng carried: {'ok' if ok else 'FAIL'} (first {first[:3].tolist()}, after apply {again[:3].tolist()})")
sys.exit(0 if ok else 1)
