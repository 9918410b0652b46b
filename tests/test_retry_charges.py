"""What a call with retries is charged: every attempt the upstream may have billed, and
nothing for one it cannot have (policies/accounting.py, ``Charge._used``; policies/operations.py,
``CostCharge``). Each test failed before the fix (a hostile trial, round 34): only the last
answer counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import SluiceProcess, completed_events, free_port, route, serve_app
from tests.redis_servers import delete_prefix, new_prefix, require_redis

CHAT = "/openai/v1/chat/completions"
USAGE_7_11 = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 11}}


async def raw_chat(sluice: SluiceProcess, body: dict) -> asyncio.StreamWriter:
    """Send a chat completion ``body`` for tenant acme on a raw connection, which the caller
    can then close at any moment; returns its writer."""
    data = json.dumps(body).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", sluice.port)
    writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"X-Tenant-ID: acme\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    await writer.drain()
    return writer


async def test_a_caller_leaving_in_the_retry_back_off_after_a_5xx_is_not_charged_its_reservation(
        upstream, start_sluice):
    """The only attempt sent was answered 503 in full (a provider bills nothing for it) and
    the next was never sent: a caller that leaves during the back-off must be charged what a
    caller that waits for the same 503 is charged (nothing), not its whole reservation."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, idempotent=True,
        retry={"attempts": 3, "backoff": {"base": "5s", "max": "5s"}, "on": [503]},
        budget={"tokens": "100000/day", "per": "tenant"})]})
    upstream.status = 503
    # Its wait, at least 5 s: the route's full-jitter back-off could pick less than the
    # 0.3 s below and send attempt 2 before the caller leaves.
    upstream.error_headers = {"Retry-After": "5"}
    writer = await raw_chat(sluice, {"model": "gpt-test", "max_tokens": 500,
                                     "messages": [{"role": "user", "content": "hi"}]})
    deadline = time.monotonic() + 20
    while not upstream.requests:  # the first attempt reached the upstream and got its 503
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # Sluice is now in the back-off before attempt 2
    writer.close()
    [done] = await completed_events(sluice)
    assert len(upstream.requests) == 1, "only the first attempt was sent"
    assert done["outcome"] == "client_disconnected"
    remaining = await sluice.metric("sluice_budget_remaining", route="openai", tenant="acme",
                                    unit="tokens")
    assert (done["usage"], done["input_tokens"] + done["output_tokens"], remaining) == (
        "none", 0, 100000.0)


async def test_retries_that_got_a_5xx_then_no_connection_charge_nothing(upstream, start_sluice):
    """Attempt 1 reached the upstream and got a whole 503 (billed nothing); attempts 2 and 3
    found no upstream to connect to (never reached it). Nothing was billed, so nothing may be
    charged; the whole reservation (input estimate + max_tokens) was."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, idempotent=True,
        retry={"attempts": 3, "backoff": {"base": "1s", "max": "1s"},
               "on": [503, "connect_error"]},
        budget={"tokens": "100000/day", "per": "tenant"})]})
    upstream.status = 503
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 500}
    async with aiohttp.ClientSession() as s:
        sent = asyncio.create_task(s.post(sluice.url + CHAT, json=body,
                                          headers={"X-Tenant-ID": "acme"}))
        deadline = time.monotonic() + 20
        while not upstream.requests:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await upstream.stop()  # the next attempts are refused a connection
        async with await sent as r:
            await r.read()
            assert (r.status, r.headers["X-Sluice-Reason"]) == (502, "upstream_unreachable")
    [done] = await completed_events(sluice)
    remaining = await sluice.metric("sluice_budget_remaining", route="openai", tenant="acme",
                                    unit="tokens")
    assert (done["usage"], done["input_tokens"] + done["output_tokens"], remaining) == (
        "none", 0, 100000.0)


@contextlib.asynccontextmanager
async def retried_chat(start_sluice, chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
                       retry: dict, budget: str, state: dict | None = None
                       ) -> AsyncIterator[SluiceProcess]:
    """A Sluice whose ``openai`` route (idempotent, ``retry``, ``budget`` tokens per tenant,
    on ``state``, memory by default) forwards to an upstream answering
    ``POST /v1/chat/completions`` with ``chat``."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    try:
        yield await start_sluice({"state": state or {"backend": "memory"}, "routes": [route(
            "openai", f"http://127.0.0.1:{port}", idempotent=True, retry=retry,
            budget={"tokens": budget, "per": "tenant"})]})
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _first_attempt_timed_out(start_sluice, later: Callable[[], web.Response],
                                   on: list[object], budget: str = "100000/day",
                                   state: dict | None = None,
                                   ) -> AsyncIterator[tuple[SluiceProcess, list[int]]]:
    """A Sluice whose ``openai`` route (``budget`` tokens per tenant, on ``state``) gives
    each attempt 500 ms: the upstream's first answer comes after 1.5 s (it ran to its end
    and billed it, usage 7 + 11), its later ones ``later()``; with the upstream's request
    count."""
    seen: list[int] = []

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        seen.append(1)
        if len(seen) == 1:  # worked to the end (and billed), after Sluice stopped waiting
            await asyncio.sleep(1.5)
            return web.json_response(USAGE_7_11)
        return later()

    async with retried_chat(start_sluice, chat,
                            {"attempts": 2, "per_try_timeout": "500ms",
                             "backoff": {"base": "10ms", "max": "20ms"}, "on": on},
                            budget, state) as sluice:
        yield sluice, seen


