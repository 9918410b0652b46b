"""Large MCP bodies (policies/bodies.py ``LargeBodies``): each parsed once, and their parses
and fingerprints take turns, with the loop serving other calls between them.

No wall-clock asserts: the structure is checked by counting the loop's passes (a task that
counts one each time it runs) at each parse and fingerprint of a large body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from policies import bodies, idempotency, mcp
from policies.bodies import LARGE_BODY_BYTES, LargeBodies
from tests.conftest import free_ports, open_runtime, route, serve_app, serve_runtime
from tests.fakeupstream import FakeUpstream

#: Large calls sent at once, each a little over LARGE_BODY_BYTES.
LARGE_CALLS = 4
_RPC_ID = re.compile(rb'"id":\s*(\d+)')


async def _mcp_server(request: web.Request) -> web.Response:
    message = json.loads(await request.read())
    return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {
        "content": [{"type": "text", "text": "ok"}], "isError": False}})


@contextlib.asynccontextmanager
async def _passes() -> AsyncIterator[list[int]]:
    """A count of the loop's passes so far (``[n]``), kept by a task that runs once a pass."""
    count = [0]

    async def tick() -> None:
        while True:
            count[0] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(tick())
    try:
        yield count
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_large_mcp_calls_are_parsed_once_and_take_turns_with_the_loop_between(
        upstream: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/{tail:.*}", _mcp_server)
    mcp_runner, mcp_port = await serve_app(app)
    runtime = await open_runtime(
        route("tools", f"http://127.0.0.1:{mcp_port}", "mcp",
              idempotency={"mode": "dedup"}),
        route("chat", upstream.url),
        events={"path": str(tmp_path / "events.jsonl")},
        dead_letter={"path": str(tmp_path / "dlq.sqlite")})
    runner, port = await serve_runtime(runtime)
    steps: list[tuple[str, int, int]] = []  # (parse | fingerprint, rpc id, loop pass)
    async with _passes() as passes:
        loads, fingerprint = bodies.loads, mcp.fingerprint

        def counted_loads(body: Any, *args: Any) -> Any:
            if len(body) >= LARGE_BODY_BYTES:
                found = _RPC_ID.search(body[:100])
                assert found is not None
                steps.append(("parse", int(found[1]), passes[0]))
            return loads(body, *args)

        def counted_fingerprint(message: mcp.Message, *args: Any) -> str:
            if len(args[2] or b"") >= LARGE_BODY_BYTES:
                steps.append(("fingerprint", int(message.id), passes[0]))  # type: ignore[arg-type]
            return fingerprint(message, *args)

        monkeypatch.setattr(bodies, "loads", counted_loads)
        monkeypatch.setattr(mcp, "fingerprint", counted_fingerprint)
        small: list[tuple[int, int]] = []  # (status, loop pass) of the calls on the other route
        try:
            async with aiohttp.ClientSession() as session:

                async def large(i: int) -> int:
                    call = {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
                        "name": "add", "arguments": {"a": [{"a": i}] * 170_000}}}
                    body = json.dumps(call).encode()
                    assert len(body) > LARGE_BODY_BYTES
                    async with session.post(
                            f"http://127.0.0.1:{port}/tools/mcp", data=body,
                            headers={"Content-Type": "application/json",
                                     "Accept": "application/json, text/event-stream"}) as r:
                        answer = await r.json()
                        assert answer["result"]["isError"] is False
                        return r.status

                async def chat(done: asyncio.Event) -> None:
                    while not done.is_set():
                        async with session.post(
                                f"http://127.0.0.1:{port}/chat/v1/chat/completions",
                                json={"model": "m", "messages": [
                                    {"role": "user", "content": "hi"}]}) as r:
                            await r.read()
                            small.append((r.status, passes[0]))

                done = asyncio.Event()
                chatting = asyncio.create_task(chat(done))
                statuses = await asyncio.gather(*(large(i) for i in range(1, LARGE_CALLS + 1)))
                done.set()
                await chatting
        finally:
            await runner.cleanup()
            await runtime.close()
            await mcp_runner.cleanup()
    assert statuses == [200] * LARGE_CALLS
    # Each body parsed once (the idempotency step uses the request path's parse), and
    # fingerprinted once.
    parses = sorted(i for kind, i, _ in steps if kind == "parse")
    assert parses == list(range(1, LARGE_CALLS + 1))
    assert sorted(i for kind, i, _ in steps if kind == "fingerprint") == parses
    # One step at a time, each in a loop pass of its own, and a body's fingerprint right after
    # its parse: one parsed tree alive at a time.
    at = [when for _, _, when in steps]
    assert at == sorted(set(at))
    kinds = [(kind, i) for kind, i, _ in steps]
    assert kinds == [pair for i in parses for pair in (("parse", i), ("fingerprint", i))]
    # The other route's calls went on between the steps (none failed), in rests.
    assert runtime.large_bodies.rests > 0
    assert small and all(status == 200 for status, _ in small)
    assert any(at[0] < when < at[-1] for _, when in small)


