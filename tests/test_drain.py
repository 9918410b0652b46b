"""SIGTERM: stop taking work, finish what is in flight, exit; cut what outlives drain_timeout."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.server import PROXY_SHUTDOWN_GRACE_S, _drain
from tests.conftest import (
    free_ports,
    open_runtime,
    route,
    serve_runtime,
    status_of,
    wait_until,
)
from tests.mcp_servers import (  # noqa: F401  (fixtures)
    mcp_server_factory,
    mcp_session,
    mcp_stateless,
    raw_session,
    tool_call,
)
from tests.redis_servers import delete_prefix, new_prefix, require_redis

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


async def openai_sluice(start_sluice, upstream, drain_timeout: str,
                        **policies: object) -> tuple[Any, str]:
    """A Sluice with one ``openai`` route (``policies`` on it) and ``drain_timeout``, and the
    route's chat completions URL."""
    sluice = await start_sluice({
        "server": {"drain_timeout": drain_timeout},
        "routes": [route("openai", upstream.url, "openai", **policies)],
    })
    return sluice, sluice.url + "/openai/v1/chat/completions"


async def test_sigterm_drains_in_flight_work_and_refuses_new(upstream, start_sluice):
    sluice = await start_sluice({
        "server": {"drain_timeout": "20s"},
        "routes": [route("openai", upstream.url, "openai"), route("mcp", upstream.url, "mcp")],
    })
    url = sluice.url + "/openai/v1/chat/completions"
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        async def in_flight() -> tuple[int, dict]:
            async with session.post(url, json=CHAT) as r:
                return r.status, await r.json()

        call = asyncio.create_task(in_flight())
        await wait_until(lambda: upstream.inflight == 1, what="the request at the upstream")
        sluice.signal(signal.SIGTERM)
        signalled = time.monotonic()

        # Bounded well inside drain_timeout: a /readyz that never says "draining" fails here,
        # naming its answer, rather than polling until the drain ends and the process exits
        # (the CI failure: a stale body compare, then "connect refused" 20 s later).
        answer: tuple[int, dict] = (0, {})
        deadline = signalled + 5
        while time.monotonic() < deadline:
            async with session.get(sluice.admin_url + "/readyz") as r:
                answer = (r.status, await r.json())
            if answer[0] == 503 and answer[1]["status"] == "draining":
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"/readyz did not report draining within 5 s: {answer}")
        assert answer[1]["state"]["backend"] == "memory"
        async with session.get(sluice.admin_url + "/healthz") as r:
            assert r.status == 200  # alive, only not ready

        async with session.post(url, json=CHAT) as r:
            assert r.status == 503
            assert r.headers["X-Sluice-Reason"] == "draining"
            assert r.headers["Retry-After"] == "1"
            assert r.headers["x-should-retry"] == "true"
            assert r.headers["Connection"] == "close"  # its next call goes to another replica
            assert (await r.json())["error"]["code"] == "draining"
        # An MCP caller gets a JSON-RPC error for its own request id.
        async with session.post(sluice.url + "/mcp/mcp", json=tool_call(41, "add")) as r:
            assert r.status == 200  # an HTTP error would end a 1.x client's session (mcp.md)
            assert r.headers["X-Sluice-Reason"] == "draining"
            body = await r.json()
        assert body["id"] == 41 and body["error"]["data"]["reason"] == "draining"
        assert len(upstream.requests) == 1  # the refused requests never reached the upstream
        assert not call.done()

        upstream.hold.set()
        status, body = await call
    assert status == 200 and body["choices"][0]["message"]["content"] == "hello from fake"
    assert await sluice.wait_exit(timeout=20) == 0
    assert time.monotonic() - signalled < 20  # it left when the work was done, not at the timeout
    events = sluice.events()  # flushed at exit
    assert [e["reason"] for e in events if e["event"] == "rejected"] == ["draining"] * 2
    assert [e["status"] for e in events if e["event"] == "completed"] == [200]
    assert "drained" in sluice.stderr()


async def test_work_past_drain_timeout_is_cut_and_the_process_exits(upstream, start_sluice):
    sluice, url = await openai_sluice(start_sluice, upstream, "500ms")
    upstream.hold = asyncio.Event()  # never set: this request outlives the drain
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(status_of(session, url, CHAT))
        await wait_until(lambda: upstream.inflight == 1, what="the request at the upstream")
        sluice.signal(signal.SIGTERM)
        signalled = time.monotonic()
        with pytest.raises(aiohttp.ClientError):  # cut: no answer, not a made-up one
            await call
        cut_after = time.monotonic() - signalled
        assert await sluice.wait_exit(timeout=30) == 0
        # Cut when the drain ends, not ~2 s later (aiohttp's shutdown grace waited twice);
        # the bound leaves a loaded machine 1.5 s.
        assert 0.5 <= cut_after < 2.0
    # The cut reached the upstream too: its request was cancelled, not left running.
    await wait_until(lambda: upstream.cancelled == 1, what="the upstream request cancelled")
    assert "drain timeout: cutting 1 request(s) still in flight" in sluice.stderr()
    # Logged as Sluice's cut, not blamed on the caller.
    [completed] = [e for e in sluice.events() if e["event"] == "completed"]
    assert completed["outcome"] == "drain_cut"


def _by_request(events: list[dict]) -> dict[str, list[dict]]:
    by_request: dict[str, list[dict]] = {}
    for event in events:
        by_request.setdefault(event.get("request_id"), []).append(event)
    return by_request