async def _chat(sluice: SluiceProcess) -> int:
    """One chat completion (500 max_tokens) for tenant acme; its status."""
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 500}
    async with aiohttp.ClientSession() as s, s.post(
            sluice.url + CHAT, json=body, headers={"X-Tenant-ID": "acme"}) as r:
        await r.read()
        return r.status


async def test_an_attempt_that_timed_out_upstream_is_charged_though_the_last_got_a_503(
        start_sluice):
    """The other face of the retry/accounting gap: attempt 1 is sent and cut by
    ``per_try_timeout`` (the upstream runs it to the end and bills it: "a timeout before the
    answer ... the whole reservation, since the upstream may have billed it all"); attempt 2
    gets a whole 503, which is relayed. The call is charged nothing (``usage: none``), so
    calls that time out and then meet a 503 spend the upstream's tokens outside the budget."""
    def overloaded() -> web.Response:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async with _first_attempt_timed_out(start_sluice, overloaded, [503, "timeout"]) as (
            sluice, seen):
        assert await _chat(sluice) == 503
        [done] = await completed_events(sluice)
        assert len(seen) == 2
        assert done["usage"] == "reserved", done
        assert done["input_tokens"] + done["output_tokens"] > 0


async def ok_upstream() -> web.AppRunner:
    """An upstream answering ``POST /v1/x`` 200, set up but listening nowhere yet."""
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/x", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    return runner


async def post_up_for_attempt_two(sluice: SluiceProcess, runner: web.AppRunner, port: int,
                                  before_up: Callable[[], None] = lambda: None) -> dict:
    """POST ``/h/v1/x`` for tenant acme; once attempt 1 has failed (a ``retried`` event),
    call ``before_up`` and start ``runner`` on ``port`` for attempt 2, which must answer
    200. Returns the ``retried`` event."""
    async with aiohttp.ClientSession() as s:
        sent = asyncio.create_task(s.post(sluice.url + "/h/v1/x", data=b"{}",
                                          headers={"X-Tenant-ID": "acme"}))
        deadline = time.monotonic() + 30
        while not (retried := [e for e in sluice.events() if e.get("event") == "retried"]):
            assert time.monotonic() < deadline, "attempt 1 did not fail"
            assert not sent.done(), sent.result()
            await asyncio.sleep(0.02)
        before_up()
        await web.TCPSite(runner, "127.0.0.1", port).start()  # up for attempt 2
        async with await sent as r:
            assert r.status == 200, await r.text()
            await r.read()
    return retried[0]


async def test_an_attempt_refused_a_connection_is_not_charged_cost_per_call(start_sluice):
    """``cost_per_call`` is charged per upstream attempt, and "a call that never reached the
    upstream costs nothing" (docs/operations.md): an attempt refused a connection never
    reached it either, yet the call below (attempt 1 refused, attempt 2 answered) is charged
    two calls' cost, and reported as passing its hold (``over_reservation_usd``)."""
    port = free_port()
    # Attempts to spare: the test starts the upstream once it reads the first retry's event
    # (flushed every 0.2 s), and full-jitter back-offs under that ran all 3 of an earlier
    # version's attempts first (a new user's suite, once).
    sluice = await start_sluice({"routes": [route(
        "h", f"http://127.0.0.1:{port}", protocol="http", idempotent=True,
        retry={"attempts": 6, "backoff": {"base": "1s", "max": "1s"}, "on": ["connect_error"]},
        budget={"usd": "100/day", "per": "tenant"},
        endpoints={"POST /v1/x": {"cost_per_call": 1.0}})]})

    runner = await ok_upstream()
    try:
        await post_up_for_attempt_two(sluice, runner, port)
        [done] = await completed_events(sluice)
        remaining = await sluice.metric("sluice_budget_remaining", route="h", tenant="acme",
                                        unit="usd")
        assert (done["operation_cost_usd"], remaining) == (1.0, 99.0)
    finally:
        await runner.cleanup()


