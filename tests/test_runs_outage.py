"""A run's ``max_requests`` across a Redis freeze (``state.backend: redis``).

A call that never reached the upstream must leave no count behind, even when Redis does not
answer at the moment the count is taken or given back (a hostile trial: the run was refused
429 ``run_budget_exhausted``, ``x-should-retry: false``, after 6 of its 10 calls):

* a count whose reply is lost (Redis frozen, ``state.timeout`` passed, the call refused 503
  ``state_unavailable``) is still run by Redis when it thaws: it must be given back;
* a give-back Redis does not answer (frozen) must be applied once it answers again, and
  only once, even though the first attempt may run in Redis when it thaws.

Each test freezes (SIGSTOP) a Redis of its own, then counts the calls the run is served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

import policies.runs as runs_module
from policies.config import RunConfig
from policies.pipeline import Call, Outcome
from policies.rate import Background
from policies.reasons import Reason, Rejected
from policies.runs import GiveBacks, RunLimits, RunRegistry, RunTracker
from policies.state import Fallback, StateBackends, StateUnavailable, redis_backends
from policies.state.runs import RedisRuns, qualified
from tests.redis_servers import RedisCluster, RedisServer, new_prefix

#: ``state.timeout`` here, seconds: short, so a frozen Redis fails a call quickly.
TIMEOUT_S = 0.2
#: How long a test waits for the counts to settle after the thaw, seconds.
SETTLE_S = 5.0
MAX_REQUESTS = 4
SCOPE = "*"
TENANT = "t"
RUN = "r1"

REACHED = Outcome("2xx", True, 200)
NEVER_SENT = Outcome("client_disconnected", False)


class Replica:
    """One replica's run policies on the test's Redis (``on_unavailable: reject``, unless
    ``fallback`` says otherwise)."""

    def __init__(self, state: StateBackends, fallback: Fallback | None = None) -> None:
        assert state.redis is not None
        self.state = state
        self.registry = RunRegistry(shared=RedisRuns(state.redis),
                                    fallback=fallback or Fallback("reject", 1))
        self.limits = RunLimits(self.registry, SCOPE, RunConfig(max_requests=MAX_REQUESTS),
                                None)
        self.tracker = RunTracker(self.registry, [self.limits])
        self._ids = iter(range(1, 1_000_000))

    async def admit(self) -> tuple[Call, list]:
        """Admit one call of the run as the request path does (tracker, then run limits);
        returns the call and its holdings, to release in reverse order."""
        call = Call(request_id=f"q{next(self._ids)}", route="x", method="POST", path="/x/",
                    headers={}, body=b"", tenant=TENANT, run=RUN, parent_run=None)
        held = []
        try:
            held.append(await self.tracker.admit(call))
            held.append(await self.limits.admit(call))
        except BaseException:
            release(held, NEVER_SENT)
            raise
        return call, held

    async def close(self) -> None:
        await self.registry.background.wait()
        await self.state.close()


def release(held: list, outcome: Outcome) -> None:
    for holding in reversed(held):
        if holding is not None:
            holding.release(outcome)


def counted(server: RedisServer, prefix: str) -> int:
    """The run's ``max_requests`` count in Redis."""
    key = f"{prefix}:{{runs}}:run:{qualified(TENANT)}{RUN}"
    return int(server.client().hget(key, f"n:{SCOPE}") or 0)


async def settled(server: RedisServer, prefix: str, expected: int) -> int:
    """The run's count once it is ``expected``, or after :data:`SETTLE_S` seconds; then a
    little longer, so that a give-back applied twice would show."""
    deadline = time.monotonic() + SETTLE_S
    while counted(server, prefix) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    return counted(server, prefix)


async def served(replica: Replica) -> int:
    """Calls of the run admitted (and sent upstream) until it is refused for its
    ``max_requests``; fails on any other refusal."""
    n = 0
    for _ in range(MAX_REQUESTS + 3):
        try:
            _, held = await replica.admit()
        except Rejected as rejected:
            assert rejected.reason is Reason.RUN_BUDGET_EXHAUSTED, rejected
            return n
        release(held, REACHED)
        n += 1
    return n


