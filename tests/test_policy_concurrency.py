"""Unit tests of ``policies.concurrency.ConcurrencyLimiter``, in-process."""

from __future__ import annotations

import asyncio

import pytest

from policies.concurrency import JITTER_MAX, ConcurrencyLimiter
from policies.reasons import Reason, Rejected


async def test_slots_then_queue_full_with_a_drain_estimate():
    limiter = ConcurrencyLimiter(limit=2, queue=0, max_wait=5.0, per_tenant=None)
    assert limiter.try_acquire("t") and limiter.try_acquire("t")
    assert not limiter.try_acquire("t")
    with pytest.raises(Rejected) as full:
        await limiter.wait("t", 1, 5.0)
    assert full.value.reason is Reason.QUEUE_FULL
    # Nobody queued, two slots, 1 s assumed service time: the next slot in ~0.5 s.
    assert 0.5 <= full.value.retry_after <= 0.5 * JITTER_MAX
    assert full.value.policy == ("concurrency", 2, 0)
    assert (limiter.inflight, limiter.queued) == (2, 0)


async def test_service_time_average_drives_retry_after():
    limiter = ConcurrencyLimiter(limit=1, queue=0, max_wait=5.0, per_tenant=None)
    assert limiter.try_acquire("t")
    limiter.release("t", 3.0)  # EWMA: 1.0 + 0.1 * (3.0 - 1.0)
    assert limiter.mean_service_s == pytest.approx(1.2)
    assert limiter.try_acquire("t")
    assert not limiter.try_acquire("t")
    with pytest.raises(Rejected) as full:
        await limiter.wait("t", 1, 5.0)
    assert 1.2 <= full.value.retry_after <= 1.2 * JITTER_MAX


async def test_freed_slot_goes_to_the_best_waiter_without_dipping():
    limiter = ConcurrencyLimiter(limit=1, queue=10, max_wait=30.0, per_tenant=None)
    assert limiter.try_acquire("t")
    served: list[str] = []

    async def waiter(name: str, priority: int) -> None:
        assert not limiter.try_acquire("t")  # the handler's order: try, then queue
        await limiter.wait("t", priority, 30.0)
        served.append(name)

    tasks = []
    for name, priority in (("be", 2), ("std-1", 1), ("crit", 0), ("std-2", 1)):
        tasks.append(asyncio.create_task(waiter(name, priority)))
        await asyncio.sleep(0)  # enqueue in this order
    assert limiter.queued == 4
    # A newcomer may not overtake the queue even at the instant a slot frees.
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (1, 3)
    assert not limiter.try_acquire("t")
    for _ in range(4):
        await asyncio.sleep(0)
        limiter.release("t", None)
    await asyncio.gather(*tasks)
    assert served == ["crit", "std-1", "std-2", "be"]
    assert (limiter.inflight, limiter.queued) == (0, 0)


async def test_queue_timeout_after_max_wait_leaves_nothing_behind():
    limiter = ConcurrencyLimiter(limit=1, queue=5, max_wait=30.0, per_tenant=2)
    assert limiter.try_acquire("t")
    assert not limiter.try_acquire("t")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(Rejected) as expired:
        await limiter.wait("t", 1, 0.05)  # the caller's shorter deadline wins
    assert loop.time() - started >= 0.05
    assert expired.value.reason is Reason.QUEUE_TIMEOUT
    assert 1.0 <= expired.value.retry_after <= JITTER_MAX
    assert (limiter.inflight, limiter.queued) == (1, 0)
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (0, 0)
    assert limiter._by_tenant == {}


async def test_caller_leaving_the_queue_frees_its_place():
    limiter = ConcurrencyLimiter(limit=1, queue=5, max_wait=30.0, per_tenant=3)
    assert limiter.try_acquire("t")
    assert not limiter.try_acquire("t")
    task = asyncio.create_task(limiter.wait("t", 1, 30.0))
    await asyncio.sleep(0)
    assert limiter.queued == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (limiter.inflight, limiter.queued) == (1, 0)
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (0, 0)
    assert limiter._by_tenant == {}


