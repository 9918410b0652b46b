"""A review of stop 41's MCP fixes: a priming event ended by a lone CR, and a drain's cut of
a long-held control request (``tasks/result``). (The ended sessions a DELETE leaves are
tested in tests/test_mcp_session_delete.py.)"""
from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import serve_app
from tests.test_mcp_session_delete import CALL, HEADERS, mcp_route


@pytest.mark.parametrize("eol", [b"\n", b"\r"])
async def test_a_stream_closed_for_polling_is_held_whatever_its_line_ends(start_sluice, eol):
    """A server closes a call's stream early for polling after its priming event (an id,
    empty data): the call is held for its resumed answer. With lone-CR line ends (valid SSE)
    the blank line ending that event is the stream's last byte, which the tracker holds back
    until told the stream ended: the relay looked at ``resumable`` before telling it, so the
    call was counted ``upstream_error`` and not held, though its stream was taken as polled."""
    async def post(request: web.Request) -> web.StreamResponse:
        await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"id: e1" + eol + b"data: " + eol + eol)
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/mcp", post)
    runner, port = await serve_app(app)
    try:
        sluice = await start_sluice({"routes": [mcp_route(f"http://127.0.0.1:{port}")]})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=CALL, headers=HEADERS) as r:
                body = await r.read()
            assert r.status == 200 and b"error" not in body, body
            await sluice.wait_metric("sluice_polled_calls", 1)  # held for its resumption
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("method", ["tools/call", "tasks/result"])
async def test_a_drain_cut_ends_a_long_held_mcp_request_with_its_jsonrpc_error(start_sluice,
                                                                              method):
    """``tasks/result`` blocks at the server until its task ends (MCP 2025-11-25). Made
    control traffic, it was not in ``Runtime.mcp_calls``, so the drain's cut did not end it
    with its JSON-RPC error (as a ``tools/call`` is): the POST was cut, which fails no call on
    the Python mcp 1.x client (it waits for ever)."""
    arrived, done = asyncio.Event(), asyncio.Event()

    async def post(request: web.Request) -> web.StreamResponse:
        await request.json()
        arrived.set()
        await done.wait()
        return web.Response(status=500)

    app = web.Application()
    app.router.add_post("/mcp", post)
    runner, port = await serve_app(app)
    try:
        sluice = await start_sluice({"server": {"drain_timeout": "1s"},
                                     "routes": [mcp_route(f"http://127.0.0.1:{port}")]})
        url = sluice.url + "/tools/mcp"
        body = ({**CALL} if method == "tools/call" else
                {"jsonrpc": "2.0", "id": 7, "method": "tasks/result",
                 "params": {"taskId": "t-1"}})
        async with aiohttp.ClientSession() as http:
            answer = asyncio.create_task(http.post(url, json=body, headers=HEADERS))
            await asyncio.wait_for(arrived.wait(), 10)
            sluice.signal(signal.SIGTERM)
            async with await answer as r:
                text = await r.text()
            assert r.status == 200 and '"id":7' in text.replace(" ", ""), (r.status, text)
            assert '"error"' in text
    finally:
        done.set()
        await runner.cleanup()
