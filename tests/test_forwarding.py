"""Forwarding: what reaches the upstream and what comes back, byte for byte.

Requests an HTTP client library would tidy up (hop-by-hop headers, absolute-form targets,
dot-segments) are written by hand over a raw socket, so Sluice sees exactly what a hostile or
sloppy caller could send.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import re

import aiohttp
import pytest
from yarl import URL

from tests.conftest import free_port, raw_request, route, wait_until
from tests.fakeupstream import GZIP_BODY, RawUpstream

QUERY = "?a=1&b=%2F%20x&c=&d=x%3Dy&e=%E2%82%AC"
BODY = bytes(range(256)) * 8  # every byte value, not valid UTF-8 or JSON


def _status_and_headers(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


async def test_prefix_stripped_base_path_kept_method_query_body_exact(upstream, start_sluice):
    sluice = await start_sluice(
        {"routes": [route("svc", upstream.url + "/base/v1", "http")]}
    )
    url = URL(f"{sluice.url}/svc/things/42{QUERY}", encoded=True)
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    async with aiohttp.ClientSession() as session:
        for method in methods:
            async with session.request(
                method, url, data=BODY, headers={"Content-Type": "application/octet-stream"}
            ) as r:
                assert r.status == 200
                assert (await r.json())["body_len"] == len(BODY)
    assert [seen.method for seen in upstream.requests] == methods
    for seen in upstream.requests:
        assert seen.raw_path == f"/base/v1/things/42{QUERY}"
        assert seen.body == BODY
        assert seen.headers["Content-Length"] == str(len(BODY))


async def test_request_hop_by_hop_headers_dropped_end_to_end_kept(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    request = (
        b"POST /svc/h HTTP/1.1\r\n"
        b"Host: 127.0.0.1\r\n"
        b"Connection: close, X-Hop-Secret\r\n"
        b"X-Hop-Secret: must-not-pass\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"TE: trailers\r\n"
        b"Trailer: X-Checksum\r\n"
        b"Upgrade: h2c\r\n"
        b"Proxy-Authorization: Basic Zm9vOmJhcg==\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"Authorization: Bearer sk-test-passes-through\r\n"
        b"X-Forwarded-For: 203.0.113.7\r\n"
        b"X-End-To-End: kept\r\n"
        b"X-Forwarded-For: 198.51.100.2\r\n"  # a second line of the same list
        b"Transfer-Encoding: chunked\r\n"
        b"\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    status, _, _ = _status_and_headers(await raw_request(sluice.port, request))
    assert status == 200
    [seen] = upstream.requests
    got = {name.lower(): value for name, value in seen.headers.items()}
    for hop in ("connection", "x-hop-secret", "keep-alive", "te", "trailer", "upgrade",
                "proxy-authorization", "proxy-connection", "transfer-encoding"):
        assert hop not in got, hop
    assert got["host"] == f"127.0.0.1:{upstream.port}"
    assert got["authorization"] == "Bearer sk-test-passes-through"
    assert got["x-forwarded-for"] == "203.0.113.7, 198.51.100.2, 127.0.0.1"
    assert got["x-end-to-end"] == "kept"
    # An empty line names no hop (a review: it became a leading empty member).
    await raw_request(sluice.port, b"GET /svc/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"X-Forwarded-For:\r\nConnection: close\r\n\r\n")
    assert upstream.requests[-1].headers["X-Forwarded-For"] == "127.0.0.1"
    assert seen.body == b"hello world"
    assert got["content-length"] == "11"


async def test_fields_named_in_connection_are_each_requests_own(upstream, start_sluice):
    """What one request's Connection lines name is dropped from that request only (the named
    set is cached by value), and a name on a second Connection line counts too."""
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    for connection in (b"Connection: close, X-A\r\n", b"Connection: close\r\nConnection: X-B\r\n"):
        answer = await raw_request(sluice.port, b"GET /svc/c HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   + connection + b"X-A: a\r\nX-B: b\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200")
    first, second = upstream.requests
    assert "X-A" not in first.headers
    assert first.headers["X-B"] == "b"
    assert second.headers["X-A"] == "a"
    assert "X-B" not in second.headers


async def test_request_headers_to_remove_stay_with_sluice(upstream, start_sluice):
    """A new user's trial: X-Tenant-ID and X-Run-ID went on to the provider. A route's
    request_headers_to_remove keeps them (any case) from it; Sluice still reads them, and its
    own Idempotency-Key is set after, even when listed."""
    sluice = await start_sluice({"routes": [route(
        "svc", upstream.url, "http", idempotency={"mode": "forward"},
        request_headers_to_remove=["X-Tenant-ID", "x-run-id", "Idempotency-Key"])]})
    async with aiohttp.ClientSession() as session, session.post(
            sluice.url + "/svc/x", json={}, headers={"x-tenant-id": "acme", "X-Run-ID": "r1",
                                                     "X-Step-ID": "s1"}) as r:
        assert r.status == 200
    [seen] = upstream.requests
    assert "X-Tenant-ID" not in seen.headers and "X-Run-ID" not in seen.headers
    assert seen.headers["X-Step-ID"] == "s1" and seen.headers["Idempotency-Key"]
    await wait_until(lambda: any(e["event"] == "completed" for e in sluice.events()),
                     what="the completed event")
    [done] = [e for e in sluice.events() if e["event"] == "completed"]
    assert (done["tenant"], done["run"]) == ("acme", "r1")


async def test_underscore_look_alikes_of_fields_sluice_drops_or_sets_are_dropped(
        upstream, start_sluice):
    """A hostile trial: ``Transfer_Encoding: chunked`` went upstream beside the
    ``Content-Length`` Sluice writes, and CGI/WSGI servers fold ``_`` into ``-``: two
    framings. A field whose ``-`` spelling Sluice drops (hop-by-hop, framing, a route's
    ``request_headers_to_remove``) or sets (``X-Forwarded-For``, ``Idempotency-Key``) goes
    nowhere in its ``_`` spelling either; other names with ``_`` pass."""
    sluice = await start_sluice({"routes": [route(
        "svc", upstream.url, "http", request_headers_to_remove=["X-Debug"])]})
    answer = await raw_request(sluice.port, (
        b"POST /svc/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
        b"Transfer_Encoding: chunked\r\nContent_Length: 40\r\nCONTENT_length: 41\r\n"
        b"Keep_Alive: 1\r\nIdempotency_Key: k\r\nX_Forwarded_For: 10.0.0.1\r\nx_debug: 1\r\n"
        b"X_Custom: kept\r\nConnection: close\r\n\r\n0\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    [seen] = upstream.requests
    assert seen.body == b"0\r\n\r\n"
    assert sorted((name.lower(), value) for name, value in seen.headers.items()) == [
        ("content-length", "5"), ("host", f"127.0.0.1:{upstream.port}"),
        ("x-forwarded-for", "127.0.0.1"), ("x_custom", "kept")]


async def test_x_forwarded_for_set_when_absent(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    async with aiohttp.ClientSession() as session, session.get(sluice.url + "/svc/x") as r:
        assert r.status == 200
    assert upstream.requests[0].headers["X-Forwarded-For"] == "127.0.0.1"


async def test_sluice_adds_no_header_of_its_own_but_x_forwarded_for(upstream, start_sluice):
    """aiohttp's client would add Accept, Accept-Encoding, User-Agent and a Content-Type."""
    sluice = await start_sluice({"routes": [route("up", upstream.url, "http")]})
    answer = await raw_request(sluice.port, (
        b"POST /up/bare HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
        b"Connection: close\r\n\r\nhello"))
    assert answer.startswith(b"HTTP/1.1 200")
    [seen] = upstream.requests
    assert seen.body == b"hello"
    assert sorted(name.lower() for name in seen.headers) == [
        "content-length", "host", "x-forwarded-for"]


