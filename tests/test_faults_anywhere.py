"""An exception from anywhere in the side code of a call (the event log, a metric, the JSON
parse, the usage meter, the idempotency capture, the MCP answer tracker, a policy's report,
the dead-letter store) ends that call with an answer or a visible cut, never a hang or a
malformed answer, and leaves nothing held: in flight, queued, buffered, keys, reservations,
run calls. The next call is served.

Property-based (hypothesis): each example runs Sluice in-process in front of a fake LLM
provider and an MCP tool server, makes the ``nth`` call of one ``target`` raise, and sends a
few calls of random kinds at once (plain, keyed, streamed, failing and retried into the
dead-letter store, MCP calls kept for their keys)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from hypothesis import example, given, settings
from hypothesis import strategies as st

import policies.bodies
import policies.deadletter
import policies.idempotency
import policies.mcp
import policies.pipeline
import policies.usage
import proxy.events
import proxy.metrics
import proxy.routes
from proxy.config import parse_config
from proxy.runtime import Runtime
from tests.conftest import serve_app, serve_runtime, wait_until
from tests.fakeupstream import FakeUpstream

TARGETS: dict[str, tuple[Any, str]] = {
    "event": (proxy.events.EventLog, "emit"),
    "event record": (proxy.events.EventLog, "emit_record"),
    "counter": (proxy.metrics.CounterSeries, "inc"),
    "histogram": (proxy.metrics.HistogramSeries, "observe"),
    "json parse": (policies.bodies, "loads"),
    "policy report": (policies.pipeline.Call, "notify"),
    "route report": (proxy.routes.Route, "report"),
    "meter start": (policies.usage.Meter, "start"),
    "meter body": (policies.usage.Meter, "body"),
    "meter chunk": (policies.usage.Meter, "chunk"),
    "meter finish": (policies.usage.Meter, "finish"),
    "capture begin": (policies.idempotency.Capture, "begin"),
    "capture feed": (policies.idempotency.Capture, "feed"),
    "mcp tracker": (policies.mcp.AnswerTracker, "feed"),
    "dead letter": (policies.deadletter.DeadLetterQueue, "add"),
}
KINDS = ("chat", "keyed", "stream", "failing", "tool", "tool again")
CHAT = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
ACCEPT = {"Accept": "application/json, text/event-stream"}


class Injected(Exception):
    """The fault the example puts in."""


@contextlib.contextmanager
def failing(target: str, nth: int) -> Iterator[None]:
    """Within the block, the ``nth`` call of ``target`` raises :class:`Injected`."""
    owner, name = TARGETS[target]
    real = getattr(owner, name)
    calls = [0]

    def fault() -> None:
        calls[0] += 1
        if calls[0] == nth:
            raise Injected(target)

    if inspect.iscoroutinefunction(real):
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            fault()
            return await real(*args, **kwargs)
    else:
        def wrapper(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            fault()
            return real(*args, **kwargs)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


async def tool_server() -> tuple[web.AppRunner, str]:
    """An MCP endpoint answering each ``tools/call`` as SSE: a progress notification, then
    its response."""
    async def post(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in ({"jsonrpc": "2.0", "method": "notifications/progress",
                       "params": {"progressToken": 1, "progress": 0.5}},
                      {"jsonrpc": "2.0", "id": message["id"], "result": {"content": []}}):
            await out.write(b"event: message\ndata: " + json.dumps(event).encode() + b"\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/mcp", post)
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}"


def config(llm: str, tools: str, directory: Path) -> str:
    return f"""
events: {{path: '{directory / "events.jsonl"}'}}
dead_letter: {{path: '{directory / "dlq.sqlite"}'}}
pricing: {{m: {{input: 1, output: 2}}}}
routes:
  - name: llm
    path_prefix: /llm/
    upstream: '{llm}'
    protocol: openai
    concurrency: {{limit: 2, queue: 8, max_wait: 5s}}
    rate: {{requests: 100000/min, tokens: 100000000/min}}
    budget: {{tokens: 100000000/day, usd: 1000000/day, per: tenant}}
    idempotency: {{mode: dedup}}
    circuit_breaker: {{fail_max: 1000, reset_timeout: 1s}}
    retry: {{attempts: 2, backoff: {{base: 1ms, max: 2ms}}, on: [502, connect_error]}}
    run: {{max_requests: 100000}}
    fanout: {{width: 4, max_wait: 5s}}
  - name: tools
    path_prefix: /tools/
    upstream: '{tools}'
    protocol: mcp
    concurrency: {{limit: 2, queue: 8, max_wait: 5s}}
    idempotency: {{mode: dedup, max_wait: 5s}}
    tools: {{deliver: {{concurrency: {{limit: 1, queue: 8, max_wait: 5s}}}}}}
