"""A caller that closes its stream once it has read the answer's last message was answered.

The official MCP clients read a call's SSE stream up to the call's response and then close
it, and the OpenAI Python SDK's synchronous client closes a chat stream as soon as it reads
``data: [DONE]``; the upstream may end the stream a moment later. When the close came first,
Sluice counted the call ``client_disconnected`` (its handler was cancelled while it waited for
the rest of the stream), though its caller had its answer: a new user saw answered MCP calls
logged that way now and then, and a dashboard or alert on callers giving up counted them.

The upstreams here send the last message and hold the stream open, so the close always comes
first. The call now ends with its answer's status class (``2xx``); a caller that leaves
before the last message, or whose last write failed, is still ``client_disconnected``. So do
an MCP control request answered on a stream (``initialize``), a GET resuming a call's answer
(with that call's response), and a session's GET stream, which has no end of its own and is
closed by its client at every session's close.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from mcp import Client

from proxy.runtime import Runtime
from tests import mcp_servers
from tests.conftest import completed_events, open_runtime, route, serve_app, wait_until
from tests.fakeupstream import FakeUpstream
from tests.test_mcp_left_callers import (
    CALL,
    HEADERS,
    ScriptedMcp,
    assert_all_given_back,
    leave_a_call,
    mcp_route,
    serve_in_process,
)
from tests.test_operations import MCP1_PYTHON, run_mcp1

mcp_session = mcp_servers.mcp_session


class HandshakingMcp(ScriptedMcp):
    """:class:`ScriptedMcp` that also answers the handshake and ``tools/list`` of the
    official clients (one tool, ``deliver``), so that they can call its tool. With
    ``sse_initialize``, ``initialize`` is answered on an SSE stream held open after the
    response, as ``sse_open`` holds a call's (``initialize_cut`` counts those Sluice cut)."""

    sse_initialize = False
    initialize_cut = 0

    async def _post(self, request: web.Request) -> web.StreamResponse:
        message = await request.json()  # aiohttp keeps the body: the parent reads it again
        method = message.get("method")
        if "id" not in message:  # a notification
            return web.Response(status=202)
        if method == "initialize":
            answer = {"jsonrpc": "2.0", "id": message["id"], "result": {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "scripted", "version": "1"}}}
            if not self.sse_initialize:
                return web.json_response(answer, headers={"Mcp-Session-Id": "s-1"})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                              "Mcp-Session-Id": "s-1"})
            await out.prepare(request)
            await out.write(b"event: message\ndata: " + json.dumps(answer).encode() + b"\n\n")
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.initialize_cut += 1
                raise
            await out.write_eof()
            return out
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


async def test_a_control_request_closed_after_its_response_is_answered(holding, start_sluice):
    """``initialize`` answered on an SSE stream the server holds open: the client reads the
    response and closes it. Before: that request was ``client_disconnected`` (the tracker
    that sees a response followed calls only)."""
    holding.sse_initialize = True
    sluice = await start_sluice({"routes": [mcp_route(holding.url,
                                                      idempotency={"mode": "forward"})]})
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        result = await client.call_tool("deliver", {"to": "ops"}, read_timeout_seconds=30)
        assert result.content[0].text == "done #1"
        await wait_until(lambda: holding.initialize_cut == 1, what="initialize's stream cut")
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
    await wait_until(lambda: any(e["event"] == "completed" and e.get("operation") == "deliver"
                                 for e in sluice.events()), what="the call's end logged")
    ends = [e for e in sluice.events() if e["event"] == "completed"]
    first = next(e["request_id"] for e in sluice.events() if e["event"] == "admitted")
    assert [e["outcome"] for e in ends if e["request_id"] == first] == ["2xx"]  # initialize
    # (The upstream answers the client's GET stream and DELETE 405: 4xx.)
    assert "client_disconnected" not in {e["outcome"] for e in ends}, ends


