#!/usr/bin/env bash
# Makes the two torchft 0.2.0 venvs of the heal bench (tests/bench/heal.py),
# each with torch from .venv (a .pth line) and tests/bench/requirements.txt
# installed --no-deps (docs/dependencies.md):
#   target/bench-torchft-stock    torchft 0.2.0 as the registry ships it
#   target/bench-torchft-patched  the same with one line added to its DDP comm
#                                 hook (torchft/ddp.py, DistributedDataParallel._comm_hook)
#
# The patch: in 0.2.0 the hook ends with
#     work.wait()
#     fut = work.get_future()
#     fut = cast("_ManagedFuture[torch.Tensor]", fut)
#     assert fut._fut
#     return fut._fut
# When the all-reduce fails (a peer group died), _ManagedWork.wait() catches
# gloo's error and reports it to the manager, but the future chain it would
# have set up is never made, so `fut._fut` is None and the assert raises out
# of DDP's backward; after an earlier error in the step, allreduce() returns a
# _DummyWork, whose plain torch Future has no `_fut` at all. Either way the
# surviving group's process dies. The one line, before the assert, returns the
# bucket as it is instead (its values are discarded: the manager has recorded
# the error, so should_commit() says no and the optimizer does not step):
#     if getattr(fut, "_fut", None) is None: f = torch.futures.Future(); f.set_result(bucket.buffer()); return f
# (torchft's main branch still has the assert as of 73dafea, 2025-10-21.)
#
#   bash tests/bench/torchft_venv.sh        (needs .venv with torch: the README)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${WARDEN_TEST_PYTHON:-$ROOT/.venv/bin/python}
TORCH_SITE=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
for kind in stock patched; do
  V=$ROOT/target/bench-torchft-$kind
  if [ ! -x "$V/bin/torchft_lighthouse" ]; then
    rm -rf "$V"
    "$PY" -m venv "$V"
    echo "$TORCH_SITE" >"$("$V/bin/python" -c 'import site; print(site.getsitepackages()[0])')/torch-from-dot-venv.pth"
    "$V/bin/pip" install -q --no-deps -r "$ROOT/tests/bench/requirements.txt"
  fi
done
HOOK=$("$ROOT/target/bench-torchft-patched/bin/python" -c 'import torchft.ddp as d; print(d.__file__)')
if ! grep -q 'if getattr(fut, "_fut", None) is None:' "$HOOK"; then
  "$ROOT/target/bench-torchft-patched/bin/python" - "$HOOK" <<'PYEOF'
import sys
path = sys.argv[1]
src = open(path).read()
old = "        assert fut._fut\n        return fut._fut\n"
assert src.count(old) == 1, "torchft/ddp.py is not 0.2.0's: the comm hook's assert was not found"
new = ('        if getattr(fut, "_fut", None) is None: f = torch.futures.Future(); f.set_result(bucket.buffer()); return f\n'
       + old)
open(path, "w").write(src.replace(old, new))
PYEOF
  rm -rf "$(dirname "$HOOK")/__pycache__"
fi
for kind in stock patched; do
  "$ROOT/target/bench-torchft-$kind/bin/python" -c 'import torchft, torchft.ddp, inspect; print("'$kind'", torchft.__file__, "patched" if "getattr(fut" in inspect.getsource(torchft.ddp) else "stock")'
done
