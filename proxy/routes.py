"""Routes as the request path uses them: built once from the config, matched by prefix.

Everything a request needs from its route (upstream URL parts, client timeout, policy objects,
bound metrics) is computed here at load time, so the request path does no config lookups.
"""

from __future__ import annotations

from urllib.parse import unquote

import aiohttp

from policies.breaker import Breaker
from policies.concurrency import ConcurrencyLimiter
from policies.rate import RateLimiter
from policies.retry import RetryPolicy
from proxy.config import RouteConfig
from proxy.events import EventLog
from proxy.metrics import Metrics, RouteMetrics


class Route:
    """One configured route and its live policy state.

    Attributes:
        prefix: the path prefix it owns, with both slashes (``/openai/``).
        upstream_base: scheme, host and base path of the upstream, no trailing slash; the
            request path after the prefix is appended to it.
        timeout: the aiohttp client timeout: ``connect`` to get a connection, ``total`` for the
            whole exchange including a streamed body (seconds).
        inflight: requests admitted and not finished (for the gauge and the drain).
        resilient: the route has a breaker or retries, so requests go through
            ``proxy.attempts`` rather than the plain one-shot forward.
    """

    __slots__ = (
        "breaker",
        "concurrency",
        "config",
        "inflight",
        "metrics",
        "name",
        "prefix",
        "protocol",
        "rate",
        "resilient",
        "retry",
        "timeout",
        "upstream_base",
    )

    def __init__(self, config: RouteConfig, metrics: Metrics, events: EventLog) -> None:
        self.config = config
        self.name = config.name
        self.prefix = config.path_prefix
        self.protocol = config.protocol
        self.upstream_base = config.upstream
        self.timeout = aiohttp.ClientTimeout(
            total=config.timeouts.total, connect=config.timeouts.connect
        )
        c = config.concurrency
        self.concurrency = (
            ConcurrencyLimiter(c.limit, c.queue, c.max_wait, c.per_tenant) if c else None
        )
        self.rate = RateLimiter(config.rate) if config.rate else None
        cb = config.circuit_breaker
        self.breaker = Breaker(cb, self.name, events) if cb else None
        self.retry = RetryPolicy(config.retry) if config.retry else None
        self.resilient = self.breaker is not None or self.retry is not None
        self.inflight = 0
        limiter = self.concurrency
        self.metrics: RouteMetrics = metrics.for_route(
            self.name,
            inflight=lambda: self.inflight,
            queued=(lambda: limiter.queued) if limiter else (lambda: 0),
        )
        if self.breaker is not None:
            metrics.bind_circuit_state(self.name, self.breaker.state_value)


class Router:
    """Finds the route owning a raw request path: the longest matching prefix wins."""

    def __init__(self, routes: list[Route]) -> None:
        self.routes = sorted(routes, key=lambda r: len(r.prefix), reverse=True)

    def match(self, raw_path: str) -> Route | None:
        """The route for ``raw_path`` (path and query as received), or ``None``."""
        for route in self.routes:
            if raw_path.startswith(route.prefix):
                return route
        return None


def has_dot_segment(raw_path: str) -> bool:
    """True if the path part has a ``.`` or ``..`` segment, plain or percent-encoded.

    Such paths are refused rather than forwarded: an upstream that resolves them would serve a
    path other than the one Sluice routed on (RFC 3986 §5.2.4).
    """
    path = raw_path.partition("?")[0]
    if "." not in path and "%" not in path:
        return False
    return any(segment in (".", "..") for segment in unquote(path).split("/"))
