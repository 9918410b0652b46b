"""Rate buckets (GCRA) shared by every replica: one atomic admission across several buckets.

The algorithm is the Generic Cell Rate Algorithm (ITU-T I.371; Brandur Leach's "Rate Limiting,
Cells, and GCRA" explains it for HTTP APIs) in its *continuous-state leaky bucket* form, which
I.371 defines as equivalent to the virtual-scheduling (theoretical-arrival-time) form: a bucket
of ``limit`` units drains at ``limit / period_s`` units per second and holds its ``level`` as
of a time ``t``. An admission taking ``amount`` units fits when ``level + amount <= limit``, so
a burst of ``limit`` passes and then the steady rate. This is exactly the semantics
:mod:`policies.rate` had with aiolimiter (it now uses these buckets), including its
``Retry-After``: the time until the bucket has drained enough,
``(level + amount - limit) * period_s / limit`` seconds (RFC 9110 §10.2.3; the IETF RateLimit
fields draft calls the same quantity the reset of the quota).

The level form (rather than storing the theoretical arrival time) keeps the numbers small, so
float rounding never decides an admission, and lets a bucket keep its level when a reload
changes its rate. A bucket stores the rate it was last taken at with its level and drains at
that rate until its next take, which stores the new one: what was taken before a reload drains
at the old rate (to the next take after the reload), not at the new one.

One :meth:`RateBuckets.admit` covers every bucket that applies to a call (route requests,
tenant requests, tokens): all of them take their amount, or none does, and a refusal names the
bucket with the longest wait, so a retry after ``retry_after_s`` fits every bucket (if no other
traffic came meanwhile). In Redis it is one Lua script; time is the server's (``TIME``), so
replicas' clocks do not matter. Keys: ``<prefix>:{<group>}:rate:<name>``, a hash ``{l, t, i}``
(level, time in microseconds, microseconds per unit) that expires once the bucket has drained
(an absent bucket is an empty one; a hash without ``i``, written before it was kept, drains at
the rate of the call reading it).

**Replicas whose rates differ share the lowest.** A reload reaches replicas one at a time
(a ConfigMap's file change is seen by each pod at its own moment), so for a while they take
from one bucket with different rates. Checked against its own rate, a replica reloaded from
``600/min`` to ``60/min`` was served nothing (the others kept the level above 60) while the
others went on at 600. So an admission names its *holder* (:class:`Holder`: one route's
limiter on one replica) and each bucket keeps, in ``<prefix>:{<group>}:rate:lim:<name>``, a
hash of holder -> ``"limit interval_us expiry_ms"``, the rate each holder last took with, for
``state.lease`` (as :mod:`policies.state.leases` keeps the concurrency limits). Each take
records its own, drops the lapsed ones (and any it cannot read), and checks and drains the
bucket by the lowest live rate, in the same script (no extra round trip). The hash expires
with its last record, so a replica killed with the lower rate stops constraining the others
one lease time after its last admission, and a raised rate applies once no live replica
holds the old one.

*Lowest* is per component: the smallest limit (the burst) and the longest interval (GCRA's
emission interval, ``period / limit``: the slowest steady rate), which may come from two
holders. That bucket admits, over any window ``w``, at most ``limit + w / interval`` units,
no more than any live holder's own rate would: comparing whole rates by units per second
would let ``600/min`` (a burst of 600) pass on a bucket another replica limits to ``10/s``
(a burst of 10) at the same steady rate. During a change of period, the bucket can be
stricter than either rate (``100/10min`` and ``20/min`` give a burst of 20 at one unit per
6 s); that lasts until the replicas agree, at most a lease time after the last one reloaded.

An amount over another holder's limit but within this holder's (a token reservation, when
the replicas' token rates differ) is not one that can never pass: it fits once the lower
records lapse. Its wait is until the last of them lapses (each at its own expiry: its
holder's lease after its last take, if it takes no more), or, if later, until the level has
drained, at the rate it was stored with, to the smallest limit among those it fits (this
holder's included): the limit the bucket is checked by then. Only an amount over the holder's
own limit waits forever.

The answer names the rate the refusing bucket was checked by (:attr:`RateResult.applied`),
so a refusal's ``RateLimit-Policy`` and message can give the rate that refused, not the
caller's own: one more field in the same reply.

A refund is not a take: it records nothing and leaves the level draining at the rate it was
stored with. The memory buckets serve one process, whose limiter is the only holder, so they
ignore holders.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from policies.state.connection import RedisState, Script

T = TypeVar("T")

#: Level overshoot forgiven as float rounding, as a fraction of the limit.
_DUST = 1e-9
#: How often the memory buckets forget drained buckets, seconds.
_SWEEP_INTERVAL_S = 60.0
#: Seconds between sweeps while ``max_buckets`` are kept: a bucket drained since is a new
#: tenant refused for nothing until the next sweep; a sweep walks every bucket (~70 ms for
#: 250,000), so not at every refused take.
_FULL_SWEEP_INTERVAL_S = 5.0
#: Buckets kept before a sweep is due whatever the interval (at least; see ``_sweep``).
_SWEEP_AT_SIZE = 4096
#: Buckets the memory buckets keep at most (``state.max_rate_buckets``'s default): each takes
#: ~0.4 KiB with a 100-character tenant id in its name, so ~100 MB at most.
MAX_BUCKETS = 250_000


class RateBucketsFull(Exception):
    """The memory buckets keep ``cap`` buckets that have not drained, and a take needs a new
    one (a new tenant's, with ``rate.per_tenant``).

    Nothing was taken. Buckets already kept go on working; a bucket is freed once it has
    drained, never earlier, so no tenant's spent rate is ever given back to make room.
    """

    def __init__(self, cap: int) -> None:
        super().__init__(f"the memory state keeps {cap} rate buckets")
        self.cap = cap


class Take(NamedTuple):
    """One bucket an admission draws on.

    Attributes:
        name: the bucket within its group, e.g. ``requests``, ``tenant:acme``, ``tokens``.
        limit: units per period, which is also the burst (a whole bucket).
        period_s: the period, seconds (a rate of ``600/min`` is ``Take(.., 600, 60.0)``).
        amount: units this call takes: 1 for a request, the reserved tokens for tokens.
    """

    name: str
    limit: int
    period_s: float
    amount: float = 1


class RateResult(NamedTuple):
    """The answer of :meth:`RateBuckets.admit`.

    Attributes:
        admitted: every bucket took its amount; ``False``: none did.
        denied: index (into the takes) of the refusing bucket with the longest wait, or
            ``None``.
        retry_after_s: seconds until every bucket would fit the call; 0 when admitted;
            ``math.inf`` when an amount exceeds its whole bucket as the caller's own rate
            gives it (it can never pass). An amount over only another holder's lower limit
            waits until those records lapse (see the module docstring).
        remaining: per bucket, whole units it could still admit now (after this call's
            take when admitted), for ``RateLimit`` headers.
        applied: ``(limit, period_s)`` the refusing bucket was checked by, when it is not
            necessarily the take's own: the lowest live rate of the holders (Redis, with a
            holder; ``period_s`` is ``limit`` times the longest interval, so a rate mixed
            from two holders reads as the one it enforces). ``None``: the take's own.
    """

    admitted: bool
    denied: int | None
    retry_after_s: float
    remaining: tuple[int, ...]
    applied: tuple[float, float] | None = None


class Holder(NamedTuple):
    """Who takes from shared buckets: one route's rate limiter on one replica.

    Attributes:
        id: its name among the replicas' (random, as a concurrency holder's).
        lease_s: seconds its rates stay recorded after its last admission
            (``state.lease``).
    """

    id: str
    lease_s: float


class RateBuckets(Protocol):
    """Shared GCRA buckets. Every method is one round trip to the backend.

    Raises (every method):
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    async def admit(self, group: str, takes: Sequence[Take], holder: Holder | None = None
                    ) -> RateResult:
        """Take each bucket's amount, all or none (see :class:`RateResult`).

        With ``holder``, each take's rate is recorded as the holder's for its lease, and each
        bucket is checked and drained by the lowest rate recorded on it by a live holder
        (Redis; the memory buckets have one process, so they ignore it)."""
        ...

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        """Give back what an admitted call took (a later step refused it, or it never reached
        the upstream); a bucket never drops below empty."""
        ...

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        """Whole units each bucket could admit now; takes nothing (``amount`` is ignored)."""
        ...


