"""Hot-path cost from Python: warden calls next to one Unix datagram per heartbeat.

Run with no agent (the private-slot path costs the same as the shared one):

    python client/python/bench/bench_hotpath.py [--number N] [--repeat R]

Prints nanoseconds per call (best of R runs of N calls), minus the cost of
an empty loop body, so the numbers are what the instrumentation adds.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import timeit

os.environ.setdefault("WARDEN_SOCKET", os.path.join(tempfile.mkdtemp(), "no-agent.sock"))

import warden  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    client = warden.connect(job_id="bench")
    fwd = client.section("forward")
    step = client.step(1)
    hb = client.heartbeat
    mod_hb = warden.heartbeat
    mod_hb()  # create the default client outside the timing

    # Baseline: one datagram per heartbeat to a reader thread draining it.
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "hb.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    stop = threading.Event()

    def drain() -> None:
        rx.settimeout(0.1)
        while not stop.is_set():
            try:
                rx.recv(64)
            except (socket.timeout, OSError):
                pass

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.connect(path)
    msg = b"hb job=bench rank=0 step=123456"
    send = tx.send

    def dgram() -> None:
        try:
            send(msg)
        except BlockingIOError:  # pragma: no cover - reader fell behind
            pass

    cases = {
        "empty loop (subtracted)": ("pass", {}),
        "client.heartbeat()": ("hb()", {"hb": hb}),
        "warden.heartbeat() (module)": ("hb()", {"hb": mod_hb}),
        "with section: (enter+exit)": ("with fwd: pass", {"fwd": fwd}),
        "with warden.section('forward'):": ("with sec('forward'): pass", {"sec": warden.section}),
        "with step: (begin+end)": ("with st: pass", {"st": step}),
        "unix datagram send": ("dg()", {"dg": dgram}),
    }
    results: dict[str, float] = {}
    for name, (stmt, glb) in cases.items():
        best = min(timeit.repeat(stmt, globals=glb, number=args.number, repeat=args.repeat))
        results[name] = best / args.number * 1e9
    base = results.pop("empty loop (subtracted)")
    print(f"python {'.'.join(map(str, __import__('sys').version_info[:3]))}, "
          f"{args.number} calls x {args.repeat} runs, empty loop {base:.1f} ns")
    for name, ns in results.items():
        print(f"  {name:36s} {ns - base:8.1f} ns/call")
    stop.set()
    t.join()
    client.close()


if __name__ == "__main__":
    main()
