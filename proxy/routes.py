"""Routes as the request path uses them: built once from the config, matched by prefix.

Everything a request needs from its route (upstream URL parts, client timeout, policy objects,
bound metrics) is computed here at load time, so the request path does no config lookups.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import unquote

import aiohttp

from policies.accounting import Accounting
from policies.budget import Budgets, MemoryLedger
from policies.concurrency import ConcurrencyLimiter
from policies.rate import RateLimiter
from proxy.config import ModelPrice, RouteConfig
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
        accounting: token accounting, on ``openai`` and ``anthropic`` routes only.
    """

    __slots__ = (
        "accounting",
        "concurrency",
        "config",
        "inflight",
        "metrics",
        "name",
        "prefix",
        "protocol",
        "rate",
        "timeout",
        "upstream_base",
    )

    def __init__(self, config: RouteConfig, metrics: Metrics, *,
                 pricing: dict[str, ModelPrice] | None = None,
                 clock: Callable[[], float] = time.time, run_header: str = "X-Run-ID") -> None:
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
        self.inflight = 0
        limiter = self.concurrency
        self.metrics: RouteMetrics = metrics.for_route(
            self.name,
            inflight=lambda: self.inflight,
            queued=(lambda: limiter.queued) if limiter else (lambda: 0),
        )
        self.accounting: Accounting | None = None
        if config.protocol in ("openai", "anthropic"):
            budgets = None
            if config.budget:
                # One ledger per route: its counters are keyed by limit names unique per route.
                budgets = Budgets(config.budget, pricing or {}, MemoryLedger(), clock)
            self.accounting = Accounting(
                config, pricing or {}, self.rate.tokens if self.rate else None, budgets,
                metrics, self.metrics, run_header,
            )


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
