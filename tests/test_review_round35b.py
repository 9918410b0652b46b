"""A hostile review (round 35b) of three changes: retries holding budget, admission bounded
by the caller's deadline, and MCP calls closed early for polling held until their response
is resumed. Each case failed before its fix.

1. A call held for its polled answer whose client then closes its session (``DELETE``) was
   held on, with its slot, its key and its place in flight, until its ``timeouts.total``
   (600 s when none is set): nothing can resume its answer once the session is gone (the
   server answers a GET of it 404), so a tool limited to one call at a time refused every
   other session's call ``queue_full`` for ten minutes. It now ends when its session is
   closed, ``client_disconnected``.
2. A retry's budget hold (after an unanswered attempt) was taken on the budgets its call
   was admitted under: a reload that lowered the budget while attempt 1 stalled let the
   retry be held against the old limit, sent, and charged past the budget in force. The
   hold is now taken on the budgets in force.
3. A call held for its polled answer on a route that keeps no answer for its key, whose
   client cancels it (``notifications/cancelled``, forwarded: the server stops the tool),
   was held on, slot and all, until its bound: its client resumes no answer it cancelled.
   It now ends with the cancel, ``client_cancelled``.
4. Sluice noted a polled call under the ``id`` of an event it had only begun to read, where a
   client resumes from the id of the last event it got whole: a resumed GET cut inside the
   response's event, resumed again, was taken for a plain stream, and the call stayed held
   until its bound though its response had come. An event's id now takes effect at its end.
5. On a ``dedup`` route a client's cancel of a call held for its polled answer is held too
   (the tool runs on, for the retry to get its answer), but that answer comes only on a GET
   resuming it, which the cancelling client never sends: the retry was refused
   ``idempotency_conflict`` and the key held until the bound (600 s). Sluice now resumes
   the answer itself.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tests import mcp_servers
from tests.conftest import completed_events, serve_app, wait_until
from tests.test_reload import rewrite
from tests.test_retry_charges import retried_chat
from tests.test_review_mcp_round35 import (
    ONE_POLL,
    _closed_for_polling,
    _completed,
    held_poll,
    polling_sluice,
)

mcp_server_factory = mcp_servers.mcp_server_factory


async def test_a_polled_call_ends_when_its_session_is_closed(mcp_server_factory,
                                                             start_sluice):
    """Before: after the DELETE, ``sluice_polled_calls`` stayed 1 and the next session's
    ``poll`` was refused ``queue_full`` (held until the default 600 s bound)."""
    _, sluice = await polling_sluice(mcp_server_factory, start_sluice, tools=ONE_POLL)
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await held_poll(http, url, sluice)
        async with http.delete(url, headers=headers) as r:
            assert r.status < 300, r.status
        await sluice.wait_metric("sluice_polled_calls", 0, timeout=5)
        await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
        await wait_until(lambda: _completed(sluice, "poll"), what="the call's end")
        [ended] = _completed(sluice, "poll")
        assert ended["outcome"] == "client_disconnected", ended
        # Its slot is free: another session's call is sent, not refused queue_full.
        other = await mcp_servers.raw_session(http, url)
        await _closed_for_polling(http, url, other, mcp_servers.tool_call(3, "poll",
                                                                          seconds=0.1))


# -- 2. a retry's budget hold after a reload that lowered the budget ------------------------


async def test_a_retrys_hold_after_a_reload_is_held_on_the_reloaded_budget(start_sluice):
    """Before: the retry's hold was taken on the budget the call was admitted under, with
    its old limit: a reload lowering ``budget.tokens`` to 1,000 while attempt 1 stalled let
    attempt 2 be held against 2,000 and sent, and the call was charged two reservations
    (~1,060 tokens) on the 1,000-token budget in force. Now the hold, an admission taken
    after the reload, is refused by the budget in force: attempt 2 is not sent."""
    seen: list[int] = []

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        seen.append(1)
        await asyncio.sleep(10.0)  # never answers within the attempt's bound
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 7,
                                                            "completion_tokens": 500}})

    async with retried_chat(start_sluice, chat,
                            {"attempts": 2, "per_try_timeout": "4s",
                             "backoff": {"base": "10ms", "max": "20ms"}, "on": ["timeout"]},
                            "2000/day") as sluice:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 500}
        async with aiohttp.ClientSession() as s:
            call = asyncio.create_task(s.post(sluice.url + "/openai/v1/chat/completions",
                                              json=body, headers={"X-Tenant-ID": "acme"}))
            await wait_until(lambda: len(seen) == 1, what="attempt 1 at the upstream")

            def lower(data: dict) -> None:
                data["routes"][0]["budget"]["tokens"] = "1000/day"

            rewrite(sluice.config_path, lower)
            await sluice.wait_metric("sluice_config_reloads_total", 1)
            async with await call as r:
                await r.read()
                assert r.headers["X-Sluice-Reason"] == "upstream_timeout"
        done = await completed_events(sluice)
        assert len(seen) == 1, "attempt 2 was held on the budget before the reload"
        charged = done[0]["input_tokens"] + done[0]["output_tokens"]
        assert charged <= 1000, done[0]
        await sluice.wait_metric("sluice_budget_reserved", 0, route="openai", tenant="acme",
                                 unit="tokens")


# -- 3. a held polled call its client cancels -----------------------------------------------


async def test_a_polled_call_its_client_cancels_ends_with_the_cancel(mcp_server_factory,
                                                                    start_sluice):
    """Before: after the client's ``notifications/cancelled`` (forwarded, 202), the call
    stayed held (``sluice_polled_calls`` 1) and the tool's one slot refused the next call
    ``queue_full`` until the default 600 s bound."""
    _, sluice = await polling_sluice(mcp_server_factory, start_sluice, tools=ONE_POLL)
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await held_poll(http, url, sluice)
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": 2, "reason": "the user gave up"}}
        async with http.post(url, json=cancel, headers=headers) as r:
            assert r.status == 202, r.status
        await sluice.wait_metric("sluice_polled_calls", 0, timeout=5)
        await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
        await wait_until(lambda: _completed(sluice, "poll"), what="the call's end")
        [ended] = _completed(sluice, "poll")
        assert ended["outcome"] == "client_cancelled", ended
        # Its slot is free: the next call is sent, not refused queue_full.
        await _closed_for_polling(http, url, headers, mcp_servers.tool_call(3, "poll",
                                                                            seconds=0.1))


# -- 4. a resumed GET cut inside an event, then resumed again -------------------------------


async def test_a_resume_cut_inside_an_event_is_followed_when_resumed_again(start_sluice):
    """A client resumes from the id of the last event it *received whole* (WHATWG: an
    event's id takes effect when the event is dispatched; one cut before its end is
    dropped, its id too). Before: Sluice noted the call under the id line of the event cut
    in half (``e2``), so the client's next GET (``Last-Event-ID: e1``) was taken for a plain
    stream: the response it carried ended nothing, and the call stayed held, slot and all,
    until its bound (600 s)."""
    gets: list[str] = []

    async def mcp(request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            await request.read()  # closed early for polling: a priming event, then the end
            return web.Response(body=b"id: e1\ndata: \n\n", content_type="text/event-stream")
        gets.append(request.headers.get("Last-Event-ID", ""))
        response = b'id: e2\ndata: {"jsonrpc":"2.0","id":2,"result":{"content":[]}}\n\n'
        if len(gets) == 1:  # the first resume ends inside the response's event
            return web.Response(body=response[:30], content_type="text/event-stream")
        return web.Response(body=response, content_type="text/event-stream")

    app = web.Application()
    app.router.add_route("*", "/mcp", mcp)
    runner, port = await serve_app(app)
    try:
        sluice = await start_sluice({"routes": [{
            "name": "tools", "path_prefix": "/tools/", "upstream": f"http://127.0.0.1:{port}",
            "protocol": "mcp", "tools": {"poll": {"concurrency": {"limit": 1, "queue": 0}}}}]})
        url = sluice.url + "/tools/mcp"
        async with aiohttp.ClientSession() as http:
            headers = {"Accept": "application/json, text/event-stream"}
            async with http.post(url, json=mcp_servers.tool_call(2, "poll"),
                                 headers=headers) as r:
                assert await r.read() == b"id: e1\ndata: \n\n"
            await sluice.wait_metric("sluice_polled_calls", 1)
            resume = {"Accept": "text/event-stream", "Last-Event-ID": "e1"}
            async with http.get(url, headers=resume) as r:
                assert b'"result"' not in await r.read()  # cut inside the event
            async with http.get(url, headers=resume) as r:  # e2 never arrived whole
                assert b'"result"' in await r.read()
            assert gets == ["e1", "e1"]
            await sluice.wait_metric("sluice_polled_calls", 0, timeout=5)
            await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
            await wait_until(lambda: _completed(sluice, "poll"), what="the call's end")
            [ended] = _completed(sluice, "poll")
            assert ended["outcome"] == "2xx", ended
    finally:
        await runner.cleanup()


# -- 5. a held cancel of a polled call, then the client's retry -----------------------------


async def test_a_retry_after_a_held_cancel_of_a_polled_call_gets_its_answer(
        mcp_server_factory, start_sluice):
    """On a ``dedup`` route Sluice holds a client's cancel of a call whose answer it keeps
    (202, not forwarded) so that the tool runs to its end and the client's retry gets its
    answer. A polled call's answer comes only on a GET resuming it, which a client that
    cancelled the call never sends: the retry waited for a twin held until its bound (600
    s), and was refused when its own wait ended, the tool's result lost."""
    server, sluice = await polling_sluice(mcp_server_factory, start_sluice,
                                          idempotency={"mode": "dedup", "max_wait": "8s"})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)
        await _closed_for_polling(http, url, headers, mcp_servers.tool_call(
            2, "poll_send", to="ops", seconds=0.5))
        await sluice.wait_metric("sluice_polled_calls", 1)
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": 2, "reason": "timed out"}}
        async with http.post(url, json=cancel, headers=headers) as r:
            assert r.status == 202, r.status
        assert await sluice.metric("sluice_requests_total", route="tools",
                                   outcome="cancel_held") == 1
        async with http.post(url, json=mcp_servers.tool_call(3, "poll_send", to="ops",
                                                             seconds=0.5),
                             headers=headers) as r:
            again = (await r.read()).decode()
    assert '"sent #1"' in again, again
    assert server.sends() == 1
    await sluice.wait_metric("sluice_polled_calls", 0)
    await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
    await wait_until(lambda: _completed(sluice, "poll_send"), what="the call's end")
    [ended] = _completed(sluice, "poll_send")
    assert ended["outcome"] == "2xx", ended
