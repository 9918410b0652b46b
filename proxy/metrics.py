"""Every Prometheus series Sluice exports, declared in one place (SPEC, "Metrics").

Names carry the ``sluice_`` prefix and base units (seconds); each has a ``route`` label whose
values come from the config, so the series count is bounded. Each registry is private to one
server instance, so tests and reloads never collide on the process-wide default registry.

Gauges that mirror live state are read at scrape time so the request path pays nothing for
them: a route's calls (in flight, queued, streams, stalled) through :meth:`Metrics.bind_load`,
the rest through ``set_function``; counters and histograms are bound to their labels once
per route (``RouteMetrics``) so a request does no label lookups.

The counters and histograms a request updates are :class:`LoopCounter` and
:class:`LoopHistogram`: plain numbers that prometheus-client's registry reads through their
``collect()`` (its custom-collector interface), exposed with the same names, types, labels and
buckets as its own ``Counter`` and ``Histogram``. Its own take a lock and run its checks on
every update (~54 Python opcodes an increment, 8 updates a request: 7% of Sluice's share over
a bare proxy, ``python -m bench opcodes``, 2026-12-03): every update runs on the one event
loop.

A scrape is rendered in a worker thread (:meth:`Metrics.render`): at 1,000 routes the text is
6.6 MB, and rendered on the loop it held every proxied call 0.6-1.5 s (a hostile trial). So
what the thread reads must bear the loop changing it meanwhile: the loop counters and
histograms copy their series first (one C-level ``dict.copy``, which the loop cannot interleave
with), prometheus-client's own metrics lock; and what reads the loop's objects (every gauge:
``set_function``, a route's calls, the writers' drop counts) is read on the loop just before,
by :meth:`Metrics.read_on_loop`, the thread formatting those values.
"""

from __future__ import annotations

import contextlib
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from policies.reasons import Reason

if TYPE_CHECKING:
    from policies.budget import Budgets
    from policies.concurrency import ConcurrencyLimiter
    from policies.state.eviction import Eviction

#: LLM calls run from under a second to many minutes; the default buckets stop at 10 s.
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
#: Queue waits are bounded by max_wait, typically well under a minute. Fine between 1 and 10 s:
#: ``histogram_quantile`` interpolates within a bucket, and with 2.5 -> 5 any p95 in between
#: read as ~4.9, so the SluiceQueueWaitNearMaxWait alert (80% of max_wait: 4 s at the default
#: 5 s) fired at waits of 2.7 s (a trial). Up to 600 s: a max_wait over the top bucket's
#: quantile (capped there) never alerts.
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 2.5, 3, 4,
                        5, 6, 8, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)

#: Refusals made before a request has a route: counted in ``sluice_edge_rejections_total``,
#: never in a route's ``sluice_rejections_total``.
EDGE_ONLY = frozenset({Reason.TOO_MANY_CONNECTIONS, Reason.REQUEST_TIMEOUT,
                       Reason.HEADERS_TOO_LARGE, Reason.EXPECTATION_FAILED, Reason.NO_ROUTE,
                       Reason.MISDIRECTED})
#: The reasons ``sluice_edge_rejections_total`` has: those, a request that is not valid
#: HTTP/1.1 (or has a header no route could read), and an error before any answer.
EDGE_REASONS = (*sorted(EDGE_ONLY, key=lambda r: r.code), Reason.BAD_REQUEST,
                Reason.INTERNAL_ERROR)
#: The reasons ``sluice_admin_rejections_total`` has: the admin port's door
#: (``proxy.edge.GuardedServer``) refuses only for these.
ADMIN_REASONS = (Reason.BAD_REQUEST, Reason.HEADERS_TOO_LARGE, Reason.INTERNAL_ERROR,
                 Reason.MISDIRECTED, Reason.REQUEST_TIMEOUT, Reason.TOO_MANY_CONNECTIONS)

#: Values of ``sluice_requests_total{outcome}``.
OUTCOMES = (
    "2xx",  # the upstream answered; by status class
    "3xx",
    "4xx",
    "5xx",
    "rejected",  # Sluice answered itself (see sluice_rejections_total for why)
    "upstream_error",  # no usable answer: connect failure, reset, cut stream, or a stream
    # the upstream ended with a server-side error event after HTTP 200 (status stays 200)
    "upstream_timeout",
    "client_disconnected",  # the caller left before the answer was complete
    "drain_cut",  # still running when the drain_timeout ran out at shutdown
    "replayed",  # answered from the idempotency store (see sluice_idempotent_replays_total)
    "run_cancelled",  # admitted, then ended by its run's cancellation (POST /admin/runs/...)
    "cancel_held",  # an MCP client's cancel of a call kept for its key (dedup): answered 202
    "client_cancelled",  # an MCP call its client cancelled while it waited in Sluice: never sent
    "cancel_applied",  # that client's cancel: the call ended in Sluice, the cancel answered 202
)


#: Distinct tenant label values; tenants seen after these share the label ``other``.
MAX_TENANT_LABELS = 100
OTHER_TENANT = "other"
#: Distinct operation label values per route (tool and model names come from requests);
#: operations seen after these share the label ``other``.
MAX_OPERATION_LABELS = 100
OTHER_OPERATION = "other"
#: Longest operation name a label value may be: MCP asks tool names to be 1 to 128
#: characters (spec 2025-06-18, "Tool names"); a longer name from a request shares ``other``,
#: or a few calls with huge names would make every scrape carry megabytes.
MAX_OPERATION_LABEL_CHARS = 128

# The ``*_created`` series double every counter and histogram and nothing here reads them.
disable_created_metrics()