async def replica_on(server: RedisServer, prefix: str,
                     fallback: Fallback | None = None) -> Replica:
    state = await redis_backends(server.url, prefix, TIMEOUT_S, probe_interval_s=0.05)
    assert state.health.up, state.health.last_error
    return Replica(state, fallback)


async def test_a_count_whose_reply_is_lost_in_a_freeze_is_given_back(redis_server):
    """Calls arrive while Redis is frozen: each is refused 503 ``state_unavailable`` after
    ``state.timeout``, but those already written to Redis' socket are run when it thaws.
    Once things settle the run holds no count, and it is served exactly ``max_requests``."""
    prefix = new_prefix()
    replica = await replica_on(redis_server, prefix)
    try:
        _, held = await replica.admit()  # the run exists, as it would in a real trial
        release(held, NEVER_SENT)
        assert await settled(redis_server, prefix, 0) == 0
        redis_server.freeze()
        try:
            outcomes = await asyncio.gather(*(replica.admit() for _ in range(3)),
                                            return_exceptions=True)
        finally:
            redis_server.thaw()
        assert all(isinstance(o, Rejected) and o.reason is Reason.STATE_UNAVAILABLE
                   for o in outcomes), outcomes
        assert await settled(redis_server, prefix, 0) == 0
        assert await served(replica) == MAX_REQUESTS
    finally:
        await replica.close()


async def test_a_give_back_made_in_a_freeze_is_applied_once_redis_answers(redis_server):
    """One call of the run reached the upstream; two more were admitted and end without
    reaching it while Redis is frozen: their give-backs fail (the first perhaps run by
    Redis when it thaws). Once Redis answers again both are applied, once each: the run
    holds one count and is served exactly ``max_requests`` in all."""
    prefix = new_prefix()
    replica = await replica_on(redis_server, prefix)
    try:
        _, first = await replica.admit()
        release(first, REACHED)
        left = [await replica.admit() for _ in range(2)]
        assert counted(redis_server, prefix) == 3
        redis_server.freeze()
        try:
            for _, held in left:
                release(held, NEVER_SENT)
            # Long enough for each give-back to fail (and Redis to be marked down).
            await asyncio.sleep(3 * TIMEOUT_S)
        finally:
            redis_server.thaw()
        assert await settled(redis_server, prefix, 1) == 1
        assert 1 + await served(replica) == MAX_REQUESTS
    finally:
        await replica.close()


@pytest.mark.parametrize("replicas", [2])
async def test_two_replicas_calls_in_a_freeze_leave_no_count(redis_server, replicas):
    """As the trial ran it: two replicas, calls in parallel on each while Redis is frozen,
    some refused for the count's lost reply, some queued to leave during the freeze. Once
    Redis answers, the run holds only the counts of calls that reached the upstream."""
    prefix = new_prefix()
    group = [await replica_on(redis_server, prefix) for _ in range(replicas)]
    try:
        _, held = await group[0].admit()
        release(held, REACHED)
        leaving = [await replica.admit() for replica in group]
        redis_server.freeze()
        try:
            for _, held in leaving:
                release(held, NEVER_SENT)
            outcomes = await asyncio.gather(
                *(replica.admit() for replica in group for _ in range(2)),
                return_exceptions=True)
        finally:
            redis_server.thaw()
        assert all(isinstance(o, Rejected) for o in outcomes), outcomes
        assert await settled(redis_server, prefix, 1) == 1
        assert 1 + await served(group[1]) == MAX_REQUESTS
    finally:
        for replica in group:
            await replica.close()


async def test_calls_served_on_the_local_share_count_in_redis_after_the_outage(
        redis_server):
    """``on_unavailable: local``, 2 replicas: each serves its share (2 of 4) of the run
    while Redis is frozen. Once Redis answers, those calls are added to the run's shared
    count, once each, and the run is refused: before, they were counted only in each
    replica's memory, and the run got its whole ``max_requests`` again after the outage (a
    hostile trial: 40 calls served on a limit of 20). A call of the outage that never
    reached the upstream is given back, whether it ended during the outage or after its
    count was added."""
    prefix = new_prefix()
    group = [await replica_on(redis_server, prefix, Fallback("local", 2)) for _ in range(2)]
    a, b = group
    try:
        _, held = await a.admit()
        release(held, REACHED)
        redis_server.freeze()
        try:
            _, left_now = await a.admit()  # ends during the outage, never sent
            release(left_now, NEVER_SENT)
            _, left_later = await a.admit()  # still waiting when Redis is back
            assert await served(a) + await served(b) == 1 + 2
        finally:
            redis_server.thaw()
        # 1 before, 3 served on the shares, 1 still held: all in the shared count now.
        assert await settled(redis_server, prefix, 5) == 5
        release(left_later, NEVER_SENT)
        assert await settled(redis_server, prefix, 4) == 4
        assert await served(a) + await served(b) == 0
    finally:
        for replica in group:
            await replica.close()


