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
:data:`CHECK_INTERVAL_S` while it is up, in a task of its own that its probe starts and never
waits for (one read at a time, bounded by :data:`READ_TIMEOUT_S` or ``state.timeout``): nothing
on a request's path, and nothing on the probe's.

What was read is :attr:`EvictionWatch.last`, one :class:`NodeEviction` per server (a
cluster's primaries): ``sluice_state_evicting_policy{node,policy}`` and the counter
``sluice_state_redis_evicted_keys_total{node}``. Per server, not summed: a server's count
drops to 0 when it restarts, a replica takes its place (failover) or ``CONFIG RESETSTAT``
runs, and a sum with one term dropped reads as a counter reset whose remaining sum is all new
evictions (500 -> 480: 480 keys, and the critical alert, for none evicted). ``None`` while
unknown: before the first read, while the backend is marked down, and after a read that
failed (refused by an ACL, timed out). A failed read changes nothing else: the backend's
health is the probe's to say, and the replica stays ready (the calls work; the limits are what
is at risk). The log says so when a read first finds an evicting policy, and again when a
later read finds another evicting policy or none that evicts, never per read.
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
class NodeEviction:
    """What one server's ``INFO`` said of eviction.

    Attributes:
        node: the server's address as Sluice reaches it, ``host:port`` (a Unix socket's
            path).
        policy: its ``maxmemory_policy``.
        evicting: keys can be evicted: a policy other than ``noeviction`` with a
            ``maxmemory`` set (``maxmemory 0`` never evicts, whatever the policy).
        evicted_keys: keys it evicted since it started (or ``CONFIG RESETSTAT``): every
            program's keys, not only Sluice's.
    """

    node: str
    policy: str
    evicting: bool
    evicted_keys: int


@dataclass(frozen=True)
class Eviction:
    """What the servers holding the state said of eviction: one :class:`NodeEviction` per
    server (a cluster's primaries), sorted by ``node``."""

    nodes: tuple[NodeEviction, ...]

    @property
    def policy(self) -> str:
        """The servers' ``maxmemory_policy``, sorted and joined by ``,`` when they differ."""
        return ",".join(sorted({node.policy for node in self.nodes}))

    @property
    def evicting(self) -> bool:
        """Some server can evict keys."""
        return any(node.evicting for node in self.nodes)

    @property
    def evicted_keys(self) -> int:
        """Keys the servers evicted, summed: for the log only (a sum is no counter)."""
        return sum(node.evicted_keys for node in self.nodes)


def node_eviction(node: str, memory: dict[str, Any], stats: dict[str, Any]) -> NodeEviction:
    """The :class:`NodeEviction` of server ``node``'s ``INFO memory`` and ``INFO stats``.

    Raises:
        KeyError, ValueError, TypeError: a reply lacks a field or holds a non-number (a
            Redis-compatible server that does not say).
    """
    policy = str(memory["maxmemory_policy"])
    return NodeEviction(node, policy, policy != NO_EVICTION and int(memory["maxmemory"]) > 0,
                        int(stats["evicted_keys"]))


def eviction_of(nodes: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> Eviction:
    """The :class:`Eviction` of servers' ``(INFO memory, INFO stats)`` replies, by address.

    Raises:
        :func:`node_eviction`'s errors.
    """
    return Eviction(tuple(node_eviction(node, memory, stats)
                          for node, (memory, stats) in sorted(nodes.items())))


def address_of(client: Redis) -> str:
    """A single server client's address: ``host:port``, or its Unix socket's path."""
    options = client.connection_pool.connection_kwargs
    if "path" in options:
        return str(options["path"])
    return f"{options.get('host', 'localhost')}:{options.get('port', 6379)}"


async def read_eviction(client: Redis | RedisCluster) -> Eviction:
    """Two ``INFO`` calls (``memory`` and ``stats``; one section each, which every Redis
    takes) on the server, or on each primary of a cluster.

    Raises:
        whatever the calls raise (:class:`redis.exceptions.RedisError`, ``TimeoutError``),
        or :func:`eviction_of`'s errors.
    """
    if isinstance(client, RedisCluster):
        primaries = client.get_primaries()
        memory = await client.info("memory", target_nodes=primaries)
        stats = await client.info("stats", target_nodes=primaries)
        if len(primaries) == 1:  # one node's reply comes as it is, not by node
            return eviction_of({primaries[0].name: (memory, stats)})
        return eviction_of({node.name: (memory[node.name], stats[node.name])
                            for node in primaries})
    return eviction_of({address_of(client): (await client.info("memory"),
                                             await client.info("stats"))})


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
                "evicted so far, sluice_state_redis_evicted_keys_total). Set maxmemory-policy %s "
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
                    "sluice_state_redis_evicted_keys_total are absent until it can (allow INFO "
                    "to Sluice's Redis user)", type(exc).__name__, exc)
