"""``sluice dlq show`` masks the credentials some provider APIs take in a JSON body; the
letter keeps them, and a replay sends them.

Headers and query fields that carry credentials are removed when a letter is written; a body
is kept as sent, and ``dlq show`` printed the tokens in it: Anthropic's MCP connector's
``mcp_servers[].authorization_token``, an OpenAI Responses ``mcp`` tool's ``authorization``
and ``headers``, Azure OpenAI On Your Data's ``data_sources[].parameters.authentication``
and ``...parameters.embedding_dependency.authentication``. They are masked at those
documented paths only, never guessed from key names (``max_tokens``, a function tool's own
``authorization`` parameter and ``key_id`` stay). A real
Sluice writes the letters; the real CLI reads them, forked."""

from __future__ import annotations

import json

import aiohttp
import pytest

from proxy.redact import MAX_NESTING, WITHHELD, body_credentials_masked
from tests.conftest import route
from tests.sluice_child import sluice_cli

FAST_BACKOFF = {"base": "10ms", "max": "20ms"}
MASK = "<redacted>"  # proxy.redact.REDACTED, as the admin views show a redacted value

#: Calls whose bodies hold a credential, each with the paths ``dlq show`` masks in it. Next
#: to them, keys and values a guess from names would mask, which stay: ``max_tokens``, a
#: function tool's own ``authorization`` parameter, a top-level ``authorization_token``,
#: ``key_id``, ``username``, and a prompt holding ``Bearer ...``.
CALLS = [
    ("anthropic", "/v1/messages", {
        "model": "claude-test", "max_tokens": 64, "authorization_token": "not-a-documented-path",
        "messages": [{"role": "user", "content": "use Bearer sk-in-the-prompt as shown"}],
        "mcp_servers": [
            {"type": "url", "url": "https://mcp.example.com/sse", "name": "one",
             "authorization_token": "ant-oauth-token-1"},
            {"type": "url", "url": "https://mcp.example.com/open", "name": "open"},
            {"type": "url", "url": "https://mcp.example.com/two", "name": "two",
             "authorization_token": "ant-oauth-token-2"}]},
     ["mcp_servers[0].authorization_token", "mcp_servers[2].authorization_token"]),
    ("openai", "/v1/responses", {
        "model": "gpt-test", "input": "hi",
        "tools": [
            {"type": "function", "name": "login",
             "parameters": {"type": "object", "properties": {"authorization": {}}},
             "authorization": "a function tool's own field"},
            {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.example.com",
             "authorization": "oai-oauth-token", "require_approval": "never",
             "headers": {"X-Api-Key": "oai-header-key", "X-Tenant": "acme-header"}}]},
     ["tools[1].authorization", 'tools[1].headers["X-Api-Key"]',
      'tools[1].headers["X-Tenant"]']),
    ("openai", "/v1/chat/completions", {
        "model": "gpt-test", "messages": [{"role": "user", "content": "hi"}],
        "data_sources": [
            {"type": "azure_search", "parameters": {
                "endpoint": "https://search.example.com", "index_name": "docs",
                "authentication": {"type": "api_key", "key": "azure-search-key"},
                "embedding_dependency": {
                    "type": "endpoint", "endpoint": "https://embed.example.com",
                    "authentication": {"type": "api_key", "key": "embed-key"}}}},
            {"type": "elasticsearch", "parameters": {
                "endpoint": "https://es.example.com", "index_name": "docs",
                "authentication": {"type": "key_and_key_id", "key": "es-key",
                                   "key_id": "es-key-id"}}},
            {"type": "azure_cosmos_db", "parameters": {
                "authentication": {"type": "connection_string",
                                   "connection_string": "mongodb+srv://u:pw@cosmos"}}},
            {"type": "mongo_db", "parameters": {
                "authentication": {"type": "username_and_password", "username": "reader",
                                   "password": "mongo-password"}}},
            {"type": "elasticsearch", "parameters": {
                "authentication": {"type": "encoded_api_key", "encoded_api_key": "ZW5j"}}},
            {"type": "azure_search", "parameters": {
                "authentication": {"type": "access_token", "access_token": "eyJ-token"},
                "embedding_dependency": {
                    "type": "endpoint", "endpoint": "https://embed.example.com",
                    "authentication": {"type": "access_token",
                                       "access_token": "eyJ-embed"}}}},
            {"type": "azure_search", "parameters": {
                "embedding_dependency": {"type": "deployment_name",
                                         "deployment_name": "ada"}}}]},
     [f"data_sources[{at}].parameters.{name}" for at, name in (
         (0, "authentication.key"), (0, "embedding_dependency.authentication.key"),
         (1, "authentication.key"), (2, "authentication.connection_string"),
         (3, "authentication.password"), (4, "authentication.encoded_api_key"),
         (5, "authentication.access_token"),
         (5, "embedding_dependency.authentication.access_token"))]),
]
SECRETS = ["ant-oauth-token-1", "ant-oauth-token-2", "oai-oauth-token", "oai-header-key",
           "acme-header", "azure-search-key", "es-key\"", "mongodb+srv", "mongo-password",
           "ZW5j", "eyJ-token", "embed-key", "eyJ-embed"]


