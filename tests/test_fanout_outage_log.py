"""A hostile trial of Sluice's Redis faults (trial/redismem): with Redis down and a
``fanout.width`` configured, every call logged its own WARNING "concurrency of route
*/run:...: state backend unavailable ...; this replica admits at most ..." (300 calls, 301
lines), since each run's limiter is made anew once its calls have all ended and its "logged
once" flag went with it. The README promises outage losses are logged "not once per call":
the runs of one ``fanout.width`` now share one line per outage, and one when Redis is back."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import route
from tests.redis_servers import RedisServer
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
