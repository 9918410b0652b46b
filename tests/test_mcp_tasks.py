"""A ``tools/call`` that runs on as an MCP task (2025-11-25) keeps its holdings until the
task is over.

The server answers a task-augmented call at once with a ``CreateTaskResult`` and runs the
tool in the background; the client follows it with ``tasks/get``, ``tasks/result`` and
``tasks/cancel``, control traffic. Sluice used to give the call's slot back at that quick
answer: under a tool's ``concurrency: {limit: 1, queue: 0}`` three staggered tasks ran at
the server at once (a hostile trial). Now the call is held until its task is seen over
(``proxy.mcp_tasks``), its bound passes, its session ends or the drain cuts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import uuid
from typing import Any, Self

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import REPO, serve_app, wait_until

MCP_TS = REPO / ".mcp-ts"
TS_TASK_SERVER = REPO / "tests" / "mcp_ts" / "task_server.mjs"
TS_TASK_CLIENT = REPO / "tests" / "mcp_ts" / "task_client.mjs"

SESSION = "s-1"
HEADERS = {"Accept": "application/json, text/event-stream", "Mcp-Session-Id": SESSION,
           "MCP-Protocol-Version": "2025-11-25"}
TERMINAL = ("completed", "failed", "cancelled")


class TaskServer:
    """An MCP endpoint answering tasks as the 2025-11-25 spec has them (JSON answers): a
    ``tools/call`` with ``params.task`` makes a task (``working``) that runs until the test
    ends it (:meth:`complete`) or a ``tasks/cancel`` does; ``tasks/get`` and
    ``tasks/cancel`` answer the Task, ``tasks/result`` waits for its end. The session's GET
    stream carries what :meth:`notify` sends. Counts the tasks running at once."""

    def __init__(self) -> None:
        self.tasks: dict[str, dict[str, Any]] = {}
        self.ended: dict[str, asyncio.Event] = {}
        self.running = 0
        self.max_running = 0
        self.cancels: list[str] = []
        #: Each request's method as it came (``DELETE`` for a session's end).
        self.methods: list[str] = []
        self.stream: asyncio.Queue[dict] = asyncio.Queue()
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Self:
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        app.router.add_get("/mcp", self._get)
        app.router.add_delete("/mcp", self._delete)
        self.runner, self.port = await serve_app(app, handler_cancellation=True)
        return self

    async def stop(self) -> None:
        for event in self.ended.values():
            event.set()
        if self.runner is not None:
            await self.runner.cleanup()

    def _end(self, task_id: str, status: str) -> None:
        task = self.tasks[task_id]
        if task["status"] not in TERMINAL:
            task["status"] = status
            self.running -= 1
            self.ended[task_id].set()

    def complete(self, task_id: str) -> None:
        self._end(task_id, "completed")

    def notify(self, task_id: str) -> None:
        self.stream.put_nowait({"jsonrpc": "2.0", "method": "notifications/tasks/status",
                                "params": self.tasks[task_id]})

    async def _delete(self, request: web.Request) -> web.Response:
        self.methods.append("DELETE")
        for task_id, task in self.tasks.items():  # the session's end cancels its tasks
            if task["status"] not in TERMINAL:
                self._end(task_id, "cancelled")
        return web.Response(status=200)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        while True:
            message = await self.stream.get()
            await out.write(b"event: message\ndata: " + json.dumps(message).encode() + b"\n\n")

    async def _post(self, request: web.Request) -> web.Response:
        message = await request.json()
        method, rpc_id, params = message.get("method"), message.get("id"), message.get("params")
        self.methods.append(method)

        def answer(result: dict) -> web.Response:
            return web.json_response({"jsonrpc": "2.0", "id": rpc_id, "result": result})

        if method == "tools/call" and "task" in params:
            task_id = uuid.uuid4().hex
            task = {"taskId": task_id, "status": "working", "ttl": params["task"].get("ttl"),
                    "pollInterval": 100, "createdAt": "2026-12-01T00:00:00Z",
                    "lastUpdatedAt": "2026-12-01T00:00:00Z"}
            self.tasks[task_id], self.ended[task_id] = task, asyncio.Event()
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            return answer({"task": dict(task)})
        if method in ("tasks/get", "tasks/result", "tasks/cancel"):
            task_id = params["taskId"]
            if method == "tasks/cancel":
                self.cancels.append(task_id)
                self._end(task_id, "cancelled")
            elif method == "tasks/result":
                await self.ended[task_id].wait()
                return answer({"content": [{"type": "text", "text": "done"}]})
            return answer(dict(self.tasks[task_id]))
        return web.Response(status=202) if rpc_id is None else answer({})


@pytest.fixture
async def server() -> Any:
    stub = await TaskServer().start()
    yield stub
    await stub.stop()


def task_call(rpc_id: int, ttl: int = 60_000) -> dict:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
            "params": {"name": "slow_task", "arguments": {}, "task": {"ttl": ttl}}}


def follow_up(rpc_id: int, method: str, task_id: str) -> dict:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": {"taskId": task_id}}


def tasks_route(upstream: str, **tool: Any) -> dict:
    """An mcp route whose ``slow_task`` runs one at a time, none queued."""
    return {"name": "tools", "path_prefix": "/tools/", "upstream": upstream, "protocol": "mcp",
            "tools": {"slow_task": {"concurrency": {"limit": 1, "queue": 0}, **tool}}}


class Client:
    """A raw MCP client of the ``tools`` route: ``post`` returns the JSON-RPC answer."""

    def __init__(self, http: aiohttp.ClientSession, url: str, **headers: str) -> None:
        self.http, self.url, self.headers = http, url + "/tools/mcp", {**HEADERS, **headers}

    async def post(self, message: dict) -> dict:
        async with self.http.post(self.url, json=message, headers=self.headers) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def create(self, rpc_id: int, ttl: int = 60_000) -> str:
        answer = await self.post(task_call(rpc_id, ttl))
        return answer["result"]["task"]["taskId"]

    async def refused(self, rpc_id: int) -> bool:
        """Whether a second task call is refused for the tool's slot (503 queue_full)."""
        answer = await self.post(task_call(rpc_id))
        return answer.get("error", {}).get("data", {}).get("reason") == "queue_full"


