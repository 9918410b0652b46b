"""A hostile trial of Sluice's Redis faults (trial/redis): during an outage a replica's
local share of a budget was of ``cap - spent`` as Redis last said, leaving out what the
replicas' calls in flight held there. Those calls go on to spend it, so the budget was
overspent by up to every reservation in flight when Redis stopped answering (3,599 tokens
on a 3,000 budget after a 2 s freeze under load, 3 replicas)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import route
from tests.test_shared_rate_budget import budget_levels, own_state, post, replicas, wait_for


def body(max_tokens: int) -> dict:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": "count for me"}],
            "max_tokens": max_tokens}


async def test_local_share_leaves_out_what_calls_in_flight_hold(
        upstream, start_sluice, redis_server):
    state = own_state(redis_server, "local")  # replicas: 3, a share is a third
    a, b = await replicas(start_sluice, 2, state, route(
        "openai", upstream.url, budget={"tokens": "600/day", "per": "tenant"}))
    acme = {"X-Tenant-ID": "acme"}
    counter = "tokens-per-tenant-day:acme"
    prefix = state["key_prefix"]
    async with aiohttp.ClientSession() as session:
        # Replica a: calls that hold most of the budget at the upstream for a while.
        slow = [asyncio.create_task(post(session, a.url, body(100), **acme,
                                         **{"x-fake-delay": "3"})) for _ in range(4)]
        await wait_for(lambda: len(upstream.requests) == 4, what="the slow calls to arrive")
        spent, held = budget_levels(redis_server.url, prefix, counter)
        assert spent == 0 and held >= 400, (spent, held)
        # Replica b hears of the budget (its answer carries spent and held) ...
        status, _, _ = await post(session, b.url, body(10), **acme)
        assert status == 200
        await wait_for(lambda: budget_levels(redis_server.url, prefix, counter)[0] > 0,
                       what="b's settle")
        spent, held = budget_levels(redis_server.url, prefix, counter)
        left = 600 - spent - held
        redis_server.freeze()
        try:
            # ... and with Redis away admits at most its share of what is left: a third
            # of ``600 - spent - held`` (under 60 tokens), not of ``600 - spent``.
            served = 0
            for _ in range(10):
                status, headers, _ = await post(session, b.url, body(10), **acme)
                if status == 200:
                    served += 1
                else:
                    assert headers["X-Sluice-Reason"] == "budget_exhausted", headers
            # Each of those calls reserved at least its max_tokens (10).
            assert served * 10 <= left / 3, (
                f"b served {served} calls from a share of {left / 3:.0f} tokens left "
                f"(spent {spent}, held by calls in flight {held})")
        finally:
            redis_server.thaw()
        for task in slow:
            status, _, _ = await task
            assert status == 200
