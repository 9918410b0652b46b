"""Forwarding one admitted request to its upstream and streaming the answer back.

Bytes pass through untouched in both directions: the server and the client session both run
with ``auto_decompress=False``, so ``Content-Encoding`` and ``Content-Length`` stay true to the
bytes they describe. Only framing is the proxy's own (RFC 9110 §7.6.1):

* hop-by-hop fields are dropped both ways: ``Connection``, ``Keep-Alive``,
  ``Proxy-Connection``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``,
  ``Proxy-Authenticate``, ``Proxy-Authorization``, and every field named in ``Connection``;
* on the request, ``Host`` (the upstream's own is set from its URL) and ``Content-Length``
  (recomputed from the buffered body) are dropped too, since forwarding them stale desyncs or
  misroutes the upstream connection;
* ``X-Forwarded-For`` gets the caller's address appended.

A response is streamed chunk by chunk as it arrives (``iter_any``), so SSE events reach the
caller with no added buffering; a small, complete, non-streaming answer is read whole and sent
in one write, which costs less. If the upstream fails after the status line was sent, the
connection to the caller is closed without the final chunk, so the caller sees a truncated
answer rather than a clean end (aiohttp's ``ClientPayloadError`` on the other side).
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from policies.reasons import Reason, Rejected
from policies.usage import Meter

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length"}
_RESPONSE_DROP = HOP_BY_HOP

#: Complete answers up to this size are read whole and sent in one write.
BUFFER_LIMIT_BYTES = 256 * 1024


def _copy_headers(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    connection = headers.get("Connection")
    if connection:
        drop = drop | {token.strip().lower() for token in connection.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def upstream_headers(request: web.Request) -> CIMultiDict[str]:
    """The caller's headers as they go upstream (see the module docstring)."""
    headers = _copy_headers(request.headers, _REQUEST_DROP)
    peer = request.remote
    if peer:
        prior = headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    return headers


def upstream_url(origin_and_base: str, rest: str) -> URL:
    """The upstream URL for the path ``rest`` (already stripped of the route prefix).

    ``rest`` is forwarded byte for byte (``encoded=True``): yarl would otherwise normalise
    dot-segments and percent-escapes, and the upstream would see a path other than the one
    Sluice matched its route on.
    """
    return URL(origin_and_base + rest, encoded=True)


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    url: URL,
    body: bytes,
    client_timeout: aiohttp.ClientTimeout,
    meter: Meter | None = None,
) -> tuple[web.StreamResponse, str]:
    """Send the request upstream and relay the answer.

    ``meter`` (on metered LLM calls) reads usage from the answer as it passes: it asks the
    upstream for uncompressed bytes, adds its headers, and may drop the usage chunk Sluice
    itself asked for (:class:`policies.usage.Meter`).

    Returns:
        ``(response, outcome)``; ``outcome`` is a ``sluice_requests_total`` outcome label.

    Raises:
        Rejected: ``upstream_unreachable`` or ``upstream_timeout`` when no answer came, so the
            caller can be told in its protocol's error shape.
        asyncio.CancelledError: the caller disconnected; the upstream request is closed.
    """
    headers = upstream_headers(request)
    if meter is not None:
        meter.request_headers(headers)
    try:
        upstream = await session.request(
            request.method,
            url,
            headers=headers,
            data=body if body else None,
            allow_redirects=False,
            timeout=client_timeout,
        )
    except TimeoutError:
        raise Rejected(Reason.UPSTREAM_TIMEOUT, None, "no response headers in time") from None
    except aiohttp.ClientError as exc:
        if meter is not None and isinstance(exc, aiohttp.ClientConnectorError):
            meter.sent = False  # no connection, so the upstream never saw it
        raise Rejected(Reason.UPSTREAM_UNREACHABLE, None, type(exc).__name__) from None

    outcome = f"{upstream.status // 100}xx"
    try:
        headers = _copy_headers(upstream.headers, _RESPONSE_DROP)
        if meter is not None:
            meter.start(upstream.status, headers)
        length = upstream.content_length
        streaming = length is None or length > BUFFER_LIMIT_BYTES
        if not streaming:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, TimeoutError):
                raise Rejected(
                    Reason.UPSTREAM_UNREACHABLE, None, "the upstream's answer was cut short"
                ) from None
            if meter is not None:
                data = meter.body(data)
            return web.Response(
                status=upstream.status, reason=upstream.reason, body=data, headers=headers
            ), outcome
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await out.prepare(request)
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
                # The status line is out: close without the last chunk so the cut is visible.
                if request.transport is not None:
                    request.transport.close()
                return out, "upstream_timeout" if isinstance(e, TimeoutError) else "upstream_error"
            if not chunk:
                break
            if meter is not None:
                chunk = meter.chunk(chunk)
                if not chunk:
                    continue
            await out.write(chunk)  # raises ConnectionResetError if the caller has gone
        if meter is not None and (tail := meter.finish()):
            await out.write(tail)
        await out.write_eof()
        return out, outcome
    finally:
        upstream.release()
