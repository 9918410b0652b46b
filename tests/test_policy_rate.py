"""Unit tests of ``policies.rate``, in-process."""

from __future__ import annotations

import asyncio

import pytest

import policies.rate
from policies.config import Rate, RateConfig
from policies.pipeline import REFUSED, Call, Outcome
from policies.rate import Bucket, RateLimiter
from policies.reasons import Reason, Rejected


def rate(count: int, period_s: int) -> Rate:
    return Rate(count, period_s, f"{count}/{period_s}s")


def limiter(route: str | None = None, tenant: str | None = None) -> RateLimiter:
    """A RateLimiter from config text, e.g. ``limiter("2/min", tenant="1/h")``."""
    config: dict = {}
    if route:
        config["requests"] = route
    if tenant:
        config["per_tenant"] = {"requests": tenant}
    return RateLimiter(RateConfig.model_validate(config))


def call(tenant: str) -> Call:
    return Call(request_id="r", route="r", method="POST", path="/r/", headers={}, body=b"",
                tenant=tenant)


async def test_burst_of_n_then_429_with_the_time_to_the_next_slot():
    bucket = Bucket(rate(3, 60), "requests")
    for _ in range(3):
        bucket.take()
    with pytest.raises(Rejected) as limited:
        bucket.take()
    assert limited.value.reason is Reason.RATE_LIMITED
    assert 19.9 < limited.value.retry_after <= 20.0  # one request per 60/3 s
    assert limited.value.policy == ("requests", 3, 60)
    with pytest.raises(Rejected) as again:  # a refused request is not charged
        bucket.take()
    assert 19.9 < again.value.retry_after <= 20.0


async def test_waiting_retry_after_is_enough():
    bucket = Bucket(rate(4, 1), "requests")
    for _ in range(4):
        bucket.take()
    with pytest.raises(Rejected) as limited:
        bucket.take()
    await asyncio.sleep(limited.value.retry_after)
    bucket.take()


async def test_tenants_have_their_own_buckets():
    limits = limiter(tenant="2/min")
    await limits.admit(call("a"))
    await limits.admit(call("a"))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("a"))
    assert limited.value.policy == ("requests-per-tenant", 2, 60)
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
    assert limited.value.policy == ("requests", 2, 60)


async def test_a_request_refused_by_the_route_does_not_spend_the_tenants_quota():
    limits = limiter("1/min", tenant="1/h")
    await limits.admit(call("a"))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("b"))
    assert limited.value.policy == ("requests", 1, 60)  # refused by the route...
    limits.route_bucket = None  # ...so once the route has room, b's own quota is intact
    await limits.admit(call("b"))


async def test_idle_tenant_buckets_are_dropped_first_when_full(monkeypatch):
    monkeypatch.setattr(policies.rate, "MAX_TENANT_BUCKETS", 3)
    limits = limiter(tenant="1/h")
    await limits.admit(call("a"))
    limits._tenant_bucket("idle")  # seen, never charged: nothing to forget
    await limits.admit(call("c"))
    await limits.admit(call("d"))  # full: the idle bucket goes, a's spent quota is remembered
    assert "idle" not in limits._tenants
    with pytest.raises(Rejected):
        await limits.admit(call("a"))
    assert len(limits._tenants) == 3


async def test_units_of_a_call_refused_later_are_given_back_and_kept_once_served():
    limits = limiter("2/min", tenant="1/min")
    units = await limits.admit(call("a"))
    units.release(REFUSED)  # e.g. queue_full or budget_exhausted after the rate step
    units = await limits.admit(call("a"))  # tenant a's only unit is back
    units.release(Outcome("2xx", reached=True, status=200))
    with pytest.raises(Rejected) as limited:
        await limits.admit(call("a"))  # served: the unit stays spent
    assert limited.value.policy == ("requests-per-tenant", 1, 60)
    await limits.admit(call("b"))  # the route had its refused unit back too
