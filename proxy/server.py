"""The two listeners (agents' traffic and admin), their lifecycle, and graceful shutdown.

SIGTERM (or SIGINT) starts a drain, as Kubernetes expects of a pod being stopped: ``/readyz``
turns 503 at once so the endpoint is taken out of rotation, new requests on the proxy port get
503 ``draining`` with ``Connection: close`` (the listener stays open, so a caller gets an
answer rather than a refused connection), and the requests already in (in flight and queued)
get up to ``server.drain_timeout`` seconds to finish. Then those not admitted yet (queued for
a slot or a run's width, here or on the shared Redis queue, or waiting for a twin's answer)
are answered 503 ``draining`` in their route's shape, since nothing of them reached the
upstream, and those answers are written before the rest (in flight, or still sending their
body) are cut and the process exits. A call waiting out a retry back-off is neither: one whose
next attempt would start only once the drain cuts (at the drain's start, or at the cut)
stops retrying and is answered its last failure, dead-lettered ``draining``
(:func:`proxy.attempts._back_off`). A second SIGTERM or SIGINT (Ctrl-C again) does the same
at once, if it comes ``SECOND_SIGNAL_AFTER_S`` or more after the first (one sooner is logged
as ignored); one that comes after the drain ends the shutdown's wait for dead letters held
for a locked file (:meth:`policies.deadletter.DeadLetterQueue.close`).

SIGHUP, or a change of the config file, reloads the config in place (:mod:`proxy.reload`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web, web_response
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.exposition import choose_encoder

from policies.config import Config
from policies.logs import EVERY_S as LOG_REPEATS_EVERY_S
from policies.logs import RepeatFilter
from policies.reasons import Reason, Rejected
from policies.state import StateUnavailable
from proxy.admin import add_admin_routes
from proxy.attempts import DEAD_LETTER_WAIT_S
from proxy.descriptors import DescriptorWatch, raise_open_files_limit
from proxy.dlq import file_left_behind
from proxy.edge import REQUEST_NOT_LOGGED, SERVER_NAME, AdminServer, EdgeServer, parse_cause
from proxy.handler import handle
from proxy.rejections import render
from proxy.reload import RELOADER, Fingerprint, Reloader
from proxy.runtime import RUNTIME, Runtime, cancel_live

log = logging.getLogger("sluice")

#: A second SIGTERM or SIGINT cuts the drain short only this long after the first, seconds:
#: one Ctrl-C can arrive twice (the terminal signals the process group, and a wrapper such as
#: a shell script or ``make`` forwards it too).
SECOND_SIGNAL_AFTER_S = 1.0
#: How often the drain checks whether in-flight work has finished, seconds.
DRAIN_POLL_S = 0.05
#: After the drain, how long aiohttp waits for the admin port's handlers before cancelling
#: them, seconds.
SHUTDOWN_GRACE_S = 1.0
#: The same for the proxy port, whose handlers the drain has already waited for: what is still
#: in flight is cut at once. aiohttp waits this long twice (for the handler, then for it to
#: end once its request is cancelled, which does not reach a handler awaiting its upstream),
#: so a grace of 1 s cut calls 2 s after drain_timeout. Not 0: aiohttp reads 0 as no limit.
PROXY_SHUTDOWN_GRACE_S = 0.05
#: How long a drain that waited for calls on an MCP route goes on once none is left, for the
#: control traffic a session's client sends after a result (seconds).
MCP_FOLLOW_UP_S = 1.0


class RedactMalformedRequests(logging.Filter):
    """Keeps request bytes out of aiohttp's log of a request its parser refused.

    That log quotes the offending header line or request target, which may hold an API key
    (an ``Authorization`` value with a stray control character, a key in a query string);
    the record keeps the peer and the error's kind and drops the quoted bytes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            cause = parse_cause(exc) or "not valid HTTP/1.1"
            record.msg = (f"{record.getMessage()}: {type(exc).__name__} ({exc.code}), {cause}; "
                          f"{REQUEST_NOT_LOGGED}")
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def build_proxy_server(runtime: Runtime) -> EdgeServer:
    """The low-level server on ``server.listen``: every request passes the edge's checks
    (:mod:`proxy.edge`: connection limits and timeouts, Host, Origin, path) and goes to
    :func:`proxy.handler.handle`.

    aiohttp's ``Application`` would add a router, middleware and signal machinery that a proxy
    with one handler never uses (about 50 µs a request in ``bench/overhead.py``'s profile).
    Create it inside the running loop.
    """
    return EdgeServer(
        runtime,
        handle,
        handler_cancellation=True,  # a caller's disconnect cancels its upstream request
        access_log=None,  # per-request logging is the event log's job
        auto_decompress=False,  # bodies pass through byte for byte
    )


