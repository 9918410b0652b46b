"""Hostile review (review2) of 5113cc8..63461bd: each test failed on the code it was written
against and passes since its fix. One finding is left (docs, closing note) and has no test
here: an attempt cut by per_try_timeout while still connecting is charged as sent."""

from __future__ import annotations

import itertools

import httpx2 as httpx
import openai
import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from policies.config import IdempotencyConfig
from policies.deadletter import redact_path
from policies.idempotency import Idempotency, Replay
from policies.pipeline import Call
from tests.conftest import route

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


# -- 1. per-request headers now read as the caller's credentials ----------------------------


async def test_a_signed_sdk_retry_is_still_one_call_under_a_derived_key(upstream, start_sluice):
    """An agent whose HTTP client signs every request (RFC 9421 HTTP Message Signatures, as
    Cloudflare's Web Bot Auth has agents do: ``Signature-Agent``, ``Signature-Input`` with
    ``created``/``nonce``, ``Signature``) re-signs the openai SDK's retry. ``Signature`` and
    ``Signature-Input`` hold "signature", so ``_credentials`` now reads them: the retry gets
    another ``sluice-d-`` key and the upstream runs the call twice (before the change only
    Authorization / x-api-key / api-key were read, and the same test passed)."""
    upstream.statuses = [500]
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, idempotency={"derive_from": ["X-Run-ID", "X-Step-ID"]})]})
    nonce = itertools.count()

    async def sign(request: httpx.Request) -> None:
        n = next(nonce)
        request.headers["Signature-Agent"] = '"https://agent.example"'
        request.headers["Signature-Input"] = (
            f'sig1=("@authority" "signature-agent");created={1764970000 + n};'
            f'keyid="poqkLGiymh_W0uP6PZFw-dvez3QJT5SolqXBCW38r0U";nonce="n{n}";'
            'tag="web-bot-auth"')
        request.headers["Signature"] = f"sig1=:c2lnbmF0dXJl{n}:"

    http_client = httpx.AsyncClient(event_hooks={"request": [sign]})
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=2, default_headers={"X-Run-ID": "run-7"},
                                http_client=http_client)
    try:
        await client.chat.completions.create(**CHAT, extra_headers={"X-Step-ID": "step-3"})
    finally:
        await client.close()
    assert [r.headers["x-stainless-retry-count"] for r in upstream.requests] == ["0", "1"]
    keys = [r.headers["Idempotency-Key"] for r in upstream.requests]
    assert len(set(keys)) == 1, f"the retry was sent as another call: {keys}"
    assert upstream.executed == 1


def _tool_call(extra: dict[str, str]) -> Call:
    body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                         "params": {"name": "send", "arguments": {"to": "a"}}})
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": "Bearer t", **extra}))
    return Call(request_id="r", route="tools", method="POST", path="/tools/mcp",
                headers=headers, body=body, tenant="t", rpc_id=1)


@pytest.mark.parametrize(("first", "retry"), [
    # RFC 9421 signatures: created/nonce differ on every request.
    ({"Signature-Input": 'sig1=();created=1764970000;nonce="a"', "Signature": "sig1=:AAA=:"},
     {"Signature-Input": 'sig1=();created=1764970007;nonce="b"', "Signature": "sig1=:BBB=:"}),
    # A per-request anti-forgery token (Rails/Django/Spring rotate it).
    ({"X-CSRF-Token": "c1"}, {"X-CSRF-Token": "c2"}),
    # An edge's per-request signed JWT about the caller (AWS ALB OIDC, GCP IAP): not a
    # credential the caller sends, read as one by its value (eyJ...).
    ({"X-Amzn-Oidc-Data": "eyJhbGciOiJFUzI1NiJ9.eyJleHAiOjF9.sig1"},
     {"X-Amzn-Oidc-Data": "eyJhbGciOiJFUzI1NiJ9.eyJleHAiOjJ9.sig2"}),
], ids=["rfc9421-signature", "csrf-token", "alb-oidc-jwt"])
async def test_a_tool_calls_retry_with_a_per_request_header_is_replayed(first, retry) -> None:
    """As round 34's own Cookie test: the same MCP call, same Authorization, retried with a
    header that differs per request but carries no caller credential of its own; it must be
    the stored answer, not a second run of the side effect."""
    policy = Idempotency(IdempotencyConfig(), "tools", mcp_calls=True)
    owner = await policy.admit(_tool_call(first))
    assert owner is not None
    owner.capture.begin(200, "OK", CIMultiDict({"Content-Type": "application/json"}))
    owner.capture.feed(b'{"jsonrpc": "2.0", "id": 1, "result": {"content": []}}')
    owner.finish("2xx")
    try:
        again = await policy.admit(_tool_call(retry))
    except Replay as replayed:
        assert replayed.record.status == 200
        return
    again.finish("2xx")
    pytest.fail("the retry was admitted as a new call: its side effect runs twice")


# -- 2. query fields: credentials kept, harmless fields dropped -----------------------------


@pytest.mark.parametrize("name", [
    # Redacted at 5113cc8 (by fragment), kept now: one-word names not in SECRET_QUERY_WORDS.
    "appkey", "APPKEY", "apitoken", "APIToken", "appsecret", "apisecret", "hapikey",
    "subscriptionkey", "SASToken",
    # Rails/PHP nested params: brackets are no word separator.
    "user[password]", "auth[token]", "credentials[api_key]",
    # Never redacted: OpenWeatherMap's and Wolfram|Alpha's (LLM API) key field.
    "appid",
])
def test_a_query_credential_is_not_kept_in_a_dead_letter(name: str) -> None:
    stored, removed = redact_path(f"/v1/x?{name}=HOSTILE0123456789&page=2")
    assert "HOSTILE" not in stored, (stored, removed)


@pytest.mark.parametrize("query", [
    # Pagination cursors (every Google API, AWS, S3 ListObjectsV2) and flags: not secrets.
    "pageToken=CAoQAA", "NextToken=abc", "continuation-token=1x2", "private=true",
    "sort_key=created", "partition_key=p1",
    # Two-word searches that begin with an auth scheme word: the stricter value rule still
    # takes "scheme + one word" for a credential.
    "q=basic+auth", "q=token+bucket", "q=Basic+Instinct",
])
def test_a_harmless_query_field_is_kept_in_a_dead_letter(query: str) -> None:
    path = f"/v1/search?{query}&page=2"
    assert redact_path(path) == (path, [])


# -- 3. sluice runs --admin: a mistyped address is a traceback -------------------------------


def test_runs_admin_with_a_bad_port_is_an_error_not_a_traceback() -> None:
    """``--admin`` now takes ``host:port`` bare; ``--admin 127.0.0.1:990l`` (a typo) reaches
    ``urllib`` and dies with ``http.client.InvalidURL`` and a traceback rather than the
    CLI's own "cannot reach the admin port" line (as ``--admin localhost:9`` gets)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "proxy", "runs", "list", "--admin",
                           "127.0.0.1:990l"], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": ".", "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-400:]
