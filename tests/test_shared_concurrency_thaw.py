"""A shared concurrency limit when Redis comes back after an outage (``on_unavailable: local``).

During the outage each replica admits its share of the limit on memory leases. Redis does
not know those calls, so until they are counted there a replica asking Redis for a slot would
be granted one beside them: the route ran 6 and 7 calls on a limit of 4 in the first half
second after a thaw (a hostile trial, two replicas). Here: a replica's own memory calls count
in its first acquire after the thaw; every replica moves its memory leases into Redis (and
takes again the leases Redis lost) as soon as it sees Redis up, not at their renewal, a third
of ``lease`` later; and a replica that
admitted from its share keeps to it for ``settle_s`` after Redis answers, while the others'
moves land. Two replicas' state on a Redis of the test's own, stopped and started again.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policies.reasons import Reason, Rejected
from policies.shared_concurrency import SharedConcurrencyLimiter
from policies.state import (
    RENEW_BATCH,
    Fallback,
    Health,
    StateBackends,
    StateUnavailable,
    memory_backends,
    redis_backends,
)
from policies.state.leases import MemoryLeases
from tests.redis_servers import RedisServer, new_prefix
from tests.test_shared_concurrency import DONE, _value, eventually, leases_held, limiter

T = TypeVar("T")

#: Long enough that no renewal (every third of it) runs during a test: what moves a memory
#: lease into Redis here is the recovery, not the renewal.
LEASE_S = 30.0


async def replica_state(server: RedisServer, prefix: str) -> StateBackends:
    state = await redis_backends(server.url, prefix, 0.2, probe_interval_s=0.05)
    state.fallback = Fallback("local", 2)
    state.lease_s = LEASE_S
    return state


async def memory_leases_held(state: StateBackends) -> int:
    assert state.fallback.local is not None
    return (await state.fallback.local.leases.counts("r", "t"))[0]


async def grab(lim: SharedConcurrencyLimiter):
    """A slot if one is free now (never queues), else ``None``."""
    try:
        return await lim.acquire("t", caller_timeout=0.0)
    except Rejected:
        return None


async def test_calls_admitted_from_memory_keep_the_limit_after_redis_is_back(redis_server):
    """``limit: 4`` on two replicas; Redis stopped, each admits its share (2) from memory;
    Redis back: both replicas asking for more, again and again from the first moment, never
    put more than 4 calls in flight, the memory calls are counted in Redis long before their
    renewal, and once they end the whole limit is there again."""
    prefix = new_prefix()
    a_state = await replica_state(redis_server, prefix)
    b_state = await replica_state(redis_server, prefix)
    try:
        a, b = limiter(a_state, 4), limiter(b_state, 4)
        redis_server.stop()
        held = [await lim.acquire("t") for lim in (a, a, b, b)]
        assert a.degraded and b.degraded
        redis_server.start()  # the same port, empty: nothing held there
        extra = []
        for _ in range(30):
            for lim in (a, b):
                if (slot := await grab(lim)) is not None:
                    extra.append(slot)
            assert len(held) + len(extra) <= 4, f"{len(held) + len(extra)} calls on a limit of 4"
            await asyncio.sleep(0.02)
        assert not a.degraded and not b.degraded  # they did ask Redis
        await eventually(lambda: leases_held(a_state), 4, 5.0, "memory calls counted in Redis")
        assert not a_state.held_leases.unmoved and not b_state.held_leases.unmoved
        assert (await memory_leases_held(a_state), await memory_leases_held(b_state)) == (0, 0)
        for slot in held + extra:
            slot.release(DONE)
        await eventually(lambda: leases_held(a_state), 0, 5.0, "leases given back")
        again = [await a.acquire("t") for _ in range(4)]
        assert await grab(b) is None
        for slot in again:
            slot.release(DONE)
        await eventually(lambda: leases_held(a_state), 0, 5.0, "leases given back")
    finally:
        await a_state.close()
        await b_state.close()


async def test_a_replica_counts_its_memory_calls_in_redis_once_its_probe_sees_it_up(
        redis_server):
    """No call of its own asks Redis after the outage: the health probe seeing Redis up is
    enough to move the replica's memory leases there (their renewal is 10 s away)."""
    state = await replica_state(redis_server, new_prefix())
    try:
        lim = limiter(state, 4)
        redis_server.stop()
        held = [await lim.acquire("t"), await lim.acquire("t")]
        assert lim.degraded and await memory_leases_held(state) == 2
        redis_server.start()
        await eventually(lambda: _value(state.health.up), True, 5.0, "Redis seen up")
        await eventually(lambda: leases_held(state), 2, 5.0, "memory calls counted in Redis")
        # Redis counts a moved lease before the replica has read the move's answer and given
        # its memory lease back: wait for the answers (read at once, a loaded machine found
        # both memory leases still held).
        await eventually(lambda: memory_leases_held(state), 0, 5.0, "memory leases given back")
        assert not state.held_leases.unmoved
        assert all(slot.lease.leases is state.leases for slot in held)
        for slot in held:
            slot.release(DONE)
        await eventually(lambda: leases_held(state), 0, 5.0, "leases given back")
    finally:
        await state.close()


