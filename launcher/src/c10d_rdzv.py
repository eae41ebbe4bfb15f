"""warden run's c10d rendezvous: torchrun's own algorithm, run by torch.

In: argv[1], a JSON object from the launcher (never from the store): the
endpoint, the run id, min/max nodes, this node's address, whether it hosts
the store, torch's rendezvous timeouts. On stdin, one command a line:
``join`` (the next round: torch's ``next_rendezvous``), ``end <json>`` (the
job ended here: a note in the store; a job finished here waits in the exit
barrier for the round's other nodes, then torch's ``set_closed``), ``leave``
(torch's exit op: out of the participants at once), ``notice
<json>`` (a notice of a coming stop here: the job's one notice in the
store, create-if-absent).

Out, on stdout, one JSON object a line: ``ready``; ``round`` (torch's
round, this node's rank and the world, the workers' master address and
port); ``news`` (another node waits for the next round, or a participant of
this round is gone: the launcher restarts into the next round); ``ended``
(another node ended the job); ``note``; ``error`` (a join failed);
``done`` (an end or a leave carried out); ``notice_set`` (the job's notice
as the store has it after a ``notice``: this node's, or the one another
node wrote first); ``notice`` (another node's notice, seen once, with
``in_round``: whether this node is in the round the notice was written in,
or between rounds, so its workers cannot meet that round's).

How: torch's ``DynamicRendezvousHandler`` over the ``C10dRendezvousBackend``
on a ``TCPStore`` at the endpoint, made by torch's own ``create_backend``
and ``create_handler`` (what torchrun's ``--rdzv-backend c10d`` runs). The
only thing between torch and the store is a check of the state: torch keeps
it as a pickle, and anyone who reaches the endpoint can write it, so every
state read from the store is unpickled here first with only torch's
rendezvous classes and ``datetime`` allowed, and bounded in size and
counts; a state that fails is refused before torch unpickles it.

The exit barrier (torchrun's agent's ``_exit_barrier``): every node of a
round says once, on a counter of that round in the store, that it is done
with the round: it ended the job here (finished or failed), left, or
joined the next round. A node whose job finished here waits (bounded by
``exit_barrier_s``, torchrun's 300 s) until the count reaches the round's
nodes, so no node, the store's host least of all, ends while another still
needs the store (its join, its round's master port). The last to count
closes the rendezvous when any node ended the job, before it releases the
waiters: after the release nobody touches the store, so the store's host
may go at once. A failed end closes first and does not wait (torchrun's
agent waits only on success); a node that left or moved on counts, so
nobody waits for a node that will never come. Its calls go on a client of
their own: a wait of minutes on the handler's client would hold up torch's
keep-alive, whose requests share that socket.

Never: run or open anything the store names; outlive the launcher (its
parent-death signal, and EOF on stdin ends it); touch the store once the
launcher is gone.
"""

import io
import json
import os
import pickle
import sys
import threading
import time
from datetime import datetime, timedelta

# The workers host their own store each round (warden's
# TORCHELASTIC_USE_AGENT_STORE=False): node 0 hands out a free port, as
# torchrun does when the agent store is not shared.
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed import DistNetworkError, TCPStore  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: E402
    create_backend,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint  # noqa: E402

CONF = json.loads(sys.argv[1])
RUN_ID = CONF["run_id"]
MAX_NODES = int(CONF["max_nodes"])
POLL_S = float(CONF.get("poll_s", 0.5))

# Bounds on what is read from the store. A state holds each node once or
# twice (participants or a list, and a heartbeat): a few hundred bytes a
# node, base64 in the store.
MAX_STATE_BYTES = 16 << 20
MAX_LISTED = 65536
MAX_ADDR = 255
MAX_END_BYTES = 4096
END_KEY = "warden.end." + RUN_ID
MAX_NOTICE_BYTES = 4096
MAX_REASON = 300
NOTICE_KEY = "warden.notice." + RUN_ID
#: How long a node whose job finished waits for the round's other nodes
#: (torchrun's agent's ``exit_barrier_timeout``, 300 s by default).
EXIT_BARRIER_S = float(CONF.get("exit_barrier_s", 300))
#: What a node that ended the job adds to the round's exit count beside its
#: 1: the count's high part says whether any did (a round has fewer than
#: 2**32 nodes).
ENDED = 1 << 32

_ALLOWED = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
}

_out = threading.Lock()


def emit(**obj):
    line = json.dumps(obj, separators=(",", ":"))
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def brief(e):
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__
    if cause is not None:
        text += f" ({type(cause).__name__}: {cause})"
    return text[:400]


