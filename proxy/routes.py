"""Routes as the request path uses them: built once from the config, matched by prefix.

Everything a request needs from its route (upstream URL parts, client timeout, policy objects,
bound metrics) is computed here at load time, so the request path does no config lookups.

A config reload builds new ``Route`` objects, which touches nothing live; putting them in
force (:meth:`proxy.runtime.Runtime.commit`) has each one call :meth:`Route.take_over` on the
route of the same name it replaces, so live policy state (slots held, queues, bucket levels)
carries over, then :meth:`Route.bind_metrics`; see :mod:`proxy.reload` for the pattern a
policy follows.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Collection
from typing import Any

from yarl import URL

from policies.accounting import Accounting
from policies.bodies import FormReader
from policies.breaker import Breaker
from policies.budget import Budgets, hold_for
from policies.concurrency import ConcurrencyLimiter, OperationSlot
from policies.config import DEFAULT_OPERATION, ModelPrice, RouteConfig
from policies.idempotency import Idempotency
from policies.operations import (
    Operation,
    Operations,
    Plan,
    TakeOver,
    carry_over,
    new_limiter,
    reconfigure_limiter,
    replaces_idempotency,
    width_limiters,
)
from policies.pipeline import Call
from policies.rate import RateLimiter
from policies.retry import RetryPolicy
from policies.runs import FanoutWidth, RunLimits, RunRegistry, RunTracker
from policies.state import StateBackends, memory_backends
from proxy.client import client_timeout
from proxy.events import EventLog
from proxy.forward import request_drop, upstream_url
from proxy.locations import Relocation
from proxy.metrics import BudgetGauges, Metrics, RouteMetrics


class Route:
    """One configured route and its live policy state.

    Attributes:
        prefix: the path prefix it owns, with both slashes (``/openai/``).
        upstream_base: scheme, host and base path of the upstream, no trailing slash; the
            request path after the prefix is appended to it.
        locations: maps a redirect's ``Location`` under ``upstream_base`` back to
            ``prefix`` (:class:`proxy.locations.Relocation`).
        timeout: the aiohttp client timeout: ``connect`` to get a connection, ``total`` for the
            whole exchange including a streamed body (seconds).
        inflight: requests admitted through this object and not finished.
        present: requests matched to this object and not finished: the admitted ones and
            those still being read, admitted or queued.
        streams: the admitted requests of ``inflight`` that are MCP streams (a session's GET
            stream, ``subscriptions/listen``): open and mostly silent for a whole session,
            they carry no call a drain should wait for.
        retired: the routes of the same name this one replaced on reloads that still had
            requests present then; their counts join ``inflight_total`` and
            ``present_total`` (a call queued on one is admitted there, reloads later).
        draining: the objects of ``concurrency`` and ``fanout`` blocks (the route's, its
            operations') that reloads removed while they held calls, by block key; the block
            added back gets its own again (:class:`policies.operations.TakeOver`).
        policies: the admission steps, in order (:meth:`_admission_order`).
        accounting: token accounting, on ``openai`` and ``anthropic`` routes only.
        backends: the state its policies keep their counters in
            (:class:`policies.state.StateBackends`).
        budgets: the route's budgets (the accounting's on LLM routes; on ``mcp`` and
            ``http`` routes, the ``usd`` budgets operations' costs are charged to), or None.
        operations: the route's per-operation blocks (:mod:`policies.operations`), or None.
        base_plan: how a call no operation block applies to is admitted and forwarded;
            :meth:`plan` finds a call's plan.
        metrics, budget_gauges: its series and budget gauges, set by :meth:`bind_metrics`
            once the route goes in force (building one binds nothing).
    """

    #: Attributes holding policy objects. A policy object may have a ``state()`` method
    #: returning a JSON-ready dict, shown by the admin API under its name.
    POLICIES = ("idempotency", "breaker", "rate", "accounting", "fanout", "concurrency",
                "retry")

    __slots__ = (
        "_plans",
        "accounting",
        "backends",
        "base_plan",
        "breaker",
        "budget_gauges",
        "budgets",
        "concurrency",
        "config",
        "cut",
        "deadline_header",
        "draining",
        "events",
        "fanout",
        "global_fanout",
        "global_limits",
        "idempotency",
        "inflight",
        "live",
        "locations",
        "metrics",
        "name",
        "operations",
        "own_credentials",
        "prefix",
        "present",
        "protocol",
        "rate",
        "request_drop",
        "retired",
        "retry",
        "run_limits",
        "run_tracker",
        "streams",
        "timeout",
        "upstream_base",
        "urls",
    )

    def __init__(self, config: RouteConfig, events: EventLog, *,
                 pricing: dict[str, ModelPrice] | None = None,
                 clock: Callable[[], float] = time.time, run_header: str = "X-Run-ID",
                 runs: RunRegistry | None = None, global_limits: RunLimits | None = None,
                 global_fanout: FanoutWidth | None = None, global_fanout_wait: float = 0.0,
                 state: StateBackends | None = None,
                 identity_headers: Collection[str] = (),
                 forms: FormReader | None = None, prefixes: Collection[str] = ()) -> None:
        """Build the route and its policy objects; nothing live is touched (no gauge bound, no
        shared object changed), so a route built and then dropped leaves no trace.

        ``global_fanout_wait`` is the top-level ``fanout.max_wait`` of the config being built:
        the shared ``global_fanout`` still has the running one until the reload is committed.
        ``identity_headers``: the tenant, run, parent run and priority headers, whose
        underscore look-alikes are not forwarded (:func:`proxy.forward.request_drop`).
        ``forms``: reads a form's model, the runtime's (its worker thread shut down with it);
        a route's own if none is given. ``prefixes``: every route's prefix in the config, so
        that a redirect is never mapped onto another route's (:mod:`proxy.locations`).
        """
        self.config = config
        #: Where the policies keep their counters: this process's memory, or Redis shared by
        #: every replica (the runtime's, from the ``state`` block).
        self.backends = state if state is not None else memory_backends()
        self.name = config.name
        self.prefix = config.path_prefix
        self.protocol = config.protocol
        self.upstream_base = config.upstream
        #: A redirect's ``Location`` mapped back onto this route (``proxy.locations``).
        self.locations = Relocation(self.prefix, self.upstream_base, prefixes)
        #: The upstream URL carries user info: aiohttp sends it as HTTP Basic credentials,
        #: and refuses a request that also has an Authorization header.
        self.own_credentials = "@" in urllib.parse.urlsplit(config.upstream).netloc
        self.request_drop = request_drop(config.request_headers_to_remove, identity_headers)
        #: The request path from this index on is what goes upstream (the prefix less its
        #: last slash).
        self.cut = len(self.prefix) - 1
        #: The upstream URL of each short request target seen (:meth:`url`), by the target.
        self.urls: dict[str, URL] = {}
        #: The header carrying what is left of a caller's deadline to the upstream
        #: (``timeouts.deadline_header``; ``http`` and ``mcp`` routes only), or ``None``.
        self.deadline_header = (config.timeouts.deadline_header
                                if config.protocol in ("http", "mcp") else None)
        self.events = events
        self.timeout = client_timeout(config.timeouts.total, config.timeouts.connect)
        self.concurrency: ConcurrencyLimiter | None = new_limiter(config.concurrency,
                                                                  self.backends, self.name)
        # Runs: the tree and cancellation (shared by every route), this route's run limits
        # and fan-out, and those of the top-level blocks (shared, from the runtime).
        runs = runs if runs is not None else RunRegistry()
        self.run_limits = (RunLimits(runs, self.name, config.run, config.fanout)
                           if config.run or (config.fanout and config.fanout.depth is not None)
                           else None)
        self.run_tracker = RunTracker(
            runs, [limits for limits in (global_limits, self.run_limits) if limits is not None])
        f = config.fanout
        self.fanout = (FanoutWidth(f.width, f.max_wait, width_limiters(self.backends, self.name))
                       if f and f.width else None)
        self.global_limits = global_limits
        self.global_fanout = global_fanout
        self.rate = (RateLimiter(config.rate, self.backends, self.name, config.protocol)
                     if config.rate else None)
        i = config.idempotency
        self.idempotency = (Idempotency(i, self.name, backends=self.backends,
                                        mcp_calls=config.protocol == "mcp")
                            if i and i.mode != "off" else None)
        cb = config.circuit_breaker
        self.breaker = Breaker(cb, self.name, events.emit_system, self.backends) if cb else None
        self.retry = RetryPolicy(config.retry) if config.retry else None
        self.inflight = 0
        self.present = 0
        self.streams = 0
        #: The calls admitted through this object and not finished (stall detection).
        self.live: set[Call] = set()
        self.retired: tuple[Route, ...] = ()
        self.draining: dict[str, Any] = {}
        self.accounting: Accounting | None = None
        # The route's counters are the group of its name in the shared ledger.
        # A reservation is held for at least as long as a call may run (a 1 h total timeout
        # once lost its reservation at 15 min, mid-stream, and the budget was overspent).
        self.budgets = (Budgets(config.budget, pricing or {}, self.backends, clock, self.name,
                                hold_for(config, global_fanout_wait if global_fanout
                                         else 0.0))
                        if config.budget else None)
        _, blocks = config.operations()
        if config.protocol in ("openai", "anthropic"):
            token_models = {name: op.rate.tokens if op.rate is not None else None
                            for name, op in blocks.items()}
            self.accounting = Accounting(config, pricing or {}, self.rate, self.budgets,
                                         run_header, token_models)
        self.operations = (Operations(config, self.backends, events.emit_system, self.budgets,
                                      run_header, forms if forms is not None else FormReader())
                           if blocks else None)
        self._plans: dict[str, Plan] = {}
        self._admission_order()

    def bind_metrics(self, metrics: Metrics, replaced: Route | None = None) -> None:
        """Export this route's series and gauges: called when it goes in force (after
        :meth:`take_over` of ``replaced``, the route of the same name it replaces, if any), never
        when it is built, so a reload that fails leaves the running routes' gauges as they were.
        """
        # Gauges read this route's policies at scrape time; a gauge of a block this route
        # lacks is removed, so it cannot keep reading the object of the route it replaced.
        # Its calls' gauges (in flight, queued...) are the runtime's (Runtime.load).
        self.metrics: RouteMetrics = metrics.for_route(
            self.name, limits=(lambda: self.concurrency) if self.concurrency else None)
        _, blocks = self.config.operations()
        metrics.name_operations(self.name, blocks)
        if self.idempotency is not None:
            metrics.bind_idempotency(
                self.name,
                entries=lambda: len(self.idempotency.store) if self.idempotency else 0,
                size=lambda: self.idempotency.store.bytes if self.idempotency else 0,
                waiting=lambda: self.idempotency.waiting if self.idempotency else 0,
            )
        else:
            metrics.unbind_idempotency(self.name)
        if self.breaker is not None:
            metrics.bind_circuit_state(
                self.name, lambda: self.breaker.state_value() if self.breaker else 0)
        else:
            metrics.unbind_circuit_state(self.name)
        self.budget_gauges = BudgetGauges(metrics, self.name, self.budgets)
        if replaced is not None:
            self.budget_gauges.take_over(replaced.budget_gauges)
        # Read through the operation object: take_over() may have swapped its breaker.
        metrics.bind_operation_breakers(self.name, {
            op.name: lambda op=op: op.breaker.state_value() if op.breaker else 0
            for op in self.operations or () if op.breaker is not None})

    def detach_metrics(self) -> None:
        """Export nothing more of this route: a reload removed it and dropped its series, and
        the calls still in flight on it count where nobody scrapes
        (:meth:`proxy.metrics.RouteMetrics.detach`)."""
        detached = self.metrics.detach()
        self.budget_gauges = BudgetGauges(detached, self.name, self.budgets)

    def _admission_order(self) -> None:
        """The plans of the route's calls (:class:`policies.operations.Plan`): its policies
        in the order they admit a call (docs/design.md), the ones that cost nothing and hold
        nothing first, the queues last, so a call refused by a quota never waits in a queue,
        and one waiting in a queue holds its quota. An operation's steps come right after
        the route's of the same kind; its slot before the route's, so a call queued for a
        busy operation holds no route slot that the route's other operations could use."""
        self.base_plan = self._plan(None)
        self._plans = ({op.name: self._plan(op) for op in self.operations}
                       if self.operations is not None else {})

    def _plan(self, op: Operation | None) -> Plan:
        config = self.config
        return Plan(
            op,
            (
                self.run_tracker,  # the run tree; a cancelled run is refused before all else
                # A replay or a wait for a twin costs no quota or slot. An operation's own
                # block replaces the route's, ``mode: off`` included (no step at all).
                op.idempotency if op is not None and replaces_idempotency(op.config)
                else self.idempotency,
                self.global_limits,  # run budgets and fan-out depth, all routes
                self.run_limits,  # the same, this route
                self.breaker,  # an open breaker refuses before anything is taken
                op and op.breaker,
                self.rate,
                self.accounting,  # token rate and budget reservation
                op and op.rate,  # the operation's units (a model's tokens: after accounting)
                op and op.costs,  # the operation's cost, held on the usd budgets
                self.global_fanout,  # the run's width, all routes, and its queue
                self.fanout,  # the run's width on this route, and its queue
                # The operation's slot, and its queue, counted in the route's per_tenant.
                op and op.concurrency and (OperationSlot(op.concurrency, self.concurrency)
                                           if self.concurrency is not None
                                           else op.concurrency),
                self.concurrency,  # the slot, and its queue
            ),
            (self.breaker, op and op.breaker),
            op.breaker if op is not None and self.protocol == "mcp"
            and op.config.circuit_breaker is not None and _counts_tool_errors(op) else None,
            op.retry if op is not None and op.retry else self.retry,
            config.timeouts_for(op.config if op is not None else None),
            config.idempotent or (op is not None and op.config.idempotent),
            # Each returns at once for a call that names no run: such a call skips them.
            (self.run_tracker, self.global_limits, self.run_limits, self.global_fanout,
             self.fanout),
        )

    def report(self, call: Call, event: str, fields: dict[str, Any]) -> None:
        """A policy's step for one of this route's calls (``Call.notify``): its timeline
        event, with the call's operation and MCP method, and an expiry's count in
        ``sluice_expiries_total`` (``fields["deadline"]``, taken out: the caller's own
        deadline, else ``max_wait``) and its wait in ``sluice_queue_wait_seconds``."""
        if event == "expired":
            self.metrics.expiries["deadline" if fields.pop("deadline", False)
                                  else "max_wait"].inc()
            # Its wait is a queue wait too: the longest waits were the ones the queue-wait
            # alert never saw (a trial).
            self.metrics.queue_wait.observe(fields["waited_s"])
        fields.update(call.event_names())
        self.events.emit(event, call.request_id, self.name, call.tenant, call.run,
                         call.idempotency_key, **fields)

    async def plan(self, call: Call) -> Plan:
        """The plan ``call`` is admitted and forwarded with; sets ``call.operation`` to its
        operation's name (``None`` for none) for metrics and events, and ``call.model`` on
        ``models:`` (a large form is read in a worker thread)."""
        operations = self.operations
        if operations is None:
            return self.base_plan
        name, op = await operations.resolve(call)
        call.operation = name
        return self._plans[op.name] if op is not None else self.base_plan

    def url(self, target: str) -> URL:
        """The upstream URL of request target ``target`` (path and query, the prefix
        included), kept in :attr:`urls` for the next call to the same target when it is at
        most :data:`URL_KEPT_CHARS` long (routes are called on a few targets each; yarl's
        own cache is shared by every route, 128 strings, and its constructor costs ~20
        opcodes a call on a hit)."""
        url = self.urls.get(target)
        if url is not None:
            return url
        url = upstream_url(self.upstream_base, target[self.cut:])
        if len(target) <= URL_KEPT_CHARS:
            urls = self.urls
            if len(urls) >= URLS_KEPT:
                urls.clear()  # targets a caller chose can be any: the old ones are made again
            urls[target] = url
        return url

    @property
    def retries(self) -> bool:
        """Some call of this route may be retried (:meth:`RouteConfig.retries
        <policies.config.RouteConfig.retries>`)."""
        return self.config.retries()

    @property
    def policies(self) -> tuple[Any, ...]:
        """The admission steps of a call no operation block applies to."""
        return self.base_plan.policies

    def stalled(self, after_s: float) -> int:
        """Calls in flight (this route's, and those admitted before a reload) that moved no
        bytes for more than ``after_s`` seconds."""
        since = time.monotonic() - after_s
        return sum(1 for route in (self, *self.retired) for call in route.live
                   if call.progress_at < since)

    @property
    def inflight_total(self) -> int:
        """Requests in flight on this route, including those admitted before a reload."""
        return self.inflight + sum(route.inflight for route in self.retired)

    @property
    def streams_total(self) -> int:
        """MCP streams admitted on this route and open, those admitted before a reload
        included."""
        return self.streams + sum(route.streams for route in self.retired)

    @property
    def present_total(self) -> int:
        """Requests on this route from match to answer, queued ones and those on the objects
        reloads replaced included."""
        return self.present + sum(route.present for route in self.retired)

    @property
    def limiters(self) -> list[ConcurrencyLimiter]:
        """The limiters calls of this route queue in (``sluice_queue_depth``, read at a
        scrape): its ``concurrency``, its endpoints', tools' and models', and each run's of
        its ``fanout.width``; and those of the objects reloads replaced where they differ (a
        block removed, or removed and added back: calls queued in the old one wait there).
        The operations' and runs' were left out, and a route queueing at an endpoint's limit
        showed 0 queued (a hostile review)."""
        found: dict[int, ConcurrencyLimiter] = {}
        for route in (self, *self.retired):
            limiters = [route.concurrency]
            if route.operations is not None:
                limiters += [op.concurrency for op in route.operations.by_name.values()]
            if route.fanout is not None:
                limiters += [run.limiter for run in route.fanout.runs.values()]
            for limiter in limiters:
                if limiter is not None:
                    found.setdefault(id(limiter), limiter)
        return list(found.values())

    def take_over(self, old: Route) -> None:
        """Carry the live state of ``old``, the route of the same name this one replaces.

        One line per policy, all alike (see :mod:`proxy.reload`). Part of a reload's commit:
        a changed block reconfigures ``old``'s policy object in place, which serves already;
        a removed one retires it, and one added back gets it again while it still holds calls
        (:class:`policies.operations.TakeOver`).
        """
        new, prev = self.config, old.config
        carry = TakeOver(old.draining)
        self.concurrency = carry(
            "concurrency", old.concurrency, self.concurrency, prev.concurrency,
            new.concurrency, reconfigure_limiter,
        )
        self.fanout = carry("fanout", old.fanout, self.fanout, prev.fanout, new.fanout,
                            lambda width, c: width.reconfigure(c))
        self.rate = carry(
            "rate", old.rate, self.rate, prev.rate, new.rate,
            lambda rate, c: rate.reconfigure(c),
        )
        # Stored answers and keys in flight survive any reload that keeps the block: a
        # changed one is adopted in place, since forgetting either lets a side effect run
        # twice (its store shrinks to new bounds; a new TTL applies to new answers).
        self.idempotency = carry(
            "idempotency", old.idempotency, self.idempotency, prev.idempotency,
            new.idempotency, lambda keys, c: keys.reconfigure(c),
        )
        # The breaker keeps its state whatever changed in its block (open stays open; the new
        # thresholds apply from the next outcome): it lives in the state backend under the
        # route's name, shared with every replica, so only the object's view could be reset.
        self.breaker = carry("breaker", old.breaker, self.breaker, prev.circuit_breaker,
                             new.circuit_breaker, lambda breaker, c: breaker.reconfigure(c))
        self.retry = carry("retry", old.retry, self.retry, prev.retry, new.retry)
        # Accounting is rebuilt from the new blocks, but spend carries over: the budget ledger
        # (keyed by unit, scope and window, not by amount) and the route's rates.
        if self.budgets is not None and old.budgets is not None:
            self.budgets.take_over(old.budgets)
        if self.accounting is not None and old.accounting is not None:
            self.accounting.tenants.update(old.accounting.tenants)  # the admin view's
        # The accounting takes metered calls' request units or leaves them to the rate step,
        # as the new blocks say.
        if self.accounting is not None:
            self.accounting.use_rate(self.rate)
        elif self.rate is not None:
            self.rate.metered_elsewhere = False
        # Operations named before and after keep their state (slots, levels, breakers).
        if self.operations is not None:
            self.operations.take_over(old.operations, carry)
        elif old.operations is not None:
            old.operations.retire(carry)
        self.draining = carry.draining
        self.retired = tuple(route for route in (old, *old.retired) if route.present)
        self._admission_order()

    def state(self) -> dict[str, Any]:
        """Config summary and live state for the admin API (JSON-ready)."""
        out: dict[str, Any] = {
            "name": self.name,
            "path_prefix": self.prefix,
            "upstream": self.upstream_base,
            "protocol": self.protocol,
            "inflight": self.inflight_total,
            "open_streams": self.streams_total,
        }
        for name in self.POLICIES:
            policy = getattr(self, name)
            state = getattr(policy, "state", None)
            out[name] = None if policy is None else (state() if state else {})
        if self.operations is not None:
            out[self.operations.key] = self.operations.state()
        return out