async def _answer(session: aiohttp.ClientSession, url: str, body: dict,
                  headers: dict[str, str]) -> tuple[int, dict[str, str], dict]:
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_calls_still_queued_when_the_drain_ends_are_answered_503_not_cut(upstream,
                                                                               start_sluice):
    # A queued call never reached the upstream: a closed connection told its caller nothing
    # (an SDK cannot tell whether a POST cut so ran). Each queue answers in its route's shape:
    # a route's slot queue, an MCP route's (a JSON-RPC error for its id) and a run's width
    # queue (fanout.width); the calls at the upstream are still cut.
    sluice = await start_sluice({
        "server": {"drain_timeout": "500ms"},
        "routes": [
            route("openai", upstream.url, "openai",
                  concurrency={"limit": 1, "queue": 1, "max_wait": "60s"}),
            route("mcp", upstream.url, "mcp",
                  concurrency={"limit": 1, "queue": 1, "max_wait": "60s"}),
            route("tools", upstream.url, "http", fanout={"width": 1, "max_wait": "60s"}),
        ],
    })
    upstream.hold = asyncio.Event()  # never set: the held calls end only by the cut
    openai_url = sluice.url + "/openai/v1/chat/completions"
    mcp_url, tools_url = sluice.url + "/mcp/mcp", sluice.url + "/tools/x"
    run = {"X-Run-ID": "run-1"}
    async with aiohttp.ClientSession() as session:
        # One after the other: sent together, a queued call could take the slot first.
        held: list[asyncio.Task] = []

        async def hold(url: str, body: dict, headers: dict[str, str]) -> None:
            index = len(held)
            held.append(asyncio.create_task(
                _answer(session, url, body, {"X-Request-ID": f"held-{index}", **headers})))
            await wait_until(lambda: upstream.inflight == index + 1,
                             what=f"held call {index} at the upstream")

        await hold(openai_url, CHAT, {})
        await hold(mcp_url, tool_call(6, "search"), {})
        await hold(tools_url, {"n": 1}, run)
        queued = [
            asyncio.create_task(_answer(session, openai_url, CHAT, {"X-Request-ID": "q-openai"})),
            asyncio.create_task(_answer(session, mcp_url, tool_call(7, "search"),
                                        {"X-Request-ID": "q-mcp"})),
            asyncio.create_task(_answer(session, tools_url, {"n": 2},
                                        {"X-Request-ID": "q-tools", **run})),
        ]
        await wait_until(lambda: {e["request_id"] for e in sluice.events()
                                  if e["event"] == "enqueued"} == {"q-openai", "q-mcp", "q-tools"},
                         what="the three calls queued")
        sluice.signal(signal.SIGTERM)
        held_openai, held_mcp, held_tools = await asyncio.gather(*held, return_exceptions=True)
        for outcome in (held_openai, held_tools):
            assert isinstance(outcome, aiohttp.ClientError)  # cut: no answer
        # An MCP call in flight gets its JSON-RPC error instead: a cut POST fails no call on
        # the Python mcp 1.x client, which then waits for ever (docs/mcp.md).
        assert not isinstance(held_mcp, BaseException)
        status, _, body = held_mcp
        assert status == 200 and body["id"] == 6
        assert body["error"]["data"]["reason"] == "draining"
        (s_openai, h_openai, b_openai), (s_mcp, h_mcp, b_mcp), (s_tools, h_tools, b_tools) = (
            await asyncio.gather(*queued))
        assert await sluice.wait_exit(timeout=30) == 0

    assert s_openai == 503 and b_openai["error"]["code"] == "draining"
    assert b_openai["error"]["type"] == "server_error"
    assert s_tools == 503 and b_tools["error"]["reason"] == "draining"
    assert b_tools["error"]["retry_after_s"] == 1.0
    # MCP: HTTP 200 with a JSON-RPC error for its own id (an HTTP error status would end a
    # 1.x client's whole session, docs/mcp.md), as for the drain's other refusals.
    assert s_mcp == 200 and b_mcp["id"] == 7
    assert b_mcp["error"]["code"] == 503 and b_mcp["error"]["data"]["reason"] == "draining"
    for headers in (h_openai, h_mcp, h_tools):
        assert headers["X-Sluice-Reason"] == "draining"
        assert headers["Retry-After"] == "1" and headers["x-should-retry"] == "true"
        assert headers["Connection"] == "close"  # the process is going away

    stderr = sluice.stderr()
    assert ("drain timeout: cutting 3 request(s) still in flight and 0 being read; "
            "3 waiting answered 503 draining") in stderr
    assert "Traceback" not in stderr
    by_request = _by_request(sluice.events())
    for request_id in ("q-openai", "q-mcp", "q-tools"):
        # Counted and logged as a refusal (sluice_rejections_total{reason="draining"}), as
        # a queue_timeout is: `enqueued` then `rejected`, and no `completed` event.
        assert [e["event"] for e in by_request[request_id]] == ["enqueued", "rejected"]
        assert by_request[request_id][-1]["reason"] == "draining"
    for index in range(3):
        events = by_request[f"held-{index}"]
        names = [e["event"] for e in events]
        # The MCP call's server is told of the cut (notifications/cancelled, docs/mcp.md).
        assert names.count("cancel_sent") == (index == 1)
        assert [name for name in names if name != "cancel_sent"] == ["admitted", "completed"]
        assert next(e for e in events if e["event"] == "completed")["outcome"] == "drain_cut"
    # The held calls' slots, freed by the cut, went to nobody: only they reached the upstream,
    # and the MCP call's cancel.
    calls = [seen for seen in upstream.requests if b"notifications/cancelled" not in seen.body]
    assert len(calls) == 3
    assert [json.loads(seen.body)["params"]["requestId"] for seen in upstream.requests
            if b"notifications/cancelled" in seen.body] == [6]


