"""Heal from a live replica: no rollback when a data-parallel rank is lost.

In: the training state, declared once (``declare(model, optimizer, data=)``);
each attempt of the training function under ``warden.run`` calls
``state.resume(restore)`` on its new process group and steps with
``state.steps(total)``. Out: the state of every rank set to the newest step
that a live, consistent replica holds, sent from that replica to the ranks
that lack it (the replacement of a lost rank, a survivor interrupted while
its optimizer was updating) over the rebuilt process group; nothing is read
from a checkpoint. Where no rank holds a consistent state (a fresh job, every
replica lost), ``restore`` runs on every rank instead (the checkpoint path),
and the fallback is said on stderr. Never: imports torch before it is used,
unpickles a peer's bytes (the skeleton goes through ``torch.load(...,
weights_only=True)``), or lets a restart land inside an optimizer update
unseen (an update interrupted there makes the rank a receiver).

The flow, with ``warden run`` (which replaces a rank that died by a signal
from a standby interpreter while the others restart in process):

1. Survivors: ``RestartRequested`` ends their attempt (their process groups
   aborted); they keep their process, model and optimizer. Their state is
   that of the last step they committed (``steps`` commits a step when its
   body returned after the optimizer's update), and its RNG and data
   position are restored from the snapshot taken at that commit, so the
   step in flight is redone exactly.
2. The replacement starts at the same restart count (its launcher sets it)
   with a freshly built model and optimizer.
3. ``resume`` gathers every rank's committed step (-1: none, or an update
   was interrupted), picks for each rank not at the newest step the lowest
   rank at that step holding the same state (``warden.heal_layout``: any
   rank in plain DDP; the same shard position of another replica group in
   FSDP2/HSDP, from the DTensors' mesh), and sends it model, optimizer,
   step, RNG and data position (point to point; the others send nothing).
   A shard position no live rank holds sends the whole job to ``restore``.

The launcher learns that the workers can be healed from the file named by
``WARDEN_HEAL_FILE``: ``declare`` writes the process's pid there.

Across hosts (``WARDEN_ROUND_EPOCH`` set by ``warden run --rdzv-backend
etcd``), the attempts' stores must be reachable from every host: a TCPStore
hosted by node rank 0's launcher at ``MASTER_ADDR:WARDEN_ROUND_STORE_PORT``
(a process of its own that outlives every worker; without that variable,
by rank 0 at ``MASTER_PORT``), one per round and process, each attempt of
the round under a prefix of its own, numbered from the rank's first
attempt in that round (restart counts are each host
agent's, so they differ between hosts). When another host is lost and a
spare takes its node rank, ``warden run`` keeps this host's workers and
writes the new round to the file named by ``WARDEN_HEAL_ROUND_FILE`` before
it asks them to restart in process: the next attempt meets the spare's new
ranks on that round's store, and they receive their state as above. When a
rank of another host is lost and its own launcher heals it (its host's
survivors restarted by their agent, the rank replaced from a standby), this
host is asked nothing: its ranks see a lost peer, close their groups, see
the attempt after theirs begun on the round's store (``_next_attempt_begun``)
and restart in process to join it (``warden._restart``); the replacement
takes that attempt's number from the store (``_joining_attempt``). A
training thread blocked in a collective meanwhile (gloo's ``abort()`` wakes
none) has its attempt's connections shut down by ``_Stuck``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import io
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import _native, _restart, heal_layout, tensor_bytes
from . import _torch as _groups

__all__ = ["State", "declare", "init_process_group", "seed_step", "store_dir"]

#: The launcher's variable naming the file this worker's pid goes to.
HEAL_FILE_ENV = "WARDEN_HEAL_FILE"
#: Where ``init_process_group`` keeps its per-attempt FileStores (optional).
STORE_DIR_ENV = "WARDEN_HEAL_STORE_DIR"
#: The launcher's file naming the round to heal into, across hosts.
ROUND_FILE_ENV = "WARDEN_HEAL_ROUND_FILE"
#: The round store's port at node rank 0's launcher (``warden run``'s round_store):
#: set, every rank connects there as a client; unset, rank 0 hosts it.
STORE_PORT_ENV = "WARDEN_ROUND_STORE_PORT"
#: Largest round file read, bytes (the launcher writes about 100).
MAX_ROUND_FILE_BYTES = 4096
#: Largest skeleton (the non-tensor part of the state) a rank accepts, bytes.
MAX_SKELETON_BYTES = 64 * 1024 * 1024
#: Largest tensor payload a rank accepts from a peer, bytes (a peer of the
#: same job, but a size read off the wire is never trusted blindly).
MAX_PAYLOAD_BYTES = 1 << 40

_TENSOR = "__warden_tensor__"

#: Seconds a restart request may wait untaken, outside an optimizer update,
#: before this rank leaves to be healed (see ``_Stuck``).
STUCK_ENV = "WARDEN_HEAL_STUCK_S"
DEFAULT_STUCK_S = 1.0
#: The exit code of a rank that left that way (EX_TEMPFAIL): no traceback,
#: so ``warden run`` heals it like a rank killed by a signal.
STUCK_EXIT = 75


def _torch() -> Any:
    import torch  # noqa: PLC0415 - only when used

    return torch


def _say(line: str) -> None:
    print(f"warden.heal: {line}", file=sys.stderr, flush=True)


def store_dir() -> str:
    """The folder of this job's per-attempt stores (private to the user).

    ``$WARDEN_HEAL_STORE_DIR`` when set, else a folder under the temporary
    directory named after the job and the launcher's pid, so two runs of
    the same job never share a store.
    """
    given = os.environ.get(STORE_DIR_ENV)
    if given:
        os.makedirs(given, mode=0o700, exist_ok=True)
        return given
    job = os.environ.get("WARDEN_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "job"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[:64]
    launcher = os.environ.get("WARDEN_LAUNCHER_PID", "0")
    base = os.path.join(tempfile.gettempdir(), f"warden-heal-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if st.st_uid != os.getuid() or (st.st_mode & 0o077) or not os.path.isdir(base) or os.path.islink(base):
        raise RuntimeError(
            f"warden.heal: {base} is not a private folder of this user; set {STORE_DIR_ENV}"
        )
    path = os.path.join(base, f"{safe}-{launcher}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


#: The states declared in this process (``init_process_group`` releases
#: their FSDP2 groups at the start of each attempt).
_declared: "weakref.WeakSet[State]" = weakref.WeakSet()

#: This process's control store (one per job and in-job restart): which
#: attempts some rank has entered.
_control: Any = None

#: Across hosts: (epoch, the round's TCPStore) of this process's round.
_round_store: Optional[Tuple[int, Any]] = None
#: Across hosts: (epoch, host, port) of the round's store when a launcher
#: hosts it (``WARDEN_ROUND_STORE_PORT``): only then is a rank's own fault
#: healed inside the round, and only then does a rank waiting for a lost
#: peer's heal ask the store whether the peers' next attempt began.
_hosted_at: Optional[Tuple[int, str, int]] = None
#: Across hosts: the restart count this rank's attempts in each round are
#: numbered from (the count of its first attempt there, less the attempt
#: it joined then: a replacement joins its peers' next attempt).
_round_base: Dict[int, int] = {}
#: Across hosts: (epoch, attempt) of the attempt this rank joined last.
_joined: Optional[Tuple[int, int]] = None
#: Across hosts: (epoch, the round's control prefix on a client of its own
#: with a short timeout), for ``_next_attempt_begun``: a store whose host
#: is gone answers within it, not within the attempt's timeout.
_poll: Optional[Tuple[int, Any]] = None
#: When a failed poll client may be made again (monotonic seconds).
_poll_retry_at = 0.0
_poll_lock = threading.Lock()
#: The poll client's timeout, seconds (asked off the training thread).
POLL_TIMEOUT_S = 1.0
#: The pause before a new poll client after one failed, seconds.
POLL_RETRY_S = 1.0
#: Attempts looked for in one round (``_joining_attempt``'s search bound):
#: more in-process restarts than any job makes.
MAX_ATTEMPTS = 1 << 20


def _round() -> Optional[Dict[str, Any]]:
    """The round across hosts this rank is in, or None on one host.

    The environment's (``WARDEN_ROUND_EPOCH``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE``), unless the launcher's round file names
    a later round to heal into; then that one, copied into the environment
    for the training code. A file that cannot be read or makes no sense is
    said and ignored (the rank stays in its round, whose peers are gone:
    its launcher then restarts it).
    """
    epoch = os.environ.get("WARDEN_ROUND_EPOCH", "")
    if not epoch:
        return None
    here = {
        "epoch": int(epoch),
        "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "master_port": int(os.environ.get("MASTER_PORT", "29500")),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "store_port": _port_or_none(os.environ.get(STORE_PORT_ENV)),
    }
    path = os.environ.get(ROUND_FILE_ENV)
    if not path:
        return here
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return here
    except OSError as e:
        _say(f"round file {path}: {e}: staying in round {here['epoch']}")
        return here
    try:
        raw = os.read(fd, MAX_ROUND_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        if len(raw) > MAX_ROUND_FILE_BYTES:
            raise ValueError(f"more than {MAX_ROUND_FILE_BYTES} bytes")
        got = json.loads(raw)
        new = {
            "epoch": int(got["epoch"]),
            "master_addr": str(got["master_addr"]),
            "master_port": int(got["master_port"]),
            "world_size": int(got["world_size"]),
            "store_port": None if got.get("store_port") is None else int(got["store_port"]),
        }
        if not (0 < new["master_port"] < 65536 and 0 < new["world_size"] and new["master_addr"]):
            raise ValueError(f"port {new['master_port']}, world size {new['world_size']}")
        if new["store_port"] is not None and not 0 < new["store_port"] < 65536:
            raise ValueError(f"store port {new['store_port']}")
    except (ValueError, KeyError, TypeError) as e:
        _say(f"round file {path} is not a round ({e}): staying in round {here['epoch']}")
        return here
    if new["epoch"] <= here["epoch"]:
        return here
    os.environ["WARDEN_ROUND_EPOCH"] = str(new["epoch"])
    os.environ["MASTER_ADDR"] = new["master_addr"]
    os.environ["MASTER_PORT"] = str(new["master_port"])
    os.environ["WORLD_SIZE"] = str(new["world_size"])
    if new["store_port"] is None:
        os.environ.pop(STORE_PORT_ENV, None)
    else:
        os.environ[STORE_PORT_ENV] = str(new["store_port"])
    return new


def _port_or_none(text: Optional[str]) -> Optional[int]:
    """``WARDEN_ROUND_STORE_PORT``'s port, or None (unset, or not a port:
    said, and rank 0 hosts the round's store as without it)."""
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        _say(f"{STORE_PORT_ENV}={text!r} is not a port: rank 0 hosts the round's store")
        return None
    return port


