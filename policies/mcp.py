"""MCP over streamable HTTP: what Sluice reads in a client's POST and in a server's answer.

Pure functions over bytes and headers (no I/O, nothing from ``proxy``), for the ``mcp`` route
protocol. The words "request", "notification" and "response" are JSON-RPC 2.0's.

* :func:`parse_post` reads a POST body into an :class:`McpPost` (its messages: method, id,
  tool name, arguments); :func:`traffic` sorts a request into ``control`` (never throttled or
  queued), ``stream`` (long-lived: no slot, no total timeout) and ``call`` (policies apply).
* :func:`check_headers`: the ``Mcp-Method`` / ``Mcp-Name`` / ``MCP-Protocol-Version`` headers
  of protocol 2026-07-28 must agree with the body (:class:`HeaderMismatch`, a 400).
* :func:`fingerprint`: the idempotency fingerprint of a request: method, params (tool,
  arguments, MRTR continuation...) and chosen headers; never the JSON-RPC ``id`` nor
  ``_meta``, which differ on every call.
* :func:`rewrite_id`: a stored answer (JSON or SSE) given the id of the request it replays to.
* :func:`for_replay`: a stored SSE answer without the server's requests to the
  first call's client (an elicitation, a sampling call) and its progress, as a replay gives
  it.
* :class:`AnswerTracker` / :func:`answer_outcome`: whether an answer, as it streams, holds the
  response to the request yet, and whether that response is a tool failure.
* :func:`refusal`: the JSON-RPC error body Sluice answers a refused call with (docs/mcp.md);
  :func:`cancelled`, a call its client cancelled while it waited in Sluice (JSON or SSE, as
  :func:`accepts_sse` tells); :func:`cancel_notification`, Sluice's own cancel of a request
  it sent (at the revisions where :func:`cancels_by_closing` is false).

Errors: everything raised here for bad input is a ``ValueError``: :class:`InvalidMcpRequest`
(the POST cannot be read as MCP; answer 400) and its subclass :class:`HeaderMismatch`, and
:class:`UnusableAnswer` (a stored answer holds no response to rewrite).

Sources: the MCP specification (modelcontextprotocol/modelcontextprotocol), revisions
2025-03-26 (JSON-RPC batches added), 2025-06-18 (batches removed; the ``MCP-Protocol-Version``
header, and "assume 2025-03-26" when it is missing), 2025-11-25 (sessions, the GET stream,
``Last-Event-ID``), 2026-07-28 (``basic/transports/streamable-http``: request metadata headers
and their Base64 sentinel, server validation, no sessions or GET stream,
``subscriptions/listen``; ``basic/index``: request ids are strings or integers, never null,
error code ranges; ``basic/patterns/mrtr``: ``InputRequiredResult``, ``inputResponses``,
``requestState``); JSON-RPC 2.0; the SSE parsing rules of the WHATWG HTML standard
(server-sent events, "interpreting an event stream").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from policies import bodies

RequestId = str | int
"""A JSON-RPC request id as MCP allows it: a string or an integer, never null (2026-07-28
``basic/index``; earlier revisions say the same)."""

Kind = Literal["request", "notification", "response"]

Traffic = Literal["control", "stream", "call"]
"""How admission treats a request to an MCP endpoint:

* ``control``: session plumbing that must never be throttled, queued or refused by a limit
  (refusing it breaks the session for every call): ``initialize``, ``server/discover``,
  ``ping``, notifications, responses to server requests, any ``*/list``, DELETE (session end)
  and any method other than GET and POST;
* ``stream``: a long-lived server-to-client stream: the 2025-era GET (the session's stream,
  or the resumption of a cut response stream with ``Last-Event-ID``) and 2026-07-28's
  ``subscriptions/listen``. Holds no slot, has no total timeout (an idle one only);
* ``call``: everything else (``tools/call``, ``resources/read``, ``prompts/get``, ...).
"""

#: JSON-RPC "Invalid params": the caller's mistake, not a failing tool.
INVALID_PARAMS = -32602

#: ``_meta`` key carrying the protocol version in 2026-07-28 requests.
META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"

#: The first protocol revision whose request metadata headers servers must validate.
MODERN_VERSION = "2026-07-28"

#: The header naming a request's protocol revision (sent after ``initialize``).
VERSION_HEADER = "MCP-Protocol-Version"

#: The header naming a request's session (2025 revisions, session-mode servers).
SESSION_HEADER = "Mcp-Session-Id"

#: The header by which a GET resumes an SSE stream after the last event its client got
#: (2025 revisions; WHATWG ``Last-Event-ID``).
LAST_EVENT_ID_HEADER = "Last-Event-ID"

#: The notification a client sends to cancel one of its requests (``params.requestId``).
CANCELLED = "notifications/cancelled"

#: Methods whose ``params.name`` (or ``params.uri``) is mirrored in ``Mcp-Name`` (2026-07-28).
NAMED_METHODS = frozenset({"tools/call", "resources/read", "prompts/get"})

#: Request methods that are control traffic whatever their name (the ``*/list`` ones are too):
#: the session's own management, and a task's follow-ups (MCP 2025-11-25), whose work was
#: admitted as the ``tools/call`` that made the task. Counted as calls, a run at its
#: ``max_requests`` could not even cancel its own task, and a ``logging/setLevel`` queued
#: behind tool calls for a slot (a hostile trial). What asks the server for work of its own
#: (``tools/call``, ``resources/read``, ``prompts/get``, a method not known here) is a call.
CONTROL_METHODS = frozenset({
    "initialize", "server/discover", "ping", "logging/setLevel", "completion/complete",
    "resources/subscribe", "resources/unsubscribe", "tasks/get", "tasks/result",
    "tasks/cancel",
})

#: A task's follow-ups (MCP 2025-11-25, experimental tasks), each naming ``params.taskId``:
#: what Sluice reads for a task's end while it holds the ``tools/call`` that made the task
#: (``proxy.mcp_tasks``).
TASK_METHODS = frozenset({"tasks/get", "tasks/result", "tasks/cancel"})
#: The notification a server may send when a task's status changes (``params`` is the Task).
TASK_STATUS = "notifications/tasks/status"
#: A task's statuses after which its server runs nothing more for it.
TASK_TERMINAL = frozenset({"completed", "failed", "cancelled"})

#: Request methods a client connecting to a server sends first: new work for a draining
#: replica (its client would connect there, then have its first call refused ``draining``).
OPENING_METHODS = frozenset({"initialize", "server/discover"})

#: Request methods that open a long-lived stream.
STREAM_METHODS = frozenset({"subscriptions/listen"})

SSE = "text/event-stream"

#: The requests of a server's to its client that a tool waits on for its answer (MCP
#: 2025-11-25: elicitation, sampling, the client's roots). Not ``ping``, which no tool
#: waits on (a review: a server's ping on a call's stream made its caller's leaving end
#: the call, the tool ran on and its retry ran it again), nor a method this list does not
#: know: a call is then finished without its caller, as before.
CLIENT_ANSWERED = frozenset({"elicitation/create", "sampling/createMessage", "roots/list"})

_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
_B64_PREFIX, _B64_SUFFIX = "=?base64?", "?="


# -- errors -------------------------------------------------------------------------------------


class InvalidMcpRequest(ValueError):
    """The POST body is not an MCP JSON-RPC message Sluice can read: answer 400.

    ``method``: the JSON-RPC method of the POST when its body was read before the fault (a
    header that disagrees with it), for the refusal's event; ``None`` otherwise.
    ``rpc_id``: the id its error echoes (:func:`echoed_id`) when the body was parsed before
    the fault, so that the refusal need not parse it again; ``None`` otherwise.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.method: str | None = None
        self.rpc_id: RequestId | None = None