class CounterSeries:
    """One labelled series of a :class:`LoopCounter`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0; every call site adds a count or a charge)."""
        self.value += amount


class HistogramSeries:
    """One labelled series of a :class:`LoopHistogram`: a count per bucket (not cumulative;
    the last one is ``+Inf``) and the sum of the observations."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose upper bound (``le``) is >= it."""
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class _LoopMetric:
    """A labelled metric updated and read only on the event loop, exposed through
    ``registry`` as prometheus-client exposes its own (``labels`` binds a series once;
    ``remove_by_labels`` drops series, as on the library's metrics)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], object] = {}
        registry.register(self)

    def _new_series(self) -> object:
        raise NotImplementedError

    def labels(self, *values: str) -> object:
        """The series of these label values (positional, in ``labelnames`` order)."""
        key = tuple(str(value) for value in values)
        series = self._series.get(key)
        if series is None:
            if len(key) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}, got {key}")
            series = self._series[key] = self._new_series()
        return series

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        """Drop every series whose labels include ``labels``.

        Raises:
            ValueError: a label name this metric does not have.
        """
        unknown = set(labels) - set(self._labelnames)
        if unknown:
            raise ValueError(f"{self._name} has no label {sorted(unknown)}")
        wanted = [(self._labelnames.index(k), str(v)) for k, v in labels.items()]
        for key in [key for key in self._series
                    if all(key[i] == value for i, value in wanted)]:
            del self._series[key]

    def _family(self) -> Metric:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        """The family without samples (the registry's name check at registration)."""
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class LoopCounter(_LoopMetric):
    """A counter (``NAME_total``) of :class:`CounterSeries`."""

    def labels(self, *values: str) -> CounterSeries:
        return super().labels(*values)  # type: ignore[return-value]

    def _new_series(self) -> CounterSeries:
        return CounterSeries()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        # A copy: the loop may add a series while a render's thread reads them.
        for key, series in self._series.copy().items():
            family.add_metric(key, series.value)  # type: ignore[attr-defined]
        yield family


class LoopHistogram(_LoopMetric):
    """A histogram (``NAME_bucket``, ``NAME_count``, ``NAME_sum``) of
    :class:`HistogramSeries` with upper bounds ``buckets`` (seconds; ``+Inf`` is added)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        self._bounds = tuple(float(b) for b in buckets)
        self._le = [*(floatToGoString(b) for b in self._bounds), "+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> HistogramSeries:
        return super().labels(*values)  # type: ignore[return-value]

    def _new_series(self) -> HistogramSeries:
        return HistogramSeries(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        # Copies: the loop may add a series, or observe, while a render's thread reads them
        # (an observation may then be in the buckets and not yet in the sum).
        for key, series in self._series.copy().items():
            cumulative, buckets = 0, []
            for le, count in zip(self._le, series.counts.copy(),  # type: ignore[attr-defined]
                                 strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(key, buckets, series.sum)  # type: ignore[attr-defined]
        yield family


class Metrics:
    """The series of one Sluice server, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        #: What a render's thread formats of the collectors read on the loop, while it
        #: renders (:meth:`render`); unset elsewhere (they are then read at once).
        self._rendering = threading.local()
        #: Registers a collector to be read on the loop (:class:`_ReadOnLoop`).
        on_loop = self._on_loop = _OnLoop(r, self._rendering)
        # The standard process_* (memory, CPU, open files), python_gc_* and python_info.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.requests = LoopCounter(
            "sluice_requests", "Requests finished, by outcome.", ["route", "outcome"], registry=r
        )
        self.rejections = LoopCounter(
            "sluice_rejections",
            "Requests Sluice answered itself instead of forwarding, by reason.",
            ["route", "reason"],
            registry=r,
        )
        self.edge_rejections = LoopCounter(
            "sluice_edge_rejections",
            "Connections and requests refused before any route's checks (over "
            "server.max_connections with none idle to close; header or body timeouts; "
            "requests that are not valid HTTP/1.1, name no route or another host), by "
            "reason.",
            ["reason"],
            registry=r,
        )
        self.admin_rejections = LoopCounter(
            "sluice_admin_rejections",
            "Connections and requests the admin port refused at its door (over its 64 "
            "connections with none idle to close; header timeouts; requests that are not "
            "valid HTTP/1.1; a Host it does not serve), by reason: probes and scrapes "
            "crowded out or misdirected.",
            ["reason"],
            registry=r,
        )
        idle_closed = LoopCounter(
            "sluice_idle_connections_closed",
            "Connections closed between requests (idle, silent, or part of a head in; on the "
            "admin port also part of a body in) to make room for a new one, the port being at "
            "its connection limit, by port.",
            ["port"],
            registry=r,
        )
        self.idle_closed_proxy = idle_closed.labels("proxy")
        self.idle_closed_admin = idle_closed.labels("admin")
        # Descriptors (proxy/descriptors.py).
        self.connections_limit = Gauge(
            "sluice_connections_limit",
            "Connections a port serves at once, by port: on the proxy port "
            "server.max_connections, or fewer when the open-files limit (RLIMIT_NOFILE) "
            "leaves room for fewer (the log says so at start and reload).",
            ["port"], registry=on_loop,
        )
        self.descriptors_exhausted = LoopCounter(
            "sluice_descriptors_exhausted",
            "Checks (one a second) that found the process out of descriptors (open files at "
            "RLIMIT_NOFILE): new connections were being closed unaccepted, which the event "
            "loop does not report.", [], registry=r,
        ).labels()
        for reason in EDGE_REASONS:  # at 0 from the start, so that rate() sees the first
            self.edge_rejections.labels(reason.code)
        for reason in ADMIN_REASONS:
            self.admin_rejections.labels(reason.code)
        self._load: Callable[[], dict[str, RouteLoad]] = dict
        on_loop.register(_LoadGauges(lambda: self._load()))
        self.buffered_bytes = Gauge(
            "sluice_buffered_request_bytes",
            "Request body bytes held now, all routes (as they arrive, at least a body's first "
            "64 KiB, from a request's head to the end of its call); "
            "server.max_buffered_bytes bounds it.",
            registry=on_loop,
        )
        self.queue_wait = LoopHistogram(
            "sluice_queue_wait_seconds",
            "Time a request that had to queue waited: to its admission, or to its end "
            "when it was never admitted (a queue timeout, a caller that left).",
            ["route"],
            buckets=QUEUE_WAIT_BUCKETS_S,
            registry=r,
        )
        self.upstream_duration = LoopHistogram(
            "sluice_upstream_duration_seconds",
            "Time from admission to the end of the upstream's answer.",
            ["route"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        # The configured concurrency limits, so dashboards and alerts can put the live values
        # next to them (they change on reload); only routes with a concurrency block have them.
        self.concurrency_limit = Gauge(
            "sluice_concurrency_limit", "Configured concurrency limit (slots).", ["route"],
            registry=on_loop,
        )
        self.queue_limit = Gauge(
            "sluice_queue_limit", "Configured queue capacity (requests).", ["route"],
            registry=on_loop,
        )
        self.queue_max_wait = Gauge(
            "sluice_queue_max_wait_seconds", "Configured longest wait in the queue.", ["route"],
            registry=on_loop,
        )
        # Config reloads (proxy/reload.py); the gauge pair follows Prometheus's own
        # prometheus_config_last_reload_* convention.
        self.config_reloads = Counter(
            "sluice_config_reloads", "Config reloads applied (SIGHUP or a changed file).",
            registry=r,
        )
        self.config_reloads_unchanged = Counter(
            "sluice_config_reloads_unchanged",
            "Reloads (SIGHUP or a file whose times changed) that found the config file, and "
            "the files it names, holding the config in force byte for byte: nothing applied.",
            registry=r,
        )
        self.config_reload_failures = Counter(
            "sluice_config_reload_failures",
            "Config reloads refused because the new file was invalid (the old one still serves).",
            registry=r,
        )
        self.config_last_reload_successful = Gauge(
            "sluice_config_last_reload_successful",
            "1 if the last config load or reload succeeded, 0 if it was refused.",
            registry=on_loop,
        )
        self.config_last_reload_success = Gauge(
            "sluice_config_last_reload_success_timestamp_seconds",
            "Unix time of the last successful config load or reload.",
            registry=on_loop,
        )
        self.config_restart_pending = Gauge(
            "sluice_config_restart_pending",
            "1 while the config file asks for a change only a restart applies (a listen "
            "address, state, dead_letter...; a reload keeps the running value), else 0.",
            registry=on_loop,
        )
        self.config_last_reload_successful.set(1)
        self.config_last_reload_success.set_to_current_time()

        # Amplification: attempts / work units (SPEC); see policies/idempotency.py.
        self.upstream_attempts = LoopCounter(
            "sluice_upstream_attempts", "Requests sent to the upstream, retries included.",
            ["route"], registry=r,
        )
        self.work_units = LoopCounter(
            "sluice_work_units",
            "Distinct logical calls: requests that are neither a client retry nor a repeat of "
            "a known idempotency key.",
            ["route"], registry=r,
        )
        self.idempotent_replays = LoopCounter(
            "sluice_idempotent_replays",
            "Answers replayed instead of forwarded: from the idempotency store, or a twin's "
            "failure given to the duplicates that waited for it.",
            ["route"], registry=r,
        )
        self.idempotent_failure_replays = LoopCounter(
            "sluice_idempotent_failure_replays",
            "Of the replays, those of a twin's failure: a duplicate that waited for its key's "
            "call was given that call's failure (not stored) instead of running it again.",
            ["route"], registry=r,
        )
        self.idempotency_entries = Gauge(
            "sluice_idempotency_store_entries",
            "Records in this replica's idempotency store for the route: all of them with the "
            "memory backend; with Redis, only those of the local fallback (the shared records "
            "are counted in Redis, not here).",
            ["route"], registry=on_loop,
        )
        self.idempotency_bytes = Gauge(
            "sluice_idempotency_store_bytes",
            "Bytes charged to this replica's idempotency store for the route (bounded by "
            "max_bytes; with Redis, the local fallback's only).",
            ["route"], registry=on_loop,
        )
        self.idempotency_waiting = Gauge(
            "sluice_idempotency_waiting",
            "Requests waiting for an in-flight request with the same idempotency key.",
            ["route"], registry=on_loop,
        )

        # Retries, circuit breakers and dead letters (policies/retry.py, breaker.py,
        # deadletter.py).
        self.retries = LoopCounter(
            "sluice_retries", "Retries Sluice made after a failed attempt.", ["route"], registry=r
        )
        self.retry_overflow = LoopCounter(
            "sluice_retry_overflow",
            "Retries skipped because the retry budget was spent (Envoy's retry_overflow).",
            ["route"], registry=r,
        )
        self.circuit_state = Gauge(
            "sluice_circuit_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ["route"], registry=on_loop,
        )
        self.dead_letters = LoopCounter(
            "sluice_dead_letters", "Requests recorded in the dead-letter store.", ["route"],
            registry=r,
        )
        self.dead_letter_depth = Gauge(
            "sluice_dead_letter_depth", "Records in the dead-letter store.", ["route"],
            registry=on_loop,
        )
        self.dead_letter_failures = LoopCounter(
            "sluice_dead_letter_write_failures",
            "Dead letters lost: the store could not write them (a full disk, a file that "
            "cannot be opened or is damaged, Redis not answering, a locked file with as "
            "many letters held for it as are kept).", ["route"], registry=r,
        )

        # Shared state (policies/state/).
        self.state_backend_up = Gauge(
            "sluice_state_backend_up",
            "1 while the state backend answers; 0 while Redis is unreachable and "
            "state.on_unavailable applies.", ["backend"], registry=on_loop,
        )

        # Token accounting (policies/accounting.py).
        self.tokens = LoopCounter(
            "sluice_tokens",
            "Tokens charged, by direction (input, output): as the upstream reported them, "
            "else estimated (see sluice_usage_missing_total).",
            ["route", "tenant", "direction"],
            registry=r,
        )
        self.cost = LoopCounter(
            "sluice_cost_usd", "USD charged, priced from the pricing table.",
            ["route", "tenant"], registry=r,
        )
        self.usage_missing = LoopCounter(
            "sluice_usage_missing",
            "Answers without a usage report: charged at their reservation, or estimated for a "
            "stream that was cut.",
            ["route"],
            registry=r,
        )
        self.usage_over_reservation = LoopCounter(
            "sluice_usage_over_reservation",
            "Calls charged more than was reserved for them: reported usage past the tokens "
            "reserved (input estimate plus output cap), or an operation's cost past its "
            "cost_per_call hold (retries, cost_per_second). Charged as spent, they can pass "
            "a budget by the difference (the completed event's over_reservation_tokens or "
            "over_reservation_usd).",
            ["route"],
            registry=r,
        )
        self.budget_remaining = Gauge(
            "sluice_budget_remaining",
            "Budget left in the current window (tokens or USD), per tenant (tenant=\"*\" for a "
            "per-route budget).",
            ["route", "tenant", "unit"],
            registry=on_loop,
        )
        self.budget_reserved = Gauge(
            "sluice_budget_reserved",
            "Budget held by requests in flight (tokens or USD), per tenant.",
            ["route", "tenant", "unit"],
            registry=on_loop,
        )
        # Per operation (policies/operations.py): the tool, endpoint pattern or model.
        self.operation_requests = LoopCounter(
            "sluice_operation_requests",
            "Requests finished, by operation and outcome (the outcomes of "
            "sluice_requests_total).",
            ["route", "operation", "outcome"], registry=r,
        )
        self.operation_rejections = LoopCounter(
            "sluice_operation_rejections",
            "Requests Sluice refused, by operation and reason.",
            ["route", "operation", "reason"], registry=r,
        )
        self.operation_duration = LoopHistogram(
            "sluice_operation_upstream_duration_seconds",
            "Admission to completion of requests, by operation.",
            ["route", "operation"], buckets=DURATION_BUCKETS_S, registry=r,
        )
        self.operation_cost = LoopCounter(
            "sluice_operation_cost_usd",
            "USD charged for operations' cost_per_call and cost_per_second.",
            ["route", "operation"], registry=r,
        )
        self.operation_circuit_state = Gauge(
            "sluice_operation_circuit_state",
            "An operation's circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ["route", "operation"], registry=on_loop,
        )
        self._operation_labels: dict[str, set[str]] = {}
        # Anti-metrics: the signals that stay silent elsewhere (issue 12).
        self.cancels = LoopCounter(
            "sluice_cancels",
            "Calls ended by their run's cancellation, by where they were (admitting, queued, "
            "inflight).",
            ["route", "where"], registry=r,
        )
        self.finished_after_leaving = LoopCounter(
            "sluice_finished_after_leaving",
            "MCP calls whose upstream exchange Sluice finished after their caller left (kept "
            "for their idempotency key; counted client_disconnected in sluice_requests_total), "
            "by what it came to (2xx ... 5xx, upstream_timeout, upstream_error, drain_cut, "
            "run_cancelled).",
            ["route", "outcome"], registry=r,
        )
        self.finishing = Gauge(
            "sluice_finishing_after_leaving",
            "MCP calls whose upstream exchange Sluice is finishing after their caller left "
            "(counted in sluice_inflight_requests too).", registry=on_loop,
        )
        self.polling = Gauge(
            "sluice_polled_calls",
            "MCP calls whose answer the upstream closed early for polling, held until their "
            "response comes on the GET that resumes it (counted in sluice_inflight_requests "
            "too).", registry=on_loop,
        )
        self.held_tasks = Gauge(
            "sluice_held_task_calls",
            "MCP tools/calls answered with a CreateTaskResult (2025-11-25 tasks), held until "
            "their task is seen over or their bound passes (counted in "
            "sluice_inflight_requests too).", registry=on_loop,
        )
        self.task_tables = Gauge(
            "sluice_task_table_entries",
            "Entries of Sluice's tables of MCP tasks (proxy/mcp_tasks.py), by table: held "
            "(tasks whose calls are held), tenants and sessions (counts of tenants and "
            "sessions with task calls held or in flight), asked (sessions with task calls "
            "in flight), early_ends (terminal statuses seen before their task's "
            "CreateTaskResult, kept 30 s). All but early_ends are 0 when no task is held.",
            ["table"], registry=on_loop,
        )
        self.expiries = LoopCounter(
            "sluice_expiries",
            "Queued calls dropped before reaching the upstream, by reason (max_wait: the "
            "queue's bound; deadline: the caller's own deadline).",
            ["route", "reason"], registry=r,
        )
        self._tenant_labels: set[str] = set()

    def read_on_loop(self, names: Iterable[str] = ()) -> dict[_ReadOnLoop, list[Metric]]:
        """Read, on the event loop, every collector that reads the loop's objects (the
        gauges, the routes' calls, the writers' drop counts), for :meth:`render`; with
        ``names`` (a scrape's ``name[]``), only those exposing one of them (a review: a
        scrape of one series read every route's gauges, 50-100 ms at 2,000 routes)."""
        return self._on_loop.read(names)

    def render(self, encoder: Callable[[Collector], bytes], names: Sequence[str],
               read: dict[_ReadOnLoop, list[Metric]]) -> bytes:
        """The exposition of the registry by ``encoder`` (prometheus-client's
        ``choose_encoder``), only the series ``names`` if any are given (``name[]``, as its
        own handlers do), with what ``read`` (:meth:`read_on_loop`) read on the loop.

        Thread-safe: meant for a worker thread, so the loop serves calls meanwhile."""
        self._rendering.read = read
        try:
            return encoder(self.registry.restricted_registry(names) if names
                           else self.registry)
        finally:
            self._rendering.read = None

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as a label value: the first ``MAX_TENANT_LABELS`` tenants seen keep their
        name, later ones share ``other`` (label values from a header must stay bounded), as
        do tenants named as a label with another meaning (``*``, ``other``)."""
        labels = self._tenant_labels
        if tenant in labels:
            return tenant
        if tenant in _NOT_TENANT_LABELS:
            # A caller sending X-Tenant-ID: * overwrote the per-route budget's gauges.
            return OTHER_TENANT
        if len(labels) < MAX_TENANT_LABELS:
            labels.add(tenant)
            return tenant
        return OTHER_TENANT

    def operation_label(self, route: str, operation: str) -> str:
        """``operation`` as a label value on ``route``: the operations its config names
        (:meth:`name_operations`) and the first ``MAX_OPERATION_LABELS`` seen of at most
        ``MAX_OPERATION_LABEL_CHARS`` characters keep their name, others share ``other`` (tool
        and model names come from requests, so their number and size must stay bounded)."""
        labels = self._operation_labels.setdefault(route, set())
        if operation in labels:
            return operation
        if len(labels) < MAX_OPERATION_LABELS and len(operation) <= MAX_OPERATION_LABEL_CHARS:
            labels.add(operation)
            return operation
        return OTHER_OPERATION

    def name_operations(self, route: str, names: Iterable[str]) -> None:
        """Give the operations ``route``'s config names a label of their own whatever callers
        sent before: names from requests cannot push a configured tool into ``other``."""
        self._operation_labels.setdefault(route, set()).update(names)

    def bind_load(self, read: Callable[[], dict[str, RouteLoad]]) -> None:
        """Export each route's live calls (``sluice_inflight_requests``,
        ``sluice_queue_depth``, ``sluice_open_streams``, ``sluice_stalled_requests``) from
        ``read()`` at scrape time: route name to its :class:`RouteLoad`, a series for each
        route it names (the runtime names the routes in force, and the removed ones until
        their calls end)."""
        self._load = read

    def for_route(
        self,
        route: str,
        limits: Callable[[], ConcurrencyLimiter] | None = None,
    ) -> RouteMetrics:
        """Bind every series to ``route``; the callables are read at scrape time.

        ``limits`` returns the route's concurrency limiter, or is ``None`` when the route has
        no concurrency block (its limit gauges are then removed, e.g. after a reload).
        """
        gauges = {
            self.concurrency_limit: lambda lim: lim.limit,
            self.queue_limit: lambda lim: lim.queue_capacity,
            self.queue_max_wait: lambda lim: lim.max_wait,
        }
        for gauge, read in gauges.items():
            if limits is None:
                gauge.remove_by_labels({"route": route})
            else:
                gauge.labels(route).set_function(lambda read=read: read(limits()))
        return RouteMetrics(self, route)

    def forget_route(self, route: str) -> None:
        """Drop every series of a route removed from the config (its values would go stale)."""
        self._operation_labels.pop(route, None)
        for metric in vars(self).values():
            if isinstance(metric, MetricWrapperBase | _LoopMetric):
                try:
                    metric.remove_by_labels({"route": route})
                except ValueError:  # a series without a route label
                    continue

    def bind_idempotency(self, route: str, entries: Callable[[], float],
                         size: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read a route's idempotency store size and waiters at scrape time."""
        self.idempotency_entries.labels(route).set_function(entries)
        self.idempotency_bytes.labels(route).set_function(size)
        self.idempotency_waiting.labels(route).set_function(waiting)

    def unbind_idempotency(self, route: str) -> None:
        """Drop a route's idempotency gauges (a reload removed its block)."""
        for gauge in (self.idempotency_entries, self.idempotency_bytes,
                      self.idempotency_waiting):
            gauge.remove_by_labels({"route": route})

    def bind_circuit_state(self, route: str, state: Callable[[], float]) -> None:
        """Read ``route``'s breaker state (0, 1, 2) at scrape time."""
        self.circuit_state.labels(route).set_function(state)

    def unbind_circuit_state(self, route: str) -> None:
        """Drop a route's breaker gauge (a reload removed its block)."""
        self.circuit_state.remove_by_labels({"route": route})

    def bind_operation_breakers(self, route: str,
                                states: dict[str, Callable[[], float]]) -> None:
        """Read the breaker state of each of ``route``'s operations that has one, by
        operation name (from the config, so bounded), at scrape time; operations no longer
        listed lose their series."""
        self.operation_circuit_state.remove_by_labels({"route": route})
        for operation, state in states.items():
            self.operation_circuit_state.labels(route, operation).set_function(state)

    def bind_dead_letter_depth(self, route: str, depth: Callable[[], float]) -> None:
        """Read ``route``'s dead-letter count at scrape time."""
        self.dead_letter_depth.labels(route).set_function(depth)

    def bind_output_dropped(self, read: Callable[[], dict[str, float]]) -> None:
        """Export ``sluice_output_dropped_total{output}``: lines of output (``events``,
        ``log``) dropped because their destination took nothing (proxy/output.py), read at
        scrape time from ``read()``, by output."""
        self._on_loop.register(_ReadCounter(
            "sluice_output_dropped",
            "Lines of output (events, log) dropped because their destination (a pipe, a "
            "terminal, a file) was not taking them.", "output", read))

    def bind_state_key_faults(self, read: Callable[[], dict[str, float]]) -> None:
        """Export ``sluice_state_key_faults_total{what}``: calls on a Redis key under the
        prefix holding what Sluice does not write there (policies/state/connection.py), by
        kind of state, read at scrape time from ``read()``."""
        self._on_loop.register(_ReadCounter(
            "sluice_state_key_faults",
            "Shared-state calls on a key holding what Sluice does not write there (another "
            "type, unreadable content), served as state.on_unavailable says while the backend "
            "stays up, by kind of state.", "what", read))

    def bind_state_eviction(self, read: Callable[[], Eviction | None]) -> None:
        """Export whether the Redis servers of the shared state evict keys, as ``read()``
        last read them (policies/state/eviction.py), per server:
        ``sluice_state_evicting_policy{node,policy}`` and the counter
        ``sluice_state_redis_evicted_keys_total{node}``, both absent while unknown
        (``None``)."""
        self._on_loop.register(_EvictionSeries(read))

    def bind_dead_letters_dropped(
            self, read: Callable[[], Mapping[tuple[str, str], float]]) -> None:
        """Export ``sluice_dead_letters_dropped_total{route,reason}``: the oldest dead letters
        this replica's writes dropped (policies/deadletter.py), read at scrape time from
        ``read()``, by route and the bound that dropped them (``reason``: its key,
        ``max_records`` or ``max_records_per_tenant``; as ``sluice_expiries_total`` names
        ``max_wait``)."""
        self._on_loop.register(_ReadCounter(
            "sluice_dead_letters_dropped",
            "Oldest dead letters dropped, by the bound that dropped them (max_records: the "
            "store's, dead_letter.max_records; max_records_per_tenant: the share of the "
            "tenant whose letter was written, its own oldest).",
            ("route", "reason"), read))


class RouteLoad(NamedTuple):
    """A route's calls now, for its gauges (:meth:`Metrics.bind_load`)."""

    inflight: int  # admitted and not finished, streams included
    queued: int  # waiting for a slot of the route's concurrency limiter
    streams: int  # MCP GET streams open
    stalled: int  # in flight and silent for longer than server.stall_after


#: The gauges of :class:`RouteLoad`, field by field: (name, help).
_LOAD_GAUGES = (
    ("sluice_inflight_requests",
     "Requests admitted and not yet finished (on a route a reload removed: until they end)."),
    ("sluice_queue_depth",
     "Requests waiting for a concurrency slot: the route's, its endpoints', tools' and "
     "models', or a run's fanout.width."),
    ("sluice_open_streams",
     "MCP GET streams open (a session's stream, or a resumed answer once its response is "
     "through): counted in sluice_inflight_requests, they hold no concurrency slot."),
    ("sluice_stalled_requests",
     "Requests in flight that moved no bytes for longer than server.stall_after."),
)


class _ReadOnLoop:
    """A collector of values read from the event loop's objects, which a render's thread
    must not read (a dict the loop changes as it is iterated): it formats what
    :meth:`Metrics.read_on_loop` read just before, on the loop. Collected outside a render
    (a test's ``generate_latest``, on the loop), it reads them at once."""

    def __init__(self, collector: Collector, rendering: threading.local) -> None:
        self._collector = collector
        self._rendering = rendering
        #: The sample names it exposes, as prometheus-client's registry names them (a
        #: family's name with its type's suffixes), for a render of some names only.
        self.names = frozenset(name for family in self.describe()
                               for name in _sample_names(family))

    def describe(self) -> list[Metric]:
        """The collector's families (its ``describe()``, else what it collects: as the
        registry's ``auto_describe`` would), for the registry's name checks."""
        describe = getattr(self._collector, "describe", None)
        return describe() if describe is not None else list(self._collector.collect())

    def read(self) -> list[Metric]:
        """The collector's families now (on the loop)."""
        return list(self._collector.collect())

    def collect(self) -> Iterable[Metric]:
        read = getattr(self._rendering, "read", None)
        if read is None:
            return self._collector.collect()
        # One registered after the render's read (none is, once the runtime is built)
        # shows nothing in that render rather than be read from its thread.
        return read.get(self, [])


class _OnLoop:
    """Registers collectors to be read on the loop (as a ``registry=`` argument too:
    prometheus-client's metrics call ``register`` on it), each in ``registry``'s order."""

    def __init__(self, registry: CollectorRegistry, rendering: threading.local) -> None:
        self._registry = registry
        self._rendering = rendering
        self._collectors: list[_ReadOnLoop] = []

    def register(self, collector: Collector) -> None:
        wrapped = _ReadOnLoop(collector, self._rendering)
        self._registry.register(wrapped)
        self._collectors.append(wrapped)

    def read(self, names: Iterable[str] = ()) -> dict[_ReadOnLoop, list[Metric]]:
        """Each collector's families now, or only those of the collectors exposing one of
        ``names`` (a scrape's ``name[]``: the rest are not rendered, so not read)."""
        wanted = frozenset(names)
        return {collector: collector.read() for collector in self._collectors
                if not wanted or collector.names & wanted}


#: The suffixes prometheus-client's registry adds to a family's name, by its type, in the
#: sample names a ``name[]`` restriction matches (its ``CollectorRegistry._get_names``).
_TYPE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "info": ("_info",),
}


