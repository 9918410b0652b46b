"""One admission across rate buckets and budget holds: all or nothing, in one round trip.

A metered call on a route with rates and budgets must take a unit from each request bucket
(route, tenant), its reserved tokens from the token bucket, and hold its worst case on every
budget limit. Done as a rate call then a ledger call, that is two Redis round trips on the
request path, and a refusal by the ledger after the buckets took their units needs a third
(the refund). :meth:`Admissions.admit` does both in one step: every bucket takes its amount
and every claim is held under the reservation id, or nothing changes at all.

The rules stay where they are: GCRA and its ``Retry-After`` in :mod:`policies.state.rate`
(its Lua functions, :data:`~policies.state.rate.GCRA_LUA`), reserve/settle/reap in
:mod:`policies.state.ledger` (:data:`~policies.state.ledger.LEDGER_LUA`); the script here only
chains them. The answer carries both verdicts, so the caller can name the limit whose wait is
longest (a retry after it fits every limit, if nothing else came meanwhile).

Redis: one ``EVALSHA`` whose keys (the buckets, the group's reservation hash and expiry set,
the budget counters) all carry the group's hash tag, so in a Redis Cluster it runs on one
slot. Memory: the memory buckets and ledger are checked, then taken, with no ``await`` in
between, so the step is atomic on the event loop. Settling stays the ledger's
(:meth:`~policies.state.ledger.Ledger.settle`, one round trip, exactly once by id); a call
that never reached the upstream gives both back in one step too (:meth:`Admissions.release`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from policies.state.connection import RedisState, Script
from policies.state.ledger import (
    LEDGER_LUA,
    Claim,
    MemoryLedger,
    RedisLedger,
    hold_ms_of,
)
from policies.state.rate import (
    GCRA_LUA,
    Holder,
    MemoryRateBuckets,
    RateResult,
    RedisRateBuckets,
    Take,
    bucket_args,
    holder_args,
    memory_plan,
    rate_result,
)


class AdmissionResult(NamedTuple):
    """The answer of :meth:`Admissions.admit`.

    Attributes:
        admitted: every bucket took its amount and every claim is held; ``False``: nothing
            was taken or held.
        rates: the buckets' verdict (its ``admitted`` is this call's; ``denied`` and
            ``retry_after_s`` name the bucket with the longest wait, if one does not fit;
            ``remaining`` is per bucket, after the take when admitted).
        denied: indexes of the claims that do not fit (empty when they all do).
    """

    admitted: bool
    rates: RateResult
    denied: list[int]


class Admissions(Protocol):
    """Rate buckets and budget holds taken together. One round trip per call.

    Raises:
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    async def admit(self, group: str, takes: Sequence[Take], rid: str,
                    claims: Sequence[Claim], now: float, hold_s: float,
                    holder: Holder | None = None) -> AdmissionResult:
        """Take each bucket's amount and hold every claim under reservation ``rid``, or do
        neither.

        Args:
            group: the route's group (one hash slot), for the buckets and the ledger alike.
            takes: the buckets and amounts (:class:`~policies.state.rate.Take`), maybe none.
            rid: the reservation id (unused without claims); an id already held is admitted
                without taking or holding anything again.
            claims: the budget claims (:class:`~policies.state.ledger.Claim`), maybe none.
            now: Unix seconds on the caller's clock (the one its window names come from).
            hold_s: how long the reservation may stay unsettled before it is reaped, seconds.
            holder: the rate limiter taking (Redis: each bucket is checked and drained by
                the lowest rate live holders recorded on it, as
                :meth:`~policies.state.rate.RateBuckets.admit` says).
        """
        ...

    async def release(self, group: str, takes: Sequence[Take], rid: str,
                      claimed: bool = True) -> bool:
        """Give back what :meth:`admit` took for a call that never reached the upstream:
        refund each bucket's amount and release reservation ``rid`` with nothing spent, in
        one step. The release is once by id (``False``: nothing was held under ``rid``).
        ``claimed``: the admission held claims, and took its units with them: with nothing
        held under ``rid`` it took none (it was refused, or has not landed: with Redis, an
        admission delayed on its way then finds ``rid`` marked gone and takes nothing), so
        nothing is refunded. Without claims the refund is not once by id: it is the
        caller's to ask once per admission."""
        ...


class MemoryAdmissions:
    """Over one process's buckets and ledger; nothing suspends, so each call is atomic."""

    def __init__(self, rates: MemoryRateBuckets, ledger: MemoryLedger) -> None:
        self._rates = rates
        self._ledger = ledger

    async def admit(self, group: str, takes: Sequence[Take], rid: str,
                    claims: Sequence[Claim], now: float, hold_s: float,
                    holder: Holder | None = None) -> AdmissionResult:
        rates, ledger = self._rates, self._ledger
        plan = memory_plan(group, takes)
        denied = ledger.check(group, rid, claims, now, hold_s) if claims else []
        if claims and ledger.holds(group, rid):  # admitted before: take nothing again
            verdict = rates.check(plan, rates.now_us())
            return AdmissionResult(True, verdict._replace(admitted=True, denied=None,
                                                          retry_after_s=0.0), [])
        if denied:  # the rates' verdict too, taking nothing: the caller names the longest wait
            verdict = rates.check(plan, rates.now_us())
            return AdmissionResult(False, verdict._replace(admitted=False), denied)
        refused = rates.take(plan)
        if refused is not None:
            return AdmissionResult(False, refused, [])
        if claims:
            ledger.hold(group, rid, claims, now, hold_s)
        return AdmissionResult(True, rates.taken(plan), [])

    async def release(self, group: str, takes: Sequence[Take], rid: str,
                      claimed: bool = True) -> bool:
        held = self._ledger.release(group, rid)
        if held or not claimed:
            await self._rates.refund(group, takes)
        return held


