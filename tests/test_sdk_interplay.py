"""The official openai and anthropic SDKs through Sluice: answers, errors, and retries.

Upstream errors must reach the SDK as the upstream sent them, so it raises its usual error
type. Sluice's own "not now" answers must parse as the SDK's ``RateLimitError`` (429) or
``InternalServerError`` (503), and their ``retry-after-ms`` / ``x-should-retry`` headers must
steer the SDK's retry loop: wait as told and retry, or do not retry at all.
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp
import anthropic
import httpx2
import openai
import pytest

from tests.conftest import route, wait_until

MESSAGES = [{"role": "user", "content": "hi"}]


class Wire:
    """httpx event hooks recording what the SDK sends and receives, with monotonic times."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, httpx2.Request]] = []
        self.received: list[tuple[float, httpx2.Response]] = []

    async def on_request(self, request: httpx2.Request) -> None:
        self.sent.append((time.monotonic(), request))

    async def on_response(self, response: httpx2.Response) -> None:
        self.received.append((time.monotonic(), response))

    def hooks(self) -> dict:
        return {"request": [self.on_request], "response": [self.on_response]}


def openai_client(sluice, max_retries: int = 0, wire: Wire | None = None,
                  **headers: str) -> openai.AsyncOpenAI:
    http_client = openai.DefaultAsyncHttpxClient(event_hooks=wire.hooks()) if wire else None
    return openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                              max_retries=max_retries, http_client=http_client,
                              default_headers=headers or None)


def anthropic_client(sluice, max_retries: int = 0, wire: Wire | None = None,
                     **headers: str) -> anthropic.AsyncAnthropic:
    http_client = (anthropic.DefaultAsyncHttpxClient(event_hooks=wire.hooks())
                   if wire else None)
    return anthropic.AsyncAnthropic(base_url=sluice.url + "/anthropic", api_key="sk-ant-test",
                                    max_retries=max_retries, http_client=http_client,
                                    default_headers=headers or None)


async def call_openai(client: openai.AsyncOpenAI, **kwargs):
    return await client.chat.completions.create(model="gpt-test", messages=MESSAGES, **kwargs)


async def call_anthropic(client: anthropic.AsyncAnthropic, **kwargs):
    return await client.messages.create(model="claude-test", max_tokens=64, messages=MESSAGES,
                                        **kwargs)


# -- answers and upstream errors ----------------------------------------------------------


async def test_anthropic_sdk_plain_and_streamed(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("anthropic", upstream.url, "anthropic")]})
    client = anthropic_client(sluice)
    message = await call_anthropic(client)
    assert message.content[0].text == "hello from fake"
    assert message.usage.input_tokens == 11 and message.usage.output_tokens == 5
    async with client.messages.stream(model="claude-test", max_tokens=64,
                                      messages=MESSAGES) as stream:
        text = "".join([t async for t in stream.text_stream])
    assert text == "".join(f"tok{i} " for i in range(upstream.chunks))
    assert [r.path_qs for r in upstream.requests] == ["/v1/messages"] * 2
    # The key passes through (as x-api-key or a bearer token, depending on the SDK version).
    assert any("sk-ant-test" in value for value in upstream.requests[0].headers.values())
    await client.close()


async def test_upstream_errors_surface_as_the_sdks_own_types(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("openai", upstream.url, "openai"),
                                            route("anthropic", upstream.url, "anthropic")]})
    cases = [
        (400, openai.BadRequestError, anthropic.BadRequestError),
        (404, openai.NotFoundError, anthropic.NotFoundError),
        (429, openai.RateLimitError, anthropic.RateLimitError),
        (500, openai.InternalServerError, anthropic.InternalServerError),
        (503, openai.InternalServerError, anthropic.ServiceUnavailableError),
    ]
    oai, ant = openai_client(sluice), anthropic_client(sluice)
    for status, openai_error, anthropic_error in cases:
        fault = {"extra_headers": {"x-fake-status": str(status)}}
        with pytest.raises(openai_error) as caught:
            await call_openai(oai, **fault)
        assert caught.value.status_code == status
        assert caught.value.message.endswith(f"fake upstream status {status}")
        assert "x-sluice-reason" not in caught.value.response.headers
        with pytest.raises(anthropic_error) as caught:
            await call_anthropic(ant, **fault)
        assert caught.value.status_code == status
        assert "x-sluice-reason" not in caught.value.response.headers
    assert len(upstream.requests) == 2 * len(cases)  # max_retries=0: one attempt each
    await oai.close()
    await ant.close()


