"""Which MCP requests a ``dedup`` route keys (a hostile trial and a review, 2026-12-06): only
``tools/call``. Every request with an id was keyed, and by its method and name alone, so a
resource's first content was replayed for the key's ttl, a task's poll never saw the task
end, and another task's poll got the first task's status; under a ``derive_from`` step or a
session-wide ``Idempotency-Key`` a task's polls were refused 422 or replayed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from tests.conftest import route, serve_app, wait_until

HEADERS = {"Accept": "application/json, text/event-stream", "Authorization": "Bearer k"}


async def _rpc(session: aiohttp.ClientSession, url: str, rpc_id: int, method: str,
               params: dict, headers: dict | None = None) -> tuple[dict, str | None]:
    async with session.post(url, headers={**HEADERS, **(headers or {})}, json={
            "jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params}) as r:
        assert r.status == 200, await r.text()
        return await r.json(), r.headers.get("Idempotent-Replayed")


async def mcp_endpoint(handle: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> tuple[web.AppRunner, int]:
    """``handle`` serving ``POST /mcp`` on a free loopback port: its runner (to clean up) and
    its port."""
    app = web.Application()
    app.router.add_post("/mcp", handle)
    return await serve_app(app)


async def test_only_a_tool_call_is_keyed_by_its_payload(start_sluice):
    seen: list[tuple[str, dict]] = []

    async def handle(request: web.Request) -> web.Response:
        doc = await request.json()
        params = doc.get("params", {})
        seen.append((doc["method"], params))
        n = len(seen)
        if doc["method"] == "tasks/get":  # a task that ends after its first poll
            first_poll = [m for m, _ in seen].count("tasks/get") == 1
            result = {"taskId": params["taskId"], "status": "working" if first_poll
                      else "completed"}
        elif doc["method"] == "tools/call" and "task" in params:
            result = {"task": {"taskId": f"task-{n}", "status": "working"}}
        else:
            result = {"read": n}
        return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": result})

    runner, port = await mcp_endpoint(handle)
    try:
        sluice = await start_sluice({"routes": [route(
            "tools", f"http://127.0.0.1:{port}", "mcp", idempotency={"mode": "dedup"})]})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as session:
            reads = [await _rpc(session, url, i, "resources/read", {"uri": "counter://x"})
                     for i in range(1, 3)]
            assert [(doc["id"], doc["result"], replayed) for doc, replayed in reads] == [
                (1, {"read": 1}, None), (2, {"read": 2}, None)]
            polls = [await _rpc(session, url, i, "tasks/get", {"taskId": task})
                     for i, task in ((3, "t-1"), (4, "t-1"), (5, "t-2"))]
            assert [doc["result"] for doc, _ in polls] == [
                {"taskId": "t-1", "status": "working"}, {"taskId": "t-1", "status": "completed"},
                {"taskId": "t-2", "status": "completed"}]
            # A tool call is still one call by its payload, and asking for it as a task
            # is another call (its answer is a task, not the tool's result).
            plain = {"name": "send", "arguments": {"to": "a"}}
            first, _ = await _rpc(session, url, 6, "tools/call", plain)
            again, replayed = await _rpc(session, url, 7, "tools/call",
                                         {**plain, "_meta": {"progressToken": 7}})
            assert (again["id"], again["result"], replayed) == (7, first["result"], "true")
            as_task, replayed = await _rpc(session, url, 8, "tools/call",
                                           {**plain, "task": {"ttl": 60000}})
            assert (as_task["result"], replayed) == ({"task": {"taskId": "task-7",
                                                               "status": "working"}}, None)
        assert [method for method, _ in seen] == ["resources/read"] * 2 + ["tasks/get"] * 3 + [
            "tools/call"] * 2
    finally:
        await runner.cleanup()


async def _task_server() -> tuple[web.AppRunner, int, list[str]]:
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        doc = await request.json()
        seen.append(doc["method"])
        if doc["method"] == "tools/call":
            result = {"task": {"taskId": "t-1", "status": "working"}}
        else:  # tasks/get: the task ends after its first poll
            done = seen.count("tasks/get") > 1
            result = {"taskId": "t-1", "status": "completed" if done else "working"}
        return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": result})

    runner, port = await mcp_endpoint(handle)
    return runner, port, seen


async def test_a_task_poll_in_a_derive_from_step_reaches_the_server(start_sluice):
    """A task-augmented tool call and its ``tasks/get`` polls carry the step's headers: the
    first poll was refused 422 (another payload under the call's key)."""
    runner, port, seen = await _task_server()
    try:
        sluice = await start_sluice({"routes": [route(
            "tools", f"http://127.0.0.1:{port}", "mcp",
            idempotency={"mode": "dedup", "derive_from": ["X-Run-ID", "X-Step-ID"]})]})
        url = sluice.url + "/tools/mcp"
        step = {"X-Run-ID": "run-1", "X-Step-ID": "step-1"}
        async with aiohttp.ClientSession() as session:
            await _rpc(session, url, 1, "tools/call", {  # each answered 200 (_rpc)
                "name": "send", "arguments": {"to": "a"}, "task": {"ttl": 60000}}, step)
            polls = [await _rpc(session, url, i, "tasks/get", {"taskId": "t-1"}, step)
                     for i in (2, 3)]
            again = await _rpc(session, url, 4, "tools/call", {
                "name": "send", "arguments": {"to": "a"}, "task": {"ttl": 60000}}, step)
        assert [doc.get("result", doc.get("error")) for doc, _ in polls] == [
            {"taskId": "t-1", "status": "working"}, {"taskId": "t-1", "status": "completed"}]
        assert again[1] == "true"  # the step's tool call is still one call
        assert seen == ["tools/call", "tasks/get", "tasks/get"]
    finally:
        await runner.cleanup()


async def test_a_task_poll_with_a_session_wide_idempotency_key_is_not_replayed(start_sluice):
    """An MCP client sets headers per transport (session), not per request: one with an
    ``Idempotency-Key`` among them sends it on every poll, and the second was replayed."""
    runner, port, seen = await _task_server()
    try:
        sluice = await start_sluice({"routes": [route(
            "tools", f"http://127.0.0.1:{port}", "mcp", idempotency={"mode": "dedup"})]})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as session:
            polls = [await _rpc(session, url, i, "tasks/get", {"taskId": "t-1"},
                                {"Idempotency-Key": "session-wide"}) for i in (2, 3)]
        assert [(doc["result"]["status"], replayed) for doc, replayed in polls] == [
            ("working", None), ("completed", None)]
        assert seen == ["tasks/get", "tasks/get"]
    finally:
        await runner.cleanup()


async def test_a_sessions_management_and_a_tasks_follow_ups_take_no_slot_nor_run_count(
        start_sluice):
    """A hostile trial: ``logging/setLevel``, ``completion/complete``, subscriptions and a
    task's ``tasks/get``/``tasks/cancel`` were calls: a run at its ``max_requests`` was
    refused ``run_budget_exhausted`` for cancelling its own task, and ``logging/setLevel``
    queued behind a tool call for the route's one slot, then was refused ``queue_timeout``."""
    seen: list[str] = []
    release = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        doc = await request.json()
        seen.append(doc["method"])
        if doc["method"] == "tools/call":
            await release.wait()
        return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": {}})

    runner, port = await mcp_endpoint(handle)
    try:
        sluice = await start_sluice({"routes": [route(
            "tools", f"http://127.0.0.1:{port}", "mcp", run={"max_requests": 1},
            concurrency={"limit": 1, "queue": 1, "max_wait": "30s"})]})
        url = sluice.url + "/tools/mcp"
        run = {"X-Run-ID": "r1"}
        async with aiohttp.ClientSession() as session:
            slot = asyncio.create_task(_rpc(session, url, 1, "tools/call",
                                            {"name": "slow", "arguments": {}}, run))
            await wait_until(lambda: seen == ["tools/call"], what="the slot taken")
            follow_ups = [("logging/setLevel", {"level": "debug"}),
                          ("completion/complete", {"ref": {"type": "ref/prompt", "name": "p"},
                                                   "argument": {"name": "a", "value": "x"}}),
                          ("resources/subscribe", {"uri": "counter://x"}),
                          ("resources/unsubscribe", {"uri": "counter://x"}),
                          ("tasks/get", {"taskId": "t-1"}),
                          ("tasks/result", {"taskId": "t-1"}),
                          ("tasks/cancel", {"taskId": "t-1"})]
            for i, (method, params) in enumerate(follow_ups, start=2):
                doc, _ = await _rpc(session, url, i, method, params, run)
                assert doc == {"jsonrpc": "2.0", "id": i, "result": {}}, method
            release.set()
            await slot
        assert seen == ["tools/call", *(method for method, _ in follow_ups)]
        assert await sluice.metric("sluice_rejections_total", route="tools",
                                   reason="run_budget_exhausted") == 0
    finally:
        release.set()
        await runner.cleanup()


async def test_an_sse_answer_with_bare_cr_line_ends_is_kept_for_its_key(start_sluice):
    """A hostile trial: SSE lines may end in a lone CR; the answer's last byte was that CR,
    held back in case an LF followed, so its response event was never seen, nothing was kept
    for the key and the retry ran the tool again."""
    seen: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        seen.append(doc["method"])
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        answer = {"jsonrpc": "2.0", "id": doc["id"],
                  "result": {"content": [{"type": "text", "text": f"run {len(seen)}"}]}}
        await out.write(b"event: message\rdata: " + json.dumps(answer).encode() + b"\r\r")
        await out.write_eof()
        return out

    runner, port = await mcp_endpoint(handle)
    try:
        sluice = await start_sluice({"routes": [route(
            "tools", f"http://127.0.0.1:{port}", "mcp", idempotency={"mode": "dedup"})]})
        url = sluice.url + "/tools/mcp"
        call = {"name": "send", "arguments": {"to": "ops"}}
        async with aiohttp.ClientSession() as session:
            answers = []
            for rpc_id in (1, 2):
                async with session.post(url, headers=HEADERS, json={
                        "jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
                        "params": call}) as r:
                    answers.append((r.headers.get("Idempotent-Replayed"), await r.text()))
        assert seen == ["tools/call"]  # the retry was replayed, not run again
        assert answers[1][0] == "true" and "run 1" in answers[1][1]
    finally:
        await runner.cleanup()


# -- MRTR continuations (2026-07-28), through the official 2.x client and server ---------------

from mcp import Client, MCPError, types  # noqa: E402

from tests import mcp_servers  # noqa: E402

mcp_stateless = mcp_servers.mcp_stateless


def mcp_route(upstream: str) -> dict:
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream, "protocol": "mcp",
            "idempotency": {"mode": "dedup", "max_wait": "30s"}}


