"""MCP traffic through Sluice, end to end: the official ``mcp`` SDK on both sides (issue 11).

A real server (``tests/mcp_servers.py``: the SDK's ``MCPServer`` over streamable HTTP, in its
own process, stateless or session mode) sits behind a real Sluice process (``start_sluice``);
the clients are the SDK's 2.x ``Client`` in this process (``mode="legacy"``: the 2025-11-25
handshake, the GET stream and DELETE of session mode) and, where ``.venv-mcp1`` exists, the
1.x client in a child process. Every test is one observation of the issue's "Why" that failed
before: control traffic throttled, the GET stream holding a slot and cut at ``timeouts.total``,
a side-effecting tool executed once per retry, ``derive_from`` keys refused on every call,
dedup lost when the client closes right after the result, a refusal ending a 1.x session.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from mcp import Client, MCPError

from tests import mcp_servers
from tests.conftest import REPO, serve_app, wait_until
from tests.mcp_servers import McpServer
from tests.test_reload import rewrite

# The server fixtures, for this module's tests.
mcp_session = mcp_servers.mcp_session
mcp_stateless = mcp_servers.mcp_stateless
mcp_server_factory = mcp_servers.mcp_server_factory

MCP1_PYTHON = REPO / ".venv-mcp1" / "bin" / "python"


def mcp_route(server: McpServer, **policies: Any) -> dict:
    """A ``protocol: mcp`` route ``/tools/`` in front of ``server``."""
    return {"name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
            "protocol": "mcp", **policies}


def endpoint(sluice: Any) -> str:
    return sluice.url + "/tools/mcp"


def text(result: Any) -> str:
    return result.content[0].text


# -- control traffic is never throttled ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["stateless", "session"])
async def test_tools_list_after_a_call_is_not_rate_limited(mcp_server_factory, start_sluice,
                                                           mode):
    """Before: the SDK's own tools/list after the first result took the route's last rate unit,
    and the call that had already run raised 429."""
    server = mcp_server_factory(mode)
    sluice = await start_sluice({"routes": [mcp_route(server, rate={"requests": "1/min"})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        result = await client.call_tool("add", {"a": 2, "b": 3})
        assert text(result) == "5" and not result.is_error
        with pytest.raises(MCPError) as refused:  # the second call is over the rate: that one
            await client.call_tool("add", {"a": 1, "b": 1})
        assert refused.value.error.code == 429
        assert refused.value.error.data["reason"] == "rate_limited"
        assert refused.value.error.data["retryAfterMs"] > 0
        tools = await client.list_tools()  # control traffic still flows; the session lives
        assert {"add", "slow", "send"} <= {t.name for t in tools.tools}
    assert await sluice.metric("sluice_rejections_total", route="tools",
                               reason="rate_limited") == 1


async def test_each_events_names_its_json_rpc_method(mcp_session, start_sluice):
    """A session's events name what each POST was (``mcp_method``), the control traffic
    included: before, only a call's tool (``operation``) told them apart, and the events of
    ``initialize``, ``tools/list`` and the notifications looked alike."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session,
                                                      rate={"requests": "1/min"})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        assert text(await client.call_tool("add", {"a": 2, "b": 3})) == "5"
        with pytest.raises(MCPError):  # over the route's rate
            await client.call_tool("add", {"a": 1, "b": 1})
        await client.list_tools()
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")

    def methods(kind: str) -> list[str | None]:
        return [e.get("mcp_method") for e in sluice.events() if e["event"] == kind]

    # (The client lists the tools after its first result too: that tools/list may come
    # before the refusal.)
    await wait_until(lambda: "tools/list" in methods("completed") and methods("rejected"),
                     what="the events flushed")
    admitted = methods("admitted")
    for method in ("initialize", "notifications/initialized", "tools/call", "tools/list"):
        assert method in admitted, admitted
        assert method in methods("completed")
    assert None in admitted  # the GET stream and the DELETE: no JSON-RPC message
    [refused] = [e for e in sluice.events() if e["event"] == "rejected"]
    assert (refused["mcp_method"], refused["operation"], refused["reason"]) == (
        "tools/call", "add", "rate_limited")
    [called] = [e for e in sluice.events()
                if e["event"] == "completed" and e.get("mcp_method") == "tools/call"]
    assert called["operation"] == "add" and called["outcome"] == "2xx"


