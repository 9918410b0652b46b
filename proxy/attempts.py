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
* a failure the route retries on (``retry.on``) that is still failing when retries end
  (or when the drain would cut its next attempt before it starts: :func:`_back_off`):
  dead-lettered (:func:`_dead_letter`; not one Sluice could not safely repeat whose caller
  is an SDK that retries it itself), then the upstream's last answer is relayed, or,
  if it never answered, Sluice writes 502 ``upstream_unreachable``, 504 ``upstream_timeout``,
  or 503 ``deadline_unreachable`` when the deadline left no time to try again.

Whether the request reached the upstream is decided in one place, :func:`proxy.forward.left`,
for plain and retrying routes alike: it decides what is charged and whether a POST without a
key may be repeated.

On a route with ``retry``, one layer retries a failure, never two: when Sluice took the
failure on (its status or error kind is in ``retry.on`` and repeating the request is safe),
what it relays or writes once retrying ends carries ``x-should-retry: false``, which the
OpenAI and Anthropic SDKs obey before their own rules, so they do not stack their retries on
Sluice's. A failure Sluice does not retry (a status outside ``retry.on``, or a POST it cannot
safely repeat: ``unsafe_to_retry``) is passed on without that header, so the caller's SDK
applies its own rules as it would without Sluice (a new user found the default config's LLM
routes had lost every retry of a 429 or a 503: Sluice did not repeat the POST and told the SDK
not to either).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

from policies import breaker as brk
from policies.deadletter import (
    DEAD_LETTER_HEADER,
    Attempt,
    DeadLetter,
    LetterNotKept,
    redact,
    redact_path,
)
from policies.idempotency import key_origin, names_a_key
from policies.logs import PER_CALL
from policies.mcp import (
    LAST_EVENT_ID_HEADER,
    SESSION_HEADER,
    VERSION_HEADER,
    AnswerTracker,
    TaskStatusWatch,
    Traffic,
    cancel_notification,
    cancels_by_closing,
    is_sse,
    task_cancel,
)
from policies.operations import Plan
from policies.pipeline import SENT_UNANSWERED, Call
from policies.reasons import Reason, Rejected
from policies.retry import (
    CLIENT_RETRY_HEADER,
    IDEMPOTENCY_HEADER,
    RetryPolicy,
    retry_is_safe,
    upstream_retry_after,
)
from policies.state import StateUnavailable
from proxy import forward as fwd
from proxy import mcp_tasks
from proxy.client import client_timeout, send_aside
from proxy.rejections import render
from proxy.routes import Route
from proxy.runtime import Polled, Runtime

log = logging.getLogger("sluice")

_NO_RETRY = {"x-should-retry": "false"}
#: How long a dead-lettered call's answer waits for its record to be written, to name it in
#: ``X-Sluice-Dead-Letter``, seconds. The call holds its slot meanwhile: a store that another
#: process keeps locked (its letters held in memory until it lets go, one after another)
#: held every failing call's slot for as long, and refused healthy calls ``queue_timeout``.
DEAD_LETTER_WAIT_S = 1.0
#: How long after an attempt's limit its own timeout scope ends, seconds: aiohttp's bound on
#: connecting, set to the limit, goes first, so a connection not made in time says so.
CONNECT_FIRST_S = 0.05
#: How long a call closed early for polling is held for its response when its attempt had
#: no total timeout to bound it (``timeouts.total``'s default), seconds.
POLLED_WAIT_S = 600.0


#: Ends of retrying that come of the call (its upstream, its route), not of its caller or of
#: this replica: the failure is the call's, which its key's waiting twins are given
#: (:meth:`policies.idempotency.Capture.failure`). Not so ``sdk_retry`` (the caller's SDK
#: retries: one attempt here), ``draining`` (this replica stops), ``budget_exhausted`` and
#: the like (the caller's run or tenant has no room), nor a deadline that was the caller's
#: (:attr:`_Tries.callers`).
_CALLS_STOPS = frozenset({"attempts_exhausted", "retry_after_too_long", "unsafe_to_retry",
                          "circuit_open", "retry_budget", "deadline"})


class _Tries:
    """What the attempts of one call came to.

    Attributes:
        response: the latest failed answer still open (relayed if it is the last word).
        error: or the latest failure that had no answer.
        kind: ``connect_error`` (the request never left), ``connection_lost`` (it may have
            reached the upstream) or ``timeout`` for ``error``.
        stop: why retrying ended on a failure the route retries on; set means dead-lettered.
        callers: the last failure, or the end of retrying, came of the caller's own deadline
            (an attempt it cut short, no time left for another), not of the call.
        log: every attempt, for the dead letter (routes with ``retry`` only), as the fields
            of :class:`policies.deadletter.Attempt` (built only for a dead letter).
    """

    __slots__ = ("callers", "error", "kind", "log", "pending", "response", "stop", "tracker")

    def __init__(self) -> None:
        #: Breakers whose verdict on the answer is known only once it has been read.
        self.pending: _Waiting | None = None
        #: Reads the relayed answer for ``pending``'s verdict.
        self.tracker: AnswerTracker | None = None
        self.response: aiohttp.ClientResponse | None = None
        self.error: Rejected | None = None
        self.kind = ""
        self.stop = ""
        self.callers = False
        self.log: list[tuple[float, int | None, str | None, float]] = []

    def answered(self, response: aiohttp.ClientResponse) -> None:
        self.drop_response()
        self.response, self.error = response, None

    def drop_response(self) -> None:
        if self.response is not None:
            self.response.release()
            self.response = None


class _Waiting:
    """Tickets of breakers that hear a 2xx answer's verdict only once it has been read
    (:attr:`_Tries.pending`): an MCP tool's breaker, one ticket, judged by the call's result
    (a tool failure or not, :func:`_verdict`); or, for an LLM stream, every breaker of the
    attempt, judged by the error event the stream may end with
    (:func:`policies.breaker.classify_stream`), the one it is the half-open probe of
    included, through the pass its status line's success returned (:func:`_record_probes`)."""

    __slots__ = ("tickets", "tool")

    def __init__(self, tickets: list[tuple[brk.Breaker, brk.Pass]], tool: bool) -> None:
        self.tickets = tickets
        self.tool = tool


