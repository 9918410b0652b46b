"""Unit tests of ``policies.concurrency.ConcurrencyLimiter``, in-process.

Random interleavings are driven in ``tests/test_limiter_properties.py``; here each behaviour
and each race found in review has its own readable test.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import concurrency
from policies.concurrency import JITTER_MAX, MIN_RETRY_AFTER_S, WAITING, ConcurrencyLimiter
from policies.reasons import Reason, Rejected


def limiter_with(limit: int = 1, queue: int = 5, max_wait: float = 30.0,
                 per_tenant: int | None = None) -> ConcurrencyLimiter:
    return ConcurrencyLimiter(limit, queue, max_wait, per_tenant)


async def full_after_fast_calls(limiter: ConcurrencyLimiter, service_s: float) -> None:
    """Three calls of ``service_s`` seconds each for tenant ``t`` (the limiter's mean, once
    observed), then one more that takes a slot and keeps it (the slow call)."""
    for _ in range(3):
        await limiter.acquire("t")
        limiter.release("t", service_s)
    await limiter.acquire("t")


async def queued(limiter: ConcurrencyLimiter, tenant: str = "t", priority: int = 1,
                 timeout: float | None = None, cost: float | None = None
                 ) -> asyncio.Task[float | None]:
    """A task queueing on ``limiter``, once it is in the queue."""
    before = limiter.queued
    task = asyncio.create_task(limiter.acquire(tenant, priority, timeout, cost=cost))
    await asyncio.sleep(0)
    assert limiter.queued == before + 1
    return task


async def test_slots_then_queue_full_with_a_drain_estimate():
    limiter = limiter_with(limit=2, queue=0, max_wait=5.0)
    await limiter.acquire("t")
    await limiter.acquire("t")
    with pytest.raises(Rejected) as full:
        await limiter.acquire("t")
    assert full.value.reason is Reason.QUEUE_FULL
    # Nobody queued, two slots, 1 s assumed service time: the next slot in ~0.5 s.
    assert 0.5 <= full.value.retry_after <= 0.5 * JITTER_MAX
    assert full.value.policy == ("concurrency", 2, 0, 0)
    assert (limiter.inflight, limiter.queued, limiter._by_tenant) == (2, 0, {"t": 2})


async def test_a_refusal_at_a_limit_of_one_says_one_slot():
    """It said "1 slots busy and 1 queued"."""
    limiter = limiter_with(limit=1, queue=1)
    await limiter.acquire("t")
    waiting = await queued(limiter)
    with pytest.raises(Rejected) as full:
        await limiter.acquire("t")
    assert full.value.detail == "1 slot busy and 1 queued"
    never = limiter_with(limit=1, queue=0, max_wait=0.0)
    await never.acquire("t")
    with pytest.raises(Rejected) as full:
        await never.acquire("t")
    assert full.value.detail == "1 slot busy and max_wait is 0s: no call waits for a slot"
    waiting.cancel()


async def test_a_refusal_after_a_reload_lowered_the_limits_names_what_is_there():
    """After a reload lowered ``limit: 4, queue: 4`` to 1 and 1 with every slot and place
    taken, a refusal said "1 slot busy and 1 queued" while 4 ran and 4 waited."""
    limiter = limiter_with(limit=4, queue=4)
    for _ in range(4):
        await limiter.acquire("t")
    waiting = [await queued(limiter) for _ in range(4)]
    limiter.reconfigure(1, 1, 30.0, None)
    with pytest.raises(Rejected) as full:
        await limiter.acquire("t")
    assert full.value.detail == "1 slot busy (4 in flight) and 4 queued"
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert limiter.queued == 0


async def test_service_time_average_drives_retry_after():
    limiter = limiter_with(queue=0, max_wait=5.0)
    await limiter.acquire("t")
    limiter.release("t", 3.0)  # the first sample replaces the 1 s guess
    await limiter.acquire("t")
    limiter.release("t", 1.0)  # EWMA: 3.0 + 0.1 * (1.0 - 3.0)
    assert limiter.mean_service_s == pytest.approx(2.8)
    await limiter.acquire("t")
    with pytest.raises(Rejected) as full:
        await limiter.acquire("t")
    assert 2.8 <= full.value.retry_after <= 2.8 * JITTER_MAX


async def test_freed_slot_goes_to_the_best_waiter_without_dipping():
    limiter = limiter_with(queue=10)
    await limiter.acquire("t")
    served: list[str] = []

    async def waiter(name: str, priority: int) -> None:
        await limiter.acquire("t", priority)
        served.append(name)

    tasks = []
    for name, priority in (("be", 2), ("std-1", 1), ("crit", 0), ("std-2", 1)):
        tasks.append(asyncio.create_task(waiter(name, priority)))
        await asyncio.sleep(0)  # enqueue in this order
    assert limiter.queued == 4
    # A newcomer may not overtake the queue even at the instant a slot frees.
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (1, 3)
    newcomer = await queued(limiter)
    newcomer.cancel()
    for _ in range(4):
        await asyncio.sleep(0)
        limiter.release("t", None)
    await asyncio.gather(*tasks)
    assert served == ["crit", "std-1", "std-2", "be"]
    assert (limiter.inflight, limiter.queued) == (0, 0)


async def test_queue_timeout_after_max_wait_leaves_nothing_behind():
    limiter = limiter_with(per_tenant=2)
    await limiter.acquire("t")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(Rejected) as expired:
        await limiter.acquire("t", 1, 0.05)  # the caller's shorter deadline wins
    assert loop.time() - started >= 0.05
    assert expired.value.reason is Reason.QUEUE_TIMEOUT
    assert 1.0 <= expired.value.retry_after <= JITTER_MAX
    assert (limiter.inflight, limiter.queued) == (1, 0)
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (0, 0)
    assert limiter._by_tenant == {}


async def test_caller_leaving_the_queue_frees_its_place():
    limiter = limiter_with(per_tenant=3)
    await limiter.acquire("t")
    task = await queued(limiter)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (limiter.inflight, limiter.queued) == (1, 0)
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (0, 0)
    assert limiter._by_tenant == {}


async def test_caller_leaving_just_as_the_slot_is_handed_over_gives_it_back():
    limiter = limiter_with()
    await limiter.acquire("t")
    task = await queued(limiter)
    limiter.release("t", None)  # handed to the waiter, which has not run yet...
    task.cancel()  # ...and is cancelled before it can
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (limiter.inflight, limiter.queued, limiter._by_tenant) == (0, 0, {})


async def test_waiter_cancelled_then_a_release_before_it_runs_frees_the_slot():
    # Issue 10's first race: the cancelled waiter's future is already cancelled when the
    # release tries to hand it the slot (InvalidStateError, and the slot stayed taken).
    limiter = limiter_with()
    await limiter.acquire("t")
    task = await queued(limiter)
    task.cancel()  # cancelled, not yet run...
    limiter.release("t", None)  # ...when the holder's slot frees
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (limiter.inflight, limiter.queued, limiter._by_tenant) == (0, 0, {})
    await limiter.acquire("t")  # the route is not wedged
    assert limiter.inflight == 1


async def test_waiter_cancelled_after_its_expiry_does_not_release_a_slot_it_never_held():
    # Issue 10's second race: the waiter's max_wait ran out (queue_timeout set), then it was
    # cancelled before it resumed; it took the "slot handed over" branch and released the
    # holder's slot, letting two calls through on a limit of 1.
    limiter = limiter_with()
    await limiter.acquire("t")
    task = await queued(limiter)
    waiter, = limiter.waiters()
    waiter.timer.cancel()
    limiter._expire(waiter)  # its max_wait runs out: the future holds queue_timeout...
    task.cancel()  # ...and the caller is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (limiter.inflight, limiter.queued, limiter._by_tenant) == (1, 0, {"t": 1})
    with pytest.raises(Rejected):  # the holder still has the only slot
        await limiter.acquire("u", 1, 0.01)
    limiter.release("t", None)
    assert (limiter.inflight, limiter._by_tenant) == (0, {})


async def test_per_tenant_counts_in_flight_and_queued_and_answers_at_once():
    limiter = limiter_with(per_tenant=2)
    await limiter.acquire("a")
    waiting = await queued(limiter, "a")
    with pytest.raises(Rejected) as capped:
        await limiter.acquire("a")
    assert capped.value.reason is Reason.TENANT_CONCURRENCY
    assert capped.value.policy == ("tenant-concurrency", 2, 0, 0)
    assert capped.value.retry_after > 0
    b_waiting = await queued(limiter, "b")  # another tenant is queued, not refused
    limiter.release("a", None)
    await b_waiting  # fair queueing: "a" already had its turn, so "b" goes first
    limiter.release("b", None)
    await waiting
    limiter.release("a", None)
    assert limiter._by_tenant == {} and (limiter.inflight, limiter.queued) == (0, 0)


async def test_queue_full_does_not_keep_the_tenants_share():
    limiter = limiter_with(queue=0, per_tenant=1)
    await limiter.acquire("a")
    with pytest.raises(Rejected):
        await limiter.acquire("b")
    assert limiter._by_tenant == {"a": 1}


async def test_many_departures_do_not_grow_the_queue_without_bound():
    limiter = limiter_with(queue=10_000)
    await limiter.acquire("t")
    tasks = [asyncio.create_task(limiter.acquire("t")) for _ in range(1000)]
    await asyncio.sleep(0)
    for task in tasks[:-1]:
        task.cancel()
    await asyncio.gather(*tasks[:-1], return_exceptions=True)
    assert limiter.queued == 1
    assert sum(len(q.entries) for q in limiter._classes.values()) == limiter.queued == 1
    limiter.release("t", None)
    await tasks[-1]  # the one that stayed is served
    limiter.release("t", None)
    assert (limiter.inflight, limiter.queued) == (0, 0)


async def test_calls_served_from_the_queue_leave_nothing_behind_without_aging():
    # Once, a per-tenant order that only aging popped kept every call that had queued
    # (20,000 calls, 20,000 waiters kept, on a route with ``aging: null`` and in every run's
    # fanout.width limiter); then the heaps kept ended calls until a compaction. A call now
    # leaves its class's queue as it stops waiting.
    limiter = ConcurrencyLimiter(1, 10, 30.0, None, aging=None)
    await limiter.acquire("t")
    for _ in range(2000):
        waiting = asyncio.create_task(limiter.acquire("t"))
        await asyncio.sleep(0)
        limiter.release("t", 0.01)
        await waiting
    [queue] = limiter._classes.values()
    assert queue.entries == []


async def test_the_callers_timeout_less_the_service_time_bounds_the_wait():
    limiter = limiter_with(per_tenant=2)
    # Before any completion the service time is a guess: only the caller's timeout counts.
    assert limiter.wait_budget(None) == 30.0
    assert limiter.wait_budget(2.0) == 2.0
    await limiter.acquire("t")
    limiter.release("t", 1.5)  # observed: the first sample replaces the 1 s guess
    assert limiter.wait_budget(2.0) == pytest.approx(0.5)
    assert limiter.wait_budget(60.0) == 30.0
    # A caller whose timeout cannot cover even the call itself is told at once.
    await limiter.acquire("t")
    with pytest.raises(Rejected) as unreachable:
        await limiter.acquire("t", 1, 1.0)
    assert unreachable.value.reason is Reason.DEADLINE_UNREACHABLE
    assert (limiter.queued, limiter._by_tenant) == (0, {"t": 1})


async def test_a_deadline_counts_only_the_calls_that_would_be_served_before_it():
    """A hostile trial: a critical call behind three best-effort ones was refused
    ``deadline_unreachable`` (its wait estimated from the whole queue), though it was served
    at once when it sent no deadline. The calls that go first are the ones that count."""
    limiter = limiter_with(limit=1, queue=8)
    await full_after_fast_calls(limiter, 0.5)  # a mean of 0.5 s; "t" holds the slot
    backlog = [await queued(limiter, "t", priority=2) for _ in range(3)]
    # Critical goes first: one turn of wait and its own 0.5 s fit its 1.5 s.
    critical = await queued(limiter, "c", priority=0, timeout=1.5)
    # t's fourth would go after all four: 2.5 s of wait do not fit.
    with pytest.raises(Rejected) as refused:
        await limiter.acquire("t", 2, 1.5)
    assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
    assert refused.value.retry_after >= 2.5
    # Another tenant's first best-effort call goes before t's backlog but for its first,
    # tied with it: three turns and its own 0.5 s fit 2.1 s (the whole queue would not).
    fair = await queued(limiter, "f", priority=2, timeout=2.1)
    served = []
    for tenant in ("t", "c", "t", "f", "t", "t"):
        limiter.release(tenant, 0.5)
        await asyncio.sleep(0)
        done = [task for task in (critical, *backlog, fair) if task.done()
                and task not in served]
        served += done
    assert served == [critical, backlog[0], fair, backlog[1], backlog[2]]
    assert (limiter.inflight, limiter.queued) == (0, 0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 2), st.booleans()),
                max_size=40),
       st.integers(0, 2), st.sampled_from("abcd"))
@settings(max_examples=60, deadline=None)
def test_the_calls_ahead_are_counted_as_the_queue_serves_them(arrivals, priority, tenant):
    """:meth:`ConcurrencyLimiter._ahead` against a count over every waiter: calls of better
    classes, and of the newcomer's class tagged at or before its tag, some having left."""

    async def run() -> None:
        limiter = limiter_with(limit=1, queue=100)
        await limiter.acquire("x")
        tasks = []
        for who, cls, leaves in arrivals:
            tasks.append((await queued(limiter, who, cls), leaves))
        for task, leaves in tasks:
            if leaves:
                task.cancel()
        await asyncio.sleep(0)
        tag = max(limiter._vtime.get((priority, tenant), 0.0), limiter.vnow.get(priority, 0.0))
        waiting = limiter.waiters()
        assert len(waiting) == limiter.queued
        assert all(w.state == WAITING for w in waiting)
        exact = sum(1 for w in waiting if w.cls < priority or (w.cls == priority and w.tag <= tag))
        assert limiter._ahead(priority, tag) == exact
        for task, _ in tasks:
            task.cancel()
        await asyncio.gather(*(task for task, _ in tasks), return_exceptions=True)

    asyncio.run(run())


