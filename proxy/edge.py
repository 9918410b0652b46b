"""The proxy port's edge: connections and requests Sluice refuses before the request path.

**Connections** (:class:`EdgeProtocol`, one per TCP connection; limits under ``server:``):

* ``max_connections``: a connection beyond it first takes the place of the oldest one that is
  between requests (opened and silent, part of a head in, or kept alive idle: nginx likewise
  frees idle keep-alive connections when it runs out), which is closed; if every connection
  has a request in progress, it is answered 503 ``too_many_connections`` once its first bytes
  arrive (so the caller reads the answer rather than a reset), then closed. The first counts
  in ``sluice_idle_connections_closed_total``, the second in ``too_many_connections``. So
  idle or silent sockets, however many, never keep a probe or a caller out. Where the
  open-files limit leaves room for fewer connections, the bound is that many
  (:mod:`proxy.descriptors`), so that the 503 comes before descriptors run out;
* ``header_timeout``: a request's head (request line and headers) must arrive within this of
  its first byte (of the connection's opening, for the first request), else 408
  ``request_timeout`` and close. This is what ends slowloris connections and silent ones;
* ``body_timeout`` and ``min_body_rate``: a body may pause at most ``body_timeout``, and once
  ``body_timeout`` has passed must average ``min_body_rate`` bytes a second since its head
  (since its ``100 Continue``, for a caller that waited for one: a request pipelined behind
  a slow one is invited only when its turn comes), else 408 and close;
* ``idle_timeout``: a keep-alive connection idle between requests is closed (aiohttp's own
  keep-alive timer);
* ``abort_on_close``: a caller's EOF (a FIN) is a caller that left: the connection closes and
  its call is cut (its queue place, slot and upstream request freed). TCP cannot tell that
  from a half-close (``shutdown(SHUT_WR)``: ``nc -N``, some HTTP/1.0 clients); with
  ``abort_on_close: false`` an EOF after whole requests is read as one, and they are
  answered, the connection closed after the last (HAProxy without ``option abortonclose``),
  while an EOF idle or with part of a head or body sent is still a caller that left
  (:meth:`EdgeProtocol.eof_received`);
* a request head (request line and headers) over ``MAX_HEAD_BYTES`` (60 KiB, Envoy's default
  ``max_request_headers_kb``) is answered 431 ``headers_too_large`` and the connection closed
  as soon as that many bytes of it have arrived, or when a read that would take it past that
  holds no blank line (its end) within the bound. aiohttp's own bounds (8190 bytes a line,
  128 headers) let one head hold about 1 MB until ``header_timeout``, and a thousand such
  connections took a fresh Sluice from 65 MB to 974 MB (68 MB with this bound). A head that
  starts in the same read as the end of the request before it is not seen apart from that
  request, so it may hold up to 60 KiB plus one read (uvloop reads at most 256 KB at a time).
  A head pipelined behind a request still being served is not answered (its answer would
  come first): the connection is closed;
* a parser-level refusal (a request target or header value over 8190 bytes, or more than 128
  headers: 431 ``headers_too_large``; bad framing or syntax: 400 ``bad_request``) is answered
  in Sluice's shape: JSON body, ``X-Sluice-Reason``, ``Connection: close``, the cause named
  when the parser's description is one Sluice knows (:func:`parse_cause`), and nothing of
  the request echoed, in the answer or in the log. aiohttp drops the requests its parser took
  from a read it refuses: on a connection's first read a request before the refused one is
  served in the refusal's place and the connection then closed
  (:meth:`EdgeProtocol._answer_in_order`); on a later read the refusal is answered, and a
  client that pipelined a valid request and a malformed one in it reads the 400 as the valid
  one's (which was not sent upstream);
* requests pipelined behind one still being served are read no further once those queued
  hold over ``FIRST_HOLD_BYTES`` (64 KiB: their heads as sent and their bodies' bytes): the
  connection is read again as they are taken. aiohttp would parse and queue 32 of them,
  bodies included, none counted in ``max_buffered_bytes`` before its handler starts (60
  connections pipelining 120 KB bodies behind a slow call held 238 MB past an 8 MB bound,
  a hostile trial); now at most 64 KiB and what one read brought are queued per
  connection. Below that the connection is read on, so with ``abort_on_close`` a caller
  that pipelines a small request and leaves is found gone while the one before it is
  served (its call cut); one that pipelined more is found gone when reading resumes;
* after a request with chunked framing, or an HTTP/1.0 request with ``Transfer-Encoding``
  (whose framing RFC 9112 §6.1 says to treat as faulty), the connection is closed once the
  answer is sent, and nothing pipelined behind it is served. aiohttp's C parser does not
  reset its pending header field between messages, so the last trailer field of a chunked
  request would become a header of the next request on the connection (``X-Tenant-ID:
  victim``); the pure-Python parser does not have that defect but costs about 6x as much CPU
  per request head. Clients rarely send chunked requests (the LLM SDKs send
  ``Content-Length``); those that do open a new connection for their next request.

**Requests** (:meth:`EdgeServer.serve`, before :func:`proxy.handler.handle`):

* only HTTP/1.1 and HTTP/1.0 are served: another version on the request line (``HTTP/2.0``,
  or none: HTTP/0.9) is refused with 400 ``bad_request`` in an HTTP/1.1 answer, and the
  connection closed; an HTTP/1.1 request without ``Host`` gets 400 (RFC 9112 §3.2);
* ``Host`` must be one ``server.allowed_hosts`` allows, else 421 ``misdirected_request``.
  By default: the listen address's own name; for a loopback address also ``localhost``,
  ``127.0.0.1`` and ``[::1]``; for a wildcard address (``0.0.0.0``, ``::``) those, the
  machine's host name and any IP address literal. DNS rebinding (a browser page whose name
  turns into 127.0.0.1) always sends its own name, so it is refused here, whatever the
  upstream would have done: Sluice sets ``Host`` to the upstream's own when forwarding (the
  upstream's TLS and virtual hosting need it), so an upstream cannot check it for itself;
* on ``mcp`` routes, a browser's ``Origin`` must be in ``server.allowed_origins`` or be the
  same host (and port) as the ``Host`` it calls, else 403 ``forbidden_origin`` in the
  JSON-RPC shape; requests without ``Origin`` (not from a browser) pass;
* a path with a control character, raw or percent-encoded (``%00``-``%1F``, ``%7F``), is
  refused with 400 ``bad_request`` (the parser refuses raw ones first);
* a request target with a ``#`` (a fragment, which RFC 9112 §3.2 does not allow there) is
  refused with 400 ``bad_request``: the URL it is forwarded to drops the fragment, while
  routing and metering read the target as sent, so ``/v1/chat/completions#x`` reached the
  upstream as ``/v1/chat/completions`` unmetered (past every budget and token rate);
* a ``Transfer-Encoding`` other than ``chunked`` alone (``gzip, chunked``) is refused with
  400 ``bad_request``: Sluice does not decode such codings, and would forward the still-coded
  bytes as the body;
* a header value that is not UTF-8 (Latin-1 text, stray bytes) is refused with 400
  ``bad_request`` naming the field: aiohttp reads such bytes as surrogate escapes and its
  writer drops them, so the upstream would get the value silently changed;
* a ``Content-Length`` over ``server.max_request_bytes`` is refused with 413
  ``request_too_large`` before the body is read (and before any ``100 Continue``). A body
  counts against ``server.max_buffered_bytes`` from its head to the end of its call
  (:class:`BodyHold`): at its head, its first ``FIRST_HOLD_BYTES`` (64 KiB; the whole of a
  smaller declared length) or what has arrived of it if more, and then each byte as it
  arrives. A request whose first count would pass the bound is refused with 503
  ``buffers_full`` before its body is read (and before any ``100 Continue``); one whose
  next bytes find no room, with the same 503 as they arrive, and its connection closed.
  Counted at its declared length from its head on, 8 connections declaring 32 MiB and
  sending 2 KiB/s held the whole bound for hours (a hostile trial);
* ``Expect: 100-continue`` is answered by Sluice (``100 Continue`` before the body is
  read) and never forwarded; any other expectation is refused with 417
  ``expectation_failed``. The 100 is sent just before the body is read
  (:meth:`BodyHold.invite`): after these checks and the request path's own that need no body
  (a route must match, CONNECT is refused, the caller's identity, dot-segments, a path read
  as different metered endpoints), so a caller refused by any of them is not invited to
  upload first; and before admission, as Envoy sends it before its filters run: a call its
  route's limits then refuse (429, 503) has sent its body. Admission is not peeked at for
  it: most of it needs the body (a model's or a tool's limits, token rates) or a round trip
  to Redis (shared limits), and a peek at the rest (the route's queue, its breaker) would
  hold only for that moment, while the body is bounded by ``max_request_bytes`` and counted
  in ``max_buffered_bytes`` as any other.

Each limit is read from the config in force when a connection opens or a request arrives, so
a reload applies them to new connections. The admin port's connections get the same header and
idle timeouts and a small connection cap; as its callers send their requests whole, a body there
is at most 4 KiB and due within 2 s of its head, and a connection still receiving one makes
room for a new connection as one still receiving a head does (:class:`AdminServer`); the
request checks are the proxy port's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import Any

from aiohttp import hdrs, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpVersion, HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.http_parser import HttpRequestParser
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import ERROR as PARSE_ERROR_MESSAGE
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from policies.config import Config, ServerConfig
from policies.logs import PER_CALL
from policies.reasons import Reason, Rejected
from proxy.descriptors import (
    DESCRIPTORS_PER_CONNECTION,
    connection_limit,
    descriptor_reserve,
    open_files_limit,
)
from proxy.forward import digits_value, only_chunked, parser_reason
from proxy.rejections import refuse, refuse_at_edge, rejection_body, rejection_headers, render
from proxy.routes import Route
from proxy.runtime import Runtime

log = logging.getLogger("sluice")

Handler = Callable[[Runtime, web.BaseRequest, "BodyHold | None"],
                   Awaitable[web.StreamResponse]]

#: Host names of the loopback interface, allowed when Sluice listens on it.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})
#: A percent-encoded control character (C0 or DEL).
_ESCAPED_CONTROL = re.compile(r"%(?:[01][0-9A-Fa-f]|7[Ff])")
#: The most bytes of one request head (request line and headers) Sluice reads: Envoy's default
#: ``max_request_headers_kb`` (60). nginx's default allows 32 KiB; the LLM SDKs send ~1 KiB.
MAX_HEAD_BYTES = 60 * 1024
#: How long a connection refused mid-head reads and drops what its caller still sends before
#: it closes, seconds (so the refusal is not lost to a reset; nginx's ``lingering_time``).
LINGER_S = 2.0
#: A request body's first bytes counted held at its head (:class:`BodyHold`), before they
#: arrive: a body this size or smaller (an LLM SDK's call is a few KiB to tens of KiB) is
#: counted once, at the door, and refused unread when there is no room for it.
FIRST_HOLD_BYTES = 64 * 1024
#: Set on a request whose body the edge cut with its 408 (``server.body_timeout``): the
#: handler whose read that cut ended counts no caller that left (the edge counted a refusal).
BODY_CUT = web.RequestKey("sluice_body_cut", bool)
#: Parser errors whose request head is too big rather than malformed.
_TOO_MANY_HEADERS = "Too many headers"
#: Why an HTTP/1.1 request without ``Host`` is refused (by the parser, or by the door).
_NO_HOST = "an HTTP/1.1 request must carry Host (RFC 9112 §3.2)"
_UNLISTED_HOST = "list the name in server.allowed_hosts to serve it"
#: Why a request target holding a fragment is refused (see the module docstring).
_FRAGMENT = "a fragment (#) in the request target (RFC 9112 §3.2): send the path without it"
#: The parser's description of a refusal (llhttp's error reason, or aiohttp's own check) ->
#: the cause a refusal names. Looked up whole, never passed on: the parser's message goes on
#: to quote the request's bytes (a header line, the request target), which may hold a key.
_PARSE_CAUSES = {
    "Missing 'Host' header in request.": _NO_HOST,
    "Duplicate Content-Length": "Content-Length is given more than once",
    "Duplicate 'Content-Length' header found.": "Content-Length is given more than once",
    "Transfer-Encoding can't be present with Content-Length":
        "Content-Length and Transfer-Encoding are both given (RFC 9112 §6.1)",
    "Content-Length can't be present with Transfer-Encoding":
        "Content-Length and Transfer-Encoding are both given (RFC 9112 §6.1)",
    "Invalid character in Content-Length": "Content-Length is not a number of bytes",
    "Empty Content-Length": "Content-Length is empty",
    "Content-Length overflow": "Content-Length is too large a number",
    "Duplicate 'Transfer-Encoding' header found.": "Transfer-Encoding is given more than once",
    "Request has invalid `Transfer-Encoding`":
        "Transfer-Encoding does not end in chunked (RFC 9112 §6.3)",
    "Invalid `Transfer-Encoding` header value":
        "Transfer-Encoding does not end in chunked (RFC 9112 §6.3)",
    "Duplicate 'Host' header found.": "Host is given more than once",
    "Invalid header token": "a header name holds a character not allowed in one",
    "Invalid header field char": "a header name holds a character not allowed in one",
    "Invalid header value char": "a header value holds a control character",
    "Missing expected LF after header value": "a header line ends in CR without LF",
    "Missing expected CR after header value": "a header line ends in LF without CR",
    "Unexpected whitespace after header value":
        "a header line begins with whitespace (obsolete line folding, RFC 9112 §5.2)",
    "Expected LF after CR": "a line ends in CR without LF",
    "Expected LF after headers": "the head does not end in a blank CRLF line",
    "Invalid method encountered": "the request method is not a valid token",
    "Expected space after method": "the request line has no single space after the method",
    "Unexpected space after start line": "the request line ends in whitespace",
    "Expected HTTP/, RTSP/ or ICE/": "the request line does not end in an HTTP version",
    "Invalid major version": "the request line's HTTP version is malformed",
    "Invalid minor version": "the request line's HTTP version is malformed",
    "Received HTTPS traffic on an HTTP port":
        "TLS (HTTPS) was sent to this plain-HTTP port",
    "Invalid HTTP version": "the request line's HTTP version is malformed",
    "Expected CRLF after version": "the request line does not end in CRLF",
    "Expected CRLF": "a line does not end in CRLF",
    "Bad line ending, expected CRLF": "a line does not end in CRLF",
    "Invalid char in url path": "the request target holds a character not allowed in a URL",
    "Invalid char in url query": "the request target holds a character not allowed in a URL",
    "Invalid char in url fragment start":
        "the request target holds a character not allowed in a URL",
    "Invalid characters in url": "the request target holds a character not allowed in a URL",
    "Unexpected start char in url": "the request target does not start with /",
    "Invalid character in chunk size": "a chunk size is not hexadecimal",
    "Chunk size overflow": "a chunk size is too large a number",
    "Expected LF after chunk data": "a chunk's data does not end where its size says",
    "Expected LF after chunk size": "a chunk size line does not end in CRLF",
    "Missing expected CR after chunk size": "a chunk size line does not end in CRLF",
    "Missing expected CR after chunk data": "a chunk's data does not end where its size says",
    "Invalid character in chunk extensions": "a chunk extension holds a character not allowed",
    "Invalid character in chunk extensions value":
        "a chunk extension holds a character not allowed",
    "Invalid character in chunk extensions name":
        "a chunk extension holds a character not allowed",
    "Invalid character in chunk extensions quoted value":
        "a chunk extension holds a character not allowed",
    "Invalid character in chunk extensions quote value":
        "a chunk extension holds a character not allowed",
    "Not enough data to satisfy transfer length header.":
        "the connection ended before the chunked body did",
    "Data after `Connection: close`": "bytes followed a request that said Connection: close",
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Allowed ``Host`` values remembered per config, so most requests cost one set lookup.
_HOSTS_REMEMBERED = 64
#: How long a caller refused for held bodies (``buffers_full``) is told to wait, seconds:
#: bodies are given back as calls end, which is not predictable here.
BUFFERS_FULL_RETRY_AFTER_S = 1.0
#: Connections the admin port serves at once (probes, Prometheus, operators): beyond it, the
#: oldest idle one is closed, or 503 ``too_many_connections``, as ``server.max_connections``
#: on the proxy port.
ADMIN_MAX_CONNECTIONS = 64
#: The largest request body the admin port takes, bytes: none of its endpoints reads one
#: (``sluice runs cancel`` posts an empty body). A larger ``Content-Length``, or a chunked
#: body (its length unknown until read), is refused with 413 ``request_too_large`` at its head.
ADMIN_MAX_BODY_BYTES = 4 * 1024
#: The admin port's ``body_timeout`` (or ``server.body_timeout`` if shorter), seconds; its
#: ``min_body_rate`` is :data:`ADMIN_MAX_BODY_BYTES` a second (or ``server.min_body_rate`` if
#: higher). So a body it takes is whole within 2 s of its head, or the connection is closed:
#: its callers send their bodies with their heads, and it has no slow uploaders to wait for.
ADMIN_BODY_TIMEOUT = 1.0

# Phases of a connection, as its timers see it.
_OPENED = 0  # just opened, not a byte yet: header_timeout from the opening, then closed quietly
_HEAD = 1  # some of a request head has arrived
_BODY = 2  # a head has arrived, its body is still coming
_READ = 3  # a whole request has arrived (being handled, or answered and the connection idle:
# aiohttp's keep-alive timer, idle_timeout, applies then)


#: The ``Server`` field of the answers Sluice writes itself, and of a relayed one whose
#: upstream sent none (Envoy's say ``envoy``): :func:`proxy.server.serve` makes it aiohttp's
#: default, in place of one naming Python and aiohttp with their versions.
SERVER_NAME = "sluice"


def raw_answer(rejected: Rejected) -> bytes:
    """A whole HTTP/1.1 answer for ``rejected`` in the plain ``http`` shape, closing the
    connection: for the edge's refusals, written straight to the transport (so with its own
    ``Server``: aiohttp adds none here)."""
    body = rejection_body(rejected, "http")
    status = rejected.reason.status
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
             "Content-Type: application/json", f"Content-Length: {len(body)}",
             "Connection: close", f"Server: {SERVER_NAME}"]
    lines += [f"{name}: {value}" for name, value in rejection_headers(rejected).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


_HEAD_TIMEOUT = raw_answer(Rejected(
    Reason.REQUEST_TIMEOUT, None, "the request's head did not arrive within server.header_timeout"
))
_HEAD_TOO_LARGE = raw_answer(Rejected(
    Reason.HEADERS_TOO_LARGE, None, f"a request head may be at most {MAX_HEAD_BYTES} bytes"))
_BODY_TIMEOUT = raw_answer(Rejected(
    Reason.REQUEST_TIMEOUT, None,
    "the request body paused longer than server.body_timeout, or came slower than "
    "server.min_body_rate",
))
_TOO_MANY = raw_answer(Rejected(Reason.TOO_MANY_CONNECTIONS, 1.0,
                                 "server.max_connections; try again shortly"))
_ADMIN_TOO_MANY = raw_answer(Rejected(
    Reason.TOO_MANY_CONNECTIONS, 1.0,
    f"the admin port serves {ADMIN_MAX_CONNECTIONS} at once; try again shortly"))


class GuardedServer(web.Server):
    """aiohttp's low-level server whose connections are each an :class:`EdgeProtocol`, so they
    get the connection limits of the module docstring from :meth:`connection_settings`.

    Attributes:
        open: connections being served now (refused ones are not counted).
        refusing: connections over ``max_connections`` waiting for their 503.
        too_many: that 503, whole, naming the bound.
    """

    too_many = _TOO_MANY
    #: Whether a connection still receiving a request's body may be closed to make room, as
    #: one between requests is (:meth:`evict_one`).
    evicts_bodies = False

    def __init__(self, handler: Callable[..., Awaitable[web.StreamResponse]],
                 **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.open = 0
        self.refusing = 0

    def connection_settings(self) -> ServerConfig:
        """The limits a connection opening now gets."""
        raise NotImplementedError

    def refused(self, reason: Reason) -> None:
        """Count a connection or request its connection refused (nothing by default)."""

    def evicted(self) -> None:
        """Count a connection closed to make room (nothing by default)."""

    def evict_one(self) -> bool:
        """Close the oldest connection between requests (:attr:`EdgeProtocol.between_requests`)
        or, with :attr:`evicts_bodies`, still receiving a request's body
        (:attr:`EdgeProtocol.receiving_body`), to make room for a new one; whether there was
        one. It counts as open until its ``connection_lost`` (the next loop turn), so the
        count may pass the bound by the connections evicted in one turn, each of them
        closing."""
        bodies = self.evicts_bodies
        for protocol, transport in self._connections.items():  # oldest first
            if (isinstance(protocol, EdgeProtocol) and not transport.is_closing()
                    and (protocol.between_requests or (bodies and protocol.receiving_body))):
                transport.close()
                self.evicted()
                return True
        return False

    def __call__(self) -> EdgeProtocol:
        settings = self.connection_settings()
        return EdgeProtocol(self, settings, loop=self._loop,
                            keepalive_timeout=settings.idle_timeout, **self._kwargs)


class EdgeServer(GuardedServer):
    """The proxy port: :class:`GuardedServer` with the request checks of :meth:`serve` in
    front of ``handler``, under ``server:``'s limits."""

    def __init__(self, runtime: Runtime, handler: Handler, **kwargs: Any) -> None:
        super().__init__(self.serve, request_factory=self._make_request, **kwargs)
        self.runtime = runtime
        self._handler = handler
        self._door: Door | None = None
        self._for: ServerConfig | None = None
        self._settings: ServerConfig | None = None
        #: The open-files limit and the bound it left, as last logged.
        self._told: tuple[int, int] | None = None
        runtime.metrics.connections_limit.labels("proxy").set_function(
            lambda: self.connection_settings().max_connections)

    def connection_settings(self) -> ServerConfig:
        """The config's ``server`` block, its ``max_connections`` lowered to what the
        open-files limit leaves room for (:func:`proxy.descriptors.connection_limit`), read
        again when a reload brings a new block."""
        server = self.runtime.config.server
        if server is not self._for:
            self._for = server
            self._settings = self._bounded(server)
        assert self._settings is not None
        return self._settings

    def _bounded(self, server: ServerConfig) -> ServerConfig:
        redis = self.runtime.state.redis
        reserve = descriptor_reserve(ADMIN_MAX_CONNECTIONS,
                                     None if redis is None else redis.max_connections)
        soft = open_files_limit()[0]
        bound = connection_limit(server.max_connections, soft, reserve)
        if bound == server.max_connections:
            self.too_many = _TOO_MANY
            self._told = None
            return server
        self.too_many = raw_answer(Rejected(
            Reason.TOO_MANY_CONNECTIONS, 1.0,
            f"the open-files limit lets this process serve {bound} connections at once; "
            "try again shortly"))
        if self._told != (soft, bound):
            self._told = (soft, bound)
            log.warning(
                "open-files limit (RLIMIT_NOFILE) %d leaves room for %d connections on the "
                "proxy port, not server.max_connections %d (%d descriptors each, %d kept for "
                "the admin port, Redis and files): connections over %d get 503 "
                "too_many_connections. Raise the limit (ulimit -n, systemd LimitNOFILE=, "
                "docker run --ulimit nofile=) to serve more", soft, bound,
                server.max_connections, DESCRIPTORS_PER_CONNECTION, reserve, bound)
        return server.model_copy(update={"max_connections": bound})

    def refused(self, reason: Reason) -> None:
        self.runtime.metrics.edge_rejections.labels(reason.code).inc()

    def evicted(self) -> None:
        self.runtime.metrics.idle_closed_proxy.inc()


    def _make_request(self, message: RawRequestMessage, payload: StreamReader,
                      protocol: RequestHandler, writer: Any, task: asyncio.Task[None],
                      ) -> web.BaseRequest:
        version = message.version
        if version is HttpVersion11 and not message.chunked:  # nearly every request
            pass
        elif message is PARSE_ERROR_MESSAGE:
            message = _PARSE_ERROR_MESSAGE_11  # answered as HTTP/1.1, not 1.0
        elif version != HttpVersion11 and version != HttpVersion10:
            # Refused at the door, in an HTTP/1.1 status line (aiohttp would echo the
            # request's version: "HTTP/2.0 400"), and the connection closed.
            message = message._replace(version=_REFUSED_VERSION, should_close=True)
        elif message.chunked or (version < HttpVersion11
                                 and "Transfer-Encoding" in message.headers):
            # Close after the answer; see the module docstring (trailers, RFC 9112 §6.1).
            message = message._replace(should_close=True)
        return web.BaseRequest(message, payload, protocol, writer, task, self._loop,
                               client_max_size=self.runtime.config.server.max_request_bytes)

    def serve(self, request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        """The request handler aiohttp calls: the edge's checks, then the request path."""
        if request.protocol._close:
            # The caller's EOF was read once this request was taken off the queue and before
            # this step (uvloop reads between them), where eof_received finds no request to
            # tell: the connection closes after this one, and its answer says so.
            _closes_after(request)
        rt = self.runtime
        door = self._door
        if door is None or door.config is not rt.config:
            door = self._door = Door(rt.config)
        refused = door.check(rt, request)
        if refused is not None:
            if hdrs.EXPECT in request.headers and not request.content.is_eof():
                _closes_after(request)  # its body never invited (see BodyHold.give_back)
            return _answered(refused)
        headers = request.headers
        length = headers.get(hdrs.CONTENT_LENGTH)  # digits only: the parser refused the rest
        if length is not None:
            declared = digits_value(length)
        elif hdrs.TRANSFER_ENCODING in headers:  # chunked: its length is known once read,
            declared = door.max_request_bytes    # so it counts as the most it may be
            if hdrs.UPGRADE in headers and asks_websocket(request):
                declared = 0  # no hold: the handler refuses it as a handshake (asks_websocket)
        else:
            declared = 0
        hold = None
        if declared:
            if declared > door.max_request_bytes:
                return _unread(rt, request, Rejected(
                    Reason.BODY_TOO_LARGE, None,
                    f"limit {door.max_request_bytes} bytes; Content-Length says {declared}"))
            # Pipelined, or sent with its head: some of it may be here already.
            first = max(min(declared, FIRST_HOLD_BYTES), request.content.total_bytes)
            if rt.buffered_bytes + first > door.max_buffered_bytes:
                return _unread(rt, request, buffers_full(rt, door.max_buffered_bytes))
            hold = BodyHold(rt, request, first, door.max_buffered_bytes,
                            length is None or declared > first)
        expect = headers.get(hdrs.EXPECT)
        if expect is not None and request.version >= HttpVersion11:
            if expect.lower() != "100-continue":
                if not request.content.is_eof():
                    _closes_after(request)  # its body never invited (see BodyHold.give_back)
                return _answered(refuse_at_edge(
                    rt, Rejected(Reason.EXPECTATION_FAILED, None, "")))
            if hold is not None and not request.content.is_eof():
                # Sent just before the body is read (BodyHold.invite), once the checks that
                # need no body (the module docstring lists them) have passed: a caller
                # refused by them is not invited to upload first (a review).
                hold.continues = True
        # Held from here (the handler takes the body's bytes in its first step, with no
        # await since this check) to the end of its call.
        return self._handler(rt, request, hold)


def asks_websocket(request: web.BaseRequest) -> bool:
    """Whether ``request`` is a WebSocket handshake Sluice refuses 501
    ``websocket_not_supported`` (:func:`proxy.handler._serve`, before anything is taken or
    sent): ``websocket`` (any case, any version) among its ``Upgrade`` protocols, on any of
    its lines, in an HTTP/1.1 request. Sluice relays no WebSocket, and Upgrade is
    hop-by-hop: forwarded, the handshake went upstream as a plain GET, and the caller got
    the upstream's puzzling 400 (a hostile trial).

    The rule, the cheapest exact one: asked (by the handler) of a request the edge holds no
    body for, which is one without a body (no ``Content-Length``, or 0: a handshake is a GET
    sent with none, RFC 6455 §4.1) or one with chunked framing (asked by the edge, which
    then takes no hold, so the handler asks it too). A chunked body's emptiness is known
    only once read, after this check: a chunked request with ``Upgrade: websocket`` is
    refused whatever its body, where a ``Content-Length`` body (an LLM API's POST) makes the
    request no handshake, its ``Upgrade`` ignored (RFC 9110 §7.8 lets a server) and the
    call served; so neither pays a look-up of ``Upgrade``, only a request without a body
    or a chunked one does. An HTTP/1.0 request's ``Upgrade`` is ignored (RFC 9110 §7.8: a
    server MUST), and so is another protocol (``h2c``): such a request is served over
    HTTP/1.1. Called only when ``Upgrade`` is present."""
    return request.version >= HttpVersion11 and any(
        token.partition("/")[0].strip().lower() == "websocket"
        for line in request.headers.getall(hdrs.UPGRADE) for token in line.split(","))


def buffers_full(rt: Runtime, limit: int) -> Rejected:
    """503 ``buffers_full``: the bodies held at once (``rt.buffered_bytes``) leave no room
    under ``limit`` (``server.max_buffered_bytes``, bytes) for the bytes of one more."""
    return Rejected(Reason.BUFFERS_FULL, BUFFERS_FULL_RETRY_AFTER_S,
                    f"{rt.buffered_bytes} bytes of bodies held, limit {limit}")


class BodyHold:
    """The bytes of one request body counted in :attr:`Runtime.buffered_bytes`, which
    ``server.max_buffered_bytes`` bounds, from its handler's first step to the end of its
    call (:func:`proxy.handler.handle` takes and gives back; the connection grows it).

    A body counts what has arrived of it, never less than a first amount the door found room
    for (:data:`FIRST_HOLD_BYTES`, or the declared length if smaller): counted at its declared
    length from its head on, slow uploaders held memory they had not sent (a hostile trial).
    Each read of the connection grows the count by the body's bytes it brought
    (:meth:`grow`); bytes that find no room end the request with 503 ``buffers_full``
    (:meth:`EdgeProtocol._no_room`). So the count never passes the bound, and the bytes in
    memory pass it by at most one read (uvloop reads up to 256 KiB) per connection refused.

    Attributes:
        held: the bytes counted now (0 before :meth:`take` and after :meth:`give_back`).
    """

    __slots__ = ("_first", "_grows", "_limit", "_request", "_rt", "continues", "held")

    def __init__(self, rt: Runtime, request: web.BaseRequest, first: int, limit: int,
                 grows: bool) -> None:
        self._rt = rt
        self._request = request
        self._first = first
        self._limit = limit
        #: The first amount may be less than the body (else the connection need not count
        #: its reads: most bodies are smaller than the first amount).
        self._grows = grows
        self.held = 0
        #: The caller waits for ``100 Continue`` before it sends the body (:meth:`invite`).
        self.continues = False

    def take(self) -> None:
        """Count the first amount, and from now on the bytes as they arrive. Called in the
        handler's first step, with no await since the door found room for it."""
        self.held = self._first
        self._rt.buffered_bytes += self._first
        if self._grows:
            protocol = self._request.protocol
            if isinstance(protocol, EdgeProtocol):
                protocol._hold = self

    def invite(self) -> None:
        """Send ``100 Continue``: the caller waits for it before it sends the body (RFC 9110
        §10.1.1). Called just before the body is read, when :attr:`continues`; the body's
        ``body_timeout`` starts now (:meth:`EdgeProtocol.continued`)."""
        self.continues = False
        request = self._request
        transport = request.transport
        if transport is None or request.content.is_eof():
            return
        transport.write(_CONTINUE)
        protocol = request.protocol
        if isinstance(protocol, EdgeProtocol):
            protocol.continued(request.content)

    def grow(self) -> bool:
        """Count the body's bytes arrived beyond those counted; ``False``, counting nothing,
        when that would pass the bound (the request is then refused)."""
        arrived = self._request.content.total_bytes
        more = arrived - self.held
        if more <= 0:
            return True
        rt = self._rt
        if rt.buffered_bytes + more > self._limit:
            return False
        rt.buffered_bytes += more
        self.held = arrived
        return True

    def refuse(self) -> None:
        """End the read of the body with 503 ``buffers_full`` (its bytes found no room):
        :func:`proxy.handler.handle`'s read raises it as a :class:`Rejected`."""
        self._request.content.set_exception(buffers_full(self._rt, self._limit))

    def read(self, length: int) -> None:
        """The body is read whole, ``length`` bytes: count those, no more (a chunked body's
        first amount may be more than its length)."""
        if self.held > length:
            self._rt.buffered_bytes -= self.held - length
            self.held = length

    def give_back(self) -> None:
        """Uncount every byte counted; the body's bytes still to arrive are not counted (a
        handler that answered without reading them: aiohttp reads and drops them). A body
        never invited (``continues``: the request was refused before its ``100 Continue``)
        has its answer say ``Connection: close`` (RFC 9110 §10.1.1): a caller that then sends
        no body and reuses the connection had its next request read as that body (a review)."""
        if self.continues:
            self.continues = False
            _closes_after(self._request)
        self._rt.buffered_bytes -= self.held
        self.held = 0
        if self._grows:
            protocol = self._request.protocol
            if isinstance(protocol, EdgeProtocol) and protocol._hold is self:
                protocol._hold = None


#: Why a request with a transfer coding besides ``chunked`` is refused (its value is not
#: echoed: see the module docstring).
_TRANSFER_CODING = ("a transfer coding other than chunked (Transfer-Encoding) is not accepted: "
                    "Sluice would pass its bytes on undecoded; send the body as it is")


#: Ends the log line of a parser refusal: the parser's own message quotes the request.
REQUEST_NOT_LOGGED = "the request's bytes are left out of this log"


def parse_cause(exc: BaseException) -> str | None:
    """What was wrong with a request aiohttp's parser refused, in Sluice's words from
    :data:`_PARSE_CAUSES`; ``None`` when the parser's description is not one of those (it is
    then not shown: it might quote the request). A ``RequestPayloadError`` (a body the parser
    refused) is read from the parser error that caused it."""
    if not isinstance(exc, HttpProcessingError):
        exc = exc.__cause__  # type: ignore[assignment]
        if not isinstance(exc, HttpProcessingError):
            return None
    return _PARSE_CAUSES.get(parser_reason(exc.message))


class AdminServer(GuardedServer):
    """The admin port (``server.admin_listen``): the proxy port's header and idle timeouts,
    but at most :data:`ADMIN_MAX_CONNECTIONS` connections, since only probes, Prometheus and
    operators call it. Without them a few hundred slow or silent connections would hold it as
    long as they liked, and the kubelet's probes with it. Its callers send a request whole,
    so a body is held to :data:`ADMIN_MAX_BODY_BYTES` (413 above) and
    :data:`ADMIN_BODY_TIMEOUT`, and a connection still receiving one makes room for a new
    connection as one still receiving a head does (:attr:`evicts_bodies`): 70 connections
    trickling a body, reopened as they were closed, got 34 of 40 probes a 503 (a hostile
    trial). Requests its parser refuses are answered as on the proxy port
    (:meth:`EdgeProtocol.handle_error`, HTTP/1.1)."""

    too_many = _ADMIN_TOO_MANY
    evicts_bodies = True

    def __init__(self, runtime: Runtime, handler: Callable[..., Awaitable[web.StreamResponse]],
                 **kwargs: Any) -> None:
        make_request = kwargs.pop("request_factory")

        def request_factory(message: RawRequestMessage, *args: Any) -> web.BaseRequest:
            # A parser refusal is answered in an HTTP/1.1 status line, as on the proxy port
            # (aiohttp's placeholder message for it says 1.0).
            if message is PARSE_ERROR_MESSAGE:
                message = _PARSE_ERROR_MESSAGE_11
            return make_request(message, *args)

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            # The proxy port's Host check (DNS rebinding: a browser page whose name turns
            # into 127.0.0.1 read /admin/config and the tenants in /metrics, a hostile trial).
            host = request.headers.get(hdrs.HOST)
            if host is not None and not self._hosts()(host):
                self.refused(Reason.MISDIRECTED)
                return render(Rejected(Reason.MISDIRECTED, None, _UNLISTED_HOST), "http")
            headers = request.headers
            length = headers.get(hdrs.CONTENT_LENGTH)  # digits only: the parser refused the rest
            if (digits_value(length) > ADMIN_MAX_BODY_BYTES if length is not None
                    else hdrs.TRANSFER_ENCODING in headers):
                self.refused(Reason.BODY_TOO_LARGE)
                return await sent_and_closed(request, render(Rejected(
                    Reason.BODY_TOO_LARGE, None,
                    f"the admin port takes a body of at most {ADMIN_MAX_BODY_BYTES} bytes, "
                    "with Content-Length"), "http"))
            return await handler(request)

        super().__init__(handle, request_factory=request_factory, **kwargs)
        self.runtime = runtime
        runtime.metrics.connections_limit.labels("admin").set(ADMIN_MAX_CONNECTIONS)
        self._for: ServerConfig | None = None
        self._settings: ServerConfig | None = None
        self._hosts_for: tuple[ServerConfig, HostCheck] | None = None

    def _hosts(self) -> HostCheck:
        """The ``Host`` check of the config serving now: ``server.admin_listen``'s own names
        (the kubelet's probes and Prometheus call it by the pod's address), and any
        ``server.allowed_hosts`` lists."""
        server = self.runtime.config.server
        if self._hosts_for is None or self._hosts_for[0] is not server:
            self._hosts_for = (server, HostCheck(server.admin_listen, server.allowed_hosts,
                                                 own_names=True))
        return self._hosts_for[1]

    def refused(self, reason: Reason) -> None:
        self.runtime.metrics.admin_rejections.labels(reason.code).inc()

    def evicted(self) -> None:
        self.runtime.metrics.idle_closed_admin.inc()

    def connection_settings(self) -> ServerConfig:
        server = self.runtime.config.server
        if server is not self._for:
            self._for = server
            self._settings = server.model_copy(update={
                "max_connections": ADMIN_MAX_CONNECTIONS,
                "body_timeout": min(server.body_timeout, ADMIN_BODY_TIMEOUT),
                "min_body_rate": max(server.min_body_rate, ADMIN_MAX_BODY_BYTES)})
        assert self._settings is not None
        return self._settings


def _closes_after(request: web.BaseRequest) -> None:
    """Have ``request``'s answer say ``Connection: close`` (its connection closes after it)."""
    request._message = request._message._replace(should_close=True)
    request._cache.pop("keep_alive", None)


async def _answered(response: web.StreamResponse) -> web.StreamResponse:
    return response


_PARSE_ERROR_MESSAGE_11 = PARSE_ERROR_MESSAGE._replace(version=HttpVersion11)
#: The version given a request whose own Sluice does not serve (llhttp parses ``HTTP/2.0``
#: and HTTP/0.9 lines): 1.1 for the answer's status line, a distinct object for the door to
#: know it by (``is``: nothing to look up on every other request).
_REFUSED_VERSION = HttpVersion(1, 1)


def _refused_on(rt: Runtime, route: Route, rejected: Rejected) -> web.Response:
    """A refusal at the door of a request on ``route``: in its shape, counted and logged on
    it under the default tenant (the caller's identity headers are not read yet)."""
    route.metrics.outcomes["rejected"].inc()
    return refuse(rt, route, rejected, rt.next_request_id(),
                  rt.config.identity.default_tenant, None)


def _refused_at(rt: Runtime, raw_path: str, rejected: Rejected) -> web.Response:
    """:func:`_refused_on` the route ``raw_path`` goes to; at the edge (plain ``http`` shape,
    ``sluice_edge_rejections_total``) when it goes to none."""
    route = rt.router.match(raw_path)
    return refuse_at_edge(rt, rejected) if route is None else _refused_on(rt, route, rejected)


async def _unread(rt: Runtime, request: web.BaseRequest, rejected: Rejected
                  ) -> web.StreamResponse:
    """Refuse a request by its declared ``Content-Length`` before any of its body is read or
    invited (no ``100 Continue``): 413 over ``server.max_request_bytes``, 503 ``buffers_full``
    over ``server.max_buffered_bytes``; in the route's shape and counted on it, as when a body
    turns out too long while read. The connection is closed: the body was not read."""
    return await sent_and_closed(request, _refused_at(rt, request.raw_path, rejected))


async def sent_and_closed(request: web.BaseRequest, response: web.StreamResponse
                          ) -> web.StreamResponse:
    """Send ``response`` to ``request`` now and close the connection, the rest of its body
    unread: left to aiohttp, the unread body would be read and dropped for up to 10 s (its
    lingering close) before the connection closes."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


class Door:
    """The request checks of one config (see the module docstring), built once per config."""

    def __init__(self, config: Config) -> None:
        self.config = config
        server = config.server
        self.max_request_bytes = server.max_request_bytes
        self.max_buffered_bytes = server.max_buffered_bytes
        self.host_allowed = HostCheck(server.listen, server.allowed_hosts)
        #: Its values found allowed, looked up first: most requests need no call.
        self._hosts_seen = self.host_allowed.seen
        self.origins = frozenset(server.allowed_origins)
        self.any_origin = "*" in self.origins
        self.mcp = any(route.protocol == "mcp" for route in config.routes)

    def check(self, rt: Runtime, request: web.BaseRequest) -> web.StreamResponse | None:
        """A refusal for ``request``, or ``None`` to let it through."""
        headers = request.headers
        if request.version is _REFUSED_VERSION:
            return refuse_at_edge(rt, Rejected(Reason.BAD_REQUEST, None,
                                               "only HTTP/1.1 and HTTP/1.0 are served"))
        host = headers.get(hdrs.HOST)
        if host is None and request.version == HttpVersion11:
            return refuse_at_edge(rt, Rejected(
                Reason.BAD_REQUEST, None, _NO_HOST))
        if host is not None and host not in self._hosts_seen and not self.host_allowed(host):
            return refuse_at_edge(rt, Rejected(Reason.MISDIRECTED, None, _UNLISTED_HOST))
        if hdrs.TRANSFER_ENCODING in headers and not only_chunked(headers):
            return refuse_at_edge(rt, Rejected(Reason.BAD_REQUEST, None, _TRANSFER_CODING))
        if not "".join(headers.values()).isascii():  # in C: one pass over every value
            refusal = _undecodable_header(headers)
            if refusal is not None:
                return _refused_at(rt, request.raw_path, refusal)
        raw = request.raw_path
        if "%" in raw and _ESCAPED_CONTROL.search(raw.partition("?")[0]):
            return refuse_at_edge(rt, Rejected(Reason.BAD_REQUEST, None,
                                               "a control character in the path"))
        if "#" in raw:
            return refuse_at_edge(rt, Rejected(Reason.BAD_REQUEST, None, _FRAGMENT))
        if self.mcp and not self.any_origin:
            origin = headers.get(hdrs.ORIGIN)
            if origin is not None:
                route = rt.router.match(raw)
                if route is not None and route.protocol == "mcp" and not self.origin_allowed(
                        origin, host):
                    return _refused_on(rt, route, Rejected(
                        Reason.FORBIDDEN_ORIGIN, None,
                        "list it in server.allowed_origins to allow it"))
        return None

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """Whether a browser page of ``origin`` may call a request whose ``Host`` is ``host``."""
        origin = origin.strip().lower()
        if origin in self.origins:
            return True
        scheme, sep, authority = origin.partition("://")
        if not sep or host is None:
            return False  # "null" (a sandboxed or file page), or no Host to be the same as
        origin_host, origin_port = _host_port(authority, 443 if scheme == "https" else 80)
        own_host, own_port = _host_port(host.strip().lower(), None)
        return origin_host == own_host and (own_port is None or own_port == origin_port)


class HostCheck:
    """Whether a ``Host`` value names a server listening on ``listen``: one ``allowed`` lists
    (``server.allowed_hosts``: names, ``*.suffix`` patterns, ``*`` for any), or by default
    the listen address's own names (see the module docstring); with ``own_names``, both. The
    port is not compared. Values found allowed are remembered (:attr:`seen`), up to a bound:
    a connection sends the same one each time."""

    def __init__(self, listen: str, allowed: Sequence[str] | None, *,
                 own_names: bool = False) -> None:
        self.ip_literals = False
        names: frozenset[str] = frozenset()
        if allowed is None or own_names:
            host = listen.rpartition(":")[0].strip("[]").lower()
            literal = f"[{host}]" if ":" in host else host
            if host in _WILDCARDS:
                names = LOOPBACK_NAMES | {socket.gethostname().lower()}
                self.ip_literals = True
            elif host == "localhost" or (_is_ip_literal(literal)
                                         and ipaddress.ip_address(host).is_loopback):
                names = LOOPBACK_NAMES | {literal}
            else:
                names = frozenset({literal})
        allowed = allowed or ()
        self.names = names | {h for h in allowed if not h.startswith("*")}
        self.suffixes = tuple(h[1:] for h in allowed if h.startswith("*."))
        self.any = "*" in allowed
        #: Values found allowed, as sent (looked up before calling, on the request path).
        self.seen: set[str] = set()

    def __call__(self, host: str) -> bool:
        if host in self.seen:
            return True
        name = host_name(host)
        allowed = (self.any or name in self.names or (self.ip_literals and _is_ip_literal(name))
                   or any(name.endswith(suffix) for suffix in self.suffixes))
        if allowed and len(self.seen) < _HOSTS_REMEMBERED:
            self.seen.add(host)
        return allowed


def host_name(host: str) -> str:
    """The name part of a ``Host`` value, lower case, without port or trailing dot."""
    return _host_port(host.strip().lower(), None)[0]


def _host_port(authority: str, default: int | None) -> tuple[str, int | None]:
    if authority.startswith("["):
        end = authority.find("]")
        name, rest = (authority[:end + 1], authority[end + 1:]) if end > 0 else (authority, "")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port = authority.partition(":")
    return name.rstrip("."), int(port) if port.isdigit() else default


def _undecodable_header(headers: Any) -> Rejected | None:
    """A 400 for the first header whose value is not UTF-8 (the parser's surrogate escapes
    of its bytes do not encode), or ``None``: non-ASCII UTF-8 text passes."""
    for name, value in headers.items():
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return Rejected(Reason.BAD_REQUEST, None, (
                    f"the value of {name[:64]!r} is not UTF-8 and cannot be forwarded "
                    "unchanged"))
    return None


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
    except ValueError:
        return False
    return True


def _whole_first_request(data: bytes, end: int, loop: asyncio.AbstractEventLoop
                         ) -> tuple[RawRequestMessage, StreamReader] | None:
    """The first request in ``data`` (a connection's first read, whose first head ends at
    ``end``), parsed by a parser of its own: its message and its whole body, or ``None`` when
    the parser refuses it (its head or its body) or it does not end in ``data``. The
    parser's limits are aiohttp's defaults, which :func:`proxy.server.build_proxy_server`
    keeps; its body's reader never pauses the connection (the bytes are all here)."""
    parser = HttpRequestParser(BaseProtocol(loop), loop, 2**31 - 1,
                               payload_exception=RequestPayloadError, auto_decompress=False)
    try:
        messages, _, _ = parser.feed_data(data[:end])
    except HttpProcessingError:
        return None
    if not messages:
        return None
    message, payload = messages[0]
    if not payload.is_eof():
        try:
            parser.feed_data(data[end:])
        except HttpProcessingError:
            pass  # a later request's: the first one's body is whole or not, as below
        if not payload.is_eof() or payload.exception() is not None:
            return None
    return message, payload


class _Linger(asyncio.Protocol):
    """What a connection refused mid-head becomes once its answer is written: it drops what
    the caller still sends, and closes when the caller does or after ``LINGER_S``; its
    ``connection_lost`` is the refused connection's, so the edge's count stays right."""

    def __init__(self, refused: asyncio.BaseProtocol, transport: asyncio.BaseTransport) -> None:
        self._refused = refused
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the caller is done: close

    def connection_lost(self, exc: BaseException | None) -> None:
        self._timer.cancel()
        self._refused.connection_lost(exc)


class EdgeProtocol(RequestHandler):
    """One connection of a :class:`GuardedServer`: aiohttp's request handler plus Sluice's
    connection limits and its own answer to requests the parser refuses (module docstring)."""

    __slots__ = ("_body", "_body_bytes", "_body_start", "_deadline", "_edge", "_head_bytes",
                 "_head_tail", "_hold", "_phase", "_refused", "_settings", "_timer")

    def __init__(self, manager: GuardedServer, settings: ServerConfig, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._edge = manager
        self._settings = settings
        self._phase = _OPENED
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._body: StreamReader | None = None
        self._body_start = 0.0
        self._body_bytes = 0
        self._head_bytes = 0
        #: The last bytes (up to 3) of the head being read: its blank line may start there.
        self._head_tail = b""
        self._refused: asyncio.Transport | None = None
        #: The body being read by the request served now, counted as it arrives.
        self._hold: BodyHold | None = None

    # -- connection lifecycle ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        edge = self._edge
        if edge.open >= self._settings.max_connections and not edge.evict_one():
            self._refuse(transport)  # type: ignore[arg-type]
            return
        edge.open += 1
        super().connection_made(transport)
        self._arm(self._loop.time() + self._settings.header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is not None:
            self._refused = None
            self._edge.refusing -= 1
            self._disarm()
            return
        if self._manager is not None:
            self._edge.open -= 1
        self._disarm()
        super().connection_lost(exc)

    def eof_received(self) -> bool:
        """The caller's EOF: whether to keep the connection open for writing (``False``
        closes it, and aiohttp then cancels the call being served, as for any caller gone).

        By default (``abort_on_close``) the caller has left: a FIN from a closed socket and
        one from ``shutdown(SHUT_WR)`` look the same, and nearly every client that sends one
        while its answer is pending is gone (an SDK's timeout, a cancelled task), so its
        upstream call and queue place are freed at once. With ``abort_on_close: false`` and
        every request it sent whole (being served, or queued behind one), it is read as a
        half-close: the connection stays open to carry the answers and closes after the last
        one. Idle, or with part of a head or body in, the caller has left either way."""
        if (self._settings.abort_on_close or self._refused is not None
                or self._phase != _READ or self.transport is None
                or (self._waiter is not None and not self._messages)):
            return False
        messages = self._messages
        if not messages:  # the last request is being served: close once it is answered
            self._close = True
            current = self._current_request
            if current is not None and current.writer.output_size == 0:
                # and say so in its answer, as a queued one's does (its EOF may be read only
                # once it is taken: reading pauses while much is queued, see data_received;
                # one taken and not yet started is told in EdgeServer.serve).
                _closes_after(current)
            return True
        message, payload = messages[-1]
        if isinstance(message, RawRequestMessage):  # the last one says so in its answer
            messages[-1] = (message._replace(should_close=True), payload)
        else:  # a parse error's answer closes the connection anyway
            self._close = True
        return True

    @property
    def between_requests(self) -> bool:
        """Nothing of a request is being handled or awaited from the caller: opened and
        silent, part of a head in, or answered and kept alive idle. Idle means aiohttp's
        loop waits for the next request (``_waiter``): a request it has taken off the queue
        but not yet started (Python 3.11 starts its task a loop turn later) is not idle."""
        phase = self._phase
        if phase == _BODY or self._messages or self._request_in_progress:
            return False
        return phase != _READ or self._waiter is not None

    @property
    def receiving_body(self) -> bool:
        """A request's head has arrived and its body is still coming (its handler may have
        answered already: aiohttp then reads and drops the rest before the next request)."""
        return self._phase == _BODY

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Over ``max_connections``: answer 503 when the request arrives, then close."""
        edge = self._edge
        self._manager = None  # aiohttp's bookkeeping never sees this connection
        edge.refused(Reason.TOO_MANY_CONNECTIONS)
        if edge.refusing >= self._settings.max_connections:
            transport.close()  # as many waiting for their 503 as served: no answer at all
            return
        edge.refusing += 1
        self._refused = transport
        self._timer = self._loop.call_later(self._settings.header_timeout, transport.close)

    # -- reading -------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        refused = self._refused
        if refused is not None:
            if not refused.is_closing():
                refused.write(self._edge.too_many)
                refused.close()
            return
        if self._close or self._force_close:
            # aiohttp parses nothing more (_answer_in_order closed it): nor is it counted as
            # a head here, where the rest of a refused request's body ended the answer of the
            # request served in its place as a head too large (a review).
            return
        # A read that could take a head past the bound (``_head_bytes`` is a head's bytes so
        # far, or the last head's: at worst more reads are looked at) must end it in time.
        if len(data) > MAX_HEAD_BYTES - self._head_bytes and not self._head_ends_in(data):
            self._head_too_large()
            return
        count = self._request_count
        phase = self._phase
        reading = self._body if phase == _BODY else None
        super().data_received(data)
        if self._force_close:
            return
        messages = self._messages
        if (messages and not self._buffer_paused
                and (len(messages) > 1 or (self._waiter is None and messages[0][1].total_bytes
                                           + len(data) + self._head_bytes > FIRST_HOLD_BYTES))
                and self._queued_bytes() > FIRST_HOLD_BYTES):
            # (A keep-alive connection's next request, queued while the last answer
            # finishes, is summed only when its body, this read and a head's bytes could
            # pass the bound: the whole sum there cost ~150 opcodes a request.)
            # Requests queued behind the one being served hold that much: read no more until
            # they are taken (:meth:`_resume_reading_for_buffer`). aiohttp would queue 32,
            # bodies and all, uncounted in max_buffered_bytes: 60 connections pipelining
            # 120 KB bodies behind a slow call held 238 MB past an 8 MB bound (a hostile
            # trial). Below it reading goes on, so a caller that pipelines a small request
            # and leaves is seen leaving (paused at the first queued request, its FIN went
            # unread and its call ran to its end: a review).
            self._pause_reading_for_buffer()
        hold = self._hold
        if hold is not None and not hold.grow():
            self._no_room(hold)
            return
        if (phase == _OPENED and self._request_count != count and self._messages
                and not isinstance(self._messages[-1][0], RawRequestMessage)):
            self._answer_in_order(data)
        if self._request_count != count and self._messages:
            if reading is not None and not reading.is_eof():
                self._body_refused(reading)
            # One or more request heads arrived; the last one's body may still be coming.
            body = self._messages[-1][1]
            if body.is_eof():
                self._phase = _READ
                self._disarm()
            else:
                now = self._loop.time()
                self._phase = _BODY
                self._body = body
                self._body_start = now
                self._body_bytes = 0
                self._arm(now + self._settings.body_timeout)
        elif self._phase == _BODY:
            body = self._body
            if body is None or body.is_eof():
                self._phase = _READ
                self._body = None
                self._disarm()
            else:
                self._body_bytes += len(data)
                settings = self._settings
                now = self._loop.time()
                deadline = now + settings.body_timeout
                if settings.min_body_rate:
                    deadline = min(deadline, self._body_start + settings.body_timeout
                                   + self._body_bytes / settings.min_body_rate)
                self._deadline = deadline  # later than before: the timer re-arms lazily
        elif self._phase == _HEAD:
            self._head_bytes += len(data)
            self._head_tail = (self._head_tail + data[-3:])[-3:]
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_too_large()
        elif data:
            if self._phase != _OPENED:  # the first request's time counts from the opening
                self._arm(self._loop.time() + self._settings.header_timeout)
            self._phase = _HEAD
            self._head_bytes = len(data)
            self._head_tail = data[-3:]
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_too_large()

    def _queued_bytes(self) -> int:
        """The bytes of the requests queued behind the one being served (the first queued is
        the next one served while aiohttp's loop waits for one): their heads as sent (request
        line and header lines) and what has arrived of their bodies."""
        queued = 0
        first = self._waiter is not None
        for message, payload in self._messages:
            if first:
                first = False
                continue
            queued += payload.total_bytes
            if isinstance(message, RawRequestMessage):
                queued += len(message.method) + len(message.path) + 14 + sum(
                    len(name) + len(value) + 4 for name, value in message.raw_headers)
        return queued

    def _resume_reading_for_buffer(self) -> None:
        """aiohttp's resume as it takes a request off its queue, held while the requests
        still queued hold over ``FIRST_HOLD_BYTES`` (:meth:`data_received`). A body left
        unread meanwhile is timed from then on (``body_timeout``, ``min_body_rate``): its
        caller did not pause it."""
        if self._messages and self._queued_bytes() > FIRST_HOLD_BYTES:
            return
        super()._resume_reading_for_buffer()
        if self._phase == _BODY:
            now = self._loop.time()
            self._body_start = now
            self._body_bytes = 0
            self._arm(now + self._settings.body_timeout)

    def _body_refused(self, body: StreamReader) -> None:
        """The parser refused the rest of ``body`` (a malformed chunk, trailers past its
        bounds) in a later read than its head: aiohttp's C parser then drops the body without
        a word to its reader and queues the error as a message of its own, so the handler
        reading the body would wait for ever, holding its bytes of ``max_buffered_bytes``
        (a hostile trial). The reader gets the parser's error, as aiohttp's pure-Python
        parser gives it (a ``RequestPayloadError`` caused by it), and the handler's failed
        read is answered 400 (431 for trailers) by :meth:`handle_error`, as the same bytes in
        the head's read are."""
        message = self._messages[-1][0]
        cause = getattr(message, "exc", None)
        if isinstance(message, RawRequestMessage) or not isinstance(cause, BaseException):
            return  # a body is never left unended by a whole next request
        error = RequestPayloadError(str(cause))
        error.__cause__ = cause
        body.set_exception(error)
        # Ended too: aiohttp reads what is left of an unread body after its answer, and
        # would meet the error there and log it with the request's bytes.
        body.feed_eof()

    def _answer_in_order(self, data: bytes) -> None:
        """The parser refused ``data``, a connection's first read: keep its refusal, queued
        last, only if it answers the request it concerns.

        aiohttp drops the requests its parser took from a read it refuses, so a valid request
        and a malformed one sent together were answered once, with the malformed one's 400,
        which the caller reads as the valid one's (RFC 9112 §9.3.2; a hostile trial). A first
        read starts a request, so it is parsed again: when a whole first request ends before
        the read does, it is served in the refusal's place, the connection closed after its
        answer, and nothing after it is answered. A refusal of that first request itself
        stands. So does a later read's: it may continue a head or a body the read before
        left in the parser, whose position between reads aiohttp's C parser does not show
        (taken for a read that starts a request when the one before ended a whole one, a read
        had a header value served as a request; taken for one that continues something, the
        400 of a malformed request sent alone with its body on a kept-alive connection was
        lost: two reviews)."""
        end = data.find(b"\r\n\r\n") + 4
        if end < 4 or end >= len(data):
            return  # no head ended before the read's last bytes: the refusal is the first's
        first = _whole_first_request(data, end, self._loop)
        if first is None:
            return  # the first request itself was refused
        self._edge.refused(Reason.BAD_REQUEST)
        self.logger.warning("a request sent behind another in a connection's first read was "
                            "refused by the parser: the connection is closed without its "
                            "answer; %s", REQUEST_NOT_LOGGED, extra=PER_CALL)
        message, payload = first  # in the refusal's place: the waiter aiohttp woke finds it
        self._messages[-1] = (message._replace(should_close=True), payload)
        self.close()  # and nothing more is parsed

    def continued(self, body: StreamReader) -> None:
        """``100 Continue`` was sent for ``body``: its ``body_timeout`` (and the time its
        ``min_body_rate`` is averaged over) starts now. Counted from its head, a body
        pipelined behind a request taking 2 s upstream had 1 s of a 3 s ``body_timeout``
        left when it was invited (a hostile trial)."""
        if self._phase == _BODY and self._body is body:
            now = self._loop.time()
            self._body_start = now
            self._arm(now + self._settings.body_timeout)

    def _no_room(self, hold: BodyHold) -> None:
        """The bytes of the body being read found no room under ``server.max_buffered_bytes``
        (:meth:`BodyHold.grow`): its reader gets the refusal, which its handler answers with
        503 ``buffers_full`` in the route's shape and then closes the connection, as the door
        does for a body with no room for its first bytes. Nothing more is read meanwhile: the
        transport is paused, not the parser (aiohttp's pause asserts a body still expected,
        and these bytes may have ended it)."""
        self._hold = None
        if self.transport is not None:
            self.transport.pause_reading()
        hold.refuse()

    def _head_ends_in(self, data: bytes) -> bool:
        """Whether the head ``data`` starts or continues ends within ``MAX_HEAD_BYTES`` of its
        start (always, while a body is read). A head that arrives whole in one read is parsed
        at once; without this look only heads spread over reads were bounded, and a 101 KB
        one sent at once was forwarded (a new user's trial). The blank line may begin in the
        read before: it is looked for from that read's last bytes (``data`` starting with CRLF
        alone ends a head only after a line's CRLF, not after a header value: taken as an
        end, it let a head cut before a line's CRLF bring 80 KiB more in its next read)."""
        phase = self._phase
        if phase == _BODY:
            return True
        if phase != _HEAD:
            return data.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4) >= 0
        tail = self._head_tail
        return (tail + data).find(b"\r\n\r\n", 0,
                                  MAX_HEAD_BYTES - self._head_bytes + 4 + len(tail)) >= 0

    def _head_too_large(self) -> None:
        """431 for a head past ``MAX_HEAD_BYTES``; a pipelined one is not answered (its answer
        would be read as the answer to the request still being served), its connection
        closed. The caller is likely still sending its head: closing now would reset the
        connection and the reset can destroy the answer before the caller reads it, so what
        it still sends is read and dropped for up to ``LINGER_S`` (nginx's lingering close)."""
        self._edge.refused(Reason.HEADERS_TOO_LARGE)
        transport = self.transport
        # Served or queued, or taken off the queue with its handler not started yet (Python
        # 3.11 starts it a loop turn later; only then is _request_in_progress set): aiohttp
        # waits for the next request only with _waiter set (its first excepted).
        if (self._request_in_progress or self._messages or transport is None
                or (self._request_count and self._waiter is None)):
            self.force_close()
            return
        self._disarm()
        self._phase = _READ
        self._parser = None  # and the head it holds: aiohttp drops it as the connection ends
        transport.write(_HEAD_TOO_LARGE)
        transport.write_eof()  # type: ignore[attr-defined]
        transport.set_protocol(_Linger(self, transport))

    # -- timers --------------------------------------------------------------------------

    def _arm(self, deadline: float) -> None:
        self._deadline = deadline
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(deadline, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport is None:
            return
        now = self._loop.time()
        if now < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._expired)
            return
        if self._phase in (_HEAD, _OPENED):
            if self._request_in_progress or self._messages:
                # A pipelined head behind a request still being served: its time starts
                # when the connection is free for it.
                self._arm(now + self._settings.header_timeout)
                return
            # Silent since it opened: closed without an answer, like an idle connection.
            answer = _HEAD_TIMEOUT if self._phase == _HEAD else None
        elif self._phase == _BODY:
            if self._reading_paused:  # Sluice is not reading: not the caller's fault
                self._arm(now + self._settings.body_timeout)
                return
            current = self._current_request
            if self._messages or (current is not None and current.content is not self._body):
                # The body of a request pipelined behind one still being served: its caller
                # may wait for a 100 Continue sent only once its turn comes, and a 408 now
                # would be read as the answer to the request ahead (a review).
                self._arm(now + self._settings.body_timeout)
                return
            answer = None
            if current is not None and current.writer.output_size == 0:
                answer = _BODY_TIMEOUT
                current[BODY_CUT] = True
        else:
            return
        if answer is not None:
            self.transport.write(answer)
            self._edge.refused(Reason.REQUEST_TIMEOUT)
        self.force_close()

    # -- errors --------------------------------------------------------------------------

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None,
                     ) -> web.StreamResponse:
        """Sluice's answer to a request aiohttp could not parse or hand on, and to an error
        escaping the handler: in the ``http`` shape, never quoting the request."""
        if isinstance(exc, ConnectionResetError):
            # The caller has gone: a write met its closing connection before aiohttp
            # cancelled the handler (an MCP SDK closes as soon as it has read its response).
            # The handler has counted and logged that end (client_disconnected); it is no
            # fault of Sluice's own, and nothing can be answered.
            raise ConnectionError("the caller has gone")
        if request.writer.output_size > 0:
            if exc is not None:  # else a fault of Sluice's own went without a word
                log.error("error after an answer was begun (peer %s): the connection is cut",
                          request.remote, exc_info=exc)
            raise ConnectionError("an answer was already being sent; the connection is cut")
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            if (isinstance(exc, LineTooLong) or isinstance(exc.__cause__, LineTooLong)
                    or _TOO_MANY_HEADERS in str(exc)):
                rejected = Rejected(Reason.HEADERS_TOO_LARGE, None,
                                    "at most 8190 bytes a request target or header value, "
                                    "and 128 headers")
            else:
                rejected = Rejected(Reason.BAD_REQUEST, None, f"not valid HTTP/1.1: {cause}"
                                    if (cause := parse_cause(exc)) else
                                    f"not valid HTTP/1.1 ({type(exc).__name__})")
            level = logging.DEBUG if (isinstance(exc, BadHttpMethod)
                                      and self._request_count == 1) else logging.WARNING
            # PER_CALL: a client sending nothing else gets a line every 10 s, not one each.
            self.logger.log(level, "Error handling request from %s: %s (%d), %s; %s",
                            request.remote, type(exc).__name__, rejected.reason.status,
                            rejected.detail, REQUEST_NOT_LOGGED, extra=PER_CALL)
        else:
            log.error("error before an answer was written (peer %s)",
                      request.remote, exc_info=exc)
            rejected = Rejected(Reason.INTERNAL_ERROR, None, "")
        self._edge.refused(rejected.reason)
        response = render(rejected, "http")
        response.force_close()
        return response