async def test_get_stream_holds_no_slot_and_delete_ends_the_session(mcp_session, start_sluice):
    """Before: at ``limit: 1`` the session's GET stream held the slot for the whole session, so
    every call and the closing DELETE got 503 and the server's session was never ended."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_session, concurrency={"limit": 1, "queue": 0})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        await wait_until(lambda: _stream_open(sluice), what="the GET stream is open")
        assert text(await client.call_tool("add", {"a": 20, "b": 22})) == "42"
        assert text(await client.call_tool("slow", {"seconds": 0.2})) == "slept"
    # The DELETE reached the server, which ended the session.
    server_log = mcp_session.count_file.with_suffix(".stderr")
    await wait_until(lambda: "Terminating session" in server_log.read_text(),
                     what="the server ended the session")
    assert await sluice.metric("sluice_rejections_total", route="tools",
                               reason="queue_full") == 0
    await asyncio.sleep(0.3)  # the event log is flushed every 0.2 s
    completed = [e for e in sluice.events() if e["event"] == "completed"]
    # initialize, initialized, the GET stream, 2 calls, tools/list, DELETE: all answered 2xx.
    assert all(200 <= e["status"] < 300 for e in completed), completed


async def test_get_stream_is_counted_apart_from_the_calls_in_flight(mcp_session, start_sluice,
                                                                     tmp_path):
    """``sluice_inflight_requests`` counts the session's GET stream, which holds no slot; a
    dashboard of it against ``concurrency.limit`` showed 2 on a limit of 1 (a new user's
    trial). ``sluice_open_streams`` counts the streams, so calls in flight are the
    difference."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_session, concurrency={"limit": 1, "queue": 0})]})
    gate = tmp_path / "gate"
    async with Client(endpoint(sluice), mode="legacy") as client:
        await sluice.wait_metric("sluice_open_streams", 1, route="tools")
        call = asyncio.create_task(client.call_tool("gated", {"path": str(gate)},
                                                    read_timeout_seconds=30))
        await sluice.wait_metric("sluice_inflight_requests", 2, route="tools")
        assert await sluice.metric("sluice_open_streams", route="tools") == 1
        async with aiohttp.ClientSession() as http, \
                http.get(sluice.admin_url + "/admin/routes") as r:
            [tools] = (await r.json())["routes"]
        assert (tools["inflight"], tools["open_streams"],
                tools["concurrency"]["inflight"]) == (2, 1, 1)
        gate.touch()
        assert not (await call).is_error
        await sluice.wait_metric("sluice_inflight_requests", 1, route="tools")
        assert await sluice.metric("sluice_open_streams", route="tools") == 1
    await sluice.wait_metric("sluice_open_streams", 0, route="tools")
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")