async def test_calls_taken_without_queueing_count_against_their_tenant_once_a_queue_forms():
    """The fast path charges too: a tenant holding slots taken while nobody waited is behind
    one holding none, whoever queued first."""
    limiter = ConcurrencyLimiter(3, 10, 30.0, None)
    for _ in range(2):
        await limiter.acquire("heavy", cost=100.0)
    await limiter.acquire("other", cost=100.0)
    heavy = await queued(limiter, "heavy", cost=100.0)  # first in the queue, served second
    light = await queued(limiter, "light", cost=100.0)
    assert {w.tenant: w.tag for w in limiter.waiters()} == {"heavy": 200.0, "light": 0.0}
    limiter.release("other", 1.0)
    await light
    assert [w.tenant for w in limiter.waiters()] == ["heavy"] and not heavy.done()


async def test_a_tenant_left_behind_by_the_class_time_starts_its_next_calls_there():
    """A tenant whose virtual time fell behind the route's while it held a slot is charged
    from the route's time (CFS's min_vruntime), on a queued call as on one taken at once."""
    limiter = ConcurrencyLimiter(2, 10, 30.0, None)
    await limiter.acquire("slow", cost=1.0)  # its time: 1
    await limiter.acquire("holder", cost=1.0)
    tasks = [await queued(limiter, "busy", cost=1.0) for _ in range(3)]  # tags 0, 1, 2
    limiter.release("holder", 1.0)
    for task in tasks:
        await task
        limiter.release("busy", 1.0)
    assert limiter.vnow == {1: 2.0} and (limiter.inflight, limiter.queued) == (1, 0)
    await limiter.acquire("slow", cost=1.0)  # at once, from the route's time: 2 + 1; full
    await queued(limiter, "slow", cost=1.0)
    await queued(limiter, "slow", cost=1.0)
    assert [w.tag for w in limiter.waiters()] == [3.0, 4.0]


