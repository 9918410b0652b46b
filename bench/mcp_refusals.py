"""How the official MCP clients take a proxy's refusal of one ``tools/call`` (docs/mcp.md).

``python -m bench mcp_refusals [--quick] [--clients a,b] [--shapes a,b]``

A real MCP server (``tests/mcp_servers.py``, stateless and session mode) sits behind a small
aiohttp proxy, :class:`RefusingProxy`, that forwards everything except a ``tools/call`` of the
``send`` tool, which it answers itself in one of :data:`SHAPES`. Each client in :data:`CLIENTS`
runs one session (``bench/mcp_clients/``): two 2 s ``slow`` calls in flight, then the refused
``send``, then ``add`` to see whether the session survived. The table says, per client and
shape, what the caller of the refused call got and what became of the other calls.

The proxy also records what each client sends: ``Mcp-Method`` / ``Mcp-Name`` headers, the GET
stream and its ``Last-Event-ID`` after the proxy ends it (``getcut``, on a resumable server),
DELETE on close. Clients whose runtime is missing are skipped with a note: the 1.x Python
client needs ``.venv-mcp1``, the TypeScript ones ``.mcp-ts`` (``.ci/run`` makes both:
``python3 -m venv .venv-mcp1 && .venv-mcp1/bin/pip install 'mcp>=1.30,<2'`` and ``npm install
--prefix .mcp-ts @modelcontextprotocol/sdk@^1.32 @modelcontextprotocol/client@^2.4``);
``MCP1_PYTHON`` and ``MCP_TS_DIR`` override the paths.
Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.common import RESULTS, machine_lines, table, versions, write_record
from tests.mcp_servers import McpServer, run_mcp_server

REPO = Path(__file__).resolve().parent.parent
CLIENT_PY = REPO / "bench" / "mcp_clients" / "client.py"
CLIENT_MJS = REPO / "bench" / "mcp_clients" / "client.mjs"
MCP1_PYTHON = Path(os.environ.get("MCP1_PYTHON", REPO / ".venv-mcp1" / "bin" / "python"))
MCP_TS_DIR = Path(os.environ.get("MCP_TS_DIR", REPO / ".mcp-ts"))

#: The tool the proxy refuses.
REFUSED_TOOL = "send"
#: Seconds before a client process is given up on.
CLIENT_TIMEOUT_S = 40.0

#: Headers the proxy records on every request.
RECORDED = ("mcp-method", "mcp-name", "mcp-protocol-version", "mcp-session-id", "last-event-id")

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "content-length", "host"}


def _error(rpc_id: Any, code: int, reason: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {
        "code": code, "message": f"Sluice refused the call: {reason}",
        "data": {"reason": reason, "retryAfterMs": 1000}}}


def _wrong_id(rpc_id: Any) -> Any:
    return rpc_id + 1000 if isinstance(rpc_id, int) else f"{rpc_id}-other"


def _sse(message: dict[str, Any]) -> bytes:
    return b"event: message\ndata: " + orjson.dumps(message) + b"\n\n"


REFUSAL_HEADERS = {"Retry-After": "1", "X-Sluice-Reason": "rate_limited"}

#: Refusal shapes: name -> (description, function of the request id -> aiohttp Response).
SHAPES: dict[str, tuple[str, Any]] = {
    "429-json": ("HTTP 429, application/json JSON-RPC error (code 429, id echoed)",
                 lambda i: web.json_response(_error(i, 429, "rate_limited"), status=429,
                                             headers=REFUSAL_HEADERS)),
    "503-json": ("HTTP 503, application/json JSON-RPC error (code 503, id echoed)",
                 lambda i: web.json_response(_error(i, 503, "queue_full"), status=503,
                                             headers=REFUSAL_HEADERS)),
    "429-text": ("HTTP 429, text/plain body (no JSON-RPC)",
                 lambda i: web.Response(status=429, text="rate limited",
                                        headers=REFUSAL_HEADERS)),
    "200-json": ("HTTP 200, application/json JSON-RPC error (code 429, id echoed)",
                 lambda i: web.json_response(_error(i, 429, "rate_limited"),
                                             headers=REFUSAL_HEADERS)),
    "200-sse": ("HTTP 200, text/event-stream, one event with the JSON-RPC error",
                lambda i: web.Response(body=_sse(_error(i, 429, "rate_limited")),
                                       content_type="text/event-stream",
                                       headers=REFUSAL_HEADERS)),
    "200-json-wrongid": ("HTTP 200, application/json JSON-RPC error with another id",
                         lambda i: web.json_response(_error(_wrong_id(i), 429, "rate_limited"),
                                                     headers=REFUSAL_HEADERS)),
    "200-sse-wrongid": ("HTTP 200, text/event-stream JSON-RPC error with another id",
                        lambda i: web.Response(body=_sse(_error(_wrong_id(i), 429, "rate_limited")),
                                               content_type="text/event-stream",
                                               headers=REFUSAL_HEADERS)),
}

#: The shape docs/mcp.md recommends (see the table there).
RECOMMENDED = "200-json"


@dataclass
class Seen:
    """One request as the proxy received it, and the status it answered."""

    at: float
    method: str
    rpc_method: str | None
    rpc_id: Any
    tool: str | None
    headers: dict[str, str]
    status: int = 0
    refused: bool = False


class RefusingProxy:
    """Forwards to ``upstream`` (an MCP endpoint URL) except ``tools/call`` of a refused tool.

    ``shape`` names the refusal (a key of :data:`SHAPES`, or ``None`` to refuse nothing);
    ``cut_first_get`` ends the first GET stream once its first event has passed, to see the
    client reconnect. ``log`` holds every request.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.shape: str | None = None
        self.cut_first_get = False
        self.log: list[Seen] = []
        self._gets = 0
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self.url = ""

    def reset(self, shape: str | None, *, cut_first_get: bool = False) -> None:
        self.shape, self.cut_first_get = shape, cut_first_get
        self.log, self._gets = [], 0

    async def start(self) -> str:
        self._client = aiohttp.ClientSession(auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/mcp"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen = Seen(at=time.monotonic(), method=request.method, rpc_method=None, rpc_id=None,
                    tool=None, headers={h: request.headers[h] for h in RECORDED
                                        if h in request.headers})
        self.log.append(seen)
        if request.method == "POST":
            with contextlib.suppress(orjson.JSONDecodeError):
                msg = orjson.loads(body)
                if isinstance(msg, dict):
                    seen.rpc_method, seen.rpc_id = msg.get("method"), msg.get("id")
                    params = msg.get("params")
                    if seen.rpc_method == "tools/call" and isinstance(params, dict):
                        seen.tool = params.get("name")
        if self.shape is not None and seen.tool == REFUSED_TOOL:
            response = SHAPES[self.shape][1](seen.rpc_id)
            seen.status, seen.refused = response.status, True
            return response
        return await self._forward(request, body, seen)

    async def _forward(self, request: web.Request, body: bytes, seen: Seen) -> web.StreamResponse:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        cut = False
        if request.method == "GET":
            self._gets += 1
            cut = self.cut_first_get and self._gets == 1
        async with self._client.request(request.method, self.upstream, headers=headers,
                                        data=body or None) as upstream:
            seen.status = upstream.status
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP})
            await response.prepare(request)
            sent = b""
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                    sent += chunk
                    if cut and (b"\n\n" in sent or b"\r\n\r\n" in sent):
                        break  # the first event is through: end the stream, as a timeout would
            except (ConnectionResetError, aiohttp.ClientError):
                pass  # the client went away: end our side too
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            return response