# KEYS: the reservations hash and its expiry set, then the buckets, then (with a holder) their
# records hashes, then the counters. ARGV: number of buckets, rid, hold ms, the holder ('' for
# none), its records' lease ms, (limit, period us, amount) per bucket, then (amount, cap,
# counter TTL ms) per claim. Returns {admitted 0|1, refusing bucket (1-based, 0 none), its wait
# in us as text, the rate it was checked by ('limit interval_us', '' for none), remaining per
# bucket, denied claims (0-based), levels of the counters after}.
# The ledger is reaped (and the id looked up) only when there are claims.
_ADMIT = Script(GCRA_LUA + LEDGER_LUA + """
local n, rid, hold = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local r = 2 + n
if ARGV[4] ~= '' then r = 2 + 2 * n end
local m = #KEYS - r
local b = buckets(2, 5, n, 2 + n, ARGV[4], tonumber(ARGV[5]))
local refused, wait = refusing(b)
local denied, held = {}, false
if m > 0 then
  reap(KEYS[1], KEYS[2], hold)
  held = redis.call('HEXISTS', KEYS[1], rid) == 1
  if not held then denied = denied_claims(r, 5 + 3 * n, m) end
end
local admitted = 0
if held then
  admitted, refused, wait = 1, 0, '0'
elseif refused == 0 and #denied == 0 then
  take(b)
  if m > 0 then hold_claims(KEYS[1], KEYS[2], rid, hold, r, 5 + 3 * n, m) end
  admitted = 1
end
return {admitted, refused, wait, applied(b, refused), remaining(b), denied, levels(r + 1)}
""", "admission")


# KEYS: the reservations hash and its expiry set, then the buckets. ARGV: rid, then (limit,
# period us, amount) per bucket, then '1' if the admission held claims (else '0'), then how
# long an id not held is marked gone, ms. Returns {1 when the reservation was released, 0
# if not held, the levels of its counters after (as the ledger's settle)}.
_RELEASE = Script(GCRA_LUA + LEDGER_LUA + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local rec = raw and record(KEYS[1], raw)
-- Checked before the refund writes anything (see settleable in LEDGER_LUA).
if rec and rec.s ~= 'x' then settleable(rec) end
local b = buckets(2, 1, #KEYS - 2)
-- An admission with claims takes its units with its hold, in one script: no hold, no units
-- (not landed yet, and the mark below makes it take nothing when it does; or refused).
if ARGV[#ARGV - 1] == '0' or (rec and rec.s ~= 'x') then refund(b) end
return settle_levels(KEYS[1], KEYS[2], ARGV[1], nil, tonumber(ARGV[#ARGV]))
""", "admission")


class RedisAdmissions:
    """In Redis: each call one ``EVALSHA`` on the group's slot. The counters' levels it
    answers with are kept by ``ledger`` (for budget headers, as its own reserve does)."""

    def __init__(self, state: RedisState, rates: RedisRateBuckets, ledger: RedisLedger
                 ) -> None:
        self._state = state
        self._rates = rates
        self._ledger = ledger

    async def admit(self, group: str, takes: Sequence[Take], rid: str,
                    claims: Sequence[Claim], now: float, hold_s: float,
                    holder: Holder | None = None) -> AdmissionResult:
        ledger = self._ledger
        hold_ms = hold_ms_of(hold_s)
        if claims:
            ledger.note_hold(group, hold_ms)
        keys = ledger.reservation_keys(group) + self._rates.keys(group, takes)
        if holder is not None:
            keys += self._rates.record_keys(group, takes)
        keys += [ledger.counter(group, claim.key) for claim in claims]
        args = [len(takes), rid, hold_ms, *holder_args(holder), *bucket_args(takes),
                *ledger.claim_args(claims, now, hold_ms)]

        def read(reply: Sequence[Any]) -> AdmissionResult:
            admitted, refused, wait, applied, remaining, denied, flat = reply
            if claims:
                ledger.remember(group, [claim.key for claim in claims], flat)
            rates = rate_result(bool(admitted), int(refused), wait, applied, remaining)
            return AdmissionResult(bool(admitted), rates, [int(i) for i in denied])

        return await self._state.eval(_ADMIT, keys, args, read)

    async def release(self, group: str, takes: Sequence[Take], rid: str,
                      claimed: bool = True) -> bool:
        keys = self._ledger.reservation_keys(group) + self._rates.keys(group, takes)
        return await self._state.eval(
            _RELEASE, keys, [rid, *bucket_args(takes), "1" if claimed else "0",
                             self._ledger.gone_ms(group)],
            lambda reply: self._ledger.remember_settled(group, reply))