async def test_leases_a_restarted_redis_lost_are_taken_again_once_it_is_seen_up(redis_server):
    """Redis restarts empty under two running calls: once a call has found it gone and the
    probe sees it back, both leases are taken again (their renewal is 10 s away), so
    the route's count is right before new calls ask."""
    state = await replica_state(redis_server, new_prefix())
    try:
        lim = limiter(state, 4)
        held = [await lim.acquire("t"), await lim.acquire("t")]
        redis_server.stop()
        with pytest.raises(StateUnavailable):  # a call finds it gone: marked down
            await leases_held(state)
        redis_server.start()  # empty
        await eventually(lambda: _value(state.health.up), True, 5.0, "Redis seen up")
        # Each lease's answer is read after Redis ran its script: wait for the answers.
        await eventually(lambda: _value(sum(slot.lease.retaken for slot in held)), 2, 5.0,
                         "leases taken again")
        assert await leases_held(state) == 2
        for slot in held:
            slot.release(DONE)
        await eventually(lambda: leases_held(state), 0, 5.0, "leases given back")
        assert not state.held_leases.live
    finally:
        await state.close()


@pytest.mark.parametrize("pause", [0.0, 0.5])
async def test_leases_a_fast_restart_lost_are_taken_again_at_the_next_call(redis_server,
                                                                            pause):
    """Redis restarted empty between two calls, so fast that none failed and it was never
    marked down (a hostile trial: back in 25-70 ms, 8 calls at the upstream on a limit of
    4): the next call, on a connection redis-py finds closed (the command fails: pause 0) or
    reconnects before sending it (the close already seen: pause 0.5 s), has the leases
    taken again at once (their renewal is 10 s away)."""
    state = await replica_state(redis_server, new_prefix())
    try:
        lim = limiter(state, 4)
        held = [await lim.acquire("t"), await lim.acquire("t")]
        redis_server.stop()
        redis_server.start()  # empty
        await asyncio.sleep(pause)
        await leases_held(state)  # answered on a new connection
        assert state.health.up
        await eventually(lambda: _value(sum(slot.lease.retaken for slot in held)), 2, 5.0,
                         "leases taken again")
        assert await leases_held(state) == 2
        for slot in held:
            slot.release(DONE)
        await eventually(lambda: leases_held(state), 0, 5.0, "leases given back")
    finally:
        await state.close()


