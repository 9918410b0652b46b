"""Every way a request can end gives its concurrency slot back.

Each route has ``limit: 1, queue: 0``: had a failure leaked its slot, the next request would be
answered 503 ``queue_full`` at once instead of being served. After each failure the test waits
for ``sluice_inflight_requests`` to read 0 and then sends a request that must succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web

import policies.mcp
import policies.usage
import proxy.forward
import proxy.handler
from policies.state.admission import MemoryAdmissions
from proxy.config import parse_config
from proxy.runtime import Runtime
from tests.conftest import (
    free_port,
    leave_mid_body,
    leave_the_queue,
    route,
    serve_app,
    serve_runtime,
    wait_until,
)

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}
ONE_SLOT = {"limit": 1, "queue": 0}


def one_slot_route(upstream_url: str, name: str = "openai", **extra) -> dict:
    return route(name, upstream_url, "openai", concurrency=ONE_SLOT, **extra)


async def post(session: aiohttp.ClientSession, url: str, payload: dict = CHAT,
               **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with session.post(url, json=payload, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def assert_slot_free(sluice, session, upstream, name: str = "openai") -> None:
    """In-flight is back to 0 and the one slot serves the next request."""
    await sluice.wait_metric("sluice_inflight_requests", 0, route=name)
    assert await sluice.metric("sluice_queue_depth", route=name) == 0
    upstream.hold = None
    upstream.stream_hold = None
    status, _, _ = await post(session, f"{sluice.url}/{name}/v1/chat/completions")
    assert status == 200


async def test_upstream_error_status(upstream, start_sluice):
    sluice = await start_sluice({"routes": [one_slot_route(upstream.url)]})
    upstream.statuses = [500, 503]
    async with aiohttp.ClientSession() as session:
        for expected in (500, 503):
            status, headers, body = await post(session, sluice.url + "/openai/v1/chat/completions")
            assert status == expected
            assert "X-Sluice-Reason" not in headers  # the upstream's own answer, passed on
            assert b"fake upstream status" in body
        await assert_slot_free(sluice, session, upstream)
    assert await sluice.metric("sluice_requests_total", route="openai", outcome="5xx") == 2


async def test_upstream_connect_refused(upstream, start_sluice):
    closed = f"http://127.0.0.1:{free_port()}"  # bound then released: nothing listens
    sluice = await start_sluice({"routes": [one_slot_route(closed, "dead"),
                                            one_slot_route(upstream.url)]})
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # the second would be queue_full had the first leaked its slot
            status, headers, _ = await post(session, sluice.url + "/dead/v1/chat/completions")
            assert status == 502
            assert headers["X-Sluice-Reason"] == "upstream_unreachable"
        await sluice.wait_metric("sluice_inflight_requests", 0, route="dead")
        assert await sluice.metric("sluice_requests_total", route="dead",
                                   outcome="upstream_error") == 2
        await assert_slot_free(sluice, session, upstream)


async def test_upstream_timeout_before_headers_and_mid_stream(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        one_slot_route(upstream.url, timeouts={"connect": "1s", "total": "500ms"})]})
    url = sluice.url + "/openai/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        upstream.hold = asyncio.Event()  # stalled before the response headers
        status, headers, _ = await post(session, url)
        assert status == 504
        assert headers["X-Sluice-Reason"] == "upstream_timeout"
        await wait_until(lambda: upstream.cancelled == 1, what="the upstream request closed")
        await assert_slot_free(sluice, session, upstream)

        upstream.stream_hold = asyncio.Event()  # stalled after the first event
        async with session.post(url, json=STREAM) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()  # cut, not ended cleanly
        await wait_until(lambda: upstream.cancelled == 2, what="the stalled stream closed")
        await assert_slot_free(sluice, session, upstream)
    assert await sluice.metric("sluice_requests_total", route="openai",
                               outcome="upstream_timeout") == 2


async def test_client_disconnect_while_waiting_for_the_upstream(upstream, start_sluice):
    sluice = await start_sluice({"routes": [one_slot_route(upstream.url)]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(post(session, sluice.url + "/openai/v1/chat/completions"))
        await wait_until(lambda: upstream.inflight == 1, what="the request at the upstream")
        call.cancel()  # aiohttp closes the connection of a cancelled request
        with contextlib.suppress(asyncio.CancelledError):
            await call
        # The disconnect cancels the upstream request too: its handler sees the cancellation.
        await wait_until(lambda: upstream.cancelled == 1, what="the upstream request cancelled")
        await assert_slot_free(sluice, session, upstream)
    assert await sluice.metric("sluice_requests_total", route="openai",
                               outcome="client_disconnected") == 1


async def test_client_disconnect_mid_stream(upstream, start_sluice):
    sluice = await start_sluice({"routes": [one_slot_route(upstream.url)]})
    upstream.stream_hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        r = await session.post(sluice.url + "/openai/v1/chat/completions", json=STREAM)
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        assert b"tok0" in first
        r.close()  # drop the connection mid-stream
        await wait_until(lambda: upstream.cancelled == 1, what="the upstream stream cancelled")
        assert upstream.completed == 0
        await assert_slot_free(sluice, session, upstream)
    await sluice.wait_metric("sluice_requests_total", 1, route="openai",
                             outcome="client_disconnected")


async def test_client_disconnect_while_queued(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, "openai", concurrency={"limit": 1, "queue": 1,
                                                       "max_wait": "60s"})]})
    upstream.hold = asyncio.Event()
    url = sluice.url + "/openai/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, url))
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        await leave_the_queue(sluice, post(session, url), "openai")
        upstream.hold.set()
        assert (await first)[0] == 200
        await assert_slot_free(sluice, session, upstream)
    assert len(upstream.requests) == 2  # the queued caller that left never reached it


async def test_a_caller_leaving_mid_body_is_counted_and_logged(upstream, start_sluice):
    """An upload abandoned half way left no event and no count: nginx logs it (499)."""
    sluice = await start_sluice({"routes": [one_slot_route(upstream.url)]})
    await leave_mid_body(sluice, "/openai/v1/chat/completions", b"X-Tenant-ID: uploader\r\n")
    await sluice.wait_metric("sluice_requests_total", 1, route="openai",
                             outcome="client_disconnected")
    await wait_until(lambda: any(e["event"] == "completed" for e in sluice.events()),
                     what="the completed event")
    [event] = [e for e in sluice.events() if e["event"] == "completed"]
    assert (event["tenant"], event["status"], event["outcome"], event["body_incomplete"]) == (
        "uploader", 0, "client_disconnected", True)
    assert await sluice.metric("sluice_buffered_request_bytes") == 0
    async with aiohttp.ClientSession() as session:
        await assert_slot_free(sluice, session, upstream)
    assert len(upstream.requests) == 1


async def openai_runtime(upstream_url: str, policies: str = "") -> Runtime:
    """An open in-process runtime whose ``openai`` route ``/openai/`` fronts
    ``upstream_url`` with ``policies`` (flow-mapping entries)."""
    runtime = Runtime(parse_config(
        "routes:\n"
        f"  - {{name: openai, path_prefix: /openai/, upstream: '{upstream_url}',\n"
        f"      protocol: openai{', ' + policies if policies else ''}}}\n"))
    await runtime.open()
    return runtime


async def test_proxy_error(upstream, monkeypatch, caplog):
    """A bug in Sluice itself cannot be provoked from outside, so this runs the proxy app
    in-process and makes forwarding raise once."""
    runtime = await openai_runtime(upstream.url, "concurrency: {limit: 1, queue: 0}")
    real_send = proxy.forward.send
    failures = []

    async def broken_send(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected proxy bug")
        return await real_send(*args, **kwargs)

    monkeypatch.setattr(proxy.forward, "send", broken_send)
    runner, port = await serve_runtime(runtime)
    url = f"http://127.0.0.1:{port}/openai/v1/chat/completions"
    try:
        with caplog.at_level(logging.ERROR, logger="sluice"):
            async with aiohttp.ClientSession() as session:
                status, headers, body = await post(session, url,
                                                   Authorization="Bearer sk-never-logged")
                assert status == 502
                assert headers["X-Sluice-Reason"] == "upstream_unreachable"
                assert b'"code":"upstream_unreachable"' in body
                [openai_route] = runtime.routes
                assert openai_route.inflight == 0
                assert openai_route.concurrency.inflight == 0
                assert runtime.metrics.registry.get_sample_value(
                    "sluice_inflight_requests", {"route": "openai"}) == 0
                assert (await post(session, url))[0] == 200
        assert "injected proxy bug" in caplog.text
        assert "sk-never-logged" not in caplog.text
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_proxy_error_in_admission_is_an_internal_error_not_the_upstreams(
        upstream, monkeypatch, caplog):
    """A fault raised while admitting (a state call's bug: the budget's admission here, as
    a Redis reply it could not read raised, after the concurrency slot was taken) was
    answered 502 upstream_unreachable, "the upstream gave no answer", and operators chased
    a healthy upstream that was never asked (a hostile trial). It is 500 internal_error in
    the route's error shape, counted as a refusal, and everything taken is given back."""
    runtime = await openai_runtime(
        upstream.url, "concurrency: {limit: 1, queue: 0}, budget: {tokens: 100000/day},"
        " usage: {default_max_tokens: 40}")
    real_admit = MemoryAdmissions.admit
    failures = []

    async def broken_admit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(1)
            raise ValueError("injected state bug")
        return await real_admit(self, *args, **kwargs)

    monkeypatch.setattr(MemoryAdmissions, "admit", broken_admit)
    runner, port = await serve_runtime(runtime)
    url = f"http://127.0.0.1:{port}/openai/v1/chat/completions"
    try:
        with caplog.at_level(logging.ERROR, logger="sluice"):
            async with aiohttp.ClientSession() as session:
                status, headers, body = await post(session, url)
                assert failures and status == 500, (status, body)
                assert headers["X-Sluice-Reason"] == "internal_error"
                assert orjson.loads(body)["error"]["code"] == "internal_error"
                assert upstream.requests == []
                [openai_route] = runtime.routes
                assert (openai_route.inflight, openai_route.concurrency.inflight) == (0, 0)
                assert openai_route.accounting.budgets.reserved(
                    "tokens", "tenant", "default") == 0
                sample = runtime.metrics.registry.get_sample_value
                assert sample("sluice_rejections_total",
                              {"route": "openai", "reason": "internal_error"}) == 1
                assert sample("sluice_requests_total",
                              {"route": "openai", "outcome": "upstream_error"}) == 0
                assert (await post(session, url))[0] == 200
        assert "injected state bug" in caplog.text
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_proxy_error_mid_stream_cuts_the_answer(upstream, monkeypatch):
    """Seen in a hostile trial: a fault of Sluice's own once the upstream's status line had
    gone to the caller (here the usage meter failing on a chunk) made the handler answer
    502 as well, and aiohttp wrote that second status line inside the stream's chunked body
    ("Invalid character in chunk size: b'HTTP/1.1 502 Bad Gateway'"). The answer is cut
    instead, and the slot is free."""
    runtime = await openai_runtime(upstream.url, "concurrency: {limit: 1, queue: 0}")

    def broken_chunk(self, data):
        raise RuntimeError("injected meter bug")

    runner, port = await serve_runtime(runtime)
    url = f"http://127.0.0.1:{port}/openai/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            with monkeypatch.context() as patched:
                patched.setattr(policies.usage.Meter, "chunk", broken_chunk)
                async with session.post(url, json=STREAM) as r:
                    assert r.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError) as cut:
                        await r.read()
            assert "HTTP/1.1" not in str(cut.value)
            [openai_route] = runtime.routes
            await wait_until(lambda: openai_route.present == 0, what="the call to end")
            assert (openai_route.inflight, openai_route.concurrency.inflight) == (0, 0)
            assert (await post(session, url, STREAM))[0] == 200
    finally:
        await runner.cleanup()
        await runtime.close()


