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
changes its rate, as :meth:`policies.rate.Bucket.successor` does.

One :meth:`RateBuckets.admit` covers every bucket that applies to a call (route requests,
tenant requests, tokens): all of them take their amount, or none does, and a refusal names the
bucket with the longest wait, so a retry after ``retry_after_s`` fits every bucket (if no other
traffic came meanwhile). In Redis it is one Lua script; time is the server's (``TIME``), so
replicas' clocks do not matter. Keys: ``<prefix>:{<group>}:rate:<name>``, a hash ``{l, t}`` that
expires once the bucket has drained (an absent bucket is an empty one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from policies.state.connection import RedisState, Script

#: Level overshoot forgiven as float rounding, as a fraction of the limit.
_DUST = 1e-9
#: How often the memory buckets forget drained buckets, seconds.
_SWEEP_INTERVAL_S = 60.0
#: Buckets kept before a sweep is due whatever the interval (at least; see ``_sweep``).
_SWEEP_AT_SIZE = 4096


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
            ``math.inf`` when an amount exceeds its whole bucket (it can never pass).
        remaining: per bucket, whole units it could still admit now (after this call's
            take when admitted), for ``RateLimit`` headers.
    """

    admitted: bool
    denied: int | None
    retry_after_s: float
    remaining: tuple[int, ...]


class RateBuckets(Protocol):
    """Shared GCRA buckets. Every method is one round trip to the backend.

    Raises (every method):
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    async def admit(self, group: str, takes: Sequence[Take]) -> RateResult:
        """Take each bucket's amount, all or none (see :class:`RateResult`)."""
        ...

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        """Give back what an admitted call took (a later step refused it, or it never reached
        the upstream); a bucket never drops below empty."""
        ...

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        """Whole units each bucket could admit now; takes nothing (``amount`` is ignored)."""
        ...


# -- memory -----------------------------------------------------------------------------------


#: What :meth:`MemoryRateBuckets.check` found of each bucket, for ``commit``: its stored
#: ``[level, t_us, us per unit]`` (``None`` if absent), its level then, its us per unit.
_Scan = list[tuple[list[float] | None, float, float]]


class MemoryRateBuckets:
    """The buckets of one process. Nothing suspends, so each call is atomic on the loop.

    Args:
        clock_us: wall time in microseconds (injectable for tests).
    """

    def __init__(self, clock_us: Callable[[], int] = lambda: time.time_ns() // 1000) -> None:
        self._clock_us = clock_us
        # (group, name) -> [level, t_us, us per unit]
        self._buckets: dict[tuple[str, str], list[float]] = {}
        self._next_sweep = 0
        self._sweep_at_size = _SWEEP_AT_SIZE

    def __len__(self) -> int:
        return len(self._buckets)

    def _scan(self, group: str, takes: Sequence[Take], now: int
              ) -> tuple[_Scan, int | None, float]:
        """Each bucket as found at ``now``, and the bucket with the longest wait if taking
        ``takes`` would be refused (its index, and the wait in microseconds), else ``None``.
        Takes nothing."""
        buckets = self._buckets
        found: _Scan = []
        worst, worst_i = -1.0, None
        for i, take in enumerate(takes):
            limit, amount = take.limit, take.amount
            interval = take.period_s * 1e6 / limit  # us per unit: GCRA's emission interval
            state = buckets.get((group, take.name))
            level = 0.0
            if state is not None:
                elapsed = now - state[1]
                level = state[0] - (elapsed if elapsed > 0 else 0) / interval
                if level < 0.0:
                    level = 0.0
            found.append((state, level, interval))
            if amount > limit:
                wait = math.inf
            else:
                over = level + amount - limit
                if over <= limit * _DUST:
                    continue
                wait = over * interval
            if wait > worst:
                worst, worst_i = wait, i
        return found, worst_i, worst

    async def admit(self, group: str, takes: Sequence[Take]) -> RateResult:
        now = self.now_us()
        found, worst_i, worst = self._scan(group, takes, now)
        if worst_i is None:
            return self.commit(group, takes, found, now)
        return RateResult(False, worst_i, _seconds(worst), _remaining(takes, _levels(found)))

    def now_us(self) -> int:
        """The clock in microseconds (forgetting drained buckets when a sweep is due)."""
        now = self._clock_us()
        if now >= self._next_sweep or len(self._buckets) >= self._sweep_at_size:
            self._sweep(now)
        return now

    def check(self, group: str, takes: Sequence[Take], now: int) -> tuple[_Scan, RateResult]:
        """The buckets as found at ``now`` and the verdict, taking nothing: ``admitted``
        means every bucket *would* take its amount (``remaining`` is then before the take).
        With :meth:`commit`, one atomic step with other memory state
        (:mod:`policies.state.admission`)."""
        found, worst_i, worst = self._scan(group, takes, now)
        left = _remaining(takes, _levels(found))
        if worst_i is None:
            return found, RateResult(True, None, 0.0, left)
        return found, RateResult(False, worst_i, _seconds(worst), left)

    def commit(self, group: str, takes: Sequence[Take], found: _Scan, now: int) -> RateResult:
        """Take every amount from the buckets as :meth:`check` ``found`` them at ``now``
        (nothing may run between the two)."""
        buckets = self._buckets
        levels = []
        for take, (state, level, interval) in zip(takes, found, strict=True):
            level += take.amount
            levels.append(level)
            if level <= 0:  # an empty bucket and an absent one are the same, as in Redis
                buckets.pop((group, take.name), None)
            elif state is None:
                buckets[(group, take.name)] = [level, now, interval]
            else:  # in place: most calls find their bucket (stored again: a take earlier
                # in the same call may have emptied and dropped it)
                state[0], state[1], state[2] = level, now, interval
                buckets[(group, take.name)] = state
        return RateResult(True, None, 0.0, _remaining(takes, levels))

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        now = self._clock_us()
        refunds = [take._replace(amount=-take.amount) for take in takes]
        self.commit(group, refunds, self._scan(group, refunds, now)[0], now)

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        return self.check(group, takes, self._clock_us())[1].remaining

    def _sweep(self, now: int) -> None:
        self._next_sweep = now + int(_SWEEP_INTERVAL_S * 1e6)
        drained = [key for key, (level, t, interval) in self._buckets.items()
                   if level - (now - t) / interval <= 0]
        for key in drained:
            del self._buckets[key]
        # Many short-lived buckets (a tenant per call) are dropped once they double what the
        # last sweep left, not only each minute: a drained bucket is an absent one.
        self._sweep_at_size = max(2 * len(self._buckets), _SWEEP_AT_SIZE)


def _levels(found: _Scan) -> list[float]:
    return [level for _, level, _ in found]


def _seconds(wait_us: float) -> float:
    return math.inf if wait_us == math.inf else wait_us / 1e6


def _remaining(takes: Sequence[Take], levels: Sequence[float]) -> tuple[int, ...]:
    """Whole units each bucket could still admit at ``levels``."""
    left = []
    for take, level in zip(takes, levels, strict=True):
        units = math.floor(take.limit - level + take.limit * _DUST)
        left.append(units if units > 0 else 0)
    return tuple(left)


# -- redis ------------------------------------------------------------------------------------

#: Lua functions over GCRA buckets, for this module's script and the admission's
#: (:mod:`policies.state.admission`). ``buckets(k, a, n)`` reads the ``n`` buckets
#: ``KEYS[k + 1 .. k + n]``, each with (limit, period in microseconds, amount) from
#: ``ARGV[a + 1 ..]``; ``refusing(b)`` names the one with the longest wait (1-based; 0: every
#: one fits) and that wait in microseconds as text (``'-1'``: never); ``take``/``refund``
#: move every level and store it; ``remaining(b)`` lists whole units left per bucket.
GCRA_LUA = """
local now_us_t = redis.call('TIME')
local now_us = tonumber(now_us_t[1]) * 1000000 + tonumber(now_us_t[2])
local function buckets(k, a, n)
  local b = {keys = {}, limits = {}, intervals = {}, amounts = {}, levels = {}, n = n}
  for i = 1, n do
    local limit = tonumber(ARGV[a + 3 * i - 2])
    b.keys[i] = KEYS[k + i]
    b.limits[i] = limit
    b.intervals[i] = tonumber(ARGV[a + 3 * i - 1]) / limit
    b.amounts[i] = tonumber(ARGV[a + 3 * i])
    local level = 0
    local stored = redis.call('HMGET', b.keys[i], 'l', 't')
    if stored[1] then
      local elapsed = now_us - tonumber(stored[2])
      if elapsed < 0 then elapsed = 0 end
      level = tonumber(stored[1]) - elapsed / b.intervals[i]
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
local function store(b, i)
  if b.levels[i] <= 0 then
    redis.call('DEL', b.keys[i])
  else
    redis.call('HSET', b.keys[i], 'l', string.format('%.17g', b.levels[i]), 't',
               string.format('%.0f', now_us))
    redis.call('PEXPIRE', b.keys[i], math.ceil(b.levels[i] * b.intervals[i] / 1000) + 1)
  end
end
local function refusing(b)
  local worst, worst_i = -1, 0
  for i = 1, b.n do
    local wait = nil
    if b.amounts[i] > b.limits[i] then
      wait = math.huge
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
local function take(b)
  for i = 1, b.n do
    b.levels[i] = b.levels[i] + b.amounts[i]
    store(b, i)
  end
end
local function refund(b)
  for i = 1, b.n do
    b.levels[i] = b.levels[i] - b.amounts[i]
    if b.levels[i] < 0 then b.levels[i] = 0 end
    store(b, i)
  end
end
"""

# KEYS: one hash per bucket. ARGV[1]: 'take' | 'refund' | 'peek'; then per bucket: limit,
# period in microseconds, amount. Returns {admitted 0|1, denied index (1-based, 0 none),
# wait in microseconds as a string ('-1': never), remaining per bucket...}.
_GCRA = Script(GCRA_LUA + """
local b = buckets(0, 1, #KEYS)
local reply = {1, 0, '0'}
if ARGV[1] == 'take' then
  local denied, wait = refusing(b)
  if denied > 0 then reply = {0, denied, wait} else take(b) end
elseif ARGV[1] == 'refund' then
  refund(b)
end
for _, r in ipairs(remaining(b)) do reply[#reply + 1] = r end
return reply
""")


def bucket_args(takes: Sequence[Take]) -> list[object]:
    """The ARGV of ``takes`` for :data:`GCRA_LUA`'s ``buckets``: (limit, period us, amount)
    each; floats as ``repr`` so Lua reads exactly what Python meant."""
    args: list[object] = []
    for take in takes:
        args += [take.limit, repr(take.period_s * 1e6), repr(float(take.amount))]
    return args


def rate_result(admitted: bool, denied: int, wait: bytes | str, remaining: Sequence[object]
                ) -> RateResult:
    """A :class:`RateResult` from a script's answer (``denied`` 1-based, 0 none; ``wait``
    microseconds as text, ``-1`` never)."""
    left = tuple(int(r) for r in remaining)  # type: ignore[call-overload]
    if denied == 0:
        return RateResult(admitted, None, 0.0, left)
    us = float(wait)
    return RateResult(False, denied - 1, math.inf if us < 0 else us / 1e6, left)


class RedisRateBuckets:
    """GCRA buckets in Redis: each call is one ``EVALSHA`` on the group's slot."""

    def __init__(self, state: RedisState) -> None:
        self._state = state

    def keys(self, group: str, takes: Sequence[Take]) -> list[str]:
        """The buckets' keys, in ``group``'s hash slot."""
        return [self._state.key(group, "rate", take.name) for take in takes]

    async def _run(self, mode: str, group: str, takes: Sequence[Take]) -> list[object]:
        return await self._state.eval(_GCRA, self.keys(group, takes),
                                      [mode, *bucket_args(takes)])

    async def admit(self, group: str, takes: Sequence[Take]) -> RateResult:
        if not takes:
            return RateResult(True, None, 0.0, ())
        reply = await self._run("take", group, takes)
        return rate_result(bool(int(reply[0])), int(reply[1]),  # type: ignore[call-overload]
                           reply[2], reply[3:])  # type: ignore[arg-type]

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        if takes:
            await self._run("refund", group, takes)

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        if not takes:
            return ()
        reply = await self._run("peek", group, takes)
        return tuple(int(r) for r in reply[3:])  # type: ignore[call-overload]
