"""A security trial's findings: each test failed on the code it was written against."""

from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict

from policies.deadletter import DeadLetter
from proxy import dlq
from proxy.config import parse_config
from proxy.forward import SLUICE_ANSWER_HEADERS
from tests.conftest import open_runtime, raw_request, route, serve_app, serve_runtime

REPO = Path(__file__).resolve().parent.parent
#: Budgets' clock: today 12:00 UTC, so no daily window rolls over mid-test.
NOON = {"SLUICE_TEST_NOW": str(int(time.time()) // 86400 * 86400 + 43200)}


# -- 1. metering read the path case-sensitively and with its ;parameters --

@pytest.mark.parametrize(("protocol", "target", "reason"), [
    ("openai", "/openai/V1/Chat/Completions", "exceeds_limit"),
    ("openai", "/openai/v1/Chat/Completions", "exceeds_limit"),
    ("openai", "/openai/v1/chat/completions;jsessionid=1", "bad_request"),
    ("anthropic", "/anthropic/v1/Messages", "exceeds_limit"),
    ("anthropic", "/anthropic/v1/messages;jsessionid=1", "bad_request"),
])
async def test_a_path_spelled_as_case_folding_or_param_dropping_upstreams_route_is_metered(
        upstream, start_sluice, protocol, target, reason) -> None:
    """Express and ASP.NET Core route ``/v1/Chat/Completions``, Tomcat and Spring
    ``/v1/chat/completions;jsessionid=1``, as the chat endpoint, and ``endpoints:`` patterns
    read them so (policies.paths), but metering compared the path as sent: a 5,000-token
    call passed a 1,000-token daily budget unmetered (no reservation, no charge). (A
    ``;jsessionid`` spelling names chat in one reading and no endpoint in the other, so it
    is refused at the door since: section 4.)"""
    sluice = await start_sluice({"routes": [route(
        protocol, upstream.url, protocol=protocol,
        budget={"tokens": "1000/day", "per": "tenant"})]}, env=NOON)
    body = json.dumps({"model": "m", "max_tokens": 5000,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    answer = await raw_request(sluice.port, (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Tenant-ID: acme\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body)
    assert upstream.requests == [], f"served unmetered: {answer[:120]!r}"
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert f"X-Sluice-Reason: {reason}".encode() in answer


# -- 2. an upstream's own X-Sluice-* answer fields reached the caller, and its replays --

#: Sluice's own fields as a hostile upstream forges them.
FORGED = {"X-Sluice-Reason": "budget_exhausted", "X-Sluice-Dead-Letter": "1",
          "X-Sluice-Run-Warning": '"run";used=0.990', "x-sluice-budget-remaining": "0",
          "X-Sluice-Budget-Policy": '"forged";q=1;w=1'}


async def test_an_upstreams_own_sluice_fields_are_neither_relayed_nor_replayed(
        start_sluice) -> None:
    """An upstream answering with ``X-Sluice-Reason``, ``X-Sluice-Dead-Letter`` (naming
    another tenant's letter), ``X-Sluice-Run-Warning`` or ``X-Sluice-Budget-*`` had them
    relayed as Sluice's own signals, and stored for an ``Idempotency-Key``'s replays."""
    async def forging(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True}, headers={**FORGED, "X-Upstream-Own": "kept"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forging)
    runner, port = await serve_app(app)
    try:
        sluice = await start_sluice({"routes": [route(
            "h", f"http://127.0.0.1:{port}", protocol="http",
            idempotency={"mode": "dedup", "ttl": "1h"})]})
        async with aiohttp.ClientSession() as session:
            for replayed in ("", "true"):
                async with session.post(sluice.url + "/h/v1/tool", json={},
                                        headers={"Idempotency-Key": "k1"}) as answer:
                    assert answer.status == 200
                    assert answer.headers.get("Idempotent-Replayed", "") == replayed
                    assert answer.headers["X-Upstream-Own"] == "kept"
                    assert [n for n in answer.headers if n.lower().startswith("x-sluice-")] == []
    finally:
        await runner.cleanup()


async def test_a_chained_sluices_refusal_arrives_with_its_status_and_body_not_its_fields(
        upstream) -> None:
    """A review: the README says another Sluice may sit behind this one, and its
    ``X-Sluice-*`` answer fields are now dropped as any upstream's (an upstream cannot be
    trusted to speak for Sluice). What the README promises instead: the inner refusal's
    status and body, whose ``error.code`` names the reason, still reach the caller."""
    inner = await open_runtime(route("openai", upstream.url, protocol="openai",
                                     budget={"tokens": "1000/day", "per": "tenant"}))
    inner_runner, inner_port = await serve_runtime(inner)
    outer = await open_runtime(route("openai", f"http://127.0.0.1:{inner_port}/openai",
                                     protocol="openai"))
    outer_runner, outer_port = await serve_runtime(outer)
    try:
        body = {"model": "m", "max_tokens": 5000,
                "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{outer_port}/openai/v1/chat/completions",
                                    json=body) as answer:
                assert answer.status == 400
                assert (await answer.json())["error"]["code"] == "exceeds_limit"
                assert [n for n in answer.headers if n.lower().startswith("x-sluice-")] == []
        assert upstream.requests == []
    finally:
        await outer_runner.cleanup()
        await outer.close()
        await inner_runner.cleanup()
        await inner.close()


_SLUICE_NAME = re.compile(r"x-sluice-[a-z0-9-]*", re.IGNORECASE)


def sluice_names_in(source: str) -> tuple[set[str], list[str]]:
    """The ``X-Sluice-*`` names string constants of Python ``source`` spell out whole (lower
    case; docstrings and comments aside), and the constants that build one at run time
    instead: an f-string's or a concatenation's piece that a name runs to the end of
    (``f"X-Sluice-{kind}"``, ``"X-Sluice-" + kind``, ``"X-Sluice-Budget" + "-Reset"``), a
    name ending in ``-`` (``"X-Sluice-Budget-"``), or one a ``%`` or ``{}`` template
    continues (``"X-Sluice-%s" % kind``, ``"X-Sluice-{}".format(kind)``)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    pieces = set()  # constants joined to something computed: an f-string's or a + operand's
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            pieces.update(id(part) for part in node.values)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            pieces.update((id(node.left), id(node.right)))
    named: set[str] = set()
    dynamic: list[str] = []
    for node in ast.walk(tree):
        if (not isinstance(node, ast.Constant) or not isinstance(node.value, str)
                or id(node) in docstrings):
            continue
        for found in _SLUICE_NAME.finditer(node.value):
            after = node.value[found.end():found.end() + 1]
            if (found.group().endswith("-") or after in ("%", "{")
                    or (id(node) in pieces and after == "")):
                dynamic.append(node.value)
            else:
                named.add(found.group().lower())
    return named, dynamic


@pytest.mark.parametrize("source", [
    'NAME = f"X-Sluice-{kind}"', 'NAME = "X-Sluice-" + kind', 'NAME = "x-sluice-%s" % kind',
    'NAME = "X-Sluice-{}".format(kind)', 'NAME = "X-Sluice-Budget-" + kind',
    'NAME = "X-Sluice-Budget" + "-Reset"', 'NAME = f"X-Sluice-Budget{sep}Reset"',
    'NAME = prefix + "X-Sluice-Budget"',
])
def test_the_scan_finds_an_x_sluice_name_built_at_run_time(source: str) -> None:
    """A review: the scan read only whole names, so one built at run time passed it
    silently, and an upstream could forge it."""
    assert sluice_names_in(source)[1], source


def test_every_answer_field_sluice_sets_is_dropped_from_upstream_answers() -> None:
    """Every ``X-Sluice-*`` name written in Sluice's code is in
    :data:`proxy.forward.SLUICE_ANSWER_HEADERS`, so an upstream cannot forge one added
    later (a string constant naming one, outside docstrings and comments); and none is
    built at run time, which such a scan could not read (:func:`sluice_names_in`)."""
    named: set[str] = set()
    for source in [*(REPO / "proxy").rglob("*.py"), *(REPO / "policies").rglob("*.py")]:
        found, dynamic = sluice_names_in(source.read_text())
        assert not dynamic, (f"{source}: an X-Sluice- name built at run time: {dynamic}; "
                             "spell it whole in a constant and list it in "
                             "proxy.forward.SLUICE_ANSWER_HEADERS")
        named |= found
    assert len(named) >= 7  # the scan found the names it should
    assert named <= SLUICE_ANSWER_HEADERS, named - SLUICE_ANSWER_HEADERS


async def test_a_dead_letter_replay_keeps_none_of_the_upstreams_sluice_fields() -> None:
    """``sluice dlq replay`` stores the answer it gets for the letter's key, to be replayed to
    the key's later requests: it kept an upstream's forged ``X-Sluice-*`` fields too."""
    async def forging(request: web.Request) -> web.Response:
        return web.json_response({"ok": True}, headers=FORGED)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forging)
    runner, port = await serve_app(app)
    try:
        config = parse_config(yaml.safe_dump({"routes": [route(
            "h", f"http://127.0.0.1:{port}", protocol="http")]}))
        [config_route] = config.routes
        letter = DeadLetter("h", "acme", None, "k1", "r1", "POST", "/v1/tool", [], [], b"{}",
                            2, [], "attempts")
        status, _, _, _, headers = await dlq._send(
            config_route, config_route.timeouts, None, letter, CIMultiDict(), dlq._Connected())
        assert status == 200
        assert [n for n in headers if n.lower().startswith("x-sluice-")] == []
    finally:
        await runner.cleanup()


# -- 4. readings of one path that name different endpoints were metered as one of them --

@pytest.mark.parametrize(("protocol", "target"), [
    ("openai", "/openai/v1/responses;x=%2Fcompletions"),  # responses to Tomcat, not completions
    ("openai", "/openai/v1/embeddings;x=%2Fchat%2Fcompletions"),  # embeddings, not chat
    ("anthropic", "/anthropic/v1/messages/count_tokens;x=%2Fmessages"),  # free, not messages
    ("openai", "/openai/v1/chat/completions;jsessionid=1"),  # chat to Tomcat, none to aiohttp
    ("openai", "/openai/v1/chat%2Fcompletions"),  # chat to uvicorn, none to Express
    ("openai", "/openai/v1/chat\\/completions"),  # chat to Kestrel (\\ is /), else completions
])
async def test_a_path_whose_readings_name_different_endpoints_is_refused(
        upstream, start_sluice, protocol, target) -> None:
    """A review: Tomcat, Jetty and Spring drop ``;parameters`` before they decode, so they
    serve ``/v1/responses;x=%2Fcompletions`` as ``responses``, which Sluice metered as
    legacy completions (its suffix order picks among the readings), and
    ``/v1/messages/count_tokens;x=%2Fmessages`` (free) as messages (a false 400 on a
    budgeted route). When a path's readings name different endpoints, or one an endpoint
    and another none, Sluice cannot know what the upstream serves: refused 400
    ``bad_request``, as dot-segments are, before the upstream sees it."""
    sluice = await start_sluice({"routes": [route(protocol, upstream.url, protocol=protocol)]})
    body = json.dumps({"model": "m", "max_tokens": 5, "input": "hi",
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    answer = await raw_request(sluice.port, (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
    assert upstream.requests == [], f"forwarded: {answer[:120]!r}"
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"X-Sluice-Reason: bad_request" in answer
    assert b"read as different endpoints" in answer


@pytest.mark.parametrize(("protocol", "method", "target"), [
    ("openai", "POST", "/openai/v1;v=1/chat/completions"),  # chat in every reading
    ("openai", "POST", "/openai/v1/chat/completion%73"),  # %73 is s to every upstream
    ("openai", "POST", "/openai/v1/files;x=%2Fy"),  # no endpoint in any reading
    ("openai", "POST", "/openai/v1/chat/completions?q=%2F;x"),  # the query is not the path
    ("openai", "GET", "/openai/v1/responses;x=%2Fcompletions"),  # only a POST is metered
    ("http", "POST", "/http/v1/responses;x=%2Fcompletions"),  # an http route meters nothing
])
async def test_a_path_whose_readings_agree_is_served(upstream, start_sluice, protocol, method,
                                                     target) -> None:
    sluice = await start_sluice({"routes": [route(protocol, upstream.url, protocol=protocol)]})
    body = json.dumps({"model": "m", "max_tokens": 5,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    answer = await raw_request(sluice.port, (
        f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert len(upstream.requests) == 1
