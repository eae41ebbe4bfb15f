# A standby interpreter of `warden run` (launcher/src/standby.rs runs this
# source with `python -c`, so it needs nothing installed beyond the job's own
# Python). It imports the heavy modules ahead of time, says it is ready, and
# waits for its orders: then it becomes a rank of the job, as if started with
# `python script.py ARGS` or `python -m MODULE ARGS`.
#
# Protocol, on fd 0 (a Unix socket the launcher holds the other end of):
# - the standby writes b"R" once the preload list is imported and CUDA is
#   not initialized;
# - the launcher writes JSON objects, one a line: any number of
#   {"preload": "a?,b?"} (more modules, the workers' own imports as their
#   clients reported them: imported at once, in order), then the orders
#   {"argv", "env", "cwd"}, and shuts its side down; EOF with no orders
#   means "not needed": exit 0 quietly.
# Then fd 0 becomes /dev/null (a cold worker's stdin), os.environ is
# replaced by the rank's (putenv: native code and children see it too), and
# the script runs as __main__; its SystemExit and uncaught exceptions end the
# process as they would a cold one's. stdout and stderr were the rank's pipes
# from the start.
#
# sys.path: `python -c` puts the working directory first (''), so a
# `torch.py` (or `json.py`) planted in a shared working directory would run
# as the job's user at the preload. The launcher sets PYTHONSAFEPATH (3.11+
# then adds nothing); for older Pythons the entry is taken out here, before
# any import that could be looked up there (sys is built in). The promoted
# rank gets the directory a cold worker gets first: the script's, or the
# working directory for -m.
import sys

if sys.path and sys.path[0] == "":
    del sys.path[0]

import json  # noqa: E402
import os  # noqa: E402


def _preload(spec):
    for name in [n for n in spec.split(",") if n]:
        optional = name.endswith("?")
        name = name.rstrip("?")
        try:
            __import__(name)
        except ImportError as e:
            if not optional:
                print(f"warden standby: cannot preload {name}: {e}", file=sys.stderr)
        except Exception:
            # An optional module (the defaults, what the workers reported)
            # that fails at import here is left out; --preload's are the
            # user's word: their failure ends the standby (cold restart).
            if not optional:
                raise


def _cuda_check():
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        # The rank's CUDA_VISIBLE_DEVICES would come too late.
        print("warden standby: a preloaded module initialized CUDA; not usable", file=sys.stderr)
        os._exit(3)


def _orders():
    os.write(0, b"R")
    buf = b""
    order = None
    while order is None:
        b = os.read(0, 1 << 16)
        if not b:
            break
        buf += b
        while b"\n" in buf and order is None:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if "argv" in msg:
                order = msg
            else:
                _preload(msg.get("preload", ""))
                _cuda_check()
    if order is None and buf.strip():
        order = json.loads(buf)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return order


def _main():
    _preload(os.environ.get("WARDEN_STANDBY_PRELOAD", ""))
    _cuda_check()
    order = _orders()
    if order is None:
        os._exit(0)
    os.chdir(order["cwd"])
    os.environ.clear()
    os.environ.update(order["env"])
    args = order["argv"]
    import runpy

    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


_main()
