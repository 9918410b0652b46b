"""Budget spend still to reconcile with Redis survives reloads (a review, 2026-12-06): spend a
call admitted two reloads earlier kept on the local fallback went to a queue nobody read any
more (``Redeliveries.adopt`` re-pointed only the direct predecessor's queue), and an entry a
round had in flight at a reload, whose send then failed, went back to the old queue."""

from __future__ import annotations

import asyncio
import gc
import time

from policies.budget import Budgets
from policies.config import BudgetConfig
from policies.state import StateUnavailable, redis_backends
from policies.usage import Usage
from tests.redis_servers import RedisServer, delete_prefix, new_prefix


async def _spent_once_reconciled(backends, key: str) -> float:
    """What the shared ledger says ``key`` spent once anything is (5 s at most): Redis is
    back, and the reconciler sends what it kept."""
    deadline = time.monotonic() + 5
    spent = 0.0
    while time.monotonic() < deadline and not spent:
        await asyncio.sleep(0.2)
        try:
            (spent, _), = await backends.ledger.levels("r", [key])
        except StateUnavailable:
            continue
    return spent


def blocks() -> list[BudgetConfig]:
    return [BudgetConfig.model_validate({"tokens": "1000/day", "per": "tenant"})]


async def test_local_spend_of_a_call_admitted_before_two_reloads_is_reconciled(redis_server):
    prefix = new_prefix()
    backends = await redis_backends(redis_server.url, prefix, 0.5, probe_interval_s=0.1)
    port, directory = redis_server.port, redis_server.directory
    restarted = None
    try:
        a = Budgets(blocks(), {}, backends, time.time, "r")
        redis_server.stop()  # an outage: the call is held on this replica's local ledger
        held = await a.reserve("t", None, "m", 10, 20)
        assert held.source is not backends
        key = held.claims[0].key
        await asyncio.sleep(0.3)  # the call goes on a while (its release-by-id task ends)
        # Two reloads while the call is in flight (same route, same budget block).
        b = Budgets(blocks(), {}, backends, time.time, "r")
        b.take_over(a)
        c = Budgets(blocks(), {}, backends, time.time, "r")
        c.take_over(b)
        # The call ends: 30 tokens spent locally, to be charged to the shared ledger.
        a.settle(held, Usage(10, 20))
        # The old route objects go once their calls have ended.
        del a, b, held
        await asyncio.sleep(0.3)
        gc.collect()
        # Redis is back: the route's reconciler (c's) sends what was kept.
        restarted = RedisServer(directory, port=port).start()
        spent = await _spent_once_reconciled(backends, key)
        assert spent == 30, (f"shared ledger spent {spent}, expected 30; entries queued on "
                             f"the route's reconciler: {len(c.reconciler)}")
    finally:
        await backends.close()
        if restarted is not None:
            delete_prefix(restarted.url, prefix)
            restarted.stop()


async def test_a_reconcile_send_in_flight_at_a_reload_is_not_lost_when_it_fails(redis_server):
    """An entry the old round has in flight comes back to the shared queue if its send
    fails; it went back to the deque the round captured at its start, no one's after the
    reload."""
    prefix = new_prefix()
    backends = await redis_backends(redis_server.url, prefix, 0.5, probe_interval_s=0.1)
    try:
        a = Budgets(blocks(), {}, backends, time.time, "r")
        claims = a.prepare("t", None, "m", 10, 20).claims
        key = claims[0].key
        # 30 tokens spent on the local fallback during an earlier outage, to reconcile.
        a.reconciler.charge(claims, [30.0])
        redis_server.freeze()  # Redis stalls as the round sends it
        a.reconciler.kick()
        await asyncio.sleep(0.1)  # the round has the entry in flight
        b = Budgets(blocks(), {}, backends, time.time, "r")  # a reload
        b.take_over(a)
        await asyncio.sleep(1.0)  # the send times out (state timeout 0.5 s)
        redis_server.thaw()
        spent = await _spent_once_reconciled(backends, key)
        assert spent == 30, (f"shared ledger spent {spent}, expected 30; queued on the "
                             f"route's reconciler: {len(b.reconciler)}")
    finally:
        await backends.close()
        delete_prefix(redis_server.url, prefix)