class _Answering:
    """A shared run state whose give-backs fail while ``down``; the first of ``slow`` waits
    for ``answer`` before it is answered."""

    def __init__(self, slow: str) -> None:
        self.down = True
        self.slow = slow
        self.answer = asyncio.Event()
        self.applied: list[str] = []

    async def give_back_request(self, take: str, scopes: tuple[str, ...],
                                counted_on: object = None) -> int:
        if self.down:
            raise StateUnavailable("down", 1.0, maybe_applied=False)
        if take == self.slow:
            await self.answer.wait()
        self.applied.append(take)
        return len(scopes)


async def test_a_give_back_kept_while_the_oldest_is_dropped_is_still_sent(monkeypatch):
    """The round sent the oldest kept give-back, then took the oldest off the list when it
    was answered: if that one had been dropped meanwhile (the list full, another failed
    give-back added), the one taken off was another, never sent (a review). At most
    ``MAX_GIVE_BACKS`` are kept; every one kept is sent once."""
    monkeypatch.setattr(runs_module, "MAX_GIVE_BACKS", 3)
    shared = _Answering(slow="a")
    give_backs = GiveBacks(shared, Background())  # type: ignore[arg-type]
    for take in "abc":
        with pytest.raises(StateUnavailable):
            await give_backs.give_back(take, (SCOPE,))
    shared.down = False
    give_backs.kick()  # sends a, whose answer waits
    await asyncio.sleep(0)
    shared.down = True
    with pytest.raises(StateUnavailable):  # kept, and the list is full: the oldest dropped
        await give_backs.give_back("d", (SCOPE,))
    shared.down = False
    shared.answer.set()
    for _ in range(100):
        give_backs.kick()
        await asyncio.sleep(0.01)
        if not len(give_backs):
            break
    assert sorted(shared.applied) == ["a", "b", "c", "d"]


async def test_a_call_that_counted_nothing_gives_nothing_back():
    """A run with no ``max_requests`` counts nothing in its admission: when Redis did not
    answer it, nothing is given back (a review saw a give-back of no scope sent, a record
    left in Redis, and "1 call reconciled" logged)."""
    shared = _Answering(slow="")
    registry = RunRegistry()
    registry.give_backs = GiveBacks(shared, registry.background)  # type: ignore[arg-type]
    registry.give_back("a", ())
    await asyncio.sleep(0.05)
    assert (len(registry.give_backs), shared.applied) == (0, [])
    registry.give_back("b", (SCOPE,))
    await asyncio.sleep(0.05)
    assert len(registry.give_backs) == 1  # the one that counted is kept for when Redis answers


def _child_call(replica, run, parent):
    return Call(request_id=f"q{next(replica._ids)}", route="x", method="POST", path="/x/",
                headers={}, body=b"", tenant=TENANT, run=run, parent_run=parent)


async def _admit_child(replica, run, parent):
    call = _child_call(replica, run, parent)
    held = [await replica.tracker.admit(call)]
    held.append(await replica.limits.admit(call))
    return held