def _sample_names(family: Metric) -> tuple[str, ...]:
    """The sample names of ``family`` as a registry restriction matches them: its name, and
    its name with each of its type's suffixes."""
    return (family.name, *(family.name + suffix for suffix in _TYPE_SUFFIXES.get(family.type,
                                                                                 ())))


class _LoadGauges:
    """The gauges of each route's :class:`RouteLoad`, read at scrape time from ``read()``
    (route name to load): one series per route it names, so a route with no calls left
    after its removal has none."""

    def __init__(self, read: Callable[[], dict[str, RouteLoad]]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(name, doc, labels=["route"]) for name, doc in _LOAD_GAUGES]

    def collect(self) -> Iterator[Metric]:
        families = self.describe()
        for route, load in self._read().items():
            for family, value in zip(families, load, strict=True):
                family.add_metric([route], value)  # type: ignore[attr-defined]
        yield from families


class _ReadCounter:
    """A counter whose values are read at scrape time, as ``{label value: count}`` for one
    label, ``{(label values...): count}`` for several (kept by whatever counts them: the
    output writers, the dead-letter queue)."""

    def __init__(self, name: str, documentation: str, labels: str | tuple[str, ...],
                 read: Callable[[], Mapping[Any, float]]) -> None:
        self._name, self._documentation = name, documentation
        self._labels = [labels] if isinstance(labels, str) else list(labels)
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labels)
        for values, count in self._read().items():
            family.add_metric(list(values) if isinstance(values, tuple) else [values], count)
        yield family


