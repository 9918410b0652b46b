"""The queue's scheduler (issue 12): fairness across tenants, aging, deadlines; and the run
registry's own rules. The scheduler runs on a simulated clock (``bench/scheduler.py``), so
minutes of load take well under a second."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench.scheduler import Arrival, SimLoop, compare, percentile, simulate
from policies import runs as runs_module
from policies.budget import Budgets
from policies.concurrency import ConcurrencyLimiter
from policies.config import BudgetConfig, FanoutConfig, RunConfig
from policies.pipeline import Call, Outcome
from policies.reasons import Reason, Rejected
from policies.runs import FanoutWidth, LiveCall, RunLimits, RunRegistry, RunTracker
from policies.state import memory_backends


def test_light_tenant_waits_near_its_unloaded_value_beside_a_10x_heavy_one():
    # Both tenants in one class; the heavy one alone overloads the route (1.3x capacity).
    arrivals = [Arrival(a.at, a.tenant, 1) for a in _skewed()]
    fifo = simulate(arrivals, 8, 1.0, fifo=True, max_wait=30.0)
    fair = simulate(arrivals, 8, 1.0, fifo=False, max_wait=30.0)
    alone = simulate([a for a in arrivals if a.tenant == "light"], 8, 1.0, fifo=False)
    unloaded = percentile(alone[("tenant", "light")], 0.95)
    light = percentile(fair[("tenant", "light")], 0.95)
    assert light <= unloaded + 1.0  # at most one service time more than when alone
    assert percentile(fifo[("tenant", "light")], 0.95) > 10 * (light + 0.1)
    assert percentile(fair[("tenant", "heavy")], 0.95) > 10  # the heavy one waits, not both


def _skewed() -> list[Arrival]:
    from bench.scheduler import skewed
    return skewed(300.0, 8, 1.0, load=1.3, ratio=10.0)


def test_weights_give_a_tenant_its_share():
    arrivals = [Arrival(i * 0.01, tenant, 1) for i in range(2000) for tenant in ("a", "b")]
    waits = simulate(arrivals, 4, 1.0, fifo=False, weights={"a": 3.0}, max_wait=1e9)
    # Both backlogged: "a" is served three times as often, so it waits far less.
    assert percentile(waits[("tenant", "a")], 0.5) < percentile(waits[("tenant", "b")], 0.5) / 2


def test_aging_serves_best_effort_under_a_constant_critical_load():
    # Critical calls arrive faster than one slot serves them: without aging, best-effort
    # would wait until they stop.
    arrivals = [Arrival(i * 0.4, "crit", 0) for i in range(300)]
    arrivals += [Arrival(5.0, "batch", 2)]
    aged = simulate(sorted(arrivals, key=lambda a: a.at), 1, 0.5, fifo=False, aging=2.0,
                    max_wait=1e9)
    assert aged[("class", 2)][0] <= 3 * 2.0 + 0.5  # up one class per 2 s, then served
    starved = simulate(sorted(arrivals, key=lambda a: a.at), 1, 0.5, fifo=False, aging=None,
                       max_wait=1e9)
    assert starved[("class", 2)][0] > 30


def test_aging_serves_a_best_effort_backlog_one_call_per_interval():
    # Seen in a hostile trial: a tenant's second best-effort call under a constant critical
    # load waited out its max_wait. Aging lifted only calls within their tenant's share of
    # the class, and a class never served on its own never moved its clock past the first.
    arrivals = [Arrival(i * 0.4, "crit", 0) for i in range(300)]
    arrivals += [Arrival(5.0, "batch", 2)] * 3
    aged = simulate(sorted(arrivals, key=lambda a: a.at), 1, 0.5, fifo=False, aging=2.0,
                    max_wait=1e9)
    waits = sorted(aged[("class", 2)])
    assert len(waits) == 3
    # The first up three classes in 3 x 2 s; each next one an interval later, no sooner.
    assert waits[0] <= 3 * 2.0 + 0.5
    assert [round(b - a) for a, b in itertools.pairwise(waits)] == [2, 2]
    # Critical work (overloaded on its own) lost those three slots and nothing more.
    crit = [a for a in arrivals if a.tenant == "crit"]
    alone = simulate(crit, 1, 0.5, fifo=False, aging=2.0, max_wait=1e9)
    assert max(aged[("class", 0)]) <= max(alone[("class", 0)]) + 3 * 0.5


def test_bench_comparison_runs():
    results, unloaded = compare(seconds=60.0)
    assert set(results) == {"fifo", "sluice"} and unloaded >= 0


def _loop_run(coro):
    loop = SimLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_a_deadline_shorter_than_the_estimated_wait_is_refused_at_once():
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, 10, 30.0, None)
        limiter.mean_service_s, limiter.observed = 2.5, True  # 5 s: wait + service
        await limiter.acquire("t")
        started = asyncio.get_running_loop().time()
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=1.0)
        assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
        assert asyncio.get_running_loop().time() == started  # at once
        assert limiter.queued == 0
        # With room for the estimated wait and the call, it queues.
        task = asyncio.ensure_future(limiter.acquire("t", caller_timeout=6.0))
        await asyncio.sleep(0)
        assert limiter.queued == 1
        limiter.release("t", 2.5)
        await task
        limiter.release("t", None)

    _loop_run(main())


def test_unmetered_calls_cost_their_service_time_and_are_corrected():
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, 10, 30.0, None)
        # Until the unit (the median of 8 service times) is known, a call costs 1 and
        # nothing is corrected; then it costs its tenant's mean in the unit, corrected.
        for seconds in (3.0, 0.001, 2.0, 2.0, 120.0, 2.0, 2.0, 2.0):
            assert await limiter.acquire("t") is None
            limiter.release("t", seconds, None)
        charged = await limiter.acquire("t")
        assert charged == pytest.approx(limiter.mean_service_s)  # seconds: the route's mean
        limiter.release("t", 3.0, charged)
        assert limiter._unit == 2.0
        assert await limiter.acquire("t", cost=100.0) is None  # tokens: no correction
        # An unmetered call on a route that meters tokens costs a typical metered one.
        task = asyncio.ensure_future(limiter.acquire("u"))
        await asyncio.sleep(0)
        assert limiter.waiters()[0].increment == pytest.approx(100.0)
        limiter.release("t", 1.0)
        assert await task is None
        limiter.release("u", 1.0)
        assert limiter.state()["tenant_weights"] == {}

    _loop_run(main())


# --- the run registry and policies ------------------------------------------------------------


def _call(run: str | None, parent: str | None = None, **kw) -> Call:
    return Call(request_id="r", route="x", method="POST", path="/x/", headers={}, body=b"",
                tenant="t", run=run, parent_run=parent, **kw)


def test_links_are_fixed_at_first_sight_and_never_cycle():
    registry = RunRegistry()
    a = registry.resolve("a", None, "t")
    b = registry.resolve("b", "a", "t")
    assert (b.depth, b.parent) == (1, a)
    assert registry.resolve("b", "zzz", "t").parent is a  # a later parent is ignored
    registry.resolve("a", "b", "t")  # would close a cycle
    assert a.parent is None
    late = registry.resolve("late", None, "t")
    registry.resolve("late", "a", "t")  # first named as a root, nothing counted: linked now
    assert (late.parent, late.depth) == (a, 1)
    assert registry.resolve("self", "self", "t").parent is None


async def test_two_tenants_runs_of_one_id_share_nothing():
    """A run is a tenant's run id: links, depth, ``max_requests``, width and cancellation
    of team-a's ``r`` leave team-b's ``r`` alone (a hostile trial found them shared)."""
    registry = RunRegistry()
    tracker = RunTracker(registry)
    limits = RunLimits(registry, "x", RunConfig(max_requests=1), FanoutConfig(depth=1))
    width = FanoutWidth(1, 0.05)

    def of(tenant: str, run: str, parent: str | None = None) -> Call:
        call = _call(run, parent)
        call.tenant = tenant
        return call

    async def admitted(call: Call) -> list:
        return [await tracker.admit(call), await limits.admit(call), await width.admit(call)]

    b_root = registry.resolve("r", None, "b")  # team-b's idle root, counting nothing
    registry.resolve("r", "a-1", "a")
    registry.resolve("a-1", "a-0", "a")  # a-1, an idle root, linked: r moves a level down
    assert (registry.get("r", "a").depth, b_root.depth, b_root.parent) == (2, 0, None)
    # Each in a task of its own, as a handler's: a cancel ends the call's task.
    held = await asyncio.create_task(admitted(of("a", "k")))
    other = await asyncio.create_task(admitted(of("b", "k")))  # not queued behind team-a's
    with pytest.raises(Rejected) as spent:
        await limits.admit(of("a", "k"))
    assert spent.value.reason is Reason.RUN_BUDGET_EXHAUSTED
    assert registry.tenants_of("k") == ["a", "b"]
    runs, calls = registry.cancel("k", 60.0, "a")
    assert ([(n.tenant, n.id) for n in runs], [c.call.tenant for c in calls]) == (
        [("a", "k")], ["a"])
    with pytest.raises(Rejected) as refused:
        await tracker.admit(of("a", "k"))
    assert refused.value.reason is Reason.RUN_CANCELLED
    assert registry.cancelled_by(registry.get("k", "b")) is None
    for holding in (*held, *other):
        holding.release(Outcome("2xx", True, 200, 0.01))
    assert width.runs == {}


def test_idle_runs_are_swept():
    now = [0.0]
    registry = RunRegistry(clock=lambda: now[0])
    registry.resolve("old", None, "t")
    registry.resolve("kid", "old", "t")
    now[0] = 100_000.0
    registry.resolve("new", None, "t")
    assert set(registry.runs) == {("t", "new")}


async def test_an_idle_parent_is_kept_while_its_child_calls_so_its_cancel_reaches_it():
    """Hostile trial: a root run idle for a day while its sub-agent kept calling was swept;
    the child kept a link to the forgotten object, so a cancel of the root (made a new run)
    refused none of the child's new calls, and the root's max_requests counts were lost."""
    now = [0.0]
    registry = RunRegistry(clock=lambda: now[0])
    tracker = RunTracker(registry)
    (await tracker.admit(_call("root"))).release(Outcome("2xx", True))
    for _ in range(30):  # the sub-agent works on, hourly, for 30 h
        now[0] += 3600.0
        (await tracker.admit(_call("kid", "root"))).release(Outcome("2xx", True))
    assert registry.runs[("t", "kid")].parent is registry.runs.get(("t", "root"))
    registry.cancel("root", 600.0, "t")
    with pytest.raises(Rejected) as refused:
        await tracker.admit(_call("kid", "root"))
    assert refused.value.reason is Reason.RUN_CANCELLED


async def test_tracker_inherits_and_refuses_a_passed_parent_deadline():
    now = [0.0]
    registry = RunRegistry(clock=lambda: now[0])
    tracker = RunTracker(registry)
    assert await tracker.admit(_call(None)) is None
    parent = _call("p", priority=0, timeout=5.0)
    parent.received_at = 0.0
    held = await tracker.admit(parent)
    held.release(Outcome("2xx", True, 200, 0.1))
    child = _call("c", "p", priority=1, priority_given=False)
    child.received_at = 1.0
    now[0] = 1.0
    (await tracker.admit(child)).release(Outcome("rejected", False))
    assert (child.priority, child.timeout, child.lineage) == (0, 4.0, ("p",))
    now[0] = 6.0
    late = _call("c2", "p", priority_given=False)
    with pytest.raises(Rejected) as refused:
        await tracker.admit(late)
    assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
    view = registry.view(registry.runs[("t", "p")], detail=True)
    assert (view["calls"], view["own"]["calls"], view["children"]) == (1, 1, ["c", "c2"])


async def test_run_limits_give_back_a_count_that_never_reached_the_upstream():
    registry = RunRegistry()
    limits = RunLimits(registry, "x", RunConfig(max_requests=1), FanoutConfig(depth=3))
    assert await limits.admit(_call(None)) is None
    held = await limits.admit(_call("r"))
    held.release(Outcome("rejected", reached=False))
    held = await limits.admit(_call("r"))  # the first never reached: counted again
    held.release(Outcome("2xx", reached=True))
    with pytest.raises(Rejected):
        await limits.admit(_call("r"))
    depth_only = RunLimits(registry, "y", None, FanoutConfig(depth=0))
    assert await depth_only.admit(_call("r")) is None


async def test_width_refuses_after_max_wait_and_reconfigures_in_place():
    width = FanoutWidth(1, 0.05)
    assert await width.admit(_call(None)) is None
    first = await width.admit(_call("r"))
    with pytest.raises(Rejected) as refused:
        await width.admit(_call("r"))
    assert refused.value.reason is Reason.FANOUT_LIMITED and "width" in refused.value.detail
    width.reconfigure(FanoutConfig(width=2, max_wait="1s"))
    second = await width.admit(_call("r"))
    assert width.state() == {"width": 2, "runs": 1}
    first.release(Outcome("2xx", True, 200, 0.1))
    second.release(Outcome("2xx", True, 200, 0.1))
    assert width.runs == {}
    holders = [await width.admit(_call("q")) for _ in range(2)]
    waiting = asyncio.ensure_future(width.admit(_call("q")))
    await asyncio.sleep(0)
    waiting.cancel()  # a caller leaving the run's queue holds nothing
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for holder in holders:
        holder.release(Outcome("2xx", True, 200, 0.1))
    assert width.runs == {}


async def test_per_run_budgets_charge_every_ancestor():
    budgets = Budgets([BudgetConfig(tokens="100/total", per="run")], {}, memory_backends(),
                      lambda: 0.0)
    held = await budgets.reserve("t", "kid", None, 30, 30, ("parent",))
    assert len(held.claims) == 2
    with pytest.raises(Rejected):  # the parent's 100 is shared with its other children
        await budgets.reserve("t", "kid2", None, 30, 30, ("parent",))
    budgets.settle(held, None)


def test_a_generous_deadline_queues_even_when_the_estimate_passes_max_wait():
    """A caller whose timeout covers the estimated wait and the call is queued, though the
    estimate exceeds ``max_wait`` (the openai SDK sends ``x-stainless-timeout: 600``): if no
    slot frees within ``max_wait`` it is refused ``queue_timeout``, naming ``max_wait``, not
    ``deadline_unreachable``, which would blame the caller's timeout."""
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, 10, 5.0, None)
        limiter.mean_service_s, limiter.observed = 10.0, True  # estimated wait 10 s > 5 s
        await limiter.acquire("t")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=600.0)
        assert refused.value.reason is Reason.QUEUE_TIMEOUT
        assert "max_wait of 5s" in refused.value.detail
        assert loop.time() - started == pytest.approx(5.0)
        # Served when a slot frees within max_wait.
        task = asyncio.ensure_future(limiter.acquire("t", caller_timeout=600.0))
        await asyncio.sleep(1.0)
        assert limiter.queued == 1
        limiter.release("t", 10.0)
        await task
        limiter.release("t", None)
        assert (limiter.inflight, limiter.queued) == (0, 0)

    _loop_run(main())


