"""The budget ledger with an injected clock (policies/budget.py): UTC windows, totals per run,
Retry-After from the limit that denied, settling, USD, and forgetting idle counters."""

from __future__ import annotations

import calendar

import pytest

from policies.budget import (
    HOLD_S,
    POLICY_HEADER,
    REMAINING_HEADER,
    RESET_HEADER,
    SETTLE_WAIT_S,
    WARNING_HEADER,
    Budgets,
    clock_from_env,
    hold_for,
    longest_call_s,
    price_usd,
)
from policies.config import BudgetConfig, ModelPrice, RouteConfig
from policies.reasons import Reason, Rejected
from policies.state import memory_backends
from policies.state.admission import MemoryAdmissions
from policies.state.ledger import MemoryLedger
from policies.usage import Usage
from proxy.events import EventLog
from proxy.rejections import rejection_headers
from proxy.routes import Route


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def at(text: str) -> float:
    """Unix seconds of a UTC time written ``YYYY-MM-DD HH:MM:SS``."""
    date, time_ = text.split()
    return float(calendar.timegm((*map(int, date.split("-")), *map(int, time_.split(":")))))


def budgets(clock: Clock, *blocks: dict, pricing: dict | None = None) -> Budgets:
    return Budgets([BudgetConfig.model_validate(b) for b in blocks],
                   {k: ModelPrice.model_validate(v) for k, v in (pricing or {}).items()},
                   memory_backends(), clock)


async def test_daily_budget_frees_at_the_next_utc_day_and_retry_after_says_so():
    clock = Clock(at("2026-03-01 23:00:00"))
    b = budgets(clock, {"output_tokens": "1000/day", "per": "tenant"})
    r = await b.reserve("acme", None, "m", 10, 1000)
    b.settle(r, Usage(10, 1000))
    with pytest.raises(Rejected) as denied:
        await b.reserve("acme", None, "m", 10, 1)
    assert denied.value.reason is Reason.BUDGET_EXHAUSTED
    assert denied.value.retry_after == 3600  # one hour to 00:00 UTC
    headers = rejection_headers(denied.value)
    assert headers["Retry-After"] == "3600"
    assert headers["x-should-retry"] == "false"  # longer than an SDK should wait
    assert headers["RateLimit-Policy"] == '"output_tokens-per-tenant-day";q=1000;w=86400'

    other = await b.reserve("globex", None, "m", 10, 1000)  # another tenant is unaffected
    b.settle(other, None)

    clock.now = at("2026-03-02 00:00:00")
    r = await b.reserve("acme", None, "m", 10, 1000)
    assert b.headers(r)[REMAINING_HEADER] == "0"
    assert b.headers(r)[RESET_HEADER] == "86400"


async def test_only_in_flight_reservations_in_the_way_suggest_a_short_wait():
    clock = Clock(at("2026-03-01 12:00:00"))
    b = budgets(clock, {"tokens": "1000/h", "per": "route"})
    held = await b.reserve("a", None, "m", 100, 800)
    with pytest.raises(Rejected) as denied:
        await b.reserve("b", None, "m", 100, 100)
    assert denied.value.retry_after == SETTLE_WAIT_S
    assert "900 tokens reserved" in denied.value.detail
    b.settle(held, Usage(100, 50))  # it used far less than it held
    r = await b.reserve("b", None, "m", 100, 100)
    assert b.backends.ledger.level("", r.claims[0].key) == (150, 200)


async def test_run_total_never_frees_and_says_do_not_retry():
    clock = Clock(at("2026-03-01 12:00:00"))
    b = budgets(clock, {"tokens": "500/total", "per": "run"})
    r = await b.reserve("t", "run-1", "m", 100, 300)
    b.settle(r, Usage(100, 300))
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", "run-1", "m", 100, 300)
    assert denied.value.retry_after is None
    headers = rejection_headers(denied.value)
    assert headers["x-should-retry"] == "false" and "Retry-After" not in headers
    b.settle(await b.reserve("t", "run-2", "m", 100, 300), None)  # a new run has its own


