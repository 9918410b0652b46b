"""Run trees, run counters and cancellations shared by every replica (Redis backend).

:class:`policies.runs.RunRegistry` keeps each replica's own view of its runs (live calls,
statistics, fan-out width); with the Redis backend it asks a :class:`RedisRuns` for what must
be the same on every replica.

A run is a tenant's run id: every key and message names it as ``<q><run>``, where ``<q>`` is
``<len(tenant)>:<tenant>:`` (:func:`qualified`; the length keeps any tenant and run pair from
reading as another, as ``policies/budget.py`` keys run budgets), and a parent is looked up in
its child's tenant.

* **Links and first-call times.** Each run has a hash ``<prefix>:{runs}:run:<q><id>`` with
  ``first`` (its first call, Redis ``TIME`` in ms), ``parent`` (the run id it was first seen
  under, of the same tenant) and ``n:<scope>`` (calls counted for ``run.max_requests`` in that
  scope, its descendants' included). Every call of a run refreshes the expiry of its run and
  of each ancestor to :data:`RUN_IDLE_TTL_S`, so a tree lives as long as any of it calls.
  A run a replica linked only in its own tree while Redis did not answer its admission is
  linked here once Redis answers (:meth:`RedisRuns.link`).
* **Takes.** Each count is taken under an id of its caller's (:func:`new_take_id`), recorded
  in a hash ``<prefix>:{runs}:take:<id>`` (the runs it counted on and one ``n:<scope>`` field
  per scope counted) for :data:`TAKE_HOLD_S`. A give-back names that id and undoes what the
  take counted, once: a give-back sent again, because Redis did not answer the first (it may
  have run it), finds nothing more to undo. A give-back that finds no record (its take's
  reply was lost, and the take is still queued in a frozen Redis, or never ran) leaves one
  saying the take is given back, so that the take counts nothing if it runs after it.
* **Tenants of a run id.** A set ``<prefix>:{runs}:tenants:<id>`` of the ``<q>`` of each
  tenant that has a run ``<id>``, added to when a run's hash is made and expiring with it, so
  that a cancel naming no tenant finds every tenant's run of that id in one script.
* **Cancellations.** A sorted set ``<prefix>:{runs}:cancelled`` of ``<q><run>`` scored by the
  Redis time (ms) until which their calls are refused (``run.cancel_ttl`` of the replica that
  cancelled). A cancel also publishes ``<ttl_ms> <q><run>`` on ``<prefix>:runs:cancel`` per
  tenant it hits; each replica's :class:`CancelFeed` hears it and ends that tenant's run's
  calls, its descendants' included, at once. Pub/sub is at-most-once, so the set stays the
  truth: every call checks its whole lineage against it (a replica that missed the message,
  or started after it, still refuses), and the feed re-reads the set each time it
  (re)subscribes.

Every key lives in the ``{runs}`` hash slot, so each script runs on one slot of a Redis
Cluster; the scripts walk parent links, so they build ancestors' keys themselves (all in that
slot). The price: one node of a cluster carries all run state and its load. Each
request-path operation is one script, one round trip, bounded by ``state.timeout`` and
raising :class:`~policies.state.errors.StateUnavailable` when Redis does not answer; a call
of a run makes one (:meth:`RedisRuns.admit` places it, checks its cancellation and counts it
for ``max_requests``), a call that never reached the upstream one more to give its count
back (and one more for each time Redis did not answer that: see
:class:`policies.runs.GiveBacks`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from policies.state.connection import Script
from policies.state.notify import READ_TIMEOUT_S, stop_listener, subscription
from policies.state.stored import stored_int

if TYPE_CHECKING:

    from policies.state.connection import RedisState

log = logging.getLogger("sluice.state")

#: The hash slot group of every run key.
GROUP = "runs"
#: A run (and its counts) with no call in its tree for this long is forgotten, seconds.
RUN_IDLE_TTL_S = 86400
#: Longest lineage (a run and its ancestors) a script follows (as
#: ``policies.runs.MAX_LINEAGE``): a run is never linked more than ``MAX_LINEAGE - 1`` levels
#: below its root, and a call of a run whose lineage is longer (a root linked later above
#: it) is refused, so a walk of at most this many links reaches the root and a cycle check
#: is never cut short.
MAX_LINEAGE = 64
#: Cancellations read back at most when the feed (re)subscribes.
RESYNC_LIMIT = 10_000
#: How long the record of a count (a take) is kept, seconds: a give-back must reach Redis
#: within it, or the count stays for the run's life. It covers a call's waits before it is
#: sent upstream (queues, minutes at most) and an outage that holds its give-back back; each
#: record costs ~200 bytes of Redis memory for this long (~12 MB at 100 calls a second).
TAKE_HOLD_S = 600


#: ``(tenant, run ids)``: the runs a take was heard to count on, the run first.
CountedOn = tuple[str, tuple[str, ...]]


def new_take_id() -> str:
    """A fresh id for one count (:meth:`RedisRuns.take_request`, :meth:`RedisRuns.admit`),
    unique across replicas."""
    return uuid.uuid4().hex


#: The take of an admission that counts nothing: its record key is never written, but the
#: script is given one (its keys share a Redis Cluster slot).
NO_TAKE = "-"


def qualified(tenant: str) -> str:
    """``<len(tenant)>:<tenant>:``, what precedes a run id of ``tenant`` in keys and
    messages."""
    return f"{len(tenant)}:{tenant}:"


def unqualified(name: str) -> tuple[str, str] | None:
    """``(tenant, run)`` from ``<q><run>`` (:func:`qualified`), or ``None`` when ``name`` is
    not of that form (written by an older Sluice, or not by Sluice)."""
    length, sep, rest = name.partition(":")
    if not sep or not (length.isascii() and length.isdigit()) or len(length) > 6:
        return None  # "²".isdigit() is true and int() refuses it: the feed stopped (a review)
    size = int(length)
    if rest[size:size + 1] != ":" or len(rest) <= size + 1:
        return None
    return rest[:size], rest[size + 1:]

# Place a call's run in the shared tree, read its lineage, and count the call.
# KEYS: cancelled zset, the run's hash, the parent's hash (or the run's again), the take's
# record (see _TAKE).
# ARGV: run, parent ('' for none), key prefix of the tenant's run hashes, idle ttl s, max
# lineage, the tenant's <q>, key prefix of tenant sets, take hold ms, then per max_requests
# scope: field, limit, depth limit (-1: none), max duration ms (-1: none).
# Each run hash made here puts the tenant in its id's tenant set; each run of the lineage
# refreshes the expiry of its hash and of that set.
# A new run is linked under its parent unless that would close a cycle; a run first seen as a
# root is linked later only while it has counted nothing (as the memory registry does). The
# cycle check walks the parent's chain to its root, at most max links: a chain longer than
# that (or one reaching a run marked 'deep') is not walked further, as it would put the run
# past max - 1 levels: the run is not linked, the call refused ('deep'), and a new run marked
# 'deep' so that it and every run named below it stay refused. A lineage longer than max, or
# holding a run marked 'deep', is deep: its calls are refused (so every count and
# cancellation check reaches the root).
# The call is counted in every scope on every run of the lineage, or nowhere: not when the
# lineage is longer than max (deep), cancelled, deeper or older than a scope allows, a run
# is at a scope's limit, or the take was given back before it ran (its record says 'gone').
# A count is recorded as _TAKE records it.
# Returns {ids, first-call ms, cancelled index (0: none), ms its refusal has left, now ms,
# counted (0/1), per scope the index of the first run at its limit (0: none), per scope the
# highest count after counting, deep (0/1)}.
_ADMIT = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local run, parent, pre = ARGV[1], ARGV[2], ARGV[3]
local ttl, max = tonumber(ARGV[4]), tonumber(ARGV[5])
local q, sets, hold = ARGV[6], ARGV[7], ARGV[8]
local key = KEYS[2]
local deep, new = 0, redis.call('HSETNX', key, 'first', now) == 1
if new then redis.call('SADD', sets .. run, q) end
-- Linked when new (its first admission: a replica's outage count may have made its hash,
-- without a link) or holding nothing but its first-call time.
if parent ~= '' and parent ~= run and (new or redis.call('HLEN', key) == 1) then
  local node, cycle, above = parent, false, 0
  while node and above < max do
    if node == run then cycle = true break end
    local row = redis.call('HMGET', pre .. node, 'parent', 'deep')
    if row[2] then break end  -- below a run marked deep: as deep as a chain too long
    above = above + 1
    node = row[1]
  end
  if node and not cycle then
    -- The chain above the parent is longer than max: not walked further, not linked. The
    -- call is refused; a new run is marked so that it and its descendants stay refused.
    deep = 1
    if new then redis.call('HSET', key, 'deep', 1) end
  elseif not cycle then
    if redis.call('HSETNX', KEYS[3], 'first', now) == 1 then
      redis.call('SADD', sets .. parent, q)
    end
    redis.call('HSET', key, 'parent', parent)
  end
end
local ids, firsts = {}, {}
local hit, left = 0, 0
local node = run
for i = 1, max do
  local k = pre .. node
  local row = redis.call('HMGET', k, 'first', 'parent', 'deep')
  local first = row[1]
  if row[3] then deep = 1 end
  if not first then
    first = now
    redis.call('HSET', k, 'first', now)
    redis.call('SADD', sets .. node, q)
  end
  redis.call('EXPIRE', k, ttl)
  redis.call('EXPIRE', sets .. node, ttl)
  ids[i] = node
  firsts[i] = first
  if hit == 0 then
    local until_ms = redis.call('ZSCORE', KEYS[1], q .. node)
    if until_ms and tonumber(until_ms) > now then
      hit, left = i, tonumber(until_ms) - now
    end
  end
  node = row[2]
  if not node then break end
  if i == max then deep = 1 end
end
local counted, full, highs = 0, {}, {}
if deep == 1 then
  hit = 0
elseif hit == 0 and #ARGV > 8 and redis.call('HEXISTS', KEYS[4], 'pre') == 1 then
  -- Run already (the client sent it again after a connection dropped): counted once.
  counted = 1
  for g = 9, #ARGV, 4 do
    local high = 0
    for i = 1, #ids do
      high = math.max(high, int_field(redis.call('HGET', pre .. ids[i], ARGV[g]), 'a run'))
    end
    full[#full + 1] = 0
    highs[#highs + 1] = high
  end
elseif hit == 0 and #ARGV > 8 and redis.call('HEXISTS', KEYS[4], 'gone') == 0 then
  local fits = true
  for g = 9, #ARGV, 4 do
    local depth_limit, duration = tonumber(ARGV[g + 2]), tonumber(ARGV[g + 3])
    if depth_limit >= 0 and #ids - 1 > depth_limit then fits = false end
    if duration >= 0 then
      for i = 1, #ids do
        if now - num(firsts[i], 'a run') >= duration then fits = false end
      end
    end
  end
  if fits then
    local room = true
    for g = 9, #ARGV, 4 do
      local field, limit = ARGV[g], tonumber(ARGV[g + 1])
      local at, high = 0, 0
      for i = 1, #ids do
        local n = int_field(redis.call('HGET', pre .. ids[i], field), 'a run')
        if n >= limit then at = i break end
        if n + 1 > high then high = n + 1 end
      end
      full[#full + 1] = at
      highs[#highs + 1] = high
      if at > 0 then room = false end
    end
    if room then
      counted = 1
      redis.call('HSET', KEYS[4], 'pre', pre, 'ids', cjson.encode(ids))
      for g = 9, #ARGV, 4 do
        for i = 1, #ids do redis.call('HINCRBY', pre .. ids[i], ARGV[g], 1) end
        redis.call('HSET', KEYS[4], ARGV[g], 1)
      end
      redis.call('PEXPIRE', KEYS[4], hold)
    end
  end
end
return {ids, firsts, hit, left, now, counted, full, highs, deep}
""", "runs")

