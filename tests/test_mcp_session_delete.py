"""A session's DELETE waits for the session's calls whose answers Sluice keeps for a retry.

The official Python clients (1.x, and 2.x in ``legacy`` mode) send ``DELETE`` with their
``Mcp-Session-Id`` when ``async with Client(...)`` exits, before they close the POSTs still
open. On a ``dedup`` route Sluice finishes a timed-out call without its caller (or holds its
client's cancel) so that the retry gets its answer; but it forwarded the DELETE at once, the
server ended the session, its tool task was cancelled after the side effect, the call's
stream ended without its response, nothing was kept for the key, and the retry ran the tool
again (a hostile trial, 5 of 5). Sluice now answers such a DELETE itself (200, as the server
does) and sends it upstream once the last of those calls has ended.

A stream the upstream ends without the call's response is counted ``upstream_error`` (it was
``2xx``, though its client got the JSON-RPC error 502 ``upstream_unreachable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from mcp import Client, MCPError

from proxy.session_end import ENDED_SESSIONS_KEPT
from tests import mcp_servers
from tests.conftest import completed_events, serve_app, wait_until
from tests.test_mcp_left_callers import ScriptedMcp, assert_all_given_back, noticed_leaving
from tests.test_operations import MCP1_PYTHON, run_mcp1
from tests.test_review_mcp_round35 import _closed_for_polling, polling_sluice

mcp_session = mcp_servers.mcp_session
mcp_server_factory = mcp_servers.mcp_server_factory

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


class SessionServer(ScriptedMcp):
    """An MCP endpoint with sessions, as the official server behaves: a ``tools/call`` is
    answered on SSE (a progress event at once, the response once :attr:`release` is set);
    a DELETE ends the session, and with it the streams of its calls in flight, with no
    response (the official server cancels the tool's task). Logs what happened in order
    (:attr:`log`): ``call``, ``answered``, ``ended_without_response``, ``delete``."""

    def __init__(self) -> None:
        super().__init__()
        self.deleted = asyncio.Event()
        self.log: list[str] = []
        #: The Authorization a DELETE must carry, if any (else 401).
        self.delete_needs: str | None = None
        #: What a call's stream carries first.
        self.first_event: dict = {"jsonrpc": "2.0", "method": "notifications/progress",
                                  "params": {"progressToken": 1, "progress": 0.5}}

    def add_routes(self, app: web.Application) -> None:
        super().add_routes(app)
        app.router.add_delete("/mcp", self._delete)

    async def _delete(self, request: web.Request) -> web.Response:
        if (self.delete_needs is not None
                and request.headers.get("Authorization") != self.delete_needs):
            self.log.append("delete refused")
            return web.Response(status=401)
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
            await out.write(_event(self.first_event))
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


async def finishing_without_its_caller(start_sluice: Any, session_server: SessionServer,
                                       **top: Any) -> tuple[Any, str]:
    """A Sluice (``top``: more of its config) in front of ``session_server`` on a ``dedup``
    route, with CALL's caller gone and the call being finished without it: ``(sluice, the
    route's MCP URL)``."""
    sluice = await start_sluice({**top, "routes": [mcp_route(session_server.url,
                                                             idempotency=DEDUP)]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        await leave_call(http, url, session_server)
    await noticed_leaving(sluice, session_server)
    return sluice, url


async def delete_session(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with http.delete(url, headers=HEADERS) as r:
        return r.status, await r.read()


# -- through the official client and server -------------------------------------------------------


async def test_sdk_timed_out_call_then_client_exit_then_retry_runs_once(mcp_session,
                                                                         start_sluice):
    """The hostile trial's scenario (memory backend): a slow side-effecting call times out
    inside ``async with Client(...)`` (2.x, legacy: a session and its DELETE on exit), the
    client exits, and a new client retries the same call. Before: ``sent #2``, two side
    effects."""
    sluice = await start_sluice({"state": {"backend": "memory"},
                                 "routes": [mcp_route(mcp_session.base_url, idempotency=DEDUP)]})
    url = sluice.url + "/tools/mcp"
    async with Client(url, mode="legacy") as client:
        with pytest.raises(MCPError):
            await client.call_tool("send_slowly", {"to": "ops", "seconds": 2.5},
                                   read_timeout_seconds=0.7)
    async with Client(url, mode="legacy") as client:
        result = await client.call_tool("send_slowly", {"to": "ops", "seconds": 2.5},
                                        read_timeout_seconds=30)
    assert result.content[0].text == "sent #1" and not result.is_error
    assert mcp_session.sends() == 1
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 1
    await assert_all_given_back(sluice)
    # Both sessions' DELETEs were sent upstream in the end: none is left waiting.
    await wait_until(lambda: sum(e["event"] == "session_delete_sent"
                                 for e in sluice.events()) >= 1,
                     what="the deferred DELETE sent")
    [first] = [e for e in sluice.events() if e["event"] == "completed"
               and e.get("operation") == "send_slowly"]
    assert first["outcome"] in ("2xx", "client_disconnected")
    assert first.get("finished_after_leaving", "2xx") == "2xx"


# -- raw HTTP against a scripted session server ---------------------------------------------------


async def test_a_delete_waits_for_a_call_finishing_without_its_caller(session_server,
                                                                      start_sluice):
    """Answered 200 at once, sent upstream only after the call has finished; the retry gets
    the kept answer and the tool ran once. Before: the DELETE reached the server at once,
    which ended the call's stream without its response, and the retry ran it again."""
    sluice, url = await finishing_without_its_caller(start_sluice, session_server)
    async with aiohttp.ClientSession() as http:
        assert await delete_session(http, url) == (200, b"")
        # A second DELETE of the session while the first waits: answered too, not sent.
        assert await delete_session(http, url) == (200, b"")
        assert "delete" not in session_server.log
        session_server.release.set()
        await asyncio.wait_for(session_server.deleted.wait(), 10)
        await assert_all_given_back(sluice)
        retry = {**CALL, "id": 8}
        async with http.post(url, json=retry, headers=HEADERS) as r:
            body = await r.text()
            replayed = r.headers.get("Idempotent-Replayed")
    assert session_server.log == ["call", "answered", "delete"]
    assert replayed == "true" and "done #1" in body and '"id":8' in body.replace(" ", "")
    assert session_server.calls == 1
    await completed_events(sluice, 3)  # the call, and each DELETE when answered
    [deferred, again] = [e for e in sluice.events() if e["event"] == "completed"
                         and e.get("session_delete") == "deferred"]
    assert again["call_request_ids"] == deferred["call_request_ids"]
    assert (deferred["status"], deferred["outcome"]) == (200, "2xx")
    assert len(deferred["call_request_ids"]) == 1
    await wait_until(lambda: any(e["event"] == "session_delete_sent" for e in sluice.events()),
                     what="the session_delete_sent event")
    [sent] = [e for e in sluice.events() if e["event"] == "session_delete_sent"]
    assert sent["status"] == 200 and sent["request_id"] == deferred["request_id"]


async def test_a_delete_waits_for_a_call_whose_cancel_was_held(session_server, start_sluice):
    """The 2.x client in legacy mode: its timeout sends ``notifications/cancelled`` (held)
    and leaves the POST open; its exit sends the DELETE before it closes that POST."""
    sluice = await start_sluice({"routes": [mcp_route(session_server.url,
                                                      idempotency=DEDUP)]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=CALL, headers=HEADERS) as r:
            await r.content.readuntil(b"\n\n")
            cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                      "params": {"requestId": 7, "reason": "timed out"}}
            async with http.post(url, json=cancel, headers=HEADERS) as c:
                assert c.status == 202
            assert await delete_session(http, url) == (200, b"")
        assert "delete" not in session_server.log
        session_server.release.set()
        await asyncio.wait_for(session_server.deleted.wait(), 10)
        await assert_all_given_back(sluice)
    assert session_server.log == ["call", "answered", "delete"]


async def test_a_delete_with_no_kept_call_goes_through_at_once(session_server, start_sluice):
    """Nothing of the session in flight (or a route that keeps no answers): forwarded as
    before, answered by the server."""
    sluice = await start_sluice({"routes": [mcp_route(session_server.url,
                                                      idempotency=DEDUP)]})
    async with aiohttp.ClientSession() as http:
        assert (await delete_session(http, sluice.url + "/tools/mcp"))[0] == 200
    assert session_server.log == ["delete"]
    [completed] = await completed_events(sluice, 1)
    assert "session_delete" not in completed and completed["outcome"] == "2xx"


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
    sluice, _ = await finishing_without_its_caller(start_sluice, session_server)
    async with aiohttp.ClientSession() as http:
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


MCP1_EXIT_AND_RETRY = """
import asyncio, json, sys
from datetime import timedelta
from mcp.client.streamable_http import streamablehttp_client
from mcp import ClientSession

async def session(url, timeout_s):
    args = {"to": "ops", "seconds": 2.5}
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            try:
                result = await session.call_tool(
                    "send_slowly", args, read_timeout_seconds=timedelta(seconds=timeout_s))
                return result.content[0].text
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"[:200]

async def main(url):
    first = await session(url, 0.7)
    retry = await session(url, 30)
    print(json.dumps({"first": first, "retry": retry}))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_python_1x_client_exit_after_a_timeout_then_retry_runs_once(
        mcp_session, start_sluice, tmp_path):
    """The 1.x client sends no cancel on its timeout and leaves the POST open: at its exit
    the DELETE comes while the call's caller still seems to wait. Before: ``sent #2``."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url,
                                                      idempotency=DEDUP)]})
    out = await run_mcp1(tmp_path / "mcp1_exit.py", MCP1_EXIT_AND_RETRY,
                         sluice.url + "/tools/mcp")
    assert "Timed out" in out["first"], out
    assert out["retry"] == "sent #1"
    assert mcp_session.sends() == 1
    await assert_all_given_back(sluice)


