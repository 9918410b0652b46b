"""A review of the runs fixes (stop 43): a run forgotten while it was being re-linked, runs
under a cancelled ancestor forgotten, and the depth cap checked on a replica's own links
before the shared tree was asked. Each failed on the code before its fix."""

from __future__ import annotations

import contextlib

import pytest

from policies import runs as runs_module
from policies.config import RunConfig
from policies.pipeline import Call, Outcome
from policies.reasons import Reason, Rejected
from policies.runs import RunLimits, RunRegistry, RunTracker
from tests.test_state_runs import shared_runs, where  # noqa: F401  (the fixture)


def _call(run, parent=None):
    return Call(request_id="r", route="x", method="POST", path="/x/", headers={}, body=b"",
                tenant="t", run=run, parent_run=parent)


async def test_a_root_linked_under_an_unknown_parent_is_not_forgotten_meanwhile(monkeypatch):
    """X, an idle root, calls naming a parent P not known here: resolve creates P, whose
    eviction forgets X itself; X is then linked under P but is no longer in the registry.
    Its live call is out of reach of a cancel of X or of P."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 2)
    registry = RunRegistry()
    tracker = RunTracker(registry)
    busy = registry.resolve("busy", None, "t")
    busy.live.add(runs_module.LiveCall(_call("busy"), None))  # one run holding a call
    registry.resolve("X", None, "t")  # X: an idle root
    call = _call("X", "P")
    call.timeout = None
    held = await tracker.admit(call)  # X's call, naming parent P
    held.live.task = None
    x = held.info
    assert registry.runs.get(("t", "X")) is x, "X's live call is on an object forgotten"
    _, calls = registry.cancel("P", 60.0, "t")
    assert any(live.call is call for live in calls), "a cancel of P did not reach X's call"


async def test_same_with_a_chain_whose_tip_is_busy(monkeypatch):
    """The registry at MAX_RUNS holds one agent's chain of 19 runs (its tip has a call in
    flight) and X, an idle root. X's next call names a parent P not known here: creating P
    forgets X (the chain's ancestors are skipped for free, its busy tip is looked at, X is
    next), then X is linked under P though no longer remembered."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 20)
    registry = RunRegistry()
    tracker = RunTracker(registry)
    registry.resolve("c0", None, "t")
    for i in range(18):
        registry.resolve(f"c{i + 1}", f"c{i}", "t")
    tip = registry.resolve("c18", None, "t")
    tip.live.add(runs_module.LiveCall(_call("busy"), None))  # the agent's deepest call
    registry.resolve("X", None, "t")
    assert len(registry.runs) == 20
    call = _call("X", "P")
    held = await tracker.admit(call)
    held.live.task = None  # the test's own task: not to be cancelled
    assert registry.runs.get(("t", "X")) is held.info, "X forgot while its call is live"
    _, calls = registry.cancel("X", 60.0, "t")
    assert any(live.call is call for live in calls), "a cancel of X did not reach X's call"


async def test_a_cancelled_runs_grandchild_stays_refused_after_eviction(monkeypatch):
    """C is cancelled (10 min). Its sub-agent D, created after the cancel, and D's own
    sub-agent E are refused 409 but remembered holding nothing. Other traffic fills the
    registry: E is forgotten and D with it (a chain forgotten from its tip up). E's next
    call names D: D is created again as a root, and E's call is admitted."""
    monkeypatch.setattr(runs_module, "MAX_RUNS", 50)
    t = [0.0]
    registry = RunRegistry(clock=lambda: t[0])
    tracker = RunTracker(registry)
    registry.resolve("C", None, "t")
    registry.cancel("C", 600.0, "t")
    for run, parent in (("D", "C"), ("E", "D")):
        with pytest.raises(Rejected) as refused:
            await tracker.admit(_call(run, parent))
        assert refused.value.reason is Reason.RUN_CANCELLED
    for n in range(60):  # other agents' runs, one second apart
        t[0] += 1
        registry.resolve(f"other-{n}", None, "t")
    assert registry.get("C", "t") is not None  # the cancellation is held
    with pytest.raises(Rejected) as refused:
        await tracker.admit(_call("E", "D"))
    assert refused.value.reason is Reason.RUN_CANCELLED


