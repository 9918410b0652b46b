"""Per-operation policies end to end (issue 11): ``tools:`` on mcp routes, ``endpoints:`` on
http routes, ``models:`` on openai routes, tool costs in budgets, reloads.

MCP tests use the official ``mcp`` SDK on both sides: the server of ``tests/mcp_servers.py``
in its own process behind a real Sluice process, the 2.x ``Client`` in this process (both its
handshake era ``mode="legacy"`` and its default, which sends ``Mcp-Method`` / ``Mcp-Name``),
and the 1.x client in a child process where ``.venv-mcp1`` exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import yaml
from mcp import Client, MCPError

from proxy.config import StrictLoader
from tests import mcp_servers
from tests.conftest import REPO, wait_until
from tests.redis_servers import delete_prefix, new_prefix, require_redis

mcp_stateless = mcp_servers.mcp_stateless
mcp_session = mcp_servers.mcp_session

MCP1_PYTHON = REPO / ".venv-mcp1" / "bin" / "python"


async def run_mcp1(path: Path, source: str, *args: str) -> Any:
    """Run ``source`` (a script using the mcp 1.x client) with ``.venv-mcp1``'s Python and
    ``args``; its JSON output. Fails the test if it exits non-zero or takes over 60 s."""
    path.write_text(source)
    proc = await asyncio.create_subprocess_exec(
        str(MCP1_PYTHON), str(path), *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    return json.loads(out)


def mcp_route(upstream: str, **policies: Any) -> dict:
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream,
            "protocol": "mcp", **policies}


def endpoint(sluice: Any) -> str:
    return sluice.url + "/tools/mcp"


def text(result: Any) -> str:
    return result.content[0].text


async def flushed(sluice: Any, operation: str, count: int = 1) -> list[dict]:
    """The event log once it holds ``count`` ``completed`` events of ``operation``, the test's
    last calls: it is flushed every 0.2 s, in order, so what came before them is there too (a
    fixed 0.3 s sleep assumed a busy machine's Sluice flushed on time)."""
    def written() -> bool:
        return sum(e["event"] == "completed" and e.get("operation") == operation
                   for e in sluice.events()) >= count

    await wait_until(written, what=f"{count} completed {operation} event(s) in the log")
    return sluice.events()


async def finished(sluice: Any, operation: str, route: str = "tools") -> float:
    """``sluice_operation_requests_total`` of ``operation``, every outcome: an answered call
    whose client closed the connection right after the result (the MCP SDKs may) counts as
    ``client_disconnected``, not ``2xx``."""
    return sum(value for (name, labels), value in (await sluice.metrics()).items()
               if name == "sluice_operation_requests_total"
               and ("operation", operation) in labels and ("route", route) in labels)


def rewrite(path: Path, mutate: Any) -> None:
    """Change the YAML config at ``path`` as an editor does: write aside, rename over."""
    data = yaml.load(path.read_text(), Loader=StrictLoader)
    mutate(data)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


# -- a slow tool at its limit, the fast one served at once ---------------------------------------

SLOW_LIMITED = {"concurrency": {"limit": 8, "queue": 8, "max_wait": "20s"},
                "tools": {"slow": {"concurrency": {"limit": 1, "queue": 4, "max_wait": "20s"}}}}


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_slow_tool_at_its_limit_while_the_fast_tool_is_served(mcp_stateless, start_sluice,
                                                                    mode):
    """Before: at a route ``limit: 1`` a fast ``add`` waited behind every slow call. Now
    ``slow`` has its own limit of 1 and queues behind itself only."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_stateless.base_url, **SLOW_LIMITED)]})
    async with Client(endpoint(sluice), mode=mode) as client:
        slows = [asyncio.create_task(client.call_tool("slow", {"seconds": 2.0}))
                 for _ in range(3)]
        # Two of the three wait in the slow tool's queue.
        await wait_until(lambda: sum(e["event"] == "enqueued" for e in sluice.events()) == 2,
                         what="two slow calls queued")
        result = await client.call_tool("add", {"a": 2, "b": 3})
        assert text(result) == "5"
        assert sum(task.done() for task in slows) < 3  # served while slow calls were waiting
        assert [text(r) for r in await asyncio.gather(*slows)] == ["slept"] * 3
    events = await flushed(sluice, "slow", 3)
    queued = [e for e in events if e["event"] == "enqueued"]
    assert [e["operation"] for e in queued] == ["slow", "slow"]
    completed = {e["operation"] for e in events if e["event"] == "completed"
                 and "operation" in e}
    assert completed == {"slow", "add"}
    assert await finished(sluice, "slow") == 3
    assert await finished(sluice, "add") == 1


MCP1_SLOW_AND_ADD = """
import asyncio, json, sys, time
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

async def main(url):
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            slows = [asyncio.create_task(session.call_tool("slow", {"seconds": 2.0}))
                     for _ in range(3)]
            await asyncio.sleep(0.5)
            added = await session.call_tool("add", {"a": 2, "b": 3})
            pending = sum(not t.done() for t in slows)
            done = await asyncio.gather(*slows)
            print(json.dumps({"add": added.content[0].text, "pending_at_add": pending,
                              "slow": [r.content[0].text for r in done]}))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_mcp1_client_fast_tool_not_behind_the_slow_one(mcp_session, start_sluice,
                                                             tmp_path):
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url, **SLOW_LIMITED)]})
    result = await run_mcp1(tmp_path / "mcp1_client.py", MCP1_SLOW_AND_ADD, endpoint(sluice))
    assert result["add"] == "5" and result["slow"] == ["slept"] * 3
    assert result["pending_at_add"] >= 1  # add came back while slow calls still waited
    assert await finished(sluice, "slow") == 3


# -- one tool's failures open its breaker only ---------------------------------------------------


