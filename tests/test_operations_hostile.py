"""Per-operation policies under hostile input: a call must not dodge its operation's policy
by how it is spelled (issue 11).

* An endpoint path with percent-encoded unreserved characters (``/v1/job%73/1``) is the same
  resource as the plain one (RFC 3986 §6.2.2.2) and upstreams decode it before routing, so it
  must match the same ``endpoints:`` pattern.
* A JSON-RPC batch (protocol 2025-03-26, still served by the TypeScript SDK 1.x server) is no
  one call: a batch holding a ``tools/call`` is refused 400, so its calls cannot run outside
  their tools' limits and costs, or pass a route's limits once for many.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from policies.operations import OperationIndex
from tests import mcp_servers
from tests.conftest import REPO, wait_until
from tests.test_operations import MCP1_PYTHON, MCP1_SEQUENCE, run_mcp1

mcp_stateless = mcp_servers.mcp_stateless
mcp_session = mcp_servers.mcp_session

MCP_TS = REPO / ".mcp-ts"
TS_SERVER = REPO / "tests" / "mcp_ts" / "batch_server.mjs"
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


async def raw_post(port: int, target: str, body: bytes = b"{}") -> tuple[int, dict[str, str]]:
    """POST ``target`` byte for byte (an HTTP client library may normalise it); the answer's
    status and headers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    await reader.read()
    writer.close()
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), headers


async def test_percent_encoded_path_matches_its_endpoint_pattern(upstream, start_sluice):
    sluice = await start_sluice({"routes": [{
        "name": "api", "path_prefix": "/api/", "upstream": upstream.url,
        "endpoints": {"POST /v1/jobs/*": {"rate": {"requests": "1/min"}}}}]})
    assert (await raw_post(sluice.port, "/api/v1/jobs/1"))[0] == 200
    for disguised in ("/api/v1/job%73/2", "/api/v1/%6Aobs/3", "/api/%76%31/jobs/4"):
        status, headers = await raw_post(sluice.port, disguised)
        assert (status, headers.get("X-Sluice-Reason")) == (429, "rate_limited"), disguised
    # %2F is data to some upstreams (one segment: the pattern's) and a slash to others
    # (Starlette's, behind uvicorn); a run of slashes is one to nginx, a trailing one none to
    # Express. Each spelling dodged the pattern (a hostile trial): either reading applies.
    for disguised in ("/api/v1/jobs/5%2Fx", "/api/v1/jobs%2F6", "/api/v1/jobs%2f7",
                      "/api/v1//jobs/8", "/api//v1/jobs//9", "/api/v1/jobs/10/",
                      # Case, ;parameters and a backslash: a later hostile trial.
                      "/api/V1/JOBS/11", "/api/v1/jobs;x=1/12", "/api/v1;v=2/jobs/13",
                      "/api/v1\\jobs\\14"):
        status, headers = await raw_post(sluice.port, disguised)
        assert (status, headers.get("X-Sluice-Reason")) == (429, "rate_limited"), disguised
    assert (await raw_post(sluice.port, "/api/v1/search"))[0] == 200
    assert [seen.method for seen in upstream.requests] == ["POST", "POST"]
    assert await sluice.metric("sluice_operation_rejections_total", route="api",
                               operation="POST /v1/jobs/*", reason="rate_limited") == 13


def test_a_pattern_ending_in_a_slash_matches_its_lenient_spellings():
    """A review: every reading dropped a trailing slash, so a Django-style pattern
    (``/api/jobs/``) matched none of the spellings uvicorn or nginx route to it."""
    index = OperationIndex("endpoints", ["POST /api/jobs/", "POST /v1/jobs/*", "default"])
    for spelled in ("/api/jobs/", "/api/jobs%2F", "/api/jobs//", "/api//jobs/"):
        assert index.find("POST", spelled, b"", None)[1] == "POST /api/jobs/", spelled
    for spelled in ("/v1/jobs/5", "/v1/jobs/5/", "/v1/jobs%2F5", "/v1//jobs/5"):
        assert index.find("POST", spelled, b"", None)[1] == "POST /v1/jobs/*", spelled
    assert index.find("POST", "/api/other/", b"", None)[1] == "default"


