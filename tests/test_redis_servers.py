"""The suite's free ports lie below the ephemeral range, and its own ``redis-server`` helper
survives a port taken before it binds (CI failed once on "redis-server on port 39237 did not
start")."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests import redis_servers
from tests.ports import ephemeral_floor, free_ports
from tests.redis_servers import RedisServer, answers, free_port


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    floor = ephemeral_floor()
    for _ in range(20):
        port = free_port()
        assert 1024 <= port and port + 10000 < floor
    picked = free_ports(5)
    assert len(set(picked)) == 5 and max(picked) < floor


def test_a_picked_port_taken_first_is_replaced(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken, free_port()])
        monkeypatch.setattr(redis_servers, "free_port", lambda: next(picks))
        server = RedisServer(tmp_path / "redis")
        assert server.port == taken
        server.start()
        try:
            assert server.port != taken and answers(server.url)
        finally:
            server.stop()


def test_a_pinned_port_taken_fails_with_the_servers_log(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(RuntimeError, match="exited at start three times") as failure:
            RedisServer(tmp_path / "redis", port=taken).start()
    assert "Address already in use" in str(failure.value)