async def test_a_queued_call_the_drain_answers_is_counted_as_a_refusal(upstream, tmp_path):
    # In process, to read the counters the process takes with it: the answered call counts
    # in sluice_rejections_total{reason="draining"} and as a `rejected` outcome, the cut one
    # as drain_cut, and nothing stays held or queued.
    events = tmp_path / "events.jsonl"
    runtime = await open_runtime(
        route("openai", upstream.url, concurrency={"limit": 1, "queue": 1, "max_wait": "60s"}),
        events={"path": str(events)})
    runner, port = await serve_runtime(runtime, shutdown_timeout=PROXY_SHUTDOWN_GRACE_S)
    url = f"http://127.0.0.1:{port}/openai/v1/chat/completions"
    upstream.hold = asyncio.Event()
    [route_] = runtime.routes

    def sample(name: str, **labels: str) -> float:
        value = runtime.metrics.registry.get_sample_value(name, {"route": "openai", **labels})
        return value or 0.0

    try:
        async with aiohttp.ClientSession() as session:
            held = asyncio.create_task(status_of(session, url, CHAT))
            await wait_until(lambda: upstream.inflight == 1, what="one call at the upstream")
            queued = asyncio.create_task(_answer(session, url, CHAT, {}))
            await wait_until(lambda: sample("sluice_queue_depth") == 1, what="one call queued")
            hurry = asyncio.Event()
            hurry.set()
            await _drain(runtime, 60.0, hurry)  # as a second SIGTERM: at once
            await runner.cleanup()  # serve()'s next step: what is in flight is cut
            status, headers, _ = await queued
            with pytest.raises(aiohttp.ClientError):
                await held
    finally:
        await runner.cleanup()
        await runtime.close()
    assert (status, headers["X-Sluice-Reason"]) == (503, "draining")
    assert sample("sluice_rejections_total", reason="draining") == 1
    assert sample("sluice_requests_total", outcome="rejected") == 1
    assert sample("sluice_requests_total", outcome="drain_cut") == 1
    assert sample("sluice_requests_total", outcome="client_disconnected") == 0
    assert sample("sluice_queue_depth") == 0 and sample("sluice_inflight_requests") == 0
    assert route_.present_total == 0 and not runtime.admitting
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["event"], e.get("reason") or e.get("outcome")) for e in lines
            if e["event"] in ("rejected", "completed")] in (
        [("rejected", "draining"), ("completed", "drain_cut")],
        [("completed", "drain_cut"), ("rejected", "draining")])


async def test_a_second_sigterm_answers_queued_calls_at_once(upstream, start_sluice):
    sluice, url = await openai_sluice(start_sluice, upstream, "120s",
                                      concurrency={"limit": 1, "queue": 2, "max_wait": "120s"})
    upstream.hold = asyncio.Event()  # never set
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(_answer(session, url, CHAT, {}))
        await wait_until(lambda: upstream.inflight == 1, what="one call at the upstream")
        queued = [asyncio.create_task(_answer(session, url, CHAT, {"X-Request-ID": f"q{n}"}))
                  for n in range(2)]
        await sluice.wait_metric("sluice_queue_depth", 2, route="openai")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining: 1 request(s) in flight, 2 more waiting"
                         in sluice.stderr(), what="the drain started")
        await asyncio.sleep(1.2)  # an operator's second one, not the same Ctrl-C twice
        assert not any(task.done() for task in queued)  # the first signal waits for them
        sluice.signal(signal.SIGTERM)
        answers = await asyncio.gather(*queued)
        with pytest.raises(aiohttp.ClientError):
            await held
        assert await sluice.wait_exit(timeout=60) == 0  # long before the 120 s drain_timeout
    assert [(status, headers["X-Sluice-Reason"], body["error"]["code"])
            for status, headers, body in answers] == [(503, "draining", "draining")] * 2
    assert ("second stop signal: cutting 1 request(s) still in flight and 0 being read; "
            "2 waiting answered 503 draining") in sluice.stderr()
    assert len(upstream.requests) == 1


async def test_a_second_sigterm_cuts_the_drain_short(upstream, start_sluice):
    """An operator's second Ctrl-C (or a second SIGTERM) does not wait out a long
    ``drain_timeout``: what is left is cut at once (a new user's trial waited 30 s)."""
    sluice, url = await openai_sluice(start_sluice, upstream, "120s")
    upstream.hold = asyncio.Event()  # never set: only a cut ends this request
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(status_of(session, url, CHAT))
        await wait_until(lambda: upstream.inflight == 1, what="the request at the upstream")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining: 1 request(s) in flight" in sluice.stderr(),
                         what="the drain started")
        assert ("(a second SIGTERM or Ctrl-C, 1s or more after the first, cuts them now)"
                in sluice.stderr())
        assert not call.done()  # the first signal waits for it
        sluice.signal(signal.SIGTERM)  # within 1 s of the first: the same Ctrl-C, twice
        # Said, not silently ignored: the drain's line promised a second signal cuts.
        await wait_until(lambda: "after the first stop signal ignored" in sluice.stderr(),
                         what="the repeat signal said ignored")
        ignored = next(line for line in sluice.stderr().splitlines()
                       if "after the first stop signal ignored" in line)
        assert re.search(r"sluice: SIGTERM 0\.\d+s after the first stop signal ignored: within "
                         r"the 1s grace \(one Ctrl-C can arrive twice\); another one after it "
                         r"cuts the calls now$", ignored), ignored
        await asyncio.sleep(0.3)
        assert not call.done()
        await asyncio.sleep(1.0)  # later: an operator's second one
        sluice.signal(signal.SIGTERM)
        with pytest.raises(aiohttp.ClientError):
            await call
        assert await sluice.wait_exit(timeout=60) == 0  # long before the 120 s drain_timeout
    assert "second stop signal: cutting 1 request(s) still in flight" in sluice.stderr()
    assert sluice.stderr().count("stop signal ignored") == 1  # not the one that cut


async def test_calls_queued_at_sigterm_are_served_not_cut(upstream, start_sluice):
    # Seen in a hostile trial: the drain waited only for admitted calls, so those still queued
    # were cut whenever the drain looked while none was admitted (inside a slot's hand-over).
    sluice, url = await openai_sluice(start_sluice, upstream, "20s",
                                      concurrency={"limit": 1, "queue": 4, "max_wait": "20s"})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        calls = [asyncio.create_task(status_of(session, url, CHAT)) for _ in range(3)]
        await wait_until(lambda: upstream.inflight == 1, what="one call at the upstream")
        await sluice.wait_metric("sluice_queue_depth", 2, route="openai")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining:" in sluice.stderr(), what="the drain's start")
        assert "1 request(s) in flight, 2 more waiting" in sluice.stderr()
        upstream.hold.set()
        assert await asyncio.gather(*calls) == [200, 200, 200]
    assert await sluice.wait_exit() == 0
    assert "drained" in sluice.stderr()
    assert len(upstream.requests) == 3