async def forward(request: web.BaseRequest, rt: Runtime, route: Route, call: Call,
                  traffic: Traffic = "call", plan: Plan | None = None,
                  finish: fwd.Finish | None = None) -> tuple[web.StreamResponse, str]:
    """Forward an admitted call; see the module docstring.

    ``traffic`` is the MCP traffic class (:data:`policies.mcp.Traffic`; ``call`` on every
    other protocol). MCP ``control`` and ``stream`` requests make one attempt, with no
    breaker and no retries: they are session plumbing, not work, and refusing or repeating
    one breaks the session. A ``stream`` (the GET stream) has no total timeout, only
    ``timeouts.idle`` between bytes.

    ``plan`` is the call's (:meth:`proxy.routes.Route.plan`; default: the route's own): its
    breakers admit each attempt, its retry policy and timeouts apply. An MCP tool's breaker
    (``plan.tool_breaker``) hears a 2xx answer's verdict only once the answer is read: an
    ``isError`` result or a JSON-RPC error other than invalid params is that tool's failure.

    ``finish``: the call's exchange may outlive its caller (:class:`proxy.forward.Finish`,
    an MCP call whose answer is kept for its key); the relay is told.

    A streamed call on an ``openai`` or ``anthropic`` route (one whose ``call.meter`` read
    ``"stream": true``) that is answered 2xx tells its breakers only once its stream has
    ended: a server-side error event in place of the rest of the answer is a failure
    (:func:`policies.breaker.classify_stream`), and the call's outcome ``upstream_error``.
    A breaker it is the half-open probe of hears its status line at once, then only its
    stream's failure, which opens it again (:meth:`policies.breaker.Breaker.record`).

    Returns:
        ``(response, outcome)``: ``outcome`` is a ``sluice_requests_total`` label; whether
        the request may have reached the upstream is left in ``call.reached``.

    Raises:
        Rejected: the breaker refused the first attempt, or the caller's timeout passed
            before it (nothing was sent).
        asyncio.CancelledError: the caller disconnected; the attempt in flight is closed and
            the breaker hears nothing of it.
    """
    headers = fwd.upstream_headers(request, route.request_drop)
    if route.own_credentials:
        # The route's credentials are the upstream's: a caller's own Authorization (the
        # SDKs always send one) made aiohttp refuse every call, counted as an attempt.
        headers.popall(hdrs.AUTHORIZATION, None)
    if call.upstream_key is not None:
        headers[IDEMPOTENCY_HEADER] = call.upstream_key
    meter = call.meter
    if meter is not None:
        meter.request_headers(headers)
    url = route.url(call.path)
    tries = _Tries()
    if plan is None:
        plan = route.base_plan
    timeout = route.timeout
    if traffic == "call":
        retry = plan.retry
        breakers = plan.breakers
        tool_breaker = plan.tool_breaker
        if plan.timeouts is not route.config.timeouts:
            timeout = client_timeout(plan.timeouts.total, plan.timeouts.connect)
    else:
        retry, breakers, tool_breaker = None, (), None
        if traffic == "stream":
            timeouts = route.config.timeouts
            timeout = client_timeout(None, timeouts.connect, sock_read=timeouts.idle)
    try:
        await _attempts(rt, route, call, url, headers, tries, retry, breakers, tool_breaker,
                        plan.idempotent, timeout)
        extra: dict[str, str] | None = None
        if tries.stop:
            extra = dict(_NO_RETRY) if _retried(tries) else {}
            # Not a dead letter when the caller's SDK retries it itself (the Stainless SDKs
            # send their attempt count): the record would outlive a retry that succeeded,
            # and its replay would do the work once more (a new user's trial).
            if not (tries.stop == "unsafe_to_retry" and CLIENT_RETRY_HEADER in call.headers):
                letter_id = await _dead_letter(rt, route, call, headers, tries)
                if letter_id is not None:
                    extra[DEAD_LETTER_HEADER] = str(letter_id)
            if tries.response is None and tries.stop == "deadline":
                tries.error = Rejected(Reason.DEADLINE_UNREACHABLE, None,
                                       f"{len(tries.log)} attempt(s); the last: {tries.kind}")
        if call.capture is not None:
            if tries.callers or (tries.stop and tries.stop not in _CALLS_STOPS):
                call.capture.callers_own = True  # a twin of the call tries for itself
            elif extra:
                call.capture.add_to_failure(extra)
        if tries.response is not None:
            response, tries.response = tries.response, None
            if call.response_headers:
                extra = {**call.response_headers, **(extra or {})}
            call.status = response.status
            call.progress_at = time.monotonic()
            capture = call.capture
            watch: AnswerTracker | TaskStatusWatch | None = None
            if route.protocol == "mcp":  # one test keeps the rest off other routes' path
                capture, watch = _follow_mcp_answer(rt, route, call, request, response, tries,
                                                    traffic, capture)
            total, sent_at = timeout.total, call.sent_at
            try:
                answer, outcome = await fwd.relay(
                    request, response, extra, capture, meter, call, finish,
                    None if total is None or sent_at is None else sent_at + total,
                    route.locations)
            except Rejected as error:  # not relayable (a bad status or header) or cut in time
                await _verdict(tries, None, meter, cut=True)
                call.status = error.reason.status
                failed = render(error, route.protocol, call.rpc_id)
                if _retried(tries):  # else no layer of Sluice's retried it: the SDK may
                    failed.headers.update(_NO_RETRY)
                if call.capture is not None:  # its key's waiting duplicates get it too
                    call.capture.written(failed)
                timed_out = error.reason is Reason.UPSTREAM_TIMEOUT
                if timed_out and traffic == "call":
                    _cancel_timed_out(rt, route, call)
                return failed, "upstream_timeout" if timed_out else "upstream_error"
            if route.protocol == "mcp":
                _after_mcp_answer(rt, route, call, request, tries.tracker, watch, traffic,
                                  outcome, total)
            if tries.pending is not None:
                await _verdict(tries, tries.tracker, meter,
                               cut=outcome in ("upstream_error", "upstream_timeout"))
            return answer, outcome
        error = tries.error
        assert error is not None
        answer = render(error, route.protocol, call.rpc_id)
        if extra:
            answer.headers.update(extra)
        if call.capture is not None:  # its key's waiting duplicates get it too
            call.capture.written(answer)
        if tries.kind == "timeout":
            if traffic == "call":
                _cancel_timed_out(rt, route, call)
            return answer, "upstream_timeout"
        return answer, "upstream_error"
    finally:
        tries.drop_response()
        if tries.pending is not None:  # the caller left during the answer
            waiting, tries.pending = tries.pending, None
            if not waiting.tool:  # what the answer showed before the caller left stands
                verdict = _read_verdict(meter)
                for breaker, ticket in waiting.tickets:
                    breaker.record_soon(ticket, verdict)
            else:
                [(breaker, ticket)] = waiting.tickets
                found = tries.tracker.outcome if tries.tracker is not None else None
                if found is None:  # before the response: the answer says nothing
                    breaker.release(ticket)
                else:  # after it, as the MCP SDKs do: its verdict stands
                    breaker.record_soon(ticket, brk.FAILURE if found.tool_failure
                                        else brk.SUCCESS)