async def test_failing_tool_opens_its_own_breaker_only(mcp_session, start_sluice):
    breaker = {"fail_max": 2, "reset_timeout": "60s"}
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_session.base_url, circuit_breaker={"fail_max": 2, "reset_timeout": "60s"},
        tools={"fail": {"circuit_breaker": breaker}, "add": {"circuit_breaker": breaker}})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        for _ in range(2):  # isError results: the tool ran and failed
            failed = await client.call_tool("fail", {"message": "boom"})
            assert failed.is_error and "boom" in text(failed)
        with pytest.raises(MCPError) as refused:
            await client.call_tool("fail", {})
        assert refused.value.error.code == 503
        assert refused.value.error.data["reason"] == "circuit_open"
        for n in range(4):  # the other tool, and the route, stay available
            assert text(await client.call_tool("add", {"a": n, "b": 1})) == str(n + 1)
    assert await sluice.metric("sluice_operation_rejections_total", route="tools",
                               operation="fail", reason="circuit_open") == 1
    assert await sluice.metric("sluice_circuit_state", route="tools") == 0
    assert await sluice.metric("sluice_operation_circuit_state", route="tools",
                               operation="fail") == 2
    assert await sluice.metric("sluice_operation_circuit_state", route="tools",
                               operation="add") == 0
    events = await flushed(sluice, "add", 4)
    opened = [e for e in events if e["event"] == "circuit_opened"]
    assert [(e["route"], e["operation"]) for e in opened] == [("tools", "fail")]


async def test_tool_errors_off_counts_transport_failures_only(mcp_stateless, start_sluice):
    sluice = await start_sluice({"routes": [mcp_route(mcp_stateless.base_url, tools={
        "fail": {"circuit_breaker": {"fail_max": 1, "tool_errors": False}}})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        for _ in range(3):  # isError results, each forwarded: the breaker stays closed
            assert (await client.call_tool("fail", {})).is_error
    assert await sluice.metric("sluice_operation_circuit_state", route="tools",
                               operation="fail") == 0


MCP1_SEQUENCE = """
import asyncio, json, sys
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

async def main(url, calls):
    out = []
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            for name, args in calls:
                try:
                    r = await asyncio.wait_for(session.call_tool(name, args), 10)
                    out.append({"ok": r.content[0].text, "is_error": r.isError})
                except Exception as exc:
                    error = getattr(exc, "error", None)
                    out.append({"raised": type(exc).__name__,
                                "code": getattr(error, "code", None),
                                "data": getattr(error, "data", None)})
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_mcp1_client_tool_breaker_fails_only_that_tool(mcp_session, start_sluice,
                                                              tmp_path):
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_session.base_url, tools={"fail": {"circuit_breaker": {"fail_max": 2,
                                                                   "reset_timeout": "60s"}}})]})
    calls = [["fail", {}], ["fail", {}], ["fail", {}], ["add", {"a": 1, "b": 2}]]
    results = await run_mcp1(tmp_path / "mcp1_sequence.py", MCP1_SEQUENCE, endpoint(sluice),
                             json.dumps(calls))
    assert [r.get("is_error") for r in results[:2]] == [True, True]
    assert results[2]["code"] == 503 and results[2]["data"]["reason"] == "circuit_open"
    assert results[3] == {"ok": "3", "is_error": False}  # the session lives on


# -- retry safety per operation ------------------------------------------------------------------


async def test_retried_side_effecting_call_executes_once(mcp_stateless, start_sluice):
    """The route retries 502s. ``send`` is not declared idempotent: its failed attempt is not
    repeated, so it runs once. ``add`` is (``idempotent: true`` in its block): it is retried
    and answers."""
    gateway = await mcp_servers.McpGateway(mcp_stateless.base_url, fail_after_run=1).start()
    try:
        sluice = await start_sluice({"routes": [mcp_route(
            gateway.url, retry={"attempts": 3, "backoff": {"base": "50ms", "max": "100ms"},
                                "on": [502]},
            tools={"add": {"idempotent": True}})]})
        async with Client(endpoint(sluice), mode="legacy") as client:
            with pytest.raises(MCPError):
                await client.call_tool("send", {"to": "ops@example.com", "body": "once"})
            assert mcp_stateless.sends() == 1
            gateway.fail_after_run = 1
            assert text(await client.call_tool("add", {"a": 1, "b": 2})) == "3"
        assert gateway.calls == ["send", "add", "add"]
        assert mcp_stateless.sends() == 1
        events = await flushed(sluice, "add")
        retried = [e for e in events if e["event"] == "retried"]
        assert [e["operation"] for e in retried] == ["add"]
        letters = [e for e in events if e["event"] == "dead_lettered"]
        assert [(e["operation"], e["reason"]) for e in letters] == [("send", "unsafe_to_retry")]
    finally:
        await gateway.stop()


@pytest.mark.parametrize("mode", ["stateless", "session"])
async def test_repeated_side_effecting_call_with_the_same_arguments_runs_once(
        mcp_server_factory, start_sluice, mode):
    """``send`` deduplicates (its block's ``idempotency``): the same arguments again replay the
    first answer, under the new request's JSON-RPC id, although the SDK closed the connection
    right after the first result; other arguments run."""
    server = mcp_server_factory(mode)
    sluice = await start_sluice({"routes": [mcp_route(
        server.base_url, tools={"send": {"idempotency": {"mode": "dedup"}}})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        first = await client.call_tool("send", {"to": "ops@example.com", "body": "hi"})
        again = await client.call_tool("send", {"body": "hi", "to": "ops@example.com"})
        other = await client.call_tool("send", {"to": "dev@example.com", "body": "hi"})
        assert [text(first), text(again), text(other)] == ["sent #1", "sent #1", "sent #2"]
        # Tools without the block run every time.
        assert text(await client.call_tool("add", {"a": 1, "b": 1})) == "2"
        assert text(await client.call_tool("add", {"a": 1, "b": 1})) == "2"
    assert server.sends() == 2
    events = await flushed(sluice, "add", 2)
    replayed = [e for e in events if e["event"] == "replayed"]
    assert [e["operation"] for e in replayed] == ["send"]


async def test_a_tools_idempotency_off_replaces_the_routes_dedup(mcp_stateless, start_sluice):
    """A tool's block replaces the route's, ``mode: off`` too: a new user's ``send`` with
    ``idempotency: {mode: off}`` on a ``dedup`` route was still replayed (the tool had no
    policy object, so the route's applied)."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_stateless.base_url, idempotency={"mode": "dedup"},
        tools={"send": {"idempotency": {"mode": "off"}}})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        added = [text(await client.call_tool("add", {"a": 1, "b": 1})) for _ in range(2)]
        sent = [text(await client.call_tool("send", {"to": "ops@example.com", "body": "hi"}))
                for _ in range(2)]
    assert sent == ["sent #1", "sent #2"] and mcp_stateless.sends() == 2
    assert added == ["2", "2"]
    events = await flushed(sluice, "send", 2)
    assert [e["operation"] for e in events if e["event"] == "replayed"] == ["add"]


async def test_a_stored_answer_is_not_replayed_to_a_client_of_another_generation(
        mcp_server_factory, start_sluice):
    """Found by a hostile trial: an answer stored from a 2025-11-25 client (no
    ``resultType``) replayed to a 2026-07-28 client (``mode="auto"``) failed its validation,
    which ended that client's whole session. Now that call alone fails (422 as a JSON-RPC
    error): the session goes on, the tool does not run again, and a client of the first
    generation still gets the replay."""
    server = mcp_server_factory("session")
    sluice = await start_sluice({"routes": [mcp_route(
        server.base_url, tools={"send": {"idempotency": {"mode": "dedup"}}})]})
    args = {"to": "ops@example.com", "body": "hi"}
    async with Client(endpoint(sluice), mode="legacy") as client:
        assert text(await client.call_tool("send", args)) == "sent #1"
    async with Client(endpoint(sluice)) as modern:
        with pytest.raises(MCPError, match="another protocol generation"):
            await modern.call_tool("send", args)
        assert text(await modern.call_tool("add", {"a": 1, "b": 2})) == "3"  # still alive
    async with Client(endpoint(sluice), mode="legacy") as client:
        assert text(await client.call_tool("send", args)) == "sent #1"  # replayed
    assert server.sends() == 1


mcp_server_factory = mcp_servers.mcp_server_factory


async def test_derive_from_keys_ignore_the_json_rpc_id(mcp_stateless, start_sluice):
    """Before: ``derive_from`` keys on MCP gave 422 on every repeat (the JSON-RPC id was part
    of the fingerprint). Now the repeat under a new id replays, with that id."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_stateless.base_url, tools={
        "send": {"idempotency": {"mode": "dedup", "derive_from": ["X-Step-ID"]}}})]})
    headers = {"Accept": "application/json, text/event-stream", "X-Step-ID": "step-1",
               "MCP-Protocol-Version": "2025-06-18"}
    answers = []
    async with aiohttp.ClientSession() as http:
        for rid in (1, "retry-1"):
            call = {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                    "params": {"name": "send", "arguments": {"to": "x"}}}
            async with http.post(endpoint(sluice), json=call, headers=headers) as r:
                assert r.status == 200
                answers.append((r.headers.get("Idempotent-Replayed"), await r.text()))
    assert answers[0][0] is None and answers[1][0] == "true"
    assert '"id":"retry-1"' in answers[1][1] and "sent #1" in answers[1][1]
    assert mcp_stateless.sends() == 1


async def test_a_callers_tool_answer_is_not_replayed_to_a_caller_with_other_credentials(
        mcp_stateless, start_sluice):
    """A keyless tool call is keyed by its tool and arguments; keyed by tenant alone, a new
    user's second caller (another API key, the same default tenant) was given the first
    one's ``my_inbox`` answer for the whole ttl. The caller's credentials are part of the
    key now: the same caller's repeat replays, another's runs; a ``derive_from`` key alike."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_stateless.base_url, idempotency={"mode": "dedup"},
        tools={"add": {"idempotency": {"mode": "dedup", "derive_from": ["X-Step-ID"]}}})]})

    async def send(key: str, tool: str = "send") -> tuple[str | None, str]:
        call = (mcp_servers.tool_call(1, tool, to="x") if tool == "send"
                else mcp_servers.tool_call(1, tool, a=1, b=2))
        headers = {"Accept": "application/json, text/event-stream", "X-Step-ID": "step-1",
                   "MCP-Protocol-Version": "2025-06-18", "Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession() as http, http.post(
                endpoint(sluice), json=call, headers=headers) as r:
            assert r.status == 200
            return r.headers.get("Idempotent-Replayed"), await r.text()

    alice, again, bob = await send("alice-key"), await send("alice-key"), await send("bob-key")
    assert (alice[0], again[0], bob[0]) == (None, "true", None)
    assert "sent #1" in alice[1] and "sent #1" in again[1] and "sent #2" in bob[1]
    assert mcp_stateless.sends() == 2
    derived = [await send(key, "add") for key in ("alice-key", "alice-key", "bob-key")]
    assert [replayed for replayed, _ in derived] == [None, "true", None]