def test_case_params_and_backslash_spellings_match_their_endpoint_pattern():
    """A hostile trial: ``/V1/JOBS/3`` (Express by default and ASP.NET Core route paths
    case-insensitively), ``/v1/jobs;x=1/4`` and ``/v1;v=2/jobs/5`` (Tomcat, Jetty and Spring
    drop a segment's ``;parameters``) dodged ``POST /v1/jobs/*``; so did ``\\`` (IIS splits
    segments at it). Patterns are still tried in file order: the first one a reading
    matches applies, ``Admin``'s here, however the path spells it."""
    index = OperationIndex("endpoints", ["GET /v1/Admin/**", "* /v1/admin/**",
                                         "POST /v1/jobs/*", "default"])
    for spelled in ("/V1/JOBS/3", "/v1/Jobs/3/", "/v1/jobs;x=1/4", "/v1;v=2/jobs/5",
                    "/V1;V=2/JOBS;X=1/6/", "/v1/jobs;x=a%2Fb/7", "/v1\\jobs\\8",
                    "/v1/jobs%5C9", "/v1/job%73;x/10"):
        assert index.find("POST", spelled, b"", None)[1] == "POST /v1/jobs/*", spelled
    for spelled in ("/v1/admin/users", "/V1/ADMIN/users", "/v1/admin;jsessionid=1/users"):
        assert index.find("GET", spelled, b"", None)[1] == "GET /v1/Admin/**", spelled
        assert index.find("DELETE", spelled, b"", None)[1] == "* /v1/admin/**", spelled
    for other in ("/v1/jobs/1/2", "/v1/jobsx/1", "/v1/jobs", "/v2/jobs;/1"):
        assert index.find("POST", other, b"", None)[1] == "default", other


async def test_a_long_path_against_a_many_wildcard_pattern_stalls_nothing(upstream,
                                                                           start_sluice):
    """Endpoint patterns were backtracking regexes: ``/**/items/**/history/**/notes/**/x``
    against a 7 KB path of ``items/history/`` took hours (quartic), and the event loop with it:
    every other call of the process waited. Both calls must be answered (a generous bound:
    the fix makes this milliseconds)."""
    sluice = await start_sluice({"routes": [{
        "name": "api", "path_prefix": "/api/", "upstream": upstream.url,
        "endpoints": {"GET /**/items/**/history/**/notes/**/x": {"rate": {"requests": "5/min"}},
                      "GET /v1/**": {"rate": {"requests": "5/min"}}}}]})
    hostile = "/api/" + "items/history/notes/" * 350
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        answers = await asyncio.gather(http.get(sluice.url + hostile),
                                       http.get(sluice.url + "/api/v1/ok"))
        assert [r.status for r in answers] == [200, 200]
    assert await sluice.metric("sluice_operation_requests_total", route="api",
                               operation="GET /v1/**", outcome="2xx") == 1