class HeaderMismatch(InvalidMcpRequest):
    """An MCP request header disagrees with the body, or cannot be decoded: answer 400.

    MCP 2026-07-28 has servers answer this with JSON-RPC error -32020 ``HeaderMismatch``;
    an intermediary only owes an HTTP error status (a JSON-RPC body is optional for it).
    """

    def __init__(self, header: str, header_value: str, body_value: object) -> None:
        super().__init__(f"header {header}: {header_value!r} does not match the body's "
                         f"{body_value!r}")
        self.header, self.header_value, self.body_value = header, header_value, body_value


class UnusableAnswer(ValueError):
    """A stored answer holds no JSON-RPC response to the request it was stored for."""


# -- parsing a POST -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Message:
    """One JSON-RPC message of a POST body, as sent.

    ``params`` is the request's ``params`` object (``None`` when absent); for a response,
    ``result`` or ``error`` carries the answer.
    """

    kind: Kind
    method: str | None
    id: RequestId | None
    params: Mapping[str, Any] | None = None

    @property
    def tool(self) -> str | None:
        """The tool a ``tools/call`` names (``params.name``); ``None`` for anything else."""
        if self.method == "tools/call" and self.params is not None:
            return self.params["name"]
        return None

    @property
    def target(self) -> str | None:
        """What ``Mcp-Name`` mirrors: ``params.name``, or ``params.uri`` for
        ``resources/read``, on the methods of :data:`NAMED_METHODS`; else ``None``."""
        if self.method not in NAMED_METHODS or self.params is None:
            return None
        value = self.params.get("uri" if self.method == "resources/read" else "name")
        return value if isinstance(value, str) else None

    @property
    def arguments(self) -> Mapping[str, Any]:
        """``params.arguments`` of a ``tools/call`` or ``prompts/get``; ``{}`` when absent."""
        if self.params is None:
            return {}
        args = self.params.get("arguments")
        return args if isinstance(args, Mapping) else {}

    @property
    def traffic(self) -> Traffic:
        """This message's :data:`Traffic` class when POSTed."""
        if self.kind != "request":
            return "control"  # notifications (incl. cancellations) and responses
        assert self.method is not None
        if self.method in CONTROL_METHODS or self.method.endswith("/list"):
            return "control"
        if self.method in STREAM_METHODS:
            return "stream"
        return "call"


@dataclass(frozen=True, slots=True)
class McpPost:
    """A parsed POST body: one message, or a batch (protocol 2025-03-26 only)."""

    messages: tuple[Message, ...]
    batch: bool = False

    @property
    def request(self) -> Message | None:
        """The one request of a non-batch POST; ``None`` for a notification, a response or a
        batch."""
        if self.batch or self.messages[0].kind != "request":
            return None
        return self.messages[0]

    @property
    def tool(self) -> str | None:
        """The tool of a non-batch ``tools/call``, the operation per-tool policies key on."""
        request = self.request
        return request.tool if request is not None else None

    @property
    def opens_session(self) -> bool:
        """Whether the POST holds a client's first request to a server (:data:`OPENING_METHODS`:
        a 2025 client's ``initialize``, a new session; a 2026-07-28 client's
        ``server/discover``), alone or in a 2025-03-26 batch (which a server may take)."""
        return any(m.method in OPENING_METHODS and m.kind == "request" for m in self.messages)

    @property
    def method(self) -> str | None:
        """The JSON-RPC method of a non-batch POST's request or notification (e.g.
        ``initialize``, ``tools/call``); ``None`` for a response or a batch."""
        return None if self.batch else self.messages[0].method

    @property
    def answers(self) -> tuple[RequestId, ...]:
        """The ids of the server's requests to its client that the POST's responses answer
        (an elicitation's, a sampling call's), in order; ``()`` for a POST holding none."""
        return tuple(m.id for m in self.messages if m.kind == "response" and m.id is not None)

    @property
    def asks_task(self) -> bool:
        """A non-batch ``tools/call`` asking to run as a task (``params.task``, an object:
        MCP 2025-11-25), which its server answers at once with a ``CreateTaskResult``."""
        request = self.request
        return (request is not None and request.method == "tools/call"
                and request.params is not None and isinstance(request.params.get("task"), dict))

    @property
    def task_id(self) -> str | None:
        """The task a non-batch ``tasks/get``, ``tasks/result`` or ``tasks/cancel`` names
        (``params.taskId``, a string); ``None`` for any other POST."""
        request = self.request
        if request is None or request.method not in TASK_METHODS or request.params is None:
            return None
        task_id = request.params.get("taskId")
        return task_id if isinstance(task_id, str) else None

    @property
    def cancels(self) -> RequestId | None:
        """The request a non-batch ``notifications/cancelled`` cancels: its
        ``params.requestId`` as sent (a string and a number are different ids); ``None`` for
        any other POST, or a cancel naming no valid id."""
        message = self.messages[0]
        if self.batch or message.method != CANCELLED or message.kind != "notification":
            return None
        request_id = message.params.get("requestId") if message.params is not None else None
        return request_id if is_id(request_id) else None


def allows_batch(protocol_version: str | None) -> bool:
    """Whether a POST may carry a JSON-RPC batch at this ``MCP-Protocol-Version``.

    Batches exist in revision 2025-03-26 only (removed in 2025-06-18); a request without the
    header is taken to be 2025-03-26, as revisions 2025-06-18 on tell servers to.
    """
    return protocol_version is None or protocol_version == "2025-03-26"