def _stores(count: int, world: int, rank: int, timeout_s: float) -> Tuple[Any, Any]:
    """(control store, attempt store) of attempt ``count``.

    One host: FileStores in ``store_dir()`` (a store hosted by a rank would
    die with it). Across hosts: the round's TCPStore, which node rank 0's
    launcher hosts at ``WARDEN_ROUND_STORE_PORT`` (a store process of its
    own, so no worker's death takes it down), or without that variable rank
    0 at the round's port; under the prefixes ``control`` and
    ``attempt-<n>``, ``n`` counted from this rank's first attempt in the
    round.
    """
    global _control, _round_store, _hosted_at
    dist = _torch().distributed
    round_ = _round()
    if round_ is None:
        # In-job restarts start new processes at in-process count 0 again.
        in_job = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        folder = store_dir()
        if _control is None:
            _control = dist.FileStore(os.path.join(folder, f"control-{in_job}"), -1)
        return _control, dist.FileStore(os.path.join(folder, f"attempt-{in_job}-{count}"), world)
    epoch = round_["epoch"]
    if world != round_["world_size"]:
        raise RuntimeError(f"warden.heal: round {epoch} has {round_['world_size']} ranks, this rank was told {world}")
    if _round_store is None or _round_store[0] != epoch:
        # Hosted by node rank 0's launcher when it says so (the store then
        # outlives every worker, rank 0 included); else by rank 0.
        hosted = round_["store_port"] is not None
        port = round_["store_port"] if hosted else round_["master_port"]
        store = dist.TCPStore(
            round_["master_addr"],
            port,
            world_size=None,
            is_master=not hosted and rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        _round_store = (epoch, store)
        _hosted_at = (epoch, round_["master_addr"], port) if hosted else None
    store = _round_store[1]
    control = dist.PrefixStore("control", store)
    if epoch not in _round_base:
        # This rank's first attempt in the round: a replacement (a heal of
        # a rank lost inside the round) joins the attempt its peers make
        # next, whatever its own count; in a fresh round that is attempt 0.
        attempt = _joining_attempt(control, lambda i: dist.PrefixStore(f"attempt-{i}", store), world)
        _round_base[epoch] = count - attempt
        if attempt:
            _say(f"rank {rank}: joins attempt {attempt} of round {epoch}, its peers' next")
    base = _round_base[epoch]
    return control, dist.PrefixStore(f"attempt-{count - base}", store)


def _joining_attempt(control: Any, attempt_store: Callable[[int], Any], world: int) -> int:
    """The attempt a rank's first call in a round joins: the newest one some
    rank entered (``entered-<i>`` in ``control``) while not every rank has
    joined it, else the one after it; 0 when none was entered.

    Attempts are entered in order (0, 1, ...), each once every rank left the
    one before, so the newest entered is found by doubling then bisecting:
    O(log attempts) questions to the store.
    """

    def entered(i: int) -> bool:
        return bool(control.check([f"entered-{i}"]))

    if not entered(0):
        return 0
    low, high = 0, 1
    while high < MAX_ATTEMPTS and entered(high):
        low, high = high, high * 2
    # entered(low), not entered(high) (or high at the bound).
    while high - low > 1:
        mid = (low + high) // 2
        if entered(mid):
            low = mid
        else:
            high = mid
    joined = int(attempt_store(low).add("warden-heal-joined", 0))
    return low if joined < world else low + 1


def _next_attempt_begun() -> Optional[bool]:
    """Across hosts, with the round's store hosted by a launcher: whether
    some rank entered the attempt after the one this rank joined last (a
    lost peer healed by its own host's launcher: its host's survivors and
    its replacement enter it, and nothing asks this rank). None where that
    cannot be told (one host, a store hosted by a rank, no attempt joined
    in the store's round). A store that does not answer is False (asked
    again after a pause)."""
    joined, at = _joined, _hosted_at
    if joined is None or at is None or at[0] != joined[0]:
        return None
    # The training thread and ``_Stuck`` both ask; a store client takes one
    # call at a time.
    with _poll_lock:
        return _ask_next_begun(joined, at)


def _ask_next_begun(joined: Tuple[int, int], at: Tuple[int, str, int]) -> bool:
    global _poll, _poll_retry_at
    now = time.monotonic()
    if _poll is None or _poll[0] != joined[0]:
        if now < _poll_retry_at:
            return False
        dist = _torch().distributed
        try:
            client = dist.TCPStore(
                at[1],
                at[2],
                world_size=None,
                is_master=False,
                timeout=datetime.timedelta(seconds=POLL_TIMEOUT_S),
                wait_for_workers=False,
            )
        except Exception:  # the store's host gone: a request may still come
            _poll_retry_at = time.monotonic() + POLL_RETRY_S
            return False
        _poll = (joined[0], dist.PrefixStore("control", client))
    try:
        return bool(_poll[1].check([f"entered-{joined[1] + 1}"]))
    except Exception:
        _poll = None
        _poll_retry_at = time.monotonic() + POLL_RETRY_S
        return False


def _recovering() -> Any:
    """The ``heal`` section around a restart attempt's regrouping and heal
    (``init_process_group``, ``State.resume``); no section in the first
    attempt, where the agent already judges a rank with no step as in
    ``init``.

    A survivor waits there for its replacement (a standby taking the place,
    a second fault's rank exiting first): seconds under load, and a Lightning
    replacement rebuilds its module and DDP before it joins. Outside a
    section that wait was ``idle``, judged against the job's calibrated
    between-steps time, and the agent declared a hang on the survivors in
    the middle of a heal (3 of 4 ranks stalled at the same step), which
    asked for a second, needless in-process restart (CI, issue 31). A
    ``heal`` section gets ``hang.heal_timeout`` (2 min) until calibrated, so
    a replacement that froze is still found; ``timeout_s`` bounds it too.
    The old group's teardown stays outside: after an in-process restart the
    agent asked for, the agent judges it in ``restart`` (``hang.heal_timeout``
    as well, from the ask), where a gloo group's destructor that joins a
    worker thread still in a collective is a stall it still finds; after a
    lost peer's error (the wait for its heal, then the teardown, whether
    the agent asks or this rank joins the peers' next attempt itself) the
    client marks ``heal_wait`` itself (``_restart._RestartSection``).
    """
    if _restart.restart_count() > 0:
        return _native.section("heal")
    return contextlib.nullcontext()


def init_process_group(backend: str = "gloo", timeout_s: float = 600.0) -> None:
    """The default process group of this attempt, on a store of its own.

    Each attempt (``warden.restart_count()``, within each in-job restart)
    gets a new FileStore in ``store_dir()``: the old store's keys belong to
    the old group, and a store hosted by a rank (TCPStore on rank 0) would
    die with that rank. Across hosts, the round's TCPStore instead (see
    ``_stores``). Rank and world size come from ``RANK`` and
    ``WORLD_SIZE`` (across hosts: the round's).

    The ranks meet in Python before torch's rendezvous: a wait inside it is
    C++ that no restart signal interrupts, and a peer lost during a heal
    would leave the others waiting there for the whole timeout. Meanwhile a
    rank that sees a later attempt begun (a second fault during the heal,
    whose restart request reached the others before this process had
    registered) joins that attempt instead.
    """
    # The aborted groups FSDP2 still holds: closed now, not at resume, so
    # no peer blocked on their sockets waits for this rank (outside the
    # heal section: see _recovering).
    if sum(heal_layout.release(state.model) for state in list(_declared)):
        gc.collect()
    with _recovering():
        _init_process_group(backend, timeout_s)


def _init_process_group(backend: str, timeout_s: float) -> None:
    global _joined
    torch = _torch()
    dist = torch.distributed
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    _round()
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + timeout_s
    while True:
        count = _restart.restart_count()
        control, store = _stores(count, world, rank, timeout_s)
        base = _round_base.get(int(os.environ.get("WARDEN_ROUND_EPOCH") or -1), 0)
        control.set(f"entered-{count - base}", "1")
        later = _meet(store, control, "warden-heal-joined", world, count - base + 1, deadline)
        if later is False:
            # Everyone added itself, but a rank that died after adding (a
            # second fault during the heal: the survivor killed while it
            # waited here for a replacement) is counted too, and a rank
            # that took the count for "all here" would enter torch's
            # rendezvous for this attempt and wait there, in C++, while
            # its peers moved on (seen under the Transformers Trainer).
            # So each says once more that it is here, now that every rank
            # is: the window for a death between the two is the poll's few
            # milliseconds, not a replacement's start.
            later = _meet(store, control, "warden-heal-ready", world, count - base + 1, deadline)
        if later is None:
            raise RuntimeError(f"warden.heal: not every rank joined attempt {count} within {timeout_s} s")
        if not later:
            break
        _say(f"rank {rank}: attempt {count + 1} began while this rank waited in attempt {count}: joining it")
        _restart._count = count + 1
        # Its own request for that attempt, if one comes, is acknowledged
        # without a raise: raised, it would move this rank (and its peers
        # after it) one attempt further, leaving a replacement that started
        # at this count waiting in torch's rendezvous for ever.
        _native._restart_joined_early(count + 1)
    if os.environ.get("WARDEN_ROUND_EPOCH"):
        _joined = (int(os.environ["WARDEN_ROUND_EPOCH"]), count - base)
    if not _groups.wait_for_aborts():
        _say(
            f"rank {rank}: an abort of the process groups still runs after {_groups.ABORT_WAIT_S:.0f} s; "
            f"making attempt {count}'s group without waiting for it"
        )
    before = set(_socket_fds())
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _set_attempt_sockets(before)


def _meet(store: Any, control: Any, key: str, world: int, next_entered: int, deadline: float) -> Optional[bool]:
    """Adds this rank to ``key`` and waits for ``world`` ranks there: False
    once they are, True when attempt ``next_entered`` began meanwhile (this
    rank joins it), None past ``deadline``."""
    store.add(key, 1)
    while store.add(key, 0) < world:
        if control.check([f"entered-{next_entered}"]):
            return True
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.002)
    return False


