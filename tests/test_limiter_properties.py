"""Property-based tests of the concurrency limiter and the budget ledger (hypothesis, stateful).

The limiter runs on a real asyncio event loop whose clock is virtual, so queue expiries fire
when the test moves time, not when the machine gets round to it. Each step of a random program
is one of: a call arrives (tenant, priority, caller timeout), a task is cancelled, a holder
releases its slot, time moves, the loop runs a few turns, a reload changes the limits, or a
reload removes the block (the limit raised without bound) and a later one adds it back. Steps
between loop turns are what make the races: a cancel and a hand-over, an expiry and a cancel,
landing before the task they concern has run.

Invariants, after every step: never more than ``limit`` in flight (a lowered limit may be
exceeded only by calls admitted before it, and only until they finish); counts never negative;
no task ends any other way than holding a slot, ``Rejected`` or cancelled (no
``InvalidStateError``, no unhandled error in a callback); per-tenant caps hold; the queue is
work-conserving (a caller still waiting means every slot is taken, and none waits on a removed
block); the route's virtual time never goes back; and every hand-over serves a waiter that no
other waiting waiter outranks by (effective class after aging, fair-queueing tag or age,
arrival). At the end, once every call has ended, everything is back to zero.

The ledger program reserves, settles and releases random claims across shared counters; the
invariants: a reservation is admitted only if it fits every limit, spent + held never exceeds
a limit while every settle stays within its reservation, nothing goes negative, and every
held amount returns to zero.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from policies.concurrency import UNLIMITED, ConcurrencyLimiter
from policies.reasons import Rejected
from policies.state.ledger import Claim, MemoryLedger

TENANTS = ("a", "b", "c")
WEIGHTS = st.dictionaries(st.sampled_from(TENANTS), st.floats(0.25, 4.0), max_size=3)
AGING = st.none() | st.floats(0.2, 2.0)
EXAMPLES = settings(max_examples=100, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` moves only when the test advances it."""

    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self.now = 0.0

    def time(self) -> float:
        return self.now