def test_the_first_observed_call_time_replaces_the_guess():
    """One finished 3 s call makes the mean 3 s, not 1.2 s (the 1 s guess averaged in): a
    caller with 4.5 s left behind a 3 s call in flight cannot be served in time and is told
    at once, instead of being queued, sent at 3 s and answered after its deadline."""
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, 4, 10.0, None)
        await limiter.acquire("t")
        limiter.release("t", 3.0)
        assert limiter.mean_service_s == 3.0
        await limiter.acquire("t")
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=4.5)
        assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
        limiter.release("t", 4.0)  # later samples are averaged in
        assert limiter.mean_service_s == pytest.approx(3.1)
        assert (limiter.inflight, limiter.queued) == (0, 0)

    _loop_run(main())


def test_before_any_call_time_is_known_the_deadline_detail_subtracts_nothing():
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, 4, 10.0, None)
        await limiter.acquire("t")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=0.5)
        assert loop.time() - started == pytest.approx(0.5)  # the whole timeout, nothing set aside
        assert refused.value.detail == "the caller's timeout ran out while it was queued"
        limiter.release("t", 2.0)
        await limiter.acquire("t")
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=4.5)  # estimate 2 s + 2 s fits: queued
        assert loop.time() - started == pytest.approx(0.5 + 2.5)
        assert refused.value.detail.startswith("the caller's timeout, less the time a call takes")
        limiter.release("t", None)

    _loop_run(main())


