"""Identity at the door (proxy/identity.py): values validated before they reach an event, a
metric label or the admin page; trusted tenants from API-key digests (identity.tenants)."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import os

import aiohttp
import pytest
import yaml

from policies.secrets import API_KEY_QUERY_FIELDS, secret_query_field
from proxy.cli import main
from tests.conftest import raw_request, route, wait_until

CHAT = "/up/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def post_latin1(port: int, header: str, value: str) -> tuple[int, str, dict]:
    """POST as Python's http.client does it: a str header value goes out as Latin-1 bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST", CHAT)
        conn.putheader("Content-Type", "application/json")
        conn.putheader(header, value)
        body = json.dumps(BODY).encode()
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        answer = conn.getresponse()
        return answer.status, answer.getheader("X-Sluice-Reason") or "", json.loads(
            answer.read())
    finally:
        conn.close()


async def test_a_latin1_identity_value_is_a_400_naming_the_header_and_breaks_nothing(
        upstream, start_sluice):
    """``X-Tenant-ID: équipe`` from http.client got 500: the admitted event failed to encode
    before the slot's release, and the route answered queue_timeout from then on."""
    sluice = await start_sluice({"routes": [route(
        "up", upstream.url, "openai",
        concurrency={"limit": 1, "queue": 1, "max_wait": "1s"},
        budget={"tokens": "100000/day", "per": "tenant"},
        idempotency={"mode": "dedup"})]})
    headers = ("X-Tenant-ID", "X-Run-ID", "X-Request-ID", "X-Parent-Run-ID", "X-Priority",
               "Idempotency-Key")
    for header in headers:
        status, reason, body = await asyncio.to_thread(post_latin1, sluice.port, header,
                                                       "équipe")
        assert (status, reason) == (400, "bad_request"), header
        assert header in body["error"]["message"]
        assert "équipe" not in body["error"]["message"]
    async with aiohttp.ClientSession() as session:
        for n in range(3):  # no slot, reservation or key was left behind
            async with session.post(sluice.url + CHAT, json=BODY, headers={
                    "X-Tenant-ID": "equipe",
                    "X-Run-ID": f"run-{n}", "Idempotency-Key": f"k{n}"}) as r:
                assert r.status == 200
        for path in ("/admin/", "/admin/routes", "/metrics"):
            async with session.get(sluice.admin_url + path) as r:
                assert r.status == 200, path
    assert len(upstream.requests) == 3
    await wait_until(lambda: sum(e["event"] == "completed" for e in sluice.events()) == 3,
                     what="3 completed events")
    assert sum(e["event"] == "rejected" for e in sluice.events()) == len(headers)
    assert "Traceback" not in sluice.stderr()


async def test_identity_values_are_visible_ascii_sent_once(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("up", upstream.url, "openai")]})
    body = json.dumps(BODY).encode()
    for lines, status in (
        (b"X-Tenant-ID: a\tb\r\n", 400),
        (b"X-Tenant-ID: a b\r\n", 400),
        (b"X-Run-ID: r\x7f\r\n", 400),
        (b"X-Tenant-ID: \xc3\xa9quipe\r\n", 400),  # UTF-8 is refused as well: ASCII only
        (b"X-Tenant-ID: a\r\nX-Tenant-ID: b\r\n", 400),
        (b"X-Tenant-ID: team-a_1.x@y+z\r\nX-Run-ID: run:42/7\r\n", 200),
        (b"X-Tenant-ID:\r\n", 200),  # empty: the default tenant
    ):
        answer = await raw_request(sluice.port, b"POST " + CHAT.encode() + b" HTTP/1.1\r\n"
                                   b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                   + lines + b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                                   % len(body) + body)
        got = int(answer.split(b" ", 2)[1])
        assert got == status, lines
    await wait_until(lambda: sum(e["event"] == "completed" for e in sluice.events()) == 2,
                     what="2 completed events")
    assert [e["tenant"] for e in sluice.events() if e["event"] == "completed"] == [
        "team-a_1.x@y+z", "default"]


