"""Free loopback ports for the servers the tests start, picked below the ephemeral range.

A port found by ``bind(0)`` and released is one the kernel hands out next to anyone: any
outgoing connection (the suite runs four workers and many clients) can take it before the
server meant for it binds it. CI failed once that way ("redis-server on port 39237 did not
start"). Below ``ip_local_port_range`` only an explicit bind takes a port, and these tests are
the only ones that pick there; a server that still finds its port taken is started again on
another (``start_sluice``, :meth:`tests.redis_servers.RedisServer.start`).
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

#: A Redis cluster node also listens on its port + 10000 (its bus).
CLUSTER_BUS_OFFSET = 10000
_SPAN = 6000


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(count: int, *, bus: bool = False) -> list[int]:
    """``count`` distinct free loopback ports, each with its port + 10000 free too when
    ``bus``; all of them below the ephemeral range, the bus ports included (unless that
    range starts too low to leave room: then as ``bind(0)`` gives them). Each is held until
    all are picked, so none is handed out twice.

    Raises:
        RuntimeError: no such ports found in 200 tries per port.
    """
    top = ephemeral_floor() - (CLUSTER_BUS_OFFSET if bus else 0)
    low = max(1024, top - _SPAN)
    if top - low < 1000:  # the ephemeral range starts low: take ports as the kernel gives them
        return _kernel_ports(count, bus)
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(200 * count):
            if len(ports) == count:
                break
            port = random.randrange(low, top)
            try:
                with contextlib.ExitStack() as pair:
                    for candidate in (port, port + CLUSTER_BUS_OFFSET)[: 2 if bus else 1]:
                        pair.enter_context(socket.socket()).bind(("127.0.0.1", candidate))
                    held.enter_context(pair.pop_all())
            except OSError:
                continue
            ports.append(port)
        if len(ports) < count:
            raise RuntimeError(f"no {count} free port(s) between {low} and {top}")
        return ports


def _kernel_ports(count: int, bus: bool) -> list[int]:
    """:func:`free_ports` where nothing lies below the ephemeral range: ports ``bind(0)``
    gives (each held until all are picked), the race with outgoing connections accepted."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(200 * count):
            if len(ports) == count:
                return ports
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if bus:
                if port + CLUSTER_BUS_OFFSET > 65535:
                    continue
                try:
                    held.enter_context(socket.socket()).bind(
                        ("127.0.0.1", port + CLUSTER_BUS_OFFSET))
                except OSError:
                    continue
            ports.append(port)
        raise RuntimeError(f"no {count} free port(s)")
