"""A review of the run's cancel of a keyed MCP call (dedup, 2025-era), which sends the
server Sluice's own ``notifications/cancelled`` and holds the key for its answer: Sluice's
own retries stop at the cancel; a server that takes the cancel and stays silent (as the spec
says it should) has the call closed after ``CANCEL_ANSWER_WAIT_S``; the 1.x Python SDK
servers (session and stateless); the headers the cancel carries."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests import mcp_servers
from tests.conftest import wait_until
from tests.mcp_servers import HTTP_HEADERS, tool_call
from tests.test_mcp_run_cancel_upstream import (
    TOKEN,
    cancel_run,
    cancelled_while_a_duplicate_waits,
    mcp_route,
    post,
)

mcp_session = mcp_servers.mcp_session
mcp_stateless = mcp_servers.mcp_stateless

V2025 = {**HTTP_HEADERS, "MCP-Protocol-Version": "2025-11-25"}


class FakeMcp:
    """A hand-made MCP server (2025-11-25, sessionless) in the test's loop, on 127.0.0.1.

    ``tools/call``: by ``mode``
      * ``"silent"``: an SSE answer (200, headers only), then nothing; a
        ``notifications/cancelled`` naming it is acknowledged (202) and the request is
        not answered, as the spec says a receiver SHOULD NOT (the TypeScript SDK server's
        Protocol._onrequest drops the handler's result once its AbortController aborted),
        and the stream stays open (that transport closes a POST's stream once every
        request on it has its response);
      * ``"retry_then_ok"``: the first call is 503 ``Retry-After: 2``; later ones a JSON result.
    Every POST's body and headers are recorded (``posts``)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.posts: list[tuple[float, dict, dict[str, str]]] = []
        self.calls = 0
        self.runner: web.AppRunner | None = None
        self.base_url = ""
        self.release = asyncio.Event()

    async def start(self) -> FakeMcp:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    def of(self, method: str) -> list[tuple[float, dict, dict[str, str]]]:
        return [p for p in self.posts if p[1].get("method") == method]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        doc = json.loads(raw) if raw else {}
        self.posts.append((time.monotonic(), doc, dict(request.headers)))
        method = doc.get("method")
        if method == "notifications/cancelled":
            return web.Response(status=202)
        if method != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": doc.get("id"), "result": {}})
        self.calls += 1
        if self.mode == "retry_then_ok" or (self.mode == "silent" and self.calls > 1):
            if self.calls == 1 and self.mode == "retry_then_ok":
                return web.Response(status=503, headers={"Retry-After": "2"}, text="busy")
            return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": {
                "content": [{"type": "text", "text": f"ran #{self.calls}"}]}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache"})
        await out.prepare(request)
        with contextlib.suppress(asyncio.CancelledError, ConnectionResetError):
            await self.release.wait()
        return out


@pytest.mark.parametrize("caller_leaves", [False, True])
async def test_a_run_cancel_during_a_retry_back_off_sends_no_attempt_after_it(start_sluice,
                                                                              caller_leaves):
    """A keyed call got 503 (Retry-After: 2) and waits in Sluice's retry back-off when its
    run is cancelled: nothing of it is at the server, so no cancel is sent and the call
    ends; no attempt goes out after the cancel. The same through ``Call.stop`` when its
    caller left in the back-off first (the call finished without it, held). (A review: the
    first cut took it for a call at the server, sent a cancel naming an answered request,
    and left the back-off running: the tools/call went out again after the cancel.)"""
    fake = await FakeMcp("retry_then_ok").start()
    try:
        route = {**mcp_route(fake.base_url), "idempotent": True,
                 "retry": {"on": [503], "attempts": 3}}
        sluice = await start_sluice({"routes": [route]}, env={"SLUICE_ADMIN_TOKEN": TOKEN})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as http:
            call = asyncio.create_task(post(http, url, tool_call(1, "send", to="ops"),
                                            {**V2025, "X-Run-ID": "job"}))
            await wait_until(lambda: fake.calls == 1, what="the first attempt")
            if caller_leaves:
                call.cancel()  # the caller leaves in the back-off
                with contextlib.suppress(asyncio.CancelledError):
                    await call
                await sluice.wait_metric("sluice_finishing_after_leaving", 1)
            else:
                await asyncio.sleep(0.3)  # in the back-off now
            cancelled_at = time.monotonic()
            await cancel_run(sluice, http, "job")
            if not caller_leaves:
                _, _, body = await call
                assert "run_cancelled" in body
            await asyncio.sleep(3.0)  # past the back-off
        after = [p for p in fake.of("tools/call") if p[0] > cancelled_at]
        assert after == [], (
            f"{len(after)} tools/call sent upstream after the run was cancelled; "
            f"cancels sent: {len(fake.of('notifications/cancelled'))}")
    finally:
        await fake.stop()