async def test_a_full_queue_refuses_the_call_it_would_serve_last():
    limiter = limiter_with(queue=2)
    await limiter.acquire("noisy", 2)
    first, last = await queued(limiter, "noisy", 2), await queued(limiter, "noisy", 2)
    # The noisy tenant's own next call of the class ranks after its queued ones: refused.
    with pytest.raises(Rejected) as full:
        await limiter.acquire("noisy", 2)
    assert full.value.reason is Reason.QUEUE_FULL and limiter._by_tenant == {"noisy": 3}
    # Another tenant's, within its share, takes the place of the noisy tenant's latest.
    quiet = asyncio.create_task(limiter.acquire("quiet", 2))
    with pytest.raises(Rejected) as displaced:
        await last
    assert displaced.value.reason is Reason.QUEUE_FULL and displaced.value.retry_after > 0
    assert limiter._by_tenant == {"noisy": 2, "quiet": 1} and limiter.queued == 2
    # A waiter whose caller left (not yet run) leaves a place: nobody is refused for it.
    critical = asyncio.create_task(limiter.acquire("noisy", 0))
    first.cancel()
    await asyncio.sleep(0)
    assert first.cancelled() and not quiet.done() and not critical.done()
    assert limiter.queued == 2 and limiter._by_tenant == {"noisy": 2, "quiet": 1}
    limiter.release("noisy", None)
    await critical
    limiter.release("noisy", None)
    await quiet
    limiter.release("quiet", None)
    assert (limiter.inflight, limiter.queued, limiter._by_tenant) == (0, 0, {})


