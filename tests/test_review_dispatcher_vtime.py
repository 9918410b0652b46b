"""The Redis dispatcher's hand-over and the class's virtual time (from a hostile review).

The memory limiter chooses and grants in one step, so a class's virtual time never passes a
waiting call's tag, and ``_best`` looks only at each class's first call. The Redis dispatcher
(:class:`policies.shared_concurrency.SharedConcurrencyLimiter`) chooses a waiter, awaits
Redis for its lease, and only then grants it: calls that arrived during that round trip may
be tagged below the one it grants (a new tenant starts at the class's time). Granting it must
not move the class's time past them, or they are "behind their class" and the one-candidate
choice no longer matches the rank over every waiter (an older aged call passed over for a
younger one).
"""

from __future__ import annotations

import asyncio

from policies.pipeline import Outcome
from policies.shared_concurrency import SharedConcurrencyLimiter
from policies.state import memory_backends

DONE = Outcome("2xx", reached=True, status=200, service_s=1.0)


async def _until(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_calls_arriving_during_the_lease_round_trip_are_not_left_behind_vnow():
    shared = SharedConcurrencyLimiter(1, 100, 60.0, None, backends=memory_backends(),
                                      group="r", poll_s=30.0, aging=30.0)
    real_try = shared._try
    gate = asyncio.Event()
    gated = asyncio.Event()

    async def slow_try(tenant: str):
        # The round trip to Redis, held open until the test has queued the newcomers.
        if shared.queued and not gate.is_set():
            gated.set()
            await gate.wait()
        return await real_try(tenant)

    shared._try = slow_try  # type: ignore[method-assign]
    first = await shared.acquire("a")  # a's time moves one call past the class's
    a2 = asyncio.create_task(shared.acquire("a"))  # tagged past the class's time
    await _until(lambda: shared.queued == 1, "a's second call queued")
    first.release(DONE)  # the dispatcher asks for a lease for a2, and waits on "Redis"
    await asyncio.wait_for(gated.wait(), 5.0)
    b1 = asyncio.create_task(shared.acquire("b"))  # a new tenant: at the class's time
    await _until(lambda: shared.queued == 2, "b queued")
    tags = {w.tenant: w.tag for w in shared.waiters()}
    assert tags["b"] < tags["a"]
    gate.set()
    slot = await asyncio.wait_for(a2, 5.0)  # the lease was asked for a2: it gets it
    vnow = shared.vnow.get(1, 0.0)
    behind = [(w.tenant, w.tag) for w in shared.waiters() if w.tag < vnow]
    assert not behind, f"waiting calls tagged below the class's time {vnow}: {behind}"
    slot.release(DONE)
    (await asyncio.wait_for(b1, 5.0)).release(DONE)
    assert (shared.inflight, shared.queued) == (0, 0)