async def accept(ctx: object, params: types.ElicitRequestParams) -> types.ElicitResult:
    return types.ElicitResult(action="accept", content={"ok": True})


async def test_a_continuation_retried_after_a_timeout_runs_the_tool_once(mcp_stateless,
                                                                         start_sluice):
    """A tool that asks its user first (an ``InputRequiredResult`` round; the client sends
    the call again with ``inputResponses`` and the sealed ``requestState``), then has a slow
    side effect; the call times out and the application calls the tool again. The retry's
    continuation is the same call as the first's, so it gets the first's answer: one side
    effect. Before: its ``requestState``, sealed with a random nonce, made every
    continuation a call of its own, and each retry ran the tool again (three sends)."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_stateless.base_url)]})
    answers = []
    async with Client(sluice.url + "/tools/mcp", elicitation_callback=accept) as client:
        for _ in range(3):
            try:
                result = await client.call_tool("confirm_slowly", {"to": "ops", "seconds": 2},
                                                read_timeout_seconds=1.0)
            except MCPError as timed_out:
                answers.append(str(timed_out))
            else:
                answers.append(result.content[0].text)
                break
    assert answers[-1] == "sent #1", answers
    assert mcp_stateless.sends() == 1


async def test_continuations_after_different_answers_stay_apart(mcp_stateless, start_sluice):
    """Two rounds: the second continuation's ``inputResponses`` hold only the second answer,
    the first rides in the sealed ``requestState``. Two clients that answer the first
    question differently and the second alike make two different calls: each runs the tool
    and gets its own result, not the other's replayed (a fingerprint that left the state
    out, and put nothing in its place, would give the second client the first's)."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_stateless.base_url)]})

    def answering(first: bool) -> object:
        async def answer(ctx: object, params: types.ElicitRequestParams) -> types.ElicitResult:
            ok = first if params.message == "first?" else True
            return types.ElicitResult(action="accept", content={"ok": ok})
        return answer

    results = []
    for first in (True, False, True):
        async with Client(sluice.url + "/tools/mcp",
                          elicitation_callback=answering(first)) as client:
            result = await client.call_tool("ask_twice", {"to": "ops"})
            results.append(result.content[0].text)
    assert results == ["first=True second=True", "first=False second=True",
                       "first=True second=True"]
    assert [s["body"] for s in mcp_stateless.sent()] == ["first=True second=True",
                                                         "first=False second=True"]