async def test_a_sessions_get_stream_closed_by_its_client_ends_2xx(mcp_session, start_sluice):
    """A 2025 client (the 2.x client in legacy mode) opens its session's GET stream and
    closes it when the session closes: the stream's normal end, as it has no end of its own.
    Before: one ``client_disconnected`` per session (a new user's trial: 21 of 21)."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url,
                                                      idempotency={"mode": "forward"})]})
    for _ in range(2):
        async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
            await sluice.wait_metric("sluice_open_streams", 1, route="tools")
            assert (await client.call_tool("add", {"a": 2, "b": 3})).content[0].text == "5"
        await sluice.wait_metric("sluice_open_streams", 0, route="tools")
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")

    def ends() -> list[dict]:
        return [e for e in sluice.events() if e["event"] == "completed"]

    # initialize, initialized, the GET stream, the call, DELETE (and any tools/list): each
    # session's GET stream is among them, the last to end.
    await wait_until(lambda: len(ends()) >= 10, what="both sessions' ends logged")
    assert {e["outcome"] for e in ends()} == {"2xx"}, ends()
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="client_disconnected") == 0


async def test_a_get_stream_left_before_the_upstream_answered_is_client_disconnected(
        start_sluice):
    """A GET stream whose client leaves before the upstream's head came never started."""
    held = asyncio.Event()

    async def get(request: web.Request) -> web.StreamResponse:
        await held.wait()
        return web.Response(status=405)

    app = web.Application()
    app.router.add_get("/mcp", get)
    runner, port = await serve_app(app, handler_cancellation=True)
    try:
        sluice = await start_sluice({"routes": [mcp_route(f"http://127.0.0.1:{port}")]})
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(http.get(
                sluice.url + "/tools/mcp", headers={"Accept": "text/event-stream",
                                                    "Mcp-Session-Id": "s-1"}))
            await sluice.wait_metric("sluice_open_streams", 1, route="tools")
            request.cancel()
        await sluice.wait_metric("sluice_open_streams", 0, route="tools")
        [end] = await completed_events(sluice, 1)
        assert end["outcome"] == "client_disconnected"
    finally:
        held.set()
        await runner.cleanup()


class PollingMcp:
    """An MCP endpoint that closes each POST's answer early for polling (one priming event
    with an id, no response) and gives the response on the GET resuming it with
    ``Last-Event-ID``, once ``answer`` is set, holding that GET open until ``end`` is."""

    def __init__(self) -> None:
        self.answer, self.end = asyncio.Event(), asyncio.Event()
        self.pending: dict[str, Any] = {}
        self.url = ""

    async def post(self, request: web.Request) -> web.StreamResponse:
        message = await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        self.pending[f"ev-{message['id']}"] = message["id"]
        await out.write(f"id: ev-{message['id']}\ndata: \n\n".encode())
        await out.write_eof()
        return out

    async def get(self, request: web.Request) -> web.StreamResponse:
        last = request.headers.get("Last-Event-ID", "")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if last in self.pending:
            await self.answer.wait()
            body = {"jsonrpc": "2.0", "id": self.pending[last], "result": {"content": []}}
            await out.write(f"id: {last}-r\ndata: {json.dumps(body)}\n\n".encode())
        await self.end.wait()
        await out.write_eof()
        return out


@pytest.fixture
async def polling() -> AsyncIterator[PollingMcp]:
    server = PollingMcp()
    app = web.Application()
    app.router.add_post("/mcp", server.post)
    app.router.add_get("/mcp", server.get)
    runner, port = await serve_app(app, handler_cancellation=True)
    server.url = f"http://127.0.0.1:{port}"
    yield server
    server.answer.set()
    server.end.set()
    await runner.cleanup()


@pytest.fixture
async def in_front(polling) -> AsyncIterator[tuple[Runtime, str]]:
    """A runtime served in this process with one ``tools`` route in front of ``polling``:
    it, and the route's MCP endpoint."""
    runtime = await open_runtime(route("tools", polling.url, "mcp"))
    runner, url = await serve_in_process(runtime)
    yield runtime, url
    await runner.cleanup()
    await runtime.close()


def outcomes(runtime: Runtime, *labels: str) -> tuple[float | None, ...]:
    """``sluice_requests_total`` of the ``tools`` route for each of ``labels``."""
    return tuple(runtime.metrics.registry.get_sample_value(
        "sluice_requests_total", {"route": "tools", "outcome": label}) for label in labels)


async def closed_early(http: aiohttp.ClientSession, url: str) -> None:
    """Send CALL: its answer is closed early for polling, after one event, ``ev-1``."""
    async with http.post(url, json=CALL, headers=HEADERS) as r:
        assert await r.read() == b"id: ev-1\ndata: \n\n"


@pytest.mark.parametrize("write_fails", [False, True])
async def test_a_get_resuming_a_calls_answer_ends_with_that_calls_response(
        polling, in_front, monkeypatch, write_fails):
    """A GET resuming a call's answer closed early for polling: closed by its client after
    the response, ``2xx``; when the write carrying the response fails (the client gone),
    ``client_disconnected`` (from a review: the GET counted ``2xx`` there, as it was marked a
    finished stream before the write)."""
    runtime, url = in_front
    real_write = web.StreamResponse.write

    async def write(self: web.StreamResponse, data: bytes) -> None:
        if (write_fails and self._req is not None and self._req.method == "GET"
                and b'"result"' in bytes(data) and self._req.path.startswith("/tools/")):
            raise ConnectionResetError("the caller has gone")
        return await real_write(self, data)

    async with aiohttp.ClientSession() as http:
        await closed_early(http, url)
        monkeypatch.setattr(web.StreamResponse, "write", write)
        polling.answer.set()
        async with http.get(url, headers={"Accept": "text/event-stream",
                                          "Last-Event-ID": "ev-1"}) as r:
            if not write_fails:
                event = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                assert b'"result"' in event
    await wait_until(lambda: runtime.inflight == 0, what="both requests' ends")
    # The POST is 2xx either way; the GET is 2xx only if its response went out.
    assert outcomes(runtime, "2xx", "client_disconnected") == ((1, 1) if write_fails
                                                              else (2, 0))