#: The TCP sockets (inodes) the current attempt's default group opened:
#: gloo's connections to its peers, taken around ``dist.init_process_group``
#: (the round's store connections excluded). ``_Stuck`` shuts them down to
#: bring a training thread blocked in one of its collectives back.
_attempt_sockets: frozenset = frozenset()


def _socket_fds() -> Dict[int, int]:
    """This process's sockets: inode -> a file descriptor of it."""
    out: Dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and link.endswith("]"):
            try:
                out[int(link[8:-1])] = int(name)
            except ValueError:
                continue
    return out


def _tcp_connections() -> Dict[int, int]:
    """This process's TCP sockets that are not listening: inode -> remote port
    (``/proc/self/net/tcp`` and ``tcp6``)."""
    out: Dict[int, int] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    # sl local rem st ... inode: a listener's state is 0A.
                    if len(fields) < 10 or fields[3] == "0A":
                        continue
                    out[int(fields[9])] = int(fields[2].rsplit(":", 1)[1], 16)
        except (OSError, ValueError, IndexError):
            continue
    return out


def _set_attempt_sockets(before: "set[int]") -> None:
    """Records the TCP connections opened since ``before`` (inodes), less the
    round's store's, as the attempt's group's."""
    global _attempt_sockets
    tcp = _tcp_connections()
    store_port = _hosted_at[2] if _hosted_at is not None else None
    _attempt_sockets = frozenset(
        i for i in _socket_fds() if i not in before and i in tcp and tcp[i] != store_port
    )


