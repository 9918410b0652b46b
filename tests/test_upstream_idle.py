"""``server.upstream_idle_timeout``: how long an idle upstream connection is kept for reuse.

Found by a hostile trial: kept 30 s, a connection an upstream closes after its own 5 s
(uvicorn's, Node's) could be reused just as it closed; a POST written on it got no answer and,
not safe to retry (RFC 9112 §9.3.1), was answered 502. The pool now lets a connection go
before such an upstream would, and the setting says how soon."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tests.conftest import route
from tests.ports import free_ports
from tests.test_reload import rewrite, until


async def _upstream() -> tuple[web.AppRunner, int, list[int]]:
    """An upstream that keeps idle connections 60 s and notes each request's client port."""
    ports: list[int] = []

    async def answer(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=60)
    await runner.setup()
    [port] = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port, ports


async def test_an_idle_upstream_connection_is_let_go_after_upstream_idle_timeout(start_sluice):
    runner, port, ports = await _upstream()
    try:
        upstream = f"http://127.0.0.1:{port}"
        short = await start_sluice({"server": {"upstream_idle_timeout": "200ms"},
                                    "routes": [route("r", upstream, "http")]})
        long = await start_sluice({"server": {"upstream_idle_timeout": "60s"},
                                   "routes": [route("r", upstream, "http")]})
        async with aiohttp.ClientSession() as session:

            async def two_calls(sluice, pause_s: float) -> set[int]:
                before = len(ports)
                for n in range(2):
                    if n:
                        await asyncio.sleep(pause_s)
                    async with session.post(sluice.url + "/r/x", json={}) as r:
                        assert r.status == 200
                return set(ports[before:])

            # Back to back, both reuse their connection...
            assert len(await two_calls(short, 0)) == 1
            assert len(await two_calls(long, 0)) == 1
            # ... and after a pause five times the short one's, only the long one does.
            assert len(await two_calls(short, 1.0)) == 2
            assert len(await two_calls(long, 1.0)) == 1
    finally:
        await runner.cleanup()


async def test_a_reload_keeps_the_running_idle_timeout_and_says_it_as_written(
        upstream, start_sluice):
    """The pool is made at the start: a reload keeps its idle time, saying so in the unit a
    config is written in (it said "still 4.0")."""
    sluice = await start_sluice({"routes": [route("r", upstream.url, "http")]})
    rewrite(sluice.config_path,
            lambda data: data["server"].update(upstream_idle_timeout="10s"))
    await sluice.wait_metric("sluice_config_reloads_total", 1)
    await until(lambda: "config reload: server.upstream_idle_timeout changed but cannot "
                "change while running; still 4s until a restart" in sluice.stderr())