@dataclass(frozen=True)
class ClientSpec:
    """One official client and how to run ``bench/mcp_clients`` with it."""

    name: str
    argv: tuple[str, ...]
    mode: str

    def available(self) -> str | None:
        """``None`` when it can run, else why not."""
        exe = self.argv[0]
        if exe == "node":
            if shutil.which("node") is None:
                return "node is not installed"
            if not (MCP_TS_DIR / "node_modules" / "@modelcontextprotocol" / self.pkg).is_dir():
                return f"@modelcontextprotocol/{self.pkg} is not installed under {MCP_TS_DIR}"
            return None
        return None if Path(exe).exists() else f"{exe} is missing"

    def command(self, url: str, slow_s: float, *, notify: bool = False,
                call_timeout_s: float = 6.0) -> list[str]:
        tail = [self.mode, str(slow_s), "notify" if notify else "plain", str(call_timeout_s)]
        if self.argv[0] == "node":
            return [*self.argv, url, self.pkg, *tail]
        return [*self.argv, url, *tail]

    @property
    def pkg(self) -> str:
        """The npm package of a TypeScript client: ``sdk`` (1.x line) or ``client`` (2.x)."""
        return "sdk" if self.name.startswith("ts-sdk") else "client"


CLIENTS = (
    ClientSpec("py-mcp1", (str(MCP1_PYTHON), str(CLIENT_PY)), "legacy"),
    ClientSpec("py-mcp2-legacy", (sys.executable, str(CLIENT_PY)), "legacy"),
    ClientSpec("py-mcp2-auto", (sys.executable, str(CLIENT_PY)), "auto"),
    ClientSpec("ts-sdk1", ("node", str(CLIENT_MJS)), "legacy"),
    ClientSpec("ts-client2-legacy", ("node", str(CLIENT_MJS)), "legacy"),
    ClientSpec("ts-client2-auto", ("node", str(CLIENT_MJS)), "auto"),
)