# Count one call on every run of a lineage for a scope, or on none.
# KEYS: the run's hash (the rest are built from ARGV[1]), the take's record.
# ARGV: key prefix of the tenant's run hashes, field, limit (-1: none, for counts already
# served on a replica's local share during an outage), idle ttl (s), take hold ms, ids...
# Returns {0, highest count after} when counted, or {index of the first run at the limit, 0}.
# A run's hash lives RUN_IDLE_TTL_S past its last use, here too: a count taken for a run the
# admission script had not written (Redis did not answer it) left a hash that never expired.
# A count is recorded under the take's id for the hold ('pre': the prefix, 'ids': the runs,
# JSON, and the field), for _GIVE_BACK; a take given back before it ran (its record says
# 'gone') counts nothing and answers {0, 0}: its caller stopped waiting for the answer. A
# take that finds its own record ran already (redis-py sends a script again after a dropped
# connection): it answers as counted and counts nothing more. _ADMIT does the same.
_TAKE = Script("""
local pre, field, limit, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if redis.call('HEXISTS', KEYS[2], 'gone') == 1 then return {0, 0} end
local high = 0
if redis.call('HEXISTS', KEYS[2], 'pre') == 1 then
  -- Run already (the client sent it again after a connection dropped): counted once.
  for i = 6, #ARGV do
    high = math.max(high, int_field(redis.call('HGET', pre .. ARGV[i], field), 'a run'))
  end
  return {0, high}
end
for i = 6, #ARGV do
  local n = int_field(redis.call('HGET', pre .. ARGV[i], field), 'a run')
  if limit >= 0 and n >= limit then return {i - 5, 0} end
  if n + 1 > high then high = n + 1 end
end
local ids = {}
for i = 6, #ARGV do
  redis.call('HINCRBY', pre .. ARGV[i], field, 1)
  redis.call('EXPIRE', pre .. ARGV[i], ttl)
  ids[#ids + 1] = ARGV[i]
end
redis.call('HSET', KEYS[2], 'pre', pre, 'ids', cjson.encode(ids), field, 1)
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return {0, high}
""", "runs")