async def test_a_call_sent_on_the_session_after_its_delete_is_waited_for_too(session_server,
                                                                             start_sluice):
    """A client reusing the session's id after its DELETE: the request is forwarded (the
    server still has the session), and the DELETE, checked again as each call ends, waits
    for that call too."""
    sluice, url = await finishing_without_its_caller(start_sluice, session_server)
    later = {**CALL, "id": 9, "params": {"name": "deliver", "arguments": {"to": "sales"}}}
    async with aiohttp.ClientSession() as http:
        assert await delete_session(http, url) == (200, b"")

        async def call_later() -> str:
            async with http.post(url, json=later, headers=HEADERS) as r:
                return await r.text()

        answer = asyncio.create_task(call_later())
        await wait_until(lambda: session_server.calls == 2, what="the later call upstream")
        session_server.release.set()
        assert "done #2" in await answer
        await asyncio.wait_for(session_server.deleted.wait(), 10)
        await assert_all_given_back(sluice)
    assert session_server.log == ["call", "call", "answered", "answered", "delete"]


async def deleted_while_finishing(start_sluice: Any, session_server: SessionServer,
                                  drain_timeout: str) -> Any:
    """A Sluice (``drain_timeout``) in front of ``session_server`` with a call finishing
    without its caller and its session's DELETE answered, waiting for it."""
    sluice, url = await finishing_without_its_caller(
        start_sluice, session_server, server={"drain_timeout": drain_timeout})
    async with aiohttp.ClientSession() as http:
        assert await delete_session(http, url) == (200, b"")
    return sluice


