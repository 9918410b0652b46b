"""An MCP session's DELETE waits for the session's calls whose answers are kept for a retry.

The official Python clients (1.x, and 2.x in ``legacy`` mode) end a session with ``DELETE``
and its ``Mcp-Session-Id`` when their context exits, before they close the POSTs still open.
The server then ends the session and cancels its tools' tasks. On a ``dedup`` route that
undid what Sluice does for a timed-out call (finishing it without its caller, holding its
client's cancel: ``proxy.handler``): the tool was cancelled after its side effect, its
stream ended without the response, nothing was kept for the key, and the client's retry ran
the tool a second time (a hostile trial, 5 of 5).

The rule, here only: a DELETE of a session (route and ``Mcp-Session-Id``) that has a call
in flight through Sluice whose answer is kept for its key and whose response has not come
(:func:`kept_calls`: its caller waiting, gone, or its cancel held; or held for an answer
closed early for polling) is answered by Sluice at once, 200 with no body as the official
server answers it, and sent upstream once no such call of the session is left
(:func:`call_ended`, from the end of every call). Every such call is bounded by its own
``timeouts``, so the wait is too. A DELETE of a session with none goes through as before.

- The calls are matched by route and session only, not by tenant: the DELETE ends the
  server's session whoever sends it, and deferring it only delays it.
- A second DELETE while one waits is answered 200 too and kept with its own headers (up
  to :data:`MAX_DELETES_KEPT`): once the calls have ended they are sent in the order they
  came until the server takes one (a 2xx), so that a DELETE the server refuses (another
  caller's, without the session owner's credentials) cannot stand for the owner's.
- Requests of the session sent after its DELETE (a client reusing the id) are forwarded as
  before: the server's session is still there. A keyed call among them delays the DELETE
  further, as it would have; the check is made again at each call's end, not against the
  calls of the moment the DELETE came.
- A call held for an answer closed early for polling gets that answer fetched by Sluice
  itself (:func:`proxy.attempts.fetch_held_answer`): its client, having deleted the
  session, will not resume it.
- The drain waits for the calls as ever (``server.drain_timeout``); its cut ends them, and
  each DELETE left is then sent (the drain waits :data:`proxy.server.SHUTDOWN_GRACE_S` for
  those sends), so that the server's session ends with the process rather than at its idle
  timeout.

The DELETE's ``completed`` event is written when Sluice answers it (``2xx``, what its client
got) with ``session_delete: "deferred"`` and the ``call_request_ids`` it waits for; the
upstream send is a ``session_delete_sent`` event under the DELETE's request id (the
upstream's ``status``, 0 when it failed, and ``deferred_s``, seconds since it came).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from aiohttp import hdrs, web

from policies import mcp
from proxy import attempts
from proxy import forward as fwd
from proxy.client import client_timeout, send_aside

if TYPE_CHECKING:
    from multidict import CIMultiDict

    from policies.pipeline import Call
    from proxy.routes import Route
    from proxy.runtime import Runtime

log = logging.getLogger("sluice")

#: How many ended MCP sessions :attr:`Runtime.ended_sessions` remembers (the oldest go first;
#: a call of one forgotten is held to its own bound, as before).
ENDED_SESSIONS_KEPT = 256


#: DELETEs of one session kept while they wait (each with its own headers, sent in turn
#: until the server takes one); those past it are answered 200 and not sent.
MAX_DELETES_KEPT = 4


class Deferred(NamedTuple):
    """A session's DELETE answered by Sluice and not sent yet."""

    route: Route
    #: The DELETE's own request id, tenant and run (its events').
    request_id: str
    tenant: str
    run: str | None
    #: Its headers as they go upstream.
    headers: CIMultiDict[str]
    path: str
    #: Monotonic seconds when it came.
    since: float


def kept_calls(rt: Runtime, route: str, session: str, ending: Call | None = None
               ) -> list[Call]:
    """The calls of MCP ``session`` on ``route`` a DELETE waits for: in flight through
    Sluice (its handler running, finished without its caller, or held for an answer closed
    early for polling), kept for its key (``dedup``), not cancelled by its run, whose
    response has not come, and whose tool does not wait on its client (a server's request,
    an elicitation, unanswered: the deleted session's client will not answer it, and held
    to its timeout it kept the DELETE waiting for nothing); ``ending`` (a call being
    settled now) is not counted."""
    return [call for call in (*rt.mcp_calls, *rt.finishing.values(), *rt.polling.values())
            if call is not ending and call.route == route
            and call.headers.get(mcp.SESSION_HEADER) == session and fwd.kept_for_retry(call)]