# Give back what one take (_TAKE or _ADMIT) counted in some scopes, once per scope (never
# below 0; a forgotten run is not re-created). A take with no record (not run yet, or it
# counted nothing) is marked 'gone' for the hold, so that it counts nothing if it runs later;
# unless its caller heard it count (then named the runs it counted on): its record lapsed
# (a call queued longer than the hold), the scopes are given back on those runs, and a record
# with no scope left is kept for the hold, so that a give-back sent again undoes nothing.
# KEYS: the take's record. ARGV: take hold ms, number of fields N, N fields, then (heard
# counted only) the key prefix of the tenant's run hashes and the run ids.
# Returns how many scopes were given back.
_GIVE_BACK = Script("""
local take, n = KEYS[1], tonumber(ARGV[2])
-- Every count given back is read and checked before the first write: a run hash holding
-- what HINCRBY refuses fails the call having changed nothing (Redis does not roll a script
-- back; a give-back that failed midway kept the decrements before it).
local function check(pre, ids, fields)
  for _, field in ipairs(fields) do
    for _, id in ipairs(ids) do int_field(redis.call('HGET', pre .. id, field), 'a run') end
  end
end
local function give_back(pre, ids, field)
  for _, id in ipairs(ids) do
    local k = pre .. id
    if tonumber(redis.call('HGET', k, field) or '0') > 0 then
      redis.call('HINCRBY', k, field, -1)
    end
  end
end
if redis.call('EXISTS', take) == 0 then
  local done = 0
  if #ARGV > n + 2 then
    local pre, ids, fields = ARGV[n + 3], {}, {}
    for i = n + 4, #ARGV do ids[#ids + 1] = ARGV[i] end
    for f = 3, n + 2 do fields[#fields + 1] = ARGV[f] end
    check(pre, ids, fields)
    for _, field in ipairs(fields) do
      give_back(pre, ids, field)
      done = done + 1
    end
    redis.call('HSET', take, 'pre', pre)
  else
    redis.call('HSET', take, 'gone', 1)
  end
  redis.call('PEXPIRE', take, ARGV[1])
  return done
end
local pre, fields = redis.call('HGET', take, 'pre'), {}
if pre then
  for f = 3, n + 2 do
    if redis.call('HEXISTS', take, ARGV[f]) == 1 then fields[#fields + 1] = ARGV[f] end
  end
end
if #fields == 0 then return 0 end
local ids = decoded(redis.call('HGET', take, 'ids') or '', "a run's take")
for _, id in ipairs(ids) do
  if type(id) ~= 'string' then bad("a run's take", 'names no run') end
end
check(pre, ids, fields)
for _, field in ipairs(fields) do
  redis.call('HDEL', take, field)
  give_back(pre, ids, field)
end
return #fields
""", "runs")

