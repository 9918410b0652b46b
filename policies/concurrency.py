"""Concurrency limit with a bounded, fair, deadline-aware queue (config key ``concurrency``).

At most ``limit`` requests of a route are at the upstream at once. A request that finds every
slot busy waits in a queue of at most ``queue`` entries for at most ``max_wait`` seconds. A
freed slot is handed straight to the best waiter, so the count never dips and a newcomer cannot
overtake the queue. The best waiter is chosen by, in order:

1. **Priority class** (``X-Priority``: critical, standard, best-effort; HAProxy's
   ``set-priority-class``), *with aging*: a call that has waited ``aging`` seconds counts as one
   class better, two intervals two classes, three one above critical, so a best-effort call
   under a constant critical load is served within ``3 x aging``, plus an interval for each
   call of its class ahead of it (see :meth:`ConcurrencyLimiter._class_of`).
2. **Weighted fair queueing across tenants**, after Linux CFS's vruntime: each tenant has a
   virtual time that every call it sends advances by ``cost / weight``
   (``concurrency.tenant_weights``, default 1). The cost is the call's reserved tokens where
   the route meters tokens (``Call.cost``), else its expected service time (the tenant's
   observed mean, corrected to the actual duration when the call ends) in a unit, the median
   of the route's first 8 service times; until those are in, every call costs 1. Counted
   in seconds, the calls queued on a cold route were priced at the starting guess (1 s) and
   those after the first answer at what was observed: with a 0.1 s upstream and weights
   3:1, a hostile trial's flooder got 2% of the slots, not 25%, until its backlog drained.
   A typical call costs 1 before and after the unit is known, and later costs compare as
   seconds do (a unit that followed the moving mean let a tenant of 30 s calls on a 0.1 s
   route take 77% of the slot time; one fixed by the first answer alone, a cached 1 ms one
   or a 120 s cold start, priced the cold backlog 100 times too low or high: reviews).
   A call is tagged with
   its tenant's virtual time when it arrives, never below the route's (the tag of the last call
   served: a tenant returning from idle gets no banked credit, as CFS places a waking task at
   ``min_vruntime``), and the smallest tag is served first. A tenant sending ten times as much
   therefore waits behind itself, not in front of the others: each tenant gets its weight's
   share of the slots while it has work queued. A tenant's virtual time is kept only while it
   has calls in flight or queued; once it has none it is forgotten and starts again at the
   route's time, as CFS places a new task at ``min_vruntime``. Fairness is among tenants with
   work waiting, and those keep theirs, so the limiter's memory is bounded by the calls it
   holds, however many distinct tenants pass through.
3. Arrival order.

A full queue refuses the call it would serve last: a newcomer of a better class, or of a
tenant within its fair share, takes the place of the queued call of the worst class with the
largest tag, which is answered ``queue_full`` at once (:meth:`ConcurrencyLimiter._displaced`);
otherwise the newcomer is refused. So a tenant or class that fills the queue cannot keep
better work out of it.

Deadlines: a call whose caller sent its own timeout is refused ``deadline_unreachable`` at once
when the estimated wait plus the call's own time already exceeds it, and otherwise waits at
most its timeout less that time; one still queued when that passes is dropped (event
``expired``) and never reaches the upstream. The call's own time is the mean service time for
a deadline (``X-Request-Timeout``), and the mean time to the upstream's first byte for the
Stainless SDKs' ``x-stainless-timeout``, httpx's read timeout: a stream that starts answering
in time is in time, however long it runs.

``per_tenant`` caps one tenant's requests on the route, in flight *and* queued together, so one
tenant can never hold more than ``per_tenant`` slots; the next one is answered 429
``tenant_concurrency`` at once (its own quota is spent, SPEC); a call of the route waiting for
an operation's slot counts too (:class:`OperationSlot`). Each tenant's count is kept even
without a cap (one dict update per request), so a cap switched on by a reload is exact at once
and the admin API can show who holds the slots.

On a config reload the limiter is reconfigured in place (:meth:`ConcurrencyLimiter.reconfigure`):
nothing held or queued is dropped. A higher ``limit`` hands the new slots to waiters at once; a
lower one takes effect as requests finish (a freed slot is handed over only while the count is
under the new limit). A smaller ``queue`` or ``per_tenant`` refuses newcomers until the counts
fall below it; a new ``max_wait`` applies to requests queued after the reload. A block the
reload removes is the limit raised without bound (:meth:`ConcurrencyLimiter.retire`): its
queued calls are admitted at once, and its calls in flight still release into it; added back
while it still holds calls, the block gets this limiter again, so those calls count.

Rejections carry an honest ``retry_after`` estimated with Little's law: a queue of ``n`` ahead
drains in about ``n`` turns (spread up to +50% at random, so callers refused together do not
retry together), and at most ``max_wait`` plus one turn: by then every call queued now has left
the queue. A turn, the time between two slots freeing, is ``S / limit``, where ``S`` is the
route's mean service time (an exponentially weighted average of observed upstream durations,
seeded by the first one), or the time no slot has freed, once that is longer: calls that
got slower say so only when they end, so a mean of 6 ms told callers to come back in 6 ms
while 3 s calls held every slot (a new user's trial). See :meth:`ConcurrencyLimiter.turn`.

This limiter counts one process's calls (``state.backend: memory``). With ``state.backend:
redis`` a route uses :class:`policies.shared_concurrency.SharedConcurrencyLimiter`, which keeps
this queue and counts ``limit`` and ``per_tenant`` across replicas with Redis leases.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Mapping

from policies.pipeline import Call, Holding, Outcome
from policies.reasons import Reason, Rejected
from policies.wording import counted

#: Priority classes by ``X-Priority`` value; lower is served first.
PRIORITIES = {"critical": 0, "standard": 1, "best-effort": 2}
DEFAULT_PRIORITY = 1

_EWMA_WEIGHT = 0.1  # weight of the newest sample in the service-time average
_INITIAL_SERVICE_S = 1.0  # assumed mean service time before the first completion, seconds
#: The least service time a call's cost is counted in (a route whose calls took no
#: measurable time), seconds.
_MIN_MEAN_S = 1e-6
#: Service times whose median is the unit a call's cost is counted in.
_UNIT_SAMPLES = 8
#: Largest factor the Retry-After estimate is spread by (see ``_drain_estimate``).
JITTER_MAX = 1.5
#: The shortest Retry-After a concurrency refusal gives, seconds: the openai and anthropic
#: SDKs' own first back-off (``INITIAL_RETRY_DELAY``). An estimate is the past's mean; when
#: the calls holding the slots prove longer, a caller told less spends its retries (two by
#: default) before any slot frees: a burst of 1 s calls after fast ones was told 2-8 ms and
#: its SDK gave up within 0.3 s (a hostile trial), sooner than with no hint at all. A hint
#: too long costs the caller that wait; too short, its call.
MIN_RETRY_AFTER_S = 0.5
_TENANTS_SHOWN = 20  # tenants listed by state(), the biggest holders first
#: The ``limit`` of a limiter whose block a reload removed (:meth:`ConcurrencyLimiter.retire`):
#: more slots than calls can ever be in flight, so every call is admitted at once.
UNLIMITED = sys.maxsize
#: The ``queue_timeout`` details when the caller's own deadline, not ``max_wait``, ended the
#: wait: once a call's time is known it is set aside from the deadline, before then it is not.
DEADLINE_EXPIRED = ("the caller's timeout, less the time a call takes, ran out while it was "
                    "queued")
DEADLINE_PASSED = "the caller's timeout ran out while it was queued"
_DEADLINE_DETAILS = frozenset({DEADLINE_EXPIRED, DEADLINE_PASSED})


class Slot:
    """One slot held for one call (a :class:`policies.pipeline.Holding`)."""

    __slots__ = ("charged", "cls", "limiter", "tenant")

    def __init__(self, limiter: ConcurrencyLimiter, tenant: str, charged: float | None,
                 cls: int = DEFAULT_PRIORITY) -> None:
        self.limiter = limiter
        self.tenant = tenant
        self.charged = charged
        self.cls = cls

    def release(self, outcome: Outcome) -> None:
        """Free the slot; an answer from the upstream updates the mean service time."""
        self.limiter.release(self.tenant, outcome.service_s, self.charged, self.cls,
                             outcome.first_byte_s)


# A waiter's life: WAITING until exactly one of a hand-over (GRANTED), its max_wait running out
# (EXPIRED) or its caller leaving (GONE) ends it. Only a WAITING waiter can change state, so a
# timer, a hand-over and a cancellation racing for it cannot both act on it.
WAITING, GRANTED, EXPIRED, GONE = range(4)


class _Waiter:
    __slots__ = ("aged", "cls", "enqueued", "future", "increment", "order", "state", "tag",
                 "tenant", "timer")

    def __init__(self, future: asyncio.Future[object], tenant: str, cls: int, tag: float,
                 order: int, enqueued: float) -> None:
        self.increment = 0.0
        self.future = future
        self.tenant = tenant
        self.cls = cls
        self.tag = tag
        self.order = order
        self.enqueued = enqueued
        self.state = WAITING
        self.timer: asyncio.TimerHandle | None = None
        #: Chosen by the last :meth:`ConcurrencyLimiter._best` in a better class than its own.
        self.aged = False


class _Class:
    """The waiters of one priority class, in fair-queueing order: ``(tag, order, waiter)``
    kept sorted, the next call to serve first and the one a full queue gives up last. A
    waiter leaves it as it stops waiting (:meth:`remove`), so every entry waits, and the
    calls served before a newcomer are counted by bisection (:meth:`at_or_before`).
    O(log n) to find a place, and a memmove of the list's tail to insert or remove (a
    few microseconds at 10,000 queued): it replaced two heaps with lazily skipped ends, on
    which counting the calls ahead took a walk of the heap."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[float, int, _Waiter]] = []

    def add(self, waiter: _Waiter) -> None:
        bisect.insort(self.entries, (waiter.tag, waiter.order, waiter))

    def remove(self, waiter: _Waiter) -> None:
        """Take ``waiter`` out (a no-op if it is not in)."""
        entries = self.entries
        at = bisect.bisect_left(entries, (waiter.tag, waiter.order))
        if at < len(entries) and entries[at][2] is waiter:
            del entries[at]

    def first(self) -> _Waiter | None:
        """The waiter with the smallest tag (the earliest of those tied), if any."""
        entries = self.entries
        return entries[0][2] if entries else None

    def last(self) -> _Waiter | None:
        """The waiter with the largest tag (the latest of its tenant's), if any."""
        entries = self.entries
        return entries[-1][2] if entries else None

    def at_or_before(self, tag: float) -> int:
        """How many of its waiters are tagged at or before ``tag``."""
        return bisect.bisect_right(self.entries, (tag, math.inf))