async def test_open_streams_gauge_across_reloads_and_the_routes_removal(start_sluice):
    """From a review of the gauge: it follows streams admitted before a reload (the route
    object replaced), keeps counting a removed route's streams under its name until they
    close (as ``sluice_inflight_requests`` does), counts them with a route re-added while they
    are open, and is back at 0 when they close."""
    held, opened = asyncio.Event(), []

    async def get(request: web.Request) -> web.StreamResponse:
        opened.append(1)
        try:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b": open\n\n")
            await held.wait()
            await out.write_eof()
            return out
        finally:
            opened.pop()

    app = web.Application()
    app.router.add_get("/mcp", get)
    runner, port = await serve_app(app, handler_cancellation=True)

    def tools(name: str = "tools", limit: int = 1) -> dict:
        return {"name": name, "path_prefix": f"/{name}/", "upstream": f"http://127.0.0.1:{port}",
                "protocol": "mcp", "concurrency": {"limit": limit}}

    async def reloaded(count: int) -> None:
        await wait_until(lambda: sluice.stderr().count("config reloaded") >= count,
                         what=f"reload {count}")

    try:
        sluice = await start_sluice({"routes": [tools()]})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as http:
            async def stream(**headers: str) -> aiohttp.ClientResponse:
                r = await http.get(url, headers={"Accept": "text/event-stream",
                                                 "Mcp-Session-Id": "s-1", **headers})
                await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                return r

            first, resumed = await stream(), await stream(**{"Last-Event-ID": "3"})
            await sluice.wait_metric("sluice_open_streams", 2, route="tools")
            assert await sluice.metric("sluice_inflight_requests", route="tools") == 2
            rewrite(sluice.config_path, lambda d: d["routes"].__setitem__(0, tools(limit=3)))
            await reloaded(1)
            third = await stream()
            await sluice.wait_metric("sluice_open_streams", 3, route="tools")
            first.close()
            await sluice.wait_metric("sluice_open_streams", 2, route="tools")
            rewrite(sluice.config_path, lambda d: d["routes"].__setitem__(0, tools("other")))
            await reloaded(2)
            assert await sluice.metric("sluice_open_streams", route="tools") == 2
            rewrite(sluice.config_path, lambda d: d["routes"].append(tools()))
            await reloaded(3)
            gauge = await sluice.metric("sluice_open_streams", route="tools")
            inflight = await sluice.metric("sluice_inflight_requests", route="tools")
            assert gauge == inflight == 2  # the removed route's, the re-added one has none
            resumed.close()
            third.close()
            await wait_until(lambda: not opened, what="the upstream's streams closed")
        await sluice.wait_metric("sluice_open_streams", 0, route="tools")
        await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
    finally:
        held.set()
        await runner.cleanup()


def _stream_open(sluice: Any) -> bool:
    return any(e["event"] == "admitted" for e in sluice.events())


def _is_list_changed(message: Any) -> bool:
    root = getattr(message, "root", message)
    return getattr(root, "method", None) == "notifications/tools/list_changed"


