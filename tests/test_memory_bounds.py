"""Per-run state stays bounded whatever run ids callers send (issue 13, memory): the run
registry forgets the least recently seen runs that hold nothing, and keeps every run whose
state a limit needs (a call live, a ``max_requests`` count, a cancellation, a child)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from policies import runs as runs_module
from policies.config import RunConfig
from policies.pipeline import Call, Outcome
from policies.reasons import Reason, Rejected
from policies.runs import RunLimits, RunRegistry, RunTracker


def _call(run: str, parent: str | None = None) -> Call:
    return Call(request_id="r", route="x", method="POST", path="/x/", headers={}, body=b"",
                tenant="t", run=run, parent_run=parent)


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
    assert set(registry.runs) == {f"run-{n}" for n in range(8 * cap, 9 * cap)}
    assert after_nine < after_three * 1.05, (after_three, after_nine)


def test_the_least_recently_seen_go_first_and_runs_holding_state_stay(monkeypatch):
    monkeypatch.setattr(runs_module, "MAX_RUNS", 20)
    registry = RunRegistry()
    regular = registry.resolve("regular", None, "t")
    counted = registry.resolve("counted", None, "t")
    assert registry.take_request("x", [counted], 5) is None
    live = registry.resolve("live", None, "t")
    live.live.add(runs_module.LiveCall(_call("live"), None))
    registry.cancel("cancelled", 600.0)
    parent = registry.resolve("parent", None, "t")
    child = registry.resolve("child", "parent", "t")
    child.live.add(runs_module.LiveCall(_call("child", "parent"), None))
    regular.calls = 3
    for n in range(200):
        registry.resolve(f"burst-{n}", None, "t")
        registry.resolve("regular", None, "t")  # seen again and again: never the oldest
    assert len(registry.runs) == 20
    kept = {"regular", "counted", "live", "cancelled", "parent", "child"}
    assert kept <= set(registry.runs)
    assert registry.runs["regular"] is regular and regular.calls == 3
    assert registry.resolve("child", "parent", "t").parent is parent
    # Once the child's call ends and the child is forgotten, its parent can go too.
    child.live.clear()
    for n in range(200):
        registry.resolve(f"later-{n}", None, "t")
    assert not {"child", "parent", "regular"} & set(registry.runs)
    assert {"counted", "live", "cancelled"} <= set(registry.runs)


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
    assert {"root", "mid", "leaf"} <= set(registry.runs)