async def test_a_drain_sends_a_waiting_delete_once_its_call_has_ended(session_server,
                                                                      start_sluice):
    """SIGTERM while a DELETE waits for a call finishing without its caller: the drain
    waits for the call, the DELETE is sent after it, and the process exits."""
    sluice = await deleted_while_finishing(start_sluice, session_server, "20s")
    sluice.signal(signal.SIGTERM)
    await wait_until(lambda: "draining" in sluice.stderr(), what="the drain to start")
    session_server.release.set()
    assert await sluice.wait_exit(timeout=20) == 0
    assert session_server.log == ["call", "answered", "delete"]
    [sent] = [e for e in sluice.events() if e["event"] == "session_delete_sent"]
    assert sent["status"] == 200


async def test_a_drain_cut_sends_a_waiting_delete(session_server, start_sluice):
    """Past ``drain_timeout`` the call is cut, and the DELETE that waited for it is sent
    before the process exits: the server's session ends with it."""
    sluice = await deleted_while_finishing(start_sluice, session_server, "300ms")
    sluice.signal(signal.SIGTERM)
    assert await sluice.wait_exit(timeout=20) == 0
    assert "delete" in session_server.log
    [completed] = [e for e in sluice.events() if e["event"] == "completed"
                   and e.get("mcp_method") == "tools/call"]
    assert completed["finished_after_leaving"] == "drain_cut"