async def test_get_stream_outlives_the_total_timeout_and_delivers(mcp_session, start_sluice):
    """Before: the GET stream was cut at ``timeouts.total``; the SDK gave up reconnecting and
    the server's notifications were lost."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session, timeouts={"total": "1s"})]})
    seen: list[Any] = []

    async def on_message(message: Any) -> None:
        seen.append(message)

    async with Client(endpoint(sluice), mode="legacy", message_handler=on_message) as client:
        await wait_until(lambda: _stream_open(sluice), what="the GET stream is open")
        await asyncio.sleep(3.0)  # three times timeouts.total
        assert text(await client.call_tool("notify", {})) == "notified"
        await wait_until(lambda: any(map(_is_list_changed, seen)),
                         what="the notification on the GET stream")
    await asyncio.sleep(0.3)
    outcomes = [e["outcome"] for e in sluice.events() if e["event"] == "completed"]
    assert "upstream_timeout" not in outcomes


async def test_get_stream_has_an_idle_timeout_and_passes_last_event_id(upstream, start_sluice):
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": upstream.url, "protocol": "mcp",
        "timeouts": {"total": "300ms", "idle": "1s"}, "concurrency": {"limit": 1}}]})
    upstream.hold = asyncio.Event()  # the upstream sends nothing
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        started = loop.time()
        async with http.get(endpoint(sluice), headers={
                "Accept": "text/event-stream", "Last-Event-ID": "stream-1_17"}) as r:
            status, reason = r.status, r.headers["X-Sluice-Reason"]
        waited = loop.time() - started
    assert (status, reason) == (504, "upstream_timeout")
    assert 1.0 <= waited < 3.0  # cut after timeouts.idle of silence, not timeouts.total
    assert upstream.requests[0].method == "GET"
    assert upstream.requests[0].headers["Last-Event-ID"] == "stream-1_17"


async def test_a_drain_waits_for_calls_not_for_idle_get_streams(mcp_session, start_sluice):
    """Seen in a hostile trial: a session's GET stream stays open, silent, for the whole
    session, and the drain waited for it as for a call: with any 2025-era client connected
    (Python 1.x, 2.x ``legacy``, both TypeScript SDKs), every SIGTERM waited the whole
    ``drain_timeout`` with nothing running (6.2 s of a 6 s drain_timeout for three idle
    sessions, 0.0 s with none), then logged a WARNING "cutting 3 request(s) still in flight".
    The drain now waits for calls only; the streams are ended once those are done (the
    clients reconnect them, elsewhere)."""
    sluice = await start_sluice({"server": {"drain_timeout": "120s"},
                                 "routes": [mcp_route(mcp_session)]})
    url = endpoint(sluice)
    call = mcp_servers.tool_call(5, "slow", seconds=1.0)
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)
        async with http.get(url, headers={**headers, "Accept": "text/event-stream"}) as stream:
            assert stream.status == 200

            async def post_call() -> str:
                async with http.post(url, json=call, headers=headers) as r:
                    return await r.text()

            answer = asyncio.create_task(post_call())
            await wait_until(lambda: _admitted(sluice) >= 1, what="the call")
            sluice.signal(signal.SIGTERM)
            assert '"slept"' in await answer  # the call in flight is served to its end
            # Before: the drain waited out its 120 s for the stream.
            assert await sluice.wait_exit(timeout=60) == 0
    assert "drain timeout" not in sluice.stderr()
    assert "drained" in sluice.stderr()


@pytest.mark.parametrize("json_response", [False, True])
async def test_a_call_the_drain_cuts_gets_its_json_rpc_error(mcp_server_factory, start_sluice,
                                                             json_response):
    """Seen in a hostile trial: a call still running when the drain ended was cut (its
    connection closed without a word). The Python ``mcp`` 1.x client fails no call on a cut
    POST stream, so the call waited for ever (no timeout by default); the TypeScript 2025
    clients waited for their request timeout (60 s by default); the Python 2.x client in
    ``auto`` mode, cut before the status line, lost its whole session (an ExceptionGroup
    out of ``Client``). As after a run's cancel or a timeout, the call's answer now ends with
    its JSON-RPC error (reason ``draining``): an SSE answer as one last event, one not begun
    as HTTP 200 and the error. Its outcome is still ``drain_cut``."""
    server = mcp_server_factory("session", json_response=json_response)
    sluice = await start_sluice({"server": {"drain_timeout": "1s"},
                                 "routes": [mcp_route(server)]})
    url = endpoint(sluice)
    call = mcp_servers.tool_call(9, "slow", seconds=20)
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)

        begun = asyncio.Event()

        async def post_call() -> tuple[int, str, bytes]:
            async with http.post(url, json=call, headers=headers) as r:
                begun.set()
                return r.status, r.headers["Content-Type"], await r.read()  # before: cut

        answer = asyncio.create_task(post_call())
        await wait_until(lambda: _admitted(sluice) >= 1, what="the call in flight")
        if not json_response:  # an SSE answer begun: on a loaded machine the 1 s drain
            await asyncio.wait_for(begun.wait(), 20)  # could end before the server began it
        sluice.signal(signal.SIGTERM)
        status, content_type, body = await answer
    assert status == 200
    if json_response:
        assert content_type.startswith("application/json")
        error = orjson.loads(body)
    else:
        assert content_type.startswith("text/event-stream")
        last = body.decode().strip().split("\n\n")[-1]
        error = orjson.loads(last.split("data: ", 1)[1])
    assert error["id"] == 9
    assert (error["error"]["code"], error["error"]["data"]["reason"]) == (503, "draining")
    assert await sluice.wait_exit(timeout=30) == 0
    [completed] = [e for e in sluice.events() if e["event"] == "completed"
                   and e.get("operation") == "slow"]
    assert completed["outcome"] == "drain_cut"


def _admitted(sluice: Any) -> int:
    """Tool calls admitted so far: a session's initialize, notifications and GET stream are
    admitted too, and counted, a wait for "the call in flight" ended before it was sent."""
    return sum(e["event"] == "admitted" and "operation" in e for e in sluice.events())


async def test_a_call_whose_stream_ends_without_its_response_gets_an_error_event(
        mcp_session, start_sluice):
    """A session deleted while its tool runs: the server ends that call's SSE stream with no
    response, and passed on as it came, the Python mcp 1.x client waited for ever (a hostile
    trial; directly against the server too). Sluice ends the stream with the call's JSON-RPC
    error as its last event."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session)]})
    url = endpoint(sluice)
    call = mcp_servers.tool_call(17, "slow", seconds=5.0)
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)
        async with http.post(url, json=call, headers=headers) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            await wait_until(lambda: _admitted(sluice) >= 1, what="the call in flight")
            async with http.delete(url, headers=headers) as gone:
                assert gone.status in (200, 204)
            stream = await r.read()
    events = [orjson.loads(line[len(b"data: "):]) for line in stream.splitlines()
              if line.startswith(b"data: ") and line.strip() != b"data:"]
    last = events[-1]
    assert last["id"] == 17 and "result" not in last
    assert last["error"]["data"]["reason"] == "upstream_unreachable"
    assert "without the call's response" in last["error"]["message"]