async def test_response_hop_by_hop_headers_dropped(start_sluice):
    raw = await RawUpstream(
        b"HTTP/1.1 200 OK\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: 11\r\n"
        b"Connection: close, X-Hop-Resp\r\n"
        b"X-Hop-Resp: must-not-pass\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"Proxy-Authenticate: Basic realm=x\r\n"
        b"Proxy-Connection: close\r\n"
        b"Upgrade: h2c\r\n"
        b"Trailer: X-T\r\n"
        b"X-End-To-End: kept\r\n"
        b"\r\n"
        b'{"ok":true}'
    ).start()
    try:
        sluice = await start_sluice({"routes": [route("svc", raw.url, "http")]})
        answer = await raw_request(
            sluice.port, b"GET /svc/x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
    finally:
        await raw.stop()
    status, headers, body = _status_and_headers(answer)
    assert status == 200
    assert body == b'{"ok":true}'
    assert headers["x-end-to-end"] == "kept"
    assert headers["content-length"] == "11"
    for hop in ("x-hop-resp", "keep-alive", "proxy-authenticate", "proxy-connection",
                "upgrade", "trailer"):
        assert hop not in headers, hop
    assert "x-hop-resp" not in headers.get("connection", "").lower()


async def test_chunked_response_reframed_not_forwarded(start_sluice):
    raw = await RawUpstream(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: X-Hop\r\nX-Hop: 1\r\n\r\n"
        b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
    ).start()
    try:
        sluice = await start_sluice({"routes": [route("svc", raw.url, "http")]})
        async with aiohttp.ClientSession() as session, session.get(sluice.url + "/svc/x") as r:
            assert r.status == 200
            assert await r.read() == b"abcdefg"
            assert "X-Hop" not in r.headers
    finally:
        await raw.stop()


async def test_an_answer_without_content_type_is_relayed_without_one(start_sluice):
    """A hostile trial: an upstream answer with no ``Content-Type`` reached the caller with
    ``application/octet-stream`` (aiohttp's default for a body), which the upstream never
    said; Envoy and HAProxy add none. Neither a whole answer, a streamed one nor a replay of
    a kept one gets one now; an answer that has one keeps it."""
    whole = await RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nreal").start()
    streamed = await RawUpstream(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"4\r\nreal\r\n0\r\n\r\n").start()
    typed = await RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                              b"Content-Length: 4\r\n\r\nreal").start()
    try:
        sluice = await start_sluice({"routes": [
            route("whole", whole.url, "http", idempotency={"mode": "dedup"}),
            route("streamed", streamed.url, "http"), route("typed", typed.url, "http")]})
        heads = []
        for path, extra in (("/whole/x", b"Idempotency-Key: k1\r\n"),
                            ("/whole/x", b"Idempotency-Key: k1\r\n"),  # a replay
                            ("/streamed/x", b""), ("/typed/x", b"")):
            answer = await raw_request(sluice.port, b"POST " + path.encode() + b" HTTP/1.1\r\n"
                                       b"Host: 127.0.0.1\r\nContent-Length: 2\r\n" + extra
                                       + b"Connection: close\r\n\r\n{}")
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"real" in body, (path, answer)
            heads.append(head)
        assert [re.findall(rb"(?im)^content-type:[^\r]*", head) for head in heads] == [
            [], [], [], [b"Content-Type: text/plain"]]
        assert b"Idempotent-Replayed: true" in heads[1]
        assert len(whole.requests) == 1  # the second was a replay
    finally:
        for raw in (whole, streamed, typed):
            await raw.stop()


