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

from policies.reasons import Reason, Rejected

#: Priority classes by ``X-Priority`` value; lower is served first.
PRIORITIES = {"critical": 0, "standard": 1, "best-effort": 2}
DEFAULT_PRIORITY = 1

_EWMA_WEIGHT = 0.1  # weight of the newest sample in the service-time average
_INITIAL_SERVICE_S = 1.0
#: Largest factor the Retry-After estimate is spread by (see ``_drain_estimate``).
JITTER_MAX = 1.5  # assumed mean service time before the first completion, seconds
_TENANTS_SHOWN = 20  # tenants listed by state(), the biggest holders first


class _Waiter:
    __slots__ = ("future", "live", "tenant", "timer")

    def __init__(self, future: asyncio.Future[None], tenant: str) -> None:
        self.future = future
        self.tenant = tenant
        self.live = True
        self.timer: asyncio.TimerHandle | None = None


class ConcurrencyLimiter:
    """Slots and the queue of one route.

    Use ``try_acquire`` (never suspends) and, only when it returns False, ``await wait(...)``;
    call ``release`` exactly once for every successful acquire, on every exit path.

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

    def try_acquire(self, tenant: str) -> bool:
        """Take a slot now if one is free and nobody is queued; never suspends.

        Raises:
            Rejected: ``tenant_concurrency`` when ``tenant`` is at ``per_tenant``.
        """
        held = self._by_tenant.get(tenant, 0)
        if self.per_tenant is not None and held >= self.per_tenant:
            raise Rejected(
                Reason.TENANT_CONCURRENCY,
                self.mean_service_s / max(held, 1),
                f"limit {self.per_tenant} in flight or queued per tenant",
                ("tenant-concurrency", self.per_tenant, 0),
            )
        self._by_tenant[tenant] = held + 1
        if self.inflight < self.limit and not self.queued:
            self.inflight += 1
            return True
        return False

    def wait_budget(self, caller_timeout: float | None) -> float:
        """How long a request may queue, seconds: ``max_wait``, or less when the caller's own
        timeout leaves less room once the mean service time is set aside for the call itself
        (HAProxy's ``timeout queue`` bounded by the caller's deadline; waiting longer only
        admits work the caller will have abandoned). The service time is set aside only once
        it has been observed; ``wait`` refuses a budget of 0 or less at once."""
        if caller_timeout is None:
            return self.max_wait
        room = caller_timeout - self.mean_service_s if self.observed else caller_timeout
        return min(self.max_wait, room)

    async def wait(self, tenant: str, priority: int, max_wait: float) -> None:
        """Queue for a slot after ``try_acquire`` returned False.

        ``max_wait`` may be below the configured one when the caller's own deadline is nearer
        (see :meth:`wait_budget`).

        Raises:
            Rejected: ``queue_full`` at once; ``deadline_unreachable`` at once when
                ``max_wait`` is 0 or less; ``queue_timeout`` after ``max_wait`` seconds.
            asyncio.CancelledError: the caller went away; nothing is left held.
        """
        if max_wait <= 0:
            self._forget(tenant)
            raise Rejected(
                Reason.DEADLINE_UNREACHABLE,
                self._drain_estimate(self.queued + 1),
                f"the caller's timeout leaves no time to queue: calls take "
                f"{self.mean_service_s:.3g}s on average",
            )
        if self.queue_full:
            self._forget(tenant)
            raise Rejected(
                Reason.QUEUE_FULL,
                self._drain_estimate(self.queued + 1),
                f"{self.limit} slots busy and {self.queue_capacity} queued",
                ("concurrency", self.limit, 0),
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), tenant)
        heapq.heappush(self._heap, (priority, next(self._order), waiter))
        self.queued += 1
        waiter.timer = loop.call_later(max_wait, self._expire, waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.live:
                self._drop(waiter)
                self._forget(tenant)
            elif waiter.future.done() and not waiter.future.cancelled():
                # The slot was handed over just as the caller left: give it back.
                self.release(tenant, None)
            raise
        except Rejected:
            self._forget(tenant)
            raise

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
        if self.queued and self.inflight <= self.limit:
            self._hand_over()  # the slot passes on; inflight is unchanged
            return
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
        while self.queued and self.inflight < self.limit:
            self.inflight += 1
            self._hand_over()

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

    def _hand_over(self) -> None:
        """Give a slot already counted in ``inflight`` to the first live waiter (``queued > 0``)."""
        while True:
            _, _, waiter = heapq.heappop(self._heap)
            if waiter.live:
                waiter.live = False
                self.queued -= 1
                if waiter.timer is not None:
                    waiter.timer.cancel()
                waiter.future.set_result(None)
                return

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.live:
            return
        self._drop(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(
                Rejected(
                    Reason.QUEUE_TIMEOUT,
                    self._drain_estimate(self.queued + 1),
                    f"waited the queue's max_wait of {self.max_wait:g}s",
                    ("concurrency", self.limit, 0),
                )
            )

    def _drop(self, waiter: _Waiter) -> None:
        """Take a waiter out of the count; its heap entry is skipped when popped."""
        waiter.live = False
        self.queued -= 1
        if waiter.timer is not None:
            waiter.timer.cancel()
        if len(self._heap) > 2 * self.queued + 64:
            self._heap = [entry for entry in self._heap if entry[2].live]
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