# -- Sluice's own rejections, per protocol ---------------------------------------------------


def _rejection_routes(upstream_url: str) -> list[dict]:
    routes = []
    for protocol in ("openai", "anthropic", "http", "mcp"):
        routes.append(route(f"{protocol}-rate", upstream_url, protocol,
                            rate={"requests": "1/min"}))
        routes.append(route(f"{protocol}-busy", upstream_url, protocol,
                            concurrency={"limit": 1, "queue": 0}))
    return routes


def _assert_not_now_headers(headers, reason: str) -> None:
    assert headers["x-sluice-reason"] == reason
    assert int(headers["retry-after"]) >= 1
    assert int(headers["retry-after-ms"]) > 0
    assert headers["x-should-retry"] == "true"
    if reason == "rate_limited":
        assert headers["ratelimit-policy"] == '"requests";q=1;w=60'
        assert headers["ratelimit"].startswith('"requests";r=0;t=')


async def test_sluice_rejections_parse_as_each_protocols_error(upstream, start_sluice):
    sluice = await start_sluice({"routes": _rejection_routes(upstream.url)})
    upstream.hold = asyncio.Event()
    jsonrpc = {"jsonrpc": "2.0", "method": "tools/call",
               "params": {"name": "search", "arguments": {}}}
    async with aiohttp.ClientSession() as session:
        # Occupy the one slot of every "-busy" route.
        holders = [
            asyncio.create_task(session.post(f"{sluice.url}/{p}-busy/v1/x", json={**jsonrpc,
                                                                                  "id": 1}))
            for p in ("openai", "anthropic", "http", "mcp")
        ]
        await wait_until(lambda: upstream.inflight == 4, what="every busy route's slot taken")

        # While every slot is held: each route's 503 queue_full, in its protocol's shape.
        oai = openai_client(sluice)
        with pytest.raises(openai.InternalServerError) as busy:
            await call_openai(oai.with_options(base_url=sluice.url + "/openai-busy/v1"))
        assert busy.value.status_code == 503 and busy.value.code == "queue_full"
        assert busy.value.type == "server_error"
        _assert_not_now_headers(busy.value.response.headers, "queue_full")

        ant = anthropic_client(sluice)
        with pytest.raises(anthropic.InternalServerError) as busy:
            await call_anthropic(ant.with_options(base_url=sluice.url + "/anthropic-busy"))
        assert busy.value.status_code == 503
        assert busy.value.body["type"] == "error"
        assert busy.value.body["error"]["type"] == "overloaded_error"
        _assert_not_now_headers(busy.value.response.headers, "queue_full")

        async with session.post(sluice.url + "/http-busy/v1/x", json={}) as r:
            assert r.status == 503
            _assert_not_now_headers(r.headers, "queue_full")
            error = (await r.json())["error"]
        assert set(error) == {"reason", "message", "retry_after_s"}
        assert error["reason"] == "queue_full" and error["retry_after_s"] > 0

        # mcp: HTTP 200 and a JSON-RPC 2.0 error that echoes the request's id, whatever its
        # type (an HTTP error status ends the whole session of the mcp 1.x client).
        async with session.post(sluice.url + "/mcp-busy/mcp", json={**jsonrpc, "id": 8}) as r:
            assert r.status == 200
            _assert_not_now_headers(r.headers, "queue_full")
            body = await r.json()
        assert body["jsonrpc"] == "2.0" and body["id"] == 8
        assert body["error"]["code"] == 503
        assert body["error"]["data"]["reason"] == "queue_full"
        assert body["error"]["data"]["retryAfterMs"] == int(r.headers["retry-after-ms"])

        upstream.hold.set()
        for holder in holders:
            (await holder).release()

        # Rate limits: the first request passes, the second is 429 rate_limited.
        oai_rate = oai.with_options(base_url=sluice.url + "/openai-rate/v1")
        await call_openai(oai_rate)
        with pytest.raises(openai.RateLimitError) as limited:
            await call_openai(oai_rate)
        assert limited.value.code == "rate_limited" and limited.value.type == "rate_limit_error"
        _assert_not_now_headers(limited.value.response.headers, "rate_limited")

        ant_rate = ant.with_options(base_url=sluice.url + "/anthropic-rate")
        await call_anthropic(ant_rate)
        with pytest.raises(anthropic.RateLimitError) as limited:
            await call_anthropic(ant_rate)
        assert limited.value.body["error"]["type"] == "rate_limit_error"
        _assert_not_now_headers(limited.value.response.headers, "rate_limited")

        async with session.post(sluice.url + "/http-rate/v1/x", json={}) as r:
            assert r.status == 200
        async with session.post(sluice.url + "/http-rate/v1/x", json={}) as r:
            assert r.status == 429
            _assert_not_now_headers(r.headers, "rate_limited")
            error = (await r.json())["error"]
        assert error["reason"] == "rate_limited" and 0 < error["retry_after_s"] <= 60

        async with session.post(sluice.url + "/mcp-rate/mcp", json={**jsonrpc, "id": 1}) as r:
            assert r.status == 200
        async with session.post(sluice.url + "/mcp-rate/mcp",
                                json={**jsonrpc, "id": "req-abc"}) as r:
            assert r.status == 200
            _assert_not_now_headers(r.headers, "rate_limited")
            body = await r.json()
        assert body["id"] == "req-abc" and body["error"]["code"] == 429
        assert body["error"]["data"]["reason"] == "rate_limited"
        await oai.close()
        await ant.close()


