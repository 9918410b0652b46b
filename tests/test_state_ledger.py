"""The shared budget ledger (policies.state.ledger): memory, one Redis, a Redis Cluster; and
a stateful property test of the Redis ledger against the memory one."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from policies.state import StateBackends, redis_backends
from policies.state.ledger import Claim, MemoryLedger
from tests.redis_servers import delete_prefix, new_prefix, replica, require_redis

HOUR = 3600.0


def claims(now: float, **amounts_and_caps: tuple[float, float]) -> list[Claim]:
    return [Claim(key, amount, cap, now + HOUR)
            for key, (amount, cap) in amounts_and_caps.items()]


def rid() -> str:
    return uuid.uuid4().hex


async def test_reserve_holds_every_claim_or_none(backends: StateBackends):
    ledger, now = backends.ledger, time.time()
    assert await ledger.reserve("r", rid(), claims(now, day=(60, 100), run=(60, 50)),
                                now, 60) == [1]
    assert await ledger.levels("r", ["day", "run"]) == [(0, 0), (0, 0)]
    assert await ledger.reserve("r", rid(), claims(now, day=(40, 100), run=(40, 50)),
                                now, 60) == []
    assert await ledger.levels("r", ["day", "run"]) == [(0, 40), (0, 40)]
    assert backends.ledger.level("r", "run") == (0, 40)
    # Both now refuse 61; only the run's counter refuses 11.
    assert await ledger.reserve("r", rid(), claims(now, day=(61, 100), run=(61, 50)),
                                now, 60) == [0, 1]
    assert await ledger.reserve("r", rid(), claims(now, day=(11, 100), run=(11, 50)),
                                now, 60) == [1]


async def test_reserving_again_with_the_same_id_holds_once(backends: StateBackends):
    ledger, now, same = backends.ledger, time.time(), rid()
    for _ in range(3):
        assert await ledger.reserve("r", same, claims(now, day=(30, 100)), now, 60) == []
    assert await ledger.levels("r", ["day"]) == [(0, 30)]


async def test_settle_applies_once(backends: StateBackends):
    ledger, now, one = backends.ledger, time.time(), rid()
    await ledger.reserve("r", one, claims(now, day=(100, 1000), usd=(0.5, 2.0)), now, 60)
    assert await ledger.settle("r", one, [70, 0.125]) is True
    assert await ledger.levels("r", ["day", "usd"]) == [(70, 0), (0.125, 0)]
    assert await ledger.settle("r", one, [70, 0.125]) is False
    assert await ledger.settle("r", rid(), [1, 1]) is False
    assert await ledger.levels("r", ["day", "usd"]) == [(70, 0), (0.125, 0)]


async def test_many_concurrent_reservations_never_overshoot(backends: StateBackends):
    now = time.time()
    async with replica(backends) as second, replica(backends) as third:
        ledgers = [backends.ledger, second.ledger, third.ledger]
        ids = [rid() for _ in range(60)]
        denied = await asyncio.gather(*(
            ledgers[i % 3].reserve("r", ids[i], claims(now, day=(100, 1000), run=(100, 2000)),
                                   now, 60)
            for i in range(60)))
        admitted = [i for i, d in enumerate(denied) if not d]
        assert len(admitted) == 10
        assert await backends.ledger.levels("r", ["day"]) == [(0, 1000)]
        await asyncio.gather(*(ledgers[i % 3].settle("r", ids[i], [90, 90]) for i in admitted))
    assert await backends.ledger.levels("r", ["day", "run"]) == [(900, 0), (900, 0)]


async def test_an_abandoned_reservation_is_reaped_and_a_late_settle_charges_once(
        backends: StateBackends):
    ledger, now = backends.ledger, time.time()
    dead = rid()
    assert await ledger.reserve("r", dead, claims(now, day=(800, 1000)), now, 0.3) == []
    assert await ledger.reserve("r", rid(), claims(now, day=(500, 1000)), now, 0.3) == [0]
    await asyncio.sleep(0.35)
    # The next reserve reaps the one nobody settled: its hold is back in the budget.
    alive = rid()
    assert await ledger.reserve("r", alive, claims(now, day=(500, 1000)), now, 60) == []
    assert await ledger.levels("r", ["day"]) == [(0, 500)]
    # Its call did finish after all: the spend counts, the hold is not released twice.
    assert await ledger.settle("r", dead, [300]) is True
    assert await ledger.settle("r", dead, [300]) is False
    assert await ledger.levels("r", ["day"]) == [(300, 500)]


async def test_charge_adds_spend_without_a_reservation(backends: StateBackends):
    ledger, now = backends.ledger, time.time()
    await ledger.charge("r", claims(now, day=(1200, 1000)), now)
    assert await ledger.levels("r", ["day"]) == [(1200, 0)]
    assert await ledger.reserve("r", rid(), claims(now, day=(1, 1000)), now, 60) == [0]


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_counters_expire_after_their_window(backends: StateBackends):
    state = backends.redis
    assert state is not None
    now = time.time()
    await backends.ledger.reserve(
        "r", rid(), [Claim("day:20321", 10, 100, now + 100)], now, 60)
    key = state.key("r", "budget", "day:20321")
    ttl_ms = await state.run(lambda client: client.pttl(key))
    assert 159_000 < ttl_ms <= 160_000  # the window's end, plus the longest hold


# -- the Redis ledger against the memory one --------------------------------------------------

CAPS = {"day": 100.0, "run": 150.0, "usd": 75.0}
# Coarse amounts, exact in binary, so that counters often land exactly on their caps.
amounts = st.integers(0, 8).map(lambda eighths: eighths * 12.5)


class LedgerAgainstMemory(RuleBasedStateMachine):
    """Any sequence of reserves, settles and repeated settles leaves the Redis ledger where
    the memory ledger is: same refusals, same (spent, held) of every counter."""

    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.prefix = new_prefix()
        self.backends = self.loop.run_until_complete(
            redis_backends(require_redis(), self.prefix, 2.0))
        self.redis = self.backends.ledger
        self.memory = MemoryLedger()
        self.now = time.time()
        self.settled: list[str] = []

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    @rule(target=reservations,
          wanted=st.dictionaries(st.sampled_from(sorted(CAPS)), amounts, min_size=1))
    def reserve(self, wanted: dict[str, float]):  # type: ignore[no-untyped-def]
        batch = [Claim(key, amount, CAPS[key], self.now + HOUR)
                 for key, amount in wanted.items()]
        one = rid()
        got = self.run(self.redis.reserve("r", one, batch, self.now, HOUR))
        want = self.run(self.memory.reserve("r", one, batch, self.now, HOUR))
        assert got == want
        return multiple() if got else multiple((one, len(batch)))

    @rule(reservation=consumes(reservations), data=st.data())
    def settle(self, reservation: tuple[str, int], data: st.DataObject) -> None:
        one, size = reservation
        actual = data.draw(st.lists(amounts, min_size=size, max_size=size))
        assert self.run(self.redis.settle("r", one, actual)) is True
        assert self.run(self.memory.settle("r", one, actual)) is True
        self.settled.append(one)

    @rule(data=st.data())
    def settle_again(self, data: st.DataObject) -> None:
        if not self.settled:
            return
        one = data.draw(st.sampled_from(self.settled))
        assert self.run(self.redis.settle("r", one, [1.0])) is False
        assert self.run(self.memory.settle("r", one, [1.0])) is False

    @invariant()
    def same_levels(self) -> None:
        keys = sorted(CAPS)
        assert self.run(self.redis.levels("r", keys)) == self.run(
            self.memory.levels("r", keys))

    def teardown(self) -> None:
        self.run(self.backends.close())
        self.loop.close()
        delete_prefix(require_redis(), self.prefix)


LedgerAgainstMemory.TestCase.settings = settings(
    max_examples=50, stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_redis_ledger_matches_memory = LedgerAgainstMemory.TestCase


async def test_the_levels_kept_for_gauges_follow_the_settle_not_only_the_reserve(
        backends: StateBackends):
    """``level`` is what the budget gauges, ``/admin/routes`` and the budget headers read
    without a round trip. On Redis it kept the levels of the last reserve: after one call
    settled 18 of its 128 reserved tokens, the gauges said 128 reserved and 2872 remaining
    of 3000 (a hostile trial), until that counter's next reserve."""
    ledger, now = backends.ledger, time.time()
    first, second = rid(), rid()
    assert await ledger.reserve("g", first, claims(now, day=(128, 3000)), now, 60) == []
    assert await ledger.reserve("g", second, claims(now, day=(100, 3000)), now, 60) == []
    assert ledger.level("g", "day") == (0, 228)
    assert await ledger.settle("g", first, [18]) is True
    assert ledger.level("g", "day") == (18, 100)
    # Given back unspent through the admission step's release (a refusal after admission).
    assert await backends.admissions.release("g", [], second) is True
    assert ledger.level("g", "day") == (18, 0)
    assert await ledger.settle("g", first, [18]) is False  # once
    assert ledger.level("g", "day") == (18, 0)


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_a_refresh_reaps_a_dead_replicas_lapsed_reservation(backends: StateBackends):
    """A replica's kept level showed another replica's reservation after its hold had passed
    (that replica killed) until the next reserve in the group; the refresh a scrape makes
    now reaps it as that reserve would, and a settle arriving late still charges once."""
    ledger, now = backends.ledger, time.time()
    dead = rid()
    async with replica(backends) as other:
        assert await other.ledger.reserve("g", dead, claims(now, day=(200, 3000)), now,
                                          60) == []
        mine = rid()
        assert await ledger.reserve("g", mine, claims(now, day=(10, 3000)), now, 60) == []
        assert await ledger.settle("g", mine, [7]) is True
        assert ledger.level("g", "day") == (7, 200)  # the other replica's, held
        await ledger.refresh_held()
        assert ledger.level("g", "day") == (7, 200)  # not due
        # Its hold over, as a minute would make it (the ledger reaps on Redis's clock).
        expiries = ledger.reservation_keys("g")[1]
        assert backends.redis is not None
        await backends.redis.run(lambda client: client.zadd(expiries, {dead: 0}, xx=True))
        await ledger.refresh_held()
        assert ledger.level("g", "day") == (7, 0)
        assert await other.ledger.settle("g", dead, [150]) is True  # lapsed: charged once
        assert await other.ledger.settle("g", dead, [150]) is False
        assert (await ledger.levels("g", ["day"])) == [(157, 0)]