def _shut_attempt_sockets() -> int:
    """Shuts down (both ways) the current attempt's group's connections that
    are still open; returns how many. A collective blocked on one of them
    returns with an error ("connection closed"), which ``warden.run`` takes
    as a lost peer. The descriptors stay the group's (closed when it is
    destroyed); a descriptor reused for another socket meanwhile is left alone
    (its inode is checked on a duplicate)."""
    wanted = _attempt_sockets
    done = 0
    for inode, fd in _socket_fds().items():
        if inode not in wanted:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inode:
                continue
            sock = socket.socket(fileno=dup)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
            finally:
                sock.detach()
        except OSError:
            continue
        finally:
            os.close(dup)
    return done


def _announce() -> None:
    """Tells the launcher this worker can be healed (its pid in its file)."""
    path = os.environ.get(HEAL_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, path)
    except OSError as e:
        _say(f"cannot write {path} ({e}): the launcher will restart the job instead of healing it")


def _stuck_after() -> float:
    raw = os.environ.get(STUCK_ENV, "")
    if not raw:
        return DEFAULT_STUCK_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 3600.0:
        _say(f"{STUCK_ENV}={raw!r} is not a number of seconds from 0.1 to 3600: using {DEFAULT_STUCK_S}")
        return DEFAULT_STUCK_S
    return value


