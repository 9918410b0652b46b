"""Per-run and per-tenant state stays bounded whatever ids callers send (issue 13, memory):
the run registry forgets the least recently seen runs that hold nothing, and keeps every run
whose state a limit needs (a call live, a ``max_requests`` count, a cancellation, a child); the
concurrency limiter keeps fair-queueing state only for tenants with calls live."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from bench.scheduler import SimLoop
from policies import runs as runs_module
from policies.concurrency import ConcurrencyLimiter
from policies.config import RouteConfig, RunConfig
from policies.pipeline import Call, Outcome
from policies.reasons import Reason, Rejected
from policies.runs import RunLimits, RunRegistry, RunTracker
from proxy.events import EventLog
from proxy.routes import URL_KEPT_CHARS, URLS_KEPT, Route


def _call(run: str, parent: str | None = None) -> Call:
    return Call(request_id="r", route="x", method="POST", path="/x/", headers={}, body=b"",
                tenant="t", run=run, parent_run=parent)


def run_ids(registry: RunRegistry) -> set[str]:
    """The ids of the runs remembered (these tests' runs are all of tenant ``t``)."""
    return {run for _, run in registry.runs}


def test_endless_distinct_runs_hold_at_most_max_runs():
    """Every run id was kept a day after its last call: ~0.9 KiB per run, so a million
    distinct runs in a day held ~0.9 GB."""
    registry = RunRegistry()
    cap = runs_module.MAX_RUNS
    tracemalloc.start()
    try:
        for n in range(3 * cap):
            registry.resolve(f"run-{n}", None, f"tenant-{n}")
        gc.collect()
        after_three = tracemalloc.get_traced_memory()[0]
        for n in range(3 * cap, 9 * cap):
            registry.resolve(f"run-{n}", None, f"tenant-{n}")
        gc.collect()
        after_nine = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(registry.runs) == cap
    assert set(registry.runs) == {(f"tenant-{n}", f"run-{n}") for n in range(8 * cap, 9 * cap)}
    assert after_nine < after_three * 1.05, (after_three, after_nine)


def test_the_least_recently_seen_go_first_and_runs_holding_state_stay(monkeypatch):
    monkeypatch.setattr(runs_module, "MAX_RUNS", 20)
    registry = RunRegistry()
    regular = registry.resolve("regular", None, "t")
    counted = registry.resolve("counted", None, "t")
    assert registry.take_request("x", [counted], 5) is None
    live = registry.resolve("live", None, "t")
    live.live.add(runs_module.LiveCall(_call("live"), None))
    registry.cancel("cancelled", 600.0, "t")
    parent = registry.resolve("parent", None, "t")
    child = registry.resolve("child", "parent", "t")
    child.live.add(runs_module.LiveCall(_call("child", "parent"), None))
    regular.calls = 3
    for n in range(200):
        registry.resolve(f"burst-{n}", None, "t")
        registry.resolve("regular", None, "t")  # seen again and again: never the oldest
    assert len(registry.runs) == 20
    kept = {"regular", "counted", "live", "cancelled", "parent", "child"}
    assert kept <= run_ids(registry)
    assert registry.runs[("t", "regular")] is regular and regular.calls == 3
    assert registry.resolve("child", "parent", "t").parent is parent
    # Once the child's call ends and the child is forgotten, its parent can go too.
    child.live.clear()
    for n in range(200):
        registry.resolve(f"later-{n}", None, "t")
    assert not {"child", "parent", "regular"} & run_ids(registry)
    assert {"counted", "live", "cancelled"} <= run_ids(registry)


async def test_a_run_budgets_spend_survives_a_flood_of_new_runs(monkeypatch):
    """Forgetting a run that had spent its ``max_requests`` would let it start over."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 10)
    registry = RunRegistry()
    tracker = RunTracker(registry)
    limits = RunLimits(registry, "x", RunConfig(max_requests=2), None)

    async def call(run: str) -> None:
        tracked = await tracker.admit(_call(run))
        try:
            counted = await limits.admit(_call(run))
        except Rejected:
            tracked.release(Outcome("rejected", False))
            raise
        counted.release(Outcome("2xx", True, 200, 0.01))
        tracked.release(Outcome("2xx", True, 200, 0.01))

    await call("spender")
    await call("spender")
    for n in range(100):
        registry.resolve(f"flood-{n}", None, "t")
    assert len(registry.runs) == 10
    with pytest.raises(Rejected) as refused:
        await call("spender")
    assert refused.value.reason is Reason.RUN_BUDGET_EXHAUSTED
    assert "spender" in refused.value.detail


async def test_a_run_past_its_max_duration_survives_a_flood_of_new_runs(monkeypatch):
    """Hostile trial: forgetting a run limited only by ``max_duration`` forgot its first
    call's time, so once 10,000 other runs had been seen it started over, its time reset."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 10)
    now = [0.0]
    registry = RunRegistry(clock=lambda: now[0])
    tracker = RunTracker(registry)
    limits = RunLimits(registry, "x", RunConfig(max_duration="60s"), None)

    async def call(run: str) -> None:
        tracked = await tracker.admit(_call(run))
        try:
            await limits.admit(_call(run))
        finally:
            tracked.release(Outcome("2xx", True, 200, 0.01))

    await call("long")
    now[0] = 61.0
    for n in range(100):
        await call(f"flood-{n}")
    with pytest.raises(Rejected) as refused:
        await call("long")
    assert refused.value.reason is Reason.RUN_BUDGET_EXHAUSTED


def test_runs_holding_only_counts_are_bounded_too(monkeypatch, caplog):
    """Seen in a hostile trial: with ``run.max_requests`` set every run holds a count, so
    none was ever forgotten: 40,000 run ids kept 24,500 runs (past ``MAX_RUNS``) for a day."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 10)
    monkeypatch.setattr(runs_module, "MAX_COUNTED_RUNS", 20)
    registry = RunRegistry()
    live = registry.resolve("live", None, "t")
    live.live.add(runs_module.LiveCall(_call("live"), None))
    assert registry.take_request("x", [live], 5) is None
    for n in range(200):
        info = registry.resolve(f"run-{n}", None, "t")
        assert registry.take_request("x", [info], 5) is None
    assert len(registry.runs) <= 20
    assert {"live", "run-199"} <= run_ids(registry)  # the live one, and the newest
    warnings = [r.getMessage() for r in caplog.records if "runs remembered" in r.getMessage()]
    # One text each time, which the proxy's repeat filter folds (a run id made each unique).
    assert warnings and set(warnings) == {
        "more than 20 runs remembered: runs holding only max_requests counts are forgotten, "
        "their counts with them"}


def test_the_depth_of_a_remembered_tree_is_kept(monkeypatch):
    """A run's ancestors are not forgotten while it is remembered (a parent with a child
    stays), so its depth, which ``fanout.depth`` limits, is not reset by a flood of runs."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 10)
    registry = RunRegistry()
    registry.resolve("root", None, "t")
    registry.resolve("mid", "root", "t")
    leaf = registry.resolve("leaf", "mid", "t")
    assert leaf.depth == 2
    for n in range(100):
        registry.resolve(f"flood-{n}", None, "t")
        registry.resolve("leaf", "mid", "t")
    assert registry.resolve("leaf", "mid", "t").depth == 2
    assert {"root", "mid", "leaf"} <= run_ids(registry)