__all__ = ["Route", "Router", "carry_over"]


#: The most upstream URLs a route keeps (:meth:`Route.url`), and the longest request target
#: it keeps one for, in characters: at most ~1 MB a route whatever its callers send.
URLS_KEPT = 256
URL_KEPT_CHARS = 1024

#: How many route prefixes a ``no_route`` refusal lists; the rest are counted (a config may
#: hold thousands of routes).
PREFIXES_LISTED = 10


class Router:
    """Finds the route owning a raw request path: the longest matching prefix wins."""

    def __init__(self, routes: list[Route]) -> None:
        self.routes = sorted(routes, key=lambda r: len(r.prefix), reverse=True)
        #: The prefixes a ``no_route`` refusal names, in config order: a caller that missed
        #: them (an SDK's base URL without ``/openai``) sees where to point. Built once here,
        #: not per refusal.
        listed = ", ".join(route.prefix for route in routes[:PREFIXES_LISTED])
        more = len(routes) - PREFIXES_LISTED
        self.prefixes = f"{listed} and {more} more" if more > 0 else listed
        # Where no prefix is longer than one segment ("/openai/"), a path's first segment
        # names its route: one slice and one look-up, however many routes.
        self._by_segment: dict[str, Route] | None = None
        if all(route.prefix.count("/") <= 2 for route in routes):
            self._by_segment = {r.prefix: r for r in routes if r.prefix.count("/") == 2}

    def match(self, raw_path: str) -> Route | None:
        """The route for ``raw_path`` (path and query as received), or ``None``."""
        by_segment = self._by_segment
        if by_segment is not None:
            end = raw_path.find("/", 1)
            if end > 0:
                route = by_segment.get(raw_path[:end + 1])
                if route is not None:
                    return route
        for route in self.routes:
            if raw_path.startswith(route.prefix):
                return route
        return None


def _counts_tool_errors(op: Operation) -> bool:
    """Whether ``op``'s breaker counts tool failures (``circuit_breaker.tool_errors``; unset:
    a named tool's does, ``default``'s does not)."""
    configured = op.config.circuit_breaker.tool_errors if op.config.circuit_breaker else None
    return op.name != DEFAULT_OPERATION if configured is None else configured
