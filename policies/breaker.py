"""One circuit breaker per route upstream, shared by every replica (config key ``circuit_breaker``).

States (Nygard, "Release It!"; Resilience4j's names): **closed** lets attempts through and
counts their outcomes; **open** answers 503 ``circuit_open`` at once, with ``Retry-After`` =
the time left until half-open plus a random share of up to one ``reset_timeout`` (so refused
callers do not all return at the same instant), never past the SDKs' 60 s cap when the
half-open is due within it (see :meth:`Breaker._rejection`), and calls
nothing upstream; **half-open** lets exactly one probe through at a time, across every
replica, and ``success_threshold`` successful probes in a row close it again while a failed
probe opens it for another ``reset_timeout``. Like Resilience4j's default, the move from open
to half-open happens on the first attempt after the wait, not on a timer.

What the breaker hears about an attempt (:func:`classify`):

* **failure**: a connect error, a timeout of the attempt's own time limit, a 5xx, or a 429
  without rate-limit headers (no ``Retry-After``/``RateLimit``/reset field: the provider gave
  no sign this is a quota and not a fault).
* **success**: any other answer, including 4xx caused by the request (400, 401, 404, 413, 422),
  so one tenant's bad requests never open the breaker for the others (Envoy admission control:
  success = status < 500).
* **nothing** (neutral): the caller's own cancellation or deadline, a 429 *with* rate-limit
  headers (a quota, which says nothing about health), and every answer Sluice writes itself
  (those never reach an attempt).
* a **stream** (an LLM call that asked for one, answered 2xx) is judged once it has ended
  (:func:`classify_stream`): one the upstream ended with an error event after HTTP 200 is a
  failure when the event names a server-side fault (Anthropic's ``overloaded_error``,
  ``api_error``; OpenAI's ``server_error``), neutral when it names a rate limit, and a
  success when it names the request's own (``invalid_request_error``), as the status it
  stands for would be (:func:`policies.usage.stream_error_side`). A half-open probe's stream
  is judged by its status line instead, and its failure (only) heard again at its end: it
  opens the breaker anew unless the breaker has moved on or heard a success since
  (:meth:`Breaker.record`).

Trips: ``fail_max`` consecutive failures, or, when ``rate`` is set, a failure rate ``>= rate``
over the last ``window`` seconds once ``min_calls`` outcomes are in it (Resilience4j's
TIME_BASED sliding window and ``minimumNumberOfCalls``, see ``shared/notes/infra-semantics.md``
§3.2). An upstream ``Retry-After`` on a 429 or 503 that arrives while the breaker is open
extends the open time to at least that long (capped at ``MAX_OPEN_HINT_S``), and never
shortens it. Outcomes of attempts admitted before the last state change are dropped (a stale
closed-state failure would otherwise re-open a half-open breaker).

**Where the state lives**: the machine is :mod:`policies.state.breaker`'s, in the route's
state backend (``route.backends.breakers``): this process's memory, or Redis shared by every
replica, so a breaker opened through one replica refuses on the others, and the half-open
probe is one lease for all of them. Per attempt, on Redis:

* :meth:`Breaker.attempt` is answered from this replica's cached view while that view says
  *closed* and is younger than ``VIEW_FRESH_S`` (no round trip); otherwise it asks Redis (one
  script call), which is also how an open breaker's end and the probe are decided (while
  one attempt asks about a closed view, the others keep to it until the answer). Every
  reply refreshes the view, so a breaker opened anywhere refuses here within
  ``VIEW_FRESH_S`` plus one call;
* :meth:`Breaker.record` is one script call for a failure, a probe's outcome, or a neutral
  outcome that carries an upstream ``Retry-After`` or frees a probe lease; the others cost
  none of their own: a neutral outcome of a non-probe attempt (the common cancellation)
  counts for nothing, and a success admitted while closed is counted on this replica and
  delivered inside this breaker's next script, or by a flush at most ``FLUSH_S`` (0.25 s)
  later, one round trip for every success since (:meth:`BreakerStates.defer`; what the
  delay changes and why it is safe: :mod:`policies.state.breaker`). So a call admitted
  while closed and answered well costs the breaker no round trip, save a view refresh every
  ``VIEW_FRESH_S`` and a flush every ``FLUSH_S`` shared by every call meanwhile.

**The probe's lease** lasts ``state.lease`` (``StateBackends.lease_s``), and the replica
whose attempt is the probe renews it every third of that while the attempt runs
(:class:`_Renewal`, started in :meth:`Breaker.attempt` and stopped by :meth:`Breaker.record`,
:meth:`Breaker.release` or :meth:`Breaker.record_soon`, whichever ends the probe). So a probe
longer than a lease (an LLM call with no response headers yet) keeps it and no second probe
passes, while a replica killed mid-probe stops renewing and another may probe at most one
lease later, whatever ``reset_timeout`` is (a fixed 30 s lease refused every replica for
30 s, and let a second probe through after 30 s). A probe whose task ends without an outcome
(nothing left to record it) is no longer renewed either, on memory as on Redis. Renewals are
one script each, only while half-open; a closed breaker starts none.

``sluice_circuit_state`` and the admin page read the cached view. ``/metrics`` first
refreshes the views older than ``VIEW_FRESH_S`` (:meth:`Breaker.refresh_stale`, one script
each), so the gauge follows any replica's transition, opening or closing, within
``VIEW_FRESH_S`` of a scrape; the admin page (and a gauge read outside a scrape) gets a
stale view refreshed in the background, for the next read.

When the backend does not answer (:class:`~policies.state.StateUnavailable`):
``state.on_unavailable: local`` decides from this replica's own memory breaker until Redis
answers again (its outcomes are not merged back: a breaker's history is short-lived), and
``reject`` refuses the attempt 503 ``state_unavailable``. An outcome that cannot be written is
dropped (logged; deferred successes at debug level, as they could only have lowered a
failure rate or reset a run of failures: losing them leans towards opening): the upstream's
answer still reaches its caller.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, NamedTuple, TypeVar

from policies.config import CircuitBreakerConfig
from policies.logs import PER_CALL
from policies.pipeline import Call, survive_leaving
from policies.rate import Background
from policies.reasons import SDK_RETRY_AFTER_CAP_S, Reason, Rejected
from policies.state import BreakerStates, StateBackends, StateUnavailable, memory_backends
from policies.state.breaker import (
    CLOSED,
    CLOSED_AGAIN,
    FAILURE,
    FLUSH_S,
    HALF_OPEN,
    HALF_OPENED,
    NEUTRAL,
    OPEN,
    OPENED,
    PROBE_FAILED,
    STATE_NAMES,
    SUCCESS,
    BreakerParams,
    Ticket,
    Verdict,
)
from policies.usage import CLIENT, SERVER

__all__ = ["FAILURE", "MAX_OPEN_HINT_S", "NEUTRAL", "PROBE_RETRY_AFTER_S", "SUCCESS",
           "Breaker", "Pass", "classify", "classify_stream"]

log = logging.getLogger("sluice")

T = TypeVar("T")

#: Wait while a half-open probe is in flight (its answer is typically a second or so away),
#: before the spread :meth:`Breaker._rejection` adds.
PROBE_RETRY_AFTER_S = 1.0
#: Longest open time an upstream Retry-After can ask for, seconds (Envoy's 300 s caps on
#: rate-limited back-off and on outlier ejection time).
MAX_OPEN_HINT_S = 300.0
#: How long a replica trusts its cached view of a shared breaker, seconds: a breaker opened
#: through another replica refuses here at most this long (plus one call) later.
VIEW_FRESH_S = 0.5
#: How often a probe's outcome (or its lease's give-back) that Redis could not take is sent
#: again, seconds: until it lands (or the lease, no longer renewed, lapses), the probe's lease
#: keeps every replica refusing.
PROBE_RESEND_S = 0.25

#: Fields that tell a 429 is a quota answer rather than a fault.
_RATE_LIMIT_HEADERS = (
    "retry-after",
    "retry-after-ms",
    "ratelimit",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-reset",
)


def classify_stream(stream_error: str | None) -> int:
    """What a 2xx stream tells the breaker once it has ended, by the error event it may have
    ended with (:attr:`policies.usage.Meter.stream_error`, whose fault the event says it
    is): FAILURE for the server's (an ``overloaded_error`` or ``api_error`` after HTTP 200,
    as a 5xx), NEUTRAL for a rate limit (as a 429 with rate-limit headers), SUCCESS for the
    request's own (``invalid_request_error``, as a 400) or for none."""
    if stream_error is None or stream_error == CLIENT:
        return SUCCESS
    return FAILURE if stream_error == SERVER else NEUTRAL


