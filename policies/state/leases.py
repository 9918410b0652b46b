"""Concurrency slots shared by every replica: leases that expire unless renewed.

A route's ``concurrency.limit`` counts calls at the upstream across all replicas. Each call
holds a *lease*: an entry with an expiry in the route's sorted set (and in its tenant's, for
``per_tenant``), renewed while the call runs (:class:`Lease` renews every third of the lease
time in the background). A replica killed with SIGKILL stops renewing, so its slots free
themselves within one lease time: every acquire first drops the entries whose expiry has
passed. Expiries are the server's time (``TIME``), so replicas' clocks do not matter.

A release publishes on the route's channel, so a waiter on any replica wakes at once
(:meth:`Leases.watch`); leases that lapse publish nothing, which is why waiters also poll
(:mod:`policies.shared_concurrency`). Each replica keeps its own queue and priorities; this
module only says whether a slot is free now.

Redis layout: ``<prefix>:{<group>}:conc`` (lease id -> expiry ms) and
``<prefix>:{<group>}:conc:t:<tenant>`` (same, one tenant's), both expiring when their last
lease would; channel ``<prefix>:{<group>}:conc:wake``. acquire, renew and release are one
script call each.

Replicas whose ``limit`` differs (a reload reaches them one at a time) share the lowest: each
acquire names its *holder* (one route's limiter on one replica) and the limit it was given,
kept one lease time in ``<prefix>:{<group>}:conc:lim`` (holder -> limit) and
``<prefix>:{<group>}:conc:lim:exp`` (holder -> expiry ms). Without it a replica reloaded to
a higher limit filled the route past the others' and starved their callers (they never saw
a count under their own limit), and one reloaded to a lower limit was starved by the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

from policies.logs import PER_CALL
from policies.state.connection import RedisState, Script
from policies.state.errors import StateUnavailable
from policies.state.notify import MemoryNotifier, Signal

log = logging.getLogger("sluice.state")

#: Lease refusals (:attr:`LeaseResult.refused_by`).
LIMIT = "limit"
TENANT = "tenant"


class LeaseResult(NamedTuple):
    """The answer of :meth:`Leases.acquire`.

    Attributes:
        granted: the lease is held (until released or lapsed).
        refused_by: ``None`` when granted; ``"tenant"`` when the tenant holds ``per_tenant``
            leases (checked first, as :mod:`policies.concurrency` does); ``"limit"`` when the
            route holds ``limit``.
        inflight: leases held on the group now, this one included when granted.
        tenant_inflight: the tenant's, likewise.
    """

    granted: bool
    refused_by: str | None
    inflight: int
    tenant_inflight: int


class Leases(Protocol):
    """Shared slot leases. acquire, renew and release are one round trip each.

    Raises (every async method):
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    async def acquire(self, group: str, tenant: str, lease_id: str, limit: int,
                      per_tenant: int | None, lease_s: float,
                      holder: str | None = None,
                      uncounted: tuple[int, int] = (0, 0)) -> LeaseResult:
        """Take a slot for ``lease_id`` if one is free, expiring in ``lease_s`` seconds.
        Acquiring an id already held renews it and grants again. With ``holder``, ``limit``
        is recorded as that holder's for ``lease_s``, and the slot is free only under the
        lowest limit recorded on the group by a live holder. ``uncounted``: calls of the
        caller's own at the upstream that hold no lease here yet (taken from memory during an
        outage, see :meth:`Lease.refresh`), the group's and the tenant's: the slot is free only
        if the leases held and these together are under ``limit`` (``per_tenant``)."""
        ...

    async def register(self, group: str, holder: str, limit: int, lease_s: float) -> int:
        """Record ``limit`` as ``holder``'s for ``lease_s`` (as :meth:`acquire` does, without
        taking a slot: after a reload); the group's lowest live limit."""
        ...

    async def renew(self, group: str, tenant: str, lease_id: str, lease_s: float) -> bool:
        """Push the lease's expiry to ``lease_s`` from now, taking it again, whatever the
        limit, if it was not held (it lapsed, or Redis lost it): ``False`` then."""
        ...

    async def release(self, group: str, tenant: str, lease_id: str) -> bool:
        """Give the slot back and wake waiters on every replica; ``False`` if it was not
        held."""
        ...

    async def counts(self, group: str, tenant: str) -> tuple[int, int]:
        """Live leases of the group and of the tenant (for the admin API and gauges)."""
        ...

    def watch(self, group: str) -> contextlib.AbstractAsyncContextManager[Signal]:
        """A :class:`~policies.state.notify.Signal` set when a slot of ``group`` is released
        anywhere; enter it before checking, then wait on it."""
        ...


