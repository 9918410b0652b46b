"""The request path, top to bottom.

match route -> identify caller -> refuse what cannot be forwarded as sent (dot-segments, a
path upstreams read as different metered endpoints, a WebSocket upgrade) -> read body ->
admit: the route's policies in order (``Route.policies``: idempotency key, where a replay or
a wait for an in-flight twin costs no quota and no slot; circuit breaker; rate; token
accounting: token rate and budget reservation; the concurrency slot and its queue) ->
forward (attempts with the breaker and retries, metering usage: ``proxy.attempts``) ->
release and record.

On ``mcp`` routes the POST body is read as MCP first (an unreadable one, or request headers
that disagree with it, get 400 ``bad_request``), and only ``call`` traffic (``tools/call`` and
the like) goes through the policies; ``control`` traffic (initialize, notifications, ping,
responses, ``*/list``, DELETE) and the ``stream`` (the session's GET stream) take nothing: no
slot, rate unit, queue or budget, because refusing or queueing them breaks the session for
every call (issue 11). They are still identified, forwarded and logged.

Everything the policies take for a call is held by one :class:`policies.pipeline.Admission`
and given back in one place (:func:`_settle`, from the handler's ``finally``), whatever ends
the call: a later policy's refusal, the upstream's answer, an upstream error or timeout, the
caller's disconnect (the handler is cancelled at whatever ``await`` it was on, which also
closes the upstream request) or an exception from anywhere. It never awaits, so a
cancellation cannot interrupt it, and no branch releases anything by hand.

One exception to "the caller's disconnect closes the upstream request": an MCP call whose
idempotency keeps answers (``dedup``) is forwarded in a task of its own, and when its caller
leaves after the call may have reached the upstream and before its response came, that task
finishes the exchange without the caller (an MCP server runs the tool to its end anyway), so
that its answer is kept for its key and its retry does not run the tool again (not when the
server's tool waits on that caller's answer to a request of its own, an elicitation: it could
never end). The call then holds everything until that task ends, and the task's end, not the
handler, settles it (:func:`_leave`, :func:`_hand_over`): exactly one of the two does, once.
For the same reason, a client's ``notifications/cancelled`` naming such a call of its session
in flight is answered 202 here and not forwarded (:func:`_call_to_hold`): the tool runs on, and
its answer is kept for the retry. A cancel naming a call of its session still waiting in
admission (which the server has not seen) ends that call here instead, on any route
(:func:`_waiting_call`). A run's cancel of such a call in flight answers its caller at once,
and Sluice sends the server a ``notifications/cancelled`` of its own; the task then finishes
the exchange to the server's answer, as for a caller that left (:func:`_leave`,
:func:`_cancel_finishing`), so that the key is held until the tool has stopped or its
result is kept."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from aiohttp import hdrs, web
from multidict import istr

from policies import mcp
from policies.bodies import LARGE_BODY_BYTES
from policies.concurrency import (
    DEFAULT_PRIORITY,
    PRIORITIES,
    ConcurrencyLimiter,
    OperationSlot,
)
from policies.idempotency import Replay, replay_response
from policies.logs import PER_CALL
from policies.operations import Plan
from policies.paths import has_dot_segment
from policies.pipeline import (
    ABANDONED,
    CLIENT_CANCELLED,
    DRAIN_CUT,
    REFUSED,
    Admission,
    Call,
    Outcome,
    Policy,
)
from policies.reasons import REASON_HEADER, Reason, Rejected
from policies.retry import is_client_retry
from policies.runs import FanoutWidth
from policies.usage import endpoints_differ
from proxy import attempts, session_end
from proxy.edge import BODY_CUT, BodyHold, asks_websocket, sent_and_closed
from proxy.forward import (
    RELAYED_STREAM,
    RESUMED_ANSWER,
    RESUMED_CALL,
    Finish,
    answered,
    awaits_client,
    cancelled_at_server,
    delivered,
    end_answer,
    end_mcp_answer,
    judged_stream,
    kept_for_retry,
)
from proxy.identity import IdentityRejected, identify
from proxy.mcp_tasks import CANCEL_BEFORE_DELETE_S, TASK_POLL, HeldTask
from proxy.metrics import MAX_OPERATION_LABEL_CHARS
from proxy.rejections import refuse, refuse_at_edge, render
from proxy.routes import Route
from proxy.runtime import Polled, Runtime

log = logging.getLogger("sluice")

#: How long a draining replica suggests callers wait (another replica can take them), seconds.
DRAINING_RETRY_AFTER_S = 1.0
#: A caller's timeout as Sluice reads it: seconds in plain decimals below 1e9 (~31 years;
#: the SDKs send "600" or "600.0"); anything else is no deadline, as is 0.
_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")
#: The Stainless SDKs' own timeout headers (istr: looked up without lower-casing each time).
_STAINLESS_TIMEOUT = istr("x-stainless-timeout")
_STAINLESS_READ_TIMEOUT = istr("x-stainless-read-timeout")


def _caller_timeout(request: web.BaseRequest, header: str) -> tuple[float | None, bool]:
    """The caller's own timeout in seconds, and whether it is a read timeout: ``header``
    (``identity.timeout_header``, ``X-Request-Timeout``), a deadline for the whole call, else
    the Stainless SDKs' headers, httpx's read timeout, if sent; ``None`` for a value that is
    not a plain decimal above 0 (see :data:`_SECONDS`)."""
    get = request.headers.get
    raw, reads = get(header), False
    if raw is None:
        raw, reads = get(_STAINLESS_TIMEOUT), True
        # The anthropic SDK (2.17) sends "NOT_GIVEN" there when the timeout is the client's,
        # and the value in the read-timeout header: read past a value that is no number.
        if raw is None or not _SECONDS.fullmatch(raw):
            raw = get(_STAINLESS_READ_TIMEOUT)
    if raw and _SECONDS.fullmatch(raw):  # not "inf", "nan", "1e-300", "-1", "1_000"
        value = float(raw)
        if value > 0:
            return value, reads
    return None, False


#: How long past the caller's own deadline admission may still run before the call is
#: answered 503 ``deadline_unreachable``: the policies that wait (a queue, a twin's answer)
#: end their own wait at the deadline with their own reason; this bounds the rest, chiefly
#: a shared-state round trip to a Redis that does not answer, which ``state.timeout`` alone
#: bounds (a caller with a 0.3 s deadline held 6 s by a frozen Redis, a hostile trial).
ADMISSION_DEADLINE_GRACE_S = 0.25


async def _admit_by_deadline(admission: Admission, policies: Sequence[Policy],
                             call: Call) -> None:
    """Admit ``call``, whose caller sent a deadline (``X-Request-Timeout`` or the SDKs'
    timeout headers, counted from its arrival), by that deadline plus
    :data:`ADMISSION_DEADLINE_GRACE_S`. A call admitted after its deadline would be refused
    before its first attempt anyway (:mod:`proxy.attempts`). Ending an admission is what a
    caller leaving does: whatever a policy took is given back.

    Raises:
        Rejected: ``deadline_unreachable`` when the bound passed; or a policy's refusal.
    """
    left = call.time_left()
    bound = asyncio.timeout(max(left or 0.0, 0.0) + ADMISSION_DEADLINE_GRACE_S)
    try:
        async with bound:
            await admission.admit(policies, call)
    except TimeoutError:
        if not bound.expired():
            raise
        raise Rejected(Reason.DEADLINE_UNREACHABLE, None,
                       "the call's deadline passed before it could be sent") from None


class _McpRequest(NamedTuple):
    """What the request path reads of a request on an ``mcp`` route."""

    traffic: mcp.Traffic
    #: The tool of a ``tools/call``, else ``None``.
    operation: str | None
    #: The request id a ``notifications/cancelled`` names, else ``None``.
    cancels: mcp.RequestId | None
    #: It opens a session or a client's first exchange (``initialize``, ``server/discover``).
    opens_session: bool
    #: The JSON-RPC id of its one request (``None`` for a notification, a response, a batch).
    rpc_id: mcp.RequestId | None
    #: The JSON-RPC method of its one request or notification, for its events (``None`` for
    #: a GET, a DELETE, a response, a batch).
    rpc_method: str | None
    #: The ids of the server's requests to its client that its responses answer.
    answers: tuple[mcp.RequestId, ...] = ()
    #: A ``tools/call`` asking to run as a task (``params.task``, 2025-11-25).
    asks_task: bool = False
    #: The task a ``tasks/get``, ``tasks/result`` or ``tasks/cancel`` names.
    task_id: str | None = None
    #: The request of a ``call`` (parsed: for the idempotency step, ``Call.parsed``).
    request: mcp.Message | None = None


def _mcp_traffic(request: web.BaseRequest, body: bytes) -> _McpRequest:
    """What a request on an ``mcp`` route is (:class:`_McpRequest`).

    Raises:
        mcp.InvalidMcpRequest: a POST body that is not MCP, or an ``Mcp-Method`` /
            ``Mcp-Name`` / ``MCP-Protocol-Version`` header that disagrees with it, or a
            JSON-RPC batch holding a call (400).
    """
    if request.method != "POST":
        return _McpRequest(mcp.traffic(request.method), None, None, False, None, None)
    version = request.headers.get(mcp.VERSION_HEADER)
    post = mcp.parse_post(body, version)
    try:
        mcp.check_headers(post, request.headers, require=mcp.is_modern(version))
    except mcp.InvalidMcpRequest as bad:
        bad.method = post.method  # read: its refusal's event names it
        bad.rpc_id = None if post.batch else post.messages[0].id
        raise
    # A batch (protocol 2025-03-26; the TypeScript SDK 1.x server still runs every member) is
    # no one call: it would pass a route's rate, a run's max_requests and a slot once for any
    # number of tools/calls, under none of their tools' blocks, and with no idempotency key,
    # so its retry would run them all again. No official client sends one.
    if post.batch and any(m.traffic == "call" for m in post.messages):
        raise mcp.InvalidMcpRequest(
            "a JSON-RPC batch holding a call (e.g. tools/call): send each call in its own "
            "POST, so that it is limited, keyed and retried as one call")
    traffic = mcp.traffic("POST", post)
    request_message = post.request
    control = traffic == "control"
    return _McpRequest(traffic, post.tool, post.cancels if control else None,
                       control and post.opens_session,
                       request_message.id if request_message is not None else None,
                       post.method, post.answers if control else (), post.asks_task,
                       post.task_id if control else None,
                       request_message if traffic == "call" else None)


async def _mcp_traffic_in_turn(rt: Runtime, request: web.BaseRequest, body: bytes
                               ) -> _McpRequest:
    """:func:`_mcp_traffic` of a large body, in its turn (:class:`policies.bodies.LargeBodies`)."""
    async with rt.large_bodies.turn():
        return _mcp_traffic(request, body)


async def handle(rt: Runtime, request: web.BaseRequest, hold: BodyHold | None = None
                 ) -> web.StreamResponse:
    """Serve one agent request (the only handler of the proxy port, bound to its runtime).

    ``hold``: its body's count under ``server.max_buffered_bytes``, whose first bytes the
    edge found room for (``None``: no body): taken in this first step, with no await since
    that check, grown by the connection as the body arrives, and given back at the end of
    the call (queued, forwarded), in this one frame.
    """
    raw_path = request.raw_path
    route = rt.router.match(raw_path)
    if route is None or request.method == "CONNECT":
        # Not a path: absolute-form (a forward proxy's), CONNECT's authority, OPTIONS's "*".
        # CONNECT on a route's path too: aiohttp's client sends it upstream as a tunnel to
        # the upstream itself (authority form), the path gone (a hostile trial).
        detail = ("CONNECT is not served" if request.method == "CONNECT" else
                  f"{raw_path[:200]}; Sluice forwards only under its routes' prefixes: "
                  f"{rt.router.prefixes}" if raw_path[:1] == "/" else
                  "a request target of * is not served" if raw_path == "*" else
                  "absolute-form request targets are refused")
        if hold is not None:
            hold.give_back()  # nothing counted yet; an uninvited body's answer says close
        return refuse_at_edge(rt, Rejected(Reason.NO_ROUTE, None, detail))
    if hold is not None:
        hold.take()
    # An MCP request arriving during the drain counts once _serve lets it in; others are
    # refused there.
    presence = _Presence(route, not rt.draining)
    try:
        return await _serve(rt, route, request, raw_path, hold, presence)
    finally:
        presence.leave()
        if hold is not None:
            hold.give_back()


class _Presence:
    """One request's place in its route's counts, given back by :func:`handle`'s ``finally``
    alone (:meth:`leave`), whatever ends the request: in ``present`` (what the drain waits
    for) and, for an MCP stream, in ``streams`` too (what it then does not).

    Counted on the route object it matched, queued or admitted: a reload keeps that object
    (and its later admissions) counted, and the drain waits for it."""

    __slots__ = ("present", "route", "stream")

    def __init__(self, route: Route, present: bool) -> None:
        self.route = route
        self.stream = False
        self.present = present
        if present:
            route.present += 1

    def enter(self) -> None:
        """Count present a request not counted when made (it arrived during the drain)."""
        self.route.present += 1
        self.present = True

    def idle(self) -> None:
        """Count the (admitted, present) request as a stream the drain does not wait for;
        once, however often called (a resumed call's answer: when its response is through)."""
        if self.present and not self.stream:
            self.route.streams += 1
            self.stream = True

    def leave(self) -> None:
        if self.present:  # a stream is present too (idle)
            route = self.route
            route.present -= 1
            if self.stream:
                route.streams -= 1
            self.present = self.stream = False


async def _serve(rt: Runtime, route: Route, request: web.BaseRequest,
                 raw_path: str, hold: BodyHold | None, presence: _Presence
                 ) -> web.StreamResponse:
    """Everything :func:`handle` does once the request has a route; ``hold``: the body's
    bytes counted held, ``presence`` its place in the route's counts (see :func:`handle`)."""
    headers = request.headers
    try:
        who = identify(rt, request)
    except IdentityRejected as refused:  # logged under a safe tenant, nothing the caller sent
        return _reject(rt, route, refused, rt.next_request_id(), refused.tenant, None)
    tenant, run, request_id = who.tenant, who.run, who.request_id
    priority = None if who.priority is None else PRIORITIES.get(who.priority)
    # Read with the identity, before the body: a reload landing while the body arrived
    # served a call with one config's tenant and the other's deadline header (a trial).
    timeout, timeout_reads = _caller_timeout(request, rt.timeout_header)

    if has_dot_segment(raw_path):
        return _reject(rt, route, Rejected(Reason.BAD_REQUEST, None, "dot-segments in path"),
                       request_id, tenant, run)
    # Three `in` tests: one combined test (a frozenset's isdisjoint, a regex) runs fewer
    # opcodes but takes 4-6 times as long on a plain path.
    if (("%" in raw_path or ";" in raw_path or "\\" in raw_path) and route.accounting is not None
            and endpoints_differ(route.protocol, request.method, raw_path)):
        return _reject(rt, route, Rejected(Reason.BAD_REQUEST, None,
                                           "a path upstreams read as different endpoints: "
                                           "its ;parameters, %-encoding or backslashes"),
                       request_id, tenant, run)
    if hold is None:
        # No body held: no body, or a chunked WebSocket handshake (the edge takes no hold
        # for one, asks_websocket): a call with a Content-Length body (an LLM API's POST)
        # pays nothing for this.
        if hdrs.UPGRADE in headers and asks_websocket(request):  # it needs one
            return _reject(rt, route, Rejected(Reason.WEBSOCKET_NOT_SUPPORTED, None),
                           request_id, tenant, run)
    elif hold.continues:
        hold.invite()  # 100 Continue: every check needing no body (nor admission) has passed
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _reject(rt, route, Rejected(Reason.BODY_TOO_LARGE, None,
                                           f"limit {rt.config.server.max_request_bytes} bytes"),
                       request_id, tenant, run)
    except Rejected as refused:  # its bytes found no room (BodyHold.grow): 503 buffers_full
        return await sent_and_closed(request, _reject(rt, route, refused, request_id, tenant,
                                                      run))
    except (asyncio.CancelledError, ConnectionResetError):
        if request.get(BODY_CUT):  # the edge's 408, counted there as a refusal
            raise
        # The caller left (or the drain cut it) with its body still coming: nothing is
        # held yet, but the upload is counted and logged as a call that ended so, as one
        # that leaves while queued is (a 499 in nginx's log).
        _left_unadmitted(rt, route, request_id, tenant, run, body_incomplete=True)
        raise
    if hold is not None:
        hold.read(len(body))
    traffic: mcp.Traffic = "call"
    operation = rpc_id = rpc_method = rpc_request = None
    resumes = asks_task = False
    if route.protocol == "mcp":
        try:
            # A large body is parsed in its turn, one at a time per process.
            large = len(body) >= LARGE_BODY_BYTES
            (traffic, operation, cancels, opens_session, rpc_id, rpc_method, answers,
             asks_task, task_id, rpc_request) = (
                await _mcp_traffic_in_turn(rt, request, body) if large
                else _mcp_traffic(request, body))
            if rpc_method is not None:
                rpc_method = _capped(rpc_method)
        except mcp.InvalidMcpRequest as bad:
            return _reject(rt, route, Rejected(Reason.BAD_REQUEST, None, bad.detail[:200]),
                           request_id, tenant, run,
                           None if bad.method is None else _capped(bad.method), bad.rpc_id)
        except asyncio.CancelledError:  # left (or cut) while its large body waited its turn
            _left_unadmitted(rt, route, request_id, tenant, run)
            raise
        resumes = mcp.resumes(request.method, headers)
        # New work is refused while draining; an MCP session's control traffic is not new
        # work: a client lists its tools after the first result of one it had not listed,
        # and refused, the Python 2.x client failed calls that had finished (a new user's
        # trial). Nor is a resumed stream: it brings the answer of a call admitted before
        # (refused, its caller never got it). Opening a session is new work (its calls would
        # be refused here next), and so is a 2026 client's ``server/discover`` (the Python
        # 2.x client's default first message). Once the drain cuts, nothing more is let in:
        # it would be cut as it began.
        if rt.draining and (rt.cutting or not (
                resumes or (traffic == "control" and not opens_session))):
            return _refuse_draining(rt, route, request_id, tenant, run, rpc_method, rpc_id)
        if not presence.present:  # let in during the drain: it waits for it
            presence.enter()
        if resumes:
            # Waited for only when it resumes a call this process saw closed early: a
            # session's own GET stream is resumed with Last-Event-ID too (the Python SDK's
            # client, once a notification had an id), and it stays open, silent, for the
            # whole session.
            resumed = rt.take_polled(route.name, headers.get(mcp.SESSION_HEADER),
                                     headers[mcp.LAST_EVENT_ID_HEADER])
            if resumed is not None:  # its call answered, it is a stream the drain leaves
                request[RESUMED_CALL] = (resumed, presence.idle)
            else:
                resumes = False
        # A cancel without a session names nothing: its id is only its client's.
        session = headers.get(mcp.SESSION_HEADER) if cancels is not None else None
        if session is not None:
            waiting = _waiting_call(rt, route, tenant, session, cancels)
            if waiting is not None:
                return _end_waiting(rt, route, *waiting, request_id, tenant, run)
            held = _call_to_hold(rt, route, tenant, session, cancels)
            if held is not None:
                return _hold_cancel(rt, route, held, request_id, tenant, run)
            _end_polled_by_cancel(rt, route, tenant, session, cancels)
        if answers and (session := headers.get(mcp.SESSION_HEADER)) is not None:
            _client_answered(rt, route, tenant, session, answers)
        if task_id is not None and rt.tasks.held:
            # A follow-up of a task whose call is held here: its answer may end the hold.
            # By tenant too: another tenant's poll of the same id ends nothing of this one.
            key = (route.name, headers.get(mcp.SESSION_HEADER) or "", tenant, task_id)
            if key in rt.tasks.held:
                request[TASK_POLL] = (key, rpc_method)
        if request.method == "DELETE":  # a session's end waits for its kept calls
            session = headers.get(mcp.SESSION_HEADER)
            if session is not None:
                await _cancel_session_tasks(rt, route, session)
            deferred = session_end.defer(rt, route, request, request_id, tenant, run)
            if deferred is not None:
                return deferred
    elif rt.draining:
        # Every call of another protocol is new work. (So nothing let in during the drain
        # gets this far, and presence needs no entering here.)
        return _refuse_draining(rt, route, request_id, tenant, run)

    client_retry = is_client_retry(headers)
    call = Call(
        request_id=request_id, route=route.name, method=request.method, path=raw_path,
        headers=headers, body=body, tenant=tenant, run=run,
        priority=DEFAULT_PRIORITY if priority is None else priority,
        priority_given=priority is not None,
        parent_run=who.parent_run if run is not None else None,
        timeout=timeout, timeout_reads=timeout_reads, operation=operation,
        reporter=route.report, client_retry=client_retry, rpc_id=rpc_id,
        rpc_method=rpc_method,
    )
    call.new_unit = not client_retry
    # MCP control and stream traffic take nothing, an operation's steps included.
    try:
        # A route without operation blocks plans every call its base way: no coroutine.
        plan = (await route.plan(call) if traffic == "call" and route.operations is not None
                else route.base_plan)
    except (asyncio.CancelledError, ConnectionResetError):
        # Left (or cut) while its form's model was read off the loop: nothing held yet.
        _left_unadmitted(rt, route, request_id, tenant, run)
        raise
    operation = call.operation
    if operation is not None and len(operation) > MAX_OPERATION_LABEL_CHARS:
        call.operation = _capped(operation)  # looked up whole, by route.plan
    if rpc_request is not None:  # an MCP call (so `large` is set): its request, parsed once
        if plan.reads_request:  # by its idempotency step, which frees it
            call.parsed = (rpc_request, rt.large_bodies if large else None)
            rpc_request = None
        elif large:  # by nothing: freed now, in its turn, not held while the call queues
            try:
                async with rt.large_bodies.turn(holding=True):
                    rpc_request = None
            except asyncio.CancelledError:
                _left_unadmitted(rt, route, request_id, tenant, run)
                raise
        else:
            rpc_request = None
    admission = Admission()
    outcome = ABANDONED
    admitted_at = 0.0
    finish: Finish | None = None
    try:
        try:
            if traffic == "call":  # MCP control and stream traffic take nothing
                if asks_task and _holds_slot(plan, run):
                    # Its task is held while it runs (proxy.mcp_tasks): a place taken now,
                    # refused past its tenant's share, before it takes anything else.
                    rt.tasks.reserve(route.name, headers.get(mcp.SESSION_HEADER) or "",
                                     tenant)
                    call.task_asked = True
                # Registered while admission may wait (a queue, a twin's answer, the shared
                # state): the drain answers such calls 503 draining when it ends (_drained).
                waiting = rt.admitting
                waiting[call] = asyncio.current_task()
                policies = plan.policies if run is not None else plan.runless
                try:
                    if call.timeout is None:
                        # Most callers send no deadline: no timeout scope, which would cost
                        # a timer handle and loop look-ups per call for nothing.
                        await admission.admit(policies, call)
                    else:
                        await _admit_by_deadline(admission, policies, call)
                finally:
                    del waiting[call]
        except Rejected as rejected:
            outcome = REFUSED
            return refuse(rt, route, rejected, request_id, tenant, run, call.idempotency_key,
                          call.operation, call.rpc_method, call.rpc_id)
        except Replay as replay:
            outcome = Outcome("replayed", reached=False, status=replay.record.status)
            return _replay(rt, route, call, replay)
        if rt.cutting:
            # Admitted as the drain ends (a slot the cut freed): refused, rather than sent
            # upstream as the process stops; nothing was sent, so the caller may retry it.
            outcome = REFUSED
            return _drained(rt, route, call)
        if rt.draining and (mean_s := _outlasts_drain(rt, route, call)) is not None:
            outcome = REFUSED
            return _drained(rt, route, call, f"the drain ends before this call would end: "
                            f"its calls take {mean_s:.3g}s on average")

        # Admitted: from here the outcome is the upstream's, or why there was none. The
        # route's in-flight count is the handler's own: taken here, after admitted_at is set,
        # with nothing that can raise between them, and given back in the finally below.
        admitted_at = call.progress_at = time.monotonic()
        route.inflight += 1
        if traffic != "stream":  # a stream's silence is its normal state, not a stall
            route.live.add(call)
        elif not resumes:  # nor what a drain waits for, but for a call's resumed answer
            presence.idle()
        if route.protocol == "mcp" and traffic != "stream" and rpc_id is not None:
            # A request (control ones too: a task's tasks/result waits for the task's end, a
            # review) the drain's cut answers with its JSON-RPC error (Runtime.end_mcp_calls).
            task = asyncio.current_task()
            if task is not None:
                rt.mcp_calls[call] = task
        call.phase = "forwarding"
        if route.budgets is not None:  # its tenant's budget gauges, from now (tokens or costs)
            route.budget_gauges.watch(call.tenant, route.metrics.tenant(call.tenant))
        if call.enqueued_at is not None:
            route.metrics.queue_wait.observe(admitted_at - call.enqueued_at)
        if call.operation is None and call.rpc_method is None:
            rt.events.emit("admitted", request_id, route.name, tenant, run,
                           call.idempotency_key)
        else:
            rt.events.emit("admitted", request_id, route.name, tenant, run,
                           call.idempotency_key, **call.event_names())
        try:
            if route.protocol == "mcp" and traffic == "call" and call.capture is not None:
                # An MCP call whose answer is kept for its key: forwarded in a task of its
                # own, which may outlive this handler (see _leave).
                finish = Finish()
                finish.task = asyncio.create_task(
                    attempts.forward(request, rt, route, call, traffic, plan, finish))
                response, label = await asyncio.shield(finish.task)
            else:
                response, label = await attempts.forward(request, rt, route, call, traffic,
                                                         plan)
        except Rejected as rejected:  # the first attempt refused (breaker, deadline)
            outcome = Outcome("rejected", reached=False, status=rejected.reason.status)
            return refuse(rt, route, rejected, request_id, tenant, run, call.idempotency_key,
                          call.operation, call.rpc_method, call.rpc_id)
        if (label == "upstream_timeout" and presence.stream and call.phase == "answering"
                and RESUMED_CALL not in request):
            # An MCP session's GET stream (or subscriptions/listen) silent for timeouts.idle:
            # the official servers write nothing on it for a whole session, its normal state
            # (no stall either), and its client opens another. Ended as its client closing it
            # is: counted upstream_timeout, each open session added one every idle period.
            outcome = _delivered_outcome(call, admitted_at)
            return response
        outcome = _answer_outcome(call, response.status, label, admitted_at, response)
        if request.method == "DELETE" and route.protocol == "mcp" and response.status < 300:
            session_end.end_session_polls(rt, route, headers.get(mcp.SESSION_HEADER))
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        if finish is not None:
            task = finish.task
            if (task is not None and task.done() and not task.cancelled()
                    and task.exception() is None):
                # Its answer was all relayed, and the caller left before this handler took
                # it back (a loop turn): the call ended with that answer.
                outcome = _finish_outcome(rt, route, call, task, admitted_at)
                raise
            _leave(rt, route, call, request, finish)
        if call in rt.cancelled_waiting:  # its client cancelled it as it waited (_end_waiting)
            rt.cancelled_waiting.discard(call)
            _uncancel()
            # One ended in a retry back-off had an attempt at the server (answered a failure).
            outcome = _client_cancelled(call)
            # In the server's own shape (an SSE event, to a client that takes one): its
            # client gave up on it, and the Python 2.x client raised out of its JSON path.
            sse = mcp.accepts_sse(call.headers.get("Accept"))
            return web.Response(body=mcp.cancelled(call.rpc_id, sse=sse),
                                content_type=mcp.SSE if sse else "application/json")
        if admitted_at and delivered(request):
            # The answer's last message has gone (an MCP request's response, OpenAI's
            # [DONE]): answered, whatever ended its stream after. Its caller closing it (the
            # official MCP clients, OpenAI's synchronous client), or its run's cancel or the
            # drain (Runtime.end_answered, end_mcp_calls), which end it as the upstream would
            # have instead of cutting it.
            outcome = _delivered_outcome(call, admitted_at)
            if (call.cancelled is not None or rt.draining) and _caller_connected(request):
                if call.cancelled is not None:  # its run's cancel closed the upstream's stream
                    route.metrics.cancelled("inflight")
                call.relaying = None  # ended here: a drain starting now cancels it no more
                await _take_back(finish)
                out = request[RELAYED_STREAM]
                if not await end_answer(request, out) and request.transport is not None:
                    # Not ended here (its end was being written when the cancel came, or
                    # its caller has gone): closed, so that aiohttp writes no end after it.
                    request.transport.close()
                return out
            raise
        if (finish is None and admitted_at and traffic == "call"
                and _ended_by_sluice(rt, call) and attempts.cancels_upstream(call)):
            # Sluice ends a call its server may still run (a run's cancel, the drain's cut):
            # the server is asked to stop it, as for a call whose answer is kept (_leave).
            # Before 2026-07-28 a closed POST is no cancel: the tool ran on, its side
            # effect after its run was cancelled, beside the next call its slot let in.
            attempts.send_cancel(rt, route, call)
        if call.cancelled is not None:  # its run was cancelled (POST /admin/runs/.../cancel)
            answer = await _run_cancelled(rt, route, call, request, bool(admitted_at), finish)
            if finish is not None and finish.left:  # its server was asked to cancel it
                outcome = Outcome("run_cancelled", call.reached, call.status)
            return answer
        if rt.cutting and not admitted_at and request.transport is not None:
            # Still queued (or otherwise admitting) when the drain ended: it never reached
            # the upstream, so it is answered 503 draining, not cut (Runtime.refuse_waiting).
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            outcome = REFUSED
            return _drained(rt, route, call)
        if (rt.cutting and admitted_at and traffic != "stream" and route.protocol == "mcp"
                and _caller_connected(request)):
            # Cut by the drain (Runtime.end_mcp_calls), its caller still there.
            outcome = Outcome("drain_cut", call.reached, call.status)
            return await _end_at_drain(route, call, request, finish)
        # Cancelled: by the caller leaving, or by the drain cutting what outlived it.
        if admitted_at:
            if (not rt.cutting and presence.stream and call.phase == "answering"
                    and RESUMED_CALL not in request):
                # An MCP session's GET stream its client closed (at every session's close)
                # once under way: it has no end of its own. (A GET resuming a call's answer
                # ends with that call's response: delivered() tells.)
                outcome = _delivered_outcome(call, admitted_at)
            else:
                label = "drain_cut" if rt.cutting else "client_disconnected"
                outcome = Outcome(label, call.reached, call.status)
        elif rt.cutting:
            outcome = DRAIN_CUT
        raise
    except Exception:
        log.exception("proxy error on route %s (request %s)", route.name, request_id)
        if not call.reached:
            # Raised before anything reached the upstream (in admission, say: a state call's
            # bug): Sluice's own fault, 500 internal_error. A 502 upstream_unreachable sent
            # operators after a healthy upstream that was never asked (a hostile trial).
            outcome = REFUSED
            return refuse(rt, route, Rejected(Reason.INTERNAL_ERROR, None, "proxy error"),
                          request_id, tenant, run, call.idempotency_key,
                          call.operation, call.rpc_method, call.rpc_id)
        outcome = Outcome("upstream_error", True, 502)
        error = Rejected(Reason.UPSTREAM_UNREACHABLE, None, "proxy error")
        if call.phase == "answering":
            # The upstream's status line is out: a 502 written now landed inside its body
            # (a second status line mid-stream), or, in an MCP call's task, nothing did and
            # the caller waited for the rest of an answer that would never come.
            return await _cut(request, error, call.status)
        return render(error, route.protocol, call.rpc_id)
    finally:
        rt.mcp_calls.pop(call, None)
        if finish is None:
            _settle(rt, route, call, admission, outcome, admitted_at, traffic)
        elif finish.task is not None and not finish.task.done():
            _hand_over(rt, route, call, admission, outcome, admitted_at, finish)
        elif finish.left:  # it finished without its caller, who had gone as it ended
            _settle(rt, route, call, admission, outcome, admitted_at, traffic,
                    Outcome("client_disconnected", call.reached, call.status))
        else:
            _settle(rt, route, call, admission, outcome, admitted_at, traffic)
        if resumes and not presence.stream and not rt.cutting:
            _poll_again(rt, route, request)


def _refuse_draining(rt: Runtime, route: Route, request_id: str, tenant: str,
                     run: str | None, rpc_method: str | None = None,
                     rpc_id: mcp.RequestId | None = None) -> web.Response:
    """503 ``draining`` for new work arriving while the process drains, closing the
    connection: the process is going away, so the caller's next call goes elsewhere."""
    refused = _reject(rt, route, Rejected(Reason.DRAINING, DRAINING_RETRY_AFTER_S,
                                          "it takes no new calls"),
                      request_id, tenant, run, rpc_method, rpc_id)
    refused.force_close()
    return refused


def _caller_connected(request: web.BaseRequest) -> bool:
    """Whether the caller's connection is still open, so that an answer can still be
    written to it (a handler cancelled by the caller leaving finds it closing)."""
    transport = request.transport
    return transport is not None and not transport.is_closing()


def _ended_by_sluice(rt: Runtime, call: Call) -> bool:
    """Whether Sluice itself ends ``call``, not its caller: its run's cancel
    (``POST /admin/runs/.../cancel``) or the drain's cut; its server may then be asked to
    stop it (:func:`proxy.attempts.send_cancel`)."""
    return call.cancelled is not None or rt.cutting


def _client_cancelled(call: Call) -> Outcome:
    """The outcome of a call its client cancelled that Sluice ended: it reached the
    upstream when an attempt had (one answered a failure before a retry back-off)."""
    return (Outcome(CLIENT_CANCELLED.label, True, CLIENT_CANCELLED.status)
            if call.reached else CLIENT_CANCELLED)


def _left_unadmitted(rt: Runtime, route: Route, request_id: str, tenant: str,
                     run: str | None, **fields: Any) -> None:
    """Count and log a call whose caller left (or the drain cut) before it held anything:
    its body still arriving, or its model being read. As one that leaves while queued is
    (a 499 in nginx's log); ``fields`` go on its ``completed`` event."""
    label = "drain_cut" if rt.cutting else ABANDONED.label
    route.metrics.outcomes[label].inc()
    rt.events.emit("completed", request_id, route.name, tenant, run, None, status=0,
                   outcome=label, **fields)


def _poll_again(rt: Runtime, route: Route, request: web.BaseRequest) -> None:
    """A GET resuming a call's answer ended before the call's response came through on it
    (its client left, the upstream failed): the client resumes it again, from the last
    event id it got, and that GET resumes the call too (:meth:`Runtime.note_polled`).
    Forgotten when the first GET took it, a second one was a session's plain stream, which
    a drain does not wait for (a review)."""
    try:  # after the call's end is settled, and never in place of its answer
        tracker = request.get(RESUMED_ANSWER)
        polled = request[RESUMED_CALL][0]
        if tracker is not None and tracker.sse and not tracker.between_events:
            # Broken off inside an event, which the next GET sends again whole: what the
            # call's capture holds is no longer the answer, and is not kept for its key.
            polled.capture = None
        event_id = (tracker.last_event_id.decode("utf-8", "surrogateescape")
                    if tracker is not None else request.headers[mcp.LAST_EVENT_ID_HEADER])
        rt.note_polled(route.name, request.headers.get(mcp.SESSION_HEADER), event_id, polled)
    except Exception:
        log.exception("route %s: a resumed answer is not noted for its next resume",
                      route.name)


def _end_polled_by_cancel(rt: Runtime, route: Route, tenant: str, session: str,
                          rpc_id: mcp.RequestId) -> None:
    """A client's ``notifications/cancelled`` names a call held for its polled answer that
    Sluice does not hold the cancel for (:func:`_call_to_hold`: no answer kept for its
    key): the cancel goes on to the server, which stops the tool, and the client resumes
    no answer it cancelled, so the hold ends now, ``client_cancelled``; held to its bound
    (600 s without ``timeouts.total``), it kept its slot for nothing (a review)."""
    for task, call in list(rt.polling.items()):
        if (not task.done() and call.cancelled is None
                and _named_by_cancel(call, route, tenant, session, rpc_id)):
            rt.cancelled_waiting.add(call)
            task.cancel()


def _client_answered(rt: Runtime, route: Route, tenant: str, session: str,
                     answers: tuple[mcp.RequestId, ...]) -> None:
    """A client's POST carries its responses to the server's requests ``answers`` (an
    elicitation's, a sampling call's): the MCP calls of its route, tenant and session
    (``Mcp-Session-Id``: a server's request ids are its session's) in flight whose answers
    carried those requests wait on their client no more, and may be finished without it
    again (:func:`_leave`). Taken as the POST arrives, before it is forwarded: a caller
    that leaves once its answer is on the way leaves a call the server can end; so does a
    call held for an answer closed early for polling (a review: else its session's DELETE
    did not wait for it). Such POSTs are rare: a scan of the MCP calls in flight keeps this
    off every other request's path."""
    for call in itertools.chain(rt.mcp_calls, rt.finishing.values(), rt.polling.values()):
        capture = call.capture
        tracker = capture.tracker if capture is not None else None
        if (tracker is not None and tracker.awaits_client and call.route == route.name
                and call.tenant == tenant and call.headers.get(mcp.SESSION_HEADER) == session):
            for rpc_id in answers:
                tracker.client_answered(rpc_id)


def _settle(rt: Runtime, route: Route, call: Call, admission: Admission, outcome: Outcome,
            admitted_at: float, traffic: mcp.Traffic, left: Outcome | None = None) -> None:
    """The end of every call, run exactly once and never awaiting: give back everything it
    held, telling each holding ``outcome``, and count and log how it ended. Run by the
    handler's ``finally``, or, for a call whose forward task outlives its handler, by that
    task's end (:func:`_hand_over`).

    ``left``: the caller's own outcome (it left) when the call's exchange was finished
    without it; ``outcome`` is then what the upstream's answer came to.

    A call whose answer the upstream closed early for polling (:attr:`Call.polled`) is not
    over: it is held (:func:`_hold_polled`), and settled here once its response has come.

    Never raises: a fault in the counting and logging is logged. Raised from the handler's
    ``finally``, it replaced the answer being returned: a small answer's body, written once
    the handler returns, was never sent, and the connection was cut without a word.
    """
    if call.polled is not None and _hold_polled(rt, route, call, admission, outcome,
                                                admitted_at, left):
        if rt.session_deletes:
            session_end.held_for_polling(rt, route, call)
        return
    if call.task is not None and _hold_task(rt, route, call, admission, outcome,
                                            admitted_at, left):
        return
    if call.task_asked:  # its place for a task (proxy.mcp_tasks), no task held
        call.task_asked = False
        rt.tasks.unreserve(route.name, call.headers.get(mcp.SESSION_HEADER) or "",
                           call.tenant)
    if call.cancelled is not None and outcome is ABANDONED:
        outcome = (Outcome("run_cancelled", call.reached, call.status)
                   if admitted_at else REFUSED)
    if admitted_at:
        route.inflight -= 1
        route.live.discard(call)
    admission.release(outcome)
    if rt.session_deletes:  # a session's DELETE may wait for this call (never raises)
        session_end.call_ended(rt, call)
    try:  # counting and logging how it ended, once everything it held is given back
        if admitted_at:
            if left is None:
                _completed(rt, route, call, outcome, admitted_at, traffic != "stream")
            else:
                _completed(rt, route, call, left, admitted_at, True, finished=outcome)
        elif outcome.label == "rejected":  # its `rejected` event went out with the refusal
            route.metrics.outcomes[outcome.label].inc()
            if call.operation is not None:
                route.metrics.operation(call.operation).outcome(outcome.label)
        elif outcome.label != "replayed":
            # Left, cut by the drain or failed before admission (queued, say): without an
            # event of its own, the timeline showed it in flight forever.
            _completed(rt, route, call, outcome, None, False)
        if call.new_unit:
            route.metrics.work_units.inc()
    except Exception:
        log.exception("counting the end of request %s on route %s failed", call.request_id,
                      route.name)


def _hold_polled(rt: Runtime, route: Route, call: Call, admission: Admission,
                 outcome: Outcome, admitted_at: float, left: Outcome | None) -> bool:
    """Hold a call whose answer the upstream closed early for polling (2025-11-25, SEP-1699)
    instead of settling it: its tool runs on at the server, and its response comes on the
    GET its client resumes the answer with (:class:`proxy.runtime.Polled`), maybe on another
    connection. Until then it keeps everything it took (its key, slot, rate and run counts,
    budget reservation, the ``cost_per_second`` clock), its place in flight on its route,
    and its body counted held; a ``dedup`` route's capture is fed the resumed answer, so its
    response is kept for the key. Returns whether it is held: not when its run was
    cancelled, the drain cuts or its session's DELETE went through (it ends now, as
    before), nor when its response came first (a resumed GET can beat this handler's end).

    The hold is a task of its own (:func:`_until`), which ends when the response comes
    through, or with ``TimeoutError`` at the call's bound (:attr:`Polled.deadline`: its
    attempt's ``timeouts.total``), or cancelled by the call's run's cancel
    (:attr:`Call.background`) or the drain's cut (:attr:`Runtime.polling`); its end settles
    the call, once (:func:`_polled_end`), with that outcome."""
    polled, call.polled = call.polled, None
    if (polled.answered or _ended_by_sluice(rt, call)
            or (route.name, call.headers.get(mcp.SESSION_HEADER, "")) in rt.ended_sessions):
        if not polled.answered:
            polled.capture = None  # nothing is kept for the key of a call that ends now
        return False
    try:
        waiter = polled.waiter = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(_until(waiter, polled.deadline or 0.0))
    except Exception:  # _settle never raises: the call ends now instead
        log.exception("route %s: call %s, closed early for polling, is not held for its "
                      "response", route.name, call.request_id)
        polled.capture = polled.waiter = None
        return False
    route.present += 1
    held = len(call.body)
    rt.buffered_bytes += held
    rt.polling[task] = call
    call.background = task
    task.add_done_callback(functools.partial(_polled_end, rt, route, call, admission, outcome,
                                             admitted_at, left, polled, held))
    return True


async def _until(waiter: asyncio.Future[None], deadline: float) -> None:
    """Wait for ``waiter``: a polled call's response on a resumed GET (:func:`_hold_polled`),
    or a held task's end (:func:`_hold_task`).

    Raises:
        TimeoutError: ``deadline`` (monotonic seconds) passed first.
    """
    async with asyncio.timeout_at(deadline):
        await waiter


def _polled_end(rt: Runtime, route: Route, call: Call, admission: Admission, ended: Outcome,
                admitted_at: float, left: Outcome | None, polled: Polled, held: int,
                task: asyncio.Task[None]) -> None:
    """The end of a polled call's hold (:func:`_hold_polled`): settle the call with what it
    came to. ``ended``: how its POST ended (its answer's status class); ``held``: the bytes
    of its body, counted in ``buffered_bytes`` until now."""
    try:
        if task.cancelled():  # its run's cancel, or the drain's cut
            if call.cancelled is not None:
                route.metrics.cancelled("inflight")
                outcome = Outcome("run_cancelled", call.reached, call.status)
                _stop_polled(rt, route, call)
            elif call in rt.cancelled_waiting:  # its client's cancel (_end_polled_by_cancel)
                rt.cancelled_waiting.discard(call)
                outcome = Outcome(CLIENT_CANCELLED.label, call.reached, call.status)
            else:
                outcome = Outcome("drain_cut" if rt.cutting else "client_disconnected",
                                  call.reached, call.status)
                if rt.cutting:
                    _stop_polled(rt, route, call)
        elif isinstance(task.exception(), TimeoutError):
            log.info("route %s: the response of call %s, closed early for polling, did not "
                     "come on a resumed GET within its timeouts.total", route.name,
                     call.request_id, extra=PER_CALL)
            outcome = Outcome("upstream_timeout", call.reached, call.status)
            _stop_polled(rt, route, call, "the call timed out")
        elif task.exception() is not None:
            _log_failure(route, call, task.exception())  # type: ignore[arg-type]
            outcome = Outcome("upstream_error", call.reached, call.status)
        else:
            outcome = _answer_outcome(call, ended.status, ended.label, admitted_at)
        _settle(rt, route, call, admission, outcome, admitted_at, "call", left)
    finally:
        polled.capture = polled.waiter = None
        route.present -= 1
        rt.buffered_bytes -= held
        rt.polling.pop(task, None)
        rt.cancelled_waiting.discard(call)
        call.background = None


def _stop_polled(rt: Runtime, route: Route, call: Call, reason: str | None = None) -> None:
    """Sluice ends a call held for its polled answer (its run's cancel, the drain's cut, its
    bound): its tool still runs at the server, which no request of Sluice's is open to, so
    the server is asked to stop it (:func:`proxy.attempts.send_cancel`)."""
    if attempts.cancels_upstream(call):
        attempts.send_cancel(rt, route, call, reason=reason)


def _hold_task(rt: Runtime, route: Route, call: Call, admission: Admission,
               outcome: Outcome, admitted_at: float, left: Outcome | None) -> bool:
    """Hold a ``tools/call`` answered with a ``CreateTaskResult`` (MCP 2025-11-25 tasks)
    instead of settling it: its tool runs on at the server as the task (:attr:`Call.task`,
    :mod:`proxy.mcp_tasks`). Until the task is seen over or its bound passes the call keeps
    everything it took (its slots, rate and run counts, budget reservation), its place in
    flight on its route and its body counted held, as a call closed early for polling does
    (:func:`_hold_polled`). Returns whether it is held: not when it ended otherwise (an
    error, its caller gone before the answer), when the task was seen over already, nor when
    its run was cancelled or the drain cuts (then its server is sent the task's
    ``tasks/cancel``). A call whose session's DELETE went through first is held all the
    same (a server may run a deleted session's tasks on: :mod:`proxy.mcp_tasks`), its
    ``tasks/cancel`` sent now.

    The hold is a task of its own (:func:`_until`), which ends when the task is seen
    over, or with ``TimeoutError`` at its bound (:attr:`HeldTask.deadline`), or cancelled by
    the call's run's cancel (:attr:`Call.background`) or the drain's cut
    (:attr:`proxy.mcp_tasks.Tasks.holding`); its end settles the call, once
    (:func:`_task_end`)."""
    task: HeldTask = call.task
    call.task = None
    stopped = _ended_by_sluice(rt, call)
    answered = outcome.label[0].isdigit()  # else its client may not know of the task
    if task.ended is not None or stopped or not answered:
        if task.ended is None and (stopped or not answered):
            attempts.send_cancel(rt, route, call, reason="the call was ended",
                                 task_id=task.task_id)
        rt.tasks.forget(task)
        call.task = task  # its completed event names it
        return False
    try:
        waiter = task.waiter = asyncio.get_running_loop().create_future()
        holder = asyncio.create_task(_until(waiter, task.deadline))
    except Exception:  # _settle never raises: the call ends now instead
        log.exception("route %s: call %s, whose task runs on, is not held", route.name,
                      call.request_id)
        task.waiter = None
        rt.tasks.forget(task)
        return False
    task.call = call
    if (route.name, task.key[1]) in rt.ended_sessions:  # its client will not follow it
        task.cancel_sent = True
        attempts.send_cancel(rt, route, call, reason="its session was deleted",
                             task_id=task.task_id)
    route.present += 1
    held = len(call.body)
    rt.buffered_bytes += held
    rt.tasks.holding[holder] = call
    call.background = holder
    holder.add_done_callback(functools.partial(_task_end, rt, route, call, admission, outcome,
                                               admitted_at, left, task, held))
    return True


def _holds_slot(plan: Plan, run: str | None) -> bool:
    """Whether a call of ``plan`` (of a run or not) takes a concurrency slot: the tool's
    or operation's, the route's, or a run's ``fanout.width``. Only such a call's task is
    held while it runs (:mod:`proxy.mcp_tasks`): a rate or a budget is spent at admission,
    and holding a call with no slot held a table entry for nothing."""
    steps = plan.policies if run is not None else plan.runless
    return any(isinstance(step, _SLOT_STEPS) for step in steps)


_SLOT_STEPS = (ConcurrencyLimiter, OperationSlot, FanoutWidth)


async def _cancel_session_tasks(rt: Runtime, route: Route, session: str) -> None:
    """A DELETE of ``session`` came: send each of its held tasks' server a
    ``tasks/cancel`` before the DELETE goes on (after it the session's id names nothing at
    the server), waiting up to :data:`proxy.mcp_tasks.CANCEL_BEFORE_DELETE_S` for them.
    The calls stay held, to their bounds or their tasks' ends: a server may run a deleted
    session's tasks on (the TypeScript SDK 1.x does)."""
    sends = []
    for call, task in rt.tasks.session_calls(route.name, session):
        task.cancel_sent = True
        sent = attempts.send_cancel(rt, route, call, reason="its session is deleted",
                                    task_id=task.task_id)
        if sent is not None:
            sends.append(sent)
    if sends:
        await asyncio.wait(sends, timeout=CANCEL_BEFORE_DELETE_S)


def _task_end(rt: Runtime, route: Route, call: Call, admission: Admission, ended: Outcome,
              admitted_at: float, left: Outcome | None, task: HeldTask, held: int,
              holder: asyncio.Task[None]) -> None:
    """The end of a held task's hold (:func:`_hold_task`): settle its call with what it came
    to. ``ended``: how its POST ended (the ``CreateTaskResult``'s status class); ``held``:
    the bytes of its body, counted in ``buffered_bytes`` until now. At its bound, a run's
    cancel or the drain's cut the server is sent the task's ``tasks/cancel``."""
    try:
        rt.tasks.forget(task)
        if holder.cancelled() and task.ended is None:
            if call.cancelled is not None:  # its run's cancel
                route.metrics.cancelled("inflight")
                outcome = Outcome("run_cancelled", call.reached, call.status)
                task.ended = "run_cancelled"
            else:  # the drain's cut (or the loop's end)
                outcome = Outcome("drain_cut", call.reached, call.status)
                task.ended = "drain_cut"
            attempts.send_cancel(rt, route, call, reason=f"the call was ended ({task.ended})",
                                 task_id=task.task_id)
        elif task.ended is None:  # its bound: the call's timeouts.total
            log.info("route %s: the task of call %s was not seen over within its "
                     "timeouts.total", route.name, call.request_id, extra=PER_CALL)
            task.ended = "timeout"
            outcome = Outcome("upstream_timeout", call.reached, call.status)
            if not task.cancel_sent:
                attempts.send_cancel(rt, route, call, reason="the task's bound passed",
                                     task_id=task.task_id)
        else:
            outcome = _answer_outcome(call, ended.status, ended.label, admitted_at)
        call.task = task  # its completed event names it
        _settle(rt, route, call, admission, outcome, admitted_at, "call", left)
    finally:
        task.waiter = task.call = None
        route.present -= 1
        rt.buffered_bytes -= held
        rt.tasks.holding.pop(holder, None)
        call.background = None


def _leave(rt: Runtime, route: Route, call: Call, request: web.BaseRequest,
           finish: Finish) -> None:
    """The handler of a call forwarded in a task of its own ends without its answer (the
    caller left, the drain cut it, its run was cancelled): decide what becomes of that task.

    An MCP server runs a tool to its end whether or not the POST that asked for it is still
    open. So when the call may have reached the upstream and its response has not come yet,
    and only its caller left, the exchange is finished without the caller
    (:class:`proxy.forward.Finish`): the call keeps its slot, key and every other holding
    until the upstream's answer ends, and its answer is then kept for its key, so that the
    caller's retry gets it instead of running the tool again. Otherwise the task is
    cancelled, which closes the upstream request, as on every other route. So is it when
    the answer has carried a request of the server's to its client (an elicitation) that the
    client has not answered (:func:`proxy.forward.awaits_client`): the tool waits for that
    answer, which nobody will send now, so the response would never come, and the call held
    its slot and key (and an identical retry waited for the key, then got 409) until
    ``timeouts.total`` (a hostile trial). Ended now, it keeps nothing for its key: the retry
    runs the tool again, which is safe, since the tool was waiting on its client.

    A run's cancel or the drain's cut ends a call Sluice can ask its server to stop
    (:func:`proxy.attempts.cancels_upstream`: a 2025-era request) with that server's
    ``notifications/cancelled``, sent by Sluice (:func:`proxy.attempts.send_cancel`); a
    run's cancel then finishes the exchange as for a caller that left, its caller answered
    ``run_cancelled`` at once: the call holds its key until the server's answer (the
    cancellation error frees it; a result, the tool having run on, is kept for it, so that
    a twin waiting for the key gets it rather than running the tool again). The drain's cut
    holds nothing (the process is going away). A 2026-07-28 call's cancel is the close of
    its stream (the task cancelled), and nothing is kept for its key.
    """
    task = finish.task
    if task is None or task.done():
        return
    if not call.reached or answered(request):
        task.cancel()
        return
    ended = _ended_by_sluice(rt, call)
    if ended and attempts.cancels_upstream(call):
        attempts.send_cancel(rt, route, call, None if rt.cutting else task)
        held = not rt.cutting and not awaits_client(call)
    else:
        held = not ended and not awaits_client(call)
    if held:
        finish.left = True
    else:
        task.cancel()


def _hand_over(rt: Runtime, route: Route, call: Call, admission: Admission, outcome: Outcome,
               admitted_at: float, finish: Finish) -> None:
    """The handler ends before its call's forward task: that task's end settles the call
    (:func:`_settle`) instead, so that exactly one party gives its holdings back, once,
    whichever ends first. ``outcome`` is the handler's (how the caller's request ended).

    Until then the task keeps the call present on its route (the drain waits for it) and, if
    it finishes without the caller, is reachable by a run's cancel (:attr:`Call.background`)
    and by the drain's cut (:attr:`Runtime.finishing`)."""
    task = finish.task
    assert task is not None
    route.present += 1  # the handler's own counts are given back by handle(): its body
    held = len(call.body)  # is still held, by the task, so it counts until the task ends
    rt.buffered_bytes += held
    if finish.left:
        call.background = task
        rt.finishing[task] = call
        call.stop = functools.partial(_cancel_finishing, rt, route, call, task)
    else:
        task.cancel()  # nobody awaits its answer (_leave has cancelled it already, mostly)
    task.add_done_callback(functools.partial(_finished, rt, route, call, admission, outcome,
                                             admitted_at, finish, held))


def _finished(rt: Runtime, route: Route, call: Call, admission: Admission, caller: Outcome,
              admitted_at: float, finish: Finish, held: int, task: asyncio.Task[object]
              ) -> None:
    """The end of a call's forward task that outlived its handler (:func:`_hand_over`);
    ``held``: the bytes of its body, counted in ``buffered_bytes`` until now. A call its
    client cancelled as the task waited out a retry back-off (:func:`_end_waiting`), its
    caller gone, ended ``client_cancelled``: no handler is left to take it out of
    :attr:`Runtime.cancelled_waiting`, where it stayed for the process's life (a review)."""
    try:
        if finish.left and call in rt.cancelled_waiting:
            _settle(rt, route, call, admission, _client_cancelled(call), admitted_at, "call")
        elif finish.left:
            if (task.cancelled() and rt.cutting and call.cancelled is None
                    and attempts.cancels_upstream(call)):
                attempts.send_cancel(rt, route, call)  # the drain's cut: its server stops
            _settle(rt, route, call, admission, _finish_outcome(rt, route, call, task,
                                                                 admitted_at),
                    admitted_at, "call", caller)
        else:  # cut by the handler: the handler's outcome stands
            if not task.cancelled() and task.exception() is not None:
                _log_failure(route, call, task.exception())
            _settle(rt, route, call, admission, caller, admitted_at, "call")
    finally:
        rt.cancelled_waiting.discard(call)
        route.present -= 1
        rt.buffered_bytes -= held
        rt.finishing.pop(task, None)
        call.stop = None
        if call.background is task:  # else its answer was closed for polling: held on
            call.background = None


def _cancel_finishing(rt: Runtime, route: Route, call: Call, task: asyncio.Task[object]
                      ) -> None:
    """A run's cancel of a call being finished after its caller left (:attr:`Call.stop`):
    its server is asked to stop it (:func:`proxy.attempts.send_cancel`), and the finish
    goes on to the server's answer, holding the key (see :func:`_leave`); a 2026-07-28
    call's cancel is closing its stream: its task is cancelled. Never raises (it runs
    inside the run's cancel)."""
    try:
        route.metrics.cancelled("inflight")
        if attempts.cancels_upstream(call):
            attempts.send_cancel(rt, route, call, task)
            return
    except Exception:
        log.exception("route %s: the cancel of call %s was not sent", route.name,
                      call.request_id)
    task.cancel()


def _finish_outcome(rt: Runtime, route: Route, call: Call, task: asyncio.Task[object],
                    admitted_at: float) -> Outcome:
    """What the exchange of a call finished without its caller came to, as the request path
    would have said it with the caller there."""
    if task.cancelled():  # the drain's cut, or its run's cancel
        if rt.cutting:
            return Outcome("drain_cut", call.reached, call.status)
        if call.cancelled is not None:
            return Outcome("run_cancelled", call.reached, call.status)
        return Outcome("client_disconnected", call.reached, call.status)
    error = task.exception()
    if error is None:
        response, label = task.result()  # type: ignore[misc]
        return _answer_outcome(call, response.status, label, admitted_at, response)
    if isinstance(error, Rejected):  # the first attempt refused (breaker, deadline)
        return Outcome("rejected", reached=False, status=error.reason.status)
    if isinstance(error, ConnectionResetError):
        return Outcome("client_disconnected", call.reached, call.status)
    _log_failure(route, call, error)
    return Outcome("upstream_error", call.reached, 502)


def _answer_outcome(call: Call, status: int, label: str, admitted_at: float,
                    response: web.StreamResponse | None = None) -> Outcome:
    """The outcome of a call the forwarder ended with an answer of ``status`` (``label``:
    its ``sluice_requests_total`` outcome; ``response``, when it is at hand, for a failure
    Sluice wrote: :func:`_written_status`); an upstream's answer is a sample of the service
    time and of the time to its first byte."""
    if label[0].isdigit():
        return Outcome(label, call.reached, status, time.monotonic() - admitted_at,
                       call.answered_at - admitted_at if call.answered_at else None)
    return Outcome(label, call.reached,
                   status if response is None else _written_status(response))


#: Reasons by their code, to read an answer Sluice wrote back (its ``X-Sluice-Reason``).
_REASONS = {reason.code: reason for reason in Reason}


def _written_status(response: web.StreamResponse) -> int:
    """The status a call's ``completed`` event names for a failure Sluice wrote itself
    (``upstream_timeout``, ``upstream_error``): the reason's own, 504 or 502, though on an
    ``mcp`` route a call's is sent as HTTP 200 and a JSON-RPC error
    (:func:`proxy.rejections.render`), as a run's cancel's 409 is, and its event names 409."""
    reason = _REASONS.get(response.headers.get(REASON_HEADER, ""))
    return reason.status if reason is not None else response.status


def _delivered_outcome(call: Call, admitted_at: float) -> Outcome:
    """The outcome of a call whose answer's last message had gone to the caller
    (:func:`proxy.forward.delivered`) when something else ended its stream (its caller
    closing it, its run's cancel, a drain), or of an MCP session's GET stream its client
    closed: the answer's status class, as if the upstream had ended the stream then, unless
    that last message was an error event (the SDKs raise on it and close the stream:
    :func:`proxy.forward.judged_stream`)."""
    label = judged_stream(call.meter, call.capture, f"{call.status // 100}xx")
    return _answer_outcome(call, call.status, label, admitted_at)


def _log_failure(route: Route, call: Call, error: BaseException) -> None:
    """Log a fault of Sluice's own (with its traceback) that ended a call; a refusal or the
    caller's disconnect is none."""
    if not isinstance(error, (Rejected, ConnectionResetError)):
        log.error("proxy error on route %s (request %s)", route.name, call.request_id,
                  exc_info=error)


async def _run_cancelled(rt: Runtime, route: Route, call: Call, request: web.BaseRequest,
                         admitted: bool, finish: Finish | None = None) -> web.StreamResponse:
    """Answer a call whose run was cancelled while it was queued or in flight.

    The cancel reached the handler as a task cancellation, which already closed the upstream
    request; it is taken back here so that the caller gets an answer now. Before any of the
    upstream's answer was sent, that answer is 409 ``run_cancelled``; a stream already started
    is cut (the connection closed without its last chunk, so the cut is visible). An MCP
    call's SSE answer that has not carried its response yet ends instead with an event
    holding the ``run_cancelled`` JSON-RPC error: a cut stream fails nothing on the Python
    ``mcp`` 1.x client, whose call then waits for its own timeout (none by default).
    """
    kind = "inflight" if admitted else "queued" if call.phase == "queued" else "admitting"
    route.metrics.cancelled(kind)
    await _take_back(finish)
    rejected = Rejected(Reason.RUN_CANCELLED, None, call.cancelled or "", retry=False)
    # Answering means sent: a status received from the upstream whose answer is still being
    # read (a small one is read whole first) has not reached the caller, which gets the 409.
    if call.phase == "answering" and request.transport is not None:
        answer = await _cut(request, rejected, call.status)
        if answer is request.get(RELAYED_STREAM):
            route.metrics.rejections[rejected.reason].inc()
        return answer
    if admitted:
        route.metrics.rejections[rejected.reason].inc()
        call.status = rejected.reason.status  # what its `completed` event says it was sent
        return render(rejected, route.protocol, call.rpc_id)
    return refuse(rt, route, rejected, call.request_id, call.tenant, call.run,
                  call.idempotency_key, call.operation, call.rpc_method, call.rpc_id)


async def _take_back(finish: Finish | None) -> None:
    """Take back the handler's task, which Sluice cancelled to end its call now (a run's
    cancel, the drain's cut), so that it can answer: its cancellation is undone, and a
    forward task cancelled by :func:`_leave` has unwound, so its upstream request is closed
    and nothing else writes to the caller. One :func:`_leave` left to finish without its
    caller (its server asked to cancel it) writes to the caller no more: not waited for,
    and nothing awaits here, so that the caller's last event follows what was relayed."""
    _uncancel()
    if (finish is not None and finish.task is not None and not finish.task.done()
            and not finish.left):
        await asyncio.wait((finish.task,))


def _uncancel() -> None:
    """Undo every cancellation of the running task: Sluice's own, to end its call now (a
    client's cancel and its run's can both land on a queued call in one loop turn), so
    that it answers with nothing left pending on the task."""
    task = asyncio.current_task()
    if task is not None:
        while task.cancelling():
            task.uncancel()


async def _end_at_drain(route: Route, call: Call, request: web.BaseRequest,
                        finish: Finish | None) -> web.StreamResponse:
    """Answer an MCP call in flight that the drain cut (:meth:`Runtime.end_mcp_calls`),
    as a run's cancel is answered: its upstream request is closed already; an SSE answer
    that has not carried its response ends with the call's JSON-RPC error (reason
    ``draining``) as its last event, and one not begun is that error (HTTP 200); any other
    answer is cut. A cut POST fails no call on the Python ``mcp`` 1.x client (it waited for
    ever), the TypeScript 2025 clients waited for their request timeout, and the Python 2.x
    client in ``auto`` mode, cut before the status line, lost its whole session."""
    await _take_back(finish)
    rejected = Rejected(Reason.DRAINING, DRAINING_RETRY_AFTER_S,
                        "the drain ended while this call ran; it may have run", retry=False)
    if call.phase == "answering":
        return await _cut(request, rejected, call.status)
    call.status = rejected.reason.status  # what its `completed` event says it was sent
    response = render(rejected, route.protocol, call.rpc_id)
    response.force_close()  # the process is going away
    return response


async def _cut(request: web.BaseRequest, rejected: Rejected, status: int
               ) -> web.StreamResponse:
    """End an answer whose status line has gone to the caller, for ``rejected``: an MCP
    call's SSE answer ends with its JSON-RPC error as last event (see
    :func:`proxy.forward.end_mcp_answer`), and that stream is returned; any other answer is
    cut (its connection closed without its last bytes, so the cut is visible), and what is
    returned is never sent."""
    if await end_mcp_answer(request, rejected):
        return request[RELAYED_STREAM]
    if request.transport is not None:
        request.transport.close()
    return web.Response(status=status or 502)  # never sent: the connection is closed


def _capped(name: str) -> str:
    """A name from a request (a tool's, an MCP method's) as events and metrics keep it: what
    an MCP tool name may be (1 to 128 characters), then how much more there was, not
    megabytes of a made-up one on every event line of the call."""
    if len(name) <= MAX_OPERATION_LABEL_CHARS:
        return name
    return (f"{name[:MAX_OPERATION_LABEL_CHARS]}..."
            f"(+{len(name) - MAX_OPERATION_LABEL_CHARS} characters)")


def _operation(call: Call) -> dict[str, object]:
    """An event's ``operation`` field: the call's tool, endpoint or model, when it has one."""
    return {} if call.operation is None else {"operation": call.operation}


def _completed(rt: Runtime, route: Route, call: Call, outcome: Outcome,
               admitted_at: float | None, timed: bool, finished: Outcome | None = None) -> None:
    """Count and log a call that was not refused or replayed, once its holdings are given
    back: its ``completed`` event.

    ``admitted_at``: monotonic seconds at its admission, the start of the event's
    ``duration_s``; ``None`` for a call that ended before it (the caller left, the drain cut
    it), whose event has no ``duration_s`` but, if it queued, ``waited_s`` (seconds queued).
    ``timed``: its duration is a sample of the upstream's (an MCP stream's is the session's
    length). ``finished``: what the call's exchange came to when it was finished after its
    caller left (``outcome`` is then the caller's, ``client_disconnected``): the event says
    so in ``finished_after_leaving`` (that outcome) and ``finished_status`` (the upstream's
    status, 0 if none), and ``sluice_finished_after_leaving_total`` counts it.
    """
    fields: dict[str, object]
    if admitted_at is not None:
        elapsed = time.monotonic() - admitted_at
        fields = {"status": outcome.status, "outcome": outcome.label,
                  "duration_s": round(elapsed, 6)}
    else:
        elapsed = 0.0
        fields = {"status": outcome.status, "outcome": outcome.label}
        if call.enqueued_at is not None:
            waited = time.monotonic() - call.enqueued_at
            fields["waited_s"] = round(waited, 6)
            # The waits that ended in no admission count too: the longest waits (queue
            # timeouts) were the ones the queue-wait alert never saw (a trial).
            route.metrics.queue_wait.observe(waited)
    metrics = route.metrics
    if timed:
        metrics.upstream_duration.observe(elapsed)
    metrics.outcomes[outcome.label].inc()
    if finished is not None:
        label = finished.label
        if call.cancelled is not None and label[0].isdigit() and cancelled_at_server(call):
            label = "cancelled"  # its server stopped it, as its run's cancel asked
        fields["finished_after_leaving"] = label
        fields["finished_status"] = finished.status
        metrics.finished_after_leaving(label)
    charged = call.charged
    if charged is not None:
        fields.update(charged)
    if call.operation is not None:
        fields["operation"] = call.operation
        series = metrics.operation(call.operation)
        series.outcome(outcome.label)
        if timed:
            series.duration.observe(elapsed)
        if call.operation_cost is not None:
            series.cost.inc(call.operation_cost)
            metrics.tenant(call.tenant).cost.inc(call.operation_cost)
            fields["operation_cost_usd"] = call.operation_cost
            if call.operation_overrun:
                fields["over_reservation_usd"] = call.operation_overrun
                metrics.usage_over_reservation.inc()
    if call.rpc_method is not None:
        fields["mcp_method"] = call.rpc_method
    task = call.task
    if task is not None:  # answered with a CreateTaskResult: how its task was seen to end
        fields["task_id"] = task.task_id
        fields["task_end"] = task.ended or "not_held"
        if task.status is not None:
            fields["task_status"] = task.status
    if charged is not None:
        tenant = metrics.tenant(call.tenant)
        if charged["input_tokens"]:
            tenant.input_tokens.inc(charged["input_tokens"])  # type: ignore[arg-type]
        if charged["output_tokens"]:
            tenant.output_tokens.inc(charged["output_tokens"])  # type: ignore[arg-type]
        if charged["cost_usd"]:
            tenant.cost.inc(charged["cost_usd"])  # type: ignore[arg-type]
        if charged["usage"] in ("estimated", "reserved"):
            metrics.usage_missing.inc()
        elif "over_reservation_tokens" in charged:
            metrics.usage_over_reservation.inc()
    rt.events.emit_record("completed", call.request_id, route.name, call.tenant, call.run,
                          call.idempotency_key, fields)


def _reject(rt: Runtime, route: Route, rejected: Rejected, request_id: str, tenant: str,
            run: str | None, rpc_method: str | None = None,
            rpc_id: mcp.RequestId | None = None) -> web.Response:
    """Refuse before the call is built: the refusal, and the request's ``rejected`` outcome
    (``rpc_id``: its MCP request's id, as read: ``None`` before the body is)."""
    route.metrics.outcomes["rejected"].inc()
    return refuse(rt, route, rejected, request_id, tenant, run,
                  mcp_method=rpc_method, rpc_id=rpc_id)


def _outlasts_drain(rt: Runtime, route: Route, call: Call) -> float | None:
    """The mean call time of ``call``'s operation or route (the longer), seconds, if ``call``,
    admitted from a queue while draining, would at that time still run when the drain cuts;
    else ``None`` (no queue, no call time observed yet, or time enough). A hostile trial: a
    call admitted 0.7 s before a 3 s drain's end, on a route of 1 s calls, reached the
    upstream only to be cut, charged its whole reservation (an MCP tool's side effect ran
    for nothing); refused instead, it is safe to retry on another replica."""
    if call.enqueued_at is None:
        return None
    op = (route.operations.by_name.get(call.operation)
          if route.operations is not None and call.operation is not None else None)
    # The slower of its operation's limiter and the route's, those that have seen a call end:
    # a slow tool queued on its own slot, on a route of fast calls (a review).
    means = [limiter.mean_service_s for limiter in (op and op.concurrency, route.concurrency)
             if limiter is not None and limiter.observed]
    if not means:
        return None
    mean_s = max(means)
    return mean_s if rt.cut_before(time.monotonic() + mean_s) else None


def _drained(rt: Runtime, route: Route, call: Call,
             why: str = "the drain ended before this call was admitted") -> web.Response:
    """The answer to a call the drain ended before it was admitted (queued, waiting for a
    twin's answer or the shared state), or admitted too late to finish (``why`` says which):
    503 ``draining`` in the route's shape, counted and logged as a refusal (its holdings go
    back as any refusal's do, in the handler's ``finally``), and the connection closed,
    since the process is going away."""
    response = refuse(rt, route, Rejected(Reason.DRAINING, DRAINING_RETRY_AFTER_S,
                                          f"{why}; nothing was sent upstream"),
                      call.request_id, call.tenant, call.run, call.idempotency_key,
                      call.operation, call.rpc_method, call.rpc_id)
    response.force_close()
    return response


def _named_by_cancel(call: Call, route: Route, tenant: str, session: str,
                     rpc_id: mcp.RequestId) -> bool:
    """Whether a client's ``notifications/cancelled`` of ``rpc_id`` names ``call``: an MCP
    call of the same route, tenant and session (``Mcp-Session-Id``) with that JSON-RPC id as
    sent (``7`` and ``"7"`` differ)."""
    return (call.rpc_id == rpc_id and type(call.rpc_id) is type(rpc_id)
            and call.route == route.name and call.tenant == tenant
            and call.headers.get(mcp.SESSION_HEADER) == session)


def _call_to_hold(rt: Runtime, route: Route, tenant: str, session: str,
                  request_id: mcp.RequestId) -> Call | None:
    """The call a client's ``notifications/cancelled`` would stop that Sluice lets run on
    instead (:func:`_hold_cancel`), or ``None`` to forward the cancel as any notification:
    a ``tools/call`` the cancel names (:func:`_named_by_cancel`) whose answer is kept for its
    key (``dedup``), and which is still in flight through Sluice with its response not
    come: its handler running, being finished after its caller left, or held for its
    response after its answer was closed early for polling; not one whose tool waits on
    the client that cancels it (an elicitation it has not answered:
    :attr:`policies.mcp.AnswerTracker.awaits_client`), which held would never end.
    Cancels are rare: a scan of the MCP calls in flight at cancel time keeps this off the
    path of every other request."""
    for call in itertools.chain(rt.mcp_calls, rt.finishing.values(), rt.polling.values()):
        if (call.capture is None or call.cancelled is not None
                or not _named_by_cancel(call, route, tenant, session, request_id)):
            continue
        return call if kept_for_retry(call) else None
    return None


def _waiting_call(rt: Runtime, route: Route, tenant: str, session: str,
                  rpc_id: mcp.RequestId) -> tuple[Call, asyncio.Task[Any]] | None:
    """The call a client's ``notifications/cancelled`` ends in Sluice (:func:`_end_waiting`),
    with the task that waits, or ``None``: a call the cancel names (:func:`_named_by_cancel`)
    still in admission (queued for a slot or a run's width, waiting for a twin's answer or
    the shared state), so that the upstream has not seen it, or waiting out a retry
    back-off (:attr:`Runtime.backing_off`), its last attempt answered with a failure, so
    that nothing of it runs at the upstream: forwarded, the cancel named nothing there
    (202), and the next attempt ran the tool its client had given up on (a review). Not a
    back-off the drain's cut has woken (it answers the call). Cancels are rare: a scan of
    those calls keeps this off the path of every other request."""
    for call, task in rt.admitting.items():
        if not task.done() and _named_by_cancel(call, route, tenant, session, rpc_id):
            return call, task
    if rt.cutting:
        return None
    for call, task in rt.backing_off.items():
        if not task.done() and _named_by_cancel(call, route, tenant, session, rpc_id):
            return call, task
    return None


def _end_waiting(rt: Runtime, route: Route, call: Call, task: asyncio.Task[Any],
                 request_id: str, tenant: str, run: str | None) -> web.Response:
    """Answer request ``request_id``, a client's cancel of ``call`` (:func:`_waiting_call`),
    202 as an MCP server answers a notification, without forwarding it: the server never
    got the call, or answered its last attempt with a failure and waits for no other. Unless
    the call is being ended already (by an earlier cancel, or its run's), ``task`` is
    cancelled where it waits (the handler's, or the forward task of a call whose answer is
    kept for its key, which the handler awaits), and its handler answers it
    "Request cancelled" (:func:`policies.mcp.cancelled`), gives back what it held and counts
    it ``client_cancelled``; sent on, the call would have run once a slot freed, though its
    client had given up on it. Counted as ``sluice_requests_total{outcome="cancel_applied"}``
    and logged as a ``cancel_applied`` event naming the call (``call_request_id``)."""
    if call not in rt.cancelled_waiting and call.cancelled is None:
        rt.cancelled_waiting.add(call)
        task.cancel()
    route.metrics.outcomes["cancel_applied"].inc()
    rt.events.emit("cancel_applied", request_id, route.name, tenant, run, call.idempotency_key,
                   status=202, call_request_id=call.request_id, mcp_method=mcp.CANCELLED,
                   **_operation(call))
    return web.Response(status=202)


def _hold_cancel(rt: Runtime, route: Route, call: Call, request_id: str, tenant: str,
                 run: str | None) -> web.Response:
    """Answer a client's cancel of ``call`` (:func:`_call_to_hold`) as an MCP server answers
    a notification, 202 with no body, without forwarding it: the tool runs to its end and its
    answer is kept for the call's key, so that the client's retry (a timeout's cancel is
    mostly followed by one) gets that answer instead of running the tool a second time, as it
    did when the server stopped the tool after its side effect. Counted as
    ``sluice_requests_total{outcome="cancel_held"}`` and logged as a ``cancel_held`` event
    carrying the call's key and ``call_request_id``."""
    route.metrics.outcomes["cancel_held"].inc()
    if call in rt.polling.values():  # held for its polled answer, which its client won't fetch
        attempts.fetch_held_answer(rt, route, call)
    rt.events.emit("cancel_held", request_id, route.name, tenant, run, call.idempotency_key,
                   status=202, call_request_id=call.request_id, mcp_method=mcp.CANCELLED,
                   **_operation(call))
    return web.Response(status=202)


def _replay(rt: Runtime, route: Route, call: Call, replay: Replay) -> web.Response:
    """Count, log as an event, and answer with the stored response of the key's first use,
    or with the failure of the twin it waited for (its event then says ``failure: true``)."""
    record = replay.record
    route.metrics.replays.inc()
    route.metrics.outcomes["replayed"].inc()
    failure: dict[str, bool] = {}
    if replay.failure:
        route.metrics.failure_replays.inc()
        failure["failure"] = True
    rt.events.emit("replayed", call.request_id, route.name, call.tenant, call.run,
                   call.idempotency_key, status=record.status, bytes=len(record.body),
                   waited_s=round(replay.waited_s, 6), **call.event_names(), **failure)
    return replay_response(record)
