"""The queue's scheduler on a simulated clock: FIFO against Sluice's (WFQ + aging).

Drives the real :class:`policies.concurrency.ConcurrencyLimiter` on an event loop whose clock
jumps to the next timer instead of sleeping (a discrete-event simulation), so minutes of
skewed load take a fraction of a second and every run of the same seed gives the same
figures. The FIFO baseline is the same limiter with every call in one tenant and one class,
which is exactly arrival order.

The workload (``skewed``): a ``limit``-slot route with a fixed service time; a heavy tenant
sending ``ratio`` times as much as a light one, the two together at ``load`` times the route's
capacity, in all three priority classes (the heavy tenant's calls mostly standard and
best-effort, plus a steady critical stream that alone keeps the route busy part of the time).
"""

from __future__ import annotations

import asyncio
import random
import selectors
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from policies.concurrency import ConcurrencyLimiter
from policies.reasons import Rejected

CLASS_NAMES = {0: "critical", 1: "standard", 2: "best-effort"}


class _JumpSelector(selectors.DefaultSelector):
    """A selector that, instead of blocking for ``timeout``, moves the loop's clock by it."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: SimLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is not None and timeout > 0 and self.loop is not None:
            self.loop.now += timeout
        return super().select(0)


class SimLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: ``time()`` jumps from one timer to the next."""

    def __init__(self) -> None:
        selector = _JumpSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


@dataclass(frozen=True)
class Arrival:
    at: float
    tenant: str
    cls: int


def skewed(seconds: float, limit: int, service_s: float, load: float = 1.3,
           ratio: float = 10.0, critical_share: float = 0.3, seed: int = 1) -> list[Arrival]:
    """Poisson arrivals: a heavy and a light tenant at ``ratio``:1, ``load`` x capacity."""
    rng = random.Random(seed)
    capacity = limit / service_s
    rates = {"heavy": load * capacity * ratio / (ratio + 1), "light": load * capacity / (ratio + 1)}
    out: list[Arrival] = []
    for tenant, rate in rates.items():
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            if tenant == "heavy":
                u = rng.random()
                cls = 0 if u < critical_share else 1 if u < 0.7 else 2
            else:
                cls = 1 if rng.random() < 0.7 else 2
            out.append(Arrival(t, tenant, cls))
    return sorted(out, key=lambda a: a.at)


def simulate(arrivals: list[Arrival], limit: int, service_s: float, *, fifo: bool,
             aging: float | None = 5.0, max_wait: float = 600.0,
             weights: dict[str, float] | None = None) -> dict[tuple[str, Any], list[float]]:
    """Queue waits in seconds by ``("tenant", name)`` and ``("class", n)``; refused calls are
    counted under ``("refused", tenant)`` with their wait."""
    loop = SimLoop()
    limiter = ConcurrencyLimiter(limit, 1_000_000, max_wait, None,
                                 tenant_weights=weights, aging=None if fifo else aging)
    waits: dict[tuple[str, Any], list[float]] = defaultdict(list)

    async def one(arrival: Arrival) -> None:
        await asyncio.sleep(arrival.at - loop.time())
        start = loop.time()
        tenant, cls = ("all", 1) if fifo else (arrival.tenant, arrival.cls)
        try:
            await limiter.acquire(tenant, cls)
        except Rejected:
            waits[("refused", arrival.tenant)].append(loop.time() - start)
            return
        waited = loop.time() - start
        waits[("tenant", arrival.tenant)].append(waited)
        waits[("class", arrival.cls)].append(waited)
        await asyncio.sleep(service_s)
        limiter.release(tenant, service_s)

    async def main() -> None:
        await asyncio.gather(*(one(a) for a in arrivals))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return waits


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def table(results: dict[str, dict[tuple[str, Any], list[float]]],
          unloaded_p95: float, fmt: Callable[[float], str] = lambda v: f"{v:.2f}") -> str:
    """Per-tenant and per-class p50/p95/p99 waits, one row per scheduler and group."""
    lines = [f"{'scheduler':<10} {'group':<20} {'calls':>6} {'p50 s':>7} {'p95 s':>7} "
             f"{'p99 s':>7}"]
    for name, waits in results.items():
        for key in sorted(waits, key=str):
            if key[0] == "refused":
                continue
            label = f"{key[0]} {CLASS_NAMES.get(key[1], key[1])}"
            values = waits[key]
            lines.append(f"{name:<10} {label:<20} {len(values):>6} "
                         f"{fmt(percentile(values, .5)):>7} {fmt(percentile(values, .95)):>7} "
                         f"{fmt(percentile(values, .99)):>7}")
    lines.append(f"light tenant alone (unloaded): p95 {fmt(unloaded_p95)} s")
    return "\n".join(lines)


def compare(seconds: float = 600.0, limit: int = 8, service_s: float = 1.0, load: float = 1.3,
            ratio: float = 10.0, aging: float = 5.0, seed: int = 1
            ) -> tuple[dict[str, dict[tuple[str, Any], list[float]]], float]:
    """FIFO and Sluice's scheduler on the same arrivals, and the light tenant's p95 wait when
    it is alone on the route (its unloaded value)."""
    arrivals = skewed(seconds, limit, service_s, load, ratio, seed=seed)
    results = {
        "fifo": simulate(arrivals, limit, service_s, fifo=True),
        "sluice": simulate(arrivals, limit, service_s, fifo=False, aging=aging),
    }
    alone = [a for a in arrivals if a.tenant == "light"]
    unloaded = simulate(alone, limit, service_s, fifo=False, aging=aging)
    return results, percentile(unloaded[("tenant", "light")], 0.95)


def hand_over_cost(tenants: int, aging: float | None, hand_overs: int = 1000) -> float:
    """CPU microseconds (``time.process_time``) a freed slot takes to reach the next caller on
    a 1-slot route with one call queued from each of ``tenants`` tenants, in all three
    classes: :meth:`ConcurrencyLimiter.release` alone, the mean over ``hand_overs`` of them."""
    loop = SimLoop()
    limiter = ConcurrencyLimiter(1, tenants + 1, 600.0, None, aging=aging)
    served: list[str] = []

    async def one(tenant: str, cls: int) -> None:
        await limiter.acquire(tenant, cls)
        served.append(tenant)

    async def main() -> float:
        await limiter.acquire("holder")
        waiting = [asyncio.ensure_future(one(f"t{i}", i % 3)) for i in range(tenants)]
        await asyncio.sleep(0)
        holder, spent = "holder", 0.0
        for _ in range(min(hand_overs, tenants)):
            start = time.process_time()
            limiter.release(holder, 1.0)
            spent += time.process_time() - start
            await asyncio.sleep(0)  # the caller handed the slot takes it
            holder = served[-1]
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return spent / min(hand_overs, tenants) * 1e6

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