def defer(rt: Runtime, route: Route, request: web.BaseRequest, request_id: str, tenant: str,
          run: str | None) -> web.Response | None:
    """Answer a DELETE of an MCP session here, 200 with no body, when it must wait (module
    docstring); ``None`` to forward it as before."""
    session = request.headers.get(mcp.SESSION_HEADER)
    if session is None:
        return None
    key = (route.name, session)
    waits_for = kept_calls(rt, route.name, session)
    waiting = rt.session_deletes.get(key)
    if waiting is None:
        if not waits_for:
            return None
        waiting = rt.session_deletes[key] = []
        for call in waits_for:
            if call in rt.polling.values():  # its client will not resume it now
                attempts.fetch_held_answer(rt, route, call)
    if len(waiting) < MAX_DELETES_KEPT:
        # Each with its own headers: the first one kept, had it been the only one sent, let
        # a stranger's DELETE (refused by the server) stand for the owner's (a review).
        headers = fwd.upstream_headers(request, route.request_drop)
        if route.own_credentials:
            headers.popall(hdrs.AUTHORIZATION, None)
        waiting.append(Deferred(route, request_id, tenant, run, headers, request.raw_path,
                                time.monotonic()))
    route.metrics.outcomes["2xx"].inc()
    rt.events.emit("completed", request_id, route.name, tenant, run, status=200,
                   outcome="2xx", session_delete="deferred",
                   call_request_ids=[call.request_id for call in waits_for])
    return web.Response(status=200)


def held_for_polling(rt: Runtime, route: Route, call: Call) -> None:
    """``call``'s answer was closed early for polling after its session's DELETE came: its
    client will not resume it, so Sluice fetches it (module docstring)."""
    session = call.headers.get(mcp.SESSION_HEADER)
    if session is not None and (route.name, session) in rt.session_deletes:
        attempts.fetch_held_answer(rt, route, call)


def call_ended(rt: Runtime, call: Call) -> None:
    """``call`` ends (``proxy.handler._settle``): send its session's deferred DELETE if no
    call it waits for is left. Never raises."""
    try:
        session = call.headers.get(mcp.SESSION_HEADER)
        if session is None:
            return
        key = (call.route, session)
        waiting = rt.session_deletes.get(key)
        if waiting is None or kept_calls(rt, call.route, session, ending=call):
            return
        del rt.session_deletes[key]
        task = asyncio.create_task(_send_until_taken(rt, waiting))
        # Present from now, not from the task's first step: a drain looking in between
        # saw nothing present and ended before it was sent.
        waiting[0].route.present += 1
        rt.session_delete_tasks.add(task)
        task.add_done_callback(rt.session_delete_tasks.discard)
    except Exception:
        log.exception("route %s: a deferred session DELETE is not sent", call.route)


async def _send_until_taken(rt: Runtime, waiting: list[Deferred]) -> None:
    """Send the DELETEs ``waiting`` upstream in the order they came until the server takes
    one (a 2xx: the session has ended, the rest are not sent), counted present on their
    route (the drain waits), as :func:`call_ended`, which starts it, counted it."""
    route = waiting[0].route
    try:
        for deferred in waiting:
            if await _send(rt, deferred) // 100 == 2:
                return
    finally:
        route.present -= 1


async def _send(rt: Runtime, deferred: Deferred) -> int:
    """Send ``deferred`` upstream within its route's ``timeouts`` and log its
    ``session_delete_sent`` event; the server's status, 0 when it got none."""
    route = deferred.route
    status = 0
    try:
        timeouts = route.config.timeouts
        assert rt.session is not None
        status = await send_aside(
            rt.session, "DELETE", route.url(deferred.path),
            deferred.headers, None, client_timeout(timeouts.total, timeouts.connect),
            f"route {route.name}: the deferred DELETE {deferred.request_id}")
        if status and status < 300:
            end_session_polls(rt, route, deferred.headers.get(mcp.SESSION_HEADER))
    finally:
        rt.events.emit("session_delete_sent", deferred.request_id, route.name,
                       deferred.tenant, deferred.run, status=status,
                       deferred_s=round(time.monotonic() - deferred.since, 6))
    return status


def end_session_polls(rt: Runtime, route: Route, session: str | None) -> None:
    """The upstream closed MCP ``session`` (its client's DELETE): end the calls of it held
    for a polled answer (``proxy.handler._hold_polled``), ``client_disconnected``. Nothing
    can resume their answers now, and held to their bound (600 s without
    ``timeouts.total``) they kept their slots and keys for nothing (a review)."""
    if session is None:
        return
    # A call of it still in flight may be closed early for polling after this (its stream's
    # end read after the DELETE's answer): held then, it kept its slot to its bound, 600 s
    # by default (a hostile trial: a legacy client leaving mid-call).
    if any(call.method != "DELETE" and call.headers.get(mcp.SESSION_HEADER) == session
           for each in (route, *route.retired) for call in each.live):
        ended = rt.ended_sessions
        ended[route.name, session] = None
        if len(ended) > ENDED_SESSIONS_KEPT:
            ended.popitem(last=False)
    if not rt.polling:
        return
    for task, call in list(rt.polling.items()):
        if call.route == route.name and call.headers.get(mcp.SESSION_HEADER) == session:
            task.cancel()
    for key in [key for key in rt.polled if key[0] == route.name and key[1] == session]:
        del rt.polled[key]
