"""A hostile review of MCP tool calls and runs (round 35): each case failed before its fix.

1. A tool call Sluice ends with its own ``upstream_timeout`` (504) or ``upstream_unreachable``
   (502) before the upstream's answer began (a JSON-answering server, a tool's
   ``timeouts.total``; a server that drops the connection) was answered with that HTTP status.
   The Python ``mcp`` 1.x client ends its *whole session* on any status from 400 up but 404
   (docs/mcp.md): the session's other calls in flight were cancelled and every later call
   failed, where the same timeout once the answer had begun (an SSE server) failed that one
   call only. Such a call is now answered as every other per-call refusal on an ``mcp`` route:
   HTTP 200 and the JSON-RPC error (code 504 / 502, ``data.reason``).
2. A call whose SSE answer the server closes early for polling (2025-11-25, SEP-1699: a
   priming event with an id, then a clean end; the client resumes it with a GET carrying
   ``Last-Event-ID``) is settled by Sluice when that POST ends, while its tool is still
   running at the server: its key is given back with no answer kept (the resumed GET, which
   carries the response, keeps nothing for it either), and its slot too. So on a ``dedup``
   route the same call again ran the tool a second time instead of being replayed, and a
   tool's ``concurrency.limit`` let more calls run at the server than it allows. Such a
   call now stays in flight, holding everything it took, until its response comes on the
   resumed GET (its answer then kept for its key), its ``timeouts.total`` passes, its run
   is cancelled or the drain cuts it.
3. A replayed answer (``dedup``) held every event of the first call's SSE answer, the
   server's requests to its client included: an ``elicitation/create`` (a tool asking its
   user to confirm) or a ``sampling/createMessage`` (an LLM call the client makes) was asked
   again of the retrying client, for a tool that did not run again; its reply went to a
   server that no longer waited for it, so a user declining the second time was told
   ``sent #1`` all the same. A replay now carries no server request.
4. A session's GET stream, silent for its whole life with the official servers (their normal
   state: Sluice counts no stall on it), was cut at ``timeouts.idle`` and counted and logged
   ``upstream_timeout``: one per open session every ``idle`` (10 min by default) in
   ``sluice_requests_total`` and the dashboard's "Requests by outcome", for upstreams that
   were fine. It now ends as its client closing it does, ``2xx``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests import mcp_servers
from tests.conftest import free_port, wait_until
from tests.test_operations import MCP1_PYTHON, run_mcp1

mcp_server_factory = mcp_servers.mcp_server_factory

CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "send", "arguments": {"to": "ops"}}}
HEADERS = {"Accept": "application/json, text/event-stream"}

MCP1_ONE_CALL_TIMES_OUT = """
import asyncio, json, sys
from datetime import timedelta
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

def said(exc):
    error = getattr(exc, "error", None)
    return {"raised": type(exc).__name__, "code": getattr(error, "code", None),
            "data": getattr(error, "data", None)}

async def main(url):
    out = {}
    try:
        async with streamablehttp_client(url) as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                async def other():
                    try:
                        r = await session.call_tool("slow", {"seconds": 2},
                                                    read_timeout_seconds=timedelta(seconds=10))
                        out["other"] = r.content[0].text
                    except BaseException as exc:
                        out["other"] = said(exc)
                        raise
                task = asyncio.create_task(other())
                await asyncio.sleep(0.3)
                try:
                    await session.call_tool("send_slowly", {"to": "ops", "seconds": 4},
                                            read_timeout_seconds=timedelta(seconds=10))
                    out["timed"] = "answered"
                except BaseException as exc:
                    out["timed"] = said(exc)
                await asyncio.gather(task, return_exceptions=True)
                r = await session.call_tool("add", {"a": 1, "b": 2},
                                            read_timeout_seconds=timedelta(seconds=10))
                out["add"] = r.content[0].text
    except BaseException as exc:
        out["session"] = f"{type(exc).__name__}: {exc}"[:300]
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_mcp1_session_survives_a_tool_timing_out_before_its_answer_began(
        mcp_server_factory, start_sluice, tmp_path):
    """Before: ``send_slowly`` got HTTP 504; the 1.x client raised it out of its transport,
    the concurrent ``slow`` call was cancelled, ``add`` never ran, and the session ended
    with an ``ExceptionGroup``."""
    server = mcp_server_factory("session", json_response=True)
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
        "protocol": "mcp", "tools": {"send_slowly": {"timeouts": {"total": "1s"}}}}]})
    out = await run_mcp1(tmp_path / "mcp1_timeout.py", MCP1_ONE_CALL_TIMES_OUT,
                         sluice.url + "/tools/mcp")
    assert "session" not in out, out
    assert out["timed"]["code"] == 504, out
    assert out["timed"]["data"]["reason"] == "upstream_timeout"
    assert out["other"] == "slept" and out["add"] == "3"
    assert await sluice.metric("sluice_operation_requests_total", route="tools",
                               operation="send_slowly", outcome="upstream_timeout") == 1


