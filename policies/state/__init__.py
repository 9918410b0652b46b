"""Shared state behind the policies: one small async interface per kind, memory or Redis.

Each kind has an interface (a ``Protocol``), a memory implementation (one process) and a Redis
implementation (every replica), which behave the same (tests/test_state_*.py run one test body
against both, and against a Redis Cluster):

============================  ==============================  =================================
kind                          interface                       module
============================  ==============================  =================================
rate buckets (GCRA)           :class:`RateBuckets`            :mod:`policies.state.rate`
budget ledger                 :class:`Ledger`                 :mod:`policies.state.ledger`
rates and budget together     :class:`Admissions`             :mod:`policies.state.admission`
concurrency leases            :class:`Leases`                 :mod:`policies.state.leases`
idempotency records/markers   :class:`IdempotencyRecords`     :mod:`policies.state.idempotency`
circuit breakers              :class:`BreakerStates`          :mod:`policies.state.breaker`
dead letters                  :class:`DeadLetterStore`        :mod:`policies.state.deadletters`
============================  ==============================  =================================

The methods take plain values (strings, numbers, bytes), never config objects; a *group*
names what shares one Redis hash slot (a route's name, usually), so that every call is one
script on one slot. Every Redis call on the request path is one round trip and raises
:class:`StateUnavailable` when Redis cannot answer within the timeout; the caller applies
``state.on_unavailable``. Build a set with :func:`memory_backends` or :func:`redis_backends`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from policies.config import StateConfig
from policies.state.admission import Admissions, MemoryAdmissions, RedisAdmissions
from policies.state.breaker import BreakerStates, MemoryBreakerStates, RedisBreakerStates
from policies.state.connection import Health, RedisState, redact_url
from policies.state.deadletters import (
    DeadLetterStore,
    MemoryDeadLetterStore,
    RedisDeadLetterStore,
)
from policies.state.errors import StateUnavailable
from policies.state.idempotency import (
    IdempotencyRecords,
    MemoryIdempotencyRecords,
    RedisIdempotencyRecords,
)
from policies.state.leases import HeldLeases, Leases, MemoryLeases, RedisLeases, give_back
from policies.state.ledger import MAX_COUNTERS, Ledger, LedgerFull, MemoryLedger, RedisLedger
from policies.state.rate import (
    MAX_BUCKETS,
    MemoryRateBuckets,
    RateBuckets,
    RateBucketsFull,
    RedisRateBuckets,
)

__all__ = [
    "Admissions",
    "BreakerStates",
    "DeadLetterStore",
    "Fallback",
    "Health",
    "IdempotencyRecords",
    "Leases",
    "Ledger",
    "LedgerFull",
    "RateBuckets",
    "RateBucketsFull",
    "RedisState",
    "StateBackends",
    "StateUnavailable",
    "backends_for",
    "memory_backends",
    "redact_url",
    "redis_backends",
]

log = logging.getLogger("sluice.state")

#: Longest shutdown waits for writes policies started in the background, seconds.
CLOSE_GRACE_S = 2.0
#: Lease renewals in flight at once when Redis answers again after an outage
#: (:meth:`StateBackends.renew_leases`): a few, so the pool's other calls are not starved.
RENEW_BATCH = 8
#: ``state.lease``'s default, seconds (:attr:`StateBackends.lease_s` until configured).
DEFAULT_LEASE_S = 5.0


@dataclass(slots=True)
class StateBackends:
    """One implementation of every kind of state, and the health of what holds them.

    Attributes:
        health: the backend's health (always up for memory); ``sluice_state_backend_up``.
        redis: the Redis connection, or ``None`` for the memory backend.
    """

    health: Health
    rates: RateBuckets
    ledger: Ledger
    leases: Leases
    idempotency: IdempotencyRecords
    breakers: BreakerStates
    dead_letters: DeadLetterStore
    #: ``rates`` and ``ledger`` taken together in one call (one round trip).
    admissions: Admissions
    redis: RedisState | None = None
    #: What policies do while this set is unavailable (never, for memory).
    fallback: Fallback = field(default_factory=lambda: Fallback("local", 1))
    #: Seconds a concurrency lease outlives a replica that stopped renewing it
    #: (``state.lease``).
    lease_s: float = DEFAULT_LEASE_S
    #: Writes policies started and nothing awaits (settles, refunds, reconciliation, keys
    #: and leases given back, dead letters): :meth:`close` lets them end first.
    background: set[asyncio.Future[Any]] = field(default_factory=set)
    #: The concurrency leases this process holds on this set: renewed (a memory lease
    #: moved into Redis) as soon as Redis answers again after an outage.
    held_leases: HeldLeases = field(default_factory=HeldLeases)
    #: The renewal of every held lease started when Redis was last seen up again, and
    #: whether Redis came back again while it ran.
    _renewing: asyncio.Task[None] | None = None
    _renew_again: bool = False
    #: What :meth:`seen_back` calls wait on: resolved when Redis is seen back, or at their
    #: timeout.
    _pauses: set[asyncio.Future[bool]] = field(default_factory=set)
    #: The writes a recovery woke go through this, :data:`RENEW_BATCH` at a time (:meth:`paced`).
    _recovery_writes: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(RENEW_BATCH))

    @property
    def kind(self) -> str:
        """``memory`` or ``redis``."""
        return "memory" if self.redis is None else "redis"

    async def start(self) -> None:
        """Connect (Redis only; never raises for an unreachable server: see
        :func:`redis_backends`)."""
        if self.redis is not None:
            await self.redis.start()

    @property
    def settle_s(self) -> float:
        """Seconds a replica that saw an outage keeps to its share of a concurrency limit
        once Redis is up again: time for every other replica cut off by the same outage to
        see Redis back (its probe, every ``probe_interval_s``) and start moving its own such
        calls into Redis (a round trip, at most the timeout, per :data:`RENEW_BATCH` of
        them); twice the probe interval plus the timeout. 0 for memory."""
        if self.redis is None:
            return 0.0
        return 2 * self.redis.probe_interval_s + self.redis.timeout_s

    def wake(self, up: bool = True, _error: str | None = None) -> None:
        """A :meth:`Health.on_change` and :meth:`Health.on_reconnect` listener: once Redis is
        up again, or answers on a new connection after a broken one, wake every
        :meth:`seen_back` waiting. Not while Redis is still marked down (the probe's own
        connection reconnects before the probe's answer marks it up: woken then, the writes
        failed at once and waited a whole period more). One restart is heard once per pooled
        connection that reconnects, each waking the writes paused since: a few more
        renewals, paced."""
        if up and self.health.up:
            for pause in self._pauses:
                _end_pause(pause, True)

    async def seen_back(self, timeout_s: float) -> bool:
        """Wait ``timeout_s`` seconds, or until Redis is seen back (up again, or answering
        on a new connection after a broken one) if that comes first, and say whether it
        was that: the pause of a write retried on a schedule, so that it is made when Redis
        can take it, not up to a whole period later; such a write goes through
        :meth:`paced`. Costs what ``asyncio.sleep`` does (a future and a timer): every keyed
        call on Redis renews its marker in such a loop."""
        loop = asyncio.get_running_loop()
        pause: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(timeout_s, _end_pause, pause, False)
        self._pauses.add(pause)
        try:
            return await pause
        finally:
            timer.cancel()
            self._pauses.discard(pause)

    def paced(self, woken: bool) -> contextlib.AbstractAsyncContextManager[object]:
        """Where a write retried on a schedule runs: when a recovery woke it (``woken``,
        from :meth:`seen_back`), :data:`RENEW_BATCH` at a time with the others it woke; else
        at once. Woken all at once, a replica's running keyed calls renewed their markers
        together on the pool's connections, past ``state.timeout``, and marked Redis down
        again, each recovery waking them all once more (a hostile review: 150 calls, the
        health down in 49 of 60 looks over 3 s, a keyed call run twice meanwhile)."""
        return self._recovery_writes if woken else contextlib.nullcontext()

    def renew_leases(self, up: bool = True, _error: str | None = None) -> None:
        """A :meth:`Health.on_change` and :meth:`Health.on_reconnect` listener: once Redis is
        up again, or answers on a new connection after a broken one, give back the leases
        whose release it did not answer and renew every lease held here now rather than at
        its next renewal (up to a third of ``state.lease`` later, while other replicas admit
        as if its call were not running): a lease Redis lost (restarted empty, or an outage
        longer than the lease) is taken again, and one taken from memory during the outage
        is moved into Redis. See :meth:`_renew_held`."""
        held = self.held_leases
        if not up or not (held.live or held.lost):
            return
        if self._renewing is not None and not self._renewing.done():
            self._renew_again = True  # leases taken since its list was made: once more
            return
        self._renewing = asyncio.get_running_loop().create_task(
            self._renew_held(), name="sluice-leases-renewed-on-recovery")
        self.keep(self._renewing)

    async def _renew_held(self) -> None:
        """The lost releases, then the held leases (memory ones first), :data:`RENEW_BATCH`
        at a time, while the backend stays up; again if Redis came back meanwhile. All at
        once, thousands of renewals queued for the pool's connections past the timeout,
        failed, and marked Redis down again, each recovery starting another round (a hostile
        review: 2,000 calls held, the health flapping 40 times in 8 s, with calls admitted
        from memory meanwhile)."""
        held = self.held_leases
        while True:
            self._renew_again = False
            steps: list[Callable[[], Awaitable[object] | None]] = [
                functools.partial(self._release_lost, ids) for ids in list(held.lost)]
            steps += [lease.refresh for lease in held.unmoved]
            steps += [lease.refresh for lease in held.live if lease not in held.unmoved]
            for start in range(0, len(steps), RENEW_BATCH):
                if not self.health.up:
                    return  # down again: the next recovery starts over
                batch = [step() for step in steps[start:start + RENEW_BATCH]]
                running = [asyncio.ensure_future(a) for a in batch if a is not None]
                if running:
                    await asyncio.wait(running)
                for task in running:
                    exc = None if task.cancelled() else task.exception()
                    if exc is not None and not isinstance(exc, StateUnavailable):
                        log.error("a concurrency lease's renewal failed", exc_info=exc)
            if not self._renew_again:
                return

    async def _release_lost(self, ids: tuple[str, str, str]) -> None:
        # Out of the set while it is tried; give_back puts it back if Redis does not answer.
        self.held_leases.lost.discard(ids)
        await give_back(self.leases, *ids, self.held_leases)

    def keep(self, task: asyncio.Future[Any]) -> None:
        """Let :meth:`close` wait for ``task``, a write started in the background."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Let the background writes end, then close the Redis connection (nothing to do for
        memory).

        A settle started by a call answered just before shutdown would otherwise be cut with
        the connection, leaving the call's worst case held until the ledger reaps it and its
        spend uncharged. The wait is bounded by ``grace_s`` seconds (each write is bounded by
        ``state.timeout``), and skipped while the backend is down: its writes then fail at once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.health.up and (pending := [t for t in self.background if not t.done()]):
            left = deadline - loop.time()
            if left <= 0:
                log.warning("%d state write(s) still running after %gs at shutdown: cut",
                            len(pending), grace_s)
                break
            await asyncio.wait(pending, timeout=left)
        if self.redis is not None:
            await self.redis.close()


