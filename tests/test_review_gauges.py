"""Gauges that lied after a fault or a reload (a hostile trial at 7e2c916): each test failed
before its fix. Real ``sluice serve`` processes; Redis under a key prefix of the test's own."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
import redis

from tests.conftest import route, status_of, wait_until
from tests.redis_servers import delete_prefix, new_prefix, require_redis

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


async def eventually(probe: Callable[[], Awaitable[float]], expected: float, timeout: float,
                     what: str) -> None:
    deadline = time.monotonic() + timeout
    while (value := await probe()) != expected:
        assert time.monotonic() < deadline, f"{what}: {value!r} after {timeout}s"
        await asyncio.sleep(0.1)


# -- 1. a killed replica's lapsed reservation stayed in the gauges of an idle route -------------


async def test_a_killed_replicas_lapsed_reservation_leaves_the_gauges_at_the_next_scrape(
        upstream, start_sluice):
    """B holds a reservation for a call at the upstream; A's call for the same tenant settles
    meanwhile, so A shows B's reservation in ``sluice_budget_reserved``. B is SIGKILLed. Once
    the reservation's hold has passed, A's next scrape shows nothing reserved (it showed it
    until the route's next call, however long after: 227 tokens at +180 s of a 120 s hold).

    The hold is 2 minutes at least (``policies.budget.HOLD_S``; no config shortens it), so
    the test moves the reservation's expiry into the past in Redis, as 2 minutes would."""
    url = require_redis()
    prefix = new_prefix()
    state = {"backend": "redis", "redis_url": url, "key_prefix": prefix, "timeout": "500ms"}
    config = {"state": state, "routes": [route(
        "openai", upstream.url, budget={"tokens": "100000/day", "per": "tenant"})]}
    a = await start_sluice(config)
    b = await start_sluice(config)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    labels = {"route": "openai", "tenant": tenant, "unit": "tokens"}
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        async with aiohttp.ClientSession() as session:
            chat = a.url + "/openai/v1/chat/completions"
            on_b = asyncio.create_task(status_of(
                session, b.url + "/openai/v1/chat/completions", CHAT,
                {"X-Tenant-ID": tenant, "x-fake-delay": "60"}))
            await wait_until(lambda: upstream.inflight == 1, what="B's call at the upstream")
            assert await status_of(session, chat, CHAT, {"X-Tenant-ID": tenant}) == 200
            held_by_b = await a.metric("sluice_budget_reserved", **labels)
            assert held_by_b > 0  # A's settle answered with B's reservation still held
            b.kill()
            with contextlib.suppress(aiohttp.ClientError):
                await on_b
        expiries = [key for key in client.scan_iter(match=f"{prefix}:*~resv-exp")]
        assert len(expiries) == 1
        assert client.zcard(expiries[0]) == 1  # B's; A's was settled
        client.zadd(expiries[0], {member: 0 for member in client.zrange(expiries[0], 0, -1)},
                    xx=True)
        await eventually(lambda: a.metric("sluice_budget_reserved", **labels), 0.0, 5.0,
                         "A's sluice_budget_reserved after B's reservation lapsed")
        # A's call spent 16 tokens (the fake's usage); B's is given back, spend unknown.
        assert await a.metric("sluice_budget_remaining", **labels) == 100000 - 16
    finally:
        client.close()
        delete_prefix(url, prefix)