def _follow_mcp_answer(rt: Runtime, route: Route, call: Call, request: web.BaseRequest,
                       response: aiohttp.ClientResponse, tries: _Tries, traffic: Traffic,
                       capture: Any) -> tuple[Any, AnswerTracker | TaskStatusWatch | None]:
    """What reads an MCP route's answer as it is relayed, besides ``capture`` (the call's
    idempotency capture, or ``None``): its response's tracker (``tries.tracker``) and a
    task watch (:func:`_task_watch`). Returns the capture the relay is given (feeding
    them all) and the watch, if any. The tracker also gives an MCP tool's breaker its
    verdict once the answer is read (:func:`_verdict`)."""
    if traffic == "call" or (traffic == "control" and call.rpc_id is not None
                             and is_sse(response.headers.get("Content-Type"))):
        # A call's answer, or a control request's on a stream (initialize,
        # tools/list): followed to its response, which tells when the caller has it
        # (forward.delivered). Not a control request's JSON answer: complete only at
        # its end, it would tell nothing, and be held whole for nothing.
        # The id as the handler read it from the body (not parsed again here).
        # ``""`` is an id as ``0`` is: ``or 0`` took it for none, so the response
        # was never seen and a made-up error for request 0 ended the stream.
        rpc_id = call.rpc_id
        tries.tracker = AnswerTracker(response.headers.get("Content-Type"),
                                      0 if rpc_id is None else rpc_id)
        request[fwd.MCP_ANSWER] = tries.tracker
        capture = _Both(capture, tries.tracker) if capture is not None else tries.tracker
    elif (resumed := request.get(fwd.RESUMED_CALL)) is not None:
        # A GET resuming a call's answer: followed for where it ends, should the
        # upstream close it early again (_after_mcp_answer); its id is the one it resumed
        # from. Once the response is through, it is told (``resumed[1]``: the drain waits
        # no more for it, though a server may hold it open and a client read on),
        # and so is the call, held until then (``resumed[0]``, proxy.handler).
        tries.tracker = AnswerTracker(response.headers.get("Content-Type"),
                                      resumed[0].rpc_id)
        tries.tracker.last_event_id = request.headers.get(
            LAST_EVENT_ID_HEADER, "").encode("utf-8", "surrogateescape")
        request[fwd.RESUMED_ANSWER] = tries.tracker
        capture = _Answered(capture, tries.tracker, resumed[1], resumed[0])
    watch: AnswerTracker | TaskStatusWatch | None = None
    if response.status < 300:
        # MCP tasks (2025-11-25): a follow-up's answer (tasks/get, tasks/result,
        # tasks/cancel of a task held here) says whether the task is over; any SSE
        # answer or stream of a session may carry a notifications/tasks/status.
        poll = request.get(mcp_tasks.TASK_POLL)
        sse = is_sse(response.headers.get("Content-Type"))
        if poll is not None or sse:
            watch = _task_watch(rt, route, call, poll, response, sse)
            if watch is not None:
                capture = _Watched(capture, watch)
    return capture, watch


def _after_mcp_answer(rt: Runtime, route: Route, call: Call, request: web.BaseRequest,
                      tracker: AnswerTracker | None,
                      watch: AnswerTracker | TaskStatusWatch | None, traffic: Traffic,
                      outcome: str, total: float | None) -> None:
    """An MCP route's relayed answer (:func:`_follow_mcp_answer`'s ``tracker`` and
    ``watch``; ``outcome``, its ``sluice_requests_total`` label) as the held tasks and
    polled calls see it: a follow-up's answer seen, a task created, an answer closed early
    for polling noted for its resuming GET. Never awaits (the client may resume at once)."""
    if (isinstance(watch, AnswerTracker)
            and (poll := request.get(mcp_tasks.TASK_POLL)) is not None):
        mcp_tasks.seen_answer(rt.tasks, poll[0], poll[1], watch.finish())
    if call.task_asked and outcome == "2xx" and tracker is not None:
        _task_created(rt, route, call, tracker.finish(), total)
    if tracker is not None and tracker.outcome is None:
        # The answer ended without its response.
        if tracker.resumable:
            # Closed early for polling (2025-11-25): the client resumes it with a
            # GET carrying the last event id, which the drain then waits for
            # (proxy.handler). Noted before anything awaits: the client may send
            # that GET at once.
            rt.note_polled(route.name, call.headers.get(SESSION_HEADER),
                           tracker.last_event_id.decode("utf-8", "surrogateescape"),
                           _polled(request, call, traffic, outcome, tracker, total))
        if outcome == "upstream_timeout" and traffic == "call":
            _cancel_timed_out(rt, route, call)  # cut at its timeouts.total


def _cancel_timed_out(rt: Runtime, route: Route, call: Call) -> None:
    """A call Sluice answers ``upstream_timeout`` (its ``timeouts.total``, an attempt's
    bound, the caller's own deadline) while its server may still run it: ask the server to
    stop it (:func:`send_cancel`), as the MCP spec asks of a sender whose request timed out.
    Before 2026-07-28 closing the POST is no cancel: the tool ran on, its side effect came
    after its caller was told it timed out, and a retry ran it again beside it (a hostile
    trial). Not a call its run's cancel has asked to stop already."""
    if call.cancelled is None and cancels_upstream(call):
        send_cancel(rt, route, call, reason="the call timed out")


def _polled(request: web.BaseRequest, call: Call, traffic: Traffic, outcome: str,
            tracker: AnswerTracker, total: float | None) -> Polled:
    """What a GET resuming an answer the upstream closed early for polling follows: the
    request's own :class:`~proxy.runtime.Polled`, or, for a GET that was itself closed
    early again, the one it resumed. A call's answer that ended cleanly so is not the
    call's end (its tool runs on at the server): it is left on the call
    (:attr:`Call.polled`), and ``proxy.handler`` holds the call until its response comes on
    a resumed GET, or until ``total`` seconds (its attempt's ``timeouts.total``) from the
    attempt's sending have passed."""
    resumed = request.get(fwd.RESUMED_CALL)
    if resumed is not None:
        return resumed[0]
    if traffic != "call" or outcome != "2xx":
        return Polled(tracker.request_id)
    sent_at = call.sent_at
    polled = Polled(tracker.request_id, call.capture,
                    (time.monotonic() if sent_at is None else sent_at)
                    + (POLLED_WAIT_S if total is None else total))
    call.polled = polled
    return polled


def _task_watch(rt: Runtime, route: Route, call: Call, poll: tuple[Any, str] | None,
                response: aiohttp.ClientResponse, sse: bool
                ) -> AnswerTracker | TaskStatusWatch | None:
    """What reads an MCP answer for the ends of tasks held (:mod:`proxy.mcp_tasks`): a
    follow-up's answer (``poll``: the held task's key and the method) for its response;
    and a session's GET stream, or an SSE answer of a session with task calls held or in
    flight, for its terminal ``notifications/tasks/status`` (:class:`TaskStatusWatch`,
    which parses only the events naming that method). ``None`` when there is nothing to
    look for."""
    session = call.headers.get(SESSION_HEADER)
    # The watcher (a closure) is built only for a watch that uses it: most SSE answers of
    # an MCP route have no task to look for.
    if poll is not None:
        watch = AnswerTracker(response.headers.get("Content-Type"),
                              call.rpc_id if call.rpc_id is not None else _NO_RESPONSE_ID)
        if sse:
            watch.on_task_end = rt.tasks.watcher(route.name, session, call.tenant)
        return watch
    # A session's GET stream opens before its tasks do: read while it lasts, for them.
    if sse and ((call.method == "GET" and session) or rt.tasks.watches(route.name, session)):
        return TaskStatusWatch(rt.tasks.watcher(route.name, session, call.tenant))
    return None


#: The request id a follow-up's watch looks for without one: none (never an MCP id).
_NO_RESPONSE_ID: Any = float("nan")


