"""Forwarding through the circuit breaker and the retry layer: the attempt loop.

Routes with a ``circuit_breaker`` or ``retry`` block forward through :func:`forward` here
instead of :func:`proxy.forward.forward`. One admitted request becomes one or more upstream
attempts. Each attempt is admitted by the breaker and covers only the phase up to the
upstream's response headers (:func:`proxy.forward.send`); the answer finally chosen is relayed
once (:func:`proxy.forward.relay`) and never retried, so no response byte reaches the caller
twice.

How a request ends:

* the breaker refuses its first attempt: 503 ``circuit_open`` (a rejection, counted as one);
* success, or a failure the route does not retry on: the upstream's answer, relayed;
* a failure the route retries on (``retry.on``) that is still failing when retries end:
  dead-lettered (``policies/deadletter.py``), then the upstream's last answer is relayed, or,
  if it never answered, Sluice writes 502 ``upstream_unreachable``, 504 ``upstream_timeout``,
  or 503 ``deadline_unreachable`` when the deadline left no time to try again.

On a route with ``retry``, Sluice owns retries: every failure it relays or writes (408, 429,
5xx, no answer) carries ``x-should-retry: false``, which the OpenAI and Anthropic SDKs obey
before their own rules, so they do not stack their retries on Sluice's. The upstream's status,
body and other headers are relayed unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from policies import breaker as brk
from policies.deadletter import Attempt, DeadLetter, redact, redact_path
from policies.idempotency import Capture
from policies.reasons import Reason, Rejected
from policies.retry import (
    IDEMPOTENCY_HEADER,
    RetryPolicy,
    is_client_retry,
    retry_is_safe,
    upstream_retry_after,
)
from policies.usage import Meter
from proxy import forward as fwd
from proxy.rejections import jsonrpc_id, refuse, render
from proxy.routes import Route
from proxy.runtime import Runtime

log = logging.getLogger("sluice")

#: aiohttp errors raised before the request left: repeating it cannot apply it twice.
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
#: Answers the SDKs would retry themselves (408, 429, >= 500).
_SDK_RETRIED = frozenset({408, 429})


def _final(status: int) -> bool:
    return status >= 500 or status in _SDK_RETRIED


async def forward(
    request: web.BaseRequest,
    rt: Runtime,
    route: Route,
    url: URL,
    body: bytes,
    request_id: str,
    tenant: str,
    run: str | None,
    caller_timeout: float | None,
    idempotency_key: str | None = None,
    capture: Capture | None = None,
    meter: Meter | None = None,
) -> tuple[web.StreamResponse, str]:
    """Forward with the route's breaker and retries; see the module docstring.

    Args:
        caller_timeout: the caller's own timeout in seconds (``x-stainless-timeout``), if it
            sent one; no attempt or wait outlasts it.
        idempotency_key: the ``Idempotency-Key`` value the route's idempotency policy sends
            upstream (the same on every attempt), if the route has one.
        capture: fed the answer finally relayed, for the idempotency store.
        meter: reads the relayed answer's usage (token accounting); told when no attempt
            reached the upstream.

    Returns:
        ``(response, outcome)``; ``outcome`` is a ``sluice_requests_total`` outcome label.

    Raises:
        asyncio.CancelledError: the caller disconnected; the attempt in flight is closed and
            the breaker hears nothing of it.
    """
    retry = route.retry
    breaker = route.breaker
    metrics = route.metrics
    method = request.method
    headers = fwd.upstream_headers(request)
    if idempotency_key is not None:
        headers[IDEMPOTENCY_HEADER] = idempotency_key
    key = headers.get(IDEMPOTENCY_HEADER)
    if meter is not None:
        meter.request_headers(headers)
    reached = False  # some attempt reached the upstream (a charge may apply)
    client_retry = retry is not None and is_client_retry(request.headers)
    allowed = retry.attempts if retry is not None and not client_retry else 1
    now = time.monotonic()
    deadline = now + retry.deadline if retry is not None and retry.deadline else None
    caller_deadline = now + caller_timeout if caller_timeout else None
    attempts: list[Attempt] = []
    last: aiohttp.ClientResponse | None = None  # the latest failed answer, relayed if final
    error: Rejected | None = None  # or the latest failure that had no answer
    kind = ""  # "connect_error" or "timeout" for ``error``
    stop = ""  # why retrying ended on a failure it retries on; set means dead-lettered
    holding = False  # a retry-budget slot is held for the attempt in flight
    if client_retry:
        retry.budget.hold()
        holding = True
    try:
        number = 0
        while True:
            number += 1
            limit, callers_limit = _attempt_limit(retry, deadline, caller_deadline)
            if number > 1 and limit is not None and limit <= 0:
                stop = "deadline"
                break
            ticket = 0
            if breaker is not None:
                try:
                    ticket = breaker.admit()
                except Rejected as rejected:
                    if number == 1:
                        return refuse(rt, route, rejected, request_id, tenant, run, key,
                                      body), "rejected"
                    stop = "circuit_open"
                    # The breaker opened during the back-off, after the failed answer was let
                    # go: the refusal is what is left to tell the caller.
                    if last is None and error is None:
                        error = rejected
                    break
            started_at = time.time()
            started = time.monotonic()
            metrics.upstream_attempts.inc()
            try:
                async with asyncio.timeout(limit):
                    response = await fwd.send(rt.session, method, url, headers, body,
                                              route.timeout)
            except (Rejected, TimeoutError) as exc:
                if isinstance(exc, Rejected):
                    error = exc
                    kind = "timeout" if exc.reason is Reason.UPSTREAM_TIMEOUT else "connect_error"
                    sent = not isinstance(exc.__cause__, _NOT_SENT)
                    reached = reached or sent
                    neutral = False
                else:
                    error = Rejected(Reason.UPSTREAM_TIMEOUT, None,
                                     f"no response headers within {limit:.3g}s")
                    kind = "timeout"
                    sent = reached = True
                    # Cut short by the caller's own deadline: not the upstream's fault.
                    neutral = callers_limit
                if breaker is not None:
                    if neutral:
                        breaker.release(ticket)
                    else:
                        breaker.record(ticket, brk.FAILURE)
                attempts.append(Attempt(started_at, None, kind, time.monotonic() - started))
                status = None
                hint = None
                if last is not None:
                    last.release()
                    last = None
                if retry is None or not retry.retries_error(kind):
                    break
            except BaseException:
                if breaker is not None:
                    breaker.release(ticket)
                raise
            else:
                status = response.status
                hint = upstream_retry_after(response.headers) if status >= 400 else None
                if breaker is not None:
                    breaker.record(ticket, brk.classify(status, response.headers), status, hint)
                attempts.append(Attempt(started_at, status, None, time.monotonic() - started))
                if last is not None:
                    last.release()
                last, error, sent = response, None, True
                reached = True
                if retry is None or status not in retry.on_statuses:
                    break
            finally:
                if holding:
                    retry.budget.release()
                    holding = False

            # A failure this route retries on: retry it, or say why not.
            wait = 0.0
            if number >= allowed:
                stop = "attempts_exhausted"
            elif not retry_is_safe(method, key is not None, sent):
                stop = "unsafe_to_retry"
            else:
                wait = retry.wait(number - 1, hint)
                if wait is None:
                    stop = "retry_after_too_long"
                elif _too_late(time.monotonic() + wait, deadline, caller_deadline):
                    stop = "deadline"
                elif breaker is not None and breaker.blocked_for() > wait:
                    stop = "circuit_open"
                elif not retry.budget.try_acquire(route.inflight + _queued(route)):
                    stop = "retry_budget"
                    metrics.retry_overflow.inc()
            if stop:
                break
            holding = True
            metrics.retries.inc()
            rt.events.emit("retried", request_id, route.name, tenant, run, key,
                           attempt=number + 1, after=status or kind, wait_s=round(wait, 3))
            if last is not None:
                last.release()
                last = None
            await asyncio.sleep(wait)

        extra: dict[str, str] | None = None
        if stop:
            extra = {"x-should-retry": "false"}
            letter_id = await _dead_letter(rt, route, request, headers, body, key, request_id,
                                           tenant, run, attempts, stop)
            if letter_id is not None:
                extra["X-Sluice-Dead-Letter"] = str(letter_id)
            if last is None and stop == "deadline":
                error = Rejected(Reason.DEADLINE_UNREACHABLE, None,
                                 f"{len(attempts)} attempt(s); the last: {kind}")
        if last is not None:
            response, last = last, None
            if extra is None and retry is not None and _final(response.status):
                extra = {"x-should-retry": "false"}
            return await fwd.relay(request, response, extra, capture, meter)
        assert error is not None
        if meter is not None and not reached:
            meter.sent = False  # no attempt reached the upstream: nothing to charge
        answer = render(error, route.protocol, jsonrpc_id(route.protocol, body))
        if retry is not None:
            answer.headers.update(extra or {"x-should-retry": "false"})
        return answer, "upstream_timeout" if kind == "timeout" else "upstream_error"
    finally:
        if holding:
            retry.budget.release()
        if last is not None:
            last.release()


def _attempt_limit(retry: RetryPolicy | None, deadline: float | None,
                   caller_deadline: float | None) -> tuple[float | None, bool]:
    """Seconds the next attempt may take to its headers, and whether the caller's deadline
    is what binds it (then its timeout is the caller's, not the upstream's, fault)."""
    limit = retry.per_try_timeout if retry is not None else None
    now = time.monotonic()
    if deadline is not None and (limit is None or deadline - now < limit):
        limit = max(0.0, deadline - now)
    if caller_deadline is not None and (limit is None or caller_deadline - now < limit):
        return max(0.0, caller_deadline - now), True
    return limit, False


def _too_late(at: float, deadline: float | None, caller_deadline: float | None) -> bool:
    return (deadline is not None and at >= deadline) or (
        caller_deadline is not None and at >= caller_deadline
    )


def _queued(route: Route) -> int:
    limiter = route.concurrency
    return limiter.queued if limiter is not None else 0


async def _dead_letter(rt: Runtime, route: Route, request: web.BaseRequest,
                       headers: CIMultiDict[str], body: bytes, key: str | None,
                       request_id: str, tenant: str, run: str | None,
                       attempts: list[Attempt], reason: str) -> int | None:
    """Record failed work; returns its id, or ``None`` if it could not be written."""
    store = rt.dead_letters
    if store is None:
        return None
    kept, removed = redact(headers.items())
    path, removed_query = redact_path(request.raw_path[len(route.prefix) - 1:])
    letter = DeadLetter(
        route=route.name, tenant=tenant, run=run, idempotency_key=key, request_id=request_id,
        method=request.method, path=path, headers=kept, redacted=removed + removed_query,
        body=body, body_size=len(body), attempts=attempts, reason=reason,
    )
    try:
        letter_id = await store.add(letter)
    except sqlite3.Error:
        log.exception("dead-letter write failed on route %s (request %s)", route.name,
                      request_id)
        return None
    route.metrics.dead_letters.inc()
    rt.events.emit("dead_lettered", request_id, route.name, tenant, run, key,
                   dead_letter_id=letter_id, reason=reason, attempts=len(attempts))
    return letter_id