@pytest.mark.parametrize("when", ["before the move", "as it starts", "as it lands"])
async def test_a_call_ending_while_its_lease_moves_leaves_nothing_held(redis_server, when):
    """The call ends before Redis is back, in the same step the move starts, or just after
    the move's answer: its lease is given back wherever it is then, in Redis and in memory."""
    state = await replica_state(redis_server, new_prefix())
    try:
        lim = limiter(state, 4)
        redis_server.stop()
        slot = await lim.acquire("t")
        if when == "before the move":
            slot.release(DONE)
        redis_server.start()
        if when == "as it starts":
            assert slot.lease.refresh() is not None  # what recovery does, out of turn
            slot.release(DONE)
        await eventually(lambda: _value(state.health.up), True, 5.0, "Redis seen up")
        if when == "as it lands":
            await eventually(lambda: leases_held(state), 1, 5.0, "lease moved")
            slot.release(DONE)
        await slot.lease.release()
        assert await leases_held(state) == 0
        assert await memory_leases_held(state) == 0
        assert not state.held_leases.unmoved and not state.held_leases.live
        assert (lim.inflight, lim.queued) == (0, 0)
    finally:
        await state.close()


# -- outages at any await (hypothesis, a Redis stand-in) -----------------------------------------


class Switch:
    """Whether the stand-in Redis answers; shared by every replica."""

    def __init__(self) -> None:
        self.up = True


class FlakyLeases:
    """One replica's client of a Redis stand-in: the leases of a shared ``MemoryLeases``,
    each call suspending for a few turns of the loop after it is sent and before its answer
    arrives, so other tasks run in between, as with the real one. While the switch is off, a
    call raises ``StateUnavailable``: the first after the replica last saw Redis up may have
    been applied before its answer was lost (``maybe_applied``); later ones are refused
    unsent, as a backend marked down refuses them. ``rng`` decides both."""

    def __init__(self, store: MemoryLeases, switch: Switch, health: Health,
                 rng: random.Random) -> None:
        self.store, self.switch, self.health, self.rng = store, switch, health, rng
        #: Renewals on their way now, and the most there were at once.
        self.renewing = self.peak_renewing = 0
        #: If set, the next renewal waits for it before it is sent.
        self.gate: asyncio.Event | None = None

    async def _travel(self) -> None:
        """A message on its way: 1 to 4 turns of the loop, as the seed says."""
        for _ in range(self.rng.randint(1, 4)):
            await asyncio.sleep(0)

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        if not self.health.up and self.health.known:
            raise StateUnavailable("marked down", 0.01, maybe_applied=False)
        await self._travel()
        if self.switch.up:
            result = await op()
            await self._travel()
            if self.switch.up:
                self.health.ok()
                return result
        elif self.rng.random() < 0.5:  # it ran; its answer is lost
            await op()
        self.health.fail("down")
        raise StateUnavailable("down", 0.01)

    async def acquire(self, *args, **kwargs):
        return await self._call(lambda: self.store.acquire(*args, **kwargs))

    async def register(self, *args):
        return await self._call(lambda: self.store.register(*args))

    async def renew(self, *args):
        self.renewing += 1
        self.peak_renewing = max(self.peak_renewing, self.renewing)
        try:
            if self.gate is not None:
                gate, self.gate = self.gate, None
                await gate.wait()
            return await self._call(lambda: self.store.renew(*args))
        finally:
            self.renewing -= 1

    async def release(self, *args):
        return await self._call(lambda: self.store.release(*args))

    async def counts(self, *args):
        return await self._call(lambda: self.store.counts(*args))

    def watch(self, group: str):
        return self.store.watch(group)


class StandInRedis:
    """What :meth:`StateBackends.settle_s` reads of a Redis connection, and its close."""

    probe_interval_s = 0.01
    timeout_s = 0.01

    async def close(self) -> None:
        pass


STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("call"), st.sampled_from("ab"),
                  st.floats(0.0, 0.05),  # how long it holds its slot
                  st.none() | st.floats(0.0, 0.05)),  # cancelled after this long
        st.tuples(st.just("down")),
        st.tuples(st.just("up"), st.sampled_from(("", "a", "b", "ab"))),  # whose probe sees it
        st.tuples(st.just("wait"), st.floats(0.0, 0.03)),
    ),
    min_size=1, max_size=16,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Interleavings hypothesis found once, kept: the background release of an acquire whose