async def test_caller_leaving_just_as_the_slot_is_handed_over_gives_it_back():
    limiter = ConcurrencyLimiter(limit=1, queue=5, max_wait=30.0, per_tenant=None)
    assert limiter.try_acquire("t")
    assert not limiter.try_acquire("t")
    task = asyncio.create_task(limiter.wait("t", 1, 30.0))
    await asyncio.sleep(0)
    limiter.release("t", None)  # handed to the waiter, which has not run yet...
    task.cancel()  # ...and is cancelled before it can
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (limiter.inflight, limiter.queued) == (0, 0)
    assert limiter.try_acquire("t")


async def test_per_tenant_counts_in_flight_and_queued_and_answers_at_once():
    limiter = ConcurrencyLimiter(limit=1, queue=5, max_wait=30.0, per_tenant=2)
    assert limiter.try_acquire("a")
    assert not limiter.try_acquire("a")  # counted, must now wait
    waiting = asyncio.create_task(limiter.wait("a", 1, 30.0))
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as capped:
        limiter.try_acquire("a")
    assert capped.value.reason is Reason.TENANT_CONCURRENCY
    assert capped.value.policy == ("tenant-concurrency", 2, 0)
    assert capped.value.retry_after > 0
    assert not limiter.try_acquire("b")  # another tenant is queued, not refused
    b_waiting = asyncio.create_task(limiter.wait("b", 1, 30.0))
    await asyncio.sleep(0)
    limiter.release("a", None)
    await waiting
    limiter.release("a", None)
    await b_waiting
    limiter.release("b", None)
    assert limiter._by_tenant == {} and (limiter.inflight, limiter.queued) == (0, 0)


async def test_queue_full_does_not_keep_the_tenants_share():
    limiter = ConcurrencyLimiter(limit=1, queue=0, max_wait=30.0, per_tenant=1)
    assert limiter.try_acquire("a")
    assert not limiter.try_acquire("b")
    with pytest.raises(Rejected):
        await limiter.wait("b", 1, 30.0)
    assert limiter._by_tenant == {"a": 1}


async def test_many_departures_do_not_grow_the_queue_without_bound():
    limiter = ConcurrencyLimiter(limit=1, queue=10_000, max_wait=30.0, per_tenant=None)
    assert limiter.try_acquire("t")
    assert not any(limiter.try_acquire("t") for _ in range(1000))
    tasks = [asyncio.create_task(limiter.wait("t", 1, 30.0)) for _ in range(1000)]
    await asyncio.sleep(0)
    for task in tasks[:-1]:
        task.cancel()
    await asyncio.gather(*tasks[:-1], return_exceptions=True)
    assert limiter.queued == 1
    assert len(limiter._heap) <= 2 * limiter.queued + 64 + 1
    limiter.release("t", None)
    await tasks[-1]  # the one that stayed is served
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (0, 0)


async def test_the_callers_timeout_less_the_service_time_bounds_the_wait():
    limiter = ConcurrencyLimiter(limit=1, queue=5, max_wait=30.0, per_tenant=2)
    # Before any completion the service time is a guess: only the caller's timeout counts.
    assert limiter.wait_budget(None) == 30.0
    assert limiter.wait_budget(2.0) == 2.0
    assert limiter.try_acquire("t")
    limiter.release("t", 1.5)  # observed: 1.0 + 0.1 * (1.5 - 1.0) = 1.05 s
    assert limiter.wait_budget(2.0) == pytest.approx(0.95)
    assert limiter.wait_budget(60.0) == 30.0
    # A caller whose timeout cannot cover even the call itself is told at once.
    assert limiter.try_acquire("t")
    assert not limiter.try_acquire("t")
    with pytest.raises(Rejected) as unreachable:
        await limiter.wait("t", 1, limiter.wait_budget(1.0))
    assert unreachable.value.reason is Reason.DEADLINE_UNREACHABLE
    assert (limiter.queued, limiter._by_tenant) == (0, {"t": 1})
