"""A run's cancel of a keyed MCP call asks its server to stop it, and holds the key until the
server's answer.

Sluice used to end such a call as the drain's cut does: its upstream request closed and its
idempotency key freed, while the official servers run the tool on (a closed POST stream is no
cancel to a 2025-era server). A duplicate waiting for the key then ran the tool again: two
side effects (a hostile trial). Now, on a ``dedup`` route, the caller is answered
``run_cancelled`` at once as before, Sluice POSTs the call's ``notifications/cancelled`` on the
same session, and the call holds its key until the server's answer on the call's own stream:
the cancellation error frees it (the tool stopped: the duplicate runs it, once), a result is
kept for it (the server ran the tool to its end: the duplicate gets it replayed).

Through the official SDK's server (``tests/mcp_servers.py``: ``send_after`` waits, then has
its side effect; a cancel during the wait stops it, recorded by the server), by hand-made
2025-11-25 requests so that a test sees each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import aiohttp

from policies import mcp
from tests import mcp_servers
from tests.conftest import completed_events, wait_until
from tests.mcp_servers import HTTP_HEADERS, raw_session, tool_call

mcp_session = mcp_servers.mcp_session
mcp_stateless = mcp_servers.mcp_stateless

TOKEN = "t0ken-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
#: How long the first call's tool waits before its side effect, seconds: long enough for
#: each test's steps on a busy machine, short enough when the tool runs to its end.
TOOL_S = 3.0
#: The tool's wait for a server that ignores the cancel and runs the tool on: within
#: ``CANCEL_ANSWER_WAIT_S`` (2 s), the time Sluice gives a server that took the cancel to
#: answer the call before it closes the call's stream.
RUNS_ON_S = 1.5


def mcp_route(upstream: str) -> dict:
    """A ``protocol: mcp`` route ``/tools/`` in front of ``upstream``, keeping answers."""
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream, "protocol": "mcp",
            "idempotency": {"mode": "dedup", "max_wait": "30s"}}


async def post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]
               ) -> tuple[int, str, str]:
    """POST ``body``: the status, ``Idempotent-Replayed`` and the whole answer."""
    async with http.post(url, json=body, headers=headers) as r:
        return r.status, r.headers.get("Idempotent-Replayed", ""), await r.text()


async def cancel_run(sluice: Any, http: aiohttp.ClientSession, run: str) -> dict:
    async with http.post(f"{sluice.admin_url}/admin/runs/{run}/cancel", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def session_headers(http: aiohttp.ClientSession, url: str, server: Any) -> dict[str, str]:
    """A session's request headers (a 2025-11-25 session on a session-mode server; a
    stateless one's requests carry the protocol version and no session id)."""
    if server.mode == "session":
        return await raw_session(http, url)
    return {**HTTP_HEADERS, "MCP-Protocol-Version": "2025-11-25"}


async def cancelled_while_a_duplicate_waits(sluice, headers: dict[str, str], seconds: float,
                                            completed: int = 2):
    """A keyed ``send_after`` call of run ``job`` (its SSE answer begun: the server has it),
    its duplicate waiting for the key, then the run cancelled: the cancel's report, the
    first call's answer, the duplicate's (status, ``Idempotent-Replayed``, body), and the
    ``completed`` events once ``completed`` of them are logged."""
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        first = tool_call(1, "send_after", to="ops", seconds=seconds)
        async with http.post(url, json=first, headers={**headers, "X-Run-ID": "job"}) as r:
            assert r.status == 200
            duplicate = asyncio.create_task(post(
                http, url, tool_call(2, "send_after", to="ops", seconds=seconds), headers))
            await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
            report = await cancel_run(sluice, http, "job")
            answer = await r.text()
        dup = await asyncio.wait_for(duplicate, 40)
        events = await completed_events(sluice, completed)
    return report, answer, dup, events