#: CPU ticks (of ``SC_CLK_TCK``, 10 ms) the training thread may spend over
#: the wait and still count as blocked: a thread in a gloo collective waits
#: on a socket and spends none.
_BUSY_TICKS = 2


def _thread_cpu_ticks(tid: int) -> Optional[int]:
    """User plus system CPU ticks of this process's thread ``tid``
    (``/proc/self/task/<tid>/stat``), or None where it cannot be read."""
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


class _Stuck(threading.Thread):
    """Leaves the process when a restart request cannot reach its training thread.

    Why: gloo's ``abort()`` wakes no collective (torch 2.15: a blocked
    ``allreduce`` returns only when a peer's socket closes), so a survivor
    blocked in a collective with other survivors (the rank opposite the lost
    one in a ring) takes no restart signal, and those survivors' own pending
    collectives keep their old groups' sockets open in turn: each waits on
    the other until gloo's timeout (measured: 1 run in 5 of a 4-rank heal).
    Such a rank's memory is out of reach, but a live replica holds its
    state: it leaves with ``STUCK_EXIT`` (no traceback), its sockets close,
    the others' collectives fail, and ``warden run`` heals it like a rank
    killed by a signal. Only under ``warden run`` (``WARDEN_HEAL_FILE`` set),
    never while an optimizer update defers the restart to its commit, and
    not while the training thread spends CPU: on a loaded host a slow
    thread takes the request late, and leaving would turn a survivor into a
    replacement for nothing. Nor once ``warden.run`` caught the request:
    its thread is in the attempt's teardown then, having shut the group's
    connections itself, and a teardown off the CPU for a second (a loaded
    host) is no collective; leaving there began a second heal in the
    middle of the first, and a survivor of it failed (CI, issue 31).
    """

    _started = False
    _lock = threading.Lock()

    def __init__(self, state: "State", after: float) -> None:
        super().__init__(name="warden-heal-stuck", daemon=True)
        self._state = weakref.ref(state)
        self._after = after
        # Made by the training thread (State's declaration): its CPU time
        # tells a thread blocked in a collective (none) from one that is
        # only slow on a loaded host (some), which takes the request soon.
        self._training_tid = threading.get_native_id()

    @classmethod
    def start_for(cls, state: "State") -> None:
        if not os.environ.get(HEAL_FILE_ENV):
            return
        with cls._lock:
            if cls._started:
                return
            cls._started = True
        cls(state, _stuck_after()).start()

    def run(self) -> None:
        poll = min(0.05, self._after / 4)
        seen: Optional[int] = None
        since = 0.0
        cpu: Optional[int] = None
        shut = False
        while True:
            time.sleep(poll)
            state = self._state()
            if state is None:
                return
            pending = _native._restart_pending()
            now = time.monotonic()
            if pending is None or state._updating or _native._restart_pending_caught():
                # None, deferred to the update's commit, or taken: caught by
                # ``warden.run``, whose teardown runs before it acknowledges
                # (the agent judges a stall there in ``restart``).
                seen = None
                if pending is None:
                    self._watch_round(state, now)
                continue
            if pending["seq"] != seen:
                seen, since, shut = pending["seq"], now, False
                cpu = _thread_cpu_ticks(self._training_tid)
                continue
            if now - since >= self._after:
                spent = _thread_cpu_ticks(self._training_tid)
                if cpu is not None and spent is not None and spent - cpu > _BUSY_TICKS:
                    # It runs: slow (a loaded host), not blocked. Wait on.
                    since, cpu = now, spent
                    continue
                if not shut:
                    # First the attempt's own connections: the collective
                    # fails, the thread takes the request, and the process
                    # (its memory, its CUDA context) stays.
                    shut = True
                    n = _shut_attempt_sockets()
                    if n:
                        _say(
                            f"rank {state.rank} (pid {os.getpid()}): the restart request (seq {seen}) has not reached "
                            f"the training thread in {now - since:.1f} s: it is blocked in a collective; shut down its "
                            f"process group's {n} connection{'s' if n > 1 else ''}"
                        )
                        since, cpu = now, spent
                        continue
                _say(
                    f"rank {state.rank} (pid {os.getpid()}): the restart request (seq {seen}) has not reached the training "
                    f"thread in {now - since:.1f} s: it is blocked in native code (a collective no abort "
                    f"wakes); leaving with exit {STUCK_EXIT} to be healed from a live replica"
                )
                os._exit(STUCK_EXIT)

    #: No request: since when the training thread has spent no CPU, its
    #: ticks then, and when the round's store may be asked next.
    _idle_since = 0.0
    _idle_ticks: Optional[int] = None
    _ask_at = 0.0

    def _watch_round(self, state: "State", now: float) -> None:
        """Across hosts, with no request: a training thread blocked (no CPU
        for ``after`` seconds) in an attempt whose successor its peers began
        on the round's store (a lost rank healed by its own host's launcher,
        which asks nothing of this host) gets its group's connections shut
        down, so that it comes back and joins them. The store is asked only
        while the thread is blocked, at most twice a second."""
        if _hosted_at is None or _joined is None or not _attempt_sockets:
            self._idle_ticks = None
            return
        ticks = _thread_cpu_ticks(self._training_tid)
        if ticks is None or self._idle_ticks is None or ticks - self._idle_ticks > _BUSY_TICKS:
            self._idle_since, self._idle_ticks = now, ticks
            return
        if now - self._idle_since < self._after or now < self._ask_at:
            return
        self._ask_at = now + 0.5
        attempt = _joined
        if not _next_attempt_begun():
            return
        n = _shut_attempt_sockets()
        if n:
            _say(
                f"rank {state.rank} (pid {os.getpid()}): blocked in a collective of attempt {attempt[1]} while its "
                f"peers began attempt {attempt[1] + 1}: shut down its process group's {n} connection{'s' if n > 1 else ''}"
            )
        self._idle_since, self._idle_ticks = now, ticks