@pytest.mark.parametrize("shared_state", ["redis"], indirect=True)
async def test_same_tool_call_through_two_replicas_runs_once(mcp_session, start_sluice,
                                                             shared_state):
    route = mcp_route(mcp_session.base_url, tools={"send": {"idempotency": {"mode": "dedup"}}})
    replicas = [await start_sluice({"state": shared_state, "routes": [route]})
                for _ in range(2)]
    answers = []
    for sluice in replicas:
        async with Client(endpoint(sluice), mode="legacy") as client:
            answers.append(text(await client.call_tool("send", {"to": "ops", "body": "x"})))
    assert answers == ["sent #1", "sent #1"]
    assert mcp_session.sends() == 1


# -- per-endpoint limit on an http route ---------------------------------------------------------


async def test_per_endpoint_limit_on_an_http_route(upstream, start_sluice):
    sluice = await start_sluice({"routes": [{
        "name": "api", "path_prefix": "/api/", "upstream": upstream.url,
        "endpoints": {"POST /v1/jobs/*": {"concurrency": {"limit": 1, "queue": 0}}}}]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(http.post(sluice.url + "/api/v1/jobs/1", data=b"{}"))
        await wait_until(lambda: len(upstream.requests) == 1, what="the first job upstream")
        async with http.post(sluice.url + "/api/v1/jobs/2", data=b"{}") as r:
            assert r.status == 503
            assert r.headers["X-Sluice-Reason"] == "queue_full"
        upstream.hold.set()
        async with await first as r:
            assert r.status == 200
        upstream.hold = asyncio.Event()
        held = asyncio.create_task(http.post(sluice.url + "/api/v1/jobs/3", data=b"{}"))
        await wait_until(lambda: len(upstream.requests) == 2, what="the third job upstream")
        # Other endpoints are not limited by the job endpoint's slot.
        others = [http.get(sluice.url + "/api/v1/jobs/3"),
                  http.post(sluice.url + "/api/v1/search", data=b"{}")]
        waiting = [asyncio.create_task(o) for o in others]
        await wait_until(lambda: len(upstream.requests) == 4, what="both others upstream")
        upstream.hold.set()
        for task in (held, *waiting):
            async with await task as r:
                assert r.status == 200
    assert await sluice.metric("sluice_operation_rejections_total", route="api",
                               operation="POST /v1/jobs/*", reason="queue_full") == 1
    assert await sluice.metric("sluice_operation_requests_total", route="api",
                               operation="POST /v1/jobs/*", outcome="2xx") == 2


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> Any:
    """A ``state`` block: memory, or Redis under a key prefix of the test's own."""
    if request.param == "memory":
        yield {"backend": "memory"}
        return
    url = require_redis()
    prefix = new_prefix()
    try:
        yield {"backend": "redis", "redis_url": url, "key_prefix": prefix, "timeout": "2s"}
    finally:
        delete_prefix(url, prefix)


async def test_route_per_tenant_counts_calls_queued_for_an_operations_slot(upstream,
                                                                         start_sluice, state):
    # A hostile trial: per_tenant counts a tenant's calls in flight *and queued* on the
    # route, but one waiting for an endpoint's slot (taken before the route's, so that it
    # holds none of the route's slots) was not counted: one tenant held 1 call in flight and
    # 9 queued with per_tenant 2, none refused.
    sluice = await start_sluice({"state": state, "routes": [{
        "name": "api", "path_prefix": "/api/", "upstream": upstream.url,
        "concurrency": {"limit": 8, "queue": 32, "max_wait": "20s", "per_tenant": 2},
        "endpoints": {"POST /slow": {"concurrency": {"limit": 1, "queue": 16,
                                                     "max_wait": "20s"}}}}]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        async def post(path: str, tenant: str) -> tuple[int, str | None]:
            async with http.post(sluice.url + "/api" + path, data=b"{}",
                                 headers={"X-Tenant-ID": tenant}) as answer:
                await answer.read()
                return answer.status, answer.headers.get("X-Sluice-Reason")

        calls = [asyncio.create_task(post("/slow", "a"))]
        await wait_until(lambda: len(upstream.requests) == 1, what="a's first call upstream")
        calls.append(asyncio.create_task(post("/slow", "a")))
        await sluice.wait_metric("sluice_queue_depth", 1, route="api")
        # a holds 2 on the route (1 in flight, 1 queued for the endpoint): refused at once,
        # for the endpoint and for any other call of the route.
        assert await post("/slow", "a") == (429, "tenant_concurrency")
        assert await post("/other", "a") == (429, "tenant_concurrency")
        calls.append(asyncio.create_task(post("/slow", "b")))  # b's own count: it queues
        await sluice.wait_metric("sluice_queue_depth", 2, route="api")
        upstream.hold.set()
        assert await asyncio.gather(*calls) == [(200, None)] * 3
        # Each call was counted once, and is no more: a holds 2 at once again.
        upstream.hold = asyncio.Event()
        calls = [asyncio.create_task(post(path, "a")) for path in ("/slow", "/other")]
        await wait_until(lambda: len(upstream.requests) == 5, what="a's two calls upstream")
        upstream.hold.set()
        assert await asyncio.gather(*calls) == [(200, None)] * 2


# -- per-model token rate on an openai route -----------------------------------------------------


async def test_per_model_token_rate_on_an_openai_route(upstream, start_sluice):
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"gpt-4o": {"rate": {"tokens": "1000/min"}}}}]})
    client = openai.AsyncOpenAI(base_url=sluice.url + "/llm/v1", api_key="sk-test",
                                max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    try:
        await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=600)
        with pytest.raises(openai.RateLimitError) as limited:
            await client.chat.completions.create(model="gpt-4o", messages=messages,
                                                 max_tokens=600)
        assert limited.value.response.headers["X-Sluice-Reason"] == "token_rate_limited"
        # Another model has its own limit (none here): served at once, several times.
        for _ in range(3):
            await client.chat.completions.create(model="gpt-4o-mini", messages=messages,
                                                 max_tokens=600)
        # A call without max_tokens cannot be weighed against the model's token rate; a model
        # without one needs none.
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="gpt-4o", messages=messages)
        await client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    finally:
        await client.close()
    assert len(upstream.requests) == 5
    assert await sluice.metric("sluice_operation_rejections_total", route="llm",
                               operation="gpt-4o", reason="token_rate_limited") == 1