class _Checked(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise RendezvousStateError(
            f"the rendezvous state in the store names {module}.{name}, not one of torch's rendezvous classes: refused"
        )


def _node_ok(n):
    return (
        isinstance(n, dr._NodeDesc)
        and isinstance(n.addr, str)
        and len(n.addr) <= MAX_ADDR
        and isinstance(n.pid, int)
        and isinstance(n.local_id, int)
    )


def check_state(bits):
    """Refuses a state torch would not write, before torch unpickles it."""
    if len(bits) > MAX_STATE_BYTES:
        raise RendezvousStateError(
            f"the rendezvous state in the store is {len(bits)} bytes, more than {MAX_STATE_BYTES}: refused"
        )
    try:
        s = _Checked(io.BytesIO(bits)).load()
    except RendezvousStateError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle
        raise RendezvousStateError(f"the rendezvous state in the store is not a state: {brief(e)}") from None
    bad = None
    if not isinstance(s, dr._RendezvousState):
        bad = f"a {type(s).__name__}"
    elif not (isinstance(s.round, int) and s.round >= 0):
        bad = "its round"
    elif not isinstance(s.participants, dict) or len(s.participants) > MAX_NODES:
        bad = f"more participants than --nnodes allows ({MAX_NODES})"
    elif not all(_node_ok(n) and isinstance(r, int) for n, r in s.participants.items()):
        bad = "a participant"
    elif len(set(s.participants.values())) != len(s.participants) or not all(
        0 <= r < MAX_NODES for r in s.participants.values()
    ):
        # torch assigns 0..n-1 once, in the write that completes the round
        # (a node that leaves it keeps none): two nodes of one rank, or a
        # rank past --nnodes, are never torch's.
        bad = "two participants of one rank, or a rank past --nnodes"
    elif not all(
        isinstance(x, set) and len(x) <= MAX_LISTED and all(_node_ok(n) for n in x)
        for x in (s.wait_list, s.redundancy_list)
    ):
        bad = "its waiting nodes"
    elif not (
        isinstance(s.last_heartbeats, dict)
        and len(s.last_heartbeats) <= 3 * MAX_LISTED
        and all(_node_ok(n) and isinstance(t, datetime) for n, t in s.last_heartbeats.items())
    ):
        bad = "its heartbeats"
    if bad:
        raise RendezvousStateError(f"the rendezvous state in the store is not torch's ({bad}): refused")


class CheckedBackend(dr.RendezvousBackend):
    """torch's c10d backend, every state it reads checked first."""

    def __init__(self, inner):
        self._inner = inner

    @property
    def name(self):
        return self._inner.name

    def get_state(self):
        got = self._inner.get_state()
        if got is not None:
            check_state(got[0])
        return got

    def set_state(self, state, token=None):
        got = self._inner.set_state(state, token)
        if got is not None:
            check_state(got[0])
        return got


def valid_addr(a):
    return (
        isinstance(a, str)
        and 0 < len(a) <= MAX_ADDR
        and all(c.isalnum() or c in ".-:_[]%" for c in a)
    )


params = RendezvousParameters(
    backend="c10d",
    endpoint=CONF["endpoint"],
    run_id=RUN_ID,
    min_nodes=int(CONF["min_nodes"]),
    max_nodes=MAX_NODES,
    local_addr=CONF.get("local_addr"),
    **{k: v for k, v in CONF.get("torch", {}).items()},
)
_exit_client = None
_notice_client = None


def notice_store():
    """The notice poll's own client of the store, so a notice is read while
    a join holds the handler's (torch's join waits for a round that the
    hosts leaving on the notice will never make). The poll thread alone
    uses it; made again after a failure, bounded."""
    global _notice_client
    if _notice_client is None:
        host, port = parse_rendezvous_endpoint(CONF["endpoint"], default_port=29400)
        _notice_client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    return _notice_client


def exit_store():
    """The exit barrier's own client of the store: made once the store is
    up (at start, after a reconnect, or after it failed), so an end does
    not wait to connect; torch's keep-alive shares the handler's."""
    global _exit_client
    if _exit_client is None:
        host, port = parse_rendezvous_endpoint(CONF["endpoint"], default_port=29400)
        read_s = int(CONF.get("torch", {}).get("read_timeout", 60))
        _exit_client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=read_s))
    return _exit_client


try:
    inner, store = create_backend(params)
    handler = dr.create_handler(store, CheckedBackend(inner), params)
    exit_store()
    notice_store()
except Exception as e:  # noqa: BLE001 - said to the launcher, which exits
    emit(ev="error", kind="store", text=brief(e))
    sys.exit(3)

