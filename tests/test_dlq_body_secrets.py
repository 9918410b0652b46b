"""Credentials carried in a request's JSON body never reach a dead letter: the fields the
providers document (Anthropic's MCP connector ``mcp_servers[].authorization_token``, OpenAI
Responses' MCP tool ``tools[].authorization`` and ``tools[].headers``), members named as one
(``api_key``, ``password``...) and strings shaped as a key (``sk-...``), at any depth. A
hostile trial found them stored verbatim and printed by ``sluice dlq show``. Real Sluice
processes, the real CLI in subprocesses, the fake upstream; the unit rules at the end."""

from __future__ import annotations

import json

import aiohttp
import pytest

from policies.config import DeadLetterConfig
from policies.deadletter import (
    REDACT_OFF_LOOP_BYTES,
    REDACTED_VALUE,
    DeadLetter,
    DeadLetterFile,
    DeadLetterQueue,
    is_body_field,
    pointer_steps,
    redact_body,
)
from policies.secrets import secret_body_name
from tests.conftest import REPO, route
from tests.redis_servers import delete_prefix, new_prefix, require_redis
from tests.sluice_child import ForkedCli
from tests.sluice_child import ended as outcome

TOKEN = "ghp_MCPSERVERTOKEN1234567890abcdefXYZ"
KEY = "sk-proj-BODYSECRET1234567890abcdef"
FAST_RETRY = {"attempts": 2, "backoff": {"base": "10ms", "max": "20ms"}}

ANTHROPIC_BODY = {
    "model": "claude-test", "max_tokens": 5,
    "messages": [{"role": "user", "content": "hi"}],
    "mcp_servers": [{"type": "url", "url": "https://mcp.example.com/sse", "name": "gh",
                     "authorization_token": TOKEN}]}
RESPONSES_BODY = {
    "model": "gpt-test", "input": "hi", "api_key": KEY,
    "metadata": {"note": "kept", "password": "hunter2-not-a-key-form"},
    "tools": [{"type": "mcp", "server_label": "gh", "server_url": "https://mcp.example.com",
               "authorization": TOKEN,
               "headers": {"Authorization": "Bearer " + TOKEN, "X-Tenant": "acme"}}]}


async def cli(*args: str, env: dict[str, str] | None = None) -> ForkedCli:
    return ForkedCli(list(args), str(REPO), env=env)


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest, tmp_path):
    if request.param == "memory":
        yield {"dead_letter": {"path": str(tmp_path / "dlq.sqlite")}}
        return
    url = require_redis()
    prefix = new_prefix()
    try:
        yield {"state": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                         "timeout": "2s"}}
    finally:
        delete_prefix(url, prefix)


async def failed_call(sluice, upstream, path: str, body: bytes) -> str:
    """``body`` POSTed to ``path``, every attempt answered 503: the dead letter's id."""
    upstream.status = 503
    async with aiohttp.ClientSession() as s, s.post(
            sluice.url + path, data=body,
            headers={"Content-Type": "application/json", "X-Tenant-ID": "acme",
                     "Idempotency-Key": f"k-{path}-{len(body)}"}) as r:
        await r.read()
        assert r.status == 503
        letter = r.headers["X-Sluice-Dead-Letter"]
    upstream.status = None
    return letter


