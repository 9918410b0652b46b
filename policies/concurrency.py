"""Concurrency limit with a bounded, prioritised queue (config key ``concurrency``).

At most ``limit`` requests of a route are at the upstream at once. A request that finds every
slot busy waits in a queue of at most ``queue`` entries for at most ``max_wait`` seconds, served
by priority class first and arrival order second (HAProxy's ``(class, enqueue time)`` key). A
freed slot is handed straight to the next waiter, so the count never dips and a newcomer cannot
overtake the queue.

``per_tenant`` caps one tenant's requests on the route, in flight *and* queued together, so one
tenant can never hold more than ``per_tenant`` slots; the next one is answered 429
``tenant_concurrency`` at once (its own quota is spent, SPEC). Each tenant's count is kept even
without a cap (one dict update per request), so a cap switched on by a reload is exact at once
and the admin API can show who holds the slots.

On a config reload the limiter is reconfigured in place (:meth:`ConcurrencyLimiter.reconfigure`):
nothing held or queued is dropped. A higher ``limit`` hands the new slots to waiters at once; a
lower one takes effect as requests finish (a freed slot is handed over only while the count is
under the new limit). A smaller ``queue`` or ``per_tenant`` refuses newcomers until the counts
fall below it; a new ``max_wait`` applies to requests queued after the reload.

Rejections carry an honest ``retry_after`` estimated with Little's law: a queue of ``n`` ahead
drains in about ``n * S / limit`` seconds (spread up to +50% at random, so callers refused
together do not retry together), where ``S`` is the route's mean service time (an
exponentially weighted average of observed upstream durations).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from collections.abc import Callable

from policies.pipeline import Call, Outcome
from policies.reasons import Reason, Rejected

#: Priority classes by ``X-Priority`` value; lower is served first.
PRIORITIES = {"critical": 0, "standard": 1, "best-effort": 2}
DEFAULT_PRIORITY = 1

_EWMA_WEIGHT = 0.1  # weight of the newest sample in the service-time average
_INITIAL_SERVICE_S = 1.0
#: Largest factor the Retry-After estimate is spread by (see ``_drain_estimate``).
JITTER_MAX = 1.5  # assumed mean service time before the first completion, seconds
_TENANTS_SHOWN = 20  # tenants listed by state(), the biggest holders first


class Slot:
    """One slot held for one call (a :class:`policies.pipeline.Holding`)."""

    __slots__ = ("limiter", "tenant")

    def __init__(self, limiter: ConcurrencyLimiter, tenant: str) -> None:
        self.limiter = limiter
        self.tenant = tenant

    def release(self, outcome: Outcome) -> None:
        """Free the slot; an answer from the upstream updates the mean service time."""
        self.limiter.release(self.tenant, outcome.service_s)


# A waiter's life: WAITING until exactly one of a hand-over (GRANTED), its max_wait running out
# (EXPIRED) or its caller leaving (GONE) ends it. Only a WAITING waiter can change state, so a
# timer, a hand-over and a cancellation racing for it cannot both act on it.
WAITING, GRANTED, EXPIRED, GONE = range(4)


class _Waiter:
    __slots__ = ("future", "state", "tenant", "timer")

    def __init__(self, future: asyncio.Future[None], tenant: str) -> None:
        self.future = future
        self.tenant = tenant
        self.state = WAITING
        self.timer: asyncio.TimerHandle | None = None


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
    """

    def __init__(self, limit: int, queue: int, max_wait: float, per_tenant: int | None) -> None:
        self.limit = limit
        self.queue_capacity = queue
        self.max_wait = max_wait
        self.per_tenant = per_tenant
        self.inflight = 0
        self.queued = 0
        self.mean_service_s = _INITIAL_SERVICE_S
        #: True once a completion has updated ``mean_service_s`` (before, it is a guess).
        self.observed = False
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._order = itertools.count()
        self._by_tenant: dict[str, int] = {}

    # -- admission ----------------------------------------------------------------------------

    async def acquire(self, tenant: str, priority: int = DEFAULT_PRIORITY,
                      caller_timeout: float | None = None,
                      on_queued: Callable[[int], None] | None = None) -> None:
        """Take a slot for ``tenant``, queueing for one if none is free.

        Args:
            priority: the queue class, 0 first (see :data:`PRIORITIES`).
            caller_timeout: the caller's own timeout in seconds, if it sent one; it can
                shorten the wait (:meth:`wait_budget`).
            on_queued: called with the queue depth once this call has joined the queue.

        Raises:
            Rejected: ``tenant_concurrency`` (429) when ``tenant`` is at ``per_tenant``;
                ``deadline_unreachable`` when the caller's timeout leaves no time to queue,
                ``queue_full`` when the queue is full, both at once; ``queue_timeout`` when
                no slot freed within the wait. Nothing is held.
            asyncio.CancelledError: the caller went away; nothing is held.
        """
        held = self._by_tenant.get(tenant, 0)
        if self.per_tenant is not None and held >= self.per_tenant:
            raise Rejected(
                Reason.TENANT_CONCURRENCY,
                self.mean_service_s / max(held, 1),
                f"limit {self.per_tenant} in flight or queued per tenant",
                ("tenant-concurrency", self.per_tenant, 0),
            )
        if self.inflight < self.limit and not self.queued:
            self.inflight += 1
            self._by_tenant[tenant] = held + 1
            return
        max_wait = self.wait_budget(caller_timeout)
        if max_wait <= 0:
            raise Rejected(
                Reason.DEADLINE_UNREACHABLE,
                self._drain_estimate(self.queued + 1),
                f"the caller's timeout leaves no time to queue: calls take "
                f"{self.mean_service_s:.3g}s on average",
            )
        if self.queue_full:
            raise Rejected(
                Reason.QUEUE_FULL,
                self._drain_estimate(self.queued + 1),
                f"{self.limit} slots busy and {self.queue_capacity} queued",
                ("concurrency", self.limit, 0),
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), tenant)
        # From here to the end, every exit runs the except below or returns holding the slot.
        self._by_tenant[tenant] = held + 1
        heapq.heappush(self._heap, (priority, next(self._order), waiter))
        self.queued += 1
        try:
            waiter.timer = loop.call_later(max_wait, self._expire, waiter)
            if on_queued is not None:
                on_queued(self.queued)
            await waiter.future
        except BaseException:
            self._abandon(waiter)
            raise

    async def admit(self, call: Call) -> Slot:
        """The pipeline step (:class:`policies.pipeline.Policy`): a slot for ``call``, held
        until the call ends; ``enqueued`` and ``expired`` are reported through
        ``call.notify``.

        Raises:
            Rejected: as :meth:`acquire` does.
        """
        def queued(depth: int) -> None:
            call.enqueued_at = time.monotonic()
            call.notify("enqueued", {"queue_depth": depth})

        try:
            await self.acquire(call.tenant, call.priority, call.timeout, queued)
        except Rejected as rejected:
            if rejected.reason is Reason.QUEUE_TIMEOUT and call.enqueued_at is not None:
                call.notify("expired", {"waited_s": round(time.monotonic() - call.enqueued_at, 6)})
            raise
        return Slot(self, call.tenant)

    def wait_budget(self, caller_timeout: float | None) -> float:
        """How long a request may queue, seconds: ``max_wait``, or less when the caller's own
        timeout leaves less room once the mean service time is set aside for the call itself
        (HAProxy's ``timeout queue`` bounded by the caller's deadline; waiting longer only
        admits work the caller will have abandoned). The service time is set aside only once
        it has been observed; ``acquire`` refuses a budget of 0 or less at once."""
        if caller_timeout is None:
            return self.max_wait
        room = caller_timeout - self.mean_service_s if self.observed else caller_timeout
        return min(self.max_wait, room)

    @property
    def queue_full(self) -> bool:
        """True when ``wait`` would answer a newcomer ``queue_full`` without queueing it."""
        return self.queued >= self.queue_capacity

    def release(self, tenant: str, service_s: float | None) -> None:
        """Free the slot taken for ``tenant``; ``service_s`` updates the mean service time."""
        if service_s is not None:
            self.mean_service_s += _EWMA_WEIGHT * (service_s - self.mean_service_s)
            self.observed = True
        self._forget(tenant)
        # Over the limit only after a reload lowered it: then the slot is retired, not passed on.
        if self.inflight <= self.limit and self._hand_over():
            return  # the slot passed on; inflight is unchanged
        self.inflight -= 1

    # -- reload -------------------------------------------------------------------------------

    def reconfigure(self, limit: int, queue: int, max_wait: float, per_tenant: int | None) -> None:
        """Adopt new limits in place, keeping every request held or queued (hot reload).

        Args are those of the constructor. Waiters that fit under a raised ``limit`` are
        admitted at once; a lowered one is reached as in-flight requests finish.
        """
        self.limit = limit
        self.queue_capacity = queue
        self.max_wait = max_wait
        self.per_tenant = per_tenant
        while self.inflight < self.limit:
            self.inflight += 1
            if not self._hand_over():
                self.inflight -= 1
                break

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
            "tenants": dict(
                sorted(self._by_tenant.items(), key=lambda kv: -kv[1])[:_TENANTS_SHOWN]
            ),
        }

    # -- internals ----------------------------------------------------------------------------

    def _hand_over(self) -> bool:
        """Give a slot already counted in ``inflight`` to the first waiter still waiting.

        Returns False when nobody waits. A waiter whose caller was cancelled but has not run
        yet (its future is already cancelled) is skipped and dropped here.
        """
        while self._heap:  # re-read: _drop may compact the heap into a new list
            _, _, waiter = heapq.heappop(self._heap)
            if waiter.state != WAITING:
                continue
            if waiter.future.done():
                self._drop(waiter, GONE)
                continue
            self._drop(waiter, GRANTED)
            waiter.future.set_result(None)
            return True
        return False

    def _expire(self, waiter: _Waiter) -> None:
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
                f"waited the queue's max_wait of {self.max_wait:g}s",
                ("concurrency", self.limit, 0),
            )
        )

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting caller is leaving by an exception: leave nothing held for it."""
        if waiter.state == GRANTED:
            # The slot was handed over just as the caller left: pass it on.
            self.release(waiter.tenant, None)
            return
        if waiter.state == WAITING:
            self._drop(waiter, GONE)
        self._forget(waiter.tenant)

    def _drop(self, waiter: _Waiter, state: int) -> None:
        """End a waiting waiter in ``state``; its heap entry, if still there, is skipped."""
        waiter.state = state
        self.queued -= 1
        if waiter.timer is not None:
            waiter.timer.cancel()
        if state != GRANTED and len(self._heap) > 2 * self.queued + 64:
            self._heap = [entry for entry in self._heap if entry[2].state == WAITING]
            heapq.heapify(self._heap)

    def _forget(self, tenant: str) -> None:
        held = self._by_tenant[tenant] - 1
        if held:
            self._by_tenant[tenant] = held
        else:
            del self._by_tenant[tenant]

    def _drain_estimate(self, ahead: int) -> float:
        """Seconds until ``ahead`` queued requests have been served (Little's law), spread at
        random up to +50% so that callers refused together do not all return at the same
        instant and collide again (Envoy jitters its rate-limited back-off to [d, 1.5d])."""
        return ahead * self.mean_service_s / self.limit * random.uniform(1.0, JITTER_MAX)