def _metrics_handler(runtime: Runtime,
                     thread: concurrent.futures.Executor) -> Callable[[web.Request], Any]:
    """``/metrics``: the registry, once the shared budget counters last seen holding a
    reservation have been read again (:meth:`policies.state.ledger.RedisLedger.refresh_held`),
    so ``sluice_budget_reserved`` and ``sluice_budget_remaining`` say what Redis holds, not
    what it held when this replica last called on them, and the circuit breakers' views older
    than 0.5 s have been too (:meth:`policies.breaker.Breaker.refresh_stale`), so
    ``sluice_circuit_state`` follows another replica's transition within 0.5 s. Redis not
    answering leaves them as they were (bounded by ``state.timeout``; at once while it is
    marked down). The reads run at once, side by side.

    The text is rendered in ``thread`` (one worker, so one render at a time, the others
    queued behind it), as prometheus-client's own handler renders it (the format the
    ``Accept`` header negotiates, the series ``name[]`` asks for): at 1,000 routes it is
    6.6 MB, and rendered on the loop it held every proxied call 0.6-1.5 s (a hostile
    trial). Only what reads the loop's objects is read on the loop
    (:meth:`proxy.metrics.Metrics.read_on_loop`)."""
    series = runtime.metrics

    async def render(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(
            ",".join(request.headers.getall(hdrs.ACCEPT, [])))
        names = request.query.getall("name[]", [])
        read = series.read_on_loop(names)
        body = await asyncio.get_running_loop().run_in_executor(
            thread, series.render, encoder, names, read)
        return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type})

    async def budgets() -> None:
        refresh = getattr(runtime.state.ledger, "refresh_held", None)
        if refresh is not None:
            try:
                await refresh()
            except StateUnavailable:
                pass

    async def fresh(request: web.Request) -> web.Response:
        breakers = [breaker for route in runtime.routes
                    for breaker in (route.breaker,
                                    *(op.breaker for op in route.operations or ()))
                    if breaker is not None]
        await asyncio.gather(budgets(), *(breaker.refresh_stale() for breaker in breakers))
        return await render(request)

    #: The render under way per kind of scrape (its format and series): scrapes that
    #: arrive while it runs share it. 500 concurrent scrapes, each rendering, held the
    #: readiness probe 2-5 s and the proxy's calls up to 1.3 s (a hostile trial); and kinds
    #: queue in the one thread, bounded by the admin port's connection cap. Nothing is kept
    #: once it is done: a scrape after a change always sees it.
    rendering: dict[tuple[str, tuple[str, ...]], asyncio.Future[web.Response]] = {}

    async def metrics(request: web.Request) -> web.StreamResponse:
        # What decides the output: the format the Accept header negotiates and the series
        # asked for (name[]); a query that changes neither shares (a review: ?nocache=N
        # rendered every scrape again).
        kind = (choose_encoder(",".join(request.headers.getall(hdrs.ACCEPT, [])))[1],
                tuple(sorted(request.query.getall("name[]", []))))
        shared = rendering.get(kind)
        if shared is None:
            shared = rendering[kind] = asyncio.ensure_future(fresh(request))
            shared.add_done_callback(lambda done: rendering.pop(kind, None)
                                     if rendering.get(kind) is done else None)
        made = await asyncio.shield(shared)
        response = web.Response(status=made.status, body=made.body, headers=made.headers)
        response.enable_compression()
        return response

    return metrics