# -- retry semantics ------------------------------------------------------------------------


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_queue_full_makes_the_sdk_wait_as_told_then_retry(upstream, start_sluice, sdk):
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, "openai", concurrency={"limit": 1, "queue": 0}),
        route("anthropic", upstream.url, "anthropic", concurrency={"limit": 1, "queue": 0}),
    ]})
    upstream.hold = asyncio.Event()
    wire = Wire()
    path = "/openai/v1/chat/completions" if sdk == "openai" else "/anthropic/v1/messages"
    async with aiohttp.ClientSession() as session:
        holder = asyncio.create_task(session.post(
            sluice.url + path, json={"model": "m", "max_tokens": 8, "messages": MESSAGES}))
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        if sdk == "openai":
            client = openai_client(sluice, max_retries=2, wire=wire)
            call = asyncio.create_task(call_openai(client))
        else:
            client = anthropic_client(sluice, max_retries=2, wire=wire)
            call = asyncio.create_task(call_anthropic(client))
        await sluice.wait_metric("sluice_rejections_total", 1, route=sdk, reason="queue_full")
        upstream.hold.set()  # the slot frees well before the advertised wait ends
        (await holder).release()
        answer = await call
    assert (answer.choices[0].message.content if sdk == "openai"
            else answer.content[0].text) == "hello from fake"

    (rejected_at, rejected), (_, served) = wire.received
    assert (rejected.status_code, served.status_code) == (503, 200)
    assert rejected.headers["x-should-retry"] == "true"
    advertised_s = int(rejected.headers["retry-after-ms"]) / 1000
    assert advertised_s > 0
    [(_, first), (retried_at, retry)] = wire.sent
    assert first.headers["x-stainless-retry-count"] == "0"
    assert retry.headers["x-stainless-retry-count"] == "1"
    assert retried_at - rejected_at >= advertised_s - 0.01  # waited as told, not its back-off
    assert len(upstream.requests) == 2  # the holder and the retry; the rejection never reached it
    await client.close()


