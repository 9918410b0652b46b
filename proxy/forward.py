"""Forwarding one admitted request to its upstream and streaming the answer back.

Bytes pass through untouched in both directions: the server and the client session both run
with ``auto_decompress=False``, so ``Content-Encoding`` and ``Content-Length`` stay true to the
bytes they describe; an answer without ``Content-Type`` is relayed without one
(:mod:`policies.untyped`). Only framing is the proxy's own (RFC 9110 §7.6.1):

* hop-by-hop fields are dropped both ways: ``Connection``, ``Keep-Alive``,
  ``Proxy-Connection``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``,
  ``Proxy-Authenticate``, ``Proxy-Authorization``, and every field named in any
  ``Connection`` line (a field may be split over several lines, RFC 9110 §5.3);
* on the request, ``Host`` (the upstream's own is set from its URL; the caller's was checked
  against ``server.allowed_hosts`` at the edge), ``Content-Length`` (recomputed from the
  buffered body) and ``Expect`` (Sluice answered ``100-continue`` itself and has the whole
  body) are dropped too, since forwarding them stale desyncs, misroutes or stalls the
  upstream connection;
* on the request, a spelling with an underscore for a dash (``X_Tenant_ID``,
  ``Transfer_Encoding``) of a field dropped here, of an identity header (tenant, run, parent
  run, priority, the timeout header) or of one Sluice sets (``X-Forwarded-For``,
  ``Idempotency-Key``) is dropped: WSGI and CGI upstreams read it as the field itself
  (``HTTP_X_TENANT_ID``), so it would name another tenant than the one Sluice charged, or
  frame the body a second way beside Sluice's ``Content-Length`` (nginx drops every
  underscored field by default, ``underscores_in_headers off``); the fields Sluice reads go
  on as sent;
* ``X-Forwarded-For`` gets the caller's address appended;
* ``Idempotency-Key`` is set when the route's idempotency policy chose the key (derived or
  fresh); a caller's own key passes as it came;
* on an answer other than a 200, ``Location``, ``Content-Location`` and ``Refresh``'s URL
  under the route's upstream are mapped back onto the route (:mod:`proxy.locations`), so
  that a client following a redirect (or polling a 202's ``Location``) stays inside
  Sluice; ``Server`` is the upstream's, or ``sluice`` when it sent none
  (:func:`proxy.server.serve`). No ``Via`` is added either way;
  trailers of a chunked answer are not relayed (aiohttp's client drops them).

A response is streamed chunk by chunk as it arrives (``iter_any``), so SSE events reach the
caller with no added buffering; a small, complete, non-streaming answer is read whole and sent
in one write, which costs less. If the upstream fails after the status line was sent, the
connection to the caller is closed without the final chunk, so the caller sees a truncated
answer rather than a clean end (aiohttp's ``ClientPayloadError`` on the other side).

The one hook for the idempotency store: an optional ``capture`` sees the status line, the
headers and every body chunk as it is relayed, so a stored answer is exactly what the first
caller received, without a second forwarding path. A stream the upstream ends with a
rate-limit error event is no outcome, as a 429 is none, and one it ends cleanly before its
last event (:attr:`~policies.usage.Meter.cut_short`) may be a part of the answer: the capture
is told so (:meth:`~policies.idempotency.Capture.not_an_outcome`), and keeps nothing.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
import time
from collections.abc import Collection

import aiohttp
from aiohttp import HttpVersion11, hdrs, web
from aiohttp.http_exceptions import LineTooLong
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from policies.budget import POLICY_HEADER, REMAINING_HEADER, RESET_HEADER, WARNING_HEADER
from policies.deadletter import DEAD_LETTER_HEADER
from policies.idempotency import Capture
from policies.logs import PER_CALL
from policies.mcp import AnswerTracker
from policies.pipeline import Call
from policies.reasons import REASON_HEADER, Reason, Rejected
from policies.runs import RUN_WARNING_HEADER
from policies.untyped import UntypedResponse, UntypedStreamResponse
from policies.usage import QUOTA, SERVER, Meter
from proxy.locations import Relocation
from proxy.rejections import rejection_body

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
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
#: Request fields Sluice sets itself (a caller's own goes on as it came, or with the caller's
#: address appended): their underscore look-alikes are dropped (:func:`request_drop`).
_REQUEST_OWNED = frozenset({"x-forwarded-for", "idempotency-key"})
#: aiohttp errors raised before the request left (see :func:`left`).
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
#: Answer fields Sluice sets itself, lower case. An upstream's own are dropped from its answer
#: before it is relayed or stored for a replay: an upstream could otherwise forge Sluice's
#: signals (a reason, a dead letter's id, a budget or run warning; a security trial): the
#: idea of Envoy's header sanitizing (it removes ``x-envoy-*`` request headers an external
#: client sends), the other way. A chained Sluice's are dropped too (README, Budgets). Part
#: of :data:`RESPONSE_DROP`, whose intersection with an answer's fields is taken anyway: no
#: cost per field. ``tests/test_security_trial.py`` fails on an ``X-Sluice-`` name in the
#: source not here, and on one built at run time.
SLUICE_ANSWER_HEADERS = frozenset(name.lower() for name in (
    REASON_HEADER, DEAD_LETTER_HEADER, RUN_WARNING_HEADER, REMAINING_HEADER, POLICY_HEADER,
    RESET_HEADER, WARNING_HEADER))
#: Fields of an upstream's answer never relayed nor stored for a replay.
RESPONSE_DROP = HOP_BY_HOP | SLUICE_ANSWER_HEADERS

#: Complete answers up to this size are read whole and sent in one write.
BUFFER_LIMIT_BYTES = 256 * 1024
#: ``sluice_requests_total``'s outcome for a relayed status, by its class (status // 100).
_OUTCOMES = ("0xx", "1xx", "2xx", "3xx", "4xx", "5xx")

#: Characters aiohttp refuses to write in a header (control characters but tab; the same set
#: as its own writer's check), though its client accepts them from an upstream.
log = logging.getLogger("sluice")

#: Seconds between checks, once a streamed answer's deadline has passed, that its caller is
#: not behind (:class:`_Deadline`).
_RECHECK_S = 1.0
#: The longest the last event of an MCP answer (:func:`end_mcp_answer`) waits for a caller
#: that is behind, seconds; past it, the answer is cut instead.
LAST_EVENT_WAIT_S = 1.0

FORBIDDEN_IN_HEADERS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_HEADER = "a response header has control characters"
#: The streamed answer being relayed to the caller, once its status line is out (set on the
#: request, so a call ended mid-answer can still finish it: ``proxy.handler``).
RELAYED_STREAM = web.RequestKey("sluice_relayed_stream", web.StreamResponse)
#: The tracker of an MCP request's answer (a call's, or a control request's with an id) as
#: it is relayed (set on the request by ``proxy.attempts``): whether its response has come.
MCP_ANSWER = web.RequestKey("sluice_mcp_answer", AnswerTracker)
#: Set once the answer's last message has gone to the caller (:func:`delivered`).
ANSWER_SENT = web.RequestKey("sluice_answer_sent", bool)
#: Set as the end of the relayed answer begins to be written (chunked framing's last chunk):
#: written a second time (a cancel can land while the first waits for the caller to take
#: it), it reached the caller as stray bytes after a whole answer (a review).
ANSWER_ENDED = web.RequestKey("sluice_answer_ended", bool)
#: The tracker of a call's answer resumed on a GET (set by ``proxy.attempts``), read only to
#: see when its response has gone to the caller (:data:`ANSWER_SENT`).
RESUMED_ANSWER = web.RequestKey("sluice_resumed_answer", AnswerTracker)
#: On a GET resuming the answer of an MCP call the upstream closed early for polling (set
#: by ``proxy.handler`` from :attr:`proxy.runtime.Runtime.polled`): ``(the call's
#: proxy.runtime.Polled, what to call once its response is through)``, by which
#: ``proxy.attempts`` follows the resumed answer.
RESUMED_CALL = web.RequestKey("sluice_resumed_call", tuple)


class Finish:
    """An MCP call's upstream exchange, run in a task of its own (``proxy.handler``) so that
    it can outlive its caller: an MCP server runs a tool to its end whether or not the POST
    that asked for it is still open, so cutting the exchange when the caller leaves would
    free the call's key (its retry would run the tool again) and its slot (the upstream would
    run more calls than the limit) while the tool still runs.

    Once :attr:`left` is set (the caller has gone), :func:`relay` sends the caller nothing
    more and reads the upstream's answer up to the call's response (the end of the answer,
    for a JSON one), under the route's timeouts as before, so that the call ends with the
    upstream's real outcome; unless the answer then carries a request of the server's to
    the client that left (:func:`awaits_client`): the relay ends there
    (``ConnectionResetError``), since that response would never come.
    """

    __slots__ = ("left", "task")

    def __init__(self) -> None:
        #: The caller has gone; the answer is read without being relayed.
        self.left = False
        #: The task forwarding the call (set by the handler that starts it).
        self.task: asyncio.Task[tuple[web.StreamResponse, str]] | None = None


#: The last event of an MCP call's stream the upstream ended without the call's response.
_NO_RESPONSE = Rejected(Reason.UPSTREAM_UNREACHABLE, None,
                        "the upstream ended its answer without the call's response")


def answered(request: web.BaseRequest) -> bool:
    """Whether the MCP call's answer being relayed for ``request`` has carried its response
    (then nothing of the call is left to finish)."""
    tracker = request.get(MCP_ANSWER)
    return tracker is not None and tracker.outcome is not None


def awaits_client(call: Call | None) -> bool:
    """Whether the MCP call's answer (its key's capture follows it: a ``dedup`` call) has
    carried a request of the server's to its client that the client has not answered
    (:attr:`policies.mcp.AnswerTracker.awaits_client`): the server's tool waits for that
    answer, so the call cannot be finished without its caller."""
    capture = call.capture if call is not None else None
    tracker = capture.tracker if capture is not None else None
    return tracker is not None and tracker.awaits_client


def cancelled_at_server(call: Call) -> bool:
    """Whether the MCP call's answer (a ``dedup`` call's, which its key's capture follows)
    was the server's cancellation error (:attr:`policies.mcp.Outcome.cancelled`): the
    server stopped the call when told to, before its response."""
    capture = call.capture
    tracker = capture.tracker if capture is not None else None
    found = tracker.outcome if tracker is not None else None
    return found is not None and found.cancelled


def kept_for_retry(call: Call) -> bool:
    """Whether an MCP call in flight through Sluice (its handler running, finished without
    its caller, or held for an answer closed early for polling) is one whose answer its key
    will keep (``dedup``) and whose response has not come, so that a retry waits for it: a
    client's cancel of it is held, and its session's DELETE waits for it. Not a call its run
    cancelled, nor one whose tool waits on its client (:func:`awaits_client`): held for, it
    would never end."""
    capture = call.capture
    if capture is None or call.cancelled is not None:
        return False
    tracker = capture.tracker  # set once the answer began with a status that is kept
    if capture.status and (tracker is None or tracker.outcome is not None):
        return False  # its response has come, or will not be kept
    return tracker is None or not tracker.awaits_client


def delivered(request: web.BaseRequest) -> bool:
    """Whether the last message of the answer relayed for ``request`` (an MCP request's
    response, an OpenAI stream's ``data: [DONE]``) has been handed to the caller's
    connection (its send buffer: what the caller read is not known): the caller has its
    answer, and its closing the stream afterwards is no disconnect. The official MCP
    clients close a request's stream as soon as its response is read, and the OpenAI Python
    SDK's synchronous client as soon as it reads ``[DONE]``, while the upstream may end the
    stream a moment later."""
    return request.get(ANSWER_SENT, False)


async def end_mcp_answer(request: web.BaseRequest, rejected: Rejected) -> bool:
    """End an MCP call's SSE answer, already started, with ``rejected`` as its last event
    (the JSON-RPC error for the call's id, the SSE refusal shape of docs/mcp.md) instead of
    cutting it: the Python ``mcp`` 1.x client fails no call on a cut POST stream, so the call
    would wait for its caller's own timeout (none by default).

    Returns whether it did: not when the answer is no MCP call's SSE stream, has carried its
    response already, stops inside an event (what follows would not arrive whole), or the
    caller has gone or took none of the event within :data:`LAST_EVENT_WAIT_S` (then its
    connection is cut).
    """
    out, answer = request.get(RELAYED_STREAM), request.get(MCP_ANSWER)
    if (out is None or answer is None or answer.outcome is not None
            or not answer.between_events):
        return False
    body = rejection_body(rejected, "mcp", answer.request_id)
    return await end_answer(request, out, b"event: message\ndata: " + body + b"\n\n")


async def end_answer(request: web.BaseRequest, out: web.StreamResponse,
                     last: bytes = b"") -> bool:
    """Send ``last`` (bytes, if any) and the end of ``out``, the answer relayed for
    ``request``, as the upstream would have ended it. Returns whether it did: not when its
    end was begun already (:data:`ANSWER_ENDED`), nor when the caller has gone or took none
    of it within :data:`LAST_EVENT_WAIT_S` (then its connection is cut)."""
    if request.get(ANSWER_ENDED, False):
        return False
    request[ANSWER_ENDED] = True
    try:
        async with asyncio.timeout(LAST_EVENT_WAIT_S):
            if last:
                await out.write(last)
            await out.write_eof()
    except ConnectionResetError:
        return False
    except TimeoutError:
        # A caller that takes no more (it stopped reading) would hold the call, its slot
        # included, for as long as it kept its connection: cut (aborted, as a close waits
        # for the unsent bytes to go).
        if request.transport is not None:
            request.transport.abort()
        return False
    return True


def _sent(request: web.BaseRequest, call: Call | None) -> None:
    """The last message of the answer relayed for ``request`` has gone to the caller
    (:func:`delivered`): a drain ends the rest of it rather than waits for it
    (:attr:`Call.relaying`, the task relaying it)."""
    request[ANSWER_SENT] = True
    if call is not None and call.relaying is None:
        call.relaying = asyncio.current_task()


async def _relay_chunk(request: web.BaseRequest, out: web.StreamResponse, chunk: bytes,
                       finish: Finish) -> bool:
    """Send ``chunk`` of an answer that may outlive its caller, unless the caller has gone;
    whether to read on (not once the caller has gone and the call's response is in).

    Raises:
        ConnectionResetError: the caller has gone after the response passed: the answer is
            cut as any other.
    """
    if not finish.left:
        try:
            await out.write(chunk)
            return True
        except ConnectionResetError:
            if answered(request):
                raise
            finish.left = True
    return not answered(request)


class _Deadline:
    """Cuts the caller's connection once a streamed answer's deadline has passed while it is
    behind (its send buffer is full, so a write to it waits).

    Nothing else bounds such a wait: the upstream's timer runs only while its answer is read,
    so a caller that kept its connection open and stopped reading held its slot, its budget
    reservation, its key and the upstream connection for as long as it liked (a hostile
    trial's: ``timeouts.total: 5s``, still held after minutes). The connection is aborted,
    not closed (a close waits for the unsent bytes to go); the handler is cancelled as it is
    when a caller leaves (``client_disconnected``; what was streamed is charged). A caller
    not behind at the deadline is left to the upstream's own timer, which ends the answer as
    an ``upstream_timeout`` (an MCP call's with a last event, whose write may still wait: so
    the check is repeated every :data:`_RECHECK_S` until the relay ends).
    """

    __slots__ = ("call", "handle", "request")

    def __init__(self, request: web.BaseRequest, call: Call | None, deadline: float) -> None:
        self.request, self.call = request, call
        self.handle = asyncio.get_running_loop().call_later(deadline - time.monotonic(),
                                                            self._due)

    def _due(self) -> None:
        protocol, transport = self.request.protocol, self.request.transport
        if transport is None or protocol is None:
            return
        if not protocol.writing_paused:
            self.handle = asyncio.get_running_loop().call_later(_RECHECK_S, self._due)
            return
        log.warning("route %s: the caller took too little of its streamed answer within "
                    "timeouts.total; its connection is cut",
                    self.call.route if self.call is not None else "?", extra=PER_CALL)
        # What it had not taken is lost, maybe the answer's last message too.
        self.request.pop(ANSWER_SENT, None)
        if self.call is not None:
            self.call.relaying = None
        transport.abort()

    def cancel(self) -> None:
        self.handle.cancel()


@functools.lru_cache(maxsize=256)
def _dropped(drop: frozenset[str], connection: tuple[str, ...]) -> frozenset[str]:
    """``drop`` and every field the ``Connection`` lines name (lower case). Cached: nearly
    every message says ``keep-alive`` or ``close``, and the set is built once, not per
    message."""
    return drop | {token.strip().lower() for line in connection for token in line.split(",")}


def _warn_undecodable(headers: CIMultiDict[str], call: Call | None) -> None:
    """Log each of an answer's header fields whose value is not UTF-8 (bytes such as
    Latin-1's, kept by the parser as surrogate escapes). aiohttp's writer cannot send them as
    received and drops those bytes; refusing an answer the upstream has done the work for
    over one field would cost the caller more, so it is relayed, and this says so."""
    for name, value in headers.items():
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                log.warning("route %s: the upstream's answer has a %r header that is not "
                            "UTF-8; its undecodable bytes do not reach the caller",
                            call.route if call is not None else "?", name[:64],
                            extra=PER_CALL)


def digits_value(digits: str) -> int:
    """The number a Content-Length the HTTP parser accepted (ASCII digits, below 2**64) writes.

    Not ``int(digits)`` alone: RFC 9110 allows any number of leading zeros, which the parser
    reads, but ``int()`` refuses a string of more than ``sys.int_max_str_digits`` (4,300)
    digits, and a request must not fail on that.
    """
    return int(digits.lstrip("0") or "0")


def _copy_headers(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    connection = headers.getall(hdrs.CONNECTION, None)
    if connection is not None:
        drop = _dropped(drop, tuple(connection))
    # A copy (in C) less the few fields present that go, found by a case-insensitive set
    # intersection (in C) rather than a test per field.
    out = headers.copy()
    for name in headers.keys() & drop:
        out.popall(name, None)
    return out


def request_drop(removed: list[str], identity: Collection[str] = ()) -> frozenset[str]:
    """The request fields that never go upstream (hop-by-hop ones, ``Host``,
    ``Content-Length``, ``Expect``) and a route's ``request_headers_to_remove``, with their
    underscore look-alikes (:func:`lookalikes`: ``Transfer_Encoding`` beside the
    ``Content-Length`` Sluice writes was a second framing to a WSGI or CGI upstream, a
    hostile trial), and the look-alikes alone of the ``identity`` headers and of those Sluice
    sets (``X-Forwarded-For``, ``Idempotency-Key``), lower case: the ``drop`` of
    :func:`upstream_headers`. Found in one set intersection, in C, whatever the request
    holds: no step of the request path's own."""
    dropped = _REQUEST_DROP | {name.lower() for name in removed}
    passed = {name.lower() for name in identity} | _REQUEST_OWNED
    return frozenset({spelling for name in dropped | passed for spelling in lookalikes(name)}
                     - (passed - dropped))


#: Separators of an identity header's name spelled both ways at most (2^n spellings); past
#: them, only the spelling with every one an underscore (a name that long is not in use).
_SPELLED_SEPARATORS = 6


def lookalikes(name: str) -> set[str]:
    """The spellings of header ``name`` (lower case) with any of its dashes written as an
    underscore or the reverse, ``name`` itself included: WSGI and CGI read them all as one
    field (``X_Tenant_ID``, ``X-Tenant_ID`` and ``X-Tenant-ID`` are ``HTTP_X_TENANT_ID``)."""
    parts = re.split("[-_]", name.lower())
    if len(parts) - 1 > _SPELLED_SEPARATORS:
        return {name.lower(), "_".join(parts)}
    return {"".join(part + sep for part, sep in zip(parts, (*seps, ""), strict=True))
            for seps in itertools.product("-_", repeat=len(parts) - 1)}


#: :func:`request_drop` of a route that removes nothing more.
_DEFAULT_DROP = request_drop([])


def upstream_headers(request: web.BaseRequest, drop: frozenset[str] = _DEFAULT_DROP
                     ) -> CIMultiDict[str]:
    """The caller's headers as they go upstream (see the module docstring), less ``drop``
    (:func:`request_drop`)."""
    headers = _copy_headers(request.headers, drop)
    peer = request.remote
    if peer:
        # Every line of it: several lines are one list (RFC 9110 §5.3), and a hop named on a
        # second line was lost (a hostile trial); an empty line names none (a review).
        prior = headers.getall(hdrs.X_FORWARDED_FOR, None)
        headers[hdrs.X_FORWARDED_FOR] = ", ".join([*filter(None, prior), peer]) if prior \
            else peer
    return headers


def upstream_headers_of(headers: CIMultiDictProxy[str], drop: frozenset[str] = _DEFAULT_DROP
                        ) -> CIMultiDict[str]:
    """A request's ``headers`` as they go upstream, less ``drop``, for a request Sluice
    makes on a call's behalf (no peer to name in ``X-Forwarded-For``)."""
    return _copy_headers(headers, drop)


def upstream_url(origin_and_base: str, rest: str) -> URL:
    """The upstream URL for the path ``rest`` (already stripped of the route prefix).

    ``rest`` is forwarded byte for byte (``encoded=True``): yarl would otherwise normalise
    dot-segments and percent-escapes, and the upstream would see a path other than the one
    Sluice matched its route on.
    """
    return URL(origin_and_base + rest, encoded=True)


def left(error: Rejected) -> bool:
    """Whether a request that got no answer may have reached the upstream: the one rule for
    what is charged and what may be repeated.

    Only a failure to get a connection at all (refused, unreachable, or no connection within
    ``timeouts.connect``) shows the request never left; any later failure (a reset, a
    timeout while waiting for the answer) may have reached an upstream that acted on it.
    """
    return not isinstance(error.__cause__, _NOT_SENT)


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: URL,
    headers: CIMultiDict[str],
    body: bytes,
    client_timeout: aiohttp.ClientTimeout,
) -> aiohttp.ClientResponse:
    """Send one request upstream and wait for its status line and headers.

    This is the phase a retry may repeat: nothing has reached the caller yet.

    Raises:
        Rejected: ``upstream_timeout`` or ``upstream_unreachable``; the aiohttp error is its
            ``__cause__`` (a ``ClientConnectorError`` or ``ConnectionTimeoutError`` means the
            request never left).
    """
    try:
        return await session.request(
            method,
            url,
            headers=headers,
            data=body if body else None,
            allow_redirects=False,
            timeout=client_timeout,
        )
    except TimeoutError as exc:
        raise Rejected(Reason.UPSTREAM_TIMEOUT, None, (
            "no connection to it in time" if isinstance(exc, aiohttp.ConnectionTimeoutError)
            else "no response headers in time")) from exc
    except aiohttp.ClientError as exc:
        raise Rejected(Reason.UPSTREAM_UNREACHABLE, None, send_failure(exc)) from exc


#: What aiohttp's response parser says was wrong with an upstream's status line or headers ->
#: how a refusal names it. Looked up whole: its message goes on to quote the upstream's bytes.
_UNREADABLE = {
    "Expected HTTP/, RTSP/ or ICE/": "its answer does not begin with an HTTP status line",
    "Invalid status code": "its status code is not three digits",
    "Invalid HTTP version": "its status line's HTTP version is malformed",
    "Invalid major version": "its status line's HTTP version is malformed",
    "Invalid minor version": "its status line's HTTP version is malformed",
    "Missing expected CR after response line": "its status line does not end in CRLF",
    "Invalid header token": "a header name holds a character not allowed in one",
    "Invalid header value char": "a header value holds a control character",
    "Duplicate Content-Length": "Content-Length is given more than once",
    "Invalid character in Content-Length": "its Content-Length is not a number of bytes",
    "Content-Length overflow": "its Content-Length is too large a number",
    "Too many headers received": "it sent more than 128 headers",
}


def only_chunked(headers: CIMultiDictProxy[str]) -> bool:
    """``Transfer-Encoding`` (every field of it) is ``chunked`` alone, in a request or an
    answer. The parser refuses a list not ending in ``chunked``; ``gzip, chunked`` it frames
    by the chunks, and the body it hands over is still gzip, which forwarding with
    ``Content-Length`` would pass on as if it were the body itself (RFC 9112 §6.1: a coding
    not understood is not served)."""
    codings = ",".join(headers.getall(hdrs.TRANSFER_ENCODING)).split(",")
    return [c.strip().lower() for c in codings if c.strip()] == ["chunked"]


def parser_reason(message: object) -> str:
    """The description in an HTTP parser error's message (llhttp's reason, or aiohttp's own
    check), without the bytes it goes on to quote (``"<reason>:\n\n  <bytes>"``; a bad start
    line's is prefixed ``Bad status line:``): for looking up in a table of Sluice's words."""
    return str(message).removeprefix("Bad status line:\n  ").split(":\n", 1)[0]


def send_failure(exc: aiohttp.ClientError) -> str:
    """What went wrong when sending a request upstream or reading its status line and
    headers, for a 502 ``upstream_unreachable``: whether Sluice could not connect at all, the
    connection ended before an answer, or the upstream answered with something that is not
    valid HTTP. Never quotes the upstream's bytes (its parser errors do)."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "could not connect to it: its host name did not resolve"
    if isinstance(exc, aiohttp.ClientSSLError | aiohttp.ServerFingerprintMismatch):
        return "could not connect to it: the TLS handshake failed"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "could not connect to it: connection refused"
        return f"could not connect to it ({type(exc.os_error).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection without answering"
    if isinstance(exc, ConnectionResetError):  # aiohttp's ClientOSError for a reset too
        return "the connection was reset before it answered"
    if isinstance(exc, aiohttp.ClientResponseError):
        # The parser's error is this one's cause (aiohttp re-raises it as its own kind).
        cause = exc.__cause__
        parsed = cause.__cause__ if cause is not None else None
        if isinstance(parsed, LineTooLong):
            why = "a status or header line is over 8190 bytes"
        else:
            why = _UNREADABLE.get(parser_reason(getattr(cause, "message", "")), "")
        return "it answered, but not in valid HTTP" + (f": {why}" if why else "")
    return f"the connection failed before it answered ({type(exc).__name__})"


def judged_stream(meter: Meter | None, capture: Capture | None, label: str) -> str:
    """The outcome of a stream whose last message reached the caller, ``label`` (its status
    class) unless ``meter`` read an error event in it (:attr:`Meter.stream_error`): a
    server-side one is ``upstream_error`` (HTTP 200 sent already: a failure of the upstream,
    as a 5xx is; ``proxy.attempts`` tells its breaker), and a rate limit or quota leaves
    nothing kept for the key in ``capture`` (no outcome, as a 429 is none: the key's retry,
    once the limit has passed, reaches the upstream). The bytes went to the caller as they
    came. One rule for the upstream ending the stream (:func:`relay`) and for the caller
    closing it on the event first (``proxy.handler``)."""
    error = None if meter is None else meter.stream_error
    if error == SERVER:
        return "upstream_error"
    if error == QUOTA and capture is not None:
        capture.not_an_outcome()
    return label


def judged_whole(meter: Meter, capture: Capture | None, label: str) -> str:
    """The outcome of an answer ``meter`` has read whole, buffered or relayed as it came:
    :func:`judged_stream`'s when it read an error event; and a stream ended cleanly before
    its answer did (:attr:`policies.usage.Meter.cut_short`) keeps nothing for the key in
    ``capture`` (what came may be a part of the answer), its label unchanged. One rule for
    both framings: the same bytes sent with a Content-Length were kept, chunked they were
    not (a review)."""
    if meter.stream_error is not None:  # an attribute test first: most answers have none
        return judged_stream(meter, capture, label)
    if capture is not None and meter.cut_short:
        capture.not_an_outcome()
    return label


async def relay(
    request: web.BaseRequest,
    upstream: aiohttp.ClientResponse,
    extra_headers: dict[str, str] | None = None,
    capture: Capture | None = None,
    meter: Meter | None = None,
    call: Call | None = None,
    finish: Finish | None = None,
    deadline: float | None = None,
    locations: Relocation | None = None,
) -> tuple[web.StreamResponse, str]:
    """Relay an upstream answer to the caller, then release it (one read whole has released
    itself); never retried.

    ``extra_headers`` are set on the answer, replacing upstream fields of the same name;
    ``capture``, when given, is fed the answer as it is relayed; ``meter`` reads its usage
    (and may drop the usage chunk Sluice itself asked for) before either sees it; ``call``,
    when given, has its ``progress_at`` stamped as a streamed answer's chunks arrive (stall
    detection). ``finish``, for an MCP call that may outlive its caller (:class:`Finish`):
    once the caller has gone (it is told so, or a write to the caller fails before the
    call's response has passed), the answer is read on without being sent, up to the
    response. ``deadline``: monotonic seconds by which a streamed answer must have been
    relayed (its attempt's ``timeouts.total``): a caller whose connection still cannot take
    more of it then has that connection cut (:class:`_Deadline`), as if it had left.
    ``locations``: the route's mapping of a redirect's ``Location`` back onto Sluice
    (:mod:`proxy.locations`), applied to any answer but a 200 before ``capture`` sees it, so
    that a replay of it from its key's record points where the first caller was sent.

    Returns:
        ``(response, outcome)`` as :func:`forward` does; a stream ``meter`` found ended by a
        server-side error event (:attr:`policies.usage.Meter.stream_error`) is
        ``upstream_error``, its status still the one relayed.

    Raises:
        Rejected: when a small answer was cut before any of it was sent:
            ``upstream_timeout`` (504) if a timeout cut it (``timeouts.total`` runs to the
            answer's last byte), else ``upstream_unreachable`` (502).
        asyncio.CancelledError: the caller disconnected.
        ConnectionResetError: a write to the caller failed (it has gone), unless ``finish``
            lets the answer be read on.
    """
    guard: _Deadline | None = None
    read_whole = False
    try:
        status = upstream.status
        # Most answers are 200: one test passes them (here and for their Location below).
        # The range test alone is correct; `status != 200` is a fast path before it (bench
        # opcodes: relay 168 opcodes per 200 answer, 172 without it).
        if status != 200 and not 200 <= status <= 599:
            # 600-999 are invalid (RFC 9110 §15: treat as 5xx); the only final 1xx aiohttp
            # returns is 101, an upgrade Sluice never asks for (Upgrade is hop-by-hop).
            raise Rejected(Reason.UPSTREAM_UNREACHABLE, None,
                           f"it answered with status {status}, which is not valid HTTP (100-599)"
                           if status > 599 else
                           f"it answered with status {status}, which Sluice does not relay")
        outcome = _OUTCOMES[status // 100]
        upstream_headers = upstream.headers
        if hdrs.TRANSFER_ENCODING in upstream_headers and not only_chunked(upstream_headers):
            # A coding of the transfer (gzip, or chunked not last) is hop-by-hop: relayed
            # without it, the caller got gzip bytes as the body, or the chunks' own framing
            # and then no end (a hostile trial); refused as a request with one is (400).
            raise Rejected(Reason.UPSTREAM_UNREACHABLE, None,
                           "it answered with a transfer coding other than chunked, which "
                           "Sluice does not relay")
        headers = _copy_headers(upstream_headers, RESPONSE_DROP)
        if status != 200 and locations is not None:  # a 200's are relayed as they came
            locations.rewrite(headers)
        if not "".join(headers.values()).isascii():  # in C: one pass over every value
            _warn_undecodable(headers, call)
        if capture is not None:
            # The upstream's headers only: those Sluice adds below (budget and run warnings,
            # x-should-retry) describe this call's moment, and a replay must not repeat them.
            capture.begin(status, upstream.reason, headers)
        if extra_headers:
            headers.update(extra_headers)
        # Digits only (the parser refused the rest); none for a chunked or close-ended answer.
        length = upstream_headers.get(hdrs.CONTENT_LENGTH)
        declared = None if length is None else digits_value(length)
        if (length is not None and len(length) > 1 and length[0] == "0"  # zero-padded
                and hdrs.CONTENT_LENGTH in headers):
            headers[hdrs.CONTENT_LENGTH] = str(declared)  # aiohttp reads it with int() too
        if meter is not None:
            meter.start(status, headers)
        if declared is not None and declared <= BUFFER_LIMIT_BYTES:
            try:
                data = await upstream.read()
            except TimeoutError:  # also aiohttp's ServerTimeoutError (a ClientError too)
                raise Rejected(
                    Reason.UPSTREAM_TIMEOUT, None,
                    f"its {status} answer did not finish in time; {length} bytes announced",
                ) from None
            except aiohttp.ClientError:
                raise Rejected(
                    Reason.UPSTREAM_UNREACHABLE, None, "the upstream's answer was cut short"
                ) from None
            # Read to its end, the answer has given its connection back (a read that fails,
            # cancelled too, closes it): release() would only mark the spent stream closed,
            # ~120 opcodes (aiohttp's ClientResponse.read and _response_eof).
            read_whole = True
            if meter is not None:
                data = meter.body(data)
                outcome = judged_whole(meter, capture, outcome)
            if capture is not None:
                capture.feed(data)
            # None where the upstream sent none (aiohttp would say application/octet-stream).
            response = (web.Response if hdrs.CONTENT_TYPE in headers else UntypedResponse)(
                status=status, reason=upstream.reason, body=data, headers=headers
            )
            if finish is not None and finish.left:
                return response, outcome  # all read, and nobody to send it to
            try:
                # Prepared here rather than by aiohttp after the handler returns, so that a
                # header aiohttp refuses to write becomes a 502 instead of a dropped connection.
                if call is not None:  # from now on a call ended early can only be cut
                    call.phase = "answering"
                await response.prepare(request)
            except ValueError:
                raise Rejected(Reason.UPSTREAM_UNREACHABLE, None, _BAD_HEADER) from None
            except ConnectionResetError:
                if finish is None:
                    raise
                finish.left = True
            return response, outcome
        if FORBIDDEN_IN_HEADERS.search("".join((upstream.reason or "", *headers.values()))):
            # Checked before prepare(): a failed prepare has already switched the caller's
            # connection to chunked framing, so not even an error answer could follow.
            raise Rejected(Reason.UPSTREAM_UNREACHABLE, None, _BAD_HEADER)
        out = (web.StreamResponse if hdrs.CONTENT_TYPE in headers else UntypedStreamResponse)(
            status=status, reason=upstream.reason, headers=headers)
        if ((declared is None or hdrs.CONTENT_LENGTH not in headers)
                and request.version < HttpVersion11):
            # No length and no chunks for HTTP/1.0: the answer ends at the close (RFC 9112
            # §6.3), which aiohttp writes no header for yet keeps the connection open (a
            # keep-alive 1.0 client read the next answer as this one's body, a hostile trial).
            # Also when the meter dropped the upstream's length (it strips the usage chunk):
            # the caller got neither and waited (a review).
            out.force_close()
        if call is not None:
            call.phase = "answering"
        if finish is None:
            await out.prepare(request)
            request[RELAYED_STREAM] = out
        elif not finish.left:
            try:
                await out.prepare(request)
                request[RELAYED_STREAM] = out
            except ConnectionResetError:
                finish.left = True
        content = upstream.content
        tracker = request.get(MCP_ANSWER)
        # What tells when the answer's last message has gone (a meter, for [DONE], too).
        last = tracker if tracker is not None else request.get(RESUMED_ANSWER)
        # An answer with neither Content-Length nor chunked framing ends at its connection's
        # close, and aiohttp reads a reset (the upstream died mid-answer) as that end too:
        # its protocol keeps the error that closed the connection, which tells them apart.
        closing = None
        if (declared is None and hdrs.TRANSFER_ENCODING not in upstream_headers
                and (connection := upstream.connection) is not None):
            closing = connection.protocol
        if deadline is not None:
            guard = _Deadline(request, call, deadline)
        while True:
            try:
                chunk = await content.readany()
                if not chunk and closing is not None and isinstance(closing.exception(),
                                                                    OSError):
                    raise aiohttp.ClientPayloadError("the connection was reset")
                if chunk and call is not None:
                    now = call.progress_at = time.monotonic()
                    if deadline is not None and now > deadline:
                        # Read past the deadline (aiohttp hands out what it has buffered
                        # without looking at its timer): the answer did not finish in time,
                        # and writing on could wait on a caller that reads no more.
                        raise TimeoutError
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
                timed_out = isinstance(e, TimeoutError)
                label = "upstream_timeout" if timed_out else "upstream_error"
                cut = Rejected(Reason.UPSTREAM_TIMEOUT if timed_out
                               else Reason.UPSTREAM_UNREACHABLE, None,
                               "the upstream's answer did not finish in time" if timed_out
                               else "the upstream's answer was cut short")
                if finish is not None and finish.left:
                    return out, label  # nobody to tell
                if await end_mcp_answer(request, cut):
                    return out, label
                # The status line is out: close without the last chunk so the cut is visible.
                if request.transport is not None:
                    request.transport.close()
                return out, label
            if not chunk:
                break
            if meter is not None:
                chunk = meter.chunk(chunk)
                if not chunk:
                    continue
            if capture is not None:
                capture.feed(chunk)
            if finish is None:
                await out.write(chunk)  # raises ConnectionResetError if the caller has gone
            elif not await _relay_chunk(request, out, chunk, finish):
                return out, outcome  # the caller has gone and the response is in
            elif finish.left:
                if awaits_client(call):
                    # The server asked the client that left (an elicitation after it left):
                    # its tool waits for an answer nobody will send, so the response would
                    # never come. The call ends as its caller did, nothing kept for its key.
                    raise ConnectionResetError("the caller left the server's request to it "
                                               "unanswered")
                continue  # read on without the caller: nothing was written
            # An error event is a stream's last message too: the SDKs raise on it, and close.
            if ((last is not None and last.outcome is not None)
                    or (meter is not None and (meter.done or meter.failed))):
                _sent(request, call)
        if meter is not None:
            if tail := meter.finish():
                if capture is not None:
                    capture.feed(tail)
                if finish is None or not finish.left:
                    await out.write(tail)
                    if meter.done or meter.failed:
                        _sent(request, call)
            outcome = judged_whole(meter, capture, outcome)
        # An MCP call's stream that ended without the call's response (its session deleted
        # while the tool ran) ends with the call's error as its last event: passed on as it
        # came, the Python mcp 1.x client waited for ever (a hostile trial). Not one whose
        # events had ids: that is a server's early close for polling (2025-11-25), and the
        # client resumes it with Last-Event-ID; an error then failed a call still running.
        # Such a stream is no answer: counted as one the upstream cut (upstream_error), as
        # its client gets upstream_unreachable; it was counted 2xx (a hostile trial). Its end
        # is told to the tracker first (finish): a last line may end in a CR it held back for
        # an LF to follow (SSE lines may end in a lone CR), and the response event it closes
        # went unseen, the answer kept for no key (a hostile trial).
        if (outcome == "2xx" and tracker is not None and tracker.sse
                and tracker.finish() is None and not tracker.resumable):
            outcome = "upstream_error"
        if (finish is None or not finish.left) and not (
                tracker is not None and not tracker.resumable
                and await end_mcp_answer(request, _NO_RESPONSE)):
            request[ANSWER_ENDED] = True
            await out.write_eof()
        return out, outcome
    finally:
        if guard is not None:
            guard.cancel()
        if not read_whole:
            upstream.release()