def build_admin_app(runtime: Runtime, reloader: Reloader | None = None) -> web.Application:
    """The app on ``server.admin_listen``: ``/metrics``, ``/healthz``, ``/readyz``, ``/admin/``."""
    app = web.Application(middlewares=[_not_the_proxy_port])
    app[RUNTIME] = runtime
    if reloader is not None:
        app[RELOADER] = reloader
    # A thread of its own, not asyncio's default pool (reloads read their file there): a
    # scrape must not wait behind a reload's parse, nor a reload behind renders.
    thread = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                   thread_name_prefix="sluice-metrics")

    async def stop_rendering(app: web.Application) -> None:
        # A render under way ends on its own; it reads nothing the shutdown closes.
        thread.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_rendering)
    app.router.add_get("/metrics", _metrics_handler(runtime, thread))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    add_admin_routes(app)
    return app


class AdminRunner(web.AppRunner):
    """An ``AppRunner`` whose server is an :class:`~proxy.edge.AdminServer`, so the admin
    port's connections get header, body and idle timeouts and a connection cap."""

    def __init__(self, runtime: Runtime, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._runtime = runtime

    async def _make_server(self) -> web.Server:
        # aiohttp's own server (after the app's startup) supplies the app's handler and
        # request factory; only the connection class changes.
        plain = await super()._make_server()
        return AdminServer(self._runtime, plain.request_handler,
                           request_factory=plain.request_factory, loop=plain._loop,
                           **plain._kwargs)


@web.middleware
async def _not_the_proxy_port(request: web.Request, handler: Any) -> web.StreamResponse:
    """A path the admin port does not serve: a 404 ``no_route`` in the proxy's shape that says
    which port this is. An SDK pointed here (``http://127.0.0.1:9901/openai/v1``) showed a bare
    "404: Not Found" (a new user's trial)."""
    if not isinstance(request.match_info.http_exception, web.HTTPNotFound):
        return await handler(request)
    listen = request.app[RUNTIME].config.server.listen  # restart-only: the one bound
    return render(Rejected(Reason.NO_ROUTE, None, (
        f"{request.raw_path[:200]}; this is Sluice's admin port, server.admin_listen: "
        f"/metrics, /healthz, /readyz, /admin/; agents call server.listen, {listen}")),
        "http")


# Both probes name the process that answers (``pid``), so a supervisor or a test can tell its
# own Sluice from another process that holds the port (tests/conftest.py's start_sluice).


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "pid": os.getpid()})


async def _readyz(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    state = {"backend": runtime.state.kind, **runtime.state.health.as_dict()}
    if runtime.draining or not runtime.started:
        status = "draining" if runtime.draining else "starting"
        return web.json_response({"status": status, "pid": os.getpid(), "state": state},
                                 status=503)
    if not runtime.state.health.up:
        # Still ready: state.on_unavailable says how calls are served meanwhile, and taking
        # every replica out of its Service for a Redis outage would refuse them all.
        state["on_unavailable"] = runtime.state.fallback.mode
    return web.json_response({"status": "ready", "pid": os.getpid(), "state": state})


def _bound(runner: web.BaseRunner) -> str:
    """The addresses ``runner`` listens on, as ``HOST:PORT`` (the port the system chose for a
    ``:0`` listener, which the config cannot tell)."""
    return ", ".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                     for host, port, *_ in runner.addresses)


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


#: The cyclic collector's youngest-generation threshold while serving (CPython's default: 700
#: allocations). A proxied request allocates a few hundred container objects, nearly all freed
#: by reference counting; at 700 a collection ran every few requests and traversed the ones in
#: flight.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Make the cyclic garbage collector cheap for the request path, once started.

    Everything alive at startup (modules, config, routes: ~70,000 objects) is moved out of the
    collector's sight (``gc.freeze``): a full collection, which requests in flight trigger every
    few seconds under load, traversed all of it. Under ``bench overhead``'s fast load
    (2026-12-02, ``gc.callbacks`` timing, loaded machine) the collector took 67-107 us of wall
    time per request before, 22-23 with the freeze alone, 8-9 with the threshold too. Frozen
    objects are still freed by reference counting; only a reference cycle among them (e.g. a
    config replaced by a reload) is never collected, a few KiB per reload.
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


