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
another limit's reset): the end of the window when the spend alone leaves no room, or a short
wait (:data:`SETTLE_WAIT_S`) when only reservations of requests in flight are in the way, since
those settle to actual usage, usually less. A spent ``N/total`` budget never frees, so it says
``x-should-retry: false`` with no wait. A request whose own worst case exceeds a whole limit is
refused at once with 400 ``exceeds_limit``.

The ledger holding the counters is behind :class:`Ledger`, so a shared (Redis) one can replace
the in-memory one; :class:`Budgets` keeps the rules.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from policies.config import BudgetConfig, ModelPrice
from policies.reasons import Reason, Rejected
from policies.usage import Usage, cost_usd

#: Suggested wait when only reservations of requests in flight deny, seconds: they settle
#: within a request's duration, usually to less than they hold.
SETTLE_WAIT_S = 1.0
#: How often the in-memory ledger forgets counters of ended windows and idle runs, seconds.
SWEEP_INTERVAL_S = 60.0
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


class Claim(NamedTuple):
    """One limit's part of a reservation: ``amount`` held on counter ``key`` whose limit is
    ``cap``; the counter may be forgotten after ``expires_at`` (Unix seconds) once idle."""

    key: Hashable
    amount: float
    cap: float
    expires_at: float


class Ledger(Protocol):
    """Counters of spent and reserved amounts. Implementations: :class:`MemoryLedger`."""

    async def reserve(self, claims: Sequence[Claim], now: float) -> list[int]:
        """Hold every claim, or none: returns the indexes of the claims that do not fit
        (``spent + reserved + amount > cap``), empty when all were held."""
        ...

    def settle(self, claims: Sequence[Claim], actual: Sequence[float]) -> None:
        """Release each claim's hold and add ``actual`` to its spend. Never blocks (a remote
        ledger queues it), so it may run in a ``finally`` that must not await."""
        ...

    def level(self, key: Hashable) -> tuple[float, float]:
        """``(spent, reserved)`` of a counter, for headers and gauges (a remote ledger may
        answer from the values its last ``reserve`` saw)."""
        ...


class MemoryLedger:
    """The ledger of one process. ``reserve`` never suspends, so it is atomic on the loop."""

    def __init__(self) -> None:
        self._spent: dict[Hashable, float] = {}
        self._held: dict[Hashable, float] = {}
        self._expiry: dict[Hashable, float] = {}
        self._next_sweep = 0.0

    async def reserve(self, claims: Sequence[Claim], now: float) -> list[int]:
        if now >= self._next_sweep:
            self._sweep(now)
        spent, held = self._spent, self._held
        denied = [
            i for i, (key, amount, cap, _) in enumerate(claims)
            if spent.get(key, 0.0) + held.get(key, 0.0) + amount > cap
        ]
        if denied:
            return denied
        expiry = self._expiry
        for key, amount, _, expires_at in claims:
            held[key] = held.get(key, 0.0) + amount
            if expires_at > expiry.get(key, 0.0):
                expiry[key] = expires_at
        return denied

    def settle(self, claims: Sequence[Claim], actual: Sequence[float]) -> None:
        spent, held = self._spent, self._held
        for (key, amount, _, _), used in zip(claims, actual, strict=True):
            left = held.get(key, 0.0) - amount
            if left > 1e-9:
                held[key] = left
            else:  # float dust from USD sums must not read as a live reservation
                held.pop(key, None)
            if used:
                spent[key] = spent.get(key, 0.0) + used

    def level(self, key: Hashable) -> tuple[float, float]:
        return self._spent.get(key, 0.0), self._held.get(key, 0.0)

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + SWEEP_INTERVAL_S
        for key in [k for k, t in self._expiry.items() if t <= now and k not in self._held]:
            del self._expiry[key]
            self._spent.pop(key, None)


class Reservation:
    """What one request holds: its claims, and the limits they belong to."""

    __slots__ = ("claims", "limits", "price")

    def __init__(self, claims: list[Claim], limits: list[Limit], price: ModelPrice | None):
        self.claims = claims
        self.limits = limits
        self.price = price