def new_lease_id() -> str:
    """A random lease id (128 bits, hex)."""
    return os.urandom(16).hex()


# -- memory -----------------------------------------------------------------------------------


class MemoryLeases:
    """The leases of one process (expiry by ``clock``); nothing suspends.

    Args:
        clock: seconds, monotonic or wall (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._groups: dict[str, dict[str, float]] = {}
        self._tenants: dict[tuple[str, str], dict[str, float]] = {}
        #: group -> holder -> (limit, expiry)
        self._limits: dict[str, dict[str, tuple[int, float]]] = {}
        self.notifier = MemoryNotifier()

    def _lowest(self, group: str, holder: str, limit: int, lease_s: float) -> int:
        now = self._clock()
        if len(self._limits) > 1024:  # groups of runs come and go: keep the live ones
            self._limits = {g: hs for g, hs in self._limits.items()
                            if any(v[1] > now for v in hs.values())}
        limits = {h: v for h, v in self._limits.get(group, {}).items() if v[1] > now}
        limits[holder] = (limit, now + lease_s)
        self._limits[group] = limits
        return min(v[0] for v in limits.values())

    def _live(self, table: dict[str, float] | None, now: float) -> dict[str, float]:
        if table is None:
            return {}
        for lease_id in [i for i, expiry in table.items() if expiry <= now]:
            del table[lease_id]
        return table

    def _tables(self, group: str, tenant: str) -> tuple[dict[str, float], dict[str, float]]:
        now = self._clock()
        route = self._live(self._groups.get(group), now)
        mine = self._live(self._tenants.get((group, tenant)), now)
        return route, mine

    def _store(self, group: str, tenant: str, route: dict[str, float],
               mine: dict[str, float]) -> None:
        if route:
            self._groups[group] = route
        else:
            self._groups.pop(group, None)
        if mine:
            self._tenants[(group, tenant)] = mine
        else:
            self._tenants.pop((group, tenant), None)

    async def acquire(self, group: str, tenant: str, lease_id: str, limit: int,
                      per_tenant: int | None, lease_s: float,
                      holder: str | None = None,
                      uncounted: tuple[int, int] = (0, 0)) -> LeaseResult:
        if holder is not None:
            limit = self._lowest(group, holder, limit, lease_s)
        route, mine = self._tables(group, tenant)
        expiry = self._clock() + lease_s
        if lease_id in route:
            route[lease_id] = mine[lease_id] = expiry
            return LeaseResult(True, None, len(route), len(mine))
        try:
            if per_tenant is not None and len(mine) + uncounted[1] >= per_tenant:
                return LeaseResult(False, TENANT, len(route), len(mine))
            if len(route) + uncounted[0] >= limit:
                return LeaseResult(False, LIMIT, len(route), len(mine))
            route[lease_id] = mine[lease_id] = expiry
            return LeaseResult(True, None, len(route), len(mine))
        finally:
            self._store(group, tenant, route, mine)

    async def register(self, group: str, holder: str, limit: int, lease_s: float) -> int:
        return self._lowest(group, holder, limit, lease_s)

    async def renew(self, group: str, tenant: str, lease_id: str, lease_s: float) -> bool:
        route, mine = self._tables(group, tenant)
        held = lease_id in route
        route[lease_id] = mine[lease_id] = self._clock() + lease_s
        self._store(group, tenant, route, mine)
        return held

    async def release(self, group: str, tenant: str, lease_id: str) -> bool:
        route, mine = self._tables(group, tenant)
        held = route.pop(lease_id, None) is not None
        mine.pop(lease_id, None)
        self._store(group, tenant, route, mine)
        if held:
            self.notifier.publish(group)
        return held

    async def counts(self, group: str, tenant: str) -> tuple[int, int]:
        route, mine = self._tables(group, tenant)
        self._store(group, tenant, route, mine)
        return len(route), len(mine)

    def watch(self, group: str) -> contextlib.AbstractAsyncContextManager[Signal]:
        return self.notifier.watch(group)


# -- redis ------------------------------------------------------------------------------------

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local function hold(id, ms)
  redis.call('ZADD', KEYS[1], now + ms, id)
  redis.call('ZADD', KEYS[2], now + ms, id)
  for i = 1, 2 do
    if redis.call('PTTL', KEYS[i]) < ms then redis.call('PEXPIRE', KEYS[i], ms) end
  end
end
"""

