"""A duplicate that took a key in Redis to wait for its twin claimed from this replica's
memory during an outage, and then left: the key must stay known to Redis while the twin
still runs."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.test_idempotency_fallback_flight import KEY, backend_up, two_replicas
from tests.test_shared_rate_budget import CHAT, body, post, wait_for


async def test_a_duplicate_that_leaves_while_waiting_here_does_not_free_a_running_twins_key(
        upstream, start_sluice, redis_server):
    """Redis stopped: the first call is claimed from A's memory and held upstream. Redis back,
    a duplicate sent to A takes the key in Redis (A's registration of the first call's
    marker comes a third of the lease later) and waits for the twin A runs; its caller
    leaves. 51c8b75: leaving freed the key in Redis, and the registration had given up on
    seeing the duplicate's marker, so a third copy sent to B ran the upstream while the
    first still ran (2 executions, 2 at once)."""
    a, b = await two_replicas(start_sluice, upstream, redis_server, "30s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        redis_server.stop()
        try:
            first = asyncio.create_task(post(session, a.url, **KEY))
            await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
        finally:
            redis_server.start()
        await backend_up(a)
        await backend_up(b)
        try:
            async with session.post(a.url + CHAT, json=body(), headers=KEY,
                                    timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                await r.read()
        except TimeoutError:
            pass  # the duplicate's caller left while it waited for its twin
        await asyncio.sleep(1.0)  # the server has seen it leave
        assert len(upstream.requests) == 1, "the duplicate did not wait for its twin"
        third = asyncio.create_task(post(session, b.url, **KEY))
        await asyncio.sleep(1.5)
        executions = len(upstream.requests)
        upstream.hold.set()
        (status_1, _, _), (status_3, headers_3, _) = await first, await third
    assert executions == 1, "a copy ran upstream while the first was still in flight"
    assert (status_1, status_3) == (200, 200)
    assert headers_3.get("Idempotent-Replayed") == "true"
    assert len(upstream.requests) == 1


async def test_a_key_handed_over_here_after_an_outage_takes_its_marker_in_redis(
        upstream, start_sluice, redis_server):
    """Redis stopped: the first call and its duplicate, both claimed from A's memory, the
    duplicate waiting. Redis back, the first ends with no outcome (its caller leaves; a
    failure would be given to the duplicate instead) and hands the key to the duplicate,
    which runs upstream for 3 s. 51c8b75: only a request that started a flight took its
    marker in Redis, not one handed it, so a third copy sent to B meanwhile ran the upstream
    too (3 executions, 2 at once)."""
    a, b = await two_replicas(start_sluice, upstream, redis_server, "3s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        redis_server.stop()
        try:
            first = asyncio.create_task(post(session, a.url, **KEY))
            await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
            duplicate = asyncio.create_task(post(session, a.url, **KEY,
                                                 **{"x-fake-delay": "3"}))
            await asyncio.sleep(0.5)  # it waits for its twin, here
        finally:
            redis_server.start()
        await backend_up(a)
        await backend_up(b)
        first.cancel()
        await wait_for(lambda: upstream.cancelled == 1, what="the first call cancelled")
        upstream.hold.set()
        await wait_for(lambda: len(upstream.requests) == 2, what="the duplicate upstream")
        await asyncio.sleep(1.2)  # a third of the lease: the key has taken its marker
        third = asyncio.create_task(post(session, b.url, **KEY))
        await asyncio.sleep(0.5)
        executions = len(upstream.requests)
        (status_2, _, _), (status_3, headers_3, _) = await duplicate, await third
    assert executions == 2, "a copy ran upstream while the handed-over one was in flight"
    assert (status_2, status_3) == (200, 200)
    assert headers_3.get("Idempotent-Replayed") == "true"
    assert len(upstream.requests) == 2