async def test_a_delete_waits_for_a_polled_call_whose_answer_sluice_fetches(
        mcp_server_factory, start_sluice):
    """A call whose answer the server closed early for polling (2025-11-25), its client
    then deleting the session without resuming it: Sluice resumes the answer itself, keeps
    it for the key, and sends the DELETE after. Before: the DELETE went through, the hold
    ended with nothing kept, and the retry in a new session ran the tool again."""
    server, sluice = await polling_sluice(mcp_server_factory, start_sluice, idempotency=DEDUP)
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)
        await _closed_for_polling(http, url, headers, mcp_servers.tool_call(
            2, "poll_send", to="ops", seconds=1))
        await sluice.wait_metric("sluice_polled_calls", 1)
        async with http.delete(url, headers=headers) as r:
            assert (r.status, await r.read()) == (200, b"")
        await sluice.wait_metric("sluice_polled_calls", 0, timeout=15)
        await wait_until(lambda: any(e["event"] == "session_delete_sent"
                                     for e in sluice.events()), what="the DELETE sent")
        again = await mcp_servers.raw_session(http, url)
        async with http.post(url, json=mcp_servers.tool_call(3, "poll_send", to="ops",
                                                             seconds=1), headers=again) as r:
            replayed, body = r.headers.get("Idempotent-Replayed"), await r.text()
    assert replayed == "true" and "sent #1" in body
    assert server.sends() == 1
    [sent] = [e for e in sluice.events() if e["event"] == "session_delete_sent"]
    assert sent["status"] == 200


async def test_a_servers_ping_on_the_calls_stream_does_not_end_it_when_its_caller_leaves(
        session_server, start_sluice):
    """A server's ``ping`` on the call's stream was taken for a question its tool waited on:
    the caller leaving ended the call at once, the tool ran on at the server, nothing was
    kept, and the retry ran it again (a review). No tool waits on a ping: the call is
    finished without its caller, and the retry gets its answer."""
    session_server.first_event = {"jsonrpc": "2.0", "id": 0, "method": "ping"}
    sluice, url = await finishing_without_its_caller(start_sluice, session_server)
    async with aiohttp.ClientSession() as http:
        session_server.release.set()
        async with http.post(url, json={**CALL, "id": 8}, headers=HEADERS) as r:
            replayed, body = r.headers.get("Idempotent-Replayed"), await r.text()
    assert replayed == "true" and "done #1" in body
    assert session_server.log == ["call", "answered"]
    await assert_all_given_back(sluice)