def test_a_streams_length_is_not_held_against_a_callers_read_timeout():
    """The SDKs' timeout (``x-stainless-timeout``) is httpx's read timeout: a stream whose
    first byte comes in time is in time, however long it then runs. Measured against the
    whole stream's length, a caller with a 3 s timeout was refused ``deadline_unreachable``
    behind 2 s streams, though its wait (~2 s) and the next first byte fit (a hostile
    trial). The check now sets aside the mean time to the first byte."""
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, 10, 30.0, None)
        await limiter.acquire("t")
        limiter.release("t", 2.0, first_byte_s=0.1)  # a 2 s stream that started at 0.1 s
        assert (limiter.mean_service_s, limiter.mean_first_byte_s) == (2.0, 0.1)
        await limiter.acquire("t")
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(limiter.acquire("t", caller_timeout=3.0, reads=True))
        await asyncio.sleep(0)
        assert limiter.queued == 1  # waits: estimated 2 s, plus 0.1 s to its first byte
        limiter.release("t", 2.0, first_byte_s=0.1)
        await task
        # A read timeout that cannot cover the wait and the first byte is still refused.
        started = loop.time()
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=1.5, reads=True)
        assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
        assert "0.1s on average to start answering" in refused.value.detail
        # A deadline (X-Request-Timeout) covers the whole call: 2 s of wait and a 2 s call
        # do not fit in 3 s (a review: an SSE tool answering its headers at once would
        # otherwise run past the caller's deadline).
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=3.0)
        assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
        assert "calls take 2s on average" in refused.value.detail
        assert loop.time() == started
        limiter.release("t", None)

    _loop_run(main())