async def all_given_back(sluice: Any) -> None:
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
    await sluice.wait_metric("sluice_held_task_calls", 0)
    await sluice.wait_metric("sluice_buffered_request_bytes", 0)
    for table in ("held", "tenants", "sessions", "asked"):  # no entry of Sluice's left
        await sluice.wait_metric("sluice_task_table_entries", 0, table=table)


def task_events(sluice: Any, task_id: str) -> list[dict]:
    return [e for e in sluice.events() if e["event"] == "completed"
            and e.get("task_id") == task_id]


async def ended_as(sluice: Any, task_id: str, how: str) -> dict:
    await wait_until(lambda: task_events(sluice, task_id), what="the call's completed event")
    [event] = task_events(sluice, task_id)
    assert event["task_end"] == how, event
    return event


async def test_the_tools_limit_holds_while_its_task_runs(server, start_sluice):
    """Before: the second call was admitted beside the running task (2 at the server)."""
    sluice = await start_sluice({"routes": [tasks_route(server.url)]})
    async with aiohttp.ClientSession() as http:
        client = Client(http, sluice.url)
        first = await client.create(1)
        assert await sluice.metric("sluice_held_task_calls") == 1
        assert await client.refused(2)
        assert server.max_running == 1
        server.complete(first)
        assert (await client.post(follow_up(3, "tasks/get", first)))["result"]["status"] \
            == "completed"
        event = await ended_as(sluice, first, "tasks/get")
        assert (event["outcome"], event["task_status"]) == ("2xx", "completed")
        await all_given_back(sluice)
        second = await client.create(4)  # the slot is free again
        server.complete(second)
        await client.post(follow_up(5, "tasks/result", second))
        await ended_as(sluice, second, "tasks/result")
    assert server.max_running == 1
    await all_given_back(sluice)


