"""Property test of a route's and its operations' concurrency limits together (hypothesis).

A route with ``limit: 3`` and ``tools: {slow: {limit: 1}, fast: {limit: 2}}`` (queues on
both) admits random arrivals of ``slow``, ``fast`` and other tools through
``Route.plan(call)`` and one :class:`policies.pipeline.Admission` each, while random holders
finish and the loop runs between steps (so a hand-over races the next arrival). After every
step: no operation and not the route has more in flight than its limit; the route's slots are
held by admitted calls only (a call waiting in an operation's queue holds no route slot, so
other tools can still be served); and
once everything has ended, every count is back to zero.

Calls come from several tenants under the route's ``per_tenant``, and random waiting callers
leave (cancellation): a tenant's count on the route (its calls in flight and queued there or
for an operation's slot) never passes ``per_tenant``, is exactly its calls admitted or
waiting, and returns to zero (a review: an operation's slot gave the count up before the
route's step took it again, so a tenant of ``per_tenant: 2`` held 3 calls).
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.config import RouteConfig
from policies.pipeline import ABANDONED, Admission, Call, Outcome
from policies.reasons import Rejected
from proxy.events import EventLog
from proxy.routes import Route

TOOLS = ("slow", "fast", "other")
TENANTS = ("a", "b", "c")
PER_TENANT = 2
LIMITS = {"slow": 1, "fast": 2}
ROUTE_LIMIT = 3
DONE = Outcome("2xx", reached=True, status=200)

STEPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.tuples(st.sampled_from(TOOLS), st.sampled_from(TENANTS))),
    st.tuples(st.just("leave"), st.integers(0, 20)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
    st.tuples(st.just("turn"), st.just(0)),
), max_size=40)


def route() -> Route:
    config = RouteConfig.model_validate({
        "name": "tools", "path_prefix": "/tools/", "upstream": "http://127.0.0.1:1",
        "protocol": "mcp", "concurrency": {"limit": ROUTE_LIMIT, "queue": 10, "max_wait": "60s",
                                         "per_tenant": PER_TENANT},
        "tools": {name: {"concurrency": {"limit": limit, "queue": 10, "max_wait": "60s"}}
                  for name, limit in LIMITS.items()}})
    return Route(config, EventLog(None))


async def run(steps: list[tuple[str, object]]) -> None:
    r = route()
    admitted: list[tuple[str, str, Admission]] = []
    pending: list[asyncio.Task[None]] = []
    waiting: dict[asyncio.Task[None], str] = {}  # arrivals not yet admitted, by tenant
    n = 0

    async def arrive(tool: str, tenant: str) -> None:
        nonlocal n
        n += 1
        call = Call(request_id=str(n), route="tools", method="POST", path="/tools/mcp",
                    headers={}, body=b"", tenant=tenant, operation=tool)
        admission = Admission()
        try:
            await admission.admit((await r.plan(call)).policies, call)
        except (Rejected, asyncio.CancelledError):
            admission.release(ABANDONED)
            raise
        admitted.append((tool, tenant, admission))

    def check() -> None:
        ops = r.operations
        assert ops is not None
        for tool, limit in LIMITS.items():
            limiter = ops.by_name[tool].concurrency
            # A call waiting for a route slot keeps the operation's (it is its turn there).
            assert limiter is not None
            assert sum(t == tool for t, _, _ in admitted) <= limiter.inflight <= limit
        assert r.concurrency is not None
        assert 0 <= r.concurrency.inflight <= ROUTE_LIMIT
        assert r.concurrency.inflight == len(admitted)  # only admitted calls hold route slots
        # Each tenant's count: its calls admitted and waiting, once each, never past the cap.
        for task in [task for task in waiting if task.done()]:
            del waiting[task]
        counts = r.concurrency._by_tenant
        assert all(0 < held <= PER_TENANT for held in counts.values()), counts
        assert counts == {tenant: held for tenant in TENANTS if (held := sum(
            t == tenant for _, t, _ in admitted) + sum(t == tenant for t in waiting.values()))}

    for kind, arg in steps:
        if kind == "arrive":
            tool, tenant = arg  # type: ignore[misc]
            task = asyncio.create_task(arrive(tool, tenant))
            pending.append(task)
            waiting[task] = tenant
        elif kind == "leave" and waiting:
            list(waiting)[int(arg) % len(waiting)].cancel()  # type: ignore[call-overload]
        elif kind == "finish" and admitted:
            admitted.pop(int(arg) % len(admitted))[2].release(DONE)  # type: ignore[call-overload]
        for _ in range(3):
            await asyncio.sleep(0)
        check()
    while pending and not all(task.done() for task in pending):  # drain: finish everyone
        while admitted:
            admitted.pop()[2].release(DONE)
        for _ in range(3):
            await asyncio.sleep(0)
        check()
    while admitted:
        admitted.pop()[2].release(DONE)
    for task in pending:
        assert task.cancelled() or task.exception() is None or (
            isinstance(task.exception(), Rejected)
            and task.exception().reason.code == "tenant_concurrency")  # type: ignore[union-attr]
    ops = r.operations
    assert ops is not None
    assert all(op.concurrency.inflight == 0 and op.concurrency.queued == 0  # type: ignore
               for op in ops)
    assert r.concurrency is not None
    assert r.concurrency.inflight == 0 and r.concurrency.queued == 0
    assert r.concurrency._by_tenant == {}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STEPS)
def test_route_and_operation_limits_hold_together(steps: list[tuple[str, object]]) -> None:
    asyncio.run(run(steps))


async def test_a_call_stays_counted_while_the_shared_route_limiter_asks_redis(monkeypatch):
    """A review: the operation's slot gave its count of the call up once taken, and the Redis
    limiter's step awaited Redis before counting it again: another call of the tenant sent
    meanwhile was admitted, 3 in flight with ``per_tenant: 2`` (behind a 150 ms Redis). The
    count passes from the operation's step to the route's, kept while Redis is asked."""
    from policies.concurrency import ConcurrencyLimiter, OperationSlot
    from policies.shared_concurrency import SharedConcurrencyLimiter
    from policies.state import memory_backends

    gate = asyncio.Event()
    asked = asyncio.Event()
    real_try = SharedConcurrencyLimiter._try

    async def slow_try(self: SharedConcurrencyLimiter, tenant: str) -> object:
        asked.set()
        await gate.wait()  # Redis's answer, late
        return await real_try(self, tenant)

    monkeypatch.setattr(SharedConcurrencyLimiter, "_try", slow_try)
    route_limiter = SharedConcurrencyLimiter(8, 32, 60.0, 2, backends=memory_backends(),
                                             group="api")
    step = OperationSlot(ConcurrencyLimiter(1, 16, 60.0, None), route_limiter)

    def call(n: int, tenant: str = "a") -> Call:
        return Call(request_id=str(n), route="api", method="POST", path="/api/slow",
                    headers={}, body=b"", tenant=tenant)

    async def admit(policies: list[object], c: Call) -> Admission:
        admission = Admission()
        try:
            await admission.admit(policies, c)  # type: ignore[arg-type]
        except BaseException:
            admission.release(ABANDONED)
            raise
        return admission

    gate.set()
    other = await admit([route_limiter], call(0))  # a: 1 in flight on the route
    b_call = await admit([step, route_limiter], call(1, "b"))  # b holds the endpoint's slot
    gate.clear()
    second = asyncio.create_task(admit([step, route_limiter], call(2)))
    await asyncio.sleep(0)
    assert route_limiter._by_tenant == {"a": 2, "b": 1}  # a's second queued, counted
    asked.clear()
    b_call.release(DONE)  # the endpoint's slot passes to a's second call
    await asked.wait()  # which now waits for Redis's answer for the route's lease
    assert route_limiter._by_tenant == {"a": 2}  # counted all along
    # A third call of a is over per_tenant: refused at once, without asking Redis.
    third = asyncio.create_task(admit([route_limiter], call(3)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert third.done()
    with pytest.raises(Rejected) as refused:
        await third
    assert refused.value.reason.code == "tenant_concurrency"
    gate.set()
    (await second).release(DONE)
    other.release(DONE)
    assert route_limiter._by_tenant == {}
