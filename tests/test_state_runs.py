"""The shared run state (``policies/state/runs.py``) on one Redis and on a Redis Cluster: links
and lineages, all-or-none counting under interleaved replicas (a property test), and the
cancellation feed, including a cancel made before a replica subscribed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.config import RunConfig
from policies.pipeline import Call
from policies.runs import RunLimits, RunRegistry, RunTracker
from policies.state import redis_backends
from policies.state import runs as runs_state
from policies.state.runs import Count, RedisRuns, new_take_id, qualified, unqualified
from tests.redis_servers import (
    CLIENT_TIMEOUT_S,
    TEST_PROBE_S,
    RedisCluster,
    delete_prefix,
    new_prefix,
    require_redis,
)


@pytest.fixture(params=["redis", "cluster"])
def where(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """``(url, prefix)`` of a fresh key prefix on one Redis, then on a cluster."""
    prefix = new_prefix()
    if request.param == "redis":
        url = require_redis()
        yield url, prefix
        delete_prefix(url, prefix)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        yield cluster.url, prefix
        cluster.delete_prefix(prefix)


@contextlib.asynccontextmanager
async def shared_runs(url: str, prefix: str) -> AsyncIterator[RedisRuns]:
    """One replica's view of the shared run state (with the ``backends`` fixture's client
    bound: connecting to the cluster outlasted 0.5 s once on a busy machine; this counts
    calls, not time)."""
    backends = await redis_backends(url, prefix, CLIENT_TIMEOUT_S, probe_interval_s=TEST_PROBE_S)
    assert backends.redis is not None and backends.health.up, backends.health.last_error
    runs = RedisRuns(backends.redis)
    try:
        yield runs
    finally:
        await runs.feed.close()
        await backends.close()


async def test_links_make_a_lineage_without_cycles(where):
    async with shared_runs(*where) as runs:
        assert (await runs.admit("t", "c", "b")).ids == ("c", "b")
        # b was first seen as c's parent, counting nothing: a later parent links it.
        assert (await runs.admit("t", "b", "a")).ids == ("b", "a")
        lineage = await runs.admit("t", "c", None)
        assert lineage.ids == ("c", "b", "a")
        assert lineage.cancelled is None and all(age >= 0 for age in lineage.ages)
        # a under c would close a cycle: ignored, a stays a root.
        assert (await runs.admit("t", "a", "c")).ids == ("a",)
        # c keeps the parent it was first seen with.
        assert (await runs.admit("t", "c", "x")).ids == ("c", "b", "a")
        # A root that counted calls is not moved under a parent afterwards.
        await runs.admit("t", "solo", None)
        assert (await runs.take_request("s", "t", ("solo",), 5)) == (None, 1)
        assert (await runs.admit("t", "solo", "a")).ids == ("solo",)


async def test_counts_are_all_or_none_and_given_back(where):
    async with shared_runs(*where) as runs:
        await runs.admit("t", "kid", "root")
        assert await runs.take_request("s", "t", ("kid", "root"), 2) == (None, 1)
        assert await runs.take_request("s", "t", ("root",), 2, "take-1") == (None, 2)
        # root is full: the kid's call counts nowhere, not even on the kid.
        assert await runs.take_request("s", "t", ("kid", "root"), 2) == ("root", 0)
        assert await runs.give_back_request("take-1", ["s"]) == 1
        assert await runs.take_request("s", "t", ("kid", "root"), 2) == (None, 2)
        assert await runs.take_request("s", "t", ("kid",), 2) == ("kid", 0)
        assert await runs.take_request("other-scope", "t", ("kid", "root"), 2) == (None, 1)


async def test_a_give_back_applies_once_and_may_come_before_its_take(where):
    """A give-back names its take: sent again (Redis did not answer the first, which it may
    have run) it gives nothing more back; it undoes the runs the take counted on, each scope
    once; and sent before its take has run (the take's reply was lost in a frozen Redis that
    has not run it yet), the take counts nothing when it runs."""
    async with shared_runs(*where) as runs:
        both = [Count("*", 3, None, None), Count("route", 3, None, None)]
        await runs.admit("t", "kid", "root")
        assert (await runs.admit("t", "kid", "root", both, "a")).counted
        assert await runs.take_request("s", "t", ("kid", "root"), 3, "b") == (None, 1)
        assert await runs.give_back_request("a", ["route"]) == 1
        assert await runs.give_back_request("a", ["route"]) == 0
        assert await runs.give_back_request("a", ["*", "route"]) == 1
        assert await runs.give_back_request("b", ["s"]) == 1
        assert await runs.give_back_request("b", ["s"]) == 0
        for scope in ("*", "route", "s"):  # each back to 0, neither below nor above
            assert await runs.take_request(scope, "t", ("kid", "root"), 1) == (None, 1)
        assert await runs.give_back_request("c", ["s"]) == 0  # before its take
        assert await runs.take_request("s", "t", ("kid",), 5, "c") == (None, 0)
        assert (await runs.admit("t", "kid", None, both, "c")).counted is False
        assert await runs.give_back_request("c", ["s"]) == 0
        assert await runs.take_request("s", "t", ("kid", "root"), 2) == (None, 2)


async def test_a_take_sent_again_counts_once(where):
    """redis-py sends a script again when the connection dropped after sending it; Redis may
    have run the first (a review: counted twice under one take, given back once, and the
    run lost a call for its life). A take that finds its own record answers as counted,
    with the counts as they stand, and counts nothing more."""
    async with shared_runs(*where) as runs:
        both = [Count("*", 3, None, None), Count("route", 1, None, None)]
        assert await runs.take_request("s", "t", ("kid", "root"), 1, "a") == (None, 1)
        assert await runs.take_request("s", "t", ("kid", "root"), 1, "a") == (None, 1)
        first = await runs.admit("t", "kid", "root", both, "b")
        again = await runs.admit("t", "kid", "root", both, "b")
        assert (first.counted, first.highs) == (again.counted, again.highs) == (True, (1, 1))
        assert await runs.give_back_request("a", ["s"]) == 1
        assert await runs.give_back_request("b", ["*", "route"]) == 2
        assert await runs.take_request("s", "t", ("kid", "root"), 1) == (None, 1)
        assert (await runs.admit("t", "kid", "root", both)).highs == (1, 1)


async def test_an_uncapped_take_adds_an_outage_count_once(where):
    """A call served on a replica's local share while Redis did not answer is added to the
    shared counts once it answers, past the limit if need be (the call was served), and
    once however often the add is sent (a frozen Redis runs the first when it thaws); one
    given back before its add ran is not added at all."""
    async with shared_runs(*where) as runs:
        assert await runs.take_request("s", "t", ("kid", "root"), 1) == (None, 1)
        assert await runs.take_request("s", "t", ("kid", "root"), None, "a") == (None, 2)
        assert await runs.take_request("s", "t", ("kid", "root"), None, "a") == (None, 2)
        assert await runs.give_back_request("b", ["s"]) == 0
        assert await runs.take_request("s", "t", ("kid", "root"), None, "b") == (None, 0)
        assert await runs.give_back_request("a", ["s"]) == 1
        # Back to the first call's count: a given back, b never added.
        assert await runs.take_request("s", "t", ("kid", "root"), 2) == (None, 2)
        assert await runs.take_request("s", "t", ("kid", "root"), 2) == ("kid", 0)


async def test_a_count_heard_is_given_back_after_its_record_lapsed(where, monkeypatch):
    """A call queued longer than ``TAKE_HOLD_S`` (a ``max_wait`` of 15 minutes) found its
    take's record gone when it gave its count back: marked not to count, and the count
    stayed for the run's life (a review). A caller that heard its take count names the
    runs it counted on: given back there, once."""
    monkeypatch.setattr(runs_state, "TAKE_HOLD_S", 0.1)
    async with shared_runs(*where) as runs:
        assert await runs.take_request("s", "t", ("kid", "root"), 1, "a") == (None, 1)
        await asyncio.sleep(0.3)  # the record lapses
        heard = ("t", ("kid", "root"))
        assert await runs.give_back_request("a", ["s"], heard) == 1
        assert await runs.give_back_request("a", ["s"], heard) == 0  # once
        assert await runs.take_request("s", "t", ("kid", "root"), 1) == (None, 1)
        assert await runs.take_request("s", "t", ("root",), 1) == ("root", 0)


async def test_admit_counts_every_scope_or_none(where):
    async with shared_runs(*where) as runs:
        both = [Count("*", 3, None, None), Count("route", 2, None, None)]
        assert (await runs.admit("t", "kid", "root", both)).counted
        lineage = await runs.admit("t", "kid", "root", both)
        assert (lineage.counted, lineage.full, lineage.highs) == (True, (None, None), (2, 2))
        # The route's scope is full on kid: nothing counted in either scope.
        lineage = await runs.admit("t", "kid", "root", both)
        assert (lineage.counted, lineage.full) == (False, (None, "kid"))
        assert await runs.take_request("*", "t", ("root",), 3) == (None, 3)
        # Too deep, or too old, for a scope: counted nowhere, and the counts not read.
        deep = await runs.admit("t", "grandkid", "kid", [Count("route", 9, 1, None)])
        assert (deep.counted, deep.full) == (False, ())
        await asyncio.sleep(0.05)
        old = await runs.admit("t", "grandkid", "kid", [Count("route", 9, None, 0.04)])
        assert (old.counted, old.full) == (False, ())
        await runs.cancel("root", 60, ["t"])
        cancelled = await runs.admit("t", "grandkid", "kid", [Count("route", 9, None, None)])
        assert (cancelled.cancelled, cancelled.counted) == ("root", False)
        assert await runs.take_request("route", "t", ("grandkid",), 1) == (None, 1)


async def test_only_an_admission_that_counts_records_a_take():
    """A run's call with no ``max_requests`` counts nothing and leaves no take record; one
    that counts leaves one (for its give-back). (That the first draws no id at all is not
    seen in Redis: this checks what is.)"""
    url, prefix = require_redis(), new_prefix()
    client = redis.Redis.from_url(url)
    try:
        async with shared_runs(url, prefix) as runs:
            def takes() -> list[bytes]:
                return [key for key in client.scan_iter(f"{prefix}:*") if b":take:" in key]

            assert (await runs.admit("t", "r", None)).ids == ("r",)
            assert takes() == []
            assert (await runs.admit("t", "r", None, [Count("s", 5, None, None)])).counted
            assert len(takes()) == 1
    finally:
        client.close()
        delete_prefix(url, prefix)


async def test_a_cancel_reaches_the_lineage_and_every_feed(where):
    async with shared_runs(*where) as first, shared_runs(*where) as later:
        await first.admit("t", "kid", "root")
        assert await first.cancel("root", 60, ["t"]) == {"t": pytest.approx(60, abs=0.01)}
        lineage = await first.admit("t", "grandkid", "kid")
        assert (lineage.cancelled, round(lineage.cancelled_left)) == ("root", 60)
        # A shorter cancel does not shorten the refusal in force.
        assert await first.cancel("root", 5, ["t"]) == {"t": pytest.approx(60, abs=0.5)}

        heard: list[tuple[str, float]] = []
        later.feed.start(lambda tenant, run, left: heard.append((run, left)))
        await asyncio.wait_for(later.feed.subscribed.wait(), 5)
        # Made before this replica subscribed: read back from the set on subscribing. (On a
        # busy machine a cluster delivered one of the earlier cancels' messages after that too,
        # as below: heard twice, applied twice, which changes nothing.)
        assert {(run, round(left)) for run, left in heard} == {("root", 60)}
        await first.cancel("another", 30, ["t"])
        for _ in range(250):
            if any(run == "another" for run, _ in heard):
                break
            await asyncio.sleep(0.02)
        # A cluster may deliver the earlier cancels' messages late (after the read-back):
        # a cancel heard twice is applied twice, which changes nothing.
        assert {(run, round(left)) for run, left in heard} == {("root", 60), ("another", 30)}
        assert sorted(await first.in_force()) == [("t", "another", pytest.approx(30, abs=1)),
                                                  ("t", "root", pytest.approx(60, abs=1))]


forests = st.lists(st.integers(0, 7), min_size=1, max_size=6).map(
    lambda ups: [None, *[min(up, i) for i, up in enumerate(ups)]])  # run i+1's parent <= i


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parents=forests, calls=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2)),
                                       min_size=1, max_size=30),
       limit=st.integers(1, 4))
def test_interleaved_replicas_never_overspend_a_run(where, parents, calls, limit):
    """Three replicas count calls of one run tree at once (at admission and on their own):
    each run's count is exactly the calls granted on its subtree and never above the limit,
    and each refused call's lineage holds a run at the limit."""
    url, base = where
    prefix = f"{base}:{new_prefix()[-12:]}"  # under the fixture's prefix: deleted with it

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            reps = [await stack.enter_async_context(shared_runs(url, prefix))
                    for _ in range(3)]
            names = [f"r{i}" for i in range(len(parents))]
            lineages = []
            for i, parent in enumerate(parents):
                lineage = await reps[0].admit("t", names[i], None if parent is None else
                                              names[parent])
                lineages.append(lineage.ids)
            asked = [lineages[run % len(lineages)] for run, _ in calls]

            async def count(index: int, ids: tuple[str, ...], rep: int) -> tuple[str | None,
                                                                                  int]:
                # Both ways a call is counted: in the tracker's admission, or on its own.
                if index % 2:
                    return await reps[rep].take_request("s", "t", ids, limit)
                lineage = await reps[rep].admit("t", ids[0], None,
                                                [Count("s", limit, None, None)])
                assert lineage.ids == ids
                return lineage.full[0], lineage.highs[0]

            results = await asyncio.gather(*(
                count(index, ids, rep)
                for index, (ids, (_, rep)) in enumerate(zip(asked, calls, strict=True))))
            counts = {}
            for name in names:
                counts[name] = sum(1 for ids, (full, _) in zip(asked, results, strict=True)
                                   if full is None and name in ids)
                assert counts[name] <= limit
            for ids, (full, _) in zip(asked, results, strict=True):
                if full is not None:
                    assert counts[full] == limit and full in ids
            # What Redis holds is what the model says was granted.
            for name in names:
                take = new_take_id()
                full, _ = await reps[0].take_request("s", "t", (name,), counts[name] + 1, take)
                assert full is None
                await reps[0].give_back_request(take, ["s"])
                if counts[name]:
                    assert await reps[0].take_request("s", "t", (name,), counts[name]) == (name, 0)

    asyncio.run(scenario())


