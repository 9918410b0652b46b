"""A real MCP server for end-to-end tests: the official SDK's ``MCPServer`` over streamable HTTP.

``run_mcp_server()`` starts it in its own process (the test venv's Python, so the ``mcp`` 2.x
package of the ``test`` extra) on 127.0.0.1 and a port the child picks itself, waits until
uvicorn has started, and yields an :class:`McpServer`; leaving the block stops the process.
The pytest fixtures ``mcp_stateless`` and ``mcp_session`` wrap it; ``mcp_server_factory`` starts
servers with other options. Startup costs about 1 s (importing the SDK).

Modes:
    ``stateless``  ``stateless_http=True``: no ``Mcp-Session-Id``, no GET stream, a fresh
                   transport per POST (the mode most deployed tool servers use).
    ``session``    a session per ``initialize``: ``Mcp-Session-Id`` on every request, the
                   client's GET stream for server messages, DELETE at the end.
Clients of protocol 2026-07-28 (the ``mcp`` 2.x client in its default ``mode="auto"``) use
neither: they send ``server/discover`` and per-request POSTs with ``Mcp-Method`` / ``Mcp-Name``;
the same server answers them in both modes.

Tools (all answer on ``/mcp``):
    ``add(a: int, b: int) -> int``           at once
    ``slow(seconds: float = 2.0) -> str``    sleeps ``seconds`` (at most 30), then ``"slept"``
    ``poll(seconds: float = 1.0) -> str``    closes the call's SSE stream at once (polling;
                                             ``resumable`` only), sleeps, then ``"polled"``
    ``poll_send(to: str, seconds: float = 1.0) -> str``
                                             ``poll``, with ``send``'s side effect once the
                                             stream is closed: a polled tool that is counted
    ``confirm_send(to: str, ask_after: float = 0.0, answer_after: float = 0.0) -> str``
                                             asks its client to confirm (an elicitation on
                                             the call's stream) after ``ask_after`` seconds,
                                             then ``send``'s side effect, and answers
                                             ``answer_after`` seconds later
    ``confirm_slowly(to: str, seconds: float = 2.0) -> str``
                                             asks its client to confirm first (a resolver:
                                             an ``InputRequiredResult`` round at 2026-07-28),
                                             then ``send_slowly``
    ``ask_twice(to: str) -> str``            two questions in two such rounds, then
                                             ``send``'s side effect, body and result
                                             ``first=.. second=..`` (the answers)
    ``send(to: str, body: str = "") -> str`` the side effect: appends one line
                                             ``{"to", "body"}`` to the count file, returns
                                             ``"sent #N"``
    ``send_slowly(to: str, seconds: float = 2.0) -> str``
                                             ``send``'s side effect first, then a sleep of
                                             ``seconds`` (at most 30), then ``"sent #N"``: a
                                             slow tool that outlasts a caller's timeout
    ``send_after(to: str, seconds: float = 2.0) -> str``
                                             a sleep of ``seconds`` (at most 30), then
                                             ``send``'s side effect and ``"sent #N"``; a
                                             cancel during the sleep (``notifications/
                                             cancelled`` on its session) stops it before the
                                             side effect and is recorded (``cancels()``)
    ``sends() -> int``                       how many times ``send`` has run
    ``fail(message: str = "tool failed")``   a tool failure: a result with ``isError: true``
    ``notify() -> str``                      sends ``notifications/tools/list_changed`` on the
                                             session's GET stream (session mode, 2025 clients)
    ``gated(path: str) -> str``              answers ``"opened"`` once the file ``path`` exists
                                             (at most 60 s): in flight as long as its test needs

``McpServer.sends()`` reads the count file directly, without an MCP call, so a test can count
executions behind a proxy without going through it.

Options: ``json_response=True`` answers requests with ``application/json`` instead of SSE;
``resumable=True`` gives the server an in-memory event store, so its SSE events carry ids and the
client may reconnect with ``Last-Event-ID``. ``list_delay=S`` makes ``tools/list`` answer only
after ``S`` seconds (slow control traffic).

Run by hand: ``python tests/mcp_servers.py --mode session --port 9000``.
"""

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web

Mode = Literal["stateless", "session"]

#: Seconds to wait for the child to report its port (one that exits is seen at once; 20
#: was too short at load 11, where importing the SDK alone took 16 s).
STARTUP_TIMEOUT_S = 60.0

#: The path the server answers MCP on.
MCP_PATH = "/mcp"