async def serve(config: Config, config_path: str | None = None,
                stop_requested: Callable[[], bool] = lambda: False,
                reload_requested: Callable[[], bool] = lambda: False,
                read: Fingerprint = None, read_since_ns: int | None = None) -> None:
    """Run Sluice until SIGTERM/SIGINT, then drain and return.

    With ``config_path`` (the file ``config`` was loaded from), SIGHUP and changes to that file
    reload the config; without it, SIGHUP is ignored. ``stop_requested`` says whether a
    SIGTERM or SIGINT came before the loop took the signals over (it then stops at once),
    ``reload_requested`` whether a SIGHUP did (the config is read again once the watch
    starts); ``read``: the config file's fingerprint taken before it was read
    (:func:`proxy.reload.fingerprint`; ``None``: taken now), so that a change made since is
    seen and applied; ``read_since_ns``: when that read began, for the files the config
    names (:class:`proxy.reload.Reloader`).
    """
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, RedactMalformedRequests) for f in server_log.filters):
        server_log.addFilter(RedactMalformedRequests())
    repeats = _repeat_filters()
    raised = raise_open_files_limit()
    if raised is not None:
        log.info("open-files limit (RLIMIT_NOFILE) raised from %d to the hard limit %d", *raised)
    runtime = Runtime(config)
    reloader = (Reloader(runtime, config_path, read=read, read_since_ns=read_since_ns)
                if config_path else None)
    try:
        await runtime.open()
    except BaseException:
        await runtime.close()  # what opened before the failure (the upstream session)
        runtime.remove_created_files()
        raise
    proxy_server = build_proxy_server(runtime)
    proxy_server.connection_settings()  # logs now if the open-files limit lowers its bound
    proxy_runner = web.ServerRunner(proxy_server, shutdown_timeout=PROXY_SHUTDOWN_GRACE_S)
    admin_runner = AdminRunner(
        runtime, build_admin_app(runtime, reloader), access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    stop, hurry = asyncio.Event(), runtime.hurry  # hurry: heard by the shutdown's close too
    first_signal_at = 0.0

    def on_stop_signal(sig: signal.Signals) -> None:
        nonlocal first_signal_at
        since = time.monotonic() - first_signal_at
        if not stop.is_set():
            first_signal_at = time.monotonic()
            stop.set()
        elif since >= SECOND_SIGNAL_AFTER_S:
            hurry.set()  # a second one: no more waiting
        elif not hurry.is_set():
            # Said, as the drain's first line promises a second signal cuts the calls: an
            # operator whose Ctrl-C came too soon would otherwise wait with no word why.
            log.info("%s %.1fs after the first stop signal ignored: within the %gs grace (one "
                     "Ctrl-C can arrive twice); another one after it cuts the calls now",
                     sig.name, since, SECOND_SIGNAL_AFTER_S)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal, sig)
    if stop_requested():
        stop.set()
    # Until the reloader takes it over, a SIGHUP must not kill the process (its default):
    # it is remembered, and the reloader reads the file again when it starts.
    hup_came = [reload_requested()]
    loop.add_signal_handler(signal.SIGHUP, hup_came.append, True)
    reporter = asyncio.create_task(_report_held(repeats), name="sluice-log-repeats")
    watch = asyncio.create_task(DescriptorWatch(runtime.metrics.descriptors_exhausted.inc).run(),
                                name="sluice-descriptors")
    # aiohttp gives every answer without a Server field (Sluice's own, on both ports, and a
    # relayed one whose upstream sent none) "Python/3.11 aiohttp/3.x", naming the stack and
    # its versions, with headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE), the name read from
    # this module's globals; "sluice" instead, as Envoy's say "envoy". Set here, once, for
    # no cost per request (tests/test_server_header.py fails if aiohttp stops reading it),
    # and given back when serving ends: a process that serves in-process (a test, an
    # embedding app) keeps its own default after.
    server_software = web_response.SERVER_SOFTWARE
    web_response.SERVER_SOFTWARE = SERVER_NAME
    try:
        await proxy_runner.setup()
        await admin_runner.setup()
        host, port = _split(config.server.listen)
        # The kernel's accept queue holds a burst of connections until the loop accepts them;
        # aiohttp's default of 128 dropped the rest of a burst, whose callers then waited for
        # their SYN to be sent again (1 s, 3 s, 7 s...) before Sluice could answer them.
        await _listen(web.TCPSite(proxy_runner, host, port, reuse_address=True,
                                  backlog=config.server.max_connections),
                      "server.listen", config.server.listen)
        admin_host, admin_port = _split(config.server.admin_listen)
        await _listen(web.TCPSite(admin_runner, admin_host, admin_port, reuse_address=True),
                      "server.admin_listen", config.server.admin_listen)
        if config.state.backend == "redis":  # letters the move from memory left behind
            hint = await asyncio.to_thread(file_left_behind, config, config_path)
            if hint is not None:
                log.warning("%s", hint)
        runtime.started = True
        log.info(
            "sluice serving on %s (admin %s), %d route(s)",
            _bound(proxy_runner), _bound(admin_runner), len(runtime.routes),
        )
        if reloader is not None:
            reloader.start(signalled=any(hup_came))
        tune_gc()
        await stop.wait()
        if reloader is not None:
            await reloader.stop()
        await _drain(runtime, runtime.config.server.drain_timeout, hurry)
    finally:
        await proxy_runner.cleanup()
        await admin_runner.cleanup()
        await runtime.close()
        if not runtime.started:  # a listener could not be bound: leave no new file behind
            runtime.remove_created_files()
        reporter.cancel()
        watch.cancel()
        _log_held(repeats, final=True)
        web_response.SERVER_SOFTWARE = server_software