async def test_a_turn_rests_only_when_another_is_waiting() -> None:
    turns = LargeBodies()
    # A lone body: its parse's turn, then its fingerprint's, each handed on after one pass.
    async with turns.turn():
        pass
    async with turns.turn(holding=True):
        pass
    assert turns.rests == 0
    # One waiting (and one that left while waiting): the turn ending is rested for, once.
    release = asyncio.Event()

    async def hold() -> None:
        async with turns.turn():
            await release.wait()

    async def work() -> None:
        async with turns.turn():
            pass

    first = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiting, gone = asyncio.create_task(work()), asyncio.create_task(work())
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    async with asyncio.timeout(5):
        await asyncio.gather(first, waiting)
    assert turns.rests == 1
    # Only a waiter that left: no rest.
    first = asyncio.create_task(hold())
    release.clear()
    await asyncio.sleep(0)
    gone = asyncio.create_task(work())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    release.set()
    await first
    assert turns.rests == 1


async def test_a_lone_large_mcp_call_does_not_rest(tmp_path: Path) -> None:
    # On an MCP route without idempotency, a lone 14 MB call waited out a rest (+0.2-0.3 s)
    # with nothing else to serve.
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/{tail:.*}", _mcp_server)
    mcp_runner, mcp_port = await serve_app(app)
    runtime = await open_runtime(
        route("tools", f"http://127.0.0.1:{mcp_port}", "mcp"),
        events={"path": str(tmp_path / "events.jsonl")},
        dead_letter={"path": str(tmp_path / "dlq.sqlite")})
    runner, port = await serve_runtime(runtime)
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "add", "arguments": {"a": [{"a": 1}] * 170_000}}}
    body = json.dumps(call).encode()
    assert len(body) > LARGE_BODY_BYTES
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{port}/tools/mcp", data=body,
                headers={"Content-Type": "application/json",
                         "Accept": "application/json, text/event-stream"}) as r:
            assert r.status == 200
            assert (await r.json())["result"]["isError"] is False
        assert runtime.large_bodies.rests == 0
    finally:
        await runner.cleanup()
        await runtime.close()
        await mcp_runner.cleanup()


async def test_a_turn_freeing_a_tree_goes_first_and_a_cancelled_waiter_is_skipped() -> None:
    turns = LargeBodies()
    order: list[str] = []
    release = asyncio.Event()

    async def work(name: str, holding: bool = False) -> None:
        async with turns.turn(holding=holding):
            order.append(name)
            if name == "first":
                await release.wait()

    first = asyncio.create_task(work("first"))
    await asyncio.sleep(0)
    new = asyncio.create_task(work("new"))
    gone = asyncio.create_task(work("gone", holding=True))
    holder = asyncio.create_task(work("holder", holding=True))
    await asyncio.sleep(0)
    gone.cancel()  # a caller that left while waiting
    release.set()
    await asyncio.gather(first, new, holder)
    assert gone.cancelled()
    assert order == ["first", "holder", "new"]
    # Nothing is left waiting, and the next turn is taken at once.
    async with asyncio.timeout(5):
        async with turns.turn():
            order.append("later")
    assert order[-1] == "later"


async def test_a_turn_handed_to_a_caller_that_left_is_handed_on() -> None:
    turns = LargeBodies()
    release = asyncio.Event()
    order: list[str] = []

    async def hold() -> None:
        async with turns.turn():
            await release.wait()

    async def work(name: str) -> None:
        async with turns.turn():
            order.append(name)

    first = asyncio.create_task(hold())
    await asyncio.sleep(0)
    handed = asyncio.create_task(work("handed"))
    after = asyncio.create_task(work("after"))
    await asyncio.sleep(0)
    release.set()
    await first
    # Handed the turn (its future resolved, "after" still waiting) and cancelled before it ran.
    async with asyncio.timeout(5):
        while len(turns._new) == 2:
            await asyncio.sleep(0)
    handed.cancel()
    async with asyncio.timeout(5):
        await after
    assert order == ["after"]