async def test_a_timed_out_attempt_is_charged_beside_the_usage_the_next_one_reports(
        start_sluice):
    # Attempt 1 runs to its end upstream after Sluice stopped waiting (billed), attempt 2
    # answers with its usage: both count, the first at its reservation (the input estimated
    # from the body, 500 max_tokens), and the event says one attempt went unanswered.
    async with _first_attempt_timed_out(start_sluice, lambda: web.json_response(USAGE_7_11),
                                        ["timeout"]) as (sluice, _):
        assert await _chat(sluice) == 200
        [done] = await completed_events(sluice)
        assert (done["usage"], done["unanswered_attempts"]) == ("reported", 1)
        assert done["output_tokens"] == 11 + 500
        # Attempt 2 held a reservation of its own, so the budget was not passed.
        assert "over_reservation_tokens" not in done, done
        remaining = await sluice.metric("sluice_budget_remaining", route="openai",
                                        tenant="acme", unit="tokens")
        assert remaining == 100000 - done["input_tokens"] - done["output_tokens"]
        assert await sluice.metric("sluice_budget_reserved", route="openai", tenant="acme",
                                   unit="tokens") == 0


@pytest.fixture(params=["memory", "redis"])
def budget_state(request: pytest.FixtureRequest) -> Iterator[dict]:
    """A ``state`` block: this process's memory, or the shared Redis under a prefix of its
    own (deleted afterwards)."""
    if request.param == "memory":
        yield {"backend": "memory"}
        return
    url = require_redis()
    prefix = new_prefix()
    try:
        yield {"backend": "redis", "redis_url": url, "key_prefix": prefix}
    finally:
        delete_prefix(url, prefix)


async def test_a_retry_after_an_unanswered_attempt_needs_room_in_the_budget(
        start_sluice, budget_state):
    """Attempt 1 timed out (the upstream ran it and billed it: charged its whole
    reservation, about 530 tokens); a retry may be billed as much again. With 900 tokens a
    day, there is no room for a second reservation: retrying stops (dead letter reason
    ``budget_exhausted``) instead of sending attempt 2, which passed the budget before
    (only the first attempt was reserved: 530 + 18 charged on 900)."""
    async with _first_attempt_timed_out(start_sluice, lambda: web.json_response(USAGE_7_11),
                                        ["timeout"], budget="900/day",
                                        state=budget_state) as (sluice, seen):
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 500}
        async with aiohttp.ClientSession() as s, s.post(
                sluice.url + CHAT, json=body, headers={"X-Tenant-ID": "acme"}) as r:
            await r.read()
            assert (r.status, r.headers["X-Sluice-Reason"]) == (504, "upstream_timeout")
            assert r.headers["x-should-retry"] == "false"
            # Why it was not retried is in the answer (a new user found it only in the
            # dead letter, round 35).
            assert ("not retried: the budget has no room for another attempt "
                    "(budget_exhausted)") in await r.text()
        [done] = await completed_events(sluice)
        assert len(seen) == 1, "attempt 2 was sent with no room left for it"
        reserved = done["input_tokens"] + done["output_tokens"]
        assert (done["usage"], done.get("unanswered_attempts")) == ("reserved", None)
        assert 500 < reserved < 900
        deadline = time.monotonic() + 20
        while not (letters := [e for e in sluice.events() if e.get("event") == "dead_lettered"]):
            assert time.monotonic() < deadline, "no dead_lettered event"
            await asyncio.sleep(0.02)
        assert [e["reason"] for e in letters] == ["budget_exhausted"]
        await sluice.wait_metric("sluice_budget_reserved", 0, route="openai", tenant="acme",
                                 unit="tokens")
        await sluice.wait_metric("sluice_budget_remaining", 900 - reserved, route="openai",
                                 tenant="acme", unit="tokens")


async def test_an_attempt_cut_while_still_connecting_is_not_charged(start_sluice):
    """``per_try_timeout`` (300 ms) shorter than ``timeouts.connect`` (5 s) passed while
    the connection was still being made (an upstream whose accept queue is full drops the
    SYN): nothing was sent, yet each attempt counted as sent and unanswered, charged its
    whole reservation and held another for its retry (a review, round 34, left then). Such
    an attempt now reads as never sent: nothing charged, nothing held."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)  # an accept queue of one, never accepted
    filler = socket.create_connection(full.getsockname())
    try:
        port = full.getsockname()[1]
        sluice = await start_sluice({"routes": [route(
            "openai", f"http://127.0.0.1:{port}", idempotent=True,
            retry={"attempts": 2, "per_try_timeout": "300ms",
                   "backoff": {"base": "10ms", "max": "20ms"}, "on": ["timeout"]},
            budget={"tokens": "100000/day", "per": "tenant"})]})
        async with aiohttp.ClientSession() as s, s.post(
                sluice.url + CHAT, json={"model": "gpt-test", "max_tokens": 500,
                                         "messages": [{"role": "user", "content": "hi"}]},
                headers={"X-Tenant-ID": "acme"}) as r:
            assert (r.status, r.headers["X-Sluice-Reason"]) == (504, "upstream_timeout")
            assert "no connection to it in time" in await r.text()
        [done] = await completed_events(sluice)
        assert (done["usage"], done["input_tokens"] + done["output_tokens"]) == ("none", 0)
        assert "unanswered_attempts" not in done
        remaining = await sluice.metric("sluice_budget_remaining", route="openai",
                                        tenant="acme", unit="tokens")
        assert remaining == 100000
    finally:
        filler.close()
        full.close()