async def test_a_tasks_result_answer_ends_the_hold(server, start_sluice):
    sluice = await start_sluice({"routes": [tasks_route(server.url)]})
    async with aiohttp.ClientSession() as http:
        client = Client(http, sluice.url)
        task_id = await client.create(1)
        waiting = asyncio.create_task(client.post(follow_up(2, "tasks/result", task_id)))
        assert await client.refused(3)
        server.complete(task_id)
        assert (await waiting)["result"]["content"][0]["text"] == "done"
        await ended_as(sluice, task_id, "tasks/result")
        await all_given_back(sluice)


async def test_a_tasks_cancel_answered_cancelled_ends_the_hold(server, start_sluice):
    sluice = await start_sluice({"routes": [tasks_route(server.url)]})
    async with aiohttp.ClientSession() as http:
        client = Client(http, sluice.url)
        task_id = await client.create(1)
        assert await client.refused(2)
        answer = await client.post(follow_up(3, "tasks/cancel", task_id))
        assert answer["result"]["status"] == "cancelled"
        event = await ended_as(sluice, task_id, "tasks/cancel")
        assert event["task_status"] == "cancelled"
        await all_given_back(sluice)


async def test_a_terminal_status_notification_ends_the_hold(server, start_sluice):
    """The server's ``notifications/tasks/status`` on the session's GET stream."""
    sluice = await start_sluice({"routes": [tasks_route(server.url)]})
    async with aiohttp.ClientSession() as http:
        client = Client(http, sluice.url)
        stream = await http.get(client.url, headers={**HEADERS, "Accept": "text/event-stream"})
        task_id = await client.create(1)
        assert await client.refused(2)
        server.complete(task_id)
        server.notify(task_id)
        event = await ended_as(sluice, task_id, "notification")
        assert event["task_status"] == "completed"
        stream.close()
        await all_given_back(sluice)


async def test_another_tenants_or_sessions_poll_ends_nothing(server, start_sluice):
    """The server answers any poll of the id (this stub checks nothing); only one of the
    call's own route, session and tenant ends its hold."""
    sluice = await start_sluice({"routes": [tasks_route(server.url)]})
    async with aiohttp.ClientSession() as http:
        owner = Client(http, sluice.url, **{"X-Tenant-ID": "acme"})
        other_tenant = Client(http, sluice.url, **{"X-Tenant-ID": "globex"})
        other_session = Client(http, sluice.url, **{"X-Tenant-ID": "acme",
                                                     "Mcp-Session-Id": "s-2"})
        task_id = await owner.create(1)
        server.complete(task_id)
        for n, client in enumerate((other_tenant, other_session)):
            for method in ("tasks/get", "tasks/result"):
                answer = await client.post(follow_up(10 + n, method, task_id))
                assert "result" in answer
        assert await owner.refused(2)
        assert await sluice.metric("sluice_held_task_calls") == 1
        await owner.post(follow_up(3, "tasks/get", task_id))
        await ended_as(sluice, task_id, "tasks/get")
        await all_given_back(sluice)


async def test_the_tasks_ttl_does_not_bound_the_hold(server, start_sluice):
    """A task's ``ttl`` is how long its server keeps the result, and the client chooses it.
    Before: the hold ended at ``ttl: 1`` (1 ms) while the tool ran on, and a second task
    ran beside it under limit 1 (a hostile review). The call's ``timeouts.total`` bounds
    it, and its server is then sent ``tasks/cancel``."""
    sluice = await start_sluice({"routes": [tasks_route(server.url,
                                                        timeouts={"total": "3s"})]})
    async with aiohttp.ClientSession() as http:
        client = Client(http, sluice.url)
        task_id = await client.create(1, ttl=1)
        assert await client.refused(2)
        assert server.max_running == 1
        event = await ended_as(sluice, task_id, "timeout")
        assert event["outcome"] == "upstream_timeout"
        await wait_until(lambda: server.cancels == [task_id], what="Sluice's tasks/cancel")
        await all_given_back(sluice)
        await client.create(3)  # the slot is free again


