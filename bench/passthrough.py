"""The baseline for ``bench/overhead.py``: a bare aiohttp + uvloop pass-through proxy.

No policies, no metrics, no events: it strips ``--prefix`` from the path, forwards method, path,
headers (less hop-by-hop ones, ``Host`` and ``Content-Length``) and the buffered body to
``--upstream``, reads the answer whole and sends it back. It uses the same aiohttp settings as
Sluice (uvloop, ``auto_decompress=False``, an unbounded connection pool, no access log, handler
cancellation), so the gap between the two is what Sluice itself adds. By hand:

    python bench/passthrough.py --port 9002 --upstream http://127.0.0.1:9001 --prefix /openai
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web
from multidict import CIMultiDict

_DROP_REQUEST = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "proxy-authorization", "host", "content-length"}
)
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "proxy-authenticate", "content-length"}
)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def build_app(upstream: str, prefix: str) -> web.Application:
    """The proxy app: every path under ``prefix`` goes to ``upstream`` with the prefix removed."""
    cut = len(prefix)

    async def proxy(request: web.Request) -> web.Response:
        body = await request.read()
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST
        )
        url = upstream + request.raw_path[cut:]
        async with request.app[SESSION].request(
            request.method, url, headers=headers, data=body or None, allow_redirects=False
        ) as answer:
            data = await answer.read()
            out = CIMultiDict(
                (k, v) for k, v in answer.headers.items() if k.lower() not in _DROP_RESPONSE
            )
            return web.Response(status=answer.status, body=data, headers=out)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        )
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9001")
    parser.add_argument("--prefix", default="", help="path prefix to strip, e.g. /openai")
    args = parser.parse_args()
    web.run_app(build_app(args.upstream.rstrip("/"), args.prefix), host="127.0.0.1",
                port=args.port, access_log=None, print=None, backlog=1024,
                handler_cancellation=True, auto_decompress=False, shutdown_timeout=1.0,
                loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
