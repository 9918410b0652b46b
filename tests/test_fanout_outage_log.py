"""A hostile trial of Sluice's Redis faults (trial/redismem): with Redis down and a
``fanout.width`` configured, every call logged its own WARNING "concurrency of route
*/run:...: state backend unavailable ...; this replica admits at most ..." (300 calls, 301
lines), since each run's limiter is made anew once its calls have all ended and its "logged
once" flag went with it. The README promises outage losses are logged "not once per call":
the runs of one ``fanout.width`` now share one line per outage, and one when Redis is back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import pytest

from policies.operations import width_limiters
from policies.pipeline import Outcome
from policies.runs import WidthLimiters
from policies.shared_concurrency import SharedConcurrencyLimiter
from policies.state import Fallback, redis_backends
from tests.conftest import route
from tests.redis_servers import RedisServer, new_prefix
from tests.test_shared_rate_budget import own_state, post

CALLS, RUNS = 300, 10


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if " WARNING " in line]


async def test_an_outage_logs_one_line_for_every_runs_width_not_one_per_call(
        upstream, start_sluice, redis_server: RedisServer) -> None:
    state = own_state(redis_server, "local")
    sluice = await start_sluice({
        "state": state, "fanout": {"width": 8, "depth": 4, "max_wait": "2s"},
        "routes": [route("openai", upstream.url,
                         concurrency={"limit": 64, "queue": 64, "max_wait": "5s"})]})
    async with aiohttp.ClientSession() as session:
        status, _, _ = await post(session, sluice.url, **{"X-Run-ID": "warm"})
        assert status == 200
        redis_server.stop()
        await sluice.wait_metric("sluice_state_backend_up", 0, backend="redis")
        before = len(warnings(sluice.stderr()))
        gate = asyncio.Semaphore(8)

        async def one(i: int) -> int:
            async with gate:
                answer, _, _ = await post(session, sluice.url, **{"X-Run-ID": f"run{i % RUNS}"})
                return answer

        statuses = await asyncio.gather(*(one(i) for i in range(CALLS)))
        assert statuses == [200] * CALLS  # on_unavailable: local, each run within its share
        outage = warnings(sluice.stderr())[before:]
        per_run = [line for line in outage if "/run:" in line]
        assert len(per_run) == 1, f"{len(per_run)} lines for {CALLS} calls: {per_run[:3]}"
        assert "fanout.width (top level): state backend unavailable" in per_run[0]
        assert "of each run's 8 slots from its own memory" in per_run[0]
        assert len(outage) <= 5, outage  # the backend's own line, the route's, this one

        again = RedisServer(redis_server.directory, port=redis_server.port).start()
        try:
            await sluice.wait_metric("sluice_state_backend_up", 1, backend="redis")
            before = len(warnings(sluice.stderr()))
            for i in range(RUNS):
                status, _, _ = await post(session, sluice.url, **{"X-Run-ID": f"run{i}"})
                assert status == 200
        finally:
            again.stop()
    back = [line for line in warnings(sluice.stderr())[before:] if "fanout.width" in line]
    assert len(back) == 1 and "fanout.width (top level): shared across replicas again" in back[0]


# -- a review of the shared notice: it flipped with one run's key fault, and it missed the
# -- start of an outage when no fanout call had seen Redis back since the last one --------


def width_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings naming a fanout.width or one of its runs (the per-call INFO lines of
    leases given back later are not the notice's)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and ("fanout.width" in r.getMessage() or "/run:" in r.getMessage())]


async def one_call(limiters: WidthLimiters, run: str) -> None:
    """A call of ``run`` on a limiter made for it (as for a run whose calls had all ended),
    its slot taken and given back."""
    slot = await limiters("t", run, 4, 1.0).take("t")
    slot.release(Outcome("2xx", True, 200))


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_key_fault_on_one_runs_key_does_not_flip_the_shared_notice(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """One run's key holds a list (WRONGTYPE), Redis up; its calls and a good run's
    alternate, each on a limiter made anew. Each bad call logged "state backend unavailable"
    and each good one "shared across replicas again" (40 lines for 20 pairs; main: 20). A
    key fault is that run's, not the scope's outage: the shared notice says nothing of it,
    the state's key-fault line says it once."""
    caplog.set_level(logging.WARNING)
    backends = await redis_backends(redis_server.url, new_prefix(), 0.5)
    try:
        backends.fallback = Fallback("local", 1)
        limiters = width_limiters(backends, "*")
        bad = limiters("t", "bad", 4, 1.0)
        assert isinstance(bad, SharedConcurrencyLimiter)
        with redis_server.client() as admin:
            admin.lpush(backends.redis.key(bad.group, "conc"), "not-a-lease")
        for _ in range(20):
            for run in ("bad", "good"):
                await one_call(limiters, run)
        assert backends.redis.health.up
        assert backends.redis.key_faults["lease"] >= 20  # each bad call's acquire
        assert width_lines(caplog) == []
        (fault,) = [r.getMessage() for r in caplog.records if "key under the prefix" in
                    r.getMessage()]
        assert "lease state" in fault and "at most one such line a minute" in fault
    finally:
        await backends.close()


async def test_each_outage_is_said_even_with_no_fanout_call_between_them(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Redis goes down, a run's call says so; Redis comes back and no fanout call is made;
    it goes down again: that outage is said too (the notice stayed "degraded" until a
    fanout call saw Redis answer, so the second outage's start was not said). The first
    call after Redis is back says it once."""
    caplog.set_level(logging.WARNING)
    backends = await redis_backends(redis_server.url, new_prefix(), 0.5, probe_interval_s=0.1)
    server = redis_server
    try:
        backends.fallback = Fallback("local", 1)
        limiters = width_limiters(backends, "*")
        health = backends.redis.health
        for outage in range(2):
            server.stop()
            await until(lambda: not health.up, "the backend marked down")
            for i in range(3):
                await one_call(limiters, f"run{outage}-{i}")
            server = RedisServer(server.directory, port=server.port).start()
            await until(lambda: health.up, "the backend back")
        lines = width_lines(caplog)
        assert len(lines) == 2, lines
        assert all("fanout.width (top level): state backend unavailable" in line
                   for line in lines)
        for run in ("a", "b"):
            await one_call(limiters, run)
        again = width_lines(caplog)[2:]
        assert len(again) == 1 and "shared across replicas again" in again[0], again
    finally:
        server.stop()
        await backends.close()
