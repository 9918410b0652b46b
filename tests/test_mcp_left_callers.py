"""An MCP call whose caller leaves while its tool runs is finished, not cut.

The official ``mcp`` 2.x client times out a call by closing its POST; the official servers run
the tool to its end all the same. Sluice used to cut the call there (its handler is cancelled
when the caller leaves), which freed the call's idempotency key and its concurrency slot while
the tool still ran: the client's retry (same tool and arguments: the same derived key) ran the
tool a second time, and the upstream saw more calls at once than the route's limit (a hostile
trial). On an ``mcp`` route whose idempotency keeps answers (``dedup``), Sluice now reads the
call's answer to its end without the caller, holding everything the call held, and keeps that
answer for the key: the retry gets it.

The first tests run the official client against the official server (``tests/mcp_servers.py``);
the others put a scripted upstream behind Sluice to leave at each phase and to fail after the
caller left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator
from typing import Any, Self

import aiohttp
import pytest
from aiohttp import web
from mcp import Client, MCPError

import proxy.forward
from policies.mcp import AnswerTracker
from proxy.config import parse_config
from proxy.forward import MCP_ANSWER, Finish, _relay_chunk
from proxy.runtime import Runtime
from tests import mcp_servers
from tests.conftest import (
    completed_events,
    leave_the_queue,
    serve_app,
    serve_runtime,
    wait_until,
)
from tests.redis_servers import TEST_TIMEOUT_S, delete_prefix, new_prefix, require_redis
from tests.test_reload import rewrite, set_limit

mcp_stateless = mcp_servers.mcp_stateless

TOKEN = "t0ken-for-tests"


def mcp_route(upstream: str, **policies: Any) -> dict:
    """A ``protocol: mcp`` route ``/tools/`` in front of ``upstream``, keeping answers."""
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream, "protocol": "mcp",
            "idempotency": {"mode": "dedup", "max_wait": "30s"}, **policies}


def text(result: Any) -> str:
    return result.content[0].text


async def admin_inflight(sluice: Any) -> int:
    """The route's in-flight count as ``/admin/routes`` shows it."""
    async with aiohttp.ClientSession() as s, s.get(sluice.admin_url + "/admin/routes") as r:
        body = await r.json()
    [route] = [r for r in body["routes"] if r["name"] == "tools"]
    return route["inflight"]


async def assert_all_given_back(sluice: Any) -> None:
    """Nothing the calls took is still held: in flight, queued, waiting on a key."""
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
    await sluice.wait_metric("sluice_buffered_request_bytes", 0)
    assert await admin_inflight(sluice) == 0
    assert await sluice.metric("sluice_queue_depth", route="tools") == 0
    assert await sluice.metric("sluice_idempotency_waiting", route="tools") == 0


async def tools_runtime(upstream: str) -> Runtime:
    """An opened runtime (for tests that reach inside it) with one ``tools`` mcp route to
    ``upstream``: answers kept for their keys, one call at a time."""
    runtime = Runtime(parse_config(
        "routes:\n"
        f"  - {{name: tools, path_prefix: /tools/, upstream: '{upstream}', protocol: mcp,\n"
        "      idempotency: {mode: dedup}, concurrency: {limit: 1, queue: 0}}\n"))
    await runtime.open()
    return runtime


async def serve_in_process(runtime: Runtime) -> tuple[web.ServerRunner, str]:
    """Serve ``runtime``'s proxy port in this process (for tests that reach inside it): the
    runner to clean up, and the ``tools`` route's MCP endpoint URL."""
    runner, port = await serve_runtime(runtime)
    return runner, f"http://127.0.0.1:{port}/tools/mcp"


# -- through the official client and server -----------------------------------------------------


