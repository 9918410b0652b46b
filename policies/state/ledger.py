"""The budget ledger shared by every replica: reserve all-or-none, settle exactly once.

Semantics are those of :class:`policies.budget.MemoryLedger` (counters of *spent* and
*reserved* amounts; a claim fits when ``spent + reserved + amount <= cap``; every claim of a
call is held, or none), made safe for many replicas and for calls that die:

* every reservation has an id chosen by the caller. Reserving again with an id already held
  changes nothing and admits (a retried or cancelled-then-repeated call cannot hold twice);
* :meth:`Ledger.settle` by id releases the holds and adds the actual spend, once: a second
  settle of the same id finds nothing and does nothing (returns ``False``);
* a reservation not settled within ``hold_s`` (its replica was killed, or it hung) is *reaped*
  by the next ``reserve`` of its group (with Redis, or the next
  :meth:`RedisLedger.refresh_held` of a replica that reserved in it: a scrape of the
  gauges): its holds are released, and it is kept as *lapsed* for another ``hold_s``, so
  that a settle arriving late still charges the actual spend (once) but releases nothing
  twice. Reaped capacity goes back to the budget: Sluice does not know what a
  dead replica's call spent;
* windows live in the counter's name (the caller's key, e.g. ``tokens-per-tenant-day:acme:
  20321`` for UTC day 20321), and a counter expires ``hold_s`` after its window ends (or
  after a run's total idles out), so old windows clean themselves up.

Redis layout (all under the group's hash tag, e.g. the route, so one script touches one slot):
``<prefix>:{<group>}:budget:<key>`` a hash ``{s: spent, h: held}``;
``...:budget:~resv`` a hash of reservation id -> JSON ``{s: 'h'|'l', c: [[counter, amount]...]}``;
``...:budget:~resv-exp`` a sorted set of reservation id by expiry (server ms). Pattern from
shared/notes/library-pitfalls.md §5.4.

Amounts are floats (tokens, or USD); they travel as ``repr()`` strings so that what a settle
releases is exactly what the reserve held.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from policies.state.connection import RedisState, Script
from policies.state.stored import stored_float, stored_text

#: A counter whose held amount falls to this or less holds nothing (float dust from USD sums).
DUST = 1e-9
#: Counter levels the Redis ledger remembers from its last answers, for :meth:`Ledger.level`.
LEVEL_CACHE_SIZE = 10_000
#: Counters of one group :meth:`RedisLedger.refresh_held` reads again, at most (one script).
REFRESH_KEYS = 500


class Claim(NamedTuple):
    """One limit's part of a reservation.

    Attributes:
        key: the counter within the group, its window in its name.
        amount: what the call may spend at most (tokens or USD).
        cap: the limit of this counter.
        expires_at: Unix seconds, on the caller's clock, after which the counter may be
            forgotten (its window's end, or a run total's idle expiry).
    """

    key: str
    amount: float
    cap: float
    expires_at: float


class Ledger(Protocol):
    """Counters of spent and reserved amounts. Every async method is one round trip.

    Raises (every async method):
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    async def reserve(self, group: str, rid: str, claims: Sequence[Claim], now: float,
                      hold_s: float) -> list[int]:
        """Hold every claim under reservation ``rid``, or none.

        Args:
            now: Unix seconds on the caller's clock (the one its window names come from).
            hold_s: how long the reservation may stay unsettled before it is reaped.

        Returns:
            Indexes of the claims that do not fit; empty when all are held (or ``rid`` was
            already held).
        """
        ...

    async def settle(self, group: str, rid: str, actual: Sequence[float],
                     mark: bool = False) -> bool:
        """Release reservation ``rid``'s holds and add ``actual`` (one amount per claim, in
        order) to the counters' spend. ``False`` when there was nothing to settle (already
        settled, never reserved, or reaped long ago); a lapsed reservation is charged but
        releases nothing (its holds were released when it was reaped). With Redis an id
        that held nothing is marked gone for the hold, so a reserve of it still on its way
        holds nothing; ``mark``: so is one that held something (a reserve that may have been
        sent twice, the reconciler's: the late copy must not hold again)."""
        ...

    async def charge(self, group: str, claims: Sequence[Claim], now: float) -> None:
        """Add each claim's ``amount`` to its counter's spend, without a reservation or a
        cap check: spend made elsewhere (while the backend was unavailable) being
        reconciled. ``cap`` is ignored."""
        ...

    async def levels(self, group: str, keys: Sequence[str]) -> list[tuple[float, float]]:
        """``(spent, reserved)`` of each counter, read now."""
        ...

    def level(self, group: str, key: str) -> tuple[float, float]:
        """``(spent, reserved)`` of a counter without a round trip: the memory ledger's live
        values; the Redis ledger's as of its last answer about that counter (``(0, 0)`` if
        none), for headers and gauges."""
        ...