# Records ``limit`` as ``holder``'s until ``now + ms`` in the group's holders' limits ``lim``
# (holder -> limit) and their expiries ``exp`` (holder -> ms), drops the lapsed ones, and
# returns the lowest limit left.
_LOWEST = """
local function lowest(lim, exp, holder, limit, ms)
  local gone = redis.call('ZRANGEBYSCORE', exp, '-inf', now)
  for i = 1, #gone do
    redis.call('ZREM', lim, gone[i])
    redis.call('ZREM', exp, gone[i])
  end
  redis.call('ZADD', lim, limit, holder)
  redis.call('ZADD', exp, now + ms, holder)
  for _, k in ipairs({lim, exp}) do
    if redis.call('PTTL', k) < ms then redis.call('PEXPIRE', k, ms) end
  end
  return tonumber(redis.call('ZRANGE', lim, 0, 0, 'WITHSCORES')[2])
end
"""

# KEYS: as acquire's first two (for _NOW), the holders' limits and expiries. ARGV: holder,
# limit, lease ms. Returns the group's lowest live limit.
_REGISTER = Script(_NOW + _LOWEST + """
return lowest(KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
""", "lease")

# KEYS: the group's leases, the tenant's, and with a holder its holders' limits and their
# expiries. ARGV: id, limit, per_tenant (-1: none), lease ms, holder ('' for none), the
# caller's calls holding no lease yet, the group's and the tenant's (counted against limit
# and per_tenant beside the leases).
# Returns {granted, refused (0 none, 1 limit, 2 tenant), inflight, tenant inflight}.
_ACQUIRE = Script(_NOW + _LOWEST + """
local id, ms, limit = ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[2])
if ARGV[5] ~= '' then limit = lowest(KEYS[3], KEYS[4], ARGV[5], limit, ms) end
local inflight, mine = redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2])
if redis.call('ZSCORE', KEYS[1], id) then
  hold(id, ms)
  return {1, 0, inflight, mine}
end
local per_tenant = tonumber(ARGV[3])
if per_tenant >= 0 and mine + tonumber(ARGV[7]) >= per_tenant then
  return {0, 2, inflight, mine}
end
if inflight + tonumber(ARGV[6]) >= limit then return {0, 1, inflight, mine} end
hold(id, ms)
return {1, 0, inflight + 1, mine + 1}
""", "lease")

# KEYS: as acquire. ARGV: id, lease ms. Returns 1 if it was held, 0 if it was taken again.
_RENEW = Script(_NOW + """
local held = redis.call('ZSCORE', KEYS[1], ARGV[1]) and 1 or 0
hold(ARGV[1], tonumber(ARGV[2]))
return held
""", "lease")

# KEYS: as acquire. ARGV: id, channel. Returns 1 if it was held.
_RELEASE = Script("""
local held = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if held == 1 then redis.call('PUBLISH', ARGV[2], 'released') end
return held
""", "lease")

_COUNTS = Script(_NOW + """
return {redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2])}
""", "lease")


