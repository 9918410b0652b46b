"""A run's cancel or the drain's cut after an answer's last message has gone ends the
stream as the upstream would have (``proxy.forward.end_answer``) and counts it answered
(tests/test_answered_callers.py): here, when the caller is behind at that moment.

In process (the runtime and the proxy port in the test's loop), so that the caller's
connection can be held "behind" (its protocol's writing paused, as the transport does when the
caller's receive window and Sluice's send buffer are full) at a chosen moment. From a hostile
review of that change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config import parse_config
from proxy.runtime import Runtime
from tests.conftest import wait_until
from tests.test_answered_callers import HandshakingMcp
from tests.test_mcp_left_callers import CALL, HEADERS, serve_in_process


@pytest.fixture
async def holding() -> AsyncIterator[HandshakingMcp]:
    server = await HandshakingMcp().start()
    server.mode = "sse_open"
    yield server
    await server.stop()


async def mcp_runtime(upstream: str, mode: str) -> Runtime:
    runtime = Runtime(parse_config(
        "routes:\n"
        f"  - {{name: tools, path_prefix: /tools/, upstream: '{upstream}', protocol: mcp,\n"
        f"      idempotency: {{mode: {mode}}}}}\n"))
    await runtime.open()
    return runtime


def the_connection(runner: web.ServerRunner) -> Any:
    """Sluice's protocol object of the one caller connection."""
    [protocol] = runner.server.connections  # type: ignore[union-attr]
    return protocol


async def post_raw(port: int, extra: bytes = b"") -> tuple[asyncio.StreamReader,
                                                           asyncio.StreamWriter]:
    body = json.dumps(CALL).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /tools/mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Accept: application/json, text/event-stream\r\n"
                 b"X-Run-ID: job\r\n" + extra +
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    return reader, writer


