"""One circuit breaker per route upstream, shared by every caller (config key ``circuit_breaker``).

States (Nygard, "Release It!"; Resilience4j's names): **closed** lets attempts through and
counts their outcomes; **open** answers 503 ``circuit_open`` at once, with ``Retry-After`` =
the time left until half-open plus a random share of up to one ``reset_timeout`` (so refused
callers do not all return at the same instant, see :meth:`Breaker._rejection`), and calls
nothing upstream; **half-open** lets exactly one probe
through at a time, and ``success_threshold`` successful probes in a row close it again while a
failed probe opens it for another ``reset_timeout``. Like Resilience4j's default, the move from
open to half-open happens on the first attempt after the wait, not on a timer.

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

Trips: ``fail_max`` consecutive failures (pybreaker's counter), or, when ``rate`` is set, a
failure rate ``>= rate`` over the last ``window`` seconds once ``min_calls`` outcomes are in it
(Resilience4j's TIME_BASED sliding window and ``minimumNumberOfCalls``, see
``shared/notes/infra-semantics.md`` §3.2). An upstream ``Retry-After`` on a 429 or 503 that
arrives while the breaker is open extends the open time to at least that long (capped at
``MAX_OPEN_HINT_S``), and never shortens it.

How pybreaker is used (``shared/notes/library-pitfalls.md`` §1): it keeps the state machine,
the consecutive-failure and success-threshold counters and the transition listeners. It has no
asyncio support, admits every caller in half-open, turns excluded exceptions into successes and
lands late outcomes on whatever state is current. So instead of holding ``calling()`` open
across the ``await`` (where a caller's cancellation could only count as a success, and a
cancelled probe would close the breaker), this module

* admits attempts itself (:meth:`Breaker.attempt`): open-until on the monotonic clock, one probe
  in half-open;
* feeds pybreaker each outcome synchronously, once the attempt's response headers (or error)
  are in, through ``calling()`` around a block that raises for a failure;
* drops outcomes that are neutral, and outcomes of attempts admitted before the last state
  change (a stale closed-state failure would otherwise re-open a half-open breaker).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping

import pybreaker

from policies.config import CircuitBreakerConfig
from policies.pipeline import Call
from policies.reasons import Reason, Rejected

#: ``sluice_circuit_state`` values.
STATE_VALUES = {pybreaker.STATE_CLOSED: 0, pybreaker.STATE_HALF_OPEN: 1, pybreaker.STATE_OPEN: 2}
#: Wait while a half-open probe is in flight (its answer is typically a second or so away),
#: before the spread :meth:`Breaker._rejection` adds.
PROBE_RETRY_AFTER_S = 1.0
#: Longest open time an upstream Retry-After can ask for, seconds (Envoy's 300 s caps on
#: rate-limited back-off and on outlier ejection time).
MAX_OPEN_HINT_S = 300.0

#: Outcomes of one attempt as the breaker sees them (see the module docstring).
SUCCESS, FAILURE, NEUTRAL = 0, 1, 2

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


def classify(status: int, headers: Mapping[str, str]) -> int:
    """What an upstream answer with ``status`` tells the breaker: SUCCESS, FAILURE or NEUTRAL."""
    if status < 429:
        return SUCCESS
    if status == 429:
        if any(name in headers for name in _RATE_LIMIT_HEADERS):
            return NEUTRAL
        return FAILURE
    return FAILURE if status >= 500 else SUCCESS


class _UpstreamFailure(Exception):
    """Raised inside ``calling()`` so that pybreaker counts the attempt as failed."""


class FailureRateWindow:
    """Outcomes of the last ``window_s`` seconds in one-second buckets (Resilience4j TIME_BASED).

    ``add`` is O(1) amortised: buckets are cleared as the clock moves past them.
    """

    __slots__ = ("_calls", "_failures", "_last", "_size", "_total", "_total_failed",
                 "min_calls", "threshold")

    def __init__(self, window_s: float, threshold: float, min_calls: int) -> None:
        self._size = max(1, math.ceil(window_s))
        self.threshold = threshold
        self.min_calls = min_calls
        self._calls = [0] * self._size
        self._failures = [0] * self._size
        self._last = int(time.monotonic())
        self._total = 0
        self._total_failed = 0

    def add(self, failed: bool, now: float) -> bool:
        """Record one outcome at monotonic time ``now``; True when the window trips."""
        second = int(now)
        if second != self._last:
            for step in range(1, min(second - self._last, self._size) + 1):
                i = (self._last + step) % self._size
                self._total -= self._calls[i]
                self._total_failed -= self._failures[i]
                self._calls[i] = self._failures[i] = 0
            self._last = second
        i = second % self._size
        self._calls[i] += 1
        self._total += 1
        if failed:
            self._failures[i] += 1
            self._total_failed += 1
        return self._total >= self.min_calls and self._total_failed >= self.threshold * self._total

    def reset(self) -> None:
        """Forget every outcome (on closing, as Resilience4j resets its metrics)."""
        self._calls = [0] * self._size
        self._failures = [0] * self._size
        self._total = self._total_failed = 0


class Breaker(pybreaker.CircuitBreakerListener):
    """The breaker of one route.

    Per attempt: ``ticket = attempt()`` (raises ``Rejected``), then exactly one of
    ``record(ticket, outcome, status, retry_after)`` or ``release(ticket)`` (neutral outcome,
    e.g. the caller went away). ``check()`` is the same test as ``attempt()`` without taking
    anything, for refusing a call before it queues (the pipeline step :meth:`admit`).

    Args:
        config: the route's ``circuit_breaker`` block.
        route: the route's name, for events and messages.
        on_event: called as ``on_event(event, **fields)`` on every transition
            (``circuit_opened``, ``circuit_half_open``, ``circuit_closed``).
    """

    def __init__(self, config: CircuitBreakerConfig, route: str,
                 on_event: Callable[..., None]) -> None:
        self.route = route
        self.reset_timeout = config.reset_timeout
        self._on_event = on_event
        self._window = (
            FailureRateWindow(config.window, config.rate, config.min_calls)
            if config.rate is not None else None
        )
        self._epoch = 0  # bumped on every state change; a ticket is the epoch it was issued in
        self._open_until = 0.0  # monotonic seconds
        self._probing = False
        self._trip_cause = "fail_max"
        self._cause = ""  # why it last opened, for the rejection's message
        self._breaker = pybreaker.CircuitBreaker(
            fail_max=config.fail_max,
            reset_timeout=config.reset_timeout,
            success_threshold=config.success_threshold,
            listeners=[self],
            name=route,
            throw_new_error_on_trip=False,
        )

    # -- admission ----------------------------------------------------------------------------

    @property
    def current(self) -> str:
        """``closed``, ``open`` or ``half-open``."""
        return self._breaker.current_state

    def state(self) -> dict[str, object]:
        """The breaker for the admin API (JSON-ready)."""
        return {"state": self.current, "blocked_for_s": round(self.blocked_for(), 3)}

    def state_value(self) -> int:
        """The state as ``sluice_circuit_state`` reports it: 0 closed, 1 half-open, 2 open."""
        return STATE_VALUES[self._breaker.current_state]

    def blocked_for(self) -> float:
        """Seconds until an attempt could be admitted; 0 when one would be now."""
        state = self._breaker.current_state
        if state == pybreaker.STATE_CLOSED:
            return 0.0
        if state == pybreaker.STATE_OPEN:
            return max(0.0, self._open_until - time.monotonic())
        return PROBE_RETRY_AFTER_S if self._probing else 0.0

    def check(self) -> None:
        """Refuse now if an attempt would be refused; takes nothing.

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
        self.check()

    def attempt(self) -> int:
        """Permission for one upstream attempt; the ticket goes to ``record`` or ``release``.

        Moves an open breaker whose wait is over to half-open, and makes this attempt its
        probe.

        Raises:
            Rejected: ``circuit_open`` while open, or while another probe is in flight.
        """
        state = self._breaker.current_state
        if state == pybreaker.STATE_CLOSED:
            return self._epoch
        if state == pybreaker.STATE_OPEN:
            wait = self._open_until - time.monotonic()
            if wait > 0:
                raise self._rejection(wait)
            self._breaker.half_open()
        if self._probing:
            raise self._rejection(PROBE_RETRY_AFTER_S)
        self._probing = True
        return self._epoch

    def _rejection(self, wait: float) -> Rejected:
        """503 ``circuit_open`` telling the caller to come back after ``wait`` seconds, spread.

        Every caller refused while open would otherwise be told the same instant (the SDKs
        honour ``retry-after-ms`` to the millisecond) and return together, where only one
        probe can pass: the rest are refused again and return together once more, and when
        the breaker closes the whole herd lands on the upstream at once (measured in
        ``bench/storm.py``: it re-opened the breaker on a healthy upstream). So the wait is
        never shorter than ``wait`` but gets a random share of up to one ``reset_timeout``
        (one ``PROBE_RETRY_AFTER_S`` while a probe is in flight): the refused callers come
        back spread over about as long as they arrived in.
        """
        if self._probing:
            detail = "a probe is in flight"
            wait += random.uniform(0, PROBE_RETRY_AFTER_S)
        else:
            detail = f"opened by {self._cause}"
            wait += random.uniform(0, self.reset_timeout)
        return Rejected(Reason.CIRCUIT_OPEN, wait, f"route {self.route}: {detail}")

    # -- outcomes -----------------------------------------------------------------------------

    def record(self, ticket: int, outcome: int, status: int | None = None,
               retry_after: float | None = None) -> None:
        """Feed the outcome of an attempt admitted with ``ticket``.

        Args:
            outcome: SUCCESS, FAILURE or NEUTRAL (see :func:`classify`).
            status: the upstream's status, if it answered.
            retry_after: the upstream's Retry-After in seconds, if it sent one; on a 429 or
                503 it may extend an open breaker's wait.
        """
        if ticket == self._epoch:
            self._probing = False
            if outcome != NEUTRAL:
                failed = outcome == FAILURE
                # The common case, a success while closed with no failure counted, would only
                # make pybreaker reset a counter that is already 0: skipping its ~5 us of
                # generator plumbing keeps the hot path cheap.
                if (failed or self._breaker.fail_counter
                        or self._breaker.current_state != pybreaker.STATE_CLOSED):
                    try:
                        with self._breaker.calling():
                            if failed:
                                raise _UpstreamFailure
                    except _UpstreamFailure:
                        pass
                window = self._window
                if (window is not None and ticket == self._epoch
                        and window.add(failed, time.monotonic())
                        and self._breaker.current_state == pybreaker.STATE_CLOSED):
                    self._trip_cause = "failure_rate"
                    self._breaker.open()
        if (retry_after is not None and status in (429, 503)
                and self._breaker.current_state == pybreaker.STATE_OPEN):
            until = time.monotonic() + min(retry_after, MAX_OPEN_HINT_S)
            self._open_until = max(self._open_until, until)

    def release(self, ticket: int) -> None:
        """End an attempt whose outcome says nothing about the upstream (neutral)."""
        if ticket == self._epoch:
            self._probing = False

    # -- pybreaker listener -------------------------------------------------------------------

    def state_change(self, cb: pybreaker.CircuitBreaker,
                     old_state: pybreaker.CircuitBreakerState | None,
                     new_state: pybreaker.CircuitBreakerState) -> None:
        """Bump the epoch, time the open state, and put the transition on the timeline."""
        self._epoch += 1
        self._probing = False
        name = new_state.name
        old = old_state.name if old_state is not None else None
        if name == pybreaker.STATE_OPEN:
            self._open_until = time.monotonic() + self.reset_timeout
            cause = "probe_failed" if old == pybreaker.STATE_HALF_OPEN else self._trip_cause
            self._cause = cause
            self._on_event("circuit_opened", route=self.route, cause=cause,
                                     open_for_s=self.reset_timeout)
        elif name == pybreaker.STATE_HALF_OPEN:
            self._on_event("circuit_half_open", route=self.route)
        else:
            self._trip_cause = "fail_max"
            if self._window is not None:
                self._window.reset()
            self._on_event("circuit_closed", route=self.route)
