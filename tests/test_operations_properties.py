"""Property test of a route's and its operations' concurrency limits together (hypothesis).

A route with ``limit: 3`` and ``tools: {slow: {limit: 1}, fast: {limit: 2}}`` (queues on
both) admits random arrivals of ``slow``, ``fast`` and other tools through
``Route.plan(call)`` and one :class:`policies.pipeline.Admission` each, while random holders
finish and the loop runs between steps (so a hand-over races the next arrival). After every
step: no operation and not the route has more in flight than its limit; the route's slots are
held by admitted calls only (a call waiting in an operation's queue holds no route slot, so
other tools can still be served); and
once everything has ended, every count is back to zero.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.config import RouteConfig
from policies.pipeline import ABANDONED, Admission, Call, Outcome
from policies.reasons import Rejected
from proxy.events import EventLog
from proxy.routes import Route

TOOLS = ("slow", "fast", "other")
LIMITS = {"slow": 1, "fast": 2}
ROUTE_LIMIT = 3
DONE = Outcome("2xx", reached=True, status=200)

STEPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(TOOLS)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
    st.tuples(st.just("turn"), st.just(0)),
), max_size=40)


def route() -> Route:
    config = RouteConfig.model_validate({
        "name": "tools", "path_prefix": "/tools/", "upstream": "http://127.0.0.1:1",
        "protocol": "mcp", "concurrency": {"limit": ROUTE_LIMIT, "queue": 10, "max_wait": "60s"},
        "tools": {name: {"concurrency": {"limit": limit, "queue": 10, "max_wait": "60s"}}
                  for name, limit in LIMITS.items()}})
    return Route(config, EventLog(None))


async def run(steps: list[tuple[str, object]]) -> None:
    r = route()
    admitted: list[tuple[str, Admission]] = []
    pending: list[asyncio.Task[None]] = []
    n = 0

    async def arrive(tool: str) -> None:
        nonlocal n
        n += 1
        call = Call(request_id=str(n), route="tools", method="POST", path="/tools/mcp",
                    headers={}, body=b"", tenant="t", operation=tool)
        admission = Admission()
        try:
            await admission.admit(r.plan(call).policies, call)
        except (Rejected, asyncio.CancelledError):
            admission.release(ABANDONED)
            raise
        admitted.append((tool, admission))

    def check() -> None:
        ops = r.operations
        assert ops is not None
        for tool, limit in LIMITS.items():
            limiter = ops.by_name[tool].concurrency
            # A call waiting for a route slot keeps the operation's (it is its turn there).
            assert limiter is not None
            assert sum(t == tool for t, _ in admitted) <= limiter.inflight <= limit
        assert r.concurrency is not None
        assert 0 <= r.concurrency.inflight <= ROUTE_LIMIT
        assert r.concurrency.inflight == len(admitted)  # only admitted calls hold route slots

    for kind, arg in steps:
        if kind == "arrive":
            pending.append(asyncio.create_task(arrive(str(arg))))
        elif kind == "finish" and admitted:
            _, admission = admitted.pop(int(arg) % len(admitted))  # type: ignore[call-overload]
            admission.release(DONE)
        for _ in range(3):
            await asyncio.sleep(0)
        check()
    while pending and not all(task.done() for task in pending):  # drain: finish everyone
        while admitted:
            admitted.pop()[1].release(DONE)
        for _ in range(3):
            await asyncio.sleep(0)
        check()
    while admitted:
        admitted.pop()[1].release(DONE)
    for task in pending:
        assert task.exception() is None
    ops = r.operations
    assert ops is not None
    assert all(op.concurrency.inflight == 0 and op.concurrency.queued == 0  # type: ignore
               for op in ops)
    assert r.concurrency is not None
    assert r.concurrency.inflight == 0 and r.concurrency.queued == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STEPS)
def test_route_and_operation_limits_hold_together(steps: list[tuple[str, object]]) -> None:
    asyncio.run(run(steps))