async def _listen(site: web.TCPSite, key: str, address: str) -> None:
    """Start ``site`` on ``address``, the config's ``key``.

    Raises:
        OSError: the address cannot be bound (taken by another process, say), its message
            naming the config key to change.
    """
    try:
        await site.start()
    except OSError as exc:
        raise OSError(exc.errno, f"{key} {address}: {exc.strerror or exc} (set {key} to a "
                                 "free address in a copy of the config)") from None


def _repeat_filters() -> list[tuple[logging.Handler, RepeatFilter]]:
    """A :class:`~policies.logs.RepeatFilter` on each handler of the root logger (one each: a
    shared one would drop a record on the second handler as a repeat of the first's)."""
    filters = []
    for handler in logging.getLogger().handlers:
        found = next((f for f in handler.filters if isinstance(f, RepeatFilter)), None)
        if found is None:
            found = RepeatFilter()
            handler.addFilter(found)
        filters.append((handler, found))
    return filters


async def _report_held(filters: list[tuple[logging.Handler, RepeatFilter]]) -> None:
    while True:
        await asyncio.sleep(LOG_REPEATS_EVERY_S)
        _log_held(filters)


def _log_held(filters: list[tuple[logging.Handler, RepeatFilter]], final: bool = False) -> None:
    """Each handler's held-back counts, to that handler alone (through the logger, every
    handler would print every handler's counts)."""
    for handler, repeats in filters:
        for line in repeats.held(final):
            handler.handle(log.makeRecord(log.name, logging.WARNING, __file__, 0, line, None,
                                          None))


def _mcp_calls_present(runtime: Runtime) -> bool:
    """Whether a call of an ``mcp`` route (not one of its streams) is present, before or
    after a reload."""
    return any(route.present_total > route.streams_total
               for route in (*runtime.routes, *runtime.removed) if route.protocol == "mcp")