# answer was lost landing on the memory lease taken under the same id, once moved; a
# release during the outage given up at once; a move whose answer was lost, then the call
# ending with its lease still in memory.
@example(steps=[("down",), ("call", "a", 0.0, None), ("wait", 0.015625)],
         limit=1, seed=0, lease_s=3.0)
@example(steps=[("call", "a", 0.0, None), ("call", "a", 0.0, None),
                ("call", "a", 0.0, 0.015625), ("wait", 0.015625), ("down",),
                ("wait", 0.015625)],
         limit=1, seed=0, lease_s=3.0)
@example(steps=[("down",), ("call", "a", 0.0, None), ("wait", 0.0),
                ("call", "b", 0.0, 0.015625), ("wait", 1e-09), ("up", "b"), ("down",),
                ("wait", 0.015625)],
         limit=1, seed=10, lease_s=3.0)
@given(steps=STEPS, limit=st.integers(1, 4), seed=st.integers(0, 2**16),
       lease_s=st.sampled_from((0.09, 3.0)))
def test_outages_at_any_await_leave_no_lease_and_every_call_counted(steps, limit, seed,
                                                                     lease_s):
    """Calls on two replicas arrive, hold and leave, some cancelled, while the stand-in Redis
    goes away and comes back at random moments (answers lost or not, each replica's probe
    seeing it back or not): memory leases taken, moved, renewed out of turn, released
    mid-move. Once every replica has seen Redis up, Redis counts exactly the calls running
    (every memory lease moved, every lost one taken again): with a 3 s lease, before any
    renewal in turn could have made up for a lease lost or not moved; once all have ended,
    nothing is held anywhere: Redis, memory, the replicas' counts and lease sets. A lease
    of 90 ms has renewals run in turn during the program too."""
    asyncio.run(_outages(steps, limit, random.Random(seed), lease_s))


def stand_in_replicas(limit: int, rng: random.Random, lease_s: float,
                      per_tenant: int | None = None
                      ) -> tuple[MemoryLeases, Switch,
                                 dict[str, tuple[StateBackends, SharedConcurrencyLimiter]]]:
    """Replicas ``a`` and ``b`` (``on_unavailable: local``, 2 replicas) sharing ``limit``
    (and ``per_tenant``) on the stand-in Redis: its store, its switch, and each replica's
    state and limiter."""
    store, switch = MemoryLeases(), Switch()
    replicas: dict[str, tuple[StateBackends, SharedConcurrencyLimiter]] = {}
    for name in "ab":
        state = memory_backends()
        state.health = Health()
        state.health.ok()
        state.leases = FlakyLeases(store, switch, state.health, rng)
        state.redis = StandInRedis()  # type: ignore[assignment]
        state.fallback = Fallback("local", 2)
        state.lease_s = lease_s
        state.health.on_change(state.renew_leases)  # as redis_backends() does
        replicas[name] = (state, limiter(state, limit, queue=4, max_wait=0.2,
                                         per_tenant=per_tenant))
    return store, switch, replicas


async def test_callers_arriving_together_after_the_thaw_keep_to_the_share():
    """``limit: 4`` on two replicas; during the outage A admits 1 call from memory and B 2.
    A sees Redis back first (B's probe has not run yet: its 2 calls are not in Redis) and
    3 callers arrive at A at once: A keeps to its share (2) counting the acquires still
    waiting for Redis's answer, so 4 calls run, not 6 (a hostile review: 6)."""
    store, switch, replicas = stand_in_replicas(4, random.Random(0), 3.0)
    (a_state, a), (_, b) = replicas["a"], replicas["b"]
    switch.up = False
    held = [await a.acquire("t"), await b.acquire("t"), await b.acquire("t")]
    assert a.degraded and b.degraded
    switch.up = True
    a_state.health.ok()  # A's probe; B's is yet to run
    await eventually(lambda: store.counts("r", "t"), (1, 1), 2.0, "A's call moved")
    burst = await asyncio.gather(*(grab(a) for _ in range(3)))
    granted = [slot for slot in burst if slot is not None]
    assert (a.inflight, b.inflight) == (2, 2), f"{a.inflight} + {b.inflight} on a limit of 4"
    assert len(granted) == 1
    for slot in held + granted:
        slot.release(DONE)
    switch.up = True
    replicas["b"][0].health.ok()
    await eventually(lambda: store.counts("r", "t"), (0, 0), 2.0, "leases given back")