"""


async def send(session: aiohttp.ClientSession, base: str, kind: str, n: int) -> str:
    """One call of ``kind``: its status, or how it was cut."""
    headers = {"X-Run-ID": "run-1", "X-Tenant-ID": "acme"}
    if kind.startswith("tool"):
        rpc = {"jsonrpc": "2.0", "id": n, "method": "tools/call",
               "params": {"name": "deliver", "arguments": {"again": kind == "tool again"}}}
        request = session.post(base + "/tools/mcp", json=rpc, headers={**headers, **ACCEPT})
    else:
        body = {**CHAT, "stream": True} if kind == "stream" else CHAT
        if kind == "keyed":
            headers["Idempotency-Key"] = "key-1"
        elif kind == "failing":
            headers["x-fake-status"] = "502"
        request = session.post(base + "/llm/v1/chat/completions", json=body, headers=headers)
    try:
        async with asyncio.timeout(10):  # an answer that never ends is the failure sought
            async with request as r:
                await r.read()
                return str(r.status)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as cut:
        return type(cut).__name__  # a visible cut: the caller's SDK retries it


def held(runtime: Runtime) -> dict[str, float]:
    """What the calls still hold, by kind; all zero once they have ended."""
    llm, tools = runtime.routes
    out: dict[str, float] = {"buffered bytes": runtime.buffered_bytes,
                             "finishing": len(runtime.finishing),
                             "run calls": sum(len(info.live)
                                              for info in runtime.runs.runs.values())}
    for route in (llm, tools):
        out[f"{route.name} present"] = route.present_total
        out[f"{route.name} in flight"] = route.inflight_total
        out[f"{route.name} slots"] = route.concurrency.inflight
        out[f"{route.name} queued"] = route.concurrency.queued
        out[f"{route.name} keys"] = len(route.idempotency._flights)
        out[f"{route.name} key waiters"] = route.idempotency.waiting
    out["reserved"] = sum(llm.budgets.reserved(unit, "tenant", "acme")
                          for unit in ("tokens", "usd"))
    return out


async def one_example(target: str, nth: int, kinds: list[str]) -> None:
    llm = await FakeUpstream().start()
    tools, tools_url = await tool_server()
    with tempfile.TemporaryDirectory() as directory:
        runtime = Runtime(parse_config(config(llm.url, tools_url, Path(directory))))
        await runtime.open()
        runner, port = await serve_runtime(runtime)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                with failing(target, nth):
                    ended = await asyncio.gather(*(send(session, base, kind, n)
                                                   for n, kind in enumerate(kinds)))
                assert all(e.isdigit() or e.startswith(("ClientPayload", "ServerDisc"))
                           for e in ended), ended
                await wait_until(lambda: not any(held(runtime).values()),
                                 what=f"nothing held: {held(runtime)}")
                for kind in ("chat", "tool"):
                    assert await send(session, base, kind, 99) == "200"
        finally:
            await runner.cleanup()
            await runtime.close()
            await tools.cleanup()
            await llm.stop()


@settings(max_examples=60, deadline=None)
# Seen in a hostile trial: a fault once the answer had started wrote a second status line
# into a stream's body, and left an MCP call kept for its key waiting for ever.
@example("meter chunk", 1, ["stream"])
@example("capture feed", 2, ["stream", "tool"])
@example("mcp tracker", 1, ["tool"])
# Found here: a fault counting a call's end replaced its answer (a cut connection).
@example("counter", 2, ["tool"])
@given(st.sampled_from(sorted(TARGETS)), st.integers(1, 6),
       st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
def test_a_fault_anywhere_ends_its_call_and_leaves_nothing_held(target, nth, kinds):
    asyncio.run(one_example(target, nth, kinds))