# -- trusted identity -------------------------------------------------------------------------


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = {digest("sk-team-a"): "team-a", digest("sk-team-b"): "team-b"}


async def _call(session: aiohttp.ClientSession, url: str, headers: dict[str, str]
                ) -> tuple[int, str]:
    async with session.post(url + CHAT, json=BODY, headers=headers) as r:
        return r.status, r.headers.get("X-Sluice-Reason", "")


async def test_trusted_identity_takes_the_tenant_from_the_api_key(upstream, start_sluice,
                                                                    tmp_path):
    (tmp_path / "tenants.yaml").write_text(
        "# sha256 of each API key -> its tenant\n" + yaml.safe_dump(TENANTS))
    sluice = await start_sluice({"identity": {"tenants": "tenants.yaml"},
                                 "routes": [route("up", upstream.url, "openai")]})
    cases = [
        ({"Authorization": "Bearer sk-team-a"}, (200, "")),
        ({"x-api-key": "sk-team-b"}, (200, "")),
        ({"Authorization": "Bearer sk-team-a", "X-Tenant-ID": "team-a"}, (200, "")),
        ({"Authorization": "Bearer sk-team-a", "X-Tenant-ID": "team-b"},
         (403, "tenant_mismatch")),
        ({"Authorization": "Bearer sk-team-a", "x-api-key": "sk-team-b"},
         (403, "tenant_mismatch")),
        ({"Authorization": "Bearer sk-stolen-or-made-up"}, (401, "unknown_api_key")),
        ({"X-Tenant-ID": "team-a"}, (401, "unknown_api_key")),
    ]
    async with aiohttp.ClientSession() as session:
        for headers, expected in cases:
            assert await _call(session, sluice.url, headers) == expected, headers
    await wait_until(lambda: sum(e["event"] in ("completed", "rejected")
                                 for e in sluice.events()) == len(cases), what="the events")
    assert [e["tenant"] for e in sluice.events() if e["event"] == "completed"] == [
        "team-a", "team-b", "team-a"]
    for text in (sluice.events_path.read_text(), sluice.stderr()):
        assert "sk-team" not in text and "sk-stolen" not in text


async def test_underscore_look_alikes_of_identity_headers_are_not_forwarded(
        upstream, start_sluice, tmp_path):
    # A hostile trial: team-a's key with X_Tenant_ID: team-b was charged to team-a, and the
    # look-alike went upstream as sent, where a WSGI or CGI server reads it as X-Tenant-ID
    # (HTTP_X_TENANT_ID): the tool server behind saw team-b. The fields Sluice reads still go
    # on as sent; every other underscored field too.
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    sluice = await start_sluice({"identity": {"tenants": "tenants.yaml",
                                              "run_header": "X-Agent-Run"},
                                 "routes": [route("up", upstream.url, "http")]})
    sent = [("Authorization", "Bearer sk-team-a"), ("X-Tenant-ID", "team-a"),
            ("X_Tenant_ID", "team-b"), ("x-tenant_id", "team-b"), ("X-Agent-Run", "r1"),
            ("X_Agent_Run", "r2"), ("X-Parent_Run-ID", "p"), ("X_Priority", "critical"),
            ("X_Custom_Field", "kept")]
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/up/x", data=b"{}", headers=sent) as answer:
            assert answer.status == 200
    forwarded = {name.lower(): value for name, value in upstream.requests[-1].headers.items()}
    assert {name: value for name, value in forwarded.items()
            if name.replace("_", "-") in ("x-tenant-id", "x-agent-run", "x-parent-run-id",
                                          "x-priority", "x-custom-field")} == {
        "x-tenant-id": "team-a", "x-agent-run": "r1", "x_custom_field": "kept"}