# -- memory -----------------------------------------------------------------------------------


class _Reservation:
    """Held claims as (counter digest, amount, when the counter's window is gone on the
    ledger's clock), and when the reservation is next due for reaping (ledger's clock)."""

    __slots__ = ("claims", "expires_at", "lapsed")

    def __init__(self, claims: list[tuple[bytes, float, float]], expires_at: float) -> None:
        self.claims = claims
        self.expires_at = expires_at
        self.lapsed = False


class LedgerFull(Exception):
    """The memory ledger keeps ``cap`` counters with spend inside their windows and a new
    counter (a new tenant's day, a new run's total) would need one more.

    Nothing was held. Counters already kept go on working; a counter is freed when its window
    ends (plus the hold), never earlier, so no spend inside a window is ever forgotten.
    """

    def __init__(self, cap: int) -> None:
        super().__init__(f"the memory ledger keeps {cap} budget counters")
        self.cap = cap


#: Counters the memory ledger keeps at most (``state.max_budget_counters``'s default): each
#: takes ~150 bytes (a 16-byte digest and a packed ``(spent, expiry)``), so ~150 MB at most.
MAX_COUNTERS = 1_000_000
#: A counter's value: spent, then the Unix second after which it may be forgotten.
_COUNTER = struct.Struct("dd")
_EMPTY = _COUNTER.pack(0.0, 0.0)