class Budgets:
    """The budget blocks of one route over a ledger.

    Args:
        blocks: the route's ``budget`` blocks.
        pricing: the top-level ``pricing`` table (USD per million tokens, by model).
        ledger: where the counters live.
        clock: Unix seconds now (injectable for tests).
    """

    def __init__(self, blocks: Sequence[BudgetConfig], pricing: dict[str, ModelPrice],
                 ledger: Ledger, clock: Callable[[], float]) -> None:
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
        self.ledger = ledger
        self.clock = clock

    # -- admission ----------------------------------------------------------------------------

    async def reserve(self, tenant: str, run: str | None, model: str | None,
                      input_tokens: int, output_tokens: int,
                      ancestors: Sequence[str] = ()) -> Reservation:
        """Hold the worst case of one request on every limit, or refuse it.

        A ``per: run`` limit is held on the run *and on each of its ``ancestors``* (its parent
        first): every run's counter covers its whole subtree, so a parent's budget bounds what
        its sub-agents spend, and each sub-agent still has its own.

        Raises:
            Rejected: ``unpriced_model`` (400) when a usd limit applies and ``model`` has no
                price; ``exceeds_limit`` (400) when the worst case exceeds a whole limit;
                ``budget_exhausted`` (429) when it does not fit now.
        """
        price = self.pricing.get(model) if model is not None else None
        if price is None and self.needs_price:
            raise Rejected(Reason.UNPRICED_MODEL, None,
                           f"model {model!r} is not in the pricing table", retry=False)
        now = self.clock()
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
                    retry=False,
                )
            for scope_run in (run, *ancestors) if limit.per == "run" else (run,):
                claims.append(Claim(self._key(limit, tenant, scope_run, now), amount,
                                    limit.amount, self._expiry(limit, now)))
                limits.append(limit)
        denied = await self.ledger.reserve(claims, now)
        if denied:
            raise self._refusal([(limits[i], claims[i]) for i in denied], now)
        return Reservation(claims, limits, price)

    def settle(self, reservation: Reservation, usage: Usage | None) -> None:
        """Replace a reservation by ``usage`` (``None``: nothing was used). Never awaits."""
        if usage is None:
            actual = [0.0] * len(reservation.claims)
        else:
            actual = [_amount(limit.unit, usage, reservation.price)
                      for limit in reservation.limits]
        self.ledger.settle(reservation.claims, actual)

    # -- reporting ----------------------------------------------------------------------------

    def headers(self, reservation: Reservation) -> dict[str, str]:
        """Headers for an admitted answer, from the binding limit: the one with the largest
        share spent or reserved (this request's reservation included); the warning names the
        fullest limit past its block's ``warn_at``.

        ``X-Sluice-Budget-Remaining`` is what is left of it (tokens, or USD);
        ``X-Sluice-Budget-Policy`` names it in the IETF ``RateLimit-Policy`` syntax
        (``"name";q=LIMIT;w=WINDOW_S``); ``X-Sluice-Budget-Reset`` gives the seconds until its
        window ends (absent for a total); ``X-Sluice-Budget-Warning``
        (``"name";used=FRACTION``) appears once the block's ``warn_at`` is reached.
        """
        binding: tuple[float, Limit, float] | None = None
        warning: tuple[float, Limit] | None = None
        for limit, claim in zip(reservation.limits, reservation.claims, strict=True):
            spent, held = self.ledger.level(claim.key)
            used = (spent + held) / limit.amount
            if binding is None or used > binding[0]:
                binding = (used, limit, limit.amount - spent - held)
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
        """Least left now of this unit's limits for a scope (``per`` tenant or route)."""
        now = self.clock()
        left = math.inf
        for limit in self.limits:
            if limit.unit == unit and limit.per == per:
                spent, held = self.ledger.level(self._key(limit, tenant, None, now))
                left = min(left, limit.amount - spent - held)
        return max(left, 0.0)

    def reserved(self, unit: str, per: str, tenant: str) -> float:
        """Held now by requests in flight on this unit's limits for a scope."""
        now = self.clock()
        return sum(
            self.ledger.level(self._key(limit, tenant, None, now))[1]
            for limit in self.limits if limit.unit == unit and limit.per == per
        )

    # -- internals ----------------------------------------------------------------------------

    @staticmethod
    def _key(limit: Limit, tenant: str, run: str | None, now: float) -> Hashable:
        if limit.per == "tenant":
            scope: Hashable = tenant
        elif limit.per == "run":
            scope = (tenant, run)
        else:
            scope = ""
        window = 0 if limit.period_s is None else int(now // limit.period_s)
        return (limit.name, scope, window)

    @staticmethod
    def _expiry(limit: Limit, now: float) -> float:
        if limit.period_s is None:
            return now + limit.ttl_s
        return _window_end(limit.period_s, now)

    def _refusal(self, denials: list[tuple[Limit, Claim]], now: float) -> Rejected:
        """``budget_exhausted`` with the wait of the slowest denying limit."""
        waits: list[float | None] = []
        details = []
        for limit, claim in denials:
            spent, held = self.ledger.level(claim.key)
            if spent + claim.amount <= limit.amount:
                waits.append(SETTLE_WAIT_S)  # only requests in flight are in the way
            elif limit.period_s is None:
                waits.append(None)  # a run's total never frees
            else:
                waits.append(_window_end(limit.period_s, now) - now)
            details.append(
                f"{limit.name} {limit.text}: {_fmt(limit.unit, spent)} spent, "
                f"{_fmt(limit.unit, held)} reserved by requests in flight, this request "
                f"needs up to {_fmt(limit.unit, claim.amount)}"
            )
        never = any(w is None for w in waits)
        wait = None if never else max(w for w in waits if w is not None)
        limit = denials[0][0]
        policy = None
        if limit.unit != "usd" and limit.period_s is not None:
            policy = (limit.name, int(limit.amount), limit.period_s)
        return Rejected(Reason.BUDGET_EXHAUSTED, wait, "; ".join(details), policy,
                        retry=False if never else None)


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