async def test_the_tools_timeouts_total_bounds_the_hold(server, start_sluice):
    sluice = await start_sluice({"routes": [tasks_route(server.url,
                                                        timeouts={"total": "3s"})]})
    async with aiohttp.ClientSession() as http:
        client = Client(http, sluice.url)
        task_id = await client.create(1, ttl=600_000)
        assert await client.refused(2)
        event = await ended_as(sluice, task_id, "timeout")
        assert event["outcome"] == "upstream_timeout"
        await wait_until(lambda: server.cancels == [task_id], what="Sluice's tasks/cancel")
        await all_given_back(sluice)


async def test_the_sessions_delete_cancels_its_tasks_and_holds_them_to_the_bound(
        server, start_sluice):
    """A server may run a deleted session's tasks on (the TypeScript SDK 1.x does). Before:
    the DELETE ended the hold and sent no ``tasks/cancel``; deleting and opening sessions
    escaped the tool's limit (a hostile review). Now each held task is sent its
    ``tasks/cancel`` before the DELETE goes on, and the call is held to its bound."""
    sluice = await start_sluice({"routes": [tasks_route(server.url,
                                                        timeouts={"total": "3s"})]})
    async with aiohttp.ClientSession() as http:
        client = Client(http, sluice.url)
        task_id = await client.create(1)
        async with http.delete(client.url, headers=HEADERS) as r:
            assert r.status < 300
        assert server.cancels == [task_id]
        assert server.methods[-2:] == ["tasks/cancel", "DELETE"]
        other = Client(http, sluice.url, **{"Mcp-Session-Id": "s-2"})
        assert await other.refused(2)
        event = await ended_as(sluice, task_id, "timeout")
        assert event["outcome"] == "upstream_timeout"
        assert server.cancels == [task_id]  # not sent twice
        await all_given_back(sluice)


async def test_the_drain_waits_for_a_held_task_then_cuts_it(server, start_sluice):
    """SIGTERM waits for the task as for a call in flight, up to ``drain_timeout``; then the
    call ends ``drain_cut`` and its server is sent ``tasks/cancel``. Before: the call had
    ended with its CreateTaskResult, and the drain waited for nothing."""
    sluice = await start_sluice({"server": {"drain_timeout": "1s"},
                                 "routes": [tasks_route(server.url)]})
    async with aiohttp.ClientSession() as http:
        task_id = await Client(http, sluice.url).create(1)
    sluice.signal(signal.SIGTERM)
    assert await sluice.wait_exit() == 0
    event = await ended_as(sluice, task_id, "drain_cut")
    assert event["outcome"] == "drain_cut"
    assert server.cancels == [task_id]


# -- through the TypeScript SDK 1.x client and server -------------------------------------------


