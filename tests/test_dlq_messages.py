"""What ``sluice dlq replay`` says, and how it counts an answer: no secret in its messages (an
upstream URL's password, a malformed ``--header``'s value), why a send failed, and an MCP
answer whose tool (or JSON-RPC) failed counted as failed. Each was found by a new user's
trial. The real CLI in a subprocess, on a letter written to a dead-letter file, sent to a
test's own upstream (or a closed port)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from policies.deadletter import DeadLetter, DeadLetterFile
from tests.conftest import free_port, route, serve_app
from tests.mcp_servers import tool_call
from tests.test_dlq_replay import cli, outcome

PASSWORD = "UpPass123"


@contextlib.asynccontextmanager
async def stalled_upstream() -> AsyncIterator[str]:
    """The URL of an upstream whose ``POST /mcp`` answers nothing until the block ends (30 s
    at most)."""
    released = asyncio.Event()

    async def stall(request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(released.wait(), 30)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/mcp", stall)
    runner, port = await serve_app(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        released.set()  # the runner's cleanup waits for its handlers
        await runner.cleanup()


def letter_file(tmp_path: Path, upstream: str, protocol: str = "http", path: str = "/mcp",
                body: bytes = b"{}", **policies: object) -> tuple[str, str]:
    """A config with one route ``tools`` to ``upstream`` and a dead-letter file holding one
    letter of it (``POST path`` with ``body``): the config's path and the letter's id."""
    letters = str(tmp_path / "dlq.sqlite")
    config = tmp_path / "sluice.yaml"
    config.write_text(json.dumps({"dead_letter": {"path": letters},
                                  "routes": [route("tools", upstream, protocol, **policies)]}))
    file = DeadLetterFile(letters)
    try:
        added = file.add(DeadLetter(
            route="tools", tenant="acme", run=None, idempotency_key=None, request_id="q",
            method="POST", path=path,
            headers=[("Content-Type", "application/json"),
                     ("Accept", "application/json, text/event-stream")],
            redacted=[], body=body, body_size=len(body), attempts=[],
            reason="attempts_exhausted"))
    finally:
        file.close()
    return str(config), str(added.id)


async def test_a_replay_never_prints_the_upstreams_password(tmp_path):
    """The upstream's URL was printed as configured, user info and all: a failed replay said
    ``replayed dead letter 1 to http://bob:UpPass123@...``. It is redacted as the admin
    views redact it, and the failure says why (connection refused), not only its class."""
    closed = free_port()
    config, letter = letter_file(tmp_path, f"http://bob:{PASSWORD}@127.0.0.1:{closed}/base")
    code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    assert code == 1, (out, err)
    assert PASSWORD not in out + err
    assert f"to http://bob:<redacted>@127.0.0.1:{closed}/base/mcp: failed: " in out, out
    assert "connection refused" in out, out


async def test_a_replay_cut_by_its_timeout_says_which_timeout(tmp_path):
    """``failed: TimeoutError in 0.503s`` did not say which timeout ended it."""
    async with stalled_upstream() as upstream:
        config, letter = letter_file(tmp_path, upstream, timeouts={"total": "300ms"})
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    assert code == 1, (out, err)
    assert "failed: TimeoutError (no whole answer within timeouts.total, 0.3s)" in out, out


async def test_a_malformed_header_is_refused_without_quoting_its_value(tmp_path):
    """``-H 'Authorization Bearer sk-...'`` (no colon) was refused quoting the whole
    argument, the secret with it."""
    config, letter = letter_file(tmp_path, f"http://127.0.0.1:{free_port()}")
    code, _, err = await outcome(await cli(
        "dlq", "replay", letter, "--config", config, "-H", "X-Note: fine",
        "-H", "Authorization Bearer sk-leak123"))
    assert code == 1 and "sk-leak123" not in err and "Bearer" not in err, err
    assert "--header #2 is not 'NAME: VALUE'" in err, err


def _answer(kind: str) -> dict[str, object]:
    if kind == "jsonrpc_error":
        return {"jsonrpc": "2.0", "id": 7, "error": {"code": -32603, "message": "boom"}}
    return {"jsonrpc": "2.0", "id": 7, "result": {
        "content": [{"type": "text", "text": "done"}], "isError": kind == "tool_failed"}}


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("kind", "said"), [
    ("tool_failed", "but the tool failed (its result has isError: true)"),
    ("jsonrpc_error", "but the call failed (JSON-RPC error -32603)"),
    ("ok", None),
])
async def test_an_mcp_replay_whose_tool_failed_is_a_failed_replay(tmp_path, sse, kind, said):
    """An MCP server answers a failed call with HTTP 200: a JSON-RPC error, or a tool result
    with ``isError: true``. The replay was reported a success (exit 0) and recorded as
    answered, so the next replay was refused without ``--again``. Its answer is read as the
    live path reads it for tool breakers; a failure exits 1, says so, and leaves the letter
    replayable. An answer whose call succeeded is still a success, JSON or SSE."""
    sent: list[bytes] = []

    async def serve(request: web.Request) -> web.Response:
        sent.append(await request.read())
        doc = orjson.dumps(_answer(kind))
        if sse:
            return web.Response(body=b"event: message\ndata: " + doc + b"\n\n",
                                content_type="text/event-stream")
        return web.Response(body=doc, content_type="application/json")

    app = web.Application()
    app.router.add_post("/mcp", serve)
    runner, port = await serve_app(app)
    try:
        config, letter = letter_file(tmp_path, f"http://127.0.0.1:{port}", "mcp",
                                     body=orjson.dumps(tool_call(7, "send", to="ops")))
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
        if said is None:
            assert code == 0 and "HTTP 200" in out and "but" not in out, (out, err)
            code, _, err = await outcome(await cli("dlq", "replay", letter, "--config",
                                                   config))
            assert code == 1 and "already replayed" in err, err
            assert len(sent) == 1
            return
        assert code == 1 and "HTTP 200" in out and said in out, (out, err)
        # Not answered: the next replay is sent without --again.
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
        assert code == 1 and said in out, (out, err)
        assert len(sent) == 2
        _, out, _ = await outcome(await cli("dlq", "show", letter, "--config", config))
        assert [(r["status"], r["error"]) for r in json.loads(out)["replays"]] == [
            (200, kind), (200, kind)]
        _, out, _ = await outcome(await cli("dlq", "list", "--config", config))
        assert f" {kind} " in out, out
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("policies", "said"), [
    ({"retry": {"per_try_timeout": "300ms"}}, "retry.per_try_timeout, 0.3s"),
    ({"retry": {"deadline": "300ms"}}, "retry.deadline, 0.3s"),
    # The endpoint's own retry replaces the route's, as for its live calls.
    ({"retry": {"per_try_timeout": "60s"},
      "endpoints": {"POST /mcp": {"retry": {"per_try_timeout": "300ms"}}}},
     "retry.per_try_timeout, 0.3s"),
], ids=["per_try_timeout", "deadline", "endpoints-own"])
async def test_a_replay_to_a_stuck_upstream_is_cut_as_its_attempts_were(tmp_path, policies,
                                                                       said):
    """A replay was bounded by ``timeouts`` alone (600 s by default): the route's
    ``retry.per_try_timeout`` (or ``deadline``), which cut each of the call's attempts,
    did not apply, so a replay to a stuck upstream held the operator's terminal for ten
    minutes. Its one attempt now has the bound an attempt of the call had to its headers."""
    async with stalled_upstream() as upstream:
        config, letter = letter_file(tmp_path, upstream, **policies)
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
        _, shown, _ = await outcome(await cli("dlq", "show", letter, "--config", config))
    assert code == 1, (out, err)
    assert f"failed: TimeoutError (no response headers within {said})" in out, out
    assert [r["error"] for r in json.loads(shown)["replays"]] == ["TimeoutError"]


async def test_a_replays_answer_body_may_take_longer_than_the_per_try_timeout(tmp_path):
    """As for a live attempt, ``per_try_timeout`` bounds the wait for the response headers;
    the body then has ``timeouts.total``."""

    async def slow_body(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'{"part": ')
        await asyncio.sleep(0.6)
        await response.write(b'"two"}')
        return response

    app = web.Application()
    app.router.add_post("/mcp", slow_body)
    runner, port = await serve_app(app)
    try:
        config, letter = letter_file(tmp_path, f"http://127.0.0.1:{port}",
                                     retry={"per_try_timeout": "300ms"})
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    finally:
        await runner.cleanup()
    assert code == 0 and "HTTP 200, 15 bytes" in out, (out, err)


INJECTED = ("/job?q=%1b%5d0%3bPWNED%07%1b%5b2K%0d%0a"
            "replayed%20dead%20letter%201:%20HTTP%20500")


async def test_a_replay_prints_the_query_percent_encoded_as_it_was_sent(tmp_path):
    """A live call's ``?q=%1b...%0d%0a...`` is kept encoded in its letter, but the replay's
    line printed the URL with its query decoded (``redact_url``): a raw ESC retitled the
    operator's terminal and a CR LF forged a line of its own (a hostile trial)."""
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/job", ok)
    runner, port = await serve_app(app)
    try:
        config, letter = letter_file(tmp_path, f"http://127.0.0.1:{port}", path=INJECTED)
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    finally:
        await runner.cleanup()
    assert code == 0, (out, err)
    assert "\x1b" not in out + err and "\x07" not in out and "\r" not in out
    assert out.count("\n") == 1, out
    assert "/job?q=%1B%5D0;PWNED%07%1B%5B2K%0D%0Areplayed%20dead" in out, out