def counter_digest(group: str, key: str) -> bytes:
    """The memory ledger's name for counter ``key`` of ``group``: 16 bytes of BLAKE2b
    (distinct counters collide with probability ~n^2 / 2^129, nil for any n kept)."""
    return hashlib.blake2b(f"{group}\x00{key}".encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


class MemoryLedger:
    """The ledger of one process; nothing suspends, so every call is atomic on the loop.

    Counters are kept compact: one dict from a digest of (group, key) to packed ``(spent,
    expiry)`` bytes, held amounts in a second dict only while held. A counter that has spent
    nothing and holds nothing is dropped (an absent counter reads 0). At most ``max_counters``
    are kept: a reservation that needs a new one beyond it raises :class:`LedgerFull` (and
    holds nothing), while counters already kept keep working; counters leave only once their
    window is over, so the cap never gives spend back.

    Args:
        clock: Unix seconds, for reservation expiry (the caller's ``now`` names windows).
        max_counters: the cap on counters kept (``state.max_budget_counters``).
    """

    def __init__(self, clock: Callable[[], float] = time.time,
                 max_counters: int = MAX_COUNTERS) -> None:
        self._clock = clock
        self.max_counters = max_counters
        self._counters: dict[bytes, bytes] = {}
        self._held: dict[bytes, float] = {}
        self._reservations: dict[tuple[str, str], _Reservation] = {}
        self._due: list[tuple[float, str, str]] = []  # (expiry, group, rid), a heap
        self._next_sweep = 0.0

    def __len__(self) -> int:
        """Counters kept."""
        return len(self._counters)

    async def reserve(self, group: str, rid: str, claims: Sequence[Claim], now: float,
                      hold_s: float) -> list[int]:
        denied = self.check(group, rid, claims, now, hold_s)
        if not denied:
            self.hold(group, rid, claims, now, hold_s)
        return denied

    def check(self, group: str, rid: str, claims: Sequence[Claim], now: float,
              hold_s: float) -> list[int]:
        """Indexes of the claims that do not fit now (none when ``rid`` is already held),
        after reaping what is due; holds nothing. With :meth:`hold`, one atomic step with
        other memory state (:mod:`policies.state.admission`).

        Raises:
            LedgerFull: every claim fits but holding them needs counters beyond
                ``max_counters``.
        """
        self._reap(self._clock(), hold_s)
        if now >= self._next_sweep:
            self._sweep(now)
        if (group, rid) in self._reservations:
            return []
        counters, held = self._counters, self._held
        denied = []
        new: set[bytes] = set()
        for i, claim in enumerate(claims):
            digest = counter_digest(group, claim.key)
            packed = counters.get(digest)
            if packed is None:
                new.add(digest)
                spent = 0.0
            else:
                spent = _COUNTER.unpack(packed)[0]
            if spent + held.get(digest, 0.0) + claim.amount > claim.cap:
                denied.append(i)
        if not denied and new and len(counters) + len(new) > self.max_counters:
            raise LedgerFull(self.max_counters)
        return denied

    def release(self, group: str, rid: str) -> bool:
        """Settle reservation ``rid`` to nothing spent (see :meth:`settle`)."""
        reservation = self._reservations.get((group, rid))
        if reservation is None:
            return False
        return self._settle(group, rid, [0.0] * len(reservation.claims))

    def holds(self, group: str, rid: str) -> bool:
        """Reservation ``rid`` is held (or lapsed and not yet forgotten)."""
        return (group, rid) in self._reservations

    def hold(self, group: str, rid: str, claims: Sequence[Claim], now: float,
             hold_s: float) -> None:
        """Hold every claim under ``rid`` without checking caps (:meth:`check` did); nothing
        when ``rid`` is already held."""
        if (group, rid) in self._reservations:
            return
        clock = self._clock()
        counters, held = self._counters, self._held
        kept = []
        for claim in claims:
            digest = counter_digest(group, claim.key)
            held[digest] = held.get(digest, 0.0) + claim.amount
            spent, expiry = _COUNTER.unpack(counters.get(digest, _EMPTY))
            counters[digest] = _COUNTER.pack(spent, max(expiry, claim.expires_at + hold_s))
            kept.append((digest, claim.amount,
                         clock + max(claim.expires_at - now, 0.0) + hold_s))
        self._reservations[(group, rid)] = _Reservation(kept, clock + hold_s)
        heapq.heappush(self._due, (clock + hold_s, group, rid))

    async def settle(self, group: str, rid: str, actual: Sequence[float],
                     mark: bool = False) -> bool:
        return self._settle(group, rid, actual)

    def _settle(self, group: str, rid: str, actual: Sequence[float]) -> bool:
        reservation = self._reservations.pop((group, rid), None)
        if reservation is None:
            return False
        clock = self._clock()
        for (digest, amount, gone_at), used in zip(reservation.claims, actual, strict=True):
            if used and gone_at > clock:  # spend in a window long over is dropped
                # The counter keeps the expiry its hold gave it; reaped and swept meanwhile,
                # it comes back until the window's end (on this ledger's clock).
                packed = self._counters.get(digest)
                self._add(digest, used, 0.0 if packed is not None else gone_at)
            if not reservation.lapsed:
                self._unhold(digest, amount)
        # Settled reservations leave their heap entries behind (reaped lazily when due, a
        # hold later): rebuild the heap once they outnumber the live ones, so calls settled
        # within the last hold do not pile up.
        if len(self._due) > 2 * len(self._reservations) + 1024:
            self._due = [(r.expires_at, g, i) for (g, i), r in self._reservations.items()]
            heapq.heapify(self._due)
        return True

    async def charge(self, group: str, claims: Sequence[Claim], now: float) -> None:
        """Spend made elsewhere is recorded whatever ``max_counters`` says: it was spent."""
        for claim in claims:
            self._add(counter_digest(group, claim.key), claim.amount, claim.expires_at)

    async def levels(self, group: str, keys: Sequence[str]) -> list[tuple[float, float]]:
        return [self.level(group, key) for key in keys]

    def level(self, group: str, key: str) -> tuple[float, float]:
        digest = counter_digest(group, key)
        return (_COUNTER.unpack(self._counters.get(digest, _EMPTY))[0],
                self._held.get(digest, 0.0))

    def _add(self, digest: bytes, amount: float, expires_at: float) -> None:
        spent, expiry = _COUNTER.unpack(self._counters.get(digest, _EMPTY))
        self._counters[digest] = _COUNTER.pack(spent + amount, max(expiry, expires_at))

    def _unhold(self, digest: bytes, amount: float) -> None:
        left = self._held.get(digest, 0.0) - amount
        if left > DUST:
            self._held[digest] = left
            return
        self._held.pop(digest, None)
        packed = self._counters.get(digest)
        if packed is not None and _COUNTER.unpack(packed)[0] == 0.0:
            del self._counters[digest]  # nothing spent, nothing held: same as absent

    def _reap(self, clock: float, grace_s: float) -> None:
        due = self._due
        while due and due[0][0] <= clock:
            _, group, rid = heapq.heappop(due)
            reservation = self._reservations.get((group, rid))
            if reservation is None:
                continue
            if reservation.lapsed:
                del self._reservations[(group, rid)]
                continue
            for digest, amount, _ in reservation.claims:
                self._unhold(digest, amount)
            reservation.lapsed = True
            reservation.expires_at = clock + grace_s
            heapq.heappush(due, (reservation.expires_at, group, rid))

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + 60.0
        unpack, held = _COUNTER.unpack, self._held
        gone = [d for d, packed in self._counters.items()
                if unpack(packed)[1] <= now and d not in held]
        for digest in gone:
            del self._counters[digest]


# -- redis ------------------------------------------------------------------------------------

# Shared Lua (also the admission's, :mod:`policies.state.admission`): server time in ms,
# releasing a hold, extending a counter's TTL, reaping, reading levels; ``denied_claims(k, a,
# n)`` and ``hold_claims(...)`` check and hold the ``n`` claims on counters ``KEYS[k + 1 ..
# k + n]``, each with (amount, cap, counter TTL ms) from ``ARGV[a + 1 ..]``; ``settle(resv,
# exp, rid, a)`` settles reservation ``rid`` with the spend per claim from ``ARGV[a + 1 ..]``
# (``a`` nil: nothing spent), once: 0 when there was nothing to settle. A counter the spend
# lands on keeps (or regains) the expiry it had when reserved: it may have been emptied and
# deleted meanwhile if the reservation was reaped.
LEDGER_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function unhold(key, amount)
  if redis.call('EXISTS', key) == 1 then
    local left = tonumber(redis.call('HINCRBYFLOAT', key, 'h', '-' .. amount))
    if left <= 1e-9 then redis.call('HDEL', key, 'h') end
  end
end
local function extend(key, ttl)
  local current = redis.call('PTTL', key)
  if current >= 0 and current < ttl or current == -1 then redis.call('PEXPIRE', key, ttl) end
end
-- A reservation record as hold_claims and mark_gone write it: {s = 'h' (held) | 'l'
-- (lapsed) | 'x' (gone), c = {{counter key, amount as text, counter expiry ms}...}}, each
-- counter in the group's budget keys (named after resv, '<prefix>:{<group>}:budget:~resv');
-- nil when raw is anything else.
local function readable(resv, raw)
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec.c) ~= 'table'
      or (rec.s ~= 'h' and rec.s ~= 'l' and rec.s ~= 'x') then return nil end
  local base = string.sub(resv, 1, #resv - 5)
  for _, c in ipairs(rec.c) do
    if type(c) ~= 'table' or type(c[1]) ~= 'string' or string.sub(c[1], 1, #base) ~= base
        or type(c[3]) ~= 'number' or not (plain_float(c[2]) and plain_float(c[2]) >= 0)
    then return nil end
  end
  return rec
end
local function record(resv, raw)
  return readable(resv, raw) or bad('a budget reservation', 'holds what Sluice does not write')
end
-- A counter whose hold can be released: absent, or a hash whose 'h' Redis can add to.
local function holdable(key)
  local kind = redis.call('TYPE', key)['ok']
  return kind == 'none' or (kind == 'hash' and plain_float(redis.call('HGET', key, 'h') or '0'))
end
-- Reservations past their hold: a held one's holds are released and it is kept as lapsed
-- for grace ms; a lapsed or gone one is forgotten. One that cannot be read (another program
-- wrote it) is forgotten too, its holds (unknown) left as they are, and a counter of a
-- readable one whose hold Redis cannot release is left as it is: it faults its own calls.
-- Failing the reap instead failed every budgeted call of the group, every tenant's, for as
-- long as the record stayed (a hostile review).
local function reap(resv, exp, grace)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, 64)) do
    local raw = redis.call('HGET', resv, id)
    local rec = raw and readable(resv, raw)
    if rec and rec.s == 'h' then
      for _, c in ipairs(rec.c) do
        if holdable(c[1]) then unhold(c[1], c[2]) end
      end
      rec.s = 'l'
      redis.call('HSET', resv, id, cjson.encode(rec))
      redis.call('ZADD', exp, now + grace, id)
    else
      redis.call('HDEL', resv, id)
      redis.call('ZREM', exp, id)
    end
  end