def is_modern(protocol_version: str | None) -> bool:
    """Whether this ``MCP-Protocol-Version`` requires header/body validation (2026-07-28 on)."""
    return (protocol_version is not None and _VERSION.fullmatch(protocol_version) is not None
            and protocol_version >= MODERN_VERSION)


def parse_post(body: bytes, protocol_version: str | None = None) -> McpPost:
    """Read an MCP POST body.

    ``protocol_version`` is the request's ``MCP-Protocol-Version`` header (``None`` when
    absent); it decides whether a batch (a JSON array) is allowed, see :func:`allows_batch`.

    Raises :class:`InvalidMcpRequest` (a ``ValueError``), and nothing else, for anything that
    is not UTF-8 JSON holding JSON-RPC 2.0 messages as MCP allows them: ``"jsonrpc": "2.0"``;
    a request or notification with a string ``method`` and, if present, an object ``params``;
    a request ``id`` that is a string or an integer; a response with exactly one of
    ``result`` / ``error`` and such an ``id`` (``null`` allowed for an error); a ``tools/call``
    with a string ``params.name`` and, if present, an object ``params.arguments``.
    """
    try:
        doc = bodies.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidMcpRequest(f"body is not JSON: {exc}") from None
    if isinstance(doc, list):
        if not allows_batch(protocol_version):
            raise InvalidMcpRequest(
                f"JSON-RPC batch at protocol {protocol_version}: only 2025-03-26 has batches")
        if not doc:
            raise InvalidMcpRequest("empty JSON-RPC batch")
        return McpPost(tuple(_message(m) for m in doc), batch=True)
    try:
        return McpPost((_message(doc),))
    except InvalidMcpRequest as bad:
        bad.rpc_id = echoed_id(doc)
        raise


def echoed_id(doc: object) -> RequestId | None:
    """The id an error answer to the parsed body ``doc`` echoes: its ``id`` when a string or
    an integer (MCP's ids), else ``None`` (a batch, an id that is not one: a list nested 300
    deep once made the refusal itself fail, 500)."""
    found = doc.get("id") if isinstance(doc, dict) else None
    return found if is_id(found) else None