def add_letter(letters: str, path: str, headers: list[tuple[str, str]]) -> str:
    """Write one letter of route ``tools`` (``POST path`` with ``headers``) to the
    dead-letter file ``letters``; its id."""
    file = DeadLetterFile(letters)
    try:
        return str(file.add(DeadLetter(
            route="tools", tenant="acme\u202e", run=None, idempotency_key=None,
            request_id="q", method="POST", path=path, headers=headers, redacted=[],
            body=b"{}", body_size=2, attempts=[], reason="attempts_exhausted")).id)
    finally:
        file.close()


CONTROLS = "\x1b]0;PWNED\x07\x1b[2J\x7f\u009b2J\u2028\u202e\u2066"
#: The characters of ``CONTROLS`` that drive a terminal.
RAW = "\x1b\x07\x7f\u009b\u2028\u202e\u2066"


async def test_list_and_show_write_no_control_character_raw(tmp_path):
    """``dlq show`` printed a header value's C1 CSI (U+009B), U+2028 and bidi overrides raw
    (orjson escapes only C0), and ``dlq list`` a stored path's ESC sequences, which drove
    the operator's terminal (a hostile trial). ``show`` stays the same JSON."""
    letters = str(tmp_path / "dlq.sqlite")
    letter = add_letter(letters, "/b" + CONTROLS, [("X-Note", CONTROLS)])
    code, out, err = await outcome(await cli("dlq", "show", letter, "--file", letters))
    assert code == 0, err
    assert not any(ch in out for ch in RAW), ascii(out)
    shown = json.loads(out)
    assert shown["headers"] == [["X-Note", CONTROLS]] and shown["path"] == "/b" + CONTROLS
    code, out, err = await outcome(await cli("dlq", "list", "--file", letters))
    assert code == 0, err
    assert not any(ch in out for ch in RAW), ascii(out)
    assert "/b\\x1b]0;PWNED\\x07" in out and "acme\\u202e" in out, out
    assert len(out.splitlines()) == 2, out