async def test_a_replica_that_saw_the_outage_keeps_to_its_share_though_it_admitted_nothing():
    """B holds its share (2) on Redis leases when Redis goes, admits nothing meanwhile, but
    sees the outage (a renewal fails); A admits its share from memory. Redis back, B's probe
    sees it first: B keeps to its share while A's calls are not in Redis yet, rather than
    filling the limit beside them (5 of 4 when only a replica that fell back kept to it)."""
    store, switch, replicas = stand_in_replicas(4, random.Random(0), 3.0)
    (a_state, a), (b_state, b) = replicas["a"], replicas["b"]
    held = [await b.acquire("t"), await b.acquire("t")]
    switch.up = False
    b_state.health.fail("a renewal timed out")
    a_state.health.fail("down")  # marked down: nothing sent, nothing lost
    held += [await a.acquire("t"), await a.acquire("t")]
    assert a.degraded and not b.degraded
    switch.up = True
    b_state.health.ok()  # B's probe; A's is yet to run
    assert await grab(b) is None
    assert a.inflight + b.inflight == 4
    a_state.health.ok()
    await eventually(lambda: store.counts("r", "t"), (4, 4), 2.0, "A's calls moved")
    for slot in held:
        slot.release(DONE)
    await eventually(lambda: store.counts("r", "t"), (0, 0), 2.0, "leases given back")


async def test_a_tenant_keeps_to_its_share_of_per_tenant_after_the_thaw():
    """``per_tenant: 2`` on two replicas (1 each from memory): tenant X has a call on each
    during the outage; A sees Redis back and moves its call, B has not yet. A's next call
    for X is refused, as during the outage: 3 calls of X would run (a review: 3 of 2)."""
    store, switch, replicas = stand_in_replicas(10, random.Random(0), 3.0, per_tenant=2)
    (a_state, a), (b_state, b) = replicas["a"], replicas["b"]
    switch.up = False
    for state in (a_state, b_state):  # marked down: no acquire is sent, none is lost
        state.health.fail("down")
        # A settle window of 10 s, not the stand-in's 30 ms: the refusal below must come
        # within it, which a loaded machine missed (a new user's suite, round 35).
        state.redis.probe_interval_s = 5.0  # type: ignore[union-attr]
    held = [await a.acquire("X"), await b.acquire("X")]
    switch.up = True
    a_state.health.ok()  # A's probe; B's is yet to run
    await eventually(lambda: store.counts("r", "X"), (1, 1), 2.0, "A's call moved")
    with pytest.raises(Rejected) as refused:
        await a.acquire("X", caller_timeout=0.0)
    assert refused.value.reason is Reason.TENANT_CONCURRENCY
    other = await a.acquire("Y", caller_timeout=0.0)  # another tenant is within its share
    b_state.health.ok()
    await eventually(lambda: store.counts("r", "X"), (3, 2), 2.0, "B's call moved")
    for slot in (*held, other):
        slot.release(DONE)
    await eventually(lambda: store.counts("r", "X"), (0, 0), 2.0, "leases given back")