async def test_a_queued_call_the_drain_would_cut_is_refused_not_sent(upstream, start_sluice):
    # A hostile trial: a call admitted from the queue shortly before the drain's end, on a
    # route whose calls take longer than what was left, reached the upstream and was cut
    # there (charged, its side effects run for nothing). It is refused 503 draining instead.
    sluice, url = await openai_sluice(start_sluice, upstream, "3s",
                                      concurrency={"limit": 1, "queue": 2, "max_wait": "60s"})
    upstream.delay = 2.0  # the route's calls take 2 s; 1 s or less is left for the queued one
    async with aiohttp.ClientSession() as session:
        assert await status_of(session, url, CHAT) == 200  # the route learns its call time
        held = asyncio.create_task(status_of(session, url, CHAT))
        await wait_until(lambda: len(upstream.requests) == 2, what="the held call upstream")
        queued = asyncio.create_task(_answer(session, url, CHAT, {"X-Request-ID": "late"}))
        await sluice.wait_metric("sluice_queue_depth", 1, route="openai")
        sluice.signal(signal.SIGTERM)
        assert await held == 200
        status, headers, body = await queued
    assert await sluice.wait_exit(timeout=30) == 0
    assert (status, headers["X-Sluice-Reason"]) == (503, "draining")
    assert "the drain ends before this call would" in body["error"]["message"]
    assert "nothing was sent upstream" in body["error"]["message"]
    assert len(upstream.requests) == 2  # the late call never reached the upstream
    assert [e["event"] for e in _by_request(sluice.events())["late"]] == ["enqueued",
                                                                         "rejected"]


async def test_a_call_queued_on_its_operations_slot_the_drain_would_cut_is_refused(
        upstream, start_sluice):
    # A review: only the route's limiter was asked, so a slow endpoint queued on its own slot
    # (the route has none) was sent and cut as before.
    sluice = await start_sluice({
        "server": {"drain_timeout": "3s"},
        "routes": [route("tools", upstream.url, "http", endpoints={
            "POST /slow": {"concurrency": {"limit": 1, "queue": 2, "max_wait": "60s"}}})]})
    url = sluice.url + "/tools/slow"
    upstream.delay = 2.0
    async with aiohttp.ClientSession() as session:
        assert await status_of(session, url, {}) == 200  # the endpoint learns its call time
        held = asyncio.create_task(status_of(session, url, {}))
        await wait_until(lambda: len(upstream.requests) == 2, what="the held call upstream")
        queued = asyncio.create_task(_answer(session, url, {}, {"X-Request-ID": "late"}))
        await wait_until(lambda: any(e["event"] == "enqueued" for e in sluice.events()),
                         what="the late call queued")
        sluice.signal(signal.SIGTERM)
        assert await held == 200
        status, headers, body = await queued
    assert await sluice.wait_exit(timeout=30) == 0
    assert (status, headers["X-Sluice-Reason"]) == (503, "draining")
    assert "the drain ends before this call would end" in body["error"]["message"]
    assert len(upstream.requests) == 2


async def test_new_requests_during_the_drain_do_not_hold_it(upstream, start_sluice):
    # From a review: the drain waits for every request present, and requests arriving while
    # it runs (each refused 503 draining once read) could keep that from ever reaching 0:
    # here, slow uploads overlapping one another.
    sluice, url = await openai_sluice(start_sluice, upstream, "20s")
    upstream.hold = asyncio.Event()

    async def slow_upload() -> bytes:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", sluice.port)
        except OSError:
            return b""  # the listener closed: the drain ended
        try:
            writer.write(b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Length: 60\r\nConnection: close\r\n\r\n")
            for _ in range(60):  # 6 s each
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.1)
            return await reader.read()
        except OSError:
            return b""
        finally:
            writer.close()

    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(status_of(session, url, CHAT))
        await wait_until(lambda: upstream.inflight == 1, what="the call at the upstream")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining:" in sluice.stderr(), what="the drain's start")
        uploads = []
        for _ in range(5):  # always one or more under way, from here until well past the hold
            uploads.append(asyncio.create_task(slow_upload()))
            await asyncio.sleep(0.5)
        upstream.hold.set()
        released = time.monotonic()
        assert await held == 200
        assert await sluice.wait_exit(timeout=30) == 0
        assert time.monotonic() - released < 3.0  # not as the uploads end (5.5 s on), or at 20 s
        # Cut by the exit, unanswered: each would have been refused 503 draining once read.
        await asyncio.gather(*uploads)


async def test_a_replica_drains_calls_queued_on_a_slot_another_holds(upstream, start_sluice):
    # Seen in a hostile trial: with the route's one slot held on the other replica, SIGTERM
    # ended this one at once (nothing admitted here) and cut its queued callers. They wait
    # for the slot now, as long as the drain allows.
    prefix = new_prefix()
    state = {"backend": "redis", "redis_url": require_redis(), "key_prefix": prefix}
    config = {"server": {"drain_timeout": "20s"}, "state": state,
              "routes": [route("openai", upstream.url, "openai",
                               concurrency={"limit": 1, "queue": 4, "max_wait": "20s"})]}
    try:
        holder, draining = await start_sluice(config), await start_sluice(config)
        upstream.hold = asyncio.Event()
        path = "/openai/v1/chat/completions"
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(status_of(session, holder.url + path, CHAT))
            await wait_until(lambda: upstream.inflight == 1, what="the holder's call")
            queued = asyncio.create_task(status_of(session, draining.url + path, CHAT))
            await draining.wait_metric("sluice_queue_depth", 1, route="openai")
            draining.signal(signal.SIGTERM)
            await wait_until(lambda: "draining:" in draining.stderr(), what="the drain")
            await asyncio.sleep(0.3)  # before, the process had exited by now
            assert draining.proc.poll() is None and not queued.done()
            upstream.hold.set()
            assert (await first, await queued) == (200, 200)
        assert await draining.wait_exit() == 0
        await holder.stop()
    finally:
        delete_prefix(str(state["redis_url"]), prefix)