async def test_a_call_over_its_models_whole_token_rate_is_400_whatever_the_route_has_left(
        upstream, start_sluice):
    """A hostile trial: a call whose worst case (~726 tokens) passes its model's whole token
    rate (700/h) was 400 ``exceeds_limit`` alone, but 429 ``token_rate_limited`` with a
    Retry-After and ``x-should-retry: true`` when the route's own token bucket was short
    then: the SDK waited and retried into the 400. The model's whole limit is checked
    before the route's buckets are asked."""
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "rate": {"tokens": "1000/min"},
        "models": {"gpt-4o-mini": {"rate": {"tokens": "700/h"}}}}]})
    url = sluice.url + "/llm/v1/chat/completions"

    async def call(http: aiohttp.ClientSession, model: str, cap: int) -> tuple[int, dict]:
        async with http.post(url, json={"model": model, "max_tokens": cap, "messages": [
                {"role": "user", "content": "hi"}]}) as answer:
            await answer.read()
            return answer.status, dict(answer.headers)

    async with aiohttp.ClientSession() as http:
        for route_short in (False, True):
            if route_short:  # 600 of the route's 1000 tokens a minute, and ~60 inputs
                for _ in range(2):
                    assert (await call(http, "gpt-4o", 300))[0] == 200
            status, headers = await call(http, "gpt-4o-mini", 690)
            assert (status, headers.get("X-Sluice-Reason")) == (400, "exceeds_limit"), headers
            assert headers["x-should-retry"] == "false" and "Retry-After" not in headers
    assert len(upstream.requests) == 2
    assert await sluice.metric("sluice_operation_rejections_total", route="llm",
                               operation="gpt-4o-mini", reason="exceeds_limit") == 2