async def test_a_call_whose_upstream_is_unreachable_is_answered_as_a_jsonrpc_error(
        start_sluice):
    """Before: HTTP 502 (the 1.x client's session ended on it). A notification and a GET,
    which have no id to answer, keep the HTTP status."""
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": closed, "protocol": "mcp"}]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=CALL, headers=HEADERS) as r:
            status, reason, body = r.status, r.headers["X-Sluice-Reason"], await r.read()
        assert (status, reason) == (200, "upstream_unreachable")
        answer: Any = json.loads(body)
        assert answer["id"] == 7 and answer["error"]["code"] == 502
        assert answer["error"]["data"]["reason"] == "upstream_unreachable"
        async with http.get(url, headers={"Accept": "text/event-stream"}) as r:
            assert r.status == 502
    def completed() -> list[dict]:
        return [e for e in sluice.events() if e["event"] == "completed"
                and e.get("operation") == "send"]

    await wait_until(completed, what="the call's completed event")
    [ended] = completed()
    assert ended["outcome"] == "upstream_error" and ended["status"] == 502


#: ``tools`` giving ``poll`` one slot and no queue: a second call at once is refused.
ONE_POLL = {"poll": {"concurrency": {"limit": 1, "queue": 0}}}


async def polling_sluice(mcp_server_factory: Any, start_sluice: Any,
                         env: dict[str, str] | None = None,
                         **policies: object) -> tuple[Any, Any]:
    """The resumable session-mode server, which closes a call's answer early for polling
    (its ``poll`` and ``poll_send`` tools), behind a Sluice whose ``mcp`` route ``tools``
    (``/tools/``) has ``policies``: the server and the Sluice."""
    server = mcp_server_factory("session", resumable=True)
    route = {"name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
             "protocol": "mcp", **policies}
    extra = {"env": env} if env is not None else {}
    return server, await start_sluice({"routes": [route]}, **extra)


async def held_poll(http: aiohttp.ClientSession, url: str, sluice: Any) -> dict[str, str]:
    """A session on ``url`` whose ``poll`` call (id 2, 10 s) the server closed early for
    polling, now held by ``sluice`` for its response: the session's headers."""
    headers = await mcp_servers.raw_session(http, url)
    await _closed_for_polling(http, url, headers, mcp_servers.tool_call(2, "poll",
                                                                        seconds=10))
    await sluice.wait_metric("sluice_polled_calls", 1)
    return headers


async def test_a_polled_calls_answer_is_kept_for_its_key(mcp_server_factory, start_sluice):
    """Before: ``sent #2``: the second identical call ran the tool again; a call answered on
    its POST is replayed (``sent #1``)."""
    from mcp import Client

    server, sluice = await polling_sluice(mcp_server_factory, start_sluice,
                                          idempotency={"mode": "dedup", "max_wait": "30s"})
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        first = await client.call_tool("poll_send", {"to": "ops", "seconds": 0.3},
                                       read_timeout_seconds=20)
        assert first.content[0].text == "sent #1"
        again = await client.call_tool("poll_send", {"to": "ops", "seconds": 0.3},
                                       read_timeout_seconds=20)
        assert again.content[0].text == "sent #1", "the tool ran a second time"
    assert server.sends() == 1


async def test_a_polled_call_holds_its_tools_slot_while_its_tool_runs(mcp_server_factory,
                                                                      start_sluice):
    """Before: with ``poll`` limited to one call at a time and no queue, a second ``poll``
    was sent while the first one's tool still ran at the server (its POST closed early for
    polling): two at once. The first call now ends when its response comes on the resumed
    GET: its ``completed`` event is written then, once, and not when its POST closed."""
    from mcp import Client, MCPError

    _, sluice = await polling_sluice(mcp_server_factory, start_sluice, tools=ONE_POLL)

    def completed() -> list[dict]:
        return [e for e in sluice.events() if e["event"] == "completed"
                and e.get("operation") == "poll"]

    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        first = asyncio.create_task(client.call_tool("poll", {"seconds": 4.0},
                                                     read_timeout_seconds=20))
        # Its POST closed for polling: held for its response.
        await sluice.wait_metric("sluice_polled_calls", 1)
        assert not first.done()  # its tool still runs; its answer comes on the resumed GET
        with pytest.raises(MCPError) as refused:
            await client.call_tool("poll", {"seconds": 0.1}, read_timeout_seconds=20)
        assert refused.value.error.data["reason"] == "queue_full"
        assert (await first).content[0].text == "polled"
    await wait_until(completed, what="the first call's completed event")
    [ended] = completed()
    assert ended["outcome"] == "2xx" and ended["status"] == 200
    assert ended["duration_s"] >= 3.5  # to its response, not to its POST's early close
    await sluice.wait_metric("sluice_polled_calls", 0)
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")