class PolledAskingServer:
    """A ``tools/call`` answered with a priming event, an ``elicitation/create`` (both with
    event ids), then closed early for polling (SEP-1699); a resuming GET gets nothing yet.
    Logs ``call``, ``answer <id>`` (the client's response POST), ``get``, ``delete``."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.stopping = asyncio.Event()

    async def start(self) -> PolledAskingServer:
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        app.router.add_get("/mcp", self._get)
        app.router.add_delete("/mcp", self._delete)
        self.runner, self.port = await serve_app(app, handler_cancellation=True)
        return self

    async def _delete(self, request: web.Request) -> web.Response:
        self.log.append("delete")
        return web.Response(status=200)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        self.log.append("get")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await self.stopping.wait()  # the answer is not ready
        return out

    async def _post(self, request: web.Request) -> web.StreamResponse:
        message = await request.json()
        if "method" not in message:
            self.log.append(f"answer {message.get('id')}")
            return web.Response(status=202)
        self.log.append("call")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"id: e1\ndata: \n\n")
        await out.write(b"id: e2\n" + _event({"jsonrpc": "2.0", "id": 0,
                                             "method": "elicitation/create", "params": {}}))
        await out.write_eof()
        return out


async def test_a_polled_calls_answered_question_lets_its_sessions_delete_wait(start_sluice):
    """The client answered the elicitation of a call closed early for polling: its tool
    can end, so the session's DELETE must wait for it (and Sluice fetch its answer). The
    answer was looked for among live and finishing calls only, so the call stayed "waiting
    on its client", the DELETE went through at once and the held call ended with nothing
    kept for its key (a review)."""
    server = await PolledAskingServer().start()
    try:
        sluice = await start_sluice({"routes": [mcp_route(f"http://127.0.0.1:{server.port}",
                                                          idempotency=DEDUP)]})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=CALL, headers=HEADERS) as r:
                await r.read()
            await sluice.wait_metric("sluice_polled_calls", 1)
            answer = {"jsonrpc": "2.0", "id": 0, "result": {"action": "accept", "content": {}}}
            async with http.post(url, json=answer, headers=HEADERS) as r:
                assert r.status == 202
            assert await delete_session(http, url) == (200, b"")
        await wait_until(lambda: any(e.get("session_delete") == "deferred"
                                     for e in sluice.events()), what="the DELETE deferred")
        await wait_until(lambda: "get" in server.log, what="Sluice fetching the answer")
        assert "delete" not in server.log  # it waits for the call
    finally:
        server.stopping.set()
        assert server.runner is not None
        await server.runner.cleanup()


async def test_a_refused_delete_does_not_stand_for_the_owners(session_server, start_sluice):
    """Two DELETEs waited for one call: another caller's first, which the server refuses,
    then the owner's. Only the first was kept and sent: the server answered it 401, the
    owner's was never sent and the session lived on, though the owner was told 200 (a
    review). Each is kept with its own headers and sent in turn until the server takes
    one."""
    session_server.delete_needs = "Bearer owner"
    sluice, url = await finishing_without_its_caller(start_sluice, session_server)
    async with aiohttp.ClientSession() as http:
        for who in ("Bearer stranger", "Bearer owner"):
            async with http.delete(url, headers={**HEADERS, "Authorization": who}) as r:
                assert (r.status, await r.read()) == (200, b"")
        session_server.release.set()
        await asyncio.wait_for(session_server.deleted.wait(), 10)
    assert session_server.log == ["call", "answered", "delete refused", "delete"]
    await wait_until(lambda: len([e for e in sluice.events()
                                  if e["event"] == "session_delete_sent"]) == 2,
                     what="both DELETEs sent")
    assert [e["status"] for e in sluice.events()
            if e["event"] == "session_delete_sent"] == [401, 200]


@pytest.mark.parametrize("others_ended", [0, ENDED_SESSIONS_KEPT + 1])
async def test_a_call_closed_for_polling_after_its_sessions_delete_is_not_held(start_sluice,
                                                                             others_ended):
    """A hostile trial: a legacy client leaving mid-call sends its session's DELETE; the
    server ends the call's stream after its priming event (an id: polling), and Sluice read
    that end after the DELETE's answer, when nothing could resume the call any more. Held
    for polling, it kept the route's slot to ``timeouts.total`` (600 s by default).

    With ``others_ended``, other agents end their idle sessions meanwhile (a review): the
    DELETE being handled counted as its own session's call in flight, so every DELETE was
    remembered, and those pushed the one that mattered out of the 256 kept."""
    released = asyncio.Event()
    log: list[str] = []

    async def post(request: web.Request) -> web.StreamResponse:
        await request.json()
        log.append("call")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"id: e1\ndata: \n\n")
        await released.wait()  # the DELETE's answer is through Sluice first
        await out.write_eof()
        return out

    async def delete(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/mcp", post)
    app.router.add_delete("/mcp", delete)
    runner, port = await serve_app(app)
    try:
        sluice = await start_sluice({"routes": [mcp_route(
            f"http://127.0.0.1:{port}", concurrency={"limit": 1, "queue": 0})]})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as http:
            call = asyncio.create_task(http.post(url, json=CALL, headers=HEADERS))
            await wait_until(lambda: log == ["call"], what="the call at the server")
            assert await delete_session(http, url) == (200, b"")
            for n in range(others_ended):
                async with http.delete(url, headers={**HEADERS, "Mcp-Session-Id": f"o-{n}"}
                                       ) as r:
                    assert r.status == 200
            released.set()
            async with await call as r:  # read to its end: the caller stays
                assert r.status == 200 and b"id: e1" in await r.read()
            await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
            assert await sluice.metric("sluice_polled_calls") == 0
    finally:
        released.set()
        await runner.cleanup()