_ops = threading.Lock()  # one torch call on the handler at a time
_st = threading.Lock()
state = {
    "joining": False,
    "round": None,
    "members": None,
    "told": False,
    "ended": False,
    "noticed": False,
    "departed": None,
}


#: Joins tried again after the store's connection broke mid-join.
JOIN_RECONNECTS = 3


def _reconnect():
    """A new client of the store and a new handler on it, after torch's
    client lost its connection (the store's host closed it mid-join on a
    loaded machine): the node joins again as a new participant; the old
    one's heartbeats stop and torch drops it."""
    global inner, store, handler, _exit_client
    inner, store = create_backend(params)
    handler = dr.create_handler(store, CheckedBackend(inner), params)
    _exit_client = None
    exit_store()


def _next_rendezvous():
    for attempt in range(JOIN_RECONNECTS + 1):
        try:
            return handler.next_rendezvous()
        except RendezvousConnectionError as e:
            if attempt == JOIN_RECONNECTS:
                raise
            emit(ev="note", text=f"the store's connection broke during the join ({brief(e)}); joining again")
            time.sleep(1.0)
            try:
                _reconnect()
            except Exception as r:  # noqa: BLE001 - the next try says it
                emit(ev="note", text=f"reconnecting to the store failed: {brief(r)}")


def join():
    with _ops:
        try:
            # Done with the round this node was in (a finished node of it
            # may wait for this one in the exit barrier).
            depart_or_say(ended=False)
            info = _next_rendezvous()
            st = handler._state_holder.state
            members = set(st.participants)
            rank, world = info.rank, info.world_size
            addr = info.bootstrap_store_info.master_addr
            port = info.bootstrap_store_info.master_port
            if not (0 <= rank < world <= MAX_NODES) or not valid_addr(addr) or not (0 < port < 65536):
                raise RendezvousStateError(
                    f"round {st.round}: rank {rank} of {world}, master {addr[:80]!r}:{port} is not a round of this job: refused"
                )
            with _st:
                state.update(joining=False, round=st.round, members=members, told=False)
            emit(ev="round", round=st.round, rank=rank, world=world, master_addr=addr, master_port=port)
        except RendezvousClosedError as e:
            with _st:
                state["joining"] = False
            emit(ev="error", kind="closed", text=brief(e), end=read_end())
        except RendezvousTimeoutError as e:
            with _st:
                state["joining"] = False
            emit(ev="error", kind="timeout", text=brief(e))
        except Exception as e:  # noqa: BLE001 - said to the launcher
            with _st:
                state["joining"] = False
            emit(ev="error", kind="store", text=brief(e))


def read_end():
    """The note of the node that ended the job, bounded and checked."""
    try:
        if not store.check([END_KEY]):
            return None
        raw = store.get(END_KEY)
        if len(raw) > MAX_END_BYTES:
            return None
        end = json.loads(raw)
        outcome, code, by = end.get("outcome"), end.get("exit_code"), end.get("by")
        if outcome not in ("finished", "failed"):
            return None
        if code is not None and not (isinstance(code, int) and 0 <= code <= 255):
            return None
        if not valid_addr(by):
            by = "?"
        return {"outcome": outcome, "exit_code": code, "by": by}
    except Exception:  # noqa: BLE001 - no note: the launcher says so
        return None


def read_notice(client=None):
    """The job's notice of a coming stop, bounded and checked; None: none.
    ``client``: the store's client to ask, whose failure is raised (the
    caller makes it again); by default the handler's, whose failure is no
    notice."""
    try:
        s = store if client is None else client
        if not s.check([NOTICE_KEY]):
            return None
        raw = s.get(NOTICE_KEY)
    except Exception:  # noqa: BLE001 - see above
        if client is not None:
            raise
        return None
    try:
        if len(raw) > MAX_NOTICE_BYTES:
            return None
        n = json.loads(raw)
        step, deadline, reason, by = n.get("step"), n.get("deadline_ms"), n.get("reason"), n.get("by")
        if not (isinstance(step, int) and 0 <= step < 2**63):
            return None
        if not (isinstance(deadline, int) and 0 <= deadline < 2**63):
            deadline = 0
        if not isinstance(reason, str):
            reason = ""
        if not valid_addr(by):
            by = "?"
        rnd = n.get("round")
        if not (type(rnd) is int and 0 <= rnd < 2**63):
            rnd = None
        return {"step": step, "deadline_ms": deadline, "reason": reason[:MAX_REASON], "by": by, "round": rnd}
    except Exception:  # noqa: BLE001 - none readable: no notice
        return None