def masked(body: dict, paths: list[str]) -> dict:
    """``body`` with the value at each of ``paths`` (as ``dlq show`` names them) masked."""
    copy = json.loads(json.dumps(body))
    for path in paths:
        holder, key = copy, None
        for part in path.replace("]", "").replace("[", ".").split("."):
            if key is not None:
                holder = holder[key]
            key = json.loads(part) if part.startswith('"') else (
                int(part) if part.isdigit() else part)
        holder[key] = MASK
    return copy


async def test_show_masks_body_credentials_at_their_documented_paths_and_replay_sends_them(
        upstream, start_sluice, tmp_path):
    sluice = await start_sluice({
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
        "routes": [route(name, upstream.url, name, retry={"attempts": 2,
                                                          "backoff": FAST_BACKOFF})
                   for name in ("openai", "anthropic")]})
    config = str(sluice.config_path)
    upstream.status = 503
    sent: dict[str, bytes] = {}
    async with aiohttp.ClientSession() as http:
        for n, (prefix, path, body, _) in enumerate(CALLS):
            raw = json.dumps(body).encode()
            async with http.post(f"{sluice.url}/{prefix}{path}", data=raw, headers={
                    "Content-Type": "application/json", "X-Tenant-ID": "acme",
                    "Idempotency-Key": f"key-{n}"}) as r:
                await r.read()
                assert r.status == 503
                sent[r.headers["X-Sluice-Dead-Letter"]] = raw
    upstream.status = None

    for letter, (_, _, body, paths) in zip(sent, CALLS, strict=True):
        code, out, err = await sluice_cli("dlq", "show", letter, "--config", config)
        assert code == 0, err
        shown = json.loads(out)  # the output is JSON, and so is the body in it
        assert not [s for s in SECRETS if s in shown["body"]["text"]]
        assert json.loads(shown["body"]["text"]) == masked(body, paths)
        assert shown["body_masked"] == paths

        code, out, err = await sluice_cli("dlq", "show", letter, "--config", config,
                                          "--unmask")
        assert code == 0, err
        shown = json.loads(out)
        assert shown["body_masked"] == []
        assert shown["body"]["text"].encode() == sent[letter]  # as stored, byte for byte

    # The letter keeps them: a replay sends the body as it was sent.
    letter = next(iter(sent))
    code, out, err = await sluice_cli("dlq", "replay", letter, "--config", config)
    assert code == 0 and "HTTP 200" in out, (out, err)
    assert upstream.requests[-1].body == sent[letter]
    code, out, err = await sluice_cli("dlq", "show", letter, "--config", config)
    assert code == 0 and "ant-oauth-token" not in out and len(json.loads(out)["replays"]) == 1


async def test_a_body_with_nothing_to_mask_is_shown_as_stored(upstream, start_sluice,
                                                              tmp_path):
    # Not written again when nothing is masked: its spacing, key order and escapes kept.
    sluice = await start_sluice({
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
        "routes": [route("openai", upstream.url, retry={"attempts": 1})]})
    upstream.status = 503
    raw = (b'{ "model":"gpt-test",  "messages":[{"role":"user","content":"caf\\u00e9"}],'
           b'"tools":[{"type":"mcp","server_label":"open","headers":{}}],"n":1.50}')
    async with aiohttp.ClientSession() as http, http.post(
            f"{sluice.url}/openai/v1/chat/completions", data=raw,
            headers={"Content-Type": "application/json", "Idempotency-Key": "k"}) as r:
        await r.read()
        letter = r.headers["X-Sluice-Dead-Letter"]
    code, out, err = await sluice_cli("dlq", "show", letter, "--config",
                                      str(sluice.config_path))
    assert code == 0, err
    shown = json.loads(out)
    assert shown["body_masked"] == [] and shown["body"]["text"].encode() == raw