# Link a run under the parent a replica placed it under while Redis did not answer its
# admission (_ADMIT never ran: the call was decided on that replica's own tree), once Redis
# answers. Without it a cancel of an ancestor, recorded here, missed the run's descendants on
# every replica that asks Redis, and their calls counted nothing on the ancestors. Unlike
# _ADMIT's late link of a root, it links a run that has counted (its descendants' calls
# counted on it as a root meanwhile; those counts stay off the ancestors): the run's first
# call named this parent, so it was never a root. A run linked already (a slow Redis ran the
# admission after all, or another replica linked it) keeps its link; one that would close a
# cycle stays as it is; one whose parent's chain is longer than max is not linked, and if
# made here is marked 'deep' (as _ADMIT marks a new run), so its calls are refused.
# KEYS: the run's hash, the parent's hash. ARGV: run, parent, key prefix of the tenant's run
# hashes, idle ttl s, max lineage, the tenant's <q>, key prefix of tenant sets.
# Returns 1 when linked here, else 0.
_LINK = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local run, parent, pre = ARGV[1], ARGV[2], ARGV[3]
local ttl, max, q, sets = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ARGV[7]
local key = KEYS[1]
local row = redis.call('HMGET', key, 'parent', 'deep')
if row[1] or row[2] or parent == run then return 0 end
local node, above = parent, 0
while node and above < max do
  if node == run then return 0 end  -- a cycle
  local up = redis.call('HMGET', pre .. node, 'parent', 'deep')
  if up[2] then break end  -- below a run marked deep: as deep as a chain too long
  above = above + 1
  node = up[1]
