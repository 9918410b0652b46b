"""Credentials carried in a request's JSON body never reach a dead letter: the fields the
providers document (Anthropic's MCP connector ``mcp_servers[].authorization_token``, OpenAI
Responses' MCP tool ``tools[].authorization`` and ``tools[].headers``), members named as one
(``api_key``, ``password``...) and strings shaped as a key (``sk-...``), at any depth. A
hostile trial found them stored verbatim and printed by ``sluice dlq show``. Real Sluice
processes, the real CLI in subprocesses, the fake upstream; the unit rules at the end."""

from __future__ import annotations

import json
import threading

import aiohttp
import pytest

import policies.deadletter
from policies.config import DeadLetterConfig
from policies.deadletter import (
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
    """A cut document reads as no JSON: redacted after the cut, its first bytes kept the key."""
    queue = DeadLetterQueue(DeadLetterConfig(path=str(tmp_path / "dlq.sqlite"),
                                             max_body_bytes=1000))
    await queue.open()
    try:
        body = json.dumps({"api_key": KEY, "messages": [
            {"role": "user", "content": "x" * 100}] * 20_000}).encode()
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


def new_letter(body: bytes, headers: list[tuple[str, str]] | None = None) -> DeadLetter:
    return DeadLetter(route="openai", tenant="acme", run=None, idempotency_key=None,
                      request_id="r-1", method="POST", path="/v1/chat/completions",
                      headers=headers or [], redacted=[], body=body, body_size=len(body),
                      attempts=[], reason="attempts_exhausted")


async def stored(tmp_path, letter: DeadLetter, **config) -> DeadLetter:
    """``letter`` written by the server's queue, as the file then holds it."""
    queue = DeadLetterQueue(DeadLetterConfig(path=str(tmp_path / "dlq.sqlite"), **config))
    await queue.open()
    try:
        letter_id = await queue.add(letter)
    finally:
        await queue.close()
    file = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    try:
        kept = file.get(letter_id)
    finally:
        file.close()
    assert kept is not None
    return kept


async def test_a_body_is_redacted_on_the_stores_thread_never_on_the_event_loop(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever its size: 200 failing calls of 600 KB bodies, each read on the loop,
    stalled every call (and /healthz) 8-15 s and every letter missed its wait (a review)."""
    loop_thread = threading.current_thread()
    read_on: list[threading.Thread] = []
    real = policies.deadletter.redact_body

    def watched(body: bytes) -> tuple[bytes, list[str]]:
        read_on.append(threading.current_thread())
        return real(body)

    monkeypatch.setattr(policies.deadletter, "redact_body", watched)
    letter = await stored(tmp_path, new_letter(json.dumps({"api_key": KEY}).encode()))
    assert letter.redacted == ["/api_key"]
    assert len(read_on) == 1 and read_on[0] is not loop_thread
    assert read_on[0].name.startswith("sluice-dlq")


LONG = "n" * 200_000


async def test_the_redacted_list_is_bounded_and_counted(tmp_path) -> None:
    """JSON Pointers repeat their ancestors' names: a 0.25 MB body of 2,000 passwords below
    one long name listed 400 MB (a review). At most MAX_REDACTED_POINTERS, each cut to
    MAX_POINTER_CHARS, then how many more; every password is removed all the same."""
    body = json.dumps({LONG: {f"p{i}": {"password": "hunter2"} for i in range(2000)}}).encode()
    letter = await stored(tmp_path, new_letter(body))
    listed = policies.deadletter.MAX_REDACTED_POINTERS
    assert len(letter.redacted) == listed + 1
    assert letter.redacted[-1] == f"/…and {2000 - listed} more"
    assert all(len(entry) <= policies.deadletter.MAX_POINTER_CHARS
               for entry in letter.redacted)
    assert letter.redacted[0].endswith("…") and not letter.truncated
    assert b"hunter2" not in letter.body
    # Counted in what a held letter keeps (MAX_HELD_BYTES): its body, and what it lists.
    assert policies.deadletter._size(letter) >= len(letter.body) + sum(map(len, letter.redacted))


def test_a_cut_or_counted_entry_cannot_be_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.dlq import _with_body_fields

    body, removed = redact_body(json.dumps(
        {LONG: {f"p{i}": {"password": "hunter2"} for i in range(100)}}).encode())
    letter = new_letter(body)
    letter.redacted = removed
    monkeypatch.setenv("V", "x")
    for entry in (removed[0], removed[-1]):
        with pytest.raises(ValueError, match="is not PATH=ENVVAR"):
            _with_body_fields(letter, [f"{entry}=V"], send_redacted=False)


async def test_a_body_of_too_many_members_is_not_read_nor_kept(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_REDACT_MEMBERS the walk stops: the body is not kept (marked cut, never
    replayed), its credentials with it, and ``redacted`` says why."""
    monkeypatch.setattr(policies.deadletter, "MAX_REDACT_MEMBERS", 1000)
    body = json.dumps({"rows": list(range(1000)), "api_key": KEY}).encode()
    letter = await stored(tmp_path, new_letter(body))
    assert letter.body == b"" and letter.truncated and letter.body_size == len(body)
    assert letter.redacted == [policies.deadletter.NOT_READ]
    small = json.dumps({"rows": list(range(10)), "api_key": KEY}).encode()
    assert redact_body(small)[1] == ["/api_key"]


SCHEMA_BODIES = [
    {"model": "gpt-test", "tools": [{"type": "function", "function": {
        "name": "login", "parameters": {"type": "object", "properties": {
            "user": {"type": "string"}, "password": {"type": "string"}},
            "required": ["user", "password"]}}}]},
    {"tools": [{"name": "t", "input_schema": {"type": "object", "properties": {
        "api_key": {"type": "string"},
        "auth": {"type": "object", "properties": {"token": {"type": "string"}}}}}}]},
    {"contents": [], "tools": [{"functionDeclarations": [{"name": "login", "parameters": {
        "type": "OBJECT", "properties": {"password": {"type": "STRING"}}}}]}]},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "cfg", "schema": {
        "$defs": {"client_secret": {"type": "string"}},
        "type": "object", "properties": {"client_secret": {"$ref": "#/$defs/client_secret"}}}}}},
]