class _EvictionSeries:
    """Each Redis server's eviction policy and count, read at scrape time from ``read()``;
    no sample while it is unknown (absent rather than NaN, Prometheus's unknown: a NaN
    sample would make the counter's ``increase()`` over it NaN). The count is the server's
    own cumulative ``evicted_keys``, exported as a counter per server: it goes back to 0 only
    when that server's does (a restart, a failover, ``CONFIG RESETSTAT``), which
    ``increase()`` reads as a reset of that series alone."""

    def __init__(self, read: Callable[[], Eviction | None]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        policy, evicted = self._families()
        eviction = self._read()
        for node in eviction.nodes if eviction is not None else ():
            policy.add_metric([node.node, node.policy], 1.0 if node.evicting else 0.0)
            evicted.add_metric([node.node], node.evicted_keys)
        yield policy
        yield evicted

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily(
                "sluice_state_evicting_policy",
                "1 while a Redis server of the state has a maxmemory-policy that evicts keys "
                "(any but noeviction, with a maxmemory set): at its maxmemory it deletes "
                "Sluice's leases, markers and counters unseen; 0 with noeviction. Labels: "
                "node, the server's host:port (each primary of a cluster); policy, its "
                "maxmemory-policy. Absent while unknown (Redis down, INFO refused).",
                labels=["node", "policy"]),
            CounterMetricFamily(
                "sluice_state_redis_evicted_keys",
                "Keys a Redis server of the state has evicted since it started (its INFO "
                "stats evicted_keys, every program's keys), as last read, by node (each "
                "primary of a cluster). Back to 0 when that server restarts, fails over or "
                "runs CONFIG RESETSTAT. Absent while unknown.",
                labels=["node"]),
        )