@dataclass
class Run:
    """One client session through the proxy and what it showed."""

    client: str
    server: str
    shape: str
    result: dict[str, Any]
    seen: list[Seen]
    sends_executed: int
    stderr: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def refused_posts(self) -> int:
        return sum(1 for s in self.seen if s.refused)

    def one_call_failed(self) -> bool:
        """The refused call raised, every other call succeeded, the session lived on."""
        calls = self.result.get("calls", {})
        return (calls.get("refused", {}).get("outcome") == "raised"
                and all(calls.get(k, {}).get("outcome") == "ok"
                        for k in ("slow_1", "slow_2", "after"))
                and not self.result.get("session_error"))

    def effect(self) -> str:
        """A table cell: what the refused call did, then the other calls and the session."""
        calls = self.result.get("calls")
        if calls is None:
            return f"client crashed: {self.result.get('crash', '?')}"
        refused = calls.get("refused", {})
        outcome = refused.get("outcome", "never called")
        if outcome == "raised":
            err = refused.get("error", {})
            kind = str(err.get("type", "?")).rsplit(".", 1)[-1]
            data = err.get("data")
            has_data = isinstance(data, dict) and "retryAfterMs" in data
            first = f"raises {kind} code {err.get('code')}{', data readable' if has_data else ''}"
        elif outcome == "timeout":
            first = "hangs until the caller's timeout"
        else:
            first = outcome
        if self.refused_posts > 1:
            first += f" (sent {self.refused_posts}x)"
        others = [k for k in ("slow_1", "slow_2", "after")
                  if calls.get(k, {}).get("outcome") != "ok"]
        if not others and not self.result.get("session_error"):
            return f"{first}; others ok"
        lost = ", ".join(f"{k} {calls.get(k, {}).get('outcome', 'never called')}" for k in others)
        session = self.result.get("session_error")
        tail = f"; session died ({_short(session)})" if session else ""
        return f"{first}; {lost}{tail}"


def _short(err: dict[str, Any] | None) -> str:
    if not err:
        return ""
    leaves = err.get("leaves")
    if leaves:
        return _short(leaves[0])
    return str(err.get("type", "?")).rsplit(".", 1)[-1] + ": " + str(err.get("message", ""))[:60]


