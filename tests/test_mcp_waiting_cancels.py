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
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from mcp import Client, MCPError

import policies.mcp
from proxy import handler
from proxy.config import parse_config
from proxy.runtime import Runtime
from tests import mcp_servers, test_mcp_cancels
from tests.conftest import wait_until
from tests.test_mcp_cancels import DEDUP, RecordingMcp, cancel, mcp_route
from tests.test_mcp_left_callers import (
    CALL,
    HEADERS,
    TOKEN,
    assert_all_given_back,
    serve_in_process,
)

mcp_session = mcp_servers.mcp_session
recording = test_mcp_cancels.recording

ONE_SLOT = {"limit": 1, "queue": 4, "max_wait": "30s"}


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
    """Both cancels reach a queued call of run ``job`` at once: the call is answered once,
    by whichever came first, and nothing stays held (in-process, each order in one loop
    turn: below)."""
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
    # Events are written in order: once the holder's end is in the log, so is the queued
    # call's, which came before it.
    # The first admitted is the holder's; the log may not have it yet (flushed every 0.2 s).
    holder_id = (await events_of(sluice, "admitted", 1))[0]["request_id"]
    await wait_until(lambda: any(e["event"] == "completed" and e["request_id"] == holder_id
                                 for e in sluice.events()), what="the holder's end logged")
    [enqueued] = [e for e in sluice.events() if e["event"] == "enqueued"]
    ends = [e for e in sluice.events() if e["event"] in ("completed", "rejected")
            and e["request_id"] == enqueued["request_id"]]
    assert len(ends) == 1, ends


# -- in one loop turn: the runtime served in this process -----------------------------------------
# (From a hostile review of the change.) What a cancel's request does between its body and
# its 202, _waiting_call then _end_waiting, never suspends: calling the two is that cancel
# arriving at that instant, so it can be made to land in the same loop turn as something else.


class IdsMcp(RecordingMcp):
    """:class:`RecordingMcp` that also keeps the JSON-RPC id of every ``tools/call`` it got."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[Any] = []

    async def _post(self, request: Any) -> Any:
        message = await request.json()
        if message.get("method") == "tools/call":
            self.ids.append(message["id"])
        return await super()._post(request)


@pytest.fixture
async def ids_upstream() -> Any:
    server = await IdsMcp().start()
    yield server
    await server.stop()


@contextlib.asynccontextmanager
async def served(upstream: str, extra: str = "") -> AsyncIterator[tuple[Runtime, str]]:
    """A runtime with one ``tools`` mcp route (one slot, a queue of 4) served in this
    process, and its MCP endpoint's URL."""
    rt = Runtime(parse_config(
        "routes:\n"
        f"  - {{name: tools, path_prefix: /tools/, upstream: '{upstream}', protocol: mcp,\n"
        "      idempotency: {mode: forward},\n"
        f"      concurrency: {{limit: 1, queue: 4, max_wait: 30s}}{extra}}}\n"))
    await rt.open()
    runner, url = await serve_in_process(rt)
    try:
        yield rt, url
    finally:
        await runner.cleanup()
        await rt.close()


def queued(rt: Runtime) -> int:
    return rt.router.match("/tools/mcp").concurrency.queued


def client_cancel(rt: Runtime, rpc_id: Any, session: str = "s-1") -> bool:
    """What a client's cancel of its call ``rpc_id`` does, synchronously; ``False`` when it
    would be forwarded."""
    route = rt.router.match("/tools/mcp")
    [call] = [c for c in rt.admitting if c.rpc_id == rpc_id]
    found = handler._waiting_call(rt, route, call.tenant, session, rpc_id)
    if found is None:
        return False
    handler._end_waiting(rt, route, *found, "cancel-request", call.tenant, call.run)
    return True


async def assert_nothing_held(rt: Runtime) -> None:
    route = rt.router.match("/tools/mcp")
    await wait_until(lambda: route.inflight == 0 and not rt.admitting, what="all given back")
    assert route.concurrency.inflight == 0 and route.concurrency.queued == 0
    assert not rt.cancelled_waiting and not rt.mcp_calls


async def send(http: aiohttp.ClientSession, url: str, message: dict,
               headers: dict) -> tuple[int, str]:
    async with http.post(url, json=message, headers=headers) as r:
        return r.status, await r.text()


SESSION = {**HEADERS, "Mcp-Session-Id": "s-1"}


