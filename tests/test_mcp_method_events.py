"""The events of an MCP POST name its JSON-RPC method (``mcp_method``): capped as a tool
name is, on a refusal for a header, and on the events of a client's cancel answered here
(tests/test_mcp_e2e.py has a whole session). From a hostile review.

In process (the runtime and the proxy port in the test's loop) so that the events can be
read as dicts as they are emitted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.metrics import MAX_OPERATION_LABEL_CHARS
from proxy.runtime import Runtime
from tests.conftest import wait_until
from tests.test_answered_callers import HandshakingMcp
from tests.test_delivered_cut import mcp_runtime
from tests.test_mcp_cancels import cancel
from tests.test_mcp_left_callers import CALL, HEADERS, serve_in_process
from tests.test_mcp_waiting_cancels import SESSION, IdsMcp, queued, send, served


@pytest.fixture
async def upstream() -> AsyncIterator[HandshakingMcp]:
    server = await HandshakingMcp().start()
    yield server
    await server.stop()


def capture(runtime: Runtime) -> list[tuple[str, dict]]:
    events: list[tuple[str, dict]] = []
    emit = runtime.events.emit_record
    runtime.events.emit_record = lambda kind, *a: (events.append((kind, a[-1])),  # type: ignore
                                                    emit(kind, *a))
    return events


#: What an event may carry of a name a caller made up, as ``operation`` is capped
#: (proxy/handler.py: MAX_OPERATION_LABEL_CHARS and its "...(+N characters)" suffix).
CAP = MAX_OPERATION_LABEL_CHARS + 64


@pytest.mark.parametrize("message", [
    # A notification: control traffic, no Mcp-Method header needed at any version.
    {"jsonrpc": "2.0", "method": "notifications/" + "x" * 20_000},
    # A request of a made-up method at 2025-03-26 (no Mcp-Method header required): a "call".
    {"jsonrpc": "2.0", "id": 1, "method": "y" * 20_000},
])
async def test_a_huge_made_up_method_does_not_go_whole_on_every_event(upstream, message):
    """``method`` is only checked to be a non-empty string (policies/mcp.py ``_message``), so
    a caller can send a megabyte of it (``max_request_bytes`` is 32 MiB): events keep what a
    tool name may be, as for ``operation``. Before: whole on every event of the call."""
    runtime = await mcp_runtime(upstream.url, "forward")
    events = capture(runtime)
    runner, url = await serve_in_process(runtime)
    try:
        async with aiohttp.ClientSession() as http, http.post(
                url, data=json.dumps(message),
                headers={**HEADERS, "Content-Type": "application/json",
                         "MCP-Protocol-Version": "2025-03-26"}) as r:
            await r.read()
        await wait_until(lambda: any(kind == "completed" for kind, _ in events),
                         what="the call's end")
        carried = {kind: len(fields.get("mcp_method") or "") for kind, fields in events}
        assert carried, events
        assert all(size <= CAP for size in carried.values()), carried
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_header_mismatch_refusal_names_the_method_it_read(upstream):
    """The body parsed (its method is known) but ``Mcp-Method`` disagrees with it: the
    POST is refused 400, and its ``rejected`` event names the method read. Before: none."""
    runtime = await mcp_runtime(upstream.url, "forward")
    events = capture(runtime)
    runner, url = await serve_in_process(runtime)
    try:
        async with aiohttp.ClientSession() as http, http.post(
                url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                headers={**HEADERS, "Mcp-Method": "prompts/list"}) as r:
            assert r.status == 400, await r.text()
        [rejected] = [fields for kind, fields in events if kind == "rejected"]
        assert rejected.get("mcp_method") == "tools/list", rejected
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_client_cancel_answered_here_names_its_method():
    """A ``notifications/cancelled`` POST answered by Sluice itself (its call still queued)
    logs ``cancel_applied`` with the call's ``operation`` and its own ``mcp_method``.
    Before: no method, so it read as the call's own event."""
    ids_upstream = await IdsMcp().start()
    try:
        async with served(ids_upstream.url) as (rt, url):
            events = capture(rt)
            async with aiohttp.ClientSession() as http:
                first = asyncio.create_task(send(http, url, CALL, SESSION))
                await wait_until(lambda: ids_upstream.inflight == 1, what="the first call")
                waiting = asyncio.create_task(send(http, url, {**CALL, "id": 100}, SESSION))
                await wait_until(lambda: queued(rt) == 1, what="the second call queued")
                status, _ = await send(http, url, cancel(100), SESSION)
                assert status == 202
                await asyncio.wait_for(waiting, 10)
                ids_upstream.release.set()
                await first
            [applied] = [fields for kind, fields in events if kind == "cancel_applied"]
            assert applied.get("mcp_method") == "notifications/cancelled", applied
    finally:
        await ids_upstream.stop()