async def test_a_replay_does_not_ask_the_client_again_what_the_first_call_asked(
        mcp_server_factory, start_sluice):
    """Before: the elicitation callback ran twice (the second for nothing: the tool ran
    once, and the server never read the second reply)."""
    from mcp import Client, types

    server = mcp_server_factory("session")
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
        "protocol": "mcp", "idempotency": {"mode": "dedup", "max_wait": "30s"}}]})
    asked: list[Any] = []

    async def confirm(context: Any, params: Any) -> Any:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"ok": True})

    async with Client(sluice.url + "/tools/mcp", mode="legacy",
                      elicitation_callback=confirm) as client:
        first = await client.call_tool("confirm_send", {"to": "ops"}, read_timeout_seconds=20)
        again = await client.call_tool("confirm_send", {"to": "ops"}, read_timeout_seconds=20)
    assert first.content[0].text == again.content[0].text == "sent #1"
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 1
    assert server.sends() == 1
    assert asked == ["send to ops?"]


def test_a_replayed_sse_answer_keeps_everything_but_the_servers_requests_and_progress() -> None:
    """And not the first call's progress (a hostile trial, 2026-12-06): its token is the
    first call's request id, which in the retrying session named another call in flight."""
    from policies.mcp import for_replay

    request = (b'id: 1\r\nevent: message\r\ndata: {"jsonrpc":"2.0","id":0,'
               b'"method":"sampling/createMessage","params":{}}\r\n\r\n')
    progress = (b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/progress",'
                b'"params":{"progressToken":1,"progress":1}}\n\n')
    rest = (b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/message",'
            b'"params":{}}\n\n: keep-alive\n\nid: 2\ndata: {"jsonrpc":"2.0",\n'
            b'data: "id":5,"result":{}}\n\n')
    assert for_replay(request + progress + rest, "text/event-stream") == rest
    assert for_replay(progress + rest, "text/event-stream") == rest
    assert for_replay(rest, "text/event-stream") is rest
    as_json = b'{"jsonrpc":"2.0","id":5,"result":{}}'
    assert for_replay(as_json, "application/json") is as_json


async def test_an_idle_session_stream_cut_at_timeouts_idle_is_no_upstream_timeout(
        mcp_server_factory, start_sluice):
    """Before: each idle cut of the GET stream was an ``upstream_timeout``."""
    from mcp import Client

    server = mcp_server_factory("session")
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
        "protocol": "mcp", "timeouts": {"idle": "1s"}}]})

    def streams_ended() -> list[dict]:  # the session's GET streams (no JSON-RPC method)
        return [e for e in sluice.events() if e["event"] == "completed"
                and e.get("mcp_method") is None]

    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        await wait_until(streams_ended, what="the idle GET stream cut", timeout=15)
        assert (await client.call_tool("add", {"a": 1, "b": 2})).content[0].text == "3"
        [ended, *_] = streams_ended()
    assert ended["outcome"] == "2xx", ended
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="upstream_timeout") == 0


async def _closed_for_polling(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                              body: dict[str, Any]) -> str:
    """Post a ``poll`` call by hand and read its SSE answer, which the server closes early
    for polling (a priming event with an id, no response); its last event id."""
    async with http.post(url, json=body, headers=headers) as r:
        assert r.status == 200
        answer = (await r.read()).decode()
    assert '"result"' not in answer, answer
    return [line[3:].strip() for line in answer.splitlines() if line.startswith("id:")][-1]