async def test_retry_after_is_at_most_max_wait_and_one_turn_however_long_the_queue():
    # Every call queued now has left the queue within max_wait, served or expired: a queue of
    # 50 on one 1 s slot told its refused callers to come back in 51-76 s (x-should-retry:
    # false past 60 s) though it would be empty in 2.
    limiter = limiter_with(queue=50, max_wait=2.0)
    await limiter.acquire("t")
    limiter.release("t", 1.0)
    await limiter.acquire("t")
    waiting = [asyncio.create_task(limiter.acquire("t")) for _ in range(50)]
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as full:
        await limiter.acquire("t")
    assert full.value.reason is Reason.QUEUE_FULL
    assert 3.0 <= full.value.retry_after <= 3.0 * JITTER_MAX
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


@pytest.fixture
def estimates_unfloored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimates themselves, without the least hint a refusal gives (milliseconds are
    what these tests can afford to wait)."""
    monkeypatch.setattr(concurrency, "MIN_RETRY_AFTER_S", 0.0)


@pytest.mark.usefixtures("estimates_unfloored")
async def test_a_house_busy_longer_than_the_mean_says_so_in_retry_after():
    # Fast calls set the mean at 6 ms; then a slow one holds the only slot. A new user's
    # SDK was told to come back in 6 ms (retry-after-ms) while 3 s calls held every slot.
    limiter = limiter_with(queue=1, max_wait=30.0)
    await full_after_fast_calls(limiter, 0.006)
    waiting = await queued(limiter)
    with pytest.raises(Rejected) as first:
        await limiter.acquire("t")
    # Nothing has said yet that calls got slower: two turns of the mean.
    assert first.value.retry_after <= 2 * 0.006 * JITTER_MAX
    await asyncio.sleep(0.3)
    with pytest.raises(Rejected) as later:
        await limiter.acquire("t")
    # No slot freed for at least 0.3 s with every one busy: a turn is at least that long,
    # and the queue has two to go (the one waiting, then this one).
    assert later.value.reason is Reason.QUEUE_FULL
    assert later.value.retry_after >= 2 * 0.3
    # A slot passing on starts the count again: the mean (now with the slow call in it) rules.
    limiter.release("t", 0.306)
    await waiting
    again = await queued(limiter)
    with pytest.raises(Rejected) as after:
        await limiter.acquire("t")
    assert after.value.retry_after <= 2 * limiter.mean_service_s * JITTER_MAX
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)


async def test_a_callers_deadline_is_measured_against_a_stalled_house():
    # The deadline check estimates the wait with the same turn: a caller whose timeout a
    # stalled slot will outlast is told at once, not queued until its timeout.
    limiter = limiter_with(queue=5, max_wait=30.0)
    await full_after_fast_calls(limiter, 0.01)
    waiting = await queued(limiter)
    with pytest.raises(Rejected):  # a full look at the house: the count is taken
        await limiter.acquire("t", 1, 0.005)
    await asyncio.sleep(0.5)
    with pytest.raises(Rejected) as refused:
        await limiter.acquire("t", 1, 0.9)
    # Two turns of at least 0.5 s each exceed 0.9 s less the 10 ms call.
    assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_the_stall_clock_starts_when_a_call_first_queues_not_at_the_first_refusal():
    # Fast calls set the mean at 6 ms; then a slow call fills the house and one queues behind
    # it. A hostile trial's first refusals, a second later, were told the fast mean (37-48 ms
    # while 3.5 s calls held both slots): the clock had started at the first refusal.
    limiter = limiter_with(queue=1, max_wait=30.0)
    await full_after_fast_calls(limiter, 0.006)
    waiting = await queued(limiter)  # found every slot busy: no slot has freed since
    await asyncio.sleep(0.3)
    with pytest.raises(Rejected) as first:
        await limiter.acquire("t")
    # The first refusal already knows no slot freed for 0.3 s: two turns of at least that.
    assert first.value.reason is Reason.QUEUE_FULL
    assert first.value.retry_after >= 2 * 0.3
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_the_stall_clock_restarts_at_a_hand_over_not_at_the_next_refusal():
    # A slot passed on is a turn whose time is known: the clock starts there.
    limiter = limiter_with(queue=1, max_wait=30.0)
    await full_after_fast_calls(limiter, 0.006)
    waiting = await queued(limiter)
    limiter.release("t", 0.006)  # handed to the waiter, which now holds the only slot
    await waiting
    await asyncio.sleep(0.3)
    again = await queued(limiter)
    with pytest.raises(Rejected) as refused:
        await limiter.acquire("t")
    assert refused.value.retry_after >= 2 * 0.3
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)


@pytest.mark.usefixtures("estimates_unfloored")
async def test_a_tenant_at_its_cap_is_told_at_least_how_long_its_calls_have_run():
    # The tenant's 2 calls run long on a route with free slots, after fast calls set the mean
    # at 6 ms. A hostile trial measured 12 ms (the mean over 2) while they had run 0.3 s.
    limiter = limiter_with(limit=8, queue=5, per_tenant=2)
    await full_after_fast_calls(limiter, 0.006)
    await limiter.acquire("t")
    with pytest.raises(Rejected) as first:
        await limiter.acquire("t")
    assert first.value.reason is Reason.TENANT_CONCURRENCY
    assert first.value.retry_after <= 0.006  # nothing known yet but the mean
    await asyncio.sleep(0.3)
    with pytest.raises(Rejected) as later:
        await limiter.acquire("t")
    # No slot freed since the first refusal: each of its calls has run at least 0.3 s.
    assert later.value.retry_after >= 0.3 / 2
    # Another tenant's call ending is a turn: the look is dropped, the mean rules again.
    await limiter.acquire("u")
    limiter.release("u", 0.006)
    with pytest.raises(Rejected) as after:
        await limiter.acquire("t")
    assert after.value.retry_after <= 0.3 / 2


@pytest.mark.usefixtures("estimates_unfloored")
async def test_a_tenant_at_its_cap_on_a_full_house_is_told_how_long_every_slot_stayed_busy():
    # The route's stall clock, started by a call that queued, bounds the tenant's calls too.
    limiter = limiter_with(limit=2, queue=5, per_tenant=2)
    await full_after_fast_calls(limiter, 0.006)
    await limiter.acquire("t")
    waiting = await queued(limiter, tenant="u")
    await asyncio.sleep(0.3)
    with pytest.raises(Rejected) as first:
        await limiter.acquire("t")
    assert first.value.reason is Reason.TENANT_CONCURRENCY
    assert first.value.retry_after >= 0.3 / 2
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


@pytest.mark.parametrize("first_s, service_s", [(0.1, 0.1), (4.0, 4.0), (0.001, 0.1),
                                                (120.0, 0.1)])
async def test_weights_hold_from_a_cold_start(first_s, service_s):
    """A hostile trial: on a route that had answered no call yet, every queued call was
    priced at the starting guess of 1 s and those after the first answer at what was
    observed, so with a 0.1 s upstream the flooding tenant (weight 1) got 1 slot in 49
    against a light one of weight 3, and with a 4 s upstream more than its share. A review:
    with the unit fixed by the first answer alone, a cached 1 ms one or a 120 s cold start
    skewed them as far the other ways. Priced per call until the unit (the median of 8
    service times) is known, the shares are 3:1 from the start."""
    limiter = ConcurrencyLimiter(1, 100, 600.0, None, tenant_weights={"light": 3.0})
    charged = await limiter.acquire("holder")
    heavy = [await queued(limiter, "heavy") for _ in range(30)]
    light = [await queued(limiter, "light") for _ in range(2)]
    served: list[str] = []
    holder, holding = "holder", charged
    for turn in range(40):
        limiter.release(holder, first_s if turn == 0 else service_s, holding)
        await asyncio.sleep(0)
        granted = [t for t in heavy + light if t.done() and not getattr(t, "seen", False)]
        assert len(granted) == 1
        task = granted[0]
        task.seen = True  # type: ignore[attr-defined]
        holder, holding = ("heavy" if task in heavy else "light"), task.result()
        served.append(holder)
        if holder == "light":  # light keeps two calls queued
            light.append(await queued(limiter, "light"))
    assert served.count("light") == pytest.approx(30, abs=2)
    for task in heavy + light:
        task.cancel()
    await asyncio.gather(*heavy, *light, return_exceptions=True)


_SERVICE_S = {"a": 30.0, "b": 0.1}


async def _slot_time_shares(limiter: ConcurrencyLimiter, total_s: float) -> dict[str, float]:
    """Both tenants keep two calls queued behind the one slot; each call, once granted,
    holds the slot for its tenant's service time (released with it, and with its charge,
    as Slot.release does). Returns each tenant's share of the slot time."""
    pending: list[tuple[str, asyncio.Future]] = []

    def send(tenant: str) -> None:
        pending.append((tenant, asyncio.ensure_future(limiter.acquire(tenant))))

    holder, charged = "b", await limiter.acquire("b")
    for tenant in ("a", "a", "b", "b"):
        send(tenant)
    await asyncio.sleep(0)
    used = {"a": 0.0, "b": 0.0}
    while sum(used.values()) < total_s:
        used[holder] += _SERVICE_S[holder]
        limiter.release(holder, _SERVICE_S[holder], charged)
        await asyncio.sleep(0)
        granted = [entry for entry in pending if entry[1].done()]
        assert len(granted) == 1
        pending.remove(granted[0])
        holder, charged = granted[0][0], granted[0][1].result()
        send(holder)  # the tenant keeps two calls queued
        await asyncio.sleep(0)
    for _, task in pending:
        task.cancel()
    await asyncio.gather(*(task for _, task in pending), return_exceptions=True)
    total = sum(used.values())
    return {tenant: spent / total for tenant, spent in used.items()}



