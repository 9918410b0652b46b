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

        # Retries, circuit breakers and dead letters (policies/retry.py, breaker.py,
        # deadletter.py). attempts / work units is the amplification factor.
        self.upstream_attempts = Counter(
            "sluice_upstream_attempts", "Requests sent to the upstream, retries included.",
            ["route"], registry=r,
        )
        self.work_units = Counter(
            "sluice_work_units",
            "Units of work received: requests that are not an SDK's own retry "
            "(x-stainless-retry-count absent or 0).",
            ["route"], registry=r,
        )
        self.retries = Counter(
            "sluice_retries", "Retries Sluice made after a failed attempt.", ["route"], registry=r
        )
        self.retry_overflow = Counter(
            "sluice_retry_overflow",
            "Retries skipped because the retry budget was spent (Envoy's retry_overflow).",
            ["route"], registry=r,
        )
        self.circuit_state = Gauge(
            "sluice_circuit_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ["route"], registry=r,
        )
        self.dead_letters = Counter(
            "sluice_dead_letters", "Requests recorded in the dead-letter store.", ["route"],
            registry=r,
        )
        self.dead_letter_depth = Gauge(
            "sluice_dead_letter_depth", "Records in the dead-letter store.", ["route"],
            registry=r,
        )

    def for_route(
        self, route: str, inflight: Callable[[], float], queued: Callable[[], float]
    ) -> RouteMetrics:
        """Bind every series to ``route``; the two callables are read at scrape time."""
        self.inflight.labels(route).set_function(inflight)
        self.queue_depth.labels(route).set_function(queued)
        return RouteMetrics(self, route)

    def bind_circuit_state(self, route: str, state: Callable[[], float]) -> None:
        """Read ``route``'s breaker state (0, 1, 2) at scrape time."""
        self.circuit_state.labels(route).set_function(state)

    def bind_dead_letter_depth(self, route: str, depth: Callable[[], float]) -> None:
        """Read ``route``'s dead-letter count at scrape time."""
        self.dead_letter_depth.labels(route).set_function(depth)


class RouteMetrics:
    """One route's series, bound to their labels once."""

    __slots__ = (
        "dead_letters",
        "outcomes",
        "queue_wait",
        "rejections",
        "retries",
        "retry_overflow",
        "upstream_attempts",
        "upstream_duration",
        "work_units",
    )

    def __init__(self, metrics: Metrics, route: str) -> None:
        self.outcomes = {o: metrics.requests.labels(route, o) for o in OUTCOMES}
        self.rejections = {r: metrics.rejections.labels(route, r.code) for r in Reason}
        self.queue_wait = metrics.queue_wait.labels(route)
        self.upstream_duration = metrics.upstream_duration.labels(route)
        self.upstream_attempts = metrics.upstream_attempts.labels(route)
        self.work_units = metrics.work_units.labels(route)
        self.retries = metrics.retries.labels(route)
        self.retry_overflow = metrics.retry_overflow.labels(route)
        self.dead_letters = metrics.dead_letters.labels(route)