async def run_client(spec: ClientSpec, proxy: RefusingProxy, server: McpServer, shape: str,
                     *, slow_s: float, call_timeout_s: float = 6.0,
                     in_process: bool = False) -> Run:
    """One session of ``spec`` through ``proxy`` refusing in ``shape``.

    ``"none"`` refuses nothing; ``"getcut"`` refuses nothing, has the client call ``notify``
    first and ends the GET stream after that notification. Each call of the session gives up
    after ``call_timeout_s`` (a call the client never answers). With ``in_process``, a client of
    this interpreter's ``mcp`` (the 2.x Python ones) runs in this event loop instead of a
    child process: the same scenario, without an interpreter start.
    """
    getcut = shape == "getcut"
    proxy.reset(None if shape in ("none", "getcut") else shape, cut_first_get=getcut)
    before = server.sends()
    err = b""
    if in_process and spec.argv[0] == sys.executable:
        from bench.mcp_clients.client import run_session

        result = await run_session(proxy.url, spec.mode, slow_s, getcut, call_timeout_s)
    else:
        proc = await asyncio.create_subprocess_exec(
            *spec.command(proxy.url, slow_s, notify=getcut, call_timeout_s=call_timeout_s),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "MCP_TS_DIR": str(MCP_TS_DIR)})
        try:
            out, err = await asyncio.wait_for(proc.communicate(), CLIENT_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            err += f"killed after {CLIENT_TIMEOUT_S:.0f} s".encode()
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"crash": err.decode()[-300:]}
    await asyncio.sleep(0.1)  # a DELETE or GET racing the client's exit
    return Run(client=spec.name, server=server.mode, shape=shape, result=result,
               seen=list(proxy.log), sends_executed=server.sends() - before,
               stderr=err.decode()[-2000:])


def observations(run: Run) -> dict[str, str]:
    """What a client sent, from the proxy's log of one session-mode ``getcut`` run."""
    posts = [s for s in run.seen if s.method == "POST" and s.rpc_method == "tools/call"]
    gets = [s for s in run.seen if s.method == "GET"]
    first = posts[0].headers if posts else {}
    resumed = [s.headers.get("last-event-id") for s in gets[1:]]
    return {
        "protocol": first.get("mcp-protocol-version", "-"),
        "mcp_method_name": (f"{first.get('mcp-method', '-')} / {first.get('mcp-name', '-')}"
                            if first.get("mcp-method") else "no"),
        "first_method": next((s.rpc_method for s in run.seen if s.rpc_method), "-") or "-",
        "get_streams": str(len(gets)),
        "last_event_id": ", ".join(r or "none" for r in resumed) if resumed else "no reconnect",
        "delete": "yes" if any(s.method == "DELETE" for s in run.seen) else "no",
    }


@contextlib.contextmanager
def servers(tmp: Path, modes: list[str]) -> Iterator[dict[str, McpServer]]:
    with contextlib.ExitStack() as stack:
        out = {m: stack.enter_context(run_mcp_server(m, count_file=tmp / f"{m}.jsonl"))
               for m in modes}
        out["resumable"] = stack.enter_context(
            run_mcp_server("session", count_file=tmp / "resumable.jsonl", resumable=True))
        yield out