async def test_an_idle_route_is_not_held_to_its_share_long_after_redis_is_back():
    """The settle window runs from when Redis came back, not from the route's first call
    since: a route idle past it gets its whole limit at once (a review: 1 of 4 admitted,
    2 s after the recovery)."""
    store, switch, replicas = stand_in_replicas(4, random.Random(0), 3.0)
    state, lim = replicas["a"]
    switch.up = False
    (await lim.acquire("t")).release(DONE)  # fell back to its share
    switch.up = True
    state.health.ok()
    await asyncio.sleep(state.settle_s + 0.1)
    slots = await asyncio.gather(*(grab(lim) for _ in range(4)))
    assert None not in slots
    for slot in slots:
        slot.release(DONE)
    await eventually(lambda: store.counts("r", "t"), (0, 0), 2.0, "leases given back")


async def test_redis_back_again_during_the_recovery_renewals_renews_once_more():
    """A blip while the recovery's renewals run (one held open): a call admitted from
    memory in it is moved when Redis is back again, not at its renewal a second later (a
    review: left to it, 5 calls ran on a limit of 4 meanwhile)."""
    store, switch, replicas = stand_in_replicas(4, random.Random(0), 3.0)
    state, lim = replicas["a"]
    first = await lim.acquire("t")
    state.leases.gate = gate = asyncio.Event()
    state.renew_leases(True)  # a recovery: its renewal of the first call waits at the gate
    await eventually(lambda: _value(state.leases.renewing), 1, 2.0, "renewal under way")
    switch.up = False
    second = await lim.acquire("t")  # from memory
    assert lim.degraded and len(state.held_leases.unmoved) == 1
    switch.up = True
    state.health.ok()  # back again while the first recovery's renewals run
    gate.set()
    await eventually(lambda: _value(len(state.held_leases.unmoved)), 0, 0.5,
                     "the memory call moved")
    await eventually(lambda: store.counts("r", "t"), (2, 2), 2.0, "both calls in Redis")
    for slot in (first, second):
        slot.release(DONE)
    await eventually(lambda: store.counts("r", "t"), (0, 0), 2.0, "leases given back")


async def test_a_lost_acquire_run_after_a_freeze_longer_than_the_lease_is_released(
        redis_server):
    """An acquire sent into a frozen Redis times out (the call runs from memory, then ends);
    Redis stays frozen past the lease time and runs the acquire when it thaws: that lease is
    released as soon as Redis is seen back (a review: retried only until the lease would have
    lapsed, it then held the slot for a whole lease time)."""
    state = await replica_state(redis_server, new_prefix())
    state.lease_s = 1.0
    try:
        lim = limiter(state, 4)
        warm = await lim.acquire("t")  # the scripts loaded: a frozen server runs them later
        warm.release(DONE)
        await eventually(lambda: leases_held(state), 0, 2.0, "warm-up lease given back")
        redis_server.freeze()
        slot = await lim.acquire("t")  # times out on Redis: from memory
        slot.release(DONE)
        await asyncio.sleep(2.0)  # the freeze outlasts the lease
        redis_server.thaw()
        await eventually(lambda: _value(state.health.up), True, 5.0, "Redis seen up")
        await eventually(lambda: leases_held(state), 0, 0.5, "the lost acquire's lease")
        assert not state.held_leases.lost
    finally:
        redis_server.thaw()
        await state.close()


async def test_releases_not_tried_before_redis_went_again_are_kept_for_the_next_time():
    """20 releases Redis did not answer; it comes back and goes again during the first batch
    of them: none is forgotten (each is still to release), and the next recovery releases
    them all."""
    store, switch, replicas = stand_in_replicas(40, random.Random(0), 3.0)
    state, _lim = replicas["a"]
    ids = {("r", "t", f"lost-{i}") for i in range(20)}
    for _, tenant, lease_id in ids:
        assert (await store.acquire("r", tenant, lease_id, 40, None, 3.0)).granted
    state.held_leases.lost.update(ids)
    state.health.fail("down")
    state.health.ok()  # back: the releases start, 8 at a time
    switch.up = False  # and it goes again at once
    await eventually(lambda: _value(state._renewing.done()), True, 2.0, "recovery ended")
    assert state.held_leases.lost == ids
    switch.up = True
    state.health.ok()
    await eventually(lambda: store.counts("r", "t"), (0, 0), 2.0, "every lost lease released")
    assert not state.held_leases.lost