# -- a cancelled call leaves no answer for its key ------------------------------------------------


async def test_a_replay_does_not_carry_the_first_calls_session_id(mcp_session, start_sluice):
    """A ``dedup`` answer stored from session A's call carried A's ``Mcp-Session-Id`` header
    into its replay to session B: the TypeScript SDK 1.x client takes the session id of
    every response, so B's client went on in A's session (its DELETE then 404) and A's id
    was handed to another session (a helper's finding). The replay carries none: each
    client keeps its own."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session,
                                                      idempotency={"mode": "dedup"})]})
    url = endpoint(sluice)
    call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": "add", "arguments": {"a": 40, "b": 2}}}
    async with aiohttp.ClientSession() as http:
        first = await mcp_servers.raw_session(http, url)
        second = await mcp_servers.raw_session(http, url)
        assert first["Mcp-Session-Id"] != second["Mcp-Session-Id"]
        key = {"Idempotency-Key": "replayed-across-sessions"}
        async with http.post(url, json=call, headers={**first, **key}) as r:
            assert "42" in await r.text()
        async with http.post(url, json=call, headers={**second, **key}) as r:
            assert "42" in await r.text()
            assert r.headers.get("Idempotent-Replayed") == "true"
            assert "Mcp-Session-Id" not in r.headers, r.headers


async def test_a_cancelled_calls_answer_is_not_replayed_to_the_next_caller(mcp_session,
                                                                          start_sluice):
    """A client that cancels its call (``notifications/cancelled``: the TypeScript SDK's
    ``timeout`` does, and keeps reading the POST stream) gets the server's "Request
    cancelled" error (-32800 from the 2.x server, code 0 from the 1.x one) as the call's
    response. Sluice stored it as the call's answer: every later identical call of the
    tenant, from any client, was told "Request cancelled" for the key's whole ttl, and the
    tool never ran for it (a hostile trial). A cancelled call, like a caller that left, leaves
    no answer: the next caller's call runs.

    The cancel goes to the server directly (as through another replica, or a client that
    bypasses Sluice): one sent through Sluice for its call in flight on this ``dedup`` route
    is held, and the call runs to its end (``tests/test_mcp_cancels.py``)."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session,
                                                      idempotency={"mode": "dedup"})]})
    url = endpoint(sluice)
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "slow", "arguments": {"seconds": 1.5}}}
    async with aiohttp.ClientSession() as http:
        first = await mcp_servers.raw_session(http, url)

        async def cancelled() -> str:
            async with http.post(url, json=call, headers=first) as r:
                return await r.text()

        answer = asyncio.create_task(cancelled())
        await asyncio.sleep(0.3)
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": 7, "reason": "the user pressed stop"}}
        async with http.post(mcp_session.url, json=cancel, headers=first) as r:
            assert r.status == 202
        assert "Request cancelled" in await answer
    async with Client(endpoint(sluice), mode="legacy") as client:
        assert text(await client.call_tool("slow", {"seconds": 1.5})) == "slept"