async def _drain(runtime: Runtime, timeout_s: float, hurry: asyncio.Event) -> None:
    """Wait up to ``timeout_s`` for every call present to end (MCP streams apart), or until
    ``hurry`` is set (a second SIGTERM or Ctrl-C); then answer those not admitted yet 503
    ``draining`` and wait (up to ``SHUTDOWN_GRACE_S``) for those answers to be written,
    leaving what is in flight for :func:`serve`'s shutdown of the proxy port to cut."""
    deadline = time.monotonic() + timeout_s
    # A call in retry back-off whose next attempt would start past the deadline stops
    # retrying now, answered with its last failure and dead-lettered (proxy.attempts).
    runtime.drain_until(deadline)
    # Queued calls are waited for too, as Envoy and HAProxy do: each is admitted as a slot
    # frees, or refused when its max_wait ends; only what outlives the timeout is ended.
    inflight = runtime.inflight
    log.info("draining: %d request(s) in flight, %d more waiting or being read, waiting up "
             "to %gs (a second SIGTERM or Ctrl-C, %gs or more after the first, cuts them now)",
             inflight, runtime.present - inflight, timeout_s, SECOND_SIGNAL_AFTER_S)
    # Polling keeps the request path free of drain bookkeeping; it runs only at shutdown.
    # MCP streams (a session's GET stream) stay open, silent, for as long as their session:
    # waited for, they held every drain to its timeout. They carry no call, so they are not
    # waited for (a GET resuming the answer of a call seen closed early is no stream here:
    # proxy.handler); the shutdown of the proxy port ends them with the rest (their clients
    # reconnect them, to another replica).
    # An MCP client sends control traffic right after a call's result (the Python 2.x
    # client's tools/list, before it hands the result over): a drain that ended with the
    # call shut the port on it, and the client lost a result its tool had produced (a new
    # user's trial: 4 of 10 runs). So a drain that waited for calls of an MCP route ends only
    # once nothing has been present for MCP_FOLLOW_UP_S (not one that waited for other
    # routes' calls only: a new user saw each drain take a second more once the config had
    # an MCP route).
    follow_up, quiet_since = False, 0.0
    while time.monotonic() < deadline and not hurry.is_set():
        # A call whose answer's last message has gone (OpenAI's [DONE], an MCP call's
        # response) is answered: its stream is ended, not waited for while its upstream holds
        # it open (a new user's trial: every such stream held a drain to its timeout).
        answered = runtime.end_answered()
        if answered:
            log.info("draining: ending %d stream(s) whose answer has gone out",
                     len(answered))
        if runtime.present > runtime.streams:
            follow_up = follow_up or _mcp_calls_present(runtime)
            quiet_since = 0.0
        elif not follow_up:
            break
        elif not quiet_since:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= MCP_FOLLOW_UP_S:
            break
        await asyncio.sleep(DRAIN_POLL_S)
    if runtime.present > runtime.streams:
        runtime.cutting = True
        # Calls in retry back-off (a second stop signal came before their back-off ended)
        # are at no upstream: each stops retrying and is answered its last failure,
        # dead-lettered. Calls not admitted yet (queued, mostly) never reached the upstream:
        # each is answered 503 draining. Those answers are written before aiohttp's shutdown
        # cancels the handlers; only then is what is in flight (or still being read) cut.
        runtime.drain_until(time.monotonic())
        backing_off = list(runtime.backing_off.values())
        answering = runtime.refuse_waiting()
        inflight = runtime.inflight - len(backing_off)
        log.warning("%s: cutting %d request(s) still in flight and %d being read; %d waiting "
                    "answered 503 draining%s",
                    "second stop signal" if hurry.is_set() else "drain timeout", inflight,
                    max(runtime.present - runtime.inflight - len(answering), 0),
                    len(answering),
                    f"; {len(backing_off)} in retry back-off answered their last failure, "
                    "dead-lettered" if backing_off else "")
        if answering or backing_off:
            # A back-off's answer waits for its dead letter to be written (up to
            # DEAD_LETTER_WAIT_S) to name it.
            await asyncio.wait((*answering, *backing_off),
                               timeout=SHUTDOWN_GRACE_S + (DEAD_LETTER_WAIT_S if backing_off
                                                           else 0.0))
        # MCP calls in flight end with their JSON-RPC error rather than a cut connection
        # (a cut POST fails no call on the Python mcp 1.x client): their handlers write it.
        # So do answered streams (a second stop signal cut the drain short): their end.
        ending = runtime.end_answered() + runtime.end_mcp_calls()
        if ending:
            await asyncio.wait(ending, timeout=SHUTDOWN_GRACE_S)
        # MCP calls being finished after their callers left, held for an answer closed
        # early for polling, or held while their task runs (2025-11-25 tasks), are no
        # handler's: aiohttp's shutdown does not cut them, so the drain does (each gives
        # its holdings back as it ends), and waits for them to have ended.
        finishing = cancel_live((*runtime.finishing, *runtime.polling,
                                 *runtime.tasks.holding))
        if finishing:
            await asyncio.wait(finishing, timeout=SHUTDOWN_GRACE_S)
        # The sessions' DELETEs that waited for those calls are sent as they end: so that
        # the servers' sessions end with this process, not at their idle timeouts.
        # So are the cancels of the calls the cut ended, which tell their servers to stop.
        sending = runtime.session_delete_tasks | runtime.upstream_cancels
        if sending:
            await asyncio.wait(sending, timeout=SHUTDOWN_GRACE_S)
    elif runtime.present:
        runtime.cutting = True  # what is left (the streams) ends as the drain's cut
        log.info("drained; ending %d MCP stream(s)", runtime.present)
    else:
        log.info("drained")