@pytest.mark.parametrize("weights, slow_share", [({}, (0.4, 0.6)), ({"b": 3.0}, (0.18, 0.35))])
async def test_a_tenant_of_slow_calls_gets_its_weights_share_of_the_slot_time(
        weights, slow_share):
    """A review of the cold-start fix: tenant a's calls take 30 s and b's 0.1 s, both keep
    work queued. Counted in units of the route's *mean*, moved by each sample, a 30 s call
    cost at most 1 / EWMA weight = 10 units however long it ran: a took 77% of the slot
    time with equal weights, 60% with b weighted 3. In a unit fixed at the first sample,
    costs compare as seconds do."""
    limiter = ConcurrencyLimiter(1, 100, 600.0, None, tenant_weights=weights or None)
    shares = await _slot_time_shares(limiter, 3000.0)
    low, high = slow_share
    assert low <= shares["a"] <= high, shares


async def test_a_burst_after_fast_calls_is_told_no_less_than_the_sdks_first_back_off():
    """A hostile trial: fast calls set the mean at 6 ms, then a tenant's fan-out of 1 s calls
    filled its cap and the slot: its refused calls were told 2-8 ms (``retry-after-ms``), and
    the openai SDK spent its two retries within 0.3 s, long before a slot freed, sooner than
    with no hint at all (its own back-off starts at 0.5 s)."""
    limiter = limiter_with(limit=1, queue=1)
    await full_after_fast_calls(limiter, 0.006)
    waiting = await queued(limiter)
    with pytest.raises(Rejected) as full:
        await limiter.acquire("t")
    assert full.value.reason is Reason.QUEUE_FULL
    assert MIN_RETRY_AFTER_S <= full.value.retry_after <= MIN_RETRY_AFTER_S * JITTER_MAX
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)

    capped = limiter_with(limit=4, per_tenant=1)
    await full_after_fast_calls(capped, 0.006)
    with pytest.raises(Rejected) as refused:
        await capped.acquire("t")
    assert refused.value.reason is Reason.TENANT_CONCURRENCY
    assert refused.value.retry_after == MIN_RETRY_AFTER_S


