"""The concurrency policy end to end: slots, the bounded queue, priorities, per-tenant caps.

The fake upstream's ``hold`` keeps admitted requests at the upstream until the test releases
them, so "every slot is busy" is a fact the test observes, not a timing guess.
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp
import openai

from policies.pipeline import CALLER_LEAD
from tests.conftest import route, wait_until

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
#: uvloop's timers tick in whole milliseconds and may fire a fraction of one early.
TIMER_SLACK_S = 0.005


async def chat(session: aiohttp.ClientSession, url: str, **headers: str):
    """POST a chat completion; returns ``(status, headers, json body, seconds taken)``."""
    started = time.monotonic()
    async with session.post(url + "/openai/v1/chat/completions", json=CHAT,
                            headers=headers) as r:
        return r.status, r.headers, await r.json(), time.monotonic() - started


def openai_route(upstream, **concurrency) -> dict:
    return route("openai", upstream.url, "openai", concurrency=concurrency)


async def test_upstream_never_sees_more_than_the_limit(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=3, queue=20, max_wait="60s")]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        calls = [asyncio.create_task(chat(session, sluice.url)) for _ in range(12)]
        await wait_until(lambda: upstream.inflight == 3, what="3 requests at the upstream")
        await sluice.wait_metric("sluice_queue_depth", 9, route="openai")
        assert upstream.inflight == 3
        assert await sluice.metric("sluice_inflight_requests", route="openai") == 3
        upstream.hold.set()
        results = await asyncio.gather(*calls)
    assert [status for status, *_ in results] == [200] * 12
    assert len(upstream.requests) == 12
    assert upstream.peak_inflight == 3


async def test_overflow_is_answered_while_every_slot_is_busy(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=2, queue=1, max_wait="60s")]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        busy = [asyncio.create_task(chat(session, sluice.url)) for _ in range(2)]
        await wait_until(lambda: upstream.inflight == 2, what="both slots busy")
        queued = asyncio.create_task(chat(session, sluice.url))
        await sluice.wait_metric("sluice_queue_depth", 1, route="openai")

        status, headers, body, _ = await chat(session, sluice.url)

        # Answered while both slots are still held and the queue is full.
        assert not upstream.hold.is_set()
        assert upstream.inflight == 2 and not queued.done()
        assert status == 503
        assert headers["X-Sluice-Reason"] == "queue_full"
        # One queued ahead, two slots, 1 s assumed service time: (1 + 1) * 1 / 2 = 1 s,
        # spread up to +50% at random.
        advertised_ms = int(headers["retry-after-ms"])
        assert 1000 <= advertised_ms <= 1500
        assert headers["Retry-After"] == str(math.ceil(int(headers["retry-after-ms"]) / 1000))
        assert headers["x-should-retry"] == "true"
        assert headers["RateLimit-Policy"] == '"concurrency";q=2;qu="concurrent-requests"'
        assert headers["RateLimit"] == f'"concurrency";r=0;t={headers["Retry-After"]}'
        assert headers["Cache-Control"] == "no-store"
        assert headers["Content-Type"] == "application/json"
        assert body["error"]["code"] == "queue_full"
        assert body["error"]["type"] == "server_error"
        assert body["error"]["message"].startswith("Sluice: ")

        upstream.hold.set()
        assert [r[0] for r in await asyncio.gather(*busy, queued)] == [200, 200, 200]
    assert len(upstream.requests) == 3
    await wait_until(lambda: any(e["event"] == "rejected" for e in sluice.events()),
                     what="the rejected event")
    [rejected] = [e for e in sluice.events() if e["event"] == "rejected"]
    assert rejected["reason"] == "queue_full"
    # The same wait, logged: to the millisecond (round(s, 3)) where the header rounds up. In
    # whole milliseconds, since round(s, 3) * 1000 is off by up to ~1e-13 (seen 1.0000000000002).
    assert abs(round(rejected["retry_after_s"] * 1000) - advertised_ms) <= 1
    # Its timeline is that one line: it never sat in the queue.
    assert [e["event"] for e in sluice.events()
            if e["request_id"] == rejected["request_id"]] == ["rejected"]
    assert [e["queue_depth"] for e in sluice.events() if e["event"] == "enqueued"] == [1]


async def test_retry_after_grows_while_slow_calls_hold_every_slot(upstream, start_sluice):
    # Fast calls first: the route's mean service time is a few ms. Then the upstream holds its
    # calls. A new user's SDK, told retry-after-ms from that stale mean, came back within
    # milliseconds again and again while 3 s calls held every slot.
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=1, queue=1, max_wait="60s")]})
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            assert (await chat(session, sluice.url))[0] == 200
        upstream.hold = asyncio.Event()
        held = asyncio.create_task(chat(session, sluice.url))
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        queued = asyncio.create_task(chat(session, sluice.url))
        await sluice.wait_metric("sluice_queue_depth", 1, route="openai")
        first = await chat(session, sluice.url)
        await asyncio.sleep(1.0)
        later = await chat(session, sluice.url)
        upstream.hold.set()
        assert [r[0] for r in await asyncio.gather(held, queued)] == [200, 200]
    assert first[0] == later[0] == 503
    assert first[1]["X-Sluice-Reason"] == later[1]["X-Sluice-Reason"] == "queue_full"
    # A second with the only slot busy and none freed: two to go ahead of a retry (the queued
    # call, then it) take at least that long each.
    assert int(later[1]["retry-after-ms"]) >= 2000
    assert int(later[1]["retry-after-ms"]) > int(first[1]["retry-after-ms"])
    assert later[1]["x-should-retry"] == "true"


async def test_queue_timeout_after_max_wait(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=1, queue=2, max_wait="300ms")]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(chat(session, sluice.url))
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        status, headers, body, waited = await chat(session, sluice.url)
        assert status == 503
        assert headers["X-Sluice-Reason"] == "queue_timeout"
        assert body["error"]["code"] == "queue_timeout"
        assert int(headers["Retry-After"]) >= 1
        assert headers["x-should-retry"] == "true"
        assert waited >= 0.3 - TIMER_SLACK_S
        upstream.hold.set()
        assert (await first)[0] == 200
    assert len(upstream.requests) == 1
    await sluice.wait_metric("sluice_queue_depth", 0, route="openai")
    await wait_until(lambda: any(e["event"] == "expired" for e in sluice.events()),
                     what="the expired event")
    [expired] = [e for e in sluice.events() if e["event"] == "expired"]
    assert expired["waited_s"] >= 0.3 - TIMER_SLACK_S


async def test_critical_is_served_before_standard_before_best_effort(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=1, queue=10, max_wait="60s")]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        calls = [asyncio.create_task(chat(session, sluice.url, **{"X-Tag": "first"}))]
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        arrivals = [("best-effort", "be"), ("standard", "std-1"), ("critical", "crit"),
                    (None, "std-2"), ("bogus", "std-3"), ("critical", "crit-2")]
        for depth, (priority, tag) in enumerate(arrivals, start=1):
            headers = {"X-Tag": tag} | ({"X-Priority": priority} if priority else {})
            calls.append(asyncio.create_task(chat(session, sluice.url, **headers)))
            await sluice.wait_metric("sluice_queue_depth", depth, route="openai")
        upstream.hold.set()
        assert [r[0] for r in await asyncio.gather(*calls)] == [200] * 7
    # An unknown or missing X-Priority counts as standard; arrival order within a class.
    assert [r.headers["X-Tag"] for r in upstream.requests] == [
        "first", "crit", "crit-2", "std-1", "std-2", "std-3", "be"]
    assert upstream.peak_inflight == 1


async def test_per_tenant_cap_is_429_and_other_tenants_are_unaffected(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=4, queue=4, max_wait="60s", per_tenant=1)]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        a1 = asyncio.create_task(chat(session, sluice.url, **{"X-Tenant-ID": "a"}))
        await wait_until(lambda: upstream.inflight == 1, what="tenant a's request upstream")

        status, headers, body, _ = await chat(session, sluice.url, **{"X-Tenant-ID": "a"})
        assert status == 429
        assert headers["X-Sluice-Reason"] == "tenant_concurrency"
        assert headers["x-should-retry"] == "true"
        assert int(headers["Retry-After"]) >= 1
        assert headers["RateLimit-Policy"] == (
            '"tenant-concurrency";q=1;qu="concurrent-requests"')
        assert body["error"]["code"] == "tenant_concurrency"
        assert body["error"]["type"] == "rate_limit_error"

        b1 = asyncio.create_task(chat(session, sluice.url, **{"X-Tenant-ID": "b"}))
        await wait_until(lambda: upstream.inflight == 2, what="tenant b's request upstream")
        upstream.hold.set()
        assert [(await a1)[0], (await b1)[0]] == [200, 200]
        # Tenant a's share was given back when its request finished.
        assert (await chat(session, sluice.url, **{"X-Tenant-ID": "a"}))[0] == 200
    assert await sluice.metric("sluice_rejections_total", route="openai",
                               reason="tenant_concurrency") == 1


async def test_callers_own_timeout_shortens_the_queue_wait(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=1, queue=2, max_wait="60s")]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(chat(session, sluice.url))
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        status, headers, _, waited = await chat(session, sluice.url,
                                                **{"x-stainless-timeout": "0.5"})
        assert status == 503
        assert headers["X-Sluice-Reason"] == "queue_timeout"
        # The caller's 0.5 s less Sluice's lead on it, not the route's 60 s.
        assert 0.5 * (1 - CALLER_LEAD) - TIMER_SLACK_S <= waited < 30
        upstream.hold.set()
        assert (await first)[0] == 200
        # Admitted, its upstream slower than its timeout: cut there, and the 504 says whose
        # timeout it was (a new user read it as the upstream's or Sluice's own limit).
        status, headers, body, _ = await chat(session, sluice.url, **{
            "x-stainless-timeout": "0.5", "x-fake-delay": "5"})
        assert (status, headers["X-Sluice-Reason"]) == (504, "upstream_timeout")
        assert "the caller's own timeout" in body["error"]["message"]


async def test_an_sdk_stream_queues_behind_streams_longer_than_its_timeout(upstream,
                                                                            start_sluice):
    """The openai SDK's timeout is a read timeout (it sends it as ``x-stainless-timeout``):
    behind 4 s streams on one slot, a stream with a 7 s timeout waits ~4 s for its first
    byte and is served; it was refused ``deadline_unreachable`` at once, as if it had to
    finish within 7 s (the estimated wait plus a whole stream; a hostile trial)."""
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=1, queue=2, max_wait="30s")]})
    upstream.chunk_delay = 0.8  # 5 content events: a 4 s stream that starts at once
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                timeout=7.0, max_retries=0)

    async def stream() -> str:
        chunks = await client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": "hi"}], stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    try:
        assert await stream()  # the route has seen one: streams start at once, last 4 s
        first = asyncio.create_task(stream())
        await wait_until(lambda: upstream.inflight == 1, what="the first stream upstream")
        assert await stream()  # queued behind it, then served
        assert await first
    finally:
        await client.close()
    assert await sluice.metric("sluice_rejections_total", route="openai",
                               reason="deadline_unreachable") == 0


async def test_a_full_queue_makes_room_for_a_better_class_and_a_quiet_tenant(upstream,
                                                                            start_sluice):
    # A noisy tenant's best-effort calls fill the queue: before, a critical call and a quiet
    # tenant's first call were refused queue_full while those waited (measured with 1,500
    # callers, 90% from one tenant, on a full queue of 256: the quiet tenants had 15% of
    # their calls served, as the noisy one did). A bounded priority queue refuses the call it
    # would serve last.
    sluice = await start_sluice({"routes": [
        openai_route(upstream, limit=1, queue=3, max_wait="60s")]})
    upstream.hold = asyncio.Event()
    noisy = {"X-Tenant-ID": "noisy", "X-Priority": "best-effort"}
    async with aiohttp.ClientSession() as session:
        calls = {"slot": asyncio.create_task(
            chat(session, sluice.url, **noisy, **{"X-Tag": "slot"}))}
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        for depth in range(1, 4):
            calls[f"be-{depth}"] = asyncio.create_task(
                chat(session, sluice.url, **noisy, **{"X-Tag": f"be-{depth}"}))
            await sluice.wait_metric("sluice_queue_depth", depth, route="openai")
        # The noisy tenant's next call is refused at the door: it would be served last.
        status, headers, _, _ = await chat(session, sluice.url, **noisy)
        assert (status, headers["X-Sluice-Reason"]) == (503, "queue_full")
        # A critical call takes the place of the noisy tenant's latest, answered at once.
        calls["crit"] = asyncio.create_task(chat(session, sluice.url, **{
            "X-Tenant-ID": "noisy", "X-Priority": "critical", "X-Tag": "crit"}))
        status, headers, body, _ = await calls.pop("be-3")
        assert (status, headers["X-Sluice-Reason"]) == (503, "queue_full")
        assert int(headers["Retry-After"]) >= 1 and headers["x-should-retry"] == "true"
        assert "better class" in body["error"]["message"]
        # So does a quiet tenant's call of the same class: it is within its fair share.
        calls["quiet"] = asyncio.create_task(chat(session, sluice.url, **{
            "X-Tenant-ID": "quiet", "X-Priority": "best-effort", "X-Tag": "quiet"}))
        status, headers, _, _ = await calls.pop("be-2")
        assert (status, headers["X-Sluice-Reason"]) == (503, "queue_full")
        assert await sluice.metric("sluice_queue_depth", route="openai") == 3
        upstream.hold.set()
        assert [r[0] for r in await asyncio.gather(*calls.values())] == [200] * 4
    assert [r.headers["X-Tag"] for r in upstream.requests] == ["slot", "crit", "quiet", "be-1"]
    await sluice.wait_metric("sluice_queue_depth", 0, route="openai")
    assert await sluice.metric("sluice_rejections_total", route="openai",
                               reason="queue_full") == 3