# -- memory -----------------------------------------------------------------------------------


#: One bucket of a memory admission, prepared from its :class:`Take` by :func:`memory_plan`:
#: its key ``(group, name)``, limit, amount (a float), microseconds per unit (GCRA's emission
#: interval) and the overshoot its check forgives as float rounding (``limit * 1e-9``; ``-inf``
#: when the amount exceeds the whole bucket, so that it never fits).
PlannedBucket = tuple[tuple[str, str], int, float, float, float]
#: The buckets of one memory admission, in the order of its takes.
Plan = tuple[PlannedBucket, ...]


def memory_plan(group: str, takes: Sequence[Take]) -> Plan:
    """``takes`` in ``group`` as :class:`MemoryRateBuckets` reads them: everything an
    admission derives from its takes, computed once (a caller that names the same buckets on
    every call, as :class:`policies.rate.RateLimiter` does per tenant, keeps it)."""
    return tuple(((group, take.name), take.limit, float(take.amount),
                  take.period_s * 1e6 / take.limit,
                  take.limit * _DUST if take.amount <= take.limit else -math.inf)
                 for take in takes)


class MemoryRateBuckets:
    """The buckets of one process. Nothing suspends, so each call is atomic on the loop.

    The request path calls :meth:`take` with a :data:`Plan` it keeps; the
    :class:`RateBuckets` methods prepare theirs on each call.

    At most ``max_buckets`` are kept (a bucket per tenant ever seen within its period would
    grow with the tenant ids callers make up): a take that needs a new one beyond it raises
    :class:`RateBucketsFull` and takes nothing, while buckets already kept keep working.

    Args:
        clock_ns: wall time in nanoseconds (injectable for tests); buckets keep microseconds.
        max_buckets: the cap on buckets kept (``state.max_rate_buckets``).
    """

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns,
                 max_buckets: int = MAX_BUCKETS) -> None:
        self._clock_ns = clock_ns
        self.max_buckets = max_buckets
        # (group, name) -> (level, t_us, us per unit); replaced, never changed in place
        self._buckets: dict[tuple[str, str], tuple[float, int, float]] = {}
        self._next_sweep = 0
        self._sweep_at_size: float = min(_SWEEP_AT_SIZE, max_buckets)

    def __len__(self) -> int:
        return len(self._buckets)

    def now_us(self) -> int:
        """The clock in microseconds."""
        return self._clock_ns() // 1000

    def take(self, plan: Plan) -> RateResult | None:
        """Take every bucket's amount now, all or none: ``None`` once taken, else the refusal
        (as :meth:`admit` answers it; nothing is taken).

        The request path's step, so it does the least: each level is computed once, the new
        states are stored in one ``update`` after every bucket fits, and an admission builds
        no answer (its ``remaining`` is for Redis's headers; :meth:`taken` reads it).

        Raises:
            RateBucketsFull: a bucket is new and ``max_buckets`` are kept; nothing is taken.
        """
        now = self._clock_ns() // 1000  # now_us(), inline: this runs once per request
        if now >= self._next_sweep:
            self._sweep(now)
        buckets = self._buckets
        updated = {}
        for key, limit, amount, interval, dust in plan:
            state = buckets.get(key)
            if state is None:  # absent: empty
                level = amount
                # Many new buckets: see _sweep (safe mid-loop: ``updated`` is stored after).
                if len(buckets) >= self._sweep_at_size:
                    self._sweep(now)
                if len(buckets) >= self.max_buckets:
                    raise RateBucketsFull(self.max_buckets)
            else:  # drained since (a clock that stepped back drains nothing), then taken;
                # compares, not max(): CPython 3.11 parses a builtin max()'s arguments on
                # every call, ~250 instructions against a handful for a compare
                level, t, drain = state  # at the rate it was stored with (a reload)
                elapsed = now - t
                if elapsed > 0:
                    level -= elapsed / drain
                level = (level if level > 0.0 else 0.0) + amount
            if level - limit > dust:
                return self.check(plan, now)
            updated[key] = (level, now, interval)
        buckets.update(updated)
        return None

    def taken(self, plan: Plan) -> RateResult:
        """The answer of the admission :meth:`take` just made of ``plan`` (nothing may run
        between the two): whole units left per bucket after it."""
        buckets = self._buckets
        return RateResult(True, None, 0.0, _remaining(plan, [buckets[key][0]
                                                            for key, *_ in plan]))

    def check(self, plan: Plan, now: int) -> RateResult:
        """What taking ``plan`` at ``now`` would answer, taking nothing: ``admitted`` means
        every bucket *would* take its amount (``remaining`` is then before the take)."""
        levels = self._levels(plan, now)
        worst, worst_i = -1.0, None
        for i, ((_, limit, amount, interval, dust), level) in enumerate(
                zip(plan, levels, strict=True)):
            if amount > limit:
                wait = math.inf
            else:
                over = level + amount - limit
                if over <= dust:
                    continue
                wait = over * interval
            if wait > worst:
                worst, worst_i = wait, i
        left = _remaining(plan, levels)
        if worst_i is None:
            return RateResult(True, None, 0.0, left)
        return RateResult(False, worst_i, math.inf if worst == math.inf else worst / 1e6, left)

    def give_back(self, plan: Plan) -> None:
        """Return every bucket's amount now (a refund); a bucket never drops below empty, and
        an empty bucket is dropped (an absent one is the same, as in Redis). What is left
        drains at the rate it was stored with: a refund is not a take at a new rate."""
        now = self.now_us()
        buckets = self._buckets
        for (key, _, amount, _, _), level in zip(plan, self._levels(plan, now), strict=True):
            level -= amount
            if level <= 0:
                buckets.pop(key, None)
            else:  # held something, so stored
                buckets[key] = (level, now, buckets[key][2])

    def _levels(self, plan: Plan, now: int) -> list[float]:
        """Each bucket's level at ``now`` (an absent one is empty)."""
        buckets = self._buckets
        levels = []
        for key, _, _, _, _ in plan:
            state = buckets.get(key)
            levels.append(0.0 if state is None else
                          max(state[0] - max(now - state[1], 0) / state[2], 0.0))
        return levels

    async def admit(self, group: str, takes: Sequence[Take], holder: Holder | None = None
                    ) -> RateResult:
        plan = memory_plan(group, takes)
        refused = self.take(plan)
        return self.taken(plan) if refused is None else refused

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        self.give_back(memory_plan(group, takes))

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        return self.check(memory_plan(group, takes), self.now_us()).remaining

    def _sweep(self, now: int) -> None:
        drained = [key for key, (level, t, interval) in self._buckets.items()
                   if level - (now - t) / interval <= 0]
        for key in drained:
            del self._buckets[key]
        # Many short-lived buckets (a tenant per call) are dropped once they double what the
        # last sweep left, not only each minute: a drained bucket is an absent one. At the
        # cap, once: a full house is looked at again every _FULL_SWEEP_INTERVAL_S, not at
        # every refused take (a sweep walks every bucket).
        kept = len(self._buckets)
        full = kept >= self.max_buckets
        self._sweep_at_size = (min(max(2 * kept, _SWEEP_AT_SIZE), self.max_buckets)
                               if not full else math.inf)
        self._next_sweep = now + int(
            (_FULL_SWEEP_INTERVAL_S if full else _SWEEP_INTERVAL_S) * 1e6)


