"""What a budget refusal tells: the limit its RateLimit fields name is the one whose wait it
gives (a hostile trial's F1), and the wait while only calls in flight hold the room (F2)."""

from __future__ import annotations

import pytest

from policies.budget import Budgets, HoldTimes
from policies.reasons import Reason, Rejected
from policies.usage import Usage
from proxy.rejections import rejection_headers
from tests.test_budget_ledger import Clock, at, budgets


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
    """Time ``b``'s reservations by ``monotonic`` (seconds)."""
    b.holds = HoldTimes(monotonic)


async def refused(b: Budgets, tenant: str, prompt: int, completion: int) -> Rejected:
    """What ``b`` refuses a call of ``tenant``'s to model ``m`` with (it must refuse)."""
    with pytest.raises(Rejected) as denied:
        await b.reserve(tenant, None, "m", prompt, completion)
    return denied.value


async def test_calls_in_flight_holding_the_room_are_waited_for_as_long_as_they_run():
    clock, monotonic = Clock(at("2026-03-01 12:00:00")), Clock(100.0)
    b = budgets(clock, {"tokens": "1000/h", "per": "tenant"})
    held_for(b, monotonic)
    held = await b.reserve("t", None, "m", 100, 700)
    monotonic.now += 3  # running 3 s, nothing ended yet: at least that long
    denied = await refused(b, "t", 100, 200)
    assert denied.retry_after == 3
    monotonic.now += 5
    b.settle(held, Usage(100, 50))  # an 8 s call
    held = await b.reserve("t", None, "m", 100, 700)
    monotonic.now += 0.5
    denied = await refused(b, "t", 100, 200)
    assert denied.retry_after == 7.5  # the mean call, less the 0.5 s it has run
    headers = rejection_headers(denied)
    assert (headers["Retry-After"], headers["x-should-retry"]) == ("8", "true")
    # A tenant none of whose calls has ended here is judged by the limit's calls: its call of
    # 30 s has run past their 8 s, so its end is due.
    other = await b.reserve("u", None, "m", 100, 700)
    monotonic.now += 30
    denied = await refused(b, "u", 100, 200)
    assert denied.retry_after == 1
    b.settle(other, None)
    b.settle(held, None)


async def test_one_call_stuck_in_flight_does_not_set_the_wait_younger_ones_free():
    # A review: the oldest call's age was the wait, so one call running an hour made every
    # refusal say "an hour, do not retry" while calls of 2 s freed the room.
    clock, monotonic = Clock(at("2026-03-01 00:00:10")), Clock(100.0)
    b = budgets(clock, {"tokens": "1000/day", "per": "route"})
    held_for(b, monotonic)
    b.settle(await b.reserve("t", None, "m", 10, 10), Usage(10, 10))  # calls take 0 s...
    monotonic.now += 2
    done = await b.reserve("t", None, "m", 10, 10)
    monotonic.now += 2
    b.settle(done, Usage(10, 10))  # ...and 2 s, the mean about 0.2 s
    stuck = await b.reserve("t", None, "m", 100, 400)
    monotonic.now += 3600
    young = [await b.reserve("t", None, "m", 100, 50) for _ in range(3)]
    monotonic.now += 0.1
    denied = await refused(b, "t", 100, 300)
    assert denied.retry_after == 1  # the young calls' end is near: the least wait
    assert rejection_headers(denied)["x-should-retry"] == "true"
    for reservation in (stuck, *young):
        b.settle(reservation, None)


async def test_a_wait_for_calls_in_flight_stays_within_what_the_sdks_honour():
    clock, monotonic = Clock(at("2026-03-01 00:00:10")), Clock(100.0)
    b = budgets(clock, {"tokens": "1000/day", "per": "tenant"})
    held_for(b, monotonic)
    held = await b.reserve("t", None, "m", 100, 800)
    monotonic.now += 3600  # its mean unknown, the call has run an hour
    denied = await refused(b, "t", 100, 200)
    assert denied.retry_after == 60
    assert rejection_headers(denied)["x-should-retry"] == "true"
    b.settle(held, None)


async def test_calls_in_flight_before_midnight_are_waited_for_until_the_day_ends_at_most():
    clock, monotonic = Clock(at("2026-03-01 23:59:54")), Clock(100.0)
    b = budgets(clock, {"tokens": "500/day", "per": "tenant"})
    held_for(b, monotonic)
    held = await b.reserve("t", None, "m", 30, 400)
    monotonic.now += 10
    denied = await refused(b, "t", 30, 100)
    assert denied.retry_after == 6  # midnight, sooner than the call's end
    b.settle(held, None)


async def test_one_tenants_slow_calls_do_not_set_anothers_wait():
    # A review: one mean per route told a tenant of 1 s calls to wait 264 s, another
    # tenant's calls taking 300 s.
    clock, monotonic = Clock(at("2026-03-01 00:00:10")), Clock(100.0)
    b = budgets(clock, {"tokens": "1000/day", "per": "tenant"})
    held_for(b, monotonic)
    slow = await b.reserve("a", None, "m", 10, 10)
    monotonic.now += 300
    b.settle(slow, Usage(10, 10))
    fast = await b.reserve("b", None, "m", 10, 10)
    monotonic.now += 1
    b.settle(fast, Usage(10, 10))
    held = await b.reserve("b", None, "m", 100, 800)
    monotonic.now += 0.2
    denied = await refused(b, "b", 100, 200)
    assert denied.retry_after == 1  # b's own calls: 1 s, 0.2 s of it run
    b.settle(held, None)


async def test_a_new_window_keeps_what_the_limits_calls_take():
    # A review: the means were kept per window, so each new minute (or run) forgot them and
    # told 1 s while calls of 8 s held the room.
    clock, monotonic = Clock(at("2026-03-01 12:00:05")), Clock(100.0)
    b = budgets(clock, {"tokens": "1000/min", "per": "tenant"})
    held_for(b, monotonic)
    first = await b.reserve("t", None, "m", 100, 100)
    monotonic.now += 8
    b.settle(first, Usage(100, 100))  # an 8 s call, in minute 12:00
    clock.now = at("2026-03-01 12:01:05")
    held = await b.reserve("t", None, "m", 100, 700)
    monotonic.now += 0.5
    denied = await refused(b, "t", 100, 200)
    assert denied.retry_after == 7.5
    b.settle(held, None)