class RouteMetrics:
    """One route's series, bound to their labels once (per tenant: at first sight)."""

    __slots__ = (
        "_by_operation",
        "_by_tenant",
        "_metrics",
        "dead_letter_failures",
        "dead_letters",
        "expiries",
        "failure_replays",
        "name",
        "outcomes",
        "queue_wait",
        "rejections",
        "replays",
        "retries",
        "retry_overflow",
        "upstream_attempts",
        "upstream_duration",
        "usage_missing",
        "usage_over_reservation",
        "work_units",
    )

    def __init__(self, metrics: Metrics, route: str) -> None:
        self._metrics = metrics
        self.name = route
        self.outcomes = {o: metrics.requests.labels(route, o) for o in OUTCOMES}
        self.rejections = {r: metrics.rejections.labels(route, r.code) for r in Reason
                           if r not in EDGE_ONLY}
        self.queue_wait = metrics.queue_wait.labels(route)
        self.upstream_duration = metrics.upstream_duration.labels(route)
        self.upstream_attempts = metrics.upstream_attempts.labels(route)
        self.work_units = metrics.work_units.labels(route)
        self.replays = metrics.idempotent_replays.labels(route)
        self.failure_replays = metrics.idempotent_failure_replays.labels(route)
        self.retries = metrics.retries.labels(route)
        self.retry_overflow = metrics.retry_overflow.labels(route)
        self.dead_letters = metrics.dead_letters.labels(route)
        self.dead_letter_failures = metrics.dead_letter_failures.labels(route)
        self.usage_missing = metrics.usage_missing.labels(route)
        self.usage_over_reservation = metrics.usage_over_reservation.labels(route)
        self.expiries = {r: metrics.expiries.labels(route, r) for r in ("max_wait", "deadline")}
        self._by_tenant: dict[str, TenantSeries] = {}
        self._by_operation: dict[str, OperationSeries] = {}

    def detach(self) -> Metrics:
        """Stop exporting this route's series: it was removed from the config
        (:meth:`Metrics.forget_route`), and a call still in flight on it must not bring a
        series back (a first-seen tenant's or operation's). From now on they are counted in a
        private registry, returned, that nobody scrapes."""
        self._metrics = Metrics()
        self._by_tenant = {}
        self._by_operation = {}
        return self._metrics

    def cancelled(self, kind: str) -> None:
        """Count a call ended by its run's cancellation, by where it was then (``inflight``,
        ``queued`` or ``admitting``)."""
        self._metrics.cancels.labels(self.name, kind).inc()

    def finished_after_leaving(self, outcome: str) -> None:
        """Count a call whose exchange was finished after its caller left, by ``outcome``."""
        self._metrics.finished_after_leaving.labels(self.name, outcome).inc()

    def operation(self, operation: str) -> OperationSeries:
        """The per-operation series of this route (``other`` beyond the label cap)."""
        series = self._by_operation.get(operation)
        if series is None:
            label = self._metrics.operation_label(self.name, operation)
            series = self._by_operation.get(label)
            if series is None:
                series = OperationSeries(self._metrics, self.name, label)
                self._by_operation[label] = series
            if label == operation:
                self._by_operation[operation] = series
        return series

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