# --- the concurrency limiter's fair-queueing state -------------------------------------------


def _on_sim_loop(coro):
    loop = SimLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_a_hundred_thousand_distinct_tenants_leave_the_limiter_empty():
    """Each tenant's virtual time was kept for ever once it had been served without queueing
    (the route's time never passed it): one entry per tenant ever seen."""
    async def main() -> int:
        limiter = ConcurrencyLimiter(4, 8, 30.0, None)
        largest = 0
        for batch in range(100_000 // 8):
            tenants = [f"t{batch}-{i}" for i in range(8)]  # 4 served at once, 4 queued
            tasks = [asyncio.ensure_future(limiter.acquire(t)) for t in tenants]
            await asyncio.sleep(0)
            assert limiter.queued == 4
            largest = max(largest, len(limiter._vtime))
            for tenant, task in zip(tenants, tasks, strict=True):
                charged = await task
                limiter.release(tenant, 0.01, charged)
        assert (limiter.inflight, limiter.queued) == (0, 0)
        assert limiter._vtime == {} and limiter._by_tenant == {}
        assert limiter._tenant_service == {}
        return largest

    assert _on_sim_loop(main()) <= 8  # only the tenants with a call live


def test_a_tenant_returning_from_idle_starts_at_the_routes_virtual_time():
    """A tenant that used the route alone earlier is neither credited nor charged for it:
    with the others queued, its new call is tagged at the route's time, as a new tenant's."""
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, 10, 30.0, None)
        for _ in range(5):  # alone on the route: served at once, five calls' worth
            limiter.release("early", 1.0, await limiter.acquire("early"))
        await limiter.acquire("holder")
        order: list[str] = []
        for name in ("busy-1", "busy-2", "busy-3", "early"):
            task = asyncio.ensure_future(limiter.acquire(name.partition("-")[0]))
            task.add_done_callback(lambda _, name=name: order.append(name))
            await asyncio.sleep(0)
        tags = {w.tenant: w.tag for w in limiter.waiters() if w.order == min(
            v.order for v in limiter.waiters() if v.tenant == w.tenant)}
        assert tags == {"busy": 0.0, "early": 0.0}  # the route's time: nothing served yet
        limiter.release("holder", 1.0)
        for served in range(4):
            while len(order) == served:
                await asyncio.sleep(0)
            limiter.release(order[-1].partition("-")[0], 1.0)
        assert order == ["busy-1", "early", "busy-2", "busy-3"]  # its fair turn: second
        assert limiter._vtime == {}

    _on_sim_loop(main())