async def test_a_model_token_rate_needs_a_cap_it_can_read(upstream, start_sluice):
    # A hostile trial: with no route-level token limit, a cap sent as "900" or 900.0 (which
    # lax upstreams, vLLM or the LiteLLM proxy, read as 900) passed unmetered and took no
    # tokens from the model's rate: ten such calls went through a spent 1000/min.
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"gpt-4o": {"rate": {"tokens": "1000/min"}}}}]})
    url = sluice.url + "/llm/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as http:
        for cap in ("900", 900.0):
            async with http.post(url, json={"model": "gpt-4o", "max_tokens": cap,
                                            "messages": messages}) as answer:
                assert answer.status == 400, await answer.text()
                assert "this model's tokens are limited" in (await answer.json())[
                    "error"]["message"]
        # A model with no token rate of its own still passes such a body on, unmetered.
        async with http.post(url, json={"model": "gpt-4o-mini", "max_tokens": "900",
                                        "messages": messages}) as answer:
            assert answer.status == 200
    assert len(upstream.requests) == 1


async def test_a_models_own_block_without_a_token_rate_is_not_weighed_by_defaults(
        upstream, start_sluice):
    # A review: gpt-4o-mini's own block limits no tokens; default's token rate (which
    # applies to other models) refused its unreadable cap with 400 all the same.
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"gpt-4o-mini": {"concurrency": {"limit": 5}},
                   "default": {"rate": {"tokens": "1000/min"}}}}]})
    url = sluice.url + "/llm/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as http:
        for model, status in (("gpt-4o-mini", 200), ("gpt-4o", 400)):
            for cap in ("900", None):  # unreadable, and none at all
                body = {"model": model, "messages": messages}
                if cap is not None:
                    body["max_tokens"] = cap
                async with http.post(url, json=body) as answer:
                    assert answer.status == status, (model, cap, await answer.text())


async def test_a_model_named_with_a_lone_surrogate_leaves_metrics_readable(upstream,
                                                                           start_sluice):
    # A hostile trial: read leniently, a model named "\\ud800" became a label, and every
    # scrape after it failed with a 500 (UTF-8 cannot carry a lone surrogate) until restart.
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"gpt-4o": {"concurrency": {"limit": 5}}}}]})
    body = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    async with aiohttp.ClientSession() as http:
        async with http.post(sluice.url + "/llm/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"}) as answer:
            assert answer.status == 200
        async with http.get(sluice.admin_url + "/metrics") as scraped:
            assert scraped.status == 200, await scraped.text()
    assert await sluice.metric("sluice_operation_requests_total", route="llm",
                               operation="\\ud800", outcome="2xx") == 1


def test_an_invalid_body_no_python_upstream_reads_is_parsed_once(monkeypatch):
    # A review: every body orjson refused was parsed again by the standard library, so a
    # 26 MiB invalid one held the event loop 1.2 s instead of 0.2. Only what Python reads
    # and orjson does not (encodings, lone surrogates, NaN and Infinity) is tried again.
    from policies import bodies

    second: list[bytes] = []
    real = json.loads
    monkeypatch.setattr(bodies.json, "loads", lambda body: second.append(body) or real(body))
    big = b'{"messages": [' + b'{"role": "user", "content": "hi"},' * 1000 + b" nope"
    for body in (big, b'{"a": 1,}', b'{"a": nan}', b"\xc3\xa9"):
        with pytest.raises(orjson.JSONDecodeError):
            bodies.read_leniently(body)
    assert second == []
    for body in (b'{"a": NaN}', b'{"\xc3\xa9": -Infinity}', b'{"a": "\\ud83d"}',
                 b"\xef\xbb\xbf{}", '{"a": 1}'.encode("utf-16-le")):
        assert bodies.read_leniently(body)[1] is False
    assert len(second) == 5


async def test_a_request_naming_no_model_takes_the_default_models_block(upstream,
                                                                        start_sluice):
    # vLLM serves a request with no model by its one model: such a request dodged every
    # models: block, default's included.
    upstream.delay = 0.5
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"gpt-4o": {"rate": {"tokens": "1000/min"}},
                   "default": {"concurrency": {"limit": 1, "queue": 0}}}}]})
    url = sluice.url + "/llm/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}

    async def call() -> tuple[int, str | None]:
        async with aiohttp.ClientSession() as http, http.post(url, json=body) as answer:
            await answer.read()
            return answer.status, answer.headers.get("X-Sluice-Reason")

    assert sorted(await asyncio.gather(call(), call())) == [(200, None), (503, "queue_full")]
    assert await sluice.metric("sluice_operation_rejections_total", route="llm",
                               operation="default", reason="queue_full") == 1


async def test_only_a_post_takes_a_models_block(upstream, start_sluice):
    # A review: a request naming no model got default's block, GET /v1/models and file
    # downloads too (503 queue_full, 429 from default's rate). Only a POST asks a model for
    # an answer: other methods get the route's policies alone.
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"default": {"rate": {"requests": "1/min"}}}}]})
    async with aiohttp.ClientSession() as http:
        async def call(method: str, path: str, **kwargs: Any) -> tuple[int, str | None]:
            async with http.request(method, sluice.url + "/llm" + path, **kwargs) as answer:
                await answer.read()
                return answer.status, answer.headers.get("X-Sluice-Reason")

        for method, path in (("GET", "/v1/models"), ("GET", "/v1/files/f-1/content"),
                             ("DELETE", "/v1/files/f-1"), ("HEAD", "/v1/models")) * 2:
            assert await call(method, path) == (200, None), (method, path)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        assert await call("POST", "/v1/chat/completions", json=body) == (200, None)
        assert await call("POST", "/v1/chat/completions", json=body) == (429, "rate_limited")
    assert len(upstream.requests) == 9


