"""A shared concurrency limit when Redis comes back after an outage (``on_unavailable: local``).

During the outage each replica admits its share of the limit on memory leases. Redis does
not know those calls, so until they are counted there a replica asking Redis for a slot would
be granted one beside them: the route ran 6 and 7 calls on a limit of 4 in the first half
second after a thaw (a hostile trial, two replicas). Here: a replica's own memory calls count
in its first acquire after the thaw; every replica moves its memory leases into Redis (and
takes again the leases Redis lost) as soon as it sees Redis up, not at their renewal, a third
of ``lease`` later; and a replica that
admitted from its share keeps to it for ``settle_s`` after Redis answers, while the others'
moves land. Two replicas' state on a Redis of the test's own, stopped and started again.
"""

from __future__ import annotations

import asyncio

import pytest

from policies.reasons import Rejected
from policies.shared_concurrency import SharedConcurrencyLimiter
from policies.state import Fallback, StateBackends, StateUnavailable, redis_backends
from tests.redis_servers import RedisServer, new_prefix
from tests.test_shared_concurrency import DONE, eventually, leases_held, limiter

#: Long enough that no renewal (every third of it) runs during a test: what moves a memory
#: lease into Redis here is the recovery, not the renewal.
LEASE_S = 30.0


async def replica_state(server: RedisServer, prefix: str) -> StateBackends:
    state = await redis_backends(server.url, prefix, 0.2, probe_interval_s=0.05)
    state.fallback = Fallback("local", 2)
    state.lease_s = LEASE_S
    return state


async def memory_leases_held(state: StateBackends) -> int:
    assert state.fallback.local is not None
    return (await state.fallback.local.leases.counts("r", "t"))[0]


async def grab(lim: SharedConcurrencyLimiter):
    """A slot if one is free now (never queues), else ``None``."""
    try:
        return await lim.acquire("t", caller_timeout=0.0)
    except Rejected:
        return None


async def test_calls_admitted_from_memory_keep_the_limit_after_redis_is_back(redis_server):
    """``limit: 4`` on two replicas; Redis stopped, each admits its share (2) from memory;
    Redis back: both replicas asking for more, again and again from the first moment, never
    put more than 4 calls in flight, the memory calls are counted in Redis long before their
    renewal, and once they end the whole limit is there again."""
    prefix = new_prefix()
    a_state = await replica_state(redis_server, prefix)
    b_state = await replica_state(redis_server, prefix)
    try:
        a, b = limiter(a_state, 4), limiter(b_state, 4)
        redis_server.stop()
        held = [await lim.acquire("t") for lim in (a, a, b, b)]
        assert a.degraded and b.degraded
        redis_server.start()  # the same port, empty: nothing held there
        extra = []
        for _ in range(30):
            for lim in (a, b):
                if (slot := await grab(lim)) is not None:
                    extra.append(slot)
            assert len(held) + len(extra) <= 4, f"{len(held) + len(extra)} calls on a limit of 4"
            await asyncio.sleep(0.02)
        assert not a.degraded and not b.degraded  # they did ask Redis
        await eventually(lambda: leases_held(a_state), 4, 5.0, "memory calls counted in Redis")
        assert not a_state.held_leases.unmoved and not b_state.held_leases.unmoved
        assert (await memory_leases_held(a_state), await memory_leases_held(b_state)) == (0, 0)
        for slot in held + extra:
            slot.release(DONE)
        await eventually(lambda: leases_held(a_state), 0, 5.0, "leases given back")
        again = [await a.acquire("t") for _ in range(4)]
        assert await grab(b) is None
        for slot in again:
            slot.release(DONE)
        await eventually(lambda: leases_held(a_state), 0, 5.0, "leases given back")
    finally:
        await a_state.close()
        await b_state.close()


async def test_a_replica_counts_its_memory_calls_in_redis_once_its_probe_sees_it_up(
        redis_server):
    """No call of its own asks Redis after the outage: the health probe seeing Redis up is
    enough to move the replica's memory leases there (their renewal is 10 s away)."""
    state = await replica_state(redis_server, new_prefix())
    try:
        lim = limiter(state, 4)
        redis_server.stop()
        held = [await lim.acquire("t"), await lim.acquire("t")]
        assert lim.degraded and await memory_leases_held(state) == 2
        redis_server.start()
        await eventually(lambda: _value(state.health.up), True, 5.0, "Redis seen up")
        await eventually(lambda: leases_held(state), 2, 5.0, "memory calls counted in Redis")
        assert await memory_leases_held(state) == 0 and not state.held_leases.unmoved
        assert all(slot.lease.leases is state.leases for slot in held)
        for slot in held:
            slot.release(DONE)
        await eventually(lambda: leases_held(state), 0, 5.0, "leases given back")
    finally:
        await state.close()


async def test_leases_a_restarted_redis_lost_are_taken_again_once_it_is_seen_up(redis_server):
    """Redis restarts empty under two running calls: once a call has found it gone and the
    probe sees it back, both leases are taken again (their renewal is 10 s away), so
    the route's count is right before new calls ask."""
    state = await replica_state(redis_server, new_prefix())
    try:
        lim = limiter(state, 4)
        held = [await lim.acquire("t"), await lim.acquire("t")]
        redis_server.stop()
        with pytest.raises(StateUnavailable):  # a call finds it gone: marked down
            await leases_held(state)
        redis_server.start()  # empty
        await eventually(lambda: _value(state.health.up), True, 5.0, "Redis seen up")
        await eventually(lambda: leases_held(state), 2, 5.0, "leases taken again")
        assert sum(slot.lease.retaken for slot in held) == 2
        for slot in held:
            slot.release(DONE)
        await eventually(lambda: leases_held(state), 0, 5.0, "leases given back")
        assert not state.held_leases.live
    finally:
        await state.close()


@pytest.mark.parametrize("when", ["before the move", "as it starts", "as it lands"])
async def test_a_call_ending_while_its_lease_moves_leaves_nothing_held(redis_server, when):
    """The call ends before Redis is back, in the same step the move starts, or just after
    the move's answer: its lease is given back wherever it is then, in Redis and in memory."""
    state = await replica_state(redis_server, new_prefix())
    try:
        lim = limiter(state, 4)
        redis_server.stop()
        slot = await lim.acquire("t")
        if when == "before the move":
            slot.release(DONE)
        redis_server.start()
        if when == "as it starts":
            state.renew_leases(True)
            slot.release(DONE)
        await eventually(lambda: _value(state.health.up), True, 5.0, "Redis seen up")
        if when == "as it lands":
            await eventually(lambda: leases_held(state), 1, 5.0, "lease moved")
            slot.release(DONE)
        await slot.lease.release()
        assert await leases_held(state) == 0
        assert await memory_leases_held(state) == 0
        assert not state.held_leases.unmoved and not state.held_leases.live
        assert (lim.inflight, lim.queued) == (0, 0)
    finally:
        await state.close()


async def _value(x):
    return x
