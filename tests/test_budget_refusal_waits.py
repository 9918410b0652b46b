"""What a budget refusal tells: the limit its RateLimit fields name is the one whose wait it
gives (a hostile trial's F1), and the wait while only calls in flight hold the room (F2)."""

from __future__ import annotations

import calendar

import pytest

from policies.budget import Budgets
from policies.config import BudgetConfig
from policies.reasons import Reason, Rejected
from policies.state import memory_backends
from policies.usage import Usage
from proxy.rejections import rejection_headers


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def at(text: str) -> float:
    """Unix seconds of a UTC time written ``YYYY-MM-DD HH:MM:SS``."""
    date, time_ = text.split()
    return float(calendar.timegm((*map(int, date.split("-")), *map(int, time_.split(":")))))


def budgets(clock: Clock, *blocks: dict) -> Budgets:
    return Budgets([BudgetConfig.model_validate(b) for b in blocks], {}, memory_backends(),
                   clock)


async def test_two_spent_windows_name_the_one_whose_wait_is_given():
    clock = Clock(at("2026-03-01 03:00:10"))
    b = budgets(clock, {"tokens": "1000/min", "per": "tenant"},
                {"tokens": "1000/day", "per": "tenant"})
    b.settle(await b.reserve("t", None, "m", 30, 900), Usage(30, 900))
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", None, "m", 30, 200)
    refusal = denied.value
    assert refusal.reason is Reason.BUDGET_EXHAUSTED
    day_left = 86400 - 3 * 3600 - 10
    assert refusal.retry_after == day_left
    assert refusal.policy == ("tokens-per-tenant-day", 1000, 86400, 70)
    headers = rejection_headers(refusal)
    assert headers["RateLimit-Policy"] == '"tokens-per-tenant-day";q=1000;w=86400'
    assert headers["RateLimit"] == f'"tokens-per-tenant-day";r=70;t={day_left}'
    assert headers["Retry-After"] == str(day_left)


def held_for(b: Budgets, monotonic: Clock) -> None:
    """Time ``b``'s reservations by ``monotonic`` (seconds); on a build without hold times,
    the tests' own assertions fail (the fixed 1 s wait)."""
    try:
        from policies.budget import HoldTimes
    except ImportError:
        return
    b.holds = HoldTimes(monotonic)


async def test_calls_in_flight_holding_the_room_are_waited_for_as_long_as_they_run():
    clock, monotonic = Clock(at("2026-03-01 12:00:00")), Clock(100.0)
    b = budgets(clock, {"tokens": "1000/h", "per": "tenant"})
    held_for(b, monotonic)
    held = await b.reserve("t", None, "m", 100, 700)
    monotonic.now += 3  # running 3 s, nothing ended yet: at least that long
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", None, "m", 100, 200)
    assert denied.value.retry_after == 3
    monotonic.now += 5
    b.settle(held, Usage(100, 50))  # an 8 s call
    held = await b.reserve("t", None, "m", 100, 700)
    monotonic.now += 0.5
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", None, "m", 100, 200)
    assert denied.value.retry_after == 8  # the mean call
    headers = rejection_headers(denied.value)
    assert (headers["Retry-After"], headers["x-should-retry"]) == ("8", "true")
    # Another tenant's calls say nothing of when this one's come back: the mean alone.
    other = await b.reserve("u", None, "m", 100, 700)
    monotonic.now += 30
    with pytest.raises(Rejected) as denied:
        await b.reserve("u", None, "m", 100, 200)
    assert denied.value.retry_after == 30
    b.settle(other, None)
    b.settle(held, None)


async def test_calls_in_flight_before_midnight_are_waited_for_until_the_day_ends_at_most():
    clock, monotonic = Clock(at("2026-03-01 23:59:54")), Clock(100.0)
    b = budgets(clock, {"tokens": "500/day", "per": "tenant"})
    held_for(b, monotonic)
    held = await b.reserve("t", None, "m", 30, 400)
    monotonic.now += 10
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", None, "m", 30, 100)
    assert denied.value.retry_after == 6  # midnight, sooner than the call's end
    b.settle(held, None)