@dataclass(frozen=True)
class McpServer:
    """A running MCP server process and where to reach it."""

    mode: Mode
    port: int
    count_file: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        """The MCP endpoint, ``http://127.0.0.1:PORT/mcp``."""
        return f"http://127.0.0.1:{self.port}{MCP_PATH}"

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``, to put behind a proxy route."""
        return f"http://127.0.0.1:{self.port}"

    def sends(self) -> int:
        """How many times the ``send`` tool has executed (its side effect), read from the file."""
        if not self.count_file.exists():
            return 0
        return sum(1 for line in self.count_file.read_text().splitlines() if line)

    def sent(self) -> list[dict[str, Any]]:
        """The arguments of every ``send`` execution, oldest first."""
        if not self.count_file.exists():
            return []
        return [json.loads(line) for line in self.count_file.read_text().splitlines() if line]

    def cancels(self) -> list[str]:
        """The ``to`` of every ``send_after`` call the server stopped on a cancel, oldest
        first (read from the file next to the count file)."""
        path = _cancels_file(self.count_file)
        return path.read_text().splitlines() if path.exists() else []

    def reset_sends(self) -> None:
        """Forget past ``send`` executions (the tool counts on from the file)."""
        self.count_file.write_text("")


@contextlib.contextmanager
def run_mcp_server(
    mode: Mode = "stateless",
    *,
    count_file: Path,
    json_response: bool = False,
    resumable: bool = False,
    list_delay: float = 0.0,
) -> Iterator[McpServer]:
    """Start the server in a child process and stop it (SIGTERM, then SIGKILL) on exit.

    Raises ``RuntimeError`` with the child's stderr if it does not report a port within
    ``STARTUP_TIMEOUT_S``.
    """
    count_file.write_text("")
    args = [sys.executable, str(Path(__file__).resolve()), "--mode", mode,
            "--port", "0", "--count-file", str(count_file)]
    if json_response:
        args.append("--json-response")
    if resumable:
        args.append("--resumable")
    if list_delay:
        args += ["--list-delay", str(list_delay)]
    stderr_path = count_file.with_suffix(".stderr")
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = _read_port(proc, stderr_path)
        yield McpServer(mode=mode, port=port, count_file=count_file, proc=proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _read_port(proc: subprocess.Popen[bytes], stderr_path: Path) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            buf += chunk
            if b"\n" in buf:
                line = buf.split(b"\n", 1)[0].decode()
                if line.startswith("PORT "):
                    return int(line.split()[1])
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"MCP server did not start: {stderr_path.read_text()[-2000:]}")


# -- pytest fixtures (import them into a test module) ------------------------------------------


HTTP_HEADERS = {"Content-Type": "application/json",
                "Accept": "application/json, text/event-stream"}


async def raw_session(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    """A 2025-11-25 session opened by hand; the headers its requests carry."""
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"}}}
    async with http.post(url, json=init, headers=HTTP_HEADERS) as r:
        await r.read()
        headers = {**HTTP_HEADERS, "Mcp-Session-Id": r.headers["Mcp-Session-Id"],
                   "MCP-Protocol-Version": "2025-11-25"}
    async with http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                         headers=headers) as r:
        await r.read()
    return headers


class McpGateway:
    """In front of an MCP server (``target``: its base URL), in the test's process: forwards
    every request and answers as the server did, except that

    * while ``refusing``, it answers 503 without forwarding (the tool does not run: Sluice
      dead-letters the call);
    * for the next ``fail_after_run`` ``tools/call`` requests, it answers 502 once the server
      has run the call (the fault that makes a retry run a side effect twice).

    ``calls``: the tools of the ``tools/call`` requests it forwarded, in order."""

    def __init__(self, target: str, fail_after_run: int = 0) -> None:
        self.target = target
        self.fail_after_run = fail_after_run
        self.refusing = False
        self.calls: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "McpGateway":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self.refusing:
            return web.Response(status=503, text="unavailable")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")}
        async with aiohttp.ClientSession() as http, http.request(
                request.method, self.target + request.path_qs, headers=headers,
                data=body) as r:
            answer = await r.read()
            status, content_type = r.status, r.headers.get("Content-Type")
        doc = json.loads(body) if body else {}
        if isinstance(doc, dict) and doc.get("method") == "tools/call":
            self.calls.append(doc["params"]["name"])
            if self.fail_after_run > 0:
                self.fail_after_run -= 1
                return web.Response(status=502, text="bad gateway")
        return web.Response(status=status, body=answer,
                            headers={"Content-Type": content_type or "application/json"})


def tool_call(request_id: int | str, name: str, **arguments: Any) -> dict[str, Any]:
    """A JSON-RPC ``tools/call`` request body, for tests that post by hand."""
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}}


@pytest.fixture
def mcp_stateless(tmp_path: Path) -> Iterator[McpServer]:
    """A ``stateless_http=True`` server for one test."""
    with run_mcp_server("stateless", count_file=tmp_path / "sends-stateless.jsonl") as srv:
        yield srv


@pytest.fixture
def mcp_session(tmp_path: Path) -> Iterator[McpServer]:
    """A session-mode server (``Mcp-Session-Id``, GET stream, DELETE) for one test."""
    with run_mcp_server("session", count_file=tmp_path / "sends-session.jsonl") as srv:
        yield srv


@pytest.fixture
def mcp_server_factory(tmp_path: Path) -> Iterator[Any]:
    """``start(mode, json_response=False, resumable=False, list_delay=0.0) -> McpServer``; all
    stop at the end."""
    with contextlib.ExitStack() as stack:
        n = 0

        def start(mode: Mode = "stateless", **options: Any) -> McpServer:
            nonlocal n
            n += 1
            return stack.enter_context(run_mcp_server(
                mode, count_file=tmp_path / f"sends-{n}.jsonl", **options))

        yield start


# -- the child process --------------------------------------------------------------------------


def _build(count_file: Path, list_delay: float = 0.0) -> Any:
    # This module has no ``from __future__ import annotations``: the SDK reads the tools'
    # annotations at runtime, and ``Context`` is only imported here, in the child.
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import BaseModel

    class Confirm(BaseModel):
        ok: bool

    class Tools(MCPServer):
        async def list_tools(self) -> Any:
            await asyncio.sleep(list_delay)
            return await super().list_tools()

    server = Tools("sluice-test-tools")

    @server.tool()
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    async def slow(seconds: float = 2.0) -> str:
        """Sleep for ``seconds`` (at most 30), then answer."""
        await asyncio.sleep(min(max(seconds, 0.0), 30.0))
        return "slept"

    @server.tool()
    async def gated(path: str) -> str:
        """Answer once the file ``path`` exists (at most 60 s): a call that lasts exactly as
        long as its test needs, however slow the machine."""
        for _ in range(3000):
            if os.path.exists(path):
                break
            await asyncio.sleep(0.02)
        return "opened"

    @server.tool()
    async def poll(ctx: Context, seconds: float = 1.0) -> str:
        """Close the call's SSE stream at once (2025-11-25 polling: a client resumes it with
        ``Last-Event-ID``; needs ``resumable``), sleep ``seconds`` (at most 30), answer."""
        await ctx.close_sse_stream()
        await asyncio.sleep(min(max(seconds, 0.0), 30.0))
        return "polled"

    @server.tool()
    async def confirm_send(ctx: Context, to: str, ask_after: float = 0.0,
                           answer_after: float = 0.0) -> str:
        """Ask the client to confirm (``elicitation/create`` on the call's stream) after
        ``ask_after`` seconds, then, if it accepted, record one delivery (``send``'s side
        effect) and answer ``answer_after`` seconds later (each at most 30)."""
        await asyncio.sleep(min(max(ask_after, 0.0), 30.0))
        answer = await ctx.elicit(message=f"send to {to}?", schema=Confirm)
        if answer.action != "accept":
            return "not sent"
        sent = _deliver(count_file, to)
        await asyncio.sleep(min(max(answer_after, 0.0), 30.0))
        return f"sent #{sent}"

    from typing import Annotated

    from mcp.server.mcpserver.resolve import Elicit, Resolve

    def ask_confirm(to: str) -> Any:
        return Elicit(message=f"send to {to}?", schema=Confirm)

    def ask_first(to: str) -> Any:
        return Elicit(message="first?", schema=Confirm)

    def ask_second(first: Annotated[Confirm, Resolve(ask_first)]) -> Any:
        return Elicit(message="second?", schema=Confirm)  # asked once the first is answered

    @server.tool()
    async def confirm_slowly(to: str, ok: Annotated[Confirm, Resolve(ask_confirm)],
                             seconds: float = 2.0) -> str:
        """Ask the client to confirm first (at 2026-07-28 an ``InputRequiredResult`` round,
        MRTR; at 2025 an elicitation on the call's stream), then, if it accepted, ``send``'s
        side effect and a sleep of ``seconds`` (at most 30)."""
        if not ok.ok:
            return "not sent"
        sent = _deliver(count_file, to)
        await asyncio.sleep(min(max(seconds, 0.0), 30.0))
        return f"sent #{sent}"

    @server.tool()
    async def ask_twice(to: str, first: Annotated[Confirm, Resolve(ask_first)],
                        second: Annotated[Confirm, Resolve(ask_second)]) -> str:
        """Two questions in two MRTR rounds (the second asked once the first is answered),
        then ``send``'s side effect, with both answers as its body and in its result."""
        body = f"first={first.ok} second={second.ok}"
        _deliver(count_file, to, body)
        return body

    @server.tool()
    async def poll_send(ctx: Context, to: str, seconds: float = 1.0) -> str:
        """``poll`` that also records one delivery (``send``'s), after closing its stream."""
        await ctx.close_sse_stream()
        sent = _deliver(count_file, to)
        await asyncio.sleep(min(max(seconds, 0.0), 30.0))
        return f"sent #{sent}"

    @server.tool()
    async def send(to: str, body: str = "") -> str:
        """A side effect: record one delivery."""
        return f"sent #{_deliver(count_file, to, body)}"

    @server.tool()
    async def send_slowly(to: str, seconds: float = 2.0) -> str:
        """A slow side effect: record one delivery, then take ``seconds`` to answer."""
        sent = _deliver(count_file, to)
        await asyncio.sleep(min(max(seconds, 0.0), 30.0))
        return f"sent #{sent}"

    @server.tool()
    async def send_after(to: str, seconds: float = 2.0) -> str:
        """A side effect after a wait: ``seconds`` (at most 30), then one delivery. A cancel
        during the wait stops it, recorded, with no delivery."""
        try:
            await asyncio.sleep(min(max(seconds, 0.0), 30.0))
        except asyncio.CancelledError:
            with _cancels_file(count_file).open("a") as f:
                f.write(to + "\n")
            raise
        return f"sent #{_deliver(count_file, to)}"

    @server.tool()
    async def sends() -> int:
        """How many times ``send`` has run."""
        return _count(count_file)

    @server.tool()
    async def fail(message: str = "tool failed") -> str:
        """Always fails as a tool: the result has ``isError: true``."""
        raise ToolError(message)

    @server.tool()
    async def notify(ctx: Context) -> str:
        """Send ``notifications/tools/list_changed`` on the session's GET stream."""
        await ctx.session.send_tool_list_changed()
        return "notified"

    return server


def _cancels_file(count_file: Path) -> Path:
    return count_file.with_suffix(".cancels")


def _count(count_file: Path) -> int:
    return sum(1 for line in count_file.read_text().splitlines() if line)


def _deliver(count_file: Path, to: str, body: str = "") -> int:
    """Record one delivery (a tool's side effect) in ``count_file``; the deliveries so far."""
    with count_file.open("a") as f:
        f.write(json.dumps({"to": to, "body": body}) + "\n")
    return _count(count_file)


def _event_store() -> Any:
    from mcp.server.streamable_http import EventMessage, EventStore

    def session() -> str | None:
        """The session of the transport calling the store. The SDK shares one store among
        every session's transport and names a request's stream by its JSON-RPC id, which
        each session numbers from its own start: a store keyed by stream alone replayed
        another session's events for the same id to a resumed stream (a hostile trial)."""
        frame = inspect.currentframe()
        while frame is not None:
            transport = frame.f_locals.get("self")
            if hasattr(transport, "mcp_session_id"):
                return transport.mcp_session_id
            frame = frame.f_back
        return None

    class MemoryEventStore(EventStore):
        """Every event kept in order, with its session; ids are ``<stream>:<n>``."""

        def __init__(self) -> None:
            self.events: list[tuple[str, tuple[str | None, str], Any]] = []

        async def store_event(self, stream_id: str, message: Any) -> str:
            event_id = f"{stream_id}:{len(self.events)}"
            self.events.append((event_id, (session(), stream_id), message))
            return event_id

        async def replay_events_after(self, last_event_id: str, send_callback: Any) -> str | None:
            ids = [e[0] for e in self.events]
            if last_event_id not in ids:
                return None
            stream = self.events[ids.index(last_event_id)][1]
            if stream[0] != session():
                return None  # another session's event
            for event_id, sid, message in self.events[ids.index(last_event_id) + 1:]:
                if sid == stream and message is not None:
                    await send_callback(EventMessage(message, event_id))
            return stream[1]

    return MemoryEventStore()


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    server = _build(Path(args.count_file), args.list_delay)
    app = server.streamable_http_app(
        stateless_http=args.mode == "stateless",
        json_response=args.json_response,
        event_store=_event_store() if args.resumable else None,
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))

    async def announce() -> None:
        while not uv.started:
            await asyncio.sleep(0.01)
        print(f"PORT {sock.getsockname()[1]}", flush=True)

    announcer = asyncio.ensure_future(announce())
    await uv.serve(sockets=[sock])
    announcer.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mode", choices=["stateless", "session"], default="stateless")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--count-file", default="mcp-sends.jsonl")
    parser.add_argument("--json-response", action="store_true")
    parser.add_argument("--resumable", action="store_true")
    parser.add_argument("--list-delay", type=float, default=0.0)
    asyncio.run(_serve(parser.parse_args()))


if __name__ == "__main__":
    main()
