"""An MCP call's stream the upstream ends without the call's response is no 2xx answer.

A session-mode server that ends its session (its client's DELETE) ends the streams of the
session's calls in flight with no response. The call's client gets the JSON-RPC error 502
``upstream_unreachable`` as the stream's last event, but its ``completed`` event and
``sluice_requests_total`` said ``2xx`` (and a call finished without its caller said
``finished_after_leaving: "2xx"``; a hostile trial). It is now ``upstream_error``, as a
stream the upstream cut is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import completed_events, serve_app
from tests.test_mcp_left_callers import assert_all_given_back, noticed_leaving

DEDUP = {"mode": "dedup", "max_wait": "30s"}
SESSION = "s-1"
HEADERS = {"Accept": "application/json, text/event-stream", "Mcp-Session-Id": SESSION,
           "MCP-Protocol-Version": "2025-11-25"}
CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "deliver", "arguments": {"to": "ops"}}}


def mcp_route(upstream: str, **policies: Any) -> dict:
    """A ``protocol: mcp`` route ``/tools/`` in front of ``upstream``."""
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream, "protocol": "mcp",
            **policies}


def _event(message: dict) -> bytes:
    return b"event: message\ndata: " + json.dumps(message).encode() + b"\n\n"


class SessionServer:
    """An MCP endpoint with sessions, as the official server behaves: a ``tools/call`` is
    answered on SSE (a progress event at once, the response once :attr:`release` is set);
    a DELETE ends the session, and with it the streams of its calls in flight, with no
    response (the official server cancels the tool's task). Logs what happened in order
    (:attr:`log`): ``call``, ``answered``, ``ended_without_response``, ``delete``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.deleted = asyncio.Event()
        self.log: list[str] = []
        self.inflight = 0
        self.calls = 0
        self.cut = 0  # read by noticed_leaving: this server never sees a cut
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> SessionServer:
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        app.router.add_delete("/mcp", self._delete)
        self.runner, self.port = await serve_app(app, handler_cancellation=True)
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _delete(self, request: web.Request) -> web.Response:
        self.log.append("delete")
        self.deleted.set()
        return web.Response(status=200, content_type="application/json")

    async def _post(self, request: web.Request) -> web.StreamResponse:
        message = await request.json()
        if message.get("method") != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "result": {}})
        self.calls += 1
        self.inflight += 1
        self.log.append("call")
        try:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(_event({"jsonrpc": "2.0", "method": "notifications/progress",
                                    "params": {"progressToken": 1, "progress": 0.5}}))
            release = asyncio.ensure_future(self.release.wait())
            deleted = asyncio.ensure_future(self.deleted.wait())
            await asyncio.wait((release, deleted), return_when=asyncio.FIRST_COMPLETED)
            release.cancel()
            deleted.cancel()
            if self.deleted.is_set():
                self.log.append("ended_without_response")
            else:
                await out.write(_event({"jsonrpc": "2.0", "id": message["id"], "result": {
                    "content": [{"type": "text", "text": f"done #{self.calls}"}],
                    "isError": False}}))
                self.log.append("answered")
            await out.write_eof()
            return out
        finally:
            self.inflight -= 1


@pytest.fixture
async def session_server() -> AsyncIterator[SessionServer]:
    server = await SessionServer().start()
    yield server
    await server.stop()


async def leave_call(http: aiohttp.ClientSession, url: str, server: SessionServer) -> None:
    """Send CALL on the session, read its first event, and leave (close the POST)."""
    reading = asyncio.Event()

    async def call() -> None:
        async with http.post(url, json=CALL, headers=HEADERS) as r:
            await r.content.readuntil(b"\n\n")
            reading.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(call())
    await asyncio.wait_for(reading.wait(), 10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def delete_session(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with http.delete(url, headers=HEADERS) as r:
        return r.status, await r.read()


async def test_a_stream_ended_without_its_response_is_an_upstream_error(session_server,
                                                                        start_sluice):
    """A route that keeps no answers: the DELETE goes through while the call's client waits,
    the server ends the call's stream without its response, and the client gets the
    JSON-RPC error 502 ``upstream_unreachable``. Before, its ``completed`` event and
    ``sluice_requests_total`` said ``2xx``."""
    sluice = await start_sluice({"routes": [mcp_route(session_server.url)]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=CALL, headers=HEADERS) as r:
            await r.content.readuntil(b"\n\n")
            assert (await delete_session(http, url))[0] == 200
            rest = await r.text()
    assert '"reason":"upstream_unreachable"' in rest.replace(" ", "") and '"code":502' in rest
    events = await completed_events(sluice, 2)
    [call] = [e for e in events if e.get("mcp_method") == "tools/call"]
    assert (call["status"], call["outcome"]) == (200, "upstream_error")
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="upstream_error") == 1
    assert await sluice.metric("sluice_requests_total", route="tools", outcome="2xx") == 1


async def test_a_finish_ended_without_its_response_is_an_upstream_error(session_server,
                                                                        start_sluice):
    """The same for a call finished without its caller, on a route keeping answers: the
    server ends the stream without the response (not for a DELETE: a DELETE sent directly,
    past Sluice). Before: ``finished_after_leaving`` ``2xx``; nothing is kept either way."""
    sluice = await start_sluice({"routes": [mcp_route(session_server.url,
                                                      idempotency=DEDUP)]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_call(http, url, session_server)
        await noticed_leaving(sluice, session_server)
        async with http.delete(session_server.url + "/mcp", headers=HEADERS) as r:
            assert r.status == 200
        await assert_all_given_back(sluice)
    [completed] = await completed_events(sluice, 1)
    assert completed["outcome"] == "client_disconnected"
    assert (completed["finished_after_leaving"], completed["finished_status"]) == (
        "upstream_error", 200)
    assert await sluice.metric("sluice_finished_after_leaving_total", route="tools",
                               outcome="upstream_error") == 1
    assert await sluice.metric("sluice_finished_after_leaving_total", route="tools",
                               outcome="2xx") == 0