end
local function levels(first)
  local out = {}
  for i = first, #KEYS do
    local v = redis.call('HMGET', KEYS[i], 's', 'h')
    out[#out + 1] = v[1] or '0'
    out[#out + 1] = v[2] or '0'
  end
  return out
end
local function denied_claims(k, a, n)
  local denied = {}
  for i = 1, n do
    local j = a + 3 * i - 2
    local v = redis.call('HMGET', KEYS[k + i], 's', 'h')
    if float_field(v[1], 'a budget counter') + float_field(v[2], 'a budget counter')
       + tonumber(ARGV[j]) > tonumber(ARGV[j + 1])
    then denied[#denied + 1] = i - 1 end
  end
  return denied
end
-- Checks every counter a settle of rec writes to (and answers the level of) before the
-- first write: Redis does not roll a script back, and a settle that added the spend to its
-- first counter and then failed on the second was sent again, and charged again, at every
-- kick of the reconciler (a hostile review). counter_checked: one counter, as
-- HINCRBYFLOAT will take its fields (absent: 0).
local function counter_checked(key)
  local v = redis.call('HMGET', key, 's', 'h')
  float_field(v[1], 'a budget counter')
  float_field(v[2], 'a budget counter')
end
local function settleable(rec)
  for _, c in ipairs(rec.c) do counter_checked(c[1]) end
end
local function settle(resv, exp, rid, a)
  local raw = redis.call('HGET', resv, rid)
  if not raw then return 0 end
  local rec = record(resv, raw)
  settleable(rec)
  for i, c in ipairs(rec.c) do
    local key, used = c[1], a and ARGV[a + i]
    if used and tonumber(used) ~= 0 and c[3] > now then
      redis.call('HINCRBYFLOAT', key, 's', used)
      if redis.call('PTTL', key) == -1 then redis.call('PEXPIREAT', key, c[3]) end
    end
    if rec.s == 'h' then unhold(key, c[2]) end
  end
  redis.call('HDEL', resv, rid)
  redis.call('ZREM', exp, rid)
  return 1
end
-- A release or settle of a reservation not (yet) held leaves a mark for gone_ms, so that
-- the reserve it answers for, delayed on its way (sent as Redis stalled, or through a slow
-- proxy), holds nothing when it lands: it found the id taken and did nothing. Without it
-- the hold stayed until the reap, minutes later (a Redis fault trial). A mark settles as
-- nothing was there.
local function mark_gone(resv, exp, rid, gone_ms)
  if gone_ms > 0 then
    redis.call('HSET', resv, rid, '{"s":"x","c":[]}')
    redis.call('ZADD', exp, now + gone_ms, rid)
  end
end
local function settle_levels(resv, exp, rid, a, gone_ms, mark)
  local raw = redis.call('HGET', resv, rid)
  if not raw then
    mark_gone(resv, exp, rid, gone_ms)
    return {0, {}}
  end
  local rec = record(resv, raw)
  if rec.s == 'x' then return {0, {}} end
  settle(resv, exp, rid, a)
  if mark then mark_gone(resv, exp, rid, gone_ms) end
  local out = {}
  for _, c in ipairs(rec.c) do
    local v = redis.call('HMGET', c[1], 's', 'h')
    out[#out + 1] = c[1]
    out[#out + 1] = v[1] or '0'
    out[#out + 1] = v[2] or '0'
  end
  return {1, out}
end
local function hold_claims(resv, exp, rid, hold, k, a, n)
  local claims = {}
  for i = 1, n do
    local j = a + 3 * i - 2
    local key = KEYS[k + i]
    redis.call('HINCRBYFLOAT', key, 'h', ARGV[j])
    extend(key, tonumber(ARGV[j + 2]))
    claims[#claims + 1] = {key, ARGV[j], now + tonumber(ARGV[j + 2])}
  end
  redis.call('HSET', resv, rid, cjson.encode({s = 'h', c = claims}))
  redis.call('ZADD', exp, now + hold, rid)
end
"""

# KEYS: reservations, their expiries, then one counter per claim. ARGV: rid, hold ms, then
# per claim: amount, cap, counter TTL ms. Returns {denied (0-based), levels after}.
_RESERVE = Script(LEDGER_LUA + """
local rid, hold = ARGV[1], tonumber(ARGV[2])
reap(KEYS[1], KEYS[2], hold)
if redis.call('HEXISTS', KEYS[1], rid) == 1 then return {{}, levels(3)} end
local denied = denied_claims(2, 2, #KEYS - 2)
if #denied == 0 then hold_claims(KEYS[1], KEYS[2], rid, hold, 2, 2, #KEYS - 2) end
return {denied, levels(3)}
""", "budget")

# KEYS: reservations, their expiries. ARGV: rid, then the actual spend per claim, then
# how long an id not held is marked gone, ms, then '1' to mark it gone even if it held.
# Returns {0 (nothing to settle) or 1, {counter key, spent, held, ...} after}. The counters
# are named in the reservation (same slot).
_SETTLE = Script(LEDGER_LUA + """
return settle_levels(KEYS[1], KEYS[2], ARGV[1], 1, tonumber(ARGV[#ARGV - 1]),
                     ARGV[#ARGV] == '1')
""", "budget")

# KEYS: counters. ARGV: per counter, amount and TTL ms.
_CHARGE = Script(LEDGER_LUA + """
-- every counter checked before the first write (see settleable)
for i = 1, #KEYS do counter_checked(KEYS[i]) end
for i = 1, #KEYS do
  redis.call('HINCRBYFLOAT', KEYS[i], 's', ARGV[2 * i - 1])
  extend(KEYS[i], tonumber(ARGV[2 * i]))
end
return levels(1)
""", "budget")

# KEYS: reservations, their expiries, then counters. ARGV: the group's hold ms (0: unknown,
# reap nothing). Reaps what is due, as a reserve would, then reads the counters' levels.
_REFRESH = Script(LEDGER_LUA + """
local grace = tonumber(ARGV[1])
if grace > 0 then reap(KEYS[1], KEYS[2], grace) end
return levels(3)
""", "budget")

_LEVELS = Script("""
local out = {}
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 's', 'h')
  out[#out + 1] = v[1] or '0'
  out[#out + 1] = v[2] or '0'
end
return out
""", "budget")


#: What a key fault names a budget counter and a reservation record (never their values).
_COUNTER_NAME = "a budget counter"
_RESERVATION = "a budget reservation"

#: How long a release of a reservation id not held marks it gone when the group's hold is
#: not known here, ms: two minutes, the reservations' documented longest hold.
GONE_MS = 120_000


def hold_ms_of(hold_s: float) -> int:
    """A reservation's hold in whole milliseconds (at least 1), as the scripts take it."""
    return max(int(hold_s * 1000), 1)


class RedisLedger:
    """The ledger in Redis: each call one ``EVALSHA`` on the group's slot."""

    def __init__(self, state: RedisState) -> None:
        self._state = state
        self._seen: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()
        #: How many answers :meth:`remember` has kept: a refresh keeps what it read of a
        #: counter only if no answer about it was kept since the refresh asked.
        self._answers = 0
        self._answered: dict[tuple[str, str], int] = {}
        #: The hold (ms) of each group's latest reservation here: what a refresh reaps with.
        self._holds: dict[str, int] = {}

    def reservation_keys(self, group: str) -> list[str]:
        """The group's reservations hash and their expiry set (``KEYS[1]``, ``KEYS[2]``)."""
        return [self._state.key(group, "budget", "~resv"),
                self._state.key(group, "budget", "~resv-exp")]

    def counter(self, group: str, key: str) -> str:
        """The Redis key of counter ``key`` in ``group``."""
        return self._state.key(group, "budget", key)

    @staticmethod
    def claim_args(claims: Sequence[Claim], now: float, hold_ms: int) -> list[object]:
        """The ARGV of ``claims`` for :data:`LEDGER_LUA`'s ``denied_claims``/``hold_claims``:
        (amount, cap, counter TTL ms) each; the TTL runs to the window's end plus the hold."""
        args: list[object] = []
        for claim in claims:
            ttl_ms = max(int((claim.expires_at - now) * 1000), 0) + hold_ms
            args += [repr(float(claim.amount)), repr(float(claim.cap)), ttl_ms]
        return args

    def gone_ms(self, group: str) -> int:
        """How long a release or settle of a reservation id not held marks it gone, ms: the
        group's hold (a reserve delayed longer would have been reaped by then anyway), or
        :data:`GONE_MS` before this process has reserved in the group."""
        return self._holds.get(group) or GONE_MS

    def note_hold(self, group: str, hold_ms: int) -> None:
        """Remember ``group``'s reservation hold (ms), as a reserving script was given it:
        :meth:`refresh_held` reaps the group's lapsed reservations keeping them that long."""
        self._holds[group] = hold_ms

    async def reserve(self, group: str, rid: str, claims: Sequence[Claim], now: float,
                      hold_s: float) -> list[int]:
        hold_ms = hold_ms_of(hold_s)
        self.note_hold(group, hold_ms)
        keys = self.reservation_keys(group) + [self.counter(group, c.key) for c in claims]

        def read(reply: Sequence[Any]) -> list[int]:
            denied, flat = reply
            self.remember(group, [c.key for c in claims], flat)
            return [int(i) for i in denied]

        return await self._state.eval(
            _RESERVE, keys, [rid, hold_ms, *self.claim_args(claims, now, hold_ms)], read)

    async def settle(self, group: str, rid: str, actual: Sequence[float],
                     mark: bool = False) -> bool:
        return await self._state.eval(_SETTLE, self.reservation_keys(group),
                                      [rid, *(repr(float(a)) for a in actual),
                                       self.gone_ms(group), "1" if mark else "0"],
                                      lambda reply: self.remember_settled(group, reply))

    def remember_settled(self, group: str, reply: Sequence[Any]) -> bool:
        """Keep the levels a settling script answered (``settle_levels``: ``{settled,
        {counter key, spent, held, ...}}``), so the gauges and headers show the settle, not
        the reserve before it; returns whether the reservation was settled. One Redis no
        longer has answers no levels (its counters were named in it): the caller, which
        knows them, reads them then (:class:`policies.budget.Reconciler`)."""
        settled, flat = reply
        prefix = self.counter(group, "")
        keys = [stored_text(raw, _RESERVATION).removeprefix(prefix) for raw in flat[0::3]]
        values = [v for i, v in enumerate(flat) if i % 3]
        self.remember(group, keys, values)
        return bool(settled)

    async def charge(self, group: str, claims: Sequence[Claim], now: float) -> None:
        if not claims:
            return
        keys = [self.counter(group, c.key) for c in claims]
        args: list[object] = []
        for claim in claims:
            args += [repr(float(claim.amount)),
                     max(int((claim.expires_at - now) * 1000), 1)]
        await self._state.eval(_CHARGE, keys, args,
                               lambda flat: self.remember(group, [c.key for c in claims], flat))

    async def levels(self, group: str, keys: Sequence[str]) -> list[tuple[float, float]]:
        if not keys:
            return []
        return await self._state.eval(_LEVELS, [self.counter(group, k) for k in keys], [],
                                      lambda flat: self.remember(group, keys, flat))

    def level(self, group: str, key: str) -> tuple[float, float]:
        return self._seen.get((group, key), (0.0, 0.0))

    async def refresh_held(self) -> None:
        """Read again the levels of the counters last seen holding something (at most
        :data:`REFRESH_KEYS` a group), so that what :meth:`level` says of them is Redis's
        now. A counter's level is otherwise what this replica's last call on it heard: one
        whose settle answered while another replica's call still held its reservation kept
        showing that reservation (``sluice_budget_reserved``, and as much less
        ``sluice_budget_remaining``) after it had settled too, on an idle deployment, until
        the tenant's next call here (a hostile review). One round trip a group.

        The group's reservations past their hold are reaped first, as the next reserve would
        (up to 64 a call): a killed replica's reservation was otherwise shown held until a
        call on that route came, long after its hold (a hostile trial: 227 tokens at +180 s
        of a 120 s hold). A group with no reservation made here since start has no known
        hold and is only read.

        Raises:
            StateUnavailable: as :meth:`levels` (the levels are kept as they were).
        """
        by_group: dict[str, list[str]] = {}
        for (group, key), (_spent, held) in self._seen.items():
            if held > DUST:
                keys = by_group.setdefault(group, [])
                if len(keys) < REFRESH_KEYS:
                    keys.append(key)
        for group, keys in by_group.items():
            asked = self._answers

            def read(flat: Sequence[bytes], group: str = group, keys: list[str] = keys,
                     asked: int = asked) -> None:
                # A call's answer about a counter kept while this read was on its way may be
                # the newer: that one stays.
                fresh = [i for i, key in enumerate(keys)
                         if self._answered.get((group, key), 0) <= asked]
                self.remember(group, [keys[i] for i in fresh],
                              [v for i in fresh for v in (flat[2 * i], flat[2 * i + 1])])

            await self._state.eval(
                _REFRESH, self.reservation_keys(group) + [self.counter(group, k) for k in keys],
                [self._holds.get(group, 0)], read)

    def remember(self, group: str, keys: Sequence[str], flat: Sequence[bytes]
                 ) -> list[tuple[float, float]]:
        """Keep the levels a script answered (``spent, held`` flat, per key) for
        :meth:`level`; returns them as pairs."""
        seen = self._seen
        answered = self._answered
        self._answers += 1
        out = []
        for i, key in enumerate(keys):
            value = (stored_float(flat[2 * i], _COUNTER_NAME),
                     stored_float(flat[2 * i + 1], _COUNTER_NAME))
            seen[(group, key)] = value
            seen.move_to_end((group, key))
            answered[(group, key)] = self._answers
            out.append(value)
        while len(seen) > LEVEL_CACHE_SIZE:
            gone, _ = seen.popitem(last=False)
            answered.pop(gone, None)
        return out