async def test_a_cancel_in_the_turn_its_call_is_handed_a_slot(ids_upstream):
    """The slot is handed to call 2 (its waiter resolved, its task not resumed yet) and its
    client's cancel lands in that turn: call 2 is answered -32800 and never sent, and the
    slot passes on to call 3."""
    async with served(ids_upstream.url) as (rt, url):
        limiter = rt.router.match("/tools/mcp").concurrency
        grant, fired = limiter._grant, []

        def grant_then_cancel(waiter: Any, value: object) -> None:
            grant(waiter, value)
            if not fired:
                fired.append(client_cancel(rt, 2))

        limiter._grant = grant_then_cancel
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(send(http, url, CALL, SESSION))
            await wait_until(lambda: ids_upstream.inflight == 1, what="call 1 upstream")
            second = asyncio.create_task(send(http, url, {**CALL, "id": 2}, SESSION))
            await wait_until(lambda: queued(rt) == 1, what="call 2 queued")
            third = asyncio.create_task(send(http, url, {**CALL, "id": 3}, SESSION))
            await wait_until(lambda: queued(rt) == 2, what="call 3 queued")
            ids_upstream.release.set()
            answers = await asyncio.wait_for(asyncio.gather(first, second, third), 10)
        assert fired == [True]
        assert '"code":-32800' in answers[1][1] and "done" in answers[2][1]
        assert ids_upstream.ids == [1, 3]
        await assert_nothing_held(rt)


@pytest.mark.parametrize("order", ["client_first", "run_first"])
async def test_a_client_cancel_and_a_run_cancel_in_one_turn(ids_upstream, monkeypatch, order):
    """Both cancels in one loop turn, each order: the call is answered once (-32800 when the
    client's came first, 409 ``run_cancelled`` when the run's did), the client's cancel is
    answered here in both orders (the server never saw the call), nothing stays held, and
    the handler's task answers with no cancellation left pending (a run's cancel after the
    client's left one: ``cancelling()`` was 1)."""
    pending: list[int] = []
    real = policies.mcp.cancelled

    def answer(rpc_id: Any, **shape: bool) -> bytes:
        task = asyncio.current_task()
        pending.append(task.cancelling() if task is not None else -1)
        return real(rpc_id, **shape)

    monkeypatch.setattr(policies.mcp, "cancelled", answer)
    async with served(ids_upstream.url) as (rt, url):
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(send(http, url, CALL, {**SESSION, "X-Run-ID": "other"}))
            await wait_until(lambda: ids_upstream.inflight == 1, what="call 1 upstream")
            second = asyncio.create_task(send(http, url, {**CALL, "id": 2},
                                              {**SESSION, "X-Run-ID": "job"}))
            await wait_until(lambda: queued(rt) == 1, what="call 2 queued")
            [call] = list(rt.admitting)
            if order == "client_first":
                applied = client_cancel(rt, 2)
                rt.runs.cancel("job", 60.0, call.tenant)
            else:
                rt.runs.cancel("job", 60.0, call.tenant)
                applied = client_cancel(rt, 2)
            status, body = await asyncio.wait_for(second, 10)
            ids_upstream.release.set()
            await first
        assert applied
        assert ids_upstream.ids == [1]
        await assert_nothing_held(rt)
    if order == "client_first":
        assert status == 200 and '"code":-32800' in body and pending == [0]
    else:
        assert '"run_cancelled"' in body and pending == []


async def test_two_cancels_of_one_queued_call_are_both_answered_here(ids_upstream):
    """Two cancels of one queued call at once (two connections): the second, landing before
    the call's handler has run, was forwarded to a server that never saw the call (10 of
    10)."""
    async with served(ids_upstream.url) as (rt, url):
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(send(http, url, CALL, SESSION))
            await wait_until(lambda: ids_upstream.inflight == 1, what="call 1 upstream")
            for rpc_id in range(100, 105):
                waiting = asyncio.create_task(send(http, url, {**CALL, "id": rpc_id}, SESSION))
                await wait_until(lambda: queued(rt) == 1, what="the call queued")
                cancels = await asyncio.gather(send(http, url, cancel(rpc_id), SESSION),
                                               send(http, url, cancel(rpc_id), SESSION))
                assert [status for status, _ in cancels] == [202, 202]
                assert '"code":-32800' in (await asyncio.wait_for(waiting, 10))[1]
            ids_upstream.release.set()
            await first
        assert ids_upstream.ids == [1] and ids_upstream.cancels == []
        await assert_nothing_held(rt)


async def test_a_cancelled_queued_call_gives_its_runs_count_back(ids_upstream):
    """Run ``job`` may make 2 calls (``run.max_requests``): its queued call cancelled by its
    client gives its count back, so one more call of the run passes and the next is
    refused."""
    async with served(ids_upstream.url, ",\n      run: {max_requests: 2}") as (rt, url):
        job = {**SESSION, "X-Run-ID": "job"}
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(send(http, url, CALL, job))
            await wait_until(lambda: ids_upstream.inflight == 1, what="call 1 upstream")
            waiting = asyncio.create_task(send(http, url, {**CALL, "id": 2}, job))
            await wait_until(lambda: queued(rt) == 1, what="call 2 queued")
            assert (await send(http, url, cancel(2), job))[0] == 202
            assert '"code":-32800' in (await waiting)[1]
            ids_upstream.release.set()
            await first
            third = await send(http, url, {**CALL, "id": 3}, job)
            fourth = await send(http, url, {**CALL, "id": 4}, job)
        assert "done" in third[1] and "run_budget_exhausted" in fourth[1]
        assert ids_upstream.ids == [1, 3]
        await assert_nothing_held(rt)