async def test_a_resume_retried_after_the_first_left_still_resumes_the_call(polling,
                                                                           in_front):
    """The client's GET resuming a call's answer breaks before the response, and it resumes
    again from the same event id, as the SDKs do. Before (a review): the first GET had taken
    the call off ``Runtime.polled``, so the second was a session's plain stream: a drain
    did not wait for it, and left before the response it counted ``2xx``. The call itself
    stays in flight (held for its response) throughout: one of ``inflight``."""
    runtime, url = in_front
    resume = {"Accept": "text/event-stream", "Last-Event-ID": "ev-1"}
    async with aiohttp.ClientSession() as http:
        await closed_early(http, url)
        for _ in range(2):  # each resume breaks before the response
            get = await http.get(url, headers=resume)
            await wait_until(lambda: runtime.inflight == 2, what="the GET upstream")
            assert runtime.present > runtime.streams + 1  # a drain waits for it
            get.close()
            await wait_until(lambda: runtime.inflight == 1, what="the GET's end")
            assert len(runtime.polling) == 1  # the call, held for its response
        polling.answer.set()
        async with http.get(url, headers=resume) as r:
            event = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            assert b'"result"' in event
    await wait_until(lambda: runtime.inflight == 0, what="the last GET's end")
    assert outcomes(runtime, "2xx", "client_disconnected") == (2, 2)
    assert not runtime.polled  # taken by the GET that got the response
    assert not runtime.polling  # the call ended with it


# -- OpenAI streams: the synchronous client closes at [DONE] ------------------------------------


def openai_route(upstream: FakeUpstream) -> dict:
    return {"name": "openai", "path_prefix": "/openai/", "upstream": upstream.url,
            "protocol": "openai"}


def stream_chat_sync(base_url: str) -> str:
    """One streamed chat completion through the OpenAI SDK's synchronous client (it breaks
    out of the stream at ``[DONE]`` and closes the response); the text it read."""
    client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
    try:
        stream = client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True})
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        client.close()



async def test_openai_sync_client_closing_at_done_is_answered(upstream, start_sluice):
    """The upstream holds the stream open 5 s after ``[DONE]``. Before: every call
    ``client_disconnected`` (10 of 10 in a trial at a 10 ms linger)."""
    upstream.done_linger = 5.0
    sluice = await start_sluice({"routes": [openai_route(upstream)]})
    for _ in range(3):
        text = await asyncio.to_thread(stream_chat_sync, sluice.url + "/openai/v1")
        assert text.startswith("tok0 ")
    ends = await completed_events(sluice, 3)
    assert [(e["outcome"], e["status"], e["usage"]) for e in ends] == [("2xx", 200,
                                                                         "reported")] * 3
    assert await sluice.metric("sluice_requests_total", route="openai",
                               outcome="client_disconnected") == 0
    await sluice.wait_metric("sluice_inflight_requests", 0, route="openai")


