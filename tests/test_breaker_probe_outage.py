"""A hostile trial of Sluice's Redis faults (trial/redis): a half-open probe whose outcome
Redis could not take (frozen for 2 s while the probe ran) left the shared breaker half-open
with the probe's lease held, so every replica refused a healthy upstream 503
``circuit_open`` for the rest of the lease (a fixed 30 s then: 28 s after Redis was
back, with ``reset_timeout: 2s``). The outcome is now delivered once Redis answers."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.conftest import route
from tests.test_shared_rate_budget import own_state, post, replicas


async def test_a_probe_outcome_redis_missed_is_delivered_when_it_is_back(
        upstream, start_sluice, redis_server):
    state = own_state(redis_server, "local")
    a, b = await replicas(start_sluice, 2, state, route(
        "openai", upstream.url, circuit_breaker={"fail_max": 2, "reset_timeout": "1s"}))
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            status, _, _ = await post(session, a.url, **{"x-fake-status": "500"})
            assert status == 500
        await asyncio.sleep(0.6)  # b's view of the breaker is refreshed
        for rep in (a, b):
            status, headers, _ = await post(session, rep.url)
            assert (status, headers["X-Sluice-Reason"]) == (503, "circuit_open")
        await asyncio.sleep(1.2)  # reset_timeout: the next call is the probe
        probe = asyncio.create_task(post(session, a.url, **{"x-fake-delay": "3.0"}))
        await asyncio.sleep(0.3)
        redis_server.freeze()  # the probe's answer comes while Redis is away...
        try:
            # ... and known to be away (a's heartbeat timed out), so its outcome is not sent
            await a.wait_metric("sluice_state_backend_up", 0, backend="redis")
            assert (await probe)[0] == 200
            await asyncio.sleep(0.3)
        finally:
            redis_server.thaw()
        for rep in (a, b):
            await rep.wait_metric("sluice_state_backend_up", 1, backend="redis")
        await asyncio.sleep(1.0)  # every view is Redis's again
        deadline = time.monotonic() + 5.0
        seen = []
        while time.monotonic() < deadline:
            results = [await post(session, rep.url) for rep in (a, b)]
            seen.append([(s, h.get("X-Sluice-Reason")) for s, h, _ in results])
            if all(s == 200 for s, _, _ in results):
                break
            await asyncio.sleep(0.25)
        assert all(s == 200 for s, _ in seen[-1]), (
            f"the upstream answered the probe well, yet 5 s after Redis came back: {seen[-1]}")