async def test_look_alikes_of_the_timeout_header_and_of_an_underscored_name_are_dropped(
        upstream, start_sluice):
    # A review: X_Request_Timeout went upstream, where a WSGI or CGI server reads it as the
    # timeout header Sluice reads (HTTP_X_REQUEST_TIMEOUT). And with a tenant header
    # configured with an underscore (X_Team), passing its dashed spelling on let a caller
    # name two tenants: Sluice charged X_Team's, a WSGI upstream read both as HTTP_X_TEAM
    # (one of them, gunicorn's own choice). The configured spelling alone goes on.
    sluice = await start_sluice({"identity": {"tenant_header": "X_Team"},
                                 "routes": [route("up", upstream.url, "http")]})
    sent = [("X_Team", "team-a"), ("X-Team", "victim"), ("X-Request-Timeout", "30"),
            ("X_Request_Timeout", "999"), ("x-request_timeout", "999")]
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/up/x", data=b"{}", headers=sent) as answer:
            assert answer.status == 200
    forwarded = {name.lower() for name in upstream.requests[-1].headers}
    assert {"x_team", "x-request-timeout"} <= forwarded
    assert not {"x-team", "x_request_timeout", "x-request_timeout"} & forwarded


async def _message(session: aiohttp.ClientSession, url: str, headers: dict[str, str]
                   ) -> tuple[int, str]:
    async with session.post(url + CHAT, json=BODY, headers=headers) as r:
        return r.status, (await r.json())["error"]["message"]


async def test_identity_refusals_say_what_was_sent_once(upstream, start_sluice, tmp_path):
    """Seen (new-user trial): an unknown key read "no tenant is configured for this API key
    (identity.tenants) (the API key is not in identity.tenants)", and keys of two tenants
    in Authorization and x-api-key began "the tenant header names a tenant other than the
    API key's" though no tenant header was sent."""
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    sluice = await start_sluice({"identity": {"tenants": "tenants.yaml"},
                                 "routes": [route("up", upstream.url, "openai")]})
    async with aiohttp.ClientSession() as session:
        assert await _message(session, sluice.url, {"Authorization": "Bearer sk-team-a",
                                                    "x-api-key": "sk-team-b"}) == (
            403, "Sluice: the request names more than one tenant (the API keys in "
                 "Authorization and x-api-key give different tenants: send one key)")
        assert await _message(session, sluice.url, {"Authorization": "Bearer sk-team-a",
                                                    "X-Tenant-ID": "team-b"}) == (
            403, "Sluice: the request names more than one tenant (X-Tenant-ID names another "
                 "tenant than the API key's: send the key's tenant, or leave the header out)")
        assert await _message(session, sluice.url, {"x-api-key": "sk-made-up"}) == (
            401, "Sluice could not tell the caller's tenant from an API key (the API key in "
                 "x-api-key is not in identity.tenants)")
        assert await _message(session, sluice.url, {}) == (
            401, "Sluice could not tell the caller's tenant from an API key (none was sent, "
                 "and identity.tenants is set: send one as Authorization: Bearer, x-api-key, "
                 "api-key, x-goog-api-key, Ocp-Apim-Subscription-Key, X-Auth-Token, ?api-key=, "
                 "?api_key=, ?apikey=, ?key=, ?subscription-key=)")
    assert upstream.requests == []


async def test_a_changed_tenants_file_applies_without_a_sighup(upstream, start_sluice,
                                                               tmp_path):
    """The watcher polled only the config file: a key added to the tenants table (a
    rotated Secret) stayed 401 until a SIGHUP (a new user's trial)."""
    table = tmp_path / "tenants.yaml"
    table.write_text(yaml.safe_dump(TENANTS))
    sluice = await start_sluice({"identity": {"tenants": "tenants.yaml"},
                                 "routes": [route("up", upstream.url, "openai")]})
    new_key = {"Authorization": "Bearer sk-team-c"}
    async with aiohttp.ClientSession() as session:
        assert await _call(session, sluice.url, new_key) == (401, "unknown_api_key")
        aside = tmp_path / "tenants.yaml.new"  # as an editor or the kubelet replaces it
        aside.write_text(yaml.safe_dump(
            {**TENANTS, digest("sk-team-c"): "team-c"}))
        os.replace(aside, table)
        await wait_until(lambda: any(e["event"] == "config_reloaded"
                                     for e in sluice.events()), what="the reload")
        assert await _call(session, sluice.url, new_key) == (200, "")
    [reloaded] = [e for e in sluice.events() if e["event"] == "config_reloaded"]
    assert reloaded["trigger"] == "file"