async def test_a_call_queued_for_a_shared_slot_is_answered_when_the_drain_ends(upstream,
                                                                              start_sluice):
    # The shared (Redis) queue as the local one: a call waiting there for the slot another
    # replica holds is answered 503 draining at the drain's end, and takes no lease after.
    prefix = new_prefix()
    state = {"backend": "redis", "redis_url": require_redis(), "key_prefix": prefix}
    openai = route("openai", upstream.url, "openai",
                   concurrency={"limit": 1, "queue": 4, "max_wait": "60s"})
    try:
        holder = await start_sluice({"server": {"drain_timeout": "20s"}, "state": state,
                                     "routes": [openai]})
        draining = await start_sluice({"server": {"drain_timeout": "500ms"}, "state": state,
                                       "routes": [openai]})
        upstream.hold = asyncio.Event()
        path = "/openai/v1/chat/completions"
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(status_of(session, holder.url + path, CHAT))
            await wait_until(lambda: upstream.inflight == 1, what="the holder's call")
            queued = asyncio.create_task(_answer(session, draining.url + path, CHAT,
                                                 {"X-Request-ID": "queued"}))
            await draining.wait_metric("sluice_queue_depth", 1, route="openai")
            draining.signal(signal.SIGTERM)
            status, headers, body = await queued
            assert await draining.wait_exit() == 0
            upstream.hold.set()
            assert await first == 200
            # The slot is free for the holder's next call: the refused waiter holds no lease.
            assert await status_of(session, holder.url + path, CHAT) == 200
        await holder.stop()
    finally:
        delete_prefix(str(state["redis_url"]), prefix)
    assert (status, headers["X-Sluice-Reason"], body["error"]["code"]) == (
        503, "draining", "draining")
    assert [e["event"] for e in _by_request(draining.events())["queued"]] == [
        "enqueued", "rejected"]
    assert len(upstream.requests) == 2  # the holder's two calls; the refused one never went


def _signal_mask(pid: int, field: str) -> int:
    """``SigIgn`` or ``SigCgt`` of ``pid`` (``/proc/PID/status``): bit N-1 is signal N."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    return 0


async def test_sigterm_while_starting_exits_0_after_starting(tmp_path):
    # Seen by a new user: SIGTERM in serve's first second (imports, config, connections),
    # before the event loop took the signals, ended the process by the default action
    # (exit 143, no drain); the README says SIGTERM exits 0.
    proc = _starting_serve(tmp_path)
    try:
        # Sent as soon as serve has taken SIGHUP over (its first step), long before its loop
        # takes SIGTERM (after ~0.5 s of imports).
        await _serve_holds_sighup(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "drained" in stderr


def _starting_serve(tmp_path: Path, *command: str) -> subprocess.Popen[str]:
    """``sluice serve`` starting in a child on a one-route config in ``tmp_path`` (events in
    its ``events.jsonl``), with SIGHUP at its default, as a supervisor starts it: under nohup
    it would be ignored before Python starts, and a signal sent into the default action.
    ``command``: what runs it, ``python -m proxy.cli`` unless given (the config's options
    are added)."""
    config = tmp_path / "sluice.yaml"
    port, admin_port = free_ports(2)
    config.write_text(f"""
server: {{listen: "127.0.0.1:{port}", admin_listen: "127.0.0.1:{admin_port}"}}
events: {{path: {tmp_path / "events.jsonl"}}}
routes:
  - {{name: r, path_prefix: /r/, upstream: "http://127.0.0.1:9"}}
""")
    return subprocess.Popen([*(command or (sys.executable, "-m", "proxy.cli")), "serve",
                             "--config", str(config)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


async def _serve_holds_sighup(pid: int) -> None:
    """Until ``serve``'s first step has taken the signals over (SIGHUP is caught last)."""
    await wait_until(lambda: _signal_mask(pid, "SigCgt") & (1 << (signal.SIGHUP - 1)),
                     what="serve starting")


async def test_sighup_while_starting_reloads_once_the_watch_starts(tmp_path):
    """An ops trial: a SIGHUP sent while serve started (after an operator replaced the file
    it was reading) was ignored; the file read could be the old one. It is remembered, and
    the config is read again once the watch starts."""
    events = tmp_path / "events.jsonl"
    proc = _starting_serve(tmp_path)
    try:
        await _serve_holds_sighup(proc.pid)
        proc.send_signal(signal.SIGHUP)

        def reloaded() -> list[str]:
            lines = events.read_text().splitlines() if events.exists() else []
            # The file is the one serve read: read again, it is found unchanged.
            return [json.loads(line)["trigger"] for line in lines
                    if '"config_reloaded"' in line or '"config_unchanged"' in line]

        await wait_until(lambda: reloaded() == ["sighup"], timeout=30, what="its reload")
        assert proc.poll() is None  # not ended by it
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr


#: Runs ``sluice`` as its console script does (``main()`` of ``proxy.cli``), sending itself a
#: SIGHUP as it first imports asyncio: a deploy tool's reload arriving in serve's first
#: tenth of a second, while the CLI's modules load, at the same point every time.
_SIGHUP_AT_ASYNCIO = """
import importlib.abc, os, signal, sys

class SighupAtAsyncio(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "asyncio":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGHUP)
        return None

sys.meta_path.insert(0, SighupAtAsyncio())
from proxy.cli import main
sys.exit(main())
"""