async def tools_behind(tool: Callable[[web.Request], Awaitable[web.StreamResponse]],
                       policies: str) -> tuple[web.AppRunner, Runtime]:
    """An MCP server of one handler (``POST /mcp``), and an open runtime whose ``mcp`` route
    ``/tools/`` fronts it with ``policies`` (flow-mapping entries): the server's runner and
    the runtime, both to clean up."""
    app = web.Application()
    app.router.add_post("/mcp", tool)
    tools, port = await serve_app(app)
    runtime = Runtime(parse_config(
        "routes:\n"
        f"  - {{name: tools, path_prefix: /tools/, upstream: 'http://127.0.0.1:{port}',\n"
        f"      protocol: mcp, {policies}}}\n"))
    await runtime.open()
    return tools, runtime


async def test_a_proxy_error_mid_mcp_answer_ends_it_with_an_error(monkeypatch):
    """Seen in a hostile trial: the same fault in an MCP call kept for its key (forwarded in
    a task of its own) sent nothing more after the SSE answer's headers, and left the
    connection open: the caller waited for an answer that would never come (the Python MCP
    client has no timeout by default). The answer now ends with the call's JSON-RPC error."""
    async def tool(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        result = {"jsonrpc": "2.0", "id": message["id"], "result": {"content": []}}
        await out.write(b"event: message\ndata: " + orjson.dumps(result) + b"\n\n")
        await out.write_eof()
        return out

    tools, runtime = await tools_behind(tool, "idempotency: {mode: dedup}, "
                                              "concurrency: {limit: 1, queue: 0}")

    def broken_feed(self, chunk):
        raise RuntimeError("injected tracker bug")

    runner, port = await serve_runtime(runtime)
    url = f"http://127.0.0.1:{port}/tools/mcp"
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "deliver", "arguments": {"to": "ops"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    try:
        async with aiohttp.ClientSession() as session:
            with monkeypatch.context() as patched:
                patched.setattr(policies.mcp.AnswerTracker, "feed", broken_feed)
                async with session.post(url, json=call, headers=accept) as r:
                    async with asyncio.timeout(10):  # it waited for ever
                        body = await r.read()
            [_, data] = body.decode().strip().split("\n")
            answer = orjson.loads(data.removeprefix("data: "))
            assert answer["id"] == 7
            assert answer["error"]["data"]["reason"] == "upstream_unreachable"
            [tools_route] = runtime.routes
            await wait_until(lambda: tools_route.present == 0, what="the call to end")
            assert (tools_route.inflight, tools_route.concurrency.inflight) == (0, 0)
            assert not tools_route.idempotency._flights
            async with session.post(url, json={**call, "id": 8}, headers=accept) as r:
                assert r.status == 200 and b'"id":8' in await r.read()
    finally:
        await runner.cleanup()
        await runtime.close()
        await tools.cleanup()


async def test_a_fault_counting_a_calls_end_leaves_its_answer_whole(upstream, monkeypatch,
                                                                     caplog):
    """Found by tests/test_faults_anywhere.py: a fault in the counting and logging after
    everything was given back (here the ``completed`` event) escaped the handler's
    ``finally`` and replaced the answer: the upstream's 200, work done and charged, became
    500 ``internal_error``, and a stream's connection was cut without a word. The answer is
    now sent as it came, and the fault logged."""
    runtime = await openai_runtime(upstream.url, "concurrency: {limit: 1, queue: 0}")

    def broken_completed(*args, **kwargs):
        raise RuntimeError("injected bookkeeping bug")

    runner, port = await serve_runtime(runtime)
    url = f"http://127.0.0.1:{port}/openai/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            with monkeypatch.context() as patched, \
                    caplog.at_level(logging.ERROR, logger="sluice"):
                patched.setattr(proxy.handler, "_completed", broken_completed)
                status, _, body = await post(session, url)
                assert (status, orjson.loads(body)["object"]) == (200, "chat.completion")
                status, _, body = await post(session, url, STREAM)
                assert status == 200 and body.endswith(b"data: [DONE]\n\n")
            assert "injected bookkeeping bug" in caplog.text
            [openai_route] = runtime.routes
            assert (openai_route.inflight, openai_route.concurrency.inflight) == (0, 0)
            assert (await post(session, url))[0] == 200
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_an_error_escaping_after_the_answer_began_is_logged(upstream, monkeypatch,
                                                                   caplog):
    """The edge cuts the connection of an answer an error interrupts (no second answer can
    follow the first's bytes): it said nothing of that error, a fault of Sluice's own."""
    runtime = await openai_runtime(upstream.url)

    def broken_settle(*args, **kwargs):
        raise RuntimeError("injected settle bug")

    monkeypatch.setattr(proxy.handler, "_settle", broken_settle)
    runner, port = await serve_runtime(runtime)
    try:
        async with aiohttp.ClientSession() as session:
            with caplog.at_level(logging.ERROR, logger="sluice"):
                async with session.post(f"http://127.0.0.1:{port}/openai/v1/chat/completions",
                                        json=STREAM) as r:
                    with contextlib.suppress(aiohttp.ClientPayloadError):
                        await r.read()
                await wait_until(lambda: "injected settle bug" in caplog.text,
                                 what="the error in the log")
        assert "error after an answer was begun" in caplog.text
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_caller_gone_as_its_answer_ends_is_no_error_in_the_log(monkeypatch, caplog):
    """Seen in a hostile trial: the MCP SDKs close their connection as soon as they have read
    the response, and when that close lands as the upstream's answer ends, the last write of
    the relay (its final chunk) meets a closing transport before aiohttp has cancelled the
    handler: ``ClientConnectionResetError``. The handler ends the call (``2xx``: its
    response had been sent, see tests/test_answered_callers.py) and re-raises it, and the
    edge logged it as a fault of Sluice's own, at ERROR with a
    traceback (12 of 40 ordinary 2.x-client sessions against a session-mode server: their
    GET streams; 1 in 11 calls of the 1.x client). The race is forced here: the relayed
    answer's end finds the caller's connection closing."""
    async def tool(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        result = {"jsonrpc": "2.0", "id": message["id"], "result": {"content": []}}
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)  # streamed (chunked), as the official servers answer
        await out.write(b"event: message\ndata: " + orjson.dumps(result) + b"\n\n")
        await out.write_eof()
        return out

    tools, runtime = await tools_behind(tool, "concurrency: {limit: 1, queue: 0}")
    runner, port = await serve_runtime(runtime)
    real_write_eof = web.StreamResponse.write_eof

    async def closing_write_eof(self, data=b""):
        # Only the relayed answer: the end of a response on Sluice's own port.
        transport = self._req.transport if self._req is not None else None
        if transport is not None and transport.get_extra_info("sockname")[1] == port:
            transport.close()
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await real_write_eof(self, data)

    url = f"http://127.0.0.1:{port}/tools/mcp"
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "deliver", "arguments": {"to": "ops"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    [tools_route] = runtime.routes
    try:
        async with aiohttp.ClientSession() as session:
            with monkeypatch.context() as patched, \
                    caplog.at_level(logging.WARNING, logger="sluice"):
                patched.setattr(web.StreamResponse, "write_eof", closing_write_eof)
                for _ in range(2):  # a leaked slot would refuse the second
                    async with session.post(url, json=call, headers=accept) as r:
                        assert r.status == 200
                        with contextlib.suppress(aiohttp.ClientPayloadError):
                            await r.read()
                    await wait_until(lambda: tools_route.present == 0, what="the call to end")
                    assert (tools_route.inflight, tools_route.concurrency.inflight) == (0, 0)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
            assert runtime.metrics.registry.get_sample_value(
                "sluice_requests_total", {"route": "tools", "outcome": "2xx"}) == 2
    finally:
        await runner.cleanup()
        await runtime.close()
        await tools.cleanup()


async def test_a_run_cancel_of_an_mcp_answer_its_caller_cannot_take_frees_the_slot():
    """A run's cancel ends an MCP call's SSE answer with a last event (``run_cancelled``),
    written after the relay and its deadline guard have ended. Written to a caller whose
    connection took no more (its buffers full: writing paused), that event waited for as
    long as the caller kept its connection, holding the call's slot, and the cancel waited
    in vain for the call to end. A caller that cannot take the last event is cut."""
    started, release = asyncio.Event(), asyncio.Event()

    async def tool(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        progress = {"jsonrpc": "2.0", "method": "notifications/progress",
                    "params": {"progressToken": message["id"], "progress": 0.1}}
        await out.write(b"event: message\ndata: " + orjson.dumps(progress) + b"\n\n")
        started.set()
        await release.wait()  # working: the response comes much later
        return out

    tools, runtime = await tools_behind(tool, "concurrency: {limit: 1, queue: 0}")
    runner, port = await serve_runtime(runtime)
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                             "params": {"name": "work", "arguments": {}}})
        writer.write(b"POST /tools/mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Tenant-ID: acme\r\n"
                     b"X-Run-ID: job\r\nContent-Type: application/json\r\n"
                     b"Accept: application/json, text/event-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.wait_for(started.wait(), 10)
        await reader.readuntil(b"\n\n")  # the progress event: between events now
        # The caller reads no more, and its buffers are full: its connection takes nothing.
        assert runner.server is not None
        [caller] = runner.server.connections
        caller.pause_writing()
        [tools_route] = runtime.routes
        _, calls = runtime.runs.cancel("job", 60, "acme")
        assert len(calls) == 1
        await wait_until(lambda: tools_route.inflight == 0, timeout=10,
                         what="the cancelled call to end")
        assert tools_route.concurrency.inflight == 0
    finally:
        release.set()
        if writer is not None:
            writer.close()
        await runner.cleanup()
        await runtime.close()
        await tools.cleanup()