# --- the budget ledger's counters ---------------------------------------------------------


def _ledger_budgets(cap: int, clock: list[float]):
    from policies.budget import Budgets
    from policies.config import BudgetConfig
    from policies.state import memory_backends

    backends = memory_backends(max_budget_counters=cap)
    limits = [BudgetConfig.model_validate({"tokens": "100/day", "per": "tenant"})]
    return backends.ledger, Budgets(limits, {}, backends, lambda: clock[0], "r", hold_s=60)


async def test_distinct_tenants_keep_at_most_the_cap_and_new_ones_are_refused_cleanly():
    """A day budget per tenant kept a counter per tenant ever seen that day (~600 bytes
    each, three dicts keyed by (group, key) tuples): a million tenants, ~0.6 GB."""
    from policies.usage import Usage

    clock = [86400.0 * 20000 + 3600]
    ledger, budgets = _ledger_budgets(50, clock)
    for n in range(50):
        budgets.settle(await budgets.reserve(f"t{n}", None, "m", 1, 1), Usage(1, 1))
    assert len(ledger) == 50
    refused = 0
    for n in range(50, 500):
        with pytest.raises(Rejected) as exc:
            await budgets.reserve(f"t{n}", None, "m", 1, 1)
        refused += 1
        assert exc.value.reason is Reason.BUDGET_COUNTERS_FULL
        assert exc.value.retry is False and exc.value.retry_after is None
        assert "state.max_budget_counters" in exc.value.detail and "50" in exc.value.detail
    assert refused == 450 and len(ledger) == 50 and not ledger._held
    # Tenants already counted keep working, up to their own budgets.
    for n in range(50):
        budgets.settle(await budgets.reserve(f"t{n}", None, "m", 1, 1), Usage(1, 1))
    assert [ledger.level("r", budgets._key(budgets.limits[0], "t7", None, clock[0]))[0]] == [4.0]
    # The day is over (plus the hold): its counters go and new tenants are served again.
    clock[0] += 86400
    budgets.settle(await budgets.reserve("new", None, "m", 1, 1), Usage(1, 1))
    assert len(ledger) == 1


async def test_no_eviction_gives_a_tenant_its_spend_back():
    """A tenant that spent its day budget stays refused however many tenants come after:
    counters leave at their window's end, never to make room."""
    from policies.usage import Usage

    clock = [86400.0 * 20000 + 3600]
    ledger, budgets = _ledger_budgets(20, clock)
    budgets.settle(await budgets.reserve("spender", None, "m", 50, 50), Usage(50, 50))
    for n in range(1000):
        try:
            budgets.settle(await budgets.reserve(f"flood-{n}", None, "m", 1, 1), Usage(1, 1))
        except Rejected as exc:
            assert exc.reason is Reason.BUDGET_COUNTERS_FULL
        clock[0] += 30  # across sweeps, within the day
    with pytest.raises(Rejected) as exc:
        await budgets.reserve("spender", None, "m", 1, 1)
    assert exc.value.reason is Reason.BUDGET_EXHAUSTED
    assert len(ledger) == 20


