"""Turning a :class:`~policies.reasons.Rejected` into the response the SPEC fixes.

Headers on every answer Sluice writes itself:

* ``Retry-After``: whole seconds, rounded up, at least 1 (RFC 9110 §10.2.3 allows no
  fractions); ``retry-after-ms`` carries the precise value, which the OpenAI and Anthropic SDKs
  read first.
* ``x-should-retry``: ``true`` when the wait is at most 60 s, else ``false``. Both SDKs obey it
  before their status rules; the OpenAI SDK (3.x) ignores a wait over 120 s and falls back to
  its own back-off of 0.5-8 s (a storm against a long wait), and the Anthropic SDK ignored
  waits over 60 s before its 2.x (2.17 honours any), so a longer wait says "do not retry"
  outright: the caller's own scheduler is the one to hold such a call. It is also
  ``false``, with or without a wait, when the policy says retrying cannot help
  (``Rejected.retry``), e.g. a spent ``N/total`` budget, which it always is for a refusal
  of the request as sent (:data:`policies.reasons.AS_SENT_NEVER`: 400, 401, 403, 404, 413,
  417, 421, 422, 431, 501). The SDKs do not retry those statuses but 501 (a 5xx to them)
  anyway; the header says so to them and to any other client too.
* ``X-Sluice-Reason``: the reason code.
* For quota rejections, the IETF RateLimit fields (draft-ietf-httpapi-ratelimit-headers):
  ``RateLimit-Policy: "name";q=N;w=S`` and ``RateLimit: "name";r=R;t=S``, ``R`` the whole
  units the limit has left: 0 for a request count or a concurrency limit, and for tokens or a
  budget what is left below this request's need (a smaller request may still fit now).

The body uses the route protocol's own error shape so each SDK raises its usual error type.
On ``mcp`` routes a refused call (one with a JSON-RPC id) is answered with HTTP **200** and a
JSON-RPC error echoing its id, code = the reason's status (429, 503, 409, 422), ``data``
``{reason, retryAfterMs}``: the one shape that fails only that call on every official MCP
client (``docs/mcp.md``; a 429 or 503 status ends the whole session of the Python 1.x
client), and so is a 400 ``exceeds_limit`` (a tool's cost over a whole budget). So are a
call's own 502 ``upstream_unreachable`` and 504 ``upstream_timeout`` (code 502 / 504): the
1.x client raises those statuses out of its transport too, cancelling every call of the
session, for one tool that timed out before its answer began. So is a call's 500
``internal_error`` (a fault of Sluice's own before anything was sent, code 500): one call's
bug must not end every call of a 1.x session. Sluice's other errors there (400 unreadable
request, 404, 413) keep their statuses, as do a GET's and a notification's 500/502/504 (no
id to answer).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from policies import bodies, mcp
from policies.reasons import REASON_HEADER, SDK_RETRY_AFTER_CAP_S, Reason, Rejected

if TYPE_CHECKING:
    from proxy.routes import Route
    from proxy.runtime import Runtime

_OPENAI_TYPES = {429: "rate_limit_error", 503: "server_error", 502: "server_error"}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    421: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "request_too_large",
    503: "overloaded_error",
}


def rejection_headers(rejected: Rejected) -> dict[str, str]:
    """The SPEC's "not now" headers for ``rejected`` (see the module docstring)."""
    headers = {REASON_HEADER: rejected.reason.code, "Cache-Control": "no-store"}
    wait = rejected.retry_after
    if wait is not None:
        wait = max(wait, 0.001)
        seconds = max(1, math.ceil(wait))
        headers["Retry-After"] = str(seconds)
        headers["retry-after-ms"] = str(math.ceil(wait * 1000))
        headers["x-should-retry"] = "true" if wait <= SDK_RETRY_AFTER_CAP_S else "false"
        if rejected.policy is not None:
            name, quota, window, remaining = rejected.policy
            unit = ';qu="concurrent-requests"' if window == 0 else f";w={window}"
            name = sf_string(name)
            headers["RateLimit-Policy"] = f"{name};q={quota}{unit}"
            headers["RateLimit"] = f"{name};r={remaining};t={seconds}"
    if rejected.retry is False:
        headers["x-should-retry"] = "false"
    return headers


def sf_string(text: str) -> str:
    """``text`` as a Structured Field String (RFC 9651 §3.3.3): quoted, ``\\`` and ``"``
    escaped, a character outside visible ASCII and space (which a String cannot hold) as
    ``?``. A policy's name may be an operation's (a tool or a model named in the config)."""
    safe = "".join(c if " " <= c <= "~" else "?" for c in text)
    return '"' + safe.replace("\\", "\\\\").replace('"', '\\"') + '"'