async def test_a_server_silent_after_taking_the_cancel_gives_key_and_slot_back_soon(
        start_sluice):
    """MCP 2025-06-18/2025-11-25 Cancellation: the receiver of a notifications/cancelled
    SHOULD NOT send a response for the cancelled request (the TypeScript SDK server sends
    none, and its POST stream stays open). Once the server took the cancel, Sluice waits
    ``CANCEL_ANSWER_WAIT_S`` for its answer, then closes the call and gives its key and
    slot (concurrency limit 1 here) back: the waiting duplicate and another call run. (A
    review: the first cut held them to ``timeouts.total``, 600 s by default.)"""
    fake = await FakeMcp("silent").start()
    try:
        route = {**mcp_route(fake.base_url), "concurrency": {"limit": 1, "queue": 4,
                                                              "max_wait": "4s"}}
        route["idempotency"]["max_wait"] = "4s"
        sluice = await start_sluice({"routes": [route]}, env={"SLUICE_ADMIN_TOKEN": TOKEN})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=tool_call(1, "send", to="ops"),
                                 headers={**V2025, "X-Run-ID": "job"}) as r:
                assert r.status == 200
                await wait_until(lambda: fake.calls == 1, what="the call at the server")
                duplicate = asyncio.create_task(post(
                    http, url, tool_call(2, "send", to="ops"), V2025))
                await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
                report = await cancel_run(sluice, http, "job")
                answer = await r.text()
            assert "run_cancelled" in answer
            await wait_until(lambda: fake.of("notifications/cancelled"), what="the cancel")
            other = await post(http, url, tool_call(3, "send", to="someone-else"), V2025)
            _, _, body = await duplicate
        assert report["calls_ended"] == 1
        # What should hold: the server acknowledged the cancel; the key and slot come back.
        problems = []
        if "ran #" not in body:
            problems.append(f"duplicate: {body[:160]}")
        if "ran #" not in other[2]:
            problems.append(f"another call: {other[2][:160]}")
        assert not problems, problems
    finally:
        await fake.stop()


# -- the mcp 1.x Python SDK server (FastMCP, in .venv-mcp1) ---------------------------------



REPO = Path(__file__).resolve().parent.parent
MCP1_PY = REPO / ".venv-mcp1" / "bin" / "python"


@dataclass
class Mcp1:
    mode: str
    base_url: str
    count: Path

    def sends(self) -> int:
        return len(self.count.read_text().splitlines()) if self.count.exists() else 0

    def cancels(self) -> list[str]:
        p = self.count.with_suffix(".cancels")
        return p.read_text().splitlines() if p.exists() else []


@contextlib.contextmanager
def run_mcp1(mode: str, tmp: Path, json_response: bool = False):
    count = tmp / f"mcp1-{mode}.jsonl"
    count.write_text("")
    args = [str(MCP1_PY), str(REPO / "tests" / "mcp1_cancel_server.py"), mode, str(count)]
    if json_response:
        args.append("json")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(tmp / "mcp1.err", "wb"))
    try:
        port = mcp_servers._read_port(proc, tmp / "mcp1.err")
        yield Mcp1(mode, f"http://127.0.0.1:{port}", count)
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.fixture
def mcp1_session(tmp_path: Path):
    if not MCP1_PY.exists():
        pytest.skip("no .venv-mcp1")
    with run_mcp1("session", tmp_path) as srv:
        yield srv