async def test_typescript_sdk_tasks_run_one_at_a_time_under_limit_1(start_sluice, tmp_path):
    """The hostile trial's case: three staggered task calls of ``slow_task`` (3 s each) by
    the TypeScript SDK 1.x client against its server. Before: 3 ran at once at the server."""
    if shutil.which("node") is None or not (MCP_TS / "node_modules" / "@modelcontextprotocol"
                                            / "sdk").is_dir():
        pytest.skip("needs node and .mcp-ts (.ci/run installs them)")
    env = {**os.environ, "MCP_TS_DIR": str(MCP_TS)}
    port_file, stats_file = tmp_path / "port", tmp_path / "stats.json"
    upstream = subprocess.Popen(["node", str(TS_TASK_SERVER), str(port_file), str(stats_file)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_until(lambda: port_file.exists() and port_file.read_text() != "",
                         what="the TypeScript server's port")
        sluice = await start_sluice({"routes": [tasks_route(
            f"http://127.0.0.1:{port_file.read_text()}")]})
        proc = await asyncio.create_subprocess_exec(
            "node", str(TS_TASK_CLIENT), sluice.url + "/tools/mcp", "3",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        results = json.loads(stdout)
        stats = json.loads(stats_file.read_text())
        assert stats["maxRunning"] == 1, (stats, results)
        assert sum(r.endswith(",result") for r in results) == stats["runs"], results
        assert sum("all slots busy" in r for r in results) == 3 - stats["runs"], results
        await all_given_back(sluice)
    finally:
        upstream.terminate()
        upstream.wait(10)


async def test_a_tasks_result_error_ends_nothing(start_sluice):
    """Before: any answer to ``tasks/result`` but its own cancel ended the hold, errors
    included: a ``-32602`` (here a strict server's, for an unknown param) while the task ran
    on freed the slot, and a second task ran beside it under limit 1 (a hostile review)."""

    class Strict(TaskServer):
        async def _post(self, request: web.Request) -> web.Response:
            message = await request.json()
            params = message.get("params") or {}
            if message.get("method") == "tasks/result" and set(params) - {"taskId", "_meta"}:
                return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": {
                    "code": -32602, "message": "unknown params"}})
            return await super()._post(request)

    stub = await Strict().start()
    try:
        sluice = await start_sluice({"routes": [tasks_route(stub.url)]})
        async with aiohttp.ClientSession() as http:
            client = Client(http, sluice.url)
            task_id = await client.create(1)
            message = follow_up(2, "tasks/result", task_id)
            message["params"]["unknown"] = 1
            assert (await client.post(message))["error"]["code"] == -32602
            assert await client.refused(3)
            assert stub.max_running == 1
            stub.complete(task_id)
            await client.post(follow_up(4, "tasks/result", task_id))  # a result ends it
            await ended_as(sluice, task_id, "tasks/result")
            await all_given_back(sluice)
    finally:
        await stub.stop()


async def test_a_terminal_status_before_the_create_result_ends_the_hold(start_sluice):
    """A fast task's ``notifications/tasks/status`` (completed) passes on the session's GET
    stream before its ``CreateTaskResult`` is read. Before: it was lost, and the call held
    its slot to its bound (600 s)."""

    class Early(TaskServer):
        early = ""

        async def _post(self, request: web.Request) -> web.Response:
            message = await request.json()
            if message.get("method") == "tools/call":
                task = {"taskId": uuid.uuid4().hex, "status": "completed", "ttl": 60_000,
                        "createdAt": "2026-12-01T00:00:00Z",
                        "lastUpdatedAt": "2026-12-01T00:00:00Z"}
                self.stream.put_nowait({"jsonrpc": "2.0", "params": task,
                                        "method": "notifications/tasks/status"})
                self.early = task["taskId"]
                await asyncio.sleep(0.2)  # the notification is through Sluice by then
                return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {
                    "task": {**task, "status": "working"}}})
            return await super()._post(request)

    stub = await Early().start()
    try:
        sluice = await start_sluice({"routes": [tasks_route(stub.url)]})
        async with aiohttp.ClientSession() as http:
            client = Client(http, sluice.url)
            stream = await http.get(client.url, headers={**HEADERS,
                                                         "Accept": "text/event-stream"})
            task_id = await client.create(1)
            assert task_id == stub.early
            event = await ended_as(sluice, task_id, "notification")
            assert event["task_status"] == "completed"
            stream.close()
            await all_given_back(sluice)
    finally:
        await stub.stop()


