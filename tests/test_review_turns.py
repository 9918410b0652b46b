"""Retry-After's stretched turn (policies.concurrency.ConcurrencyLimiter.turn) on a replica
whose slots are held by another replica's calls: it cannot see them free, so the time since it
first looked is no measure of a turn there."""

from __future__ import annotations

import asyncio
import time

import pytest

from policies import concurrency
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
        backends: StateBackends, monkeypatch: pytest.MonkeyPatch):
    """A holds the route's one slot with calls of 50 ms, one after another (30 of them);
    B, whose queue is 0, refuses its callers. B has seen its own calls take 50 ms, and no
    slot of its own was held all that time: its Retry-After stays near 50 ms, not the time
    since its first refusal (51c8b75: ~1.5 s, growing for as long as A keeps the slot).
    The estimate itself, without the least hint a refusal gives (MIN_RETRY_AFTER_S)."""
    monkeypatch.setattr(concurrency, "MIN_RETRY_AFTER_S", 0.0)
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


async def test_a_stalled_house_of_eight_slots_stretches_a_turn_to_an_eighth_of_the_stall():
    """Eight calls hold every slot, none freed for 1 s (calls take 50 ms on average before):
    each has run at least 1 s, so a turn (service time over the limit) is at least 1/8 s,
    not 1 s. 51c8b75 took the whole stall as a turn: a caller with a 5 s timeout behind 7
    queued calls was refused deadline_unreachable ('the wait is estimated at 8.01s'), though
    the eight calls all ended a second later and it was served."""
    from policies.concurrency import ConcurrencyLimiter

    limiter = ConcurrencyLimiter(8, 64, 30.0, None)
    charged = await limiter.acquire("t")
    limiter.release("t", 0.05, charged)
    held = [await limiter.acquire("t") for _ in range(8)]
    waiting = [asyncio.create_task(limiter.acquire("t", caller_timeout=30.0)) for _ in range(7)]
    await asyncio.sleep(0)  # they queue, and look at the full house
    assert limiter.queued == 7
    await asyncio.sleep(1.0)
    late = asyncio.create_task(limiter.acquire("t", caller_timeout=5.0))
    await asyncio.sleep(0)
    assert not late.done(), late.exception()  # queued: 8 turns of 1/8 s fit in 5 s
    for charged in held:
        limiter.release("t", 1.0, charged)
    await asyncio.gather(late, *waiting)
    assert limiter.inflight == 8