async def _admit(tracker, limits, call):
    held = await tracker.admit(call)
    counted = await limits.admit(call)
    for holding in (counted, held):  # the call answered 200
        if holding is not None:
            holding.release(Outcome("2xx", True, 200))
    return held, counted


async def _scenario(registry):
    limits = RunLimits(registry, "s", RunConfig(max_requests=100), None)
    tracker = RunTracker(registry, [limits])
    for i in range(70):  # a chain past the cap (its deepest calls refused, its runs remembered)
        with contextlib.suppress(Rejected):
            await _admit(tracker, limits, _call(f"r{i + 1}", f"r{i}"))
    await _admit(tracker, limits, _call("X"))  # X, a root, makes a counted call
    try:
        await _admit(tracker, limits, _call("X", "r70"))  # then names the chain's tip
    except Rejected as refused:
        return refused.reason.value
    return "admitted"


async def test_memory_and_redis_agree_on_a_counted_root_naming_a_deep_parent(where):  # noqa: F811
    memory = await _scenario(RunRegistry())
    async with shared_runs(*where) as runs:
        shared = await _scenario(RunRegistry(shared=runs))
    assert memory == shared, (memory, shared)


async def test_two_replicas_agree_on_a_root_in_the_shared_tree(where):  # noqa: F811
    """The shared tree has Y as a root (its first call, on replica B, named no parent and was
    counted). Replica A first sees Y in a call naming r63 (a run 63 levels down): A links Y
    there in its own memory and refuses it 'is 64 levels below its root' before asking
    Redis, for every later call too; B admits the same calls (Redis: Y is a root)."""
    async with shared_runs(*where) as runs_a, shared_runs(*where) as runs_b:
        a, b = RunRegistry(shared=runs_a), RunRegistry(shared=runs_b)
        la = RunLimits(a, "s", RunConfig(max_requests=100), None)
        lb = RunLimits(b, "s", RunConfig(max_requests=100), None)
        ta, tb = RunTracker(a, [la]), RunTracker(b, [lb])
        for i in range(63):
            await _admit(ta, la, _call(f"r{i + 1}", f"r{i}"))
        await _admit(tb, lb, _call("Y"))  # on B: Y, a root, counted
        outcomes = {}
        for name, tracker, limits in (("B", tb, lb), ("A", ta, la), ("A again", ta, la)):
            try:
                await _admit(tracker, limits, _call("Y", "r63"))
                outcomes[name] = "admitted"
            except Rejected as refused:
                outcomes[name] = f"{refused.reason.name}: {refused}"
        assert len(set(outcomes.values())) == 1, outcomes


async def _relinked_subtree(registry):
    tracker = RunTracker(registry, [])
    for i in range(40):
        await _admit(tracker, RunLimits(registry, "s", None, None), _call(f"r{i + 1}", f"r{i}"))
    for i in range(30):
        await _admit(tracker, RunLimits(registry, "s", None, None),
                     _call(f"x{i + 1}", "X" if i == 0 else f"x{i}"))
    await _admit(tracker, RunLimits(registry, "s", None, None), _call("X", "r40"))
    out = {}
    for run in ("x22", "x23", "x30"):
        try:
            await _admit(tracker, RunLimits(registry, "s", None, None), _call(run))
            out[run] = "admitted"
        except Rejected as refused:
            out[run] = refused.reason.name
    return out


async def test_a_relinked_subtree_past_the_cap(where):  # noqa: F811
    memory = await _relinked_subtree(RunRegistry())
    async with shared_runs(*where) as runs:
        shared = await _relinked_subtree(RunRegistry(shared=runs))
    assert memory == shared == {"x22": "admitted", "x23": "FANOUT_LIMITED",
                                "x30": "FANOUT_LIMITED"}