async def test_a_tenants_share_of_held_tasks_is_bounded_and_tools_without_slots_hold_none(
        server, start_sluice):
    """Before: 4,096 tasks held at once in all, shared: one tenant's tasks filled the table
    and then every tenant's task calls went unheld, their limits escaped (a hostile review).
    Now a tool without a slot holds no task, and a tenant has 512 of the 4,096: its next
    task call of a tool with a slot is refused 429 ``tenant_concurrency``, and another
    tenant's limit still holds."""
    route = tasks_route(server.url)
    route["tools"]["free_task"] = {}  # no slot: its tasks are not held
    route["tools"]["wide_task"] = {"concurrency": {"limit": 1000, "queue": 0}}
    sluice = await start_sluice({"routes": [route]})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as http:
        noisy = Client(http, sluice.url, **{"X-Tenant-ID": "noisy", "Mcp-Session-Id": "n"})

        async def one(rpc_id: int, tool: str) -> dict:
            message = task_call(rpc_id)
            message["params"]["name"] = tool
            return await noisy.post(message)

        free = await asyncio.gather(*(one(i, "free_task") for i in range(20)))
        assert all("task" in answer["result"] for answer in free)
        assert await sluice.metric("sluice_held_task_calls") == 0
        wide = await asyncio.gather(*(one(100 + i, "wide_task") for i in range(512)))
        assert all("task" in answer["result"] for answer in wide)
        assert await sluice.metric("sluice_held_task_calls") == 512
        refused = await one(9999, "wide_task")
        assert refused["error"]["data"]["reason"] == "tenant_concurrency", refused
        quiet = Client(http, sluice.url, **{"X-Tenant-ID": "quiet", "Mcp-Session-Id": "q"})
        first = await quiet.create(1)
        assert await quiet.refused(2)
        for task_id in [first, *(a["result"]["task"]["taskId"] for a in wide)]:
            server.complete(task_id)
        for n, answer in enumerate(wide):  # the owner's polls end the holds
            await noisy.post(follow_up(20_000 + n, "tasks/get",
                                       answer["result"]["task"]["taskId"]))
        await quiet.post(follow_up(3, "tasks/get", first))
        await all_given_back(sluice)


def test_the_status_watch_parses_only_task_status_events_and_skips_large_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's GET stream is read for task ends. Before: every event was parsed as JSON
    (8x the CPU on 100k small notifications) and a large event was held whole."""
    from policies import mcp

    parsed: list[bytes] = []
    loads = mcp._loads_or_none
    monkeypatch.setattr(mcp, "_loads_or_none", lambda data: parsed.append(data) or loads(data))
    ended: list[tuple[str, str]] = []
    watch = mcp.TaskStatusWatch(lambda *args: ended.append(args))

    def event(doc: dict, end: bytes = b"\n") -> bytes:
        return b"event: message" + end + b"data: " + json.dumps(doc).encode() + end + end

    progress = event({"jsonrpc": "2.0", "method": "notifications/progress",
                      "params": {"progressToken": "t", "progress": 1}})
    status = event({"jsonrpc": "2.0", "method": "notifications/tasks/status",
                    "params": {"taskId": "a", "status": "completed"}}, b"\r\n")
    big = event({"jsonrpc": "2.0", "method": "notifications/message",
                 "params": {"data": "x" * 1_000_000}})
    stream = progress * 100 + status + big + progress + event(
        {"jsonrpc": "2.0", "method": "notifications/tasks/status",
         "params": {"taskId": "b", "status": "working"}}) + event(
        {"jsonrpc": "2.0", "method": "notifications/tasks/status",
         "params": {"taskId": "c", "status": "failed"}})
    largest = 0
    for at in range(0, len(stream), 1000):  # chunks that split events and line ends
        watch.feed(stream[at:at + 1000])
        largest = max(largest, len(watch._pending))
    assert ended == [("a", "completed"), ("c", "failed")]
    assert len(parsed) == 3  # the three status events only
    assert largest <= mcp.MAX_TASK_STATUS_EVENT_BYTES + 1000


# -- a TypeScript SDK 1.x server through raw sessions -------------------------------------------


def _ts_messages(text: str, content_type: str) -> list[dict]:
    if "text/event-stream" in content_type:
        return [json.loads(line[5:]) for line in text.splitlines()
                if line.startswith("data:") and line[5:].strip()]
    return [json.loads(text)] if text.strip() else []


class TsSession:
    """A raw 2025-11-25 session with the TypeScript task server (``task_server.mjs``)."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url + "/tools/mcp"
        self.headers = {"Accept": "application/json, text/event-stream",
                        "Content-Type": "application/json",
                        "MCP-Protocol-Version": "2025-11-25"}

    async def post(self, message: dict) -> list[dict]:
        async with self.http.post(self.url, data=json.dumps(message),
                                  headers=self.headers) as r:
            if (session := r.headers.get("Mcp-Session-Id")) is not None:
                self.headers["Mcp-Session-Id"] = session
            return _ts_messages(await r.text(), r.headers.get("Content-Type", ""))

    async def open(self) -> Self:
        await self.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {"tasks": {}},
            "clientInfo": {"name": "test", "version": "0"}}})
        await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return self

    async def call(self, message: dict) -> dict:
        [answer] = [m for m in await self.post(message) if m.get("id") == message["id"]]
        return answer

    async def create(self, rpc_id: int, ttl: int = 60_000) -> dict:
        return await self.call({
            "jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
            "params": {"name": "slow_task", "arguments": {"seconds": 4}, "task": {"ttl": ttl}}})