async def test_x_should_retry_false_stops_both_sdks(upstream, start_sluice):
    # 40/h refills one request every 90 s: over the 60 s both SDKs honour, so Sluice says
    # x-should-retry: false. Without it the openai SDK would wait 90 s (it honours up to
    # 120 s) and the anthropic SDK would retry after its own short back-off.
    per_tenant = {"per_tenant": {"requests": "40/h"}}
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, "openai", rate=per_tenant),
        route("anthropic", upstream.url, "anthropic", rate=per_tenant),
    ]})
    async with aiohttp.ClientSession() as session:
        for name in ("openai", "anthropic"):
            for _ in range(40):
                async with session.post(f"{sluice.url}/{name}/x", json={},
                                        headers={"X-Tenant-ID": "t1"}) as r:
                    assert r.status == 200
    wires = {"openai": Wire(), "anthropic": Wire()}
    oai = openai_client(sluice, max_retries=3, wire=wires["openai"], **{"X-Tenant-ID": "t1"})
    ant = anthropic_client(sluice, max_retries=3, wire=wires["anthropic"],
                           **{"X-Tenant-ID": "t1"})
    with pytest.raises(openai.RateLimitError):
        await call_openai(oai)
    with pytest.raises(anthropic.RateLimitError):
        await call_anthropic(ant)
    for name, wire in wires.items():
        [(_, response)] = wire.received  # one attempt, no retry
        assert response.headers["x-should-retry"] == "false"
        wait_ms = int(response.headers["retry-after-ms"])
        assert 60_000 < wait_ms <= 90_000  # 90 s less what leaked while the 40 were sent
        assert response.headers["retry-after"] == str(math.ceil(wait_ms / 1000))
        assert await sluice.metric("sluice_rejections_total", route=name,
                                   reason="rate_limited") == 1
    assert len(upstream.requests) == 80
    await oai.close()
    await ant.close()


async def test_one_layer_retries_a_failure_sluice_or_the_sdk_never_both(upstream, start_sluice):
    """A new user's trial: with the default config's retry block, an SDK calling without a key
    of its own lost every retry of a 503 or a 429. Sluice would not repeat the POST (it may
    have reached the upstream) and told the SDK not to either (x-should-retry: false). Now a
    failure Sluice does not retry leaves the SDK's own rules in force, as without Sluice, and
    one it retried still stops the SDK from stacking its own."""
    retry = {"attempts": 3, "backoff": {"base": "1ms", "max": "2ms"},
             "on": [502, 503, 504, "connect_error", "timeout"]}
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, "openai", retry=retry, idempotency={"mode": "dedup"}),
        route("anthropic", upstream.url, "anthropic", retry=retry,
              idempotency={"mode": "dedup"}),
    ]})
    upstream.error_headers = {"retry-after-ms": "5"}  # the SDKs' waits: short
    for status, error in ((503, openai.InternalServerError), (429, openai.RateLimitError)):
        upstream.requests.clear()
        upstream.status = status
        wire = Wire()
        client = openai_client(sluice, max_retries=2, wire=wire)
        with pytest.raises(error):
            await call_openai(client)
        await client.close()
        # The SDK's three attempts, each forwarded once: as it would go without Sluice. None
        # is a dead letter: a replay of one could redo work the SDK's retry then did.
        assert (len(wire.sent), len(upstream.requests)) == (3, 3), status
        assert not any("x-should-retry" in r.headers or "x-sluice-dead-letter" in r.headers
                       for _, r in wire.received)
    upstream.requests.clear()
    upstream.status = 503
    wire = Wire()
    client = anthropic_client(sluice, max_retries=2, wire=wire)
    with pytest.raises(anthropic.InternalServerError):
        await call_anthropic(client)
    await client.close()
    assert (len(wire.sent), len(upstream.requests)) == (3, 3)
    # With the caller's own key Sluice may repeat the POST: it retries, the SDK does not.
    upstream.requests.clear()
    wire = Wire()
    client = openai_client(sluice, max_retries=2, wire=wire)
    with pytest.raises(openai.InternalServerError):
        await call_openai(client, extra_headers={"Idempotency-Key": "own-key-1"})
    await client.close()
    assert (len(wire.sent), len(upstream.requests)) == (1, 3)
    assert wire.received[-1][1].headers["x-should-retry"] == "false"
    assert wire.received[-1][1].headers["x-sluice-dead-letter"] == "1"
    # A caller that is no such SDK gets its unsafe failure dead-lettered, as before.
    async with aiohttp.ClientSession() as session, session.post(
            sluice.url + "/openai/v1/chat/completions",
            json={"model": "gpt-test", "messages": MESSAGES}) as r:
        assert r.status == 503 and r.headers["X-Sluice-Dead-Letter"] == "2"
    assert await sluice.metric("sluice_dead_letters_total", route="openai") == 2


