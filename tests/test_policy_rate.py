"""Unit tests of ``policies.rate`` on the memory state (one process)."""

from __future__ import annotations

import asyncio

import pytest

from policies.config import RateConfig
from policies.pipeline import REFUSED, Call, Outcome
from policies.rate import RateLimiter, finish_now
from policies.reasons import Reason, Rejected
from policies.state import memory_backends
from policies.state.rate import MemoryRateBuckets, Take


def limiter(route: str | None = None, tenant: str | None = None,
            tokens: str | None = None) -> RateLimiter:
    """A RateLimiter from config text, e.g. ``limiter("2/min", tenant="1/h")``."""
    config: dict = {}
    if route:
        config["requests"] = route
    if tenant:
        config["per_tenant"] = {"requests": tenant}
    if tokens:
        config["tokens"] = tokens
    return RateLimiter(RateConfig.model_validate(config), memory_backends(), "r")


def call(tenant: str) -> Call:
    return Call(request_id="r", route="r", method="POST", path="/r/", headers={}, body=b"",
                tenant=tenant)


async def test_burst_of_n_then_429_with_the_time_to_the_next_slot():
    limits = limiter("3/min")
    for _ in range(3):
        await limits.admit(call("t"))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("t"))
    assert limited.value.reason is Reason.RATE_LIMITED
    assert 19.9 < limited.value.retry_after <= 20.0  # one request per 60/3 s
    assert limited.value.policy == ("requests", 3, 60, 0)
    with pytest.raises(Rejected) as again:  # a refused request is not charged...
        await limits.admit(call("t"))
    # ...but is told the slot after the one the first refusal was told (policies.rate.Promises)
    assert 39.9 < again.value.retry_after <= 40.0
    assert finish_now(limits.backends.rates.available("r", [Take("requests", 3, 60.0)])) == (0,)


async def test_waiting_retry_after_is_enough():
    limits = limiter("4/s")
    for _ in range(4):
        await limits.admit(call("t"))
    for _ in range(3):  # again and again: a lone caller's own promises never delay it
        with pytest.raises(Rejected) as limited:
            await limits.admit(call("t"))
        await asyncio.sleep(limited.value.retry_after)
        await limits.admit(call("t"))


async def test_tenants_have_their_own_buckets():
    limits = limiter(tenant="2/min")
    await limits.admit(call("a"))
    await limits.admit(call("a"))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("a"))
    assert limited.value.policy == ("requests-per-tenant", 2, 60, 0)
    await limits.admit(call("b"))
    await limits.admit(call("b"))


async def test_a_tenant_refused_by_its_own_quota_does_not_spend_the_routes():
    limits = limiter("2/min", tenant="1/min")
    await limits.admit(call("a"))
    with pytest.raises(Rejected):
        await limits.admit(call("a"))  # tenant a is over; the route's second unit stays free
    await limits.admit(call("b"))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("c"))
    assert limited.value.policy == ("requests", 2, 60, 0)


async def test_a_request_refused_by_the_route_does_not_spend_the_tenants_quota():
    limits = limiter("1/min", tenant="1/h")
    await limits.admit(call("a"))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("b"))
    assert limited.value.policy == ("requests", 1, 60, 0)  # refused by the route...
    # ...so once the route has room (a reload drops its rate), b's own quota is intact
    limits.reconfigure(RateConfig.model_validate({"per_tenant": {"requests": "1/h"}}))
    await limits.admit(call("b"))


async def test_units_of_a_call_refused_later_are_given_back_and_kept_once_served():
    limits = limiter("2/min", tenant="1/min")
    units = await limits.admit(call("a"))
    units.release(REFUSED)  # e.g. queue_full or budget_exhausted after the rate step
    units = await limits.admit(call("a"))  # tenant a's only unit is back
    units.release(Outcome("2xx", reached=True, status=200))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("a"))  # served: the unit stays spent
    assert limited.value.policy == ("requests-per-tenant", 1, 60, 0)
    await limits.admit(call("b"))  # the route had its refused unit back too


async def test_token_take_bigger_than_the_bucket_is_exceeds_limit_and_takes_nothing():
    limits = limiter("5/min", tokens="100/min")
    with pytest.raises(Rejected) as refused:
        limits.token_take(101)
    assert refused.value.reason is Reason.EXCEEDS_LIMIT and refused.value.retry is False
    units = await limits.take([*limits.request_takes("t"), limits.token_take(100)])
    with pytest.raises(Rejected) as limited:
        await limits.take([*limits.request_takes("t"), limits.token_take(1)])
    assert limited.value.reason is Reason.TOKEN_RATE_LIMITED
    assert 0.5 < limited.value.retry_after <= 0.6  # one token per 0.6 s
    units.release(REFUSED)  # units and tokens back together
    await limits.take([*limits.request_takes("t"), limits.token_take(100)])


async def test_tenant_state_is_forgotten_once_drained():
    """Issue 13: distinct tenants must not grow memory without bound. A tenant's bucket is
    gone once it has drained (the memory twin's sweep), whatever the number of tenants."""
    now = [1_000_000_000_000_000]
    backends = memory_backends()
    backends.rates = MemoryRateBuckets(lambda: now[0] * 1000)
    limits = RateLimiter(RateConfig.model_validate({"per_tenant": {"requests": "5/s"}}),
                         backends, "r")
    for i in range(20_000):
        units = await limits.admit(call(f"tenant-{i}"))
        units.release(Outcome("2xx", reached=True, status=200))
    assert len(backends.rates) == 20_000
    now[0] += 61_000_000  # drained long ago, and a sweep is due
    await limits.admit(call("late"))
    assert len(backends.rates) == 1


async def test_calls_of_one_tenant_in_flight_together_each_give_their_unit_back():
    """On a memory route every call of a tenant holds the same units object; each release
    still gives back (or keeps) its own call's unit."""
    limits = limiter("3/min", tenant="2/min")
    first, second = await limits.admit(call("a")), await limits.admit(call("a"))
    with pytest.raises(Rejected):
        await limits.admit(call("a"))
    first.release(REFUSED)
    second.release(Outcome("2xx", reached=True, status=200))
    await limits.admit(call("a"))  # the refused call's unit is back, the served one's is not
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("a"))
    assert limited.value.policy == ("requests-per-tenant", 2, 60, 0)
    second.release(None)  # a call that never reached the upstream: its unit comes back
    await limits.admit(call("b"))  # the route's third unit...
    await limits.admit(call("a"))  # ...and tenant a's second are free again
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("c"))
    assert limited.value.policy == ("requests", 3, 60, 0)


async def test_a_sweep_due_by_size_midway_through_a_take_keeps_what_it_took():
    """The memory buckets sweep when a new bucket finds them at their size threshold, which
    can be midway through an admission: a bucket it already read may be dropped as drained,
    and must still be stored with this take."""
    now = [1_000_000_000_000_000]
    buckets = MemoryRateBuckets(lambda: now[0] * 1000)
    route = Take("requests", 10_000, 1.0)
    for i in range(4095):  # 4,096 buckets with the route's
        finish_now(buckets.admit("r", [Take(f"tenant:{i}", 5, 1.0), route]))
    now[0] += 1_000_000  # every bucket has drained; the minute's sweep is not due yet
    taken = finish_now(buckets.admit("r", [route, Take("tenant:late", 5, 1.0)]))
    assert taken.admitted and taken.remaining == (9_999, 4)
    assert len(buckets) == 2
    assert finish_now(buckets.available("r", [route])) == (9_999,)
