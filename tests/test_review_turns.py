"""Retry-After's stretched turn (policies.concurrency.ConcurrencyLimiter.turn) on a replica
whose slots are held by another replica's calls: it cannot see them free, so the time since it
first looked is no measure of a turn there."""

from __future__ import annotations

import asyncio
import time

import pytest

from policies.pipeline import Outcome
from policies.reasons import Reason, Rejected
from policies.shared_concurrency import SharedConcurrencyLimiter
from policies.state import StateBackends
from tests.redis_servers import replica

QUICK = Outcome("2xx", reached=True, status=200, service_s=0.05)


def limiter(backends: StateBackends, limit: int, queue: int) -> SharedConcurrencyLimiter:
    return SharedConcurrencyLimiter(limit, queue, 5.0, None, backends=backends, group="r")


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_a_replica_seeing_no_release_of_anothers_quick_calls_does_not_stretch_its_turn(
        backends: StateBackends):
    """A holds the route's one slot with calls of 50 ms, one after another (30 of them);
    B, whose queue is 0, refuses its callers. B has seen its own calls take 50 ms, and no
    slot of its own was held all that time: its Retry-After stays near 50 ms, not the time
    since its first refusal (51c8b75: ~1.5 s, growing for as long as A keeps the slot)."""
    async with replica(backends) as other:
        a, b = limiter(backends, 1, 8), limiter(other, 1, 0)
        own = await b.acquire("t")
        own.release(QUICK)  # B learns a call takes 50 ms
        while (await backends.leases.counts("r", "t"))[0]:
            await asyncio.sleep(0.01)
        churn_done = asyncio.Event()

        async def churn() -> None:
            for _ in range(30):
                slot = await a.acquire("t")
                await asyncio.sleep(0.05)
                slot.release(QUICK)
            churn_done.set()

        task = asyncio.create_task(churn())
        refusals = []
        started = time.monotonic()
        while not churn_done.is_set():
            try:
                slot = await b.acquire("t")
            except Rejected as refused:
                assert refused.reason is Reason.QUEUE_FULL
                refusals.append(refused.retry_after)
            else:
                slot.release(QUICK)
            await asyncio.sleep(0.05)
        await task
        elapsed = time.monotonic() - started
        assert len(refusals) > 5 and elapsed > 1.0
        # 50 ms a turn, spread up to 1.5x; never the second-long time since the first look
        assert max(refusals) <= 0.05 * 1.5 + 1e-9, (max(refusals), elapsed)