@pytest.fixture
async def ts_server(tmp_path: Any) -> Any:
    if shutil.which("node") is None or not (MCP_TS / "node_modules" / "@modelcontextprotocol"
                                            / "sdk").is_dir():
        pytest.skip("needs node and .mcp-ts (.ci/run installs them)")
    port_file, stats_file = tmp_path / "port", tmp_path / "stats.json"
    proc = subprocess.Popen(["node", str(TS_TASK_SERVER), str(port_file), str(stats_file)],
                            env={**os.environ, "MCP_TS_DIR": str(MCP_TS)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_until(lambda: port_file.exists() and port_file.read_text() != "",
                         what="the TypeScript server's port")
        yield f"http://127.0.0.1:{port_file.read_text()}", stats_file
    finally:
        proc.terminate()
        proc.wait(10)


async def test_typescript_server_a_sessions_delete_does_not_free_the_slot(ts_server,
                                                                         start_sluice):
    """The TypeScript SDK 1.x server runs a deleted session's tasks on. Before: the DELETE
    ended the hold, and a new session's task ran beside the first under limit 1."""
    url, stats_file = ts_server
    sluice = await start_sluice({"routes": [tasks_route(url)]})
    async with aiohttp.ClientSession() as http:
        first = await TsSession(http, sluice.url).open()
        assert "task" in (await first.create(1))["result"]
        async with http.delete(first.url, headers=first.headers) as r:
            assert r.status < 300
        second = await TsSession(http, sluice.url).open()
        answer = await second.create(1)
        assert answer["error"]["data"]["reason"] == "queue_full", answer
    assert json.loads(stats_file.read_text())["maxRunning"] == 1


async def test_typescript_server_a_tiny_ttl_does_not_free_the_slot(ts_server, start_sluice):
    """The TypeScript SDK 1.x server echoes the ttl its client asks for. Before: ``ttl: 1``
    ended the hold at once, and a second task ran beside the first under limit 1."""
    url, stats_file = ts_server
    sluice = await start_sluice({"routes": [tasks_route(url)]})
    async with aiohttp.ClientSession() as http:
        session = await TsSession(http, sluice.url).open()
        task = (await session.create(1, ttl=1))["result"]["task"]
        # A poll's round trip: the first call's POST is over. Its answer is an error (the
        # server kept the task 1 ms, its ttl), which ends nothing.
        polled = await session.call(follow_up(2, "tasks/get", task["taskId"]))
        assert polled.get("result", {}).get("status") not in TERMINAL, polled
        answer = await session.create(3)
        assert answer["error"]["data"]["reason"] == "queue_full", answer
    assert json.loads(stats_file.read_text())["maxRunning"] == 1