async def test_retry_after_comes_from_the_limit_that_denied():
    clock = Clock(at("2026-03-01 12:59:30"))
    b = budgets(clock, {"tokens": "1000/min", "per": "tenant"},
                {"tokens": "100000/day", "per": "tenant"})
    r = await b.reserve("t", None, "m", 0, 1000)
    b.settle(r, Usage(0, 1000))
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", None, "m", 0, 10)
    assert denied.value.retry_after == 30  # the minute's end, not the day's
    assert denied.value.detail.startswith("tokens-per-tenant-min")


async def test_a_request_bigger_than_the_whole_budget_is_refused_up_front():
    b = budgets(Clock(0.0), {"output_tokens": "1000/day"})
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", None, "m", 10, 1001)
    assert denied.value.reason is Reason.EXCEEDS_LIMIT
    assert "more than the whole output_tokens-per-tenant-day budget of 1000/day" in (
        denied.value.detail)


async def test_usd_budget_prices_worst_case_and_refuses_unpriced_models():
    pricing = {"cheap": {"input": 1.0, "output": 2.0, "cache_write": 1.25}}
    b = budgets(Clock(0.0), {"usd": "1/day"}, pricing=pricing)
    r = await b.reserve("t", None, "cheap", 100_000, 200_000)
    # worst case: input at the dearest input rate (cache writes), output at the output rate
    assert r.claims[0].amount == pytest.approx(0.125 + 0.4)
    b.settle(r, Usage(100_000, 100_000, cache_read_tokens=0))
    assert b.backends.ledger.level("", r.claims[0].key) == (pytest.approx(0.3), 0.0)
    with pytest.raises(Rejected) as denied:
        await b.reserve("t", None, "mystery-model", 1, 1)
    assert denied.value.reason is Reason.UNPRICED_MODEL


def test_cached_tokens_beyond_the_input_count_are_not_charged_again():
    """The cache parts are parts of the input: 99,999 cached of 10 prompt tokens (a
    misbehaving upstream, a hostile trial) were charged as 10 + 99,999 tokens."""
    price = ModelPrice.model_validate({"input": 1.0, "output": 2.0, "cache_read": 0.5,
                                       "cache_write": 1.25})
    assert price_usd(price, Usage(10, 5, cache_read_tokens=99_999)) == pytest.approx(
        (10 * 0.5 + 5 * 2.0) / 1e6)
    assert price_usd(price, Usage(10, 0, cache_read_tokens=4, cache_write_tokens=99)) == (
        pytest.approx((4 * 0.5 + 6 * 1.25) / 1e6))
    assert price_usd(price, Usage(100, 0, cache_read_tokens=30, cache_write_tokens=20)) == (
        pytest.approx((50 * 1.0 + 30 * 0.5 + 20 * 1.25) / 1e6))


async def test_headers_name_the_binding_limit_and_warn():
    clock = Clock(at("2026-03-01 12:00:00"))
    b = budgets(clock, {"tokens": "1000/day", "per": "tenant", "warn_at": 0.5},
                {"tokens": "10000/day", "per": "route"})
    r = await b.reserve("t", None, "m", 100, 500)
    headers = b.headers(r)
    assert headers[REMAINING_HEADER] == "400"
    assert headers[POLICY_HEADER] == '"tokens-per-tenant-day";q=1000;w=86400'
    assert headers[RESET_HEADER] == str(12 * 3600)
    assert headers[WARNING_HEADER] == '"tokens-per-tenant-day";used=0.600'
    b.settle(r, Usage(100, 100))
    assert b.remaining("tokens", "tenant", "t") == 800
    assert b.reserved("tokens", "tenant", "t") == 0