@pytest.mark.parametrize("coding", [b"gzip", b"chunked, gzip", b"gzip, chunked"])
async def test_an_answer_with_a_transfer_coding_besides_chunked_is_refused(start_sluice,
                                                                          coding):
    """A hostile trial: ``Transfer-Encoding: gzip`` was dropped (hop-by-hop) and the gzip
    bytes relayed as the plain body; ``chunked, gzip`` sent the chunks' own framing as the
    body, then no end. Refused as a request with one is."""
    body = (b"3\r\nabc\r\n0\r\n\r\n" if coding.endswith(b"chunked")
            else gzip.compress(b'{"id": 1}'))
    raw = await RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                            b"Transfer-Encoding: " + coding + b"\r\nConnection: close\r\n\r\n"
                            + body).start()
    try:
        sluice = await start_sluice({"routes": [route("svc", raw.url, "http")]})
        async with aiohttp.ClientSession() as session, session.get(sluice.url + "/svc/x") as r:
            assert (r.status, r.headers["X-Sluice-Reason"]) == (502, "upstream_unreachable")
            assert "transfer coding other than chunked" in (await r.json())["error"]["message"]
    finally:
        await raw.stop()


async def test_gzip_bytes_and_content_encoding_pass_through(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        for path, length in (("/svc/gzip", str(len(GZIP_BODY))), ("/svc/gzip?stream", None)):
            async with session.get(sluice.url + path,
                                   headers={"Accept-Encoding": "gzip"}) as r:
                assert r.status == 200
                assert r.headers["Content-Encoding"] == "gzip"
                assert r.headers.get("Content-Length") == length
                assert await r.read() == GZIP_BODY
        # A compressed request body goes up as sent, with its Content-Encoding.
        async with session.post(sluice.url + "/svc/upload", data=GZIP_BODY,
                                headers={"Content-Encoding": "gzip"}) as r:
            assert r.status == 200
    assert [s.headers["Accept-Encoding"] for s in upstream.requests[:2]] == ["gzip"] * 2
    assert upstream.requests[2].body == GZIP_BODY
    assert upstream.requests[2].headers["Content-Encoding"] == "gzip"


async def test_authorization_passes_through_and_is_never_logged(upstream, start_sluice):
    secret = "sk-live-Zq8vK2sEcReT"
    closed = f"http://127.0.0.1:{free_port()}"  # bound then released: refused
    sluice = await start_sluice({"routes": [
        route("svc", upstream.url, "openai"),
        route("dead", closed, "openai"),
    ]})
    headers = {"Authorization": f"Bearer {secret}", "x-api-key": secret}
    async with aiohttp.ClientSession() as session:
        for path, fake_status, expect in (("/svc/v1/chat/completions", None, 200),
                                          ("/svc/v1/chat/completions", "500", 500),
                                          ("/dead/v1/chat/completions", None, 502)):
            extra = {"x-fake-status": fake_status} if fake_status else {}
            async with session.post(sluice.url + path, json={"model": "m", "messages": []},
                                    headers={**headers, **extra}) as r:
                assert r.status == expect
    # Malformed requests are refused by aiohttp's parser, whose error names the offending line:
    # a key with a stray control character, or one in a query string.
    for malformed in (b"GET /svc/x HTTP/1.1\r\nAuthorization: Bearer %s\x01\r\n",
                      b"GET /svc/x HTTP/1.1\r\nx-api-key: %s\rx\r\n",
                      b"GET /svc/x?key=%s\x7f HTTP/1.1\r\n"):
        answer = await raw_request(sluice.port, malformed % secret.encode()
                                   + b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    assert [s.headers["Authorization"] for s in upstream.requests] == [f"Bearer {secret}"] * 2
    await wait_until(lambda: sum(e["event"] == "completed" for e in sluice.events()) == 3,
                     what="3 completed events")
    assert secret not in sluice.events_path.read_text()
    await sluice.stop()  # a refusal like an earlier one is counted in a line at shutdown
    logged = [line for line in sluice.stderr().splitlines() if "Error handling request" in line]
    first = [line for line in logged if "more like it held back" not in line]
    held = sum(int(n) for line in logged for n in re.findall(r"\((\d+) more like it", line))
    assert len(first) + held == 3, "\n".join(logged)
    assert secret not in sluice.stderr()


async def test_unknown_prefix_is_404_with_reason(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "openai"),
                                            route("mcp", upstream.url, "mcp")]})
    async with aiohttp.ClientSession() as session:
        for path in ("/nope/v1/chat/completions", "/svc", "/", "/SVC/x"):
            async with session.post(sluice.url + path, json={}) as r:
                assert r.status == 404, path
                assert r.headers["X-Sluice-Reason"] == "no_route"
                body = await r.json()
                assert body["error"]["reason"] == "no_route"
                # The path asked, then where to point (a new user read the path alone, in
                # brackets after "its routes", as the list of routes).
                assert body["error"]["message"] == (
                    f"Sluice: no route matches this path ({path}; Sluice forwards only under "
                    "its routes' prefixes: /svc/, /mcp/)")
    assert upstream.requests == []