def test_a_cancel_in_many_tenants_looks_at_the_runs_known_once() -> None:
    # A cancel without ?tenant= cancelled tenant by tenant, each a look at every run known:
    # tenants x runs on the event loop (1.7 s at 9,000 tenants, a review).
    registry = RunRegistry()
    tenants = [f"t{i}" for i in range(50)]
    for tenant in tenants:
        registry.resolve("main", None, tenant)
        registry.resolve("main-kid", "main", tenant)

    class Looks(dict):
        looked = 0

        def values(self):  # type: ignore[override]
            Looks.looked += 1
            return super().values()

    registry.runs = Looks(registry.runs)
    runs, calls = registry.cancel_in("main", 60.0, tenants)
    assert Looks.looked == 1 and calls == []
    assert sorted((n.tenant, n.id) for n in runs) == sorted(
        (t, name) for t in tenants for name in ("main", "main-kid"))
    assert [n.tenant for n in runs[:4:2]] == ["t0", "t1"]  # in the order asked


@settings(max_examples=200, deadline=None)
@example([(i + 1, -1) for i in range(6)] + [(0, 6)])  # a root under its chain's tip
@given(st.lists(st.tuples(st.integers(0, 7), st.none() | st.just(-1) | st.integers(-7, 7)),
                max_size=40))