end
local new = redis.call('HSETNX', key, 'first', now) == 1
if new then redis.call('SADD', sets .. run, q) end
redis.call('EXPIRE', key, ttl)
redis.call('EXPIRE', sets .. run, ttl)
if node then
  if new then redis.call('HSET', key, 'deep', 1) end
  return 0
end
if redis.call('HSETNX', KEYS[2], 'first', now) == 1 then
  redis.call('SADD', sets .. parent, q)
end
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', sets .. parent, ttl)
redis.call('HSET', key, 'parent', parent)
return 1
""", "runs")

# Record a cancellation of run id ARGV[1] in some tenants and tell every replica.
# KEYS: cancelled zset, the run id's tenant set. ARGV: run, refusal ms, channel, key prefix of
# run hashes, '1' to add every tenant that has a run of that id (else '0'), then the <q> of
# each tenant named. Per tenant: a longer refusal already recorded is kept, and one message
# is published. Entries whose refusal ended are dropped here, so the set holds only
# cancellations in force; so are tenants of the set whose run has expired.
# Returns {<q>, ms the refusal lasts, ...} per tenant hit.
_CANCEL = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local run, ms, channel, runs = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local qs, seen = {}, {}
for i = 6, #ARGV do
  if not seen[ARGV[i]] then seen[ARGV[i]] = true qs[#qs + 1] = ARGV[i] end
end
if ARGV[5] == '1' then
  for _, q in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    if redis.call('EXISTS', runs .. q .. run) == 1 then
      if not seen[q] then seen[q] = true qs[#qs + 1] = q end
    else
      redis.call('SREM', KEYS[2], q)
    end
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out, last = {}, 0
for _, q in ipairs(qs) do
  local member = q .. run
  local until_ms = now + ms
  local old = redis.call('ZSCORE', KEYS[1], member)
  if old and tonumber(old) > until_ms then until_ms = tonumber(old) end
  redis.call('ZADD', KEYS[1], until_ms, member)
  if until_ms > last then last = until_ms end
  redis.call('PUBLISH', channel, (until_ms - now) .. ' ' .. member)
  out[#out + 1] = q
  out[#out + 1] = until_ms - now
end
if last > 0 then
  redis.call('PEXPIREAT', KEYS[1], math.max(last, redis.call('PTTL', KEYS[1]) + now))
end
return out
""", "runs")

# The cancellations in force (<q><run>), with the ms each has left. KEYS: cancelled zset.
# ARGV: limit.
_IN_FORCE = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0,
                        tonumber(ARGV[1]))
