"""The upstream HTTP client: an aiohttp session that adds nothing to what the caller sent.

aiohttp's client adds ``Accept: */*``, ``Accept-Encoding``, ``User-Agent`` and, for a body,
``Content-Type: application/octet-stream`` when the request lacks them. A proxy must not: the
upstream should see the caller's headers (RFC 9110 §7.6 lets an intermediary add only its own
forwarding fields). ``skip_auto_headers`` would do it, but it sends every request down a slow
path that copies the header set twice (about 16 µs a request in ``bench/overhead.py``'s
profile); :class:`VerbatimRequest` instead turns the defaults off once, in the class.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import aiohttp
from aiohttp import hdrs
from multidict import CIMultiDict
from yarl import URL

from policies.logs import PER_CALL

log = logging.getLogger("sluice")

#: aiohttp rounds a timeout above this many seconds (5 by default) up to the next whole
#: second of the loop's clock, to batch timer wake-ups: a ``total: 6s`` fired at 6.0-7.0 s,
#: and every retry's attempt as late. A proxy's timeouts are its users' deadlines: never.
EXACT_TIMEOUTS = math.inf

#: Headers aiohttp would otherwise add on its own (see the module docstring).
_NEVER_ADDED: CIMultiDict[None] = CIMultiDict(
    (name, None) for name in ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
)


class VerbatimRequest(aiohttp.ClientRequest):
    """A ``ClientRequest`` that adds no default header (``request_class`` of the session)."""

    DEFAULT_HEADERS: dict[str, str] = {}

    def update_headers(self, headers: object) -> None:
        # aiohttp's own adds the fields one by one in Python (bench opcodes: 128 a call); the
        # same fields in the same order in one C copy: Host first, from the URL, then the
        # session's CIMultiDict of the caller's. One holding a Host (Sluice's never do: it
        # is dropped from every call) takes aiohttp's way, which lets it replace the URL's.
        if not isinstance(headers, CIMultiDict) or hdrs.HOST in headers:
            super().update_headers(headers)  # type: ignore[arg-type]
            return
        self.headers = CIMultiDict(((hdrs.HOST, self.url.host_port_subcomponent),))
        self.headers.extend(headers)

    def update_auto_headers(self, skip_auto_headers: object) -> None:
        # The default-header and User-Agent steps add nothing; the skip set is read later by
        # the body step (payload Content-Type) and the POST default Content-Type.
        self._skip_auto_headers = _NEVER_ADDED


class UpstreamConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` that never reuses a pooled connection holding bytes nobody asked for.

    An upstream that sends a second, unrequested response after an answer (a late one, or
    one in the same write as an answer over the streamed size) leaves it parsed, or waiting
    to be, on the idle connection; aiohttp's reuse check asks only whether the connection is
    open, so the next call on it got that response as its answer, every later call the one
    before it, across tenants, and a duplicate's answer was stored under another's key (a
    hostile trial). A connection whose protocol says it should close (bytes buffered or not
    yet parsed, an answer's body unfinished) is closed when taken from the pool, and the next
    one tried. (Bytes that arrive after a connection is taken are its answer: HTTP/1.1 cannot
    tell them apart.)"""

    async def _get(self, key, traces):  # type: ignore[no-untyped-def]  # aiohttp's own
        while True:
            conn = await super()._get(key, traces)
            if conn is None or not conn.protocol or not conn.protocol.should_close:
                return conn
            conn.close()  # released with should_close: its transport is closed


def client_timeout(total: float | None, connect: float | None,
                   sock_read: float | None = None) -> aiohttp.ClientTimeout:
    """An upstream timeout, in seconds (``None``: none), kept to the millisecond rather than
    rounded up (:data:`EXACT_TIMEOUTS`)."""
    return aiohttp.ClientTimeout(total=total, connect=connect, sock_read=sock_read,
                                 ceil_threshold=EXACT_TIMEOUTS)


def upstream_session(connector: aiohttp.BaseConnector | None = None,
                     trace_configs: list[aiohttp.TraceConfig] | None = None,
                     ) -> aiohttp.ClientSession:
    """A session for forwarding: bytes untouched (no decompression), no cookies, no proxy
    settings from the environment, no headers of its own. Create it inside the running loop."""
    return aiohttp.ClientSession(
        connector=connector,
        trace_configs=trace_configs,
        auto_decompress=False,
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        request_class=VerbatimRequest,
    )


async def send_aside(session: aiohttp.ClientSession, method: str, url: URL,
                     headers: Mapping[str, str], body: bytes | None,
                     timeout: aiohttp.ClientTimeout, what: str) -> int:
    """Send a request of Sluice's own beside the calls (an MCP cancel, a deferred session
    DELETE), read its answer whole, and return its status: 0 when none came, the failure
    logged as ``what`` was not sent (a connection or timeout error at INFO, anything else
    with its traceback). Never raises but for cancellation: nobody awaits these tasks."""
    try:
        async with session.request(method, url, data=body, headers=headers,
                                   timeout=timeout) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.info("%s was not sent: %r", what, exc, extra=PER_CALL)
    except Exception:
        log.exception("%s was not sent", what)
    return 0
