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

    def __len__(self) -> int:
        return len(self._buckets)

    def _levels(self, group: str, takes: Sequence[Take], now: int) -> list[float]:
        levels = []
        for take in takes:
            state = self._buckets.get((group, take.name))
            level = 0.0
            if state is not None:
                level = max(state[0] - max(now - state[1], 0) / _interval(take), 0.0)
            levels.append(level)
        return levels

    async def admit(self, group: str, takes: Sequence[Take]) -> RateResult:
        now = self._clock_us()
        if now >= self._next_sweep:
            self._sweep(now)
        levels = self._levels(group, takes, now)
        worst, worst_i = -1.0, None
        for i, (take, level) in enumerate(zip(takes, levels, strict=True)):
            wait = _wait(take, level)
            if wait is not None and wait > worst:
                worst, worst_i = wait, i
        if worst_i is not None:
            return RateResult(False, worst_i, _seconds(worst), _remaining(takes, levels))
        for i, take in enumerate(takes):
            levels[i] += take.amount
            self._store(group, take, levels[i], now)
        return RateResult(True, None, 0.0, _remaining(takes, levels))

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        now = self._clock_us()
        levels = self._levels(group, takes, now)
        for take, level in zip(takes, levels, strict=True):
            self._store(group, take, level - take.amount, now)

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        return _remaining(takes, self._levels(group, takes, self._clock_us()))

    def _store(self, group: str, take: Take, level: float, now: int) -> None:
        if level > 0:
            self._buckets[(group, take.name)] = [level, now, _interval(take)]
        else:  # an empty bucket and an absent one are the same, as in Redis
            self._buckets.pop((group, take.name), None)

    def _sweep(self, now: int) -> None:
        self._next_sweep = now + int(_SWEEP_INTERVAL_S * 1e6)
        drained = [key for key, (level, t, interval) in self._buckets.items()
                   if level - (now - t) / interval <= 0]
        for key in drained:
            del self._buckets[key]


def _interval(take: Take) -> float:
    """Microseconds for one unit to drain (GCRA's emission interval)."""
    return take.period_s * 1e6 / take.limit


def _wait(take: Take, level: float) -> float | None:
    """Microseconds until ``take`` fits at ``level``; ``None`` if it fits now, inf if never."""
    if take.amount > take.limit:
        return math.inf
    over = level + take.amount - take.limit
    if over > take.limit * _DUST:
        return over * _interval(take)
    return None


def _seconds(wait_us: float) -> float:
    return math.inf if wait_us == math.inf else wait_us / 1e6


def _remaining(takes: Sequence[Take], levels: Sequence[float]) -> tuple[int, ...]:
    return tuple(max(math.floor(t.limit - lv + t.limit * _DUST), 0)
                 for t, lv in zip(takes, levels, strict=True))


# -- redis ------------------------------------------------------------------------------------

# KEYS: one hash per bucket. ARGV[1]: 'take' | 'refund' | 'peek'; then per bucket: limit,
# period in microseconds, amount. Returns {admitted 0|1, denied index (1-based, 0 none),
# wait in microseconds as a string ('-1': never), remaining per bucket...}.
_GCRA = Script("""
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
local mode = ARGV[1]
local n = #KEYS
local limits, intervals, amounts, levels = {}, {}, {}, {}
for i = 1, n do
  local limit = tonumber(ARGV[3 * i - 1])
  limits[i] = limit
  intervals[i] = tonumber(ARGV[3 * i]) / limit
  amounts[i] = tonumber(ARGV[3 * i + 1])
  local level = 0
  local stored = redis.call('HMGET', KEYS[i], 'l', 't')
  if stored[1] then
    local elapsed = now - tonumber(stored[2])
    if elapsed < 0 then elapsed = 0 end
    level = tonumber(stored[1]) - elapsed / intervals[i]
    if level < 0 then level = 0 end
  end
  levels[i] = level
end
local function remaining()
  local out = {}
  for i = 1, n do
    local r = math.floor(limits[i] - levels[i] + limits[i] * 1e-9)
    if r < 0 then r = 0 end
    out[i] = r
  end
  return out
end
local function store(i)
  if levels[i] <= 0 then
    redis.call('DEL', KEYS[i])
  else
    redis.call('HSET', KEYS[i], 'l', string.format('%.17g', levels[i]), 't',
               string.format('%.0f', now))
    redis.call('PEXPIRE', KEYS[i], math.ceil(levels[i] * intervals[i] / 1000) + 1)
  end
end
local reply
if mode == 'take' then
  local worst, worst_i = -1, 0
  for i = 1, n do
    local wait = nil
    if amounts[i] > limits[i] then
      wait = math.huge
    else
      local over = levels[i] + amounts[i] - limits[i]
      if over > limits[i] * 1e-9 then wait = over * intervals[i] end
    end
    if wait and wait > worst then worst, worst_i = wait, i end
  end
  if worst_i > 0 then
    local text = '-1'
    if worst ~= math.huge then text = string.format('%.3f', worst) end
    reply = {0, worst_i, text}
  else
    for i = 1, n do
      levels[i] = levels[i] + amounts[i]
      store(i)
    end
    reply = {1, 0, '0'}
  end
elseif mode == 'refund' then
  for i = 1, n do
    levels[i] = levels[i] - amounts[i]
    if levels[i] < 0 then levels[i] = 0 end
    store(i)
  end
  reply = {1, 0, '0'}
else
  reply = {1, 0, '0'}
end
for _, r in ipairs(remaining()) do reply[#reply + 1] = r end
return reply
""")


class RedisRateBuckets:
    """GCRA buckets in Redis: each call is one ``EVALSHA`` on the group's slot."""

    def __init__(self, state: RedisState) -> None:
        self._state = state

    async def _run(self, mode: str, group: str, takes: Sequence[Take]) -> list[object]:
        keys = [self._state.key(group, "rate", take.name) for take in takes]
        args: list[object] = [mode]
        for take in takes:
            args += [take.limit, repr(take.period_s * 1e6), repr(float(take.amount))]
        return await self._state.eval(_GCRA, keys, args)

    async def admit(self, group: str, takes: Sequence[Take]) -> RateResult:
        if not takes:
            return RateResult(True, None, 0.0, ())
        reply = await self._run("take", group, takes)
        remaining = tuple(int(r) for r in reply[3:])  # type: ignore[call-overload]
        if int(reply[0]):  # type: ignore[call-overload]
            return RateResult(True, None, 0.0, remaining)
        wait = float(reply[2])  # type: ignore[arg-type]
        return RateResult(False, int(reply[1]) - 1,  # type: ignore[call-overload]
                          math.inf if wait < 0 else wait / 1e6, remaining)

    async def refund(self, group: str, takes: Sequence[Take]) -> None:
        if takes:
            await self._run("refund", group, takes)

    async def available(self, group: str, takes: Sequence[Take]) -> tuple[int, ...]:
        if not takes:
            return ()
        reply = await self._run("peek", group, takes)
        return tuple(int(r) for r in reply[3:])  # type: ignore[call-overload]