async def test_a_sighup_while_the_cli_loads_is_a_reload_not_the_end(tmp_path):
    """A hostile trial: a SIGHUP in the first ~0.1 s of ``sluice serve`` ended the process
    (its default action, in 2 of 3 tries): the signals were held only once the CLI's modules
    (asyncio's ~40 ms among them) were imported and its arguments parsed. ``main`` holds them
    first now, and imports asyncio after; the SIGHUP is remembered as a reload."""
    events = tmp_path / "events.jsonl"
    proc = _starting_serve(tmp_path, sys.executable, "-c", _SIGHUP_AT_ASYNCIO)
    try:
        def reloaded() -> list[str]:
            lines = events.read_text().splitlines() if events.exists() else []
            # The file is the one serve read: read again, it is found unchanged.
            return [json.loads(line)["trigger"] for line in lines
                    if '"config_reloaded"' in line or '"config_unchanged"' in line]

        await wait_until(lambda: reloaded() == ["sighup"] or proc.poll() is not None,
                         timeout=30, what="its reload")
        assert proc.poll() is None, f"ended by the SIGHUP ({proc.returncode})"
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr


async def test_a_drain_stays_for_the_control_traffic_a_client_sends_after_its_result(
        mcp_session, start_sluice, tmp_path):  # noqa: F811
    """A new user's trial: the Python 2.x client, its tools not listed yet, sends
    ``tools/list`` after a call's result and before it hands the result over. The drain
    ended with the call, the port shut on that request, and the client raised: a result its
    tool had produced was lost (4 of 10 runs on a busy machine). A drain that waited for MCP
    calls stays a moment for such traffic; here it comes 0.2 s after the result, as from a
    slow client."""
    sluice = await _draining_sluice(start_sluice, mcp_session)
    url = sluice.url + "/tools/mcp"
    gate = tmp_path / "gate"
    async with aiohttp.ClientSession() as http:
        headers = await raw_session(http, url)
        call = await _gated_call_then_drain(sluice, http, url, headers, 2, gate)
        gate.touch()
        assert (await call)[0] == 200
        await asyncio.sleep(0.2)
        listed = await _mcp_answer(http, url, headers,
                                   {"jsonrpc": "2.0", "id": 3, "method": "tools/list"})
    # Before: (0, "ClientConnectorError(...)"): the drain had ended with the call.
    assert listed[0] == 200 and '"gated"' in listed[1], listed
    assert await sluice.wait_exit(timeout=30) == 0
    assert "drain timeout" not in sluice.stderr() and "drained" in sluice.stderr()


async def test_an_mcp_sessions_control_traffic_is_served_while_draining(
        mcp_session, start_sluice, tmp_path):  # noqa: F811
    """A new user's Python 2.x client, its tools not listed yet, sends ``tools/list`` after
    the first result of a call: refused as new work during the drain, it failed calls that
    had finished at the server. A session's control traffic is served while draining; a new
    call, or a new session (``initialize``), is refused."""
    from mcp import Client, MCPError

    sluice = await start_sluice({
        "server": {"drain_timeout": "20s"},
        "routes": [{"name": "tools", "path_prefix": "/tools/", "upstream": mcp_session.base_url,
                    "protocol": "mcp"}]})
    gate = tmp_path / "gate"
    async with Client(sluice.url + "/tools/mcp", mode="legacy") as client:
        # In flight until the gate opens: a call that ended on its own (a timed one did, on
        # a loaded machine) would end the drain before the steps below.
        running = asyncio.create_task(client.call_tool("gated", {"path": str(gate)}))
        # The call's own admission: the session's initialize and GET stream are admitted too.
        await wait_until(lambda: _admitted_tool(sluice, "gated"), what="the call admitted")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining" in sluice.stderr(), what="the drain")
        tools = await client.list_tools()  # control traffic of a session: served
        with pytest.raises(MCPError) as refused:  # a new call: refused, for this call only
            await client.call_tool("add", {"a": 1, "b": 2})
        gate.touch()
        result = await running
    assert "gated" in {tool.name for tool in tools.tools}
    assert refused.value.data["reason"] == "draining"
    assert result.content[0].text == "opened"
    assert await sluice.wait_exit(timeout=20) == 0
    rejected = [e for e in sluice.events() if e["event"] == "rejected"]
    assert [e["reason"] for e in rejected] == ["draining"]


#: A client's first message to a server, as the SDKs send it: a 2025 client's ``initialize``,
#: and the ``server/discover`` the Python 2.x client sends in its default ``mode="auto"``
#: (``ClientSession.send_discover``: the metadata in ``_meta`` and in headers).
_OPENINGS = {
    "initialize": ({}, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}),
    "server/discover": (
        {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "server/discover"},
        {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}}}),
}


@pytest.mark.parametrize("method", list(_OPENINGS))
async def test_a_new_mcp_client_is_refused_while_draining(
        mcp_stateless, start_sluice, method):  # noqa: F811
    """A new client's first message is refused, so it connects to another replica. A new
    user's trial: ``server/discover`` (the Python 2.x client's default) was served, as
    control traffic, and the client's first ``tools/call`` was refused ``draining``."""
    sluice = await start_sluice({
        "server": {"drain_timeout": "20s"},
        "routes": [{"name": "tools", "path_prefix": "/tools/", "upstream": mcp_stateless.base_url,
                    "protocol": "mcp"}]})
    url = sluice.url + "/tools/mcp"
    opening_headers, opening = _OPENINGS[method]
    headers = {"Accept": "application/json, text/event-stream"}
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(session.post(url, headers=headers,
                                                json=tool_call(2, "slow", seconds=4.0)))
        await wait_until(lambda: any(e["event"] == "admitted" for e in sluice.events()),
                         what="a call in flight, so the drain lasts")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining" in sluice.stderr(), what="the drain")
        async with session.post(url, headers={**headers, **opening_headers},
                                json=opening) as r:
            assert r.headers.get("X-Sluice-Reason") == "draining"
            body = await r.json()
        assert body["id"] == 1 and body["error"]["data"]["reason"] == "draining"
        (await held).release()
    assert await sluice.wait_exit(timeout=20) == 0
    assert [(e["event"], e.get("reason"), e.get("mcp_method")) for e in sluice.events()
            if e["event"] == "rejected"] == [("rejected", "draining", method)]