async def test_the_server_stops_the_tool_and_the_waiting_duplicate_runs_it_once(
        mcp_session, start_sluice):
    """The session-mode server honours the cancel (the 2.x server answers -32800): no side
    effect of the first call; the duplicate, which waited for the key until that answer,
    runs the tool: one side effect in all. Before: the first call's tool ran on at the
    server while the duplicate ran it too (two sends, no cancel seen by the server)."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    async with aiohttp.ClientSession() as http:
        headers = await session_headers(http, sluice.url + "/tools/mcp", mcp_session)
    report, answer, (status, replayed, body), events = await cancelled_while_a_duplicate_waits(
        sluice, headers, TOOL_S)
    assert '"reason":"run_cancelled"' in answer.replace(" ", "") and '"id":1' in answer
    cancels, sends = mcp_session.cancels(), mcp_session.sends()
    assert sends == 1
    assert cancels == ["ops"]  # the server got the cancel, and stopped the tool
    assert (status, replayed) == (200, "") and "sent #1" in body and '"id":2' in body
    assert report["calls_ended"] == 1
    [ended] = [e for e in events if e["run"] == "job"]
    assert ended["outcome"] == "run_cancelled"
    assert (ended["finished_after_leaving"], ended["finished_status"]) == ("cancelled", 200)
    [sent] = [e for e in sluice.events() if e["event"] == "cancel_sent"]
    assert sent["status"] == 202 and sent["request_id"] == ended["request_id"]
    assert await sluice.metric("sluice_finished_after_leaving_total", route="tools",
                               outcome="cancelled") == 1


async def test_a_server_that_runs_the_tool_on_has_its_result_replayed_to_the_duplicate(
        mcp_stateless, start_sluice):
    """The stateless server cannot stop the tool (each POST is a transport of its own: the
    cancel names a request it does not know, which the spec lets it ignore): the tool runs
    to its end, its result is kept for the key, and the duplicate gets it replayed. One side
    effect. Before: the duplicate ran the tool beside the first (two sends). (A tool that
    runs on past ``CANCEL_ANSWER_WAIT_S`` is cut then: the review test of a silent server.)"""
    sluice = await start_sluice({"routes": [mcp_route(mcp_stateless.base_url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    async with aiohttp.ClientSession() as http:
        headers = await session_headers(http, sluice.url + "/tools/mcp", mcp_stateless)
    _, answer, (status, replayed, body), events = await cancelled_while_a_duplicate_waits(
        sluice, headers, RUNS_ON_S, completed=1)
    assert '"reason":"run_cancelled"' in answer.replace(" ", "")
    assert mcp_stateless.sends() == 1 and mcp_stateless.cancels() == []
    assert (status, replayed) == (200, "true") and "sent #1" in body and '"id":2' in body
    [ended] = events
    assert ended["outcome"] == "run_cancelled"
    assert ended["finished_after_leaving"] == "2xx"
    [sent] = [e for e in sluice.events() if e["event"] == "cancel_sent"]
    assert sent["status"] == 202  # acknowledged, and dropped


async def test_a_call_finishing_without_its_caller_is_cancelled_at_its_server(
        mcp_session, start_sluice):
    """Its caller left first (the call is finished without it, holding its key), then its
    run is cancelled: the server is asked to cancel it and stops the tool; the duplicate
    runs it, once. Before: the finish was cut and the key freed, the tool ran on (two
    sends)."""
    sluice = await start_sluice({"routes": [mcp_route(mcp_session.base_url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await session_headers(http, url, mcp_session)
        begun = asyncio.Event()

        async def leaving() -> None:
            async with http.post(url, json=tool_call(1, "send_after", to="ops", seconds=TOOL_S),
                                 headers={**headers, "X-Run-ID": "job"}):
                begun.set()
                await asyncio.Event().wait()  # until cancelled: the caller leaves

        caller = asyncio.create_task(leaving())
        await asyncio.wait_for(begun.wait(), 10)
        caller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await caller
        await sluice.wait_metric("sluice_finishing_after_leaving", 1)
        duplicate = asyncio.create_task(post(
            http, url, tool_call(2, "send_after", to="ops", seconds=TOOL_S), headers))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        report = await cancel_run(sluice, http, "job")
        status, replayed, body = await duplicate
        events = await completed_events(sluice, 2)
    assert mcp_session.sends() == 1
    assert mcp_session.cancels() == ["ops"]
    assert (status, replayed) == (200, "") and "sent #1" in body
    assert report["calls_ended"] == 1  # the server answered the cancel within its wait
    [ended] = [e for e in events if e["run"] == "job"]
    assert ended["outcome"] == "client_disconnected"  # its caller's
    assert ended["finished_after_leaving"] == "cancelled"
    assert await sluice.metric("sluice_cancels_total", route="tools", where="inflight") == 1


async def cut_by_the_drain(mcp_session, start_sluice, make_route):  # type: ignore[no-untyped-def]
    """A Sluice with the route ``make_route`` builds and a 300 ms drain, a slow tool call
    through it, SIGTERM while it runs: the call is answered ``draining``, the process exits,
    and the server was told to stop the tool before its side effect. Returns the Sluice."""
    sluice = await start_sluice({"server": {"drain_timeout": "300ms"},
                                 "routes": [make_route(mcp_session.base_url)]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await session_headers(http, url, mcp_session)
        async with http.post(url, json=tool_call(1, "send_after", to="ops", seconds=TOOL_S),
                             headers=headers) as r:
            assert r.status == 200
            sluice.signal(signal.SIGTERM)
            answer = await r.text()
        assert '"reason":"draining"' in answer.replace(" ", "")
    assert await sluice.wait_exit(timeout=20) == 0
    await wait_until(lambda: mcp_session.cancels() == ["ops"], what="the tool cancelled")
    assert mcp_session.sends() == 0
    return sluice


async def test_the_drain_cut_tells_the_server_to_stop_the_tool(mcp_session, start_sluice):
    """Past ``drain_timeout`` the cut closes a keyed call's upstream request, as before, and
    now sends its server the call's cancel too (before the process exits): the tool stops
    before its side effect. Before: it ran on after Sluice had gone."""
    sluice = await cut_by_the_drain(mcp_session, start_sluice, mcp_route)
    [sent] = [e for e in sluice.events() if e["event"] == "cancel_sent"]
    assert sent["status"] == 202


def test_the_cancel_notification_and_which_revisions_take_it() -> None:
    """The body Sluice posts, and the revisions whose cancel it is: at 2026-07-28 closing
    the call's stream is the cancel (Sluice closes it, and posts nothing)."""
    body = mcp.cancel_notification(7, "Sluice: run r was cancelled")
    assert mcp.parse_post(body, "2025-11-25").cancels == 7
    assert mcp.parse_post(mcp.cancel_notification("a", "x"), "2025-06-18").cancels == "a"
    assert [mcp.cancels_by_closing(v) for v in (None, "2025-03-26", "2025-11-25",
                                                "2026-07-28")] == [False, False, False, True]