def count_large_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of each large body ``bodies.loads`` parses from now on, in order."""
    parsed: list[int] = []
    loads = bodies.loads

    def counted_loads(body: Any, *args: Any) -> Any:
        if len(body) >= LARGE_BODY_BYTES:
            parsed.append(len(body))
        return loads(body, *args)

    monkeypatch.setattr(bodies, "loads", counted_loads)
    return parsed


async def test_a_large_call_refused_or_failed_is_not_parsed_again_for_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its error answer carries the request's id, read when the request was parsed: each
    # error to a 25 MB tools/call parsed the body once more, on the loop.
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/{tail:.*}", _mcp_server)
    mcp_runner, mcp_port = await serve_app(app)
    dead_port = free_ports(1)[0]  # nothing listens there
    runtime = await open_runtime(
        route("limited", f"http://127.0.0.1:{mcp_port}", "mcp",
              rate={"requests": "1/h"}),
        route("dead", f"http://127.0.0.1:{dead_port}", "mcp"),
        events={"path": str(tmp_path / "events.jsonl")},
        dead_letter={"path": str(tmp_path / "dlq.sqlite")})
    runner, port = await serve_runtime(runtime)
    parsed = count_large_parses(monkeypatch)
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for i, path in enumerate(("limited", "limited", "dead"), start=1):
                body = json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                                   "params": {"name": "add",
                                              "arguments": {"a": [{"a": i}] * 170_000}}})
                async with session.post(
                        f"http://127.0.0.1:{port}/{path}/mcp", data=body,
                        headers={"Content-Type": "application/json",
                                 "Accept": "application/json, text/event-stream"}) as r:
                    answer = await r.json()
                    answers.append((answer["id"], r.headers.get("X-Sluice-Reason")))
    finally:
        await runner.cleanup()
        await runtime.close()
        await mcp_runner.cleanup()
    assert answers == [(1, None), (2, "rate_limited"), (3, "upstream_unreachable")]
    assert len(parsed) == 3  # once each


async def test_a_large_invalid_body_or_notification_is_not_parsed_again_for_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A refusal took the body with no id when the request path found it invalid, or found
    # it held no id (a notification), and parsed it again, on the loop, outside its turn.
    dead_port = free_ports(1)[0]  # nothing listens there
    runtime = await open_runtime(
        route("dead", f"http://127.0.0.1:{dead_port}", "mcp"),
        events={"path": str(tmp_path / "events.jsonl")},
        dead_letter={"path": str(tmp_path / "dlq.sqlite")})
    runner, port = await serve_runtime(runtime)
    parsed = count_large_parses(monkeypatch)
    arguments = {"a": [{"a": 1}] * 170_000}
    messages = [  # a tools/call whose params.name is no string: 400, with its id
        {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
         "params": {"name": 5, "arguments": arguments}},
        # a notification the upstream never gets: 502, with no id
        {"jsonrpc": "2.0", "method": "notifications/message", "params": arguments}]
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for message in messages:
                async with session.post(
                        f"http://127.0.0.1:{port}/dead/mcp", data=json.dumps(message),
                        headers={"Content-Type": "application/json",
                                 "Accept": "application/json, text/event-stream"}) as r:
                    answer = await r.json()
                    answers.append((r.status, answer["id"], r.headers.get("X-Sluice-Reason")))
    finally:
        await runner.cleanup()
        await runtime.close()
    assert answers == [(400, 7, "bad_request"), (502, None, "upstream_unreachable")]
    assert len(parsed) == 2  # once each


#: Bodies whose idempotency fingerprints (and the keys answers are stored under) must not
#: change with how a body is parsed: key order, non-ASCII text, floats, integers past 64
#: bits, ``_meta`` and ``requestState``, and two of 1 MiB or more that take turns. Each:
#: the message, ``ensure_ascii``, its ``MCP-Protocol-Version``.
_FIXED_BODIES: list[tuple[dict[str, Any], bool, str | None]] = [
    ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "add", "arguments": {"b": 1, "a": [1.5, 1e23, 0.1, True, None]}}}, True, None),
    ({"params": {"arguments": {"s": "\u00e9\u2028\U0001f600", "n": {"z": [], "a": {}}},
                 "name": "\u00e9", "_meta": {"progressToken": 7}},
      "method": "tools/call", "id": "s2", "jsonrpc": "2.0"}, False, "2025-06-18"),
    ({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "add", "arguments": {"big": 12345678901234567890, "huge": 2**70, "neg": -7}}},
     True, "2025-11-25"),
    ({"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {
        "name": "search", "arguments": {"q": ""}, "requestState": "opaque-state"}}, True, None),
    ({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
        "name": "add", "arguments": {"blob": [{"a": 5, "b": "\u00e9\u00e9\u00e9"}] * 90_000}}},
     False, None),
    ({"jsonrpc": "2.0", "id": 6, "method": "tools/call", "params": {
        "name": "add", "arguments": {"big": 12345678901234567890,
                                     "blob": [{"a": 1.5}] * 120_000}}}, True, "2025-03-26"),
]
#: Their fingerprints and stored keys, by JSON-RPC id, as main computed them before large
#: bodies were parsed once (dd2c477): a change here orphans every stored answer.
_FIXED_FINGERPRINTS = {
    "1": ("6e15821d9075dec43e66f7372828eacbc9e8857ec986a38a40fe3f3a6128e488",
          "sluice-t-0a15a19bc069d42764ba3fc80feac7d7"),
    "s2": ("15ffaf46925c83f2df8585d030afb4386f5ddfc145a25a41c556c4dc53f3a308",
          "sluice-t-1d9834fadacb81d3b69798ade7ca51de"),
    "3": ("d99fcdceb6c7165353e6ecb3c2ec1153c90812758f196a5378f8142ba2a75052",
          "sluice-t-c3a4521291e2231333c39517d55f475a"),
    "4": ("01402e3499eca31b9e8b861881dfeedd8b5645f5f6821865a89582a6db96f9fe",
          "sluice-t-0615e3bd4d58c0b554dcdc1200f6da0a"),
    "5": ("89542f4957435907336603690b5b96eafa197a563e3f20ad94156f3637d48c4a",
          "sluice-t-557bae471379f90748b1a74944c7d752"),
    "6": ("00ed18f8bd8187dd065fb4c59c69b25efd88ad019de1ffe677029c53635f48b2",
          "sluice-t-4495c8a5c9c4e6b131ba0e8aafa790ae"),
}


async def test_fingerprints_and_stored_keys_stay_as_they_were(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, tuple[str, str]] = {}
    claim = idempotency.Idempotency.claim

    async def recorded(self: idempotency.Idempotency, *args: Any, **kwargs: Any
                       ) -> idempotency.Claim:
        claimed = await claim(self, *args, **kwargs)
        assert kwargs["call_key"] == kwargs["fingerprint"]
        seen[str(kwargs["mcp_id"])] = (kwargs["fingerprint"].hex(), claimed.key)
        return claimed

    monkeypatch.setattr(idempotency.Idempotency, "claim", recorded)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/{tail:.*}", _mcp_server)
    mcp_runner, mcp_port = await serve_app(app)
    runtime = await open_runtime(
        route("tools", f"http://127.0.0.1:{mcp_port}", "mcp", idempotency={"mode": "dedup"}),
        events={"path": str(tmp_path / "events.jsonl")},
        dead_letter={"path": str(tmp_path / "dlq.sqlite")})
    runner, port = await serve_runtime(runtime)
    try:
        async with aiohttp.ClientSession() as session:
            for message, ascii_only, version in _FIXED_BODIES:
                headers = {"Content-Type": "application/json",
                           "Accept": "application/json, text/event-stream"}
                if version is not None:
                    headers["MCP-Protocol-Version"] = version
                async with session.post(
                        f"http://127.0.0.1:{port}/tools/mcp", headers=headers,
                        data=json.dumps(message, ensure_ascii=ascii_only).encode()) as r:
                    assert r.status == 200
    finally:
        await runner.cleanup()
        await runtime.close()
        await mcp_runner.cleanup()
    assert seen == _FIXED_FINGERPRINTS