async def test_percent_encoded_llm_path_is_still_metered(upstream, start_sluice):
    """``/v1/chat/completion%73`` is the chat endpoint to the provider: it must meet the token
    budget (before: it passed unmetered, past a spent budget)."""
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "budget": {"tokens": "10000/day", "per": "route"}}]})
    chat = json.dumps({"model": "gpt-4o-mini", "max_tokens": 50,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    uncapped = json.dumps({"model": "gpt-4o-mini",
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
    for target in ("/llm/v1/chat/completions", "/llm/v1/chat/completion%73",
                   "/llm/v1/%63hat/completions"):
        status, headers = await raw_post(sluice.port, target, chat)
        assert status == 200 and "X-Sluice-Budget-Remaining" in headers, target
        status, headers = await raw_post(sluice.port, target, uncapped)
        assert (status, headers.get("X-Sluice-Reason")) == (400, "bad_request"), target
    assert len(upstream.requests) == 3
    assert await sluice.metric("sluice_tokens_total", route="llm", tenant="default",
                               direction="input") == 3 * upstream.prompt_tokens


@pytest.fixture
def ts_batch_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The TypeScript SDK 1.x server (stateless, JSON answers; it accepts batches): its base
    URL and the file its ``send`` tool appends a line to."""
    if shutil.which("node") is None or not (MCP_TS / "node_modules").is_dir():
        pytest.skip("needs node and .mcp-ts (.ci/run installs them)")
    port_file, count_file = tmp_path / "ts-port", tmp_path / "ts-sends"
    proc = subprocess.Popen(["node", str(TS_SERVER), str(port_file), str(count_file)],
                            env={**os.environ, "MCP_TS_DIR": str(MCP_TS)})
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "TS server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}", count_file
    finally:
        proc.terminate()
        proc.wait(10)


def sends(count_file: Path) -> int:
    return len(count_file.read_text().splitlines()) if count_file.exists() else 0


def answer(text: str) -> dict:
    """The JSON-RPC message of an answer, JSON or one SSE event."""
    if text.startswith("{"):
        return json.loads(text)
    return json.loads(next(line[5:] for line in text.splitlines() if line.startswith("data:")))


def call(rpc_id: int, tool: str, **arguments: object) -> dict:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments}}


async def test_batch_of_tool_calls_cannot_dodge_the_tools_rate(ts_batch_server, start_sluice):
    base, count_file = ts_batch_server
    route = {"name": "tools", "path_prefix": "/tools/", "upstream": base, "protocol": "mcp",
             "tools": {"send": {"rate": {"requests": "1/min"}}}}
    plain = {**route, "name": "plain", "path_prefix": "/plain/"}
    plain.pop("tools")
    sluice = await start_sluice({"routes": [route, plain]})
    batch = [call(1, "send", to="a"), call(2, "send", to="b"), call(3, "send", to="c")]
    async with aiohttp.ClientSession() as http:
        async with http.post(sluice.url + "/tools/mcp", json=batch, headers=HEADERS) as r:
            assert r.status == 400
            assert r.headers["X-Sluice-Reason"] == "bad_request"
            assert "own POST" in (await r.json())["error"]["message"]
        # A batch without tools/call is not refused; single calls meet the tool's rate.
        control = [{"jsonrpc": "2.0", "id": 1, "method": "ping"},
                   {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}]
        async with http.post(sluice.url + "/tools/mcp", json=control, headers=HEADERS) as r:
            assert r.status == 200 and len(await r.json()) == 2
        answers = []
        for rpc_id in (4, 5):
            async with http.post(sluice.url + "/tools/mcp", json=call(rpc_id, "send", to="d"),
                                 headers=HEADERS) as r:
                answers.append((await r.json()).get("error", {}).get("code"))
        assert answers == [None, 429]
        assert sends(count_file) == 1
        # Nor on a route naming no tools: its rate, a run's max_requests and its slot would
        # count a batch of any number of calls once (a hostile trial sent 100 in two).
        async with http.post(sluice.url + "/plain/mcp", json=batch, headers=HEADERS) as r:
            assert (r.status, r.headers["X-Sluice-Reason"]) == (400, "bad_request")
            assert "own POST" in (await r.json())["error"]["message"]
    assert sends(count_file) == 1


async def test_tool_costs_show_in_the_tenants_budget_gauges(mcp_stateless, start_sluice):
    """A usd budget charged with tool costs is watched like a token budget: its tenant's
    ``sluice_budget_remaining`` / ``sluice_budget_reserved`` exist (before: none on mcp routes,
    so the budget alerts could never fire) and nothing stays reserved once calls end."""
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": mcp_stateless.base_url,
        "protocol": "mcp", "budget": {"usd": "0.05/day", "per": "tenant"},
        "tools": {"send": {"cost_per_call": 0.01}}}]})
    headers = {**HEADERS, "X-Tenant-ID": "acme"}
    async with aiohttp.ClientSession() as http:
        for rpc_id in (1, 2):
            async with http.post(sluice.url + "/tools/mcp", headers=headers,
                                 json=call(rpc_id, "send", to="ops")) as r:
                assert r.status == 200 and "sent #" in await r.text()
    assert mcp_stateless.sends() == 2
    remaining = await sluice.metric("sluice_budget_remaining", route="tools", tenant="acme",
                                    unit="usd")
    assert remaining == pytest.approx(0.03)
    assert await sluice.metric("sluice_budget_reserved", route="tools", tenant="acme",
                               unit="usd") == 0


async def test_tool_names_from_requests_cannot_crowd_out_or_bloat_the_metrics(mcp_stateless,
                                                                              start_sluice):
    """Before: 101 calls naming 200 KB tools made /metrics 372 MB (12 s a scrape), and the first
    100 names a caller made up took every label, so a configured tool called later was
    counted under ``other``."""
    from proxy.metrics import MAX_OPERATION_LABELS

    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": mcp_stateless.base_url,
        "protocol": "mcp", "tools": {"add": {"concurrency": {"limit": 4}}}}]})
    huge = "h" * 100_000
    async with aiohttp.ClientSession() as http:
        async def send(rpc_id: int, tool: str, **arguments: object) -> dict:
            async with http.post(sluice.url + "/tools/mcp", headers=HEADERS,
                                 json=call(rpc_id, tool, **arguments)) as r:
                assert r.status == 200
                return answer(await r.text())

        for n in range(MAX_OPERATION_LABELS):
            await send(n, f"made-up-{n}")
        await send(1000, huge)
        assert (await send(1001, "add", a=1, b=2))["result"]["content"][0]["text"] == "3"
        async with http.get(sluice.admin_url + "/metrics") as r:
            exposition = await r.text()
    assert huge[:129] not in exposition  # MCP: tool names of 1 to 128 characters
    assert len(exposition) < 2_000_000
    assert await sluice.metric("sluice_operation_requests_total", route="tools",
                               operation="add", outcome="2xx") == 1
    assert await sluice.metric("sluice_operation_requests_total", route="tools",
                               operation="other", outcome="2xx") == 2  # made-up-99, huge


async def test_a_huge_tool_name_does_not_bloat_the_event_log(mcp_stateless, start_sluice):
    """Hostile trial: a tools/call naming a 2 MB tool wrote the name whole into its
    `admitted` and `completed` events (4 MB of log for one request, 64 MB for a body at
    `max_request_bytes`), though metrics had long capped such names. MCP tool names are 1 to
    128 characters; events keep that much and say how long the rest was."""
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": mcp_stateless.base_url,
        "protocol": "mcp"}]})
    huge = "h" * 2_000_000
    async with aiohttp.ClientSession() as http:
        async with http.post(sluice.url + "/tools/mcp", headers=HEADERS,
                             json=call(1, huge)) as r:
            assert r.status == 200
            await r.read()
    await wait_until(lambda: any(e["event"] == "completed" for e in sluice.events()))
    events = [e for e in sluice.events() if e.get("operation")]
    assert events and all(len(e["operation"]) < 200 for e in events)
    assert sluice.events_path.stat().st_size < 20_000


async def test_a_huge_method_name_does_not_bloat_the_event_log(mcp_stateless, start_sluice):
    """The same for a notification with a 2 MB method, which events name (``mcp_method``):
    they keep 128 characters and say how long the rest was."""
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": mcp_stateless.base_url,
        "protocol": "mcp"}]})
    huge = "notifications/" + "h" * 2_000_000
    async with aiohttp.ClientSession() as http, http.post(
            sluice.url + "/tools/mcp", headers=HEADERS,
            json={"jsonrpc": "2.0", "method": huge}) as r:
        await r.read()
    await wait_until(lambda: any(e["event"] == "completed" for e in sluice.events()))
    [completed] = [e for e in sluice.events() if e["event"] == "completed"]
    assert completed["mcp_method"] == f"{huge[:128]}...(+{len(huge) - 128} characters)"
    assert sluice.events_path.stat().st_size < 20_000


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_mcp1_session_survives_a_tool_cost_over_the_whole_budget(mcp_session, start_sluice,
                                                                       tmp_path):
    """A tool whose ``cost_per_call`` exceeds the whole ``usd`` budget is refused
    ``exceeds_limit``: that refusal fails the one call (HTTP 200 + JSON-RPC error), where an
    HTTP 400 ended the 1.x client's whole session, its other calls included."""
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": mcp_session.base_url,
        "protocol": "mcp", "budget": {"usd": "0.005/day", "per": "tenant"},
        "tools": {"send": {"cost_per_call": 0.01}}}]})
    calls = [["send", {"to": "ops"}], ["add", {"a": 1, "b": 2}]]
    results = await run_mcp1(tmp_path / "mcp1_sequence.py", MCP1_SEQUENCE,
                             sluice.url + "/tools/mcp", json.dumps(calls))
    assert results[0]["code"] == 400 and results[0]["data"]["reason"] == "exceeds_limit"
    assert results[1] == {"ok": "3", "is_error": False}  # the session lives on
    assert mcp_session.sends() == 0