async def test_leases_are_renewed_a_few_at_a_time_when_redis_is_back():
    """60 calls held on a replica when Redis comes back (all lost by a restart, say): all
    are renewed at once, but no more than RENEW_BATCH at a time (thousands at once timed
    out waiting for the pool and marked Redis down again), each taken again."""
    store, _switch, replicas = stand_in_replicas(60, random.Random(0), 3.0)
    state, lim = replicas["a"]
    held = [await lim.acquire("t") for _ in range(60)]
    for slot in held:  # Redis restarted empty
        await store.release("r", "t", slot.lease.lease_id)
    state.health.fail("restarted")
    state.health.ok()  # the probe
    await eventually(lambda: store.counts("r", "t"), (60, 60), 5.0, "leases taken again")
    # Each renewal's answer is read a few loop turns after the store ran it: wait for the
    # answers (read at once, a poll that a loaded machine ran late found 58).
    await eventually(lambda: _value(sum(slot.lease.retaken for slot in held)), 60, 5.0,
                     "each renewal's answer read")
    assert state.leases.peak_renewing == RENEW_BATCH
    for slot in held:
        slot.release(DONE)
    await eventually(lambda: store.counts("r", "t"), (0, 0), 5.0, "leases given back")


async def _outages(steps, limit: int, rng: random.Random, lease_s: float) -> None:
    store, switch, replicas = stand_in_replicas(limit, rng, lease_s)
    running = 0
    can_end = asyncio.Event()

    async def one(lim: SharedConcurrencyLimiter, hold: float) -> None:
        nonlocal running
        slot = await lim.acquire("t")
        running += 1
        try:
            await asyncio.sleep(hold)
            await can_end.wait()
        finally:
            running -= 1
            slot.release(DONE)

    async def cancel_later(task: asyncio.Task, after: float) -> None:
        await asyncio.sleep(after)
        task.cancel()

    tasks = []
    for step in steps:
        if step[0] == "call":
            _, name, hold, cancel_after = step
            task = asyncio.create_task(one(replicas[name][1], hold))
            tasks.append(task)
            if cancel_after is not None:
                tasks.append(asyncio.create_task(cancel_later(task, cancel_after)))
        elif step[0] == "down":
            switch.up = False
        elif step[0] == "up":
            switch.up = True
            for name in step[1]:
                replicas[name][0].health.ok()  # its probe's answer
        else:
            await asyncio.sleep(step[1])
    switch.up = True
    for state, _ in replicas.values():
        state.health.ok()

    async def counted() -> bool:
        return (await store.counts("r", "t"))[0] == running

    # A lease lost or not moved would be made up for by its next renewal, a third of the
    # lease later: with a 3 s lease, the count must be right well before that.
    await eventually(counted, True, 0.9 if lease_s > 1 else 5.0,
                     f"Redis counting the {running} calls running")
    can_end.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        assert result is None or isinstance(result, (Rejected, asyncio.CancelledError)), \
            repr(result)
    for state, lim in replicas.values():
        await lim.background.wait()
        if lim._dispatcher is not None:
            await asyncio.wait_for(lim._dispatcher, 2.0)
        await asyncio.wait_for(asyncio.gather(*state.background), 2.0)
        assert (lim.inflight, lim.queued, lim._by_tenant) == (0, 0, {})
        assert not state.held_leases.live and not state.held_leases.unmoved
        if state.fallback.local is not None:
            assert await state.fallback.local.leases.counts("r", "t") == (0, 0)
    # Given back, not left to lapse (with a 3 s lease); a 90 ms lease may lapse first.
    await eventually(lambda: store.counts("r", "t"), (0, 0), 0.9 if lease_s > 1 else 1.0,
                     "leases left in Redis")