async def test_a_timed_out_call_runs_once_and_its_retry_gets_the_answer(mcp_stateless,
                                                                        start_sluice):
    """Before: the retry ran the tool again (``sent #2``, two deliveries), and the other call
    ran beside the abandoned one although the route allows one at a time."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_stateless.base_url, concurrency={"limit": 1, "queue": 0})]})
    async with Client(sluice.url + "/tools/mcp") as client:
        with pytest.raises(MCPError) as timed_out:
            await client.call_tool("send_slowly", {"to": "ops", "seconds": 3},
                                   read_timeout_seconds=0.5)
        assert "timed out" in str(timed_out.value)
        assert mcp_stateless.sends() == 1  # the tool runs on at the server
        # The abandoned call still holds the route's one slot: another call is refused
        # rather than run beside it.
        with pytest.raises(MCPError) as refused:
            await client.call_tool("add", {"a": 1, "b": 2})
        assert refused.value.error.data["reason"] == "queue_full"
        # The client's retry: same tool and arguments, a new JSON-RPC id, the same key.
        result = await client.call_tool("send_slowly", {"to": "ops", "seconds": 3},
                                        read_timeout_seconds=30)
        assert text(result) == "sent #1" and not result.is_error
        assert mcp_stateless.sends() == 1
        assert text(await client.call_tool("add", {"a": 1, "b": 2})) == "3"
    await assert_all_given_back(sluice)
    assert await sluice.metric("sluice_finished_after_leaving_total", route="tools",
                               outcome="2xx") == 1
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 1
    events = await completed_events(sluice, 2)
    [left] = [e for e in events if e.get("operation") == "send_slowly"]
    assert left["outcome"] == "client_disconnected"  # the caller's outcome
    assert (left["finished_after_leaving"], left["finished_status"]) == ("2xx", 200)
    replayed = [e for e in sluice.events() if e["event"] == "replayed"]
    assert [e["idempotency_key"] for e in replayed] == [left["idempotency_key"]]


async def test_a_drain_waits_for_a_call_finishing_without_its_caller(mcp_stateless,
                                                                     start_sluice):
    """SIGTERM while an abandoned call's tool runs: the drain waits for it, its answer is
    kept (logged as finished), and the process exits once it is done."""
    sluice = await start_sluice({"server": {"drain_timeout": "20s"},
                                 "routes": [mcp_route(mcp_stateless.base_url)]})
    async with Client(sluice.url + "/tools/mcp") as client:
        with pytest.raises(MCPError):
            await client.call_tool("send_slowly", {"to": "ops", "seconds": 2},
                                   read_timeout_seconds=0.3)
    await wait_until(lambda: mcp_stateless.sends() == 1, what="the tool running")
    assert await admin_inflight(sluice) == 1  # held while it finishes
    sluice.signal(signal.SIGTERM)
    assert await sluice.wait_exit(timeout=20) == 0
    [completed] = [e for e in sluice.events()
                   if e["event"] == "completed" and e.get("operation") == "send_slowly"]
    assert completed["outcome"] == "client_disconnected"
    assert completed["finished_after_leaving"] == "2xx"
    assert "drained" in sluice.stderr()
    assert mcp_stateless.sends() == 1


# -- a scripted upstream: each phase, and failures after the caller left -------------------------


class ScriptedMcp:
    """An MCP endpoint whose answers a test drives step by step.

    Each ``tools/call`` POST is answered as ``mode`` says: ``sse`` (headers and a progress
    notification at once, then the response once ``release`` is set), ``json`` (nothing until
    ``release``, then the JSON response), ``headers_late`` (nothing until ``release``, then
    an SSE response), ``sse_open`` (headers and the response at once, then the stream stays
    open until ``release``). With ``fail`` set, what follows ``release`` is a cut connection
    instead of the response. Counts the calls it got, finished and saw cut. A
    ``notifications/cancelled`` is answered 202 and ignored (a server may), kept in
    ``cancels`` with the headers it came with (a tool that cannot be stopped).
    """

    def __init__(self) -> None:
        self.mode = "sse"
        self.fail = False
        self.release = asyncio.Event()
        self.calls = 0
        self.finished = 0
        self.cut = 0
        self.inflight = 0
        self.cancels: list[tuple[dict, dict[str, str]]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Self:
        app = web.Application()
        self.add_routes(app)
        self.runner, self.port = await serve_app(app, handler_cancellation=True)
        return self

    def add_routes(self, app: web.Application) -> None:
        """What it answers (a subclass may answer more)."""
        app.router.add_post("/mcp", self._post)

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _post(self, request: web.Request) -> web.StreamResponse:
        message = await request.json()
        if message.get("method") == "notifications/cancelled":
            self.cancels.append((message["params"], dict(request.headers)))
            return web.Response(status=202)
        if message.get("method") != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "result": {}})
        self.calls += 1
        self.inflight += 1
        rpc_id = message["id"]
        response = {"jsonrpc": "2.0", "id": rpc_id, "result": {
            "content": [{"type": "text", "text": f"done #{self.calls}"}], "isError": False}}
        try:
            if self.mode in ("json", "headers_late"):
                await self.release.wait()
                if self.fail:
                    assert request.transport is not None
                    request.transport.close()
                    return web.Response()
                if self.mode == "json":
                    self.finished += 1
                    return web.json_response(response)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            if self.mode == "sse_open":
                await out.write(_event(response))
                await self.release.wait()
                self.finished += 1
                await out.write_eof()
                return out
            if self.mode == "sse":
                await out.write(_event({"jsonrpc": "2.0", "method": "notifications/progress",
                                        "params": {"progressToken": 1, "progress": 0.5}}))
                await self.release.wait()
                if self.fail:
                    assert request.transport is not None
                    request.transport.close()
                    return out
            await out.write(_event(response))
            self.finished += 1
            await out.write_eof()
            return out
        except asyncio.CancelledError:
            self.cut += 1
            raise
        finally:
            self.inflight -= 1


def _event(message: dict) -> bytes:
    return b"event: message\ndata: " + json.dumps(message).encode() + b"\n\n"


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedMcp]:
    server = await ScriptedMcp().start()
    yield server
    await server.stop()


CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "deliver", "arguments": {"to": "ops"}}}
HEADERS = {"Accept": "application/json, text/event-stream"}


async def leave_a_call(http: aiohttp.ClientSession, url: str, scripted: ScriptedMcp,
                       after_first_event: bool, **headers: str) -> None:
    """Send CALL and leave once it is at the upstream (after its first SSE event, if told)."""
    async def call() -> None:
        async with http.post(url, json=CALL, headers={**HEADERS, **headers}) as r:
            if after_first_event:
                await r.content.readuntil(b"\n\n")
                reading.set()
            await asyncio.Event().wait()  # until cancelled: the caller leaves

    reading = asyncio.Event()
    task = asyncio.create_task(call())
    await wait_until(lambda: scripted.inflight == 1, what="the call at the upstream")
    if after_first_event:
        await asyncio.wait_for(reading.wait(), 10)
    task.cancel()  # aiohttp closes the connection of a cancelled request
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def noticed_leaving(sluice: Any, scripted: ScriptedMcp) -> None:
    """Wait until Sluice has seen the caller leave: it finishes the call without it, or (as
    it did before) it cut the upstream request."""
    for _ in range(500):
        if scripted.cut or await sluice.metric("sluice_finishing_after_leaving") == 1:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("Sluice did not see the caller leave")


async def retried_while_finishing(waits_on: Any, http: aiohttp.ClientSession, url: str,
                                  scripted: ScriptedMcp) -> tuple[int, str, str]:
    """The caller's retry while its first call is finished without it: sent to ``url``, seen
    waiting on the key at ``waits_on`` (the Sluice it went to), then the upstream let
    answer; the retry's status, ``Idempotent-Replayed`` and body."""
    waiting = asyncio.create_task(retry(http, url))
    await waits_on.wait_metric("sluice_idempotency_waiting", 1, route="tools")
    scripted.release.set()
    return await waiting


