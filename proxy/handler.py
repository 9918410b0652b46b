"""The request path, top to bottom.

match route -> identify caller -> read body -> idempotency key (a replay or a wait for an
in-flight twin happens here, so it costs no quota and no slot) -> admit (cheapest first:
draining, circuit breaker, rate, token accounting: token rate and budget reservation, then the
concurrency slot and its queue) -> forward (with the breaker and retries when the route has
them: ``proxy.attempts``; metering usage) -> release, settle and record.

Every exit after admission runs the ``finally`` that frees the slot and settles the budget:
success, upstream error, upstream timeout, client disconnect (the handler is cancelled, which
also closes the upstream request) and any proxy error. The bookkeeping in that ``finally``
never awaits, so a cancellation cannot interrupt it. A request refused or abandoned before
admission gives its reservation back, and a request holding an idempotency key settles it on
every exit too (``claim.finish``): a refusal before the upstream frees the key for a retry.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from policies.concurrency import DEFAULT_PRIORITY, PRIORITIES
from policies.idempotency import SAFE_METHODS, Claim, replay_response
from policies.reasons import Reason, Rejected
from policies.retry import is_client_retry
from proxy import attempts
from proxy import forward as fwd
from proxy.rejections import jsonrpc_id, refuse, render
from proxy.routes import Route, has_dot_segment
from proxy.runtime import Runtime

log = logging.getLogger("sluice")

#: Longest tenant or run id accepted, characters.
MAX_ID_LENGTH = 128

#: How long a draining replica suggests callers wait (another replica can take them), seconds.
DRAINING_RETRY_AFTER_S = 1.0
_NOTHING_CHARGED: dict[str, object] = {}


def _caller_deadline(request: web.BaseRequest) -> float | None:
    """The caller's own timeout in seconds, from the Stainless SDKs' headers, if sent."""
    raw = request.headers.get("x-stainless-timeout") or request.headers.get(
        "x-stainless-read-timeout"
    )
    if raw:
        try:
            value = float(raw)
        except ValueError:
            return None
        if value > 0:
            return value
    return None


async def handle(rt: Runtime, request: web.BaseRequest) -> web.StreamResponse:
    """Serve one agent request (the only handler of the proxy port, bound to its runtime)."""
    raw_path = request.raw_path
    route = rt.router.match(raw_path)
    if route is None:
        detail = "absolute-form request targets are refused" if raw_path[:1] != "/" else raw_path
        return render(Rejected(Reason.NO_ROUTE, None, detail[:200]), "http")

    headers = request.headers
    tenant = headers.get(rt.tenant_header) or rt.default_tenant
    run = headers.get(rt.run_header)
    request_id = headers.get("X-Request-ID") or rt.next_request_id()
    events = rt.events
    metrics = route.metrics

    if has_dot_segment(raw_path):
        return _reject(rt, route, Rejected(Reason.BAD_REQUEST, None, "dot-segments in path"),
                       request_id, tenant, run)
    if len(tenant) > MAX_ID_LENGTH or (run is not None and len(run) > MAX_ID_LENGTH):
        # They become metric labels, event fields and ledger keys: keep them bounded.
        return _reject(rt, route, Rejected(
            Reason.BAD_REQUEST, None,
            f"{rt.tenant_header} and {rt.run_header} take at most {MAX_ID_LENGTH} characters"),
            request_id, tenant[:MAX_ID_LENGTH], run and run[:MAX_ID_LENGTH])
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _reject(rt, route, Rejected(Reason.BODY_TOO_LARGE, None,
                                           f"limit {rt.config.server.max_request_bytes} bytes"),
                       request_id, tenant, run)
    if rt.draining:  # after the read, so an MCP caller's error carries its request id
        return _reject(rt, route, Rejected(Reason.DRAINING, DRAINING_RETRY_AFTER_S), request_id,
                       tenant, run, body)

    idem = route.idempotency
    claim: Claim | None = None
    ikey = None
    if idem is not None and request.method not in SAFE_METHODS:
        claim = await idem.claim(request.method, raw_path, headers, tenant, body)
        ikey = claim.key
        if claim.new_unit:
            metrics.work_units.inc()
        if claim.rejected is not None:
            return _reject(rt, route, claim.rejected, request_id, tenant, run, body, ikey)
        if claim.replay is not None:
            return _replay(rt, route, claim, request_id, tenant, run)
    elif not is_client_retry(headers):
        metrics.work_units.inc()

    limiter = route.concurrency
    charge = None
    try:
        if route.breaker is not None:
            route.breaker.check()
        if route.rate is not None:
            route.rate.admit(tenant)
        if route.accounting is not None:
            charge = route.accounting.open(request.method, raw_path, body, tenant, run)
            if charge is not None:
                body = charge.body
                await route.accounting.reserve(charge)
        if limiter is not None and not limiter.try_acquire(tenant):
            priority = PRIORITIES.get(headers.get(rt.priority_header, ""), DEFAULT_PRIORITY)
            max_wait = limiter.wait_budget(_caller_deadline(request))
            if not limiter.queue_full and max_wait > 0:  # else refused before queueing
                events.emit("enqueued", request_id, route.name, tenant, run,
                            queue_depth=limiter.queued + 1)
            enqueued_at = time.monotonic()
            try:
                await limiter.wait(tenant, priority, max_wait)
            except Rejected as rejected:
                if rejected.reason is Reason.QUEUE_TIMEOUT:
                    events.emit("expired", request_id, route.name, tenant, run,
                                waited_s=round(time.monotonic() - enqueued_at, 6))
                raise
            metrics.queue_wait.observe(time.monotonic() - enqueued_at)
    except Rejected as rejected:
        if charge is not None:
            charge.release()
        if claim is not None:
            claim.finish("rejected")
        return _reject(rt, route, rejected, request_id, tenant, run, body, ikey)
    except BaseException:
        if charge is not None:
            charge.release()
        if claim is not None:
            claim.finish("client_disconnected")
        raise

    # Admitted: from here every exit passes through the finally below.
    route.inflight += 1
    events.emit("admitted", request_id, route.name, tenant, run, ikey)
    started = time.monotonic()
    outcome = "upstream_error"
    status = 0
    try:
        url = fwd.upstream_url(route.upstream_base, raw_path[len(route.prefix) - 1:])
        key = claim.header if claim else None
        meter = charge.meter if charge is not None else None
        capture = claim.capture if claim else None
        if route.resilient:
            response, outcome = await attempts.forward(
                request, rt, route, url, body, request_id, tenant, run, _caller_deadline(request),
                key, capture, meter,
            )
        else:
            metrics.upstream_attempts.inc()
            response, outcome = await fwd.forward(
                request, rt.session, url, body, route.timeout, key, capture, meter)
        status = response.status
        return response
    except Rejected as rejected:
        outcome = "upstream_timeout" if rejected.reason is Reason.UPSTREAM_TIMEOUT else outcome
        status = rejected.reason.status
        return render(rejected, route.protocol, jsonrpc_id(route.protocol, body))
    except (asyncio.CancelledError, ConnectionResetError):
        # Cancelled: by the caller leaving, or by the drain cutting what outlived it.
        outcome = "drain_cut" if rt.cutting else "client_disconnected"
        raise
    except Exception:
        log.exception("proxy error on route %s (request %s)", route.name, request_id)
        status = 502
        return render(Rejected(Reason.UPSTREAM_UNREACHABLE, None, "proxy error"), route.protocol)
    finally:
        elapsed = time.monotonic() - started
        route.inflight -= 1
        if limiter is not None:
            limiter.release(tenant, elapsed if outcome[0].isdigit() else None)
        metrics.upstream_duration.observe(elapsed)
        metrics.outcomes[outcome].inc()
        if claim is not None:
            claim.finish(outcome)
        charged = charge.settle(outcome) if charge is not None else _NOTHING_CHARGED
        events.emit("completed", request_id, route.name, tenant, run, ikey, status=status,
                    outcome=outcome, duration_s=round(elapsed, 6), **charged)


def _reject(rt: Runtime, route: Route, rejected: Rejected, request_id: str, tenant: str,
            run: str | None, body: bytes = b"", idempotency_key: str | None = None
            ) -> web.Response:
    """Refuse before admission: the refusal, and the request's ``rejected`` outcome."""
    route.metrics.outcomes["rejected"].inc()
    return refuse(rt, route, rejected, request_id, tenant, run, idempotency_key, body)


def _replay(rt: Runtime, route: Route, claim: Claim, request_id: str, tenant: str,
            run: str | None) -> web.Response:
    """Count, log as an event, and answer with the stored response of the key's first use."""
    record = claim.replay
    assert record is not None
    route.metrics.replays.inc()
    route.metrics.outcomes["replayed"].inc()
    rt.events.emit("replayed", request_id, route.name, tenant, run, claim.key,
                   status=record.status, bytes=len(record.body),
                   waited_s=round(claim.waited_s, 6))
    return replay_response(record)
