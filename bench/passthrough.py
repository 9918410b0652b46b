"""The baseline for ``bench/overhead.py``: a bare aiohttp + uvloop pass-through proxy.

No policies, no metrics, no events, no routing: it strips ``--prefix`` from the path and
forwards method, path (byte for byte), headers and the buffered body to ``--upstream``, reads
the answer whole and sends it back. The bytes on the wire match Sluice's (``proxy/forward.py``):
hop-by-hop fields and every field named in ``Connection`` are dropped both ways, ``Host`` and
``Content-Length`` on the request, and ``X-Forwarded-For`` gets the caller's address.

It runs on exactly the stack and settings Sluice runs on, so "Sluice minus baseline" is what
Sluice itself adds and nothing else:

* server (``proxy/server.py``): aiohttp's low-level ``web.Server`` (no ``Application``, router,
  middleware or signals) with a ``request_factory``, ``handler_cancellation=True``,
  ``access_log=None``, ``auto_decompress=False``, under uvloop;
* client (``proxy/client.py``, ``proxy/runtime.py``): one ``ClientSession`` with no cookie jar,
  ``trust_env=False``, ``auto_decompress=False``, no headers of its own (the default headers
  are turned off in the request class, not by ``skip_auto_headers``, which is slower), Sluice's
  default route timeout (``connect`` 5 s, ``total`` 600 s), on a ``TCPConnector`` with
  ``limit=0``, ``ttl_dns_cache=60``, ``keepalive_timeout=4`` (``server.upstream_idle_timeout``);
* forwarding (``proxy/forward.py``): header copies less the dropped fields, found by a
  case-insensitive key-view intersection, the ``Connection``-named set cached by value; the
  request class copies the forwarded headers in C (aiohttp's ``update_headers`` adds them
  one by one in Python), each request target's upstream URL is built once, not per request
  (``proxy/routes.py`` ``Route.url``), and an answer read to its end is not ``release()``-d
  again;
* process (``proxy/server.py`` ``tune_gc``): startup's objects frozen out of the cyclic
  collector's sight, young collections every 10,000 allocations.

It imports nothing from Sluice, so a change there cannot make it slower; keep the two in step
by hand. By hand:

    python bench/passthrough.py --port 9002 --upstream http://127.0.0.1:9001 --prefix /openai
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import math
import signal
from collections.abc import Awaitable, Callable

import aiohttp
import uvloop
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "proxy-authenticate", "proxy-authorization"}
)
_DROP_REQUEST = _HOP_BY_HOP | {"host", "content-length"}
#: Sluice's defaults: ``server.max_request_bytes`` and a route's ``timeouts``.
MAX_REQUEST_BYTES = 32 * 1024 * 1024
#: Kept exact, not rounded up to a whole second, as Sluice keeps them (proxy/client.py).
TIMEOUT = aiohttp.ClientTimeout(total=600.0, connect=5.0, ceil_threshold=math.inf)
_NEVER_ADDED: CIMultiDict[None] = CIMultiDict(
    (name, None) for name in ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
)


class VerbatimRequest(aiohttp.ClientRequest):
    """A ``ClientRequest`` that adds no header of its own (as ``proxy.client`` does), and
    copies the caller's headers in C."""

    DEFAULT_HEADERS: dict[str, str] = {}

    def update_headers(self, headers: object) -> None:
        # aiohttp's own adds them one by one in Python (bench opcodes: ~128 a call, 5
        # headers); the same fields in the same order: Host first, then the caller's (which
        # never hold one).
        if not isinstance(headers, CIMultiDict) or hdrs.HOST in headers:
            super().update_headers(headers)  # type: ignore[arg-type]
            return
        self.headers = CIMultiDict(((hdrs.HOST, self.url.host_port_subcomponent),))
        self.headers.extend(headers)

    def update_auto_headers(self, skip_auto_headers: object) -> None:
        self._skip_auto_headers = _NEVER_ADDED


def _without(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """A copy of ``headers`` less ``drop`` and the fields ``Connection`` names, found as
    ``proxy/forward.py`` finds them: the named set cached by value, a case-insensitive
    key-view intersection (in C)."""
    out = headers.copy()
    connection = headers.get(hdrs.CONNECTION)
    if connection:
        drop = _dropped(drop, connection)
    for name in headers.keys() & drop:
        out.popall(name, None)
    return out


@functools.lru_cache(maxsize=256)
def _dropped(drop: frozenset[str], connection: str) -> frozenset[str]:
    return drop | {token.strip().lower() for token in connection.split(",")}


def make_handler(session: aiohttp.ClientSession, upstream: str,
                 prefix: str) -> Callable[[web.BaseRequest], Awaitable[web.Response]]:
    """The one handler: every path (less ``prefix``) goes to ``upstream``."""
    cut = len(prefix)
    # The upstream URL of each request target seen (256 at most, as proxy/routes.py
    # URLS_KEPT): a URL is immutable, and one built per request costs yarl's parsing.
    urls: dict[str, URL] = {}

    async def proxy(request: web.BaseRequest) -> web.Response:
        body = await request.read()
        headers = _without(request.headers, _DROP_REQUEST)
        peer = request.remote
        if peer:
            prior = headers.getall("X-Forwarded-For", None)
            headers["X-Forwarded-For"] = (", ".join([*filter(None, prior), peer]) if prior
                                          else peer)
        raw_path = request.raw_path
        url = urls.get(raw_path)
        if url is None:
            if len(urls) >= 256:
                urls.clear()
            url = urls[raw_path] = URL(upstream + raw_path[cut:], encoded=True)
        answer = await session.request(request.method, url, headers=headers,
                                       data=body or None, allow_redirects=False)
        # No release() after it: a read to the end has given the connection back already
        # (a failed read closes the answer itself), and release() would then only mark the
        # spent stream closed, ~120 opcodes.
        data = await answer.read()
        return web.Response(status=answer.status, reason=answer.reason, body=data,
                            headers=_without(answer.headers, _HOP_BY_HOP))

    return proxy


def client_session() -> aiohttp.ClientSession:
    """The upstream client on Sluice's settings (``proxy/client.py``, ``proxy/runtime.py``)."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=4,
                                     enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False,
                                 cookie_jar=aiohttp.DummyCookieJar(),
                                 request_class=VerbatimRequest, timeout=TIMEOUT)


def server_runner(handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                  loop: asyncio.AbstractEventLoop) -> web.ServerRunner:
    """``handler`` on aiohttp's low-level server with Sluice's settings (``proxy/server.py``)."""
    def make_request(message, payload, protocol, writer, task):  # type: ignore[no-untyped-def]
        return web.BaseRequest(message, payload, protocol, writer, task, loop,
                               client_max_size=MAX_REQUEST_BYTES)

    server = web.Server(handler, request_factory=make_request, handler_cancellation=True,
                        access_log=None, auto_decompress=False)
    return web.ServerRunner(server, shutdown_timeout=1.0)


def tune_gc() -> None:
    """Sluice's collector settings (``proxy/server.py`` ``tune_gc``): startup's objects out of
    the collector's sight, young collections every 10,000 allocations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


async def serve(port: int, upstream: str, prefix: str) -> None:
    """Serve on 127.0.0.1:``port`` until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    session = client_session()
    runner = server_runner(make_handler(session, upstream, prefix), loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
        tune_gc()
        await stop.wait()
    finally:
        await runner.cleanup()
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9001")
    parser.add_argument("--prefix", default="", help="path prefix to strip, e.g. /openai")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream.rstrip("/"), args.prefix))


if __name__ == "__main__":
    main()