@pytest.fixture
def mcp1_stateless(tmp_path: Path):
    if not MCP1_PY.exists():
        pytest.skip("no .venv-mcp1")
    with run_mcp1("stateless", tmp_path) as srv:
        yield srv


async def _first_cancelled_then_duplicate(sluice, headers, completed=2, seconds=3.0):
    report, answer, dup, events = await cancelled_while_a_duplicate_waits(
        sluice, headers, seconds, completed)
    assert "run_cancelled" in answer and report["calls_ended"] + report["calls_still_running"] == 1
    return dup, events


async def test_mcp1_session_server_stops_the_tool(mcp1_session, start_sluice):
    """The 1.x session server stops the tool and answers code 0 "Request cancelled", which
    frees the key: the duplicate runs the tool, once."""
    sluice = await start_sluice({"routes": [mcp_route(mcp1_session.base_url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, sluice.url + "/tools/mcp")
    dup, events = await _first_cancelled_then_duplicate(sluice, headers)
    assert dup[0] == 200 and dup[1] == ""
    assert mcp1_session.sends() == 1
    assert mcp1_session.cancels() == ["ops"]
    [ended] = [e for e in events if e["run"] == "job"]
    assert ended["finished_after_leaving"] == "cancelled"


async def test_mcp1_stateless_server_runs_the_tool_on_and_its_result_is_replayed(
        mcp1_stateless, start_sluice):
    """The 1.x stateless server ignores the cancel and finishes the tool (within
    ``CANCEL_ANSWER_WAIT_S``): its result is replayed to the duplicate (one send)."""
    sluice = await start_sluice({"routes": [mcp_route(mcp1_stateless.base_url)]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    dup, _ = await _first_cancelled_then_duplicate(sluice, V2025, completed=1, seconds=1.5)
    assert mcp1_stateless.sends() == 1 and dup[1] == "true"  # replayed, as with 2.x


async def test_the_cancel_carries_the_headers_the_call_went_with(start_sluice):
    """The route's removed headers, Connection-named ones, the caller's Authorization
    (own_credentials) and the deadline header stay off the cancel (a caller's
    ``X-Request-Timeout: 0`` was on it), which names the call's id as sent."""
    fake = await FakeMcp("silent").start()
    try:
        base = fake.base_url.replace("http://", "http://user:pw@")
        route = {**mcp_route(base), "request_headers_to_remove": ["X-Secret"]}
        sluice = await start_sluice({"routes": [route]}, env={"SLUICE_ADMIN_TOKEN": TOKEN})
        url = sluice.url + "/tools/mcp"
        extra = {"X-Run-ID": "job", "X-Secret": "s3cr3t", "Connection": "X-Hop",
                 "X-Hop": "hop", "Authorization": "Bearer caller", "X-Forwarded-For": "1.2.3.4",
                 "X-Request-Timeout": "0"}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "?q=1", json=tool_call(1, "send", to="ops"),
                                 headers={**V2025, **extra}) as r:
                await wait_until(lambda: fake.calls == 1, what="the call")
                await cancel_run(sluice, http, "job")
                await r.text()
            await wait_until(lambda: fake.of("notifications/cancelled"), what="the cancel")
        assert len(fake.of("tools/call")) == 1
        [(_, body, cancel_h)] = fake.of("notifications/cancelled")
        low = {k.lower(): v for k, v in cancel_h.items()}
        assert "x-secret" not in low and "x-hop" not in low
        assert low["authorization"].startswith("Basic ")
        assert "x-request-timeout" not in low
        assert body["params"]["requestId"] == 1
    finally:
        await fake.stop()