async def test_python_2x_clients_timed_out_in_the_queue_get_their_timeout_error(
        mcp_session, start_sluice, tmp_path: Path):
    """Before: the cancelled call's POST was answered ``application/json`` while the server
    answers its session's calls over SSE; the Python 2.x client, which had closed that
    call's response stream at its timeout, hit it with ``send_nowait`` on its JSON path and
    raised ``anyio.BrokenResourceError`` out of the client (3 or 4 clients of 6 in a hostile
    trial) instead of the call's ``MCPError`` "timed out" (the 2.x client's normal timeout,
    what it raises against the server directly). Now it is answered as the server
    answers a cancelled call: one SSE event carrying the -32800 error."""
    sluice = await start_sluice({"routes": [mcp_route(
        mcp_session.base_url, tools={"slow": {"concurrency": {"limit": 1, "queue": 4}}})]})
    url = sluice.url + "/tools/mcp"

    def leaves(error: BaseException) -> list[BaseException]:
        if isinstance(error, BaseExceptionGroup):
            return [leaf for each in error.exceptions for leaf in leaves(each)]
        return [error]

    async def one(seconds: float, timeout: float = 0.6) -> str:
        try:
            async with Client(url, mode="legacy", read_timeout_seconds=timeout) as client:
                await client.call_tool("slow", {"seconds": seconds})
        except BaseException as error:  # what escaped the client is the bug
            found = leaves(error)
            if all(isinstance(e, MCPError) and "timed out" in str(e).lower() for e in found):
                return "timed out"
            return ", ".join(repr(e) for e in found)
        return "answered"

    # One holds the slot and four queue (a sixth would be refused queue_full). The holder
    # times out (2.5 s) well after the queued four have (0.6 s after each sends, which waits
    # on the holder's admitted event and a handshake), so their cancels find them still
    # queued: with one timeout for all, the holder's cancel freed the slot just as the first
    # queued call's own cancel came, and on a busy machine that call was handed the slot and
    # sent first (one clean-clone CI run of three, and a new user's suite).
    holder = asyncio.create_task(one(3.0, timeout=2.5))
    await wait_until(lambda: any(e["event"] == "admitted" and e.get("operation") == "slow"
                                 for e in sluice.events()), what="the holder's call admitted")
    queued = [asyncio.create_task(one(1.5 + i / 1000)) for i in range(1, 5)]
    outcomes = [await holder, *await asyncio.gather(*queued)]
    assert outcomes == ["timed out"] * 5
    [*_, last] = await events_of(sluice, "cancel_applied", 1)
    assert last["status"] == 202
    await assert_all_given_back(sluice)


async def test_a_cancelled_queued_call_is_answered_in_the_stream_its_client_accepts(
        recording, start_sluice):
    """Raw HTTP: with ``text/event-stream`` in its Accept, the queued call's POST gets one SSE
    event holding the -32800 error for its id (the server's own shape); a client accepting
    only JSON gets the JSON body."""
    sluice = await start_sluice({"routes": [mcp_route(
        recording.url, idempotency={"mode": "forward"}, concurrency=ONE_SLOT)]})
    url = sluice.url + "/tools/mcp"
    session = {**HEADERS, "Mcp-Session-Id": "s-1"}
    async with aiohttp.ClientSession() as http:
        async def post(message: dict, headers: dict) -> tuple[int, str | None, str]:
            async with http.post(url, json=message, headers=headers) as r:
                return r.status, r.headers.get("Content-Type"), await r.text()

        holder = asyncio.create_task(post(CALL, session))
        await wait_until(lambda: recording.inflight == 1, what="the first call upstream")
        for rpc_id, accept, shape in ((2, HEADERS["Accept"], "text/event-stream"),
                                      (3, "application/json", "application/json")):
            queued = asyncio.create_task(post({**CALL, "id": rpc_id},
                                              {**session, "Accept": accept}))
            await sluice.wait_metric("sluice_queue_depth", 1, route="tools")
            assert (await post(cancel(rpc_id), session))[0] == 202
            status, content_type, body = await asyncio.wait_for(queued, 10)
            assert status == 200 and content_type is not None
            assert content_type.startswith(shape)
            error = (policies.mcp.answer_outcome(body.encode(), content_type, rpc_id))
            assert error is not None and error.cancelled
            if shape == "text/event-stream":
                assert body.startswith("event: message\ndata: {") and body.endswith("}\n\n")
        recording.release.set()
        assert (await holder)[0] == 200