class State:
    """A rank's training state, declared once: what a heal sends and restores.

    ``model``: an ``nn.Module`` (its ``state_dict``; wrap it in DDP after
    ``resume``, on each attempt's new group). ``optimizer``: a
    ``torch.optim.Optimizer`` or None. ``data``: an object with
    ``state_dict()`` / ``load_state_dict()`` whose state is the same on
    every rank (a sampler's epoch and position; the rank itself is
    configuration), or None when the data position follows from the step.
    ``rng``: ``"step"`` (the default) seeds the torch, Python and NumPy RNGs
    at the start of every step from (``seed``, rank, step), so a rank's RNG
    never needs a peer (a replica holds the model, not another rank's RNG);
    ``"shared"`` carries the source's RNG states (ranks whose RNGs are
    identical), the current CUDA device's too where CUDA is initialized;
    None leaves them alone.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        data: Any = None,
        rng: Optional[str] = "step",
        seed: int = 0,
    ) -> None:
        if rng not in ("step", "shared", None):
            raise ValueError(f"warden.heal: rng={rng!r}: must be 'step', 'shared' or None")
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.rng = rng
        self.seed = int(seed)
        self.rank = int(os.environ.get("RANK", "0"))
        #: Who holds the same state: None for plain DDP (every rank), else
        #: the DTensors' mesh (FSDP2/HSDP), inferred from their placements.
        self.layout = heal_layout.infer(model)
        #: Steps committed: the next step to run.
        self.step = 0
        #: How the last ``resume`` got its state, for a person.
        self.last = "not resumed yet"
        #: The in-memory state is that of ``step`` (committed or received).
        self._consistent = False
        #: An optimizer update began and its step was not committed yet.
        self._updating = False
        #: A restart arrived while updating: raise it at the commit.
        self._deferred = False
        #: RNG and data position as of the last commit.
        self._loop: Dict[str, Any] = {}
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._begin_update)
        _restart._set_defer(self._defer_restart)
        _restart._heal_declared = True
        _restart._next_attempt_begun = _next_attempt_begun
        _declared.add(self)
        # warden.run collects garbage after a restart (a DDP wrapper in a
        # reference cycle holds the old group's sockets, which peers wait
        # on). With torch loaded a full collection walks ~170k objects,
        # 150-400 ms on the restart's path, twice over in a ring (the lost
        # rank's neighbours, then the rank opposite). Everything made
        # before the declaration lives for the whole job: freezing it
        # leaves the collection the attempt's own objects (microseconds).
        # The import-time garbage is collected first, except in a heal's
        # replacement, whose declaration is on the heal's path.
        if _restart.restart_count() == 0:
            gc.collect()
        gc.freeze()
        _announce()
        _Stuck.start_for(self)

    # -- the step boundary ------------------------------------------------

    def _begin_update(self, *_: Any) -> None:
        self._updating = True

    def _defer_restart(self) -> bool:
        """The restart signal's handler asks: not in the middle of an update."""
        if self._updating:
            self._deferred = True
            return True
        return False

    def commit(self, step: Optional[int] = None) -> None:
        """Marks step ``step`` (default: the current one) done: the state in
        memory is now that after ``step + 1`` steps. ``steps`` calls it; call
        it yourself in a loop of your own, right after the step's update."""
        self.step = (self.step if step is None else int(step)) + 1
        self._loop = self._snapshot_loop()
        self._consistent = True
        self._updating = False
        if self._deferred:
            self._deferred = False
            if _native._restart_should_raise():
                raise _restart.RestartRequested()

    def steps(self, total: int) -> Iterator[int]:
        """Yields the step numbers from the committed step up to ``total``,
        committing each one when the loop's body returns."""
        while self.step < total:
            n = self.step
            if self.rng == "step":
                seed_step(self.seed, self.rank, n)
            yield n
            self.commit(n)

    # -- what is carried --------------------------------------------------

    def _snapshot_loop(self) -> Dict[str, Any]:
        loop: Dict[str, Any] = {}
        if self.rng == "shared":
            torch = _torch()
            loop["torch"] = torch.get_rng_state()
            if torch.cuda.is_initialized():
                # Dropout on a GPU draws from the device's generator, not
                # the CPU's: without it a healed rank's masks would differ.
                loop["cuda"] = torch.cuda.get_rng_state()
            loop["python"] = random.getstate()
            np = sys.modules.get("numpy")
            if np is not None:
                kind, keys, pos, has_gauss, gauss = np.random.get_state()
                loop["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
        if self.data is not None:
            loop["data"] = copy.deepcopy(self.data.state_dict())
        return loop

    def _apply_loop(self, loop: Dict[str, Any]) -> None:
        if "torch" in loop:
            _torch().set_rng_state(loop["torch"])
        if "cuda" in loop and _torch().cuda.is_available():
            _torch().cuda.set_rng_state(loop["cuda"])
        if "python" in loop:
            v, internal, gauss = loop["python"]
            random.setstate((v, tuple(internal), gauss))
        if "numpy" in loop:
            np = sys.modules.get("numpy")
            if np is not None:
                kind, keys, pos, has_gauss, gauss = loop["numpy"]
                np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
        if "data" in loop and self.data is not None:
            self.data.load_state_dict(copy.deepcopy(loop["data"]))

    def _payload(self) -> Dict[str, Any]:
        if self.layout is not None:
            # Local shards as plain tensors: a DTensor is not sent.
            return dict(heal_layout.local_state_dict(self.model, self.optimizer), step=self.step, loop=self._loop)
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "loop": self._loop,
        }

    def _zero_grads(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)

    # -- the heal -----------------------------------------------------------

    def resume(self, restore: Optional[Callable[[], Optional[int]]] = None, group: Any = None) -> int:
        """Brings every rank to the newest consistent step a live replica
        holds; returns the step to run next.

        Call it on every rank, in every attempt, after the attempt's process
        group exists and before wrapping the model in DDP. ``restore``: the
        checkpoint path (load this rank's model, optimizer and data position
        from the newest checkpoint every rank has; return its step, or None
        on a fresh start). It runs only where no rank holds a live state.
        """
        with _recovering():
            return self._resume(restore, group)

    def _resume(self, restore: Optional[Callable[[], Optional[int]]], group: Any) -> int:
        torch = _torch()
        dist = torch.distributed
        started = time.perf_counter()
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        # FSDP2: its cached groups are the aborted ones; the mesh, made
        # again by this attempt, resolves to the new ones.
        heal_layout.rebind(self.model, self.layout, rank)
        mine = self.step if (self._consistent and not self._updating) else -1
        if self._updating:
            _say(f"rank {rank}: its optimizer update of step {self.step} was interrupted: it receives the state")
        self._updating = False
        self._deferred = False
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64), group=group)
        steps = [int(t.item()) for t in gathered]
        keys = [() if self.layout is None else self.layout.key(r) for r in range(world)]
        plan = heal_layout.plan(steps, keys)
        best = plan.best
        count = _restart.restart_count()
        if plan.lost:
            # A shard position with no live replica: its state is gone, and
            # the job as a whole goes back to the checkpoint.
            where = self.layout.describe() if self.layout is not None else "the job"
            _say(
                f"rank {rank}: no live replica holds shard position{'s' if len(plan.lost) > 1 else ''} "
                f"{', '.join(map(str, plan.lost))} of {where} at step {best}: every rank restores instead"
            )
            self._consistent = False
            best = -1
        if best < 0:
            step = restore() if restore is not None else None
            self.step = int(step or 0)
            self._zero_grads()
            self._loop = self._snapshot_loop() if step is None else self._loop
            if step is not None and "torch" not in self._loop:
                self._loop = self._snapshot_loop()
            self._consistent = True
            if count > 0:
                self.last = f"no live replica holds the state: restored from the checkpoint at step {self.step}"
                _say(f"rank {rank}: {self.last}")
            else:
                self.last = "fresh start" if step is None else f"restored from the checkpoint at step {self.step}"
            return self.step
        behind = sorted(plan.sources)
        sources = sorted(set(plan.sources.values()))
        source = plan.sources.get(rank, min(sources) if sources else rank)
        sent = 0
        if rank in sources:
            for r in behind:
                if plan.sources[r] == rank:
                    sent = _send(self._payload(), r, group)
            self._apply_loop(self._loop)
        elif rank in behind:
            payload, sent = _receive(source, group)
            if self.layout is not None:
                heal_layout.load_local_state_dict(self.model, self.optimizer, payload)
            else:
                self.model.load_state_dict(payload["model"])
                if self.optimizer is not None and payload["optimizer"] is not None:
                    self.optimizer.load_state_dict(payload["optimizer"])
            self._loop = payload["loop"]
            self._apply_loop(self._loop)
            self.step = int(payload["step"])
        else:
            self._apply_loop(self._loop)
        self._zero_grads()
        self._consistent = True
        took = time.perf_counter() - started
        if not behind:
            self.last = f"every rank live at step {best}: nothing to send"
        elif rank in behind:
            self.last = f"healed from rank {source} at step {best}: {sent} bytes in {took:.3f} s"
        else:
            mine_to = [r for r in behind if plan.sources[r] == rank]
            self.last = (
                f"rank {rank} sent step {best} to rank{'s' if len(mine_to) > 1 else ''} {','.join(map(str, mine_to))}"
                if mine_to
                else f"rank{'s' if len(sources) > 1 else ''} {','.join(map(str, sources))} sent step {best} to "
                f"rank{'s' if len(behind) > 1 else ''} {','.join(map(str, behind))}"
            )
        if count > 0 or rank in behind:
            _say(f"rank {rank}: {self.last}")
        return self.step