async def test_a_reload_that_shortens_max_wait_shortens_the_waits_under_way():
    """A hostile trial: ``max_wait`` 30 s reloaded to 2 s with calls queued: they were served
    up to 9 s later, while newcomers were told (``Retry-After``) the queue would be through
    within the new ``max_wait``. They now wait no longer than it from the reload; a caller's
    own shorter deadline still ends its wait first, and a longer ``max_wait`` extends none."""
    limiter = limiter_with(limit=1, queue=4, max_wait=30.0)
    await limiter.acquire("t")
    loop = asyncio.get_running_loop()
    long_wait = await queued(limiter)
    own_deadline = await queued(limiter, timeout=0.1)
    before = {id(w): w.timer.when() for w in limiter.waiters()}
    reloaded_at = loop.time()
    limiter.reconfigure(1, 4, 0.3, None)
    ends = {id(w): w.timer.when() for w in limiter.waiters()}
    assert sorted(ends.values())[0] == min(before.values())  # the caller's own 0.1 s kept
    assert reloaded_at + 0.3 <= max(ends.values()) < before[max(ends, key=ends.get)]
    limiter.reconfigure(1, 4, 60.0, None)  # lengthened: no wait is extended
    assert {id(w): w.timer.when() for w in limiter.waiters()} == ends
    for task in (own_deadline, long_wait):
        with pytest.raises(Rejected) as expired:
            await task
        assert expired.value.reason is Reason.QUEUE_TIMEOUT
    assert loop.time() - reloaded_at < 5.0  # not the 30 s it had queued for
    assert (limiter.queued, limiter.inflight) == (0, 1)
    limiter.release("t", None)