def classify(status: int, headers: Mapping[str, str]) -> int:
    """What an upstream answer with ``status`` tells the breaker: SUCCESS, FAILURE or NEUTRAL."""
    if status < 429:
        return SUCCESS
    if status == 429:
        if any(name in headers for name in _RATE_LIMIT_HEADERS):
            return NEUTRAL
        return FAILURE
    return FAILURE if status >= 500 else SUCCESS


class Pass(NamedTuple):
    """Permission for one attempt (from :meth:`Breaker.attempt`): the breaker state it was
    admitted from (shared, or this replica's during an outage) and its ticket there; or,
    ``after`` set, what :meth:`Breaker.record` returns for a half-open probe's success, to
    report the same answer's failure found later with (its ticket then names the epoch that
    success left the breaker in)."""

    states: BreakerStates
    ticket: Ticket
    after: bool = False


class Breaker:
    """The breaker of one route.

    Per attempt: ``ticket = await attempt()`` (raises ``Rejected``), then exactly one of
    ``await record(ticket, outcome, status, retry_after)`` or ``release(ticket)`` (neutral
    outcome, e.g. the caller went away; never awaits); a half-open probe's success may be
    followed by one more ``record`` of the pass it returned, once its answer (a stream) has
    been read. ``check()`` is the same test as
    ``attempt()`` from the cached view, taking nothing, for refusing a call before it queues
    (the pipeline step :meth:`admit`).

    Args:
        config: the route's ``circuit_breaker`` block.
        route: the route's name, for events and messages, and the breaker's name in the state
            backend (replicas share a route's breaker by its name).
        on_event: called as ``on_event(event, **fields)`` on every transition this replica's
            call caused (``circuit_opened``, ``circuit_half_open``, ``circuit_closed``).
        backends: the route's state (default: this process's memory).
    """

    def __init__(self, config: CircuitBreakerConfig, route: str,
                 on_event: Callable[..., None], backends: StateBackends | None = None) -> None:
        self.route = route
        self._on_event = on_event
        self._backends = backends if backends is not None else memory_backends()
        self.reconfigure(config)
        self._shared = self._backends.redis is not None
        # The cached view (monotonic seconds): what check(), the gauge and the admin read.
        self._state = CLOSED
        self._epoch = 0
        self._open_until = 0.0
        self._probing = False
        #: Until when (monotonic seconds) the probe the view saw may hold its lease: past it,
        #: the state lets another call probe, so the view no longer refuses for it.
        self._probe_until = 0.0
        self._cause = ""
        self._seen_at = -VIEW_FRESH_S  # stale until the first answer
        self._refreshing = False
        self._asking = False  # an attempt is asking the shared state about a closed view
        # attempt()'s test kept as one deadline (monotonic seconds, see _trust): until then
        # an attempt gets the closed view's pass, one object per epoch, without asking.
        self._trusted_until = -math.inf
        self._pass = Pass(self._backends.breakers, Ticket(self._epoch))
        #: Its own Redis calls that nobody awaits: shutdown waits for them.
        self._background = Background(self._backends)
        self._flushing = False  # a flush of deferred successes is scheduled
        #: The renewals of this breaker's probes in flight, by probe token (one, but for a
        #: probe taken from the local fallback during an outage beside a shared one).
        self._renewals: dict[str, _Renewal] = {}
        self._trust()
        # The state may be open already (a reload re-adding the block, another replica): the
        # gauge and the admin page read the view, so it is asked for at once.
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # built outside the server: the first scrape in it asks
            pass
        else:
            self._background.spawn(self._refresh())
            self._refreshing = True

    def reconfigure(self, config: CircuitBreakerConfig) -> None:
        """Adopt a reloaded ``circuit_breaker`` block, keeping the breaker's state: an open
        breaker stays open (the upstream is no healthier for an edit of the thresholds), and
        the new thresholds and timeouts apply from the next outcome and the next opening. The
        state is in the backend under the route's name in any case, so this object and every
        replica keep seeing it."""
        self.reset_timeout = config.reset_timeout
        self._params = BreakerParams(
            fail_max=config.fail_max, reset_s=config.reset_timeout,
            success_threshold=config.success_threshold,
            window_s=config.window if config.rate is not None else None,
            rate=config.rate if config.rate is not None else 1.0,
            min_calls=config.min_calls, probe_s=self._backends.lease_s)

    # -- the cached view ----------------------------------------------------------------------

    @property
    def current(self) -> str:
        """``closed``, ``open`` or ``half-open`` (as last seen)."""
        return STATE_NAMES[self._state]

    def state(self) -> dict[str, object]:
        """The breaker for the admin API (JSON-ready)."""
        return {"state": self.current, "blocked_for_s": round(self.blocked_for(), 3)}

    def state_value(self) -> int:
        """The state as ``sluice_circuit_state`` reports it: 0 closed, 1 half-open, 2 open.
        An open breaker whose open time has passed reads 1: its next attempt is let through
        as the probe (the state itself moves then, as no call may come for hours, and an
        alert on "open" would fire all that while).

        Never awaits; a stale view of a shared breaker is refreshed in the background.
        """
        if (self._shared or self._seen_at < 0) and not self._fresh() and not self._refreshing:
            try:
                self._background.spawn(self._refresh())
                self._refreshing = True
            except RuntimeError:  # no running loop (a scrape outside the server)
                pass
        if self._state == OPEN and time.monotonic() >= self._open_until:
            return HALF_OPEN
        return self._state

    def _fresh(self) -> bool:
        return time.monotonic() - self._seen_at < VIEW_FRESH_S

    async def refresh_stale(self) -> None:
        """Bring the cached view up to date when it is older than ``VIEW_FRESH_S`` (one
        script on Redis, bounded by ``state.timeout``; an unavailable backend leaves it as
        it was), for a reader about to report it: ``/metrics`` awaits this before it
        renders, so ``sluice_circuit_state`` is never older than ``VIEW_FRESH_S`` at a
        scrape. Refreshed only in the background, each scrape read what the one before had
        asked for: another replica's probe closing the breaker showed one to two scrape
        intervals late (1-2 s in a hostile trial), as nothing else asks while this
        replica's callers wait out a refusal's ``Retry-After``."""
        if (self._shared or self._seen_at < 0) and not self._fresh():
            self._refreshing = True
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            view = await self._backends.breakers.view(self.route)
        except StateUnavailable:
            return
        finally:
            self._refreshing = False
        self._see(view.state, view.epoch, view.open_for_s, view.probing, view.cause)

    def _see(self, state: int, epoch: int | None, open_for_s: float, probing: bool,
             cause: str) -> None:
        """Update the cached view; ``epoch`` ``None`` when the answer did not tell it (the
        view's state is then taken, but it is not fresh enough for admitting from it)."""
        now = time.monotonic()
        if probing and (not self._probing or now >= self._probe_until):
            # A probe seen anew: its lease is at most this long (its holder renews it).
            self._probe_until = now + self._params.probe_s
        self._state, self._probing, self._cause = state, probing, cause
        self._open_until = now + open_for_s if state == OPEN else 0.0
        if epoch is not None:
            if epoch != self._epoch:
                self._pass = Pass(self._backends.breakers, Ticket(epoch))
            self._epoch = epoch
            self._seen_at = now
        self._trust()

    def _trust(self) -> None:
        """Set until when :meth:`attempt` admits from the view without asking: while it says
        closed and is younger than ``VIEW_FRESH_S``, or while another attempt asks about it
        (``_asking``); never while it says open or half-open."""
        if self._state != CLOSED:
            self._trusted_until = -math.inf
        elif self._asking:
            self._trusted_until = math.inf
        else:
            self._trusted_until = self._seen_at + VIEW_FRESH_S

    def blocked_for(self) -> float:
        """Seconds until an attempt could be admitted as far as this replica knows; 0 when
        one would be now, or when only the shared state can tell (a probe in flight on
        another replica may have closed it since: :meth:`attempt` asks)."""
        if self._state == OPEN:
            return max(0.0, self._open_until - time.monotonic())
        if (self._state == HALF_OPEN and self._probing and not self._shared
                and time.monotonic() < self._probe_until):
            return PROBE_RETRY_AFTER_S
        return 0.0

    def check(self) -> None:
        """Refuse now if an attempt would be refused; takes nothing, never awaits.

        Raises:
            Rejected: ``circuit_open`` with the seconds until half-open (or until the probe
                in flight is likely done).
        """
        wait = self.blocked_for()
        if wait > 0:
            raise self._rejection(wait)

    async def admit(self, call: Call) -> None:
        """The pipeline step (:class:`policies.pipeline.Policy`): refuse a call before it
        queues or spends anything while no attempt would be let through (:meth:`check`).
        Holds nothing: each attempt is admitted on its own (:meth:`attempt`)."""
        if self._state != CLOSED:  # closed, blocked_for() is 0: nothing to check
            self.check()

    # -- attempts -----------------------------------------------------------------------------

    async def attempt(self) -> Pass:
        """Permission for one upstream attempt; the pass goes to ``record`` or ``release``.

        Moves an open breaker whose wait is over to half-open, and makes this attempt its
        probe (on Redis: the one probe of every replica).

        Raises:
            Rejected: ``circuit_open`` while open, or while another probe is in flight;
                ``state_unavailable`` when the shared state does not answer and
                ``state.on_unavailable`` is ``reject``.
            asyncio.CancelledError: the caller left; a probe lease it got is given back.
        """
        if time.monotonic() < self._trusted_until:
            # The view says closed and is fresh, or another attempt is asking about it: while
            # one attempt asks about a closed view gone stale, the others keep to it until
            # the answer (at most state.timeout): a busy replica would otherwise send every
            # attempt of that round trip to ask the same thing (measured: 11 at a time under
            # 16 connections, 0.03 round trips per call).
            return self._pass
        states = self._backends.breakers
        self._asking = self._state == CLOSED
        self._trust()
        try:
            admission = await self._shielded(states.admit(self.route, self._params),
                                             lambda a: self._give_back(states, a.ticket)
                                             if a.allowed else None)
        except StateUnavailable as exc:
            states = self._fallback(exc)
            admission = await states.admit(self.route, self._params)
        finally:
            self._asking = False
            self._trust()
        if states is self._backends.breakers:
            self._see(admission.state, admission.ticket.epoch, admission.wait_s
                      if admission.state == OPEN else 0.0,
                      admission.state == HALF_OPEN, admission.cause)
        if admission.transition == HALF_OPENED:
            self._on_event("circuit_half_open", route=self.route)
        if not admission.allowed:
            if admission.state == HALF_OPEN:
                raise self._rejection(PROBE_RETRY_AFTER_S, probing=True)
            raise self._rejection(admission.wait_s, cause=admission.cause)
        if admission.ticket.probe is not None:
            self._hold(states, admission.ticket)
        return Pass(states, admission.ticket)

    def _fallback(self, exc: StateUnavailable) -> BreakerStates:
        """This replica's own breaker state while the shared one is unavailable."""
        fallback = self._backends.fallback
        if fallback.mode == "reject":
            raise Rejected(Reason.STATE_UNAVAILABLE, exc.hint or PROBE_RETRY_AFTER_S,
                           f"route {self.route}: the circuit breaker's state is unavailable")
        return fallback.memory().breakers

    def _rejection(self, wait: float, *, probing: bool | None = None,
                   cause: str | None = None) -> Rejected:
        """503 ``circuit_open`` telling the caller to come back after ``wait`` seconds, spread.

        Every caller refused while open would otherwise be told the same instant (the SDKs
        honour ``retry-after-ms`` to the millisecond) and return together, where only one
        probe can pass: the rest are refused again and return together once more, and when
        the breaker closes the whole herd lands on the upstream at once (measured in
        ``bench/storm.py``: it re-opened the breaker on a healthy upstream). So the wait is
        never shorter than ``wait`` but gets a random share of up to one ``reset_timeout``
        (one ``PROBE_RETRY_AFTER_S`` while a probe is in flight): the refused callers come
        back spread over about as long as they arrived in.

        The spread never carries a wait the SDKs would honour (``wait`` at most
        :data:`~policies.reasons.SDK_RETRY_AFTER_CAP_S`, 60 s) past that cap: it is cut
        there, so ``x-should-retry`` stays ``true`` whenever the probe is due within it.
        Uncut, a ``reset_timeout`` of 40 s gave hints up to 78.5 s, and half the refused
        callers were told not to retry work a retry at about 40 s would have served.
        """
        if probing if probing is not None else (self._state == HALF_OPEN and self._probing):
            detail = "a probe is in flight"
            spread = wait + random.uniform(0, PROBE_RETRY_AFTER_S)
        else:
            detail = f"opened by {cause if cause is not None else self._cause}"
            spread = wait + random.uniform(0, self.reset_timeout)
        if wait <= SDK_RETRY_AFTER_CAP_S:
            spread = min(spread, SDK_RETRY_AFTER_CAP_S)
        return Rejected(Reason.CIRCUIT_OPEN, spread, f"route {self.route}: {detail}")

    # -- outcomes -----------------------------------------------------------------------------

    async def record(self, ticket: Pass, outcome: int, status: int | None = None,
                     retry_after: float | None = None) -> Pass | None:
        """Feed the outcome of an attempt admitted with ``ticket``; never raises for an
        unavailable state backend (the outcome is then dropped). It completes even if the
        caller is cancelled meanwhile.

        **A probe whose answer fails after its success was recorded** (an LLM stream judged
        by its status line, so that one slow stream does not hold the route refused while it
        lasts): its success returns a pass, ``after`` set, naming the epoch that success left
        the breaker in (the next one when it closed the breaker, else the probe's own). That
        pass recorded with FAILURE (the stream failed: a server-side error event, or cut)
        opens the breaker at once for ``reset_timeout`` (cause ``probe_failed``), as a failed
        probe does, provided the breaker is still in that epoch and heard no other success
        since: closed by that success, other calls' failures under ``fail_max`` since, or
        still half-open, the success counted towards ``success_threshold``. Closed with a
        success since, it is one more failure, as any call's. If it has moved on (opened
        since by anyone,
        and maybe closed again by another probe; or closed by another probe's success) it
        changes nothing, as an outcome of an older state never does
        (:data:`policies.state.breaker.PROBE_FAILED`). Recorded with SUCCESS or NEUTRAL it
        changes nothing and costs nothing. (A success the state backend did not take at
        once returns no pass: whether it closed the breaker is not known.)

        Args:
            outcome: SUCCESS, FAILURE or NEUTRAL (see :func:`classify`).
            status: the upstream's status, if it answered.
            retry_after: the upstream's Retry-After in seconds, if it sent one; on a 429 or
                503 it may extend an open breaker's wait.

        Returns:
            For a half-open probe's success, the pass to record the same answer's later
            failure with; else ``None``.
        """
        states = ticket.states
        if retry_after is None or status not in (429, 503):  # no hint for an open breaker
            if states.defer(self.route, ticket.ticket, outcome, self._params):
                # A success admitted while closed, the common outcome: counted already
                # (memory), or on its way with the next script or flush (Redis).
                if states.batched:
                    self._flush_soon(states)
                return None
            hint = None
        else:
            hint = min(retry_after, MAX_OPEN_HINT_S)
        if ticket.ticket.probe is not None:  # a probe's pass, or its after: never deferred
            return await self._record_probe(ticket, outcome, hint)
        if outcome == NEUTRAL and not hint:
            return None  # nothing to count, no lease to free: no round trip
        call = states.record(self.route, ticket.ticket, outcome, self._params, hint)
        try:
            # _shielded, inline (the first success of each second of a window, and every
            # failure, come this way). Heard even if the caller leaves meanwhile (a cut
            # stream's caller is cut too): else the transition it made is on no timeline,
            # and this replica's view keeps admitting from a closed view for VIEW_FRESH_S.
            verdict = await (call if not self._shared else survive_leaving(
                call, functools.partial(self._heard_of, states, ticket.ticket),
                self._background.spawn))
        except StateUnavailable as exc:
            log.warning("route %s: a circuit-breaker outcome was dropped: %s", self.route,
                        exc.cause, extra=PER_CALL)
            return None
        # _heard_of, inline too.
        self._heard(states, verdict,
                    ticket.ticket.epoch + 1 if verdict.transition is not None else None)
        return None

    async def _record_probe(self, ticket: Pass, outcome: int,
                            hint: float | None) -> Pass | None:
        """:meth:`record` of a half-open probe's pass, or of the pass its success returned
        (``ticket.after``): the one place a probe's later failure is told from the rest."""
        states = ticket.states
        if ticket.after:  # the probe's answer, after its success: only a failure tells
            if outcome != FAILURE or (states is self._backends.breakers
                                      and ticket.ticket.epoch < self._epoch):
                # Or the view knows the breaker has moved on: the record could change
                # nothing, and its answer would tell the view no probe is in flight while
                # a new one is (a review: check() then let calls queue for a refusal).
                return None
            outcome = PROBE_FAILED
        self._let_go(ticket.ticket)  # the probe is over: its outcome frees the lease
        try:
            verdict = await self._shielded(
                states.record(self.route, ticket.ticket, outcome, self._params, hint),
                functools.partial(self._heard_of, states, ticket.ticket))
        except StateUnavailable as exc:
            if self._may_resend(exc, outcome):
                # Dropped, the probe's lease would stay held: every replica would refuse
                # (half-open, a probe in flight) until it lapsed, up to a lease later (a
                # hostile trial, with a fixed 30 s lease then: 28 s after a 2 s freeze, with
                # reset_timeout 2s).
                log.warning("route %s: a probe's outcome waits for the state backend: %s",
                            self.route, exc.cause, extra=PER_CALL)
                self._background.spawn(self._resend(states, ticket.ticket, outcome, hint))
                return None
            log.warning("route %s: a circuit-breaker outcome was dropped: %s", self.route,
                        exc.cause, extra=PER_CALL)
            return None
        self._heard_of(states, ticket.ticket, verdict)
        if outcome != SUCCESS:
            return None
        # The epoch it left the breaker in: the next one if it closed it; else the probe's
        # own (half-open still, under success_threshold; or left already, the success
        # stale, and then the pass can change nothing).
        epoch = ticket.ticket.epoch
        if verdict.transition == CLOSED_AGAIN:
            epoch += 1
        return Pass(states, Ticket(epoch, ticket.ticket.probe), True)

    def _heard_of(self, states: BreakerStates, ticket: Ticket, verdict: Verdict) -> None:
        """:meth:`_heard` for the verdict on an outcome of ``ticket``'s: a transition happened
        in the ticket's epoch, so the new one is known; otherwise the ticket may be stale, and
        the epoch is left to the next admit to learn."""
        self._heard(states, verdict, ticket.epoch + 1 if verdict.transition is not None else None)

    def _heard(self, states: BreakerStates, verdict: Verdict, epoch: int | None) -> None:
        """Take in what recording an outcome answered (``epoch``: the new one, if known)."""
        if states is self._backends.breakers:
            self._see(verdict.state, epoch, verdict.open_for_s, False, verdict.cause)
        if verdict.transition == OPENED:
            self._on_event("circuit_opened", route=self.route, cause=verdict.cause,
                           open_for_s=round(verdict.open_for_s, 3))
        elif verdict.transition == CLOSED_AGAIN:
            self._on_event("circuit_closed", route=self.route)

    def _flush_soon(self, states: BreakerStates) -> None:
        """Make sure the successes ``states`` deferred are flushed within ``FLUSH_S``: one
        flush at a time, for every success deferred before it starts (a task that shutdown
        waits for, like every background write)."""
        if not self._flushing:
            self._flushing = True
            self._background.spawn(self._flush_later(states))

    async def _flush_later(self, states: BreakerStates) -> None:
        try:
            await asyncio.sleep(FLUSH_S)
        finally:
            self._flushing = False  # successes deferred from now on need a flush of their own
        try:
            verdict = await states.flush(self.route, self._params)
        except StateUnavailable as exc:
            log.debug("route %s: circuit-breaker successes were dropped: %s", self.route,
                      exc.cause)
            return
        if verdict is not None:
            # Only the window can open it (the epoch is left to the next admit to learn).
            self._heard(states, verdict, None)

    def record_soon(self, ticket: Pass, outcome: int) -> None:
        """:meth:`record` from code that may not await (the cleanup of a call whose caller
        left after its answer was known): it runs as a task this breaker keeps."""
        self._let_go(ticket.ticket)  # the caller's task ends before the record runs
        self._background.spawn(self.record(ticket, outcome))

    def release(self, ticket: Pass) -> None:
        """End an attempt whose outcome says nothing about the upstream (neutral). Never
        awaits: a probe's lease is given back in the background, so another caller (on any
        replica) may probe."""
        self._give_back(ticket.states, ticket.ticket)

    def _give_back(self, states: BreakerStates, ticket: Ticket) -> None:
        if ticket.probe is not None:
            self._let_go(ticket)
            self._background.spawn(self._return_lease(states, ticket))

    async def _return_lease(self, states: BreakerStates, ticket: Ticket) -> None:
        try:
            verdict = await states.record(self.route, ticket, NEUTRAL, self._params)
        except StateUnavailable as exc:
            log.warning("route %s: a probe lease waits for the state backend to be given "
                        "back: %s", self.route, exc.cause, extra=PER_CALL)
            await self._resend(states, ticket, NEUTRAL, None)
            return
        # The view loses its probe in flight: else check() (on memory) would go on refusing
        # every call with "a probe is in flight", and none would ever probe again.
        self._heard(states, verdict, None)

    def _may_resend(self, exc: StateUnavailable, outcome: int) -> bool:
        """Whether a probe outcome whose script raised ``exc`` may be sent again: see
        :meth:`_resend`."""
        return (not exc.maybe_applied or outcome != SUCCESS
                or self._params.success_threshold <= 1)

    async def _resend(self, states: BreakerStates, ticket: Ticket, outcome: int,
                      hint: float | None) -> None:
        """Send a probe's outcome that Redis did not take until it does, or until the
        probe's lease has lapsed anyway. A script that timed out may still have run (or run
        later, on a frozen server), so it may land twice: the second changes nothing (a
        failure re-opened and a success closed the breaker, moving its epoch on, so the
        second is stale; a neutral one only frees the lease), except a success under a
        ``success_threshold`` above 1, which is not sent again once it may have landed."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self._params.probe_s  # no longer renewed: it lapses by then
        while loop.time() < until:
            await asyncio.sleep(PROBE_RESEND_S)
            try:
                verdict = await states.record(self.route, ticket, outcome, self._params, hint)
            except StateUnavailable as exc:
                if not self._may_resend(exc, outcome):
                    return  # it may have landed
                continue
            self._heard_of(states, ticket, verdict)
            return
        log.warning("route %s: a probe's outcome was dropped; its lease has lapsed",
                    self.route)

    # -- the probe's lease ----------------------------------------------------------------------

    def _hold(self, states: BreakerStates, ticket: Ticket) -> None:
        """Renew the probe lease ``ticket`` holds in ``states`` until :meth:`_let_go` (the one
        place a renewal starts; :meth:`_let_go` is the one place it stops)."""
        assert ticket.probe is not None
        self._renewals[ticket.probe] = _Renewal(
            lambda: self._renew(states, ticket), self._params.probe_s / 3,
            f"sluice-probe-lease-{self.route}", lambda: self._orphaned(ticket))

    def _let_go(self, ticket: Ticket) -> None:
        """Stop renewing ``ticket``'s probe lease, if it holds one (idempotent): its outcome,
        or its give-back, is on its way, and frees the lease; failing that, it lapses."""
        if ticket.probe is not None:
            renewal = self._renewals.pop(ticket.probe, None)
            if renewal is not None:
                renewal.stop()

    async def _renew(self, states: BreakerStates, ticket: Ticket) -> bool:
        """One renewal of ``ticket``'s probe lease; False when it no longer holds it."""
        lease_s = self._params.probe_s
        held = await states.renew(self.route, ticket, lease_s)
        if held and states is self._backends.breakers and self._probing:
            self._probe_until = time.monotonic() + lease_s  # check() keeps refusing for it
        return held

    def _orphaned(self, ticket: Ticket) -> None:
        """The task that took ``ticket``'s probe ended without recording it or giving it
        back: nothing will, so the lease is left to lapse rather than renewed for good."""
        log.warning("route %s: a half-open probe's attempt ended without an outcome; its "
                    "lease lapses within %gs", self.route, self._params.probe_s,
                    extra=PER_CALL)
        self._let_go(ticket)

    # -- tasks --------------------------------------------------------------------------------

    async def _shielded(self, call: Awaitable[T],
                        on_cancel: Callable[[T], None] | None = None) -> T:
        """Await ``call`` so that the caller's cancellation does not cut it off: on Redis the
        script may run whatever happens to the caller, and its effect (a probe lease taken, a
        failure counted) must be known; ``on_cancel`` then gets its result."""
        if not self._shared:
            return await call  # memory never suspends: nothing can cut it
        return await survive_leaving(call, on_cancel or _ignore, self._background.spawn)


