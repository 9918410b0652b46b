"""The admission pipeline: one call context, one policy interface, one place that gives back.

Every policy of a route (idempotency, circuit breaker, rates, token accounting and budgets,
concurrency and its queue, and those to come) implements :class:`Policy`: ``admit(call)``
either refuses the call by raising :class:`~policies.reasons.Rejected`, or lets it pass and
returns what it now *holds* for the call (a :class:`Holding`: a slot, a rate unit, a budget
reservation, an idempotency key), or ``None`` when it holds nothing.

:class:`Admission` runs a route's policies in order and keeps every holding the moment it is
returned. Whatever ends the call (a later policy's refusal, the upstream's answer, an
exception from anywhere, the caller's cancellation at any ``await``), the request path calls
:meth:`Admission.release` once, in one ``finally``, with the call's :class:`Outcome`; it gives
every holding back in reverse order, exactly once. No branch releases anything by hand
(structured release, as ``contextlib.AsyncExitStack`` or Envoy's ``onDestroy``).

The contract a policy keeps so that nothing can leak: ``admit`` takes its holding as its
*last* step, with no ``await`` and nothing that can raise between taking it and returning it;
if it raises (``Rejected``, ``CancelledError`` or anything else), it holds nothing. A
holding's ``release`` never awaits and never raises for an outcome it does not expect.

This module knows nothing of HTTP servers or metrics: a policy reports what the request path
should log through :attr:`Call.notify` (e.g. ``enqueued``), and the path reads what policies
leave on the call (the body to send, the idempotency key, the usage charged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from policies.bodies import LargeBodies
    from policies.mcp import Message

log = logging.getLogger("sluice")


def _ignore(call: Call, event: str, fields: dict[str, Any]) -> None:
    return None


#: Sluice ends a call's waits (a queue, a twin's answer) this share of the caller's own
#: timeout early, at most :data:`CALLER_LEAD_MAX_S` (:meth:`Call.wait_left`): the caller's
#: clock started when it sent the call, a little before Sluice read it, and a refusal due at
#: the very end lost the race to the SDK's own timeout (1 call in 6 at 2 s, a hostile
#: trial), whose retry then came back as new work. The attempt, the time left told
#: upstream and what a run's calls inherit keep the caller's whole timeout.
CALLER_LEAD = 0.1
CALLER_LEAD_MAX_S = 0.25


class Call:
    """Everything about one call, from the request's arrival to its outcome.

    Set by the request path before admission:
        request_id, route, method, path (path and query as received, prefix included),
        headers (the caller's, read-only), body (bytes; a policy may replace it, e.g. the
        accounting's rewritten body), tenant, run (``None`` without a run id), priority
        (0 critical, 1 standard, 2 best-effort), priority_given (the caller named it;
        else a run may inherit its parent's), timeout (the caller's own timeout in
        seconds, ``None`` if it sent none), timeout_reads (that timeout is a read timeout,
        the Stainless SDKs': it bounds the wait for the answer's first byte, not the whole
        call as a deadline does), parent_run (the parent run named by the caller,
        ``None`` for none), operation (the tool, endpoint or model a per-operation policy
        keys on; ``None`` for none), client_retry (the caller's SDK says this request is its
        own retry: ``x-stainless-retry-count`` > 0), rpc_id (the JSON-RPC id of an MCP
        POST's one request as sent, ``None`` for anything else), rpc_method (the JSON-RPC
        method of an MCP POST's one request or notification, e.g. ``initialize``; ``None``
        for anything else), received_at (monotonic seconds).

    Left by policies for the request path:
        idempotency_key: the key, for events; upstream_key: the ``Idempotency-Key`` value to
        send upstream on every attempt; capture: fed the relayed answer for the idempotency
        store; meter: reads the answer's usage; new_unit: a new unit of work
        (``sluice_work_units_total``); enqueued_at: monotonic seconds when it joined a queue;
        charged: the ``completed`` event's usage fields, set when the charge settles;
        lineage: the run's ancestors, parent first (``policies/runs.py``); cost: what the
        call is expected to cost the upstream in tokens (its reservation), when known, for
        fair queueing; response_headers: headers a policy adds to the upstream's answer
        (e.g. a run budget's warning); phase: ``admitting``, ``queued``, ``forwarding``, or
        ``answering`` once the answer's status line is being sent to the caller (a call ended
        after that can only be cut);
        cancelled: why the call's run was cancelled, once it was (its task is then
        cancelled, or its ``background`` task if it has one); attempts: upstream attempts
        sent; progress_at: monotonic seconds of the last byte moved for it (stall
        detection); operation_cost: USD an operation's ``cost_per_call`` /
        ``cost_per_second`` charged for it, set when its cost settles; operation_overrun:
        USD of that cost past what was held for it before forwarding (retries'
        ``cost_per_call``, ``cost_per_second``), 0.0 for none;
        units_deferred: the rate step left the call's request units to the accounting step
        (:attr:`policies.rate.RateLimiter.metered_elsewhere`), which takes them: decided once
        per call, as a reload may change the flag between the two steps.

    Set by the forwarder: status, the status line being relayed to the caller (0 before);
    reached, whether an attempt may have reached the upstream (from the moment one is sent;
    false again only if :func:`proxy.forward.left` shows it never left, and no earlier one
    may have), which decides what a call that ends without an answer is charged;
    answer_status, how the latest attempt ended, for what it may have cost: its answer's
    status, :data:`SENT_UNANSWERED` when it may have reached the upstream and got no answer
    (a timeout, a connection lost after sending, the caller gone while waiting), 0 when none
    was sent or it never left; unanswered, how many earlier attempts (a later one followed)
    ended :data:`SENT_UNANSWERED`: each may have been billed in full; unsent, attempts shown
    never to have left (a refused connection);
    answered_at, when the last attempt's response headers arrived (monotonic seconds, 0.0
    before); background, the task that finishes the call's upstream exchange after its
    caller left, or that holds it for its response after its answer was closed early for
    polling (``proxy.handler``; ``None`` while the caller is there); stop, what a run's
    cancel calls instead of cancelling the call's task, when set: a call finished after its
    caller left, whose cancel Sluice sends to its MCP server while it waits for the server's
    answer (``proxy.handler``; ``None`` otherwise); relaying, the task
    relaying the call's answer once its last message has gone to the caller
    (``proxy.forward.delivered``), which a drain ends rather than waits for (``None``
    before); polled, an MCP call's answer the upstream closed early for polling
    (``proxy.runtime.Polled``), whose end is then its response resumed on a GET
    (``proxy.handler`` holds it until then; ``None`` otherwise); task_asked, an MCP
    ``tools/call`` asking to run as a task (``params.task``) that holds a place for its
    task (``proxy.mcp_tasks.Tasks.reserve``), until its task is held or the place given
    back; task, the task its
    ``CreateTaskResult`` made (``proxy.mcp_tasks.HeldTask``), whose end is then the call's
    (``proxy.handler`` holds it until then; ``None`` otherwise); the upstream time of its
    attempts (:meth:`attempt_sent`, :meth:`attempt_over`, :meth:`attempt_unsent`,
    :meth:`upstream_seconds`).

    A policy reports a step for the timeline (e.g. ``enqueued``) with
    :meth:`notify`, which hands it to ``reporter(call, event, fields)`` (default: ignored);
    the request path passes one reporter per route, so no call builds a closure.
    """

    __slots__ = ("_sent_at", "_upstream_s", "answer_status", "answered_at", "attempts",
                 "background", "body",
                 "cancelled", "capture", "charged", "client_retry", "cost", "counted_by",
                 "enqueued_at",
                 "headers", "idempotency_key", "lineage", "meter", "method", "model",
                 "new_unit", "operation",
                 "operation_cost", "operation_overrun", "parent_run", "parsed", "path", "phase",
                 "polled", "priority", "priority_given", "progress_at", "reached",
                 "received_at",
                 "relaying",
                 "reporter", "request_id", "response_headers", "route", "rpc_id",
                 "rpc_method", "run",
                 "status", "stop", "task", "task_asked",
                 "tenant", "timeout", "timeout_reads", "unanswered", "units_deferred",
                 "unsent", "upstream_key")

    def __init__(self, *, request_id: str, route: str, method: str, path: str,
                 headers: Mapping[str, str], body: bytes, tenant: str, run: str | None = None,
                 priority: int = 1, timeout: float | None = None, operation: str | None = None,
                 reporter: Callable[[Call, str, dict[str, Any]], None] = _ignore,
                 parent_run: str | None = None, priority_given: bool = True,
                 client_retry: bool = False, timeout_reads: bool = False,
                 rpc_id: int | str | None = None, rpc_method: str | None = None) -> None:
        self.request_id = request_id
        self.route = route
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.tenant = tenant
        self.run = run
        self.priority = priority
        self.timeout = timeout
        self.timeout_reads = timeout_reads
        self.operation = operation
        self.reporter = reporter
        self.parent_run = parent_run
        self.priority_given = priority_given
        self.client_retry = client_retry
        self.rpc_id = rpc_id
        self.rpc_method = rpc_method
        self.received_at = time.monotonic()
        self.lineage: tuple[str, ...] = ()
        self.cost: float | None = None
        self.response_headers: dict[str, str] | None = None
        self.phase = "admitting"
        self.cancelled: str | None = None
        self.attempts = 0
        self.progress_at = self.received_at
        self.idempotency_key: str | None = None
        self.upstream_key: str | None = None
        self.capture: Any = None
        self.meter: Any = None
        #: The model a ``models:`` route read for it, once (Azure's deployment, else the
        #: body's; ``""``: none), for the accounting; ``None``: not read.
        self.model: str | None = None
        #: An MCP call's request as the request path parsed it, for the idempotency step's
        #: fingerprint, with the turns to take for a large body (``None`` for a small one):
        #: so a body is parsed once. The step takes it off the call (``None`` again), so the
        #: parsed tree is freed before the call queues; ``None``: not handed over.
        self.parsed: tuple[Message, LargeBodies | None] | None = None
        #: The route limiter that already counts this call among its tenant's (an operation's
        #: slot counts it there while it waits: :class:`policies.concurrency.OperationSlot`),
        #: whose own step then neither checks nor counts it again; else ``None``.
        self.counted_by: Any = None
        self.new_unit = True
        self.units_deferred = False
        self.enqueued_at: float | None = None
        self.charged: dict[str, object] | None = None
        self.operation_cost: float | None = None
        self.operation_overrun = 0.0
        self.status = 0
        self.reached = False
        self.answer_status = 0
        self.unanswered = 0
        self.unsent = 0
        self.answered_at = 0.0
        self.background: asyncio.Task[Any] | None = None
        self.stop: Callable[[], None] | None = None
        self.relaying: asyncio.Task[Any] | None = None
        self.polled: Any = None
        self.task_asked = False
        self.task: Any = None
        self._upstream_s = 0.0
        self._sent_at: float | None = None

    def time_left(self) -> float | None:
        """Seconds left of the caller's own timeout (counted from the call's arrival: its
        queueing spends them), or ``None`` when it sent none; may be 0 or less."""
        if self.timeout is None:
            return None
        return self.timeout - (time.monotonic() - self.received_at)

    def wait_left(self) -> float | None:
        """Seconds this call may still wait before it is sent (a queue, a twin's answer):
        :meth:`time_left` less Sluice's lead on the caller's timeout (:data:`CALLER_LEAD`),
        so that a refusal reaches the caller before its own timeout fires; ``None`` when it
        sent none."""
        if self.timeout is None:
            return None
        return self.time_left() - min(self.timeout * CALLER_LEAD, CALLER_LEAD_MAX_S)

    def event_names(self) -> dict[str, str]:
        """The fields of this call's events that name what it is, those it has:
        ``operation`` (its tool, endpoint or model) and ``mcp_method`` (an MCP POST's
        JSON-RPC method)."""
        fields: dict[str, str] = {}
        if self.operation is not None:
            fields["operation"] = self.operation
        if self.rpc_method is not None:
            fields["mcp_method"] = self.rpc_method
        return fields

    def notify(self, event: str, fields: dict[str, Any]) -> None:
        """Report a step of this call for the timeline: ``event`` with ``fields``."""
        self.reporter(self, event, fields)

    def attempt_sent(self, at: float) -> None:
        """An upstream attempt is being sent at ``at`` (monotonic seconds); an earlier one
        still open ends there."""
        self.attempt_over(at)
        self._sent_at = at

    @property
    def sent_at(self) -> float | None:
        """When the open attempt (the one whose answer is being relayed) was sent, monotonic
        seconds; ``None`` when none is open."""
        return self._sent_at

    def attempt_over(self, at: float) -> None:
        """The open attempt, if any, ended at ``at``: failed, or its answer let go."""
        if self._sent_at is not None:
            self._upstream_s += max(at - self._sent_at, 0.0)
            self._sent_at = None

    def attempt_unsent(self) -> None:
        """The open attempt never left (a refused connection): its time is no upstream time."""
        self._sent_at = None

    def upstream_seconds(self, now: float) -> float:
        """Seconds the upstream spent on this call: each attempt from its sending to its end,
        the one still open (the answer being relayed) up to ``now``."""
        open_s = now - self._sent_at if self._sent_at is not None else 0.0
        return self._upstream_s + max(open_s, 0.0)


#: :attr:`Call.answer_status` of an attempt that may have reached the upstream and got no
#: answer.
SENT_UNANSWERED = -1


class Outcome:
    """How a call ended, as every holding's ``release`` is told.

    Attributes:
        label: the ``sluice_requests_total`` outcome (``2xx`` ... ``5xx``, ``rejected``,
            ``replayed``, ``upstream_error``, ``upstream_timeout``, ``client_disconnected``,
            ``client_cancelled``, ``drain_cut``).
        reached: the request may have reached the upstream (an attempt was sent, or its
            sending could not be shown not to have left). ``False`` means the upstream never
            saw it: whatever was taken for it is given back in full.
        status: the status the caller was sent, 0 if none.
        service_s: admission to completion in seconds when the upstream answered (a sample
            for service-time estimates), else ``None``.
        first_byte_s: admission to the upstream's response headers in seconds when it
            answered (what a caller's read timeout must cover besides the queue), else
            ``None``.
    """

    __slots__ = ("first_byte_s", "label", "reached", "service_s", "status")

    def __init__(self, label: str, reached: bool, status: int = 0,
                 service_s: float | None = None, first_byte_s: float | None = None) -> None:
        self.label = label
        self.reached = reached
        self.status = status
        self.service_s = service_s
        self.first_byte_s = first_byte_s

    def __repr__(self) -> str:
        return f"Outcome({self.label!r}, reached={self.reached}, status={self.status})"


#: The call was refused (by a policy, before anything reached the upstream).
REFUSED = Outcome("rejected", reached=False)
#: The caller left, or something failed, before anything reached the upstream.
ABANDONED = Outcome("client_disconnected", reached=False)
#: Its MCP client cancelled it (``notifications/cancelled``) before it was admitted: answered
#: (HTTP 200) with the JSON-RPC error "Request cancelled", nothing sent upstream.
CLIENT_CANCELLED = Outcome("client_cancelled", reached=False, status=200)
#: The drain cut the call before it was admitted, its connection already gone (one still there
#: is refused 503 ``draining`` instead: ``proxy.handler``).
DRAIN_CUT = Outcome("drain_cut", reached=False)


class Holding(Protocol):
    """What a policy holds for an admitted call until it ends."""

    def release(self, outcome: Outcome) -> None:
        """Give it back, once, knowing how the call ended. Never awaits."""
        ...


class Policy(Protocol):
    """One admission step (see the module docstring for the contract)."""

    async def admit(self, call: Call) -> Holding | None:
        """Let ``call`` pass, returning what is now held for it, or refuse it.

        Raises:
            Rejected: the call is refused now; nothing is held.
        """
        ...


T = TypeVar("T")


async def survive_leaving(
        step: Awaitable[T], late: Callable[[T], None],
        spawn: Callable[[Awaitable[T]], asyncio.Future[T]] = asyncio.ensure_future) -> T:
    """Await a shared-state ``step`` (a Redis script that takes something) so that the caller
    leaving does not lose what it took: the step runs to its end whatever happens to the
    caller, and ``late`` gets its result then, to give back what it took. ``spawn`` runs the
    step (e.g. a policy's own, so that shutdown waits for it).

    Raises:
        asyncio.CancelledError: the caller left; ``late`` is called once the step ends (not
            if it failed).
    """
    task = spawn(step)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(
            lambda done: late(done.result())
            if not done.cancelled() and done.exception() is None else None)
        raise


class Admission:
    """The holdings of one call: taken in policy order, given back in reverse, exactly once."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: list[Holding] = []

    async def admit(self, policies: Sequence[Policy], call: Call) -> None:
        """Run ``policies`` in order on ``call``; on return every one has admitted it.

        Raises:
            Rejected: a policy refused; what earlier ones took stays held until
                :meth:`release`, which the caller runs in its ``finally``.
        """
        held = self._held
        for policy in policies:
            holding = await policy.admit(call)
            if holding is not None:
                held.append(holding)

    def hold(self, holding: Holding) -> None:
        """Keep a holding taken outside :meth:`admit` (e.g. the route's in-flight count)."""
        self._held.append(holding)

    def release(self, outcome: Outcome) -> None:
        """Give every holding back, newest first, telling each ``outcome``. Never awaits;
        calling it again does nothing. A holding that raises is logged and the rest still
        run: one faulty release must not keep the others held."""
        held, self._held = self._held, []
        for holding in reversed(held):
            try:
                holding.release(outcome)
            except Exception:
                log.exception("releasing %r failed", holding)
