"""Whether the Redis holding the shared state evicts keys: its ``INFO``, read in the background.

Under an evicting ``maxmemory-policy`` (``allkeys-*``, ``volatile-*``) a Redis at its
``maxmemory`` deletes keys to make room, Sluice's among them: concurrency leases, idempotency
in-flight markers, budget counters, rate buckets. It keeps answering, so nothing fails and
``sluice_state_backend_up`` stays 1 while the limits stop holding (a hostile trial: a route of
``limit: 4`` across 2 replicas ran 14 calls at once 64-87% of the time, 4 to 10 of 10
duplicate idempotent pairs ran twice, a 3,000-token daily budget spent 18,228, and nothing was
logged). :class:`EvictionWatch` makes it visible: it reads ``maxmemory_policy`` and
``maxmemory`` (``INFO memory``) and ``evicted_keys`` (``INFO stats``): ``INFO`` answers where
managed services disable ``CONFIG GET``. :class:`~policies.state.connection.RedisState` reads
them when the backend connects or answers again after an outage, and every
:data:`CHECK_INTERVAL_S` while it is up, from its probe's task: nothing on a request's path.

What was read is :attr:`EvictionWatch.last` (``sluice_state_evicting_policy`` and
``sluice_state_redis_evicted_keys``), ``None`` while unknown: before the first read, while
the backend is marked down, and after a read that failed (refused by an ACL, timed out). A
failed read changes nothing else: the backend's health is the probe's to say, and the replica
stays ready (the calls work; the limits are what is at risk). The log says it once at the first
read and at each change of policy, never per read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("sluice.state")

#: How often the server's eviction policy and count are read while the backend is up, seconds.
CHECK_INTERVAL_S = 10.0
#: The least bound on one read (two ``INFO`` calls), seconds: off the request path, so wider
#: than a tight ``state.timeout``, whose misses would blank the gauges until the next read.
READ_TIMEOUT_S = 1.0
#: The one ``maxmemory-policy`` that never evicts: a full Redis refuses writes instead, which
#: Sluice sees as an outage (``state.on_unavailable``).
NO_EVICTION = "noeviction"


@dataclass(frozen=True)
class Eviction:
    """What the server's ``INFO`` said of eviction.

    Attributes:
        policy: ``maxmemory_policy`` (a cluster's primaries' policies, sorted and joined by
            ``,`` when they differ).
        evicting: keys can be evicted: a policy other than ``noeviction`` with a
            ``maxmemory`` set (on any primary of a cluster).
        evicted_keys: keys evicted since the server started (or ``CONFIG RESETSTAT``), the
            sum over a cluster's primaries: every program's keys, not only Sluice's.
    """

    policy: str
    evicting: bool
    evicted_keys: int


def eviction_of(nodes: list[tuple[dict[str, Any], dict[str, Any]]]) -> Eviction:
    """The :class:`Eviction` of servers' ``(INFO memory, INFO stats)`` replies (one pair per
    server: a cluster's primaries).

    Raises:
        KeyError, ValueError, TypeError: a reply lacks a field or holds a non-number (a
            Redis-compatible server that does not say).
    """
    policies = sorted({str(memory["maxmemory_policy"]) for memory, _ in nodes})
    evicting = any(str(memory["maxmemory_policy"]) != NO_EVICTION
                   and int(memory["maxmemory"]) > 0 for memory, _ in nodes)
    evicted = sum(int(stats["evicted_keys"]) for _, stats in nodes)
    return Eviction(",".join(policies), evicting, evicted)


async def read_eviction(client: Redis | RedisCluster) -> Eviction:
    """Two ``INFO`` calls (``memory`` and ``stats``; one section each, which every Redis
    takes) on the server, or on each primary of a cluster.

    Raises:
        whatever the calls raise (:class:`redis.exceptions.RedisError`, ``TimeoutError``),
        or :func:`eviction_of`'s errors.
    """
    if isinstance(client, RedisCluster):
        primaries = RedisCluster.PRIMARIES
        memory = await client.info("memory", target_nodes=primaries)
        stats = await client.info("stats", target_nodes=primaries)
        if "maxmemory_policy" in memory:  # one primary: its reply comes as it is
            return eviction_of([(memory, stats)])
        return eviction_of([(memory[node], stats[node]) for node in memory])
    return eviction_of([(await client.info("memory"), await client.info("stats"))])


class EvictionWatch:
    """The last :class:`Eviction` read, and the log lines it calls for.

    Attributes:
        last: the last read, ``None`` while unknown (see the module's docstring).
        checked_at: ``time.monotonic()`` of the last read tried (``None``: read at the next
            chance, as after the backend connects).
    """

    def __init__(self) -> None:
        self.last: Eviction | None = None
        self.checked_at: float | None = None
        #: The policy and whether it evicts, as last logged (a failed read keeps it, so
        #: the same policy read again after an outage is not logged again).
        self._told: tuple[str, bool] | None = None
        #: A read failed for a reason other than the server not answering, and was logged;
        #: logged again only after a read that worked.
        self._told_failure = False

    def due(self, now: float, interval_s: float = CHECK_INTERVAL_S) -> bool:
        """A read is to be made at ``now`` (monotonic seconds)."""
        return self.checked_at is None or now - self.checked_at >= interval_s

    def unknown(self) -> None:
        """The backend is marked down: nothing is known until it answers, and then it is
        read again at once."""
        self.last = None
        self.checked_at = None

    def read(self, found: Eviction, now: float) -> None:
        """Record ``found``, read at ``now``; log the policy at the first read and when it
        changes."""
        self.last = found
        self.checked_at = now
        self._told_failure = False
        told = (found.policy, found.evicting)
        if told == self._told:
            return
        before, self._told = self._told, told
        if found.evicting:
            log.warning(
                "state backend: Redis's maxmemory-policy is %s: at its maxmemory it evicts "
                "keys, Sluice's too (concurrency leases, idempotency in-flight markers, "
                "budget counters, rate buckets), while it answers and sluice_state_backend_up "
                "stays 1: shared limits, dedup and budgets then stop holding, unseen (%d keys "
                "evicted so far, sluice_state_redis_evicted_keys). Set maxmemory-policy %s "
                "(README, Shared state)", found.policy, found.evicted_keys, NO_EVICTION)
        elif before is not None and before[1]:
            log.warning("state backend: Redis's maxmemory-policy is %s now: it no longer "
                        "evicts keys", found.policy)

    def failed(self, exc: BaseException, now: float) -> None:
        """A read at ``now`` failed with ``exc``: unknown until one works. Logged once (until
        a read works again) when the server answered and refused (an ACL without ``INFO``,
        a server without those fields); a server not answering is the probe's to say."""
        self.last = None
        self.checked_at = now
        if self._told_failure or isinstance(exc, (RedisConnectionError, RedisTimeoutError,
                                                  TimeoutError, OSError)):
            return
        self._told_failure = True
        log.warning("state backend: cannot read Redis's maxmemory-policy and evicted_keys "
                    "(INFO memory, INFO stats): %s: %s; sluice_state_evicting_policy and "
                    "sluice_state_redis_evicted_keys are absent until it can (allow INFO "
                    "to Sluice's Redis user)", type(exc).__name__, exc)