def declare(
    model: Any, optimizer: Any = None, *, data: Any = None, rng: Optional[str] = "step", seed: int = 0
) -> State:
    """Declares the training state once; see :class:`State`."""
    return State(model, optimizer, data=data, rng=rng, seed=seed)


def seed_step(seed: int, rank: int, step: int) -> None:
    """Seeds the torch, Python and NumPy (when imported) RNGs for ``step`` of
    ``rank``: what ``State.steps`` does with ``rng="step"``, for a loop that
    must draw the same numbers without warden.heal."""
    value = ((int(seed) * 1_000_003 + int(rank)) * 1_000_033 + int(step)) % (1 << 63)
    _torch().manual_seed(value)
    random.seed(value)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(value % (1 << 32))


# -- the wire: a skeleton (torch.load weights_only) and one flat buffer ------


def _flatten(obj: Any, tensors: List[Any]) -> Any:
    torch = _torch()
    if torch.is_tensor(obj):
        t = obj.detach()
        tensors.append(t)
        return {_TENSOR: len(tensors) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj: Any, parts: List[Any]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return parts[obj[_TENSOR]]
        return {k: _unflatten(v, parts) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, parts) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unflatten(v, parts) for v in obj)
    return obj


def _tensor_specs(obj: Any, out: List[Tuple[int, str, List[int]]]) -> None:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            out.append((int(obj[_TENSOR]), str(obj["dtype"]), [int(d) for d in obj["shape"]]))
            return
        for v in obj.values():
            _tensor_specs(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_specs(v, out)


def _send(payload: Dict[str, Any], dst: int, group: Any) -> int:
    torch = _torch()
    dist = torch.distributed
    tensors: List[Any] = []
    skeleton = _flatten(payload, tensors)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    skel = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    flat = [t.reshape(-1).contiguous().cpu().view(torch.uint8) for t in tensors]
    body = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)
    header = torch.tensor([skel.numel(), body.numel()], dtype=torch.int64)
    dist.send(header, dst, group=group)
    dist.send(skel, dst, group=group)
    if body.numel():
        dist.send(body, dst, group=group)
    return int(skel.numel() + body.numel())