async def test_body_credentials_are_not_kept_shown_or_replayed_unasked(upstream, start_sluice,
                                                                       state):
    """The upstream got the credentials; the letter keeps the marker in their place and
    lists their JSON Pointers apart from headers; ``dlq show`` and ``dlq list`` print none;
    ``dlq replay`` refuses to send the marker unless told, and sends what the caller sent
    when each field is given back from the environment."""
    sluice = await start_sluice({**state, "routes": [
        route("anthropic", upstream.url, protocol="anthropic", retry=FAST_RETRY),
        route("openai", upstream.url, retry=FAST_RETRY)]})
    config = str(sluice.config_path)
    anthropic = await failed_call(sluice, upstream, "/anthropic/v1/messages",
                                  json.dumps(ANTHROPIC_BODY).encode())
    responses = await failed_call(sluice, upstream, "/openai/v1/responses",
                                  json.dumps(RESPONSES_BODY).encode())
    assert TOKEN.encode() in upstream.requests[-1].body  # the live call carried them

    code, shown, err = await outcome(await cli("dlq", "show", anthropic, "--config", config))
    assert code == 0, err
    assert TOKEN not in shown
    record = json.loads(shown)
    assert record["redacted_body_fields"] == ["/mcp_servers/0/authorization_token"]
    assert "/mcp_servers/0/authorization_token" not in record["redacted_headers"]
    body = json.loads(record["body"]["text"])
    assert body["mcp_servers"][0]["authorization_token"] == REDACTED_VALUE
    assert body["mcp_servers"][0]["url"] == "https://mcp.example.com/sse"

    code, shown, err = await outcome(await cli("dlq", "show", responses, "--config", config))
    assert code == 0, err
    assert TOKEN not in shown and KEY not in shown and "hunter2" not in shown
    record = json.loads(shown)
    removed = ["/api_key", "/metadata/password", "/tools/0/authorization",
               "/tools/0/headers/Authorization"]
    assert sorted(record["redacted_body_fields"]) == removed
    body = json.loads(record["body"]["text"])
    assert body["tools"][0]["headers"] == {"Authorization": REDACTED_VALUE, "X-Tenant": "acme"}
    assert body["metadata"]["note"] == "kept"
    code, listed, err = await outcome(await cli("dlq", "list", "--config", config))
    assert code == 0 and TOKEN not in listed and KEY not in listed, err

    # Not sent with the marker where a credential was: refused, nothing sent, each named.
    sent = len(upstream.requests)
    code, _, err = await outcome(await cli("dlq", "replay", responses, "--config", config))
    assert code == 1 and len(upstream.requests) == sent, err
    assert all(pointer in err for pointer in removed) and "--body-field-from-env" in err, err
    code, _, err = await outcome(await cli(
        "dlq", "replay", responses, "--config", config,
        "--body-field-from-env", "/tools/9/authorization=T"))
    assert code == 1 and "/tools/9/authorization" in err and len(upstream.requests) == sent

    # Given back from the environment: the caller's body, field for field.
    env = {"T": TOKEN, "H": "Bearer " + TOKEN, "K": KEY, "P": "hunter2-not-a-key-form"}
    code, out, err = await outcome(await cli(
        "dlq", "replay", responses, "--config", config,
        "--body-field-from-env", "/tools/0/authorization=T",
        "--body-field-from-env", "/tools/0/headers/Authorization=H",
        "--body-field-from-env", "/api_key=K", "--body-field-from-env", "/metadata/password=P",
        env=env))
    assert code == 0 and "HTTP 200" in out, err
    assert json.loads(upstream.requests[-1].body) == RESPONSES_BODY
    assert TOKEN not in err and "WARNING" not in err, err

    # Forced with the marker: sent so, and said so.
    code, _, err = await outcome(await cli("dlq", "replay", anthropic, "--config", config,
                                           "--send-redacted"))
    assert code == 0, err
    assert json.loads(upstream.requests[-1].body)["mcp_servers"][0][
        "authorization_token"] == REDACTED_VALUE
    assert "/mcp_servers/0/authorization_token" in err and "--send-redacted" in err, err


async def test_a_body_without_credentials_is_kept_and_replayed_byte_for_byte(
        upstream, start_sluice, tmp_path):
    """Nothing removed, nothing rewritten: the caller's spacing, key order and number forms
    are what the replay sends."""
    sluice = await start_sluice({"dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
                                 "routes": [route("openai", upstream.url, retry=FAST_RETRY)]})
    config = str(sluice.config_path)
    body = (b'{ "model" : "gpt-test",\n  "messages": [{"role": "user", "content": "my '
            b'token bucket"}], "temperature": 1.0E0, "max_tokens": 5, "metadata": '
            b'{"session_id": "s-1", "page_token": "p", "secret": false}}')
    letter = await failed_call(sluice, upstream, "/openai/v1/chat/completions", body)
    code, shown, err = await outcome(await cli("dlq", "show", letter, "--config", config))
    assert code == 0, err
    record = json.loads(shown)
    assert record["body"]["text"].encode() == body and record["redacted_body_fields"] == []
    code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    assert code == 0, err
    assert upstream.requests[-1].body == body


