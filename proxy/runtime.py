"""The live state of one Sluice server, shared by the proxy and admin apps."""

from __future__ import annotations

import itertools
import os

import aiohttp
from aiohttp import web

from policies.deadletter import DeadLetterQueue
from proxy.config import Config
from proxy.events import EventLog
from proxy.metrics import Metrics
from proxy.routes import Route, Router


class Runtime:
    """Config, routes with their policy state, metrics, event log and upstream session.

    Attributes:
        draining: set on SIGTERM; new requests are then answered 503 ``draining``.
        session: the one upstream ``ClientSession``, opened in the proxy app's startup.
        dead_letters: the dead-letter store, when a route has ``retry``; else ``None``.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.events = EventLog(config.events.path)
        self.routes = [Route(rc, self.metrics, self.events) for rc in config.routes]
        self.router = Router(self.routes)
        self.dead_letters: DeadLetterQueue | None = None
        if any(route.retry is not None for route in self.routes):
            store = self.dead_letters = DeadLetterQueue(config.dead_letter)
            for route in self.routes:
                if route.retry is not None:
                    self.metrics.bind_dead_letter_depth(
                        route.name, lambda name=route.name: store.depth(name)
                    )
        self.draining = False
        self.session: aiohttp.ClientSession | None = None
        identity = config.identity
        self.tenant_header = identity.tenant_header
        self.run_header = identity.run_header
        self.priority_header = identity.priority_header
        self.default_tenant = identity.default_tenant
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}-{os.urandom(3).hex()}-"

    def next_request_id(self) -> str:
        """A request id unique to this process (cheaper than a UUID on the hot path)."""
        return f"{self._id_prefix}{next(self._ids)}"

    @property
    def inflight(self) -> int:
        """Requests admitted on any route and not yet finished."""
        return sum(route.inflight for route in self.routes)

    async def open(self) -> None:
        """Open the upstream session, the event log and the dead-letter store.

        Raises:
            sqlite3.Error: the dead-letter file cannot be opened or created.
        """
        connector = aiohttp.TCPConnector(
            limit=0,  # concurrency is bounded by the routes' own limits, not by the pool
            ttl_dns_cache=60,
            keepalive_timeout=30,
            enable_cleanup_closed=True,  # closes leaked TLS transports on Python 3.11
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            trust_env=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        await self.events.start()
        if self.dead_letters is not None:
            await self.dead_letters.open()

    async def close(self) -> None:
        """Close the upstream session, the dead-letter store, and flush the event log."""
        if self.session is not None:
            await self.session.close()
        if self.dead_letters is not None:
            await self.dead_letters.close()
        await self.events.close()


RUNTIME = web.AppKey("sluice_runtime", Runtime)