async def _mcp_answer(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                      body: dict) -> tuple[int, str]:
    """The status and body of one POST to an MCP endpoint; ``(0, the error)`` for an answer
    cut before its end."""
    try:
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, await r.text()
    except aiohttp.ClientError as cut:
        return 0, repr(cut)


async def _resumed(http: aiohttp.ClientSession, url: str, headers: dict[str, str]
                  ) -> tuple[int, str]:
    """A GET resuming a call's stream, read as the SDKs' clients read it: until the call's
    response (the server holds the stream open after it); ``(0, the error)`` if cut."""
    body = ""
    try:
        async with http.get(url, headers={**headers, "Accept": "text/event-stream"}) as r:
            async for line in r.content:
                body += line.decode()
                if '"result"' in body or r.status != 200:
                    break
            return r.status, body
    except aiohttp.ClientError as cut:
        return 0, f"{cut!r} after {body!r}"


def _admitted_tool(sluice: Any, tool: str) -> bool:
    return any(e["event"] == "admitted" and e.get("operation") == tool for e in sluice.events())


def _admitted(sluice: Any) -> int:
    """Admissions so far, a session's control traffic and streams included."""
    return sum(e["event"] == "admitted" for e in sluice.events())


async def _closed_for_polling(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                              rpc_id: int, seconds: float) -> str:
    """Post a ``poll`` call (its SSE answer closed early, for polling, after its priming
    event); the ``Last-Event-ID`` a client resumes it with."""
    status, closed = await _mcp_answer(http, url, headers,
                                       tool_call(rpc_id, "poll", seconds=seconds))
    assert status == 200 and '"polled"' not in closed, closed
    return [line[3:].strip() for line in closed.splitlines() if line.startswith("id:")][-1]


async def _gated_call_then_drain(sluice: Any, http: aiohttp.ClientSession, url: str,
                                 headers: dict[str, str], rpc_id: int,
                                 gate: Path) -> asyncio.Task[tuple[int, str]]:
    """Post a ``gated`` call (in flight until ``gate`` exists), wait for its admission, then
    SIGTERM Sluice and wait for its drain: the call, as a task (:func:`_mcp_answer`)."""
    call = asyncio.create_task(_mcp_answer(http, url, headers,
                                           tool_call(rpc_id, "gated", path=str(gate))))
    await wait_until(lambda: _admitted_tool(sluice, "gated"), what="the call admitted")
    sluice.signal(signal.SIGTERM)
    await wait_until(lambda: "draining" in sluice.stderr(), what="the drain")
    return call


async def _draining_sluice(start_sluice: Any, server: Any, timeout: str = "20s") -> Any:
    """Sluice with one ``mcp`` route to ``server`` and a drain of ``timeout``."""
    return await start_sluice({
        "server": {"drain_timeout": timeout},
        "routes": [{"name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
                    "protocol": "mcp"}]})


async def test_control_traffic_served_while_draining_is_waited_for(
        mcp_server_factory, start_sluice, tmp_path):  # noqa: F811
    """From a review: a session's control traffic is served while draining, but the drain
    waited only for what was in before it began: a slow ``tools/list`` sent during the drain
    was cut mid-answer when the last call ended and the process exited. What the drain lets
    in, it waits for."""
    server = mcp_server_factory("session", list_delay=3.0)
    sluice = await _draining_sluice(start_sluice, server)
    url = sluice.url + "/tools/mcp"
    gate = tmp_path / "gate"
    async with aiohttp.ClientSession() as http:
        headers = await raw_session(http, url)
        call = await _gated_call_then_drain(sluice, http, url, headers, 2, gate)
        before = _admitted(sluice)
        listed = asyncio.create_task(_mcp_answer(
            http, url, headers, {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}))
        await wait_until(lambda: _admitted(sluice) > before, what="the tools/list let in")
        gate.touch()  # the call ends while the tools/list is still at the server
        assert (await call)[0] == 200
        listed = await listed
    # Before: (0, "ClientPayloadError(...)"), cut as the call ended.
    assert listed[0] == 200 and '"gated"' in listed[1], listed
    assert await sluice.wait_exit(timeout=30) == 0
    assert "drain timeout" not in sluice.stderr() and "drained" in sluice.stderr()


async def test_a_calls_stream_resumed_while_draining_is_served_and_waited_for(
        mcp_server_factory, start_sluice, tmp_path):  # noqa: F811
    """2025-11-25 polling: a server closes a call's SSE stream after its priming event and
    the client resumes it with a GET carrying ``Last-Event-ID``, where the call's answer
    comes. Sluice refused that GET 503 ``draining`` as a new stream: the client never got the
    answer of a call admitted before the drain. It is served, and the drain waits for it as
    for the call; a session's plain GET stream is still not waited for
    (``test_a_drain_waits_for_calls_not_for_idle_get_streams``)."""
    server = mcp_server_factory("session", resumable=True)
    sluice = await _draining_sluice(start_sluice, server)
    url = sluice.url + "/tools/mcp"
    gate = tmp_path / "gate"
    async with aiohttp.ClientSession() as http:
        headers = await raw_session(http, url)
        last_id = await _closed_for_polling(http, url, headers, 2, seconds=3.0)
        call = await _gated_call_then_drain(sluice, http, url, headers, 3, gate)
        before = _admitted(sluice)
        resumed = asyncio.create_task(_resumed(http, url, {**headers, "Last-Event-ID": last_id}))
        await wait_until(lambda: _admitted(sluice) > before, what="the GET let in")
        gate.touch()  # the call ends before the polled answer comes on the GET
        assert (await call)[0] == 200
        resumed = await resumed
    # Before: (503, ...draining...); served but not waited for, it was cut as the call ended.
    assert resumed[0] == 200 and '"polled"' in resumed[1], resumed
    assert await sluice.wait_exit(timeout=30) == 0
    assert "drain timeout" not in sluice.stderr() and "drained" in sluice.stderr()