async def test_unknown_keys_can_go_to_a_configured_tenant(upstream, start_sluice):
    sluice = await start_sluice(
        {"identity": {"tenants": "env:SLUICE_TENANTS", "unknown_key_tenant": "guests"},
         "routes": [route("up", upstream.url, "openai")]},
        env={"SLUICE_TENANTS": json.dumps(TENANTS)})
    async with aiohttp.ClientSession() as session:
        for headers in ({"Authorization": "Bearer sk-new"}, {}, {"x-api-key": "sk-team-b"}):
            assert (await _call(session, sluice.url, headers))[0] == 200
        assert await _call(session, sluice.url, {"X-Tenant-ID": "team-a"}) == (
            403, "tenant_mismatch")
        # No key was sent, so the message may not speak of "the API key's" tenant.
        assert await _message(session, sluice.url, {"X-Tenant-ID": "team-a"}) == (
            403, "Sluice: the request names more than one tenant (X-Tenant-ID names another "
                 "tenant than identity.unknown_key_tenant, which a request without a known "
                 "API key gets: send a known key, or leave the header out)")
    await wait_until(lambda: sum(e["event"] == "completed" for e in sluice.events()) == 3,
                     what="3 completed events")
    assert [e["tenant"] for e in sluice.events() if e["event"] == "completed"] == [
        "guests", "guests", "team-b"]


async def test_a_key_in_any_header_or_query_field_an_upstream_reads_gives_its_tenant(
        upstream, start_sluice):
    """A security trial: identity read keys only from ``Authorization``, ``x-api-key`` and
    ``api-key``, so team-a's key sent as ``x-goog-api-key`` or ``?key=`` (which Gemini's
    OpenAI-compatible endpoint and Azure API Management take) was charged to
    ``unknown_key_tenant``: team-a escaped its own quota and spent the guests'."""
    sluice = await start_sluice(
        {"identity": {"tenants": "env:SLUICE_TENANTS", "unknown_key_tenant": "guests"},
         "routes": [route("up", upstream.url, "openai")]},
        env={"SLUICE_TENANTS": json.dumps(TENANTS)})
    sent = [({"x-goog-api-key": "sk-team-a"}, ""), ({"Ocp-Apim-Subscription-Key": "sk-team-a"}, ""),
            ({"X-Auth-Token": "sk-team-a"}, ""), ({}, "?key=sk-team-a"),
            ({}, "?api_key=sk-team-a"), ({}, "?Subscription-Key=sk-team-a"),
            ({}, "?%6Bey=sk-team-a")]
    async with aiohttp.ClientSession() as session:
        for headers, query in sent:
            async with session.post(sluice.url + CHAT + query, json=BODY,
                                    headers=headers) as r:
                assert r.status == 200, (headers, query)
        # Two keys of different tenants, wherever they are, as Authorization + x-api-key.
        # (A known key and a value not in the table is no mismatch: the value is ignored, see
        # test_values_not_in_the_table_beside_a_known_key_are_data_not_keys.)
        for headers, query in (({"Authorization": "Bearer sk-team-a"}, "?key=sk-team-b"),
                               ({"x-goog-api-key": "sk-team-b", "X-Tenant-ID": "team-a"}, "")):
            async with session.post(sluice.url + CHAT + query, json=BODY,
                                    headers=headers) as r:
                assert (r.status, r.headers.get("X-Sluice-Reason")) == (
                    403, "tenant_mismatch"), (headers, query)
        async with session.post(sluice.url + CHAT + "?key=sk-team-b", json=BODY,
                                headers={"x-api-key": "sk-team-a"}) as r:
            assert "the API keys in x-api-key and ?key give different tenants" in (
                await r.json())["error"]["message"]
    await wait_until(lambda: sum(e["event"] == "completed" for e in sluice.events())
                     == len(sent), what="the completed events")
    assert {e["tenant"] for e in sluice.events() if e["event"] == "completed"} == {"team-a"}
    assert len(upstream.requests) == len(sent)