async def test_an_openai_caller_leaving_before_done_is_still_client_disconnected(
        upstream, start_sluice):
    """A caller that leaves mid-stream, before ``[DONE]``, did not get its answer."""
    upstream.stream_hold = asyncio.Event()
    sluice = await start_sluice({"routes": [openai_route(upstream)]})
    async with aiohttp.ClientSession() as http:
        async with http.post(sluice.url + "/openai/v1/chat/completions", json={
                "model": "gpt-test", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            r.close()
    [end] = await completed_events(sluice, 1)
    upstream.stream_hold.set()
    assert end["outcome"] == "client_disconnected"
    await sluice.wait_metric("sluice_inflight_requests", 0, route="openai")


# -- Ended by Sluice after the answer: its run's cancel, the drain --------------------------------

TOKEN = "s3cret-admin-token"


async def cancel_run(sluice: Any, run: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(
            f"{sluice.admin_url}/admin/runs/{run}/cancel",
            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()


async def read_to_the_end(response: aiohttp.ClientResponse) -> bytes:
    """The rest of ``response``; raises ``aiohttp.ClientPayloadError`` if it was cut."""
    return await asyncio.wait_for(response.content.read(), 20)


async def test_a_runs_cancel_after_an_openai_streams_done_ends_it_as_answered(upstream,
                                                                             start_sluice):
    """The upstream holds the stream open 30 s after ``[DONE]`` and the caller reads on to
    its end; the caller's run is cancelled after ``[DONE]`` went out. Before: the stream
    was cut (the caller's read failed) and the call counted ``run_cancelled``, though its
    caller had the whole answer."""
    upstream.done_linger = 30.0
    sluice = await start_sluice({"routes": [openai_route(upstream)]}, env={
        "SLUICE_ADMIN_TOKEN": TOKEN})
    async with aiohttp.ClientSession() as http, http.post(
            sluice.url + "/openai/v1/chat/completions", headers={"X-Run-ID": "job"},
            json={"model": "gpt-test", "stream": True,
                  "messages": [{"role": "user", "content": "hi"}]}) as r:
        await asyncio.wait_for(r.content.readuntil(b"data: [DONE]\n\n"), 10)
        await cancel_run(sluice, "job")
        assert await read_to_the_end(r) == b""  # ended, not cut
    [end] = await completed_events(sluice, 1)
    assert (end["outcome"], end["status"]) == ("2xx", 200)
    await wait_until(lambda: upstream.cancelled == 1, what="the upstream's stream closed")
    assert await sluice.metric("sluice_requests_total", route="openai",
                               outcome="run_cancelled") == 0
    await sluice.wait_metric("sluice_inflight_requests", 0, route="openai")


@pytest.mark.parametrize("idempotency", ["forward", "dedup"])
async def test_a_runs_cancel_after_an_mcp_calls_response_ends_its_stream_as_answered(
        holding, start_sluice, idempotency):
    """An MCP call's response went out and the upstream holds its stream open; the run's
    cancel ends the stream there. Before: the connection was cut and the call counted
    ``run_cancelled``."""
    sluice = await start_sluice({"routes": [mcp_route(holding.url,
                                                      idempotency={"mode": idempotency})]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    async with aiohttp.ClientSession() as http, http.post(
            sluice.url + "/tools/mcp", json=CALL,
            headers={**HEADERS, "X-Run-ID": "job", "Idempotency-Key": "k-1"}) as r:
        event = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        assert b'"id": 1' in event and b"done #1" in event
        await cancel_run(sluice, "job")
        assert await read_to_the_end(r) == b""
    [completed] = await the_calls_ended(sluice, holding, 1)
    assert (completed["outcome"], completed["status"]) == ("2xx", 200)
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="run_cancelled") == 0
    await assert_all_given_back(sluice)


@pytest.mark.parametrize("idempotency", ["forward", "dedup"])
async def test_the_drain_ends_an_mcp_calls_answered_stream_as_answered(holding, start_sluice,
                                                                       idempotency):
    """SIGTERM while the upstream holds an answered call's stream open: the drain ends the
    stream as the upstream would have, at once, and the call is ``2xx``. Before: the drain
    waited for it to its timeout (here 60 s), then cut it, ``drain_cut``."""
    sluice = await start_sluice({"server": {"drain_timeout": "60s"},
                                 "routes": [mcp_route(holding.url,
                                                      idempotency={"mode": idempotency})]})
    async with aiohttp.ClientSession() as http, http.post(
            sluice.url + "/tools/mcp", json=CALL, headers=HEADERS) as r:
        await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        sluice.signal(signal.SIGTERM)
        assert await read_to_the_end(r) == b""
        assert await sluice.wait_exit(timeout=20) == 0  # well before drain_timeout
    [completed] = [e for e in sluice.events() if e["event"] == "completed"]
    assert (completed["outcome"], completed["status"]) == ("2xx", 200)
    assert "ending 1 stream(s) whose answer has gone out" in sluice.stderr()


async def test_the_drain_ends_an_openai_stream_held_open_after_done(upstream, start_sluice):
    """Past ``[DONE]``, the upstream holding the stream open (here 60 s): SIGTERM ends the
    stream at once, as the upstream would have, and the call is ``2xx``. Before (a new
    user's trial): the drain waited for it to its timeout, then cut it (the caller's read
    failed), ``drain_cut``."""
    upstream.done_linger = 60.0
    sluice = await start_sluice({"server": {"drain_timeout": "60s"},
                                 "routes": [openai_route(upstream)]})
    async with aiohttp.ClientSession() as http, http.post(
            sluice.url + "/openai/v1/chat/completions",
            json={"model": "gpt-test", "stream": True,
                  "messages": [{"role": "user", "content": "hi"}]}) as r:
        await asyncio.wait_for(r.content.readuntil(b"data: [DONE]\n\n"), 10)
        sluice.signal(signal.SIGTERM)
        assert await read_to_the_end(r) == b""  # ended, not cut
        assert await sluice.wait_exit(timeout=20) == 0  # well before drain_timeout
    [completed] = [e for e in sluice.events() if e["event"] == "completed"]
    assert (completed["outcome"], completed["status"]) == ("2xx", 200)
    await wait_until(lambda: upstream.cancelled == 1, what="the upstream's stream closed")