def _task_created(rt: Runtime, route: Route, call: Call, found: Any,
                  total: float | None) -> None:
    """A ``tools/call`` asking to run as a task (with its place taken:
    :meth:`proxy.mcp_tasks.Tasks.reserve`) was answered: if with a ``CreateTaskResult``,
    its task is held (:meth:`proxy.mcp_tasks.Tasks.answered`) and so is the call, until the
    task is over (``proxy.handler``) or its bound passes: ``total`` (the call's
    ``timeouts.total``; :data:`POLLED_WAIT_S` without one) from its sending. The task's
    ``ttl`` bounds nothing: it is how long the server keeps the result, the client's
    choice."""
    if found is None or not found.task_created or found.task_id is None:
        return
    call.task_asked = False  # its place is the held task's now, or given back
    sent_at = call.sent_at
    deadline = ((time.monotonic() if sent_at is None else sent_at)
                + (POLLED_WAIT_S if total is None else total))
    call.task = rt.tasks.answered((route.name, call.headers.get(SESSION_HEADER) or "",
                                   call.tenant, found.task_id), deadline)


def _retried(tries: _Tries) -> bool:
    """Whether Sluice took the failure on (it retried as far as it went): its answer then
    says ``x-should-retry: false``, so the SDK adds none of its own. A failure repeated
    not at all, as unsafe to repeat or as no failure ``retry.on`` names (an answer cut
    before it was sent), leaves the caller's own rules standing (module docstring)."""
    return bool(tries.stop) and tries.stop != "unsafe_to_retry"


async def _verdict(tries: _Tries, tracker: AnswerTracker | None, meter: Any,
                   cut: bool = False) -> None:
    """Tell the breakers waiting for the answer (:class:`_Waiting`) what it came to.

    A stream's: a failure when the upstream cut it or was too slow with it (``cut``: the
    relay's ``upstream_error`` or ``upstream_timeout``), as a connection lost before the
    status line is; else what its error event, if any, says (``meter``'s
    :attr:`~policies.usage.Meter.stream_error`, :func:`policies.breaker.classify_stream`).
    A tool's: a failure when the answer held no response (``tracker`` ``None``: it was
    cut) or a tool failure (:attr:`policies.mcp.Outcome.tool_failure`), else a success;
    nothing when the server closed it early for polling (no response, events with ids)."""
    waiting = tries.pending
    if waiting is None:
        return
    tries.pending = None
    if not waiting.tool:
        await _record_each(waiting.tickets, brk.FAILURE if cut else _read_verdict(meter))
        return
    [(breaker, ticket)] = waiting.tickets
    found = tracker.finish() if tracker is not None else None
    if found is None and tracker is not None and tracker.resumable:
        # Closed early for polling (2025-11-25): the response comes on the GET that resumes
        # it, which no breaker hears; this answer says nothing of the tool yet.
        breaker.release(ticket)
        return
    failed = found is None or found.tool_failure
    await breaker.record(ticket, brk.FAILURE if failed else brk.SUCCESS)


class _Both:
    """Feeds a relayed answer to the idempotency capture and to the MCP answer's tracker
    (the relay takes one capture)."""

    __slots__ = ("capture", "tracker")

    def __init__(self, capture: Any, tracker: AnswerTracker) -> None:
        self.capture = capture
        self.tracker = tracker

    def begin(self, status: int, reason: str | None, headers: Any) -> None:
        self.capture.begin(status, reason, headers)

    def feed(self, chunk: bytes) -> None:
        self.capture.feed(chunk)
        self.tracker.feed(chunk)


class _Watched:
    """Feeds a relayed answer to ``capture`` (if any) and to a task watch
    (:func:`_task_watch`)."""

    __slots__ = ("capture", "watch")

    def __init__(self, capture: Any, watch: AnswerTracker | TaskStatusWatch) -> None:
        self.capture = capture
        self.watch = watch

    def begin(self, status: int, reason: str | None, headers: Any) -> None:
        if self.capture is not None:
            self.capture.begin(status, reason, headers)

    def feed(self, chunk: bytes) -> None:
        if self.capture is not None:
            self.capture.feed(chunk)
        self.watch.feed(chunk)


class _Answered:
    """Feeds a resumed answer to ``capture`` (if any), to its call's tracker and to the
    call it resumes (``polled``: its key's capture, up to the response), and once the call's
    response has come through calls ``answered`` and tells ``polled``, once."""

    __slots__ = ("answered", "capture", "polled", "tracker")

    def __init__(self, capture: Any, tracker: AnswerTracker,
                 answered: Callable[[], None], polled: Polled) -> None:
        self.capture = capture
        self.tracker = tracker
        self.answered: Callable[[], None] | None = answered
        self.polled: Polled | None = polled

    def begin(self, status: int, reason: str | None, headers: Any) -> None:
        if self.capture is not None:
            self.capture.begin(status, reason, headers)
        if status >= 300 or not self.tracker.sse:  # an error, not the call's answer resumed
            self.polled = None

    def feed(self, chunk: bytes) -> None:
        if self.capture is not None:
            self.capture.feed(chunk)
        polled = self.polled
        if polled is not None:
            polled.feed(chunk)
        if self.tracker.feed(chunk) is not None and self.answered is not None:
            answered, self.answered, self.polled = self.answered, None, None
            answered()
            if polled is not None:
                polled.respond()


def _read_verdict(meter: Any) -> int:
    """What a 2xx answer read (to its end, or until its caller left) tells its breakers: the
    error event its stream may have ended with, if a meter read one
    (:func:`policies.breaker.classify_stream`); an answer no meter reads is a success."""
    return brk.classify_stream(None if meter is None else meter.stream_error)


def _stamp_time_left(deadline_header: str, call: Call, headers: CIMultiDict[str]) -> None:
    """Tell the upstream what is left of the caller's deadline now, in seconds, under
    ``deadline_header`` (``timeouts.deadline_header``), so it can stop work nobody awaits:
    stamped again on each attempt, or a retry promised it the time the first attempts and
    back-offs had spent (a hostile trial: three attempts over 2.4 s each said 5 s). A value
    Sluice took for no deadline ("0", "inf") does not reach it as one. Called before each
    attempt (:func:`_attempts`)."""
    left = call.time_left()
    if left is not None:
        headers[deadline_header] = f"{max(left, 0.001):.3f}"
    else:
        headers.popall(deadline_header, None)


