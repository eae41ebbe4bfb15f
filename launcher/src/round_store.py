# The round's store across hosts, hosted by node rank 0's launcher
# (`warden run --rdzv-backend etcd`; launcher/src/round_store.rs), so that
# no worker's death takes it down: every rank connects to it as a client
# (`warden.heal.init_process_group`), and a rank that dies, rank 0 included,
# is replaced into the same round while the others keep their processes.
#
# Protocol, on fd 0 (a Unix socket the launcher holds the other end of), one
# line each way:
#   launcher -> "open PORT ADDR"  host a TCPStore server on PORT
#   launcher -> "close PORT"      stop it (the round is over)
#   store    -> "ok PORT" | "err PORT WHY"
# A line that is not an order is answered "err 0 ..." and changes nothing.
# fd 0's end (the launcher gone) ends the process; so does its
# parent-death signal.
import datetime
import socket
import sys

# `python -c` puts the working directory first on sys.path: a module planted
# there must not be imported as torch's dependency.
sys.path = [p for p in sys.path if p not in ("", ".")]

import torch.distributed as dist  # noqa: E402

#: The most servers open at once: a round's and the next one's (a heal into
#: a new round opens the new store before it closes the old one).
MAX_OPEN = 4
#: The longest order read (an order is two or three short words).
MAX_LINE = 256

link = socket.socket(fileno=0)
orders = link.makefile("rb")
stores = {}


def answer(text):
    link.sendall((text.replace("\n", " ")[:400] + "\n").encode())


while True:
    raw = orders.readline(MAX_LINE + 1)
    if not raw:
        break
    words = raw.decode(errors="replace").split()
    if len(words) < 2 or not words[1].isdigit() or int(words[1]) >= 65536 or int(words[1]) == 0:
        answer(f"err 0 not an order: {raw[:80]!r}")
        continue
    port = int(words[1])
    if words[0] == "close" and len(words) == 2:
        stores.pop(port, None)
        answer(f"ok {port}")
    elif words[0] == "open" and len(words) == 3:
        if port not in stores:
            if len(stores) >= MAX_OPEN:
                answer(f"err {port} {MAX_OPEN} stores open already ({sorted(stores)})")
                continue
            try:
                stores[port] = dist.TCPStore(
                    words[2],
                    port,
                    world_size=None,
                    is_master=True,
                    timeout=datetime.timedelta(seconds=60),
                    wait_for_workers=False,
                )
            except Exception as e:  # noqa: BLE001 (said to the launcher)
                answer(f"err {port} {type(e).__name__}: {e}")
                continue
        answer(f"ok {port}")
    else:
        answer(f"err {port} not an order: {raw[:80]!r}")
