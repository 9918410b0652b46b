"""``Server``: a relayed answer carries exactly its upstream's, or ``sluice`` when it sent
none; Sluice's own answers say ``Server: sluice``. aiohttp's default (``Python/3.11
aiohttp/3.14.5``: the proxy's stack and versions, shown as the upstream's) reaches no caller.

Sluice sets that default once, as ``aiohttp.web_response.SERVER_SOFTWARE``
(:func:`proxy.server.serve`): these tests fail if aiohttp stops reading that name.
"""

from __future__ import annotations

import aiohttp
import yaml
from aiohttp import web_response
from aiohttp.http import SERVER_SOFTWARE
from yarl import URL

from proxy import server
from proxy.config import parse_config
from tests.conftest import free_ports, raw_request, route
from tests.fakeupstream import RawUpstream

_BODY = b'{"ok": true}'


def _answer(*fields: bytes, chunked: bool = False) -> bytes:
    framing = (b"Transfer-Encoding: chunked\r\n" if chunked
               else b"Content-Length: %d\r\n" % len(_BODY))
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_BODY), _BODY) if chunked else _BODY
    return b"HTTP/1.1 200 OK\r\n" + b"".join(f + b"\r\n" for f in fields) + framing \
        + b"Connection: close\r\n\r\n" + body


def _servers(raw: bytes) -> list[str]:
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    return [line.partition(":")[2].strip() for line in head
            if line.partition(":")[0].strip().lower() == "server"]


async def test_relayed_answers_carry_the_upstreams_server_or_sluice(start_sluice):
    json_type = b"Content-Type: application/json"
    upstreams = {
        "named": await RawUpstream(_answer(json_type, b"Server: uvicorn")).start(),
        "none": await RawUpstream(_answer(json_type)).start(),
        "untyped": await RawUpstream(_answer()).start(),
        "streamed": await RawUpstream(_answer(json_type, chunked=True)).start(),
        "streamed-named": await RawUpstream(
            _answer(b"Server: envoy", chunked=True)).start(),
        "replayed": await RawUpstream(_answer(json_type)).start(),
    }
    try:
        sluice = await start_sluice({"routes": [
            route(name, up.url, "http",
                  **({"idempotency": {"mode": "dedup"}} if name == "replayed" else {}))
            for name, up in upstreams.items()]})
        expected = {"named": ["uvicorn"], "none": ["sluice"], "untyped": ["sluice"],
                    "streamed": ["sluice"], "streamed-named": ["envoy"]}
        for name, servers in expected.items():
            raw = await raw_request(sluice.port, (
                f"GET /{name}/x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            ).encode())
            assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith((_BODY, b"0\r\n\r\n"))
            assert (name, _servers(raw)) == (name, servers)
        # The answer replayed from its key's record is the first one: the upstream sent no
        # Server, and the record keeps none, so both say sluice.
        for replayed in (False, True):
            raw = await raw_request(sluice.port, (
                b"POST /replayed/x HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: \"k1\"\r\n"
                b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"))
            assert (b"Idempotent-Replayed: true" in raw) is replayed
            assert _servers(raw) == ["sluice"]
    finally:
        for up in upstreams.values():
            await up.stop()


async def test_sluices_own_answers_say_sluice(upstream, start_sluice):
    sluice = await start_sluice({"server": {"header_timeout": "1s"},
                                 "routes": [route("openai", upstream.url)]})
    async with aiohttp.ClientSession() as session:
        for url, status in ((sluice.url + "/nowhere", 404),  # refused at the door
                            (sluice.url + "/openai/v1/%2e%2e/x", 400),  # on the route
                            (sluice.admin_url + "/healthz", 200),
                            (sluice.admin_url + "/metrics", 200),
                            (sluice.admin_url + "/no-such-page", 404)):
            async with session.get(URL(url, encoded=True)) as r:
                assert (url, r.status, r.headers.getall("Server")) == (url, status, ["sluice"])
        # An answer relayed from an upstream that names itself keeps its name, even when
        # it is aiohttp's own (the fake upstream's, here).
        async with session.get(sluice.url + "/openai/v1/models") as r:
            assert r.headers.getall("Server") == [SERVER_SOFTWARE]
    # A head the parser refuses (the edge's answer), and one it never finished (the edge's
    # own bytes, written at header_timeout).
    raw = await raw_request(sluice.port, b"GET /openai/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                         b"Bad Header: x\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400 ") and _servers(raw) == ["sluice"]
    raw = await raw_request(sluice.port, b"GET /openai/x HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert raw.startswith(b"HTTP/1.1 408 ") and _servers(raw) == ["sluice"]



async def test_serve_in_process_gives_aiohttps_default_back(tmp_path, monkeypatch):
    # serve() names Sluice in aiohttp's module-wide default while it serves; it left it set
    # after it returned, for every other aiohttp server of the process.
    monkeypatch.setattr(web_response, "SERVER_SOFTWARE", "embedder/1")
    named: list[str] = []
    drain = server._drain

    async def drained(*args: object) -> None:  # serving, stopped at once: its drain
        named.append(web_response.SERVER_SOFTWARE)
        await drain(*args)

    monkeypatch.setattr(server, "_drain", drained)
    port, admin_port = free_ports(2)
    config = parse_config(yaml.safe_dump({
        "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin_port}"},
        "events": {"path": str(tmp_path / "events.jsonl")},
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
        "routes": [route("openai", "http://127.0.0.1:9")]}))
    await server.serve(config, stop_requested=lambda: True)
    assert named == [server.SERVER_NAME]
    assert web_response.SERVER_SOFTWARE == "embedder/1"