# -- bodies a review found the masking missed or spoiled ---------------------------------------

SECRET = "sk-in-the-body"


@pytest.mark.parametrize(("text", "shown", "paths"), [
    # A byte order mark before the JSON (Python's json refuses it, so nothing was masked):
    # read without it, written back with it.
    ('\ufeff{"mcp_servers": [{"authorization_token": "sk-in-the-body"}]}',
     '\ufeff{"mcp_servers": [{"authorization_token": "<redacted>"}]}',
     ["mcp_servers[0].authorization_token"]),
    # A key twice: an upstream's parser may take the first value or the last, and Python's
    # the last (null: nothing to mask, the text printed as stored). Withheld whole.
    ('{"mcp_servers": [{"authorization_token": "sk-in-the-body"}], "mcp_servers": null}',
     WITHHELD, ["body"]),
    ('{"tools": [{"type": "mcp", "authorization": "sk-in-the-body", "type": "function"}]}',
     WITHHELD, ["body"]),
    ('{"data_sources": [{"parameters": {"authentication": {"key": "sk-in-the-body"}},'
     ' "parameters": {}}]}', WITHHELD, ["body"]),
    # 1e999 and NaN: json.dumps would write Infinity and NaN, no JSON. Withheld.
    ('{"mcp_servers": [{"authorization_token": "sk-in-the-body"}], "t": 1e999}',
     WITHHELD, ["body"]),
    ('{"mcp_servers": [{"authorization_token": "sk-in-the-body"}], "x": NaN}',
     WITHHELD, ["body"]),
    # A name spelled with a JSON escape is the same name to every parser: withheld too.
    ('{"temperature": NaN, "tools": [{"type": "mcp", "authoriz\\u0061tion": "sk-in-the-body"}]}',
     WITHHELD, ["body"]),
    # Nesting deeper than MAX_NESTING (3.11's reader refuses it, 3.13's reads it): withheld
    # on every version.
    ('{"mcp_servers": [{"authorization_token": "sk-in-the-body"}], "d": '
     + "[" * 5000 + "]" * 5000 + "}", WITHHELD, ["body"]),
    # ... unless the body names none of the masked fields: shown as stored.
    ('{"model": "m", "model": "n", "t": 1e999, "x": NaN}',
     '{"model": "m", "model": "n", "t": 1e999, "x": NaN}', []),
    # Big integers and -0.0 are written back as they were.
    ('{"mcp_servers": [{"authorization_token": "sk-in-the-body"}], "u": -0.0,'
     ' "w": 123456789012345678901234567890}',
     '{"mcp_servers": [{"authorization_token": "<redacted>"}], "u": -0.0,'
     ' "w": 123456789012345678901234567890}',
     ["mcp_servers[0].authorization_token"]),
    # A lone surrogate the body escapes stays escaped (the text must encode to UTF-8).
    ('{"mcp_servers": [{"authorization_token": "sk-in-the-body"}], "s": "\\ud800\u00e9"}',
     '{"mcp_servers": [{"authorization_token": "<redacted>"}], "s": "\\ud800\\u00e9"}',
     ["mcp_servers[0].authorization_token"]),
])
def test_a_body_is_masked_everywhere_its_credential_may_be_read(text, shown, paths):
    assert body_credentials_masked(text) == (shown, paths)


def test_a_nested_body_is_masked_and_written_whole():
    # MAX_NESTING levels, the outer object's included, and brackets in strings apart.
    deep = "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1)
    text = ('{"mcp_servers": [{"authorization_token": "sk-in-the-body"}], "d": ' + deep
            + ', "s": "[{\\"' + "[" * 2000 + '"}')
    assert body_credentials_masked(text) == (
        '{"mcp_servers": [{"authorization_token": "<redacted>"}], "d": ' + deep
        + ', "s": "[{\\"' + "[" * 2000 + '"}', ["mcp_servers[0].authorization_token"])
    # One level more is withheld, as on a Python whose reader refuses it (3.11 reads 993).
    deeper = text.replace(deep, "[" + deep + "]")
    assert body_credentials_masked(deeper) == (WITHHELD, ["body"])