class FailsOnceMcp(RecordingMcp):
    """:class:`RecordingMcp` whose first ``tools/call`` is answered 503 ``Retry-After: 1``
    (no tool runs): the call waits out Sluice's retry back-off before its next attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def _post(self, request: web.Request) -> web.StreamResponse:
        if self.refused == 0 and (await request.json()).get("method") == "tools/call":
            self.refused += 1
            return web.Response(status=503, headers={"Retry-After": "1"})
        return await super()._post(request)


@pytest.mark.parametrize("idempotency", [{"mode": "forward"}, DEDUP])
async def test_a_cancel_of_a_call_in_retry_back_off_ends_it_with_no_next_attempt(
        idempotency: dict, start_sluice):
    """Its first attempt answered 503, the call waits 1 s before the next; its client's cancel
    then used to go on to a server where nothing of it ran (202 for nothing), and the next
    attempt ran the tool the client had given up on. Now it ends the call as it ends a queued
    one: 202 from Sluice, not forwarded, -32800 for the call, no second attempt; on ``dedup``
    too (the call's forward task, which waits the back-off, is cancelled)."""
    server = await FailsOnceMcp().start()
    server.release.set()
    try:
        sluice = await start_sluice({"routes": [mcp_route(
            server.url, idempotency=idempotency, idempotent=True,
            retry={"attempts": 3, "on": [503], "backoff": {"base": "1s", "max": "1s"}})]})
        url = sluice.url + "/tools/mcp"
        session = {**HEADERS, "Mcp-Session-Id": "s-1"}
        async with aiohttp.ClientSession() as http:
            async def post(message: dict) -> tuple[int, str]:
                async with http.post(url, json=message, headers=session) as r:
                    return r.status, await r.text()

            answer = asyncio.create_task(post(CALL))
            await wait_until(lambda: server.refused == 1, what="the first attempt refused")
            await events_of(sluice, "retried", 1)
            assert (await post(cancel(CALL["id"])))[0] == 202
            status, body = await asyncio.wait_for(answer, 10)
            assert status == 200 and '"code":-32800' in body
            await asyncio.sleep(1.5)  # past the back-off: a next attempt would be sent by now
        assert server.calls == 0 and server.cancels == []
        [ended] = [e for e in sluice.events() if e["event"] == "completed"
                   and e.get("operation") == CALL["params"]["name"]]
        assert ended["outcome"] == "client_cancelled" and ended["status"] == 200
        assert await sluice.metric("sluice_requests_total", route="tools",
                                   outcome="cancel_applied") == 1
        await assert_all_given_back(sluice)
    finally:
        await server.stop()


async def test_a_cancel_in_back_off_after_its_caller_left_ends_the_call_client_cancelled(
        tmp_path: Path) -> None:
    """A review: on ``dedup``, a call's caller left while its forward task waited out a retry
    back-off (finished without it); its client's cancel then cancelled that task, but with
    no handler left to take the call back out of ``cancelled_waiting``, it stayed there,
    body and all, for the life of the process, and was counted ``client_disconnected``."""
    server = await FailsOnceMcp().start()
    server.release.set()
    rt = Runtime(parse_config(
        f"dead_letter: {{path: '{tmp_path}/dlq.sqlite'}}\n"
        "routes:\n"
        f"  - {{name: tools, path_prefix: /tools/, upstream: '{server.url}', protocol: mcp,\n"
        "      idempotent: true, idempotency: {mode: dedup, max_wait: 30s},\n"
        "      retry: {attempts: 3, on: [503], backoff: {base: 2s, max: 2s}}}\n"))
    await rt.open()
    runner, url = await serve_in_process(rt)
    try:
        session = {**HEADERS, "Mcp-Session-Id": "s-1"}
        async with aiohttp.ClientSession() as http:
            caller = asyncio.create_task(http.post(url, json=CALL, headers=session))
            await wait_until(lambda: bool(rt.backing_off), what="the call in back-off")
        caller.cancel()  # its caller leaves: the forward task goes on without it
        await wait_until(lambda: bool(rt.finishing), what="the call finished without its caller")
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=cancel(CALL["id"]), headers=session) as r:
                assert r.status == 202
        await wait_until(lambda: not rt.finishing, what="the forward task's end")
        assert rt.cancelled_waiting == set()
        (route,) = rt.routes
        outcomes = route.metrics.outcomes
        assert outcomes["client_cancelled"].value == 1
        assert outcomes["client_disconnected"].value == 0
        assert outcomes["cancel_applied"].value == 1
        assert server.calls == 0
        assert route.present == 0 and rt.buffered_bytes == 0
    finally:
        await runner.cleanup()
        await rt.close()
        await server.stop()