def test_random_links_keep_the_tree_acyclic_and_resolve_returns(links):
    """Runs named in any order under any parent (a root re-linked under its own descendants
    included) leave a tree: every chain of parents ends at a root within its depth, each
    depth is its parent's plus one, and resolve always returns (a cycle looped it)."""
    registry = RunRegistry()
    # A cap of 4 runs a lineage, so that the runs make chains past it; a parent is named by
    # its offset from the run (-1 most often: chains).
    with mock.patch.object(runs_module, "MAX_LINEAGE", 4), \
            mock.patch.object(runs_module, "MAX_DEPTH", 3):
        for run, parent in links:
            with contextlib.suppress(Rejected):
                registry.resolve(f"r{run}", None if parent is None else f"r{run + parent}",
                                 "t")
    for info in registry.runs.values():
        seen, node = set(), info
        while node.parent is not None:
            assert node.key not in seen, f"a cycle through {node.id}"
            seen.add(node.key)
            assert node.depth == node.parent.depth + 1
            node = node.parent
        assert node.depth == 0 and len(seen) == info.depth
        assert {n.key for n in registry.subtree(info)} >= {info.key}


#: One step of a random run registry's life: ``("call", run, parent offset or None)``,
#: ``("end", run)`` (its oldest live call ends), ``("cancel", run)``, ``("tick", seconds)``.
_REGISTRY_STEPS = st.one_of(
    st.tuples(st.just("call"), st.integers(0, 11),
              st.none() | st.just(-1) | st.integers(-11, 11)),
    st.tuples(st.just("end"), st.integers(0, 11)),
    st.tuples(st.just("cancel"), st.integers(0, 11)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 30.0, 700.0])),
)


