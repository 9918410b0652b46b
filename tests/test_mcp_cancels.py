"""On a ``dedup`` route, a client's cancel of its keyed call in flight is held, not forwarded.

The 2025-era clients (Python ``mcp`` 1.x, 2.x in ``legacy`` mode, the TypeScript SDK 1.x and
the 2.x client in legacy mode) time a call out by sending ``notifications/cancelled`` on the
same session. Sluice forwarded it; the server cancelled the tool after its side effect had
run and answered -32800, which is never kept for the key; so the client's retry ran the tool
again: two executions per call (a hostile trial). Sluice now answers such a cancel itself
(202, as a server answers a notification) when it names a keyed call of the same session
still in flight through it on a ``dedup`` route: the tool runs to its end, its answer is kept
for the key, and the retry gets it. Any other cancel is forwarded as before.

The first tests run the official clients against the official session-mode server
(``tests/mcp_servers.py``); the last puts a recording upstream behind Sluice to see which
cancels reach it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from mcp import Client, MCPError

from tests import mcp_servers
from tests.conftest import REPO, wait_until
from tests.test_mcp_left_callers import (
    CALL,
    HEADERS,
    ScriptedMcp,
    assert_all_given_back,
    leave_a_call,
    noticed_leaving,
)
from tests.test_operations import MCP1_PYTHON, run_mcp1

mcp_session = mcp_servers.mcp_session

MCP_TS = REPO / ".mcp-ts"
TS_RETRY_CLIENT = REPO / "tests" / "mcp_ts" / "retry_client.mjs"
#: The client's timeout of the first call, seconds; the tool takes 2 s.
FIRST_TIMEOUT_S = 0.5


def mcp_route(upstream: str, name: str = "tools", **policies: Any) -> dict:
    """A ``protocol: mcp`` route ``/<name>/`` in front of ``upstream``."""
    return {"name": name, "path_prefix": f"/{name}/", "upstream": upstream, "protocol": "mcp",
            **policies}


DEDUP = {"mode": "dedup", "max_wait": "30s"}


def text(result: Any) -> str:
    return result.content[0].text


def cancel(request_id: Any) -> dict:
    """A client's ``notifications/cancelled`` of its request ``request_id``."""
    return {"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": "timed out"}}


async def held_cancels(sluice: Any, count: int) -> list[dict]:
    """The ``cancel_held`` events, once ``count`` are in the log (flushed every 0.2 s)."""
    def written() -> bool:
        return sum(e["event"] == "cancel_held" for e in sluice.events()) >= count

    await wait_until(written, what=f"{count} cancel_held event(s)")
    return [e for e in sluice.events() if e["event"] == "cancel_held"]


async def assert_ran_once_and_replayed(sluice: Any, server: Any) -> None:
    """The timed-out call ran once, the retry got its answer replayed, the client's cancel
    was held (logged and counted), and nothing stays held."""
    assert server.sends() == 1
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 1
    [held] = await held_cancels(sluice, 1)
    assert held["status"] == 202 and held["operation"] == "send_slowly"
    [call] = [e for e in sluice.events() if e["event"] == "admitted"
              and e.get("operation") == "send_slowly"]
    assert held["call_request_id"] == call["request_id"]
    assert held["idempotency_key"] == call["idempotency_key"]
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="cancel_held") == 1
    await assert_all_given_back(sluice)


# -- through the official clients and the session-mode server -------------------------------------


async def test_python_2x_legacy_client_timed_out_call_runs_once(mcp_session, start_sluice):
    """Before: ``sent #2``: the retry ran the tool again, the server having cancelled the
    first run (after its side effect) on the client's ``notifications/cancelled``."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url,
                                                      idempotency=DEDUP)]})
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        with pytest.raises(MCPError) as timed_out:
            await client.call_tool("send_slowly", {"to": "ops", "seconds": 2},
                                   read_timeout_seconds=FIRST_TIMEOUT_S)
        assert "timed out" in str(timed_out.value).lower()
        result = await client.call_tool("send_slowly", {"to": "ops", "seconds": 2},
                                        read_timeout_seconds=30)
        assert text(result) == "sent #1" and not result.is_error
    await assert_ran_once_and_replayed(sluice, mcp_session)


MCP1_RETRY = """
import asyncio, json, sys
from datetime import timedelta
from mcp import ClientSession, types
from mcp.client.streamable_http import streamablehttp_client