@pytest.mark.parametrize("step", ["tracker", "limits"])
async def test_a_count_made_as_the_caller_leaves_is_given_back(where, step):
    """The caller leaves while Redis counts its call for ``max_requests``, in the run
    tracker's round trip (the usual path) or the run limits' own (when the tracker's did not
    count): the count, once its reply is known, is given back. Before, it stayed spent for
    the run's life; and shutdown waited only for the give-back, not for the step on its way
    that starts it."""
    async with shared_runs(*where) as runs:
        counted = asyncio.Event()
        real = runs.take_request
        name = "admit" if step == "tracker" else "take_request"
        counting = getattr(runs, name)

        async def slow_reply(*args):
            result = await counting(*args)
            counted.set()
            await asyncio.sleep(0.1)  # the reply is on its way
            return result

        setattr(runs, name, slow_reply)
        registry = RunRegistry(shared=runs)
        limits = RunLimits(registry, "s", RunConfig(max_requests=1), None)
        call = Call(request_id="q", route="x", method="POST", path="/x/", headers={},
                    body=b"", tenant="t", run="r1", parent_run=None)
        admit = RunTracker(registry, [limits]).admit if step == "tracker" else limits.admit
        task = asyncio.create_task(admit(call))
        await asyncio.wait_for(counted.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Shutdown's wait (Runtime.close) covers the step still on its way and its give-back.
        await registry.background.wait()
        assert await real("s", "t", ("r1",), 1) == (None, 1)  # the one allowed call is free


async def test_two_tenants_runs_of_one_id_are_apart(where):
    """A run is a tenant's run id: two tenants' ``b`` link, count and are cancelled apart;
    a cancel naming no tenant hits every tenant that has the id (and says which), none
    that does not; every feed hears each tenant's cancel with its tenant."""
    async with shared_runs(*where) as runs, shared_runs(*where) as other:
        assert (await runs.admit("team-a", "b", "a")).ids == ("b", "a")
        assert (await runs.admit("team-b", "b", None)).ids == ("b",)
        # team-b's a is new, so it links under team-b's b (no cycle: team-a's b is not it).
        assert (await runs.admit("team-b", "a", "b")).ids == ("a", "b")
        assert (await runs.admit("team-a", "b", None)).ids == ("b", "a")
        assert await runs.take_request("s", "team-a", ("b", "a"), 1) == (None, 1)
        assert await runs.take_request("s", "team-a", ("b", "a"), 1) == ("b", 0)
        counted = await runs.admit("team-b", "b", None, [Count("s", 1, None, None)])
        assert (counted.tenant, counted.counted, counted.full) == ("team-b", True, (None,))

        heard: list[tuple[str, str]] = []
        other.feed.start(lambda tenant, run, left: heard.append((tenant, run)))
        await asyncio.wait_for(other.feed.subscribed.wait(), 5)
        assert await runs.cancel("b", 60, ["team-a"]) == {"team-a": pytest.approx(60, abs=1)}
        assert (await runs.admit("team-a", "b", None)).cancelled == "b"
        assert (await runs.admit("team-b", "b", None)).cancelled is None
        assert set(await runs.cancel("a", 30, every=True)) == {"team-a", "team-b"}
        assert (await runs.admit("team-b", "a", None)).cancelled == "a"
        assert (await runs.admit("team-c", "a", None)).cancelled is None  # new after it
        assert await runs.cancel("nobody-s", 30, every=True) == {}
        for _ in range(250):
            if len(heard) >= 3:
                break
            await asyncio.sleep(0.02)
        assert set(heard) == {("team-a", "b"), ("team-a", "a"), ("team-b", "a")}
        assert sorted((tenant, run) for tenant, run, _ in await runs.in_force()) == [
            ("team-a", "a"), ("team-a", "b"), ("team-b", "a")]


def test_a_run_name_reads_back_and_a_malformed_one_is_none() -> None:
    for tenant, run in (("team-a", "job"), ("1:a", "b:c"), ("x" * 128, ":"), ("9", "9:")):
        assert unqualified(qualified(tenant) + run) == (tenant, run)
    # Not Sluice's (another program under the prefix): none, never an error. "²" is a digit
    # to str.isdigit() that int() refuses: one such member in the cancelled set made every
    # resubscription of the cancel feed fail, and the replica heard no cancel (a review).
    for name in ("²:a:b", "job", "3:ab", "1:a", ":a:b", "99999999999:a:b", "1:a:"):
        assert unqualified(name) is None, name


async def test_a_count_taken_for_a_run_not_admitted_yet_expires():
    # The run limits count a call themselves when the tracker's round trip did not (Redis
    # did not answer it): that count created the run's hash with no expiry, kept for good
    # (a review).
    url = require_redis()
    prefix = new_prefix()
    try:
        async with shared_runs(url, prefix) as runs:
            assert await runs.take_request("s", "team-a", ("kid", "root"), 5) == (None, 1)
        with redis.Redis.from_url(url, socket_timeout=2) as r:
            keys = list(r.scan_iter(match=f"{prefix}:*"))
            assert len(keys) == 3  # the two runs and the take's record
            assert all(0 < r.ttl(key) <= 86400 for key in keys)
    finally:
        delete_prefix(url, prefix)


async def test_a_chain_past_the_depth_cap_is_refused_and_never_closes_a_cycle(where):
    """Hostile trial: the script's cycle check followed 64 links, so a root re-linked under
    the tip of a 70-run chain below it closed a cycle in Redis (r0's parent r70); its runs
    then read lineages of 64 runs that missed their root, and a cancel of r40 reached r1.
    Now a call of a run more than ``MAX_LINEAGE - 1`` levels below its root is refused
    (``deep``, nothing counted), and so is a link the cycle check cannot walk to its end."""
    cap = runs_state.MAX_LINEAGE - 1
    count = Count("s", 1000, None, None)
    async with shared_runs(*where) as runs:
        lineages = [await runs.admit("t", f"r{i + 1}", f"r{i}") for i in range(cap + 7)]
        for depth, lineage in enumerate(lineages, start=1):
            assert lineage.deep is (depth > cap), depth
            if depth <= cap:
                assert lineage.ids[-1] == "r0"
        # r0 has counted nothing, but under r70 it would close a cycle the walk cannot see.
        relinked = await runs.admit("t", "r0", f"r{cap + 7}")
        assert (relinked.deep, relinked.ids) == (True, ("r0",))
        assert (await runs.admit("t", "r0", None)).ids == ("r0",)  # still the root
        counted = await runs.admit("t", f"r{cap}", None, [count])
        assert (counted.deep, counted.counted, len(counted.ids)) == (False, True, cap + 1)
        for run in (f"r{cap + 1}", f"r{cap + 2}", f"r{cap + 7}"):
            refused = await runs.admit("t", run, None, [count])
            assert (refused.deep, refused.counted) == (True, False), run
        await runs.cancel("r40", 60.0, ["t"])
        assert (await runs.admit("t", "r1", None)).cancelled is None


async def test_a_run_whose_hash_an_outage_count_made_is_linked_by_its_first_admission(
        where):
    """A review: a replica's outage count of a child Redis never saw made its hash with a
    count and no first-call time; the child's next admission linked it only when its hash
    held one field, so it stayed a root for good (its parent's max_requests and cancels no
    longer reached it)."""
    async with shared_runs(*where) as runs:
        both = [Count("s", 10, None, None)]
        await runs.take_request("s", "t", ("kid", "root"), None, "outage-add-1")
        lineage = await runs.admit("t", "kid", "root", both)
        assert lineage.ids == ("kid", "root"), lineage
