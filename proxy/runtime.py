"""The live state of one Sluice server, shared by the proxy and admin apps."""

from __future__ import annotations

import itertools
import os

import aiohttp
from aiohttp import web

from policies.budget import clock_from_env
from proxy.config import Config
from proxy.events import EventLog
from proxy.metrics import Metrics
from proxy.routes import Route, Router


class Runtime:
    """Config, routes with their policy state, metrics, event log and upstream session.

    Attributes:
        draining: set on SIGTERM; new requests are then answered 503 ``draining``.
        session: the one upstream ``ClientSession``, opened in the proxy app's startup.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        #: Unix seconds now, as budgets' windows read it (``SLUICE_TEST_NOW`` moves it, for tests).
        self.clock = clock_from_env()
        self.routes = [
            Route(rc, self.metrics, pricing=config.pricing, clock=self.clock,
                  run_header=config.identity.run_header)
            for rc in config.routes
        ]
        self.router = Router(self.routes)
        self.events = EventLog(config.events.path)
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
        """Open the upstream session and the event log (inside the running loop)."""
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

    async def close(self) -> None:
        """Close the upstream session and flush the event log."""
        if self.session is not None:
            await self.session.close()
        await self.events.close()


RUNTIME = web.AppKey("sluice_runtime", Runtime)