async def main(url, first_timeout_s):
    out = {}
    args = {"to": "ops", "seconds": 2}
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            try:
                await session.call_tool("send_slowly", args,
                                        read_timeout_seconds=timedelta(seconds=first_timeout_s))
                out["first"] = "answered"
            except Exception as exc:
                out["first"] = f"{type(exc).__name__}: {exc}"[:200]
                # 1.x sends no cancel of its own on a timeout: the application aborts the
                # call with one (the id of the call just sent).
                await session.send_notification(types.ClientNotification(
                    types.CancelledNotification(params=types.CancelledNotificationParams(
                        requestId=session._request_id - 1, reason="timed out"))))
            result = await session.call_tool("send_slowly", args,
                                             read_timeout_seconds=timedelta(seconds=30))
            out["retry"] = result.content[0].text
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


@pytest.mark.skipif(not MCP1_PYTHON.exists(), reason="no .venv-mcp1 (the mcp 1.x client)")
async def test_python_1x_client_timed_out_call_runs_once(mcp_session, start_sluice, tmp_path):
    """The 1.x client's timeout sends no ``notifications/cancelled`` (its call's answer then
    comes, and is kept, as before); an application aborts a call by sending one, as the later
    clients do on a timeout. Before: ``sent #2``, as with the 2.x client in legacy mode."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url,
                                                      idempotency=DEDUP)]})
    out = await run_mcp1(tmp_path / "mcp1_retry.py", MCP1_RETRY, sluice.url + "/tools/mcp",
                         str(FIRST_TIMEOUT_S))
    assert "Timed out" in out["first"], out
    assert out["retry"] == "sent #1"
    await assert_ran_once_and_replayed(sluice, mcp_session)


@pytest.mark.parametrize("package", ["sdk", "client"])
async def test_typescript_clients_timed_out_call_runs_once(mcp_session, start_sluice, package):
    """The TypeScript SDK 1.x (``sdk``) and the 2.x client in its default legacy mode
    (``client``). Before: ``sent #2``."""
    if shutil.which("node") is None or not (MCP_TS / "node_modules" / "@modelcontextprotocol"
                                            / package).is_dir():
        pytest.skip("needs node and .mcp-ts (.ci/run installs them)")
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url,
                                                      idempotency=DEDUP)]})
    proc = await asyncio.create_subprocess_exec(
        "node", str(TS_RETRY_CLIENT), sluice.url + "/tools/mcp", package,
        str(int(FIRST_TIMEOUT_S * 1000)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "MCP_TS_DIR": str(MCP_TS)})
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    out = json.loads(stdout)
    assert "timed out" in out["first"].lower(), out
    assert out["retry"] == "sent #1"
    await assert_ran_once_and_replayed(sluice, mcp_session)