def plain_route(upstream: str, **extra: Any) -> dict:
    """A ``protocol: mcp`` route ``/tools/`` that keeps no answers (no ``idempotency``)."""
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream, "protocol": "mcp",
            **extra}


async def test_a_runs_cancel_on_a_route_without_dedup_stops_the_tool(mcp_session, start_sluice):
    """A run's cancel of a call on a route that keeps no answers: its caller is answered
    ``run_cancelled`` and the slot freed, as before, and now the server is asked to stop the
    tool too, so it does not do its side effect. Before: only calls kept for their keys were
    cancelled at their servers; this one's tool ran on (a closed POST is no cancel to a
    2025 server), its side effect after its run was cancelled."""
    sluice = await start_sluice({"routes": [plain_route(mcp_session.base_url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await session_headers(http, url, mcp_session)
        async with http.post(url, json=tool_call(1, "send_after", to="ops", seconds=TOOL_S),
                             headers={**headers, "X-Run-ID": "job"}) as r:
            assert r.status == 200
            report = await cancel_run(sluice, http, "job")
            answer = await r.text()
    assert '"reason":"run_cancelled"' in answer.replace(" ", "")
    assert report["calls_ended"] == 1
    await wait_until(lambda: mcp_session.cancels() == ["ops"], what="the tool cancelled")
    await asyncio.sleep(TOOL_S)  # past the time its side effect would have come
    assert mcp_session.sends() == 0
    [sent] = [e for e in sluice.events() if e["event"] == "cancel_sent"]
    assert sent["status"] == 202


async def test_a_tool_past_its_timeout_is_cancelled_at_its_server(mcp_session, start_sluice):
    """A tool's ``timeouts.total`` passes: its caller gets ``upstream_timeout`` as before, and
    the server is asked to stop the tool, on a ``dedup`` route too (whose key is freed for a
    retry). Before: the tool ran on, its side effect after its caller was told it timed out,
    and the retry ran it a second time."""
    route = {**mcp_route(mcp_session.base_url),
             "tools": {"send_after": {"timeouts": {"total": "1s"}}}}
    sluice = await start_sluice({"routes": [route]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await session_headers(http, url, mcp_session)
        _, _, answer = await post(http, url, tool_call(1, "send_after", to="ops",
                                                       seconds=TOOL_S), headers)
    assert '"reason":"upstream_timeout"' in answer.replace(" ", "")
    await wait_until(lambda: mcp_session.cancels() == ["ops"], what="the tool cancelled")
    await asyncio.sleep(TOOL_S)
    assert mcp_session.sends() == 0
    [sent] = [e for e in sluice.events() if e["event"] == "cancel_sent"]
    assert sent["status"] == 202


async def test_the_drain_cut_stops_the_tool_on_a_route_without_dedup(mcp_session,
                                                                      start_sluice):
    """Past ``drain_timeout`` a call on a route that keeps no answers is answered
    ``draining`` as before, and its server is now told to stop the tool."""
    await cut_by_the_drain(mcp_session, start_sluice, plain_route)
