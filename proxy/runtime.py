"""The live state of one Sluice server, shared by the proxy and admin apps."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sqlite3
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from policies.bodies import FormReader, LargeBodies
from policies.budget import clock_from_env
from policies.concurrency import ConcurrencyLimiter
from policies.config import Config, FanoutConfig, RunConfig
from policies.deadletter import DeadLetterQueue, letters_in
from policies.mcp import RequestId
from policies.operations import width_limiters
from policies.pipeline import Call
from policies.runs import FanoutWidth, RunLimits, RunRegistry
from policies.state import StateBackends, backends_for
from policies.state.connection import redact_url
from policies.state.runs import RedisRuns
from proxy import output
from proxy.client import UpstreamConnector, upstream_session
from proxy.events import EventLog
from proxy.mcp_tasks import Tasks
from proxy.metrics import Metrics, RouteLoad
from proxy.routes import Route, Router

if TYPE_CHECKING:
    from proxy.session_end import Deferred

log = logging.getLogger("sluice")


@dataclass(frozen=True, slots=True)
class BuiltConfig:
    """A config built by :meth:`Runtime.build` and not yet in force: all that
    :meth:`Runtime.commit` needs to put it in force.

    Attributes:
        config: the config itself.
        routes: its routes, new objects in file order; none is bound to a gauge yet.
        router: the router over ``routes``.
        replaces: the running route each new route of the same name replaces, by name.
        removed: the running routes the config no longer has.
        global_fanout: the top-level ``fanout.width`` the routes admit with: the running one,
            the one a reload removed while its runs still have calls (added back: they count),
            a new one, or ``None`` without a width.
        fanout_reconfigure: the ``fanout`` block the running ``global_fanout`` adopts at the
            commit, or ``None`` (it is new, or there is none).
        cancel_ttl: ``run.cancel_ttl``, or its default, seconds.
        summary: route names by what happens to them: ``added``, ``changed``, ``unchanged``,
            ``removed``.
    """

    config: Config
    routes: list[Route]
    router: Router
    replaces: dict[str, Route]
    removed: list[Route]
    global_fanout: FanoutWidth | None
    fanout_reconfigure: FanoutConfig | None
    cancel_ttl: float
    summary: dict[str, list[str]]


#: How many calls closed early for polling :attr:`Runtime.polled` remembers at most (the
#: oldest go first: a GET resuming one of those is then a stream the drain does not wait for;
#: a call still held for its response is ended by its own bound all the same).
MAX_POLLED_CALLS = 10_000


class Polled:
    """An MCP request whose answer stream the upstream closed early for polling (2025-11-25,
    SEP-1699: events with ids, then a clean end, without the response), which its client
    resumes with a GET carrying ``Last-Event-ID``: what such a GET follows
    (``proxy.attempts``).

    For a ``tools/call`` the tool runs on at the server, so the call is not over when its
    POST ends: ``proxy.handler`` holds everything it took (its key, slot, budgets) until
    :meth:`respond` says its response came through on a resumed GET, or until
    :attr:`deadline`. Until then :meth:`feed` hands the resumed answer to the call's
    idempotency capture, so that a ``dedup`` route keeps the response for the call's key.

    Attributes:
        rpc_id: the JSON-RPC id of the request.
        capture: the call's idempotency capture, while the resumed answer is to be kept for
            its key; ``None`` otherwise (none kept, the call ended, or a resumed GET broke
            off inside an event: the bytes kept would no longer be the answer).
        deadline: monotonic seconds by which the call's response must have come (its
            attempt's sending plus ``timeouts.total``); ``None`` for a request not held.
        answered: the response has come through on a resumed GET.
        waiter: resolved by :meth:`respond`, while ``proxy.handler`` holds the call.
    """

    __slots__ = ("answered", "capture", "deadline", "rpc_id", "waiter")

    def __init__(self, rpc_id: RequestId, capture: Any = None,
                 deadline: float | None = None) -> None:
        self.rpc_id = rpc_id
        self.capture = capture
        self.deadline = deadline
        self.answered = False
        self.waiter: asyncio.Future[None] | None = None

    def feed(self, chunk: bytes) -> None:
        """Bytes of a resumed answer, in order, up to and including the call's response."""
        capture = self.capture
        if capture is not None:
            capture.feed(chunk)

    def respond(self) -> None:
        """The call's response has come through on a resumed GET: the call is over."""
        self.answered = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Runtime:
    """Config, routes with their policy state, metrics, event log and upstream session.

    Attributes:
        draining: set on SIGTERM; new requests are then answered 503 ``draining``.
        session: the one upstream ``ClientSession``, opened in the proxy app's startup.
        dead_letters: the dead-letter store (its file is opened once a route retries).
        state: the shared state every policy keeps its counters in (``state`` block,
            restart-only), connected in :meth:`open`.

    Raises:
        ValueError: ``state.redis_url`` names an unset environment variable.
    """

    def __init__(self, config: Config) -> None:
        self.metrics = Metrics()
        self.state: StateBackends = backends_for(config.state)
        health = self.state.health
        self.metrics.state_backend_up.labels(self.state.kind).set_function(
            lambda: 1.0 if health.up else 0.0)
        health.on_change(self._state_changed)
        redis = self.state.redis
        if redis is not None:
            self.metrics.bind_state_key_faults(lambda: dict(redis.key_faults))
            self.metrics.bind_state_eviction(lambda: redis.eviction.last)
        self.routes: list[Route] = []
        #: Routes a reload deleted that still had requests in flight (counted by the drain).
        self.removed: list[Route] = []
        #: Unix seconds now, as budgets' windows read it (``SLUICE_TEST_NOW`` moves it, for tests).
        self.clock = clock_from_env()
        self.events = EventLog(config.events.path)
        self.metrics.bind_output_dropped(
            lambda: {"events": self.events.dropped, "log": output.log_dropped()})
        # Created at startup from the restart-only dead_letter block; its file is opened only
        # when some route retries (see open() and DeadLetterQueue.add).
        self.dead_letters = DeadLetterQueue(config.dead_letter, self.state)
        #: Reads forms' models for every route, large multipart ones in its own thread.
        self.forms = FormReader()
        #: Turns for the work on large JSON bodies, one at a time (``proxy.handler``).
        self.large_bodies = LargeBodies()
        #: The event log's and the dead-letter store's files if :meth:`open` created them.
        self._created_events: str | None = None
        self._created_letters: str | None = None
        self.metrics.bind_dead_letters_dropped(lambda: self.dead_letters.dropped)
        #: Request body bytes held now (``server.max_buffered_bytes``; ``proxy.handler``).
        self.buffered_bytes = 0
        self.metrics.buffered_bytes.set_function(lambda: self.buffered_bytes)
        self.metrics.bind_load(self.load)
        #: Set once ``serve`` has everything open (listeners, dead-letter store): until then
        #: ``/readyz`` says ``starting`` (503), so a start that fails is never ready.
        self.started = False
        self.draining = False
        #: Set when the drain timeout ran out: requests cancelled from then on were cut by
        #: Sluice, not left by their callers.
        self.cutting = False
        #: When the drain cuts what is left, monotonic seconds: set as it starts
        #: (``server.drain_timeout`` on), brought forward to the cut (:meth:`drain_until`).
        self.drain_deadline: float | None = None
        #: Set by a second stop signal (SIGTERM or Ctrl-C, ``proxy.server``): the drain is
        #: cut now, and so is the shutdown's wait for letters held for a locked file.
        self.hurry = asyncio.Event()
        #: Resolved when :attr:`drain_deadline` is set or moves, then replaced
        #: (:meth:`drain_moved`).
        self._drain_moved: asyncio.Future[None] | None = None
        #: Calls waiting out a retry back-off, each with the task that waits
        #: (``proxy.attempts``): at no upstream, so the drain's cut does not cut them but
        #: wakes them, and waits for their answers (their last failure, dead-lettered).
        self.backing_off: dict[Call, asyncio.Task[Any]] = {}
        #: MCP calls being finished after their callers left (``proxy.handler``), each task
        #: with its call, counted in flight and present on its route until it ends: the drain
        #: waits for them, and cancels those left when it cuts.
        self.finishing: dict[asyncio.Task[Any], Call] = {}
        #: Calls in admission (queued for a slot or a run's width, waiting for a twin's answer
        #: or the shared state), each with its handler's task (``proxy.handler``): what
        #: :meth:`refuse_waiting` answers when the drain ends.
        self.admitting: dict[Call, asyncio.Task[Any]] = {}
        #: MCP calls of :attr:`admitting` whose clients cancelled them
        #: (``notifications/cancelled``), their handler tasks cancelled: each handler, seeing
        #: its call here, answers it "Request cancelled" and takes it out (``proxy.handler``);
        #: and calls of :attr:`polling` so cancelled, their holds ended ``client_cancelled``.
        self.cancelled_waiting: set[Call] = set()
        #: MCP calls admitted and not finished, each with its handler's task: what
        #: :meth:`end_mcp_calls` ends when the drain cuts.
        self.mcp_calls: dict[Call, asyncio.Task[Any]] = {}
        #: MCP requests whose SSE answer the upstream closed early, without the response but
        #: with event ids (2025-11-25 polling), each by route, session and the last event id
        #: its client got (:meth:`note_polled`): a GET resuming one with that
        #: ``Last-Event-ID`` follows it (:class:`Polled`) and is waited for by the drain; any
        #: other (a session's own GET stream reconnected with the id of its last
        #: notification) is not.
        self.polled: OrderedDict[tuple[str, str, str], Polled] = OrderedDict()
        #: MCP calls closed early for polling whose response has not come yet, each by the
        #: task that holds it (``proxy.handler``): present and in flight on its route until
        #: it ends; the drain waits for them, and cancels those left when it cuts.
        self.polling: dict[asyncio.Task[Any], Call] = {}
        #: MCP tasks (2025-11-25) whose tools/calls are held until the task is over, and
        #: the holds' tasks (``proxy.mcp_tasks``, ``proxy.handler._hold_task``): present and
        #: in flight on their routes until they end; the drain waits for them, and cancels
        #: those left when it cuts.
        self.tasks = Tasks()
        #: MCP sessions whose DELETE went through while a call of theirs was in flight, by
        #: route name and ``Mcp-Session-Id`` (the latest
        #: :data:`proxy.session_end.ENDED_SESSIONS_KEPT`): such a
        #: call closed early for polling after it is not held (``proxy.handler``).
        self.ended_sessions: OrderedDict[tuple[str, str], None] = OrderedDict()
        #: MCP sessions' DELETEs answered by Sluice and not sent yet, each by route name and
        #: ``Mcp-Session-Id``: they wait for the session's calls kept for a retry
        #: (``proxy.session_end``).
        self.session_deletes: dict[tuple[str, str], list[Deferred]] = {}
        #: The tasks sending those DELETEs upstream, for the drain to wait for.
        self.session_delete_tasks: set[asyncio.Task[None]] = set()
        #: The tasks sending MCP servers Sluice's own ``notifications/cancelled`` of calls a
        #: run's cancel or the drain's cut ended (``proxy.attempts.send_cancel``), for the
        #: drain to wait for.
        self.upstream_cancels: set[asyncio.Task[None]] = set()
        self.metrics.finishing.set_function(lambda: len(self.finishing))
        self.metrics.polling.set_function(lambda: len(self.polling))
        self.metrics.held_tasks.set_function(lambda: len(self.tasks.holding))
        for table in self.tasks.counts():
            self.metrics.task_tables.labels(table).set_function(
                lambda table=table: self.tasks.counts()[table])
        self.session: aiohttp.ClientSession | None = None
        #: Run trees, counts and cancellations, shared by every route (policies/runs.py),
        #: and with the Redis backend by every replica.
        self.runs = RunRegistry(
            shared=RedisRuns(self.state.redis) if self.state.redis is not None else None,
            fallback=self.state.fallback)
        self.global_fanout: FanoutWidth | None = None
        #: The top-level ``fanout.width`` a reload removed while runs had calls under it
        #: (retired: :meth:`policies.runs.FanoutWidth.retire`): added back before they end,
        #: the block gets it again, so they count.
        self.retired_fanout: FanoutWidth | None = None
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}-{os.urandom(3).hex()}-"
        self.configure(config)

    def configure(self, config: Config) -> dict[str, list[str]]:
        """Apply ``config``: :meth:`build`, then :meth:`commit`. At startup (a fault raises out
        of the constructor), and from tests; a reload calls the two itself (:mod:`proxy.reload`).

        Returns:
            route names by what happened to them (:attr:`BuiltConfig.summary`).
        """
        built = self.build(config)
        self.commit(built)
        return built.summary

    def build(self, config: Config) -> BuiltConfig:
        """Build everything ``config`` puts in force, touching nothing live: new routes with
        their policy objects and router, and every setting derived from it. No gauge is
        bound, no running object changed and no attribute of this runtime set, so if this
        raises (only a bug can: ``config`` is validated), the running config serves as before.

        Runs on the event loop, just before :meth:`commit`, with no await in between: what it
        reads of the running config (the routes a new one replaces, the top-level fan-out) is
        still what the commit changes.
        """
        running = {route.name: route for route in self.routes}
        fanout = config.fanout
        global_limits = (RunLimits(self.runs, "*", config.run, fanout)
                         if config.run or (fanout and fanout.depth is not None) else None)
        global_fanout, fanout_reconfigure = self.global_fanout, None
        if global_fanout is None and self.retired_fanout is not None and self.retired_fanout.busy:
            global_fanout = self.retired_fanout
        if fanout is None or fanout.width is None:
            global_fanout = None
        elif global_fanout is None:
            global_fanout = FanoutWidth(fanout.width, fanout.max_wait,
                                        width_limiters(self.state, "*"))
        else:  # the running one adopts the block at commit, keeping every run's calls
            fanout_reconfigure = fanout
        ident = config.identity
        identity = (ident.tenant_header, ident.run_header, ident.parent_run_header,
                    ident.priority_header, ident.timeout_header)
        prefixes = [rc.path_prefix for rc in config.routes]
        routes = [
            Route(rc, self.events, pricing=config.pricing, clock=self.clock,
                  run_header=config.identity.run_header, runs=self.runs,
                  global_limits=global_limits, global_fanout=global_fanout,
                  global_fanout_wait=fanout.max_wait if fanout else 0.0, state=self.state,
                  identity_headers=identity, forms=self.forms, prefixes=prefixes)
            for rc in config.routes
        ]
        replaces = {route.name: running[route.name] for route in routes
                    if route.name in running}
        removed = [route for name, route in running.items() if name not in replaces]
        summary: dict[str, list[str]] = {"added": [], "changed": [], "unchanged": [],
                                         "removed": [route.name for route in removed]}
        for route in routes:
            previous = replaces.get(route.name)
            kind = ("added" if previous is None else
                    "changed" if previous.config != route.config else "unchanged")
            summary[kind].append(route.name)
        return BuiltConfig(
            config=config, routes=routes, router=Router(routes), replaces=replaces,
            removed=removed, global_fanout=global_fanout,
            fanout_reconfigure=fanout_reconfigure,
            cancel_ttl=(config.run.cancel_ttl if config.run else
                        RunConfig.model_fields["cancel_ttl"].default),
            summary=summary,
        )

    def commit(self, built: BuiltConfig) -> None:
        """Put ``built`` in force: every live change of applying a config, and nothing else.

        In this order, with no await: the running top-level fan-out adopts its new block (or
        retires, its block removed: :meth:`policies.runs.FanoutWidth.retire`);
        each route takes over the live state of the one it replaces (a changed policy block
        reconfigures the running object in place, :meth:`Route.take_over`); each route's
        gauges are bound (and a retrying route's dead-letter depth); removed routes' series
        are dropped; then routes, router and settings are swapped, the last step, after which
        the request path sees the new config. Everything the request path derives from the
        config is set here, from what :meth:`build` computed.

        Only a bug raises here. One that does stops where it is: what ran before it stays
        done (see :mod:`proxy.reload` for what that leaves).
        """
        config = built.config
        if built.fanout_reconfigure is not None and built.global_fanout is not None:
            built.global_fanout.reconfigure(built.fanout_reconfigure)
        if built.global_fanout is None and self.global_fanout is not None:
            # The block is gone: the runs' queued calls go now (a limit raised without bound).
            self.global_fanout.retire()
            self.retired_fanout = self.global_fanout
        elif built.global_fanout is not None:
            self.retired_fanout = None
        for route in built.routes:
            replaced = built.replaces.get(route.name)
            if replaced is not None:
                route.take_over(replaced)
        for route in built.routes:
            route.bind_metrics(self.metrics, built.replaces.get(route.name))
            if route.retries:
                self.metrics.bind_dead_letter_depth(
                    route.name, lambda name=route.name: self.dead_letters.depth(name)
                )
        for gone in built.removed:
            self.metrics.forget_route(gone.name)
            for each in (gone, *gone.retired):  # the older objects' calls too
                each.detach_metrics()
        # The swap: from here the request path sees the new config; nothing follows it.
        self.removed = [route for route in (*self.removed, *built.removed)
                        if route.present_total]
        self.global_fanout = built.global_fanout
        self.config = config
        self.routes = built.routes
        self.router = built.router
        identity = config.identity
        self.tenant_header = identity.tenant_header
        self.run_header = identity.run_header
        self.priority_header = identity.priority_header
        self.parent_run_header = identity.parent_run_header
        self.timeout_header = identity.timeout_header
        #: How long a cancelled run's new calls are refused (``run.cancel_ttl``).
        self.cancel_ttl = built.cancel_ttl
        self.default_tenant = identity.default_tenant

    def _state_changed(self, up: bool, error: str | None) -> None:
        """Say in the log what the policies do now that the state backend changed: once at
        start (answering or not), then at each change; "again" only after an outage."""
        redis = self.state.redis
        where = f"state.redis_url {redact_url(redis.url)}" if redis is not None else "state"
        if up:
            if self.state.health.known:
                log.warning("state backend answers again: limits are shared across replicas")
            else:
                log.info("state backend answers (%s)", where)
        elif self.state.fallback.mode == "reject":
            log.warning("state backend unavailable (%s: %s): calls refused 503 "
                        "state_unavailable until it answers (state.on_unavailable: reject)",
                        where, error)
        else:
            log.warning("state backend unavailable (%s: %s): this replica enforces 1/%d of "
                        "every limit from its own memory until it answers "
                        "(state.on_unavailable: local)", where, error,
                        self.state.fallback.replicas)

    def _cancel_heard(self, tenant: str, run: str, left_s: float) -> None:
        """A cancel made on some replica (this one's too: then it finds nothing left to do)
        reached this one: end ``tenant``'s run's calls here, its descendants' included, and
        refuse its new calls for ``left_s``."""
        ending = sum(1 for info in self.runs.subtree(self.runs.resolve(run, None, tenant))
                     for live in info.live if live.call.cancelled is None)
        self.runs.cancel(run, left_s, tenant)
        if ending:
            log.info("cancel of run %s of tenant %s heard from the shared state: %d call(s) "
                     "here told to end", run, tenant, ending)

    def drain_until(self, deadline: float) -> None:
        """Drain until ``deadline`` (monotonic seconds), or bring the drain's cut forward to
        it: sets :attr:`draining` and wakes every call in retry back-off, which stops
        retrying if its next attempt would not start before ``deadline``
        (:func:`proxy.attempts._back_off`)."""
        self.draining = True
        self.drain_deadline = deadline
        moved, self._drain_moved = self._drain_moved, None
        if moved is not None and not moved.done():
            moved.set_result(None)

    def drain_moved(self) -> asyncio.Future[None]:
        """A future resolved the next time :meth:`drain_until` sets the drain's deadline
        (one shared by every waiter; awaited through ``asyncio.wait``, which never cancels
        it)."""
        if self._drain_moved is None:
            self._drain_moved = asyncio.get_running_loop().create_future()
        return self._drain_moved

    def cut_before(self, at: float) -> bool:
        """Whether the drain cuts before ``at`` (monotonic seconds): an attempt that would
        start then would be cut as it began, or never start."""
        deadline = self.drain_deadline
        return deadline is not None and at >= deadline

    def refuse_waiting(self) -> list[asyncio.Task[Any]]:
        """End every call still in admission when the drain ends (:attr:`cutting` set first):
        its handler task is cancelled wherever it waits, and the handler, seeing
        :attr:`cutting`, answers it 503 ``draining`` (it never reached the upstream) and gives
        its holdings back as any refusal does. Returns those tasks, for the drain to wait for
        their answers to be written before the shutdown cuts what is left.

        Called before anything in flight is cut, so no waiter is left to be handed a slot
        that the cut frees."""
        return cancel_live(self.admitting.values())

    def end_mcp_calls(self) -> list[asyncio.Task[Any]]:
        """End every MCP call still in flight when the drain cuts (:attr:`cutting` set, the
        waiting calls answered first): its handler task is cancelled, and the handler, seeing
        :attr:`cutting`, ends the call's answer with its JSON-RPC error rather than cutting
        it (a cut POST fails no call on the Python ``mcp`` 1.x client, which then waits for
        ever). Returns those tasks, for the drain to wait for before the shutdown cuts the
        rest."""
        return cancel_live(self.mcp_calls.values())

    def end_answered(self) -> list[asyncio.Task[Any]]:
        """End every call in flight whose answer's last message has gone to its caller while
        its upstream holds the stream open (:attr:`Call.relaying`), for the drain (whose
        :attr:`draining` is set): the task relaying it is cancelled, once, and the handler,
        seeing the answer delivered, ends the stream as the upstream would have. Returns those
        tasks."""
        ending = []
        for route in (*self.routes, *self.removed):
            for each in (route, *route.retired):
                for call in each.live:
                    task = call.relaying
                    if task is not None:
                        call.relaying = None
                        if not task.done():
                            task.cancel()
                            ending.append(task)
        return ending

    def note_polled(self, route: str, session: str | None, event_id: str,
                    polled: Polled) -> None:
        """Remember a request whose answer stream the upstream closed early (see
        :attr:`polled`); the oldest are forgotten past :data:`MAX_POLLED_CALLS`."""
        key = (route, session or "", event_id)
        self.polled[key] = polled
        self.polled.move_to_end(key)
        while len(self.polled) > MAX_POLLED_CALLS:
            self.polled.popitem(last=False)

    def take_polled(self, route: str, session: str | None, event_id: str) -> Polled | None:
        """The request a GET with ``Last-Event-ID`` ``event_id`` resumes, forgotten here (the
        GET follows it from now: ``proxy.attempts``); ``None`` when it resumes no request
        this process saw closed early."""
        return self.polled.pop((route, session or "", event_id), None)

    def next_request_id(self) -> str:
        """A request id unique to this process (cheaper than a UUID on the hot path)."""
        return f"{self._id_prefix}{next(self._ids)}"

    @property
    def draining_routes(self) -> list[Route]:
        """Routes a reload removed whose calls have not all ended (admitted or queued)."""
        return [route for route in self.removed if route.present_total]

    def load(self) -> dict[str, RouteLoad]:
        """Each route's calls now, by route name, for its gauges (read at scrape time): every
        route in force, and each removed one until its calls end, under its name. A removed
        route added back while its old calls run counts both, which share its upstream."""
        after = self.config.server.stall_after
        load: dict[str, RouteLoad] = {}
        limiters: dict[str, dict[int, ConcurrencyLimiter]] = {}
        for route in (*self.routes, *self.draining_routes):
            seen = load.get(route.name, RouteLoad(0, 0, 0, 0))
            load[route.name] = RouteLoad(seen.inflight + route.inflight_total, 0,
                                         seen.streams + route.streams_total,
                                         seen.stalled + route.stalled(after))
            own = limiters.setdefault(route.name, {})
            for limiter in route.limiters:
                own.setdefault(id(limiter), limiter)
        for name, own in limiters.items():
            load[name] = load[name]._replace(queued=sum(lim.queued for lim in own.values()))
        return load

    @property
    def inflight(self) -> int:
        """Requests admitted on any route and not yet finished, including before a reload."""
        return sum(route.inflight_total for route in (*self.routes, *self.removed))

    @property
    def present(self) -> int:
        """Requests on any route from match to answer: admitted, queued, or still being read
        or admitted (what a drain waits for)."""
        return sum(route.present_total for route in (*self.routes, *self.removed))

    @property
    def streams(self) -> int:
        """MCP streams open on any route (part of :attr:`present`): what a drain does not
        wait for."""
        return sum(route.streams_total for route in (*self.routes, *self.removed))

    async def open(self) -> None:
        """Open the upstream session, the event log and the dead-letter store, noting the
        files this creates (:meth:`remove_created_files`).

        Raises:
            OSError: the event log or the dead-letter file cannot be opened or created
                (naming ``events.path`` or ``dead_letter.path``).
        """
        connector = UpstreamConnector(
            limit=0,  # concurrency is bounded by the routes' own limits, not by the pool
            ttl_dns_cache=60,
            keepalive_timeout=self.config.server.upstream_idle_timeout,
            enable_cleanup_closed=True,  # closes leaked TLS transports on Python 3.11
        )
        self.session = upstream_session(connector)
        await self.state.start()
        if self.runs.shared is not None:
            self.runs.shared.feed.start(self._cancel_heard)
        retrying = any(route.retries for route in self.routes)
        self._note_new_files(retrying)
        try:
            await self.events.start()
        except OSError as exc:
            raise OSError(f"events.path {self.config.events.path}: {exc.strerror or exc}"
                          ) from exc
        # Opened before the listeners are bound, so a store that cannot be opened (locked by
        # another process, unwritable) stops the start before any call is taken: opened
        # after, a start served calls for SQLite's busy timeout and then cut them, their
        # letters lost (a hostile review).
        # Else the first letter opens it, or a reload adding a retry block does.
        refused = await self.open_letters_for(self.config)
        if refused is not None:
            raise OSError(f"dead_letter.path {self.config.dead_letter.path}: {refused}"
                          ) from refused

    async def open_letters_for(self, config: Config) -> sqlite3.Error | None:
        """Open the dead-letter store if a route of ``config`` (the start's, or a reload's:
        its restart-only ``dead_letter`` block the running one) retries and it is not open
        yet; why it cannot be opened, else ``None``.

        A reload that gave a route its first retry block was applied with a store that
        could not be opened (a hostile trial): the first dead letter was lost, though the
        same file refused at start. Both ask here."""
        if not any(route.retries() for route in config.routes):
            return None
        try:
            await self.dead_letters.open()
        except sqlite3.Error as exc:
            return exc
        return None

    def _note_new_files(self, retrying: bool) -> None:
        """Note the event log's and (``retrying``: some route retries, so :meth:`open`
        opens the store) the dead-letter store's files that :meth:`open` is about to create
        (a stat each, once at startup). Not a path that is a symlink, even one to nothing
        yet: it is the user's, and removing it was removing their link."""
        events, letters = self.config.events.path, self.config.dead_letter.path
        if events is not None and not os.path.lexists(events):
            self._created_events = events
        if retrying and self.state.redis is None and not os.path.lexists(letters):
            self._created_letters = letters

    def remove_created_files(self) -> None:
        """After a start that failed (a port taken), remove the event log and dead-letter
        files :meth:`open` created, if they hold nothing yet: a failed start left a new
        ``./sluice-dlq.sqlite`` beside the user's config. Call it once :meth:`close` has
        closed them. Never raises."""
        events, letters = self._created_events, self._created_letters
        if events is not None and os.path.isfile(events) and os.path.getsize(events) == 0:
            with contextlib.suppress(OSError):
                os.unlink(events)
        if letters is not None and not letters_in(letters):
            for path in (letters, f"{letters}-wal", f"{letters}-shm", f"{letters}-journal"):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    async def close(self) -> None:
        """Close the upstream session, the dead-letter store, and flush the event log. A
        step that fails is logged and the next ones still run: a dead-letter store whose
        close raised left the event log unflushed (its last events lost)."""
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if self.session is not None:
            steps.append(("the upstream session", self.session.close))
        # Letters held for a locked file get what is left of the drain (1 s at least), or
        # until a second stop signal.
        steps.append(("the dead-letter store",
                      lambda: self.dead_letters.close(self.drain_deadline, cut=self.hurry)))
        if self.runs.shared is not None:
            steps.append(("the shared runs' feed", self.runs.shared.feed.close))
        steps.append(("the forms' worker thread", self._close_forms))
        steps += [("the runs' background work", self.runs.background.wait),
                  ("the state backend", self.state.close), ("the event log", self.events.close)]
        for name, step in steps:
            try:
                await step()
            except Exception:
                log.exception("shutdown: closing %s failed; going on with the rest", name)

    async def _close_forms(self) -> None:
        self.forms.close()


def cancel_live(tasks: Iterable[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """Cancel each of ``tasks`` not done yet; returns those, for the caller to wait for."""
    live = [task for task in tasks if not task.done()]
    for task in live:
        task.cancel()
    return live


RUNTIME = web.AppKey("sluice_runtime", Runtime)