def notice(arg):
    """Writes this node's notice unless the job has one, and says which
    stands: every rank of the job saves the step of the first."""
    try:
        mine = json.loads(arg)
        with _st:
            state["noticed"] = True
            # The round it was written in: a node between rounds then
            # knows its workers cannot meet that round's.
            mine["round"] = state["round"]
        with _ops:
            store.compare_set(NOTICE_KEY, "", json.dumps(mine))
            n = read_notice()
        emit(ev="notice_set", notice=n)
    except Exception as e:  # noqa: BLE001 - the launcher keeps its own step
        emit(ev="notice_set", notice=None, text=brief(e))


def in_round(rnd):
    """Whether this node is in round ``rnd`` of the rendezvous: the round
    of its workers, or, while it joins from an earlier round (or none), one
    torch counts it a participant of (its join returns that round). False: it left that round (a
    restart), is waiting for a later one, or the others moved on. A notice
    of no round (unreadable) is taken as this node's round, as before."""
    if rnd is None:
        return True
    with _st:
        joining, mine = state["joining"], state["round"]
    if not joining:
        return mine == rnd
    if mine is not None and mine >= rnd:
        # Joining again from that round (a restart) or a later one: torch
        # may count it a participant of that round still, until its exit
        # op lands, but its workers of that round are gone.
        return False
    try:
        st = handler._state_holder.state
        return st.round == rnd and handler._this_node in st.participants
    except Exception:  # noqa: BLE001 - torch's state mid-change: not in it
        return False


def poll_notice():
    """Another node's notice, told the launcher once, with whether this
    node is in the notice's round. Read on the poll's own client
    (``notice_store``), so a join holding the handler's does not hide it."""
    global _notice_client
    with _st:
        if state["noticed"]:
            return
    try:
        n = read_notice(notice_store())
    except Exception:  # noqa: BLE001 - the store out: asked again next poll
        _notice_client = None
        raise
    if n is None:
        return
    with _st:
        if state["noticed"]:
            return
        state["noticed"] = True
    emit(ev="notice", notice=n, in_round=in_round(n["round"]))


def poll():
    last_note = 0.0
    while True:
        time.sleep(POLL_S)
        try:
            poll_notice()
        except Exception:  # noqa: BLE001 - the store out: said below
            pass
        with _st:
            if state["joining"] or state["round"] is None or state["told"] or state["ended"]:
                continue
            mine, members = state["round"], state["members"]
        try:
            with _ops:
                waiting = handler.num_nodes_waiting()
                st = handler._state_holder.state
                closed, now_round, live = st.closed, st.round, set(st.participants)
        except Exception as e:  # noqa: BLE001 - the store out: the workers go on
            if time.monotonic() - last_note > 30:
                last_note = time.monotonic()
                emit(ev="note", text=f"the rendezvous store does not answer ({brief(e)}); the workers keep running")
            continue
        why = None
        if closed:
            with _st:
                state["ended"] = True
            with _ops:
                end = read_end()
            emit(ev="ended", end=end)
            continue
        if now_round != mine:
            why = f"the rendezvous moved to round {now_round}"
        elif members - live:
            gone = sorted(f"{n.addr}" for n in members - live)
            why = f"{len(gone)} node(s) of round {mine} gone ({', '.join(gone[:8])})"
        elif waiting > 0:
            why = f"{waiting} node(s) waiting for the next round"
        if why:
            with _st:
                if state["joining"] or state["round"] != mine:
                    continue
                state["told"] = True
            emit(ev="news", round=mine, why=why)


def _exit_keys(rnd):
    key = f"warden.exit.{RUN_ID}.{rnd}"
    return key, key + ".all"


def depart(ended):
    """Counts this node out of its round, once (caller holds ``_ops``).
    The last of the round's nodes closes the rendezvous when any ended
    the job, then releases the waiters (a ``set``: torch's store sends no
    answer to it, so the store's host, released, may go at once). Returns
    ``(round, nodes)`` for a node that must wait for the others, ``LAST``
    when it was the last, None when it is in no round or counted itself
    already."""
    with _st:
        rnd, members = state["round"], state["members"]
        if rnd is None or state["departed"] == rnd:
            return None
        state["departed"] = rnd
    n = len(members)
    key, done = _exit_keys(rnd)
    s = exit_store()
    count = s.add(key, 1 + (ENDED if ended else 0))
    if count % ENDED >= n:
        try:
            if count >= ENDED:
                handler.set_closed()
        finally:
            s.set(done, "1")
            # torch's store answers no ``set``: a request it answers, on
            # the same connection, says the set was handled and the
            # waiters told, before the store's host, if this is it, goes.
            # Elsewhere the answer may not come (the store's host went on
            # its release): nothing is lost.
            try:
                s.check([done])
            except Exception:  # noqa: BLE001 - see above
                pass
        return LAST
    return rnd, n