async def test_a_cancel_on_a_route_without_dedup_still_stops_the_tool(mcp_session,
                                                                       start_sluice):
    """Without ``dedup`` nothing is kept for a retry to get: the client's cancel goes to the
    server, which stops the tool and answers the call "Request cancelled"."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url,
                                                      idempotency={"mode": "forward"})]})
    url = sluice.url + "/tools/mcp"
    call = mcp_servers.tool_call(7, "send_slowly", to="ops", seconds=20)
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)

        async def answer() -> str:
            async with http.post(url, json=call, headers=headers) as r:
                return await r.text()

        answered = asyncio.create_task(answer())
        await wait_until(lambda: mcp_session.sends() == 1, what="the tool running")
        async with http.post(url, json=cancel(7), headers=headers) as r:
            assert r.status == 202
        assert "Request cancelled" in await answered  # the server stopped the tool
    assert not [e for e in sluice.events() if e["event"] == "cancel_held"]
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="cancel_held") == 0
    await assert_all_given_back(sluice)


# -- which cancels are held: a recording upstream --------------------------------------------------


class RecordingMcp(ScriptedMcp):
    """:class:`ScriptedMcp` that also keeps every ``notifications/cancelled`` it got, and
    answers notifications 202 as an MCP server does."""

    def __init__(self) -> None:
        super().__init__()
        self.cancels: list[dict] = []

    async def _post(self, request: web.Request) -> web.StreamResponse:
        message = await request.json()
        if message.get("method") == "notifications/cancelled":
            self.cancels.append({"requestId": message["params"]["requestId"],
                                 "session": request.headers.get("Mcp-Session-Id")})
            return web.Response(status=202)
        return await super()._post(request)


@pytest.fixture
async def recording() -> Any:
    server = await RecordingMcp().start()
    yield server
    await server.stop()


async def test_only_a_cancel_naming_a_keyed_call_of_its_session_in_flight_is_held(
        recording, start_sluice):
    """Held: the cancel of the session's call in flight (its handler running, or finished
    without its caller after it left). Forwarded: an unknown id, the id as a string when the
    call's was a number, another session, no session, a route without ``dedup``, a call
    already answered."""
    recording.mode = "sse"
    sluice = await start_sluice({"routes": [
        mcp_route(recording.url, idempotency=DEDUP),
        mcp_route(recording.url, name="plain", idempotency={"mode": "forward"})]})
    url, plain = sluice.url + "/tools/mcp", sluice.url + "/plain/mcp"
    session = {**HEADERS, "Mcp-Session-Id": "s-1"}

    async with aiohttp.ClientSession() as http:
        async def post(target: str, message: dict, headers: dict) -> int:
            async with http.post(target, json=message, headers=headers) as r:
                await r.read()
                return r.status

        async def forwarded(target: str, request_id: Any, headers: dict) -> bool:
            before = len(recording.cancels)
            assert await post(target, cancel(request_id), headers) == 202
            return len(recording.cancels) == before + 1

        call = asyncio.create_task(post(url, CALL, session))  # id 1, held at the upstream
        await wait_until(lambda: recording.inflight == 1, what="the call at the upstream")
        assert await forwarded(url, 2, session)  # no such call
        assert await forwarded(url, "1", session)  # another id: "1" is not 1
        assert await forwarded(url, 1, {**HEADERS, "Mcp-Session-Id": "s-2"})
        assert await forwarded(url, 1, HEADERS)  # no session
        assert await forwarded(plain, 1, session)  # another route: not the call's
        assert not await forwarded(url, 1, session)  # held: Sluice answered 202 itself
        recording.release.set()
        assert await call == 200
        assert recording.finished == 1 and recording.cut == 0
        await wait_until(lambda: recording.inflight == 0, what="the call's end")
        assert await forwarded(url, 1, session)  # answered already: nothing to hold

        # A call on a route without dedup, in flight: its cancel goes to the server.
        recording.release.clear()
        call = asyncio.create_task(post(plain, CALL, session))
        await wait_until(lambda: recording.inflight == 1, what="the call at the upstream")
        assert await forwarded(plain, 1, session)
        recording.release.set()
        assert await call == 200

        # A call finished without its caller (it left): still in flight through Sluice. (Of
        # another tenant: the first call's answer is kept for the key of this tenant's.)
        recording.release.clear()
        team_b = {"Mcp-Session-Id": "s-3", "X-Tenant-ID": "team-b"}
        await leave_a_call(http, url, recording, after_first_event=True, **team_b)
        await noticed_leaving(sluice, recording)
        assert await forwarded(url, 1, {**HEADERS, "Mcp-Session-Id": "s-3"})  # another tenant
        assert not await forwarded(url, 1, {**HEADERS, **team_b})
        recording.release.set()
        await sluice.wait_metric("sluice_finishing_after_leaving", 0)
        assert recording.finished == 3 and recording.cut == 0

    held = await held_cancels(sluice, 2)
    assert [e["status"] for e in held] == [202, 202]
    assert [c["requestId"] for c in recording.cancels] == [2, "1", 1, 1, 1, 1, 1, 1]
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="cancel_held") == 2
    await assert_all_given_back(sluice)
    await sluice.wait_metric("sluice_inflight_requests", 0, route="plain")
