"""A client's cancel of its MCP call still waiting in Sluice ends that call there.

Before: a ``notifications/cancelled`` naming a call still queued in Sluice (or waiting for a
twin's answer) was forwarded to a server that had never seen the call, and the call stayed
in the queue; once a slot freed it was sent, and the tool ran though its client had given up
on it. The Python 2.x client in ``legacy`` mode, whose timeout sends the cancel and leaves
the POST open, shows it: a ``send`` that timed out while queued ran when the slot freed, and
the application's retry ran it a second time.

Now Sluice answers such a cancel itself (202, not forwarded), and the waiting call is ended
where it waits: its POST is answered with the JSON-RPC error -32800 "Request cancelled" (as
the SDK's own server answers a call its client cancelled), nothing is sent upstream, and
everything it held is given back. A cancel naming anything else is handled as before.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from mcp import Client, MCPError

from tests import mcp_servers
from tests.conftest import wait_until
from tests.test_mcp_cancels import RecordingMcp, cancel, mcp_route
from tests.test_mcp_left_callers import CALL, HEADERS, TOKEN, assert_all_given_back

mcp_session = mcp_servers.mcp_session

ONE_SLOT = {"limit": 1, "queue": 4, "max_wait": "30s"}


@pytest.fixture
async def recording() -> Any:
    server = await RecordingMcp().start()
    yield server
    await server.stop()


async def events_of(sluice: Any, kind: str, count: int) -> list[dict]:
    """The ``kind`` events, once ``count`` are in the log (flushed every 0.2 s)."""
    def written() -> bool:
        return sum(e["event"] == kind for e in sluice.events()) >= count

    await wait_until(written, what=f"{count} {kind} event(s)")
    return [e for e in sluice.events() if e["event"] == kind]


async def test_python_2x_client_call_timed_out_in_the_queue_never_runs(mcp_session,
                                                                        start_sluice,
                                                                        tmp_path: Path):
    """Before: the cancelled ``send`` ran once the slot freed, and the retry said ``sent #2``."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_session.base_url, idempotency={"mode": "forward"}, concurrency=ONE_SLOT)]})
    gate = tmp_path / "gate"
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        holder = asyncio.create_task(client.call_tool("gated", {"path": str(gate)},
                                                      read_timeout_seconds=30))
        await wait_until(lambda: any(e.get("operation") == "gated" for e in sluice.events()),
                         what="the gated call admitted")
        with pytest.raises(MCPError) as timed_out:
            await client.call_tool("send", {"to": "ops"}, read_timeout_seconds=0.5)
        assert "timed out" in str(timed_out.value).lower()
        [applied] = await events_of(sluice, "cancel_applied", 1)
        await sluice.wait_metric("sluice_queue_depth", 0, route="tools")
        gate.touch()  # the slot frees: a call still queued would be sent now
        assert not (await holder).is_error
        # The retry queues behind any call still queued, so it runs after it.
        retried = await client.call_tool("send", {"to": "ops"}, read_timeout_seconds=30)
        assert retried.content[0].text == "sent #1"
    assert mcp_session.sends() == 1
    await assert_all_given_back(sluice)
    [enqueued] = [e for e in sluice.events() if e["event"] == "enqueued"]
    assert applied["call_request_id"] == enqueued["request_id"]
    assert applied["status"] == 202 and applied["operation"] == "send"
    [ended] = [e for e in sluice.events() if e["event"] == "completed"
               and e["request_id"] == enqueued["request_id"]]
    assert ended["outcome"] == "client_cancelled" and ended["status"] == 200
    assert "waited_s" in ended and "duration_s" not in ended
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="client_cancelled") == 1
    assert await sluice.metric("sluice_requests_total", route="tools",
                               outcome="cancel_applied") == 1