@settings(max_examples=600, deadline=None)
@given(st.lists(_REGISTRY_STEPS, max_size=60))
def test_random_calls_cancels_and_eviction_keep_the_registry_whole(steps):
    """Calls (a live call per call, linking runs in any order, roots re-linked), calls
    ending, cancels and time passing, on a registry of 5 runs at most (so eviction runs
    all along) and lineages of 4: after every step the remembered runs form a tree whose
    every parent is remembered (a forgotten parent left a child no cancel reached), a run
    with a live call is the one remembered under its name (its call is reachable), a run
    under a cancellation in force is never forgotten, and every remembered run without a
    child is listed for eviction (a review found the first two broken)."""
    clock = [0.0]
    registry = RunRegistry(clock=lambda: clock[0])
    live: dict[str, list[runs_module.LiveCall]] = {}
    with mock.patch.object(runs_module, "MAX_LINEAGE", 4), \
            mock.patch.object(runs_module, "MAX_DEPTH", 3), \
            mock.patch.object(runs_module, "MAX_RUNS", 5):
        protected: list[runs_module.RunInfo] = []  # under a cancellation at the last step
        for step in steps:
            if step[0] == "call":
                run, offset = f"r{step[1]}", step[2]
                parent = None if offset is None else f"r{step[1] + offset}"
                with contextlib.suppress(Rejected):
                    info = registry.resolve(run, parent, "t")
                    call = LiveCall(Call(request_id="q", route="x", method="POST", path="/",
                                         headers={}, body=b"", tenant="t", run=run), None)
                    info.live.add(call)
                    live.setdefault(run, []).append(call)
            elif step[0] == "end" and live.get(f"r{step[1]}"):
                call = live[f"r{step[1]}"].pop(0)
                info = registry.get(call.call.run, "t")
                assert info is not None and call in info.live
                info.live.discard(call)
            elif step[0] == "cancel":
                registry.cancel(f"r{step[1]}", 600.0, "t")
            elif step[0] == "tick":
                clock[0] += step[1]
            runs = registry.runs
            for info in runs.values():
                seen, node = set(), info
                while node.parent is not None:
                    assert node.key not in seen, f"a cycle through {node.id}"
                    seen.add(node.key)
                    assert runs.get(node.parent.key) is node.parent, (
                        f"{node.id}'s parent {node.parent.id} forgotten")
                    assert node.depth == node.parent.depth + 1
                    node = node.parent
                if not info.children:
                    assert info.key in registry._leaves
            for run, calls in live.items():
                if calls:
                    assert registry.get(run, "t") is not None
                    assert all(c in registry.get(run, "t").live for c in calls)
            for info in protected:
                if registry.cancelled_by(info) is not None:  # still in force
                    assert runs.get(info.key) is info, f"{info.id} forgotten under a cancel"
            protected = [n for n in runs.values() if registry.cancelled_by(n) is not None]