async def test_a_call_that_spends_nothing_leaves_no_counter():
    clock = [86400.0 * 20000 + 3600]
    ledger, budgets = _ledger_budgets(10, clock)
    for n in range(100):
        budgets.settle(await budgets.reserve(f"t{n}", None, "m", 1, 1), None)
    assert len(ledger) == 0 and not ledger._held and len(ledger._due) <= 1024 + 1


def test_the_ledgers_memory_per_tenant_is_compact_and_settled_calls_leave_nothing_else():
    """Per counter kept: a digest and packed floats, well under the ~600 bytes it was."""
    from policies.state.ledger import Claim, MemoryLedger

    async def fill(ledger: MemoryLedger, first: int, count: int) -> None:
        for n in range(first, first + count):
            rid = f"rid-{n}"
            claims = [Claim(f"tokens-per-tenant-day:tenant-{n}:20321", 10.0, 1e6, 2e9),
                      Claim(f"tokens-per-run-total:run-{n}", 10.0, 1e6, 2e9)]
            assert await ledger.reserve("route", rid, claims, 1.7e9, 900.0) == []
            assert await ledger.settle("route", rid, [5.0, 5.0])

    ledger = MemoryLedger()
    asyncio.run(fill(ledger, 0, 1000))
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        asyncio.run(fill(ledger, 1000, 20_000))
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(ledger) == 42_000 and not ledger._reservations and len(ledger._due) < 3000
    per_counter = (after - before) / 40_000
    assert per_counter < 250, per_counter


def test_the_config_default_is_the_ledgers():
    from policies.config import StateConfig
    from policies.state.ledger import MAX_COUNTERS

    assert StateConfig().max_budget_counters == MAX_COUNTERS