async def test_a_child_first_seen_in_an_outage_stays_under_its_parent(redis_server):
    """A review: a child run whose first call came while Redis was marked down was counted
    in Redis by its outage count (no link) and, at its next call, stayed a root for good."""
    prefix = new_prefix()
    rep = await replica_on(redis_server, prefix)
    rep.registry.fallback = Fallback("local", 1)
    key = lambda run: f"{prefix}:{{runs}}:run:{qualified(TENANT)}{run}"  # noqa: E731
    r = redis_server.client()
    try:
        release(await _admit_child(rep, "root", None), REACHED)  # root known to Redis
        redis_server.freeze()
        try:
            # The first call in the freeze times out (served on the local share) and marks
            # Redis down.
            release(await _admit_child(rep, "root", None), REACHED)
            await asyncio.sleep(0.3)
            # a new child run's first call: Redis is marked down, nothing is sent for it
            release(await _admit_child(rep, "kid", "root"), REACHED)
        finally:
            redis_server.thaw()
        deadline = time.monotonic() + 5
        while not r.exists(key("kid")) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        root_before = int(r.hget(key("root"), "n:*") or 0)
        release(await _admit_child(rep, "kid", "root"), REACHED)  # the child's next call
        root_after = int(r.hget(key("root"), "n:*") or 0)
        assert r.hget(key("kid"), "parent") == b"root", r.hgetall(key("kid"))
        assert root_after == root_before + 1, (root_before, root_after)
    finally:
        await rep.close()


@pytest.fixture(params=["redis", "cluster"])
def own_redis(request: pytest.FixtureRequest, tmp_path) -> Iterator[
        tuple[RedisServer | RedisCluster, list[RedisServer]]]:
    """A Redis of this test's own to freeze, with its server processes: one server, then a
    3-master cluster."""
    if request.param == "redis":
        server = RedisServer(tmp_path / "redis").start()
        yield server, [server]
        server.stop()
        return
    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        yield cluster, cluster.servers
    finally:
        cluster.stop()


async def _answering(*replicas: Replica) -> None:
    """Wait until each replica's state is marked up and its kept give-backs, counts and
    links have been sent (at most :data:`SETTLE_S` seconds)."""
    deadline = time.monotonic() + SETTLE_S
    while any(not rep.state.health.up or len(rep.registry.give_backs) for rep in replicas):
        assert time.monotonic() < deadline, [
            (rep.state.health.up, len(rep.registry.give_backs)) for rep in replicas]
        await asyncio.sleep(0.05)


async def test_a_child_placed_only_on_its_replica_in_an_outage_is_linked_once_redis_answers(
        own_redis):
    """The tree job -> job-kid -> job-kid-kid. B's admission of job-kid never reaches Redis
    (a freeze, which B's call before it has marked down), so B links job-kid under job in
    its own tree only and serves it (``on_unavailable: local``). Redis answers again; C
    admits job-kid-kid under job-kid there (job-kid's shared hash then holds a first-call
    time and a count, so no later call of job-kid could link it); job is cancelled. A replica
    started after the cancel, which asks only Redis, must refuse job-kid-kid and a child of
    it. Before, B's link never reached Redis: job-kid stayed a root there, and D served both
    (so did every replica but B, for the cancel's whole ``cancel_ttl``)."""
    server, processes = own_redis
    prefix = new_prefix()
    local = Fallback("local", 3)
    a, b, c = [await replica_on(server, prefix, local) for _ in range(3)]
    d = None
    try:
        release(await _admit_child(a, "job", None), REACHED)
        for process in processes:
            process.freeze()
        try:
            # Times out (served on B's share) and marks Redis down on B...
            release(await _admit_child(b, "warm", None), REACHED)
            assert not b.state.health.up
            # ...so job-kid's admission is not even sent: B's own tree decides.
            release(await _admit_child(b, "job-kid", "job"), REACHED)
        finally:
            for process in processes:
                process.thaw()
        await _answering(a, b, c)
        release(await _admit_child(c, "job-kid-kid", "job-kid"), REACHED)
        assert await a.registry.shared.cancel("job", 600, [TENANT]) == {TENANT: 600.0}

        d = await replica_on(server, prefix, local)
        late = []
        for run, parent in (("job-kid-kid", None), ("job-great", "job-kid-kid")):
            try:
                release(await _admit_child(d, run, parent), REACHED)
                late.append((run, "served"))
            except Rejected as rejected:
                late.append((run, rejected.reason.code))
        client = (ClusterClient.from_url(server.url) if isinstance(server, RedisCluster)
                  else redis.Redis.from_url(server.url))
        with client:
            link = client.hget(f"{prefix}:{{runs}}:run:{qualified(TENANT)}job-kid", "parent")
        assert (late, link) == (
            [("job-kid-kid", "run_cancelled"), ("job-great", "run_cancelled")], b"job")
    finally:
        for rep in (a, b, c, d):
            if rep is not None:
                await rep.close()