async def test_a_forms_model_is_read_once_per_call(upstream, monkeypatch):
    # A review: a form naming its model was parsed twice per call, by the models: look-up
    # and again by the accounting (a model whose tokens are limited); each parse of a 32 MiB
    # form held the event loop. The look-up's model goes on to the accounting on the call.
    from policies import bodies
    from policies.pipeline import REFUSED, Admission, Call
    from policies.reasons import Rejected
    from tests.conftest import open_runtime, route

    parses: list[bytes] = []
    real = bodies.form_field
    monkeypatch.setattr(bodies, "form_field",
                        lambda body, *args: parses.append(body) or real(body, *args))
    runtime = await open_runtime(route("llm", upstream.url, models={
        "whisper-1": {"rate": {"tokens": "1000/min"}}}))
    try:
        (llm,) = runtime.routes
        form = (b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
                b"whisper-1\r\n--b0--\r\n")
        call = Call(request_id="r", route="llm", method="POST",
                    path="/llm/v1/chat/completions", body=form, tenant="t",
                    headers={"Content-Type": "multipart/form-data; boundary=b0"})
        assert llm.operations.forms is runtime.forms  # one reader, closed with the runtime
        plan = await llm.plan(call)
        assert (call.operation, call.model) == ("whisper-1", "whisper-1")
        admission = Admission()
        with pytest.raises(Rejected) as refused:  # no JSON to count its tokens by
            await admission.admit(plan.policies, call)
        admission.release(REFUSED)
        assert "this model's tokens are limited" in refused.value.detail
        assert parses == [form]
    finally:
        await runtime.close()


async def test_an_azure_deployment_path_names_its_model(upstream, start_sluice):
    # A hostile trial: Azure OpenAI serves the model of the deployment its path names
    # (/openai/deployments/{name}/...), whatever the body says or without one; models: and
    # pricing read the body only, so four calls to the gpt-4o deployment passed its 1/min,
    # and a body naming a cheap model was priced as that one.
    sluice = await start_sluice({
        "pricing": {"gpt-4o-mini": {"input": 0.15, "output": 0.6}},
        "routes": [{"name": "az", "path_prefix": "/az/", "upstream": upstream.url,
                    "protocol": "openai", "models": {"gpt-4o": {"rate": {"requests": "1/min"}}}},
                   {"name": "priced", "path_prefix": "/priced/", "upstream": upstream.url,
                    "protocol": "openai", "budget": {"usd": "10/day", "per": "route"}}]})
    chat = "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
    messages = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as http:
        async def call(path: str, **body: Any) -> tuple[int, str | None]:
            async with http.post(sluice.url + path, json={"messages": messages,
                                                          "max_tokens": 5, **body}) as answer:
                await answer.read()
                return answer.status, answer.headers.get("X-Sluice-Reason")

        assert await call("/az" + chat) == (200, None)
        for body in ({"model": "gpt-4o-mini"}, {}):  # the path wins over the body
            assert await call("/az" + chat, **body) == (429, "rate_limited")
        assert await call("/az/openai/deployments/gpt-4%6F/embeddings", input="x") == (
            429, "rate_limited")
        assert await call("/az/v1/chat/completions", model="gpt-4o-mini") == (200, None)
        # Priced as the deployment's model, which the table lacks: never as the body's.
        assert await call("/priced" + chat, model="gpt-4o-mini") == (400, "unpriced_model")
    assert await sluice.metric("sluice_operation_rejections_total", route="az",
                               operation="gpt-4o", reason="rate_limited") == 3
    assert [seen.path_qs for seen in upstream.requests] == [chat, "/v1/chat/completions"]


async def test_a_form_names_its_model_and_an_unreadable_body_is_defaults(upstream,
                                                                         start_sluice):
    # A hostile trial: OpenAI's transcriptions and image edits send a form (model=whisper-1);
    # a models: block read JSON bodies only, so such calls got neither their model's block
    # nor default's, which the docs promise a call naming none.
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"whisper-1": {"rate": {"requests": "1/min"}},
                   "default": {"rate": {"requests": "1/min"}}}}]})
    url = sluice.url + "/llm/v1/audio/transcriptions"
    async with aiohttp.ClientSession() as http:
        async def post(**kwargs: Any) -> tuple[int, str | None]:
            async with http.post(url, **kwargs) as answer:
                await answer.read()
                return answer.status, answer.headers.get("X-Sluice-Reason")

        for _ in range(2):
            form = aiohttp.FormData()
            form.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
            form.add_field("model", "whisper-1")
            assert (await post(data=form))[0] in (200, 429)
        assert await post(data={"model": "whisper-1"}) == (429, "rate_limited")  # urlencoded
        assert await post(data=b"\x00 no model here",
                          headers={"Content-Type": "application/octet-stream"}) == (200, None)
        assert await post(data=b"model=x&y", headers={"Content-Type": "text/plain"}) == (
            429, "rate_limited")
    assert await sluice.metric("sluice_operation_rejections_total", route="llm",
                               operation="whisper-1", reason="rate_limited") == 2
    assert await sluice.metric("sluice_operation_rejections_total", route="llm",
                               operation="default", reason="rate_limited") == 1
    assert len(upstream.requests) == 2


#: Bodies Python's ``json.loads`` reads (as FastAPI-based upstreams do) and orjson refuses.
_LENIENT_BODIES = {
    "byte order mark": lambda text: b"\xef\xbb\xbf" + text.encode(),
    "NaN": lambda text: text.replace('"temperature": 1', '"temperature": NaN').encode(),
    "lone surrogate": lambda text: text.replace("hi", "cut \\ud83d").encode(),
    "UTF-16": lambda text: text.encode("utf-16"),
}