class OperationSeries:
    """One operation's series on one route."""

    __slots__ = ("_metrics", "cost", "duration", "label", "route")

    def __init__(self, metrics: Metrics, route: str, label: str) -> None:
        self._metrics = metrics
        self.route = route
        self.label = label
        self.duration = metrics.operation_duration.labels(route, label)
        self.cost = metrics.operation_cost.labels(route, label)

    def outcome(self, outcome: str) -> None:
        """Count one finished request with ``outcome``."""
        self._metrics.operation_requests.labels(self.route, self.label, outcome).inc()

    def rejected(self, reason: str) -> None:
        """Count one refusal for ``reason`` (a reason code)."""
        self._metrics.operation_rejections.labels(self.route, self.label, reason).inc()


class TenantSeries:
    """Token and cost counters of one (route, tenant label); ``label`` is ``other`` for
    tenants beyond the cap."""

    __slots__ = ("cost", "input_tokens", "label", "output_tokens")

    def __init__(self, metrics: Metrics, route: str, label: str) -> None:
        self.label = label
        self.input_tokens = metrics.tokens.labels(route, label, "input")
        self.output_tokens = metrics.tokens.labels(route, label, "output")
        self.cost = metrics.cost.labels(route, label)


#: Label of the per-route budget's gauges, which belong to no tenant.
ROUTE_SCOPE_LABEL = "*"
#: Tenant label values that mean something else: no tenant's own series may carry them.
_NOT_TENANT_LABELS = frozenset({ROUTE_SCOPE_LABEL, OTHER_TENANT})