class RedisLeases:
    """Leases in Redis sorted sets; one ``EVALSHA`` per call on the group's slot."""

    def __init__(self, state: RedisState) -> None:
        self._state = state

    def _keys(self, group: str, tenant: str) -> list[str]:
        return [self._state.key(group, "conc"), self._state.key(group, "conc", "t", tenant)]

    def channel(self, group: str) -> str:
        """The pub/sub channel a release of ``group`` publishes on."""
        return self._state.key(group, "conc", "wake")

    async def acquire(self, group: str, tenant: str, lease_id: str, limit: int,
                      per_tenant: int | None, lease_s: float,
                      holder: str | None = None,
                      uncounted: tuple[int, int] = (0, 0)) -> LeaseResult:
        keys = self._keys(group, tenant)
        if holder is not None:
            keys += self._holder_keys(group)
        reply = await self._state.eval(
            _ACQUIRE, keys,
            [lease_id, limit, -1 if per_tenant is None else per_tenant, _ms(lease_s),
             holder or "", *uncounted])
        granted, refused, inflight, mine = (int(x) for x in reply)
        return LeaseResult(bool(granted), (None, LIMIT, TENANT)[refused], inflight, mine)

    def _holder_keys(self, group: str) -> list[str]:
        return [self._state.key(group, "conc", "lim"), self._state.key(group, "conc", "lim", "exp")]

    async def register(self, group: str, holder: str, limit: int, lease_s: float) -> int:
        keys = [*self._keys(group, ""), *self._holder_keys(group)]
        return int(await self._state.eval(_REGISTER, keys, [holder, limit, _ms(lease_s)]))

    async def renew(self, group: str, tenant: str, lease_id: str, lease_s: float) -> bool:
        return bool(await self._state.eval(_RENEW, self._keys(group, tenant),
                                           [lease_id, _ms(lease_s)]))

    async def release(self, group: str, tenant: str, lease_id: str) -> bool:
        return bool(await self._state.eval(_RELEASE, self._keys(group, tenant),
                                           [lease_id, self.channel(group)]))

    async def counts(self, group: str, tenant: str) -> tuple[int, int]:
        inflight, mine = await self._state.eval(_COUNTS, self._keys(group, tenant), [])
        return int(inflight), int(mine)

    def watch(self, group: str) -> contextlib.AbstractAsyncContextManager[Signal]:
        return self._state.notifier.watch(self.channel(group))


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


# -- holding a lease --------------------------------------------------------------------------


class HeldLeases:
    """The leases one process holds on one state set (:class:`Lease` keeps itself here), for
    what must reach them all at once: Redis answering again after an outage
    (:meth:`~policies.state.StateBackends.renew_leases`).

    Attributes:
        live: every lease not yet released.
        unmoved: the memory leases taken while Redis did not answer and not yet moved there
            (a subset of ``live``, kept apart so that every acquire can ask whether there
            are any without looking through ``live``).
        lost: ``(group, tenant, lease id)`` of releases Redis did not answer (and of acquires
            whose answer was lost, which it may have run): released when it answers again.
            Not retried meanwhile: a frozen Redis runs what was queued in it when it thaws,
            however long after, and a release tried only until the lease would have lapsed
            left the slot of an acquire queued in a longer freeze taken for a whole lease.
    """

    def __init__(self) -> None:
        self.live: set[Lease] = set()
        self.unmoved: set[Lease] = set()
        self.lost: set[tuple[str, str, str]] = set()

    def unmoved_on(self, group: str, tenant: str) -> tuple[int, int]:
        """Calls of ``group`` here on memory leases not yet moved into Redis, and those of
        them that are ``tenant``'s."""
        route = mine = 0
        for lease in self.unmoved:
            if lease.group == group:
                route += 1
                mine += lease.tenant == tenant
        return route, mine


