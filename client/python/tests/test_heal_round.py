"""The round a worker heals into across hosts (``warden.heal._round``) and the
wait for a lost peer's heal (``warden._restart._heal_wait``): what the
launcher's round file and variables may say, and what a bad one does (said,
ignored: the rank stays in its round)."""

from __future__ import annotations

import json
import os

import pytest

from warden import _restart, heal


@pytest.fixture
def in_round(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A worker of round 3 (its environment), with a round file path."""
    monkeypatch.setenv("WARDEN_ROUND_EPOCH", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29503")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(heal.STORE_PORT_ENV, raising=False)
    path = tmp_path / "round.json"
    monkeypatch.setenv(heal.ROUND_FILE_ENV, str(path))
    return path


def test_one_host_has_no_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARDEN_ROUND_EPOCH", raising=False)
    assert heal._round() is None


def test_no_file_is_the_environments_round(in_round) -> None:
    assert heal._round() == {
        "epoch": 3,
        "master_addr": "127.0.0.2",
        "master_port": 29503,
        "world_size": 2,
        "store_port": None,
    }


def test_the_launchers_store_port_is_the_rounds(in_round, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heal.STORE_PORT_ENV, "30503")
    assert heal._round()["store_port"] == 30503


@pytest.mark.parametrize("text", ["x", "0", "70000", "-1"])
def test_a_store_port_that_is_no_port_is_said_and_rank_0_hosts(
    in_round, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    monkeypatch.setenv(heal.STORE_PORT_ENV, text)
    assert heal._round()["store_port"] is None
    assert "is not a port" in capsys.readouterr().err


def test_a_later_round_brings_its_store_port_or_drops_it(in_round, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heal.STORE_PORT_ENV, "30503")
    in_round.write_text(
        json.dumps({"epoch": 4, "master_addr": "h", "master_port": 29504, "world_size": 2, "store_port": 30504})
    )
    assert heal._round()["store_port"] == 30504
    assert os.environ[heal.STORE_PORT_ENV] == "30504"
    in_round.write_text(json.dumps({"epoch": 5, "master_addr": "h", "master_port": 29505, "world_size": 2}))
    assert heal._round()["store_port"] is None
    assert heal.STORE_PORT_ENV not in os.environ


def test_a_later_round_in_the_file_is_taken_into_the_environment(in_round) -> None:
    in_round.write_text(
        json.dumps({"epoch": 4, "master_addr": "127.0.0.4", "master_port": 29504, "world_size": 2, "nnodes": 2})
    )
    got = heal._round()
    assert got == {"epoch": 4, "master_addr": "127.0.0.4", "master_port": 29504, "world_size": 2, "store_port": None}
    assert os.environ["WARDEN_ROUND_EPOCH"] == "4"
    assert os.environ["MASTER_ADDR"] == "127.0.0.4"
    assert os.environ["MASTER_PORT"] == "29504"


def test_an_older_round_in_the_file_is_not_taken(in_round) -> None:
    in_round.write_text(json.dumps({"epoch": 2, "master_addr": "127.0.0.9", "master_port": 29502, "world_size": 2}))
    assert heal._round()["epoch"] == 3
    assert os.environ["MASTER_ADDR"] == "127.0.0.2"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"epoch": 5}),
        json.dumps({"epoch": 5, "master_addr": "h", "master_port": 70000, "world_size": 2}),
        json.dumps({"epoch": 5, "master_addr": "h", "master_port": 29505, "world_size": 0}),
        json.dumps({"epoch": 5, "master_addr": "", "master_port": 29505, "world_size": 2}),
        json.dumps({"epoch": "x", "master_addr": "h", "master_port": 29505, "world_size": 2}),
        json.dumps({"epoch": 5, "master_addr": "h", "master_port": 29505, "world_size": 2, "store_port": 0}),
        json.dumps({"epoch": 5, "master_addr": "h", "master_port": 29505, "world_size": 2, "store_port": "x"}),
        json.dumps([1, 2, 3]),
        " " * (heal.MAX_ROUND_FILE_BYTES + 1),
    ],
)
def test_a_bad_round_file_is_said_and_ignored(in_round, capsys: pytest.CaptureFixture[str], text: str) -> None:
    in_round.write_text(text)
    assert heal._round()["epoch"] == 3
    assert "is not a round" in capsys.readouterr().err
    assert os.environ["MASTER_PORT"] == "29503"


def test_a_link_is_refused(in_round, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"epoch": 9, "master_addr": "h", "master_port": 29509, "world_size": 2}))
    os.symlink(real, in_round)
    assert heal._round()["epoch"] == 3
    assert "staying in round 3" in capsys.readouterr().err


def test_the_peer_wait_is_the_launchers_within_bounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WARDEN_HEAL_PEER_WAIT_S", raising=False)
    assert _restart._heal_wait() == _restart._HEAL_WAIT_S
    monkeypatch.setenv("WARDEN_HEAL_PEER_WAIT_S", "22.0")
    assert _restart._heal_wait() == 22.0
    for bad in ("0", "-1", "nan", "1e9", "soon"):
        monkeypatch.setenv("WARDEN_HEAL_PEER_WAIT_S", bad)
        assert _restart._heal_wait() == _restart._HEAL_WAIT_S
        assert "WARDEN_HEAL_PEER_WAIT_S" in capsys.readouterr().err


# --- A rank's own fault inside a round: the attempt a replacement joins, and
# --- the word to the other hosts' ranks (torch's real stores) ---------------


def _torch_dist():
    torch = pytest.importorskip("torch")
    return torch.distributed


def _attempt_of(store, world: int) -> int:
    dist = _torch_dist()
    control = dist.PrefixStore("control", store)
    return heal._joining_attempt(control, lambda i: dist.PrefixStore(f"attempt-{i}", store), world)


def _enter(store, attempt: int, ranks: int) -> None:
    dist = _torch_dist()
    dist.PrefixStore("control", store).set(f"entered-{attempt}", "1")
    dist.PrefixStore(f"attempt-{attempt}", store).add("warden-heal-joined", ranks)


def test_a_fresh_round_is_joined_at_attempt_0() -> None:
    store = _torch_dist().HashStore()
    assert _attempt_of(store, 4) == 0
    _enter(store, 0, 2)
    # Late to the round's first attempt, which waits for it.
    assert _attempt_of(store, 4) == 0


@pytest.mark.parametrize("newest", [1, 2, 5, 37])
def test_a_replacement_joins_the_survivors_next_attempt(newest: int) -> None:
    store = _torch_dist().HashStore()
    for i in range(newest + 1):
        _enter(store, i, 4)
    # Every rank joined the newest (the lost one among them): the next.
    assert _attempt_of(store, 4) == newest + 1
    # The survivors entered it first and wait for the replacement: that one.
    _enter(store, newest + 1, 3)
    assert _attempt_of(store, 4) == newest + 1


def test_the_next_attempt_is_seen_on_a_launchers_store_and_not_before(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = _torch_dist()
    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(heal, "_poll", None)
    monkeypatch.setattr(heal, "_poll_retry_at", 0.0)
    monkeypatch.setattr(heal, "_joined", None)
    monkeypatch.setattr(heal, "_hosted_at", (7, "127.0.0.1", server.port))
    # No attempt joined yet: cannot be told.
    assert heal._next_attempt_begun() is None
    monkeypatch.setattr(heal, "_joined", (7, 3))
    assert heal._next_attempt_begun() is False
    _enter(server, 3, 4)
    assert heal._next_attempt_begun() is False
    _enter(server, 4, 2)
    assert heal._next_attempt_begun() is True
    # Another round's attempt: not this store's.
    monkeypatch.setattr(heal, "_joined", (8, 3))
    assert heal._next_attempt_begun() is None


def test_a_store_that_is_gone_is_no_begun_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _torch_dist()
    monkeypatch.setattr(heal, "_poll", None)
    monkeypatch.setattr(heal, "_poll_retry_at", 0.0)
    monkeypatch.setattr(heal, "_joined", (7, 0))
    monkeypatch.setattr(heal, "_hosted_at", (7, "127.0.0.1", port))
    monkeypatch.setattr(heal, "POLL_TIMEOUT_S", 0.5)
    assert heal._next_attempt_begun() is False
    # Not asked again at once (a pause before the next client).
    assert heal._poll is None and heal._poll_retry_at > 0


def test_a_lost_peer_waits_for_the_request_or_the_peers_next_attempt() -> None:
    seen = iter([False, False, True])
    assert _restart._wait_request_or(5.0, lambda: next(seen)) == _restart._JOINED
    assert _restart._wait_request_or(0.05, lambda: False) == _restart._NO


def test_a_thread_blocked_on_the_attempts_connection_is_woken_by_its_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    other = socket.create_connection(server.getsockname())
    before = set(heal._socket_fds())
    mine = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    monkeypatch.setattr(heal, "_hosted_at", None)
    heal._set_attempt_sockets(before)
    # The connection opened in between (both ends here), not the one
    # before, not the listener.
    assert heal._attempt_sockets == frozenset({os.fstat(s.fileno()).st_ino for s in (mine, peer)})
    got: list = []
    blocked = threading.Thread(target=lambda: got.append(mine.recv(1)))
    blocked.start()
    assert heal._shut_attempt_sockets() == 2
    blocked.join(10)
    assert not blocked.is_alive() and got == [b""]
    # The other connection is untouched.
    other.sendall(b"x")
    for s in (server, other, mine, peer):
        s.close()