def _receive(src: int, group: Any) -> Tuple[Dict[str, Any], int]:
    torch = _torch()
    dist = torch.distributed
    header = torch.zeros(2, dtype=torch.int64)
    dist.recv(header, src, group=group)
    n_skel, n_body = int(header[0]), int(header[1])
    if not (0 < n_skel <= MAX_SKELETON_BYTES and 0 <= n_body <= MAX_PAYLOAD_BYTES):
        raise RuntimeError(f"warden.heal: rank {src} announced {n_skel} + {n_body} bytes: refused")
    skel = torch.empty(n_skel, dtype=torch.uint8)
    dist.recv(skel, src, group=group)
    skeleton = torch.load(io.BytesIO(bytes(tensor_bytes.view(skel))), weights_only=True)
    specs: List[Tuple[int, str, List[int]]] = []
    _tensor_specs(skeleton, specs)
    specs.sort()
    parts: List[Any] = []
    sizes: List[int] = []
    for i, (index, dtype, shape) in enumerate(specs):
        dt = getattr(torch, dtype, None)
        if index != i or not isinstance(dt, torch.dtype) or any(d < 0 for d in shape):
            raise RuntimeError(f"warden.heal: rank {src} sent a malformed tensor entry {index}")
        numel = 1
        for d in shape:
            numel *= d
        sizes.append(numel * torch.empty(0, dtype=dt).element_size())
        parts.append((dt, shape))
    if sum(sizes) != n_body:
        raise RuntimeError(f"warden.heal: rank {src} sent {n_body} bytes for tensors of {sum(sizes)}")
    body = torch.empty(n_body, dtype=torch.uint8)
    if n_body:
        dist.recv(body, src, group=group)
    tensors: List[Any] = []
    offset = 0
    for (dt, shape), size in zip(parts, sizes):
        # A copy first: a view as a wider dtype needs an aligned offset.
        tensors.append(body[offset : offset + size].clone().view(dt).reshape(shape))
        offset += size
    return _unflatten(skeleton, tensors), n_skel + n_body