def _remaining(plan: Plan, levels: Sequence[float]) -> tuple[int, ...]:
    """Whole units each bucket could still admit at ``levels``."""
    left = []
    for (_, limit, _, _, _), level in zip(plan, levels, strict=True):
        units = math.floor(limit - level + limit * _DUST)
        left.append(units if units > 0 else 0)
    return tuple(left)


# -- redis ------------------------------------------------------------------------------------

#: Lua functions over GCRA buckets, for this module's script and the admission's
#: (:mod:`policies.state.admission`). ``buckets(k, a, n, r, holder, ms)`` reads the ``n``
#: buckets ``KEYS[k + 1 .. k + n]``, each with (limit, period in microseconds, amount) from
#: ``ARGV[a + 1 ..]``; with a ``holder`` (not ``nil`` nor ``''``) it records each bucket's
#: rate as the holder's for ``ms`` in its records hash ``KEYS[r + i]`` and uses the lowest live
#: one (``lowest_rate``, the module docstring); ``refusing(b)`` names the one with the longest
#: wait (1-based; 0: every one fits) and that wait in microseconds as text (``'-1'``: never,
#: an amount over the holder's own limit; over only lower records, until they lapse), and
#: ``applied(b, i)`` the rate bucket ``i`` was checked by (``'limit interval_us'``; ``''`` for
#: 0);
#: ``take``/``refund`` move every level and store it (a take at the rate it used, a refund
#: at the one the level was stored with); ``remaining(b)`` lists whole units left per bucket.
GCRA_LUA = """
local now_us_t = redis.call('TIME')
local now_us = tonumber(now_us_t[1]) * 1000000 + tonumber(now_us_t[2])
-- Records (limit, interval) as holder's in the bucket's records hash (holder ->
-- 'limit interval_us expiry_ms') for ms, drops the lapsed (or unreadable) records, and
-- returns the lowest live rate: the smallest limit and the longest interval among them, this
-- holder's included. A record still fresh (two thirds of ms left, the same rate) is not
-- written again. For an amount over another holder's limit it also returns when the last
-- such record lapses (ms; 0: none does) and the smallest limit the amount fits (this
-- holder's included): the one the bucket is checked by then, if those holders take no more.
local function lowest_rate(key, holder, ms, limit, interval, amount)
  local now_ms = math.floor(now_us / 1000)
  local mine = string.format('%.17g %.17g', limit, interval)
  local fresh = false
  local lapse, fit = 0, limit
  local flat = redis.call('HGETALL', key)
  for j = 1, #flat, 2 do
    local l, iv, exp = string.match(flat[j + 1], '^(%S+) (%S+) (%S+)$')
    exp = tonumber(exp)
    if flat[j] == holder then
      fresh = exp ~= nil and exp - now_ms > ms * 2 / 3 and l .. ' ' .. iv == mine
    else
      l, iv = tonumber(l), tonumber(iv)
      -- a record this version cannot read (not positive finite numbers) counts as lapsed
      if exp == nil or exp <= now_ms or not (l and l > 0 and l < math.huge)
          or not (iv and iv > 0 and iv < math.huge) then
        redis.call('HDEL', key, flat[j])
      else
        if l < limit then limit = l end
        if iv > interval then interval = iv end
        if l < amount then
          if exp > lapse then lapse = exp end
        elseif l < fit then
          fit = l
        end
      end
    end
  end
  if not fresh then
    redis.call('HSET', key, holder, mine .. string.format(' %.0f', now_ms + ms))
    if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
  end
  return limit, interval, lapse, fit
end
local function buckets(k, a, n, r, holder, ms)
  local b = {keys = {}, limits = {}, intervals = {}, drains = {}, amounts = {}, levels = {},
             lapses = {}, fits = {}, n = n}
  for i = 1, n do
    local limit = tonumber(ARGV[a + 3 * i - 2])
    local interval = tonumber(ARGV[a + 3 * i - 1]) / limit
    local amount = tonumber(ARGV[a + 3 * i])
    local lapse, fit = 0, limit
    if holder ~= nil and holder ~= '' then
      limit, interval, lapse, fit = lowest_rate(KEYS[r + i], holder, ms, limit, interval, amount)
    end
    b.keys[i] = KEYS[k + i]
    b.limits[i] = limit
    b.intervals[i] = interval
    b.amounts[i] = amount
    b.lapses[i] = lapse
    b.fits[i] = fit
    local level = 0
    local stored = redis.call('HMGET', b.keys[i], 'l', 't', 'i')
    -- the rate the stored level drains at: the one it was stored with (a reload, or the
    -- replicas' lowest rate, may have changed since)
    local drain = tonumber(stored[3])
    if not (drain and drain > 0 and drain < math.huge) then drain = interval end
    b.drains[i] = drain
    if stored[1] then
      local elapsed = now_us - num(stored[2], 'a rate bucket')
      if elapsed < 0 then elapsed = 0 end
      level = num(stored[1], 'a rate bucket') - elapsed / b.drains[i]
      if level < 0 then level = 0 end
    end
    b.levels[i] = level
  end
  return b
end
local function remaining(b)
  local out = {}
  for i = 1, b.n do
    local r = math.floor(b.limits[i] - b.levels[i] + b.limits[i] * 1e-9)
    if r < 0 then r = 0 end
    out[i] = r
  end
  return out
end
local function store(b, i, interval)
  if b.levels[i] <= 0 then
    redis.call('DEL', b.keys[i])
  else
    redis.call('HSET', b.keys[i], 'l', string.format('%.17g', b.levels[i]), 't',
               string.format('%.0f', now_us), 'i', string.format('%.17g', interval))
    redis.call('PEXPIRE', b.keys[i], math.ceil(b.levels[i] * interval / 1000) + 1)
  end
end
local function refusing(b)
  local worst, worst_i = -1, 0
  for i = 1, b.n do
    local wait = nil
    if b.amounts[i] > b.fits[i] then
      wait = math.huge
    elseif b.amounts[i] > b.limits[i] then
      -- over only other holders' lower limits: it fits once their records have lapsed and
      -- the level has drained (at the rate it was stored with) to the limit left then
      wait = b.lapses[i] * 1000 - now_us
      local drained = (b.levels[i] + b.amounts[i] - b.fits[i]) * b.drains[i]
      if drained > wait then wait = drained end
    else
      local over = b.levels[i] + b.amounts[i] - b.limits[i]
      if over > b.limits[i] * 1e-9 then wait = over * b.intervals[i] end
    end
    if wait and wait > worst then worst, worst_i = wait, i end
  end
  if worst_i == 0 then return 0, '0' end
  if worst == math.huge then return worst_i, '-1' end
  return worst_i, string.format('%.3f', worst)
end
local function applied(b, i)
  if i == 0 then return '' end
  return string.format('%.17g %.17g', b.limits[i], b.intervals[i])
end
local function take(b)
  for i = 1, b.n do
    b.levels[i] = b.levels[i] + b.amounts[i]
    store(b, i, b.intervals[i])
  end
end
local function refund(b)
  for i = 1, b.n do
    b.levels[i] = b.levels[i] - b.amounts[i]
    if b.levels[i] < 0 then b.levels[i] = 0 end
    store(b, i, b.drains[i])
  end
end
"""