@pytest.mark.parametrize("seen", [True, False], ids=["route-seen", "route-new"])
@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_client_level_timeout_is_a_deadline(upstream, start_sluice, sdk, seen):
    """``seen``: whether the route has seen a call end (so knows its call time) before the
    one queued. Unseen, the queue's wait ended exactly at the caller's timeout counted from
    Sluice's arrival, after the SDK's own timer (started when it sent the call) had fired:
    1 call in 6 ended in the SDK's timeout (a hostile trial); Sluice now plans its answer a
    share of the timeout early (``CALLER_LEAD``).

    A hostile trial: ``AsyncAnthropic(timeout=2.5)`` sends ``x-stainless-timeout:
    NOT_GIVEN`` and the value in ``x-stainless-read-timeout``; Sluice read the first, found
    no number and took the call for one without a deadline, so behind a 30 s wait it queued
    until the SDK gave up (2.5 s, then again per retry) instead of being answered 503 within
    it (here: the queue wait it was allowed ran out first)."""
    sdk_timeout = 2.0  # seconds; its retries are off
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, "openai",
              concurrency={"limit": 1, "queue": 4, "max_wait": "60s"}),
        route("anthropic", upstream.url, "anthropic",
              concurrency={"limit": 1, "queue": 4, "max_wait": "60s"}),
    ]})
    wire = Wire()
    if sdk == "openai":
        client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                    max_retries=0, timeout=sdk_timeout, http_client=(
                                        openai.DefaultAsyncHttpxClient(event_hooks=wire.hooks())))
        call, timed_out = call_openai, openai.APITimeoutError
    else:
        client = anthropic.AsyncAnthropic(
            base_url=sluice.url + "/anthropic", api_key="sk-ant-test", max_retries=0,
            timeout=sdk_timeout,
            http_client=anthropic.DefaultAsyncHttpxClient(event_hooks=wire.hooks()))
        call, timed_out = call_anthropic, anthropic.APITimeoutError
    # The route's time to a first byte, once seen: what a read timeout must leave room for,
    # so the queue's wait ends that long before the SDK's. Sluice queues the call (rather than
    # refusing it at once) while a turn (the mean service time) fits in what that leaves:
    # both are this first call's time as Sluice measured it, 0.5 s plus whatever a busy
    # machine adds. With 1.5 s and 0.6 s, 0.15 s added was a refusal at once
    # (deadline_unreachable, under load); here 0.5 s may be, and the answer still has 0.5 s
    # to reach the SDK before its own timeout.
    upstream.delay = 0.5
    try:
        if seen:
            await call(client)
        upstream.delay = 0.0
        upstream.hold = asyncio.Event()  # the one slot taken until the end: no call makes it
        holder = asyncio.create_task(call(client.with_options(timeout=60)))
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        # Sluice's answer, within the caller's deadline: the SDK never timed out.
        with pytest.raises(openai.InternalServerError if sdk == "openai"
                           else anthropic.InternalServerError) as refused:
            await call(client)
        assert not isinstance(refused.value, timed_out)
        assert refused.value.response.headers["x-sluice-reason"] == "queue_timeout"
        upstream.hold.set()
        await holder
    finally:
        await client.close()
    sent = wire.sent[-1][1].headers
    assert float(sent["x-stainless-read-timeout"]) == sdk_timeout  # what Sluice has to read
