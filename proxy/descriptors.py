"""The process's open-files limit (``RLIMIT_NOFILE``) and the connections it can serve.

Sluice usually starts under a soft limit of 1,024 descriptors (shells, systemd services,
Docker and containerd all give that), while ``server.max_connections`` defaults to 1,000 and
a proxied connection holds two descriptors (the caller's and its upstream call's; an MCP
session's GET stream holds both for the whole session). Past the limit ``accept()`` fails
with ``EMFILE``, and uvloop (libuv) handles that itself: it closes a spare descriptor it
keeps for the purpose, accepts every pending connection and closes it at once (libuv
``src/unix/stream.c``, ``uv__emfile_trick``), so callers and the admin port's probes see
resets, nothing is logged and nothing reaches Python. A hostile trial: 520 MCP GET streams
from one caller reset further streams, a victim's call and ``/healthz``, and two upstream
connects failed as 502 ``upstream_error``.

So, as production servers do:

* :func:`raise_open_files_limit`: at ``sluice serve``'s start the soft limit is raised to the
  hard one. Go's runtime does the same for every program since Go 1.19 (``src/os/rlimit.go``,
  "Go programs that import package os now automatically increase the open file limit"): the
  low soft limit exists for programs that use ``select()``, which Sluice does not;
* :func:`connection_limit`: if the soft limit is still too low for ``max_connections``, the
  proxy port serves fewer connections, so that a connection over the bound gets the 503
  ``too_many_connections`` the edge answers (:mod:`proxy.edge`) before descriptors run out
  (:data:`DESCRIPTORS_PER_CONNECTION` each, after :func:`descriptor_reserve`);
* :class:`DescriptorWatch`: should they run out anyway (idle upstream connections pooled to
  several upstreams, descriptors another library holds), a check every
  :data:`WATCH_EVERY_S` that finds the process at its limit logs a warning (at most one every
  :data:`policies.logs.EVERY_S`) and counts it in ``sluice_descriptors_exhausted_total``: the
  loop reports no failed ``accept()`` itself. The check counts the process's own descriptors,
  so a system-wide table that is full (``ENFILE``) is not seen.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
from collections.abc import Callable

from policies.logs import PER_CALL

log = logging.getLogger("sluice")

#: Descriptors one proxy-port connection may take: its own; its upstream call's; and one for
#: a connection refused while it is open, since the edge holds as many connections waiting
#: for their 503 ``too_many_connections`` as it serves (:meth:`proxy.edge.EdgeProtocol._refuse`).
DESCRIPTORS_PER_CONNECTION = 3
#: Descriptors a serving Sluice holds besides its connections: about 20 at start (standard
#: streams, the loop's epoll, io_uring, pipes and eventfd, the two listening sockets, libuv's
#: spare for ``EMFILE``, the event log, the dead-letter store's SQLite file with its -wal and
#: -shm), with room for DNS lookups' sockets, a file reopened on rotation, a form spooled to
#: disk, and an MCP call's ``notifications/cancelled`` or session DELETE on a connection of
#: its own.
BASE_DESCRIPTORS = 64
#: Connections to Redis besides its pool's: the pub/sub connections that carry cancels and
#: wake-ups.
REDIS_EXTRA_CONNECTIONS = 4
#: How often :class:`DescriptorWatch` counts the process's descriptors, seconds.
WATCH_EVERY_S = 1.0
#: Where the process's open descriptors are listed, one entry each (Linux, then macOS).
_FD_DIRS = ("/proc/self/fd", "/dev/fd")
#: The errors of a process (``EMFILE``) or a system (``ENFILE``) out of descriptors.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})


def open_files_limit() -> tuple[int, int]:
    """The soft and hard ``RLIMIT_NOFILE`` now (``resource.RLIM_INFINITY`` for no limit)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise the soft open-files limit to the hard one, as Go's runtime does at start.

    Returns the soft limit before and after when it was raised; ``None`` when it already was
    the hard one or the system refused (macOS refuses an unlimited soft limit: it is then
    left as it was)."""
    soft, hard = open_files_limit()
    if soft == hard or (hard != resource.RLIM_INFINITY and soft > hard):
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return None
    return soft, hard


def descriptor_reserve(admin_connections: int, redis_connections: int | None) -> int:
    """Descriptors kept out of the proxy port's bound: :data:`BASE_DESCRIPTORS`, the admin
    port's ``admin_connections`` twice (those it serves, and as many waiting for their 503),
    and with the Redis backend its pool (``redis_connections``; ``None`` without Redis)
    and :data:`REDIS_EXTRA_CONNECTIONS`. A Redis Cluster opens a pool per node: with many
    nodes, raise the limit."""
    reserve = BASE_DESCRIPTORS + 2 * admin_connections
    if redis_connections is not None:
        reserve += redis_connections + REDIS_EXTRA_CONNECTIONS
    return reserve


def connection_limit(max_connections: int, soft_limit: int, reserve: int) -> int:
    """The proxy port's connection bound: ``max_connections``, or fewer when ``soft_limit``
    descriptors (``RLIMIT_NOFILE``) leave room for fewer, after ``reserve``
    (:func:`descriptor_reserve`), at :data:`DESCRIPTORS_PER_CONNECTION` each; at least 1."""
    if soft_limit == resource.RLIM_INFINITY:
        return max_connections
    room = (soft_limit - reserve) // DESCRIPTORS_PER_CONNECTION
    return max(1, min(max_connections, room))


def open_descriptors() -> int | None:
    """How many descriptors the process has open now; ``None`` where that cannot be read.

    Raises:
        OSError: ``EMFILE`` or ``ENFILE``: none is left to list them with.
    """
    for path in _FD_DIRS:
        try:
            return len(os.listdir(path)) - 1  # listing the directory opened one of them
        except OSError as exc:
            if exc.errno in _EXHAUSTED:
                raise
    return None


class DescriptorWatch:
    """Counts the process's descriptors every :data:`WATCH_EVERY_S` and, when they reach
    the soft limit (new connections are then closed unaccepted, and files and upstream
    connections fail to open), logs a warning and calls ``exhausted``.

    Args:
        exhausted: called once for each check that finds the limit reached.
        count: the descriptors open now (:func:`open_descriptors`; a test's).
        limit: the soft limit now (a test's).
    """

    def __init__(self, exhausted: Callable[[], None],
                 count: Callable[[], int | None] = open_descriptors,
                 limit: Callable[[], int] = lambda: open_files_limit()[0]) -> None:
        self._exhausted = exhausted
        self._count = count
        self._limit = limit

    def check(self) -> bool:
        """One check: whether the limit is reached (logged and counted if so)."""
        limit = self._limit()
        try:
            count = self._count()
        except OSError:  # none left to count them with: exhausted
            count = limit
        if count is None or limit == resource.RLIM_INFINITY or count < limit:
            return False
        self._exhausted()
        log.warning("out of descriptors (open files at RLIMIT_NOFILE %d, or the system's "
                    "table full): new connections on both ports are closed unaccepted, "
                    "upstream connections and files fail to open; raise the limit (ulimit -n, "
                    "LimitNOFILE=) or lower server.max_connections", limit, extra=PER_CALL)
        return True

    async def run(self) -> None:
        """Check every :data:`WATCH_EVERY_S` until cancelled."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            self.check()