# KEYS: one hash per bucket, then (with a holder) each bucket's records hash. ARGV[1]: 'take' |
# 'refund' | 'peek'; ARGV[2]: the holder ('' for none); ARGV[3]: its records' lease in ms; then
# per bucket: limit, period in microseconds, amount. Returns {admitted 0|1, denied index
# (1-based, 0 none), wait in microseconds as a string ('-1': never), the rate the denied
# bucket was checked by ('limit interval_us', '' for none), remaining per bucket...}.
_GCRA = Script(GCRA_LUA + """
local n = (#ARGV - 3) / 3
local b = buckets(0, 3, n, n, ARGV[2], tonumber(ARGV[3]))
local reply = {1, 0, '0', ''}
if ARGV[1] == 'take' then
  local denied, wait = refusing(b)
  if denied > 0 then reply = {0, denied, wait, applied(b, denied)} else take(b) end
elseif ARGV[1] == 'refund' then
  refund(b)
end
for _, r in ipairs(remaining(b)) do reply[#reply + 1] = r end
return reply
""", "rate")


def bucket_args(takes: Sequence[Take]) -> list[object]:
    """The ARGV of ``takes`` for :data:`GCRA_LUA`'s ``buckets``: (limit, period us, amount)
    each; floats as ``repr`` so Lua reads exactly what Python meant."""
    args: list[object] = []
    for take in takes:
        args += [take.limit, repr(take.period_s * 1e6), repr(float(take.amount))]
    return args