def human_duration(seconds: float) -> str:
    """``seconds`` as a person reads a wait: ``0.25s``, ``42s``, ``12m 5s``, ``17h 38m``,
    ``2d 3h``; never an exponent. Waits of a minute or more are rounded up to the unit shown
    last, so the caller is never told to come back too early."""
    if seconds < 10:
        return f"{math.ceil(max(seconds, 0.0) * 1000) / 1000:g}s"
    bigger = math.inf
    for unit, small, small_name, big_name in _DURATION_UNITS:
        if seconds >= unit or unit == 1:
            total = math.ceil(seconds / small)  # rounded up to the unit shown last
            if total * small >= bigger:  # e.g. 59m 59.5s is 1h, not 60m
                return human_duration(total * small)
            big, rest = divmod(total, unit // small)
            if unit == 1:
                return f"{big}s"
            return f"{big}{big_name} {rest}{small_name}" if rest else f"{big}{big_name}"
        bigger = unit
    raise AssertionError("unreachable")


_DURATION_UNITS = ((86400, 3600, "h", "d"), (3600, 60, "m", "h"), (60, 1, "s", "m"),
                   (1, 1, "", ""))


def _message(rejected: Rejected) -> str:
    reason = rejected.reason
    # The caller must see that Sluice answered, not the upstream; a summary that says so
    # itself ("Sluice is shutting down...") is not prefixed again.
    summary = reason.summary
    text = summary if summary.startswith("Sluice ") else f"Sluice: {summary}"
    if rejected.detail:
        text += f" ({rejected.detail})"
    if rejected.retry_after is not None:
        text += f"; retry after {human_duration(rejected.retry_after)}"
    return text


def rejection_body(rejected: Rejected, protocol: str, jsonrpc_id: object = None) -> bytes:
    """The error body in ``protocol``'s shape: openai, anthropic, mcp or http."""
    reason: Reason = rejected.reason
    message = _message(rejected)
    if protocol == "openai":
        kind = _OPENAI_TYPES.get(reason.status, "invalid_request_error")
        if reason.status >= 500 and reason.status not in _OPENAI_TYPES:
            kind = "server_error"
        body: dict = {
            "error": {"message": message, "type": kind, "param": None, "code": reason.code}
        }
    elif protocol == "anthropic":
        kind = _ANTHROPIC_TYPES.get(reason.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": message}}
    elif protocol == "mcp":
        # The JSON-RPC code is the HTTP status: outside -32768..-32000, which JSON-RPC and MCP
        # reserve (MCP 2026-07-28 basic/index), and what ToolHive uses for rate limits.
        retry_ms = (None if rejected.retry_after is None
                    else math.ceil(rejected.retry_after * 1000))
        return mcp.refusal(jsonrpc_id, reason.status, message, reason=reason.code,
                           retry_after_ms=retry_ms)
    else:
        retry_s = None if rejected.retry_after is None else round(rejected.retry_after, 3)
        body = {"error": {"reason": reason.code, "message": message, "retry_after_s": retry_s}}
    return orjson.dumps(body)


def jsonrpc_id(protocol: str, body: bytes) -> mcp.RequestId | None:
    """The JSON-RPC ``id`` of an MCP request (:func:`mcp.echoed_id`), ``body`` parsed; ``None``
    for none. Not for a refusal: its request path read the id already (``Call.rpc_id``), and
    parsing a 25 MB body again would stall the loop outside its turn."""
    if protocol != "mcp" or not body:
        return None
    try:
        message = bodies.loads(body)
    except orjson.JSONDecodeError:
        return None
    return mcp.echoed_id(message)


#: Refusals and failures of one MCP call that go out as HTTP 200 + JSON-RPC error (see the
#: module docstring).
_MCP_CALL_REFUSALS = frozenset({409, 422, 429, 500, 502, 503, 504})
#: 400s that are a policy's verdict on one call, not an unreadable request: a tool whose cost
#: exceeds a whole budget must fail that call only, as a spent budget's 429 does.
_MCP_CALL_REFUSAL_REASONS = frozenset({Reason.EXCEEDS_LIMIT})


def render(rejected: Rejected, protocol: str, jsonrpc_id: object = None) -> web.Response:
    """The whole response for ``rejected`` on a route of ``protocol``; ``jsonrpc_id`` is the
    refused MCP request's id (``None``: not an MCP request, or a notification)."""
    status = rejected.reason.status
    if protocol == "mcp" and jsonrpc_id is not None and (
            status in _MCP_CALL_REFUSALS or rejected.reason in _MCP_CALL_REFUSAL_REASONS):
        status = 200
    return web.Response(
        status=status,
        body=rejection_body(rejected, protocol, jsonrpc_id),
        content_type="application/json",
        headers=rejection_headers(rejected),
    )


def refuse_at_edge(rt: Runtime, rejected: Rejected) -> web.Response:
    """Count ``rejected`` in ``sluice_edge_rejections_total`` and render it in the plain
    ``http`` shape: a refusal made before the request has a route (no events: those are
    per request on a route)."""
    rt.metrics.edge_rejections.labels(rejected.reason.code).inc()
    return render(rejected, "http")


def refuse(rt: Runtime, route: Route, rejected: Rejected, request_id: str, tenant: str,
           run: str | None, idempotency_key: str | None = None,
           operation: str | None = None, mcp_method: str | None = None,
           rpc_id: mcp.RequestId | None = None) -> web.Response:
    """Count ``rejected`` by reason, log its ``rejected`` event, and render it for ``route``.

    The one way Sluice refuses a request on a route, whether before admission (the handler)
    or at the breaker after it (``proxy.attempts``); ``rpc_id`` is the MCP request's id
    as the request path read it (``None``: none, or not read: never parsed here, where a
    large body's parse would stall the loop outside its turn, ``policies.bodies.LargeBodies``);
    ``operation`` is the call's (``policies/operations.py``), counted and logged with it;
    ``mcp_method``, an MCP POST's JSON-RPC method, is logged with it.
    """
    route.metrics.rejections[rejected.reason].inc()
    extra: dict[str, str] = {}
    if operation is not None:
        route.metrics.operation(operation).rejected(rejected.reason.code)
        extra["operation"] = operation
    if mcp_method is not None:
        extra["mcp_method"] = mcp_method
    rt.events.emit("rejected", request_id, route.name, tenant, run, idempotency_key,
                   reason=rejected.reason.code,
                   retry_after_s=None if rejected.retry_after is None
                   else round(rejected.retry_after, 3), **extra)
    return render(rejected, route.protocol, rpc_id)