@dataclass(slots=True)
class Fallback:
    """What a policy does when the shared state does not answer (``state.on_unavailable``).

    Attributes:
        mode: ``local``: decide from this replica's own memory state with ``share()`` of each
            limit; ``reject``: refuse the call 503 ``state_unavailable``.
        replicas: how many replicas share each limit (``state.replicas``).
        local: the memory state used in ``local`` mode (built lazily, kept across outages so
            a second outage continues where the first left off).
        max_budget_counters: the cap of ``local``'s budget ledger
            (``state.max_budget_counters``).
        max_rate_buckets: the cap of ``local``'s rate buckets (``state.max_rate_buckets``).
    """

    mode: Literal["local", "reject"]
    replicas: int
    local: StateBackends | None = None
    max_budget_counters: int = MAX_COUNTERS
    max_rate_buckets: int = MAX_BUCKETS

    def share(self, limit: float) -> float:
        """This replica's share of ``limit`` while degraded: ``limit / replicas``."""
        return limit / self.replicas

    def whole_share(self, limit: int) -> int:
        """This replica's share of an integer limit (slots, requests), at least 1: a share
        of 0 would refuse everything, which ``reject`` mode is for."""
        return max(1, limit // self.replicas)

    def memory(self) -> StateBackends:
        """The memory state of ``local`` mode."""
        if self.local is None:
            self.local = memory_backends(self.max_budget_counters, self.max_rate_buckets)
        return self.local


def _end_pause(pause: asyncio.Future[bool], woken: bool) -> None:
    if not pause.done():
        pause.set_result(woken)


def memory_backends(max_budget_counters: int = MAX_COUNTERS,
                    max_rate_buckets: int = MAX_BUCKETS) -> StateBackends:
    """The state of one process (the embedded default), with at most
    ``max_budget_counters`` budget counters (:class:`~policies.state.ledger.MemoryLedger`)
    and ``max_rate_buckets`` rate buckets (:class:`~policies.state.rate.MemoryRateBuckets`)."""
    health = Health()
    health.up = True  # memory cannot be unavailable
    rates = MemoryRateBuckets(max_buckets=max_rate_buckets)
    ledger = MemoryLedger(max_counters=max_budget_counters)
    return StateBackends(
        health=health,
        rates=rates,
        ledger=ledger,
        leases=MemoryLeases(),
        idempotency=MemoryIdempotencyRecords(),
        breakers=MemoryBreakerStates(),
        dead_letters=MemoryDeadLetterStore(),
        admissions=MemoryAdmissions(rates, ledger),
    )


def backends_for(config: StateConfig) -> StateBackends:
    """The state ``config`` (the ``state`` block) asks for, not yet connected: call
    :meth:`StateBackends.start` inside the running loop.

    Raises:
        ValueError: ``redis_url`` is ``env:NAME`` and that variable is unset or not a URL.
    """
    if config.backend == "memory":
        backends = memory_backends(config.max_budget_counters, config.max_rate_buckets)
    else:
        backends = _redis_set(RedisState(config.resolved_url(), config.key_prefix,
                                         config.timeout))
    backends.fallback = Fallback(config.on_unavailable, config.replicas,
                                 max_budget_counters=config.max_budget_counters,
                                 max_rate_buckets=config.max_rate_buckets)
    backends.lease_s = config.lease
    return backends


def _redis_set(state: RedisState) -> StateBackends:
    rates, ledger = RedisRateBuckets(state), RedisLedger(state)
    backends = StateBackends(
        health=state.health,
        redis=state,
        rates=rates,
        ledger=ledger,
        leases=RedisLeases(state),
        idempotency=RedisIdempotencyRecords(state),
        breakers=RedisBreakerStates(state),
        dead_letters=RedisDeadLetterStore(state),
        admissions=RedisAdmissions(state, rates, ledger),
    )
    state.health.on_change(backends.renew_leases)
    state.health.on_reconnect(backends.renew_leases)
    state.health.on_change(backends.wake)
    state.health.on_reconnect(backends.wake)
    return backends


async def redis_backends(url: str, prefix: str, timeout_s: float, *,
                         probe_interval_s: float | None = None,
                         max_connections: int | None = None) -> StateBackends:
    """Every kind of state in the Redis (or Redis Cluster) that ``url`` names.

    Args:
        url: ``redis://`` or ``rediss://`` URL of a server or of any node of a cluster (which
            one is found out here: ``INFO cluster``).
        prefix: the start of every key (``state.key_prefix``).
        timeout_s: bound on every call, seconds (``state.timeout``).
        probe_interval_s, max_connections: see :class:`RedisState`.

    Never raises for an unreachable Redis: the set starts marked down and recovers by
    itself (see :class:`RedisState`); calls meanwhile raise :class:`StateUnavailable`.
    Call :meth:`StateBackends.close` at shutdown.
    """
    options: dict[str, float | int] = {}
    if probe_interval_s is not None:
        options["probe_interval_s"] = probe_interval_s
    if max_connections is not None:
        options["max_connections"] = max_connections
    state = RedisState(url, prefix, timeout_s, **options)  # type: ignore[arg-type]
    await state.start()
    return _redis_set(state)