#: ``depart``'s answer for the last node of a round.
LAST = "last"


def depart_or_say(ended):
    """``depart``, a failure said on the console (caller holds ``_ops``):
    a node that cannot count itself out only makes the round's finished
    nodes wait their bound."""
    global _exit_client
    try:
        return depart(ended)
    except Exception as e:  # noqa: BLE001 - said; the waiters have their bound
        _exit_client = None
        emit(ev="note", text=f"could not count this node out of its round's exit barrier: {brief(e)}")
        return None


def end(arg):
    """The job ended here: its note, then the exit barrier (a finished
    job) and torch's close. The store's host answers only when every node
    of its round has counted itself out, or after ``EXIT_BARRIER_S``."""
    with _st:
        state["ended"] = True  # the poll has nothing more to say
    global _exit_client
    with _ops:
        finished = False
        try:
            note = json.loads(arg)
            finished = note.get("outcome") == "finished"
            exit_store().compare_set(END_KEY, "", json.dumps(note))
        except DistNetworkError as e:
            # The store's host is gone (its job ended, its barrier given
            # up): nobody is left to tell or to wait for.
            _exit_client = None
            emit(ev="note", text=f"the store is gone: nothing to close ({brief(e)})")
            emit(ev="done")
            return
        except Exception as e:  # noqa: BLE001 - the others see the close without a note
            _exit_client = None
            emit(ev="note", text=f"could not leave the job's end in the store: {brief(e)}")
        try:
            if not finished:
                # The others learn of the failure at once; nobody waits.
                handler.set_closed()
            mine = depart_or_say(ended=True)
            if finished and isinstance(mine, tuple):
                exit_barrier(*mine)
            elif finished and mine != LAST:
                # No round to wait for, or this node could not count
                # itself out: closed here, as without a barrier.
                handler.set_closed()
        except Exception as e:  # noqa: BLE001 - the others learn by the heartbeats
            emit(ev="note", text=f"could not close the rendezvous: {brief(e)}")
    emit(ev="done")


def exit_barrier(rnd, n):
    """Waits until the round's ``n`` nodes counted themselves out (the
    last closed the rendezvous: nothing more to do here), at most
    ``EXIT_BARRIER_S``; past it, says so and closes the rendezvous."""
    global _exit_client
    _, done = _exit_keys(rnd)
    started = time.monotonic()
    try:
        exit_store().wait([done], timedelta(seconds=EXIT_BARRIER_S))
        return
    except Exception as e:  # noqa: BLE001 - a timeout or the store gone: said below
        waited = time.monotonic() - started
        gone = isinstance(e, DistNetworkError)
        why = brief(e)
    # The client may still owe the wait's answer: not used again.
    _exit_client = None
    if gone:
        emit(
            ev="note",
            text=f"the exit barrier of round {rnd} ended after {waited:.0f} s without every node: the store is gone ({why})",
        )
        return
    try:
        key, _ = _exit_keys(rnd)
        came = exit_store().add(key, 0) % ENDED
    except Exception:  # noqa: BLE001 - the count is only for the note
        came = "?"
    emit(
        ev="note",
        text=(
            f"the exit barrier of round {rnd}: {came} of {n} node(s) done within {EXIT_BARRIER_S:.0f} s; "
            "not waiting for the others any more: closing the rendezvous"
        ),
    )
    handler.set_closed()


def leave():
    try:
        handler._stop_heartbeats()
        if _ops.acquire(timeout=5):
            try:
                handler._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + 10)
                # Out of the round: a finished node waiting for this one
                # in the exit barrier goes on.
                depart_or_say(ended=False)
            finally:
                _ops.release()
    except Exception as e:  # noqa: BLE001 - the others learn by the heartbeats
        emit(ev="note", text=f"could not leave the rendezvous: {brief(e)}")
    emit(ev="done")


emit(ev="ready")
threading.Thread(target=poll, daemon=True).start()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "join":
        with _st:
            if state["joining"]:
                continue
            state.update(joining=True, told=False)
        threading.Thread(target=join, daemon=True).start()
    elif cmd == "end":
        with _st:
            busy = state["joining"]
        if busy:
            emit(ev="done")
        else:
            end(arg)
    elif cmd == "leave":
        leave()
    elif cmd == "notice":
        notice(arg)
# The launcher is gone: no word to the store (its heartbeats stop).
os._exit(0)