def _ignore(_: object) -> None:
    """A late result nothing needs to give back."""


class _Renewal:
    """Keeps a half-open probe's lease alive while its attempt runs (see
    :meth:`Breaker._hold`): ``renew()`` every ``period_s`` (a third of the lease, so two
    renewals in a row may miss, the backend briefly unavailable, before it lapses).

    It ends when :meth:`stop` is called, when a renewal finds the lease no longer the
    probe's (given back, lapsed, or the breaker moved on: nothing to keep, and it is not
    taken again), or when the task that took the probe ends first: ``orphaned()`` is then
    called, and is expected to stop it. A renewal already sent when :meth:`stop` is called
    is let finish (cancelled, it would leave its connection in doubt); it changes nothing
    once the outcome has freed the lease, as the lease is renewed only for its own token.
    """

    __slots__ = ("_orphaned", "_owner", "_sleeping", "_stopped", "_task")

    def __init__(self, renew: Callable[[], Coroutine[Any, Any, bool]], period_s: float,
                 name: str, orphaned: Callable[[], None]) -> None:
        self._stopped = False
        self._sleeping = False
        self._orphaned = orphaned
        self._task = asyncio.get_running_loop().create_task(self._run(renew, period_s),
                                                            name=name)
        self._task.add_done_callback(_renewal_ended)
        self._owner = asyncio.current_task()
        if self._owner is not None:
            self._owner.add_done_callback(self._owner_ended)

    def stop(self) -> None:
        """Renew no more; never awaits (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self._owner is not None:
            self._owner.remove_done_callback(self._owner_ended)
            self._owner = None
        if self._sleeping:
            self._task.cancel()

    def _owner_ended(self, _: object) -> None:
        self._owner = None
        if not self._stopped:
            self._orphaned()
            self.stop()

    async def _run(self, renew: Callable[[], Coroutine[Any, Any, bool]],
                   period_s: float) -> None:
        while not self._stopped:
            self._sleeping = True
            try:
                await asyncio.sleep(period_s)
            finally:
                self._sleeping = False
            if self._stopped:
                return
            try:
                if not await renew():
                    return  # not the probe's lease any more: nothing to keep
            except StateUnavailable:
                continue  # the next one may land before the lease lapses


def _renewal_ended(renewal: asyncio.Task[None]) -> None:
    # Said when it happens: the lease lapses from here on, with its probe still running.
    if not renewal.cancelled() and renewal.exception() is not None:
        log.error("a half-open probe's lease renewal failed; the lease lapses",
                  exc_info=renewal.exception())