def holder_args(holder: Holder | None) -> list[object]:
    """The ARGV of ``holder`` for :data:`GCRA_LUA`'s ``buckets``: its id (``''`` for none) and
    its records' lease in whole milliseconds (at least 1)."""
    if holder is None:
        return ["", 0]
    return [holder.id, max(int(holder.lease_s * 1000), 1)]


def rate_result(admitted: bool, denied: int, wait: bytes | str, applied: bytes | str,
                remaining: Sequence[object]) -> RateResult:
    """A :class:`RateResult` from a script's answer (``denied`` 1-based, 0 none; ``wait``
    microseconds as text, ``-1`` never; ``applied`` the denied bucket's ``'limit
    interval_us'``)."""
    left = tuple(int(r) for r in remaining)  # type: ignore[call-overload]
    if denied == 0:
        return RateResult(admitted, None, 0.0, left)
    us = float(wait)
    limit, interval_us = (float(part) for part in applied.split())
    return RateResult(False, denied - 1, math.inf if us < 0 else us / 1e6, left,
                      (limit, limit * interval_us / 1e6))


class RedisRateBuckets:
    """GCRA buckets in Redis: each call is one ``EVALSHA`` on the group's slot."""

    def __init__(self, state: RedisState) -> None:
        self._state = state

    def keys(self, group: str, takes: Sequence[Take]) -> list[str]:
        """The buckets' keys, in ``group``'s hash slot."""
        return [self._state.key(group, "rate", take.name) for take in takes]

    def record_keys(self, group: str, takes: Sequence[Take]) -> list[str]:
        """The buckets' records hashes (holder -> its rate and the record's expiry), in
        ``group``'s hash slot (``rate:lim:`` cannot collide with a bucket's name, which
        starts ``requests``, ``tokens`` or ``tenant:``)."""
        return [self._state.key(group, "rate", "lim", take.name) for take in takes]

    async def _run(self, mode: str, group: str, takes: Sequence[Take],
                   read: Callable[[list[Any]], T], holder: Holder | None = None) -> T:
        keys = self.keys(group, takes)
        if holder is not None:
            keys += self.record_keys(group, takes)
        return await self._state.eval(_GCRA, keys,
                                      [mode, *holder_args(holder), *bucket_args(takes)], read)

    async def admit(self, group: str, takes: Sequence[Take], holder: Holder | None = None
                    ) -> RateResult:
        if not takes:
            return RateResult(True, None, 0.0, ())
        return await self._run("take", group, takes, _gcra_result, holder)

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        if takes:
            await self._run("refund", group, takes, _nothing)

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        if not takes:
            return ()
        return await self._run("peek", group, takes,
                               lambda reply: tuple(int(r) for r in reply[4:]))


def _gcra_result(reply: list[Any]) -> RateResult:
    """``_GCRA``'s reply to a take read (every field computed by the script, none stored:
    a failure here is a bug, not a key fault)."""
    return rate_result(bool(int(reply[0])), int(reply[1]), reply[2], reply[3], reply[4:])


def _nothing(_reply: object) -> None:
    return None