async def _attempts(rt: Runtime, route: Route, call: Call, url: URL,
                    headers: CIMultiDict[str], tries: _Tries, retry: RetryPolicy | None,
                    breakers: tuple[brk.Breaker, ...], tool_breaker: brk.Breaker | None,
                    declared_idempotent: bool, timeout: aiohttp.ClientTimeout) -> None:
    """The retry loop: attempts until one is final, or retrying ends (``tries.stop``).

    ``retry`` and ``breakers`` are the call's plan's (none where they do not apply);
    ``tool_breaker`` is the one of them that hears MCP tool failures; ``declared_idempotent``:
    the route or the operation says its calls may be repeated; ``timeout`` bounds each attempt.

    Raises:
        Rejected: the breaker refused the first attempt, or the caller's timeout passed
            before it.
    """
    client_retry = retry is not None and call.client_retry
    deadline = caller_deadline = None
    if call.timeout or (retry is not None and retry.deadline):
        now = time.monotonic()
        if retry is not None and retry.deadline:
            deadline = now + retry.deadline
        if call.timeout:  # the caller's clock started when it sent the call, queue included
            caller_deadline = call.received_at + call.timeout
    # Most routes bound no attempt (no per_try_timeout, no deadline, no caller timeout).
    bounded = (caller_deadline is not None or deadline is not None
               or (retry is not None and retry.per_try_timeout is not None))
    holding = False  # a retry-budget slot is held for the attempt in flight
    if client_retry:
        retry.budget.hold()
        holding = True
    try:
        number = 0
        while True:
            number += 1
            limit, callers_limit = (_attempt_limit(retry, deadline, caller_deadline)
                                    if bounded else (None, False))
            if limit is not None and limit <= 0:
                if number == 1:  # spent queueing: sending now would only waste the upstream
                    raise Rejected(Reason.DEADLINE_UNREACHABLE, None,
                                   "the call's deadline passed before it could be sent")
                tries.stop = "deadline"
                tries.callers = callers_limit
                return
            if route.deadline_header is not None:
                _stamp_time_left(route.deadline_header, call, headers)
            tries.callers = False  # until this attempt's caller's deadline cuts it
            try:
                status, hint, sent = await _attempt(rt, route, call, url, headers, tries,
                                                    limit, callers_limit, retry is not None,
                                                    breakers, tool_breaker, timeout)
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
            if call.cancelled is not None:
                return  # its run was cancelled (its caller answered): no attempt after that
            # A failure this route retries on: retry it, or say why not. A key the
            # idempotency block invented makes a retry safe only if the upstream honours
            # keys; the caller's own key says the caller relies on it.
            wait = 0.0
            # The caller's key counts only as it goes upstream: one a route or the caller's
            # own ``Connection`` drops (RFC 9110 §7.6.1) protects nothing there (a POST ran
            # twice with no key on either attempt, a hostile trial).
            # A valid one, too: an empty key made a POST retried three times (a trial).
            keyed = names_a_key(headers.getall(IDEMPOTENCY_HEADER, []))
            callers_key = keyed and IDEMPOTENCY_HEADER in call.headers
            upstream_dedups = retry.honours_idempotency_key and keyed
            if not retry_is_safe(call.method, sent, callers_key=callers_key,
                                 upstream_dedups=upstream_dedups,
                                 declared_idempotent=declared_idempotent):
                tries.stop = "unsafe_to_retry"  # before attempts: an SDK's retry of it too
            elif client_retry:  # the SDK owns this one's retries: one attempt here
                tries.stop = "sdk_retry"
            elif number >= retry.attempts:
                tries.stop = "attempts_exhausted"
            else:
                wait = retry.wait(number - 1, hint)
                if wait is None:
                    tries.stop = "retry_after_too_long"
                elif _too_late(resume_at := time.monotonic() + wait, deadline, caller_deadline):
                    tries.stop = "deadline"
                    tries.callers = not _too_late(resume_at, deadline, None)
                elif rt.cut_before(time.monotonic() + wait):
                    tries.stop = "draining"  # the drain would cut the retry as it began
                elif any(breaker.blocked_for() > wait for breaker in breakers):
                    tries.stop = "circuit_open"
                elif (call.answer_status == SENT_UNANSWERED and call.meter is not None
                      and (refused := await _hold_retry(call)) is not None):
                    tries.stop = refused.reason.code  # budget_exhausted: no room for it
                    failed = tries.error
                    if failed is not None:  # said in the answer, not in the dead letter alone
                        why = ("the budget has no room for another attempt"
                               if refused.reason is Reason.BUDGET_EXHAUSTED
                               else "the budget could not hold another attempt")
                        tries.error = Rejected(
                            failed.reason, failed.retry_after,
                            f"{failed.detail}; not retried: {why} ({refused.reason.code})",
                            failed.policy, failed.retry)
                elif not retry.budget.try_acquire(route.inflight + _queued(route)):
                    tries.stop = "retry_budget"
                    route.metrics.retry_overflow.inc()
            if tries.stop:
                return
            holding = True
            route.metrics.retries.inc()
            rt.events.emit("retried", call.request_id, route.name, call.tenant, call.run,
                           call.idempotency_key, attempt=number + 1,
                           after=status or tries.kind, wait_s=round(wait, 3),
                           **call.event_names())
            call.attempt_over(time.monotonic())
            # The failed answer stays open through the back-off (its connection held, one
            # per retry in flight, which the retry budget bounds): a drain that ends the
            # back-off relays it, the caller's answer as when retries run out.
            if not await _back_off(rt, call, wait):
                tries.stop = "draining"
                return
            tries.drop_response()
    finally:
        if holding:
            retry.budget.release()


async def _back_off(rt: Runtime, call: Call, wait: float) -> bool:
    """Wait ``wait`` seconds before the next attempt; returns ``False``, at once, when the
    drain would cut that attempt before it starts (its deadline falls within the wait, or a
    second stop signal brings it into it: :meth:`Runtime.drain_until`).

    A call waiting here is at no upstream: cut by the drain, it ended with no answer and its
    work not dead-lettered (a hostile trial: the caller held the whole ``drain_timeout``,
    then dropped). It stops retrying instead, answered and dead-lettered as when retries
    run out, reason ``draining``. A back-off that ends before the drain's deadline is
    waited out, and its attempt made."""
    resume_at = time.monotonic() + wait
    task = asyncio.current_task()
    if task is not None:  # for the drain's cut to wait for its answer
        rt.backing_off[call] = task
    try:
        while not rt.cut_before(resume_at):
            left = resume_at - time.monotonic()
            if left <= 0:
                return True
            await asyncio.wait((rt.drain_moved(),), timeout=left)
        return False
    finally:
        rt.backing_off.pop(call, None)


async def _hold_retry(call: Call) -> Rejected | None:
    """Hold on the budgets what the next attempt may cost, after one that may have been
    billed in full (:meth:`policies.accounting.Charge.hold_retry`); the refusal if it does
    not fit, which ends retrying."""
    try:
        await call.meter.hold_retry()
    except Rejected as refused:
        return refused
    return None