def queued_hook(call: Call) -> Callable[[int], None]:
    """The ``on_queued`` of :meth:`ConcurrencyLimiter.acquire` for ``call``: marks it queued
    and reports ``enqueued`` with the queue depth. A call may queue more than once (its run's
    width, its operation's slot, the route's): ``enqueued_at`` is the first, so its queue wait
    is all of them."""
    def queued(depth: int) -> None:
        if call.enqueued_at is None:
            call.enqueued_at = time.monotonic()
        call.phase = "queued"
        call.notify("enqueued", {"queue_depth": depth})
    return queued


def report_expiry(call: Call, rejected: Rejected) -> None:
    """Report ``expired`` for a queued ``call`` refused ``queue_timeout``."""
    if rejected.reason is Reason.QUEUE_TIMEOUT and call.enqueued_at is not None:
        call.notify("expired", {"waited_s": round(time.monotonic() - call.enqueued_at, 6),
                                "deadline": rejected.detail in _DEADLINE_DETAILS})


class ConcurrencyLimiter:
    """Slots and the queue of one route.

    ``await acquire(...)`` returns holding one slot, which the caller gives back with exactly
    one ``release``; if ``acquire`` raises (a refusal, the caller's cancellation at any point),
    nothing is held. That is the whole contract, whatever the interleaving of arrivals,
    hand-overs, expiries, cancellations and reloads (proven in tests/test_limiter_properties.py).

    Args:
        limit: slots, i.e. requests at the upstream at once.
        queue: waiters allowed beyond ``limit``; 0 means answer at once when full.
        max_wait: longest time a waiter stays queued, seconds.
        per_tenant: a tenant's requests in flight plus queued; ``None`` for no cap.
        tenant_weights: fair-queueing weight by tenant (others weigh 1).
        aging: seconds of waiting that move a call up one priority class; ``None``: never.
    """

    def __init__(self, limit: int, queue: int, max_wait: float, per_tenant: int | None, *,
                 tenant_weights: Mapping[str, float] | None = None,
                 aging: float | None = None) -> None:
        self._adopt(limit, queue, max_wait, per_tenant, tenant_weights, aging)
        self.inflight = 0
        self.queued = 0
        self.mean_service_s = _INITIAL_SERVICE_S
        #: Mean time from admission to the upstream's response headers, seconds: what a
        #: caller's timeout must cover besides its wait. The SDKs' timeout is a read timeout
        #: (httpx's), so a stream that starts answering in time is in time, however long it
        #: then runs; and Sluice's own bound from a caller's deadline ends at the headers.
        self.mean_first_byte_s = _INITIAL_SERVICE_S
        #: True once a completion has updated the means (before, they are a guess).
        self.observed = False
        #: What a call's cost is counted in: the median of the first service times
        #: observed (``_samples``), seconds; ``None`` until there are enough.
        self._unit: float | None = None
        self._samples: list[float] = []
        #: Changes whenever a slot frees or passes on (a release, a grant, a reload): how
        #: :meth:`turn` knows that none has since it last looked.
        self.turns = 0
        #: ``turns`` as a look on the queueing path (:meth:`_full_since`) or a hand-over
        #: last found it changed with every slot busy, and the monotonic time it did.
        self._turns_seen = (-1, 0.0)
        #: ``turns`` when these were taken, and each refused tenant's first refusal since
        #: (:meth:`_tenant_stalled`).
        self._tenant_looks: tuple[int, dict[str, float]] = (-1, {})
        self._classes: dict[int, _Class] = {}
        self._order = itertools.count()
        self._by_tenant: dict[str, int] = {}
        #: Fair queueing, per class: each tenant's virtual time in it (tenants with calls in
        #: flight or queued only), and the class's own (the tag of the last call served).
        self._vtime: dict[tuple[int, str], float] = {}
        self.vnow: dict[int, float] = {}
        #: The largest of those (0 before any): a tenant's time at or above it is past them all.
        self._vtop = 0.0
        #: The classes ``_vtime`` may have entries in (a few priorities).
        self._vclasses: set[int] = set()
        #: Mean token cost of the calls that had one (``None`` before the first).
        self._mean_tokens: float | None = None
        self._tenant_service: dict[str, float] = {}
        #: Per class, the loop time a call of it was last served aged (:meth:`_class_of`).
        self.aged_at: dict[int, float] = {}

    # -- admission ----------------------------------------------------------------------------

    async def acquire(self, tenant: str, priority: int = DEFAULT_PRIORITY,
                      caller_timeout: float | None = None,
                      on_queued: Callable[[int], None] | None = None,
                      cost: float | None = None, *, reads: bool = False,
                      counted: bool = False) -> float | None:
        """Take a slot for ``tenant``, queueing for one if none is free.

        Args:
            priority: the queue class, 0 first (see :data:`PRIORITIES`).
            caller_timeout: what is left of the caller's own timeout in seconds
                (:meth:`Call.time_left`), if it sent one; it can shorten the wait
                (:meth:`wait_budget`) or refuse it at once.
            reads: that timeout is a read timeout (:attr:`Call.timeout_reads`): it must
                cover the wait and the upstream's first byte, not the whole call.
            on_queued: called with the queue depth once this call has joined the queue.
            cost: the call's cost in tokens, if known (else its service time is used).
            counted: the call was counted among ``tenant``'s and checked against
                ``per_tenant`` already (:class:`OperationSlot`), and its count given up just
                before this (no await between): its cap is not checked again.

        Returns:
            the service time charged to the tenant's virtual time, seconds, when it is to be
            corrected at :meth:`release` (no token cost known, and the route's unit known),
            else ``None``.

        Raises:
            Rejected: ``tenant_concurrency`` (429) when ``tenant`` is at ``per_tenant``;
                ``deadline_unreachable`` when the caller's timeout leaves no time to queue,
                ``queue_full`` when the queue is full of calls that rank before this one,
                both at once, or once queued when a newcomer that ranks before it took its
                place; ``queue_timeout`` when no slot freed within the wait. Nothing is held.
            asyncio.CancelledError: the caller went away; nothing is held.
        """
        held = self._by_tenant.get(tenant, 0)
        if held >= self._tenant_cap and not counted:
            raise self._tenant_refusal(held, tenant)
        if self.inflight < self.limit and not self.queued:
            charged = self._charge(tenant, priority, cost)
            self.inflight += 1
            self._by_tenant[tenant] = held + 1
            return charged
        charged, _ = await self._wait(tenant, priority, caller_timeout, on_queued, cost, reads)
        return charged

    def _tenant_refusal(self, held: int, tenant: str | None = None) -> Rejected:
        """429 ``tenant_concurrency`` for a tenant holding ``held`` calls (in flight and
        queued), its Retry-After the time until one of them ends: a service time over
        ``held``. The service time is the route's mean, or, for ``tenant`` (its calls counted
        here, all this limiter's own), at least how long none of its calls can have ended
        (:meth:`_tenant_stalled`) when that is longer: the mean of earlier calls alone told
        a tenant to come back in 12 ms while its 2 calls of 3.5 s had run 0.3 s. ``tenant``
        is ``None`` for a count that includes other replicas' calls, whose ends go unseen."""
        service = self.mean_service_s
        if tenant is not None:
            service = max(service, self._tenant_stalled(tenant))
        return Rejected(
            Reason.TENANT_CONCURRENCY,
            max(service / max(held, 1), MIN_RETRY_AFTER_S),
            f"limit {self.per_tenant} in flight or queued per tenant",
            ("tenant-concurrency", self.per_tenant, 0, 0),
        )

    async def _wait(self, tenant: str, priority: int, caller_timeout: float | None,
                    on_queued: Callable[[int], None] | None,
                    cost: float | None, reads: bool = False) -> tuple[float | None, object]:
        """Queue ``tenant``'s call until a hand-over grants it a slot (:meth:`acquire`'s
        refusals and cancellation apply). Returns what :meth:`acquire` returns, and the value
        the hand-over passed (see :meth:`_grant`)."""
        held = self._by_tenant.get(tenant, 0)
        # This call found the house full: from now on, no turn means every slot stayed busy.
        self._full_since(time.monotonic())
        max_wait = self.wait_budget(caller_timeout, reads)
        call_s = self.own_time(reads)
        # The call's tag: where ``_charge`` starts it, its tenant's time, never the class's past.
        tag = max(self._vtime.get((priority, tenant), 0.0), self.vnow.get(priority, 0.0))
        # A full queue takes this call in place of the one it would serve last, if this one
        # ranks before it (``_displaced``); else nobody may wait (no queue left, or
        # ``max_wait: 0s``): the queue's refusal, whatever the caller's timeout, which is not
        # what stands in its way.
        displaced = None
        if self.max_wait <= 0 or (self.queue_full and (
                displaced := self._displaced(priority, tag)) is None):
            raise Rejected(
                Reason.QUEUE_FULL,
                self._drain_estimate(self.queued + 1),
                f"{self._busy()} and {self.queued} queued" if self.max_wait > 0 else
                f"{self._busy()} and max_wait is 0s: no call waits for a slot",
                ("concurrency", self.limit, 0, 0),
            )
        # Refused at once only when the caller's own timeout cannot cover the estimate: a wait
        # longer than ``max_wait`` alone is the queue's matter (``queue_timeout`` once it
        # passes), as for a caller that sent no timeout.
        if max_wait <= 0 or (caller_timeout is not None and self.observed):
            turn = self.turn()
            budget = (caller_timeout or 0.0) - call_s
            ahead = self.queued
            if max_wait > 0 and (ahead + 1) * turn > budget:
                # Only the calls served before this one stand in its way: a critical call,
                # or a tenant's within its fair share, goes before most of the queue (a
                # hostile trial: a critical call behind three best-effort ones was refused,
                # though served at once without its deadline). Counted only when the whole
                # queue would not fit.
                ahead = self._ahead(priority, tag)
            expected = (ahead + 1) * turn
            if max_wait <= 0 or expected > budget:
                left = (f"ends in {caller_timeout:.3g}s"
                        if caller_timeout > 0  # type: ignore[operator]
                        else "has passed")
                raise Rejected(
                    Reason.DEADLINE_UNREACHABLE,
                    self._drain_estimate(ahead + 1),
                    f"the caller's timeout {left}, which leaves no time to queue: the wait "
                    f"is estimated at {expected:.3g}s and "
                    + (f"the upstream takes {call_s:.3g}s on average to start answering"
                       if reads else f"calls take {call_s:.3g}s on average"),
                )
        if displaced is not None and displaced.future.done():
            self._drop(displaced, GONE)
        elif displaced is not None:
            full = f"{self._busy()} and {self.queued} queued"
            self._drop(displaced, EXPIRED)
            displaced.future.set_exception(Rejected(
                Reason.QUEUE_FULL,
                self._drain_estimate(self.queued + 1),
                f"{full}; this call's place went to one of a better class or of a tenant "
                "within its fair share",
                ("concurrency", self.limit, 0, 0),
            ))
        loop = asyncio.get_running_loop()
        charged = self._charge(tenant, priority, cost)
        waiter = _Waiter(loop.create_future(), tenant, priority, tag, next(self._order),
                         loop.time())
        waiter.increment = self._vtime[priority, tenant] - tag
        # From here to the end, every exit runs the except below or returns holding the slot.
        self._by_tenant[tenant] = held + 1
        queue = self._classes.get(priority)
        if queue is None:
            queue = self._classes[priority] = _Class()
        queue.add(waiter)
        self.queued += 1
        try:
            waiter.timer = loop.call_later(
                max_wait, self._expire, waiter,
                None if max_wait >= self.max_wait else
                DEADLINE_EXPIRED if self.observed else DEADLINE_PASSED)
            if on_queued is not None:
                on_queued(self.queued)
            granted = await waiter.future
        except BaseException:
            self._abandon(waiter)
            raise
        return charged, granted

    def _ahead(self, priority: int, tag: float) -> int:
        """How many queued calls would be served before a newcomer of class ``priority``
        tagged ``tag`` (the order :meth:`_best` serves in, aging aside): every call of a
        better class, and those of its own class tagged at or before it. O(classes x log
        queued)."""
        ahead = 0
        for cls, queue in self._classes.items():
            if cls < priority:
                ahead += len(queue.entries)
            elif cls == priority:
                ahead += queue.at_or_before(tag)
        return ahead

    def _displaced(self, priority: int, tag: float) -> _Waiter | None:
        """The queued call a newcomer of class ``priority`` tagged ``tag`` takes the place of
        in a full queue: the one it would serve last (of the worst class waiting, the largest
        tag, i.e. the latest call of the tenant furthest past its share), when the newcomer
        ranks before it; else ``None``. A tenant's newcomer never displaces its own calls of
        its class (its tag is past theirs), so a tenant flooding the queue is refused at the
        door, not churned inside; tenants within their share and better classes get in.
        A waiter whose caller left but has not run yet is returned whatever its rank: its
        place is free, and nobody need be refused for it. O(log queued), amortized."""
        for cls in sorted(self._classes, reverse=True):
            if cls < priority:
                return None
            last = self._classes[cls].last()
            if last is not None:
                return (last if last.future.done() or cls > priority or tag < last.tag
                        else None)
        return None

    async def take(self, tenant: str, priority: int = DEFAULT_PRIORITY,
                   caller_timeout: float | None = None,
                   on_queued: Callable[[int], None] | None = None, *,
                   reads: bool = False) -> Slot:
        """:meth:`acquire`, as the holding that gives the slot back (for a policy that
        keeps one limiter per key, such as ``fanout.width``'s per run).

        Raises:
            Rejected: as :meth:`acquire` does.
        """
        charged = await self.acquire(tenant, priority, caller_timeout, on_queued, reads=reads)
        return Slot(self, tenant, charged, priority)

    async def admit(self, call: Call) -> Slot:
        """The pipeline step (:class:`policies.pipeline.Policy`): a slot for ``call``, held
        until the call ends; ``enqueued`` and ``expired`` are reported through
        ``call.notify``.

        Raises:
            Rejected: as :meth:`acquire` does.
        """
        tenant = call.tenant
        counted = call.counted_by is self
        if counted:
            # An operation's slot counted it here while it waited (:class:`OperationSlot`):
            # the count passes to this step, past the cap it was checked against then, with
            # nothing awaited before this step counts it again.
            call.counted_by = None
            self._leave(tenant)
        held = self._by_tenant.get(tenant, 0)
        if ((counted or held < self._tenant_cap) and self.inflight < self.limit
                and not self.queued):
            # A free slot and nobody waiting (the usual case): :meth:`acquire`'s first branch,
            # without a coroutine, a hook and a second look-up.
            cls = call.priority
            charged = self._charge(tenant, cls, call.cost)
            self.inflight += 1
            self._by_tenant[tenant] = held + 1
            return Slot(self, tenant, charged, cls)
        try:
            charged = await self.acquire(tenant, call.priority, call.wait_left(),
                                         queued_hook(call), call.cost,
                                         reads=call.timeout_reads, counted=counted)
        except Rejected as rejected:
            report_expiry(call, rejected)
            raise
        return Slot(self, tenant, charged, call.priority)

    def count_waiting(self, tenant: str) -> None:
        """Count one of ``tenant``'s calls of the route, waiting for an operation's slot
        (:class:`OperationSlot`), among its calls in flight and queued here, which
        ``per_tenant`` caps; :meth:`_leave` ends the count.

        Raises:
            Rejected: ``tenant_concurrency`` (429): ``tenant`` holds ``per_tenant`` calls.
        """
        held = self._by_tenant.get(tenant, 0)
        if held >= self._tenant_cap:
            raise self._tenant_refusal(held, tenant)
        self._by_tenant[tenant] = held + 1

    def wait_budget(self, caller_timeout: float | None, reads: bool = False) -> float:
        """How long a request may queue, seconds: ``max_wait``, or less when the caller's own
        timeout leaves less room once the call itself is set aside: the mean service time
        for a deadline, the mean time to the upstream's first byte (``mean_first_byte_s``)
        for a read timeout (``reads``) (HAProxy's ``timeout queue`` bounded by the caller's
        deadline; waiting longer only admits work the caller will have abandoned). That time
        is set aside only once it has been observed; ``acquire`` refuses a budget of 0 or
        less at once."""
        if caller_timeout is None:
            return self.max_wait
        room = caller_timeout - self.own_time(reads) if self.observed else caller_timeout
        return min(self.max_wait, room)

    def own_time(self, reads: bool) -> float:
        """What a caller's timeout must cover besides the queue, seconds: the mean service
        time for a deadline, the mean time to the upstream's first byte for a read timeout."""
        return self.mean_first_byte_s if reads else self.mean_service_s

    def _busy(self) -> str:
        """The slots a refusal names as busy: above a lowered limit, the calls still in
        flight too (a reload's "limit 1" while 4 drain is not "1 slot busy")."""
        busy = f"{counted(self.limit, 'slot')} busy"
        return busy if self.inflight <= self.limit else f"{busy} ({self.inflight} in flight)"

    @property
    def queue_full(self) -> bool:
        """True when ``wait`` would answer a newcomer ``queue_full`` without queueing it."""
        return self.queued >= self.queue_capacity

    def release(self, tenant: str, service_s: float | None,
                charged: float | None = None, cls: int = DEFAULT_PRIORITY,
                first_byte_s: float | None = None) -> None:
        """Free the slot taken for ``tenant``; ``service_s`` (``None``: the upstream did not
        answer) updates the mean service time, and replaces ``charged`` (the estimate
        :meth:`acquire` returned) in the tenant's virtual time; ``first_byte_s`` (admission
        to the response headers; default ``service_s``) updates ``mean_first_byte_s``."""
        self.turns += 1
        if service_s is not None:
            first = service_s if first_byte_s is None else first_byte_s
            if self.observed:
                self.mean_service_s += _EWMA_WEIGHT * (service_s - self.mean_service_s)
                self.mean_first_byte_s += _EWMA_WEIGHT * (first - self.mean_first_byte_s)
            else:  # the first sample replaces the guess (averaging it in would take ~20 calls)
                self.mean_service_s = service_s
                self.mean_first_byte_s = first
                self.observed = True
            if self._unit is None:
                self._samples.append(service_s)
                if len(self._samples) == _UNIT_SAMPLES:  # the median: no outlier decides it
                    self._unit = max(sorted(self._samples)[_UNIT_SAMPLES // 2], _MIN_MEAN_S)
            if self._mean_tokens is None:
                # A tenant's mean prices only calls with no token cost on a route that has
                # seen none (``_charge``); once one has had a cost it is never read again.
                mean = self._tenant_service.get(tenant, service_s)
                self._tenant_service[tenant] = mean + _EWMA_WEIGHT * (service_s - mean)
            if charged is not None and (cls, tenant) in self._vtime:
                weights = self.tenant_weights
                error = (service_s - charged) / self._unit  # type: ignore[operator]
                self._vtime[cls, tenant] += (error / weights.get(tenant, 1.0) if weights
                                             else error)
        held = self._by_tenant[tenant] - 1
        if held:
            self._by_tenant[tenant] = held
        else:
            self._forget(tenant)
        # Nobody to hand the slot to (the usual case), or over the limit after a reload lowered
        # it (the slot is then retired, not passed on): it is freed.
        if self.queued and self.inflight <= self.limit and self._hand_over():
            return  # the slot passed on; inflight is unchanged
        self.inflight -= 1

    # -- reload -------------------------------------------------------------------------------

    def reconfigure(self, limit: int, queue: int, max_wait: float, per_tenant: int | None, *,
                    tenant_weights: Mapping[str, float] | None = None,
                    aging: float | None = None) -> None:
        """Adopt new limits in place, keeping every request held or queued (hot reload).

        Args are those of the constructor. Waiters that fit under a raised ``limit`` are
        admitted at once; a lowered one is reached as in-flight requests finish. New weights
        apply to calls queued from now on.
        """
        shorter = max_wait < self.max_wait
        self._adopt(limit, queue, max_wait, per_tenant, tenant_weights, aging)
        if shorter:
            self._shorten_waits()
        self.turns += 1  # a raised limit frees slots without a release
        while self.inflight < self.limit:
            self.inflight += 1
            if not self._hand_over():
                self.inflight -= 1
                break

    def _shorten_waits(self) -> None:
        """A reload lowered ``max_wait``: calls queued before it wait no longer than the new
        ``max_wait`` from now (if they would have waited longer), as :meth:`_drain_estimate`
        assumes of every queued call. Kept, they were served up to 9 s after a reload to
        ``max_wait: 2s`` while newcomers were told the queue would be through in 4 s (a
        hostile trial). Counted from the reload, not from their arrival: a reload ends no
        wait at once."""
        for waiter in self.waiters():
            timer = waiter.timer
            if timer is None or waiter.state != WAITING:
                continue
            loop = waiter.future.get_loop()
            ends = loop.time() + self.max_wait
            if timer.when() > ends:
                timer.cancel()
                waiter.timer = loop.call_at(ends, self._expire, waiter)

    def retire(self) -> None:
        """A reload removed this limiter's block: no limit from now on. Every queued call is
        admitted at once (as a raised limit admits them), and so is any call that reaches
        this object later (one that found its route before the reload); calls in flight
        release into it as before. :meth:`reconfigure` puts a limit back (the block added
        again while :attr:`busy`: those calls count, and a limit below them drains)."""
        self._adopt(UNLIMITED, self.queue_capacity, self.max_wait, None,
                    self.tenant_weights, self.aging)
        self.turns += 1
        for waiter in self.waiters():
            if waiter.future.done():  # cancelled; its caller has not run yet
                self._drop(waiter, GONE)
            else:
                self.inflight += 1
                self._grant(waiter, None)

    @property
    def busy(self) -> bool:
        """Calls hold slots here or wait for one: a retired limiter is kept while so."""
        return bool(self.inflight or self.queued)

    def _adopt(self, limit: int, queue: int, max_wait: float, per_tenant: int | None,
               tenant_weights: Mapping[str, float] | None, aging: float | None) -> None:
        self.limit = limit
        self.queue_capacity = queue
        self.max_wait = max_wait
        self.per_tenant = per_tenant
        #: ``per_tenant`` as a bound every count is under when there is no cap.
        self._tenant_cap = math.inf if per_tenant is None else per_tenant
        self.tenant_weights = dict(tenant_weights or {})
        self.aging = aging

    def state(self) -> dict[str, object]:
        """Limits and live counts for the admin API (JSON-ready; seconds for durations)."""
        return {
            "limit": self.limit,
            "inflight": self.inflight,
            "queue": self.queue_capacity,
            "queued": self.queued,
            "max_wait_s": self.max_wait,
            "per_tenant": self.per_tenant,
            "mean_service_s": round(self.mean_service_s, 6),
            "mean_first_byte_s": round(self.mean_first_byte_s, 6),
            "aging_s": self.aging,
            "tenant_weights": self.tenant_weights,
            "tenants": dict(
                sorted(self._by_tenant.items(), key=lambda kv: -kv[1])[:_TENANTS_SHOWN]
            ),
        }

    # -- internals ----------------------------------------------------------------------------

    def _hand_over(self) -> bool:
        """Give a slot already counted in ``inflight`` to the best waiter still waiting
        (the module docstring's order). Returns False when nobody waits. A waiter whose caller
        was cancelled but has not run yet (its future is already cancelled) is dropped here.
        """
        while True:
            waiter = self._best()
            if waiter is None:
                return False
            if waiter.future.done():
                self._drop(waiter, GONE)
                continue
            self._grant(waiter, None)
            return True

    def _grant(self, waiter: _Waiter, value: object) -> None:
        """End ``waiter`` (WAITING, its future not done) holding a slot; its :meth:`_wait`
        returns ``value``."""
        self._drop(waiter, GRANTED)
        self.turns += 1
        if self.inflight >= self.limit:
            # A slot passed on and every one is busy again: the stall clock starts here, at
            # the turn itself, not at whichever refusal comes next.
            self._turns_seen = (self.turns, time.monotonic())
        if waiter.aged:  # every grant comes here, the Redis dispatcher's too
            self.aged_at[waiter.cls] = waiter.future.get_loop().time()
        # The Redis dispatcher grants the waiter it chose before its round trip: a call that
        # came meanwhile may be tagged below it, and the class's time must not pass a waiting
        # call (``_best`` looks only at each class's first).
        vnow = self.vnow.get(waiter.cls, 0.0)
        if waiter.tag > vnow:
            first = self._classes[waiter.cls].first()
            tag = waiter.tag if first is None else min(waiter.tag, first.tag)
            if tag > vnow:
                self.vnow[waiter.cls] = tag
                self._vtop = max(self._vtop, tag)
        waiter.future.set_result(value)

    def _best(self) -> _Waiter | None:
        """The waiter to serve next, without removing it; ``None`` when none waits.

        Each class offers one candidate, the call with the smallest tag: no other call of the
        class can rank before it. Natively that is the order; and a call may age only when its
        tag is not past the class's virtual time, which never passes a waiting call's tag
        (calls are tagged at or past it, and the class's time moves to the tag of each call
        it serves, the smallest, or of the first still waiting if that is smaller: see
        :meth:`_grant`), so only calls tied with the first may, and the first of
        those has waited longest. O(classes) a choice, however many tenants wait: looking at
        every tenant's oldest call, as this once did, cost 8 ms a hand-over with 5,000 queued
        (``tests/test_limiter_properties.py`` checks each choice against every waiter)."""
        best: _Waiter | None = None
        best_key: tuple[int, int, float, int] | None = None
        now = self._loop_time()
        for queue in self._classes.values():
            waiter = queue.first()
            if waiter is None:
                continue
            rank = self._class_of(waiter, now)
            # Natives of a class by fair-queueing tag; calls aged into it after them, the
            # oldest first (tags of different classes are on different clocks).
            key = ((rank, 0, waiter.tag, waiter.order) if rank == waiter.cls
                   else (rank, 1, waiter.enqueued, waiter.order))
            if best_key is None or key < best_key:
                best, best_key = waiter, key
        if best is not None:
            best.aged = best_key[0] < best.cls  # type: ignore[index]
        return best

    def _class_of(self, waiter: _Waiter, now: float | None) -> int:
        """The class ``waiter`` (its class's first call by fairness) competes in now: its own,
        less one per ``aging`` interval waited, but only while its tenant is not ahead of its
        fair share (its tag is not past the class's virtual time). A tenant's backlog beyond
        its share waits because it is beyond its share, not because a better class starves
        it; promoting it would let an overloading tenant's old calls overtake everyone's fresh
        ones, and critical work.

        A class that better ones keep from every slot never moves its own clock, though, so
        past its first call each tenant's backlog would wait for good. So the class's first
        call ages as well once per ``aging`` interval of the class: such a class gets a slot
        per interval, at most, and no more."""
        cls = waiter.cls
        aging = self.aging
        if aging is None or now is None:
            return cls
        if waiter.tag > self.vnow.get(cls, 0.0) and now - self.aged_at.get(cls, -math.inf) < aging:
            return cls
        return max(-1, cls - int((now - waiter.enqueued) / aging))

    def _loop_time(self) -> float | None:
        for queue in self._classes.values():
            for _, _, waiter in queue.entries:
                return waiter.future.get_loop().time()
        return None

    def _charge(self, tenant: str, cls: int, cost: float | None) -> float | None:
        """Advance ``tenant``'s virtual time in ``cls`` by one call, from its tag (the
        tenant's time, never below the class's): returns the service time charged, seconds,
        when it is to be corrected at :meth:`release` (no token cost known, and the unit
        known), else ``None``."""
        if cost is not None:
            mean = self._mean_tokens
            self._mean_tokens = cost if mean is None else mean + _EWMA_WEIGHT * (cost - mean)
            charged = None
        elif self._mean_tokens is not None:
            cost = self._mean_tokens  # an unmetered call on a metered route: a typical one
            charged = None
        elif self._unit is None:  # a call until the unit is known (the module docstring)
            cost, charged = 1.0, None
        else:  # seconds, counted in the unit
            charged = self._tenant_service.get(tenant, self.mean_service_s)
            cost = charged / self._unit
        flow = cls, tenant
        tag = self._vtime.get(flow)
        if tag is None:  # the tenant's first call in flight or queued: it starts at the class's
            self._vclasses.add(cls)
            tag = self.vnow.get(cls, 0.0)
        elif tag < self._vtop:  # else no class's time is past it: no need to look
            tag = max(tag, self.vnow.get(cls, 0.0))
        # Weights divide only when set: a cost divided by 1.0 is the cost itself.
        weights = self.tenant_weights
        self._vtime[flow] = tag + cost / weights.get(tenant, 1.0) if weights else tag + cost
        return charged

    def waiters(self) -> list[_Waiter]:
        """Every waiter still waiting (for tests and the admin view)."""
        return [entry[2] for queue in self._classes.values() for entry in queue.entries]

    def _expire(self, waiter: _Waiter, deadline: str | None = None) -> None:
        """``waiter``'s wait is over: refuse it ``queue_timeout``, with ``deadline`` (the
        detail naming the caller's timeout) when that, not ``max_wait``, ended it."""
        if waiter.state != WAITING:
            return
        if waiter.future.done():  # cancelled; its caller has not run yet
            self._drop(waiter, GONE)
            return
        self._drop(waiter, EXPIRED)
        waiter.future.set_exception(
            Rejected(
                Reason.QUEUE_TIMEOUT,
                self._drain_estimate(self.queued + 1),
                deadline or f"waited the queue's max_wait of {self.max_wait:g}s",
                ("concurrency", self.limit, 0, 0),
            )
        )

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting caller is leaving by an exception: leave nothing held for it."""
        flow = (waiter.cls, waiter.tenant)
        if flow in self._vtime:  # never served: its cost was not incurred
            self._vtime[flow] -= waiter.increment
        if waiter.state == GRANTED:
            # The slot was handed over just as the caller left: pass it on.
            self.release(waiter.tenant, None)
            return
        if waiter.state == WAITING:
            self._drop(waiter, GONE)
        self._leave(waiter.tenant)

    def _drop(self, waiter: _Waiter, state: int) -> None:
        """End a waiting waiter in ``state``: it leaves its class's queue."""
        waiter.state = state
        self.queued -= 1
        self._classes[waiter.cls].remove(waiter)
        if waiter.timer is not None:
            waiter.timer.cancel()

    def _leave(self, tenant: str) -> None:
        """One of ``tenant``'s calls ends (:meth:`release` does this itself, inline)."""
        held = self._by_tenant[tenant] - 1
        if held:
            self._by_tenant[tenant] = held
        else:
            self._forget(tenant)

    def _forget(self, tenant: str) -> None:
        """``tenant`` has nothing in flight or queued now: it competes with no one, and
        returns at the route's time (module docstring), so nothing of it need be kept."""
        del self._by_tenant[tenant]
        vtime = self._vtime
        for cls in self._vclasses:
            vtime.pop((cls, tenant), None)
        if self._tenant_service:  # a metered route's empties: its tenants' means are not kept
            self._tenant_service.pop(tenant, None)

    def _drain_estimate(self, ahead: int) -> float:
        """Seconds until ``ahead`` queued requests have been served (Little's law), spread at
        random up to +50% so that callers refused together do not all return at the same
        instant and collide again (Envoy jitters its rate-limited back-off to [d, 1.5d]).

        At most ``max_wait`` plus one slot's turn: by then every call queued now has left
        the queue, served or expired, however many there were. Uncapped, a queue of 550 on
        2 slots (a reload had lowered the limit) told callers to come back in 400 s, with
        ``x-should-retry: false``, though it was empty 20 s later. At least
        :data:`MIN_RETRY_AFTER_S`."""
        turn = self.turn()
        estimate = max(min(ahead * turn, self.max_wait + turn), MIN_RETRY_AFTER_S)
        return estimate * random.uniform(1.0, JITTER_MAX)

    def turn(self) -> float:
        """Seconds expected between two slots freeing while every slot is busy: the mean
        service time over ``limit``, or, when no slot has freed or passed on since a call
        first found every slot busy (:meth:`_full_since`), the time since then over ``limit``
        if that is longer.

        A count of ``turns`` unchanged since that look means every slot stayed busy all that
        time and none freed: the calls holding them have run at least that long, whatever the
        mean of the calls before them says (a measured lower bound, not a model). The look is
        taken when a call finds the house full (it queues or is refused, :meth:`_wait`) and
        at each hand-over, not at the first refusal: fast calls, then slow ones filling every
        slot with callers queued behind them, told the first refused callers the fast mean
        (37-48 ms while 3.5 s calls had held both slots for over a second; the SDKs spent
        every retry in 0.25 s). That holds only while every slot is this limiter's own
        (``inflight`` reaches ``limit``): a
        :class:`~policies.shared_concurrency.SharedConcurrencyLimiter` sees no release of
        another replica's calls, and its Retry-After grew with the time since it first
        looked (1.5 s after 1.5 s of another replica's 50 ms calls), so the mean alone
        serves there."""
        turn = self.mean_service_s / self.limit
        now = time.monotonic()
        since = self._full_since(now)
        if since is None:
            return turn
        # Every call holding a slot has run at least ``now - since``: a service time that
        # long, over the limit, is a turn (taken whole, a stall of 1 s on 8 slots told a
        # caller behind 7 others that its wait was 8 s, and refused it).
        return max(turn, (now - since) / self.limit)

    def _tenant_stalled(self, tenant: str) -> float:
        """Seconds for which none of ``tenant``'s calls in flight can have ended, as far as
        refusals tell: since its first refusal after the route's last turn (a slot freeing or
        passing on, on any tenant's call), or since every slot was first seen busy if that is
        earlier and still holds (:meth:`_full_since`). No turn means no call in flight ended,
        its calls included, so each has run at least that long (a lower bound, as for
        :meth:`turn`). Kept on the refusal path only: the time a tenant reached its cap is
        an admission's, which reads no clock, so the first refusal is the first look. The
        looks are dropped at the next turn, and never outnumber the tenants holding calls."""
        now = time.monotonic()
        turns, looks = self._tenant_looks
        if turns != self.turns:
            looks = {}
            self._tenant_looks = (self.turns, looks)
        elif tenant not in looks and len(looks) >= len(self._by_tenant):
            # Tenants gone by queued calls leaving (no turn) keep no look.
            by_tenant = self._by_tenant
            looks = {name: at for name, at in looks.items() if name in by_tenant}
            self._tenant_looks = (turns, looks)
        since = looks.setdefault(tenant, now)
        full = self._full_since(now)
        if full is not None and full < since:
            since = full
        return now - since

    def _full_since(self, now: float) -> float | None:
        """The monotonic time since which every slot has been busy and none has freed or
        passed on, as far as looks on the queueing path tell (``now`` when this is the first
        look since the last turn); ``None`` when some slot is not this limiter's own.

        Only the refusal and queueing paths call this, never the admission of a call to a
        free slot nor a release with nobody queued, so those stay free of clock reads: the
        house filling up by admissions is seen by the first call that finds it full."""
        if self.inflight < self.limit:
            # Some slot is not this limiter's (the shared limiter's, held on another replica):
            # it frees unseen here, so an unchanged count says nothing of it, and a look
            # taken now must not stand for when every slot is this limiter's again.
            self._turns_seen = (-1, 0.0)
            return None
        turns, since = self._turns_seen
        if turns != self.turns:
            self._turns_seen = (self.turns, now)
            return now
        return since


class OperationSlot:
    """An operation's ``concurrency`` step on a route with its own (the pipeline step of
    :mod:`policies.operations`): the operation's slot, and its queue, counted in the route's
    ``per_tenant`` while the call waits there.

    The operation's slot is taken before the route's, so that a call waiting for a busy
    operation holds none of the route's slots (docs/design.md). It is queued on the route all
    the same, and ``per_tenant`` caps a tenant's calls in flight *and queued* on it: so from
    this step on the call counts in the route limiter's tenant count
    (:meth:`ConcurrencyLimiter.count_waiting`; 429 ``tenant_concurrency`` at once past it),
    and the count is the route's step's once the operation's slot is taken:
    ``call.counted_by`` names the route limiter, whose step then neither checks the cap nor
    counts the call again, and gives the count back once, as its own. A hostile trial: a
    tenant held 1 call in flight and 9 queued for an endpoint's slot on a route of
    ``per_tenant: 2``, none refused; and a review: the count ended here on success, and the
    Redis limiter's step awaited Redis before counting it again, so a tenant of
    ``per_tenant: 2`` held 3 calls.

    Args:
        operation: the operation's limiter.
        route: the route's limiter (a route without one takes the operation's step as is).
    """

    __slots__ = ("operation", "route")

    def __init__(self, operation: ConcurrencyLimiter, route: ConcurrencyLimiter) -> None:
        self.operation = operation
        self.route = route

    async def admit(self, call: Call) -> Holding:
        """The pipeline step: :meth:`ConcurrencyLimiter.admit` of the operation's limiter.

        Raises:
            Rejected: the route's ``tenant_concurrency``; or as that ``admit`` does.
        """
        route = self.route
        tenant = call.tenant
        route.count_waiting(tenant)
        call.counted_by = route
        try:
            return await self.operation.admit(call)
        except BaseException:
            if call.counted_by is route:  # the route's step never took the count over
                call.counted_by = None
                route._leave(tenant)
            raise
