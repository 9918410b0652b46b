"""Review of the cancel-hold / drain / no-response-event changes: the cases they missed."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from policies import mcp
from tests.mcp_servers import (
    mcp_server_factory,  # noqa: F401  (fixture)
    tool_call,
)
from tests.test_mcp_left_callers import HEADERS, scripted  # noqa: F401  (fixture)
from tests.test_operations import MCP1_PYTHON, run_mcp1


def _route(upstream: str, **policies: Any) -> dict:
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream, "protocol": "mcp",
            **policies}


def _events(stream: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in stream.splitlines()
            if line.startswith(b"data: ") and line.strip() != b"data:"]


async def test_a_call_with_an_empty_string_id_gets_no_made_up_error_after_its_response(
        scripted, start_sluice):  # noqa: F811
    """``""`` is a JSON-RPC string id like any other. The answer's tracker was looking for
    id ``0`` (``jsonrpc_id(...) or 0``), so it never saw the response, and the stream, ended
    cleanly after it, got an ``upstream_unreachable`` error for request ``0`` as its last
    event: an error for another request of the session (the SDKs number from 0)."""
    scripted.mode = "sse_open"
    scripted.release.set()
    sluice = await start_sluice({"routes": [_route(scripted.url)]})
    call = tool_call("", "deliver", to="ops")
    async with aiohttp.ClientSession() as http:
        async with http.post(sluice.url + "/tools/mcp", json=call, headers=HEADERS) as r:
            assert r.status == 200
            events = _events(await r.read())
    assert [e.get("id") for e in events] == [""]
    assert events[0]["result"]["content"][0]["text"] == "done #1"


def test_a_batch_holding_initialize_opens_a_session():
    """A 2025-03-26 batch may hold ``initialize`` (the TypeScript SDK's server takes a batch
    of one): it opens a session as the bare request does, so the drain refuses it."""
    body = json.dumps([{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-03-26", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}]).encode()
    post = mcp.parse_post(body, None)
    assert mcp.traffic("POST", post) == "control"
    assert post.opens_session


async def test_a_stream_the_server_closes_for_polling_is_resumed_not_failed(
        mcp_server_factory, start_sluice):  # noqa: F811
    """2025-11-25 polling (SEP-1699): a server with an event store may close a call's SSE
    stream after its priming event (an id, no data); the client reconnects with
    ``Last-Event-ID`` and gets the response there. Sluice took that clean end for a stream
    ended without its response and added the call's ``upstream_unreachable`` error as last
    event: the client failed a call the server went on to answer."""
    from mcp import Client

    server = mcp_server_factory("session", resumable=True)
    sluice = await start_sluice({"routes": [_route(server.base_url)]})
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        result = await client.call_tool("poll", {"seconds": 1.0})
    assert result.content[0].text == "polled" and not result.is_error


MCP1_POLL = """
import asyncio, json, sys
from datetime import timedelta
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

async def main(url):
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            try:
                result = await session.call_tool("poll", {"seconds": 1.0},
                                                 read_timeout_seconds=timedelta(seconds=20))
                out = {"text": result.content[0].text, "error": result.isError}
            except Exception as exc:
                out = {"failed": f"{type(exc).__name__}: {exc}"[:200]}
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_the_1x_client_resumes_a_stream_closed_for_polling(
        mcp_server_factory, start_sluice, tmp_path):  # noqa: F811
    server = mcp_server_factory("session", resumable=True)
    sluice = await start_sluice({"routes": [_route(server.base_url)]})
    out = await run_mcp1(tmp_path / "mcp1_poll.py", MCP1_POLL, sluice.url + "/tools/mcp")
    assert out == {"text": "polled", "error": False}


async def test_calls_a_server_closes_for_polling_do_not_open_their_tools_breaker(
        mcp_server_factory, start_sluice):  # noqa: F811
    """From a review: a tool's breaker heard each call whose stream the server closed early
    for polling (2025-11-25, SEP-1699: a priming event with an id, then a clean end) as a
    failure, an answer without its response: with ``fail_max: 2``, the third call of a
    healthy tool on a polling server was refused ``circuit_open``, though every call was
    answered (on the resumed GET, which no breaker hears)."""
    from mcp import Client

    server = mcp_server_factory("session", resumable=True)
    sluice = await start_sluice({"routes": [_route(server.base_url, tools={
        "poll": {"circuit_breaker": {"fail_max": 2, "reset_timeout": "60s"}}})]})
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        for _ in range(3):
            result = await client.call_tool("poll", {"seconds": 0.1})
            assert result.content[0].text == "polled" and not result.is_error
    assert await sluice.metric("sluice_operation_circuit_state", route="tools",
                               operation="poll") == 0