async def _attempt(rt: Runtime, route: Route, call: Call, url: URL,
                   headers: CIMultiDict[str], tries: _Tries, limit: float | None,
                   callers_limit: bool, logged: bool, breakers: tuple[brk.Breaker, ...],
                   tool_breaker: brk.Breaker | None, timeout: aiohttp.ClientTimeout,
                   ) -> tuple[int | None, float | None, bool]:
    """The breaker step: one attempt, admitted by every one of ``breakers`` (the route's,
    the operation's) and reported to each; ``logged``: the attempt goes in ``tries.log`` (for
    a dead letter). A 2xx answer's verdict for ``tool_breaker`` waits for the answer to be
    read (``tries.pending``, :func:`_verdict`).

    Returns:
        ``(status, retry_after, sent)``: the upstream's status (``None`` when it did not
        answer), the wait it asked for, and whether the request may have reached it.

    Raises:
        Rejected: ``circuit_open`` from the breaker; nothing was sent.
        asyncio.CancelledError: the caller left; the breaker hears nothing.
    """
    tickets: list[tuple[brk.Breaker, brk.Pass]] = []
    try:
        for breaker in breakers:
            tickets.append((breaker, await breaker.attempt()))
    except BaseException:  # one refused (or the caller left): the others' tickets go back
        for breaker, ticket in tickets:
            breaker.release(ticket)
        raise
    started = time.monotonic()
    reached_before = call.reached
    if call.answer_status == SENT_UNANSWERED:  # the one before may have been billed in full
        call.unanswered += 1
    try:
        call.reached = True  # from here it may leave, whatever ends the attempt
        call.answer_status = SENT_UNANSWERED
        route.metrics.upstream_attempts.inc()
        call.attempts += 1
        call.attempt_sent(started)
        if limit is None:
            # Most routes set no per-try bound or deadline: a timeout scope would cost a
            # timer handle, two lookups of the running loop and two getpid syscalls
            # (Python 3.11's C get_running_loop checks the pid) per attempt, for nothing.
            response = await fwd.send(rt.session, call.method, url, headers, call.body,
                                      timeout)
        else:
            if timeout.connect is None or limit < timeout.connect:
                # aiohttp bounds connecting within the attempt's limit, and this scope comes
                # just after it: an attempt cut while its connection was still being made
                # (an upstream's full accept queue drops the SYN) then reads as never sent,
                # charged nothing and safe to retry, not as sent and unanswered (a review).
                timeout = client_timeout(timeout.total, limit, timeout.sock_read)
            async with asyncio.timeout(limit + CONNECT_FIRST_S):
                response = await fwd.send(rt.session, call.method, url, headers, call.body,
                                          timeout)
        tries.answered(response)  # first: whatever happens next, the response gets closed
        call.answered_at = time.monotonic()
        status = call.answer_status = response.status
        if status < 300:  # a success (brk.classify), with no Retry-After to read
            hint, verdict = None, brk.SUCCESS
        else:
            # Read here, under the except below that gives the tickets back if reading fails.
            hint = upstream_retry_after(response.headers) if status >= 400 else None
            verdict = brk.classify(status, response.headers)
    except Rejected as exc:
        tries.error = exc
        sent = fwd.left(exc)
        # connection_lost: the request may have reached the upstream (a reset or close after
        # it was written), which an operator deciding on a replay must not read as "never
        # left"; `retry.on: [connect_error]` covers both, as before.
        tries.kind = ("timeout" if exc.reason is Reason.UPSTREAM_TIMEOUT
                      else "connection_lost" if sent else "connect_error")
        neutral = False
    except TimeoutError:
        tries.error = Rejected(Reason.UPSTREAM_TIMEOUT, None, (
            f"no response headers within {limit:.3g}s, what was left of the caller's own "
            "timeout" if callers_limit else f"no response headers within {limit:.3g}s"))
        tries.kind = "timeout"
        sent = True
        # Cut short by the caller's own deadline: not the upstream's fault.
        neutral = tries.callers = callers_limit
    except BaseException:
        for breaker, ticket in tickets:
            breaker.release(ticket)
        raise
    else:
        if logged and status >= 400:  # an answer below 400 is never retried nor dead-lettered
            tries.log.append((started, status, None, time.monotonic() - started))
        if status < 300:
            if tool_breaker is not None:
                # A tool failure shows in the answer only: its breaker hears once it is read.
                for pair in tickets:
                    if pair[0] is tool_breaker:
                        tries.pending = _Waiting([pair], True)
                tickets = [pair for pair in tickets if pair[0] is not tool_breaker]
            else:
                # Judged once read: a body cut after the status line is a failure, as a
                # connection lost before it is (a hostile trial: 502 after 502, the breaker
                # closed), and an LLM stream may yet end in an error event (the upstream
                # overloaded mid-answer). A 2xx is never retried. Not a half-open probe's
                # breaker: it is judged by the status line, or one slow stream held the
                # whole route refused (a hostile review: 10 minutes); it hears the
                # answer's failure too (_record_probes).
                waiting, probes = tickets, None
                for pair in tickets:  # most often one ticket, no probe: nothing to split
                    if pair[1].ticket.probe is not None:
                        waiting = [pair for pair in tickets if pair[1].ticket.probe is None]
                        probes = [pair for pair in tickets if pair[1].ticket.probe is not None]
                        break
                if waiting:
                    tries.pending = _Waiting(waiting, False)
                if probes:
                    await _record_probes(tries, probes, status)
                return status, hint, True
        await _record_each(tickets, verdict, status, hint)
        return status, hint, True
    call.reached = reached_before or sent
    if sent:
        call.attempt_over(time.monotonic())
    else:  # no upstream time, no cost_per_call: it never left
        call.attempt_unsent()
        call.answer_status = 0
        call.unsent += 1
    tries.drop_response()
    if neutral:
        for breaker, ticket in tickets:
            breaker.release(ticket)
    else:
        await _record_each(tickets, brk.FAILURE)
    if logged:
        tries.log.append((started, None, tries.kind, time.monotonic() - started))
    return None, None, sent


async def _record_each(tickets: list[tuple[brk.Breaker, brk.Pass]], outcome: int,
                       status: int | None = None, hint: float | None = None) -> None:
    """Report ``outcome`` to the breaker of each ticket. A record runs to its end even when
    the caller leaves during it (``Breaker.record``), but the cancellation then surfaces at
    its ``await``: the tickets after it are handed to ``record_soon`` so that none is left
    unreported (a probe's lease held until it lapses)."""
    for at, (breaker, ticket) in enumerate(tickets):
        try:
            await breaker.record(ticket, outcome, status, hint)
        except BaseException:
            for later, left in tickets[at + 1:]:
                later.record_soon(left, outcome)
            raise


async def _record_probes(tries: _Tries, probes: list[tuple[brk.Breaker, brk.Pass]],
                         status: int) -> None:
    """Report a 2xx stream's status line, a success, to the breakers it is the half-open
    probe of (``probes``; none, most often), and leave the passes each returns for the
    stream's end with the others waiting for it (``tries.pending``): a stream that fails
    then opens that breaker again, unless it has moved on since (``Breaker.record``). As
    :func:`_record_each`, the probes after a cancelled record go to ``record_soon``."""
    for at, (breaker, ticket) in enumerate(probes):
        try:
            after = await breaker.record(ticket, brk.SUCCESS, status)
        except BaseException:
            for later, left in probes[at + 1:]:
                later.record_soon(left, brk.SUCCESS)
            raise
        if after is not None:
            if tries.pending is None:
                tries.pending = _Waiting([], False)
            tries.pending.tickets.append((breaker, after))


