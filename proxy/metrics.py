"""Every Prometheus series Sluice exports, declared in one place (SPEC, "Metrics").

Names carry the ``sluice_`` prefix and base units (seconds); each has a ``route`` label whose
values come from the config, so the series count is bounded. Each registry is private to one
server instance, so tests and reloads never collide on the process-wide default registry.

Gauges that mirror live state (in-flight, queue depth) are read at scrape time through
``set_function`` so the request path pays nothing for them; counters and histograms are bound
to their labels once per route (``RouteMetrics``) so a request does no label lookups.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from policies.reasons import Reason

#: LLM calls run from under a second to many minutes; the default buckets stop at 10 s.
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
#: Queue waits are bounded by max_wait, typically well under a minute.
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

#: Values of ``sluice_requests_total{outcome}``.
OUTCOMES = (
    "2xx",  # the upstream answered; by status class
    "3xx",
    "4xx",
    "5xx",
    "rejected",  # Sluice answered itself (see sluice_rejections_total for why)
    "upstream_error",  # no usable answer: connect failure, reset, cut stream
    "upstream_timeout",
    "client_disconnected",  # the caller left before the answer was complete
)


#: Distinct tenant label values; tenants seen after these share the label ``other``.
MAX_TENANT_LABELS = 100
OTHER_TENANT = "other"

# The ``*_created`` series double every counter and histogram and nothing here reads them.
disable_created_metrics()


class Metrics:
    """The series of one Sluice server, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "sluice_requests", "Requests finished, by outcome.", ["route", "outcome"], registry=r
        )
        self.rejections = Counter(
            "sluice_rejections",
            "Requests Sluice answered itself instead of forwarding, by reason.",
            ["route", "reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "sluice_inflight_requests", "Requests admitted and not yet finished.", ["route"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "sluice_queue_depth", "Requests waiting for a concurrency slot.", ["route"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "sluice_queue_wait_seconds",
            "Time from enqueue to admission, for requests that had to queue.",
            ["route"],
            buckets=QUEUE_WAIT_BUCKETS_S,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "sluice_upstream_duration_seconds",
            "Time from admission to the end of the upstream's answer.",
            ["route"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        # Token accounting (policies/accounting.py).
        self.tokens = Counter(
            "sluice_tokens",
            "Tokens charged, by direction (input, output): as the upstream reported them, "
            "else estimated (see sluice_usage_missing_total).",
            ["route", "tenant", "direction"],
            registry=r,
        )
        self.cost = Counter(
            "sluice_cost_usd", "USD charged, priced from the pricing table.",
            ["route", "tenant"], registry=r,
        )
        self.usage_missing = Counter(
            "sluice_usage_missing",
            "Answers without a usage report: charged at their reservation, or estimated for a "
            "stream that was cut.",
            ["route"],
            registry=r,
        )
        self.budget_remaining = Gauge(
            "sluice_budget_remaining",
            "Budget left in the current window (tokens or USD), per tenant (tenant=\"*\" for a "
            "per-route budget).",
            ["route", "tenant", "unit"],
            registry=r,
        )
        self.budget_reserved = Gauge(
            "sluice_budget_reserved",
            "Budget held by requests in flight (tokens or USD), per tenant.",
            ["route", "tenant", "unit"],
            registry=r,
        )
        self._tenant_labels: set[str] = set()

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as a label value: the first ``MAX_TENANT_LABELS`` tenants seen keep their
        name, later ones share ``other`` (label values from a header must stay bounded)."""
        labels = self._tenant_labels
        if tenant in labels:
            return tenant
        if len(labels) < MAX_TENANT_LABELS:
            labels.add(tenant)
            return tenant
        return OTHER_TENANT

    def for_route(
        self, route: str, inflight: Callable[[], float], queued: Callable[[], float]
    ) -> RouteMetrics:
        """Bind every series to ``route``; the two callables are read at scrape time."""
        self.inflight.labels(route).set_function(inflight)
        self.queue_depth.labels(route).set_function(queued)
        return RouteMetrics(self, route)


class RouteMetrics:
    """One route's series, bound to their labels once (per tenant: at first sight)."""

    __slots__ = (
        "_by_tenant",
        "_metrics",
        "name",
        "outcomes",
        "queue_wait",
        "rejections",
        "upstream_duration",
        "usage_missing",
    )

    def __init__(self, metrics: Metrics, route: str) -> None:
        self._metrics = metrics
        self.name = route
        self.outcomes = {o: metrics.requests.labels(route, o) for o in OUTCOMES}
        self.rejections = {r: metrics.rejections.labels(route, r.code) for r in Reason}
        self.queue_wait = metrics.queue_wait.labels(route)
        self.upstream_duration = metrics.upstream_duration.labels(route)
        self.usage_missing = metrics.usage_missing.labels(route)
        self._by_tenant: dict[str, TenantSeries] = {}

    def tenant(self, tenant: str) -> TenantSeries:
        """The per-tenant series of this route (``other`` beyond the label cap)."""
        series = self._by_tenant.get(tenant)
        if series is None:
            label = self._metrics.tenant_label(tenant)
            series = self._by_tenant.get(label)
            if series is None:
                series = TenantSeries(self._metrics, self.name, label)
                self._by_tenant[label] = series
            if label == tenant or len(self._by_tenant) < 4 * MAX_TENANT_LABELS:
                self._by_tenant[tenant] = series
        return series


class TenantSeries:
    """Token and cost counters of one (route, tenant label); ``label`` is ``other`` for
    tenants beyond the cap."""

    __slots__ = ("cost", "input_tokens", "label", "output_tokens")

    def __init__(self, metrics: Metrics, route: str, label: str) -> None:
        self.label = label
        self.input_tokens = metrics.tokens.labels(route, label, "input")
        self.output_tokens = metrics.tokens.labels(route, label, "output")
        self.cost = metrics.cost.labels(route, label)
