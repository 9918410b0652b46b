"""Forwarding one admitted call: its upstream attempts, then the one answer relayed.

Every route forwards through :func:`forward`. A plain route makes one attempt; a route with a
``circuit_breaker`` admits each attempt through it (:func:`_attempt`, the breaker step), and
a route with ``retry`` repeats failed attempts (:func:`_attempts`, the retry loop). Each
attempt covers only the phase up to the upstream's response headers
(:func:`proxy.forward.send`); the answer finally chosen is relayed once
(:func:`proxy.forward.relay`) and never retried, so no response byte reaches the caller twice.

How a call ends here:

* the breaker refuses its first attempt: :class:`~policies.reasons.Rejected` is raised, a
  refusal like any admission refusal (nothing reached the upstream, nothing is charged);
* success, or a failure the route does not retry on: the upstream's answer, relayed;
* a failure the route retries on (``retry.on``) that is still failing when retries end:
  dead-lettered (:func:`_dead_letter`), then the upstream's last answer is relayed, or,
  if it never answered, Sluice writes 502 ``upstream_unreachable``, 504 ``upstream_timeout``,
  or 503 ``deadline_unreachable`` when the deadline left no time to try again.

Whether the request reached the upstream is decided in one place, :func:`proxy.forward.left`,
for plain and retrying routes alike: it decides what is charged and whether a POST without a
key may be repeated.

On a route with ``retry``, Sluice owns retries: every failure it relays or writes (408, 429,
5xx, no answer) carries ``x-should-retry: false``, which the OpenAI and Anthropic SDKs obey
before their own rules, so they do not stack their retries on Sluice's.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from policies import breaker as brk
from policies.deadletter import Attempt, DeadLetter, redact, redact_path
from policies.mcp import Traffic
from policies.pipeline import Call
from policies.reasons import Reason, Rejected
from policies.retry import (
    IDEMPOTENCY_HEADER,
    RetryPolicy,
    is_client_retry,
    retry_is_safe,
    upstream_retry_after,
)
from policies.state import StateUnavailable
from proxy import forward as fwd
from proxy.rejections import jsonrpc_id, render
from proxy.routes import Route
from proxy.runtime import Runtime

log = logging.getLogger("sluice")

#: Answers the SDKs would retry themselves (408, 429, >= 500).
_SDK_RETRIED = frozenset({408, 429})
_NO_RETRY = {"x-should-retry": "false"}


def _final(status: int) -> bool:
    return status >= 500 or status in _SDK_RETRIED


class _Tries:
    """What the attempts of one call came to.

    Attributes:
        response: the latest failed answer still open (relayed if it is the last word).
        error: or the latest failure that had no answer.
        kind: ``connect_error`` or ``timeout`` for ``error``.
        reached: some attempt may have reached the upstream.
        stop: why retrying ended on a failure the route retries on; set means dead-lettered.
        log: every attempt, for the dead letter (routes with ``retry`` only).
    """

    __slots__ = ("error", "kind", "log", "reached", "response", "stop")

    def __init__(self) -> None:
        self.response: aiohttp.ClientResponse | None = None
        self.error: Rejected | None = None
        self.kind = ""
        self.reached = False
        self.stop = ""
        self.log: list[Attempt] = []

    def answered(self, response: aiohttp.ClientResponse) -> None:
        self.drop_response()
        self.response, self.error, self.reached = response, None, True

    def drop_response(self) -> None:
        if self.response is not None:
            self.response.release()
            self.response = None


async def forward(request: web.BaseRequest, rt: Runtime, route: Route, call: Call,
                  traffic: Traffic = "call") -> tuple[web.StreamResponse, str, bool]:
    """Forward an admitted call; see the module docstring.

    ``traffic`` is the MCP traffic class (:data:`policies.mcp.Traffic`; ``call`` on every
    other protocol). MCP ``control`` and ``stream`` requests make one attempt, with no
    breaker and no retries: they are session plumbing, not work, and refusing or repeating
    one breaks the session. A ``stream`` (the GET stream) has no total timeout, only
    ``timeouts.idle`` between bytes.

    Returns:
        ``(response, outcome, reached)``: ``outcome`` is a ``sluice_requests_total`` label,
        ``reached`` whether the request may have reached the upstream.

    Raises:
        Rejected: the breaker refused the first attempt (nothing was sent).
        asyncio.CancelledError: the caller disconnected; the attempt in flight is closed and
            the breaker hears nothing of it.
    """
    headers = fwd.upstream_headers(request)
    if call.upstream_key is not None:
        headers[IDEMPOTENCY_HEADER] = call.upstream_key
    meter = call.meter
    if meter is not None:
        meter.request_headers(headers)
    deadline_header = route.config.timeouts.deadline_header
    if (call.timeout is not None and deadline_header is not None
            and route.protocol in ("http", "mcp")):
        # What is left of the caller's deadline, so the upstream can stop work nobody awaits.
        left = call.timeout - (time.monotonic() - call.received_at)
        headers[deadline_header] = f"{max(left, 0.001):.3f}"
    url = fwd.upstream_url(route.upstream_base, call.path[len(route.prefix) - 1:])
    tries = _Tries()
    guarded = traffic == "call"
    retry = route.retry if guarded else None
    breaker = route.breaker if guarded else None
    timeout = route.timeout
    if traffic == "stream":
        timeouts = route.config.timeouts
        timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect,
                                        sock_read=timeouts.idle)
    try:
        await _attempts(rt, route, call, url, headers, tries, retry, breaker, timeout)
        extra: dict[str, str] | None = None
        if tries.stop:
            extra = dict(_NO_RETRY)
            letter_id = await _dead_letter(rt, route, call, headers, tries)
            if letter_id is not None:
                extra["X-Sluice-Dead-Letter"] = str(letter_id)
            if tries.response is None and tries.stop == "deadline":
                tries.error = Rejected(Reason.DEADLINE_UNREACHABLE, None,
                                       f"{len(tries.log)} attempt(s); the last: {tries.kind}")
        if tries.response is not None:
            response, tries.response = tries.response, None
            if extra is None and retry is not None and _final(response.status):
                extra = _NO_RETRY
            if call.response_headers:
                extra = {**call.response_headers, **(extra or {})}
            call.status = response.status
            call.progress_at = time.monotonic()
            try:
                answer, outcome = await fwd.relay(request, response, extra,
                                                  _Progress(call, call.capture), meter)
            except Rejected as error:  # not relayable (a bad status or header) or cut in time
                call.status = error.reason.status
                failed = render(error, route.protocol, jsonrpc_id(route.protocol, call.body))
                if retry is not None:  # a final failure on a route that owns retries
                    failed.headers.update(_NO_RETRY)
                timed_out = error.reason is Reason.UPSTREAM_TIMEOUT
                return failed, "upstream_timeout" if timed_out else "upstream_error", True
            return answer, outcome, True
        error = tries.error
        assert error is not None
        answer = render(error, route.protocol, jsonrpc_id(route.protocol, call.body))
        if retry is not None:
            answer.headers.update(extra or _NO_RETRY)
        outcome = "upstream_timeout" if tries.kind == "timeout" else "upstream_error"
        return answer, outcome, tries.reached
    finally:
        tries.drop_response()


class _Progress:
    """Stamps ``call.progress_at`` as the answer's bytes move (stall detection), passing them
    on to the idempotency capture, if any (the relay's capture interface)."""

    __slots__ = ("call", "capture")

    def __init__(self, call: Call, capture: Any) -> None:
        self.call = call
        self.capture = capture

    def begin(self, status: int, reason: str | None, headers: Any) -> None:
        if self.capture is not None:
            self.capture.begin(status, reason, headers)

    def feed(self, chunk: bytes) -> None:
        self.call.progress_at = time.monotonic()
        if self.capture is not None:
            self.capture.feed(chunk)


async def _attempts(rt: Runtime, route: Route, call: Call, url: URL,
                    headers: CIMultiDict[str], tries: _Tries, retry: RetryPolicy | None,
                    breaker: brk.Breaker | None, timeout: aiohttp.ClientTimeout) -> None:
    """The retry loop: attempts until one is final, or retrying ends (``tries.stop``).

    ``retry`` and ``breaker`` are the route's, or ``None`` where they do not apply;
    ``timeout`` bounds each attempt.

    Raises:
        Rejected: the breaker refused the first attempt.
    """
    client_retry = retry is not None and is_client_retry(call.headers)
    allowed = retry.attempts if retry is not None and not client_retry else 1
    now = time.monotonic()
    deadline = now + retry.deadline if retry is not None and retry.deadline else None
    caller_deadline = now + call.timeout if call.timeout else None
    # A key the idempotency block invented makes a retry safe only if the upstream honours
    # keys; the caller's own key says the caller relies on it.
    callers_key = IDEMPOTENCY_HEADER in call.headers
    upstream_dedups = (retry is not None and retry.honours_idempotency_key
                       and IDEMPOTENCY_HEADER in headers)
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
                tries.stop = "deadline"
                return
            try:
                status, hint, sent = await _attempt(rt, route, call, url, headers, tries,
                                                    limit, callers_limit, retry is not None,
                                                    breaker, timeout)
            except Rejected as rejected:  # the breaker's refusal
                if number == 1:
                    raise
                tries.stop = "circuit_open"
                # The breaker opened during the back-off, after the failed answer was let
                # go: the refusal is what is left to tell the caller.
                if tries.response is None and tries.error is None:
                    tries.error = rejected
                return
            finally:
                if holding:
                    retry.budget.release()
                    holding = False
            if retry is None or not (status in retry.on_statuses if status is not None
                                     else retry.retries_error(tries.kind)):
                return
            # A failure this route retries on: retry it, or say why not.
            wait = 0.0
            if number >= allowed:
                tries.stop = "attempts_exhausted"
            elif not retry_is_safe(call.method, sent, callers_key=callers_key,
                                   upstream_dedups=upstream_dedups,
                                   declared_idempotent=route.config.idempotent):
                tries.stop = "unsafe_to_retry"
            else:
                wait = retry.wait(number - 1, hint)
                if wait is None:
                    tries.stop = "retry_after_too_long"
                elif _too_late(time.monotonic() + wait, deadline, caller_deadline):
                    tries.stop = "deadline"
                elif breaker is not None and breaker.blocked_for() > wait:
                    tries.stop = "circuit_open"
                elif not retry.budget.try_acquire(route.inflight + _queued(route)):
                    tries.stop = "retry_budget"
                    route.metrics.retry_overflow.inc()
            if tries.stop:
                return
            holding = True
            route.metrics.retries.inc()
            rt.events.emit("retried", call.request_id, route.name, call.tenant, call.run,
                           call.idempotency_key, attempt=number + 1,
                           after=status or tries.kind, wait_s=round(wait, 3))
            tries.drop_response()
            await asyncio.sleep(wait)
    finally:
        if holding:
            retry.budget.release()


async def _attempt(rt: Runtime, route: Route, call: Call, url: URL,
                   headers: CIMultiDict[str], tries: _Tries, limit: float | None,
                   callers_limit: bool, logged: bool, breaker: brk.Breaker | None,
                   timeout: aiohttp.ClientTimeout) -> tuple[int | None, float | None, bool]:
    """The breaker step: one attempt, admitted by ``breaker`` (if any) and reported to it;
    ``logged``: the attempt goes in ``tries.log`` (for a dead letter).

    Returns:
        ``(status, retry_after, sent)``: the upstream's status (``None`` when it did not
        answer), the wait it asked for, and whether the request may have reached it.

    Raises:
        Rejected: ``circuit_open`` from the breaker; nothing was sent.
        asyncio.CancelledError: the caller left; the breaker hears nothing.
    """
    ticket = await breaker.attempt() if breaker is not None else None
    started_at = time.time() if logged else 0.0
    started = time.monotonic()
    try:
        route.metrics.upstream_attempts.inc()
        call.attempts += 1
        if limit is None:
            # Most routes set no per-try bound or deadline: a timeout scope would cost a
            # timer handle, two lookups of the running loop and two getpid syscalls
            # (Python 3.11's C get_running_loop checks the pid) per attempt, for nothing.
            response = await fwd.send(rt.session, call.method, url, headers, call.body,
                                      timeout)
        else:
            async with asyncio.timeout(limit):
                response = await fwd.send(rt.session, call.method, url, headers, call.body,
                                          timeout)
    except Rejected as exc:
        tries.error = exc
        tries.kind = "timeout" if exc.reason is Reason.UPSTREAM_TIMEOUT else "connect_error"
        sent = fwd.left(exc)
        neutral = False
    except TimeoutError:
        tries.error = Rejected(Reason.UPSTREAM_TIMEOUT, None,
                               f"no response headers within {limit:.3g}s")
        tries.kind = "timeout"
        sent = True
        # Cut short by the caller's own deadline: not the upstream's fault.
        neutral = callers_limit
    except BaseException:
        if ticket is not None:
            breaker.release(ticket)
        raise
    else:
        status = response.status
        hint = upstream_retry_after(response.headers) if status >= 400 else None
        if logged:
            tries.log.append(Attempt(started_at, status, None, time.monotonic() - started))
        tries.answered(response)  # first: whatever happens next, the response gets closed
        if ticket is not None:
            await breaker.record(ticket, brk.classify(status, response.headers), status, hint)
        return status, hint, True
    tries.reached = tries.reached or sent
    tries.drop_response()
    if ticket is not None:
        if neutral:
            breaker.release(ticket)
        else:
            await breaker.record(ticket, brk.FAILURE)
    if logged:
        tries.log.append(Attempt(started_at, None, tries.kind, time.monotonic() - started))
    return None, None, sent


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


async def _dead_letter(rt: Runtime, route: Route, call: Call, headers: CIMultiDict[str],
                       tries: _Tries) -> int | None:
    """Dead-lettering: record the failed work; returns its id, or ``None`` if it could not be
    written (the caller still gets its answer)."""
    store = rt.dead_letters
    if store is None:
        return None
    kept, removed = redact(headers.items())
    path, removed_query = redact_path(call.path[len(route.prefix) - 1:])
    key = headers.get(IDEMPOTENCY_HEADER)
    letter = DeadLetter(
        route=route.name, tenant=call.tenant, run=call.run, idempotency_key=key,
        request_id=call.request_id, method=call.method, path=path, headers=kept,
        redacted=removed + removed_query, body=call.body, body_size=len(call.body),
        attempts=tries.log, reason=tries.stop,
    )
    try:
        letter_id = await store.add(letter)
    except (sqlite3.Error, StateUnavailable):
        log.exception("dead-letter write failed on route %s (request %s)", route.name,
                      call.request_id)
        return None
    route.metrics.dead_letters.inc()
    rt.events.emit("dead_lettered", call.request_id, route.name, call.tenant, call.run,
                   call.idempotency_key, dead_letter_id=letter_id, reason=tries.stop,
                   attempts=len(tries.log))
    return letter_id