async def test_ended_windows_and_idle_runs_are_forgotten():
    clock = Clock(at("2026-03-01 12:00:00"))
    b = budgets(clock, {"tokens": "1000/min", "per": "tenant"},
                {"tokens": "1000/total", "per": "run", "ttl": "1h"})
    for tenant in ("a", "b", "c"):
        b.settle(await b.reserve(tenant, "r", "m", 1, 1), Usage(1, 1))
    ledger = b.backends.ledger
    assert len(ledger) == 6
    clock.now += 2 * 3600 + 60  # past the run's TTL and the reap grace, a sweep due
    b.settle(await b.reserve("d", "r", "m", 1, 1), None)
    assert len(ledger) == 0


def test_test_clock_starts_at_its_first_reading():
    clock = clock_from_env({"SLUICE_TEST_NOW": "1000"})
    assert 1000 <= clock() < 1001


def test_a_routes_longest_call_counts_its_queues_attempts_waits_and_operations():
    def longest(fanout_wait_s: float = 0.0, **blocks: object) -> float:
        return longest_call_s(RouteConfig.model_validate(
            {"name": "r", "path_prefix": "/r/", "upstream": "http://127.0.0.1:1",
             "protocol": "openai", **blocks}), fanout_wait_s)

    assert longest() == 600  # timeouts.total
    assert longest(timeouts={"total": "1h"}) == 3600
    # 5 s in the queue, 3 attempts of 600 s and 2 waits of up to 60 s (max_retry_after)
    # stretched by a quarter (a Retry-After's jitter).
    assert longest(concurrency={"limit": 1, "queue": 1}, retry={"attempts": 3}) == 1955
    # The deadline bounds the waits for answers, not the last answer's body (the route's
    # total does): a review found a 1 h stream held for 15 min under a 30 s deadline.
    assert longest(retry={"attempts": 3, "deadline": "30s"}, timeouts={"total": "1h"}) == 3630
    # Queues in turn add up: the top-level fanout's, the route's fanout and concurrency,
    # the model's concurrency.
    assert longest(7.0, fanout={"width": 2, "max_wait": "20s"},
                   concurrency={"limit": 1, "queue": 1, "max_wait": "30s"},
                   models={"m": {"concurrency": {"limit": 1, "queue": 1,
                                                 "max_wait": "40s"}}}) == 7 + 20 + 30 + 40 + 600
    # A model's own timeouts replace the route's for its calls.
    assert longest(models={"slow": {"timeouts": {"total": "2h"}}}) == 7200


async def test_a_call_running_longer_than_15_minutes_keeps_its_reservation():
    """The hold was a fixed 15 min whatever ``timeouts.total`` said: a call streaming for
    an hour lost its reservation at 15 min, the next call was admitted beside it, and a
    1000-token budget ended 1840 spent (found by a hostile trial)."""
    config = RouteConfig.model_validate({
        "name": "r", "path_prefix": "/r/", "upstream": "http://127.0.0.1:1", "protocol": "openai",
        "timeouts": {"total": "1h"}, "budget": {"tokens": "1000/day", "per": "tenant"}})
    clock = Clock(at("2026-03-01 00:00:00"))
    state = memory_backends()
    state.ledger = MemoryLedger(clock=clock)
    state.admissions = MemoryAdmissions(state.rates, state.ledger)
    route = Route(config, EventLog(None), clock=clock, state=state)
    budgets = route.budgets
    assert budgets is not None and budgets.hold_s == hold_for(config) == 3600 + 60
    # A route of short calls: a killed replica's reservations go after 2 minutes, not 15.
    short = config.model_copy(update={"timeouts": config.timeouts.model_copy(
        update={"total": 5.0})})
    assert hold_for(short) == HOLD_S == 120.0
    first = await budgets.reserve("acme", None, "m", 10, 990)
    clock.now += 50 * 60  # 50 minutes into the call
    with pytest.raises(Rejected) as denied:
        await budgets.reserve("acme", None, "m", 10, 990)
    assert denied.value.reason is Reason.BUDGET_EXHAUSTED
    budgets.settle(first, Usage(10, 900))
    assert budgets.remaining("tokens", "tenant", "acme") == 90