def _attempt_records(log: list[tuple[float, int | None, str | None, float]]) -> list[Attempt]:
    """The attempts of ``log`` for a dead letter, each started at a Unix time (the log
    keeps the monotonic clock's, read once per attempt)."""
    offset = time.time() - time.monotonic()
    return [Attempt(started + offset, status, error, duration)
            for started, status, error, duration in log]


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
    written, or not within ``DEAD_LETTER_WAIT_S`` (the caller still gets its answer; the
    write goes on, its body counted in ``server.max_buffered_bytes`` until it ends)."""
    store = rt.dead_letters
    if store is None:
        return None
    if route.deadline_header is not None and route.deadline_header in headers:
        # The time its caller had left: a replay has no caller, and would tell the upstream
        # it has a moment of a deadline long gone.
        headers = headers.copy()
        headers.popall(route.deadline_header)
    kept, removed = redact(headers.items())
    path, removed_query = redact_path(call.path[len(route.prefix) - 1:])
    # The key the call was handled under, as it went upstream (the caller's as sent, or
    # Sluice's own), or as the caller sent it when the route keeps it from the upstream
    # (request_headers_to_remove): its replay is checked and held under it all the same.
    callers = call.headers.get(IDEMPOTENCY_HEADER)
    key = headers.get(IDEMPOTENCY_HEADER)
    if key is None and call.idempotency_key is not None:
        key = callers
    letter = DeadLetter(
        route=route.name, tenant=call.tenant, run=call.run, idempotency_key=key,
        key_origin=key_origin(key, callers is not None) if key is not None else None,
        request_id=call.request_id, method=call.method, path=path, headers=kept,
        redacted=removed + removed_query, body=call.body, body_size=len(call.body),
        attempts=_attempt_records(tries.log), reason=tries.stop,
    )
    # The write runs to its end whatever the caller does; it is counted, logged as an event
    # or as a failure, when it ends (before the answer, when that waited for it).
    write = asyncio.ensure_future(store.add(letter))
    write.add_done_callback(functools.partial(_dead_lettered, rt, route, call, tries.stop,
                                              len(tries.log)))
    try:
        async with asyncio.timeout(DEAD_LETTER_WAIT_S):
            return await asyncio.shield(write)
    except TimeoutError:
        log.warning("dead-letter store of route %s has not taken a letter within %.0fs "
                    "(locked by another process?): answered without its id; it is written "
                    "when the store takes it", route.name, DEAD_LETTER_WAIT_S, extra=PER_CALL)
        return None
    except Exception:  # logged by _dead_lettered: the caller still gets its answer
        return None
    finally:
        if not write.done():  # its body outlives the call: still counted as held
            held = min(len(letter.body), store.max_body_bytes)
            rt.buffered_bytes += held
            write.add_done_callback(functools.partial(_unhold, rt, held))


def _dead_lettered(rt: Runtime, route: Route, call: Call, reason: str, attempts: int,
                   write: asyncio.Future[int]) -> None:
    """A dead letter's write ended: its ``dead_lettered`` event and count, or its failure
    (a ``dead_letter_lost`` event, counted and logged)."""
    error = None if write.cancelled() else write.exception()
    if write.cancelled() or error is not None:
        route.metrics.dead_letter_failures.inc()
        rt.events.emit("dead_letter_lost", call.request_id, route.name, call.tenant, call.run,
                       call.idempotency_key, reason=reason, attempts=attempts,
                       error=str(error or "cancelled"), **call.event_names())
    if isinstance(error, StateUnavailable):
        # Redis away: expected, and every failing call would log it with a traceback (a
        # hostile trial saw six in 5 s of one freeze). One line a route every few seconds.
        log.error("dead-letter write failed on route %s: the state backend did not answer "
                  "(%s)", route.name, error.cause, extra=PER_CALL)
        return
    if isinstance(error, LetterNotKept):  # a locked or slow file, a stop: no traceback
        # Its message says why (the file locked, slow, or the server stopping): this line
        # said "for the locked file" whatever it was.
        log.error("dead-letter write failed on route %s: not kept: %s",
                  route.name, error, extra=PER_CALL)
        return
    if write.cancelled() or error is not None:
        log.error("dead-letter write failed on route %s (request %s)", route.name,
                  call.request_id, exc_info=error)
        return
    route.metrics.dead_letters.inc()
    rt.events.emit("dead_lettered", call.request_id, route.name, call.tenant, call.run,
                   call.idempotency_key, dead_letter_id=write.result(), reason=reason,
                   attempts=attempts, **call.event_names())


def _unhold(rt: Runtime, held: int, write: asyncio.Future[int]) -> None:
    rt.buffered_bytes -= held


def fetch_held_answer(rt: Runtime, route: Route, call: Call) -> None:
    """A client's cancel of ``call``, held for its polled answer (``proxy.handler``), was
    held too: the tool runs on so that the client's retry gets its answer from the call's
    key. That answer comes only on a GET resuming it, which a client that cancelled the
    call never sends: held to its bound (600 s without ``timeouts.total``), the call kept
    its key, its retries were refused ``idempotency_conflict`` and the tool's result was
    lost (a review). So Sluice resumes it itself (:func:`_fetch_held`), from the event id
    the call was noted under; a client's own GET from it is then a plain stream. Nothing
    for a call not held so."""
    session = call.headers.get(SESSION_HEADER) or ""
    for key, polled in rt.polled.items():
        if (key[0] == route.name and key[1] == session and polled.waiter is not None
                and polled.rpc_id == call.rpc_id and type(polled.rpc_id) is type(call.rpc_id)):
            del rt.polled[key]
            waiter = polled.waiter
            task = asyncio.create_task(_fetch_held(rt, route, call, polled, key[2]))
            # Ended with the hold: its response, its bound, its run's cancel, the drain.
            waiter.add_done_callback(functools.partial(_cancel, task))
            return


def _cancel(task: asyncio.Task[None], _done: asyncio.Future[None]) -> None:
    task.cancel()


async def _fetch_held(rt: Runtime, route: Route, call: Call, polled: Polled,
                      event_id: str) -> None:
    """Resume ``polled``'s answer from ``event_id`` with a GET of Sluice's own (the call's
    headers, as its client would resume it) and feed it to the call's key up to the
    call's response (:meth:`Polled.respond`, which ends the hold)."""
    headers = fwd.upstream_headers_of(call.headers, route.request_drop)
    if route.own_credentials:
        headers.popall(hdrs.AUTHORIZATION, None)
    for name in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH, IDEMPOTENCY_HEADER):
        headers.popall(name, None)
    headers[hdrs.ACCEPT] = "text/event-stream"
    headers[LAST_EVENT_ID_HEADER] = event_id
    url = route.url(call.path)
    timeouts = route.config.timeouts
    try:
        async with rt.session.get(url, headers=headers, timeout=client_timeout(
                None, timeouts.connect, sock_read=timeouts.idle)) as response:
            if response.status >= 300 or not is_sse(response.headers.get("Content-Type")):
                log.info("route %s: call %s's held answer was not resumed (%d)", route.name,
                         call.request_id, response.status, extra=PER_CALL)
                return
            tracker = AnswerTracker(response.headers.get("Content-Type"), polled.rpc_id)
            async for chunk in response.content.iter_any():
                polled.feed(chunk)
                if tracker.feed(chunk) is not None:
                    polled.respond()
                    return
        polled.capture = None  # ended without the response: nothing is kept for the key
    except (aiohttp.ClientError, TimeoutError) as exc:
        polled.capture = None
        log.info("route %s: call %s's held answer was not resumed: %r", route.name,
                 call.request_id, exc, extra=PER_CALL)
    except Exception:  # nobody awaits this task: logged here, and the hold ends at its bound
        polled.capture = None
        log.exception("route %s: call %s's held answer was not resumed", route.name,
                      call.request_id)