async def _resumed(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    """Resume a polled answer with a GET (``headers`` carry ``Last-Event-ID``) and read it
    up to the call's response."""
    body = ""
    async with http.get(url, headers={**headers, "Accept": "text/event-stream"}) as r:
        assert r.status == 200
        async for line in r.content:
            body += line.decode()
            if '"result"' in body and not line.strip():  # the response's event has ended
                break
    return body


def _completed(sluice: Any, tool: str) -> list[dict]:
    return [e for e in sluice.events() if e["event"] == "completed"
            and e.get("operation") == tool]


async def test_a_polled_call_never_resumed_is_ended_at_its_timeouts_total(
        mcp_server_factory, start_sluice):
    """A polled call whose client never resumes its answer holds its slot until its tool's
    ``timeouts.total`` (from its sending) has passed, then ends ``upstream_timeout``: one
    ``completed`` event, nothing left in flight, the slot free again."""
    _, sluice = await polling_sluice(
        mcp_server_factory, start_sluice,
        tools={"poll": {"timeouts": {"total": "1.5s"},
                        "concurrency": {"limit": 1, "queue": 0}}})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await held_poll(http, url, sluice)
        assert await sluice.metric("sluice_inflight_requests", route="tools") == 1
        assert _completed(sluice, "poll") == []  # not over when its POST closed
        async with http.post(url, json=mcp_servers.tool_call(3, "poll", seconds=0),
                             headers=headers) as r:
            refused = json.loads(await r.read())
        assert refused["error"]["data"]["reason"] == "queue_full"
        await sluice.wait_metric("sluice_polled_calls", 0, timeout=15)
        await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
        await wait_until(lambda: _completed(sluice, "poll"), what="the call's end")
        [ended] = _completed(sluice, "poll")
        assert ended["outcome"] == "upstream_timeout" and ended["status"] == 200, ended
        assert ended["duration_s"] >= 1.4
        # Its slot is free: the next call is sent (and held in its turn).
        await _closed_for_polling(http, url, headers, mcp_servers.tool_call(4, "poll",
                                                                            seconds=0.1))
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="upstream_timeout") == 1


async def test_a_polled_call_ends_with_its_runs_cancel(mcp_server_factory, start_sluice):
    """A run's cancel reaches a call held for its polled answer: it ends ``run_cancelled``,
    and gives back its key at once (nothing kept for it)."""
    _, sluice = await polling_sluice(
        mcp_server_factory, start_sluice, idempotency={"mode": "dedup", "max_wait": "30s"},
        env={"SLUICE_ADMIN_TOKEN": "trial-poll-token"})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = {**await mcp_servers.raw_session(http, url), "X-Run-ID": "r1"}
        await _closed_for_polling(http, url, headers, mcp_servers.tool_call(
            2, "poll_send", to="ops", seconds=10))
        await sluice.wait_metric("sluice_polled_calls", 1)
        async with http.post(f"{sluice.admin_url}/admin/runs/r1/cancel",
                             headers={"Authorization": "Bearer trial-poll-token"}) as r:
            cancelled = await r.json()
        assert cancelled["calls_ended"] == 1, cancelled
        await sluice.wait_metric("sluice_polled_calls", 0)
        await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
        await wait_until(lambda: _completed(sluice, "poll_send"), what="the call's end")
        [ended] = _completed(sluice, "poll_send")
        assert ended["outcome"] == "run_cancelled", ended
        # Its key is free: the same call, in another run, is sent again (not replayed).
        again = {**headers, "X-Run-ID": "r2"}
        last_id = await _closed_for_polling(http, url, again, mcp_servers.tool_call(
            3, "poll_send", to="ops", seconds=0.1))
        assert '"sent #2"' in await _resumed(http, url, {**again, "Last-Event-ID": last_id})
    await sluice.wait_metric("sluice_polled_calls", 0)
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 0


async def test_a_retry_of_a_polled_call_still_running_waits_for_its_answer(
        mcp_server_factory, start_sluice):
    """A client's retry of a polled call whose tool still runs (its timeout, then the same
    call again) waits for the first call's key and gets its answer replayed, with its own
    id, once the first call's response comes on the resumed GET: the tool runs once."""
    server, sluice = await polling_sluice(mcp_server_factory, start_sluice,
                                          idempotency={"mode": "dedup", "max_wait": "30s"})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)
        last_id = await _closed_for_polling(http, url, headers, mcp_servers.tool_call(
            2, "poll_send", to="ops", seconds=1.0))
        await sluice.wait_metric("sluice_polled_calls", 1)

        async def retry() -> str:
            async with http.post(url, json=mcp_servers.tool_call(
                    3, "poll_send", to="ops", seconds=1.0), headers=headers) as r:
                return (await r.read()).decode()

        retried = asyncio.create_task(retry())
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        first = await _resumed(http, url, {**headers, "Last-Event-ID": last_id})
        assert '"sent #1"' in first and '"id":2' in first.replace(" ", ""), first
        again = await retried
    assert '"sent #1"' in again and '"id":3' in again.replace(" ", ""), again
    assert server.sends() == 1
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 1