@pytest.mark.parametrize("doc", SCHEMA_BODIES)
def test_a_json_schema_naming_a_credential_is_kept_as_sent(doc) -> None:
    """A function's ``parameters.properties.password`` is the schema of a password: replaced
    by the marker, no function-calling letter could be replayed (a review)."""
    body = json.dumps(doc).encode()
    assert redact_body(body) == (body, [])


def test_only_strings_are_credentials() -> None:
    """A number, boolean, null or object named as one is kept (an OTP tool's ``token``);
    the strings below a member named as one are removed, each a string again when given
    back."""
    body = json.dumps({"params": {"arguments": {"token": 123456, "password": True,
                                                "secret": None},
                                  "credentials": {"user": "bob", "pass": "p", "n": 7}}}).encode()
    kept, removed = redact_body(body)
    assert removed == ["/params/credentials/user", "/params/credentials/pass"]
    assert json.loads(kept)["params"]["arguments"] == {"token": 123456, "password": True,
                                                       "secret": None}
    assert json.loads(kept)["params"]["credentials"]["n"] == 7


def test_a_field_given_back_is_the_value_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field removed was a string, so one given back as a JSON string
    (``--body-field-from-env``) makes the body the caller sent: a numeric ``token`` was
    removed and came back as ``"123456"`` (a review)."""
    from proxy.dlq import _with_body_fields

    doc = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "verify", "arguments": {"token": 123456, "otp_secret": "JBSWY3DPEHPK3PXP"}}}
    body, removed = redact_body(json.dumps(doc).encode())
    letter = new_letter(body)
    letter.redacted = removed
    monkeypatch.setenv("V", "JBSWY3DPEHPK3PXP")
    replayed, marked = _with_body_fields(letter, [f"{p}=V" for p in removed], False)
    assert marked == [] and json.loads(replayed.body) == doc


@pytest.mark.parametrize("doc,pointer", [
    ({"data_sources": [{"type": "azure_search", "parameters": {
        "endpoint": "https://x", "authentication": {"type": "api_key", "key": "Zq8xP2mN4vR7"}}}]},
     "/data_sources/0/parameters/authentication/key"),
    ({"data_sources": [{"parameters": {"authentication": {
        "type": "key_and_key_id", "key": "Zq8xP2mN4vR7", "key_id": "id1"}}}]},
     "/data_sources/0/parameters/authentication/key"),
    ({"data_sources": [{"parameters": {"authentication": {
        "type": "connection_string", "connection_string": "AccountKey=Zq8xP2mN4vR7"}}}]},
     "/data_sources/0/parameters/authentication/connection_string"),
])
def test_azure_on_your_data_credentials_are_removed(doc, pointer) -> None:
    kept, removed = redact_body(json.dumps(doc).encode())
    assert removed == [pointer] and b"Zq8xP2mN4vR7" not in kept


@pytest.mark.parametrize("value", [
    "gsk_8hJk2lMnOpQrStUvWxYz1234567890abcdEF", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz12",
    "xai-AbCdEfGhIjKlMnOpQrStUvWxYz1234567890", "github_pat_11ABCDEFG0123456789_abcdefXYZ",
    "glpat-AbCdEfGh1234567890"])
def test_more_vendors_keys_are_removed_by_their_form(value: str) -> None:
    assert redact_body(json.dumps({"messages": [{"content": value}]}).encode())[1] == [
        "/messages/0/content"]


@pytest.mark.parametrize("value", ["hf_hub_download", "xai-grok", "sk-SK"])
def test_words_that_only_start_like_a_key_are_kept(value: str) -> None:
    body = json.dumps({"messages": [{"content": value}]}).encode()
    assert redact_body(body) == (body, [])


async def test_a_utf16_body_rewritten_is_stored_with_a_utf8_content_type(tmp_path) -> None:
    """Rewritten as UTF-8, its replay must not say ``charset=utf-16`` (a review)."""
    body = json.dumps({"model": "m", "api_key": KEY}).encode("utf-16")
    letter = await stored(tmp_path, new_letter(
        body, [("Content-Type", "application/json; charset=UTF-16"), ("X-Trace", "t")]))
    assert letter.headers == [("Content-Type", "application/json; charset=utf-8"),
                              ("X-Trace", "t")]
    assert json.loads(letter.body.decode("utf-8")) == {"model": "m", "api_key": REDACTED_VALUE}