class LimiterProgram(RuleBasedStateMachine):
    """A random program of arrivals, cancels, releases, time and reloads on one limiter."""

    @initialize(limit=st.integers(1, 3), queue=st.integers(0, 4),
                per_tenant=st.none() | st.integers(1, 3), weights=WEIGHTS, aging=AGING)
    def start(self, limit: int, queue: int, per_tenant: int | None,
              weights: dict[str, float], aging: float | None) -> None:
        self.loop = VirtualClockLoop()
        self.errors: list[dict] = []
        self.loop.set_exception_handler(lambda loop, context: self.errors.append(context))
        self.limiter = ConcurrencyLimiter(limit, queue, 1.0, per_tenant,
                                          tenant_weights=weights, aging=aging)
        self.vnow: dict[int, float] = {}
        self._watch_hand_overs()
        self.tasks: list[tuple[asyncio.Task[None], str]] = []
        self.released: set[int] = set()
        self.allowed = limit  # the most that may be in flight now (see raise_or_lower)
        self.removed = False  # the block is removed (remove_block) and not added back

    def teardown(self) -> None:
        if not hasattr(self, "loop"):
            return
        # End every call: cancel the waiting, release the holding, then all must be zero.
        for task, _ in self.tasks:
            task.cancel()
        self._turns(5)
        for index, (_, tenant) in enumerate(self.tasks):
            if self._holds(index):
                self.released.add(index)
                self.limiter.release(tenant, None)
        self._turns(5)
        limiter = self.limiter
        try:
            assert (limiter.inflight, limiter.queued, limiter._by_tenant) == (0, 0, {})
            assert limiter._vtime == {}  # nothing kept of tenants with nothing live
            assert not limiter.waiters()
            assert not self.errors, self.errors
        finally:
            self.loop.close()

    # -- steps --------------------------------------------------------------------------------

    @rule(tenant=st.sampled_from(TENANTS), priority=st.integers(0, 2),
          timeout=st.none() | st.floats(0.1, 3.0), cost=st.none() | st.floats(1.0, 1000.0))
    def arrive(self, tenant: str, priority: int, timeout: float | None,
               cost: float | None) -> None:
        task = self.loop.create_task(self.limiter.acquire(tenant, priority, timeout, None,
                                                          cost))
        self.tasks.append((task, tenant))

    @precondition(lambda self: any(not t.done() for t, _ in self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        pending = [t for t, _ in self.tasks if not t.done()]
        data.draw(st.sampled_from(pending)).cancel()

    @precondition(lambda self: any(self._holds(i) for i in range(len(self.tasks))))
    @rule(data=st.data(), service_s=st.none() | st.floats(0.0, 2.0))
    def release(self, data: st.DataObject, service_s: float | None) -> None:
        holding = [i for i in range(len(self.tasks)) if self._holds(i)]
        index = data.draw(st.sampled_from(holding))
        self.released.add(index)
        self.limiter.release(self.tasks[index][1], service_s)
        self.allowed = max(self.limiter.limit, min(self.allowed, self.limiter.inflight))

    @rule(seconds=st.floats(0.0, 1.5))
    def advance(self, seconds: float) -> None:
        self.loop.now += seconds

    @rule(turns=st.integers(1, 3))
    def run(self, turns: int) -> None:
        self._turns(turns)

    @precondition(lambda self: self.limiter.waiters())  # else it seldom finds any queued
    @rule()
    def remove_block(self) -> None:
        # A reload removed the block: every queued call is admitted now, and newcomers too,
        # until ``reload`` adds it back over the calls still in flight (which must count).
        self.limiter.retire()
        assert not self.limiter.waiters()
        self.allowed = UNLIMITED
        self.removed = True

    @rule(limit=st.integers(1, 3), queue=st.integers(0, 4),
          per_tenant=st.none() | st.integers(1, 3), weights=WEIGHTS, aging=AGING)
    def reload(self, limit: int, queue: int, per_tenant: int | None,
               weights: dict[str, float], aging: float | None) -> None:
        self.limiter.reconfigure(limit, queue, 1.0, per_tenant, tenant_weights=weights,
                                 aging=aging)
        # A lowered limit drains: calls already in flight may finish above it.
        self.allowed = max(limit, self.limiter.inflight)
        self.removed = False

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def counts_are_sane(self) -> None:
        if not hasattr(self, "limiter"):
            return
        limiter = self.limiter
        assert limiter.inflight >= 0 and limiter.queued >= 0
        assert limiter.inflight <= self.allowed, (limiter.inflight, self.allowed)
        assert all(count > 0 for count in limiter._by_tenant.values())
        holding = sum(1 for i in range(len(self.tasks)) if self._holds(i))
        assert holding <= limiter.inflight
        assert not self.errors, self.errors

    @invariant()
    def work_conserving(self) -> None:
        if not hasattr(self, "limiter"):
            return
        limiter = self.limiter
        alive = [w for w in limiter.waiters() if not w.future.done()]
        assert not alive or limiter.inflight >= limiter.limit, (len(alive), limiter.inflight)
        assert not (alive and self.removed), "a call waits on a removed block"
        assert all(now >= self.vnow.get(cls, 0.0) for cls, now in limiter.vnow.items())
        self.vnow = dict(limiter.vnow)

    @invariant()
    def no_waiter_is_behind_its_class(self) -> None:
        # Calls are tagged at or past their class's time and served smallest tag first, so a
        # class's time never passes a call still waiting in it: the call with the smallest tag
        # is the only one of its class that may age (the limiter looks at no other).
        if not hasattr(self, "limiter"):
            return
        vnow = self.limiter.vnow
        assert all(w.tag >= vnow.get(w.cls, 0.0) for w in self.limiter.waiters())

    @invariant()
    def tasks_end_only_as_documented(self) -> None:
        for task, _ in getattr(self, "tasks", ()):
            if task.done() and not task.cancelled():
                error = task.exception()
                assert error is None or isinstance(error, Rejected), repr(error)

    # -- helpers ------------------------------------------------------------------------------

    def _watch_hand_overs(self) -> None:
        """Check every choice the limiter makes against all the waiters it passed over."""
        limiter = self.limiter
        choose, grant = limiter._best, limiter._grant
        # When a call of each class was last served aged, as this model sees it: the limiter's
        # own record is not read, so that a grant it forgets to record is caught.
        aged_at: dict[int, float] = {}
        chosen: list[tuple[Any, bool]] = []

        def rank(waiter: Any) -> tuple[int, int, float, int]:
            # Independent of the limiter's code: aged (only while its tenant is not ahead of
            # its share in its class) one class per interval, up to one above critical;
            # natives by tag, aged calls after them by age.
            # Beyond its share, the class's smallest tag still ages once an interval of its
            # class has passed since it last served a call so.
            cls = waiter.cls
            now = self.loop.now
            first = min(w.tag for w in limiter.waiters() if w.cls == cls)
            if limiter.aging is not None and (
                    waiter.tag <= limiter.vnow.get(cls, 0.0)
                    or (waiter.tag <= first
                        and now - aged_at.get(cls, -1e18) >= limiter.aging)):
                waited = now - waiter.enqueued
                cls = max(-1, cls - int(waited / limiter.aging))
            if cls == waiter.cls:
                return cls, 0, waiter.tag, waiter.order
            return cls, 1, waiter.enqueued, waiter.order

        def checked_best() -> object:
            best = choose()
            if best is not None:
                assert all(rank(best) <= rank(w) for w in limiter.waiters())
                chosen[:] = [(best, rank(best)[0] < best.cls)]
            return best

        def recorded_grant(waiter: Any, value: object) -> None:
            if chosen and chosen[0][0] is waiter and chosen[0][1]:
                aged_at[waiter.cls] = self.loop.now
            grant(waiter, value)

        limiter._best = checked_best  # type: ignore[method-assign]
        limiter._grant = recorded_grant  # type: ignore[method-assign]

    def _holds(self, index: int) -> bool:
        task = self.tasks[index][0]
        return (index not in self.released and task.done() and not task.cancelled()
                and task.exception() is None)

    def _turns(self, n: int) -> None:
        for _ in range(n):
            self.loop.run_until_complete(asyncio.sleep(0))


TestLimiterProgram = LimiterProgram.TestCase
TestLimiterProgram.settings = EXAMPLES


class RemovedBlockProgram(LimiterProgram):
    """The program started with every slot busy and calls queued (six arrivals), so that
    ``remove_block`` finds calls waiting far more often than random arrivals leave some, and
    the ``reload`` after it adds the block back over the calls it admitted."""

    @initialize(limit=st.integers(1, 3), queue=st.integers(1, 4),
                per_tenant=st.none() | st.integers(1, 3), weights=WEIGHTS, aging=AGING)
    def start(self, limit: int, queue: int, per_tenant: int | None,
              weights: dict[str, float], aging: float | None) -> None:
        LimiterProgram.start(self, limit, queue, per_tenant, weights, aging)
        for tenant in TENANTS * 2:
            self.arrive(tenant, 1, None, None)
        self._turns(2)


TestRemovedBlockProgram = RemovedBlockProgram.TestCase
TestRemovedBlockProgram.settings = EXAMPLES


class LedgerProgram(RuleBasedStateMachine):
    """Random reserve / settle / release programs on a ledger with shared counters."""

    reservations = Bundle("reservations")
    CAPS = {"k1": 100.0, "k2": 150.0, "k3": 60.0}

    def __init__(self) -> None:
        super().__init__()
        self.ledger = MemoryLedger()
        self.loop = asyncio.new_event_loop()
        self.open: list[tuple[str, list[Claim]]] = []
        self.ids = 0

    def level(self, key: str) -> tuple[float, float]:
        return self.ledger.level("g", key)

    def finish(self, rid: str, actual: list[float]) -> None:
        assert self.loop.run_until_complete(self.ledger.settle("g", rid, actual))

    def teardown(self) -> None:
        self.loop.close()

    @rule(target=reservations,
          parts=st.lists(st.tuples(st.sampled_from(sorted(CAPS)), st.integers(1, 80)),
                         min_size=1, max_size=3, unique_by=lambda part: part[0]))
    def reserve(self, parts: list[tuple[str, int]]) -> tuple[str, list[Claim]] | None:
        claims = [Claim(key, float(amount), self.CAPS[key], 1e12) for key, amount in parts]
        before = {key: self.level(key) for key in self.CAPS}
        self.ids += 1
        rid = str(self.ids)
        denied = self.loop.run_until_complete(self.ledger.reserve("g", rid, claims, 0.0, 1e9))
        fits = [spent + held + c.amount <= c.cap for c in claims
                for spent, held in (before[c.key],)]
        if denied:
            assert not all(fits) and set(denied) == {i for i, ok in enumerate(fits) if not ok}
            assert {key: self.level(key) for key in self.CAPS} == before  # none held
            return None
        assert all(fits)
        self.open.append((rid, claims))
        return rid, claims

    @rule(held=consumes(reservations), share=st.floats(0.0, 1.0))
    def settle(self, held: tuple[str, list[Claim]] | None, share: float) -> None:
        if held is not None:
            self.open.remove(held)
            self.finish(held[0], [c.amount * share for c in held[1]])

    @rule(held=consumes(reservations))
    def release(self, held: tuple[str, list[Claim]] | None) -> None:
        if held is not None:
            self.open.remove(held)
            self.finish(held[0], [0.0] * len(held[1]))

    @invariant()
    def within_limits(self) -> None:
        for key, cap in self.CAPS.items():
            spent, held = self.level(key)
            assert spent >= 0 and held >= -1e-9
            assert spent + held <= cap + 1e-6

    def check_all_settled(self) -> None:
        for key in self.CAPS:
            assert self.level(key)[1] < 1e-6


TestLedgerProgram = LedgerProgram.TestCase
TestLedgerProgram.settings = EXAMPLES


@settings(max_examples=50, deadline=None)
class LedgerDrains(LedgerProgram):
    """The ledger program, ending with every open reservation released: zero held."""

    def teardown(self) -> None:
        try:
            for rid, claims in self.open:
                self.finish(rid, [0.0] * len(claims))
            self.check_all_settled()
        finally:
            super().teardown()


TestLedgerDrains = LedgerDrains.TestCase
