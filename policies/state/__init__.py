"""Shared state behind the policies: one small async interface per kind, memory or Redis.

Each kind has an interface (a ``Protocol``), a memory implementation (one process) and a Redis
implementation (every replica), which behave the same (tests/test_state_*.py run one test body
against both, and against a Redis Cluster):

============================  ==============================  =================================
kind                          interface                       module
============================  ==============================  =================================
rate buckets (GCRA)           :class:`RateBuckets`            :mod:`policies.state.rate`
budget ledger                 :class:`Ledger`                 :mod:`policies.state.ledger`
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

from dataclasses import dataclass

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
from policies.state.leases import Leases, MemoryLeases, RedisLeases
from policies.state.ledger import Ledger, MemoryLedger, RedisLedger
from policies.state.rate import MemoryRateBuckets, RateBuckets, RedisRateBuckets

__all__ = [
    "BreakerStates",
    "DeadLetterStore",
    "Health",
    "IdempotencyRecords",
    "Leases",
    "Ledger",
    "RateBuckets",
    "RedisState",
    "StateBackends",
    "StateUnavailable",
    "memory_backends",
    "redact_url",
    "redis_backends",
]


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
    redis: RedisState | None = None

    async def close(self) -> None:
        """Close the Redis connection (nothing to do for memory)."""
        if self.redis is not None:
            await self.redis.close()


def memory_backends() -> StateBackends:
    """The state of one process (the embedded default)."""
    health = Health()
    health.up = True  # memory cannot be unavailable
    return StateBackends(
        health=health,
        rates=MemoryRateBuckets(),
        ledger=MemoryLedger(),
        leases=MemoryLeases(),
        idempotency=MemoryIdempotencyRecords(),
        breakers=MemoryBreakerStates(),
        dead_letters=MemoryDeadLetterStore(),
    )


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
    return StateBackends(
        health=state.health,
        redis=state,
        rates=RedisRateBuckets(state),
        ledger=RedisLedger(state),
        leases=RedisLeases(state),
        idempotency=RedisIdempotencyRecords(state),
        breakers=RedisBreakerStates(state),
        dead_letters=RedisDeadLetterStore(state),
    )