local out = {}
for i = 1, #rows, 2 do
  out[#out + 1] = rows[i]
  out[#out + 1] = tostring(tonumber(rows[i + 1]) - now)
end
return out
""", "runs")


@dataclass(frozen=True, slots=True)
class Lineage:
    """A run's place in the shared tree, as one call found it.

    Attributes:
        tenant: the tenant whose runs ``ids`` are.
        ids: the run, then its parent, up to the root (at most :data:`MAX_LINEAGE`).
        ages: seconds since each of their first calls, in the same order.
        cancelled: the run of ``ids`` whose cancellation refuses the call, or ``None``.
        cancelled_left: seconds that refusal has left (0 when ``cancelled`` is ``None``).
        counted: the call was counted in every scope asked (see :meth:`RedisRuns.admit`).
        full: per scope asked, the first run of ``ids`` at that scope's limit, or ``None``
            (empty when the counts were not looked at: cancelled, too deep or too old).
        highs: per scope asked, the highest count on the lineage after counting.
        deep: the run is, or linked under the parent named would be, more than
            ``MAX_LINEAGE - 1`` levels below its root: the call is to be refused, nothing
            was counted, ``cancelled`` is not looked at, and ``ids`` is cut at
            :data:`MAX_LINEAGE` (the run alone when the link was refused).
    """

    tenant: str
    ids: tuple[str, ...]
    ages: tuple[float, ...]
    cancelled: str | None
    cancelled_left: float
    counted: bool = False
    full: tuple[str | None, ...] = ()
    highs: tuple[int, ...] = ()
    deep: bool = False


@dataclass(frozen=True, slots=True)
class Count:
    """One ``run.max_requests`` scope a call is counted in, with the limits that must hold
    for it to be counted at all.

    Attributes:
        scope: the route's name, or ``*`` for the top-level ``run`` block.
        limit: ``max_requests``.
        depth: ``fanout.depth`` of the same scope, or ``None``.
        max_duration: ``run.max_duration`` of the same scope, seconds, or ``None``.
    """

    scope: str
    limit: int
    depth: int | None
    max_duration: float | None


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


class RedisRuns:
    """The shared part of run state in Redis (see the module docstring).

    Args:
        state: the Redis connection of the ``state`` block (its prefix and timeout apply).
    """

    def __init__(self, state: RedisState) -> None:
        self.state = state
        self._cancelled = state.key(GROUP, "cancelled")
        self._runs = state.key(GROUP, "run") + ":"
        self._tenants = state.key(GROUP, "tenants") + ":"
        self._takes = state.key(GROUP, "take") + ":"
        #: The channel cancellations are published on (classic pub/sub: no slot).
        self.channel = f"{state.prefix}:runs:cancel"
        self.feed = CancelFeed(self)

    async def admit(self, tenant: str, run: str, parent: str | None,
                    counts: Sequence[Count] = (), take: str | None = None) -> Lineage:
        """Place ``tenant``'s run ``run`` under the tenant's run ``parent`` (on first sight)
        and read its lineage and whether a cancellation refuses it; refreshes the expiry of
        the run and its ancestors. With ``counts``, also count the call in each of those
        scopes on every run of the lineage, all or none (as :meth:`take_request` does for one
        scope), unless the lineage is too deep (:attr:`Lineage.deep`), cancelled, deeper
        than a scope's ``depth`` or older than its ``max_duration``; the count is recorded
        under ``take`` (a fresh id if ``None``), for :meth:`give_back_request`.

        Raises:
            StateUnavailable: Redis did not answer within ``state.timeout``; if it was sent
                (``maybe_applied``) Redis may still count the call later: give ``take`` back.
        """
        q = qualified(tenant)
        runs = self._runs + q
        key = runs + run
        args: list[Any] = [run, parent or "", runs, RUN_IDLE_TTL_S, MAX_LINEAGE, q,
                           self._tenants, round(TAKE_HOLD_S * 1000)]
        for count in counts:
            args += [f"n:{count.scope}", count.limit,
                     -1 if count.depth is None else count.depth,
                     -1 if count.max_duration is None else round(count.max_duration * 1000)]

        def read(reply: Sequence[Any]) -> Lineage:
            ids, firsts, hit, left, now, counted, full, highs, deep = reply
            names = tuple(_text(name) for name in ids)
            now = int(now)
            return Lineage(
                tenant=tenant,
                ids=names,
                ages=tuple(max(0, now - stored_int(first, "a run")) / 1000 for first in firsts),
                cancelled=names[int(hit) - 1] if int(hit) else None,
                cancelled_left=int(left) / 1000,
                counted=bool(int(counted)),
                full=tuple(names[int(at) - 1] if int(at) else None for at in full),
                highs=tuple(int(high) for high in highs),
                deep=bool(int(deep)),
            )

        return await self.state.eval(
            _ADMIT, [self._cancelled, key, runs + parent if parent else key,
                     self._takes + (take or (new_take_id() if counts else NO_TAKE))], args, read)

    async def link(self, tenant: str, run: str, parent: str) -> bool:
        """Link ``tenant``'s run ``run`` under its run ``parent`` in the shared tree, as
        this replica linked it while Redis did not answer the run's admission (``_LINK``):
        unless the run is linked already, the link would close a cycle, or put it more than
        ``MAX_LINEAGE - 1`` levels below its root. Safe to repeat.

        Returns:
            whether this call made the link.

        Raises:
            StateUnavailable: Redis did not answer; it may still run this later.
        """
        q = qualified(tenant)
        runs = self._runs + q
        return bool(int(await self.state.eval(
            _LINK, [runs + run, runs + parent],
            [run, parent, runs, RUN_IDLE_TTL_S, MAX_LINEAGE, q, self._tenants])))

    async def take_request(self, scope: str, tenant: str, ids: tuple[str, ...],
                           limit: int | None, take: str | None = None
                           ) -> tuple[str | None, int]:
        """Count one call in ``scope`` on every run of ``ids`` (a lineage of ``tenant``'s
        runs, the run first), or on none of them; the count is recorded under ``take`` (a
        fresh id if ``None``) for :data:`TAKE_HOLD_S`, for :meth:`give_back_request`.
        ``limit`` ``None``: counted whatever the counts are (a call already served on this
        replica's local share while Redis did not answer, added once it does). A take sent
        again counts once; one given back before it ran counts nothing.

        Returns:
            ``(full, highest)``: the first run already at ``limit`` (nothing counted), else
            ``None`` and the highest count on the lineage after counting.

        Raises:
            StateUnavailable: Redis did not answer; if it was sent (``maybe_applied``), a
                frozen or slow Redis may still count the call later: give ``take`` back.
        """
        runs = self._runs + qualified(tenant)
        full, high = await self.state.eval(
            _TAKE, [runs + ids[0], self._takes + (take or new_take_id())],
            [runs, f"n:{scope}", -1 if limit is None else limit, RUN_IDLE_TTL_S,
             round(TAKE_HOLD_S * 1000), *ids])
        return (ids[int(full) - 1] if int(full) else None), int(high)

    async def give_back_request(self, take: str, scopes: Sequence[str],
                                counted_on: CountedOn | None = None) -> int:
        """Undo what the count ``take`` (:meth:`take_request` or :meth:`admit`) counted in
        each of ``scopes``, for a call that never reached the upstream: on the runs it
        counted on, whatever the lineage is now. Safe to repeat, and to send before the take
        has run: each scope is given back once, and a take not yet run counts nothing when
        it does (for :data:`TAKE_HOLD_S`). ``counted_on``, ``(tenant, run ids)``, when its
        caller heard the take count: a record that lapsed (the call waited longer than
        :data:`TAKE_HOLD_S`) is then given back on those runs instead of marked not to count.

        Returns:
            the scopes given back by this call (0: none counted, or already given back).

        Raises:
            StateUnavailable: Redis did not answer; it may still run this later. Send it
                again once Redis answers (:class:`policies.runs.GiveBacks` does), or the
                count stays taken for the run's life.
        """
        args: list[Any] = [round(TAKE_HOLD_S * 1000), len(scopes),
                           *(f"n:{scope}" for scope in scopes)]
        if counted_on is not None:
            tenant, ids = counted_on
            args += [self._runs + qualified(tenant), *ids]
        return int(await self.state.eval(_GIVE_BACK, [self._takes + take], args))

    async def cancel(self, run: str, ttl_s: float, tenants: Sequence[str] = (), *,
                     every: bool = False) -> dict[str, float]:
        """Record that run id ``run`` of each of ``tenants`` (and, with ``every``, of every
        tenant that has a run of that id in Redis) is refused, its descendants with it, for
        ``ttl_s`` seconds, and publish each to every replica's :class:`CancelFeed`. A tenant
        named whose run is not known yet is recorded too (its first calls are refused).

        Returns:
            per tenant hit, seconds its refusal lasts (more than ``ttl_s`` if a longer one
            was in force).

        Raises:
            StateUnavailable: Redis did not answer; the cancellation is not shared.
        """
        rows = await self.state.eval(
            _CANCEL, [self._cancelled, self._tenants + run],
            [run, max(1, round(ttl_s * 1000)), self.channel, self._runs, "1" if every else "0",
             *(qualified(tenant) for tenant in tenants)])
        hit: dict[str, float] = {}
        for i in range(0, len(rows), 2):
            # The set holds only what admit wrote: <q> of a tenant, never malformed.
            tenant = _text(rows[i])[:-1].partition(":")[2]
            hit[tenant] = int(rows[i + 1]) / 1000
        return hit

    async def in_force(self) -> list[tuple[str, str, float]]:
        """Every cancellation in force: ``(tenant, run, seconds left)``, at most
        :data:`RESYNC_LIMIT` (entries not of the ``<q><run>`` form are skipped).

        Raises:
            StateUnavailable: Redis did not answer.
        """
        rows = await self.state.eval(_IN_FORCE, [self._cancelled], [RESYNC_LIMIT])
        out = []
        for i in range(0, len(rows), 2):
            named = unqualified(_text(rows[i]))
            if named is not None:
                out.append((*named, int(_text(rows[i + 1])) / 1000))
        return out


class CancelFeed:
    """Each replica's subscription to the cancellations of every replica.

    :meth:`start` runs a listener on a pub/sub connection of its own; each cancellation heard
    is handed to ``on_cancel(tenant, run, seconds_left)``, which must not block. Each time the
    listener (re)subscribes it first hands over every cancellation in force
    (:meth:`RedisRuns.in_force`), so one missed while disconnected, or made before this
    replica started, still applies to calls already queued or in flight here.
    """

    def __init__(self, runs: RedisRuns) -> None:
        self._runs = runs
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._on_cancel: Callable[[str, str, float], None] | None = None
        #: Set while subscribed (tests and readiness wait on it).
        self.subscribed = asyncio.Event()

    def start(self, on_cancel: Callable[[str, str, float], None]) -> None:
        """Start listening (inside the running loop); never raises for Redis being down."""
        self._on_cancel = on_cancel
        if self._task is None:
            self._task = asyncio.create_task(self._listen(), name="sluice-runs-cancel-feed")

    async def close(self) -> None:
        """Stop listening and close the connection."""
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            await stop_listener(task, "the run cancellation listener")

    def _deliver(self, tenant: str, run: str, left_s: float) -> None:
        if self._on_cancel is not None and left_s > 0:
            self._on_cancel(tenant, run, left_s)

    def _heard(self, data: str) -> None:
        """One message: ``<ms left> <q><run>`` (see ``_CANCEL``)."""
        left_ms, _, name = data.partition(" ")
        named = unqualified(name)
        try:
            left_s = float(left_ms) / 1000
        except ValueError:
            named = None
        if named is None:  # also an older Sluice's ``<ms> <run>``: no tenant to apply it to
            log.warning("ignored a malformed run cancellation message: %.80r", data)
            return
        self._deliver(*named, left_s)

    async def _listen(self) -> None:
        runs = self._runs
        state = runs.state
        while not self._closing:
            try:
                async with subscription(state, runs.channel, confirmed=True) as pubsub:
                    # Subscribed first, then read the set: nothing falls between the two.
                    for tenant, run, left_s in await runs.in_force():
                        self._deliver(tenant, run, left_s)
                    self.subscribed.set()
                    while not self._closing:
                        message = await pubsub.get_message(timeout=READ_TIMEOUT_S)
                        if message is not None and message["type"] == "message":
                            self._heard(_text(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # StateUnavailable before the first connection, too
                log.debug("run cancellation listener: %r; reconnecting", exc)
            finally:
                self.subscribed.clear()
            await asyncio.sleep(state.probe_interval_s)