async def test_show_hides_the_body_credentials_of_a_letter_written_before_this(tmp_path) -> None:
    """A letter an earlier Sluice wrote with its body whole: ``dlq show`` prints the marker
    and lists the field, the file keeps what the caller sent (its replay sends that)."""
    path = str(tmp_path / "old.sqlite")
    file = DeadLetterFile(path)
    try:
        body = json.dumps(ANTHROPIC_BODY).encode()
        letter_id = file.add(DeadLetter(
            route="anthropic", tenant="acme", run=None, idempotency_key=None,
            request_id="r-1", method="POST", path="/v1/messages", headers=[],
            redacted=["x-api-key"], body=body, body_size=len(body), attempts=[],
            reason="attempts_exhausted")).id
    finally:
        file.close()
    code, shown, err = await outcome(await cli("dlq", "show", str(letter_id), "--file", path))
    assert code == 0, err
    assert TOKEN not in shown
    record = json.loads(shown)
    assert record["redacted_headers"] == ["x-api-key"]
    assert record["redacted_body_fields"] == ["/mcp_servers/0/authorization_token"]


async def test_a_body_cut_to_max_body_bytes_is_redacted_before_the_cut(tmp_path) -> None:
    """A cut document reads as no JSON: redacted after the cut, its first bytes kept the key.
    A body over 1 MiB is redacted on the store's own thread (REDACT_OFF_LOOP_BYTES)."""
    queue = DeadLetterQueue(DeadLetterConfig(path=str(tmp_path / "dlq.sqlite"),
                                             max_body_bytes=1000))
    await queue.open()
    try:
        body = json.dumps({"api_key": KEY, "messages": [
            {"role": "user", "content": "x" * 100}] * 20_000}).encode()
        assert len(body) > REDACT_OFF_LOOP_BYTES
        letter_id = await queue.add(DeadLetter(
            route="openai", tenant="acme", run=None, idempotency_key=None, request_id="r-2",
            method="POST", path="/v1/chat/completions", headers=[], redacted=[], body=body,
            body_size=len(body), attempts=[], reason="attempts_exhausted"))
    finally:
        await queue.close()
    file = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    try:
        letter = file.get(letter_id)
    finally:
        file.close()
    assert letter is not None and letter.truncated and len(letter.body) == 1000
    assert KEY.encode() not in letter.body and letter.redacted == ["/api_key"]


@pytest.mark.parametrize("name", ["api_key", "apiKey", "x-api-key", "API-Key", "authorization",
                                  "authorization_token", "access_token", "client_secret",
                                  "password", "private_key", "aws_secret_access_key", "token"])
def test_names_that_mean_a_credential(name: str) -> None:
    assert secret_body_name(name)


@pytest.mark.parametrize("name", ["max_tokens", "key", "session_id", "page_token", "next_token",
                                  "signature", "author", "keyword", "input_tokens"])
def test_names_of_data(name: str) -> None:
    """Data a replay must send as it was (an Anthropic thinking block's ``signature``, a
    key-value tool's ``key``, pagination cursors)."""
    assert not secret_body_name(name)


def test_values_shaped_as_keys_are_removed_at_any_depth_prose_is_not() -> None:
    body = json.dumps({"messages": [{"content": [{"type": "text", "text": KEY}]},
                                    {"content": "basic python tutorial"},
                                    {"content": "my key sk-proj-abc is wrong"}],
                       "n": 100000000000000000000000}).encode()
    kept, removed = redact_body(body)
    assert removed == ["/messages/0/content/0/text"]
    doc = json.loads(kept)
    assert doc["messages"][0]["content"][0]["text"] == REDACTED_VALUE
    assert doc["messages"][2]["content"] == "my key sk-proj-abc is wrong"
    assert doc["n"] == 100000000000000000000000  # not read as a float on the way


def test_pointers_escape_and_are_told_apart_from_headers_and_query_fields() -> None:
    _, removed = redact_body(json.dumps({"a/b": {"x~y": {"password": "p"}}}).encode())
    assert removed == ["/a~1b/x~0y/password"]
    assert pointer_steps(removed[0]) == ["a/b", "x~y", "password"]
    assert is_body_field(removed[0]) and not is_body_field("Authorization")
    assert not is_body_field("?api_key")


@pytest.mark.parametrize("body", [b"", b"not json", b'{"api_key": "sk-cut', b'"sk-abc"',
                                  b"api_key=sk-abc&x=1"])
def test_what_is_not_a_json_document_is_kept_as_sent(body: bytes) -> None:
    assert redact_body(body) == (body, [])