async def read_for(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the caller's connection brings within ``seconds`` (or up to its close)."""
    got = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                got += chunk
    return got


@pytest.mark.parametrize("mode", ["forward", "dedup"])
async def test_a_run_cancel_during_the_streams_own_end_sends_the_end_once(holding, mode):
    """The upstream ends an answered call's stream while the caller is a moment behind
    (Sluice's write of the last chunk, ``0\\r\\n\\r\\n``, waits in drain), and the run's cancel
    lands then. Before: ``end_answer`` wrote the stream's end a second time (aiohttp writes
    the terminator before it drains and marks the stream ended only after), so the caller's
    keep-alive connection carried a stray ``0\\r\\n\\r\\n`` after a whole answer."""
    runtime = await mcp_runtime(holding.url, mode)
    runner, url = await serve_in_process(runtime)
    port = int(url.split(":")[2].split("/")[0])
    try:
        reader, writer = await post_raw(port)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b" 200 " in head and b"chunked" in head.lower()
        first = await asyncio.wait_for(reader.readuntil(b"\n\n\r\n"), 10)
        assert b'"id": 1' in first
        protocol = the_connection(runner)
        protocol.pause_writing()  # the caller is behind for a moment
        holding.release.set()  # the upstream ends the stream as it should
        await wait_until(lambda: protocol._drain_waiter is not None,
                         what="Sluice writing the stream's end, waiting on the caller")
        runtime.runs.cancel_in("job", 60, runtime.runs.tenants_of("job"))
        await asyncio.sleep(0.2)
        protocol.resume_writing()  # the caller reads on, well within LAST_EVENT_WAIT_S
        rest = await read_for(reader, 1.5)
        assert rest == b"0\r\n\r\n", rest  # the stream's end, once: nothing after it
        writer.close()
    finally:
        await runner.cleanup()
        await runtime.close()


def sample(runtime: Runtime, name: str, **labels: str) -> float:
    return runtime.metrics.registry.get_sample_value(name, labels) or 0.0


def all_given_back(runtime: Runtime) -> None:
    [route] = runtime.routes
    assert route.inflight == 0 and route.present == 0 and route.streams == 0
    assert runtime.buffered_bytes == 0 and not runtime.mcp_calls and not runtime.finishing


@pytest.mark.parametrize("mode", ["forward", "dedup"])
async def test_a_run_cancel_after_delivery_counts_in_sluice_cancels_total(holding, mode):
    """``sluice_cancels_total`` counts calls ended by their run's cancellation, and the
    admin cancel reports this one in ``calls_ended`` (its upstream stream was closed): it
    counts, as it did when such a stream was cut. Before: 0."""
    runtime = await mcp_runtime(holding.url, mode)
    runner, url = await serve_in_process(runtime)
    try:
        async with aiohttp.ClientSession() as http, http.post(
                url, json=CALL, headers={**HEADERS, "X-Run-ID": "job"}) as r:
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            runtime.runs.cancel_in("job", 60, runtime.runs.tenants_of("job"))
            assert await asyncio.wait_for(r.content.read(), 10) == b""
        await wait_until(lambda: runtime.routes[0].inflight == 0, what="the call ended")
        all_given_back(runtime)
        assert sample(runtime, "sluice_cancels_total", route="tools", where="inflight") == 1
    finally:
        await runner.cleanup()
        await runtime.close()


@pytest.mark.parametrize("mode", ["forward", "dedup"])
async def test_a_caller_behind_when_its_run_is_cancelled_is_cut_and_released(holding, mode):
    """A caller that takes nothing more: ``end_answer``'s bound (``LAST_EVENT_WAIT_S``) cuts
    it, and nothing is held after."""
    runtime = await mcp_runtime(holding.url, mode)
    runner, url = await serve_in_process(runtime)
    port = int(url.split(":")[2].split("/")[0])
    try:
        reader, writer = await post_raw(port)
        await asyncio.wait_for(reader.readuntil(b"\n\n\r\n"), 10)
        protocol = the_connection(runner)
        protocol.pause_writing()  # behind, and stays so
        loop = asyncio.get_running_loop()
        began = loop.time()
        runtime.runs.cancel_in("job", 60, runtime.runs.tenants_of("job"))
        await wait_until(lambda: runtime.routes[0].inflight == 0, timeout=10,
                         what="the call ended")
        assert loop.time() - began >= 0.9  # it waited LAST_EVENT_WAIT_S for the caller
        # Cut (aborted). (The pause here is the test's: the socket itself had room, so the
        # end's bytes did go out; with a caller truly behind, abort drops them.)
        assert protocol.transport is None or protocol.transport.is_closing()
        all_given_back(runtime)
        writer.close()
    finally:
        await runner.cleanup()
        await runtime.close()


@pytest.mark.parametrize("mode", ["forward", "dedup"])
async def test_the_drains_cut_during_end_answer_after_a_run_cancel(holding, mode):
    """The run's cancel leaves the handler in ``end_answer`` (the caller is behind); the
    drain's cut cancels it again there. The handler ends (no hang), the call is settled
    once, ``2xx``, and nothing is held."""
    runtime = await mcp_runtime(holding.url, mode)
    runner, url = await serve_in_process(runtime)
    port = int(url.split(":")[2].split("/")[0])
    events: list[tuple[str, dict]] = []
    emit = runtime.events.emit_record
    runtime.events.emit_record = lambda kind, *a: (events.append((kind, a[-1])),  # type: ignore
                                                    emit(kind, *a))
    try:
        reader, writer = await post_raw(port)
        await asyncio.wait_for(reader.readuntil(b"\n\n\r\n"), 10)
        protocol = the_connection(runner)
        protocol.pause_writing()
        runtime.runs.cancel_in("job", 60, runtime.runs.tenants_of("job"))
        await wait_until(lambda: protocol._drain_waiter is not None, what="in end_answer")
        runtime.draining = runtime.cutting = True
        ending = runtime.end_mcp_calls()
        assert ending
        done, _ = await asyncio.wait(ending, timeout=5)
        assert done
        await wait_until(lambda: runtime.routes[0].inflight == 0, what="the call ended")
        all_given_back(runtime)
        completed = [fields for kind, fields in events if kind == "completed"]
        assert len(completed) == 1 and completed[0]["outcome"] == "2xx", completed
        writer.close()
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_the_answer_is_kept_for_its_key_after_a_run_cancel_after_delivery(holding):
    """``dedup``, the run cancelled after the response went out: the key's retry (outside
    the cancelled run) is answered from the kept answer, not run again."""
    runtime = await mcp_runtime(holding.url, "dedup")
    runner, url = await serve_in_process(runtime)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=CALL, headers={
                    **HEADERS, "X-Run-ID": "job", "Idempotency-Key": "k-1"}) as r:
                await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                runtime.runs.cancel_in("job", 60, runtime.runs.tenants_of("job"))
                assert await asyncio.wait_for(r.content.read(), 10) == b""
            await wait_until(lambda: runtime.routes[0].inflight == 0, what="the call ended")
            async with http.post(url, json={**CALL, "id": 7}, headers={
                    **HEADERS, "Idempotency-Key": "k-1"}) as again:
                body = await again.read()
                assert again.headers.get("Idempotent-Replayed") == "true", body
                assert b'"id": 7' in body or b'"id":7' in body
        assert holding.calls == 1
        all_given_back(runtime)
    finally:
        await runner.cleanup()
        await runtime.close()