def test_idle_chains_are_forgotten_from_their_tips_up(monkeypatch):
    """Hostile trial: chains of delegation were never forgotten (each run but a chain's tip
    has a child, and the eviction looked at the 8 oldest runs, all ancestors): 30 chains of
    700 runs kept 21,030 past ``MAX_RUNS``. A chain's tip is forgotten once it is among the
    least recently seen, and its ancestors with it; a chain whose tip holds a call keeps
    every ancestor, linked to objects the registry still holds."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 200)
    registry = RunRegistry()
    held = registry.resolve("held-0", None, "t")
    for i in range(20):
        held = registry.resolve(f"held-{i + 1}", f"held-{i}", "t")
    held.live.add(runs_module.LiveCall(_call(held.id), None))
    for chain in range(40):  # each agent delegates 60 levels down, one after the other
        for level in range(60):
            registry.resolve(f"c{chain}-{level + 1}", f"c{chain}-{level}", "t")
    assert len(registry.runs) == 200
    assert {f"held-{i}" for i in range(21)} <= run_ids(registry)
    for info in registry.runs.values():
        if info.parent is not None:
            assert registry.runs.get(info.parent.key) is info.parent, info.id
        for child in info.children:
            assert registry.runs[("t", child)].parent is info


# --- the rate buckets ---------------------------------------------------------------------


def _tenant_rate(cap: int, clock: list[float], per_tenant: str = "1/h"):
    from policies.config import RateConfig
    from policies.rate import RateLimiter
    from policies.state import memory_backends
    from policies.state.rate import MemoryRateBuckets

    backends = memory_backends(max_rate_buckets=cap)
    backends.rates = MemoryRateBuckets(lambda: int(clock[0] * 1e9), max_buckets=cap)
    config = RateConfig.model_validate({"per_tenant": {"requests": per_tenant}})
    return backends.rates, RateLimiter(config, backends, "r")


async def test_distinct_tenants_keep_at_most_the_cap_of_rate_buckets():
    """A hostile trial: a bucket per tenant id was kept until it drained (1/h: an hour),
    with no cap: 18,000 made-up X-Tenant-ID values added ~7.9 MB, linearly. Past
    ``state.max_rate_buckets`` a new tenant is refused as a budget counter's is; buckets
    kept go on working, and none is dropped to make room (its tenant would get its rate
    back)."""
    clock = [1.7e9]
    buckets, rate = _tenant_rate(50, clock)
    for n in range(50):
        assert await rate.admit(_tenant_call(f"t{n}")) is not None
    assert len(buckets) == 50
    for n in range(50, 500):
        with pytest.raises(Rejected) as exc:
            await rate.admit(_tenant_call(f"flood-{n}"))
        assert exc.value.reason is Reason.RATE_BUCKETS_FULL
        assert exc.value.retry is False and exc.value.retry_after is None
        assert "state.max_rate_buckets" in exc.value.detail and "50" in exc.value.detail
        clock[0] += 1  # across sweeps, within the hour
    assert len(buckets) == 50
    with pytest.raises(Rejected) as exc:  # a known tenant keeps its spent rate
        await rate.admit(_tenant_call("t7"))
    assert exc.value.reason is Reason.RATE_LIMITED
    # The buckets drain (an hour): they go, and new tenants are served again.
    clock[0] += 3600
    assert await rate.admit(_tenant_call("new")) is not None
    assert len(buckets) == 1


async def test_full_rate_buckets_are_swept_again_within_seconds():
    """A review: at the cap the buckets were swept once, then only each minute: buckets that
    drained meanwhile (1/s: a second) kept new tenants refused rate_buckets_full for up to a
    minute. A full house is swept again every few seconds."""
    from policies.state.rate import _FULL_SWEEP_INTERVAL_S, _SWEEP_INTERVAL_S

    clock = [1.7e9]
    buckets, rate = _tenant_rate(5, clock, "1/s")
    for n in range(5):
        assert await rate.admit(_tenant_call(f"t{n}")) is not None
    with pytest.raises(Rejected) as exc:
        await rate.admit(_tenant_call("late"))
    assert exc.value.reason is Reason.RATE_BUCKETS_FULL
    assert _FULL_SWEEP_INTERVAL_S < _SWEEP_INTERVAL_S
    clock[0] += _FULL_SWEEP_INTERVAL_S + 1  # every bucket has drained
    assert await rate.admit(_tenant_call("late")) is not None
    assert len(buckets) == 1


def _tenant_call(tenant: str) -> Call:
    return Call(request_id="r", route="r", method="POST", path="/r/", headers={}, body=b"",
                tenant=tenant)


def test_the_config_default_is_the_rate_buckets_and_the_config_sets_the_cap():
    from policies.config import StateConfig
    from policies.state import backends_for
    from policies.state.rate import MAX_BUCKETS

    assert StateConfig().max_rate_buckets == MAX_BUCKETS
    backends = backends_for(StateConfig(max_rate_buckets=7))
    assert backends.rates.max_buckets == 7  # type: ignore[attr-defined]
    assert backends.fallback.memory().rates.max_buckets == 7  # type: ignore[attr-defined]


def test_the_readme_states_the_run_registrys_bounds():
    """The README said "at most 10,000 runs (~0.9 KiB each)", but runs holding
    ``run.max_requests`` counts are kept up to ``MAX_COUNTED_RUNS``, ~1.5 KiB each with
    100-character ids (a hostile trial)."""
    from tests.conftest import REPO

    readme = " ".join((REPO / "README.md").read_text().split())
    assert (f"at most {runs_module.MAX_RUNS:,} runs, or {runs_module.MAX_COUNTED_RUNS:,} on a "
            f"route with `run.max_requests`") in readme
    assert "~1.5 KiB each" in readme


def test_a_routes_upstream_urls_stay_few_whatever_targets_callers_send():
    """Each route keeps the upstream URL of the targets it is called on (proxy.routes
    Route.url): at most URLS_KEPT of them, none of a target over URL_KEPT_CHARS, each the URL
    built from the target as sent (the prefix cut, the route's base path kept)."""
    route = Route(RouteConfig.model_validate({
        "name": "svc", "path_prefix": "/svc/", "upstream": "http://127.0.0.1:1/base",
        "protocol": "http"}), EventLog(None))
    for n in range(3 * URLS_KEPT + 1):
        target = f"/svc/items/{n}?q=%2F{n}"
        url = route.url(target)
        assert str(url) == f"http://127.0.0.1:1/base/items/{n}?q=%2F{n}"
        assert route.urls[target] is url
        assert len(route.urls) <= URLS_KEPT
    long_target = "/svc/" + "a" * URL_KEPT_CHARS
    assert route.url(long_target).raw_path == "/base/" + "a" * URL_KEPT_CHARS
    assert long_target not in route.urls
