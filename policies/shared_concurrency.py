"""Concurrency limit shared by every replica (config key ``concurrency`` with the Redis backend).

With ``state.backend: redis`` a route's ``concurrency.limit`` (and ``per_tenant``) counts calls
at the upstream across all replicas: every admitted call holds a *lease* in Redis
(:mod:`policies.state.leases`), renewed every third of ``state.lease`` while it runs and given
back through the call's holding when it ends. A replica that dies (SIGKILL, lost network)
stops renewing, so its slots free themselves within one lease time.

Each replica keeps the queue of :class:`~policies.concurrency.ConcurrencyLimiter` (priority
classes with aging, weighted fair queueing across tenants, ``queue``, ``max_wait``, the caller's
deadline, the same refusals and ``Retry-After``) for its own callers; a call finding no lease
free waits in it. While anyone waits, one task per route and replica (the *dispatcher*) asks
Redis for a lease on behalf of the best local waiter and hands it over. It tries again when a
slot is released on any replica (the release publishes on the route's channel,
:meth:`~policies.state.leases.Leases.watch`), when one is released here, and at least every
:data:`POLL_S` seconds, since a lease that lapses publishes nothing. A newcomer goes straight
to Redis only while nobody waits here, so it cannot overtake this replica's queue; across
replicas, the first to ask after a release gets the slot (there is no global queue).

``per_tenant`` is checked twice: locally, in flight and queued on this replica, as the memory
limiter does (429 ``tenant_concurrency`` at once); and in Redis, leases held by the tenant on
every replica, when a lease is asked for (the same 429, also for a waiter whose tenant took its
slots on other replicas while it waited).

When Redis does not answer (``StateUnavailable``), ``state.on_unavailable`` applies, as for
rates (:mod:`policies.rate`): ``local`` admits while this replica's calls in flight (those
admitted on Redis leases before the outage included) are under its share of the limit
(:meth:`~policies.state.Fallback.whole_share`), taking a lease from its memory for the share of
``per_tenant``, and logs it once per outage (:class:`OutageNotice`: once for all the runs of a
``fanout.width``, whose limiters come and go with their runs); ``reject`` refuses 503
``state_unavailable`` (every waiter too). Every attempt asks Redis first, so the shared limit
is back as soon as it answers. A call admitted on the local share and still running then is
moved into Redis (its memory lease taken there, past the limit if need be, so new calls wait
until the route is back under it) as soon as this replica sees Redis up, by its probe or a call
(:meth:`~policies.state.StateBackends.renew_leases`), or else at its lease's next renewal;
until it is moved, this replica's acquires count it beside the leases Redis holds
(``uncounted``). Another replica's such calls are unknown here until that replica has moved
them, so every replica that saw the outage keeps to its share (and to its share of
``per_tenant``) for ``settle_s`` from when Redis came back (two probe intervals and the
timeout), the time the others take to see Redis back and move theirs, counting its own acquires
still waiting for Redis's answer (a hostile trial, before: 6 and 7 calls at the upstream on a
limit of 4 in the half second after a thaw). A lease whose acquire Redis may have run without
the answer arriving (a timeout, the caller's cancellation) is released in the background, or
once Redis answers again if it cannot be now; a memory lease taken instead gets another id, so
that release cannot land on it once moved.

A reload that removes the block retires the limiter
(:meth:`~policies.concurrency.ConcurrencyLimiter.retire`): its waiters, and any call that
reaches it later, are admitted at once with no lease (nothing is asked of Redis); calls holding
leases give them back as they end, and the limit this replica recorded for the group lapses
within one lease time. Added back while calls admitted without a lease still run, the block
adds them to every acquire's count (``uncounted``) until they end.

Cost: one round trip to take a lease, one to give it back, one per third of ``state.lease``
for a call running longer.

``inflight`` and ``queued`` (and so ``sluice_inflight_requests``) stay this replica's;
:meth:`SharedConcurrencyLimiter.state` adds the route's count across replicas as last seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from policies.concurrency import (
    DEFAULT_PRIORITY,
    EXPIRED,
    GONE,
    GRANTED,
    UNLIMITED,
    WAITING,
    ConcurrencyLimiter,
    _Waiter,
    queued_hook,
    report_expiry,
)
from policies.pipeline import Call, Outcome
from policies.rate import Background, unavailable
from policies.reasons import Rejected
from policies.state import StateBackends, StateUnavailable
from policies.state.leases import (
    LIMIT,
    TENANT,
    Lease,
    LeaseResult,
    Leases,
    give_back,
    new_lease_id,
)
from policies.state.notify import Signal
from policies.wording import counted

log = logging.getLogger("sluice")

#: Longest a waiter goes without its dispatcher asking Redis again, seconds: how late a slot
#: freed by a lapsed lease (which publishes nothing) or a lost wake-up is noticed.
POLL_S = 0.25


class OutageNotice:
    """The log lines of limiters admitting from this replica's share while Redis does not
    answer: one when the outage starts, one when a limiter finds Redis answering again. A
    route's limiter has one of its own. The limiters of one ``fanout.width``, one per live
    run, made again for a run whose calls had all ended, share one (``name`` says whose
    runs): a line of each limiter's own would be a line per call when each call's run is
    new (300 calls over 10 runs logged 301 lines).

    An outage is the backend's: its line is said once per outage
    (:attr:`~policies.state.connection.Health.changed_monotonic` of the backend marked
    down), whichever run meets it first, and the line of an outage that began after Redis
    was back is said even if no limiter saw it back in between. Counting the runs degraded
    cannot tell when the outage ends: a run's limiter is dropped with its last call,
    degraded or not. A key fault on one run's key (the backend up, the other runs shared)
    is not the scope's outage: its shared notice says nothing of it (the state's key-fault
    line does, at most once a minute, and ``sluice_state_key_faults_total`` counts it), or
    a bad run's calls and a good run's, alternating, would flip a shared line "unavailable"
    / "shared again" at every call; a route's own notice says it as an outage.

    Args:
        name: what the shared lines name, e.g. ``fanout.width of route openai``; ``None``:
            one limiter's own notice, whose lines name its group.
    """

    __slots__ = ("more", "name", "outage")

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        #: The outage said and not yet said over: the backend health's last change when its
        #: line was said; ``None``: none.
        self.outage: float | None = None
        #: Limiters sharing it that started admitting from their share since that line (a
        #: run's limiter made again counts again).
        self.more = 0


class SharedSlot:
    """One call's lease, and its place in the local counts (a pipeline holding). A call
    admitted after a reload removed the block (:meth:`ConcurrencyLimiter.retire`) holds no
    lease (``lease`` is ``None``): only the local count."""

    __slots__ = ("charged", "cls", "lease", "limiter", "tenant")

    def __init__(self, limiter: SharedConcurrencyLimiter, tenant: str, charged: float | None,
                 cls: int, lease: Lease | None) -> None:
        self.limiter = limiter
        self.tenant = tenant
        self.charged = charged
        self.cls = cls
        self.lease = lease

    def release(self, outcome: Outcome) -> None:
        """Give the lease back (in the background) and free the local count."""
        self.limiter.release(self.tenant, outcome.service_s, self.charged, self.cls,
                             outcome.first_byte_s, self.lease)


class SharedConcurrencyLimiter(ConcurrencyLimiter):
    """The limit of one route across replicas; the queue of this replica.

    Args:
        limit, queue, max_wait, per_tenant, tenant_weights, aging: as
            :class:`~policies.concurrency.ConcurrencyLimiter` (``limit`` and ``per_tenant``
            count every replica's calls).
        backends: the Redis state set (its ``leases``, ``lease_s`` and ``fallback``).
        group: the leases' group, the route's name (one hash slot).
        poll_s: see :data:`POLL_S`.
        notice: the outage's log lines, shared with other limiters of the same kind (a
            ``fanout.width``'s runs); ``None``: its own.
    """

    def __init__(self, limit: int, queue: int, max_wait: float, per_tenant: int | None, *,
                 backends: StateBackends, group: str,
                 tenant_weights: Mapping[str, float] | None = None,
                 aging: float | None = None, poll_s: float = POLL_S,
                 notice: OutageNotice | None = None) -> None:
        super().__init__(limit, queue, max_wait, per_tenant, tenant_weights=tenant_weights,
                         aging=aging)
        self.backends = backends
        self.group = group
        self.poll_s = poll_s
        #: The route's leases on every replica, as the last answer from Redis said.
        self.shared_inflight: int | None = None
        #: Admitting from this replica's share while Redis does not answer.
        self.degraded = False
        self.notice = notice or OutageNotice()
        #: Acquires of this replica waiting for Redis's answer, by tenant.
        self._asking: dict[str, int] = {}
        #: Calls admitted here with no lease, by tenant, once a reload removed the block
        #: (:meth:`retire`): Redis does not count them, so if the block is added back while
        #: they run, every acquire adds them to the leases (``uncounted``).
        self._unleased: dict[str, int] = {}
        #: Lease releases whose acquire's answer was lost; their failures are logged.
        self.background = Background(backends)
        self._dispatcher: asyncio.Task[None] | None = None
        self._woken: Signal | None = None
        #: This limiter's name in Redis among the replicas': the route's shared limit is the
        #: lowest that live holders were configured with (a reload reaches them one by one).
        self.holder = new_lease_id()

    # -- admission ----------------------------------------------------------------------------

    async def acquire(self, tenant: str, priority: int = DEFAULT_PRIORITY,  # type: ignore[override]
                      caller_timeout: float | None = None,
                      on_queued: Callable[[int], None] | None = None,
                      cost: float | None = None, *, reads: bool = False,
                      counted: bool = False) -> SharedSlot:
        """Take a lease for ``tenant``, queueing here for one if none is free anywhere.

        Args: as :meth:`ConcurrencyLimiter.acquire`, but ``counted``: the call is counted
            among ``tenant``'s here already (:class:`~policies.concurrency.OperationSlot`),
            and stays counted while Redis is asked (so ``per_tenant`` holds meanwhile): the
            count becomes the slot's, or is given back if none is taken.

        Returns:
            the holding: the lease (renewed until released) and the local counts.

        Raises:
            Rejected: as :meth:`ConcurrencyLimiter.acquire` (``tenant_concurrency`` also when
                the tenant holds ``per_tenant`` leases across replicas); ``state_unavailable``
                (503) with ``on_unavailable: reject`` when Redis does not answer. Nothing is
                held.
            asyncio.CancelledError: the caller went away; nothing is held.
        """
        held = self._by_tenant.get(tenant, 0)
        if held >= self._tenant_cap and not counted:
            raise self._tenant_refusal(held, tenant)
        try:
            if self.limit == UNLIMITED:  # the block was removed (retire): no lease to take
                return self._admit_unleased(tenant, priority, cost, counted)
            # This replica alone filling the limit means no lease is free: skip the round trip.
            if not self.queued and self.inflight < self.limit:
                try:
                    lease, result = await self._try(tenant)
                except StateUnavailable as exc:
                    raise unavailable(exc) from None
                if lease is not None:
                    # Nothing awaits or raises from here to the return: the slot is the
                    # caller's.
                    self.inflight += 1
                    if not counted:
                        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
                    return SharedSlot(self, tenant, self._charge(tenant, priority, cost),
                                      priority, lease)
                if self.limit == UNLIMITED:  # retired while Redis answered: refusal is moot
                    return self._admit_unleased(tenant, priority, cost, counted)
                if result.refused_by == TENANT:
                    raise self._tenant_refusal(result.tenant_inflight)
        except BaseException:
            if counted:  # nothing taken: the count is given back
                self._leave(tenant)
            raise
        if counted:  # the queue counts it again at once (nothing awaits in between)
            self._leave(tenant)
        self._dispatch_soon()
        charged, lease = await self._wait(tenant, priority, caller_timeout, on_queued, cost,
                                          reads)
        assert lease is None or isinstance(lease, Lease)  # None: granted by retire()
        return SharedSlot(self, tenant, charged, priority, lease)

    def _admit_unleased(self, tenant: str, priority: int, cost: float | None,
                        counted: bool = False) -> SharedSlot:
        """Admit ``tenant``'s call with no lease: the block was removed (:meth:`retire`);
        ``counted``: as :meth:`acquire`'s."""
        self.inflight += 1
        if not counted:
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
        self._unleased[tenant] = self._unleased.get(tenant, 0) + 1
        return SharedSlot(self, tenant, self._charge(tenant, priority, cost), priority, None)

    def _grant(self, waiter: _Waiter, value: object) -> None:
        if value is None:  # by retire(), or the dispatcher after it: no lease
            self._unleased[waiter.tenant] = self._unleased.get(waiter.tenant, 0) + 1
        super()._grant(waiter, value)

    @property
    def busy(self) -> bool:
        """:attr:`ConcurrencyLimiter.busy`, or an acquire waits for Redis's answer (its
        lease, if granted, is counted here)."""
        return bool(self.inflight or self.queued or self._asking)

    async def take(self, tenant: str, priority: int = DEFAULT_PRIORITY,  # type: ignore[override]
                   caller_timeout: float | None = None,
                   on_queued: Callable[[int], None] | None = None, *,
                   reads: bool = False) -> SharedSlot:
        """:meth:`acquire` (its answer is already the holding)."""
        return await self.acquire(tenant, priority, caller_timeout, on_queued, reads=reads)

    async def admit(self, call: Call) -> SharedSlot:  # type: ignore[override]
        """The pipeline step: as :meth:`ConcurrencyLimiter.admit`, holding a lease."""
        counted = call.counted_by is self
        if counted:  # counted by an operation's slot: the count is this step's now
            call.counted_by = None
        try:
            return await self.acquire(call.tenant, call.priority, call.wait_left(),
                                      queued_hook(call), call.cost, reads=call.timeout_reads,
                                      counted=counted)
        except Rejected as rejected:
            report_expiry(call, rejected)
            raise

    async def _try(self, tenant: str) -> tuple[Lease | None, LeaseResult]:
        """One attempt at a lease for ``tenant``: from Redis, or with ``on_unavailable:
        local`` from this replica's memory with its share of the limits.

        Raises:
            StateUnavailable: Redis did not answer and ``on_unavailable`` is ``reject``.
        """
        backends = self.backends
        leases: Leases = backends.leases
        if (settling := self._over_share(tenant)) is not None:
            return None, settling
        # This replica's own calls admitted from memory and not yet in Redis count too.
        held = backends.held_leases
        unmoved = held.unmoved_on(self.group, tenant) if held.unmoved else (0, 0)
        if self._unleased:  # the block is back over calls admitted while it was removed
            unmoved = (unmoved[0] + sum(self._unleased.values()),
                       unmoved[1] + self._unleased.get(tenant, 0))
        lease_id = new_lease_id()
        asking = self._asking
        asking[tenant] = asking.get(tenant, 0) + 1
        try:
            try:
                result = await leases.acquire(self.group, tenant, lease_id, self.limit,
                                              self.per_tenant, backends.lease_s,
                                              holder=self.holder, uncounted=unmoved)
            finally:
                if left := asking[tenant] - 1:
                    asking[tenant] = left
                else:
                    del asking[tenant]
        except StateUnavailable as exc:
            if exc.maybe_applied:  # Redis may have run it before the answer timed out
                self._forget_lease(lease_id, tenant)
                # That release lands when Redis is back: a memory lease of the same id
                # moved into Redis by then would be the one released.
                lease_id = new_lease_id()
            fallback = backends.fallback
            if fallback.mode == "reject":
                raise
            share = fallback.whole_share(self.limit)
            self._degrade(exc, share)
            if self.inflight >= share:
                # The share counts every call in flight here, those admitted on Redis leases
                # before the outage too (the memory leases know only the ones after).
                return None, LeaseResult(False, LIMIT, self.inflight, 0)
            leases = fallback.memory().leases
            per_tenant = (None if self.per_tenant is None
                          else fallback.whole_share(self.per_tenant))
            # Memory leases never suspend: no cancellation can land between this and return,
            # nor between the count above and the caller's taking the slot.
            result = await leases.acquire(self.group, tenant, lease_id, share, per_tenant,
                                          backends.lease_s)
        except asyncio.CancelledError:
            self._forget_lease(lease_id, tenant)
            raise
        else:
            self.shared_inflight = result.inflight
            if self.degraded or self.notice.outage is not None:
                self._shared_again()
            if result.granted and (settling := self._over_share(tenant)) is not None:
                self._forget_lease(lease_id, tenant)
                return None, settling
        if not result.granted:
            return None, result
        shared = None if leases is backends.leases else backends.leases
        return Lease(leases, self.group, tenant, lease_id, backends.lease_s,
                     shared=shared, held=held), result

    def _over_share(self, tenant: str) -> LeaseResult | None:
        """For ``backends.settle_s`` after Redis came back (``Health.recovered_at``; with
        ``on_unavailable: local``), while other replicas' calls admitted from memory may not
        be in Redis yet: the refusal if this replica holds its share of ``per_tenant`` for
        ``tenant`` or of ``limit``, counting its acquires still waiting for Redis's answer
        (each may be granted); else ``None``."""
        backends = self.backends
        recovered = backends.health.recovered_at
        if (recovered is None or time.monotonic() >= recovered + backends.settle_s
                or backends.fallback.mode != "local"):
            return None
        fallback = backends.fallback
        asking = self._asking
        if self.per_tenant is not None:
            group = self.group
            mine = asking.get(tenant, 0) + sum(
                1 for lease in backends.held_leases.live
                if lease.group == group and lease.tenant == tenant)
            if mine >= fallback.whole_share(self.per_tenant):
                return LeaseResult(False, TENANT, self.inflight, mine)
        if self.inflight + sum(asking.values()) >= fallback.whole_share(self.limit):
            return LeaseResult(False, LIMIT, self.inflight, 0)
        return None

    def _forget_lease(self, lease_id: str, tenant: str) -> None:
        """Release ``lease_id`` in Redis, which may hold it though its acquire's answer was
        lost; releasing one that is not held changes nothing."""
        self.background.start(self._release_lost(lease_id, tenant),
                              f"lease release on {self.group}")

    async def _release_lost(self, lease_id: str, tenant: str) -> None:
        """A frozen Redis runs the acquire when it thaws: the slot should not stay taken for
        a lease time after it is back (:class:`~policies.state.leases.HeldLeases`)."""
        await give_back(self.backends.leases, self.group, tenant, lease_id,
                        self.backends.held_leases)

    def _degrade(self, exc: StateUnavailable, share: int) -> None:
        """Admitting from this replica's ``share``: said once per outage for the
        :attr:`notice`."""
        before, self.degraded = self.degraded, True
        notice = self.notice
        if exc.key_fault and notice.name is not None:
            return  # this run's key alone: not the scope's outage (see OutageNotice)
        outage = self.backends.health.changed_monotonic
        if notice.outage == outage:
            if not before:
                notice.more += 1
            return
        notice.outage, notice.more = outage, 0
        if notice.name is None:
            log.warning("concurrency of route %s: %s; this replica admits at most %d of the "
                        "%s from its own memory until it answers (state.on_unavailable: "
                        "local)", self.group, exc.cause, share, counted(self.limit, "slot"))
        else:
            log.warning("%s: %s; this replica admits at most %d of each run's %s from its "
                        "own memory until it answers (state.on_unavailable: local); said once "
                        "for every run (the first: %s)", notice.name, exc.cause, share,
                        counted(self.limit, "slot"), self.group)

    def _shared_again(self) -> None:
        """Redis answered this limiter: said once per outage for the :attr:`notice`."""
        self.degraded = False
        notice = self.notice
        if notice.outage is None:
            return
        notice.outage = None
        if notice.name is None:
            log.warning("concurrency of route %s: shared across replicas again", self.group)
        else:
            log.warning("%s: shared across replicas again (%d more run limiters admitted from "
                        "this replica's share after the outage's line)", notice.name,
                        notice.more)

    # -- the dispatcher -----------------------------------------------------------------------

    def _dispatch_soon(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.get_running_loop().create_task(
                self._dispatch(), name=f"sluice-concurrency-{self.group}")
            self._dispatcher.add_done_callback(self._dispatch_ended)
        elif self._woken is not None:  # else it is subscribing, and asks once it has
            self._woken.set()

    def _dispatch_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the concurrency dispatcher of route %s failed", self.group,
                      exc_info=task.exception())

    def _wake(self, _: object = None) -> None:
        """Make the dispatcher ask again now (a slot was freed here, or limits changed)."""
        if self.queued:
            self._dispatch_soon()

    async def _dispatch(self) -> None:
        """Ask for leases for the best local waiter until nobody waits."""
        async with self.backends.leases.watch(self.group) as woken:
            self._woken = woken
            try:
                while True:
                    waiter = self._best()
                    if waiter is None:
                        return
                    if waiter.future.done():  # cancelled; its caller has not run yet
                        self._drop(waiter, GONE)
                        continue
                    if self.limit == UNLIMITED:  # it queued as retire() ran: no lease needed
                        self.inflight += 1
                        self._grant(waiter, None)
                        continue
                    try:
                        lease, result = await self._try(waiter.tenant)
                    except StateUnavailable as exc:
                        self._refuse_all(exc)
                        continue
                    if lease is not None:
                        if waiter.state == WAITING and not waiter.future.done():
                            self.inflight += 1
                            self._grant(waiter, lease)
                        else:  # it left while Redis answered: free the slot for others
                            self.backends.keep(lease.release())
                        continue
                    if result.refused_by == TENANT:
                        if waiter.state == WAITING and not waiter.future.done():
                            self._drop(waiter, EXPIRED)
                            waiter.future.set_exception(
                                self._tenant_refusal(result.tenant_inflight))
                        continue
                    await woken.wait(self.poll_s)
            finally:
                self._woken = None

    def _refuse_all(self, exc: StateUnavailable) -> None:
        """``on_unavailable: reject``: every waiter gets 503 now rather than at its
        ``max_wait``."""
        for waiter in self.waiters():
            if not waiter.future.done():
                self._drop(waiter, EXPIRED)
                waiter.future.set_exception(unavailable(exc))

    # -- release ------------------------------------------------------------------------------

    def release(self, tenant: str, service_s: float | None, charged: float | None = None,
                cls: int = DEFAULT_PRIORITY, first_byte_s: float | None = None,
                lease: Lease | None = None) -> None:
        """Free the local count of ``tenant``'s call (:meth:`ConcurrencyLimiter.release`,
        which hands nothing over here) and give its ``lease`` back (a task); the dispatcher
        asks again once the release has landed. ``lease`` is ``None`` for a call admitted
        with none (:meth:`retire`)."""
        super().release(tenant, service_s, charged, cls, first_byte_s)
        if lease is not None:
            task = lease.release()
            self.backends.keep(task)  # shutdown waits for it (StateBackends.close)
            task.add_done_callback(self._wake)
            return
        # A call admitted while the block was removed (retire): Redis never counted it.
        left = self._unleased[tenant] - 1
        if left:
            self._unleased[tenant] = left
        else:
            del self._unleased[tenant]
        self._wake()

    def _hand_over(self) -> bool:
        """A slot freed here is not passed to a waiter here: its lease goes back to Redis,
        and the dispatcher takes one for the best waiter (its release wakes it)."""
        return False

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.state != GRANTED:
            super()._abandon(waiter)
            return
        # Granted just as its caller left: the lease the dispatcher took (if any) goes back.
        flow = (waiter.cls, waiter.tenant)
        if flow in self._vtime:
            self._vtime[flow] -= waiter.increment
        self.release(waiter.tenant, None, lease=waiter.future.result())

    # -- reload and views ---------------------------------------------------------------------

    def reconfigure(self, limit: int, queue: int, max_wait: float, per_tenant: int | None, *,
                    tenant_weights: Mapping[str, float] | None = None,
                    aging: float | None = None) -> None:
        """Adopt new limits in place (hot reload); waiters are offered a raised limit at
        once. Leases already held stay held: a lowered limit is reached as calls finish.
        The new limit is recorded in Redis at once, so that the replicas' shared limit (the
        lowest of theirs) follows without waiting for this replica's next acquire."""
        changed = limit != self.limit
        shorter = max_wait < self.max_wait
        self._adopt(limit, queue, max_wait, per_tenant, tenant_weights, aging)
        if shorter:
            self._shorten_waits()
        if changed and _in_loop():
            self.background.start(self._register(), f"limit of {self.group} recorded")
        self._wake()

    async def _register(self) -> None:
        with contextlib.suppress(StateUnavailable):  # the next acquire records it
            await self.backends.leases.register(self.group, self.holder, self.limit,
                                                self.backends.lease_s)

    def state(self) -> dict[str, object]:
        """:meth:`ConcurrencyLimiter.state` (this replica's counts), plus ``shared_inflight``
        (the route's leases on every replica, as last seen), ``lease_s`` and ``degraded``
        (admitting from the local share: so since an acquire found Redis silent, until
        Redis answers again, a call or the probe, whichever comes first)."""
        out = super().state()
        # An idle route's flag waits for its next acquire; the backend's health does not.
        degraded = self.degraded and not self.backends.health.up
        out.update(shared=True, shared_inflight=self.shared_inflight,
                   lease_s=self.backends.lease_s, degraded=degraded)
        return out


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