def is_id(value: object) -> bool:
    """``value`` can be a JSON-RPC request id as MCP has them: a string or an integer."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _message(doc: object) -> Message:
    if not isinstance(doc, dict):
        raise InvalidMcpRequest("a JSON-RPC message must be an object")
    if doc.get("jsonrpc") != "2.0":
        raise InvalidMcpRequest('"jsonrpc" must be "2.0"')
    if "method" in doc:
        method = doc["method"]
        if not isinstance(method, str) or not method:
            raise InvalidMcpRequest('"method" must be a non-empty string')
        params = doc.get("params")
        if params is not None and not isinstance(params, dict):
            raise InvalidMcpRequest('"params" must be an object')
        if method == "tools/call":
            if params is None or not isinstance(params.get("name"), str):
                raise InvalidMcpRequest('tools/call needs a string "params.name"')
            if params.get("arguments") is not None and not isinstance(params["arguments"], dict):
                raise InvalidMcpRequest('tools/call "params.arguments" must be an object')
        if "id" not in doc:
            return Message("notification", method, None, params)
        if not is_id(doc["id"]):
            raise InvalidMcpRequest('a request "id" must be a string or an integer')
        return Message("request", method, doc["id"], params)
    if ("result" in doc) == ("error" in doc):
        raise InvalidMcpRequest("a message needs a method, a result or an error")
    rpc_id = doc.get("id")
    if not (is_id(rpc_id) or (rpc_id is None and "error" in doc)):
        raise InvalidMcpRequest('a response "id" must be a string or an integer')
    return Message("response", None, rpc_id)


def traffic(http_method: str, post: McpPost | None = None) -> Traffic:
    """The :data:`Traffic` class of a request to the MCP endpoint.

    ``http_method`` is the HTTP method; ``post`` the parsed body of a POST (required then).
    A batch is a ``call`` when any of its messages is one, else ``control``.
    """
    method = http_method.upper()
    if method == "GET":
        return "stream"
    if method != "POST":
        return "control"
    if post is None:
        raise TypeError("traffic() of a POST needs its parsed body")
    classes = {m.traffic for m in post.messages}
    if "call" in classes:
        return "call"
    return "stream" if "stream" in classes else "control"


def resumes(http_method: str, headers: Mapping[str, str]) -> bool:
    """Whether a request to the MCP endpoint resumes an SSE stream: a GET with a non-empty
    ``Last-Event-ID``, by which a 2025-11-25 client gets the rest of a call's answer that a
    server closed early for polling (SEP-1699), the answer to work already admitted (or the
    rest of a session's GET stream that ended: the two look alike to a proxy). Its
    :func:`traffic` is still ``stream``."""
    return http_method.upper() == "GET" and bool(headers.get(LAST_EVENT_ID_HEADER))


# -- request metadata headers -------------------------------------------------------------------


def decode_header_value(value: str, header: str = "Mcp-Name") -> str:
    """A request metadata header value with its Base64 sentinel (``=?base64?...?=``) decoded.

    Raises :class:`HeaderMismatch` when the sentinel holds no valid Base64 of UTF-8.
    """
    if not (value.startswith(_B64_PREFIX) and value.endswith(_B64_SUFFIX)
            and len(value) >= len(_B64_PREFIX) + len(_B64_SUFFIX)):
        return value
    try:
        raw = base64.b64decode(value[len(_B64_PREFIX):-len(_B64_SUFFIX)], validate=True)
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise HeaderMismatch(header, value, "(valid Base64 of UTF-8)") from None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    values = _header_values(headers, name)
    return ", ".join(values) if values else None


def _header_values(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:  # a multidict (aiohttp's request.headers): case-insensitive already
        return list(getall(name, []))
    lower = name.lower()
    return [v for k, v in headers.items() if k.lower() == lower]


def check_headers(post: McpPost, headers: Mapping[str, str], *, require: bool = False) -> None:
    """Check that the request metadata headers agree with the body (2026-07-28 transport).

    ``Mcp-Method`` must equal the message's ``method``; ``Mcp-Name`` (Base64 sentinel decoded)
    its ``params.name`` / ``params.uri`` (see :attr:`Message.target`), and may only appear on
    the methods of :data:`NAMED_METHODS`; ``MCP-Protocol-Version`` must equal the body's
    ``params._meta["io.modelcontextprotocol/protocolVersion"]`` when both are present. A
    header that is absent is not checked unless ``require`` is true: then ``Mcp-Method`` is
    required on a request, and ``Mcp-Name`` on the named methods (pass
    ``require=is_modern(version)`` to hold 2026-07-28 clients to the spec). A batch may carry
    none of them. ``Mcp-Param-*`` headers need the tool's ``inputSchema`` and are not checked.

    ``headers`` is any mapping; a multidict is read with ``getall``, a plain mapping
    case-insensitively. Raises :class:`HeaderMismatch` (a ``ValueError``; answer 400).
    """
    method_h = _header(headers, "Mcp-Method")
    name_h = _header(headers, "Mcp-Name")
    if post.batch:
        for header, value in (("Mcp-Method", method_h), ("Mcp-Name", name_h)):
            if value is not None:
                raise HeaderMismatch(header, value, "(a batch)")
        return
    message = post.messages[0]
    if method_h is not None and method_h != message.method:
        raise HeaderMismatch("Mcp-Method", method_h, message.method)
    if method_h is None and require and message.kind == "request":
        raise HeaderMismatch("Mcp-Method", "(missing)", message.method)
    if name_h is not None:
        if message.method not in NAMED_METHODS:
            raise HeaderMismatch("Mcp-Name", name_h, f"(no name on {message.method})")
        if decode_header_value(name_h) != message.target:
            raise HeaderMismatch("Mcp-Name", name_h, message.target)
    elif require and message.kind == "request" and message.method in NAMED_METHODS:
        raise HeaderMismatch("Mcp-Name", "(missing)", message.target)
    version_h = _header(headers, VERSION_HEADER)
    meta = message.params.get("_meta") if message.params is not None else None
    body_version = meta.get(META_PROTOCOL_VERSION) if isinstance(meta, dict) else None
    if version_h is not None and body_version is not None and version_h != body_version:
        raise HeaderMismatch(VERSION_HEADER, version_h, body_version)


# -- idempotency fingerprint --------------------------------------------------------------------


#: The params :func:`fingerprint` has counted by name since before it counted them all.
_COUNTED_PARAMS = frozenset({"_meta", "inputResponses", "requestState"})


def fingerprint(message: Message, headers: Mapping[str, str] | None = None,
                names: Iterable[str] = (), body: bytes | None = None,
                after: bytes | None = None) -> str:
    """The idempotency fingerprint of a request: 64 hex digits of SHA-256.

    Covers the method, every member of ``params`` but ``_meta``, as canonical JSON (keys
    sorted at every depth, so key order does not matter; ``1`` and ``1.0`` stay different):
    for a ``tools/call`` the tool's ``name`` and ``arguments``, a task it asks to be run as
    (``task``: its answer is a task, not the tool's result), the MRTR continuation
    ``inputResponses`` and ``requestState`` (2026-07-28: the retry of a call that got an
    ``InputRequiredResult`` has the same arguments and must not replay that result); for
    another method its own (a ``resources/read``'s ``uri``, a ``tasks/get``'s ``taskId``: only
    the method and a name once counted, and two tasks' polls shared an answer). And the
    values of the headers ``names`` (case-insensitive; several values joined by ``", "``; an
    absent header differs from an empty one). Never the JSON-RPC ``id`` nor ``params._meta``
    (a progress token, client info): both change from one identical call to the next.

    ``body``, the POST holding ``message`` alone: where it has a run of 19 digits, its
    ``params`` are read again with the standard library, keeping exact the integers
    ``orjson`` (which read ``message``) makes floats, those outside 64 bits: else
    ``123...890`` and ``123...891`` would share a fingerprint, and the second call get the
    first one's answer. Every other value reads as ``orjson`` reads it, so the fingerprint is
    the same either way for a body without such an integer.

    ``after``: for an MRTR continuation whose ``requestState`` Sluice saw the server make
    (:func:`continuation_of`), what stands for that state instead: the round it continues.
    The state itself is sealed with a random nonce by the Python SDK, so an identical call's
    continuation never matched, and a ``dedup`` route ran the tool once per retry (a hostile
    trial). A state Sluice did not see made counts as itself, as before.

    Raises:
        InvalidMcpRequest: the material is nested deeper than ``orjson`` writes (254 levels;
            it reads 1,024).
    """
    params: Mapping[str, Any] = message.params or {}
    if body is not None and _LONG_NUMBER.search(body):
        try:
            doc = bodies.loads(body, _exact_loads)
        except RecursionError:
            raise InvalidMcpRequest(_TOO_DEEP) from None
        exact = doc.get("params") if isinstance(doc, dict) else None
        params = exact if isinstance(exact, dict) else {}
    arguments = params.get("arguments")
    chosen = sorted({n.lower() for n in names})
    material = [
        message.method, message.target, arguments if isinstance(arguments, Mapping) else {},
        params.get("inputResponses"),
        params.get("requestState") if after is None else ["after", after.hex()],
        [[n, _header(headers, n) if headers is not None else None] for n in chosen],
    ]
    # The other params, only when there are any: a fingerprint made before they counted
    # stays the same, so an answer stored then still replays.
    counted = None if message.target is None else (
        "uri" if message.method == "resources/read" else "name")
    rest = {k: v for k, v in params.items()
            if k not in _COUNTED_PARAMS and k != counted
            and not (k == "arguments" and isinstance(v, Mapping))}
    if rest:
        material.append(rest)
    try:
        canonical = orjson.dumps(material, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # it reads 1,024 levels of nesting but writes 254
        raise InvalidMcpRequest(_TOO_DEEP) from None
    return hashlib.sha256(canonical).hexdigest()


_TOO_DEEP = ("the call's params are nested too deeply for Sluice to fingerprint "
             "(254 levels at most)")
#: 19 digits: the shortest integer outside [-2**63, 2**64) (-9223372036854775809).
_LONG_NUMBER = re.compile(rb"[0-9]{19}")


def _exact_int(text: str) -> int | str:
    """An integer as ``orjson`` reads it where it can (int64 and uint64 values), else one
    standing for its exact value (``orjson`` would read a float)."""
    value = int(text)
    return value if -2**63 <= value < 2**64 else f"\u0000int:{value}"


def _exact_loads(body: bytes) -> Any:
    """``body`` parsed with every integer exact (:func:`_exact_int`)."""
    return json.loads(body, parse_int=_exact_int)


# -- answers: the response to a request, in JSON or SSE -----------------------------------------


def _same_id(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b  # 1 and "1" are different ids


def _is_response_to(doc: object, request_id: RequestId) -> bool:
    return (isinstance(doc, dict) and "method" not in doc and ("result" in doc or "error" in doc)
            and _same_id(doc.get("id"), request_id))


def _is_anonymous_error(doc: object) -> bool:
    """An error response without an id: the server could not read the request."""
    return (isinstance(doc, dict) and "error" in doc and "method" not in doc
            and doc.get("id") is None)


def is_sse(content_type: str | None) -> bool:
    """Whether ``content_type`` (a ``Content-Type`` value, maybe ``None``) is an SSE
    stream's, ``text/event-stream`` with any parameters."""
    return (content_type or "").split(";", 1)[0].strip().lower() == SSE


@dataclass(frozen=True, slots=True)
class Outcome:
    """The response to a request, found in an answer.

    ``is_error_result``: ``result.isError`` is true (the tool ran and failed; the model sees
    it). ``error_code``: the JSON-RPC error's code when the response is an error.
    ``input_required``: ``result.resultType`` is ``"input_required"`` (2026-07-28 MRTR): the
    call is not over, the client will send it again with ``inputResponses``.
    """

    is_error_result: bool = False
    error_code: int | None = None
    input_required: bool = False
    #: The error says the request was cancelled (its client sent ``notifications/cancelled``):
    #: -32800, or code 0 "Request cancelled" (the Python SDK 1.x server). No outcome of the
    #: call: not an answer to keep for its key, nor the tool's failure.
    cancelled: bool = False
    #: An ``input_required`` result's ``requestState`` (a string; ``None`` otherwise), which
    #: the client's continuation echoes byte for byte, and the SHA-256 of its canonical
    #: ``inputRequests`` (what it asked): see :func:`continuation_of`.
    #: (Not compared: what the continuation stands on, not what the answer came to.)
    request_state: str | None = field(default=None, compare=False)
    asked: bytes = field(default=b"", compare=False)
    #: A task named by the result (MCP 2025-11-25 tasks): a ``CreateTaskResult``'s
    #: ``result.task``, or a ``Task`` itself (``tasks/get``, ``tasks/cancel``): its
    #: ``taskId``, ``status`` and ``ttl`` (milliseconds from its creation; ``None``:
    #: unlimited or not given). ``task_id`` is ``None`` for any other result.
    task_id: str | None = field(default=None, compare=False)
    #: The result is a ``CreateTaskResult`` (``result.task``), not a ``Task``.
    task_created: bool = field(default=False, compare=False)
    task_status: str | None = field(default=None, compare=False)
    task_ttl_ms: float | None = field(default=None, compare=False)

    @property
    def tool_failure(self) -> bool:
        """The default failure rule for a tool's breaker: an ``isError`` result, or a JSON-RPC
        error other than -32602 invalid params (the caller's mistake) and a cancellation."""
        return self.is_error_result or (self.error_code is not None and not self.cancelled
                                        and self.error_code != INVALID_PARAMS)


#: JSON-RPC "Internal error": stands for an error response whose code is not an integer.
INTERNAL_ERROR = -32603
#: "Request cancelled" (LSP's RequestCancelled; the Python SDK 2.x server answers a request
#: its client cancelled with it).
REQUEST_CANCELLED = -32800


def _outcome(doc: dict[str, Any]) -> Outcome:
    if "error" in doc:
        error = doc["error"]
        code = error.get("code") if isinstance(error, dict) else None
        if not isinstance(code, int) or isinstance(code, bool):
            code = INTERNAL_ERROR  # still an error that ends the call
        cancelled = code == REQUEST_CANCELLED or (
            code == 0 and isinstance(error, dict) and error.get("message") == "Request cancelled")
        return Outcome(error_code=code, cancelled=cancelled)
    result = doc["result"]
    if not isinstance(result, dict):
        return Outcome()
    if result.get("resultType") != "input_required":
        task = result.get("task")
        created = isinstance(task, dict)
        task = task if created else result
        task_id = task.get("taskId")
        if isinstance(task_id, str) and isinstance(task.get("status"), str):
            ttl = task.get("ttl")
            return Outcome(is_error_result=result.get("isError") is True, task_id=task_id,
                           task_created=created, task_status=task["status"],
                           task_ttl_ms=float(ttl) if isinstance(ttl, (int, float))
                           and not isinstance(ttl, bool) and ttl >= 0 else None)
        return Outcome(is_error_result=result.get("isError") is True)
    state = result.get("requestState")
    try:
        asked = hashlib.sha256(orjson.dumps(result.get("inputRequests"),
                                            option=orjson.OPT_SORT_KEYS)).digest()
    except orjson.JSONEncodeError:  # nested too deeply to write: its state is not followed
        state, asked = None, b""
    return Outcome(is_error_result=result.get("isError") is True, input_required=True,
                   request_state=state if isinstance(state, str) else None, asked=asked)


def state_key(request_state: str) -> bytes:
    """The SHA-256 of an MRTR ``requestState``, by which Sluice finds the round that made it
    (:func:`continuation_of`)."""
    return hashlib.sha256(request_state.encode("utf-8", "surrogatepass")).digest()


def continuation_of(fingerprint: bytes, outcome: Outcome) -> bytes:
    """What a continuation of an MRTR round stands for in its own fingerprint
    (:func:`fingerprint`'s ``after``): the round's fingerprint (``fingerprint``: its call,
    and its own place in the chain) and what its ``input_required`` answer asked
    (``outcome.asked``). Not the ``requestState`` the client echoes: the Python SDK seals it
    with a random nonce, so it differs on every round, and two identical calls' continuations
    never matched; and not nothing in its place, since it carries the answers of the rounds
    before the last (``inputResponses`` holds only the last round's), which tell two
    continuations apart."""
    return hashlib.sha256(fingerprint + b"\0" + outcome.asked).digest()


class AnswerTracker:
    """Follows an answer as its bytes arrive and tells when the response to a request is in.

    ``content_type`` is the answer's ``Content-Type``: ``text/event-stream`` is read event by
    event (the response may follow progress notifications and, before 2026-07-28, server
    requests); anything else is taken as one JSON document, complete only at :meth:`finish`.
    A JSON-RPC batch answer (2025-03-26) counts once it holds the response to ``request_id``.
    An error response with a ``null`` id (the server could not read the request) counts as
    the response when the answer is JSON.

    :meth:`feed` returns the :class:`Outcome` once the response has arrived (and on every
    later call); :attr:`complete_at` is then the number of answer bytes up to the end of the
    event carrying it, what to store. Memory grows with the answer; the caller bounds it.
    """

    def __init__(self, content_type: str | None, request_id: RequestId) -> None:
        self.request_id = request_id
        self.sse = is_sse(content_type)
        self.outcome: Outcome | None = None
        self.complete_at: int | None = None
        self._buf = b""      # JSON: the whole body, once finished; SSE: the unread tail
        self._read = 0       # SSE: answer bytes before ``_buf``
        #: Chunks not in ``_buf`` yet: a JSON answer's (joined at its end), or those that
        #: continue an SSE line without ending it (joined once one does). Adding each to
        #: ``_buf`` copied and rescanned the answer so far per chunk: a 64 MB answer in
        #: 16 KB chunks took 3-4 s instead of 0.5 (a review).
        self._parts: list[bytes] = []
        self._data: list[bytes] = []
        #: SSE: the last event id the answer set (WHATWG ``id`` field; ``b""`` for none), as
        #: a client has it: taken when its event ends (is dispatched), not at its ``id``
        #: line. A client cut inside an event resumes from the id before it, and noted under
        #: the half event's id, its call was never found again (a review).
        self.last_event_id = b""
        #: SSE: an ``id`` field of the event still being read, not yet in effect.
        self._id_pending: bytes | None = None
        #: SSE: the ids of the server's requests to its client the answer has carried that
        #: a tool waits on (:data:`CLIENT_ANSWERED`) and the client has not answered yet
        #: (:meth:`client_answered`); ``None`` until the first one.
        self._asks: set[RequestId] | None = None
        #: Called with a task's id and status when the answer carries a
        #: ``notifications/tasks/status`` with a terminal status (:data:`TASK_TERMINAL`), up
        #: to the response (``proxy.mcp_tasks`` sets it on the streams of a session with
        #: tasks held); ``None``: not looked for.
        self.on_task_end: Callable[[str, str], None] | None = None

    @property
    def resumable(self) -> bool:
        """An SSE answer that gave its events ids: a client that did not get the response
        reconnects with ``Last-Event-ID`` (the 2025-11-25 polling a server starts by closing
        the stream early, SEP-1699) and gets it there."""
        return self.sse and bool(self.last_event_id)

    @property
    def awaits_client(self) -> bool:
        """The answer has carried a request of the server's to its client (an elicitation,
        a sampling call, ``roots/list``) that the client has not answered
        (:meth:`client_answered`): until it does, the server's tool waits, and the response
        may never come."""
        return bool(self._asks)

    def client_answered(self, request_id: RequestId) -> None:
        """The client has sent its response to the server's request ``request_id`` (a POST
        carrying it): the server's wait for it is over."""
        if self._asks:
            self._asks.discard(request_id)

    @property
    def between_events(self) -> bool:
        """An SSE answer whose bytes so far end where a new event may begin (no part of a
        line or of an event's data pending): an event written now would arrive whole. Only
        until :attr:`outcome` is set: the tracker reads nothing past the response, so after
        it this says where the chunk carrying the response ended, not where the answer is
        (read only before it: ``proxy.forward.end_mcp_answer`` checks ``outcome`` first)."""
        return self.sse and not self._buf and not self._data and self._id_pending is None

    def begin(self, status: int, reason: str | None, headers: object) -> None:
        """The answer's status line and headers (the relay's capture interface): the
        tracker reads the body only."""

    def feed(self, chunk: bytes) -> Outcome | None:
        """Take the next bytes of the answer."""
        if self.outcome is not None:
            return self.outcome
        if not self.sse:
            self._parts.append(chunk)
            return None
        buf = self._buf
        if (buf and not buf.endswith(b"\r") and chunk.find(b"\n") < 0
                and chunk.find(b"\r") < 0):
            self._parts.append(chunk)  # inside a line that has not ended yet
            return None
        self._buf = self._joined(chunk)
        self._lines(final=False)
        return self.outcome

    def _joined(self, chunk: bytes = b"") -> bytes:
        """``_buf`` with the chunks held aside and ``chunk`` after it."""
        parts = self._parts
        if not parts:
            return self._buf + chunk
        self._parts = []
        return b"".join((self._buf, *parts, chunk))

    def finish(self) -> Outcome | None:
        """The answer has ended: the outcome, or ``None`` if the response never came."""
        if self.outcome is not None:
            return self.outcome
        self._buf = self._joined()
        if self.sse:
            self._lines(final=True)  # a last line without its end of line still counts
            return self.outcome      # an event not ended by a blank line is never dispatched
        try:
            doc = orjson.loads(self._buf)
        except orjson.JSONDecodeError:
            return None
        if isinstance(doc, list):
            found = next((d for d in doc if _is_response_to(d, self.request_id)), None)
        elif _is_response_to(doc, self.request_id) or _is_anonymous_error(doc):
            found = doc
        else:
            found = None
        if found is not None:
            self.outcome, self.complete_at = _outcome(found), len(self._buf)
        return self.outcome

    def _lines(self, *, final: bool) -> None:
        buf, pos = self._buf, 0
        # The next CR and LF at or after pos (-1: none left), each searched for again only
        # once pos has passed it: searching both from every line rescanned the rest of the
        # buffer per line for a character it does not hold (CR, in LF streams).
        cr = buf.find(b"\r")
        lf = buf.find(b"\n")
        while self.outcome is None:
            if 0 <= cr < pos:
                cr = buf.find(b"\r", pos)
            if 0 <= lf < pos:
                lf = buf.find(b"\n", pos)
            if cr < 0 and lf < 0:
                if final and pos < len(buf):
                    self._line(buf[pos:], len(buf))
                    pos = len(buf)
                break
            end = lf if cr < 0 else cr if lf < 0 else min(cr, lf)
            if buf[end:end + 1] == b"\r" and end + 1 == len(buf) and not final:
                break  # maybe the first half of CRLF: wait for the next byte
            width = 2 if buf[end:end + 2] == b"\r\n" else 1
            self._line(buf[pos:end], self._read + end + width)
            pos = end + width
        self._read += pos
        self._buf = buf[pos:]

    def _line(self, line: bytes, offset: int) -> None:
        if not line:
            if self._id_pending is not None:  # the event is dispatched: its id takes effect
                self.last_event_id, self._id_pending = self._id_pending, None
            if self._data:
                self._event(b"\n".join(self._data), offset)
                self._data = []
            return
        if line.startswith(b":"):
            return  # a comment (keep-alive)
        field, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if field == b"data":
            self._data.append(value)
        elif field == b"id" and b"\0" not in value:
            self._id_pending = value

    def _event(self, data: bytes, offset: int) -> None:
        doc = _loads_or_none(data)  # not JSON (a priming event's data is empty): not it
        if _is_response_to(doc, self.request_id):
            self.outcome, self.complete_at = _outcome(doc), offset
        elif (isinstance(doc, dict) and doc.get("method") in CLIENT_ANSWERED
              and is_id(doc.get("id"))):
            if self._asks is None:
                self._asks = set()
            self._asks.add(doc["id"])  # 1 and "1" stay apart in a set, as ids must
        elif self.on_task_end is not None and isinstance(doc, dict):
            ended = task_ended(doc)
            if ended is not None:
                self.on_task_end(*ended)


def task_ended(doc: object) -> tuple[str, str] | None:
    """``(taskId, status)`` when ``doc`` is a ``notifications/tasks/status`` whose status is
    terminal (:data:`TASK_TERMINAL`); ``None`` otherwise."""
    if not isinstance(doc, dict) or doc.get("method") != TASK_STATUS or "id" in doc:
        return None
    params = doc.get("params")
    if not isinstance(params, dict):
        return None
    task_id, status = params.get("taskId"), params.get("status")
    if isinstance(task_id, str) and status in TASK_TERMINAL:
        return task_id, status
    return None


#: The bytes an SSE event carrying a task's status names (:class:`TaskStatusWatch`).
_TASK_STATUS_BYTES = TASK_STATUS.encode()
#: An SSE event longer than this is not read for a task's status: a Task is a few hundred
#: bytes, and a stream's unrelated large events are then skipped, not held whole.
MAX_TASK_STATUS_EVENT_BYTES = 64 * 1024
#: The ends of an SSE event (a blank line): LF, CRLF and CR line ends.
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n")


def _last_event_end(data: bytes) -> int:
    """The offset just past the last blank line in ``data`` (0: none)."""
    return max((at + len(end) for end in _EVENT_ENDS if (at := data.rfind(end)) >= 0),
               default=0)


def _first_event_end(data: bytes) -> int:
    """The offset just past the first blank line in ``data`` (-1: none)."""
    found = [at + len(end) for end in _EVENT_ENDS if (at := data.find(end)) >= 0]
    return min(found) if found else -1


class TaskStatusWatch:
    """Reads an SSE stream (a session's GET stream, or an SSE answer of a session) for its
    terminal ``notifications/tasks/status`` (:func:`task_ended`), calling
    ``on_task_end(task_id, status)`` for each, and for nothing else.

    Cheap on a busy stream: only an event whose bytes name ``notifications/tasks/status`` is
    parsed (an :class:`AnswerTracker` parsed every event, 8x the CPU on 100k small
    notifications, a review), and of the event being read only up to
    :data:`MAX_TASK_STATUS_EVENT_BYTES` are kept: a larger one is skipped to its end."""

    __slots__ = ("_pending", "_skipping", "on_task_end")

    def __init__(self, on_task_end: Callable[[str, str], None]) -> None:
        self.on_task_end = on_task_end
        #: The bytes of the event being read (or, while skipping, its last few).
        self._pending = b""
        self._skipping = False

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the stream."""
        data = self._pending + chunk if self._pending else chunk
        if self._skipping:
            start = _first_event_end(data)
            if start < 0:
                self._pending = data[-3:]
                return
            self._skipping = False
            data = data[start:]
        end = _last_event_end(data)
        if end and data.find(_TASK_STATUS_BYTES, 0, end) >= 0:
            self._events(data[:end])
        rest = data[end:]
        if len(rest) > MAX_TASK_STATUS_EVENT_BYTES:
            self._skipping, self._pending = True, rest[-3:]
        else:
            self._pending = rest

    def _events(self, data: bytes) -> None:
        for event in data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n"):
            if _TASK_STATUS_BYTES not in event:
                continue
            lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
            ended = task_ended(_loads_or_none(b"\n".join(
                line[1:] if line.startswith(b" ") else line for line in lines)))
            if ended is not None:
                self.on_task_end(*ended)


def task_cancel(request_id: str, task_id: str) -> bytes:
    """The ``tasks/cancel`` request by which Sluice asks a server to stop task ``task_id``
    (MCP 2025-11-25) when it ends the hold of the call that made it (its bound, a run's
    cancel, the drain's cut): a request (``request_id``, Sluice's own), answered with the
    Task or an error (a task already terminal, or unknown)."""
    return orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tasks/cancel",
                         "params": {"taskId": task_id}})


def answer_outcome(answer: bytes, content_type: str | None,
                   request_id: RequestId) -> Outcome | None:
    """The :class:`Outcome` of a whole answer to ``request_id``; ``None`` if it holds no
    response to it (see :class:`AnswerTracker` for what counts)."""
    tracker = AnswerTracker(content_type, request_id)
    tracker.feed(answer)
    return tracker.finish()


def rewrite_id(answer: bytes, content_type: str | None, old_id: RequestId,
               new_id: RequestId) -> bytes:
    """A stored answer to request ``old_id``, made the answer to request ``new_id``.

    JSON: the response object (or the batch member) whose id is ``old_id`` gets ``new_id``
    and is written back compactly. SSE (``text/event-stream``): the event whose data is that
    response gets it, its ``data:`` lines becoming one; every other byte (notifications,
    server requests and their ids, event ids, comments, line ends) stays as it was.

    Raises :class:`UnusableAnswer` when the answer holds no response to ``old_id``: an answer
    with another request's id makes every official client wait until its own timeout
    (docs/mcp.md), so such an answer must not be replayed.
    """
    if is_sse(content_type):
        return _rewrite_sse(answer, old_id, new_id)
    try:
        doc = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise UnusableAnswer("the stored answer is not JSON") from None
    docs = doc if isinstance(doc, list) else [doc]
    for each in docs:
        if _is_response_to(each, old_id):
            each["id"] = new_id
            return _dumps_answer(doc)
    raise UnusableAnswer(f"the stored answer holds no response to id {old_id!r}")


_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _rewrite_sse(answer: bytes, old_id: RequestId, new_id: RequestId) -> bytes:
    lines = [m.group() for m in _LINE.finditer(answer)]  # each with its line end, if any
    data: list[int] = []  # the current event's ``data`` lines, by index
    for i, line in enumerate(lines):
        content = line.rstrip(b"\r\n")
        if content:
            if content.partition(b":")[0] == b"data":
                data.append(i)
            continue
        # A blank line ends the event. (An event cut off before one is never dispatched.)
        doc = _loads_or_none(b"\n".join(_data_value(lines[j]) for j in data)) if data else None
        if _is_response_to(doc, old_id):
            assert isinstance(doc, dict)
            doc["id"] = new_id
            first = lines[data[0]]
            rewritten = b"data: " + _dumps_answer(doc) + first[len(first.rstrip(b"\r\n")):]
            return b"".join([*lines[:data[0]], rewritten,
                             *(lines[j] for j in range(data[0] + 1, len(lines))
                               if j not in data)])
        data = []
    raise UnusableAnswer(f"the stored stream holds no response to id {old_id!r}")


def for_replay(answer: bytes, content_type: str | None) -> bytes:
    """A stored answer as a replay gives it: an SSE answer without the events that carry a
    request of the server's to its client (``elicitation/create``, ``sampling/createMessage``,
    ``roots/list``: a message with a ``method`` and an ``id``) or a ``notifications/progress``,
    each with all its lines (fields and comments); every other byte as it was.

    Both were the first call's: replayed, the retrying client asked its user again (or ran an
    LLM completion again) for a tool that does not run again, and sent its reply to a server
    that no longer waited for it; and a progress notification names the first call's
    ``progressToken``, which the official clients make of the request's id, so in the
    retrying session it reached another call in flight there (a hostile trial). A JSON
    answer holds neither and is returned as it is, as is an SSE answer that holds none.
    """
    if not is_sse(content_type):
        return answer
    lines = [m.group() for m in _LINE.finditer(answer)]
    kept: list[bytes] = []
    event: list[bytes] = []  # the current event's lines (fields, comments)
    data: list[bytes] = []
    dropped = False
    for line in lines:
        content = line.rstrip(b"\r\n")
        if content:
            event.append(line)
            if content.partition(b":")[0] == b"data":
                data.append(_data_value(line))
            continue
        # A blank line ends the event (or is a stray one between events: kept).
        doc = _loads_or_none(b"\n".join(data)) if data else None
        if isinstance(doc, dict) and "method" in doc and (
                "id" in doc or doc["method"] == "notifications/progress"):
            dropped = True
        else:
            kept.extend(event)
            kept.append(line)
        event, data = [], []
    kept.extend(event)  # an event cut off before its blank line: as it was
    return b"".join(kept) if dropped else answer


def _dumps_answer(doc: object) -> bytes:
    try:
        return orjson.dumps(doc)
    except orjson.JSONEncodeError:  # it reads 1,024 levels of nesting but writes 254
        raise UnusableAnswer("the stored answer is nested too deeply to rewrite") from None


def _loads_or_none(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _data_value(line: bytes) -> bytes:
    value = line.rstrip(b"\r\n").partition(b":")[2]
    return value[1:] if value.startswith(b" ") else value


# -- refusals -----------------------------------------------------------------------------------


def refusal(request_id: RequestId | None, code: int, message: str, *, reason: str,
            retry_after_ms: int | None = None, **data: Any) -> bytes:
    """The JSON-RPC error body Sluice answers a refused MCP call with.

    docs/mcp.md measured the official clients: sent with HTTP 200 and ``Content-Type:
    application/json`` it fails that one call on each of them, and the caller can read
    ``data``; with HTTP 429 or 503, the Python ``mcp`` 1.x client tears down the whole session.
    ``code`` should be the refusal's HTTP meaning (429 quota, 503 overload): outside the range
    JSON-RPC and MCP reserve (-32768..-32000), as 2026-07-28 asks of application codes. ``data``
    is ``{"reason": reason, "retryAfterMs": retry_after_ms, **data}`` (``retryAfterMs`` left
    out when ``None``). ``request_id`` ``None`` gives ``"id": null`` (the request was
    unreadable).
    """
    if -32768 <= code <= -32000:
        raise ValueError(f"code {code} is in the range JSON-RPC and MCP reserve")
    payload: dict[str, Any] = {"reason": reason}
    if retry_after_ms is not None:
        payload["retryAfterMs"] = retry_after_ms
    payload.update(data)
    return orjson.dumps({"jsonrpc": "2.0", "id": request_id,
                         "error": {"code": code, "message": message, "data": payload}})


def cancelled(request_id: RequestId | None, *, sse: bool = False) -> bytes:
    """The body that answers a call its client cancelled before Sluice sent it on: the
    JSON-RPC error -32800 "Request cancelled", as the Python SDK 2.x server answers a call
    its client cancelled (:data:`REQUEST_CANCELLED`), with ``data.reason``
    ``client_cancelled`` and ``data.sent`` ``false`` (the server never got it).

    ``sse``: as an SSE stream of that one event (``event: message``), the shape that server
    answers in (to a client whose ``Accept`` takes it, :func:`accepts_sse`). The client has
    given up on the call: the Python 2.x client closes the call's response stream at its
    timeout, and reading a JSON answer after that raised ``anyio.BrokenResourceError`` out
    of the client (its SSE path catches it; a hostile trial)."""
    body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "error": {
        "code": REQUEST_CANCELLED, "message": "Request cancelled",
        "data": {"reason": "client_cancelled", "sent": False}}})
    return b"event: message\ndata: " + body + b"\n\n" if sse else body


def cancel_notification(request_id: RequestId, reason: str) -> bytes:
    """The ``notifications/cancelled`` body by which Sluice asks a server to stop request
    ``request_id`` (the id the server got), with ``reason`` (``params.reason``, for the
    server's logs): the cancellation of MCP 2025-06-18 and 2025-11-25 (the "Cancellation"
    utility), which a server may ignore (a request it does not know, or one done already);
    it answers the request with its response as usual, or with the cancellation error
    (:attr:`Outcome.cancelled`). At 2026-07-28 a client cancels a request on Streamable
    HTTP by closing its response stream instead (:func:`cancels_by_closing`)."""
    return orjson.dumps({"jsonrpc": "2.0", "method": CANCELLED,
                         "params": {"requestId": request_id, "reason": reason}})


def cancels_by_closing(protocol_version: str | None) -> bool:
    """Whether a request made at this ``MCP-Protocol-Version`` is cancelled by closing its
    response stream (2026-07-28 on: "closing the SSE response stream is the cancellation
    signal ... no ``notifications/cancelled`` is required or expected"; the official 2.x
    server acknowledges a posted one and drops it) rather than by a ``notifications/cancelled``
    (the 2025 revisions, and a request without the header: 2025-03-26)."""
    return is_modern(protocol_version)


def accepts_sse(accept: str | None) -> bool:
    """Whether an ``Accept`` header value (``None``: absent) takes ``text/event-stream``:
    that media range, ``text/*`` or ``*/*``, with no ``q=0``. The MCP clients send
    ``application/json, text/event-stream``."""
    for media in (accept or "").split(","):
        kind, _, params = media.partition(";")
        if kind.strip().lower() not in (SSE, "text/*", "*/*"):
            continue
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    if float(value.strip()) <= 0:
                        break
                except ValueError:
                    break
        else:
            return True
    return False