async def test_absolute_uri_is_404_and_never_proxied(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    for line in (b"GET http://evil.example/ HTTP/1.1",
                 b"GET http://evil.example/svc/x HTTP/1.1",
                 b"GET http://127.0.0.1:%d/svc/x HTTP/1.1" % upstream.port):
        answer = await raw_request(
            sluice.port, line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        status, headers, body = _status_and_headers(answer)
        assert status == 404, line
        assert headers["x-sluice-reason"] == "no_route"
        assert b"absolute-form" in body
    # Named for what they are (a hostile trial: they were said to be absolute-form).
    for line, said in ((b"CONNECT evil.example:443 HTTP/1.1", b"CONNECT is not served"),
                       (b"OPTIONS * HTTP/1.1", b"a request target of * is not served"),
                       # On a route's path: it went upstream as CONNECT <upstream's host:port>,
                       # its path gone, and the caller got a bodiless 200 (a hostile trial).
                       (b"CONNECT /svc/v1/x HTTP/1.1", b"CONNECT is not served")):
        answer = await raw_request(
            sluice.port, line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        status, headers, body = _status_and_headers(answer)
        assert (status, headers["x-sluice-reason"]) == (404, "no_route"), line
        assert said in body
    assert upstream.requests == []


async def test_dot_segments_refused_dots_inside_segments_forwarded(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    for target, status in ((b"/svc/../admin", 400),
                           (b"/svc/a/../../admin", 400),
                           (b"/svc/./x", 400),
                           (b"/svc/%2e%2e/admin", 400),
                           (b"/svc/%2E%2e/admin", 400),
                           (b"/svc/.%2e/admin?x=1", 400),
                           (b"/svc/x/..", 400),
                           (b"/svc/..\\admin", 400),  # a backslash splits segments on IIS
                           (b"/svc/a%5c..%5cadmin", 400),
                           # Tomcat, Jetty and Spring drop ;params before resolving, and an
                           # upstream decoding twice reads %252e as a dot (a hostile trial).
                           (b"/svc/..;/admin", 400),
                           (b"/svc/.;/..;/admin", 400),
                           (b"/svc/..;jsessionid=1/admin", 400),
                           (b"/svc/%2e%2e;x/admin", 400),
                           (b"/svc/%252e%252e/admin", 400),
                           (b"/svc/%252E./admin", 400),
                           (b"/other/../svc/x", 404)):
        answer = await raw_request(
            sluice.port,
            b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        )
        got, headers, _ = _status_and_headers(answer)
        assert got == status, target
        assert headers["x-sluice-reason"] == ("bad_request" if status == 400 else "no_route")
        assert headers["x-should-retry"] == "false", target  # as sent, it never succeeds
    assert upstream.requests == []
    async with aiohttp.ClientSession() as session, session.get(
        URL(sluice.url + "/svc/v1/file.v2..json?q=../x", encoded=True)
    ) as r:
        assert r.status == 200
        # Parameters and %25 in a path that resolves to no dot-segment pass as sent.
        for path in ("/v1/a;b=1/..x;/50%25", "/v1/%252e%252ex/.%25"):
            async with session.get(URL(sluice.url + "/svc" + path, encoded=True)) as r:
                assert r.status == 200, path
    assert [seen.raw_path for seen in upstream.requests] == [
        "/v1/file.v2..json?q=../x", "/v1/a;b=1/..x;/50%25", "/v1/%252e%252ex/.%25"]


async def test_body_over_max_request_bytes_is_413_in_protocol_shape(upstream, start_sluice):
    sluice = await start_sluice({
        "server": {"max_request_bytes": 1024},
        "routes": [route(p, upstream.url, p) for p in ("openai", "anthropic", "http")],
    })
    bodies = {}
    async with aiohttp.ClientSession() as session:
        for protocol in ("openai", "anthropic", "http"):
            url = f"{sluice.url}/{protocol}/upload"
            async with session.post(url, data=b"x" * 1024) as r:
                assert r.status == 200  # exactly the limit is allowed
            async with session.post(url, data=b"x" * 4096) as r:
                assert r.status == 413
                assert r.headers["X-Sluice-Reason"] == "request_too_large"
                bodies[protocol] = await r.json()
    assert len(upstream.requests) == 3
    assert bodies["openai"]["error"]["code"] == "request_too_large"
    assert bodies["openai"]["error"]["type"] == "invalid_request_error"
    assert "1024" in bodies["openai"]["error"]["message"]
    assert bodies["anthropic"]["type"] == "error"
    assert bodies["anthropic"]["error"]["type"] == "request_too_large"
    assert bodies["http"]["error"]["reason"] == "request_too_large"


async def test_a_502_says_whether_the_upstream_was_reached_or_answered_unreadably(
        start_sluice):
    """Seen (new-user trial): an upstream that answered garbage got "the upstream could not be
    reached (ClientResponseError)". Now a 502 says which happened, never quoting the
    upstream's bytes."""
    raw = await RawUpstream(b"").start()
    closed = free_port()  # nothing listens there
    try:
        sluice = await start_sluice({"routes": [
            route("svc", raw.url, "openai"),
            route("gone", f"http://127.0.0.1:{closed}", "openai")]})
        async with aiohttp.ClientSession() as session:
            for path, response, detail in (
                ("/gone/x", b"", "(could not connect to it: connection refused)"),
                ("/svc/x", b"", "(it closed the connection without answering)"),
                ("/svc/x", b"SECRETISH garbage\r\n\r\n",
                 "(it answered, but not in valid HTTP: its answer does not begin with an HTTP "
                 "status line)"),
                ("/svc/x", b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
                 "(it answered, but not in valid HTTP: its status code is not three digits)"),
                ("/svc/x", b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
                 "(it answered, but not in valid HTTP: a status or header line is over 8190 "
                 "bytes)"),
            ):
                raw.response = response
                async with session.get(sluice.url + path) as r:
                    assert (r.status, r.headers["X-Sluice-Reason"]) == (502,
                                                                         "upstream_unreachable")
                    message = (await r.json())["error"]["message"]
                assert message == ("Sluice: the upstream gave no answer Sluice could relay "
                                   + detail), message
                assert "SECRETISH" not in message and "aaaa" not in message
    finally:
        await raw.stop()


async def test_answers_that_cannot_be_relayed_become_502(start_sluice):
    """Statuses outside 200-599 and header values aiohttp refuses to write get a clean 502."""
    raw = await RawUpstream(b"").start()
    try:
        sluice = await start_sluice({"routes": [route("svc", raw.url, "openai")]})
        async with aiohttp.ClientSession() as session:
            for response, detail in (
                (b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\nok",
                 "it answered with status 999, which is not valid HTTP (100-599)"),
                (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n"
                 b"\r\n", "it answered with status 101, which Sluice does not relay"),
                (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Bad: a\x01b\r\n\r\nok",
                 "control characters"),
                (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Bad: a\x01b\r\n\r\n"
                 b"2\r\nok\r\n0\r\n\r\n", "control characters"),
            ):
                raw.response = response
                async with session.get(sluice.url + "/svc/x") as r:
                    assert r.status == 502
                    assert r.headers["X-Sluice-Reason"] == "upstream_unreachable"
                    error = (await r.json())["error"]
                    assert error["code"] == "upstream_unreachable"
                    assert detail in error["message"]
            await sluice.wait_metric("sluice_inflight_requests", 0, route="svc")
            assert await sluice.metric("sluice_requests_total", route="svc",
                                       outcome="upstream_error") == 4
    finally:
        await raw.stop()
    assert "Traceback" not in sluice.stderr()


async def test_an_overlong_tenant_or_run_id_is_a_clear_400(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("up", upstream.url, "openai")]})
    async with aiohttp.ClientSession() as session:
        for header in ("X-Tenant-ID", "X-Run-ID"):
            async with session.post(sluice.url + "/up/v1/chat/completions", json={},
                                    headers={header: "t" * 129}) as r:
                assert r.status == 400 and r.headers["X-Sluice-Reason"] == "bad_request"
                assert "at most 128 characters" in (await r.json())["error"]["message"]
        async with session.post(sluice.url + "/up/v1/chat/completions", json={},
                                headers={"X-Tenant-ID": "t" * 128}) as r:
            assert r.status == 200
    assert len(upstream.requests) == 1


async def test_a_route_with_credentials_in_its_upstream_url_sends_them_not_the_callers(
        upstream, start_sluice):
    """An upstream URL with user info is sent as HTTP Basic credentials; with a caller's
    own Authorization too (the SDKs always send one), aiohttp refused every call: 502, an
    attempt counted and the budget charged, though nothing was sent (a hostile trial)."""
    sluice = await start_sluice({"routes": [route(
        "svc", f"http://svc:hunter2@127.0.0.1:{upstream.port}", "http")]})
    async with aiohttp.ClientSession() as session:
        for headers in ({"Authorization": "Bearer sk-caller"}, {}):
            async with session.get(sluice.url + "/svc/x", headers=headers) as r:
                assert r.status == 200
    basic = "Basic " + base64.b64encode(b"svc:hunter2").decode()
    assert [seen.headers["Authorization"] for seen in upstream.requests] == [basic, basic]


class _StrayAnswers:
    """A keep-alive upstream that answers each request with its own path, and after the one
    for ``/evil`` sends a second answer nobody asked for: ``late`` seconds after it, or in
    the same write after an answer too big to be held whole (Sluice streams it)."""

    def __init__(self, late: float | None) -> None:
        self.late = late
        self.connections = 0
        self.strays = 0  # stray answers written
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> _StrayAnswers:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @staticmethod
    def _answer(body: bytes) -> bytes:
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                stray = self._answer(b'{"answer_for": "STRAY"}')
                if path.endswith(b"/evil") and self.late is None:
                    big = b'{"pad": "' + b"x" * 300_000 + b'"}'
                    writer.write(self._answer(big) + stray)
                    await writer.drain()
                    self.strays += 1
                    continue
                writer.write(self._answer(b'{"answer_for": "%s"}' % path))
                if path.endswith(b"/evil"):
                    await writer.drain()
                    await asyncio.sleep(self.late or 0)
                    writer.write(stray)
                    await writer.drain()
                    self.strays += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()


@pytest.mark.parametrize("late", [0.1, None], ids=["late", "same-write-after-a-big-answer"])
async def test_an_answer_nobody_asked_for_never_reaches_the_next_caller(start_sluice, late):
    """A hostile trial: an upstream sending a second, unrequested answer on a keep-alive
    connection shifted every later answer on it by one, across tenants (alice got the
    stray, bob alice's, ...), all counted 2xx. A pooled connection holding such bytes is
    closed when taken, never reused."""
    upstream = await _StrayAnswers(late).start()
    try:
        sluice = await start_sluice({"routes": [route("h", f"http://127.0.0.1:{upstream.port}",
                                                      "http")]})
        async with aiohttp.ClientSession() as session:
            async with session.get(sluice.url + "/h/evil") as r:
                assert r.status == 200
                await r.read()
            # The stray is written, and has a moment to reach the idle connection.
            await wait_until(lambda: upstream.strays == 1, what="the stray answer sent")
            await asyncio.sleep(0.1)
            for tenant in ("alice", "bob", "carol"):
                async with session.get(sluice.url + f"/h/{tenant}",
                                       headers={"X-Tenant-ID": tenant}) as r:
                    assert (r.status, await r.json()) == (200, {"answer_for": f"/{tenant}"})
        assert upstream.connections == 2  # the tainted one closed, a fresh one for the rest
    finally:
        await upstream.stop()


async def test_the_request_head_upstream_is_byte_for_byte_in_the_callers_order(start_sluice):
    """Host first (the upstream's own), then the caller's fields in its order and spelling,
    repeated lines kept apart, X-Forwarded-For and Idempotency-Key last, then the length:
    what ``VerbatimRequest.update_headers`` must write, whichever way it copies them."""
    raw = await RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                            b"Connection: close\r\n\r\nok").start()
    try:
        sluice = await start_sluice({"routes": [
            route("up", raw.url, "http", idempotency={"mode": "forward"})]})
        answer = await raw_request(sluice.port, (
            b"POST /up/head?q=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nx-lower: a\r\n"
            b"X-Twice: 1\r\nAuthorization: Bearer k\r\nX-Twice: 2\r\n"
            b"Content-Length: 5\r\nConnection: close\r\n\r\nhello"))
        assert answer.startswith(b"HTTP/1.1 200")
        [seen] = raw.requests
        head, _, body = seen.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        key = [line for line in lines if line.startswith(b"Idempotency-Key: ")]
        assert len(key) == 1
        assert lines == [
            b"POST /head?q=1 HTTP/1.1", f"Host: 127.0.0.1:{raw.port}".encode(),
            b"x-lower: a", b"X-Twice: 1", b"Authorization: Bearer k", b"X-Twice: 2",
            b"X-Forwarded-For: 127.0.0.1", key[0], b"Content-Length: 5"]
        assert body == b"hello"
    finally:
        await raw.stop()