class Lease:
    """A granted lease kept alive in the background until :meth:`release`.

    Renewal runs every ``lease_s / 3``, so two renewals in a row may fail (the backend
    briefly unavailable) before the lease lapses. If a renewal finds the lease gone (it lapsed
    during a longer outage, or Redis restarted without its data), it takes it again, even
    past the limit: the call is still at the upstream, so it must count, and new calls wait
    until the count is under the limit again (as after a lowered limit). :attr:`retaken`
    counts those times.

    A lease taken from memory while Redis did not answer (``shared``) is *moved* into Redis
    by the first renewal that Redis answers: taken there (past the limit if need be, as a
    lapsed lease is) and given back in memory. Until then it is in ``held.unmoved``, which the
    limiter counts as calls Redis does not know of (:meth:`Leases.acquire`'s ``uncounted``).
    :meth:`refresh` runs that renewal out of turn, once Redis is seen up again.
    """

    def __init__(self, leases: Leases, group: str, tenant: str, lease_id: str,
                 lease_s: float, *, shared: Leases | None = None,
                 held: HeldLeases | None = None) -> None:
        self.leases = leases
        #: For a lease taken from memory while Redis did not answer: Redis's leases, which
        #: each renewal tries first (see the class docstring).
        self._shared = shared
        self.group = group
        self.tenant = tenant
        self.lease_id = lease_id
        self.lease_s = lease_s
        #: Times the lease was found gone and taken again while its call ran.
        self.retaken = 0
        self._held = held
        if held is not None:
            held.live.add(self)
            if shared is not None:
                held.unmoved.add(self)
        #: True while the renewal task waits for its next turn (and only then may
        #: :meth:`release` cancel it: cancelled during a backend call, it could not know
        #: whether the call took effect, e.g. a lease moved into Redis whose reply is lost).
        self._sleeping = False
        #: A move into Redis failed after it may have been applied (its answer lost): the
        #: lease may be held there as well as in memory, and is given back in both.
        self._maybe_moved = False
        #: The one renewal under way, in turn or out of it (never cancelled, for the same
        #: reason); :meth:`release` waits for it.
        self._renewing: asyncio.Task[None] | None = None
        self._renewal: asyncio.Task[None] | None = asyncio.create_task(
            self._renew(), name=f"sluice-lease-{group}")
        self._renewal.add_done_callback(self._renewal_ended)
        self._release: asyncio.Task[bool] | None = None

    def _renewal_ended(self, renewal: asyncio.Task[None]) -> None:
        # Said when it happens: the lease lapses from here on, with its call still running.
        if not renewal.cancelled() and renewal.exception() is not None:
            log.error("concurrency lease on %s: its renewal failed; the lease lapses",
                      self.group, exc_info=renewal.exception())

    async def _renew(self) -> None:
        # Ends by cancellation while sleeping, or after its call once released.
        while self._release is None:
            self._sleeping = True
            try:
                await asyncio.sleep(self.lease_s / 3)
            finally:
                self._sleeping = False
            if self._release is not None:
                return
            with contextlib.suppress(StateUnavailable):  # again next turn: it outlives two
                await self._renewal_task()

    def refresh(self) -> asyncio.Task[None] | None:
        """Renew now, out of turn (Redis answers again after an outage: it may have lost the
        lease, and a memory lease should count there at once); never raises, never awaits.
        Returns the renewal under way (a new one, or one already running), or ``None`` once
        released. Its failure is for the caller to ignore: the next turn tries again."""
        if self._release is not None:
            return None
        return self._renewal_task()

    def _renewal_task(self) -> asyncio.Task[None]:
        """The renewal under way, or a new one."""
        if self._renewing is None:
            self._renewing = asyncio.get_running_loop().create_task(
                self._renewed(), name=f"sluice-lease-renew-{self.group}")
            self._renewing.add_done_callback(_retrieve)
        return self._renewing

    async def _renewed(self) -> None:
        shared = self._shared
        try:
            if shared is None:
                held = await self.leases.renew(self.group, self.tenant, self.lease_id,
                                               self.lease_s)
            else:
                try:
                    await shared.renew(self.group, self.tenant, self.lease_id, self.lease_s)
                except StateUnavailable as exc:  # Redis still away: keep the memory lease
                    # A move whose answer was lost may have taken the lease in Redis too.
                    self._maybe_moved = self._maybe_moved or exc.maybe_applied
                    await self.leases.renew(self.group, self.tenant, self.lease_id,
                                            self.lease_s)
                    raise
        finally:
            self._renewing = None
        if shared is not None:
            # Counted in Redis from now on; the memory lease (which never suspends) goes.
            local, self.leases, self._shared = self.leases, shared, None
            if self._held is not None:
                self._held.unmoved.discard(self)
            await local.release(self.group, self.tenant, self.lease_id)
        elif not held and self._release is None:
            # Gone while the call runs (Redis restarted empty, or an outage outlasted
            # the lease): the call still occupies the upstream, so it counts again;
            # others wait until the count is back under the limit.
            self.retaken += 1
            log.warning("concurrency lease on %s lapsed while its call ran; taken again",
                        self.group, extra=PER_CALL)

    def release(self) -> asyncio.Task[bool]:
        """Stop renewing and give the slot back; never awaits, never raises (for a
        pipeline holding's ``release``). Returns the task doing it; calling again returns the
        same task. If the backend does not answer, the lease is given back once it does
        (:class:`HeldLeases`), or lapses by itself."""
        if self._release is None:
            self._release = asyncio.create_task(self._end(),
                                                name=f"sluice-lease-release-{self.group}")
        return self._release

    async def _end(self) -> bool:
        # One give-back, once no renewal can take the lease again or move it: the renewal
        # loop between turns is cancelled, and a renewal in a backend call (in turn or out
        # of it) is let finish, so the lease is given back where it is then.
        renewal, self._renewal = self._renewal, None
        if renewal is not None and not renewal.done():
            if self._sleeping:
                renewal.cancel()
            await asyncio.wait([renewal])
        if self._renewing is not None:
            await asyncio.wait([self._renewing])
        if self._held is not None:
            self._held.live.discard(self)
            self._held.unmoved.discard(self)
        return await self._give_back()

    async def aclose(self) -> bool:
        """:meth:`release` and wait for it; ``True`` if the slot was still held."""
        return await self.release()

    async def _give_back(self) -> bool:
        held = await give_back(self.leases, self.group, self.tenant, self.lease_id, self._held)
        if self._shared is not None and self._maybe_moved:
            await give_back(self._shared, self.group, self.tenant, self.lease_id, self._held)
        return held