#: Headers of a call that its cancel does not carry: the call's body's, its key's, and the
#: 2026-07-28 routing headers (its cancel is sent only at earlier revisions, which have none).
_NOT_ON_CANCEL = (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH, IDEMPOTENCY_HEADER, LAST_EVENT_ID_HEADER,
                  "Mcp-Method", "Mcp-Name")


def cancels_upstream(call: Call) -> bool:
    """Whether Sluice asks the MCP server to stop ``call`` with a ``notifications/cancelled``
    of its own when it ends the call before its response (a run's cancel, the drain's cut):
    a request (it has an id) whose attempt is at the server now (sent with no answer yet, or
    a success being relayed: not a failed attempt waiting out a back-off, which holds
    nothing there), made at a revision whose cancellation is that notification
    (:func:`policies.mcp.cancels_by_closing`: at 2026-07-28, closing the call's stream is
    its cancel, and Sluice closes it)."""
    status = call.answer_status
    return (call.rpc_id is not None and (status == SENT_UNANSWERED or 200 <= status < 300)
            and not cancels_by_closing(call.headers.get(VERSION_HEADER)))


#: How long a call finished after its run's cancel waits for its server's answer once the
#: server took Sluice's ``notifications/cancelled``, seconds: the 2025 revisions say a
#: server SHOULD NOT answer a request it cancelled (the TypeScript SDK's server drops the
#: result and leaves the stream open; the Python SDK's answers "Request cancelled"), so no
#: answer by then is read as the tool stopped: its stream is closed and its key freed.
CANCEL_ANSWER_WAIT_S = 2.0


#: How many of Sluice's own cancels may be on their way to the servers at once (each a task
#: and a connection for up to ``timeouts.connect`` + :data:`CANCEL_ANSWER_WAIT_S`): past it,
#: a call Sluice ends is not cancelled at its server (logged, and its ``cancel_sent`` event
#: says status 0, ``not_sent: too_many``), rather than a storm of timeouts making a task each.
MAX_UPSTREAM_CANCELS = 256


def send_cancel(rt: Runtime, route: Route, call: Call,
                finishing: asyncio.Task[Any] | None = None, reason: str | None = None,
                task_id: str | None = None) -> asyncio.Task[None] | None:
    """Send the MCP server ``call``'s cancellation (:func:`_send_cancel`) in a task of its
    own, which the drain waits for (:attr:`Runtime.upstream_cancels`). ``finishing``: the
    task finishing the call's exchange (a run's cancel), closed if the server, having taken
    the cancel, has not answered the call within :data:`CANCEL_ANSWER_WAIT_S`; the answer,
    if any, comes on the call's own stream (the notification's is 202 and nothing else).
    ``reason``: the notification's ``params.reason`` after ``Sluice: `` (default: the run's
    cancel, or the drain). ``task_id``: the call made that MCP task (2025-11-25), and its
    hold ends: the server is sent the task's ``tasks/cancel`` instead (a request of Sluice's
    own, whose answer is read and dropped). Returns the task sending it (``None``: not
    sent). Never raises (it runs where Sluice ends a call): at most
    :data:`MAX_UPSTREAM_CANCELS` are under way at once; past it, nothing is sent."""
    try:
        if len(rt.upstream_cancels) >= MAX_UPSTREAM_CANCELS:
            log.warning("route %s: the cancel of call %s is not sent: %d cancels are under "
                        "way already", route.name, call.request_id, len(rt.upstream_cancels),
                        extra=PER_CALL)
            rt.events.emit("cancel_sent", call.request_id, route.name, call.tenant, call.run,
                           call.idempotency_key, status=0, not_sent="too_many",
                           **call.event_names())
            return None
        task = asyncio.create_task(_send_cancel(rt, route, call, finishing, reason, task_id))
        rt.upstream_cancels.add(task)
        task.add_done_callback(rt.upstream_cancels.discard)
        return task
    except Exception:
        log.exception("route %s: the cancel of call %s was not sent", route.name,
                      call.request_id)
        return None


async def _send_cancel(rt: Runtime, route: Route, call: Call,
                       finishing: asyncio.Task[Any] | None, reason: str | None = None,
                       task_id: str | None = None) -> None:
    """POST a ``notifications/cancelled`` naming ``call``'s JSON-RPC id (as the server got
    it) to the call's endpoint, with the headers the call went upstream with (its session,
    protocol version and credentials; ``Accept`` both JSON and SSE, as the transport
    requires of every POST), within the route's ``timeouts.connect`` and
    :data:`CANCEL_ANSWER_WAIT_S`, and log a ``cancel_sent`` event with the server's status
    (0 when it gave none); then, if the server took it, close ``finishing`` once it has not
    answered the call within :data:`CANCEL_ANSWER_WAIT_S`."""
    status = 0
    what = f"route {route.name}: the cancel of call {call.request_id}"
    try:
        headers = fwd.upstream_headers_of(call.headers, route.request_drop)
        if route.own_credentials:
            headers.popall(hdrs.AUTHORIZATION, None)
        for name in _NOT_ON_CANCEL:
            headers.popall(name, None)
        if route.deadline_header is not None:  # a notification has no deadline
            headers.popall(route.deadline_header, None)
        headers[hdrs.CONTENT_TYPE] = "application/json"
        headers[hdrs.ACCEPT] = "application/json, text/event-stream"
        if task_id is not None:
            body = task_cancel(f"sluice-{call.request_id}", task_id)
        else:
            assert call.rpc_id is not None
            body = cancel_notification(
                call.rpc_id, f"Sluice: {reason or call.cancelled or 'draining'}")
        timeouts = route.config.timeouts
        assert rt.session is not None
        # A notification's answer is an empty 202: one that takes longer than a call's
        # connect and this wait is not coming.
        status = await send_aside(
            rt.session, "POST", route.url(call.path),
            headers, body, client_timeout(timeouts.connect + CANCEL_ANSWER_WAIT_S,
                                          timeouts.connect), what)
    except Exception:  # building it failed; nobody awaits this task
        log.exception("%s was not sent", what)
    finally:
        named = {} if task_id is None else {"task_id": task_id}
        rt.events.emit("cancel_sent", call.request_id, route.name, call.tenant, call.run,
                       call.idempotency_key, status=status, **named, **call.event_names())
    if finishing is not None and 200 <= status < 300:  # the server took it
        # Awaited in this task, so the drain's wait for the cancels covers it too.
        await asyncio.wait((finishing,), timeout=CANCEL_ANSWER_WAIT_S)
        finishing.cancel()  # no answer in time: taken as stopped (done by then: nothing)