@pytest.mark.parametrize("unknown_key_tenant", [None, "guests"])
async def test_values_not_in_the_table_beside_a_known_key_are_data_not_keys(
        upstream, start_sluice, unknown_key_tenant):
    """A review: once identity read every place a key can be, a caller authenticated by a
    known ``Authorization: Bearer`` key got 401 (``unknown_key_tenant: null``) or 403
    ``tenant_mismatch`` (set) when its request also carried ``?key=user123`` (a key-value
    tool's data), a third-party ``?apikey=`` or a tool server's own ``X-Auth-Token``. Values
    not in the table are ignored when a known key is sent (the caller is charged to that
    key's tenant: no quota escapes); with no known key, the unknown-key rule applies, so a
    made-up key in a header beside a real one in ``?key=`` is still charged to the real
    one's tenant (the bypass the places were added for stays closed)."""
    identity = {"tenants": "env:SLUICE_TENANTS",
                **({"unknown_key_tenant": unknown_key_tenant} if unknown_key_tenant else {})}
    sluice = await start_sluice(
        {"identity": identity, "routes": [route("kv", upstream.url, "http")]},
        env={"SLUICE_TENANTS": json.dumps(TENANTS)})
    bearer_a = {"Authorization": "Bearer sk-team-a"}
    admitted = [  # (headers, query) -> charged to team-a
        (bearer_a, "?key=user123"), (bearer_a, "?apikey=ow-123"),
        ({**bearer_a, "X-Auth-Token": "tool-server-token"}, ""),
        ({**bearer_a, "X-Tenant-ID": "team-a"}, "?key=user123"),
        ({"Authorization": "Bearer sk-made-up"}, "?key=sk-team-a"),
        ({"x-api-key": "sk-made-up", "X-Auth-Token": "t"}, "?api_key=sk-team-a&key=k")]
    async with aiohttp.ClientSession() as session:
        for headers, query in admitted:
            async with session.get(f"{sluice.url}/kv/get{query}", headers=headers) as r:
                assert r.status == 200, (headers, query)
        # Still refused: keys of two tenants; a tenant header naming another tenant.
        for headers, query in (({**bearer_a, "X-Auth-Token": "t"}, "?key=sk-team-b"),
                               ({**bearer_a, "X-Tenant-ID": "guests"}, "?key=user123")):
            async with session.get(f"{sluice.url}/kv/get{query}", headers=headers) as r:
                assert (r.status, r.headers.get("X-Sluice-Reason")) == (
                    403, "tenant_mismatch"), (headers, query)
        # No known key: the unknown-key rule, naming the first place of a value.
        async with session.get(f"{sluice.url}/kv/get?key=user123",
                               headers={"X-Auth-Token": "tool-server-token"}) as r:
            if unknown_key_tenant is None:
                assert (r.status, (await r.json())["error"]["message"]) == (
                    401, "Sluice could not tell the caller's tenant from an API key (the API "
                         "key in X-Auth-Token is not in identity.tenants)")
            else:
                assert r.status == 200
    completed = len(admitted) + (unknown_key_tenant is not None)
    await wait_until(lambda: sum(e["event"] == "completed" for e in sluice.events())
                     == completed, what="the completed events")
    assert [e["tenant"] for e in sluice.events() if e["event"] == "completed"] == (
        ["team-a"] * len(admitted) + ([unknown_key_tenant] if unknown_key_tenant else []))


def test_every_query_field_identity_reads_a_key_from_is_kept_from_dead_letters():
    """A key identity reads from the query is a credential to redaction too."""
    assert all(secret_query_field(name, "v") for name in API_KEY_QUERY_FIELDS)


