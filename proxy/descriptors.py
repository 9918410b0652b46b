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
  several upstreams, descriptors another library holds), a probe every
  :data:`WATCH_EVERY_S` that finds the process out of them logs a warning (at most one every
  :data:`policies.logs.EVERY_S`) and counts it in ``sluice_descriptors_exhausted_total``: the
  loop reports no failed ``accept()`` itself. The probe (:func:`out_of_descriptors`) opens
  one descriptor and closes it, the same few microseconds whatever the count; it once
  listed ``/proc/self/fd`` instead, which held the loop 13.5 ms at 10,000 descriptors and
  ~140 ms at 100,000, every second.
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
#: How often :class:`DescriptorWatch` probes for a free descriptor, seconds.
WATCH_EVERY_S = 1.0
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


def out_of_descriptors() -> bool:
    """Whether the process is out of descriptors now: opening one (``/dev/null``, closed at
    once) fails with ``EMFILE`` (the process's soft limit) or ``ENFILE`` (the system's table
    full). Constant time, on Linux and macOS alike.

    Raises:
        OSError: any other error opening ``/dev/null``.
    """
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _EXHAUSTED:
            return True
        raise
    os.close(fd)
    return False


class DescriptorWatch:
    """Probes for a free descriptor every :data:`WATCH_EVERY_S` and, when none is left (new
    connections are then closed unaccepted, and files and upstream connections fail to
    open), logs a warning and calls ``exhausted``.

    Args:
        exhausted: called once for each check that finds none left.
        probe: whether none is left now (:func:`out_of_descriptors`; a test's).
    """

    def __init__(self, exhausted: Callable[[], None],
                 probe: Callable[[], bool] = out_of_descriptors) -> None:
        self._exhausted = exhausted
        self._probe = probe

    def check(self) -> bool:
        """One check: whether none is left (logged and counted if so)."""
        if not self._probe():
            return False
        self._exhausted()
        log.warning("out of descriptors (open files at RLIMIT_NOFILE %d, or the system's "
                    "table full): new connections on both ports are closed unaccepted, "
                    "upstream connections and files fail to open; raise the limit (ulimit -n, "
                    "LimitNOFILE=) or lower server.max_connections", open_files_limit()[0],
                    extra=PER_CALL)
        return True

    async def run(self) -> None:
        """Check every :data:`WATCH_EVERY_S` until cancelled."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            self.check()
