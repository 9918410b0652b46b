"""Budgets with reserve-then-settle (config key ``budget``).

A budget block limits one or more units (``tokens`` = input + output, ``input_tokens``,
``output_tokens``, ``usd``) per scope (``per: tenant | run | route``), each over a window
aligned to UTC (``N/min``, ``N/h``, ``N/day``: the minute, hour or day that contains the
request's admission) or in total for a run (``N/total``).

Before a request is forwarded, its worst case (estimated input + its output cap, priced from
the ``pricing`` table for ``usd``) is *reserved* on every limit that applies, atomically: all or
none. A limit admits a reservation only if ``spent + reserved + this <= limit``, so requests in
flight can never spend more than the limit together: the overshoot is zero within one replica,
as long as each request stays within its reservation (its output is capped by ``max_tokens``;
the input is an estimate, see :mod:`policies.usage`). After the answer, the reservation is
*settled*: replaced by the actual usage, which releases the difference. The window that
admitted a request is the one its usage is charged to.

A refusal is 429 ``budget_exhausted`` with ``Retry-After`` from the limits that denied (never
another limit's reset; the slowest, whose ``RateLimit`` fields it gives): the end of the window
when the spend alone leaves no room, or, when only reservations of requests in flight are in
the way (they settle to actual usage, usually less), when those calls are expected to end
(:class:`HoldTimes`: when the first of that counter's calls in flight should end, by its calls'
mean time; at least :data:`SETTLE_WAIT_S`), or the window's end if sooner. A spent ``N/total``
budget never frees, so it says ``x-should-retry: false`` with no wait. A ``usd`` limit's
refusal carries no ``RateLimit`` fields: the draft (draft-ietf-httpapi-ratelimit-headers,
"Quota Policy" parameters) makes ``q`` and ``r`` Integers and registers no currency unit for
``qu`` (``requests``, ``content-bytes``, ``concurrent-requests``), so a quota of $0.50 has no
faithful form there; its ``Retry-After`` and message say the wait and the amounts. A request
whose own worst case exceeds a whole limit is refused at once with 400 ``exceeds_limit``.

The counters live in the route's state backend (``backends.ledger``,
:mod:`policies.state.ledger`): this process's memory, or Redis shared by every replica, so the
zero overshoot holds across replicas. A reservation has an id; its settle applies once; one
whose replica died is reaped after its hold (``hold_s``: :data:`HOLD_S`, or longer on a route
whose calls may run longer). :class:`Budgets` keeps the rules. When the
shared ledger does not answer, ``state.on_unavailable`` decides: ``local`` holds on this
replica's memory ledger with ``state.replicas``' share of each limit, and the spend made there
is charged to the shared ledger, once, when it answers again (:class:`Reconciler`); ``reject``
refuses 503 ``state_unavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from policies.config import (
    BudgetConfig,
    ConcurrencyConfig,
    FanoutConfig,
    ModelPrice,
    RouteConfig,
)
from policies.logs import PER_CALL
from policies.rate import Background, fallback_for, finish_now
from policies.reasons import Reason, Rejected
from policies.redelivery import Redeliveries
from policies.retry import HINT_JITTER
from policies.state import StateBackends, StateUnavailable
from policies.state.ledger import Claim, LedgerFull
from policies.state.rate import Take
from policies.usage import Usage, cost_usd
from policies.wording import counted

log = logging.getLogger("sluice")

#: The wait when only reservations of requests in flight deny and no call of the route has
#: been seen to settle nor is seen in flight (another replica's), seconds; and the least
#: such a wait is, unless the window ends sooner (:class:`HoldTimes`).
SETTLE_WAIT_S = 1.0
#: The longest wait told while only reservations of calls in flight deny, seconds: the room
#: comes back as they end, however long one runs, and the SDKs honour a Retry-After up to
#: 60 s (longer, they give up: ``x-should-retry: false``).
MAX_SETTLE_WAIT_S = 60.0
#: Weight of the newest call in the mean time a reservation is held (as the concurrency
#: limiter's mean service time, :mod:`policies.concurrency`).
HOLD_EWMA_WEIGHT = 0.1
#: Reservations in flight whose hold times :class:`HoldTimes` keeps at most (each is
#: forgotten at its settle; beyond this the oldest are, which only shortens estimates).
LIVE_KEPT = 100_000
#: Counters whose mean hold time :class:`HoldTimes` keeps at most (the least recently
#: settled forgotten first: their refusals then wait :data:`SETTLE_WAIT_S`).
MEANS_KEPT = 100_000
#: How long a reservation may stay unsettled before the ledger reaps it, seconds, at least:
#: a route's calls may run longer (:func:`longest_call_s`), and its hold is then that plus
#: :data:`HOLD_MARGIN_S` (:func:`hold_for`). The floor is short: a killed replica's
#: reservations fill a budget until reaped (15 min, it once was, on a route of 5 s calls,
#: with callers told to come back every second; a hostile trial).
HOLD_S = 120.0
HOLD_MARGIN_S = 60.0
#: Reconcile entries kept while the shared ledger is unavailable (see :class:`Reconciler`).
MAX_PENDING = 100_000
#: The cap of a reconciling charge: spend already made is added whatever the limit.
UNCAPPED = 1e300
#: Response headers on admitted requests of a budgeted route (see :meth:`Budgets.headers`).
REMAINING_HEADER = "X-Sluice-Budget-Remaining"
POLICY_HEADER = "X-Sluice-Budget-Policy"
RESET_HEADER = "X-Sluice-Budget-Reset"
WARNING_HEADER = "X-Sluice-Budget-Warning"

_PERIOD_NAMES = {1: "s", 60: "min", 3600: "h", 86400: "day"}


@dataclass(frozen=True, slots=True)
class Limit:
    """One unit of one budget block.

    Attributes:
        name: unique on the route, e.g. ``output_tokens-per-tenant-day``; used in headers,
            rejection details and the ``RateLimit-Policy`` field.
        unit: ``tokens``, ``input_tokens``, ``output_tokens`` or ``usd``.
        amount: tokens or USD per window (or in total).
        period_s: the window in seconds, ``None`` for a run's total.
        per: ``tenant``, ``run`` or ``route``.
        warn_at: fraction spent from which answers carry the warning header, or ``None``.
        ttl_s: how long an idle run's total is kept, seconds.
        text: the allowance as configured (``1000/day``).
    """

    name: str
    unit: str
    amount: float
    period_s: int | None
    per: str
    warn_at: float | None
    ttl_s: float
    text: str

    @property
    def policy_header(self) -> str:
        """This limit in the IETF ``RateLimit-Policy`` syntax."""
        quota = _fmt_number(self.unit, self.amount)
        if self.period_s is None:
            return f'"{self.name}";q={quota}'
        return f'"{self.name}";q={quota};w={self.period_s}'


class Reservation:
    """What one request holds: its claims under reservation id ``rid``, the limits they
    belong to, and the state they are held in (``source``: the route's shared state, or
    the local fallback's while the shared one was unavailable). ``now``: the Unix seconds
    its windows were chosen at."""

    __slots__ = ("claims", "limits", "now", "price", "rid", "source")

    def __init__(self, rid: str, claims: list[Claim], limits: list[Limit],
                 price: ModelPrice | None, source: StateBackends, now: float) -> None:
        self.rid = rid
        self.claims = claims
        self.limits = limits
        self.price = price
        self.source = source
        self.now = now


class HoldTimes:
    """How long a route's reservations are held, for the wait of a refusal that only
    reservations of calls in flight deny: they come back, settled to usage, as the calls
    end, and the first to end frees room.

    Keeps, per counter's series (its limit and scope, over every window) and per limit, the
    mean time from hold to settle of this process's calls on it (an exponentially weighted
    mean, :data:`HOLD_EWMA_WEIGHT`, seeded by the first; at most :data:`MEANS_KEPT`, the
    oldest forgotten first; the limit's speaks for a scope with none yet), and the hold time
    of each reservation in flight here with its counters. The estimate for a counter
    (:meth:`estimate`) is when the first of its calls in flight here should end: the least
    of the mean less each one's age (one past the mean is expected any moment); the mean
    when none is seen here (another replica's). A counter's own mean: one tenant's slow
    calls say nothing of another's budget (a review: 300 s calls told a tenant of 1 s calls
    to wait 264 s); the soonest end, not the oldest call: one call stuck for an hour made
    every refusal say an hour while younger calls freed the room in seconds (a review).
    ``clock``: monotonic seconds (injectable for tests).
    """

    __slots__ = ("_clock", "_live", "_means")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: Counter key -> the mean hold time of its calls settled here, seconds.
        self._means: dict[str, float] = {}
        #: Reservation id -> (monotonic time held, its counters), oldest first.
        self._live: dict[str, tuple[float, tuple[str, ...]]] = {}

    def held(self, reservation: Reservation) -> None:
        """``reservation`` is held from now until :meth:`ended`."""
        live = self._live
        if len(live) >= LIVE_KEPT:
            del live[next(iter(live))]
        live[reservation.rid] = (self._clock(), tuple(_keys(reservation.claims)))

    def ended(self, reservation: Reservation, settled: bool) -> None:
        """``reservation`` is no longer held; ``settled``: its call ran (settled to its
        usage), so its hold time counts in its counters' means (a call given back never
        reached the upstream, and says nothing of how long calls take)."""
        start = self._live.pop(reservation.rid, None)
        if start is None or not settled:
            return
        took = self._clock() - start[0]
        means = self._means
        for key in start[1]:
            for kept in _mean_keys(key):
                mean = means.pop(kept, None)  # re-inserted last: the oldest go first
                if mean is None and len(means) >= MEANS_KEPT:
                    del means[next(iter(means))]
                means[kept] = took if mean is None else mean + HOLD_EWMA_WEIGHT * (took - mean)

    def estimate(self, key: str) -> float | None:
        """Seconds until the first reservation in flight on counter ``key`` is expected to
        come back (see the class); before any call on it has settled here, the age of the
        youngest in flight (a call that has run that long is not near its end by anything
        known); ``None`` when neither is known."""
        series, limit = _mean_keys(key)
        mean = self._means.get(series)
        if mean is None:
            mean = self._means.get(limit)
        now = self._clock()
        soonest = None
        for start, keys in reversed(self._live.values()):  # youngest first
            if key in keys:
                if mean is None:
                    return now - start
                left = max(mean - (now - start), 0.0)
                if soonest is None or left < soonest:
                    soonest = left
                if left <= 0.0:
                    break
        return mean if soonest is None else soonest


class Budgets:
    """The budget blocks of one route, their counters in the route's state backend.

    Args:
        blocks: the route's ``budget`` blocks.
        pricing: the top-level ``pricing`` table (USD per million tokens, by model).
        backends: where the counters live (``backends.ledger``: memory, or Redis shared by
            every replica) and what to do when it does not answer (``backends.fallback``).
        clock: Unix seconds now (injectable for tests); it names the UTC windows.
        group: the route's name: every counter of the route is in this group (one Redis slot).
        hold_s: how long a reservation may stay unsettled before the ledger reaps it (its
            replica died, or its settle was lost), seconds: longer than any call of the
            route may run, or a call still running loses its reservation and the budget can
            be overspent.
    """

    def __init__(self, blocks: Sequence[BudgetConfig], pricing: dict[str, ModelPrice],
                 backends: StateBackends, clock: Callable[[], float], group: str = "",
                 hold_s: float = HOLD_S) -> None:
        self.limits: list[Limit] = []
        for block in blocks:
            for unit, allowance in block.limits():
                window = "total" if allowance.period_s is None else _PERIOD_NAMES.get(
                    allowance.period_s, f"{allowance.period_s}s")
                self.limits.append(Limit(
                    name=f"{unit}-per-{block.per}-{window}", unit=unit,
                    amount=allowance.amount, period_s=allowance.period_s, per=block.per,
                    warn_at=block.warn_at, ttl_s=block.ttl, text=allowance.text,
                ))
        self._policy_headers = {limit.name: limit.policy_header for limit in self.limits}
        self.needs_run = any(limit.per == "run" for limit in self.limits)
        self.needs_price = any(limit.unit == "usd" for limit in self.limits)
        self.pricing = pricing
        self.backends = backends
        self.clock = clock
        self.group = group
        self.hold_s = hold_s
        self.background = Background(backends)
        self.reconciler = Reconciler(self)
        #: How long reservations are held here (the wait while only calls in flight deny).
        self.holds = HoldTimes()
        #: The budgets a reload replaced these with (:meth:`take_over`), if any.
        self.successor: Budgets | None = None
        if backends.redis is not None:
            self.reconciler.resend_when_up(backends.health)

    def take_over(self, old: Budgets) -> None:
        """Continue ``old``'s work after a reload: its state (the memory ledger of a route
        built without a shared one) and its spend still to reconcile."""
        if self.backends is not old.backends:
            self.backends = old.backends
        self.reconciler.adopt(old.reconciler)
        self.holds = old.holds  # its calls in flight settle into the same record
        old.successor = self

    def current(self) -> Budgets:
        """The budgets in force on this route now: this object, or the one a reload replaced
        it with (:meth:`take_over`), for a call admitted before the reload that takes a new
        hold after it (a retry's, :meth:`policies.accounting.Charge.hold_retry`)."""
        budgets = self
        while budgets.successor is not None:
            budgets = budgets.successor
        return budgets

    # -- admission ----------------------------------------------------------------------------

    async def reserve(self, tenant: str, run: str | None, model: str | None,
                      input_tokens: int, output_tokens: int,
                      ancestors: Sequence[str] = (), at: float | None = None) -> Reservation:
        """Hold the worst case of one request on every limit, or refuse it: one call to the
        ledger (one Redis round trip). (A metered call's step, :mod:`policies.accounting`,
        holds it with the call's rate units in one call instead: :meth:`prepare`,
        :meth:`refusal`.)

        A ``per: run`` limit is held on the run *and on each of its ``ancestors``* (its parent
        first): every run's counter covers its whole subtree, so a parent's budget bounds what
        its sub-agents spend, and each sub-agent still has its own.

        With the shared ledger unavailable, ``on_unavailable: local`` holds on this replica's
        memory ledger with each limit's share (``state.replicas``); ``reject`` refuses.

        ``at`` (epoch seconds, default now) picks the windows held in: a retry's extra hold
        is taken in its call's windows, where the call's every attempt is charged.

        Raises:
            Rejected: ``unpriced_model`` (400) when a usd limit applies and ``model`` has no
                price; ``exceeds_limit`` (400) when the worst case exceeds a whole limit;
                ``budget_exhausted`` (429) when it does not fit now; ``state_unavailable``
                (503, ``on_unavailable: reject``).
        """
        return await self._hold(
            self.prepare(tenant, run, model, input_tokens, output_tokens, ancestors, at))

    def prepare(self, tenant: str, run: str | None, model: str | None, input_tokens: int,
                output_tokens: int, ancestors: Sequence[str] = (),
                at: float | None = None) -> Reservation:
        """The reservation of one request's worst case on every limit (see :meth:`reserve`,
        and its ``at``), not yet held: its id, claims and the limits they belong to.

        Raises:
            Rejected: ``unpriced_model`` or ``exceeds_limit`` (400), as :meth:`reserve`.
        """
        price = self.pricing.get(model) if model is not None else None
        if price is None and self.needs_price:
            raise Rejected(Reason.UNPRICED_MODEL, None,
                           f"model {model!r} is not in the pricing table")
        now = self.clock() if at is None else at
        worst = Usage(input_tokens, output_tokens)
        claims = []
        limits = []
        for limit in self.limits:
            amount = _amount(limit.unit, worst, price, worst_case=True)
            if amount > limit.amount:
                raise Rejected(
                    Reason.EXCEEDS_LIMIT, None,
                    f"this request may cost {_fmt(limit.unit, amount)} ({input_tokens} input "
                    f"tokens estimated + {output_tokens} max output), more than the whole "
                    f"{limit.name} budget of {limit.text}; lower max_tokens",
                )
            for scope_run in (run, *ancestors) if limit.per == "run" else (run,):
                claims.append(Claim(self._key(limit, tenant, scope_run, now), amount,
                                    limit.amount, self._expiry(limit, now)))
                limits.append(limit)
        return Reservation(uuid.uuid4().hex, claims, limits, price, self.backends, now)

    async def reserve_usd(self, tenant: str, run: str | None, amount: float,
                          ancestors: Sequence[str] = ()) -> Reservation:
        """Hold ``amount`` USD (an operation's cost, :mod:`policies.operations`) on every
        ``usd`` limit, as :meth:`reserve` holds a request's worst case; no pricing table is
        read. Settled with :meth:`settle_usd`.

        Raises:
            Rejected: ``exceeds_limit`` (400) when ``amount`` exceeds a whole limit;
                ``budget_exhausted`` (429) when it does not fit now; ``state_unavailable``
                (503, ``on_unavailable: reject``).
        """
        now = self.clock()
        claims = []
        limits = []
        for limit in self.limits:
            if limit.unit != "usd":
                continue
            if amount > limit.amount:
                raise Rejected(Reason.EXCEEDS_LIMIT, None,
                               f"this call costs {_fmt('usd', amount)}, more than the whole "
                               f"{limit.name} budget of {limit.text}")
            for scope_run in (run, *ancestors) if limit.per == "run" else (run,):
                claims.append(Claim(self._key(limit, tenant, scope_run, now), amount,
                                    limit.amount, self._expiry(limit, now)))
                limits.append(limit)
        return await self._hold(
            Reservation(uuid.uuid4().hex, claims, limits, None, self.backends, now))

    def settle_usd(self, reservation: Reservation, usd: float) -> None:
        """Replace a :meth:`reserve_usd` reservation by the ``usd`` actually spent (may exceed
        what was held: time-priced costs are known only at the end). Never awaits."""
        self._settle(reservation, [usd] * len(reservation.claims))

    async def _hold(self, reservation: Reservation) -> Reservation:
        """Hold a prepared reservation all or none (one ledger call), or refuse; see
        :meth:`reserve`."""
        backends = self.backends
        try:
            denied = await backends.ledger.reserve(self.group, reservation.rid,
                                                   reservation.claims, reservation.now,
                                                   self.hold_s)
        except StateUnavailable as exc:
            self.unanswered(reservation, exc)
            self.localize(reservation, fallback_for(backends, exc))
            try:  # the local fallback is a memory ledger, with its own cap
                denied = await reservation.source.ledger.reserve(
                    self.group, reservation.rid, reservation.claims, reservation.now,
                    self.hold_s)
            except LedgerFull as full:
                raise self.full(full) from None
        except asyncio.CancelledError:
            self.abandon(reservation)
            raise
        except LedgerFull as exc:
            raise self.full(exc) from None
        self.answered(reservation)
        if denied:
            raise self.refusal(reservation, denied)
        self.holds.held(reservation)
        return reservation

    def localize(self, reservation: Reservation, local: StateBackends) -> None:
        """Move a reservation not yet held to the local fallback's ``local`` state, with
        this replica's share (``state.replicas``) of what each limit had left when the shared
        ledger last answered about it, neither spent nor held by calls in flight (its whole
        amount if it never did): the local ledger
        knows nothing of the shared spend, and a budget already spent there was spent once
        more during an outage (a hostile trial: 21,139 tokens on a 12,000 budget)."""
        fallback = self.backends.fallback
        shared = self.backends.ledger
        group = self.group
        # Held counts too: the calls in flight that hold it (on any replica) go on to spend
        # it, and settle into the shared ledger once it answers (a hostile trial: 3,599
        # tokens on a 3,000 budget after a 2 s freeze, from leaving it out).
        reservation.claims = [
            claim._replace(cap=fallback.share(max(claim.cap - sum(shared.level(group,
                                                                               claim.key)),
                                                  0.0)))
            for claim in reservation.claims]
        reservation.source = local

    def unanswered(self, reservation: Reservation, exc: StateUnavailable) -> None:
        """The shared ledger did not answer the reserve of ``reservation``: if it was sent,
        a frozen or slow Redis may still run it and hold it there while this call goes on
        without it, so it is released by id (once Redis answers, if not now)."""
        if exc.maybe_applied:
            self.abandon(reservation)

    def abandon(self, reservation: Reservation) -> None:
        """The call holding it was cancelled while its reserve was in flight: the script may
        have run in Redis, so release it by id (which finds nothing, and changes nothing, if
        not); kept for later if Redis is down."""
        if reservation.source.redis is not None:
            self.background.start(
                self.reconciler.settle(reservation, [0.0] * len(reservation.claims)),
                f"budget release on {self.group}")

    def answered(self, reservation: Reservation) -> None:
        """The ledger answered about ``reservation``: if that was the shared one, the spend
        recorded while it did not answer can go in now."""
        if reservation.source is self.backends and self.backends.redis is not None:
            self.reconciler.kick()

    @staticmethod
    def full(exc: LedgerFull) -> Rejected:
        """``budget_counters_full`` (503, never retried as sent) for a call whose new tenant
        or run would need a counter beyond the memory ledger's cap."""
        return Rejected(
            Reason.BUDGET_COUNTERS_FULL, None,
            f"Sluice keeps at most {exc.cap} budget counters (state.max_budget_counters), "
            "each until its window ends, and this call's tenant or run would need a new one; "
            "tenants and runs already counted are served", retry=False)

    def refusal(self, reservation: Reservation, denied: Sequence[int]) -> Rejected:
        """``budget_exhausted`` for the claims the ledger ``denied`` (indexes)."""
        return self._refusal([(reservation.limits[i], reservation.claims[i]) for i in denied],
                             reservation.now, reservation.source)

    def settle(self, reservation: Reservation, usage: Usage | None) -> None:
        """Replace a reservation by ``usage`` (``None``: nothing was used), exactly once (by
        reservation id). Never awaits: a Redis settle runs as a task, and one Redis cannot
        take now is retried when it answers again. Spend held on the local fallback is also
        queued to be charged to the shared ledger once it answers."""
        if usage is None:
            actual = [0.0] * len(reservation.claims)
        else:
            actual = [_amount(limit.unit, usage, reservation.price)
                      for limit in reservation.limits]
        self._settle(reservation, actual)

    def _settle(self, reservation: Reservation, actual: list[float]) -> None:
        self.holds.ended(reservation, True)
        source = reservation.source
        if source.redis is not None:
            self.background.start(self.reconciler.settle(reservation, actual),
                                  f"budget settle on {self.group}")
            return
        finish_now(source.ledger.settle(self.group, reservation.rid, actual))
        if source is not self.backends:  # held locally while the shared ledger was down
            self.reconciler.charge(reservation.claims, actual)

    def give_back(self, reservation: Reservation, takes: Sequence[Take]) -> None:
        """Release a reservation whose call never reached the upstream, and refund the rate
        units ``takes`` the same admission took, in one round trip (both are in the same
        shared state: :meth:`policies.state.admission.Admissions.release`). Never awaits; a
        release Redis cannot take now is kept for when it answers (the units drain)."""
        self.holds.ended(reservation, False)
        self.background.start(self.reconciler.give_back(reservation, takes),
                              f"budget release on {self.group}")

    # -- reporting ----------------------------------------------------------------------------

    def headers(self, reservation: Reservation) -> dict[str, str]:
        """Headers for an admitted answer, from the binding limit: the one with the largest
        share spent or reserved (this request's reservation included); the warning names the
        fullest limit past its block's ``warn_at``.

        ``X-Sluice-Budget-Remaining`` is what is left of it (tokens, or USD);
        ``X-Sluice-Budget-Policy`` names it in the IETF ``RateLimit-Policy`` syntax
        (``"name";q=LIMIT;w=WINDOW_S``); ``X-Sluice-Budget-Reset`` gives the seconds until its
        window ends (absent for a total); ``X-Sluice-Budget-Warning``
        (``"name";used=FRACTION``) appears once the block's ``warn_at`` is reached. Levels are
        those the reservation's ledger answered with (no further round trip).
        """
        binding: tuple[float, Limit, float] | None = None
        warning: tuple[float, Limit] | None = None
        ledger = reservation.source.ledger
        for limit, claim in zip(reservation.limits, reservation.claims, strict=True):
            spent, held = ledger.level(self.group, claim.key)
            # A cap of 0: a local share of a limit spent when Redis last answered (a call
            # costing 0 still fits it).
            used = (spent + held) / claim.cap if claim.cap > 0 else 1.0
            if binding is None or used > binding[0]:
                binding = (used, limit, claim.cap - spent - held)
            if limit.warn_at is not None and used >= limit.warn_at and (
                    warning is None or used > warning[0]):
                warning = (used, limit)
        assert binding is not None
        used, limit, left = binding
        headers = {REMAINING_HEADER: _fmt_number(limit.unit, max(left, 0.0)),
                   POLICY_HEADER: self._policy_headers[limit.name]}
        if limit.period_s is not None:
            now = self.clock()
            headers[RESET_HEADER] = str(math.ceil(_window_end(limit.period_s, now) - now))
        if warning is not None:
            used, limit = warning
            headers[WARNING_HEADER] = f'"{limit.name}";used={min(used, 1.0):.3f}'
        return headers

    def remaining(self, unit: str, per: str, tenant: str) -> float:
        """Least left now of this unit's limits for a scope (``per`` tenant or route); with
        a Redis ledger, as of its last answer about each counter."""
        now = self.clock()
        left = math.inf
        ledger = self.backends.ledger
        for limit in self.limits:
            if limit.unit == unit and limit.per == per:
                spent, held = ledger.level(self.group, self._key(limit, tenant, None, now))
                left = min(left, limit.amount - spent - held)
        return max(left, 0.0)

    def reserved(self, unit: str, per: str, tenant: str) -> float:
        """Held now by requests in flight on this unit's limits for a scope."""
        now = self.clock()
        ledger = self.backends.ledger
        return sum(
            ledger.level(self.group, self._key(limit, tenant, None, now))[1]
            for limit in self.limits if limit.unit == unit and limit.per == per
        )

    # -- internals ----------------------------------------------------------------------------

    @staticmethod
    def _key(limit: Limit, tenant: str, run: str | None, now: float) -> str:
        """The counter's name: limit, scope and window (UTC period number, or 0 for a
        total). The tenant's length prefixes it, so no tenant and run pair reads as another."""
        if limit.per == "tenant":
            scope = tenant
        elif limit.per == "run":
            scope = f"{len(tenant)}:{tenant}:{run}"
        else:
            scope = ""
        window = 0 if limit.period_s is None else int(now // limit.period_s)
        return f"{limit.name}:{scope}:{window}"

    @staticmethod
    def _expiry(limit: Limit, now: float) -> float:
        if limit.period_s is None:
            return now + limit.ttl_s
        return _window_end(limit.period_s, now)

    def _refusal(self, denials: list[tuple[Limit, Claim]], now: float,
                 source: StateBackends) -> Rejected:
        """``budget_exhausted`` with the wait of the slowest denying limit, and that limit
        named in its ``RateLimit`` fields: the policy, its ``r`` and its ``t`` are one
        limit's, as the draft's fields describe one policy each (naming the first denial
        while the wait was another's said ``w=60`` beside ``t=73385``; a hostile trial).
        A limit that never frees (a spent total) is the slowest."""
        details = []
        ledger = source.ledger
        share = "" if source is self.backends else (
            " (this replica's share while the shared state is unavailable)")
        binding: tuple[float, Limit, int] | None = None  # (wait, limit, whole units left)
        never = False
        for limit, claim in denials:
            spent, held = ledger.level(self.group, claim.key)
            left = max(math.floor(claim.cap - spent - held), 0)
            wait: float
            if spent + claim.amount <= claim.cap:  # only requests in flight are in the way
                wait = self._settle_wait(limit, claim, now)
            elif limit.period_s is None:
                wait, never = math.inf, True  # a run's total never frees
            else:
                wait = _window_end(limit.period_s, now) - now
            if binding is None or wait > binding[0]:
                binding = (wait, limit, left)
            details.append(
                f"{limit.name} {limit.text}{share}: {_fmt(limit.unit, spent)} spent, "
                f"{_fmt(limit.unit, held)} reserved by requests in flight, this request "
                f"needs up to {_fmt(limit.unit, claim.amount)}"
            )
        assert binding is not None
        wait, limit, left = binding
        policy = None
        if limit.unit != "usd" and limit.period_s is not None:
            policy = (limit.name, int(limit.amount), limit.period_s, left)
        return Rejected(Reason.BUDGET_EXHAUSTED, None if never else wait, "; ".join(details),
                        policy, retry=False if never else None)


    def _settle_wait(self, limit: Limit, claim: Claim, now: float) -> float:
        """The wait of a limit that only reservations of calls in flight deny, seconds: when
        they are expected to come back (:meth:`HoldTimes.estimate`, at least
        :data:`SETTLE_WAIT_S`; that when nothing is known), or the end of the window if
        sooner, when the room comes back whatever they spend. A fixed 1 s told callers to
        come back every second while calls of 8 s held the room, and the SDKs (2 retries)
        gave up in 2 s; at 23:59:54 it said 1 s instead of 6 (a hostile trial)."""
        estimate = self.holds.estimate(claim.key)
        wait = SETTLE_WAIT_S if estimate is None else min(max(estimate, SETTLE_WAIT_S),
                                                          MAX_SETTLE_WAIT_S)
        if limit.period_s is not None:
            wait = min(wait, _window_end(limit.period_s, now) - now)
        return wait


class Reconciler(Redeliveries["_Pending"]):
    """Spend the shared ledger has not been told yet, told once it answers again
    (:class:`policies.redelivery.Redeliveries`).

    Two kinds of entries, applied in order, each exactly once:

    * a settle of a shared reservation that Redis could not take: settled again by its id
      (a settle that did land and lost its answer finds nothing the second time);
    * spend held on the local fallback while Redis was unavailable: charged under an id of
      its own as a reservation without a cap, then settled, so a charge whose answer was lost
      is not added twice (the reservation's id is held once; its settle lands once).

    A settle that finds nothing to settle (Redis restarted empty or lost the key, the
    reservation was reaped long ago, an earlier settle landed and lost its answer) answers
    no levels, so its counters' levels are read then: else the shared ledger would keep
    those of the reserve (``level``, held), read by the budget gauges, the headers and the
    next outage's local share (:meth:`Budgets.localize`), until the counter's next answer
    (for a quiet tenant, its window's end). Settles that find their reservation, the normal
    case, take no more round trips. Every settle of a shared reservation goes through
    :meth:`settle` or :meth:`give_back`, so this holds for all of them.

    Entries are kept up to :data:`MAX_PENDING`; beyond that the oldest are dropped (logged),
    so an outage with heavy traffic cannot grow memory without bound.
    """

    __slots__ = ("_budgets",)

    def __init__(self, budgets: Budgets) -> None:
        super().__init__(budgets.background, MAX_PENDING)
        self._budgets = budgets

    async def settle(self, reservation: Reservation, actual: list[float]) -> None:
        """Settle a shared reservation now; if Redis does not answer, keep it for later."""
        await self.send(_Pending(reservation.rid, None, actual, _keys(reservation.claims)))

    async def give_back(self, reservation: Reservation, takes: Sequence[Take]) -> None:
        """Release a reservation with nothing spent and refund ``takes`` in one call; if
        Redis does not answer, keep the release for later (the refund is dropped: the units
        drain within their period)."""
        budgets = self._budgets
        source = reservation.source
        entry = _Pending(reservation.rid, None, [0.0] * len(reservation.claims),
                         _keys(reservation.claims))
        try:
            released = await source.admissions.release(budgets.group, takes, reservation.rid,
                                                       bool(reservation.claims))
            if not released and source.redis is not None:
                await source.ledger.levels(budgets.group, entry.keys)
        except StateUnavailable:
            self.keep(entry)
            raise

    def charge(self, claims: list[Claim], actual: list[float]) -> None:
        """Keep spend made on the local fallback, to charge the shared ledger later."""
        spent = [claim._replace(amount=used, cap=UNCAPPED)
                 for claim, used in zip(claims, actual, strict=True) if used]
        if spent:
            self.keep(_Pending(uuid.uuid4().hex, spent, None, _keys(spent)))

    def _round_name(self) -> str:
        return f"budget reconcile on {self._budgets.group}"

    def _dropped(self, entry: _Pending) -> None:
        log.warning("budget spend to reconcile on %s dropped (over %d kept): %s",
                    self._budgets.group, MAX_PENDING, entry, extra=PER_CALL)

    def _sent(self, count: int) -> None:
        log.warning("budget spend of %s reconciled into the shared ledger on %s",
                    counted(count, "call"), self._budgets.group)

    async def _send(self, entry: _Pending) -> None:
        """Apply one entry to the shared ledger, and read its counters' levels if its settle
        found nothing (see the class docstring). Safe to repeat after a failure."""
        budgets = self._budgets
        ledger, group = budgets.backends.ledger, budgets.group
        if entry.actual is None:  # local spend: held uncapped under its own id first
            assert entry.claims is not None
            await ledger.reserve(group, entry.rid, entry.claims, budgets.clock(),
                                 budgets.hold_s)
            entry.actual = [claim.amount for claim in entry.claims]
        # Local spend's id is marked gone even if it held: a reserve of it sent in an earlier
        # round may still be on its way, and must not hold again once this one settled (a
        # review). A call's own reserve is sent once: its settle leaves no mark.
        if not await ledger.settle(group, entry.rid, entry.actual,
                                   mark=entry.claims is not None):
            await ledger.levels(group, entry.keys)


class _Pending:
    """One reconcile entry: a shared reservation to settle (``claims`` ``None``), or local
    spend to charge (``claims``: amounts spent, ``actual`` set once the charge is held);
    ``keys``: its counters, read again if its settle finds nothing."""

    __slots__ = ("actual", "claims", "keys", "rid")

    def __init__(self, rid: str, claims: list[Claim] | None, actual: list[float] | None,
                 keys: list[str]) -> None:
        self.rid = rid
        self.claims = claims
        self.actual = actual
        self.keys = keys

    def __repr__(self) -> str:
        return f"_Pending({self.rid!r}, {self.claims!r}, {self.actual!r})"


def _keys(claims: Iterable[Claim]) -> list[str]:
    return [claim.key for claim in claims]


def _mean_keys(key: str) -> tuple[str, str]:
    """What :class:`HoldTimes` keeps a mean hold time under for counter ``key``
    (``limit:scope:window``, :meth:`Budgets._key`): its series (limit and scope, every window:
    a new minute must not forget what calls take, a review) and its limit (every scope: for
    a tenant or run not seen to settle yet)."""
    return key.rpartition(":")[0], key.partition(":")[0]


def longest_call_s(route: RouteConfig, fanout_wait_s: float = 0.0) -> float:
    """The longest a call of ``route`` may hold its reservation, seconds: from its admission
    by the budget to its answer's end, over the route's plan and each operation's.

    A plan's queue waits add up, since a call may wait out each in turn: ``fanout_wait_s``
    (the top-level ``fanout``'s ``max_wait``, when it has a ``width``), the route's
    ``fanout``, its ``concurrency`` and the operation's. Then its attempts: without
    ``retry``, one of up to ``timeouts.total``; with it, ``attempts`` of them and a wait
    between each two of up to the longer of ``backoff.max`` and ``max_retry_after``
    stretched by :data:`policies.retry.HINT_JITTER`, or, when shorter, ``retry.deadline``
    (which bounds the waits for answers) plus one ``timeouts.total`` (the last answer's
    body, which only that bounds).
    """
    def waits(*blocks: ConcurrencyConfig | FanoutConfig | None) -> float:
        return sum(block.max_wait for block in blocks if block is not None)

    fanout = route.fanout if route.fanout is not None and route.fanout.width else None
    base = fanout_wait_s + waits(fanout, route.concurrency)
    plans = [(base, route.retry, route.timeouts)] + [
        (base + waits(op.concurrency), op.retry or route.retry, route.timeouts_for(op))
        for op in route.operations()[1].values()]
    longest = 0.0
    for queue, retry, timeouts in plans:
        run = timeouts.total
        if retry is not None:
            between = max(retry.backoff.max, retry.max_retry_after * (1 + HINT_JITTER))
            run = retry.attempts * timeouts.total + (retry.attempts - 1) * between
            if retry.deadline is not None:
                run = min(run, retry.deadline + timeouts.total)
        longest = max(longest, queue + run)
    return longest


def hold_for(route: RouteConfig, fanout_wait_s: float = 0.0) -> float:
    """How long ``route``'s reservations are held before the ledger may reap them, seconds:
    :data:`HOLD_S`, or its longest call plus :data:`HOLD_MARGIN_S` when that is longer (a
    call still running must never lose its reservation: a budget would be overspent)."""
    return max(HOLD_S, longest_call_s(route, fanout_wait_s) + HOLD_MARGIN_S)


def _amount(unit: str, usage: Usage, price: ModelPrice | None, worst_case: bool = False
            ) -> float:
    if unit == "tokens":
        return usage.input_tokens + usage.output_tokens
    if unit == "input_tokens":
        return usage.input_tokens
    if unit == "output_tokens":
        return usage.output_tokens
    if price is None:
        return 0.0  # unreachable for usd limits: reserve() refuses unpriced models
    return price_usd(price, usage, worst_case)


def price_usd(price: ModelPrice, usage: Usage, worst_case: bool = False) -> float:
    """USD of ``usage`` at ``price``; ``worst_case`` prices every input token at the dearest
    input rate (an estimate cannot tell which will be cache writes)."""
    read = price.input if price.cache_read is None else price.cache_read
    write = price.input if price.cache_write is None else price.cache_write
    if worst_case:
        dearest = max(price.input, read, write)
        return cost_usd(usage, dearest, price.output, dearest, dearest)
    return cost_usd(usage, price.input, price.output, read, write)


def _window_end(period_s: int, now: float) -> float:
    return (now // period_s + 1) * period_s


def _fmt_number(unit: str, value: float) -> str:
    return f"{value:.6f}" if unit == "usd" else str(int(value))


def _fmt(unit: str, value: float) -> str:
    return f"${value:.6f}" if unit == "usd" else f"{int(value)} {unit.replace('_', ' ')}"


def clock_from_env(environ: dict[str, str] | None = None) -> Callable[[], float]:
    """The wall clock budgets read: ``time.time``, unless ``SLUICE_TEST_NOW`` (Unix seconds)
    is set, for tests: then the clock reads that value at its first reading and runs on in
    real time from there (so a test can start just before a UTC midnight)."""
    raw = (os.environ if environ is None else environ).get("SLUICE_TEST_NOW")
    if not raw:
        return time.time
    start = float(raw)
    logging.getLogger("sluice").warning(
        "SLUICE_TEST_NOW is set: budget windows run on a test clock starting at %s", raw)
    origin: list[float] = []

    def test_clock() -> float:
        if not origin:
            origin.append(time.monotonic())
        return start + time.monotonic() - origin[0]

    return test_clock
