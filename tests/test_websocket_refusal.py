"""A WebSocket handshake is refused 501 ``websocket_not_supported`` at once, never forwarded.

Sluice relays no WebSocket (the OpenAI Realtime API's ``wss://.../v1/realtime``, say), and
``Upgrade`` is hop-by-hop: forwarded, the handshake went upstream as a plain GET and the
client got the upstream's puzzling 400.
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.conftest import raw_request, route


async def test_websocket_client_gets_sluices_refusal_and_upstream_sees_nothing(
        upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, "openai", concurrency={"limit": 1, "queue": 0}),
        route("tools", upstream.url, "http")]})
    async with aiohttp.ClientSession() as session:
        for path in ("/openai/v1/realtime?model=gpt-realtime", "/tools/ws"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(sluice.url + path,
                                         headers={"Authorization": "Bearer sk-test"})
            assert refused.value.status == 501
            assert refused.value.headers["X-Sluice-Reason"] == "websocket_not_supported"
            assert refused.value.headers["x-should-retry"] == "false"
    assert upstream.requests == []
    assert await sluice.metric("sluice_rejections_total", route="openai",
                               reason="websocket_not_supported") == 1
    assert await sluice.metric("sluice_inflight_requests", route="openai") == 0


async def test_refusal_body_and_other_upgrades(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("tools", upstream.url, "http")]})
    raw = await raw_request(sluice.port, (
        b"GET /tools/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
        b"Upgrade: h2c, WebSocket/13\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nConnection: close\r\n\r\n"))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501 ")
    error = json.loads(body)["error"]
    assert error["reason"] == "websocket_not_supported"
    assert "Sluice does not relay WebSockets" in error["message"]
    # Another protocol is ignored, as before: served over HTTP/1.1, Upgrade not forwarded.
    async with aiohttp.ClientSession() as session:
        async with session.get(sluice.url + "/tools/h2c",
                               headers={"Connection": "Upgrade", "Upgrade": "h2c"}) as r:
            assert r.status == 200
        # A request with a body is no handshake (one is a GET sent without): its Upgrade is
        # ignored as h2c's is, and it is served.
        async with session.post(sluice.url + "/tools/posted", data=b"{}",
                                headers={"Connection": "Upgrade", "Upgrade": "websocket"}) as r:
            assert r.status == 200
    assert [seen.path_qs for seen in upstream.requests] == ["/h2c", "/posted"]
    assert all("Upgrade" not in seen.headers for seen in upstream.requests)


_HANDSHAKE = (b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")


async def test_chunked_handshake_refused_and_http_1_0_upgrade_ignored(upstream, start_sluice):
    """A chunked request asking for a WebSocket is refused whatever its body (an empty one
    had a body hold, and went upstream as a plain GET); a chunked one with another Upgrade
    is served with its body; an HTTP/1.0 request's Upgrade is ignored (RFC 9110 §7.8: a
    server MUST), and it is served."""
    sluice = await start_sluice({"routes": [route("tools", upstream.url, "http")]})

    async def status(data: bytes) -> bytes:
        return (await raw_request(sluice.port, data)).partition(b"\r\n")[0]

    chunked = b"Transfer-Encoding: chunked\r\nConnection: close\r\n"
    assert await status(b"GET /tools/empty HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Upgrade: websocket\r\n" + _HANDSHAKE + chunked
                        + b"\r\n0\r\n\r\n") == b"HTTP/1.1 501 Not Implemented"
    assert await status(b"POST /tools/full HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Upgrade: websocket\r\n" + chunked
                        + b"\r\n2\r\n{}\r\n0\r\n\r\n") == b"HTTP/1.1 501 Not Implemented"
    assert await status(b"POST /tools/h2c HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Upgrade: h2c\r\n" + chunked
                        + b"\r\n2\r\n{}\r\n0\r\n\r\n") == b"HTTP/1.1 200 OK"
    assert await status(b"GET /tools/h10 HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                        b"Upgrade: websocket\r\n" + _HANDSHAKE + b"\r\n") == b"HTTP/1.0 200 OK"
    assert [(seen.path_qs, seen.body) for seen in upstream.requests] == [
        ("/h2c", b"{}"), ("/h10", b"")]
    assert await sluice.metric("sluice_rejections_total", route="tools",
                               reason="websocket_not_supported") == 2
    assert await sluice.metric("sluice_buffered_request_bytes") == 0