async def give_back(leases: Leases, group: str, tenant: str, lease_id: str,
                    held: HeldLeases | None) -> bool:
    """Release ``lease_id``; if the backend does not answer, leave it in ``held.lost`` for
    when it answers again (or, with no ``held``, to lapse). Never raises
    :class:`StateUnavailable`.

    Returns:
        ``True`` if the lease was held when released; ``False`` if not, or not answered.
    """
    try:
        return await leases.release(group, tenant, lease_id)
    except StateUnavailable as exc:
        if held is None:
            log.info("concurrency lease on %s left to lapse: %s", group, exc.cause,
                     extra=PER_CALL)
        else:
            held.lost.add((group, tenant, lease_id))
            log.info("concurrency lease on %s given back once the state backend answers: %s",
                     group, exc.cause, extra=PER_CALL)
        return False


def _retrieve(task: asyncio.Task[None]) -> None:
    # Whoever awaits the renewal says how it failed (the renewal loop, the recovery's
    # StateBackends._renew_held); this only keeps asyncio from calling it never retrieved.
    if not task.cancelled():
        task.exception()


async def acquire_lease(leases: Leases, group: str, tenant: str, limit: int,
                        per_tenant: int | None, lease_s: float
                        ) -> tuple[LeaseResult, Lease | None]:
    """One attempt: the result, and the renewed :class:`Lease` when granted."""
    lease_id = new_lease_id()
    result = await leases.acquire(group, tenant, lease_id, limit, per_tenant, lease_s)
    if not result.granted:
        return result, None
    return result, Lease(leases, group, tenant, lease_id, lease_s)