async def retry(http: aiohttp.ClientSession, url: str, rpc_id: int = 2) -> tuple[int, str, str]:
    """The caller's retry of CALL under a new id: status, ``Idempotent-Replayed``, body."""
    async with http.post(url, json={**CALL, "id": rpc_id}, headers=HEADERS) as r:
        return r.status, r.headers.get("Idempotent-Replayed", ""), await r.text()


@pytest.mark.parametrize("mode, after_first_event", [
    ("headers_late", False),  # in flight, before the upstream's headers
    ("sse", True),            # mid-SSE, before the response event
    ("json", False),          # a JSON answer, before any of it
])
async def test_a_caller_leaving_before_the_response_leaves_the_call_to_finish(
        scripted, start_sluice, mode, after_first_event):
    """Before: the upstream request was cut and the key freed: the retry ran the call again
    (the upstream saw 2 calls) and got ``done #2``."""
    scripted.mode = mode
    sluice = await start_sluice({"routes": [mcp_route(scripted.url,
                                                      concurrency={"limit": 1, "queue": 0})]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, url, scripted, after_first_event)
        await noticed_leaving(sluice, scripted)
        assert await admin_inflight(sluice) == 1  # the slot is still held...
        # ...and its body, in memory until the call ends, counts against max_buffered_bytes
        # (it was given back with the handler: a review held 12 bodies past a 2 MiB bound).
        assert await sluice.metric("sluice_buffered_request_bytes") == len(json.dumps(CALL))
        waiting = asyncio.create_task(retry(http, url))  # ...and the key: the retry waits
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        assert scripted.cut == 0 and scripted.calls == 1
        scripted.release.set()
        status, replayed, body = await waiting
    assert (status, replayed) == (200, "true")
    assert '"id":2' in body.replace(" ", "") and "done #1" in body
    assert scripted.calls == 1 and scripted.finished == 1 and scripted.cut == 0
    await assert_all_given_back(sluice)
    [completed] = await completed_events(sluice, 1)
    assert completed["outcome"] == "client_disconnected"
    assert completed["finished_after_leaving"] == "2xx"


async def test_a_caller_leaving_after_the_response_is_cut_as_before(scripted, start_sluice):
    """The response has passed: nothing is left to finish, the stream is cut at once, and
    its answer is kept for the key, as before. The caller had its answer, so the call is
    ``2xx`` (it was ``client_disconnected``: tests/test_answered_callers.py)."""
    scripted.mode = "sse_open"
    sluice = await start_sluice({"routes": [mcp_route(scripted.url)]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, url, scripted, after_first_event=True)
        await wait_until(lambda: scripted.cut == 1, what="the upstream stream cut")
        await assert_all_given_back(sluice)
        status, replayed, body = await retry(http, url)
    assert (status, replayed) == (200, "true") and "done #1" in body
    [completed] = await completed_events(sluice, 1)
    assert completed["outcome"] == "2xx"
    assert "finished_after_leaving" not in completed


async def test_a_caller_leaving_while_queued_is_let_go_at_once(scripted, start_sluice):
    """Queued, the call reached nothing: it leaves as before, holding nothing."""
    scripted.mode = "sse"
    sluice = await start_sluice({"routes": [mcp_route(
        scripted.url, concurrency={"limit": 1, "queue": 1, "max_wait": "30s"})]})
    url = sluice.url + "/tools/mcp"
    other = {**CALL, "params": {"name": "deliver", "arguments": {"to": "sales"}}}
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(retry(http, url, rpc_id=9))  # holds the slot
        await wait_until(lambda: scripted.inflight == 1, what="the first call upstream")

        async def queued() -> None:
            async with http.post(url, json=other, headers=HEADERS) as r:
                await r.read()

        await leave_the_queue(sluice, queued(), "tools")
        scripted.release.set()
        assert (await first)[0] == 200
    await assert_all_given_back(sluice)
    assert scripted.calls == 1
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="client_disconnected") == 1


@pytest.mark.parametrize("mode, after_first_event", [("sse", True), ("headers_late", False)])
async def test_an_upstream_failing_after_the_caller_left_frees_the_key(
        scripted, start_sluice, mode, after_first_event):
    """The finish fails: nothing is kept for the key (the retry runs the call again), and
    nothing stays held."""
    scripted.mode, scripted.fail = mode, True
    sluice = await start_sluice({"routes": [mcp_route(scripted.url,
                                                      concurrency={"limit": 1, "queue": 0})]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, url, scripted, after_first_event)
        await wait_until(lambda: scripted.calls == 1, what="the call upstream")
        # Not before Sluice has seen the caller leave: on a busy machine the upstream's
        # failure could come first, and the call end as the caller's upstream_error.
        await noticed_leaving(sluice, scripted)
        scripted.release.set()
        await assert_all_given_back(sluice)
        [completed] = await completed_events(sluice, 1)
        scripted.fail = False
        status, replayed, body = await retry(http, url)
    assert completed["outcome"] == "client_disconnected"
    assert completed["finished_after_leaving"] == "upstream_error"
    assert (status, replayed) == (200, "") and "done #2" in body
    assert scripted.calls == 2
    await assert_all_given_back(sluice)


async def test_an_upstream_timing_out_after_the_caller_left_frees_the_key(scripted,
                                                                          start_sluice):
    """The route's own timeouts bound the finish: the upstream never answers, the call ends
    at ``timeouts.total`` as it would have with its caller there."""
    scripted.mode = "sse"
    sluice = await start_sluice({"routes": [mcp_route(scripted.url,
                                                      timeouts={"total": "1s"})]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, url, scripted, after_first_event=True)
        await wait_until(lambda: scripted.cut == 1, timeout=15, what="the timeout's cut")
        await assert_all_given_back(sluice)
        [completed] = await completed_events(sluice, 1)
    assert completed["finished_after_leaving"] == "upstream_timeout"
    assert await sluice.metric("sluice_finished_after_leaving_total", route="tools",
                               outcome="upstream_timeout") == 1


async def test_a_drain_cut_ends_a_call_finishing_without_its_caller(scripted, start_sluice):
    """Past ``drain_timeout`` the drain cuts what is still finishing, like any call in flight:
    the upstream request is closed and the process exits."""
    scripted.mode = "sse"
    sluice = await start_sluice({"server": {"drain_timeout": "300ms"},
                                 "routes": [mcp_route(scripted.url)]})
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, sluice.url + "/tools/mcp", scripted, after_first_event=True)
    await noticed_leaving(sluice, scripted)
    assert await admin_inflight(sluice) == 1
    sluice.signal(signal.SIGTERM)
    assert await sluice.wait_exit(timeout=20) == 0
    await wait_until(lambda: scripted.cut == 1, what="the upstream request cut")
    assert "drain timeout: cutting 1 request(s) still in flight" in sluice.stderr()
    [completed] = [e for e in sluice.events() if e["event"] == "completed"]
    assert completed["outcome"] == "client_disconnected"
    assert completed["finished_after_leaving"] == "drain_cut"


async def test_a_run_cancel_of_a_call_finishing_without_its_caller_asks_its_server(
        scripted, start_sluice):
    """A cancelled run's call finishing without its caller: Sluice sends its server the
    call's ``notifications/cancelled`` and holds the key for the server's answer, for
    ``CANCEL_ANSWER_WAIT_S`` once the server took the cancel (the spec says a server SHOULD
    NOT answer a request it cancelled). This server takes the cancel and stays silent: the
    call's stream is then closed and everything given back; the retry runs the call. (A
    server that answers in time has its answer kept: tests/test_mcp_run_cancel_upstream.py.)
    Before the bound, a silent server held the key and slot to ``timeouts.total``."""
    scripted.mode = "sse"
    sluice = await start_sluice({"routes": [mcp_route(scripted.url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, url, scripted, after_first_event=True, **{"X-Run-ID": "job"})
        await noticed_leaving(sluice, scripted)
        assert await admin_inflight(sluice) == 1
        async with http.post(f"{sluice.admin_url}/admin/runs/job/cancel",
                             headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200
        [(params, headers)] = scripted.cancels
        assert params == {"requestId": 1, "reason": "Sluice: run job was cancelled"}
        assert headers["Accept"] == "application/json, text/event-stream"
        await wait_until(lambda: scripted.cut == 1, timeout=20, what="the silent call closed")
        await assert_all_given_back(sluice)
        scripted.release.set()
        status, replayed, _ = await retry(http, url)
        [completed, retried] = await completed_events(sluice, 2)
    assert (status, replayed) == (200, "") and scripted.calls == 2
    assert completed["outcome"] == "client_disconnected"  # the caller's
    assert completed["finished_after_leaving"] == "run_cancelled"
    assert retried["outcome"] == "2xx"
    assert await sluice.metric("sluice_cancels_total", route="tools", where="inflight") == 1
    [sent] = [e for e in sluice.events() if e["event"] == "cancel_sent"]
    assert sent["status"] == 202 and sent["request_id"] == completed["request_id"]


async def test_llm_streams_are_still_cut_when_their_caller_leaves(upstream, start_sluice):
    """Only MCP calls are finished: an LLM stream's cut stops the upstream's generation."""
    upstream.stream_hold = asyncio.Event()
    sluice = await start_sluice({"routes": [{
        "name": "openai", "path_prefix": "/openai/", "upstream": upstream.url,
        "protocol": "openai", "idempotency": {"mode": "dedup"}}]})
    async with aiohttp.ClientSession() as http:
        r = await http.post(sluice.url + "/openai/v1/chat/completions",
                            json={"model": "gpt-test", "stream": True,
                                  "messages": [{"role": "user", "content": "hi"}]},
                            headers={"Idempotency-Key": "k1"})
        await r.content.readuntil(b"\n\n")
        r.close()
        await wait_until(lambda: upstream.cancelled == 1, what="the upstream stream cut")
    await sluice.wait_metric("sluice_inflight_requests", 0, route="openai")
    assert upstream.completed == 0
    upstream.stream_hold.set()


async def test_a_run_cancel_with_the_caller_there_still_answers_it(scripted, start_sluice):
    """The caller is still reading when its run is cancelled: its SSE answer ends with the
    ``run_cancelled`` error at once, as before; the call's server is asked to cancel it, and
    the exchange is finished without the caller (here the server ignores the cancel), the
    key held to the server's answer, which is kept. Before, the upstream request was cut and
    the key freed."""
    scripted.mode = "sse"
    sluice = await start_sluice({"routes": [mcp_route(scripted.url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=CALL, headers={**HEADERS, "X-Run-ID": "job"}) as r:
            await r.content.readuntil(b"\n\n")  # the progress notification
            async with http.post(f"{sluice.admin_url}/admin/runs/job/cancel",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                assert (await c.json())["calls_ended"] == 1  # its caller was answered
            rest = await r.text()
        assert '"reason":"run_cancelled"' in rest.replace(" ", "") and '"id":1' in rest
        await wait_until(lambda: len(scripted.cancels) == 1, what="the cancel upstream")
        assert scripted.cancels[0][0]["requestId"] == 1
        assert scripted.cut == 0 and await admin_inflight(sluice) == 1
        status, replayed, body = await retried_while_finishing(sluice, http, url, scripted)
        await assert_all_given_back(sluice)
        [completed] = await completed_events(sluice, 1)
    assert (status, replayed) == (200, "true") and "done #1" in body
    assert completed["outcome"] == "run_cancelled"
    assert (completed["finished_after_leaving"], completed["finished_status"]) == ("2xx", 200)
    assert scripted.calls == 1


async def test_a_proxy_error_while_finishing_without_the_caller_gives_everything_back(
        scripted, monkeypatch, caplog):
    """A bug in Sluice while it finishes a call without its caller (in-process, with
    forwarding made to raise): logged, counted ``upstream_error``, nothing left held."""
    runtime = await tools_runtime(scripted.url)
    real_send = proxy.forward.send
    at_send = asyncio.Event()
    go_on = asyncio.Event()

    async def broken_send(*args: Any, **kwargs: Any) -> Any:
        at_send.set()
        await go_on.wait()
        raise RuntimeError("injected proxy bug")

    monkeypatch.setattr(proxy.forward, "send", broken_send)
    runner, url = await serve_in_process(runtime)
    [tools] = runtime.routes
    try:
        with caplog.at_level(logging.ERROR, logger="sluice"):
            async with aiohttp.ClientSession() as http:
                async def call() -> None:
                    async with http.post(url, json=CALL, headers=HEADERS) as r:
                        await r.read()

                task = asyncio.create_task(call())
                await asyncio.wait_for(at_send.wait(), 10)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await wait_until(lambda: len(runtime.finishing) == 1,
                                 what="the call finishing without its caller")
                assert tools.inflight == 1 and tools.concurrency.inflight == 1
                go_on.set()
                await wait_until(lambda: not runtime.finishing, what="the finish to end")
                assert (tools.inflight, tools.present, tools.concurrency.inflight) == (0, 0, 0)
                assert tools.idempotency.waiting == 0 and not tools.idempotency._flights
                monkeypatch.setattr(proxy.forward, "send", real_send)
                scripted.mode = "json"
                scripted.release.set()
                async with http.post(url, json=CALL, headers=HEADERS) as r:
                    assert r.status == 200 and "done #1" in await r.text()
        assert "injected proxy bug" in caplog.text
        assert runtime.metrics.registry.get_sample_value(
            "sluice_finished_after_leaving_total",
            {"route": "tools", "outcome": "upstream_error"}) == 1
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_reload_while_a_call_finishes_without_its_caller(scripted, start_sluice):
    """The config is reloaded (the route's limit raised) while the call finishes: its key and
    its count stay with it, and all is given back when it ends."""
    scripted.mode = "sse"
    sluice = await start_sluice({"routes": [mcp_route(scripted.url,
                                                      concurrency={"limit": 1, "queue": 0})]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_a_call(http, url, scripted, after_first_event=True)
        await noticed_leaving(sluice, scripted)
        rewrite(sluice.config_path, set_limit(2))
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        await sluice.wait_metric("sluice_concurrency_limit", 2, route="tools")
        assert await admin_inflight(sluice) == 1
        status, replayed, body = await retried_while_finishing(sluice, http, url, scripted)
    assert (status, replayed) == (200, "true") and "done #1" in body
    assert scripted.calls == 1
    await assert_all_given_back(sluice)


async def test_a_run_cancel_and_the_caller_leaving_at_once_leave_nothing_held(
        scripted, monkeypatch):
    """Two cancellations of one call at once (its run's cancel and its caller leaving, in the
    same loop turn, in-process): whichever wins, everything is given back, once, when the
    call ends: its server, asked to cancel it, ignores that and answers (each run's call has
    arguments of its own, so that no answer kept is replayed to the next)."""
    runtime = await tools_runtime(scripted.url)
    runner, url = await serve_in_process(runtime)
    [tools] = runtime.routes
    scripted.mode = "sse"
    try:
        async with aiohttp.ClientSession() as http:
            for n, run in enumerate(("job-1", "job-2", "job-3"), 1):
                reading = asyncio.Event()

                async def call(run: str = run, reading: asyncio.Event = reading) -> None:
                    body = {**CALL, "params": {"name": "deliver", "arguments": {"to": run}}}
                    async with http.post(url, json=body,
                                         headers={**HEADERS, "X-Run-ID": run}) as r:
                        await r.content.readuntil(b"\n\n")
                        reading.set()
                        await r.read()

                scripted.release = asyncio.Event()
                task = asyncio.create_task(call())
                await asyncio.wait_for(reading.wait(), 10)
                runtime.runs.cancel(run, 60, "default")  # its calls name no tenant
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task
                await wait_until(lambda n=n: len(scripted.cancels) == n,  # type: ignore[misc]
                                 what="its cancel upstream")
                scripted.release.set()
                await wait_until(lambda: tools.present == 0 and not runtime.finishing,
                                 what="the call to end")
                assert (tools.inflight, tools.concurrency.inflight) == (0, 0)
                assert not tools.idempotency._flights
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_write_failing_before_the_response_reads_on_and_after_it_cuts() -> None:
    """The relay may learn that the caller has gone from a failed write before the handler
    is told: before the response it reads on without writing, up to the response; after
    the response, the failed write cuts the answer as before."""

    class Gone:
        async def write(self, chunk: bytes) -> None:
            raise ConnectionResetError("the caller has gone")

    tracker = AnswerTracker("text/event-stream", 1)
    request: Any = {MCP_ANSWER: tracker}
    finish = Finish()
    progress = _event({"jsonrpc": "2.0", "method": "notifications/progress",
                       "params": {"progressToken": 1, "progress": 0.5}})
    tracker.feed(progress)
    assert await _relay_chunk(request, Gone(), progress, finish) is True  # read on
    assert finish.left
    response = _event({"jsonrpc": "2.0", "id": 1, "result": {"content": []}})
    tracker.feed(response)
    assert await _relay_chunk(request, Gone(), response, finish) is False  # the response is in
    with pytest.raises(ConnectionResetError):
        await _relay_chunk(request, Gone(), b": after\n\n", Finish())


async def test_with_shared_state_the_retry_on_another_replica_gets_the_finished_answer(
        scripted, start_sluice):
    """With Redis, the key's marker and the slot's lease are held while the call finishes
    without its caller, and the retry sent to another replica waits for the answer and gets
    it."""
    url, prefix = require_redis(), new_prefix()
    state = {"backend": "redis", "redis_url": url, "key_prefix": prefix,
             "timeout": f"{int(TEST_TIMEOUT_S * 1000)}ms"}
    config = {"state": state, "routes": [mcp_route(
        scripted.url, concurrency={"limit": 1, "queue": 0})]}
    try:
        first, second = await start_sluice(config), await start_sluice(config)
        scripted.mode = "sse"
        async with aiohttp.ClientSession() as http:
            await leave_a_call(http, first.url + "/tools/mcp", scripted, after_first_event=True)
            await noticed_leaving(first, scripted)
            status, replayed, body = await retried_while_finishing(
                second, http, second.url + "/tools/mcp", scripted)
        assert (status, replayed) == (200, "true") and "done #1" in body
        assert scripted.calls == 1
        await assert_all_given_back(first)
        await assert_all_given_back(second)
    finally:
        delete_prefix(url, prefix)