async def test_a_marked_settle_leaves_its_id_gone_for_a_late_copy_of_its_reserve(
        backends: StateBackends):
    """The reconciler charges spend made on the local fallback as a reserve of its own id,
    then a settle; a round whose reserve timed out (still on the wire) is tried again. A
    review: the retry's reserve landed first and was settled, then the stalled copy landed
    and held the spend again, uncapped, until the reap. Its settle marks the id gone (the
    reconciler's ``mark``), so the late copy holds nothing. (Memory has no late scripts.)"""
    if backends.redis is None:
        pytest.skip("the memory ledger has no script on its way")
    ledger, now, one = backends.ledger, time.time(), rid()
    spent = [Claim("tokens:acme:1", 60.0, float("inf"), now + HOUR)]
    assert await ledger.reserve("r", one, spent, now, 120.0) == []  # the retry's reserve
    assert await ledger.settle("r", one, [60.0], mark=True)
    assert await ledger.reserve("r", one, spent, now, 120.0) == []  # the stalled one lands
    assert await ledger.levels("r", ["tokens:acme:1"]) == [(60.0, 0.0)]
    assert not await ledger.settle("r", one, [60.0], mark=True)  # charged once
    assert await ledger.levels("r", ["tokens:acme:1"]) == [(60.0, 0.0)]
