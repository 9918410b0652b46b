"""A hostile trial of Sluice's Redis faults (trial/redis): a duplicate waiting on one replica
for its twin in flight on another ran the request again when Redis stopped answering for a
second (``on_unavailable: local``): the local fallback knows no flight, so the upstream
executed the keyed work twice, though the duplicate had been told its twin was running. It
now gets 409 ``idempotency_conflict`` with a ``Retry-After``, as a duplicate that waited
past ``max_wait`` does."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import route
from tests.test_shared_rate_budget import own_state, post, replicas, wait_for


async def test_a_waiting_duplicate_does_not_run_again_when_redis_stops_answering(
        upstream, start_sluice, redis_server):
    state = own_state(redis_server, "local")
    a, b = await replicas(start_sluice, 2, state, route(
        "openai", upstream.url,
        idempotency={"mode": "dedup", "on_in_flight": "wait", "max_wait": "30s"}))
    key = {"Idempotency-Key": "job-7"}
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, a.url, **key, **{"x-fake-delay": "2"}))
        await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
        duplicate = asyncio.create_task(post(session, b.url, **key, **{"x-fake-delay": "2"}))
        await asyncio.sleep(0.5)  # it waits for its twin
        redis_server.freeze()
        try:
            status, headers, _ = await duplicate
        finally:
            redis_server.thaw()
        assert (await first)[0] == 200
        assert len(upstream.requests) == 1, "the keyed work ran twice"
        assert (status, headers["X-Sluice-Reason"]) == (409, "idempotency_conflict"), status
        assert int(headers["Retry-After"]) >= 1