MCP1_CANCELLED_IN_FLIGHT = """
import asyncio, json, sys, time, urllib.request
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

async def main(url, admin, token):
    async def cancel():
        await asyncio.sleep(1.5)  # the call is in flight, its SSE answer started
        req = urllib.request.Request(admin + "/admin/runs/run-1/cancel", method="POST",
                                     headers={"Authorization": "Bearer " + token})
        await asyncio.to_thread(urllib.request.urlopen, req)
    out = {}
    async with streamablehttp_client(url, headers={"X-Run-ID": "run-1"}) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            canceller = asyncio.create_task(cancel())
            started = time.monotonic()
            try:
                await asyncio.wait_for(session.call_tool("slow", {"seconds": 20}), 15)
                out["slow"] = "answered"
            except Exception as exc:
                error = getattr(exc, "error", None)
                out["slow"] = {"raised": type(exc).__name__, "code": getattr(error, "code", None),
                               "data": getattr(error, "data", None)}
            out["slow_s"] = time.monotonic() - started
            await canceller
    print(json.dumps(out))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_mcp1_call_in_flight_of_a_cancelled_run_fails_at_once(mcp_stateless, start_sluice,
                                                                     tmp_path):
    """Cancelling a run cut its MCP call's SSE answer; the 1.x client does not fail a call on a
    cut stream, so the call waited for its own timeout (15 s here; none by default). The
    stream now ends with the ``run_cancelled`` JSON-RPC error event."""
    token = "t0ken-for-cancel"
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": mcp_stateless.base_url,
        "protocol": "mcp", "tools": {"slow": {"concurrency": {"limit": 2}}}}]},
        env={"SLUICE_ADMIN_TOKEN": token})
    result = await run_mcp1(tmp_path / "mcp1_cancelled.py", MCP1_CANCELLED_IN_FLIGHT,
                            sluice.url + "/tools/mcp", sluice.admin_url, token)
    assert result["slow"]["code"] == 409, result
    assert result["slow"]["data"]["reason"] == "run_cancelled"
    assert result["slow_s"] < 14  # not the caller's own timeout (15 s): generous
    assert await sluice.metric("sluice_inflight_requests", route="tools") == 0
    assert token not in sluice.stderr()


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_mcp1_call_over_its_tools_total_timeout_fails_with_504(mcp_session, start_sluice,
                                                                      tmp_path):
    """A tool's ``timeouts.total`` cut its SSE answer, and the 1.x client waited for its own
    timeout (10 s here; none by default). The answer now ends with the ``upstream_timeout``
    JSON-RPC error event, and the session goes on."""
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": mcp_session.base_url,
        "protocol": "mcp", "tools": {"slow": {"timeouts": {"total": "1s"}}}}]})
    calls = [["slow", {"seconds": 8}], ["add", {"a": 1, "b": 2}]]
    results = await run_mcp1(tmp_path / "mcp1_sequence.py", MCP1_SEQUENCE,
                             sluice.url + "/tools/mcp", json.dumps(calls))
    assert results[0]["code"] == 504 and results[0]["data"]["reason"] == "upstream_timeout"
    assert results[1] == {"ok": "3", "is_error": False}
    assert await sluice.metric("sluice_operation_requests_total", route="tools",
                               operation="slow", outcome="upstream_timeout") == 1


async def test_calls_to_unknown_tools_do_not_open_the_shared_default_breaker(mcp_stateless,
                                                                             start_sluice):
    """The official Python server answers an unknown tool with an ``isError`` result: counted
    as tool failures on ``default``'s breaker (shared by every unnamed tool), one caller's
    made-up tool names opened it for every caller. Unless ``tool_errors: true`` says so."""
    from mcp import Client, MCPError

    def tools_route(name: str, breaker: dict) -> dict:
        return {"name": name, "path_prefix": f"/{name}/", "upstream": mcp_stateless.base_url,
                "protocol": "mcp", "tools": {"default": {"circuit_breaker": {
                    "fail_max": 3, "reset_timeout": "60s", **breaker}}}}

    sluice = await start_sluice({"routes": [tools_route("tools", {}),
                                            tools_route("strict", {"tool_errors": True})]})
    async with Client(sluice.url + "/tools/mcp") as client:
        for name in ("nope-1", "nope-2", "nope-3"):  # a model's made-up tool names
            assert (await client.call_tool(name, {})).is_error
        result = await client.call_tool("add", {"a": 1, "b": 2})  # was: circuit_open
        assert result.content[0].text == "3"
    async with Client(sluice.url + "/strict/mcp") as client:
        for name in ("nope-1", "nope-2", "nope-3"):
            assert (await client.call_tool(name, {})).is_error
        with pytest.raises(MCPError) as refused:
            await client.call_tool("add", {"a": 1, "b": 2})
        assert refused.value.error.data["reason"] == "circuit_open"


mcp_server_factory = mcp_servers.mcp_server_factory


@pytest.mark.parametrize("mode", ["stateless", "session"])
async def test_tool_call_dedup_holds_for_a_server_answering_json(mcp_server_factory,
                                                                 start_sluice, mode):
    """A server answering ``application/json`` (``json_response=True``; the TypeScript SDK's
    ``enableJsonResponse``) gave answers the idempotency store never kept: the tracker of a
    JSON answer completes only when told the body has ended, and nothing told it, so the same
    ``send`` ran twice."""
    from mcp import Client

    server = mcp_server_factory(mode, json_response=True)
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
        "protocol": "mcp", "tools": {"send": {"idempotency": {"mode": "dedup"}}}}]})
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        first = await client.call_tool("send", {"to": "ops@example.com", "body": "hi"})
        again = await client.call_tool("send", {"body": "hi", "to": "ops@example.com"})
        assert [first.content[0].text, again.content[0].text] == ["sent #1", "sent #1"]
    assert server.sends() == 1


async def test_batch_of_tool_calls_cannot_dodge_the_idempotency_key(ts_batch_server,
                                                                    start_sluice):
    # A tools/call alone gets a key from its tool and arguments on an mcp route with
    # `idempotency`, so a client's retry replays the first answer. In a batch it got none:
    # the batch's retry, or the same call sent alone and then in a batch, ran the tool again
    # (a hostile trial). Such a batch is refused, as on a route with `tools:`.
    base, count_file = ts_batch_server
    route = {"name": "tools", "path_prefix": "/tools/", "upstream": base, "protocol": "mcp",
             "idempotency": {"mode": "dedup"}}
    sluice = await start_sluice({"routes": [route]})
    async with aiohttp.ClientSession() as http:
        for body in (call(1, "send", to="a"), [call(2, "send", to="a")],
                     [call(3, "send", to="a")]):
            async with http.post(sluice.url + "/tools/mcp", json=body, headers=HEADERS) as r:
                await r.read()
                if isinstance(body, list):
                    assert (r.status, r.headers.get("X-Sluice-Reason")) == (400, "bad_request")
                else:
                    assert r.status == 200
        # A batch without a call still passes.
        control = [{"jsonrpc": "2.0", "id": 4, "method": "ping"},
                   {"jsonrpc": "2.0", "id": 5, "method": "tools/list"}]
        async with http.post(sluice.url + "/tools/mcp", json=control, headers=HEADERS) as r:
            assert r.status == 200 and len(await r.json()) == 2
    assert sends(count_file) == 1