@pytest.mark.parametrize("spelling", list(_LENIENT_BODIES))
async def test_a_body_python_upstreams_read_names_its_model(upstream, start_sluice, spelling):
    # A hostile trial: these bodies named no model to Sluice (orjson refuses them), so a
    # model's concurrency and token rate were dodged, while the upstream served them as
    # that model. They are read as the upstream reads them.
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "models": {"gpt-4o": {"rate": {"tokens": "1000/min"}}}}]})
    url = sluice.url + "/llm/v1/chat/completions"
    text = json.dumps({"model": "gpt-4o", "max_tokens": 600, "temperature": 1,
                       "messages": [{"role": "user", "content": "hi"}]})
    body = _LENIENT_BODIES[spelling](text)
    assert json.loads(body)["model"] == "gpt-4o"
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=body, headers=headers) as answer:
            assert answer.status == 200, await answer.text()
        async with http.post(url, data=body, headers=headers) as answer:
            assert answer.status == 429
            assert answer.headers["X-Sluice-Reason"] == "token_rate_limited"
    assert len(upstream.requests) == 1
    assert upstream.requests[0].body == body  # nothing to add: passed on as sent


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-16-le"])
async def test_a_body_read_leniently_is_rewritten_whole_when_sluice_adds_to_it(
        upstream, start_sluice, encoding):
    # The usage option is added to a stream's body; spliced as UTF-8 into UTF-16 bytes it
    # would have made a body nobody reads. Rewritten whole, the upstream reads what was sent
    # (its NaN and lone surrogate too) plus the option; and the charset the Content-Type
    # named is dropped (a review: an upstream decoding by it read garbage).
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "rate": {"tokens": "100000/min"}}]})
    sent = ('{"model": "gpt-4o", "max_tokens": 20, "stream": true, "temperature": NaN, '
            '"messages": [{"role": "user", "content": "h\u00e9llo \u4e16 cut \\ud83d"}]}')
    async with aiohttp.ClientSession() as http:
        async with http.post(sluice.url + "/llm/v1/chat/completions",
                             data=sent.encode(encoding),
                             headers={"Content-Type": f"application/json; charset={encoding}"}
                             ) as answer:
            assert answer.status == 200, await answer.text()
            assert b"[DONE]" in await answer.read()
    seen = upstream.requests[0]
    assert seen.headers["Content-Type"] == "application/json"
    assert int(seen.headers["Content-Length"]) == len(seen.body)
    forwarded = json.loads(seen.body.decode("utf-8"))
    assert forwarded.pop("stream_options") == {"include_usage": True}
    expected = json.loads(sent)
    assert forwarded["messages"] == expected["messages"]
    assert forwarded["temperature"] != forwarded["temperature"]  # NaN, as sent
    del forwarded["temperature"], expected["temperature"]
    assert forwarded == expected


# -- tool costs charged to a usd budget ----------------------------------------------------------


async def test_tool_costs_are_charged_to_the_usd_budget(mcp_stateless, start_sluice):
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_stateless.base_url, budget={"usd": "0.05/day", "per": "tenant"},
        tools={"send": {"cost_per_call": 0.02}, "slow": {"cost_per_second": 0.04}})]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        assert text(await client.call_tool("send", {"to": "a"})) == "sent #1"
        assert text(await client.call_tool("send", {"to": "b"})) == "sent #2"
        with pytest.raises(MCPError) as refused:  # 0.04 spent: 0.02 more does not fit
            await client.call_tool("send", {"to": "c"})
        assert refused.value.error.code == 429
        assert refused.value.error.data["reason"] == "budget_exhausted"
        assert mcp_stateless.sends() == 2
        # Time-priced: 0.25 s or more of upstream time at $0.04/s is at least $0.01.
        assert text(await client.call_tool("slow", {"seconds": 0.25})) == "slept"
        with pytest.raises(MCPError) as spent:  # now over the budget: even a slow call waits
            await client.call_tool("slow", {"seconds": 0.1})
        assert spent.value.error.data["reason"] == "budget_exhausted"
        assert text(await client.call_tool("add", {"a": 1, "b": 1})) == "2"  # costs nothing
    events = await flushed(sluice, "add")
    costs = {e["operation"]: e["operation_cost_usd"] for e in events
             if e["event"] == "completed" and "operation_cost_usd" in e}
    sends = [e["operation_cost_usd"] for e in events if e["event"] == "completed"
             and e.get("operation") == "send"]
    assert sends == [0.02, 0.02]
    assert costs["slow"] >= 0.01
    # The slow call held a micro-dollar and was charged its time: past its hold, which can
    # pass the budget, so it is said (a hostile trial charged $0.10 on a $0.01 budget, unsaid).
    overrun = {e["operation"]: e.get("over_reservation_usd") for e in events
               if e["event"] == "completed" and "operation_cost_usd" in e}
    assert overrun == {"send": None, "slow": pytest.approx(costs["slow"] - 1e-6)}
    assert await sluice.metric("sluice_usage_over_reservation_total", route="tools") == 1
    total = await sluice.metric("sluice_cost_usd_total", route="tools", tenant="default")
    assert total == pytest.approx(0.04 + costs["slow"])
    assert await sluice.metric("sluice_operation_cost_usd_total", route="tools",
                               operation="slow") == pytest.approx(costs["slow"])


# -- reloads keep or change an operation's state -------------------------------------------------


async def test_reload_keeps_and_changes_operation_state(mcp_stateless, start_sluice):
    route = mcp_route(mcp_stateless.base_url, tools={
        "slow": {"concurrency": {"limit": 1, "queue": 0}},
        "fail": {"circuit_breaker": {"fail_max": 1, "reset_timeout": "60s"}}})
    sluice = await start_sluice({"routes": [route]})
    async with Client(endpoint(sluice), mode="legacy") as client:
        assert (await client.call_tool("fail", {})).is_error  # opens fail's breaker
        holder = asyncio.create_task(client.call_tool("slow", {"seconds": 3.0}))
        await wait_until(lambda: any(e["event"] == "admitted" and e.get("operation") == "slow"
                                     for e in sluice.events()), what="slow admitted")

        def touch_add(data: dict) -> None:  # an unrelated change: both blocks unchanged
            data["routes"][0]["tools"]["add"] = {"rate": {"requests": "100/s"}}

        rewrite(sluice.config_path, touch_add)
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        with pytest.raises(MCPError) as busy:  # the slot held before the reload still counts
            await client.call_tool("slow", {"seconds": 0.1})
        assert busy.value.error.data["reason"] == "queue_full"
        with pytest.raises(MCPError) as still_open:  # the open breaker stays open
            await client.call_tool("fail", {})
        assert still_open.value.error.data["reason"] == "circuit_open"

        def raise_limit(data: dict) -> None:
            data["routes"][0]["tools"]["slow"]["concurrency"]["limit"] = 2

        rewrite(sluice.config_path, raise_limit)
        await sluice.wait_metric("sluice_config_reloads_total", 2)
        # The held slot counts against the new limit of 2: one more fits, not two.
        second = asyncio.create_task(client.call_tool("slow", {"seconds": 1.0}))
        await wait_until(lambda: sum(e["event"] == "admitted" and e.get("operation") == "slow"
                                     for e in sluice.events()) == 2, what="second slow admitted")
        with pytest.raises(MCPError) as full:
            await client.call_tool("slow", {"seconds": 0.1})
        assert full.value.error.data["reason"] == "queue_full"
        assert text(await second) == "slept" and text(await holder) == "slept"


