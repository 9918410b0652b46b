"""Refused callers of one rate bucket are told successive slots, not one instant (a hostile
trial's F3: 12 clients on 2/s were all told the same 10 ms slot, ~11 refusals per success),
while a lone caller's wait stays exact (:class:`policies.rate.Promises`)."""

from __future__ import annotations

import math

import pytest

from policies import rate as rate_module
from policies.config import RateConfig
from policies.pipeline import Call
from policies.rate import RateLimiter
from policies.reasons import Rejected
from policies.state import memory_backends
from proxy.rejections import rejection_headers


def limiter(config: dict) -> RateLimiter:
    return RateLimiter(RateConfig.model_validate(config), memory_backends(), "r")


def call(tenant: str = "t") -> Call:
    return Call(request_id="r", route="r", method="POST", path="/r/", headers={}, body=b"",
                tenant=tenant)


async def refused(limits: RateLimiter, tenant: str = "t") -> Rejected:
    with pytest.raises(Rejected) as refusal:
        await limits.admit(call(tenant))
    return refusal.value


async def test_callers_refused_together_are_told_one_interval_apart():
    limits = limiter({"requests": "2/min"})  # one unit per 30 s
    for _ in range(2):
        await limits.admit(call())
    waits = [(await refused(limits)).retry_after for _ in range(3)]
    assert [round(w) for w in waits] == [30, 60, 90]
    # Never more than one period (60 s) past a caller's own wait (30 s): a review saw
    # callers that ignore their waits push everyone else's to 409 s on 2/s.
    headers = rejection_headers(await refused(limits))
    assert headers["Retry-After"] == "90"  # whole seconds, the ceiling of retry-after-ms
    assert math.ceil(int(headers["retry-after-ms"]) / 1000) == 90
    # Another tenant's bucket has promises of its own.
    tenants = limiter({"per_tenant": {"requests": "1/min"}})
    await tenants.admit(call("a"))
    await tenants.admit(call("b"))
    assert round((await refused(tenants, "a")).retry_after) == 60
    assert round((await refused(tenants, "b")).retry_after) == 60
    assert round((await refused(tenants, "a")).retry_after) == 120


async def test_token_refusals_are_spaced_by_their_own_amounts():
    limits = limiter({"tokens": "600/min"})  # 10 tokens per second
    await limits.take([limits.token_take(600)])
    waits = []
    for amount in (100, 50, 100):
        with pytest.raises(Rejected) as refusal:
            await limits.take([limits.token_take(amount)])
        waits.append(round(refusal.value.retry_after))
    # Each conforms once the bucket drained its own amount and the promised ones before it.
    assert waits == [10, 15, 25]


def test_promises_lapse_and_stay_bounded(monkeypatch):
    monkeypatch.setattr(rate_module, "PROMISES_KEPT", 2)
    promises = rate_module.Promises()
    assert promises.told("a", 1.0, 1, 1, 1.0, now=0.0) == 1.0
    assert promises.told("a", 1.0, 1, 1, 1.0, now=0.0) == 2.0  # the next slot
    assert promises.told("a", 1.0, 1, 1, 1.0, now=10.0) == 1.0  # lapsed: its own wait
    promises.told("b", 1.0, 1, 1, 1.0, now=10.0)
    promises.told("c", 1.0, 1, 1, 1.0, now=20.0)  # full: a and b lapsed, so dropped
    assert promises.told("c", 1.0, 1, 1, 1.0, now=20.0) == 2.0
    assert len(promises._tat) == 1


def test_callers_that_ignore_their_waits_push_no_one_past_a_period():
    promises = rate_module.Promises()
    # 2/s: a caller retrying every 100 ms, refused each time, beside obeying ones.
    told = [promises.told("r", 0.5, 1, 2, 1.0, now=step / 10) for step in range(600)]
    assert max(told) <= 0.5 + 1.0 + 1e-9  # its own wait and one period, after a minute of it


def test_a_full_map_drops_its_oldest_promise_not_every_buckets(monkeypatch):
    monkeypatch.setattr(rate_module, "PROMISES_KEPT", 2)
    promises = rate_module.Promises()
    promises.told("tenant-a", 50.0, 1, 1, 100.0, now=0.0)
    promises.told("route", 1.0, 1, 1, 1.0, now=0.0)
    promises.told("tenant-b", 50.0, 1, 1, 100.0, now=0.0)  # full, none lapsed
    assert promises.told("route", 1.0, 1, 1, 1.0, now=0.0) == 2.0  # its promise kept