class BudgetGauges:
    """``sluice_budget_remaining`` and ``sluice_budget_reserved`` of one route's budgets (its
    tokens' on LLM routes, its tools' or endpoints' costs' on others), read at scrape time:
    the route-wide ones at once, a tenant's once it is first admitted (unless it is beyond the
    tenant label cap: one ``other`` series could not say whose budget it is).
    """

    __slots__ = ("_bound", "_budgets", "_gauged", "_metrics", "_route", "_tenant_units")

    def __init__(self, metrics: Metrics, route: str, budgets: Budgets | None) -> None:
        self._metrics = metrics
        self._route = route
        self._budgets = budgets
        self._gauged: set[str] = set()
        #: ``(label, unit)`` of each series bound to ``budgets``.
        self._bound: set[tuple[str, str]] = set()
        limits = budgets.limits if budgets is not None else ()
        self._tenant_units = list(dict.fromkeys(lim.unit for lim in limits if lim.per == "tenant"))
        for unit in dict.fromkeys(lim.unit for lim in limits if lim.per == "route"):
            self._bind(ROUTE_SCOPE_LABEL, "route", "", unit)

    def watch(self, tenant: str, series: TenantSeries) -> None:
        """Export ``tenant``'s remaining budget, if it has one and a label of its own."""
        if not self._tenant_units or tenant in self._gauged or series.label == OTHER_TENANT:
            return
        self._gauged.add(tenant)
        for unit in self._tenant_units:
            self._bind(tenant, "tenant", tenant, unit)

    def take_over(self, old: BudgetGauges) -> None:
        """After a reload: the tenants ``old`` exported read the new budgets now (a tenant's
        series read the replaced limits until its next admission, 982 left of a 1,000 limit
        raised to 100,000); series of units the route no longer budgets are removed."""
        for tenant in old._gauged:
            if self._tenant_units and tenant not in self._gauged:
                self._gauged.add(tenant)
                for unit in self._tenant_units:
                    self._bind(tenant, "tenant", tenant, unit)
        for label, unit in old._bound - self._bound:
            for gauge in (self._metrics.budget_remaining, self._metrics.budget_reserved):
                with contextlib.suppress(KeyError):
                    gauge.remove(self._route, label, unit)

    def _bind(self, label: str, per: str, tenant: str, unit: str) -> None:
        budgets = self._budgets
        assert budgets is not None
        self._bound.add((label, unit))
        metrics, route = self._metrics, self._route
        metrics.budget_remaining.labels(route, label, unit).set_function(
            lambda: budgets.remaining(unit, per, tenant))
        metrics.budget_reserved.labels(route, label, unit).set_function(
            lambda: budgets.reserved(unit, per, tenant))