async def measure(clients: list[ClientSpec], shapes: list[str], modes: list[str],
                  slow_s: float) -> tuple[list[Run], list[Run]]:
    runs: list[Run] = []
    probes: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp, servers(Path(tmp), modes) as srv:
        for mode in modes:
            proxy = RefusingProxy(srv[mode].url)
            await proxy.start()
            try:
                for spec in clients:
                    for shape in shapes:
                        run = await run_client(spec, proxy, srv[mode], shape, slow_s=slow_s)
                        runs.append(run)
                        print(f"  {mode:9} {spec.name:18} {shape:17} {run.effect()}", flush=True)
            finally:
                await proxy.stop()
        proxy = RefusingProxy(srv["resumable"].url)
        await proxy.start()
        try:
            for spec in clients:
                probes.append(await run_client(spec, proxy, srv["resumable"], "getcut",
                                               slow_s=slow_s))
        finally:
            await proxy.stop()
    return runs, probes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench mcp_refusals", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="the recommended shape and 429-json only, stateless server")
    parser.add_argument("--clients", help="comma list of: " + ", ".join(c.name for c in CLIENTS))
    parser.add_argument("--shapes", help="comma list of: none, " + ", ".join(SHAPES))
    parser.add_argument("--slow", type=float, default=2.0, help="seconds the slow tool takes")
    args = parser.parse_args(argv)
    started = datetime.datetime.now(datetime.UTC)
    wanted = args.clients.split(",") if args.clients else [c.name for c in CLIENTS]
    unknown = set(wanted) - {c.name for c in CLIENTS}
    shapes = (args.shapes.split(",") if args.shapes
              else ["429-json", RECOMMENDED] if args.quick else ["none", *SHAPES])
    unknown |= set(shapes) - {"none", *SHAPES}
    if unknown:
        print(f"unknown: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    clients = []
    for spec in CLIENTS:
        if spec.name in wanted:
            missing = spec.available()
            if missing:
                print(f"skipping {spec.name}: {missing}")
            else:
                clients.append(spec)
    modes = ["stateless"] if args.quick else ["stateless", "session"]
    runs, probes = asyncio.run(measure(clients, shapes, modes, args.slow))

    from importlib.metadata import version

    info = versions({"mcp (server, 2.x client)": version("mcp")})
    print("\n".join(machine_lines("MCP refusals: one refused tools/call per session", started,
                                  info)))
    client_versions = {r.client: r.result.get("client", "?") for r in runs}
    print("\nClients: " + "; ".join(f"{k} = {v}" for k, v in client_versions.items()))
    for mode in modes:
        rows = [["client", *shapes]]
        for spec in clients:
            rows.append([spec.name, *(next(r.effect() for r in runs if r.client == spec.name
                                           and r.server == mode and r.shape == s)
                                      for s in shapes)])
        print(f"\n{mode} server: effect of the refusal (refused tool: {REFUSED_TOOL})\n")
        print(table(rows, left=len(rows[0])))
    rows = [["client", "protocol", "Mcp-Method / Mcp-Name", "first request", "GET streams",
             "Last-Event-ID on reconnect", "DELETE on close"]]
    for p in probes:
        o = observations(p)
        rows.append([p.client, o["protocol"], o["mcp_method_name"], o["first_method"],
                     o["get_streams"], o["last_event_id"], o["delete"]])
    print("\nWhat each client sends (session-mode resumable server; the proxy ends the first"
          " GET stream after its first event)\n")
    print(table(rows, left=len(rows[0])))
    executed = sum(r.sends_executed for r in runs if r.shape != "none")
    print(f"\nsend executions behind a refusal: {executed} (expected 0)")
    for shape in shapes:
        if shape != "none" and all(r.one_call_failed() for r in runs if r.shape == shape):
            print(f"fails exactly one call on every client and server mode: {shape}")
    record = {"started": started.isoformat(), "info": info, "versions": client_versions,
              "runs": [{"client": r.client, "server": r.server, "shape": r.shape,
                        "effect": r.effect(), "one_call_failed": r.one_call_failed(),
                        "result": r.result, "refused_posts": r.refused_posts,
                        "sends_executed": r.sends_executed,
                        "requests": [[s.method, s.rpc_method, s.tool, s.status] for s in r.seen]}
                       for r in runs],
              "probes": [{"client": p.client, **observations(p),
                          "seen": [vars(s) for s in p.seen]} for p in probes]}
    path = write_record(RESULTS / f"mcp_refusals-{started:%Y%m%dT%H%M%S}.json", record)
    print(f"\nrecord: {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