async def test_a_polled_call_is_waited_for_then_cut_by_the_drain(
        mcp_server_factory, start_sluice):  # noqa: F811
    """A call whose answer the server closed early for polling is not over: its tool runs
    on, and its response comes on the GET its client resumes it with. The drain waits for
    it as for any call in flight, and, its client never resuming it, cuts it when
    ``drain_timeout`` ends: it ends ``drain_cut``, once, and the process exits."""
    server = mcp_server_factory("session", resumable=True)
    sluice = await _draining_sluice(start_sluice, server, timeout="1s")
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await raw_session(http, url)
        await _closed_for_polling(http, url, headers, 2, seconds=20.0)
        await sluice.wait_metric("sluice_polled_calls", 1)
        sluice.signal(signal.SIGTERM)
        assert await sluice.wait_exit(timeout=30) == 0
    assert "drain timeout: cutting 1 request(s) still in flight" in sluice.stderr()
    [ended] = [e for e in sluice.events()
               if e["event"] == "completed" and e.get("operation") == "poll"]
    assert ended["outcome"] == "drain_cut", ended


async def test_a_sessions_get_stream_resumed_with_last_event_id_does_not_hold_the_drain(
        mcp_server_factory, start_sluice):  # noqa: F811
    """From a review: the Python SDK's client reconnects its session's GET stream with
    ``Last-Event-ID`` once the server gave any of its events an id (a server with an event
    store, after any notification): the same header as a call's resumed answer. Taken for
    one, that stream (open, silent, for the whole session) held every drain to its
    timeout, as before plain GET streams were told apart. Only a GET resuming the answer of
    a call this process closed early for polling is waited for."""
    server = mcp_server_factory("session", resumable=True)
    sluice = await _draining_sluice(start_sluice, server, timeout="60s")
    url = sluice.url + "/tools/mcp"
    sse = {"Accept": "text/event-stream"}
    async with aiohttp.ClientSession() as http:
        headers = await raw_session(http, url)
        last_id = ""
        async with http.get(url, headers={**headers, **sse}) as stream:
            assert stream.status == 200
            notified = await _mcp_answer(http, url, headers, tool_call(2, "notify"))
            assert notified[0] == 200 and '"notified"' in notified[1], notified
            async for line in stream.content:  # the notification, with its id
                if line.startswith(b"id:"):
                    last_id = line[3:].strip().decode()
                    break
        assert last_id.startswith("_GET_stream"), last_id
        # The client's reconnection; the server resumes the session's stream and holds it.
        for _ in range(50):
            resumed = await http.get(url, headers={**headers, **sse, "Last-Event-ID": last_id})
            if resumed.status == 200:
                try:  # its priming event, then silence
                    while await asyncio.wait_for(resumed.content.readline(), 1.0):
                        pass
                except TimeoutError:
                    break  # open and silent: the session's stream, resumed
            resumed.release()
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the session's GET stream was never resumed")
        try:
            sluice.signal(signal.SIGTERM)
            # Before: the drain waited out its 60 s for the resumed stream.
            assert await sluice.wait_exit(timeout=30) == 0
        finally:
            resumed.release()
    assert "drain timeout" not in sluice.stderr() and "drained" in sluice.stderr()


async def test_a_resumed_calls_stream_held_open_after_its_answer_does_not_hold_the_drain(
        mcp_server_factory, start_sluice):  # noqa: F811
    """From a review: the Python SDK's server keeps a resumed call's stream open after the
    call's response, and the TypeScript SDK 1.x client reads on until the server closes it.
    Waited for as a call, such a GET held every drain to its timeout once its call was
    answered; with the response through, it is a stream like any other."""
    server = mcp_server_factory("session", resumable=True)
    sluice = await _draining_sluice(start_sluice, server, timeout="60s")
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await raw_session(http, url)
        last_id = await _closed_for_polling(http, url, headers, 2, seconds=0.5)
        async with http.get(url, headers={**headers, "Accept": "text/event-stream",
                                          "Last-Event-ID": last_id}) as resumed:
            assert resumed.status == 200
            body = ""
            async for line in resumed.content:
                body += line.decode()
                if '"polled"' in body:
                    break
            sluice.signal(signal.SIGTERM)  # the stream still open, as the client keeps it
            # Before: the drain waited out its 60 s for the answered stream.
            assert await sluice.wait_exit(timeout=30) == 0
    assert "drain timeout" not in sluice.stderr() and "drained" in sluice.stderr()


async def test_a_drain_that_waited_for_no_mcp_call_takes_no_follow_up(upstream, monkeypatch):
    """A drain that waited for calls of an ``mcp`` route stays open MCP_FOLLOW_UP_S longer
    for a session's follow-up (its client's tools/list); one that waited for another
    route's calls only ends with them. Before: any ``mcp`` route in the config made every
    drain that waited take the extra second (a new user's trial: 1.43 s against 0.42 s).
    The follow-up is made 600 s here, so a drain that takes it outlives the test's bound."""
    monkeypatch.setattr("proxy.server.MCP_FOLLOW_UP_S", 600.0)
    runtime = await open_runtime(route("openai", upstream.url),
                                 route("tools", upstream.url, "mcp"))
    runner, port = await serve_runtime(runtime, shutdown_timeout=PROXY_SHUTDOWN_GRACE_S)
    upstream.hold = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(status_of(
                session, f"http://127.0.0.1:{port}/openai/v1/chat/completions", CHAT))
            await wait_until(lambda: upstream.inflight == 1, what="the call at the upstream")
            drain = asyncio.create_task(_drain(runtime, 300.0, asyncio.Event()))
            await asyncio.sleep(0.3)
            assert not drain.done()  # it waits for the call
            upstream.hold.set()
            assert await call == 200
            await asyncio.wait_for(drain, 60)  # with the follow-up: 600 s
    finally:
        await runner.cleanup()
        await runtime.close()
