"""An MCP call whose caller closes its stream once it has read the response was answered.

The official clients read a call's SSE stream up to the call's response and then close it;
a server may end that stream a moment later (or, as allowed, later still). When the close
came first, Sluice counted the call ``client_disconnected`` (its handler was cancelled while
it waited for the rest of the stream), though its caller had its answer: a second new user
saw answered calls logged that way now and then. A dashboard or alert on callers giving up
then counts ordinary calls.

The scripted upstream here sends the response and holds the stream open, so the close always
comes first. The call now ends with its answer's status class (``2xx``); a caller that leaves
before the response, or whose last write failed, is still ``client_disconnected``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from mcp import Client

from tests.conftest import wait_until
from tests.test_mcp_left_callers import (
    CALL,
    HEADERS,
    ScriptedMcp,
    assert_all_given_back,
    completed_events,
    leave_a_call,
    mcp_route,
)
from tests.test_operations import MCP1_PYTHON, run_mcp1


class HandshakingMcp(ScriptedMcp):
    """:class:`ScriptedMcp` that also answers the handshake and ``tools/list`` of the
    official clients (one tool, ``deliver``), so that they can call its tool."""

    async def _post(self, request: web.Request) -> web.StreamResponse:
        message = await request.json()  # aiohttp keeps the body: the parent reads it again
        method = message.get("method")
        if "id" not in message:  # a notification
            return web.Response(status=202)
        if method == "initialize":
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "scripted", "version": "1"}}},
                headers={"Mcp-Session-Id": "s-1"})
        if method == "tools/list":
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {
                "tools": [{"name": "deliver", "inputSchema": {"type": "object"}}]}})
        return await super()._post(request)


@pytest.fixture
async def holding() -> AsyncIterator[HandshakingMcp]:
    """The upstream sends a call's response at once and ends its stream only on
    ``release``."""
    server = await HandshakingMcp().start()
    server.mode = "sse_open"
    yield server
    await server.stop()


async def the_calls_ended(sluice: Any, holding: HandshakingMcp, count: int) -> list[dict]:
    """The ``completed`` events of ``count`` tools/call requests, once their upstream
    streams were cut (nothing is left to relay once the caller has gone)."""
    def calls() -> list[dict]:
        return [e for e in sluice.events()
                if e["event"] == "completed" and e.get("operation") == "deliver"]

    await wait_until(lambda: holding.cut == count, what=f"{count} upstream stream(s) cut")
    await wait_until(lambda: len(calls()) >= count, what=f"{count} completed call(s)")
    return calls()


@pytest.mark.parametrize("idempotency", ["forward", "dedup"])
async def test_python_2x_client_closing_after_its_response_is_answered(holding, start_sluice,
                                                                       idempotency):
    """Before: ``outcome`` ``client_disconnected`` on both routes (``forward``: the handler's
    own relay; ``dedup``: the call's exchange runs in a task of its own)."""
    sluice = await start_sluice({"routes": [mcp_route(holding.url,
                                                      idempotency={"mode": idempotency})]})
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        result = await client.call_tool("deliver", {"to": "ops"}, read_timeout_seconds=30)
        assert result.content[0].text == "done #1"
        [completed] = await the_calls_ended(sluice, holding, 1)
    assert completed["outcome"] == "2xx" and completed["status"] == 200
    assert "duration_s" in completed  # a sample of the service time, as for any answer
    assert await sluice.metric("sluice_requests_total", route="tools", outcome="2xx") >= 1
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="client_disconnected") == 0
    assert holding.finished == 0  # the upstream's stream never ended on its own
    await assert_all_given_back(sluice)


MCP1_CALL = """
import asyncio, json, sys
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

async def main(url):
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            result = await session.call_tool("deliver", {"to": "ops"})
            print(json.dumps({"text": result.content[0].text}))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_python_1x_client_closing_after_its_response_is_answered(holding, start_sluice,
                                                                       tmp_path: Path):
    """The 1.x client closes the call's stream too once its response is read. Before:
    ``client_disconnected``."""
    sluice = await start_sluice({"routes": [mcp_route(holding.url,
                                                      idempotency={"mode": "forward"})]})
    out = await run_mcp1(tmp_path / "mcp1_call.py", MCP1_CALL, sluice.url + "/tools/mcp")
    assert out == {"text": "done #1"}
    [completed] = await the_calls_ended(sluice, holding, 1)
    assert completed["outcome"] == "2xx" and completed["status"] == 200
    await assert_all_given_back(sluice)


async def test_a_caller_leaving_before_its_response_is_still_client_disconnected(
        holding, start_sluice):
    """The same upstream, the response held back: the caller that leaves after the first
    event has no answer, and the call is ``client_disconnected`` as before."""
    holding.mode = "sse"
    sluice = await start_sluice({"routes": [mcp_route(holding.url,
                                                      idempotency={"mode": "forward"})]})
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, sluice.url + "/tools/mcp", holding, after_first_event=True)
        await wait_until(lambda: holding.cut == 1, what="the upstream stream cut")
    [completed] = await completed_events(sluice, 1)
    assert completed["outcome"] == "client_disconnected"
    await assert_all_given_back(sluice)


async def test_raw_caller_reading_the_response_then_closing(holding, start_sluice):
    """A plain HTTP client that reads up to the response event and closes: ``2xx``."""
    sluice = await start_sluice({"routes": [mcp_route(holding.url,
                                                      idempotency={"mode": "forward"})]})
    async with aiohttp.ClientSession() as http:
        async with http.post(sluice.url + "/tools/mcp", json=CALL, headers=HEADERS) as r:
            event = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            assert b'"id": 1' in event and b"done #1" in event
            r.close()  # leaves with its answer, the upstream's stream still open
    [completed] = await the_calls_ended(sluice, holding, 1)
    assert completed["outcome"] == "2xx"
    await assert_all_given_back(sluice)