async def test_a_queued_call_is_answered_request_cancelled_and_its_cancel_not_forwarded(
        recording, start_sluice):
    """Raw JSON-RPC: the queued POST gets -32800 with its id; the cancel is answered 202 and
    never reaches the server; cancels naming anything else (another id, ``"2"`` for ``2``,
    another session or tenant, no session) are forwarded and leave the call queued; the
    call's rate unit is given back (it never ran)."""
    sluice = await start_sluice({"routes": [mcp_route(
        recording.url, idempotency={"mode": "forward"}, concurrency=ONE_SLOT,
        rate={"requests": "3/min"})]})
    url = sluice.url + "/tools/mcp"
    session = {**HEADERS, "Mcp-Session-Id": "s-1"}
    queued_call = {**CALL, "id": 2}

    async with aiohttp.ClientSession() as http:
        async def post(message: dict, headers: dict) -> tuple[int, str]:
            async with http.post(url, json=message, headers=headers) as r:
                return r.status, await r.text()

        async def forwarded(request_id: Any, headers: dict) -> bool:
            before = len(recording.cancels)
            assert (await post(cancel(request_id), headers))[0] == 202
            return len(recording.cancels) == before + 1

        holder = asyncio.create_task(post(CALL, session))  # id 1: takes the one slot
        await wait_until(lambda: recording.inflight == 1, what="the first call upstream")
        queued = asyncio.create_task(post(queued_call, session))
        await sluice.wait_metric("sluice_queue_depth", 1, route="tools")
        assert await forwarded(3, session)  # no such call
        assert await forwarded("2", session)  # "2" is not 2
        assert await forwarded(2, {**HEADERS, "Mcp-Session-Id": "s-2"})
        assert await forwarded(2, {**session, "X-Tenant-ID": "team-b"})
        assert await forwarded(2, HEADERS)  # no session
        assert await sluice.metric("sluice_queue_depth", route="tools") == 1
        assert not await forwarded(2, session)  # ended in Sluice
        status, body = await asyncio.wait_for(queued, 10)
        assert status == 200
        assert '"code":-32800' in body and '"id":2' in body and '"sent":false' in body
        assert await sluice.metric("sluice_queue_depth", route="tools") == 0
        recording.release.set()
        assert (await holder)[0] == 200
        # The 3 a minute had the first call's unit and the cancelled call's, given back:
        # two more calls pass.
        assert (await post({**CALL, "id": 4}, session))[0] == 200
        assert (await post({**CALL, "id": 5}, session))[0] == 200
        status, body = await post({**CALL, "id": 6}, session)
        assert status == 200 and '"reason":"rate_limited"' in body  # a JSON-RPC error
    assert recording.calls == 3
    assert [c["requestId"] for c in recording.cancels] == [3, "2", 2, 2, 2]
    await assert_all_given_back(sluice)


async def test_a_call_waiting_for_its_twins_answer_is_ended_and_the_twin_runs_on(
        recording, start_sluice):
    """``dedup``: a second call of the same key waits for the first's answer; its client's
    cancel ends that wait only (not the first call, which is the server's, nor its own
    cancel forwarded)."""
    sluice = await start_sluice({"routes": [mcp_route(
        recording.url, idempotency={"mode": "dedup", "max_wait": "30s"})]})
    url = sluice.url + "/tools/mcp"
    first = {**HEADERS, "Mcp-Session-Id": "s-1"}
    second = {**HEADERS, "Mcp-Session-Id": "s-2"}

    async with aiohttp.ClientSession() as http:
        async def post(message: dict, headers: dict) -> tuple[int, str]:
            async with http.post(url, json=message, headers=headers) as r:
                return r.status, await r.text()

        running = asyncio.create_task(post(CALL, first))
        await wait_until(lambda: recording.inflight == 1, what="the first call upstream")
        twin = asyncio.create_task(post({**CALL, "id": 9}, second))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        assert (await post(cancel(9), second))[0] == 202
        status, body = await asyncio.wait_for(twin, 10)
        assert status == 200 and '"code":-32800' in body and '"id":9' in body
        assert await sluice.metric("sluice_idempotency_waiting", route="tools") == 0
        recording.release.set()
        status, body = await running
        assert status == 200 and "-32800" not in body
    assert recording.calls == 1 and recording.cut == 0 and recording.cancels == []
    await assert_all_given_back(sluice)


async def test_a_client_cancel_and_a_run_cancel_together_answer_the_call_once(
        recording, start_sluice):
    """Both cancels reach a queued call of run ``job`` within one loop turn: the call is
    answered once (the client's cancel came first), and nothing stays held."""
    sluice = await start_sluice({"routes": [mcp_route(
        recording.url, idempotency={"mode": "forward"}, concurrency=ONE_SLOT)]},
        env={"SLUICE_ADMIN_TOKEN": TOKEN})
    url = sluice.url + "/tools/mcp"
    session = {**HEADERS, "Mcp-Session-Id": "s-1", "X-Run-ID": "job"}

    async with aiohttp.ClientSession() as http:
        async def post(message: dict, headers: dict) -> tuple[int, str]:
            async with http.post(url, json=message, headers=headers) as r:
                return r.status, await r.text()

        async def cancel_run() -> int:
            async with http.post(f"{sluice.admin_url}/admin/runs/job/cancel",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                return r.status

        holder = asyncio.create_task(post(CALL, {**session, "X-Run-ID": "other"}))
        await wait_until(lambda: recording.inflight == 1, what="the first call upstream")
        queued = asyncio.create_task(post({**CALL, "id": 2}, session))
        await sluice.wait_metric("sluice_queue_depth", 1, route="tools")
        client_cancel, run_cancel = await asyncio.gather(post(cancel(2), session),
                                                         cancel_run())
        assert client_cancel[0] == 202 and run_cancel == 200
        status, body = await asyncio.wait_for(queued, 10)
        assert status == 200 and ('"code":-32800' in body or "run_cancelled" in body)
        recording.release.set()
        assert (await holder)[0] == 200
    assert recording.calls == 1
    await assert_all_given_back(sluice)
    ends = [e for e in sluice.events() if e.get("request_id") and e["event"] in
            ("completed", "rejected") and e.get("outcome") != "2xx"]
    assert len(ends) == 1, ends