def test_docs_example_config_loads(tmp_path: Path) -> None:
    """The per-operation example of docs/operations.md loads as written."""
    from proxy.config import load_config

    doc = (REPO / "docs" / "operations.md").read_text()
    block = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "sluice.yaml"
    path.write_text(textwrap.dedent(block))
    config = load_config(path)
    assert config.routes[0].tools is not None


async def test_mcp_name_header_that_disagrees_with_the_body_is_400(mcp_stateless, start_sluice):
    """An operation's policy keys on the tool in the body; a ``Mcp-Name`` header naming
    another tool (protocol 2026-07-28) is refused before any policy or the server sees it."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_stateless.base_url, tools={"send": {"rate": {"requests": "1/min"}}})]})
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "send", "arguments": {"to": "x"}}}
    async with aiohttp.ClientSession() as http, http.post(endpoint(sluice), json=call, headers={
            "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28",
            "Mcp-Method": "tools/call", "Mcp-Name": "add"}) as r:
        assert r.status == 400
        assert r.headers["X-Sluice-Reason"] == "bad_request"
        assert (await r.json())["id"] == 7
    assert mcp_stateless.sends() == 0


# -- shared state: an operation's counters are shared by replicas, and its own -------------------


@pytest.mark.parametrize("shared_state", ["redis"], indirect=True)
async def test_operation_rates_are_shared_by_replicas_and_kept_apart(upstream, start_sluice,
                                                                      shared_state):
    route = {"name": "api", "path_prefix": "/api/", "upstream": upstream.url,
             "endpoints": {"POST /v1/send": {"rate": {"requests": "2/min"}},
                           "POST /v1/other": {"rate": {"requests": "2/min"}}}}
    a = await start_sluice({"state": shared_state, "routes": [route]})
    b = await start_sluice({"state": shared_state, "routes": [route]})
    async with aiohttp.ClientSession() as http:
        statuses = []
        for sluice in (a, b, a):
            async with http.post(sluice.url + "/api/v1/send", data=b"{}") as r:
                statuses.append((r.status, r.headers.get("X-Sluice-Reason")))
        assert statuses == [(200, None), (200, None), (429, "rate_limited")]
        for sluice in (b, a):  # another endpoint's bucket is its own
            async with http.post(sluice.url + "/api/v1/other", data=b"{}") as r:
                assert r.status == 200
    assert [s.path_qs for s in upstream.requests] == ["/v1/send"] * 2 + ["/v1/other"] * 2


def test_operation_label_values_are_capped() -> None:
    """Tool and model names come from requests: past 100 per route they share ``other``."""
    from proxy.metrics import MAX_OPERATION_LABELS, Metrics

    metrics = Metrics()
    series = metrics.for_route("tools")
    for n in range(MAX_OPERATION_LABELS + 50):
        series.operation(f"tool-{n}").outcome("2xx")
    series.operation("tool-0").outcome("2xx")  # one seen before the cap keeps its name
    values = {s.labels["operation"]: s.value for m in metrics.registry.collect()
              if m.name == "sluice_operation_requests" for s in m.samples}
    assert len(values) == MAX_OPERATION_LABELS + 1
    assert values["other"] == 50 and values["tool-0"] == 2
    assert metrics.operation_label("llm", "gpt-4o") == "gpt-4o"  # each route its own cap


async def test_a_caller_leaving_while_its_form_is_read_is_counted_and_logged(upstream):
    # A review: a model read off the loop (a large multipart form) was awaited before the
    # handler's accounting, so a caller who left during it was in neither the events nor
    # sluice_requests_total, as a caller leaving while its body arrived is.
    from tests.conftest import open_runtime, route, serve_runtime

    runtime = await open_runtime(route("llm", upstream.url, models={
        "whisper-1": {"rate": {"requests": "1000/min"}}}))
    reading = asyncio.Event()

    async def read_slowly(body: bytes, content_type: str, name: str) -> str | None:
        reading.set()
        await asyncio.Event().wait()  # a parse its caller does not wait out
        return None

    runtime.forms.field = read_slowly  # type: ignore[method-assign]
    events: list[tuple[str, dict]] = []
    emit = runtime.events.emit

    def record(event: str, *args: Any, **fields: Any) -> None:
        events.append((event, fields))
        emit(event, *args, **fields)

    runtime.events.emit = record  # type: ignore[method-assign]
    runner, port = await serve_runtime(runtime)
    try:
        form = (b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
                b"whisper-1\r\n--b0--\r\n")
        async with aiohttp.ClientSession() as http:
            caller = asyncio.create_task(http.post(
                f"http://127.0.0.1:{port}/llm/v1/audio/transcriptions", data=form,
                headers={"Content-Type": "multipart/form-data; boundary=b0"}))
            await asyncio.wait_for(reading.wait(), 10)
            caller.cancel()
        (llm,) = runtime.routes
        await wait_until(lambda: llm.metrics.outcomes["client_disconnected"].value == 1,
                         what="the left caller counted")
        [(_, completed)] = [(e, f) for e, f in events if e == "completed"]
        assert completed["outcome"] == "client_disconnected" and completed["status"] == 0
        assert llm.present == 0 and runtime.buffered_bytes == 0
        assert upstream.requests == []
    finally:
        await runner.cleanup()
        await runtime.close()