@pytest.mark.parametrize("table, line, problem", [
    ("team-a: x\nsk-live-0123456789abcdef: team-a\n", 1, "not a SHA-256 hex digest"),
    (f"{digest('k')}: team a\n", 1, "visible ASCII"),
    (f"{digest('k')}: a\n{digest('k').upper()}: b\n", 2, "listed twice"),
    ("[a, b]\n", 1, "must be a mapping"),
    (f"{digest('k')}: a\nx: " + "[" * 5_000 + "]" * 5_000 + "\n", 2, "nested too deeply"),
])
def test_check_config_validates_the_tenants_file_without_echoing_keys(
        tmp_path, capsys, table, line, problem):
    (tmp_path / "tenants.yaml").write_text(table)
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({
        "identity": {"tenants": "tenants.yaml"},
        "routes": [route("up", "http://127.0.0.1:1", "openai")]}))
    assert main(["check-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'tenants.yaml'}:{line}: identity.tenants: " in err
    assert problem in err
    assert "sk-live" not in err


def test_check_config_names_a_missing_tenants_source(tmp_path, capsys):
    config = tmp_path / "sluice.yaml"
    config.write_text("identity:\n  tenants: nowhere.yaml\nroutes:\n"
                      "  - {name: up, path_prefix: /up/, upstream: 'http://127.0.0.1:1'}\n")
    assert main(["check-config", str(config)]) == 2
    # Not a Python object (it said "cannot read PosixPath(...)"), nor the value: it may be
    # an API key pasted where the path belongs.
    assert (f"{config}:2: identity.tenants: cannot read the file it names: No such file or "
            f"directory (a path relative to the config file's directory, {tmp_path}, with no "
            "directory part: if the value is the secret itself, write it to a file and name "
            "that file)\n" == capsys.readouterr().err)
    config.write_text("identity:\n  unknown_key_tenant: guests\nroutes:\n"
                      "  - {name: up, path_prefix: /up/, upstream: 'http://127.0.0.1:1'}\n")
    assert main(["check-config", str(config)]) == 2
    assert "unknown_key_tenant has no effect without tenants" in capsys.readouterr().err


async def test_naming_a_tenants_file_in_a_running_config_reloads_once(upstream, start_sluice,
                                                                      tmp_path):
    """The watcher compared the files the old config named: a table named by the edit read
    as changed at the next poll, and the config was reloaded a second time (a new user's
    trial and a review)."""
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    sluice = await start_sluice({"routes": [route("up", upstream.url, "openai")]})
    data = yaml.safe_load(sluice.config_path.read_text())
    data["identity"] = {"tenants": "tenants.yaml"}
    aside = sluice.config_path.with_suffix(".new")
    aside.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(aside, sluice.config_path)
    await wait_until(lambda: any(e["event"] == "config_reloaded" for e in sluice.events()),
                     what="the reload")
    await asyncio.sleep(3.0)  # three more polls of the files: nothing else follows
    assert sum(e["event"] == "config_reloaded" for e in sluice.events()) == 1
    async with aiohttp.ClientSession() as session:
        assert await _call(session, sluice.url, {"Authorization": "Bearer sk-team-a"}) == (
            200, "")
    assert await sluice.metric("sluice_config_reloads_total") == 1


@pytest.mark.parametrize("table", ["", "# keys go here\n", "{}\n"])
def test_an_empty_tenants_table_is_refused_unless_unknown_keys_have_a_tenant(
        tmp_path, capsys, table):
    """An empty table passed check-config and a reload (logged only as "other sections
    changed: identity"), after which every caller was refused 401 ``unknown_api_key``: an
    empty secret, or a file caught half-written, refusing all traffic with nothing in the
    log (a new user's trial, round 35). Refused now, unless unknown keys have a tenant."""
    (tmp_path / "tenants.yaml").write_text(table)
    config = tmp_path / "sluice.yaml"
    config.write_text("identity:\n  tenants: tenants.yaml\nroutes:\n"
                      "  - {name: up, path_prefix: /up/, upstream: 'http://127.0.0.1:1'}\n")
    assert main(["check-config", str(config)]) == 2
    assert (f"{config}:2: identity.tenants: the table holds no API key, so every caller "
            "would be refused" in capsys.readouterr().err)
    config.write_text("identity:\n  tenants: tenants.yaml\n  unknown_key_tenant: guests\n"
                      "routes:\n"
                      "  - {name: up, path_prefix: /up/, upstream: 'http://127.0.0.1:1'}\n")
    assert main(["check-config", str(config)]) == 0
